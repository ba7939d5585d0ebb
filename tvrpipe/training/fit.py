"""``fit``: train a head on a cached feature store (``tvrpipe train-head``).

The loop reads top to bottom: schedule, model and optimiser, resume, data, steps, validation; the
epoch skeleton it shares with ``finetune`` (selection, checkpoints, resume, run files) is
:mod:`tvrpipe.training.core`.

Protocol (docs/design.md, "Evaluation protocol"): the epoch is selected on the **validation** split
(the store's, or carved from train: see :mod:`tvrpipe.training.data`), never on test; test is
evaluated once, with the selected checkpoint; DSL and QB-Norm are reported under their own keys.

Choices (documented in docs/training.md): an epoch visits every training video once with one
of its captions drawn at random (no video twice in a batch, so InfoNCE has no false negatives);
AdamW with linear warmup then cosine decay (CLIP4Clip Sec. 4.1, X-Pool Sec. 4); the selection
key is validation text-to-video (R@1, R@5, R@10).

Integrity: a run directory is locked while written (:mod:`tvrpipe.lock`); features are checked
finite as they load; a non-finite loss stops training at its step, naming the batch's videos and
captions, and a non-finite score stops evaluation; no checkpoint with non-finite weights is ever
written, so none can be selected as best. The selected checkpoint's sha256 is recorded in
``metrics.json`` and checked whenever the run is evaluated again. An epoch's checkpoint files and
resume state are committed together (:class:`~tvrpipe.rundir.Checkpoints`), so a run cut anywhere resumes to the
uninterrupted result.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tvrpipe.errors import ConfigError
from tvrpipe.features.outputs import check_output_folder
from tvrpipe.features.store import open_store, store_identity
from tvrpipe.heads.base import Head, HeadConfig, clip_head_config, head_class
from tvrpipe.lock import check_writable, locked
from tvrpipe.rundir import (
    BEST,
    LAST,
    load_head,
    load_optimizer_state,
    save_head,
    write_test_ranks,
)
from tvrpipe.training.allocator import tune_allocator
from tvrpipe.training.core import (
    RunLoop,
    Schedule,
    base_lr,
    check_finite_loss,
    check_group_lr,
    check_head_groups,
    check_head_inputs,
    group_rates,
    lr_groups,
    make_optimizer,
    optimizer_step,
    seed_step,
    setting_source,
    start_run,
    without_keys,
)
from tvrpipe.training.data import SplitData, Splits, check_captioned, store_split_rows
from tvrpipe.training.evaluate import evaluate_split
from tvrpipe.training.settings import EXECUTION_FIELDS, TrainConfig
from tvrpipe.training.stream import (
    IN_MEMORY_ORDER,
    DataPlan,
    InMemoryPairs,
    StreamedPairs,
    open_splits,
    plan_data,
)

log = logging.getLogger(__name__)


# config.yaml's keys that a resumed run may change (config.yaml keeps the first invocation's and lists the changes
# under resumed_execution): the execution settings, and what the data plan measured of this machine
EXECUTION = (*(f"train.{k}" for k in EXECUTION_FIELDS), "data.budget", "data.needs", "data.evaluation", "data.tables")


def check_device(device: str) -> None:
    """Raise :class:`ConfigError` when ``device`` (``cpu``, ``cuda``, ``cuda:N``) is not on this machine."""
    if device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        if not index.isdigit():
            raise ConfigError(f"--device {device}: write cuda or cuda:N")
        if not torch.cuda.is_available() or int(index) >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: no such CUDA device here ({torch.cuda.device_count()} found); "
                              "use --device cpu")


def open_ended_epochs(train: TrainConfig, steps_per_epoch: int) -> tuple[int, int, int, int]:
    """(patience, plateau, max_epochs, validate_every) in epochs for a run without ``epochs``, on a store of
    ``steps_per_epoch`` optimizer steps an epoch.

    Progress per epoch depends on the steps in it, so the schedule counts in periods of at least
    ``min_steps / patience`` steps: on a store with fewer steps an epoch, a period is ``k`` epochs, ``k =
    min_steps / (patience * steps_per_epoch)`` rounded up, which makes patience cover ``min_steps`` steps.
    Validation runs once a period (every ``k`` epochs), and patience, plateau and max_epochs are ``k`` times
    the configured numbers of periods (max_epochs at least patience + 1 periods). ``k`` is 1 on bigger
    stores: the configured epochs, each validated. E.g. the defaults (8, 3, 60, 300 steps): 63 steps an
    epoch (MSR-VTT 9k) -> (8, 3, 60, 1); 15 -> (24, 9, 180, 3); 3 -> (104, 39, 780, 13).

    Example:
        >>> open_ended_epochs(TrainConfig(), 15)
        (24, 9, 180, 3)
    """
    k = max(1, math.ceil(round(train.min_steps / (train.patience * steps_per_epoch), 6)))  # round: 10.0000001 is 10
    return (k * train.patience, k * train.plateau, k * max(train.max_epochs, train.patience + 1), k)


def resolved_lr(method: str, train: TrainConfig, embed_dim: int) -> tuple[float, str]:
    """The learning rate a run on features of width ``embed_dim`` uses and where it comes from
    (``--lr``, or the head's ``default_lr``: read at that width where the head gives one per width)."""
    if train.lr is not None:
        return train.lr, "--lr"
    cls = head_class(method)
    width = f" at D={embed_dim}" if isinstance(cls.default_lr, Mapping) else ""
    return cls.lr_for(embed_dim), f"{method}.default_lr{width}"


def _prefetch(items: Iterator[Any]) -> Iterator[Any]:
    """Yield ``items``, building the next one in a background thread meanwhile.

    Batch building is NumPy gathers and torch casts, which release the GIL, so it overlaps with
    the training step; the items are still produced in order, one at a time (same RNG draws).
    """
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(next, items, None)
        while (item := pending.result()) is not None:
            pending = pool.submit(next, items, None)
            yield item


ZERO_SHOT = "meanpool, untrained: the cosine of the sentence and the mean of the frames (zero-shot CLIP)"
ZERO_SHOT_START = ("score = cos(sentence, mean of the frames) + g x (the head's score), g learned from 0: training "
                   "starts at zero-shot CLIP (--zero-shot-start; no paper does this)")


def store_head_config(store, method: str, overrides: dict[str, Any] | None = None) -> HeadConfig:
    """The config of ``method`` trained on ``store``: D and the CLIP's logit scale from the store's
    provenance (:func:`clip_head_config`), then the user's ``overrides`` (unknown keys fail; D is the store's, and
    another one is refused before a head of that width is built)."""
    d = int(store.provenance["embed_dim"])
    if (overrides or {}).get("embed_dim", d) != d:
        raise ConfigError(f"--set embed_dim={overrides['embed_dim']}: the features of {store.dir} are D = {d} wide "
                          "(their CLIP's); a head reads them at that width, so leave embed_dim out")
    return clip_head_config(method, d, store.provenance.get("logit_scale"), overrides)


def fit(
    features: str | os.PathLike[str],
    method: str,
    out_dir: str | os.PathLike[str],
    train: TrainConfig = TrainConfig(),
    overrides: dict[str, Any] | None = None,
    post: tuple[str, ...] = (),
    progress: bool = True,
    max_steps: int | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    recipe: dict[str, Any] | None = None,
) -> dict:
    """Train ``method`` on a feature store, select the epoch on validation, evaluate on test.

    Args:
        features: a complete feature store (``tvrpipe extract`` or a generated one).
        method: a registered head (``tvrpipe heads``).
        out_dir: the run directory; rerunning with the same config resumes from the last epoch.
        train: trainer settings.
        overrides: head config overrides (``--set key=value``); unknown keys fail.
        post: post-processing to report beside raw test metrics (``dsl``, ``qbnorm``).
        progress: show a progress bar.
        max_steps: cap on steps per epoch (benchmarks); None trains on every video.
        on_epoch: called after each validated epoch, once it is saved, with its ``epochs.csv`` row (``bench
            convergence`` logs a line per epoch of its hours-long runs with it).
        recipe: what the run records of the recipe its settings came from (:meth:`Recipe.record`).

    Returns:
        The run's metrics (also in ``out_dir/metrics.json``).

    Example:
        >>> fit("features/msrvtt-vitb32", "xpool", "runs/xpool", TrainConfig(epochs=5))  # doctest: +SKIP
    """
    # ---- options and data (nothing is written before they are checked; ``train`` checked itself)
    check_writable(out_dir, "--out")
    check_output_folder(out_dir, "--out", may_be="a run")  # a run resumes; one inside another run's folder would not
    check_device(train.device)
    store = open_store(features)
    check_captioned(store)  # a collection of one's own videos: searched, never trained on
    head_cfg = store_head_config(store, method, overrides)
    if store.provenance.get("logit_scale") is None and "generator" not in store.provenance \
            and "logit_scale_init" not in (overrides or {}):
        log.warning("%s records no learned CLIP logit scale (extracted before tvrpipe recorded it): %s starts "
                    "at CLIP's initial scale 1/0.07, not the learned one the papers reuse; run the same extract again "
                    "(it records the scale and re-extracts nothing), or pass --set logit_scale_init=LOG_SCALE "
                    "(4.6052 for OpenAI's CLIP)", features, method)
    # in memory when the splits fit the budget, else streamed from the store (no word tokens for a sentence head)
    rows, uses_tokens = store_split_rows(store), head_class(method).uses_tokens
    batch = 0 if train.epochs == 0 else min(train.batch_size, len(rows.train_videos))  # --epochs 0 draws none
    # the evaluation's share of the budget is measured on the head's own embeddings (a throwaway instance)
    data = plan_data(store, rows, uses_tokens, batch, train.memory_budget, head_class(method)(head_cfg))
    splits: Splits = open_splits(store, rows, data, uses_tokens)
    train_split = splits.train
    if train_split.n_videos < 2:
        raise ConfigError("the training split needs at least 2 videos")
    check_head_groups(method, head_cfg, train.group_lr)
    if train.init_from_clip and "generator" in store.provenance and \
            setting_source("init_from_clip", recipe, "--init-from-clip") != "--init-from-clip":
        # the recipe asks for it, not the user: the run goes on from the head's own initialisation, and says so
        log.warning("recipe %s starts %s from CLIP, but %s was generated by `%s`: no CLIP made its features, so %s "
                    "keeps its own initialisation", recipe["name"], method, store.dir, store.made_by, method)
        train = dataclasses.replace(train, init_from_clip=False)
    clip = store_clip(store) if train.init_from_clip else None  # before anything is written: it may not load
    if recipe:
        recipe = _recipe_deviations(recipe, store.provenance, train, train_batch(train, train_split), head_cfg)
    out = Path(out_dir)
    tune_allocator()  # a step's large temporaries reused from the heap, not re-faulted (allocator.py)
    with locked(out, "--out"):
        return _train(store, splits, data, method, head_cfg, out, train, post, progress, max_steps, features,
                      on_epoch, recipe, clip)


def store_clip(store) -> torch.nn.Module:
    """The CLIP ``store`` was extracted with (its provenance names the model and the weights), loaded on the CPU
    and checked against the weights' sha256 the store records.

    Raises:
        ConfigError: a generated store (no CLIP made it), or weights that cannot be loaded or are not the store's.
    """
    from tvrpipe.features.clip import load_clip

    prov = store.provenance
    if "generator" in prov:
        raise ConfigError(f"--init-from-clip: {store.dir} was generated by `{store.made_by}`, so no CLIP made its "
                          "features and there is none to start from; leave --init-from-clip out, or train on a store "
                          "of `tvrpipe extract`")
    try:
        bundle = load_clip(str(prov["model"]), str(prov["pretrained"]), device="cpu", seed=int(prov.get("seed", 0)))
    except ConfigError as e:
        raise ConfigError(f"--init-from-clip needs the CLIP of {store.dir}, which cannot be loaded ({e})") from None
    if bundle.weights_sha256 != prov.get("weights_sha256"):
        raise ConfigError(f"--init-from-clip: the weights at {prov['pretrained']!r} are not those {store.dir} was "
                          f"extracted with (sha256 {bundle.weights_sha256[:12]} vs {str(prov.get('weights_sha256'))[:12]})")
    return bundle.model


def train_batch(train: TrainConfig, split: SplitData) -> int:
    """The pairs a step of ``split`` holds: ``--batch-size``, or every training video when there are fewer
    (a batch holds no video twice); what the run records as its batch."""
    return min(train.batch_size, split.n_videos)


def _recipe_deviations(recipe: dict[str, Any], provenance: Mapping[str, Any], train: TrainConfig,
                       batch: int, head_cfg: HeadConfig) -> dict[str, Any]:
    """The recipe's record completed with how this run differs from it (:func:`~tvrpipe.training.recipes.deviations`):
    the store fixes the data, backbone, frames and words, train-head never trains CLIP, and the recipe's
    other settings it takes (``recipes.TRAIN_HEAD``) ran as ``train`` says, the batch as it was used."""
    from tvrpipe.training.recipes import TRAIN_HEAD, deviations

    ran = {k: provenance.get(k) for k in ("dataset", "split_set", "model", "pretrained", "frames", "max_words")}
    ran.update({"end_to_end": False, **{setting: getattr(train, field) for setting, field in TRAIN_HEAD.items()},
                "batch_size": batch, "head": dataclasses.asdict(head_cfg)})
    return deviations(recipe, ran)


def _train(store, splits: Splits, data: DataPlan, method: str, head_cfg, out: Path, train: TrainConfig, post: tuple[str, ...],
           progress: bool, max_steps: int | None, features, on_epoch: Callable[[dict], None] | None,
           recipe: dict[str, Any] | None, clip: torch.nn.Module | None = None) -> dict:
    """The training run proper, with the run directory locked; ``data``: how the splits are read; ``clip``: the
    store's CLIP, for a head that starts from it (``train.init_from_clip``). Its stages: the plan (schedule and
    learning rate), the model, the run's record, the epochs, and the selected epoch's test."""
    plan = _plan_schedule(method, train, head_cfg, recipe, splits.train.n_videos, max_steps)
    head, train, copied = _model(method, head_cfg, train, clip, splits.train)
    groups, rates, lr, lr_source, batch = _record_start(store, splits, data, method, head, head_cfg, out, train, post,
                                                         plan, recipe, copied, features, max_steps)
    # every parameter decays here (finetune exempts gains and biases, as CLIP's recipe does; docs/training.md)
    opt = make_optimizer(train.optimizer, [
        {"params": [p for p in params if p.requires_grad], "lr": rates[g]["lr"], "base_lr": rates[g]["lr"],
         "weight_decay": train.weight_decay, "name": g} for g, params in groups.items() if g in rates])
    loop = RunLoop(out, plan.schedule, {"": lambda path: save_head(head, path)}, on_epoch=on_epoch)
    _epochs(loop, head, opt, splits, data, method, train, plan, batch, out, progress)
    return _finish(loop, head, store, splits, method, head_cfg, train, post, plan, rates, lr, lr_source, batch, out)


@dataclass(frozen=True)
class _Plan:
    """A run's schedule: its steps an epoch, the schedule, and the open-ended run's limits (where it has them)."""

    lr: float
    lr_source: str
    steps_per_epoch: int
    schedule: Schedule
    patience: int | None
    plateau: int | None
    max_epochs: int | None


def _plan_schedule(method: str, train: TrainConfig, head_cfg, recipe: dict[str, Any] | None, n_videos: int,
                   max_steps: int | None) -> _Plan:
    """The plan: the learning rate (and where it comes from), the steps an epoch and the schedule."""
    lr, lr_source = resolved_lr(method, train, head_cfg.embed_dim)
    lr_source = setting_source("head_lr", recipe, lr_source)
    steps_per_epoch = max(1, n_videos // train.batch_size)
    if max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, max_steps)
    patience, plateau, max_epochs, every = open_ended_epochs(train, steps_per_epoch)
    schedule = (Schedule.open_ended(steps_per_epoch, max_epochs, patience, plateau, every) if train.epochs is None
                else Schedule.fixed(steps_per_epoch, train.epochs, train.warmup_fraction))
    return _Plan(lr, lr_source, steps_per_epoch, schedule, patience, plateau, max_epochs)


def _model(method: str, head_cfg, train: TrainConfig, clip: torch.nn.Module | None,
           train_split) -> tuple[Head, TrainConfig, Any]:
    """The model: the head from the run's seed (from the store's CLIP where asked), on the device, checked on two
    pairs of the data before anything is written; ``train`` as it ran (``init_from_clip`` off where nothing was
    copied) and what was copied."""
    device = torch.device(train.device)
    torch.manual_seed(train.seed)
    head = head_class(method)(head_cfg)
    copied = head.init_from_clip(clip) if clip is not None else None
    if copied is not None and not copied:  # recorded as what ran: the head's own initialisation
        log.warning("--init-from-clip: %s, so nothing is copied: %s keeps its own initialisation", copied.reason,
                    method)
        train = dataclasses.replace(train, init_from_clip=False)
    head = head.to(device)
    vids = np.arange(min(2, train_split.n_videos))  # two pairs of the data: the head takes it (before any write)
    caps = np.array([np.flatnonzero(train_split.text_video == v)[0] for v in vids])
    check_head_inputs(head, train_split.text_batch(caps, head.uses_tokens, trim=True).to(device),
                      train_split.video_batch(vids).to(device))
    return head, train, copied


def _record_start(store, splits: Splits, data: DataPlan, method: str, head: Head, head_cfg, out: Path,
                  train: TrainConfig, post: tuple[str, ...], plan: _Plan, recipe: dict[str, Any] | None, copied: Any,
                  features, max_steps: int | None) -> tuple[dict, dict, float, str, int]:
    """The run's record: each parameter group's rate, checked, and ``config.yaml`` written (or a resumed run's
    compared); the groups, their rates, the learning rate and its source as recorded, and the batch size."""
    lr, lr_source, steps_per_epoch, schedule = plan.lr, plan.lr_source, plan.steps_per_epoch, plan.schedule
    train_split = splits.train
    groups = check_group_lr(head, train.group_lr)
    steps = 0 if train.epochs == 0 else steps_per_epoch
    rates = lr_groups(groups, lr, lr_source, train.group_lr, lambda g: setting_source(f"group_lr.{g}", recipe, "--group-lr")) if steps else {}
    if lr_source == "--lr" and rates and not any(r["source"] == "--lr" for r in rates.values()):
        raise ConfigError(f"--lr {lr:g}: every parameter group of {method} trains at its --group-lr rate "
                          f"({', '.join(rates)}), so --lr would train nothing; leave it out")
    lr, lr_source = base_lr(rates, lr, lr_source, steps)
    batch = train_batch(train, train_split)
    start_run(out, {
        "method": method,
        "head": dataclasses.asdict(head_cfg),
        "train": dataclasses.asdict(train),
        "resolved": {"lr": lr, "lr_source": lr_source, "lr_groups": rates, "batch_size": batch,
                     "schedule": schedule.description,
                     # what the store's CLIP initialised (None: not asked)
                     "init_from_clip": list(copied) if copied else (f"nothing: {copied.reason}" if copied is not None
                                                                    else None)},
        "post": list(post),
        "features": str(Path(features).resolve()),
        "provenance": store_identity(store.provenance),
        "validation": splits.val_source,
        "data": data.record(),
        "max_steps": max_steps,
        **({"recipe": recipe} if recipe else {}),
        **({"not_in_papers": {"zero_shot_start": ZERO_SHOT_START}} if head_cfg.zero_shot_start else {}),
    }, ignore=EXECUTION, explain=lambda old, new: _lr_changed(out, old, new, lr, lr_source)
       or _data_changed(out, old, new), assumed={"data": {"mode": "in memory", "order": IN_MEMORY_ORDER}})
    return groups, rates, lr, lr_source, batch


def _epochs(loop: RunLoop, head: Head, opt, splits: Splits, data: DataPlan, method: str, train: TrainConfig,
            plan: _Plan, batch: int, out: Path, progress: bool) -> None:
    """The epochs: resumed where the run stopped, the untrained head validated (it competes in the selection),
    then every epoch's steps of ``batch`` pairs, validated every epoch (or every ``validate_every``)."""
    device, schedule, steps_per_epoch = torch.device(train.device), plan.schedule, plan.steps_per_epoch
    train_split = splits.train

    def restore(state: dict) -> None:
        head.load_state_dict(load_head(loop.checkpoints.folder / LAST, str(device)).state_dict())
        if opt:
            load_optimizer_state(opt, state["optimizer"], out)
    loop.resume(restore)
    # the untrained head competes in the selection: a run never ends below its start on validation
    loop.begin(lambda: evaluate_split(head, splits.val, train.device, train.eval_batch, train.block_texts))

    # ---- data: an epoch visits every video once, with one of its captions drawn at random
    pairs = (StreamedPairs(train_split, data, head.uses_tokens) if data.streamed
             else InMemoryPairs(train_split, head.uses_tokens))

    def batches(epoch: int):
        for vids, caps, texts, videos in pairs.epoch(train.seed, epoch, steps_per_epoch, batch):
            yield vids, caps, texts.to(device), videos.to(device)

    # ---- loop: validated every epoch, or every ``schedule.validate_every`` (a store of few steps an epoch)
    t_period, t_data, t_step, n_steps = time.perf_counter(), 0.0, 0.0, 0  # since the last validation
    with loop.progress(method, enabled=progress):
        for epoch in loop.epochs():
            t0 = time.perf_counter()
            head.train()
            info = loop.validation_info()
            for step, (vids, caps, texts, videos) in enumerate(
                    _prefetch(batches(epoch)) if train.prefetch else batches(epoch)):
                t1 = time.perf_counter()  # t1 - t0: time the step waited for its batch
                seed_step(train.seed, epoch, step)  # dropout and sampled noise: the same after a resume
                out_loss = head.loss(texts, videos)
                # before the step: the weights stay finite; the features were checked finite as they loaded
                check_finite_loss(out_loss.total, out_loss.terms, epoch, step, train_split.video_ids[vids],
                                  train_split.caption_ids[caps], "--lr")
                optimizer_step(opt, out_loss.total, loop.lr(epoch, step))
                t2 = time.perf_counter()
                t_data, t_step, n_steps = t_data + (t1 - t0), t_step + (t2 - t1), n_steps + 1
                loss = loop.record(out_loss.total, out_loss.terms)
                loop.advance(f"epoch {epoch + 1}/{schedule.epochs} loss {loss:.3f} "
                             f"{len(vids) / (t2 - t0):.0f} samples/s{info}")
                t0 = time.perf_counter()
            if not loop.validates(epoch):
                continue
            val = evaluate_split(head, splits.val, train.device, train.eval_batch, train.block_texts)
            busy = max(t_data + t_step, 1e-9)
            loop.end_epoch(epoch, val, {
                **group_rates(opt),  # the rate each parameter group stepped at last
                "samples_per_s": n_steps * batch / busy, "data_share": t_data / busy,
                # wall time since the last validation (the epochs since, this validation included)
                "seconds": time.perf_counter() - t_period,
            }, {"optimizer": opt.state_dict() if opt else None})
            t_period, t_data, t_step, n_steps = time.perf_counter(), 0.0, 0.0, 0


def _finish(loop: RunLoop, head: Head, store, splits: Splits, method: str, head_cfg, train: TrainConfig,
            post: tuple[str, ...], plan: _Plan, rates: dict, lr: float, lr_source: str, batch: int, out: Path) -> dict:
    """The selected epoch evaluated once on test, beside zero-shot CLIP on the same test set; ``metrics.json``."""
    device, schedule, steps_per_epoch = torch.device(train.device), plan.schedule, plan.steps_per_epoch
    patience, plateau, max_epochs = plan.patience, plan.plateau, plan.max_epochs
    # ---- the selected epoch, evaluated once on test
    loop.selected(lambda: evaluate_split(head, splits.val, train.device, train.eval_batch, train.block_texts))
    selected = load_head(loop.checkpoints.folder / BEST, train.device)
    test = evaluate_split(selected, splits.test, train.device, train.eval_batch, train.block_texts, post=post,
                          querybank=splits.train if "qbnorm" in post else None, ranks=True)
    write_test_ranks(out, test.pop("ranks"), splits.test.caption_ids, splits.test.video_ids)
    # the zero-shot row beside the run's, on the same test set: CLIP's own cosine of the mean-pooled frames
    # (meanpool untrained; its ranking has nothing to train), which a trained head has to beat
    zero_shot = head_class("meanpool")(store_head_config(store, "meanpool")).to(device).eval()
    zero_test = evaluate_split(zero_shot, splits.test, train.device, train.eval_batch, train.block_texts)
    rows = loop.rows
    return loop.write_results(
        method, splits.val_source, test,
        schedule={"lr": lr, "lr_source": lr_source, "lr_groups": rates, "batch_size": batch,
                  "description": schedule.description, "stopped_early": loop.stopped, "lr_halvings": loop.halvings,
                  # validation (and a commit of the checkpoints) after every validate_every_epochs epochs
                  "validate_every_epochs": schedule.validate_every,
                  "validate_every_steps": schedule.validate_every * steps_per_epoch,
                  **({"patience_epochs": patience, "plateau_epochs": plateau,
                      "max_epochs": max_epochs} if train.epochs is None else {})},
        train={"samples_per_s": float(np.mean([r["samples_per_s"] for r in rows])) if rows else None,
               "data_share": float(np.mean([r["data_share"] for r in rows])) if rows else None,
               "seconds": float(sum(r["seconds"] for r in rows)),
               # what the wall times above ran with (this session's; a resumed run may differ)
               "threads": torch.get_num_threads(), "allocator": tune_allocator()},
        extras={"zero_shot": {"head": ZERO_SHOT, "test": zero_test},
                **({"zero_shot_gate": float(selected.zero_shot_gate.detach())} if head_cfg.zero_shot_start else {})})


def _data_changed(out: Path, old: dict, new: dict) -> str | None:
    """The reason a run directory's config differs, when only how the data is read changed (another memory
    budget, or another machine's memory, moved the split between memory and streaming)."""
    # compared as check_run_dir compares them: without the execution settings (the budget among them)
    then, now_all = without_keys(old, EXECUTION), without_keys(new, EXECUTION)
    if [k for k in now_all if then.get(k) != now_all[k]] == ["data"]:
        was, now = old.get("data") or {}, new["data"]
        return (f"{out} was trained with its data {was.get('mode', 'in memory')} ({was.get('order', 'a permutation')}), "
                f"and this run would read it {now['mode']} ({now['order']}), which draws other batches; choose "
                "another --out, or give the --memory-budget that reads it as before")
    return None


def _lr_changed(out: Path, old: dict, new: dict, lr: float, lr_source: str) -> str | None:
    """The reason a run directory's config differs, when only the default lr behind it changed."""
    was = old.get("resolved") or {}
    if [k for k in new if old.get(k) != new[k]] == ["resolved"] and was.get("lr") != lr and None not in (
            was.get("lr"), lr):
        return (f"{out} was trained at lr {was.get('lr'):g} ({was.get('lr_source')}), and {lr_source} is now "
                f"{lr:g}; choose another --out (add --lr {was.get('lr'):g} to train as before)")
    return None


