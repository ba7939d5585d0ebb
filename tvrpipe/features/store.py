"""The feature store: a Zarr v3 group of CLIP features, the contract between extraction and heads.

Layout (docs/design.md, "Feature store"), in ``<features_dir>/``::

    features.zarr/            Zarr v3 group, uncompressed float16 (fp16 embeddings barely compress)
      videos/frames           float16 [n_videos, F, D]   projected frame [CLS] embeddings
      videos/frame_mask       bool    [n_videos, F]      False where a short video was padded
      videos/timestamps       float32 [n_videos, F]      seconds of each sampled frame (NaN: padding)
      texts/tokens            float16 [n_texts, L, D]    ln_final(x) @ text_projection, every token
      texts/token_mask        bool    [n_texts, L]
      texts/sentence          float16 [n_texts, D]       EOS token = open_clip encode_text
      attrs                   provenance (see :func:`make_provenance`) and ``complete``
    videos.parquet            row -> video_id, split, path, start_s, end_s (the clip's bounds; null: the
                              whole file), and for a collection bytes, mtime_ns (the file's fingerprint)
    texts.parquet             row -> caption_id, video_id, video_row, split (no rows for a collection)
    failures.parquet          video_id, stage, error (bad videos: zero features, mask all False)
    _progress/{videos,texts}/NNNNNN.json   completion marker of each shard (atomic rename)
    .tvrpipe.lock             held by the one process writing the store (:mod:`tvrpipe.lock`)
    .previous/                while a collection's store is updated: the store it replaces (below)

Rows follow the manifest's order, so the same ids always land in the same rows. Every row has
F frames (padded + mask), so rows are fixed-size and a writer owns whole shards (row ranges that
are exactly one Zarr chunk): writers never share a chunk. Rerunning an extraction skips completed
shards; a store made with other provenance is refused.

Updating a collection. A collection's folder gains, loses and changes files; its manifest, and so
the store's ``manifest_sha256``, change with it. A writer opened with ``update=True`` on a collection
store whose identity differs only in ``manifest_sha256`` moves that store's files into
``.previous/`` (through a staging folder renamed into place, so an interrupted move is finished by
the next writer) and creates the new store; the extraction copies from ``.previous`` the rows whose
file fingerprint (video_id, path, bytes, mtime_ns) is unchanged and that lie in a whole shard (CRC-32
checked) and did not fail, and encodes the rest. ``.previous`` is deleted once the new store is
complete. If an update is interrupted, the next one keeps ``.previous`` as its source: it resumes
the partial store when it was made from the same manifest, and otherwise deletes it.

Integrity. A shard's marker is written after its chunks and records, for every array of its kind,
the chunk's key, size in bytes and CRC-32 (read back from disk), plus the shard's failures. Every
chunk is written, even one that holds only fill values, so a missing chunk file is always damage.
:func:`open_store` checks that every shard has a marker and every chunk its recorded size (one
``stat`` per chunk: cheap, always); :func:`verify_store` (``tvrpipe features verify``) also
checks every CRC-32 and scans the embeddings for non-finite rows. A writer treats a damaged shard
like one never written, so rerunning the extraction re-extracts exactly the damaged shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import zarr

from tvrpipe.data.manifest import COLLECTION
from tvrpipe.environment import resumed_versions, versions
from tvrpipe.errors import ConfigError, LockError, NonFiniteError, TvrpipeError, writing
from tvrpipe.features.arrays import nonfinite_rows, read_rows
from tvrpipe.files import (
    atomic_write,
    atomic_write_parquet,
    atomic_write_text,
    move_into_place,
    remove_staged,
)
from tvrpipe.lock import DirLock, lock_holder

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: markers record each chunk's size and CRC-32, and every chunk is written
STORE_NAME = "features.zarr"
PROGRESS = "_progress"
KINDS = ("videos", "texts")
ARRAYS = {"videos": ("frames", "frame_mask", "timestamps"), "texts": ("tokens", "token_mask", "sentence")}
EMBEDDINGS = ("videos/frames", "texts/tokens", "texts/sentence")  # must hold finite values only
NOT_WRITTEN = "not written yet"
SIDECARS = ("videos.parquet", "texts.parquet", "failures.parquet")
PREVIOUS = ".previous"  # the store a collection's update replaces, until the new one is complete
FINGERPRINT = ("video_id", "path", "bytes", "mtime_ns")  # a collection's row is reused when all four are equal
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


def manifest_sha256(videos: pd.DataFrame, captions: pd.DataFrame, files: pd.DataFrame | None = None) -> str:
    """A hash of the manifest rows (ids, paths, splits, texts) that a store was built from, and of a
    collection's file fingerprints (``files``: video_id, bytes, mtime_ns), so that a file changed in
    place under the same name changes the store's identity."""
    h = hashlib.sha256()
    for table in (videos, captions) if files is None else (videos, captions, files):
        h.update(pd.util.hash_pandas_object(table.astype(str), index=False).to_numpy().tobytes())
    return h.hexdigest()


