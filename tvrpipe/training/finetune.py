"""``tvrpipe finetune``: train a registered head on live CLIP features of decoded frames.

DESIGN.md's full-paper path. ``--end-to-end`` unfreezes both CLIP towers, as the papers finetune
them (CLIP4Clip Sec. 4.1, X-Pool Sec. 4, UATVR Sec. 4.1, DUQ Sec. 4.1, T-MASS Sec. 4.1); without it
CLIP stays frozen and the head trains on live features with training-time frame sampling.

The loop reads top to bottom: schedule, model and optimiser, resume, data, steps, validation; the
epoch skeleton it shares with ``train-head`` (selection, checkpoints, resume, run files) is
:mod:`tvrpipe.training.core`, the live model :mod:`tvrpipe.training.live`.

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

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from tvrpipe.config import above, at_least, check_fields, one_of, within
from tvrpipe.errors import ConfigError, NonFiniteError, RunError
from tvrpipe.features.decode import check_timeout
from tvrpipe.files import atomic_write_text
from tvrpipe.heads.base import Head, TextBatch, VideoBatch, clip_head_config, head_class
from tvrpipe.lock import check_unlocked, locked
from tvrpipe.rundir import BEST, LAST, load_head, load_optimizer_state, save_head, save_weights
from tvrpipe.training.core import (
    OPTIMIZERS,
    RunLoop,
    Schedule,
    apply_step,
    check_group_lr,
    check_head_inputs,
    check_lr_values,
    check_run_dir,
    group_rates,
    lr_groups,
    make_optimizer,
    seed_step,
    setting_source,
    start_run,
    start_step,
)
from tvrpipe.training.live import LiveModel, pairs_in_step, param_groups
from tvrpipe.training.step import step_gradients
from tvrpipe.training.videodata import (
    EPOCH_PAIRS,
    ClipBatch,
    Collate,
    DecodedClips,
    PlannedBatches,
    TrainPairs,
    VideoTable,
    epoch_plan,
    epoch_steps,
)

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "bf16")
CLIP_FILE = "clip.safetensors"


@dataclass(frozen=True)
class FinetuneConfig:
    """``tvrpipe finetune`` settings; defaults are the papers' end-to-end settings."""

    end_to_end: bool = False  # False: CLIP frozen, the head trains on live features
    model: str = "ViT-B-32"  # the papers' backbone (CLIP ViT-B/32)
    pretrained: str = "openai"  # open_clip tag, a local checkpoint, or "none" (seeded random)
    epochs: int = at_least(0, 5, option="--epochs")  # X-Pool / T-MASS / DUQ: 5 epochs on MSR-VTT
    # an epoch: every training caption once (the papers'), or "videos": one per video
    epoch_pairs: str = one_of(EPOCH_PAIRS, "captions", option="--epoch-pairs")
    # X-Pool / T-MASS Sec. 4: batch 32 (the global batch, over all workers)
    batch_size: int = at_least(2, 32, option="--batch-size")
    frames: int | None = at_least(1, None, option="--frames")  # None: the manifest's (12 for MSR-VTT, X-Pool Sec. 4)
    max_words: int | None = at_least(2, None, option="--max-words")  # None: the manifest's (32 for MSR-VTT)
    # X-Pool / T-MASS: AdamW; UATVR Sec. 4.1: Adam (weight decay as an L2 term of the gradient)
    optimizer: str = one_of(OPTIMIZERS, "adamw", option="--optimizer")
    clip_lr: float = at_least(0, 1e-6, option="--clip-lr")  # X-Pool / T-MASS / DUQ: CLIP lr 1e-6
    head_lr: float = at_least(0, 1e-5, option="--head-lr")  # X-Pool / T-MASS / DUQ: lr 1e-5 for the non-CLIP parameters
    # a learning rate of its own for a group of the head's parameters (Head.param_groups), e.g.
    # {"radius": 3e-5} for T-MASS (Sec. 4.1); the head's other groups train at head_lr
    group_lr: dict[str, float] = field(default_factory=dict, metadata={"option": "--group-lr"})
    weight_decay: float = at_least(0, 0.2, option="--weight-decay")  # X-Pool Sec. 4 / CLIP4Clip: AdamW weight decay 0.2
    warmup_fraction: float = within(0.0, 1.0, 0.1)  # CLIP4Clip / X-Pool: warmup proportion 0.1, then cosine
    grad_clip: float = at_least(0, 1.0, option="--grad-clip", why="0: no clipping")  # X-Pool / T-MASS: clip_grad_norm_ 1.0
    # fp16 (GPU) / bf16: autocast of the CLIP towers; heads run in fp32
    precision: str = one_of(PRECISIONS, "fp32", option="--precision")
    grad_checkpointing: bool = False  # open_clip's activation checkpointing of the towers
    # pairs CLIP encodes at a time on each worker (training.step: the whole batch's gradient, less memory);
    # None: the worker's batch at once
    chunk_size: int | None = at_least(1, None, option="--chunk-size")
    # CLIP4Clip / ProTA Supp. B / UATVR (via CLIP4Clip): the head's temporal transformer starts from CLIP's
    # text transformer (Head.init_from_clip); off: the head's own initialisation
    init_from_clip: bool = False
    num_workers: int = at_least(0, 0, option="--num-workers")  # 0: this process; N >= 1: Ray Train workers (DDP)
    use_gpu: bool = False  # one GPU per worker (or this process)
    address: str | None = None  # Ray cluster to join; None: RAY_ADDRESS or a local instance
    # Ray Train workers' CPUs; None: all local CPUs split evenly
    cpus_per_worker: int | None = at_least(1, None, option="--cpus-per-worker")
    # DataLoader decode processes per worker; None: its CPUs
    loader_workers: int | None = at_least(0, None, option="--loader-workers")
    seed: int = 0
    eval_batch: int = at_least(1, 32, option="--eval-batch")  # videos per encoder call at evaluation
    block_texts: int = at_least(1, 256)  # texts per similarity block at evaluation
    # per-video decode wall clock (an infinity is refused by the maximum below, with its own message)
    timeout_s: float = above(0, 60.0, option="--timeout", infinite=True)
    # choice: as extract's; more failed training or test videos stop the run
    max_failed_fraction: float = within(0.0, 1.0, 0.1, option="--max-failed-fraction")
    max_steps: int | None = at_least(1, None, option="--max-steps")  # cap on steps per epoch (benchmarks, tests)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option (every field's declared range, then
        the options that go together); reads and creates nothing. A FinetuneConfig that exists has passed it."""
        check_fields(self, "finetune")
        check_lr_values(self.group_lr)
        check_timeout(self.timeout_s)
        if self.precision == "fp16" and not self.use_gpu:
            raise ConfigError("--precision fp16 needs --use-gpu (CPU autocast supports bf16: use --precision bf16)")
        world = max(1, self.num_workers)
        if self.batch_size % world:
            raise ConfigError(f"--batch-size {self.batch_size} is the global batch: it must be divisible by "
                              f"--num-workers {self.num_workers}")


@dataclass(frozen=True)
class _Job:
    """Everything a training process needs, picklable (Ray Train ships it to every worker)."""

    out: str
    method: str
    head_cfg: Any
    cfg: FinetuneConfig
    table: VideoTable
    frames: int
    max_words: int
    train_videos: np.ndarray
    train_texts: np.ndarray
    text_video: np.ndarray  # (n_captions,) video row of every caption
    val: tuple[np.ndarray, np.ndarray]  # (video rows, caption rows)
    test: tuple[np.ndarray, np.ndarray]
    video_ids: np.ndarray
    caption_ids: np.ndarray
    val_source: str
    post: tuple[str, ...]
    progress: bool
    lr_groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # {group: {lr, source}}, what metrics.json records


# ----------------------------------------------------------------------------- evaluation


def _encode_split(model: LiveModel, loader_for, videos: np.ndarray, captions: np.ndarray, job: _Job,
                  failures: dict[str, str]) -> tuple[list[TextBatch], list[VideoBatch]]:
    """The split's TextBatches and VideoBatches from the live CLIP in eval mode, on the CPU."""
    model.eval()
    vb: list[VideoBatch] = []
    with torch.no_grad():
        for batch in loader_for([[(int(v), -1, -1) for v in videos[i: i + job.cfg.eval_batch]]
                                 for i in range(0, len(videos), job.cfg.eval_batch)]):
            failures.update({str(job.video_ids[v]): e for v, e in batch.failed})
            v = model.encode_videos(batch.frames, batch.frame_mask)
            vb.append(VideoBatch(v.frames.cpu(), v.frame_mask.cpu()))
        tb: list[TextBatch] = []
        for i in range(0, len(captions), 256):
            t = model.encode_texts([str(x) for x in job.table.texts[captions[i: i + 256]]], job.max_words)
            tb.append(TextBatch(t.tokens.cpu(), t.token_mask.cpu(), t.sentence.cpu()))
    return tb, vb


