"""The first stage of a search: every video's pooled CLIP embedding against the query's sentence.

The pooled embedding is the meanpool head's (the L2-normalised mean of the L2-normalised valid frames,
:func:`tvrpipe.features.export.pooled_embeddings`), so the first stage ranks as zero-shot CLIP does. It
is computed once per store and kept beside the features in ``<store>/search-index/``:

    search-index/
      pooled.npy    float32 (n, D), L2-normalised, the videos with a decoded frame (read as a memory map)
      rows.npy      int64 (n,), their rows in the store
      faiss.index   the first stage's own files, where it has any (FirstStageIndex.files)
      index.json    the store it was built from (:func:`store_key`), and which first stage with which settings

A cache whose key is not the store's (the store was extracted again, or grew) is rebuilt on first use;
one whose first stage or build settings are not the ones asked for keeps its pooled embeddings and builds
the index again (the exact stage, which has no files, uses any cache of the store). An index given
explicitly (``--index``, ``tvrpipe export --format faiss``) that was built from another store is refused.

The first stages themselves (exact, FAISS HNSW, FAISS IVF-PQ, ...) are a registry:
:mod:`tvrpipe.search.first_stages`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError, TvrpipeError, WriteError
from tvrpipe.features.store import FeatureStore, store_identity, written_state
from tvrpipe.files import NpyWriter, atomic_replace_folder, atomic_write, remove_staged
from tvrpipe.search.first_stages import (
    FirstStageIndex,
    exportable_first_stages,
    first_stage_class,
    resolve_first_stage,
    stage_config,
)
from tvrpipe.search.first_stages.base import Settings, head_aware_refusal, normalised, stage_settings
from tvrpipe.search.first_stages.exact import exact_top

log = logging.getLogger(__name__)

INDEX_DIR = "search-index"
EXPORTED = "faiss-hnsw"  # what `tvrpipe export --format faiss` writes unless --first-stage names another
LEGACY = "faiss-hnsw"  # an index.json written before the registry, {"faiss": "<FAISS index type>"}, holds one


def store_key(store: FeatureStore) -> str:
    """A hash of what the pooled embeddings depend on: the store's identity (its manifest, weights,
    sampling), its row count and what its video shards hold (:func:`written_state`). A store extracted
    again from another folder state, or whose failed videos were recovered, has another key."""
    ident = {**store_identity(store.provenance), "n_videos": int(store.provenance.get("n_videos", 0)),
             "videos": written_state(store.dir, "videos")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class FirstStage:
    """The pooled embeddings of a store's searchable videos, and the index that takes their top k.

    Attributes:
        pooled: float32 ``(n, D)``, L2-normalised (a memory map where read from a folder); a distilled first
            stage's segment vectors.
        rows: the store row of each (videos without a decoded frame are not searchable).
        index: the first stage (:mod:`tvrpipe.search.first_stages`) over ``pooled``.
    """

    pooled: np.ndarray
    rows: np.ndarray
    index: FirstStageIndex
    record: dict | None = None  # a distilled first stage's: what it was fitted from and what building it cost

    def __len__(self) -> int:
        return len(self.rows)

    def describe(self) -> str:
        """What ranks, in words (the first stage's own :meth:`~FirstStageIndex.describe`)."""
        return self.index.describe()

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best videos of each query by cosine: ``(positions into rows (Q, k), cosines (Q, k))``,
        best first. ``queries``: ``(Q, D)`` sentence embeddings (normalised here)."""
        q = normalised(queries)
        k = min(k, len(self))
        if k < len(self) or self.index.head_aware:  # a distilled index ranks its own vectors, not pooled's
            return self.index.top(q, k)
        return exact_top(self.pooled, q, k)  # every video: their exact order, whichever index

    def top_texts(self, texts: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top` for a TextBatch of queries: a first stage that ranks by their words
        (:meth:`~tvrpipe.search.first_stages.base.FirstStageIndex.top_texts`) takes them, the others their
        sentence embeddings."""
        if self.index.head_aware:
            return self.index.top_texts(texts, min(k, len(self)))
        return self.top(texts.sentence.cpu().numpy(), k)


def searchable_rows(store: FeatureStore) -> np.ndarray:
    """The store rows of the videos with a decoded frame, in order, read from the frame masks alone (a bit per
    frame, not the frames)."""
    parts = [rows[mask.any(axis=1)] for rows, mask in store.blocks("videos/frame_mask")]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def pooled_rows(store: FeatureStore, out: Path | None = None, progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The pooled embeddings of the videos with a decoded frame, and their store rows. With ``out``, the
    embeddings are written there as a ``.npy`` file and returned memory-mapped, so memory holds one block of
    frames whatever the store's size (a million videos' embeddings are 2 GB at D = 512); else in RAM."""
    from tvrpipe.features.export import pooled_embeddings

    d = store.array("videos/frames").shape[2]
    rows = searchable_rows(store)  # first: the output's size
    if out is None:
        return pooled_embeddings(store, which=rows, progress=progress)[0], rows
    with NpyWriter(out, np.float32, (len(rows), d)) as pooled:
        pooled_embeddings(store, which=rows, out=pooled, progress=progress)
    return np.load(out, mmap_mode="r"), rows


def first_stage(store: FeatureStore, kind: str = "auto", cache: bool = True,
                settings: Settings | None = None, progress: bool = False) -> FirstStage:
    """The store's first stage ``kind`` (a registered name, an alias, or ``auto``) with ``settings`` over its
    Config's defaults, from ``<store>/search-index/`` when it was built from this very store (the index too,
    when built by this first stage with these build settings), else computed (and kept there when the folder
    is writable and ``cache``). ``progress``: a bar with the time elapsed while it is built (minutes at a
    million videos).

    Raises:
        ConfigError: no video of the store has a decoded frame; ``kind`` is unknown or its library missing;
            a setting it does not have.
    """
    cls = first_stage_class(resolve_first_stage(kind))
    config = stage_config(cls.name, settings)
    if cls.head_aware:  # built from a run's head: tvrpipe.search.distilled
        raise ConfigError(head_aware_refusal(cls.name))
    want = {"name": cls.name, "settings": cls.build_settings(config)}
    folder = Path(store.dir) / INDEX_DIR
    key = store_key(store)
    meta = _read_meta(folder)
    fresh = meta is not None and meta.get("store_key") == key
    pooled = rows = index = None
    if fresh:
        try:
            pooled, rows = np.load(folder / "pooled.npy", mmap_mode="r"), np.load(folder / "rows.npy")
            if cls.files and recorded_stage(meta) == want and all((folder / f).is_file() for f in cls.files):
                index = cls.load(folder, pooled, config)
        except (OSError, ValueError, RuntimeError) as e:  # truncated or damaged: built again
            log.warning("%s: the search index cannot be read (%s); building it again", folder, e)
            pooled = rows = index = None
    elif meta is not None:
        log.info("%s was built from an earlier state of the store; building it again", folder)
    if cache:  # what a search killed while it kept its index left beside the store
        remove_staged(store.dir, (INDEX_DIR,))
    from tvrpipe.progress import progress_bar

    with progress_bar(elapsed=True, enabled=progress and (index is None or pooled is None), transient=True) as bar:
        bar.add_task(f"building the search index ({cls.name}) of {store.dir}", total=None)
        if (pooled is None or rows is None) and cache:
            kept = _build_in_place(store, folder, key, cls, config)
            if kept is not None:
                return kept
            cache = False  # it could not be kept: built in memory, and not tried again
        if pooled is None or rows is None:
            pooled, rows = pooled_rows(store)
            index = None
        check_searchable(store, rows)
        built = False
        if index is None:
            index = cls.build(pooled, config)
            built = bool(cls.files)  # a first stage without files costs nothing to build, and is not worth a rewrite
    if cache and (not fresh or built):
        if store_key(store) == key:
            _save(folder, key, pooled, rows, index)
        else:  # an extract rewrote shards while they were read: kept, this index would outlive what it read
            log.warning("%s changed while its search index was built (an extract running?); the index is not kept",
                        store.dir)
    return FirstStage(pooled, rows, index)


class _StoreChanged(TvrpipeError):
    """The store's key changed while its index was built from it (a tvrpipe error: :func:`writing` lets it
    through, as it is no failure to write)."""


def finish_kept(tmp: Path, rows: np.ndarray, record: str, meta: Mapping[str, Any], started: float) -> None:
    """Close a kept folder built from a run's head (``search-distilled/``, ``search-encoded/``) under its staged
    name ``tmp``: its videos' store rows (``rows.npy``), then its record ``record`` (what it was built from,
    ``meta``; the seconds since ``started``, a ``time.perf_counter()``; the bytes of its files but the record)."""
    np.save(tmp / "rows.npy", rows)
    done = {**meta, "build_seconds": time.perf_counter() - started,
            "bytes": sum(f.stat().st_size for f in tmp.iterdir())}
    (tmp / record).write_text(json.dumps(done, indent=2) + "\n")


def check_searchable(store: FeatureStore, rows: np.ndarray) -> None:
    if not len(rows):
        raise ConfigError(f"--features {store.dir}: no video has a decoded frame, so there is nothing to search "
                          f"(see {Path(store.dir) / 'failures.parquet'})")


def _build_in_place(store: FeatureStore, folder: Path, key: str, cls: type[FirstStageIndex],
                    config: Any) -> FirstStage | None:
    """Build the whole cache under its staged name, the pooled embeddings written to disk block by block (not
    held in RAM: at a million videos they are 2 GB, and the index is built from the memory map), rename it into
    place and read it back as a search would. None where it cannot be kept (a read-only store, or the store
    changed while it was read): the caller builds it in memory."""
    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        pooled, rows = pooled_rows(store, tmp / "pooled.npy")
        check_searchable(store, rows)
        index = cls.build(pooled, config)
        if store_key(store) != key:
            raise _StoreChanged
        np.save(tmp / "rows.npy", rows)
        index.save(tmp)
        _write_meta(tmp, key, pooled, rows, index)

    try:
        atomic_replace_folder(folder, write)
    except _StoreChanged:  # an extract rewrote shards while they were read: kept, the index would outlive it
        log.warning("%s changed while its search index was built (an extract running?); the index is not kept",
                    store.dir)
        return None
    except (OSError, WriteError) as e:
        log.info("%s: the search index is not kept (%s); it is computed again next time", folder, e)
        return None
    pooled, rows = np.load(folder / "pooled.npy", mmap_mode="r"), np.load(folder / "rows.npy")
    return FirstStage(pooled, rows, cls.load(folder, pooled, config))


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def recorded_stage(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The first stage an index.json records, ``{"name", "settings"}``: a file written before the registry
    records ``"faiss": "<index type>"`` (:data:`LEGACY`, with that first stage's default settings, which it
    was built with) or nothing (exact: None)."""
    stage = meta.get("first_stage")
    if isinstance(stage, dict):
        return stage
    if "faiss" in meta:
        cls = first_stage_class(LEGACY)
        return {"name": cls.name, "settings": cls.build_settings(cls.Config())}
    return None


