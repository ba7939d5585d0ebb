"""Does any head collapse in its first epoch at its default learning rate? Each head on each shipped
generated store (the synth presets and bench search's training world), trained for the first epoch of
train-head's default schedule (warmup over it, the default lr); prints validation t2v R@1 untrained and
after that epoch. docs/training.md quotes its output.

    .venv/bin/python scripts/first_epoch.py OUT [--store small --store medium ...] [--method prota ...]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from tvrpipe.bench.convergence import SIZES
from tvrpipe.bench.search import benchmark_spec, collection_spec
from tvrpipe.rundir import read_epochs, read_metrics
from tvrpipe.training.fit import fit
from tvrpipe.training.settings import TrainConfig
from tvrpipe.worlds.features import generate_store

STORES = {**SIZES, "search": benchmark_spec(collection_spec(2000, 512), 2000)}
HEADS = ("xpool", "seqtransf", "tmass", "uatvr", "prota", "duq")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--store", action="append", choices=list(STORES))
    p.add_argument("--method", action="append", choices=list(HEADS))
    args = p.parse_args(argv)
    rows = []
    for name in args.store or list(STORES):
        store = generate_store(args.out / "stores" / name, STORES[name], progress=False, wait=True,
                               made_by="scripts/first_epoch.py")
        for method in args.method or HEADS:
            run = args.out / "runs" / name / method
            if not (run / "metrics.json").exists():
                # the open-ended schedule's first epoch (its warmup), at the default lr; patience 1 stops it
                # after one or two epochs
                fit(store, method, run, TrainConfig(patience=1, max_epochs=1, min_steps=0), progress=False)
            m = read_metrics(run)
            first = float(read_epochs(run)["val_t2v_R@1"].iloc[0])
            row = {"store": name, "method": method, "lr": m["schedule"]["lr"],
                   "untrained": m["untrained_val"]["t2v"]["R@1"], "epoch 1": first,
                   "collapsed": first < m["untrained_val"]["t2v"]["R@1"] / 2}
            rows.append(row)
            print(" | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
    with open(args.out / "first_epoch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
