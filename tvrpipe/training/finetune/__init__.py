"""``tvrpipe finetune``: train a registered head on live CLIP features of decoded frames.

DESIGN.md's full-paper path. ``--end-to-end`` unfreezes both CLIP towers, as the papers finetune
them (CLIP4Clip Sec. 4.1, X-Pool Sec. 4, UATVR Sec. 4.1, DUQ Sec. 4.1, T-MASS Sec. 4.1); without it
CLIP stays frozen and the head trains on live features with training-time frame sampling.

:func:`finetune` reads top to bottom: build the job, dry run, lock, start the run, run the loop here
or launch it on Ray. Each job it calls has its module:

- :mod:`~tvrpipe.training.finetune.config`: the settings (:class:`FinetuneConfig`);
- :mod:`~tvrpipe.training.finetune.job`: the job built from the manifest (:func:`build_job`);
- :mod:`~tvrpipe.training.finetune.dryrun`: what the run will do (``--dry-run``);
- :mod:`~tvrpipe.training.finetune.loop`: the training loop of one process (:func:`run_job`);
- :mod:`~tvrpipe.training.finetune.failures`: videos that fail to decode;
- :mod:`~tvrpipe.training.finetune.export`: the selected CLIP, for ``extract``;
- :mod:`~tvrpipe.training.finetune.launch`: this process or Ray Train workers.

The epoch skeleton it shares with ``train-head`` (selection, checkpoints, resume, run files) is
:mod:`tvrpipe.training.core`, the live model :mod:`tvrpipe.training.live`, a step's gradients
(chunked or not) :mod:`tvrpipe.training.step`.

- **Same head inputs**: the live CLIP yields ``TextBatch`` / ``VideoBatch`` through extraction's
  own functions (:func:`~tvrpipe.features.clip.image_features`, :func:`~tvrpipe.features.clip.text_features`),
  so every registered head trains unchanged and a head never knows whether it reads a store.
- **Data** (:mod:`tvrpipe.training.videodata`): DataLoader workers decode with extraction's
  decoder; random frame offsets within uniform segments in training, segment centres at
  evaluation; an epoch pairs every training caption with its video once (the papers'; or one
  caption per video), no video twice in a batch; a bad video is skipped and counted.
- **Optimisation** (the papers'): AdamW with one learning rate for CLIP and one for the head
  (X-Pool / T-MASS / DUQ: 1e-6 and 1e-5), weight decay 0.2 on weight matrices only (gains, biases,
  embeddings and the logit scale exempt: a choice, the sources differ; docs/training.md), warmup
  over the first 10 % of the steps then cosine decay, gradient norm clipped to 1 (X-Pool), optional
  AMP (fp16 with a gradient scaler, or bf16) and gradient checkpointing.
- **Protocol**: the epoch is selected on validation (the manifest's ``val`` split or carved from
  train exactly as ``train-head`` carves it), test is evaluated once with the selected weights,
  through the same evaluation engine and run-directory layout as ``train-head``.
- **Distributed** (``num_workers`` >= 1): the same loop under Ray Train's ``TorchTrainer`` (DDP).
  The text and video features of every worker are gathered (with gradients) before the head's
  loss, as open_clip's ``gather_with_grad`` does, so every worker computes the loss of the whole
  global batch and one step of N workers x b pairs equals one step of one process with N x b pairs
  (tested). Rank 0 evaluates and writes; the run directory must be on storage every worker reaches.
- **Resume**: a checkpoint (CLIP, head, optimiser, scaler) after every epoch; rerunning the same
  command continues after the last complete epoch.
- **Export** (end-to-end): the selected CLIP is written as ``clip.safetensors``, an open_clip
  state dict that ``tvrpipe extract --pretrained`` loads; the run's head then evaluates on that
  store with ``tvrpipe evaluate`` (the store's weights hash must match the export's).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tvrpipe.errors import ConfigError
from tvrpipe.lock import check_unlocked, locked
from tvrpipe.training.core import check_run_dir, start_run
from tvrpipe.training.finetune.config import EXECUTION, PRECISIONS, RESUMABLE, FinetuneConfig
from tvrpipe.training.finetune.export import CLIP_FILE
from tvrpipe.training.finetune.job import FinetuneJob, build_job
from tvrpipe.training.finetune.launch import NO_GPU, gpu_missing, join_ray, ray_train
from tvrpipe.training.finetune.loop import run_job

__all__ = ["CLIP_FILE", "EXECUTION", "NO_GPU", "PRECISIONS", "FinetuneConfig", "FinetuneJob", "build_job", "finetune",
           "run_job"]


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
