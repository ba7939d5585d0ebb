"""How the first stage's top k scales with its Ray shards: on a generated store, the one index of this process
(``tvrpipe search`` without ``--shards``) against the same first stage split over 1, 2, ... Ray actors of a local
Ray (``--address local --shards N``), timed on one batch of queries after a warm-up call; each sharded answer is
checked against the one index's. docs/search.md quotes its output.

    .venv/bin/python scripts/shard_timing.py OUT [--videos 100000] [--dim 512] [--queries 64] [--k 1000]
        [--shards 1 --shards 2] [--first-stage exact]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from tvrpipe.cluster import ray_init, stop_ray
from tvrpipe.features.store import open_store
from tvrpipe.search.index import first_stage
from tvrpipe.search.shards import sharded_first_stage
from tvrpipe.worlds.features import GenSpec, generate_store


def _timed(stage, q: np.ndarray, k: int, repeats: int) -> tuple[float, tuple[np.ndarray, np.ndarray]]:
    got = stage.top(q, k)  # warm-up: pages in the memory maps, starts the actors' first call
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = stage.top(q, k)
        times.append(time.perf_counter() - t)
    return float(np.median(times)), got


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="a folder for the generated store (reused when it is there)")
    p.add_argument("--videos", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--shards", type=int, action="append")
    p.add_argument("--first-stage", default="exact")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    shards = a.shards or [1, 2]
    where = a.out / f"store-{a.videos}-d{a.dim}"
    if not where.is_dir():
        t = time.perf_counter()
        # two frames a video: the first stage reads only their mean, and generation time grows with the frames
        generate_store(where, GenSpec(train_videos=0, test_videos=a.videos, captions_per_test_video=1, frames=2,
                                      max_words=8, embed_dim=a.dim, seed=0), video_shard=4096, text_shard=4096)
        print(f"generated {where} in {time.perf_counter() - t:.0f} s")
    store = open_store(where)
    q = np.random.default_rng(0).standard_normal((a.queries, a.dim)).astype(np.float32)
    t = time.perf_counter()
    one = first_stage(store, a.first_stage, cache=False)
    print(f"{os.cpu_count()} CPUs; {len(one):,} videos, D = {a.dim}, {a.queries} queries, k = {a.k}, "
          f"first stage {one.describe()}")
    print(f"one index in this process: built in {time.perf_counter() - t:.1f} s")
    base, (want_pos, want_scores) = _timed(one, q, a.k, a.repeats)
    print(f"  top k: {base * 1000:.0f} ms")
    ray_init("local", data=False)
    for n in shards:
        t = time.perf_counter()
        stage = sharded_first_stage(store, a.first_stage, (), n, "local", a.k)
        built = time.perf_counter() - t
        took, (pos, scores) = _timed(stage, q, a.k, a.repeats)
        same = bool((pos == want_pos).all() and np.allclose(scores, want_scores, atol=1e-5))
        print(f"{n} shard{'s' * (n > 1)}: built in {built:.1f} s (actors started, each pooling its rows); top k: "
              f"{took * 1000:.0f} ms ({base / took:.2f}x the one index); same hits as the one index: {same}")
        del stage
    stop_ray()


if __name__ == "__main__":
    main(sys.argv[1:])
