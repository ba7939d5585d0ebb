"""The store's writer: creates, resumes, repairs or updates a store and writes whole shards with their
completion markers, under the store's lock."""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import zarr

from tvrpipe.data.manifest import COLLECTION
from tvrpipe.environment import resumed_versions
from tvrpipe.errors import writing
from tvrpipe.features.store.layout import (
    ARRAYS,
    KINDS,
    NOT_WRITTEN,
    PREVIOUS,
    PREVIOUS_STAGING,
    PROGRESS,
    SIDECARS,
    STORE_NAME,
    Damage,
    Layout,
    Shard,
    StoreError,
    open_group,
    table_problem,
)
from tvrpipe.features.store.provenance import IDENTITY_KEYS, differs, provenance_mismatch
from tvrpipe.features.store.update import PreviousStore
from tvrpipe.files import (
    atomic_write,
    atomic_write_parquet,
    atomic_write_text,
    move_into_place,
    remove_staged,
)
from tvrpipe.lock import DirLock

log = logging.getLogger(__name__)


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
        StoreError: ``videos`` and ``texts`` break the tables' contract (:func:`table_problem`); the directory
            holds a store with other provenance (and not ``overwrite``), or
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
        problem = table_problem(videos, texts)
        if problem is not None:  # a store of such tables would be refused by every reader, after the extraction
            raise StoreError(f"{self.dir}: the {problem[0]} to write breaks the store's contract: {problem[1]}")
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
            old = dict(open_group(path).attrs)
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
        self.root = open_group(path, mode="a")
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
        self._layout = Layout(self.dir, self.root)
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
        for name in (PREVIOUS, PREVIOUS_STAGING):
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
        path, prev, staging = self.dir / STORE_NAME, self.dir / PREVIOUS, self.dir / PREVIOUS_STAGING
        if staging.is_dir():
            if prev.exists():  # not reached by a move (the rename is its last step): a leftover
                shutil.rmtree(staging)
            else:  # a move was interrupted: the store's files are split between here and staging
                self._move_store(staging)
                move_into_place(staging, prev)
        have = dict(open_group(path).attrs) if (path / "zarr.json").is_file() else None
        if (prev / STORE_NAME / "zarr.json").is_file():
            try:
                source = dict(open_group(prev / STORE_NAME).attrs)
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