def _evaluate(model: LiveModel, loader_for, split: tuple[np.ndarray, np.ndarray], job: _Job,
              failures: dict[str, str], post: tuple[str, ...] = (), readouts: bool = True) -> dict:
    from tvrpipe.evaluation.engine import evaluate_head

    videos, captions = split
    key = (videos.tobytes(), captions.tobytes())
    encoded = None if model.end_to_end else model.frozen_features.get(key)
    if encoded is None:
        encoded = _encode_split(model, loader_for, videos, captions, job, failures)
        if not model.end_to_end:  # a frozen CLIP encodes a split the same way every epoch: decode it once
            model.frozen_features[key] = encoded
    tb, vb = encoded
    column = {int(v): i for i, v in enumerate(videos)}
    text_video = np.array([column[int(v)] for v in job.text_video[captions]], np.int64)
    querybank = None
    if "qbnorm" in post:  # training captions, encoded by the same CLIP
        querybank, _ = _encode_split(model, loader_for, videos[:0], job.train_texts, job, failures)
    dev = model._bundle.device
    return evaluate_head(model.head, (b.to(dev) for b in tb), (b.to(dev) for b in vb), text_video,
                         block_texts=job.cfg.block_texts, device=dev, post=post,
                         querybank=None if querybank is None else (b.to(dev) for b in querybank),
                         text_ids=job.caption_ids[captions], video_ids=job.video_ids[videos], readouts=readouts)


