"""What an extraction has to do besides decoding and encoding: the rows of the pending shards, the rows a
retried shard keeps, and the rows an update of a collection copies from the store it replaces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.features.store import PreviousStore, Shard


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
