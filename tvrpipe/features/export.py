"""``tvrpipe export``: a complete feature store for other tools.

- ``hdf5``: the whole store in one HDF5 file, for sharing: the same arrays under the same names
  (``videos/frames``, ...), the id tables as string datasets (``ids/video_id``, ``ids/caption_id``,
  ...) and the provenance as root attributes. Arrays are copied one Zarr chunk at a time, so memory
  stays bounded.
- ``npy`` and ``parquet``: one pooled embedding per video (the meanpool head's), with ids and
  provenance, for a vector index or a dataframe (:func:`export_pooled`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import ARRAYS as STORE_ARRAYS
from tvrpipe.features.store import open_store
from tvrpipe.files import NpyWriter, atomic_write, free_disk
from tvrpipe.lock import check_writable, nearest_existing
from tvrpipe.progress import track

ARRAYS = tuple(f"{kind}/{name}" for kind, names in STORE_ARRAYS.items() for name in names)


def export_hdf5(features_dir: str | os.PathLike[str], out_file: str | os.PathLike[str], progress: bool = False) -> Path:
    """Write the store's arrays, ids and provenance into ``out_file`` (written atomically; ``progress``: a bar
    over the arrays' chunks).

    The store is checked as it is opened (:func:`~tvrpipe.features.store.open_store`); a damaged
    store is refused before anything is written.

    Example:
        >>> export_hdf5("features/msrvtt-b32", "msrvtt-b32.h5")  # doctest: +SKIP
    """
    store = open_store(features_dir)
    out = Path(out_file)
    if out.resolve().is_relative_to(store.dir.resolve()):
        raise ConfigError(f"--out {out} is inside the feature store {store.dir}: the export would overwrite or add "
                          "to the store's own files; write it outside the store's directory")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as features.h5")
    check_writable(out.parent, "--out")
    # h5py crashes the process (not an exception) when the disk fills as it closes a file: check the room first
    need = sum(store.array(name).nbytes for name in ARRAYS) * 1.02 + (16 << 20)  # + ids, attributes, headers
    ancestor = nearest_existing(out.parent)
    free = free_disk(ancestor)
    if free < need:
        raise ConfigError(f"--out {out}: the export needs about {need / 1e9:.2f} GB and {ancestor} has "
                          f"{free / 1e9:.2f} GB free; make room or write it elsewhere")
    def write(tmp: Path) -> None:
        try:
            h5 = h5py.File(tmp, "w")
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e}); choose a writable path") from None
        with h5:
            chunks = [(name, a) for name in ARRAYS for a in range(0, store.array(name).shape[0],
                                                                  store.array(name).chunks[0])]
            for name in ARRAYS:
                src = store.array(name)
                # HDF5 refuses chunks for an empty dataset (a collection's store has no captions)
                h5.create_dataset(name, shape=src.shape, dtype=src.dtype, chunks=src.chunks if src.shape[0] else None)
            for name, a in track(chunks, f"writing {out.name}", enabled=progress):
                src, step = store.array(name), store.array(name).chunks[0]
                h5[name][a : a + step] = src[a : a + step]
            strings = h5py.string_dtype()
            for table, cols in ((store.videos, ("video_id", "split", "path")),
                                (store.texts, ("caption_id", "video_id", "split"))):
                prefix = "ids/videos" if "path" in cols else "ids/texts"
                for col in cols:
                    h5.create_dataset(f"{prefix}/{col}", data=table[col].astype(str).to_numpy(dtype=object),
                                      dtype=strings)
            h5.create_dataset("ids/texts/video_row", data=store.texts["video_row"].to_numpy(np.int64))
            for k, v in store.provenance.items():
                h5.attrs[k] = json.dumps(v)
            h5.flush()

    atomic_write(out, write, parents=True)
    return out


POOLED_FORMATS = ("npy", "parquet")


def pooled_blocks(store, rows: int = 4096,
                  which: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The store's videos (``which``: only these store rows, sorted) ``rows`` at a time, each block as ``(its
    store rows, embeddings (block, D) float32, has a decoded frame (block,) bool)``: the embedding as the meanpool
    head computes it (L2-normalised mean of the L2-normalised valid frames,
    :func:`tvrpipe.heads.pooling.mean_video`); a video without a decoded frame (a failed one) has a zero row.
    Memory holds one block of frames, whatever the store's size."""
    import torch

    from tvrpipe.heads.pooling import mean_video

    which = np.arange(store.array("videos/frames").shape[0]) if which is None else np.asarray(which, np.int64)
    for a in range(0, len(which), rows):
        part = which[a : a + rows]
        m = store.read("videos/frame_mask", part)
        frames = store.read("videos/frames", part)
        yield part, mean_video(torch.from_numpy(frames.astype(np.float32)), torch.from_numpy(m)).numpy(), m.any(axis=1)


