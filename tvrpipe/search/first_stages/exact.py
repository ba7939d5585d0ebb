"""The exact first stage: a matrix product over the pooled embeddings and a partial sort, in blocks of videos."""

from __future__ import annotations

import numpy as np

_BLOCK = 65_536  # videos per block of the exact stage: 128 MiB of float32 scores per 512 queries


def exact_top(emb: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact top ``k`` rows of ``emb`` by inner product with each row of ``q``, best first, equal scores
    by row (also at the cut: of identical videos, the first rows are kept), over blocks of :data:`_BLOCK`
    rows so the score matrix never holds more than one block per query."""
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_i = np.zeros((len(q), 0), np.int64)
    for a in range(0, len(emb), _BLOCK):
        s = q @ emb[a : a + _BLOCK].T  # (Q, block)
        i = np.broadcast_to(np.arange(a, a + s.shape[1]), s.shape)
        # the kept rows all precede this block, so each row of best_* stays in ascending row order
        best_s, best_i = np.concatenate([best_s, s], 1), np.concatenate([best_i, i], 1)
        if best_s.shape[1] > k:
            cut = -np.partition(-best_s, k - 1, axis=1)[:, k - 1 : k]  # each query's k-th best score
            above, at = best_s > cut, best_s == cut
            keep = above | (at & (np.cumsum(at, axis=1) <= k - above.sum(1, keepdims=True)))  # k per query
            best_s, best_i = best_s[keep].reshape(len(q), k), best_i[keep].reshape(len(q), k)
    order = np.lexsort((best_i, -best_s), axis=1)  # score descending, then row ascending
    return np.take_along_axis(best_i, order, 1), np.take_along_axis(best_s, order, 1)
