"""How noisy a validation set of n videos is: the figures behind docs/training.md's validation floor
("How large validation is, and why").

Selection compares two scorers (two epochs, two heads) on the same validation videos, so what decides
it is the noise of their paired difference. This script measures it on the calibrated world: it
generates a store of ``worlds.features.CALIBRATED`` (read at run time, so a recalibrated world reruns as it
is; D = 512, 12 frames, 32 words) with ``--pool`` test videos and no train or val split, then draws
``--draws`` validation sets of n videos without replacement from that pool, for each n of ``--sizes``.
Each draw is scored as validation scores it: each video's first caption is a query, read against the
draw's own gallery of n videos, t2v R@1 with ties counted against (``evaluation.metrics.t2v_ranks``),
for two zero-shot scorers: mean pooling (the ``meanpool`` head's ``mean_video``: the cosine of the
sentence and the mean of the L2-normalised frames) and the middle frame (the middle valid frame, as
``worlds.stats`` takes it). Per n it prints the sd over draws of their difference (mean pooling minus
middle frame, in points) and of mean pooling's own R@1.

Finite-population correction. The draws come from one pool of N videos, so they share videos (a draw
of n shares n^2 / N videos with every other on average) and their sd is that of a sample of a fixed
pool, sqrt((N - n) / (N - 1)) times the sd of a validation set drawn from the world, where no two sets
share a video. Both sds are multiplied by sqrt((N - 1) / (N - n)) to undo it. The factor is exact for a
mean of per-video values; for R@1 it is right only to first order (whether a query hits depends on
the other videos of its gallery), which is why the pool is large: at N = 20,000 the factor is at most
1.026 (n = 1,000), so whatever it misses is a small part of 2.6 %, well inside the sd's own uncertainty.

The sd's own uncertainty: a percentile bootstrap over the draws (they are independent draws of
subsets, so resampling them is sound; no normality assumed), ``--level`` (95 %) by default. With k
draws an sd is known to about 1 / sqrt(2 (k - 1)) of itself (2 % at the default 1,000 draws): read
the digits with that in mind. It does not include how the sd varies from one world (``--seed``) to
another.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/paired_noise.py [--pool 20000] [--draws 1000] [--seed 0] \\
        [--sizes 100,200,500,900,1000] [--out DIR]

Without ``--out`` the store lives in a temporary directory and is deleted at the end; with it, the store
is kept there and a rerun with the same world reuses it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tvrpipe.errors import TvrpipeError
from tvrpipe.evaluation.metrics import t2v_ranks
from tvrpipe.features.store import STORE_NAME, open_store
from tvrpipe.heads.meanpool import mean_video
from tvrpipe.worlds import features as genstore
from tvrpipe.worlds.features import GenSpec, generate_store

SIZES = (100, 200, 500, 900, 1000)  # the validation sizes docs/training.md discusses
READ_ROWS = 1024  # videos read from the store at a time


def world_spec(pool: int, seed: int) -> GenSpec:
    """The calibrated world with ``pool`` test videos and no train or val split; CALIBRATED as it is now, the
    other fields GenSpec's defaults (intrinsic_dim, captions per video), as ``synth --preset msrvtt9k`` has them."""
    return GenSpec(train_videos=0, val_videos=0, test_videos=pool, frames=12, max_words=32, embed_dim=512,
                   seed=seed, **genstore.CALIBRATED)


