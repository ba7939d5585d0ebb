"""Checks on embedding arrays that need numpy alone: extraction's worker processes import them
without the store's zarr and pandas (a third of a second of each worker's start)."""

from __future__ import annotations

import os
from pathlib import Path

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


def raw_chunks(array) -> Path | None:
    """The folder of ``array``'s chunk files when they hold its rows as raw bytes (a local, uncompressed Zarr
    array: a store's), so that rows can be read in place; None otherwise (read through Zarr)."""
    try:
        from zarr.codecs import BytesCodec
        from zarr.storage import LocalStore
    except ImportError:  # no zarr here (a worker process): nothing to read in place
        return None
    codecs = getattr(getattr(array, "metadata", None), "codecs", ())
    whole_rows = tuple(array.chunks[1:]) == tuple(array.shape[1:])  # a chunk holds whole rows, one after another
    if whole_rows and isinstance(getattr(array, "store", None), LocalStore) and len(codecs) == 1 \
            and isinstance(codecs[0], BytesCodec):
        return Path(array.store.root) / array.path
    return None


def _pread_rows(path: Path, dtype: np.dtype, row_shape: tuple[int, ...], local: np.ndarray) -> np.ndarray | None:
    """Rows ``local`` (sorted, repeats allowed) of one raw chunk file, each run of consecutive rows in one read;
    None when the file is missing (Zarr then gives the fill value)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        step = np.diff(local)
        if (step > 0).all():  # unique already (the usual case): no np.unique
            uniq, back, step = local, None, step
        else:
            uniq, back = np.unique(local, return_inverse=True)
            step = np.diff(uniq)
        starts = np.concatenate(([0], np.flatnonzero(step != 1) + 1))
        ends = np.append(starts[1:], len(uniq))
        out = np.empty((len(uniq), *row_shape), dtype=dtype)
        flat = out.reshape(len(uniq), -1).view(np.uint8).reshape(len(uniq), row_bytes)
        for a, b in zip(starts.tolist(), ends.tolist()):
            want = (b - a) * row_bytes
            data = os.pread(fd, want, int(uniq[a]) * row_bytes)
            if len(data) != want:  # a short chunk file: left to Zarr (and the store's checks) to judge
                return None
            flat[a:b] = np.frombuffer(data, np.uint8).reshape(b - a, row_bytes)
        return out if back is None else out[back.reshape(-1)]
    finally:
        os.close(fd)


def read_rows(array, rows: np.ndarray, width: int | None = None) -> np.ndarray:
    """``array[rows]`` of a chunked array (a store's Zarr array) for sorted row indices (repeats allowed), read
    one chunk at a time (bounded extra memory); with ``width``, only the first ``width`` entries of the second
    dimension (``array[rows, :width]``).

    A store's chunks are raw little-endian bytes (:func:`raw_chunks`), so only the rows asked for are read,
    each run of consecutive rows at once, never a whole chunk for one row: a streamed epoch picks one
    caption in twenty, and a chunk of tokens is megabytes. Other arrays are read through Zarr."""
    cols, shape = slice(None), list(array.shape[1:])
    if width is not None:
        cols, shape[0] = slice(0, width), min(width, shape[0])
    out = np.empty((len(rows), *shape), dtype=array.dtype)
    if len(rows) == 0:
        return out
    root = raw_chunks(array)
    stored = np.dtype(array.dtype).newbyteorder("<")
    step = array.chunks[0]
    chunk_of = rows // step
    starts = np.concatenate(([0], np.flatnonzero(chunk_of[1:] != chunk_of[:-1]) + 1))
    for a, b in zip(starts.tolist(), np.append(starts[1:], len(rows)).tolist()):
        c = int(chunk_of[a])
        whole = None  # whole rows, read in place
        if root is not None:
            key = array.metadata.encode_chunk_key((c,) + (0,) * (array.ndim - 1))
            whole = _pread_rows(root / key, stored, tuple(array.shape[1:]), rows[a:b] - c * step)
        if whole is not None:
            out[a:b] = whole[:, cols] if width is not None else whole
        else:
            out[a:b] = array[c * step : min((c + 1) * step, array.shape[0]), cols][rows[a:b] - c * step]
    return out