# ----------------------------------------------------------------------------- the loop


def _loader(dataset: DecodedClips, sampler: PlannedBatches, collate: Collate, workers: int):
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                      persistent_workers=workers > 0, prefetch_factor=2 if workers else None)


def _save_clip(model: nn.Module, path: Path, meta: dict[str, str]) -> str:
    """An open_clip state dict in safetensors (what ``extract --pretrained`` loads); its sha256."""
    return save_weights(model.state_dict(), path, meta, "CLIP")


def run_job(job: _Job, rank: int = 0, world: int = 1, device: str | torch.device = "cpu",
            cpus: int | None = None) -> dict | None:
    """The training loop of one process (rank ``rank`` of ``world``, ``cpus`` CPUs: default all this
    process may use); rank 0 returns the metrics."""
    cfg, out = job.cfg, Path(job.out)
    pairs = _train_pairs(job)
    steps_per_epoch = _steps_per_epoch(pairs, cfg)
    schedule = Schedule.fixed(steps_per_epoch, cfg.epochs, cfg.warmup_fraction)

    # ---- model, optimiser
    model = _live_model(job, device)
    bundle, head = model._bundle, model.head
    groups = param_groups(model, cfg.clip_lr, cfg.head_lr, cfg.weight_decay, cfg.group_lr)
    opt = make_optimizer(cfg.optimizer, groups)
    scaler = torch.amp.GradScaler(bundle.device.type, enabled=cfg.precision == "fp16")
    loop = RunLoop(out, schedule, {"clip_": lambda path: _save_clip(model.clip, path, {"model": cfg.model}),
                                   "": lambda path: save_head(head, path)}, rank, world)
    failures: dict[str, str] = {}  # video id -> error, every video that failed to decode

    def restore(state: dict) -> None:
        from safetensors.torch import load_file

        model.clip.load_state_dict(load_file(str(loop.checkpoints.folder / f"clip_{LAST}")))
        head.load_state_dict(load_head(loop.checkpoints.folder / LAST).state_dict())
        if opt and state["optimizer"]:
            load_optimizer_state(opt, state["optimizer"], out)
        if state["scaler"]:  # fp16 runs only: a disabled scaler's state is empty
            scaler.load_state_dict(state["scaler"])
        failures.update(state["failures"])
    loop.resume(restore, barrier=lambda: _barrier(world))
    if rank == 0 and failures:
        _write_failures(failures, out)
    wrapped = _distributed(model, world)  # DDP over Ray Train's workers (the model itself with one)

    # ---- data: DataLoader workers decode; an epoch's batches are planned from (seed, epoch)
    train_sampler, train_loader, loader_for = _loaders(job, bundle.image_size, cpus)
    id_row = {str(v): i for i, v in enumerate(job.video_ids)}

    # ---- loop
    with loop.progress(f"finetune {job.method}", enabled=job.progress and world == 1):
        for epoch in loop.epochs():
            model.train()
            if not cfg.end_to_end:
                model.clip.eval()  # frozen: CLIP stays in inference mode
            skip = frozenset(id_row[v] for v in failures if v in id_row)
            train_sampler.plan = epoch_plan(pairs, cfg.seed, epoch, cfg.batch_size, rank, world, skip, cfg.max_steps,
                                            cfg.epoch_pairs)
            new_failed = []
            timing = []  # (seconds waiting for the batch, seconds of the step, clips) per step
            t0 = time.perf_counter()
            for step, batch in enumerate(train_loader):
                batch: ClipBatch
                t1 = time.perf_counter()
                new_failed += batch.failed
                if pairs_in_step(len(batch.videos), world, bundle.device) == 0:  # no video of the step decoded
                    loop.advance(f"epoch {epoch + 1}/{cfg.epochs}: a step whose videos all failed to decode, skipped")
                    t0 = time.perf_counter()
                    continue
                # the head's own noise (sampling heads) is the same on every rank and after a resume
                seed_step(cfg.seed, epoch, step)

                def check(loss: torch.Tensor) -> None:
                    if not torch.isfinite(loss.detach()):
                        vids = ", ".join(str(job.video_ids[v]) for v in batch.videos[:5])
                        raise NonFiniteError(f"epoch {epoch + 1} step {step + 1}: the loss is {float(loss)} on the "
                                             f"batch of videos {vids}; lower --clip-lr / --head-lr and train into a "
                                             "new --out")
                if opt is not None:
                    start_step(opt, loop.lr(epoch, step))
                total_loss, loss_terms = step_gradients(model, wrapped, batch.frames, batch.frame_mask, batch.texts,
                                                        job.max_words, cfg.chunk_size, scaler, opt is not None, check)
                if opt is not None:
                    apply_step(opt, scaler, cfg.grad_clip)
                if bundle.device.type == "cuda":
                    torch.cuda.synchronize(bundle.device)
                t2 = time.perf_counter()
                timing.append((t1 - t0, t2 - t1, len(batch.videos) * world))
                loss = loop.record(total_loss, loss_terms)
                info = f"epoch {epoch + 1}/{cfg.epochs} loss {loss:.3f} {len(batch.videos) * world / (t2 - t0):.1f} clips/s"
                loop.advance(info)
                if world > 1 and rank == 0:  # the driver shows Ray workers' progress from this file
                    _report_progress(out, (epoch - loop.start_epoch) * steps_per_epoch + step + 1,
                                     steps_per_epoch * (cfg.epochs - loop.start_epoch), info)
                t0 = time.perf_counter()
            failures.update(_all_failures(new_failed, job, world))
            if rank == 0:
                loop.end_epoch(epoch, _evaluate(model, loader_for, job.val, job, failures), {
                    **group_rates(opt),  # the rate each parameter group stepped at last
                    **_throughput(timing), "failed_videos": len(failures),
                }, {"failures": failures, "optimizer": opt.state_dict() if opt else None, "scaler": scaler.state_dict()})
                if failures:
                    _write_failures(failures, out)
            _barrier(world)
            message = _too_many_failed(failures, job.train_videos, "training videos failed to decode", job,
                                       f"training stopped after epoch {epoch + 1}, which is kept.")
            if message:
                raise RunError(message)
    if rank != 0:
        return None
    return _finish(model, loop, loader_for, job, failures)


