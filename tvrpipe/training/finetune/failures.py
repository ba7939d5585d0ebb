"""Videos that fail to decode in a finetune run: counted on every worker, written to ``failures.csv``,
and held against ``--max-failed-fraction`` (before anything is written, for files that are not there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.files import atomic_write_text


def all_failures(new: list[tuple[int, str]], video_ids: np.ndarray, world: int) -> dict[str, str]:
    """The videos that failed to decode in this epoch on any rank: {video id: error} (``new``: this rank's
    (manifest row, error), ``video_ids``: the manifest's ids by row)."""
    mine = {str(video_ids[v]): e for v, e in new}
    if world == 1:
        return mine
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def too_many_failed(failures: dict[str, str], rows: np.ndarray, video_ids: np.ndarray, limit: float, what: str,
                    after: str, listed: Path | None = None) -> str | None:
    """The error when more than ``limit`` (``--max-failed-fraction``) of the videos ``rows`` (row numbers of
    the manifest, whose ids are ``video_ids``) are in ``failures`` ({video id: error}); None otherwise. ``what``
    says what happened to them ("training videos failed to decode"), ``after`` what became of the run;
    ``listed``: the ``failures.csv`` the run writes them to (None: the message names the first few)."""
    from tvrpipe.features.failures import over_failure_limit

    failed = {vid: failures[vid] for vid in (str(video_ids[v]) for v in rows) if vid in failures}
    over = over_failure_limit(list(failed.values()), len(rows), limit, what)
    if over is None:
        return None
    example = min(failed)
    where = (f"the list is in {listed}" if listed else
             "the first: " + ", ".join(sorted(failed)[:5]) + (f" (+{len(failed) - 5} more)" if len(failed) > 5 else ""))
    return (f"{over.text} (e.g. {example}: {failed[example]}); {after} Fix them (check --video-root) and rerun "
            f"the same command, or accept the failures with --max-failed-fraction {over.accept:.2f}; {where}")


def check_files(paths: np.ndarray, video_ids: np.ndarray, splits: dict[str, np.ndarray], root: Path,
                limit: float) -> None:
    """Before anything is written: the videos of each of ``splits`` ({"training": rows, ...}) that are not files
    (``paths``, by manifest row) under the video root ``root`` (a wrong --video-root) count as failed, against
    ``limit`` (--max-failed-fraction).

    Raises:
        ConfigError: more than the fraction of a split is missing.
    """
    for what, rows in splits.items():
        missing = {str(video_ids[v]): f"missing: {paths[v]}" for v in rows if not Path(paths[v]).is_file()}
        message = too_many_failed(missing, rows, video_ids, limit,
                                  f"{what} videos are not files under --video-root {root}", "nothing was written.")
        if message:
            raise ConfigError(message)


def write_failures(failures: dict[str, str], out: Path) -> None:
    lines = ["video_id,error"] + [f"{v},{json.dumps(e)}" for v, e in sorted(failures.items())]
    atomic_write_text(out / "failures.csv", "\n".join(lines) + "\n")
