"""The failure policy that extract and finetune share: how many of the videos may fail (``--max-failed-fraction``)
and what to say when more did."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class FailureCount:
    """More than ``--max-failed-fraction`` of some videos failed (:func:`over_failure_limit`).

    Attributes:
        kinds: ``[(kind, count)]``, the errors' kinds (the text before their first ``:``), most
            frequent first, then by name.
        text: how many of how many, the percentage and the limit, then the kinds
            (``3 of 16 videos failed (18.8 % > --max-failed-fraction 0.1): missing: 2, empty: 1``).
        accept: the fraction that would accept these failures, rounded up to a percent.
    """

    kinds: list[tuple[str, int]]
    text: str
    accept: float


def over_failure_limit(errors: list[str], total: int, limit: float, what: str = "videos failed") -> FailureCount | None:
    """``errors`` (one per failed video, ``"kind: detail"``) of ``total`` videos against ``--max-failed-fraction``
    ``limit``: None when at most that fraction failed, else what to say. Shared by extract and finetune."""
    n = len(errors)
    if total == 0 or n / total <= limit:  # "more than this fraction"; n <= frac * total rounds (29 of 100)
        return None
    kinds = sorted(Counter(str(e).split(":", 1)[0] for e in errors).items(), key=lambda kv: (-kv[1], kv[0]))
    accept = math.ceil(round(100 * n / total, 9)) / 100  # rounded up: the advised value lets the run pass
    text = (f"{n} of {total} {what} ({100 * n / total:.1f} % > --max-failed-fraction {limit:g}): "
            f"{', '.join(f'{k}: {c}' for k, c in kinds)}")
    return FailureCount(kinds, text, accept)
