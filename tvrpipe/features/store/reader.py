"""The store's reader: :func:`open_store` checks a complete store as it opens it (provenance, schema, every
shard's marker and chunk sizes, the row tables) and returns a :class:`FeatureStore`."""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import zarr

from tvrpipe.errors import LockError, NonFiniteError
from tvrpipe.features.arrays import nonfinite_rows, read_rows
from tvrpipe.features.store.layout import (
    KINDS,
    NOT_WRITTEN,
    PREVIOUS,
    STORE_NAME,
    Damage,
    Layout,
    Shard,
    StoreError,
    open_group,
    table_problem,
    update_interrupted,
)
from tvrpipe.features.store.provenance import SCHEMA_VERSION, maker_command, provenance_mismatch, run_again
from tvrpipe.lock import lock_holder


def _damage_message(d: Path, damage: list[Damage], made_by: str) -> str:
    more = f" and {len(damage) - 1} more damaged shard(s)" if len(damage) > 1 else ""
    return (
        f"{d}: the feature store is damaged: {damage[0]}{more}; repair it by running {run_again(made_by)}: "
        f"it re-extracts exactly the damaged shards (`tvrpipe features verify {shlex.quote(str(d))}` lists them)"
    )


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
            f"{path} is missing or damaged ({type(e).__name__}); run {run_again(made_by)} to rewrite it"
        ) from None
    missing = [c for c in columns if c not in df.columns]
    if missing or (rows >= 0 and len(df) != rows):
        raise StoreError(
            f"{path} does not match the store (missing columns {missing}, {len(df)} rows for {rows}); "
            f"run {run_again(made_by)} to rewrite it"
        )
    return df


def _check_not_being_written(d: Path) -> None:
    """Raise :class:`LockError` when a writer holds the store's lock (an extract creating, resuming or updating
    it): what a reader finds there meanwhile (no group, an incomplete one, a collection's store moved aside into
    :data:`PREVIOUS`) is a state of that writer's, not a store to repair."""
    holder = lock_holder(d)
    if holder is not None:
        doing = "updated" if update_interrupted(d) else "written"
        raise LockError(f"{d}: the feature store is being {doing} by {holder}; rerun when it finishes")


def store_group(d: Path) -> zarr.Group:
    """The Zarr group of the store in ``d``, unchecked; :class:`StoreError` (or :class:`LockError`) where there
    is none."""
    path = d / STORE_NAME
    if not (path / "zarr.json").is_file():
        _check_not_being_written(d)
        if update_interrupted(d):
            raise StoreError(f"{d}: an update of the collection's store was interrupted (the store it replaces is "
                             f"kept in {d / PREVIOUS}); finish it by running {run_again('tvrpipe extract')}")
        raise StoreError(f"{d}: no feature store here (expected {STORE_NAME}); create one with `tvrpipe extract`")
    return open_group(path)


def open_checked(d: Path) -> tuple[zarr.Group, dict[str, Any]]:
    """The store's group and its attributes, refused where its schema is not this tvrpipe's."""
    group = store_group(d)
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
    group, prov = open_checked(d)
    made_by = str(prov.get("made_by") or "tvrpipe extract")
    if not prov.get("complete"):
        _check_not_being_written(d)
        raise StoreError(
            f"{d}: {prov.get('incomplete_reason')}" if prov.get("incomplete_reason")
            else f"{d}: the extraction has not finished; resume it by running {run_again(made_by)}"
        )
    layout = Layout(d, group)
    damage = [Damage(s, "its completion marker is missing" if p == NOT_WRITTEN else p)
              for kind in KINDS for s, p in layout.problems(kind, checksums=False).items()]
    if damage:
        raise StoreError(_damage_message(d, damage, made_by))
    if expect:
        diff = provenance_mismatch(prov, expect)
        if diff:
            raise StoreError(f"{d}: features were made with other settings ({'; '.join(diff)})")
    return FeatureStore(dir=d, provenance=prov, **read_sidecars(d, prov, made_by), group=group)


def read_sidecars(d: Path, prov: dict, made_by: str) -> dict[str, pd.DataFrame]:
    """A complete store's three tables, each checked against its rows (:func:`_read_sidecar`) and the row tables
    against their contract (:func:`table_problem`).

    Raises:
        StoreError: a table is missing or damaged, naming its file, the row and what is wrong.
    """
    tables = dict(
        videos=_read_sidecar(d / "videos.parquet", int(prov["n_videos"]), made_by, ("video_id", "split")),
        texts=_read_sidecar(d / "texts.parquet", int(prov["n_texts"]), made_by,
                            ("caption_id", "video_id", "video_row", "split")),
        failures=_read_sidecar(d / "failures.parquet", -1, made_by, ("video_id", "stage", "error")),
    )
    problem = table_problem(tables["videos"], tables["texts"])
    if problem is not None:
        name, what = problem
        raise StoreError(f"{d / name} is damaged: {what}; run {run_again(made_by)} to rewrite it")
    return tables
