"""The feature store: a Zarr v3 group of CLIP features, the contract between extraction and heads.

Layout (DESIGN.md, "Feature store"), in ``<features_dir>/``::

    features.zarr/            Zarr v3 group, uncompressed float16 (fp16 embeddings barely compress)
      videos/frames           float16 [n_videos, F, D]   projected frame [CLS] embeddings
      videos/frame_mask       bool    [n_videos, F]      False where a short video was padded
      videos/timestamps       float32 [n_videos, F]      seconds of each sampled frame (NaN: padding)
      texts/tokens            float16 [n_texts, L, D]    ln_final(x) @ text_projection, every token
      texts/token_mask        bool    [n_texts, L]
      texts/sentence          float16 [n_texts, D]       EOS token = open_clip encode_text
      attrs                   provenance (see :func:`make_provenance`) and ``complete``
    videos.parquet            row -> video_id, split, path
    texts.parquet             row -> caption_id, video_id, video_row, split
    failures.parquet          video_id, stage, error (bad videos: zero features, mask all False)
    _progress/{videos,texts}/NNNNN.json   completion marker of each shard (atomic rename)

Rows follow the manifest's order, so the same ids always land in the same rows. Every row has
F frames (padded + mask), so rows are fixed-size and a writer owns whole shards (row ranges that
are exactly one Zarr chunk): writers never share a chunk, and a shard whose marker exists is
complete. Rerunning an extraction skips completed shards; a store made with other provenance
is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import zarr

from tvrpipe.errors import TvrpipeError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
STORE_NAME = "features.zarr"
PROGRESS = "_progress"
# Provenance keys that must match for a store to be reused or read by a head.
IDENTITY_KEYS = (
    "schema_version",
    "model",
    "pretrained",
    "weights_sha256",
    "frames",
    "max_words",
    "embed_dim",
    "frame_sampling",
    "image_size",
    "preprocessing",
    "manifest_sha256",
    "dtype",
)


class StoreError(TvrpipeError):
    """A feature store is missing, incomplete or was made with other provenance."""


def manifest_sha256(videos: pd.DataFrame, captions: pd.DataFrame) -> str:
    """A hash of the manifest rows (ids, paths, splits, texts) that a store was built from."""
    h = hashlib.sha256()
    for table in (videos, captions):
        h.update(pd.util.hash_pandas_object(table.astype(str), index=False).to_numpy().tobytes())
    return h.hexdigest()


def make_provenance(**fields: Any) -> dict[str, Any]:
    """Provenance attrs: the identity keys plus anything else worth recording."""
    from tvrpipe import __version__

    missing = [k for k in IDENTITY_KEYS if k not in fields and k not in ("schema_version", "dtype")]
    if missing:
        raise ValueError(f"provenance lacks {missing}")
    return {"schema_version": SCHEMA_VERSION, "tvrpipe_version": __version__, "dtype": "float16", **fields}


def provenance_mismatch(have: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two provenances on the identity keys in ``want``."""
    return [
        f"{k}: store has {have.get(k)!r}, expected {want[k]!r}"
        for k in IDENTITY_KEYS
        if k in want and have.get(k) != want[k]
    ]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_write_parquet(df: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, stop)`` of one kind (``videos`` or ``texts``): exactly one Zarr chunk."""

    kind: str
    index: int
    start: int
    stop: int


class StoreWriter:
    """Creates (or resumes) a store and writes whole shards with completion markers.

    Args:
        features_dir: the store's directory.
        videos: the videos sidecar (columns video_id, split, path), in row order.
        texts: the texts sidecar (caption_id, video_id, video_row, split), in row order.
        provenance: from :func:`make_provenance`; must include frames, max_words, embed_dim.
        video_shard: videos per shard (and per Zarr chunk).
        text_shard: texts per shard.
        overwrite: delete a store with other provenance instead of refusing it.
    """

    def __init__(
        self,
        features_dir: str | os.PathLike[str],
        videos: pd.DataFrame,
        texts: pd.DataFrame,
        provenance: Mapping[str, Any],
        video_shard: int = 64,
        text_shard: int = 256,
        overwrite: bool = False,
    ) -> None:
        self.dir = Path(features_dir)
        self.provenance = dict(provenance)
        self.n_videos, self.n_texts = len(videos), len(texts)
        F, L, D = provenance["frames"], provenance["max_words"], provenance["embed_dim"]
        path = self.dir / STORE_NAME
        if (path / "zarr.json").is_file():
            old = dict(zarr.open_group(path, mode="r").attrs)
            diff = provenance_mismatch(old, self.provenance)
            if diff and not overwrite:
                raise StoreError(
                    f"{self.dir} holds features made with other settings ({'; '.join(diff)}); "
                    "choose another --out or pass --overwrite to replace them"
                )
            if diff:
                log.warning("replacing %s (%s)", self.dir, "; ".join(diff))
                shutil.rmtree(path)
                shutil.rmtree(self.dir / PROGRESS, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        fresh = not (path / "zarr.json").is_file()
        root = zarr.open_group(path, mode="a", zarr_format=3)
        if fresh:
            v, t = root.require_group("videos"), root.require_group("texts")
            vs, ts = max(1, min(video_shard, self.n_videos)), max(1, min(text_shard, self.n_texts))
            spec = {"compressors": None, "fill_value": 0}
            v.create_array("frames", shape=(self.n_videos, F, D), chunks=(vs, F, D), dtype="float16", **spec)
            v.create_array("frame_mask", shape=(self.n_videos, F), chunks=(vs, F), dtype="bool", **spec)
            v.create_array("timestamps", shape=(self.n_videos, F), chunks=(vs, F), dtype="float32",
                           compressors=None, fill_value=float("nan"))
            t.create_array("tokens", shape=(self.n_texts, L, D), chunks=(ts, L, D), dtype="float16", **spec)
            t.create_array("token_mask", shape=(self.n_texts, L), chunks=(ts, L), dtype="bool", **spec)
            t.create_array("sentence", shape=(self.n_texts, D), chunks=(ts, D), dtype="float16", **spec)
            root.attrs.update({**self.provenance, "complete": False, "n_videos": self.n_videos,
                               "n_texts": self.n_texts})
            _atomic_write_parquet(videos.reset_index(drop=True), self.dir / "videos.parquet")
            _atomic_write_parquet(texts.reset_index(drop=True), self.dir / "texts.parquet")
        self.root = root
        self.video_shard = root["videos/frames"].chunks[0]
        self.text_shard = root["texts/tokens"].chunks[0]
        for kind in ("videos", "texts"):
            (self.dir / PROGRESS / kind).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ shards and markers

    def shards(self, kind: str) -> list[Shard]:
        """Every shard of ``kind`` in row order."""
        n, size = (self.n_videos, self.video_shard) if kind == "videos" else (self.n_texts, self.text_shard)
        return [Shard(kind, i, a, min(a + size, n)) for i, a in enumerate(range(0, n, size))]

    def _marker(self, shard: Shard) -> Path:
        return self.dir / PROGRESS / shard.kind / f"{shard.index:06d}.json"

    def pending(self, kind: str) -> list[Shard]:
        """Shards of ``kind`` that have no completion marker yet."""
        return [s for s in self.shards(kind) if not self._marker(s).is_file()]

    def write_videos(
        self,
        shard: Shard,
        frames: np.ndarray,
        mask: np.ndarray,
        timestamps: np.ndarray,
        failures: list[dict[str, str]],
    ) -> None:
        """Write one whole video shard, then its marker (which carries the shard's failures)."""
        n = shard.stop - shard.start
        assert frames.shape[0] == mask.shape[0] == timestamps.shape[0] == n, (frames.shape, shard)
        g = self.root["videos"]
        g["frames"][shard.start : shard.stop] = frames.astype(np.float16)
        g["frame_mask"][shard.start : shard.stop] = mask.astype(bool)
        g["timestamps"][shard.start : shard.stop] = timestamps.astype(np.float32)
        _atomic_write_text(self._marker(shard), json.dumps({"rows": [shard.start, shard.stop], "failures": failures}))

    def write_texts(self, shard: Shard, tokens: np.ndarray, mask: np.ndarray, sentence: np.ndarray) -> None:
        """Write one whole text shard, then its marker."""
        g = self.root["texts"]
        g["tokens"][shard.start : shard.stop] = tokens.astype(np.float16)
        g["token_mask"][shard.start : shard.stop] = mask.astype(bool)
        g["sentence"][shard.start : shard.stop] = sentence.astype(np.float16)
        _atomic_write_text(self._marker(shard), json.dumps({"rows": [shard.start, shard.stop], "failures": []}))

    def failures(self) -> pd.DataFrame:
        """Failures recorded in every completed shard's marker."""
        rows: list[dict[str, str]] = []
        for s in self.shards("videos"):
            m = self._marker(s)
            if m.is_file():
                rows += json.loads(m.read_text())["failures"]
        return pd.DataFrame(rows, columns=["video_id", "stage", "error"])

    def finalize(self) -> pd.DataFrame:
        """After every shard is complete: write failures.parquet, mark complete, consolidate."""
        left = len(self.pending("videos")) + len(self.pending("texts"))
        if left:
            raise StoreError(f"{self.dir}: {left} shards are not complete yet; rerun the extraction to finish")
        failures = self.failures()
        _atomic_write_parquet(failures, self.dir / "failures.parquet")
        self.root.attrs["complete"] = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # consolidated metadata is not yet in the v3 spec
            zarr.consolidate_metadata(self.dir / STORE_NAME)
        return failures


@dataclass(frozen=True)
class FeatureStore:
    """A complete feature store, opened for reading.

    Attributes:
        dir: the store's directory.
        provenance: the root attrs.
        videos: sidecar table, one row per video row (video_id, split, path).
        texts: sidecar table, one row per text row (caption_id, video_id, video_row, split).
        failures: the failed videos.
        group: the Zarr group (arrays are read lazily: ``group["texts/tokens"][rows]``).
    """

    dir: Path
    provenance: dict[str, Any]
    videos: pd.DataFrame
    texts: pd.DataFrame
    failures: pd.DataFrame
    group: zarr.Group

    def array(self, name: str) -> zarr.Array:
        """One of the arrays, e.g. ``videos/frames``."""
        return self.group[name]


def open_store(features_dir: str | os.PathLike[str], expect: Mapping[str, Any] | None = None) -> FeatureStore:
    """Open a complete store; refuse it if ``expect`` names provenance it does not have.

    Args:
        features_dir: the directory ``tvrpipe extract --out`` wrote.
        expect: identity keys the caller needs (e.g. a trained head's provenance).

    Raises:
        StoreError: missing, incomplete, or different provenance.
    """
    d = Path(features_dir)
    path = d / STORE_NAME
    if not (path / "zarr.json").is_file():
        raise StoreError(f"{d}: no feature store here (expected {STORE_NAME}); create one with `tvrpipe extract`")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        group = zarr.open_group(path, mode="r")
    prov = dict(group.attrs)
    if not prov.get("complete"):
        raise StoreError(f"{d}: the extraction has not finished; rerun the same `tvrpipe extract` to resume it")
    if prov.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(f"{d}: store schema {prov.get('schema_version')} is not {SCHEMA_VERSION}; re-extract")
    if expect:
        diff = provenance_mismatch(prov, expect)
        if diff:
            raise StoreError(f"{d}: features were made with other settings ({'; '.join(diff)})")
    return FeatureStore(
        dir=d,
        provenance=prov,
        videos=pd.read_parquet(d / "videos.parquet"),
        texts=pd.read_parquet(d / "texts.parquet"),
        failures=pd.read_parquet(d / "failures.parquet"),
        group=group,
    )
