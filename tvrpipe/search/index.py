"""The first stage of a search: every video's pooled CLIP embedding against the query's sentence.

The pooled embedding is the meanpool head's (the L2-normalised mean of the L2-normalised valid frames,
:func:`tvrpipe.features.export.pooled_embeddings`), so the first stage ranks as zero-shot CLIP does. It
is computed once per store and kept beside the features in ``<store>/search-index/``:

    search-index/
      pooled.npy    float32 (n, D), L2-normalised, the videos with a decoded frame
      rows.npy      int64 (n,), their rows in the store
      faiss.index   the FAISS index of pooled.npy (only where faiss-cpu is installed and asked for)
      index.json    the store it was built from (:func:`store_key`) and how

A cache whose key is not the store's (the store was extracted again, or grew) is rebuilt on first use;
an index given explicitly (``--index``, ``tvrpipe export --format faiss``) that was built from another
store is refused.

Two first stages: ``exact`` (a matrix product and a partial sort, in blocks of videos) and ``faiss``
(an inner-product index: exact ``IndexFlatIP`` below :data:`HNSW_FROM` videos, HNSW above it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import FeatureStore, store_identity, written_state
from tvrpipe.files import remove_staged, staged_name
from tvrpipe.search.first_stages.exact import exact_top
from tvrpipe.search.first_stages.faiss_hnsw import build_faiss, faiss_available, faiss_kind

log = logging.getLogger(__name__)

INDEX_DIR = "search-index"
FIRST_STAGES = ("auto", "exact", "faiss")


def store_key(store: FeatureStore) -> str:
    """A hash of what the pooled embeddings depend on: the store's identity (its manifest, weights,
    sampling), its row count and what its video shards hold (:func:`written_state`). A store extracted
    again from another folder state, or whose failed videos were recovered, has another key."""
    ident = {**store_identity(store.provenance), "n_videos": int(store.provenance.get("n_videos", 0)),
             "videos": written_state(store.dir, "videos")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def resolve_first_stage(kind: str) -> str:
    """``auto`` -> ``faiss`` where faiss-cpu is installed, else ``exact``; ``faiss`` without it is an error."""
    if kind not in FIRST_STAGES:
        raise ConfigError(f"--first-stage {kind!r}: choose one of {', '.join(FIRST_STAGES)}")
    if kind == "auto":
        return "faiss" if faiss_available() else "exact"
    if kind == "faiss" and not faiss_available():
        raise ConfigError(f"--first-stage faiss {_NEEDS_FAISS}, or use --first-stage exact")
    return kind


# faiss-cpu is all the `search` extra holds; tvrpipe is installed from a checkout, so the extra is not a name
# pip could fetch
_NEEDS_FAISS = ("needs faiss-cpu (tvrpipe's search extra): pip install faiss-cpu, or in tvrpipe's checkout "
                "pip install -e '.[search]'")


def require_faiss(what: str) -> None:
    """Raise :class:`ConfigError` saying that ``what`` (the option asked for) needs faiss-cpu, unless installed."""
    if not faiss_available():
        raise ConfigError(f"{what} {_NEEDS_FAISS}")


@dataclass
class FirstStage:
    """The pooled embeddings of a store's searchable videos, and how to take their top k.

    Attributes:
        pooled: float32 ``(n, D)``, L2-normalised.
        rows: the store row of each (videos without a decoded frame are not searchable).
        kind: ``exact`` or ``faiss``.
        index: the FAISS index (``kind == "faiss"``).
    """

    pooled: np.ndarray
    rows: np.ndarray
    kind: str = "exact"
    index: Any = None

    def __len__(self) -> int:
        return len(self.rows)

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best videos of each query by cosine: ``(positions into rows (Q, k), cosines (Q, k))``,
        best first. ``queries``: ``(Q, D)`` sentence embeddings (normalised here)."""
        q = np.asarray(queries, np.float32)
        q = q / np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-12)
        k = min(k, len(self))
        if self.kind == "faiss" and k < len(self):
            if hasattr(self.index, "hnsw"):
                self.index.hnsw.efSearch = max(64, k)  # the beam must hold k: efSearch < k truncates
            scores, idx = self.index.search(np.ascontiguousarray(q), k)
            idx = idx.astype(np.int64)
            short = np.flatnonzero((idx < 0).any(1))
            if len(short):  # HNSW found fewer than k (-1 labels; e.g. many identical videos): the exact top k
                idx[short], scores[short] = exact_top(self.pooled, q[short], k)
            return idx, scores
        return exact_top(self.pooled, q, k)


def pooled_rows(store: FeatureStore) -> tuple[np.ndarray, np.ndarray]:
    """The pooled embeddings of the videos with a decoded frame, and their store rows."""
    from tvrpipe.features.export import pooled_embeddings

    emb, has = pooled_embeddings(store)
    rows = np.flatnonzero(has).astype(np.int64)
    return np.ascontiguousarray(emb[rows]), rows


