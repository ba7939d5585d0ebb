"""What a search returns: one :class:`Hit` per (query, rank), and its rows for JSON and CSV."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

HIT_COLUMNS = ("query", "rank", "video_id", "path", "start_s", "end_s", "score", "uncertainty")


@dataclass(frozen=True)
class Hit:
    """One video ranked for one query.

    Attributes:
        query: the query text, as given.
        rank: 1 for the best match.
        video_id: the store's id of the video.
        path: the video's file, relative to the store's video root.
        start_s, end_s: the clip's bounds inside the file in seconds, None for the whole file.
        score: the head's similarity (higher is better; comparable within one query only).
        uncertainty: the head's per-pair uncertainty where it has one (UATVR, DUQ, T-MASS), else None.
        row: the video's row in the store (to read its frames and timestamps).
    """

    query: str
    rank: int
    video_id: str
    path: str
    start_s: float | None
    end_s: float | None
    score: float
    uncertainty: float | None
    row: int

    def record(self) -> dict[str, Any]:
        """The hit's :data:`HIT_COLUMNS`, for ``--json`` and ``--csv`` (None where there is no value)."""
        d = dataclasses.asdict(self)
        return {k: (None if isinstance(d[k], float) and math.isnan(d[k]) else d[k]) for k in HIT_COLUMNS}
