"""The learnable share's sizing table (docs/synthetic.md, "The learnable share"): for each caption shift and
noise, the calibrated world's zero-shot statistics, and the R@1 of an oracle that undoes the shift exactly.

The oracle is the same world with no shift (every other draw is the same: the rotation has a random stream
of its own), so its mean-pooling R@1 is what a head that learns the rotation's inverse, and nothing else,
would reach; the gain is its R@1 minus zero-shot's. Each row is the mean over ``--seeds`` worlds of
MSR-VTT 1k-A's test size (1,000 videos, D = 512), the statistics of ``tvrpipe synth --describe``:

    .venv/bin/python scripts/calibrate_share.py 0,1.0 20,0.9 25,0.9 [--seeds 3] [--world onescene]

Each statistic is printed as its mean ± its sd across the seeds (a world is one draw: the sd is how far one
seed's world may sit from the mean), and an R@1 with the lowest and highest seed's value.

Each ANGLE,NOISE pair takes about a minute per seed on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from tvrpipe.features.store import open_store
from tvrpipe.worlds.features import CALIBRATED, ONE_SCENE, GenSpec, generate_store
from tvrpipe.worlds.stats import TARGETS, measure

SHOWN = tuple(t.name for t in TARGETS)


WORLDS = {"calibrated": CALIBRATED, "onescene": ONE_SCENE}


def world(name: str, angle: float, noise: float, seed: int) -> GenSpec:
    """The world's test split at 1k-A's size, turned by ``angle`` at ``noise``."""
    return GenSpec(train_videos=0, test_videos=1000, embed_dim=512,
                   **{**WORLDS[name], "caption_shift": angle, "noise": noise}, seed=seed)


def stats(spec: GenSpec) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return measure(open_store(generate_store(Path(tmp) / "s", spec)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pairs", nargs="+", help="ANGLE,NOISE: the caption shift in degrees and the noise")
    ap.add_argument("--seeds", type=int, default=3, help="worlds averaged per row (seeds 0..N-1)")
    ap.add_argument("--world", choices=tuple(WORLDS), default="calibrated",
                    help="worlds.features.CALIBRATED (the presets' world) or worlds.features.ONE_SCENE")
    args = ap.parse_args()
    print(f"{args.world} world, seeds 0-{args.seeds - 1}")
    print("| shift | noise | " + " | ".join(SHOWN) + " | oracle R@1 | oracle gain |")
    print("|---" * (len(SHOWN) + 4) + "|")
    for pair in args.pairs:
        angle, noise = (float(x) for x in pair.split(","))
        got = [stats(world(args.world, angle, noise, s)) for s in range(args.seeds)]
        oracle = [stats(dataclasses.replace(world(args.world, angle, noise, s), caption_shift=0.0))["meanpool_r1"]
                  for s in range(args.seeds)]
        mean = {k: float(np.mean([g[k] for g in got])) for k in SHOWN}
        sd = {k: float(np.std([g[k] for g in got], ddof=1)) if len(got) > 1 else float("nan") for k in SHOWN}
        lo = {k: min(g[k] for g in got) for k in SHOWN}
        hi = {k: max(g[k] for g in got) for k in SHOWN}
        cells = [f"{mean[k]:.1f} ± {sd[k]:.1f} ({lo[k]:.1f}-{hi[k]:.1f})" if k.endswith("_r1")
                 else f"{mean[k]:.3f} ± {sd[k]:.3f}" for k in SHOWN]
        print(f"| {angle:g} | {noise:g} | " + " | ".join(cells)
              + f" | {np.mean(oracle):.1f} | {np.mean(oracle) - mean['meanpool_r1']:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
