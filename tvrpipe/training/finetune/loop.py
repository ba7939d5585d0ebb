"""The training loop of one finetune process (rank ``rank`` of ``world``): the live model and its
optimiser, resume, the DataLoaders that decode, the steps (:mod:`tvrpipe.training.step`), validation
after each epoch, and on rank 0 the test of the selected epoch and the export."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from tvrpipe.errors import RunError
from tvrpipe.files import atomic_write_text
from tvrpipe.heads.base import head_class
from tvrpipe.rundir import BEST, LAST, load_head, load_optimizer_state, save_head
from tvrpipe.training.core import (
    RunLoop,
    Schedule,
    apply_step,
    check_finite_loss,
    group_rates,
    make_optimizer,
    seed_step,
    start_step,
)
from tvrpipe.training.data import SplitData
from tvrpipe.training.evaluate import evaluate_split
from tvrpipe.training.finetune.export import export_clip, save_clip
from tvrpipe.training.finetune.failures import all_failures, too_many_failed, write_failures
from tvrpipe.training.finetune.job import FinetuneJob, steps_per_epoch, train_pairs
from tvrpipe.training.live import LiveModel, pairs_in_step, param_groups
from tvrpipe.training.step import step_gradients
from tvrpipe.training.videodata import (
    ClipBatch,
    Collate,
    DecodedClips,
    Key,
    PlannedBatches,
    TrainPairs,
    epoch_plan,
)

log = logging.getLogger(__name__)

PROGRESS_FILE = ".progress.json"


def encode_split(model: LiveModel, loader_for, videos: np.ndarray, captions: np.ndarray, job: FinetuneJob,
                 failures: dict[str, str], name: str) -> SplitData:
    """The split's features from the live CLIP in eval mode, as a store's split holds them (on the CPU, fp32):
    the videos ``videos`` and the captions ``captions`` (rows of the manifest); a video that fails to decode is
    added to ``failures`` and has no frame."""
    model.eval()
    frames, masks, tokens, token_masks, sentences = [], [], [], [], []
    with torch.no_grad():
        for batch in loader_for([[(int(v), -1, -1) for v in videos[i: i + job.cfg.eval_batch]]
                                 for i in range(0, len(videos), job.cfg.eval_batch)]):
            failures.update({str(job.video_ids[v]): e for v, e in batch.failed})
            v = model.encode_videos(batch.frames, batch.frame_mask)
            frames.append(v.frames.cpu().numpy())
            masks.append(v.frame_mask.cpu().numpy())
        for i in range(0, len(captions), 256):
            t = model.encode_texts([str(x) for x in job.table.texts[captions[i: i + 256]]], job.max_words)
            tokens.append(t.tokens.cpu().numpy())
            token_masks.append(t.token_mask.cpu().numpy())
            sentences.append(t.sentence.cpu().numpy())
    D, F, L = model.bundle.embed_dim, job.frames, job.max_words
    column = {int(v): i for i, v in enumerate(videos)}
    join = lambda parts, shape, dtype: np.concatenate(parts) if parts else np.zeros(shape, dtype)  # noqa: E731
    return SplitData(name=name, frames=join(frames, (0, F, D), np.float32), frame_mask=join(masks, (0, F), bool),
                     tokens=join(tokens, (0, L, D), np.float32), token_mask=join(token_masks, (0, L), bool),
                     sentence=join(sentences, (0, D), np.float32),
                     text_video=np.array([column[int(v)] for v in job.text_video[captions]], np.int64),
                     video_ids=job.video_ids[videos], caption_ids=job.caption_ids[captions])


def evaluate(model: LiveModel, loader_for, split: tuple[np.ndarray, np.ndarray], job: FinetuneJob,
             failures: dict[str, str], post: tuple[str, ...] = ()) -> dict:
    """The live model's scores on ``split`` ((video rows, caption rows)): its features encoded by the live
    CLIP (a frozen CLIP's once a run), scored by :func:`~tvrpipe.training.evaluate.evaluate_split`, as
    train-head scores a store's."""
    videos, captions = split
    key = (videos.tobytes(), captions.tobytes())
    data = None if model.end_to_end else model.frozen_features.get(key)
    if data is None:
        data = encode_split(model, loader_for, videos, captions, job, failures, "eval")
        if not model.end_to_end:  # a frozen CLIP encodes a split the same way every epoch: decode it once
            model.frozen_features[key] = data
    querybank = None
    if "qbnorm" in post:  # training captions, encoded by the same CLIP
        querybank = encode_split(model, loader_for, videos[:0], job.train_texts, job, failures, "train")
    return evaluate_split(model.head, data, model.bundle.device, job.cfg.eval_batch, job.cfg.block_texts, post=post,
                          querybank=querybank)


def run_job(job: FinetuneJob, rank: int = 0, world: int = 1, device: str | torch.device = "cpu",
            cpus: int | None = None) -> dict | None:
    """The training loop of one process (rank ``rank`` of ``world``, ``cpus`` CPUs: default all this
    process may use); rank 0 returns the metrics."""
    cfg = job.cfg
    pairs = train_pairs(job)
    steps = steps_per_epoch(pairs, cfg)
    run = _start(job, Schedule.fixed(steps, cfg.epochs, cfg.warmup_fraction), rank, world, device)
    # DataLoader workers decode; an epoch's batches are planned from (seed, epoch)
    train_sampler, train_loader, loader_for = loaders(job, run.model.bundle.image_size, cpus)
    with run.loop.progress(f"finetune {job.method}", enabled=job.progress and world == 1):
        for epoch in run.loop.epochs():
            t_epoch = time.perf_counter()
            train_sampler.plan = _plan_epoch(run, job, pairs, epoch)
            timing = _train_epoch(run, job, epoch, steps, train_loader)
            _end_epoch(run, job, epoch, loader_for, timing, t_epoch)
    if rank != 0:
        return None
    return _finish(run.model, run.loop, loader_for, job, run.failures)


@dataclass
class _Run:
    """The live state of one process's run: what :func:`_start` builds and each epoch's stages update."""

    model: LiveModel
    wrapped: nn.Module  # the model under DDP with several workers, the model itself with one
    opt: torch.optim.Optimizer | None
    scaler: torch.amp.GradScaler
    loop: RunLoop
    failures: dict[str, str]  # video id -> error, every video that failed to decode
    progress: ProgressFile  # what the driver of Ray Train workers shows
    rank: int
    world: int


def _start(job: FinetuneJob, schedule: Schedule, rank: int, world: int, device: str | torch.device) -> _Run:
    """Start stage: the live model and its optimiser, resumed after the last committed epoch if any."""
    cfg, out = job.cfg, Path(job.out)
    model = live_model(job, device)
    bundle, head = model.bundle, model.head
    groups = param_groups(model, cfg.clip_lr, cfg.head_lr, cfg.weight_decay, cfg.group_lr)
    opt = make_optimizer(cfg.optimizer, groups)
    scaler = torch.amp.GradScaler(bundle.device.type, enabled=cfg.precision == "fp16")
    loop = RunLoop(out, schedule, {"clip_": lambda path: save_clip(model.clip, path, {"model": cfg.model}),
                                   "": lambda path: save_head(head, path)}, rank, world)
    failures: dict[str, str] = {}
    progress = ProgressFile(out)

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
        write_failures(failures, out)
    # DDP broadcasts rank 0's weights when it wraps the model: after the resume, so they are the resumed ones
    wrapped = distributed(model, world)
    return _Run(model, wrapped, opt, scaler, loop, failures, progress, rank, world)


def _plan_epoch(run: _Run, job: FinetuneJob, pairs: TrainPairs, epoch: int) -> list[list[Key]]:
    """Plan stage: this rank's batches of epoch ``epoch``, drawn from (seed, epoch), without the failed videos."""
    cfg = job.cfg
    id_row = {str(v): i for i, v in enumerate(job.video_ids)}
    skip = frozenset(id_row[v] for v in run.failures if v in id_row)
    return epoch_plan(pairs, cfg.seed, epoch, cfg.batch_size, run.rank, run.world, skip, cfg.max_steps,
                      cfg.epoch_pairs)


def _train_epoch(run: _Run, job: FinetuneJob, epoch: int, steps: int,
                 train_loader: Iterable[ClipBatch]) -> list[tuple[float, float, int]]:
    """Run stage: epoch ``epoch``'s steps; each step's (seconds waiting, seconds stepping, clips)."""
    cfg, loop, world = job.cfg, run.loop, run.world
    run.model.train()
    if not cfg.end_to_end:
        run.model.clip.eval()  # frozen: CLIP stays in inference mode
    new_failed: list[tuple[int, str]] = []  # (manifest row, error) of this rank's videos that failed to decode
    timing: list[tuple[float, float, int]] = []
    t0 = time.perf_counter()
    for step, batch in enumerate(train_loader):
        t1 = time.perf_counter()
        new_failed += batch.failed
        if pairs_in_step(len(batch.videos), world, run.model.bundle.device) == 0:  # no video of the step decoded
            loop.advance(f"epoch {epoch + 1}/{cfg.epochs}: a step whose videos all failed to decode, skipped")
            t0 = time.perf_counter()
            continue
        total_loss, loss_terms = _step(run, job, epoch, step, batch)
        t2 = time.perf_counter()
        timing.append((t1 - t0, t2 - t1, len(batch.videos) * world))
        loss = loop.record(total_loss, loss_terms)
        info = (f"epoch {epoch + 1}/{cfg.epochs} loss {loss:.3f} "
                f"{len(batch.videos) * world / (t2 - t0):.1f} clips/s")
        loop.advance(info)
        if world > 1 and run.rank == 0:  # the driver shows Ray workers' progress from this file
            run.progress.write((epoch - loop.start_epoch) * steps + step + 1,
                               steps * (cfg.epochs - loop.start_epoch), info)
        t0 = time.perf_counter()
    run.failures.update(all_failures(new_failed, job.video_ids, world))
    return timing


def _step(run: _Run, job: FinetuneJob, epoch: int, step: int, batch: ClipBatch) -> tuple[torch.Tensor, dict]:
    """Step stage: one optimizer step on ``batch``; returns its loss and the loss's terms."""
    cfg, opt = job.cfg, run.opt
    # the head's own noise (sampling heads) is the same on every rank and after a resume
    seed_step(cfg.seed, epoch, step)

    def check(total: torch.Tensor, terms: dict) -> None:
        check_finite_loss(total, terms, epoch, step, job.video_ids[batch.videos],
                          job.caption_ids[batch.captions], "--clip-lr / --head-lr" if cfg.end_to_end
                          else "--head-lr")
    if opt is not None:
        start_step(opt, run.loop.lr(epoch, step))
    total_loss, loss_terms = step_gradients(run.model, run.wrapped, batch.frames, batch.frame_mask, batch.texts,
                                            job.max_words, cfg.chunk_size, run.scaler, opt is not None, check)
    if opt is not None:
        apply_step(opt, run.scaler, cfg.grad_clip)
    device = run.model.bundle.device
    if device.type == "cuda":  # the step's time is the GPU's, not only its launch
        torch.cuda.synchronize(device)
    return total_loss, loss_terms


def _end_epoch(run: _Run, job: FinetuneJob, epoch: int, loader_for: Callable,
               timing: list[tuple[float, float, int]], t_epoch: float) -> None:
    """Record stage: rank 0 validates and commits epoch ``epoch``; every rank stops on too many failed videos."""
    cfg, out, opt, failures = job.cfg, Path(job.out), run.opt, run.failures
    if run.rank == 0:
        run.loop.end_epoch(epoch, evaluate(run.model, loader_for, job.val, job, failures), {
            **group_rates(opt),  # the rate each parameter group stepped at last
            **_throughput(timing), "failed_videos": len(failures),
            "seconds": time.perf_counter() - t_epoch,  # wall time of the epoch, validation included
        }, {"failures": failures, "optimizer": opt.state_dict() if opt else None,
            "scaler": run.scaler.state_dict()})
        if failures:
            write_failures(failures, out)
    _barrier(run.world)
    message = too_many_failed(failures, job.train_videos, job.video_ids, cfg.max_failed_fraction,
                              "training videos failed to decode",
                              f"training stopped after epoch {epoch + 1}, which is kept.", out / "failures.csv")
    if message:
        raise RunError(message)


def live_model(job: FinetuneJob, device: str | torch.device, bundle=None, precision: str | None = None) -> LiveModel:
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


def distributed(model: LiveModel, world: int) -> nn.Module:
    """``model`` under DistributedDataParallel when there are several workers."""
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device = model.bundle.device
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)