def write_index_files(folder: Path, key: str, pooled: np.ndarray, rows: np.ndarray, index: FirstStageIndex) -> None:
    """pooled.npy, rows.npy, the first stage's own files and index.json into ``folder`` (which exists)."""
    np.save(folder / "pooled.npy", pooled)
    np.save(folder / "rows.npy", rows)
    index.save(folder)
    _write_meta(folder, key, pooled, rows, index)


def _write_meta(folder: Path, key: str, pooled: np.ndarray, rows: np.ndarray, index: FirstStageIndex) -> None:
    meta = {"store_key": key, "videos": int(len(rows)), "dim": int(pooled.shape[1]),
            "first_stage": {"name": index.name, "settings": index.build_settings(index.config)},
            "describe": index.describe()}
    (folder / "index.json").write_text(json.dumps(meta, indent=2) + "\n")


def _save(folder: Path, key: str, pooled: np.ndarray, rows: np.ndarray, index: FirstStageIndex) -> None:
    """Write the cache under a temporary name and rename it into place; a folder that cannot be written
    (a shared, read-only store) only costs recomputing it next time."""
    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        write_index_files(tmp, key, pooled, rows, index)

    try:
        atomic_replace_folder(folder, write)
    except (OSError, WriteError) as e:
        log.info("%s: the search index is not kept (%s); it is computed again next time", folder, e)