def pooled_embeddings(store, rows: int = 4096, which: np.ndarray | None = None,
                      out: np.ndarray | NpyWriter | None = None,
                      progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Every video's embedding as the meanpool head computes it (:func:`pooled_blocks`), read ``rows`` videos
    at a time; ``which``: only these store rows (sorted), in that order (one shard of a search's first stage
    reads its own rows alone); ``out``: the ``(N, D)`` float32 array to fill in row order (a
    :class:`tvrpipe.files.NpyWriter`, so that the embeddings are never all in RAM), else a new one;
    ``progress``: a bar over the blocks.

    Returns:
        ``(embeddings (N, D) float32, has_frames (N,) bool)``, N the store's videos (or ``which``'s); a video
        without a decoded frame (a failed one) has no embedding (a zero row, ``has_frames`` False).
    """
    n, _, d = store.array("videos/frames").shape
    size = n if which is None else len(which)
    out = np.zeros((size, d), np.float32) if out is None else out
    has = np.zeros(size, bool)
    at = 0
    blocks = track(pooled_blocks(store, rows, which), "mean-pooling the videos", total=-(-size // rows),
                   enabled=progress)
    for part, emb, h in blocks:
        out[at : at + len(part)], has[at : at + len(part)] = emb, h
        at += len(part)
    return out, has


def check_new_export(store, out: str | os.PathLike[str], kind: str) -> Path:
    """``--out`` of an export that writes a new ``kind`` (``file`` or ``folder``): outside the store, not there
    yet, in a writable folder.

    Raises:
        ConfigError: naming ``--out`` and what to do.
    """
    out = Path(out)
    if out.resolve().is_relative_to(Path(store.dir).resolve()):
        raise ConfigError(f"--out {out} is inside the feature store {store.dir}; write it outside the store's directory")
    if out.exists():
        raise ConfigError(f"--out {out} exists; choose a new {kind} name")
    check_writable(out.parent, "--out")
    return out


def export_pooled(features_dir: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str,
                  progress: bool = False) -> tuple[Path, int]:
    """Write the store's pooled video embeddings (:func:`pooled_embeddings`) for other tools: the videos
    with at least one decoded frame, with their ids, splits and paths, and the store's provenance.

    - ``npy``: a folder ``out`` with ``embeddings.npy`` (float32 ``(n, D)``, L2-normalised: inner product
      = cosine), ``videos.csv`` (row of ``embeddings.npy``, video_id, split, path) and ``provenance.json``;
    - ``parquet``: one file ``out`` with columns video_id, split, path, embedding (a list of D float32),
      and the provenance as JSON in the file's metadata (key ``tvrpipe``).

    Written under a temporary name, then moved into place: an interrupted export leaves nothing.

    Returns:
        ``(out, videos left out for having no decoded frame)``.
    """

    if fmt not in POOLED_FORMATS:
        raise ConfigError(f"--format {fmt!r}: pooled embeddings are written as {' or '.join(POOLED_FORMATS)}")
    store = open_store(features_dir)
    out = check_new_export(store, out, "folder" if fmt == "npy" else "file")
    emb, has = pooled_embeddings(store, progress=progress)
    if not has.any():
        raise ConfigError(f"--features {store.dir}: no video has a decoded frame, so there is nothing to export")
    table = store.videos[["video_id", "split", "path"]].astype(str).reset_index(drop=True)[has]
    emb = emb[has]
    provenance = json.dumps({**store.provenance, "pooling": "meanpool: L2-normalised mean of L2-normalised frames"})
    def write(tmp: Path) -> None:
        if fmt == "npy":
            tmp.mkdir()
            np.save(tmp / "embeddings.npy", emb)
            table.assign(row=np.arange(len(table)))[["row", "video_id", "split", "path"]].to_csv(
                tmp / "videos.csv", index=False)
            (tmp / "provenance.json").write_text(provenance)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            arrow = pa.Table.from_pandas(table, preserve_index=False).append_column(
                "embedding", pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1]))
            pq.write_table(arrow.replace_schema_metadata({"tvrpipe": provenance}), tmp)

    atomic_write(out, write, parents=True)
    return out, int((~has).sum())
