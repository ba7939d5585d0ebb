"""The store's on-disk layout (docs/design.md, "Feature store"; the package docstring draws it): its names,
its shards (one Zarr chunk each) and the checks of their chunks against their completion markers."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import zarr

from tvrpipe.data.manifest import SPLITS, isin_mask
from tvrpipe.errors import TvrpipeError
from tvrpipe.features.arrays import nonfinite_rows

STORE_NAME = "features.zarr"
PROGRESS = "_progress"
KINDS = ("videos", "texts")
ARRAYS = {"videos": ("frames", "frame_mask", "timestamps"), "texts": ("tokens", "token_mask", "sentence")}
EMBEDDINGS = ("videos/frames", "texts/tokens", "texts/sentence")  # must hold finite values only
NOT_WRITTEN = "not written yet"
SIDECARS = ("videos.parquet", "texts.parquet", "failures.parquet")
PREVIOUS = ".previous"  # the store a collection's update replaces, until the new one is complete


class StoreError(TvrpipeError):
    """A feature store is missing, incomplete or was made with other provenance."""


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of one kind (``videos`` or ``texts``): exactly one Zarr chunk."""

    kind: str
    index: int
    start: int
    stop: int

    def __str__(self) -> str:
        return f"shard {self.kind}/{self.index} (rows {self.start}-{self.stop - 1})"


@dataclass(frozen=True)
class Damage:
    """A shard whose marker says it is complete but whose chunks are not what was written."""

    shard: Shard
    problem: str  # names the array and the chunk, e.g. "videos/frames chunk c/1/0/0 is missing"

    def __str__(self) -> str:
        return f"{self.problem}, in {self.shard}"


def open_group(path: Path, mode: str = "r") -> zarr.Group:
    """The Zarr group at ``path``; :class:`StoreError` where its metadata cannot be read."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # consolidated metadata is not yet in the v3 spec
            return zarr.open_group(path, mode=mode, zarr_format=3)
    except Exception as e:  # zarr raises many kinds on damaged metadata
        raise StoreError(
            f"{path}: the store's metadata cannot be read ({type(e).__name__}: {e}); "
            "re-extract it with --overwrite"
        ) from None


class Layout:
    """The shards of an open store and the checks of their chunks against their markers."""

    def __init__(self, features_dir: Path, group: zarr.Group) -> None:
        self.dir, self.zarr_dir = features_dir, features_dir / STORE_NAME
        try:
            self.arrays = {kind: {name: group[f"{kind}/{name}"] for name in ARRAYS[kind]} for kind in KINDS}
        except Exception as e:
            raise StoreError(
                f"{self.zarr_dir}: an array's metadata cannot be read ({type(e).__name__}: {e}); "
                "re-extract the store with --overwrite"
            ) from None

    def shards(self, kind: str) -> list[Shard]:
        a = self.arrays[kind][ARRAYS[kind][0]]
        n, size = a.shape[0], a.chunks[0]
        return [Shard(kind, i, s, min(s + size, n)) for i, s in enumerate(range(0, n, size))]

    def marker(self, shard: Shard) -> Path:
        return self.dir / PROGRESS / shard.kind / f"{shard.index:06d}.json"

    def chunk_key(self, shard: Shard, name: str) -> str:
        a = self.arrays[shard.kind][name]
        return a.metadata.encode_chunk_key((shard.index,) + (0,) * (a.ndim - 1))

    def chunk_path(self, shard: Shard, name: str) -> Path:
        return self.zarr_dir / shard.kind / name / self.chunk_key(shard, name)

    def read_marker(self, shard: Shard) -> dict | None:
        try:
            rec = json.loads(self.marker(shard).read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def check(self, shard: Shard, checksums: bool, scan: dict[str, list[int]] | None = None) -> str | None:
        """None if the shard is whole, else what is wrong (:data:`NOT_WRITTEN` if it has no marker).

        With ``scan``, rows of the embeddings holding non-finite values are appended to
        ``scan[array]`` (read from the same bytes as the checksum).
        """
        if not self.marker(shard).is_file():
            return NOT_WRITTEN
        rec = self.read_marker(shard)
        chunks = rec.get("chunks") if rec else None
        if not isinstance(chunks, dict) or rec.get("rows") != [shard.start, shard.stop]:
            return f"its completion marker {self.marker(shard)} is damaged"
        for name in ARRAYS[shard.kind]:
            key, want = self.chunk_key(shard, name), chunks.get(name)
            if not isinstance(want, dict) or want.get("key") != key:
                return f"its completion marker does not record {shard.kind}/{name}"
            path = self.zarr_dir / shard.kind / name / key
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return f"{shard.kind}/{name} chunk {key} is missing"
            if size != want.get("bytes"):
                return f"{shard.kind}/{name} chunk {key} has {size} bytes but {want.get('bytes')} were written"
            if not checksums:
                continue
            data = path.read_bytes()
            if zlib.crc32(data) != want.get("crc32"):
                return f"{shard.kind}/{name} chunk {key} does not match its checksum"
            array = f"{shard.kind}/{name}"
            if scan is not None and array in EMBEDDINGS:
                a = self.arrays[shard.kind][name]
                block = np.frombuffer(data, dtype=a.dtype.newbyteorder("<")).reshape(a.chunks)
                bad = np.flatnonzero(nonfinite_rows(block[: shard.stop - shard.start]))
                scan.setdefault(array, []).extend((shard.start + bad).tolist())
        return None

    def problems(self, kind: str, checksums: bool) -> dict[Shard, str]:
        """Every shard of ``kind`` that is not whole, with what is wrong."""
        out = {}
        for shard in self.shards(kind):
            problem = self.check(shard, checksums)
            if problem is not None:
                out[shard] = problem
        return out


def _rows_text(bad: np.ndarray) -> str:
    """``row 3`` (``row 3 and 11 more``): the first of the rows ``bad`` (a boolean mask) and how many follow."""
    rows = np.flatnonzero(bad)
    return f"row {rows[0]}" + (f" and {len(rows) - 1} more" if len(rows) > 1 else "")


def _id_problem(ids: pd.Series, key: str) -> str | None:
    """What is wrong with a table's id column ``key``: a row without an id, or an id of two rows."""
    missing = (ids.isna() | ids.eq("")).to_numpy(dtype=bool)
    if missing.any():
        return f"{_rows_text(missing)}: no {key}"
    twice = ids.duplicated().to_numpy(dtype=bool)
    if twice.any():
        value = ids.iloc[int(np.flatnonzero(twice)[0])]
        first = int(np.flatnonzero(ids.eq(value).to_numpy(dtype=bool))[0])
        return f"{_rows_text(twice)}: {key} {_q(value)} is row {first}'s too ({key} is unique)"
    return None