PROGRESS_FILE = ".progress.json"


def _live_model(job: _Job, device: str | torch.device, bundle=None, precision: str | None = None) -> LiveModel:
    """CLIP (loaded on ``device``, or ``bundle`` where given) and the head; the same seed on every rank
    gives the same weights (DDP broadcasts rank 0's anyway). CLIP trains only end-to-end. ``precision``:
    the autocast to use instead of the run's."""
    from tvrpipe.features.clip import load_clip

    cfg = job.cfg
    torch.manual_seed(cfg.seed)
    if bundle is None:
        bundle = load_clip(cfg.model, cfg.pretrained, device=device, seed=cfg.seed)
    head = head_class(job.method)(job.head_cfg)
    if cfg.init_from_clip:
        copied = head.init_from_clip(bundle.model)
        log.info("%s from CLIP's text transformer: %s", job.method,
                 ", ".join(copied) or f"nothing ({copied.reason})")
    model = LiveModel(bundle, head.to(bundle.device), cfg.end_to_end, precision or cfg.precision)
    model.clip.requires_grad_(cfg.end_to_end)
    if cfg.grad_checkpointing:
        model.clip.set_grad_checkpointing(True)
    return model


def _distributed(model: LiveModel, world: int) -> nn.Module:
    """``model`` under DistributedDataParallel when there are several workers."""
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = model._bundle.device
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)


def _loaders(job: _Job, image_size: int, cpus: int | None):
    """The training batches (a sampler whose plan is set each epoch, and its DataLoader) and
    ``loader_for(plan)``, which decodes evaluation batches; both decode in ``loader_workers`` processes."""
    cfg, F = job.cfg, job.frames
    dataset = DecodedClips(job.table, F, image_size, cfg.seed, cfg.timeout_s)
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = cfg.loader_workers if cfg.loader_workers is not None else min(8, cpus)
    train_sampler, eval_sampler = PlannedBatches(), PlannedBatches()
    train_loader = _loader(dataset, train_sampler, Collate(F, image_size, keep_failed=False), workers)
    eval_loader = _loader(dataset, eval_sampler, Collate(F, image_size, keep_failed=True), workers)

    def loader_for(plan):
        eval_sampler.plan = plan
        return iter(eval_loader)
    return train_sampler, train_loader, loader_for


def _train_pairs(job: _Job, recipe: dict[str, Any] | None = None) -> TrainPairs:
    """The (video, caption) pairs an epoch draws from.

    Raises:
        ConfigError: the batch exceeds the training videos (a batch holds no video twice), naming where the
            batch came from: ``--batch-size``, or the ``recipe`` the run records.
    """
    cfg = job.cfg
    pairs = TrainPairs.build(job.train_videos, job.train_texts, job.text_video[job.train_texts])
    if (cfg.batch_size > len(pairs.videos) or epoch_steps(pairs, cfg.batch_size, cfg.epoch_pairs) == 0) \
            and cfg.epochs > 0:
        given = setting_source("batch_size", recipe, "--batch-size")
        what = ("--batch-size" if given == "--batch-size" else
                f"{given}'s batch_size")  # a recipe's: the user never typed --batch-size
        where, how = ("", "") if given == "--batch-size" else (f" ({recipe['path']})", " with --batch-size")
        raise ConfigError(f"{what} {cfg.batch_size}{where} exceeds the {len(pairs.videos)} training videos; "
                          f"lower it{how}")
    return pairs