def make_provenance(**fields: Any) -> dict[str, Any]:
    """Provenance attrs: the identity keys plus anything else worth recording."""
    from tvrpipe import __version__

    missing = [k for k in IDENTITY_KEYS if k not in fields and k not in ("schema_version", "dtype")]
    if missing:
        raise ValueError(f"provenance lacks {missing}")
    return {"schema_version": SCHEMA_VERSION, "tvrpipe_version": __version__, "dtype": "float16",
            "versions": versions(), **fields}


def store_identity(provenance: Mapping[str, Any]) -> dict[str, Any]:
    """The identity keys of a provenance: what a run records as the store it was trained on."""
    return {k: provenance.get(k) for k in IDENTITY_KEYS}


def written_state(features_dir: str | os.PathLike[str], kind: str = "videos") -> str:
    """A hash of what the shards of ``kind`` hold, as their markers record it (each chunk's size and CRC-32,
    and the shard's failed videos). It changes whenever a shard is written again with other values, which
    the provenance's identity keys do not show: an extract rerun that recovers a failed video, re-extracts
    a damaged shard or overwrites at another precision."""
    h = hashlib.sha256()
    for marker in sorted((Path(features_dir) / PROGRESS / kind).glob("*.json")):
        h.update(marker.name.encode())
        h.update(b"\0")
        try:
            h.update(marker.read_bytes())
        except OSError:  # rewritten by an extract at this moment: a state no cache may be kept under
            h.update(os.urandom(16))
    return h.hexdigest()


def _is_path(pretrained: Any) -> bool:
    from tvrpipe.features.weights import looks_like_path

    return isinstance(pretrained, str) and pretrained != "none" and looks_like_path(pretrained)