def exported_stage(index_dir: str | os.PathLike[str], store: FeatureStore,
                   settings: Settings | None = None) -> FirstStage:
    """An index written by ``tvrpipe export --format faiss``, checked against ``store``; ``settings`` are its
    first stage's search-time ones (a beam, probes).

    Raises:
        ConfigError: not such an export, its library missing, a build setting given (it is built), or built
            from another store (or another state of this one).
    """
    d = Path(index_dir)
    meta = _read_meta(d)
    stage = recorded_stage(meta) if meta is not None else None
    cls = first_stage_class(stage["name"]) if stage is not None and stage.get("name") else None
    files = ("rows.npy", "pooled.npy", *(cls.files if cls is not None else ()))
    if cls is None or not cls.files or not all((d / f).is_file() for f in files):
        raise ConfigError(f"--index {d}: not an index written by `tvrpipe export --format faiss` "
                          f"(expected index.json, {', '.join(sorted(files[2:]) or ['faiss.index'])}, rows.npy and "
                          "pooled.npy)")
    if meta.get("store_key") != store_key(store):
        raise ConfigError(f"--index {d} was built from another store, or from {store.dir} before it changed; "
                          f"export it again: tvrpipe export --features {shlex.quote(str(store.dir))} --format faiss "
                          f"{'' if cls.name == EXPORTED else f'--first-stage {cls.name} '}--out "
                          f"{shlex.quote(f'{d}.new')}")
    built = sorted(set(stage_settings(cls.name, settings)) - set(cls.search_fields))
    if built:
        raise ConfigError(f"--index {d} is built: {built[0]} is a build setting of {cls.name}; set only "
                          f"{', '.join(cls.search_fields) or 'nothing'} with it, or export it again")
    resolve_first_stage(cls.name)  # its library installed
    try:
        pooled = np.load(d / "pooled.npy", mmap_mode="r")
        return FirstStage(pooled, np.load(d / "rows.npy"), cls.load(d, pooled, stage_config(cls.name, settings)))
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--index {d}: cannot be read ({' '.join(str(e).split())[:200]}); export it again") from None


