"""Retrieval metrics from a text-video similarity matrix (docs/design.md, "Evaluation protocol").

Functional: every function takes a similarity matrix ``sim`` of shape ``(n_text, n_video)``
(NumPy array or torch tensor, any float dtype, kept as given) and ``text_video``, the column
index of each caption's video, and returns NumPy values.

Definitions (1-based ranks; *ties count against the model*, so a constant matrix ranks every
query last instead of first, unlike the optimistic ``argsort`` of most official code):

- text-to-video: each caption ``i`` is a query over all ``n_video`` videos, with ground truth
  ``g = text_video[i]``::

      rank_i = 1 + #{j != g : sim[i, j] >= sim[i, g]}

- video-to-text: each video ``j`` that has at least one caption is a query over all captions
  (the multi-caption protocol: every caption of the set, never one sampled caption). Its own
  captions ``O_j`` are all correct answers, so the rank is that of the best-ranked one, and other
  own captions scoring above it do not count::

      rank_j = 1 + #{k not in O_j : sim[k, j] >= max_{i in O_j} sim[i, j]}

  With one caption per video this is the text-to-video rule on ``sim.T``. A video with no
  caption in the matrix is a distractor for text-to-video only: it is not a video-to-text query
  (``n`` in the v2t metrics counts the queries actually asked).

Ranks are computed over blocks of rows (``block_rows``, default 1024) so memory stays bounded by
``block_rows x n_video`` booleans even for 180k x 9k matrices.

Reference semantics: R@K in percent, MdR = median rank (``np.median``, so the mean of the two
middle ranks for an even count), MnR = mean rank, as in CLIP4Clip's ``compute_metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

BLOCK_ROWS = 1024  # choice: 1024 x 9000 bool = 9 MB per block, fast on 2 cores
RECALL_AT = (1, 5, 10)


def as_tensor(sim: Any) -> Tensor:
    """``sim`` as a 2-D torch tensor on the CPU, without copying a NumPy array."""
    t = torch.from_numpy(np.ascontiguousarray(sim)) if isinstance(sim, np.ndarray) else torch.as_tensor(sim)
    if t.ndim != 2:
        raise ValueError(f"sim must be a 2-D (n_text, n_video) matrix, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.float()
    return t.cpu()


def _as_index(text_video: Any, n_text: int, n_video: int) -> Tensor:
    tv = torch.as_tensor(np.asarray(text_video)).cpu()
    if tv.ndim != 1 or tv.shape[0] != n_text:
        raise ValueError(f"text_video must have one entry per text ({n_text}), got shape {tuple(tv.shape)}")
    if tv.dtype.is_floating_point or tv.dtype == torch.bool:
        raise ValueError(f"text_video must hold integer video indices, got {tv.dtype}")
    tv = tv.long()
    if n_text and (int(tv.min()) < 0 or int(tv.max()) >= n_video):
        lo, hi = int(tv.min()), int(tv.max())
        raise ValueError(f"text_video indices must lie in [0, {n_video}), got [{lo}, {hi}]")
    return tv


def check_no_nan(sim: Any, block_rows: int = BLOCK_ROWS) -> None:
    """Raise ValueError naming how many entries of ``sim`` are NaN (a NaN has no rank)."""
    s = as_tensor(sim)
    n_nan = sum(int(torch.isnan(s[a : a + block_rows]).sum()) for a in range(0, s.shape[0], block_rows))
    if n_nan:
        raise ValueError(
            f"similarity matrix has {n_nan} NaN value(s) out of {s.numel()}: the head produced NaN "
            "(check its inputs for all-padding masks and its numerics); NaN cannot be ranked"
        )


def t2v_ranks(sim: Any, text_video: Any, *, block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """1-based rank of each caption's video among all videos; ties count against the model.

    Args:
        sim: ``(n_text, n_video)`` similarities (NumPy or torch).
        text_video: ``(n_text,)`` column index of each caption's video.
        block_rows: captions per block (memory is ``block_rows x n_video`` booleans).

    Returns:
        int64 array ``(n_text,)``: ``1 + #{j != g: sim[i, j] >= sim[i, g]}``.

    Example:
        >>> t2v_ranks(np.array([[0.9, 0.1], [0.5, 0.5]]), [0, 1]).tolist()  # the tie loses
        [1, 2]
    """
    s = as_tensor(sim)
    tv = _as_index(text_video, *s.shape)
    check_no_nan(s, block_rows)
    ranks = torch.empty(s.shape[0], dtype=torch.long)
    for a in range(0, s.shape[0], block_rows):
        block = s[a : a + block_rows]  # (b, n_video)
        gt = block.gather(1, tv[a : a + block_rows, None])  # (b, 1)
        # counts the ground truth itself once (gt >= gt), which is the "1 +"
        ranks[a : a + block_rows] = (block >= gt).sum(1)
    return ranks.numpy()


def v2t_ranks(sim: Any, text_video: Any, *, block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """1-based rank of each video's best-ranked own caption among all captions.

    Only videos with at least one caption are queries, in increasing column order; see the
    module docstring for the exact rule (own captions never count against each other).

    Args:
        sim: ``(n_text, n_video)`` similarities (NumPy or torch).
        text_video: ``(n_text,)`` column index of each caption's video.
        block_rows: captions per block (memory is ``block_rows x n_video`` booleans).

    Returns:
        int64 array ``(n_queries,)`` with ``n_queries`` = number of videos having a caption.

    Example:
        >>> sim = np.array([[0.9, 0.4], [0.8, 0.1], [0.3, 0.3]])  # captions 0, 1 of video 0
        >>> v2t_ranks(sim, [0, 0, 1]).tolist()  # video 1: caption 0 beats its caption 2
        [1, 2]
    """
    s = as_tensor(sim)
    n_text, n_video = s.shape
    tv = _as_index(text_video, n_text, n_video)
    check_no_nan(s, block_rows)
    own = s.gather(1, tv[:, None])[:, 0]  # (n_text,) each caption's score with its own video
    best = torch.full((n_video,), -torch.inf, dtype=s.dtype)
    best = best.scatter_reduce(0, tv, own, reduce="amax")  # (n_video,) best own caption
    counts = torch.zeros(n_video, dtype=torch.long)
    for a in range(0, n_text, block_rows):
        counts += (s[a : a + block_rows] >= best).sum(0)
    # Own captions at or above the best (the best itself and exact ties with it) were counted
    # above but are correct answers: take them out again.
    counts -= torch.bincount(tv[own >= best[tv]], minlength=n_video)
    has_caption = torch.bincount(tv, minlength=n_video) > 0
    return (1 + counts[has_caption]).numpy()


def retrieval_metrics(ranks: Sequence[int] | np.ndarray) -> dict[str, float | int]:
    """R@1/5/10 (percent), MdR, MnR and the number of queries ``n`` from 1-based ranks.

    Example:
        >>> retrieval_metrics([1, 2, 7, 20])["R@5"]
        50.0
    """
    r = np.asarray(ranks, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"ranks must be a non-empty 1-D sequence, got shape {r.shape}")
    if np.any(r < 1):
        raise ValueError("ranks are 1-based: every rank must be >= 1")
    # plain Python numbers, so the dict goes straight into metrics.json
    n = int(r.size)
    out: dict[str, float | int] = {f"R@{k}": 100.0 * int(np.count_nonzero(r <= k)) / n for k in RECALL_AT}
    out["MdR"] = float(np.median(r))
    out["MnR"] = float(np.mean(r))
    out["n"] = n
    return out


def evaluate_similarity(sim: Any, text_video: Any, *, block_rows: int = BLOCK_ROWS) -> dict[str, dict]:
    """Text-to-video and video-to-text metrics of one similarity matrix.

    Returns:
        ``{"t2v": retrieval_metrics(...), "v2t": retrieval_metrics(...)}``.
    """
    return {
        "t2v": retrieval_metrics(t2v_ranks(sim, text_video, block_rows=block_rows)),
        "v2t": retrieval_metrics(v2t_ranks(sim, text_video, block_rows=block_rows)),
    }


# ---------------------------------------------------------------------------------- error bars

BOOTSTRAP_SAMPLES = 2000  # choice: the 2.5 and 97.5 percentiles of 2,000 resamples move by ~0.1 point of R@1
BOOTSTRAP_SEED = 0


def _recall_of_resamples(hits: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """R@K (percent) of ``n_boot`` resamples of the queries, drawn with replacement: ``hits`` (n,) or, for a
    paired draw, (n, m) 0/1 rows that share each resample's queries. Returns (n_boot,) or (n_boot, m)."""
    rng = np.random.default_rng(seed)
    n = hits.shape[0]
    counts = np.zeros((n_boot,) + hits.shape[1:], dtype=np.float64)
    for start in range(0, n_boot, 256):  # 256 resamples x n query indices at a time: memory bounded
        stop = min(n_boot, start + 256)
        idx = rng.integers(0, n, size=(stop - start, n))
        counts[start:stop] = hits[idx].sum(axis=1)
    return 100.0 * counts / n