def _q(value: object) -> str:
    """A table's value as a message quotes it (a NumPy scalar as the number it holds)."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _plain(column: pd.Series) -> pd.Series:
    """A column as its values: a categorical one (Parquet's dictionary encoding may read back so) as plain values,
    which compare with another table's whatever its categories."""
    return column.astype(column.cat.categories.dtype) if isinstance(column.dtype, pd.CategoricalDtype) else column


def table_problem(videos: pd.DataFrame, texts: pd.DataFrame) -> tuple[str, str] | None:
    """What breaks the contract of a store's row tables (docs/design.md, "Feature store"), as ``(file, what)``, or
    None: ``videos.parquet``'s ``video_id`` unique and present, its ``split`` one of
    :data:`~tvrpipe.data.manifest.SPLITS` (a collection's videos are all ``test``); ``texts.parquet``'s
    ``caption_id`` unique and present, its ``video_row`` a row of ``videos.parquet`` holding the caption's
    ``video_id``, its ``split`` its video's. Whole columns are compared at once: a store holds millions of rows.
    A table that breaks it would be read silently wrong: captions scored against other videos, videos left out of
    every split, a split without captions.
    """
    video_id, split = _plain(videos["video_id"]), _plain(videos["split"])
    problem = _id_problem(video_id, "video_id")
    if problem:
        return "videos.parquet", problem
    bad = ~isin_mask(split, pd.Series(SPLITS))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return "videos.parquet", (f"{_rows_text(bad)} (video {_q(video_id.iloc[i])}): split "
                                  f"{_q(split.iloc[i])} is not one of {', '.join(SPLITS)}")
    caption_id = _plain(texts["caption_id"])
    problem = _id_problem(caption_id, "caption_id")
    if problem:
        return "texts.parquet", problem
    rows = texts["video_row"]
    if len(rows) and (not pd.api.types.is_integer_dtype(rows) or rows.isna().any()):
        return "texts.parquet", f"video_row holds {rows.dtype} values, not row numbers (integers)"
    row = rows.to_numpy(dtype=np.int64)

    def caption(i: int) -> str:
        return f"caption {_q(caption_id.iloc[i])}"

    outside = (row < 0) | (row >= len(videos))
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        return "texts.parquet", (f"{_rows_text(outside)} ({caption(i)}): video_row {row[i]} is not a row of "
                                 f"videos.parquet (0 to {len(videos) - 1})")
    named = _plain(texts["video_id"]).reset_index(drop=True)
    its_id = video_id.take(row).reset_index(drop=True)
    other = (named.isna() | named.ne(its_id)).to_numpy(dtype=bool)
    if other.any():
        i = int(np.flatnonzero(other)[0])
        return "texts.parquet", (f"{_rows_text(other)} ({caption(i)}): video_row {row[i]} is video {_q(its_id[i])} in "
                                 f"videos.parquet, but the caption's video_id is {_q(named[i])}")
    its_split = split.take(row).reset_index(drop=True)
    text_split = _plain(texts["split"]).reset_index(drop=True)
    moved = (text_split.isna() | text_split.ne(its_split)).to_numpy(dtype=bool)
    if moved.any():
        i = int(np.flatnonzero(moved)[0])
        return "texts.parquet", (f"{_rows_text(moved)} ({caption(i)}): split {_q(text_split[i])}, but its video "
                                 f"{_q(named[i])} is in {_q(its_split[i])} (a caption's split is its video's)")
    return None


PREVIOUS_STAGING = f"{PREVIOUS}.tmp"  # a move into .previous in progress


def update_interrupted(features_dir: str | os.PathLike[str]) -> bool:
    """Whether an update of a collection's store in ``features_dir`` was interrupted: the store it replaces
    is still set aside (the next update takes its rows from there)."""
    d = Path(features_dir)
    return (d / PREVIOUS).is_dir() or (d / PREVIOUS_STAGING).is_dir()