def export_faiss(features_dir: str | os.PathLike[str], out: str | os.PathLike[str], kind: str = EXPORTED,
                 settings: Settings | None = None, progress: bool = False) -> tuple[Path, int]:
    """Write a new folder ``out`` with the store's first-stage index ``kind`` (:func:`~tvrpipe.search.first_stages.exportable_first_stages`; by default
    FAISS HNSW, an inner product over L2-normalised pooled embeddings) for other tools and for ``tvrpipe search
    --index``: its files (``faiss.index`` for the FAISS ones), ``pooled.npy`` and ``rows.npy`` (the embeddings
    and their store rows), ``videos.csv`` (index position, video_id, split, path), ``provenance.json`` (the
    store's) and ``index.json`` (which state of the store it was built from, and which first stage).
    Written under a temporary name, then renamed; ``progress``: bars while the videos are pooled and the index built.

    Returns:
        ``(out, videos left out for having no decoded frame)``.

    Raises:
        ConfigError: ``kind`` has no files to export or its library is missing, ``out`` exists or lies inside
            the store, or no video has a frame.
    """
    from tvrpipe.features.export import check_new_export
    from tvrpipe.features.store import open_store

    cls = first_stage_class(kind)
    if not cls.files:
        raise ConfigError(f"--first-stage {kind} has no index to export: choose one of {', '.join(exportable_first_stages())}, "
                          "or --format npy for the pooled embeddings alone")
    if not cls.available():
        raise ConfigError(f"--format faiss{'' if cls.name == EXPORTED else f' --first-stage {kind}'} needs "
                          f"{cls.install}")
    config = stage_config(cls.name, settings)
    store = open_store(features_dir)
    out = check_new_export(store, out, "folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    pooled, rows = pooled_rows(store, progress=progress)
    if not len(rows):
        raise ConfigError(f"--features {store.dir}: no video has a decoded frame, so there is nothing to export")
    def write(tmp: Path) -> None:
        from tvrpipe.progress import progress_bar

        tmp.mkdir()
        with progress_bar(elapsed=True, enabled=progress, transient=True) as bar:
            bar.add_task(f"building the {cls.name} index", total=None)
            index = cls.build(pooled, config)
        write_index_files(tmp, store_key(store), pooled, rows, index)
        table = store.videos[["video_id", "split", "path"]].astype(str).iloc[rows].reset_index(drop=True)
        table.assign(row=np.arange(len(table)))[["row", "video_id", "split", "path"]].to_csv(
            tmp / "videos.csv", index=False)
        (tmp / "provenance.json").write_text(json.dumps(store.provenance, default=str))

    atomic_write(out, write)
    return out, int(store.provenance.get("n_videos", len(store.videos))) - len(rows)
