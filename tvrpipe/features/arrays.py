"""Checks on embedding arrays that need numpy alone: extraction's worker processes import them
without the store's zarr and pandas (a third of a second of each worker's start)."""

from __future__ import annotations

import numpy as np


def nonfinite_rows(block: np.ndarray) -> np.ndarray:
    """``(n,)`` bool: which rows of ``block`` hold a NaN or an infinity.

    float16 is checked on its bits (exponent all ones), several times faster than ``isfinite``.
    """
    flat = block.reshape(len(block), -1)
    if flat.shape[1] == 0:
        return np.zeros(len(block), bool)
    if flat.dtype == np.float16:
        return (flat.view(np.uint16) & 0x7C00).max(axis=1) == 0x7C00
    return ~np.isfinite(flat).all(axis=1)


def read_rows(array, rows: np.ndarray, width: int | None = None) -> np.ndarray:
    """``array[rows]`` of a chunked array (a store's Zarr array) for sorted row indices, read one chunk at a
    time (bounded extra memory); with ``width``, only the first ``width`` entries of the second dimension
    (``array[rows, :width]``)."""
    cols, shape = slice(None), list(array.shape[1:])
    if width is not None:
        cols, shape[0] = slice(0, width), min(width, shape[0])
    out = np.empty((len(rows), *shape), dtype=array.dtype)
    if len(rows) == 0:
        return out
    step = array.chunks[0]
    chunk_of = rows // step
    starts = np.flatnonzero(np.r_[True, chunk_of[1:] != chunk_of[:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(rows)]):
        c = int(chunk_of[a])
        block = array[c * step : min((c + 1) * step, array.shape[0]), cols]
        out[a:b] = block[rows[a:b] - c * step]
    return out
