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
        query: the query text, or the picture's path (``--image``), as given.
        rank: 1 for the best match.
        video_id: the store's id of the video.
        path: the video's file, relative to the store's video root.
        start_s, end_s: the clip's bounds inside the file in seconds, None for the whole file.
        score: the head's similarity (higher ranks first; on the head's own scale, comparable within one head:
            :mod:`tvrpipe.search.meanings`).
        uncertainty: the head's per-pair uncertainty where it has one (UATVR, T-MASS, ProTA), else None.
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

    def bounds(self) -> tuple[float | None, float | None]:
        """``(start_s, end_s)`` of the clip, None for a bound it does not have (None or NaN in the store)."""
        start, end = (None if v is None or math.isnan(v) else v for v in (self.start_s, self.end_s))
        return start, end

    def clip(self, digits: int = 1, dash: str = "-", unit: str = "") -> str:
        """The clip's bounds for people (``12.0-15.5``, ``start-15.5``, ``12.0-end``), or ``whole file``."""
        start, end = self.bounds()
        if start is None and end is None:
            return "whole file"
        first = "start" if start is None else f"{start:.{digits}f}{unit}"
        return f"{first}{dash}{'end' if end is None else f'{end:.{digits}f}{unit}'}"

    def record(self) -> dict[str, Any]:
        """The hit's :data:`HIT_COLUMNS`, for ``--json`` and ``--csv`` (None where there is no value)."""
        d = dataclasses.asdict(self)
        return {k: (None if isinstance(d[k], float) and math.isnan(d[k]) else d[k]) for k in HIT_COLUMNS}
