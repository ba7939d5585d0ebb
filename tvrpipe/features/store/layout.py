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
import zarr

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


PREVIOUS_STAGING = f"{PREVIOUS}.tmp"  # a move into .previous in progress


def update_interrupted(features_dir: str | os.PathLike[str]) -> bool:
    """Whether an update of a collection's store in ``features_dir`` was interrupted: the store it replaces
    is still set aside (the next update takes its rows from there)."""
    d = Path(features_dir)
    return (d / PREVIOUS).is_dir() or (d / PREVIOUS_STAGING).is_dir()