def loaders(job: FinetuneJob, image_size: int, cpus: int | None):
    """The training batches (a sampler whose plan is set each epoch, and its DataLoader) and
    ``loader_for(plan)``, which decodes evaluation batches; both decode in ``loader_workers`` processes."""
    from torch.utils.data import DataLoader

    cfg, F = job.cfg, job.frames
    dataset = DecodedClips(job.table, F, image_size, cfg.seed, cfg.timeout_s)
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = cfg.loader_workers if cfg.loader_workers is not None else min(8, cpus)
    train_sampler, eval_sampler = PlannedBatches(), PlannedBatches()
    # training drops a video that fails to decode; evaluation keeps its row, with no frame
    train_loader, eval_loader = (
        DataLoader(dataset, batch_sampler=sampler, collate_fn=Collate(F, image_size, keep_failed=keep),
                   num_workers=workers, persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
        for sampler, keep in ((train_sampler, False), (eval_sampler, True)))

    def loader_for(plan):
        eval_sampler.plan = plan
        return iter(eval_loader)
    return train_sampler, train_loader, loader_for


def _throughput(timing: list[tuple[float, float, int]]) -> dict[str, float]:
    """clips/s and the share of step time spent waiting for data, over the epoch and in steady state
    (without the first step, which waits for the DataLoader workers to start)."""
    out = {}
    for suffix, part in (("", timing), ("_steady", timing[1:])):
        wait, step, clips = (sum(t[i] for t in part) for i in range(3))
        out[f"clips_per_s{suffix}"] = clips / max(wait + step, 1e-9)
        out[f"data_share{suffix}"] = wait / max(wait + step, 1e-9)
    return out


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _finish(model: LiveModel, loop: RunLoop, loader_for, job: FinetuneJob, failures: dict[str, str]) -> dict:
    """Rank 0: test evaluation of the selected epoch, export, metrics.json and plots."""
    from safetensors.torch import load_file

    cfg, out, folder = job.cfg, Path(job.out), loop.checkpoints.folder
    loop.selected(lambda: evaluate(model, loader_for, job.val, job, failures))
    model.clip.load_state_dict(load_file(str(folder / f"clip_{BEST}")))
    model.head.load_state_dict(load_head(folder / BEST).state_dict())
    test = evaluate(model, loader_for, job.test, job, failures, post=job.post)
    if failures:
        write_failures(failures, out)
    message = too_many_failed(failures, job.test[0], job.video_ids, cfg.max_failed_fraction,
                              "test videos failed to decode", "no test metrics were written (the training is kept).",
                              out / "failures.csv")
    if message:
        raise RunError(message)
    provenance, export = export_clip(model, out, job.method, cfg.end_to_end)
    rows = loop.rows
    return loop.write_results(
        job.method, job.val_source, test,
        schedule={"lr_groups": job.lr_groups, "batch_size": cfg.batch_size, "description": loop.schedule.description},
        train={"clips_per_s": float(np.mean([r["clips_per_s"] for r in rows])) if rows else None,
               "data_share": float(np.mean([r["data_share"] for r in rows])) if rows else None,
               # a run resumed from a version that did not time its epochs has no total
               "seconds": float(sum(r["seconds"] for r in rows)) if all("seconds" in r for r in rows) else None,
               "threads": torch.get_num_threads()},
        extras={"provenance": provenance, "export": export, "failed_videos": len(failures)})


class ProgressFile:
    """Rank 0 of a Ray Train run writes its progress here for the driver's bar (Ray Train workers' own output
    does not reach the driver's terminal), at most every ``every_s``; the driver reads it."""

    def __init__(self, out: Path, every_s: float = 1.0) -> None:
        self.path, self.every_s, self.last = Path(out) / PROGRESS_FILE, every_s, 0.0

    def write(self, done: int, total: int, info: str) -> None:
        now = time.monotonic()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        atomic_write_text(self.path, json.dumps({"done": done, "total": total, "info": info}))

    def read(self) -> dict | None:
        """``{"done", "total", "info"}``, or None before the first write (or while a write is replaced)."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