def _steps_per_epoch(pairs: TrainPairs, cfg: FinetuneConfig) -> int:
    """Optimizer steps an epoch of ``pairs`` takes (at most ``max_steps``)."""
    steps = epoch_steps(pairs, cfg.batch_size, cfg.epoch_pairs)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def _report_progress(out: Path, done: int, total: int, info: str, every_s: float = 1.0) -> None:
    """Rank 0 of a Ray Train run writes its progress for the driver's bar (at most every ``every_s``)."""
    now = time.monotonic()
    if done < total and now - getattr(_report_progress, "last", 0.0) < every_s:
        return
    _report_progress.last = now
    atomic_write_text(out / PROGRESS_FILE, json.dumps({"done": done, "total": total, "info": info}))


def _throughput(timing: list[tuple[float, float, int]]) -> dict[str, float]:
    """clips/s and the share of step time spent waiting for data, over the epoch and in steady state
    (without the first step, which waits for the DataLoader workers to start)."""
    out = {}
    for suffix, part in (("", timing), ("_steady", timing[1:])):
        wait, step, clips = (sum(t[i] for t in part) for i in range(3))
        out[f"clips_per_s{suffix}"] = clips / max(wait + step, 1e-9)
        out[f"data_share{suffix}"] = wait / max(wait + step, 1e-9)
    return out


