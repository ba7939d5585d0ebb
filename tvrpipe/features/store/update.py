"""Updating a collection's store (the package docstring, "Updating a collection"): the store it replaces,
set aside in ``.previous``, opened as a source of unchanged rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from tvrpipe.features.store.layout import ARRAYS, STORE_NAME, Layout, open_group

FINGERPRINT = ("video_id", "path", "bytes", "mtime_ns")  # a collection's row is reused when all four are equal


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
        self.group = open_group(self.dir / STORE_NAME)
        layout = Layout(self.dir, self.group)
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
