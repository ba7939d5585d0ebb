"""What an extraction has to do besides decoding and encoding: the rows of the pending shards, the rows a
retried shard keeps, and the rows an update of a collection copies from the store it replaces."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.features.store import PreviousStore, Shard


@dataclass
class Plan:
    """What a run has to do in the store its writer opened, besides what is already there: the pending caption
    shards, and the video shards to decode and encode (all their rows, or only the rows retried or not copied;
    the shard's other rows are kept), or to copy whole from the store an update replaces."""

    jobs: list[tuple[Shard, np.ndarray | None]]  # video shards to decode and encode: every row (None) or these
    texts: list[Shard]  # caption shards to encode
    copied: list[Shard]  # video shards whose every row an update copies from the store it replaces
    copies: dict[int, np.ndarray]  # by shard index: each row's row in that store (-1: to encode)
    retry: dict[Shard, np.ndarray]  # by shard: the rows recorded as failed and tried again
    damaged: int  # damaged shards (videos and texts), re-extracted

    @property
    def reused(self) -> int:
        """Videos copied from the store an update replaces."""
        return sum(int((src >= 0).sum()) for src in self.copies.values())

    @property
    def retried(self) -> int:
        """Videos recorded as failed and tried again."""
        return sum(len(rows) for rows in self.retry.values())

    def kept(self, writer, shard: Shard) -> dict[str, np.ndarray]:
        """The arrays a shard of which only some rows are in :attr:`jobs` starts from: the rows it copies from
        the store an update replaces, or its stored rows (a retried shard)."""
        if shard.index in self.copies:
            return copied_videos(writer.previous, shard, self.copies[shard.index], int(writer.provenance["frames"]),
                                 int(writer.provenance["embed_dim"]))
        return stored_videos(writer, shard)


def plan_run(writer, sidecar: pd.DataFrame, retry_failed: bool) -> Plan:
    """The :class:`Plan` of a run in the store ``writer`` opened (``sidecar``: its videos.parquet, by which an
    update matches the rows of the store it replaces); ``retry_failed``: the videos recorded as failed are
    tried again."""
    damaged = len(writer.damaged("videos")) + len(writer.damaged("texts"))
    v_pending, t_pending = writer.pending("videos"), writer.pending("texts")
    retry = {s: rows for s, rows in writer.failed_rows().items() if s not in set(v_pending)} \
        if retry_failed else {}
    # an update: rows whose file is unchanged are copied from the store it replaces
    copies = copy_sources(writer.previous, sidecar, v_pending)
    whole = [s for s in v_pending if s.index in copies and (copies[s.index] >= 0).all()]
    jobs = [(s, None if s.index not in copies else s.start + np.flatnonzero(copies[s.index] < 0))
            for s in v_pending if s not in whole] + list(retry.items())
    return Plan(jobs, t_pending, whole, copies, retry, damaged)


def progress_display(enabled: bool):
    """The progress bars of one extraction (videos and texts, or the videos an update reuses)."""
    from tvrpipe.progress import progress_bar

    return progress_bar(field="rate", elapsed=True, eta=True, enabled=enabled)


def rows_for(jobs: list[tuple[Shard, np.ndarray | None]], table: pd.DataFrame) -> pd.DataFrame:
    """The table's rows that ``jobs`` (shard, rows to do or None for all) need, with a ``row`` column."""
    idx = [np.arange(s.start, s.stop) if rows is None else rows for s, rows in jobs]
    idx = np.concatenate(idx) if idx else np.array([], int)
    return table.iloc[idx].assign(row=idx)


def video_items(rows: pd.DataFrame, video_root: Path) -> list[dict[str, Any]]:
    """What a decoder takes for each of ``rows`` (:func:`rows_for`): row, path and clip bounds (NaN: none)."""
    return [
        {"row": int(r.row), "path": str(video_root / r.path),
         "start_s": float("nan") if pd.isna(r.start_s) else float(r.start_s),
         "end_s": float("nan") if pd.isna(r.end_s) else float(r.end_s)}
        for r in rows.itertuples()
    ]


def stored_videos(writer, shard: Shard) -> dict[str, np.ndarray]:
    """A retried shard's rows as stored: the rows not retried keep them."""
    old = writer.read_videos(shard)
    return {"emb": old["frames"], "mask": old["frame_mask"], "timestamps": old["timestamps"]}


def copy_sources(previous: PreviousStore | None, sidecar: pd.DataFrame,
                 pending: list[Shard]) -> dict[int, np.ndarray]:
    """For each pending video shard with a row to copy from the store an update replaces: each of its rows'
    row there (-1: to encode)."""
    if previous is None or not pending:
        return {}
    src = previous.match(sidecar)
    out = {}
    for s in pending:
        rows = src[s.start : s.stop]
        if (rows >= 0).any():
            out[s.index] = rows
    return out


def copied_videos(previous: PreviousStore, shard: Shard, src: np.ndarray, F: int, D: int) -> dict[str, np.ndarray]:
    """A shard's rows as copied from the store an update replaces (``src``: each row's row there); the rows
    to encode (-1) hold the padding's values until their features arrive."""
    n = shard.stop - shard.start
    out = {"emb": np.zeros((n, F, D), np.float16), "mask": np.zeros((n, F), bool),
           "timestamps": np.full((n, F), np.nan, np.float32)}
    have = np.flatnonzero(src >= 0)
    if len(have):
        d = previous.read(src[have])
        out["emb"][have], out["mask"][have], out["timestamps"][have] = d["frames"], d["frame_mask"], d["timestamps"]
    return out


def write_copied(writer, shards: list[Shard], copies: dict[int, np.ndarray], progress: bool) -> None:
    """Write the shards whose every row is copied from the store an update replaces (no video decoded)."""
    F, D = int(writer.provenance["frames"]), int(writer.provenance["embed_dim"])
    with progress_display(progress) as bar:
        task = bar.add_task("videos reused", total=sum(s.stop - s.start for s in shards), rate="")
        for s in shards:
            d = copied_videos(writer.previous, s, copies[s.index], F, D)
            writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], [])
            bar.update(task, advance=s.stop - s.start)


MOMENTS_PER_DECODE = 32  # choice: a file's moments decoded from one open, at most this many (their frames are memory)


def decode_groups(items: list[dict[str, Any]], by_file: bool) -> list[list[dict[str, Any]]]:
    """The decoder calls of ``items`` (:func:`video_items`): with ``by_file`` (a collection), the clips of one file
    together, in order of time, up to :data:`MOMENTS_PER_DECODE` a call; every other item (a whole file, and
    every clip of a benchmark) alone, as before."""
    if not by_file:
        return [[item] for item in items]
    groups: dict[str, list[dict[str, Any]]] = {}
    alone = []
    for item in items:
        if np.isnan(item["start_s"]) and np.isnan(item["end_s"]):
            alone.append([item])
        else:
            groups.setdefault(item["path"], []).append(item)
    out = list(alone)
    for group in groups.values():
        group.sort(key=lambda i: (i["start_s"], i["end_s"]))
        out += [group[k : k + MOMENTS_PER_DECODE] for k in range(0, len(group), MOMENTS_PER_DECODE)]
    return out
