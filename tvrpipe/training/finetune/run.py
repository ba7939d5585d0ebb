"""The finetune driver: build the job, dry run, lock, start the run, run the loop here or launch it on Ray."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tvrpipe.errors import ConfigError
from tvrpipe.lock import check_unlocked, locked
from tvrpipe.training.core import check_run_dir, start_run
from tvrpipe.training.finetune.config import RESUMABLE, FinetuneConfig
from tvrpipe.training.finetune.job import build_job
from tvrpipe.training.finetune.launch import gpu_missing, join_ray, ray_train
from tvrpipe.training.finetune.loop import run_job


def finetune(
    manifest_dir: str | os.PathLike[str],
    video_root: str | os.PathLike[str],
    method: str,
    out_dir: str | os.PathLike[str],
    cfg: FinetuneConfig = FinetuneConfig(),
    overrides: dict[str, Any] | None = None,
    post: tuple[str, ...] = (),
    progress: bool = True,
    recipe: dict[str, Any] | None = None,
    dry_run: bool = False,
    gpu_memory: int | None = None,
) -> dict:
    """Train ``method`` on live CLIP features of decoded videos; select on validation, test once.

    Args:
        manifest_dir: a manifest (``tvrpipe manifest build`` or ``tvrpipe synth``).
        video_root: the folder the manifest's video paths are relative to.
        method: a registered head (``tvrpipe heads``).
        out_dir: the run directory (``train-head``'s layout, plus ``clip.safetensors`` end-to-end);
            rerunning the same command resumes after the last complete epoch.
        cfg: finetuning settings (``end_to_end`` unfreezes CLIP).
        overrides: head config overrides (``--set key=value``); unknown keys fail.
        post: post-processing to report beside raw test metrics (``dsl``, ``qbnorm``).
        progress: show a progress bar.
        recipe: what the run records of the recipe it was trained from (:meth:`Recipe.record`).
        dry_run: check everything a run checks, then return the plan (:func:`~tvrpipe.training.finetune.dryrun.plan_run`) instead of
            training; writes nothing.
        gpu_memory: with ``dry_run``, a GPU's memory in bytes: the plan says whether a worker's step fits it,
            the largest chunk that does, and what else the run needs to fit.

    Returns:
        The run's metrics (also in ``out_dir/metrics.json``), or with ``dry_run`` the plan.

    Example:
        >>> finetune("data/msrvtt/manifest", "data/msrvtt/videos", "xpool", "runs/xpool-e2e",
        ...          FinetuneConfig(end_to_end=True, use_gpu=True, precision="fp16"))  # doctest: +SKIP
    """
    job, pairs, config, bundle = build_job(manifest_dir, video_root, method, out_dir, cfg, overrides, post, progress,
                                           recipe)
    out, missing = Path(out_dir), gpu_missing(job.cfg)
    config = _as_first_recorded(out, config)
    if dry_run:  # every check the run makes before its first write, writing nothing
        from tvrpipe.training.finetune.dryrun import plan_run

        check_unlocked(out, "--out")
        check_run_dir(out, config, ignore=RESUMABLE)
        return plan_run(job, pairs, bundle, config, missing, gpu_memory)
    if missing:
        raise ConfigError(missing)
    del bundle
    if job.cfg.num_workers:
        join_ray(job.cfg)  # the cluster's GPUs and CPUs, counted before the first write
    with locked(out, "--out"):
        start_run(out, config, ignore=RESUMABLE)
        if job.cfg.num_workers == 0:
            return run_job(job, 0, 1, "cuda" if job.cfg.use_gpu else "cpu")
        return ray_train(job)


def _as_first_recorded(out: Path, config: dict) -> dict:
    """``config`` with the ``--pretrained`` that a run in ``out`` recorded before checkpoint paths were recorded
    resolved (the path as given, relative), where that path names the same file from here: such a run
    resumes, and its record stays what it was."""
    from tvrpipe.errors import RunError
    from tvrpipe.features.weights import resolve_pretrained
    from tvrpipe.rundir import CONFIG, read_config

    if not (out / CONFIG).is_file():
        return config
    try:
        section = read_config(out).get("finetune")
    except RunError:  # a damaged config.yaml: check_run_dir says so
        return config
    then = section.get("pretrained") if isinstance(section, dict) else None
    now = config["finetune"]["pretrained"]
    if isinstance(then, str) and then != now and resolve_pretrained(then) == now:
        return {**config, "finetune": {**config["finetune"], "pretrained": then}}
    return config
