"""The exact first stage: a matrix product over the pooled embeddings and a partial sort, in blocks of videos.

Its memory is the pooled embeddings (read block by block from ``pooled.npy`` where it is a memory map) and one
block of scores per query; it has no files of its own. :func:`exact_where_short` is the fallback of the
approximate first stages where their index returns fewer than k videos.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tvrpipe.search.first_stages.base import FirstStageIndex, StageConfig, register_first_stage

_BLOCK = 65_536  # videos per block of the exact stage: 128 MiB of float32 scores per 512 queries


def exact_top(emb: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact top ``k`` rows of ``emb`` by inner product with each row of ``q``, best first, equal scores
    by row (also at the cut: of identical videos, the first rows are kept), over blocks of :data:`_BLOCK`
    rows so the score matrix never holds more than one block per query."""
    return top_by_blocks(len(emb), len(q), k, lambda a, b: q @ emb[a:b].T, _BLOCK)


def top_by_blocks(n: int, queries: int, k: int, score: Callable[[int, int], np.ndarray],
                  block: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact top ``k`` of ``n`` items for each of ``queries`` queries, where ``score(a, b)`` gives the
    ``(queries, b - a)`` scores of items ``a`` to ``b``: ``(items (queries, k) int64, scores (queries, k))``, best
    first, equal scores by item (also at the cut), computed ``block`` items at a time."""
    best_s = np.full((queries, 0), -np.inf, np.float32)
    best_i = np.zeros((queries, 0), np.int64)
    for a in range(0, n, block):
        s = score(a, min(a + block, n))  # (Q, block)
        i = np.broadcast_to(np.arange(a, a + s.shape[1]), s.shape)
        # the kept rows all precede this block, so each row of best_* stays in ascending row order
        best_s, best_i = np.concatenate([best_s, s], 1), np.concatenate([best_i, i], 1)
        if best_s.shape[1] > k:
            cut = -np.partition(-best_s, k - 1, axis=1)[:, k - 1 : k]  # each query's k-th best score
            above, at = best_s > cut, best_s == cut
            keep = above | (at & (np.cumsum(at, axis=1) <= k - above.sum(1, keepdims=True)))  # k per query
            best_s, best_i = best_s[keep].reshape(queries, k), best_i[keep].reshape(queries, k)
    order = np.lexsort((best_i, -best_s), axis=1)  # score descending, then row ascending
    return np.take_along_axis(best_i, order, 1), np.take_along_axis(best_s, order, 1)


def exact_where_short(idx: np.ndarray, scores: np.ndarray, pooled: np.ndarray, q: np.ndarray,
                      k: int) -> tuple[np.ndarray, np.ndarray]:
    """An approximate index's answer ``(idx, scores)`` (``(Q, k)``, ``-1`` where it found fewer than ``k``), with
    the queries it left short given the exact top ``k`` instead; the others are kept as the index gave them."""
    idx = idx.astype(np.int64)
    short = np.flatnonzero((idx < 0).any(1))
    if len(short):  # e.g. an HNSW graph around many identical videos, or probed lists holding fewer than k
        idx[short], scores[short] = exact_top(pooled, q[short], k)
    return idx, scores


@register_first_stage("exact")
class Exact(FirstStageIndex):
    """Every video's cosine with the query: the exact top k, equal scores by row."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        pass

    summary = "a matrix product over the pooled embeddings and a partial sort (exact)"
    auto_rank = 0  # always available: auto's choice where nothing faster is installed
    exact = True

    @classmethod
    def build(cls, pooled: np.ndarray, config: StageConfig | None = None) -> Exact:
        return cls(pooled, config or cls.Config())

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return exact_top(self.pooled, queries, k)

    def describe(self) -> str:
        return "exact"