def differs(key: str, have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Whether two provenances differ on the identity key ``key``. Two checkpoint paths do not, where both
    record the same ``weights_sha256``: the sha256 names the weights, and a path differs with where it was
    given from (a store made before paths were recorded resolved holds the relative one) or where the
    file has moved."""
    a, b = have.get(key), want.get(key)
    if key == "pretrained" and a != b and _is_path(a) and _is_path(b):
        sha = have.get("weights_sha256")
        return sha is None or sha != want.get("weights_sha256")
    return a != b


def provenance_mismatch(have: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two provenances on the identity keys in ``want``."""
    return [
        f"{k}: store has {have.get(k)!r}, expected {want[k]!r}"
        for k in IDENTITY_KEYS
        if k in want and differs(k, have, want)
    ]



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


def _open_group(path: Path, mode: str = "r") -> zarr.Group:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # consolidated metadata is not yet in the v3 spec
            return zarr.open_group(path, mode=mode, zarr_format=3)
    except Exception as e:  # zarr raises many kinds on damaged metadata
        raise StoreError(
            f"{path}: the store's metadata cannot be read ({type(e).__name__}: {e}); "
            "re-extract it with --overwrite"
        ) from None


class _Layout:
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


_PREVIOUS_STAGING = f"{PREVIOUS}.tmp"  # a move into .previous in progress


def update_interrupted(features_dir: str | os.PathLike[str]) -> bool:
    """Whether an update of a collection's store in ``features_dir`` was interrupted: the store it replaces
    is still set aside (the next update takes its rows from there)."""
    d = Path(features_dir)
    return (d / PREVIOUS).is_dir() or (d / _PREVIOUS_STAGING).is_dir()


class PreviousStore:
    """The store a collection's update replaces (``.previous``), opened as a source of rows to copy:
    whether it was complete or not, only its whole shards count (marker present, every chunk of the
    recorded size and CRC-32), and in them only the videos that did not fail.

    Attributes:
        dir: the ``.previous`` folder.
        rows: the reusable rows: their :data:`FINGERPRINT` columns and ``row`` (their row there).
    """

    def __init__(self, features_dir: Path) -> None:
        self.dir = Path(features_dir)
        self.group = _open_group(self.dir / STORE_NAME)
        layout = _Layout(self.dir, self.group)
        empty = pd.DataFrame(columns=[*FINGERPRINT, "row"])
        try:
            table = pd.read_parquet(self.dir / "videos.parquet")
        except Exception:  # missing or damaged: nothing can be matched, every video is encoded again
            self.rows = empty
            return
        n = self.group["videos/frames"].shape[0]
        if len(table) != n or not set(FINGERPRINT) <= set(table.columns):
            self.rows = empty
            return
        keep = np.zeros(n, bool)
        for shard in layout.shards("videos"):
            if layout.check(shard, checksums=True) is None:
                keep[shard.start : shard.stop] = True
                rec = layout.read_marker(shard) or {}
                failed = {f.get("video_id") for f in rec.get("failures", [])}
                ids = table["video_id"].to_numpy()[shard.start : shard.stop]
                keep[shard.start : shard.stop] &= ~np.isin(ids, list(failed))
        self.rows = table.loc[keep, list(FINGERPRINT)].assign(row=np.flatnonzero(keep)).reset_index(drop=True)

    def match(self, videos: pd.DataFrame) -> np.ndarray:
        """For each row of ``videos`` (a new store's sidecar, with the :data:`FINGERPRINT` columns), the
        row of this store that holds the same file's features, or -1."""
        index = {_fingerprint_key(k): int(r) for k, r in
                 zip(self.rows[list(FINGERPRINT)].itertuples(index=False, name=None), self.rows["row"])}
        return np.array([index.get(_fingerprint_key(k), -1)
                         for k in videos[list(FINGERPRINT)].itertuples(index=False, name=None)], np.int64)

    def read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The video arrays (``frames``, ``frame_mask``, ``timestamps``) of ``rows``, in that order."""
        order = np.argsort(rows, kind="stable")
        out = {}
        for name in ARRAYS["videos"]:
            values = self.group[f"videos/{name}"].get_orthogonal_selection((rows[order],))
            out[name] = np.empty_like(values)
            out[name][order] = values
        return out


def _fingerprint_key(values: tuple) -> tuple[str, str, int, int]:
    video_id, path, size, mtime = values
    return str(video_id), str(path), int(size), int(mtime)


# what stores written by an earlier tvrpipe recorded as their maker, and the command that repairs them
_MAKERS = {"generate_store (tvrpipe.pipeline.genstore)": "tvrpipe synth --features-only"}


def maker_command(made_by: str | None) -> str:
    """The command that made (and so repairs) a store, from its ``made_by`` attribute."""
    made_by = str(made_by or "tvrpipe extract")
    return _MAKERS.get(made_by, made_by)


def _again(made_by: str) -> str:
    return f"`{maker_command(made_by)}` again with the same options and --out"


def _damage_message(d: Path, damage: list[Damage], made_by: str) -> str:
    more = f" and {len(damage) - 1} more damaged shard(s)" if len(damage) > 1 else ""
    return (
        f"{d}: the feature store is damaged: {damage[0]}{more}; repair it by running {_again(made_by)}: "
        f"it re-extracts exactly the damaged shards (`tvrpipe features verify {shlex.quote(str(d))}` lists them)"
    )


class StoreWriter:
    """Creates (or resumes, or repairs) a store and writes whole shards with completion markers.

    The writer holds the store's lock (:class:`~tvrpipe.lock.DirLock`) from construction to
    :meth:`close` (or the end of a ``with`` block): a second writer is refused, naming the first.

    Args:
        features_dir: the store's directory.
        videos: the videos sidecar (columns video_id, split, path, and what else the maker records: extract
            adds the clip bounds, and for a collection the file fingerprints), in row order.
        texts: the texts sidecar (caption_id, video_id, video_row, split), in row order.
        provenance: from :func:`make_provenance`; must include frames, max_words, embed_dim.
        video_shard: videos per shard (and per Zarr chunk).
        text_shard: texts per shard.
        overwrite: delete the store in ``features_dir`` (whatever its provenance) and start afresh.
        made_by: the command that makes this store, named in repair messages.
        wait: if another process is writing the store, wait for it (:class:`~tvrpipe.lock.DirLock`)
            instead of raising; what it wrote is then checked like any resumed store's.
        update: a collection's store (provenance ``kind`` ``"collection"``): a collection store in
            ``features_dir`` whose identity differs only in ``manifest_sha256`` is moved to
            ``.previous/`` and becomes :attr:`previous`, the source of unchanged rows (see the module
            docstring), instead of being refused.

    Attributes:
        previous: with ``update``, the store being replaced (:class:`PreviousStore`), else None.

    Raises:
        LockError: another process is writing the store (and not ``wait``).
        StoreError: the directory holds a store with other provenance (and not ``overwrite``), or
            (``update``) a collection store computed in another precision.
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
        made_by: str = "tvrpipe extract",
        wait: bool = False,
        update: bool = False,
    ) -> None:
        self.dir = Path(features_dir)
        self.previous: PreviousStore | None = None
        self.provenance = {**provenance, "made_by": made_by}
        self.made_by = made_by
        self.n_videos, self.n_texts = len(videos), len(texts)
        self._video_row = pd.Series(np.arange(self.n_videos), index=videos["video_id"].to_numpy())
        self._lock = DirLock(self.dir, "--out", wait=wait)
        try:
            # what writers killed mid-write left (a store's group, a sidecar, a search's index): a search
            # writes its index without this lock, so only names of processes that are gone
            remove_staged(self.dir)
            self._open(videos, texts, video_shard, text_shard, overwrite, update)
        except BaseException:
            self._lock.release()
            raise

    def _open(self, videos: pd.DataFrame, texts: pd.DataFrame, video_shard: int, text_shard: int,
              overwrite: bool, update: bool) -> None:
        path = self.dir / STORE_NAME
        if overwrite:
            self._remove(previous=True)
        elif update:
            self._prepare_update()
        if not overwrite and (path / "zarr.json").is_file():
            old = dict(_open_group(path).attrs)
            diff = provenance_mismatch(old, self.provenance)
            if diff:
                raise StoreError(
                    f"{self.dir} holds features made with other settings ({'; '.join(diff)}); "
                    "choose another --out or pass --overwrite to replace them"
                )
        if not (path / "zarr.json").is_file():
            self._create(path, video_shard, text_shard)
        # the sidecars derive from the manifest (whose hash is in the provenance): always rewritten
        atomic_write_parquet(videos.reset_index(drop=True), self.dir / "videos.parquet")
        atomic_write_parquet(texts.reset_index(drop=True), self.dir / "texts.parquet")
        self.root = _open_group(path, mode="a")
        # provenance that a store written by an earlier tvrpipe lacks (e.g. logit_scale): the identity keys
        # matched above, so these describe the same weights; recording them loses nothing
        # (not the versions: those of this process did not make the store's earlier rows)
        # (nor the precision: it describes the rows computed from now on, and the earlier rows' is unknown)
        missing = {k: v for k, v in self.provenance.items()
                   if k not in self.root.attrs and k not in ("versions", "precision")}
        attrs = self.root.attrs
        if not attrs.get("complete"):  # the rows still to come are this process's
            resumed = resumed_versions(attrs.get("versions"), attrs.get("resumed_with"))
            if resumed != attrs.get("resumed_with"):
                missing["resumed_with"] = resumed
        if missing:
            self.root.attrs.update(missing)
        self._layout = _Layout(self.dir, self.root)
        self.video_shard = self.root["videos/frames"].chunks[0]
        self.text_shard = self.root["texts/tokens"].chunks[0]
        for kind in KINDS:
            (self.dir / PROGRESS / kind).mkdir(parents=True, exist_ok=True)
        self._complete = bool(self.root.attrs.get("complete"))
        self._problems: dict[str, dict[Shard, str]] = {}  # CRC-checked state per kind, until a write

    def _remove(self, previous: bool = False) -> None:
        """Delete this store's files (only those: the directory may hold other things); with ``previous``,
        the store an update was replacing too."""
        shutil.rmtree(self.dir / STORE_NAME, ignore_errors=True)
        shutil.rmtree(self.dir / PROGRESS, ignore_errors=True)
        for name in SIDECARS:
            (self.dir / name).unlink(missing_ok=True)
        if previous:
            self._remove_previous()

    def _remove_previous(self) -> None:
        for name in (PREVIOUS, _PREVIOUS_STAGING):
            shutil.rmtree(self.dir / name, ignore_errors=True)
        self.previous = None

    def _updatable(self, attrs: Mapping[str, Any]) -> bool:
        """Whether a store with ``attrs`` is an earlier state of this collection's store: a collection store
        whose identity differs from this one's in ``manifest_sha256`` at most."""
        diff = [k for k in IDENTITY_KEYS if differs(k, attrs, self.provenance)]
        return (attrs.get("kind") == COLLECTION and self.provenance.get("kind") == COLLECTION
                and set(diff) <= {"manifest_sha256"})

    def _check_update_precision(self, attrs: Mapping[str, Any], where: Path) -> None:
        have, want = attrs.get("precision"), self.provenance.get("precision")
        if have is not None and want is not None and have != want:
            raise StoreError(
                f"{where} holds the collection's features computed in {have}, and an update reuses them only in "
                f"the same precision (a store's rows are all computed in one): rerun with --precision {have}, or "
                f"pass --overwrite to extract every video again in {want}")

    def _prepare_update(self) -> None:
        """Before a collection's store is opened: move the store it replaces into ``.previous`` (or keep the one
        an interrupted update left there), and open that as :attr:`previous`."""
        path, prev, staging = self.dir / STORE_NAME, self.dir / PREVIOUS, self.dir / _PREVIOUS_STAGING
        if staging.is_dir():
            if prev.exists():  # not reached by a move (the rename is its last step): a leftover
                shutil.rmtree(staging)
            else:  # a move was interrupted: the store's files are split between here and staging
                self._move_store(staging)
                move_into_place(staging, prev)
        have = dict(_open_group(path).attrs) if (path / "zarr.json").is_file() else None
        if (prev / STORE_NAME / "zarr.json").is_file():
            try:
                source = dict(_open_group(prev / STORE_NAME).attrs)
            except StoreError:
                source = {}
            if not self._updatable(source):
                log.warning("%s: %s holds a store of other settings, or a damaged one; nothing is copied from it, "
                            "and it is deleted once the new store is complete", self.dir, prev)
                return
            self._check_update_precision(source, prev)
            # the partial store an interrupted update left is resumed if made from the same manifest
            if have is not None and self._updatable(have) and provenance_mismatch(have, self.provenance):
                log.info("%s: an interrupted update left a store of another manifest; it is replaced, and the "
                         "videos unchanged since %s are copied from there", self.dir, prev)
                self._remove()
        elif have is not None and self._updatable(have) and provenance_mismatch(have, self.provenance):
            self._check_update_precision(have, self.dir)
            if have.get("video_root") != self.provenance.get("video_root"):  # a moved folder, or another one
                log.warning("%s was extracted from %s and is updated from %s: only the videos with the same "
                            "relative path, size and modification time are copied", self.dir, have.get("video_root"),
                            self.provenance.get("video_root"))
            shutil.rmtree(prev, ignore_errors=True)
            staging.mkdir()
            self._move_store(staging)
            move_into_place(staging, prev)
        else:
            return
        try:
            self.previous = PreviousStore(prev)
        except StoreError as e:  # its arrays' metadata is damaged: every video is encoded again
            log.warning("%s: nothing is copied from %s: %s", self.dir, prev, e)

    def _move_store(self, into: Path) -> None:
        for name in (STORE_NAME, PROGRESS, *SIDECARS):
            if (self.dir / name).exists():
                move_into_place(self.dir / name, into / name)

    def _create(self, path: Path, video_shard: int, text_shard: int) -> None:
        """Build the empty group beside ``path`` and rename it into place: never a half-made store."""
        self._remove()  # stale markers of a store whose group was deleted
        F, L, D = self.provenance["frames"], self.provenance["max_words"], self.provenance["embed_dim"]

        def build(tmp: Path) -> None:
            root = zarr.open_group(tmp, mode="w", zarr_format=3)
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

        atomic_write(path, build)

    def close(self) -> None:
        """Release the store's lock."""
        self._lock.release()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ shards and markers

    def shards(self, kind: str) -> list[Shard]:
        """Every shard of ``kind`` in row order."""
        return self._layout.shards(kind)

    def _checked(self, kind: str) -> dict[Shard, str]:
        if kind not in self._problems:  # reads every written chunk once (CRC-32)
            self._problems[kind] = self._layout.problems(kind, checksums=True)
            for shard, problem in self._problems[kind].items():
                if problem != NOT_WRITTEN:
                    log.warning("%s: re-extracting %s: %s", self.dir, shard, problem)
        return self._problems[kind]

    def recorded(self, key: str) -> Any:
        """The store's attribute ``key`` as recorded (None where absent)."""
        return self.root.attrs.get(key)

    def pending(self, kind: str) -> list[Shard]:
        """Shards of ``kind`` to (re)write: never written, or damaged since (CRC-32 checked).

        Damaged shards are logged with what is wrong; they are re-extracted like new ones.
        """
        return list(self._checked(kind))

    def damaged(self, kind: str) -> list[Damage]:
        """Shards of ``kind`` that were written and are damaged now (CRC-32 checked)."""
        return [Damage(s, p) for s, p in self._checked(kind).items() if p != NOT_WRITTEN]

    def failed_rows(self) -> dict[Shard, np.ndarray]:
        """Rows of the failed videos of each whole video shard (for a retry)."""
        out = {}
        for shard in self.shards("videos"):
            rec = self._layout.read_marker(shard)
            if rec and rec.get("failures") and self._layout.check(shard, checksums=False) is None:
                ids = [f["video_id"] for f in rec["failures"]]
                out[shard] = np.sort(self._video_row.loc[ids].to_numpy())
        return out

    def read_videos(self, shard: Shard) -> dict[str, np.ndarray]:
        """A written video shard's arrays (to rewrite it with some rows replaced)."""
        return {name: self.root[f"videos/{name}"][shard.start : shard.stop] for name in ARRAYS["videos"]}

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
        self._write(shard, {"frames": frames.astype(np.float16), "frame_mask": mask.astype(bool),
                            "timestamps": timestamps.astype(np.float32)}, failures)

    def write_texts(self, shard: Shard, tokens: np.ndarray, mask: np.ndarray, sentence: np.ndarray) -> None:
        """Write one whole text shard, then its marker."""
        self._write(shard, {"tokens": tokens.astype(np.float16), "token_mask": mask.astype(bool),
                            "sentence": sentence.astype(np.float16)}, [])

    def _write(self, shard: Shard, arrays: dict[str, np.ndarray], failures: list[dict[str, str]]) -> None:
        marker = self._layout.marker(shard)
        marker.unlink(missing_ok=True)  # not whole again until its new marker lands
        self._problems.clear()
        if self._complete:
            self.root.attrs["complete"] = False
            self._complete = False
        chunks = {}
        with zarr.config.set({"array.write_empty_chunks": True}):  # a missing chunk is then always damage
            for name, values in arrays.items():
                with writing(self._layout.chunk_path(shard, name)):
                    self.root[f"{shard.kind}/{name}"][shard.start : shard.stop] = values
                data = self._layout.chunk_path(shard, name).read_bytes()
                chunks[name] = {"key": self._layout.chunk_key(shard, name), "bytes": len(data),
                                "crc32": zlib.crc32(data)}
        atomic_write_text(marker, json.dumps({"rows": [shard.start, shard.stop], "failures": failures,
                                               "chunks": chunks}))

    def failures(self) -> pd.DataFrame:
        """Failures recorded in every completed shard's marker."""
        rows: list[dict[str, str]] = []
        for s in self.shards("videos"):
            rec = self._layout.read_marker(s)
            if rec:
                rows += [{k: f[k] for k in ("video_id", "stage", "error")} for f in rec.get("failures", [])]
        return pd.DataFrame(rows, columns=["video_id", "stage", "error"])

    def finalize(self, incomplete_reason: str | None = None) -> pd.DataFrame:
        """After every shard is written: write failures.parquet, mark the store complete, consolidate.

        Args:
            incomplete_reason: if given, the store is left incomplete (not readable) and this is
                what :func:`open_store` says instead (e.g. too many videos failed).
        """
        left = sum(len(self._layout.problems(kind, checksums=False)) for kind in KINDS)
        if left:
            raise StoreError(f"{self.dir}: {left} shards are not complete yet; rerun the extraction to finish")
        failures = self.failures()
        atomic_write_parquet(failures, self.dir / "failures.parquet")
        if incomplete_reason:
            self.root.attrs.update({"complete": False, "incomplete_reason": incomplete_reason})
            self._complete = False
        else:
            self.root.attrs.update({"complete": True, "incomplete_reason": None})
            self._complete = True
            self._remove_previous()  # the new store is whole: the one it replaces is no longer needed
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
    # arrays looked up once: a Zarr group lookup is a round trip through its event loop (~0.4 ms), and a
    # streamed epoch reads five arrays a block
    _arrays: dict[str, zarr.Array] = field(default_factory=dict, repr=False, compare=False)

    def array(self, name: str) -> zarr.Array:
        """One of the arrays, e.g. ``videos/frames``."""
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    @property
    def made_by(self) -> str:
        """The command that made the store (it also repairs it)."""
        return maker_command(self.provenance.get("made_by"))

    def shard_of(self, name: str, row: int) -> Shard:
        """The shard holding ``row`` of the array ``name`` (e.g. ``videos/frames``)."""
        kind = name.split("/")[0]
        a = self.group[name]
        step, n = a.chunks[0], a.shape[0]
        i = row // step
        return Shard(kind, i, i * step, min((i + 1) * step, n))

    def read(self, name: str, rows: np.ndarray, width: int | None = None, check: bool = True) -> np.ndarray:
        """Rows ``rows`` of the array ``name`` (any order, repeats allowed), in that order: read one chunk at a
        time in row order (bounded extra memory, sequential reads); ``width``: only the first ``width`` entries
        of the second dimension (a split's real token columns).

        Raises:
            NonFiniteError: with ``check``, a float row holds a NaN or an infinity (:meth:`check_finite`).
        """
        rows = np.asarray(rows, dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        data = read_rows(self.array(name), ordered, width)
        if check and data.dtype.kind == "f":
            self.check_finite(name, data, ordered)
        if (order == np.arange(len(order))).all():
            return data
        out = np.empty_like(data)
        out[order] = data
        return out

    def blocks(self, name: str, rows: np.ndarray | None = None, chunks: int = 1,
               check: bool = True) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(store rows, values)`` of the array ``name`` in row order, one block per ``chunks`` of the array's
        chunks (its shards): a pass over a split, or the whole array, holding one block in memory at a time.
        ``rows``: the (sorted, unique) rows to read; default every row.

        Raises:
            NonFiniteError: with ``check``, a float row holds a NaN or an infinity.
        """
        array = self.array(name)
        step = array.chunks[0] * chunks
        rows = np.arange(array.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
        if len(rows) and (np.diff(rows) <= 0).any():
            raise ValueError(f"{name}: blocks() reads sorted, unique rows")
        block_of = rows // step
        starts = np.flatnonzero(np.r_[True, block_of[1:] != block_of[:-1]]) if len(rows) else np.array([], int)
        for a, b in zip(starts, np.r_[starts[1:], len(rows)]):
            part = rows[a:b]
            data = read_rows(array, part)
            if check and data.dtype.kind == "f":
                self.check_finite(name, data, part)
            yield part, data

    def check_finite(self, name: str, data: np.ndarray, rows: np.ndarray, block: int = 4096) -> None:
        """Raise :class:`NonFiniteError` naming the store, the first ids and the shard if a row of ``data``
        (store rows ``rows`` of ``name``) holds a NaN or an infinity: the store is damaged."""
        bad = np.concatenate([a + np.flatnonzero(nonfinite_rows(data[a : a + block]))
                              for a in range(0, len(data), block)] or [np.array([], int)])
        if len(bad) == 0:
            return
        where = np.asarray(rows)[bad]
        table = self.videos if name.startswith("videos") else self.texts
        ids = ", ".join(map(str, table.iloc[where[:5], 0])) + (f" (+{len(where) - 5} more)" if len(where) > 5 else "")
        raise NonFiniteError(
            f"{self.dir}: {name} holds NaN or infinite values in {len(where)} rows ({ids}; first: row {where[0]} "
            f"in {self.shard_of(name, int(where[0]))}): the store is damaged. Run `tvrpipe features verify "
            f"{self.dir}`, then repair it by running `{self.made_by}` again with the same options and --out"
        )


def _read_sidecar(path: Path, rows: int, made_by: str, columns: Iterable[str]) -> pd.DataFrame:
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # missing, truncated, not Parquet
        raise StoreError(
            f"{path} is missing or damaged ({type(e).__name__}); run {_again(made_by)} to rewrite it"
        ) from None
    missing = [c for c in columns if c not in df.columns]
    if missing or (rows >= 0 and len(df) != rows):
        raise StoreError(
            f"{path} does not match the store (missing columns {missing}, {len(df)} rows for {rows}); "
            f"run {_again(made_by)} to rewrite it"
        )
    return df


FEATURES_ROOT_ENV = "TVRPIPE_FEATURES"  # where `train-head` without --features looks for stores


def check_not_a_store(out: str | os.PathLike[str], what: str) -> None:
    """Raise :class:`ConfigError` when ``out`` (an ``--out`` for ``what``: "a run", "a sweep") is a feature
    store, whose folder a run or a sweep would otherwise write into."""
    if (Path(out) / STORE_NAME).exists():
        example = "runs/sweep" if what == "a sweep" else "runs/NAME"
        raise ConfigError(f"--out {out} is a feature store; {what} goes into a folder of its own (e.g. {example})")


def find_stores(root: str | os.PathLike[str], depth: int = 3) -> list[Path]:
    """The feature store directories under ``root`` (it included), at most ``depth`` folders down,
    sorted; a store's own folders are not searched.

    Symbolic links to folders are followed (``features/msrvtt -> /scratch/stores/msrvtt`` is found), a
    link back to a folder above it is not walked again, and a store reached by several names is listed
    once: by its real path where that is under ``root``, else by its first name in sorted order.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    names: dict[str, list[Path]] = {}  # real path of a store -> the names it was reached by

    def walk(here: Path, level: int, above: frozenset[str]) -> None:
        real = os.path.realpath(here)
        if real in above:  # a link back to a folder on this path: a cycle
            return
        if (here / STORE_NAME).is_dir():
            names.setdefault(real, []).append(here)
            return
        if level >= depth:
            return
        try:
            children = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:  # unreadable, or a link that broke meanwhile
            return
        for child in children:
            try:
                if child.is_dir():  # follows links; a dangling one is no folder
                    walk(Path(child.path), level + 1, above | {real})
            except OSError:
                continue

    walk(root, 0, frozenset())
    real_root = Path(os.path.realpath(root))
    found = []
    for real, reached in names.items():
        direct = [p for p in reached if Path(real) == real_root / p.relative_to(root)]
        found.append((direct or sorted(reached))[0])
    return sorted(found)


def default_features_dir(dataset: str, model: str, pretrained: str,
                         root: str | os.PathLike[str] | None = None) -> Path:
    """``<features root>/<dataset>-<model>-<pretrained>`` (a checkpoint file by its stem), where the
    features root is ``root``, else ``$TVRPIPE_FEATURES``, else ``features`` (where ``train-head`` looks)."""
    tag = Path(pretrained).stem if os.sep in pretrained or Path(pretrained).suffix else pretrained
    base = Path(root if root is not None else os.environ.get(FEATURES_ROOT_ENV, "features"))
    return base / f"{dataset}-{model}-{tag}"


def default_store(root: str | os.PathLike[str] | None = None) -> Path:
    """The one feature store under ``root`` (default ``$TVRPIPE_FEATURES``, else ``features/``), for a
    command run without ``--features``.

    Raises:
        ConfigError: no store there, or several (each listed).
    """
    root = Path(root if root is not None else os.environ.get(FEATURES_ROOT_ENV, "features"))
    stores = find_stores(root)
    if len(stores) == 1:
        return stores[0]
    if not stores:
        raise ConfigError(f"no feature store under {root}/: pass --features DIR (a store of `tvrpipe extract`), "
                          f"or set {FEATURES_ROOT_ENV} to the folder that holds yours")
    listed = ", ".join(str(s) for s in stores[:10]) + (f" (+{len(stores) - 10} more)" if len(stores) > 10 else "")
    raise ConfigError(f"{len(stores)} feature stores under {root}/: pass --features with one of {listed}")


def store_attributes(features_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The store's attributes (provenance, ``complete``, counts), read without checking the store:
    for describing a store, e.g. in a report, whatever its state.

    Raises:
        StoreError: no store in ``features_dir``, or its metadata cannot be read.
    """
    return dict(_store_group(Path(features_dir)).attrs)


def _check_not_being_written(d: Path) -> None:
    """Raise :class:`LockError` when a writer holds the store's lock (an extract creating, resuming or updating
    it): what a reader finds there meanwhile (no group, an incomplete one, a collection's store moved aside into
    :data:`PREVIOUS`) is a state of that writer's, not a store to repair."""
    holder = lock_holder(d)
    if holder is not None:
        doing = "updated" if update_interrupted(d) else "written"
        raise LockError(f"{d}: the feature store is being {doing} by {holder}; rerun when it finishes")


def _store_group(d: Path) -> zarr.Group:
    path = d / STORE_NAME
    if not (path / "zarr.json").is_file():
        _check_not_being_written(d)
        if update_interrupted(d):
            raise StoreError(f"{d}: an update of the collection's store was interrupted (the store it replaces is "
                             f"kept in {d / PREVIOUS}); finish it by running {_again('tvrpipe extract')}")
        raise StoreError(f"{d}: no feature store here (expected {STORE_NAME}); create one with `tvrpipe extract`")
    return _open_group(path)


def _open_checked(d: Path) -> tuple[zarr.Group, dict[str, Any]]:
    group = _store_group(d)
    prov = dict(group.attrs)
    if prov.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{d}: store schema {prov.get('schema_version')} is not {SCHEMA_VERSION} (this tvrpipe records "
            "chunk checksums); re-extract it with --overwrite"
        )
    return group, prov


def open_store(features_dir: str | os.PathLike[str], expect: Mapping[str, Any] | None = None) -> FeatureStore:
    """Open a complete store; refuse it if damaged or if ``expect`` names provenance it lacks.

    Every shard must have its completion marker and every chunk its recorded size (one ``stat``
    per chunk); checksums are checked by :func:`verify_store`.

    Args:
        features_dir: the directory ``tvrpipe extract --out`` wrote.
        expect: identity keys the caller needs (e.g. a trained head's provenance).

    Raises:
        StoreError: missing, incomplete, damaged, or different provenance; the message says
            how to repair it.
        LockError: missing or incomplete while a writer (an extract) holds its lock; the message names it.
    """
    d = Path(features_dir)
    group, prov = _open_checked(d)
    made_by = str(prov.get("made_by") or "tvrpipe extract")
    if not prov.get("complete"):
        _check_not_being_written(d)
        raise StoreError(
            f"{d}: {prov.get('incomplete_reason')}" if prov.get("incomplete_reason")
            else f"{d}: the extraction has not finished; resume it by running {_again(made_by)}"
        )
    layout = _Layout(d, group)
    damage = [Damage(s, "its completion marker is missing" if p == NOT_WRITTEN else p)
              for kind in KINDS for s, p in layout.problems(kind, checksums=False).items()]
    if damage:
        raise StoreError(_damage_message(d, damage, made_by))
    if expect:
        diff = provenance_mismatch(prov, expect)
        if diff:
            raise StoreError(f"{d}: features were made with other settings ({'; '.join(diff)})")
    return FeatureStore(dir=d, provenance=prov, **_read_sidecars(d, prov, made_by), group=group)


def _read_sidecars(d: Path, prov: dict, made_by: str) -> dict[str, pd.DataFrame]:
    """A complete store's three tables, each checked against its rows (:func:`_read_sidecar`)."""
    return dict(
        videos=_read_sidecar(d / "videos.parquet", int(prov["n_videos"]), made_by, ("video_id", "split")),
        texts=_read_sidecar(d / "texts.parquet", int(prov["n_texts"]), made_by,
                            ("caption_id", "video_id", "video_row", "split")),
        failures=_read_sidecar(d / "failures.parquet", -1, made_by, ("video_id", "stage", "error")),
    )


@dataclass
class VerifyReport:
    """What :func:`verify_store` found.

    Attributes:
        dir: the store.
        complete: whether the extraction finished.
        shards: shards checked (every written one).
        not_written: shards of an unfinished extraction that have not been written yet.
        bytes: chunk bytes read and checksummed.
        seconds: wall time.
        damage: damaged shards, each naming the array, the chunk and the rows.
        nonfinite: for each embedding array, the rows holding NaN or infinite values.
        tables: of a complete store, why its row tables (videos, texts, failures) cannot be read, or None.
    """

    dir: Path
    complete: bool
    shards: int = 0
    not_written: int = 0
    bytes: int = 0
    seconds: float = 0.0
    damage: list[Damage] = field(default_factory=list)
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    made_by: str = "tvrpipe extract"
    tables: str | None = None

    @property
    def ok(self) -> bool:
        """No damage, no non-finite value, and tables that read."""
        return not self.damage and not any(self.nonfinite.values()) and self.tables is None


def verify_store(features_dir: str | os.PathLike[str]) -> VerifyReport:
    """Check every written chunk of a store against its marker (size and CRC-32) and scan the
    embeddings for non-finite values; works on unfinished stores too (unwritten shards are counted).

    Example:
        >>> report = verify_store("features/msrvtt-vitb32")  # doctest: +SKIP
        >>> report.ok, [str(d) for d in report.damage]  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    d = Path(features_dir)
    group, prov = _open_checked(d)
    layout = _Layout(d, group)
    report = VerifyReport(d, complete=bool(prov.get("complete")), made_by=maker_command(prov.get("made_by")))
    for kind in KINDS:
        for shard in layout.shards(kind):
            problem = layout.check(shard, checksums=True, scan=report.nonfinite)
            if problem == NOT_WRITTEN and not report.complete:
                report.not_written += 1
                continue
            report.shards += 1
            if problem is None:
                report.bytes += sum(layout.chunk_path(shard, n).stat().st_size for n in ARRAYS[kind])
            else:
                report.damage.append(Damage(shard, "its completion marker is missing" if problem == NOT_WRITTEN
                                            else problem))
    if report.complete:  # every command reads the row tables first: one that does not read is a broken store
        try:
            _read_sidecars(d, prov, report.made_by)
        except StoreError as e:
            report.tables = str(e)
    report.seconds = time.perf_counter() - t0
    return report