def first_stage(store: FeatureStore, kind: str = "auto", cache: bool = True) -> FirstStage:
    """The store's first stage, from ``<store>/search-index/`` when it was built from this very store,
    else computed (and kept there when the folder is writable and ``cache``).

    Raises:
        ConfigError: no video of the store has a decoded frame; ``kind`` is unknown or needs faiss.
    """
    kind = resolve_first_stage(kind)
    folder = Path(store.dir) / INDEX_DIR
    key = store_key(store)
    meta = _read_meta(folder)
    fresh = meta is not None and meta.get("store_key") == key
    pooled = rows = index = None
    if fresh:
        try:
            pooled, rows = np.load(folder / "pooled.npy"), np.load(folder / "rows.npy")
            if kind == "faiss" and (folder / "faiss.index").is_file():
                import faiss

                index = faiss.read_index(str(folder / "faiss.index"))
        except (OSError, ValueError, RuntimeError) as e:  # truncated or damaged: built again
            log.warning("%s: the search index cannot be read (%s); building it again", folder, e)
            pooled = rows = index = None
    elif meta is not None:
        log.info("%s was built from an earlier state of the store; building it again", folder)
    if pooled is None or rows is None:
        pooled, rows = pooled_rows(store)
        index = None
    if not len(rows):
        raise ConfigError(f"--features {store.dir}: no video has a decoded frame, so there is nothing to search "
                          f"(see {Path(store.dir) / 'failures.parquet'})")
    built = False
    if kind == "faiss" and index is None:
        index, built = build_faiss(pooled), True
    if cache:  # what a search killed while it kept its index left beside the store
        remove_staged(store.dir, (INDEX_DIR,))
    if cache and (not fresh or built):
        if store_key(store) == key:
            _save(folder, key, pooled, rows, index)
        else:  # an extract rewrote shards while they were read: kept, this index would outlive what it read
            log.warning("%s changed while its search index was built (an extract running?); the index is not kept",
                        store.dir)
    return FirstStage(pooled, rows, kind, index)


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def write_index_files(folder: Path, key: str, pooled: np.ndarray, rows: np.ndarray, index) -> None:
    """pooled.npy, rows.npy, faiss.index (when ``index``) and index.json into ``folder`` (which exists)."""
    np.save(folder / "pooled.npy", pooled)
    np.save(folder / "rows.npy", rows)
    meta = {"store_key": key, "videos": int(len(rows)), "dim": int(pooled.shape[1])}
    if index is not None:
        import faiss

        faiss.write_index(index, str(folder / "faiss.index"))
        meta["faiss"] = faiss_kind(index)
    (folder / "index.json").write_text(json.dumps(meta, indent=2) + "\n")


def _save(folder: Path, key: str, pooled: np.ndarray, rows: np.ndarray, index) -> None:
    """Write the cache under a temporary name and rename it into place; a folder that cannot be written
    (a shared, read-only store) only costs recomputing it next time."""
    tmp = folder.with_name(staged_name(INDEX_DIR))
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_index_files(tmp, key, pooled, rows, index)
        old = folder.with_name(staged_name(INDEX_DIR, kind="old"))
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        log.info("%s: the search index is not kept (%s); it is computed again next time", folder, e)
        shutil.rmtree(tmp, ignore_errors=True)


def exported_stage(index_dir: str | os.PathLike[str], store: FeatureStore) -> FirstStage:
    """A FAISS index written by ``tvrpipe export --format faiss``, checked against ``store``.

    Raises:
        ConfigError: not such an export, faiss-cpu missing, or built from another store (or another state
            of this one).
    """
    d = Path(index_dir)
    meta = _read_meta(d)
    if meta is None or not all((d / f).is_file() for f in ("faiss.index", "rows.npy", "pooled.npy")):
        raise ConfigError(f"--index {d}: not an index written by `tvrpipe export --format faiss` "
                          "(expected index.json, faiss.index, rows.npy and pooled.npy)")
    if meta.get("store_key") != store_key(store):
        raise ConfigError(f"--index {d} was built from another store, or from {store.dir} before it changed; "
                          f"export it again: tvrpipe export --features {shlex.quote(str(store.dir))} --format faiss --out "
                          f"{shlex.quote(f'{d}.new')}")
    require_faiss(f"--index {d}")
    import faiss

    try:
        return FirstStage(np.load(d / "pooled.npy"), np.load(d / "rows.npy"), "faiss",
                          faiss.read_index(str(d / "faiss.index")))
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"--index {d}: cannot be read ({' '.join(str(e).split())[:200]}); export it again") from None


def export_faiss(features_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> tuple[Path, int]:
    """Write a new folder ``out`` with the store's FAISS index for other tools and for ``tvrpipe search --index``:
    ``faiss.index`` (inner product over L2-normalised pooled embeddings: :func:`build_faiss`), ``pooled.npy`` and
    ``rows.npy`` (the embeddings and their store rows), ``videos.csv`` (index position, video_id, split, path),
    ``provenance.json`` (the store's) and ``index.json`` (which state of the store it was built from).
    Written under a temporary name, then renamed.

    Returns:
        ``(out, videos left out for having no decoded frame)``.

    Raises:
        ConfigError: faiss-cpu missing, ``out`` exists or lies inside the store, or no video has a frame.
    """
    from tvrpipe.errors import writing
    from tvrpipe.features.export import check_new_export
    from tvrpipe.features.store import open_store

    require_faiss("--format faiss")
    store = open_store(features_dir)
    out = check_new_export(store, out, "folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    pooled, rows = pooled_rows(store)
    if not len(rows):
        raise ConfigError(f"--features {store.dir}: no video has a decoded frame, so there is nothing to export")
    tmp = out.with_name(staged_name(out.name))
    try:
        with writing(out):
            tmp.mkdir()
            write_index_files(tmp, store_key(store), pooled, rows, build_faiss(pooled))
            table = store.videos[["video_id", "split", "path"]].astype(str).iloc[rows].reset_index(drop=True)
            table.assign(row=np.arange(len(table)))[["row", "video_id", "split", "path"]].to_csv(
                tmp / "videos.csv", index=False)
            (tmp / "provenance.json").write_text(json.dumps(store.provenance, default=str))
            os.replace(tmp, out)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
    return out, int(store.provenance.get("n_videos", len(store.videos))) - len(rows)