def bootstrap_recall(ranks: Sequence[int] | np.ndarray, k: int = 1, level: float = 0.95,
                     n_boot: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """The percentile bootstrap interval of R@k (percent) over queries: the queries are resampled with
    replacement ``n_boot`` times and the interval is the central ``level`` of the resamples' R@k.

    Example:
        >>> lo, hi = bootstrap_recall([1, 3, 1, 12, 2, 1, 1, 5], k=1)  # R@1 = 50.0
        >>> lo < 50.0 < hi
        True
    """
    hits = (np.asarray(ranks) <= k).astype(np.float64)
    if hits.ndim != 1 or hits.size == 0:
        raise ValueError(f"ranks must be a non-empty 1-D sequence, got shape {hits.shape}")
    r = _recall_of_resamples(hits, n_boot, seed)
    tail = 100.0 * (1.0 - level) / 2
    lo, hi = np.percentile(r, [tail, 100.0 - tail])
    return float(lo), float(hi)


def paired_recall_difference(ranks_a: Sequence[int] | np.ndarray, ranks_b: Sequence[int] | np.ndarray, k: int = 1,
                             level: float = 0.95, n_boot: int = BOOTSTRAP_SAMPLES,
                             seed: int = BOOTSTRAP_SEED) -> tuple[float, float, float]:
    """R@k of ``a`` minus R@k of ``b`` on the same queries (in the same order), with its paired percentile
    bootstrap interval: each resample draws the queries once for both, so what the two runs share (an easy or a
    hard query) cancels. An interval that covers 0 is a difference within noise.

    Returns:
        ``(difference, low, high)`` in points of percent.
    """
    a, b = np.asarray(ranks_a), np.asarray(ranks_b)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired ranks must be two 1-D sequences of one length, got {a.shape} and {b.shape}")
    hits = np.stack([(a <= k), (b <= k)], axis=1).astype(np.float64)
    r = _recall_of_resamples(hits, n_boot, seed)
    d = r[:, 0] - r[:, 1]
    tail = 100.0 * (1.0 - level) / 2
    lo, hi = np.percentile(d, [tail, 100.0 - tail])
    return float(100.0 * (hits[:, 0].mean() - hits[:, 1].mean())), float(lo), float(hi)
