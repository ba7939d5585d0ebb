"""Videos that fail to decode in a finetune run: counted on every worker, written to ``failures.csv``,
and held against ``--max-failed-fraction`` (before anything is written, for files that are not there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.files import atomic_write_text

if TYPE_CHECKING:
    from tvrpipe.training.finetune.job import FinetuneJob


def all_failures(new: list[tuple[int, str]], job: FinetuneJob, world: int) -> dict[str, str]:
    """The videos that failed to decode in this epoch on any rank: {video id: error}."""
    mine = {str(job.video_ids[v]): e for v, e in new}
    if world == 1:
        return mine
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def too_many_failed(failures: dict[str, str], rows: np.ndarray, what: str, job: FinetuneJob, after: str,
                     listed: bool = True) -> str | None:
    """The error when more than ``--max-failed-fraction`` of the videos ``rows`` (row numbers of the
    manifest) are in ``failures`` ({video id: error}); None otherwise. ``what`` says what happened to them
    ("training videos failed to decode"), ``after`` what became of the run; ``listed``: whether the run
    writes them to ``failures.csv`` (else the message names the first few)."""
    from tvrpipe.features.extract import over_failure_limit

    failed = {vid: failures[vid] for vid in (str(job.video_ids[v]) for v in rows) if vid in failures}
    over = over_failure_limit(list(failed.values()), len(rows), job.cfg.max_failed_fraction, what)
    if over is None:
        return None
    example = min(failed)
    where = (f"the list is in {Path(job.out) / 'failures.csv'}" if listed else
             "the first: " + ", ".join(sorted(failed)[:5]) + (f" (+{len(failed) - 5} more)" if len(failed) > 5 else ""))
    return (f"{over.text} (e.g. {example}: {failed[example]}); {after} Fix them (check --video-root) and rerun "
            f"the same command, or accept the failures with --max-failed-fraction {over.accept:.2f}; {where}")


def check_files(job: FinetuneJob, root: Path) -> None:
    """Before anything is written: the training and test videos that are not files under the video root
    (a wrong --video-root) count as failed, against --max-failed-fraction.

    Raises:
        ConfigError: more than the fraction of either is missing.
    """
    for what, rows in (("training", job.train_videos), ("test", job.test[0])):
        missing = {str(job.video_ids[v]): f"missing: {job.table.paths[v]}" for v in rows
                   if not Path(job.table.paths[v]).is_file()}
        message = too_many_failed(missing, rows, f"{what} videos are not files under --video-root {root}", job,
                                   "nothing was written.", listed=False)
        if message:
            raise ConfigError(message)


def write_failures(failures: dict[str, str], out: Path) -> None:
    lines = ["video_id,error"] + [f"{v},{json.dumps(e)}" for v, e in sorted(failures.items())]
    atomic_write_text(out / "failures.csv", "\n".join(lines) + "\n")