def middle_frame(frame_mask: np.ndarray) -> np.ndarray:
    """Index of each video's middle valid frame, (n, F) -> (n,): ``valid[len(valid) // 2]``, as worlds.stats."""
    return np.array([np.flatnonzero(row)[int(row.sum()) // 2] for row in frame_mask])


def pool_features(store, split: str = "test") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unit query sentences, mean-pooled videos and middle frames of ``split``, each (N, D) float32, row i
    of each belonging to the split's i-th video; the query is the video's first caption."""
    vrows = np.flatnonzero((store.videos["split"] == split).to_numpy())
    texts = store.texts
    first = texts[texts["video_row"].isin(vrows)].drop_duplicates("video_row")  # rows keep their order
    by_video = dict(zip(first["video_row"].to_numpy(), first.index.to_numpy()))
    missing = [v for v in vrows if v not in by_video]
    if missing:
        raise ValueError(f"{store.dir}: {len(missing)} videos of split {split!r} have no caption")
    trows = np.array([by_video[v] for v in vrows])  # caption i describes video i
    sent = F.normalize(torch.from_numpy(store.read("texts/sentence", trows).astype(np.float32)), dim=-1)
    means, middles = [], []
    for a in range(0, len(vrows), READ_ROWS):
        rows = vrows[a:a + READ_ROWS]
        frames = torch.from_numpy(store.read("videos/frames", rows).astype(np.float32))  # (b, F, D)
        fmask = store.read("videos/frame_mask", rows).astype(bool)  # (b, F)
        means.append(mean_video(frames, torch.from_numpy(fmask)))
        middles.append(F.normalize(frames[torch.arange(len(rows)), torch.from_numpy(middle_frame(fmask))], dim=-1))
    return sent, torch.cat(means), torch.cat(middles)


def draw_r1(sent: torch.Tensor, videos: torch.Tensor, rows: np.ndarray) -> float:
    """t2v R@1 in % of the draw ``rows``: its queries against its own gallery, ties counted against."""
    idx = torch.from_numpy(rows)
    sim = sent[idx] @ videos[idx].T  # (n, n), caption i describes video i
    return float(100.0 * (t2v_ranks(sim, np.arange(len(rows))) == 1).mean())


def finite_population_factor(pool: int, n: int) -> float:
    """sqrt((N - 1) / (N - n)): the sd of a sample of n from a pool of N, times this, is the sd of n drawn from
    an infinite population (for a mean of per-video values)."""
    if not 1 <= n < pool:
        raise ValueError(f"a draw of n videos needs 1 <= n < N, got n={n}, N={pool}")
    return math.sqrt((pool - 1) / (pool - n))


def bootstrap_sd(values: np.ndarray, level: float, n_boot: int, rng: np.random.Generator) -> tuple[float, float]:
    """Percentile bootstrap interval of the sd (ddof 1) of ``values``, resampling them."""
    k = len(values)
    sds = np.empty(n_boot)
    for a in range(0, n_boot, 500):
        idx = rng.integers(0, k, (min(500, n_boot - a), k))
        sds[a:a + len(idx)] = values[idx].std(axis=1, ddof=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(sds, [tail, 100 - tail])
    return float(lo), float(hi)


def measure(sent: torch.Tensor, mean: torch.Tensor, middle: torch.Tensor, sizes: list[int], draws: int, seed: int,
            level: float = 0.95, n_boot: int = 2000) -> list[dict]:
    """For each n: the draws' R@1 of both scorers and, corrected to an infinite population, the sd of their
    difference and of mean pooling's R@1, with bootstrap intervals. Draw d of size n is
    ``sorted(default_rng([seed, n, d]).choice(N, n, replace=False))``."""
    pool = len(sent)
    out = []
    for n in sizes:
        c = finite_population_factor(pool, n)
        r_mean, r_mid = np.empty(draws), np.empty(draws)
        for d in range(draws):
            rows = np.sort(np.random.default_rng([seed, n, d]).choice(pool, n, replace=False))
            r_mean[d], r_mid[d] = draw_r1(sent, mean, rows), draw_r1(sent, middle, rows)
        diff = r_mean - r_mid
        boot = np.random.default_rng([seed, n, draws, 1])
        lo_d, hi_d = bootstrap_sd(diff, level, n_boot, boot)
        lo_m, hi_m = bootstrap_sd(r_mean, level, n_boot, boot)
        out.append(dict(n=n, draws=draws, factor=c, meanpool=r_mean, middle=r_mid,
                        diff_mean=float(diff.mean()), meanpool_mean=float(r_mean.mean()),
                        sd_diff=c * float(diff.std(ddof=1)), sd_diff_ci=(c * lo_d, c * hi_d),
                        sd_meanpool=c * float(r_mean.std(ddof=1)), sd_meanpool_ci=(c * lo_m, c * hi_m)))
    return out


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes whole numbers separated by commas, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"--sizes needs validation sizes of at least 2 videos, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", type=int, default=20000, help="test videos of the generated world (N)")
    ap.add_argument("--draws", type=int, default=1000, help="validation sets drawn for each size")
    ap.add_argument("--sizes", type=parse_sizes, default=list(SIZES), help="validation sizes n, comma-separated")
    ap.add_argument("--seed", type=int, default=0, help="seed of the world and of the draws")
    ap.add_argument("--level", type=float, default=0.95, help="coverage of the sd's bootstrap interval")
    ap.add_argument("--out", type=Path, help="keep the generated store in this directory (a rerun reuses it)")
    args = ap.parse_args(argv)
    if args.draws < 3:
        ap.error(f"--draws must be at least 3, got {args.draws}")
    if not max(args.sizes) < args.pool:
        ap.error(f"every size must be below --pool ({args.pool}), got {max(args.sizes)}")
    if not 0 < args.level < 1:
        ap.error(f"--level must lie in (0, 1), got {args.level}")
    spec = world_spec(args.pool, args.seed)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="paired-noise-") as tmp:
            store_dir = args.out if args.out is not None else Path(tmp) / "world"
            existed = (store_dir / STORE_NAME / "zarr.json").is_file()
            generate_store(store_dir, spec, made_by="scripts/paired_noise.py")
            t_gen = time.perf_counter() - t0
            sent, mean, middle = pool_features(open_store(store_dir))
    except TvrpipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = measure(sent, mean, middle, args.sizes, args.draws, args.seed, args.level)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    print(f"world: {fields}")
    where = f"the store in {args.out}" if args.out is not None else "a temporary store"
    made = "found there, checked and completed" if existed else "generated"
    print(f"pool N = {args.pool} test videos, {args.draws} draws per size, seed {args.seed}; {where} {made} in "
          f"{t_gen:.0f} s, measured in {time.perf_counter() - t0 - t_gen:.0f} s")
    print("t2v R@1 in points against each draw's own gallery of n videos (first caption of each video, ties "
          "against); sds multiplied by sqrt((N-1)/(N-n)), the finite-population correction, as the draws share "
          f"videos of one pool; [ ]: {100 * args.level:g} % bootstrap interval over the draws")
    print("| n | sd of meanpool - middle frame | mean difference | sd of meanpool R@1 | meanpool R@1 | correction |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['sd_diff']:.2f} [{r['sd_diff_ci'][0]:.2f}, {r['sd_diff_ci'][1]:.2f}] "
              f"| {r['diff_mean']:+.1f} | {r['sd_meanpool']:.2f} [{r['sd_meanpool_ci'][0]:.2f}, "
              f"{r['sd_meanpool_ci'][1]:.2f}] | {r['meanpool_mean']:.1f} | {r['factor']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