def _all_failures(new: list[tuple[int, str]], job: _Job, world: int) -> dict[str, str]:
    """The videos that failed to decode in this epoch on any rank: {video id: error}."""
    mine = {str(job.video_ids[v]): e for v, e in new}
    if world == 1:
        return mine
    import torch.distributed as dist

    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _too_many_failed(failures: dict[str, str], rows: np.ndarray, what: str, job: _Job, after: str,
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


def _check_files(job: _Job, root: Path) -> None:
    """Before anything is written: the training and test videos that are not files under the video root
    (a wrong --video-root) count as failed, against --max-failed-fraction.

    Raises:
        ConfigError: more than the fraction of either is missing.
    """
    for what, rows in (("training", job.train_videos), ("test", job.test[0])):
        missing = {str(job.video_ids[v]): f"missing: {job.table.paths[v]}" for v in rows
                   if not Path(job.table.paths[v]).is_file()}
        message = _too_many_failed(missing, rows, f"{what} videos are not files under --video-root {root}", job,
                                   "nothing was written.", listed=False)
        if message:
            raise ConfigError(message)


def _write_failures(failures: dict[str, str], out: Path) -> None:
    lines = ["video_id,error"] + [f"{v},{json.dumps(e)}" for v, e in sorted(failures.items())]
    atomic_write_text(out / "failures.csv", "\n".join(lines) + "\n")


def _finish(model: LiveModel, loop: RunLoop, loader_for, job: _Job, failures: dict[str, str]) -> dict:
    """Rank 0: test evaluation of the selected epoch, export, metrics.json and plots."""
    from safetensors.torch import load_file

    from tvrpipe.features.clip import state_dict_sha256

    cfg, out, folder = job.cfg, Path(job.out), loop.checkpoints.folder
    loop.selected(lambda: _evaluate(model, loader_for, job.val, job, failures))
    model.clip.load_state_dict(load_file(str(folder / f"clip_{BEST}")))
    model.head.load_state_dict(load_head(folder / BEST).state_dict())
    test = _evaluate(model, loader_for, job.test, job, failures, post=job.post)
    message = _too_many_failed(failures, job.test[0], "test videos failed to decode", job,
                               "no test metrics were written (the training is kept).")
    if message:
        if failures:
            _write_failures(failures, out)
        raise RunError(message)
    if cfg.end_to_end:
        _adopt_head_scale(model.clip, model.head)
    provenance = {"weights_sha256": state_dict_sha256(model.clip), "model": _extract_model_name(model._bundle)}
    export = None
    if cfg.end_to_end:
        name = provenance["model"]
        _save_clip(model.clip, out / CLIP_FILE, {"model": name, "source": f"tvrpipe finetune --method {job.method}"})
        export = {"file": CLIP_FILE, "model": name, "weights_sha256": provenance["weights_sha256"],
                  "extract": f"tvrpipe extract --model {name} --pretrained {out / CLIP_FILE}"}
    if failures:
        _write_failures(failures, out)
    rows = loop.rows
    return loop.write_results(job.method, job.val_source, test, {
        "provenance": provenance, "export": export, "failed_videos": len(failures), "lr_groups": job.lr_groups,
        "train": {"clips_per_s": float(np.mean([r["clips_per_s"] for r in rows])) if rows else None,
                  "data_share": float(np.mean([r["data_share"] for r in rows])) if rows else None,
                  "epochs_run": len(rows)}})


def _adopt_head_scale(clip: nn.Module, head: Head) -> None:
    """Give the exported CLIP the logit scale its head learned (clamped at 100, as CLIP clamps its own).

    In the papers' code head and CLIP share one scale, ``clip.logit_scale``; here the head owns it and
    starts from CLIP's (:func:`clip_head_config`), so the export carries it back: ``extract`` records it
    in the store and every head trained on that store starts from it.
    """
    scale = getattr(clip, "logit_scale", None)
    if isinstance(scale, torch.Tensor):
        with torch.no_grad():
            scale.copy_(head.logit_scale.detach().clamp(max=math.log(100.0)).to(scale).reshape(scale.shape))


def _extract_model_name(bundle) -> str:
    """The architecture name that rebuilds these weights in ``extract``: a QuickGELU model loaded from a
    tag (ViT-B-32 ``openai``) needs its ``-quickgelu`` name once the weights are a plain checkpoint."""
    return f"{bundle.model_name}-quickgelu" if bundle.quick_gelu_forced else bundle.model_name


# ----------------------------------------------------------------------------- driver

# Settings that decide how a run executes, not what it computes: a rerun may change them and resume.
_EXECUTION = ("num_workers", "use_gpu", "address", "cpus_per_worker", "loader_workers", "chunk_size", "eval_batch",
              "timeout_s", "max_failed_fraction")
_RESUMABLE = ("execution",)  # the config.yaml sections a resumed run may change (how and where it runs)
NO_GPU = "--use-gpu: no CUDA device is available here; leave it out to train on the CPU"


def _probe_head(method: str, head_cfg: Any, cfg: FinetuneConfig, bundle, recipe: dict[str, Any] | None):
    """Before anything is written, on a throwaway head (the run's random stream untouched): the rate each
    parameter group will train at (:func:`~tvrpipe.training.core.lr_groups`; CLIP's only end-to-end) and,
    with ``init_from_clip``, what the head copies from the run's CLIP (None without it).

    Raises:
        ConfigError: ``group_lr`` names a group the head does not have.
    """
    with torch.random.fork_rng(devices=[]):
        head = head_class(method)(head_cfg)
        groups = check_group_lr(head, cfg.group_lr)
        copied = head.init_from_clip(bundle.model) if cfg.init_from_clip else None
        D, F, L = bundle.embed_dim, cfg.frames, cfg.max_words  # two pairs of the run's shapes
        check_head_inputs(head, TextBatch(torch.randn(2, L, D), torch.ones(2, L, dtype=torch.bool), torch.randn(2, D)),
                          VideoBatch(torch.randn(2, F, D), torch.ones(2, F, dtype=torch.bool)))
    if cfg.epochs == 0:  # no step: nothing trains at any rate
        return {}, copied
    rates = ({"clip": {"lr": float(cfg.clip_lr), "source": setting_source("clip_lr", recipe, "--clip-lr")}}
             if cfg.end_to_end else {})
    rates.update(lr_groups(groups, cfg.head_lr, setting_source("head_lr", recipe, "--head-lr"), cfg.group_lr,
                           lambda g: setting_source(f"group_lr.{g}", recipe, "--group-lr")))
    return rates, copied


def _gpu_missing(cfg: FinetuneConfig) -> str | None:
    """Why the run cannot have the GPUs ``--use-gpu`` asks for here, checked before anything is written
    (None: it can, or it joins a cluster, whose GPUs :func:`_join_ray` counts before the first write)."""
    if not cfg.use_gpu or (cfg.num_workers and (cfg.address or os.environ.get("RAY_ADDRESS"))):
        return None
    need = max(1, cfg.num_workers)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= need:
        return None
    if cfg.num_workers == 0:
        return NO_GPU
    return (f"--use-gpu with --num-workers {cfg.num_workers}: needs {need} GPUs, and this machine has {have}; lower "
            "--num-workers, drop --use-gpu, or join a cluster with GPUs (--address)")


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
        dry_run: check everything a run checks, then return the plan (:func:`plan_run`) instead of
            training; writes nothing.
        gpu_memory: with ``dry_run``, a GPU's memory in bytes: the plan says whether a worker's step fits it,
            the largest chunk that does, and what else the run needs to fit.

    Returns:
        The run's metrics (also in ``out_dir/metrics.json``), or with ``dry_run`` the plan.

    Example:
        >>> finetune("data/msrvtt/manifest", "data/msrvtt/videos", "xpool", "runs/xpool-e2e",
        ...          FinetuneConfig(end_to_end=True, use_gpu=True, precision="fp16"))  # doctest: +SKIP
    """
    from tvrpipe.evaluation.engine import check_post
    from tvrpipe.features.clip import preprocess_description
    from tvrpipe.features.decode import FRAME_SAMPLING
    from tvrpipe.features.extract import open_inputs
    from tvrpipe.features.store import manifest_sha256
    from tvrpipe.training.data import split_rows

    # ---- options (cfg checked itself), manifest and weights are checked before anything is written or Ray starts
    post = check_post(post)
    manifest, root, F, L, bundle = open_inputs(manifest_dir, video_root, out_dir, cfg.frames, cfg.max_words,
                                               cfg.model, cfg.pretrained, cfg.seed)
    head_cfg = clip_head_config(method, bundle.embed_dim, bundle.logit_scale, overrides)  # D, CLIP's scale
    cfg = dataclasses.replace(cfg, frames=F, max_words=L)  # what the run uses, the manifest's where not given
    rates, copied = _probe_head(method, head_cfg, cfg, bundle, recipe)
    if cfg.init_from_clip and not copied:
        log.warning("--init-from-clip: %s, so nothing is copied: %s keeps its own initialisation", copied.reason,
                    method)
        cfg = dataclasses.replace(cfg, init_from_clip=False)
    videos, captions = manifest.videos, manifest.captions
    vrow = pd.Series(np.arange(len(videos)), index=videos["video_id"])
    text_video = vrow.loc[captions["video_id"]].to_numpy()
    rows = split_rows(videos["split"].to_numpy(), captions["split"].to_numpy(), text_video, str(manifest_dir))
    starts = videos["start_s"] if "start_s" in videos else pd.Series(np.nan, index=videos.index)
    ends = videos["end_s"] if "end_s" in videos else pd.Series(np.nan, index=videos.index)
    table = VideoTable(np.array([str(root / p) for p in videos["path"]], dtype=object),
                       starts.astype(float).to_numpy(), ends.astype(float).to_numpy(),
                       captions["text"].astype(str).to_numpy(dtype=object))
    out = Path(out_dir)
    job = _Job(out=str(out.resolve()), method=method, head_cfg=head_cfg, cfg=cfg, table=table, frames=F, max_words=L,
               train_videos=rows.train_videos, train_texts=rows.train_texts, text_video=text_video,
               val=(rows.val_videos, rows.val_texts), test=(rows.test_videos, rows.test_texts),
               video_ids=videos["video_id"].astype(str).to_numpy(), caption_ids=captions["caption_id"].astype(str).to_numpy(),
               val_source=rows.val_source, post=post, progress=progress, lr_groups=rates)
    pairs = _train_pairs(job, recipe)  # the batch fits the training set: checked before the run directory is written
    _check_files(job, root)
    if recipe:  # how the run differs from its recipe: the manifest's data, and every setting as cfg runs it
        from tvrpipe.training.recipes import OPTION_SETTINGS, deviations

        recipe = deviations(recipe, {"dataset": manifest.meta.get("dataset"), "split_set": manifest.meta.get("split_set"),
                                     # CLIP's rate only where CLIP trains
                                     **{k: getattr(cfg, k) for k in OPTION_SETTINGS if k != "clip_lr" or cfg.end_to_end},
                                     "head": dataclasses.asdict(head_cfg)})
    settings = dataclasses.asdict(cfg)
    config = {
        "method": method,
        "head": dataclasses.asdict(head_cfg),
        "finetune": {k: v for k, v in settings.items() if k not in _EXECUTION},
        "execution": {k: settings[k] for k in _EXECUTION},
        "post": list(post),
        "manifest": str(Path(manifest_dir).resolve()),
        "video_root": str(root.resolve()),
        "features": None,  # live features: evaluate needs a store extracted with the run's CLIP
        # what a store must match for `tvrpipe evaluate` (metrics.json adds the finetuned weights' hash)
        "provenance": {"frames": F, "max_words": L, "embed_dim": bundle.embed_dim, "frame_sampling": FRAME_SAMPLING,
                       "image_size": bundle.image_size, "preprocessing": preprocess_description(bundle),
                       "manifest_sha256": manifest_sha256(videos, captions)},
        "validation": rows.val_source,
        # what ran, where the options alone do not say it: each parameter group's rate, what CLIP initialised
        "resolved": {"lr_groups": rates,
                     "init_from_clip": list(copied) if copied else (f"nothing: {copied.reason}" if copied is not None
                                                                    else None)},
        **({"recipe": recipe} if recipe else {}),
    }
    gpu_missing = _gpu_missing(cfg)
    if dry_run:  # every check the run makes before its first write, writing nothing
        check_unlocked(out, "--out")
        check_run_dir(out, config, ignore=_RESUMABLE)
        return plan_run(job, pairs, bundle, config, gpu_missing, gpu_memory)
    if gpu_missing:
        raise ConfigError(gpu_missing)
    del bundle
    if cfg.num_workers:
        _join_ray(cfg)  # the cluster's GPUs and CPUs, counted before the first write
    with locked(out, "--out"):
        start_run(out, config, ignore=_RESUMABLE)
        if cfg.num_workers == 0:
            return run_job(job, 0, 1, "cuda" if cfg.use_gpu else "cpu")
        return _ray_train(job)


def plan_run(job: _Job, pairs: TrainPairs, bundle, config: dict, gpu_missing: str | None,
             gpu_memory: int | None = None) -> dict:
    """What the run of ``job`` (training ``pairs``) will do: its resolved settings, split counts, steps and images
    per step, and the estimated peak memory of a training step per worker, with its chunks and without
    (:mod:`tvrpipe.training.plan`), measured on the CPU with ``bundle`` (the run's CLIP) and a fresh head; with
    ``gpu_memory`` (bytes per worker), whether it fits and what it needs to (:func:`~tvrpipe.training.plan.advise`)."""
    from tvrpipe.training.plan import advise, measure_step, variants

    cfg = job.cfg
    world = max(1, cfg.num_workers)
    steps = _steps_per_epoch(pairs, cfg)
    # fp16 autocast is measured as bf16 on the CPU: the same bytes per activation
    model = _live_model(job, "cpu", bundle, "fp32" if cfg.precision == "fp32" else "bf16")
    texts = [str(t) for t in job.table.texts[job.train_texts[:8]]] or ["a video"]
    measured = measure_step(model, texts, job.frames, job.max_words, cfg.batch_size // world, cfg.grad_checkpointing,
                            gathered=cfg.batch_size,
                            settings=variants(cfg.precision, cfg.grad_checkpointing) if gpu_memory else None)
    own = measured[(cfg.precision, cfg.grad_checkpointing)]
    memory, whole = own.at(cfg.chunk_size), own.at(None)
    counts = {name: {"videos": int(len(v)), "captions": int(len(c))} for name, (v, c) in (
        ("train", (job.train_videos, job.train_texts)), ("val", job.val), ("test", job.test))}
    return {
        "dry_run": True, "method": job.method, "out": job.out, "config": config, "splits": counts,
        "validation": job.val_source, "steps_per_epoch": steps, "epochs": cfg.epochs, "total_steps": steps * cfg.epochs,
        "workers": world, "pairs_per_step": cfg.batch_size, "images_per_step": cfg.batch_size * job.frames,
        "images_per_step_per_worker": cfg.batch_size // world * job.frames,
        "memory": {**dataclasses.asdict(memory), "total": memory.total, "unchunked_total": whole.total,
                   "measured": {k: [list(x) for x in v] for k, v in own.measured.items()}},
        "fit": None if gpu_memory is None else advise(measured, cfg.precision, cfg.grad_checkpointing, cfg.chunk_size,
                                                       gpu_memory, half="fp16" if cfg.use_gpu else "bf16"),
        "gpu": gpu_missing,  # why the run would stop here for want of GPUs (None: it would not)
    }


def _ray_train(job: _Job) -> dict:
    """Run :func:`run_job` on ``num_workers`` Ray Train workers (DDP); rank 0 writes the run."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tvrpipe.errors import TvrpipeError

    cfg = job.cfg  # Ray was started or joined (_join_ray) before the run directory was written
    cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
    cpus = cfg.cpus_per_worker or max(1, cluster_cpus // cfg.num_workers)
    resources = {"CPU": cpus, **({"GPU": 1} if cfg.use_gpu else {})}
    trainer = TorchTrainer(
        _ray_worker, train_loop_config={"job": job, "threads": cpus},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(storage_path=str(Path(job.out) / "ray"), name="finetune",
                             failure_config=FailureConfig(max_failures=0)),
    )
    try:
        _fit_with_progress(trainer, Path(job.out), job)
    except Exception as e:  # a worker's TvrpipeError keeps its message; anything else is summarised
        cause: BaseException | None = e
        seen = set()
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, TvrpipeError):
                raise type(cause)(str(cause)) from None
            inner = [getattr(cause, "__cause__", None), getattr(cause, "cause", None)]
            inner += list(getattr(cause, "worker_failures", {}).values()) if isinstance(
                getattr(cause, "worker_failures", None), dict) else []
            cause = next((c for c in inner if isinstance(c, BaseException)), None)
        raise RunError(f"Ray Train failed: {' '.join(str(e).split())[:400]}; rerun the same command to resume "
                       f"from the last complete epoch") from e
    path = Path(job.out) / "metrics.json"
    return json.loads(path.read_text())


def _join_ray(cfg: FinetuneConfig) -> None:
    """Start or join Ray for ``num_workers`` Ray Train workers, and check that the cluster has a GPU for
    each with ``--use-gpu`` (Ray would otherwise wait forever to place them)."""
    from tvrpipe.cluster import ray_init, require_gpus

    ray_init(cfg.address)
    if cfg.use_gpu:
        require_gpus(cfg.num_workers, f"--use-gpu with --num-workers {cfg.num_workers}",
                     "drop --use-gpu or lower --num-workers", per_task=1)


def _fit_with_progress(trainer, out: Path, job: _Job) -> None:
    """``trainer.fit()``, with a progress bar fed by rank 0's progress file (Ray Train workers' own
    output does not reach this terminal)."""
    import threading

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    (out / PROGRESS_FILE).unlink(missing_ok=True)
    box: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn(), disable=not job.progress)
    with bar:
        task = bar.add_task(f"finetune {job.method} ({job.cfg.num_workers} Ray Train workers)", total=None,
                            info="starting the workers")
        while thread.is_alive():
            thread.join(0.5)
            try:
                p = json.loads((out / PROGRESS_FILE).read_text())
                bar.update(task, total=p["total"], completed=p["done"], info=p["info"])
            except (OSError, ValueError, KeyError):
                pass
    if "error" in box:
        raise box["error"]


def _ray_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    torch.set_num_threads(max(1, int(config["threads"])))
    run_job(config["job"], ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(),
            cpus=int(config["threads"]))
