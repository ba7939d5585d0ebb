"""The epoch skeleton both trainers share: ``fit`` (cached features) and ``finetune`` (live CLIP).

A trainer builds its model, optimiser and batches, then drives a :class:`RunLoop`::

    loop = RunLoop(out, schedule, models={"": save_head_fn}, ...)
    loop.resume(restore)                        # the last committed epoch, if any
    with loop.progress(title):
        for epoch in loop.epochs():
            for step, batch in enumerate(batches):
                seed_step(seed, epoch, step)
                loss = ...
                optimizer_step(opt, loss, loop.lr(epoch, step))
                loop.record(loss, terms)
                loop.advance(info)
            if loop.validates(epoch):               # every epoch, or every k on a store of few steps an epoch
                loop.end_epoch(epoch, validate(), extras, state)
    best = loop.selected(validate, ...)         # the epoch selected on validation
    test = ...                                  # the selected weights on test, once
    loop.write_results(method, validation, test, extras)

What the loop owns, once for both trainers:

- **Schedule** (:class:`Schedule`): linear warmup, then cosine over a fixed number of epochs (the
  papers'), or, open-ended, a constant rate halved after ``plateau`` epochs without a better
  validation score and a stop after ``patience`` such epochs; validation after every epoch, or, on a
  store of few steps an epoch (an open-ended run), after each of the first ``validate_every`` epochs,
  then every ``validate_every``.
- **Selection**: the epoch whose validation t2v (R@1, R@5, R@10) is highest, compared in that order
  (:meth:`~tvrpipe.rundir.Scores.selection_key`); test is evaluated once, with it.
- **Checkpoints**: each validated epoch stages every model's ``last`` file, and its ``best`` file
  when validation improved, then commits them with the resume state (:class:`Checkpoints`), so a run
  cut anywhere resumes to the uninterrupted result (the epochs after the last commit are trained again,
  drawn as before).
- **Run files**: ``epochs.csv`` after every validated epoch, ``metrics.json`` and ``plots/`` at the end
  (:mod:`tvrpipe.rundir`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tvrpipe.environment import ENVIRONMENT_KEYS, run_versions
from tvrpipe.errors import ConfigError, NonFiniteError, RunError, TvrpipeError
from tvrpipe.files import file_sha256, remove_staged
from tvrpipe.heads.base import Head, TextBatch, VideoBatch, head_class
from tvrpipe.rundir import (
    BEST,
    CHECKPOINTS,
    CONFIG,
    LAST,
    SELECTION,
    Checkpoints,
    Scores,
    read_config,
    rows_from_state,
    write_config,
    write_epochs,
    write_metrics,
    write_plots,
)
from tvrpipe.training.settings import OPTIMIZERS

log = logging.getLogger(__name__)

# Writes one model's weights to a path and returns the file's sha256 (rundir.save_head, save_weights).
WriteWeights = Callable[[Path], str]


def lr_multiplier(step: int, total: int | None, warmup: int, halvings: int = 0) -> float:
    """The lr multiplier at global ``step``: warmup, then cosine to ``total`` steps, or (``total``
    None: a run until validation stops improving) constant, halved ``halvings`` times."""
    if step < warmup:
        return (step + 1) / warmup * (0.5 ** halvings if total is None else 1.0)
    if total is None:
        return 0.5 ** halvings
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class Schedule:
    """How many epochs a run trains and at which learning rate.

    Attributes:
        steps_per_epoch: optimizer steps an epoch.
        epochs: epochs to train (at most, when open-ended).
        warmup: steps of linear warmup.
        total: steps of the cosine decay; None: open-ended (constant, halved on plateaus, stopped
            after ``patience`` epochs without a better validation score).
        patience, plateau: in epochs, for an open-ended run (multiples of ``validate_every``).
        validate_every: validation (and the commit of checkpoints and resume state) after each of the first
            this many epochs, where a head at a large lr may peak and fall again within a few dozen steps,
            then after every this many epochs, and after the last.
        description: one line for ``config.yaml`` and ``metrics.json``.
    """

    steps_per_epoch: int
    epochs: int
    warmup: int
    total: int | None
    patience: int | None = None
    plateau: int | None = None
    description: str = ""
    validate_every: int = 1

    @classmethod
    def fixed(cls, steps_per_epoch: int, epochs: int, warmup_fraction: float) -> Schedule:
        """The papers' schedule: ``epochs`` epochs, warmup over ``warmup_fraction`` of the steps, then cosine."""
        total = steps_per_epoch * epochs
        return cls(steps_per_epoch, epochs, max(1, int(warmup_fraction * total)), total,
                   description=f"{epochs} epochs: warmup {warmup_fraction:g}, then cosine")

    @classmethod
    def open_ended(cls, steps_per_epoch: int, max_epochs: int, patience: int, plateau: int,
                   validate_every: int = 1) -> Schedule:
        """Until validation stops improving: warmup over the first epoch, then constant, halved after every
        ``plateau`` epochs without a better score, stopped after ``patience`` (at most ``max_epochs``), validated
        after each of the first ``validate_every`` epochs, then every ``validate_every`` (all four in epochs;
        the three counts multiples of it)."""
        every = (f"; validated after each of the first {validate_every} epochs, then every {validate_every}, "
                 f"{validate_every * steps_per_epoch} steps" if validate_every > 1 else "")
        return cls(steps_per_epoch, max_epochs, steps_per_epoch, None, patience, plateau,
                   f"until validation t2v R@1+R@5+R@10 stops improving: warmup 1 epoch, lr halved after every "
                   f"{plateau} epochs without improvement, stop after {patience} ({steps_per_epoch} steps an "
                   f"epoch{every}), at most {max_epochs} epochs", validate_every)

    def validates(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (0-based) ends with a validation: each of the first ``validate_every``, then
        every ``validate_every``-th, and the last."""
        n = epoch + 1
        return n <= self.validate_every or n % self.validate_every == 0 or n >= self.epochs

    def multiplier(self, epoch: int, step: int, halvings: int = 0) -> float:
        return lr_multiplier(epoch * self.steps_per_epoch + step, self.total, self.warmup, halvings)


def progress_score(val: Scores) -> float:
    """What early stopping watches: validation t2v R@1 + R@5 + R@10 (choice: smoother than R@1 alone
    on a few hundred validation videos, so noise neither stops a run nor halves its lr)."""
    return float(sum(val.selection_key()))


def seed_step(seed: int, epoch: int, step: int) -> None:
    """Seed torch's generators (dropout, a head's sampled noise) from (seed, epoch, step): a resumed
    run draws what the uninterrupted one drew, and every data-parallel rank draws the same.

    It seeds the CPU generator and each accelerator already in use, which are all a step can draw
    from. ``torch.manual_seed`` would also queue a lazy seed, holding a formatted stack, for every
    CUDA/XPU/MTIA backend not initialised: 0.8 ms a step on a CPU run. The model is on its device
    before the first step, so "in use" is known by then.
    """
    s = int(np.random.SeedSequence([seed, epoch, step]).generate_state(1)[0])
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(s)


RngState = tuple[torch.Tensor, torch.Tensor | None]


def rng_state(device: torch.device) -> RngState:
    """The CPU generator's state, and ``device``'s where it is a CUDA device."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: RngState, device: torch.device) -> None:
    """Put the generators back to a :func:`rng_state`."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def check_finite_loss(total: torch.Tensor, terms: Mapping[str, Any], epoch: int, step: int, videos: Sequence[str],
                      captions: Sequence[str] | None, rates: str) -> None:
    """Before a step's update, so that every checkpoint stays finite: a non-finite loss stops the run, naming
    the epoch and step (``epoch``, ``step``: 0-based), the loss and its terms, the batch's ``videos`` and
    ``captions``, the learning-rate options to lower (``rates``) and the last epoch the run keeps.

    Raises:
        NonFiniteError: ``total`` is NaN or infinite.
    """
    if bool(torch.isfinite(total.detach())):
        return

    def names(ids: Sequence[str]) -> str:
        ids = [str(i) for i in ids]
        return ", ".join(ids[:5]) + (f" (+{len(ids) - 5} more)" if len(ids) > 5 else "")
    parts = ", ".join(f"{k} {float(v):.4g}" for k, v in terms.items())
    batch = f"videos {names(videos)}" + (f" and captions {names(captions)}" if captions is not None else "")
    kept = f"epoch {epoch}" if epoch else "no epoch"
    raise NonFiniteError(
        f"epoch {epoch + 1} step {step + 1}: the loss is {float(total.detach())}" + (f" ({parts})" if parts else "")
        + f" on the batch of {batch}: training diverged; lower {rates} and train into a new --out (the run keeps "
        f"{kept} as its last finite checkpoint)")


def check_group_lr(head: Head, group_lr: Mapping[str, float] | None) -> dict[str, list[nn.Parameter]]:
    """The head's parameter groups, when ``group_lr`` names only groups it has.

    Raises:
        ConfigError: a group the head does not have, naming those it has.
    """
    groups = head.param_groups()
    unknown = sorted(set(group_lr or {}) - set(groups))
    if unknown:
        raise ConfigError(f"--group-lr {unknown[0]}: {head.name} has the parameter groups {', '.join(sorted(groups))}")
    return groups


def check_head_groups(method: str, head_cfg: Any, group_lr: Mapping[str, float]) -> None:
    """Before anything is written: every group ``group_lr`` names is one of the head's (a throwaway head is
    built without touching the random stream the run's own initialisation draws from).

    Raises:
        ConfigError: as :func:`check_group_lr`.
    """
    if group_lr:
        with torch.random.fork_rng(devices=[]):
            check_group_lr(head_class(method)(head_cfg), group_lr)


def make_optimizer(kind: str, groups: list[dict]) -> torch.optim.Optimizer | None:
    """The optimiser over ``groups`` (each with its ``lr``, ``base_lr`` and ``weight_decay``): ``adamw``
    decouples the weight decay from the gradient (Loshchilov & Hutter; X-Pool, T-MASS), ``adam`` adds it
    to the gradient as an L2 term (torch's Adam; UATVR Sec. 4.1 names Adam). None when nothing trains."""
    if kind not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    groups = [g for g in groups if g["params"]]
    if not groups:
        return None
    return (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)(groups)


def optimizer_step(opt: torch.optim.Optimizer | None, loss: torch.Tensor, multiplier: float,
                   scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0) -> None:
    """One step: every group at its ``base_lr`` times ``multiplier``, gradients (scaled by ``scaler``
    under fp16, their norm clipped to ``grad_clip`` when > 0), then the update. Without an optimiser
    (a head with nothing to train) nothing happens."""
    if opt is None:
        return
    start_step(opt, multiplier)
    (loss if scaler is None else scaler.scale(loss)).backward()
    apply_step(opt, scaler, grad_clip)


def start_step(opt: torch.optim.Optimizer, multiplier: float) -> None:
    """Before a step's backward: every group at its ``base_lr`` times ``multiplier``, no gradient left."""
    for g in opt.param_groups:
        g["lr"] = g["base_lr"] * multiplier
    opt.zero_grad(set_to_none=True)


def apply_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0) -> None:
    """After a step's backward: the gradients unscaled (``scaler``, fp16), their norm clipped to ``grad_clip``
    when > 0, then the update."""
    if scaler is None:
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], grad_clip)
        opt.step()
        return
    if grad_clip > 0:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], grad_clip)
    scaler.step(opt)
    scaler.update()


def without_keys(config: dict, keys: tuple[str, ...]) -> dict:
    """``config`` without ``keys``: top-level names (``execution``) or dotted ones (``train.device``)."""
    out = {k: v for k, v in config.items() if k not in keys}
    for key in keys:
        section, _, name = key.partition(".")
        if name and isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k != name}
    return out


def check_run_dir(out: Path, config: dict[str, Any], ignore: tuple[str, ...] = (),
                  explain: Callable[[dict, dict], str | None] | None = None,
                  assumed: Mapping[str, Any] | None = None) -> dict | None:
    """Before anything is written (a run, and the dry run of one): ``out`` is not a feature store, and a
    run already there has the same configuration, but for the keys in ``ignore`` (how and where it runs:
    top-level sections or dotted ``section.field``), the environment, and the labels of its learning
    rates' sources. Returns that run's config (None: ``out`` holds none).

    ``assumed``: what a run written before a section of the config existed did (top-level sections), read into
    its config where it lacks them (a run recorded before ``data`` read its splits in memory).

    Raises:
        ConfigError: ``out`` is a feature store, or holds another run; ``explain(old, new)`` may give the
            reason instead.
    """
    from tvrpipe.features.outputs import enclosing_folder, folder_kind
    from tvrpipe.features.store import check_not_a_store

    check_not_a_store(out, "a run")
    for folder, kind in ((out, folder_kind(out)), enclosing_folder(out) or (None, None)):
        if kind in ("a manifest", "a feature store"):
            raise ConfigError(f"--out {out}: {folder} is {kind}; a run goes into a folder of its own (e.g. runs/NAME)")

    def same(c: dict) -> dict:
        c = without_keys({k: v for k, v in c.items() if k not in ENVIRONMENT_KEYS and k != RESUMED}, ignore)
        resolved = {k: v for k, v in (c.get("resolved") or {}).items() if k != "lr_source"}
        if isinstance(resolved.get("lr_groups"), dict):
            resolved["lr_groups"] = {g: {k: v for k, v in r.items() if k != "source"} if isinstance(r, dict) else r
                                     for g, r in resolved["lr_groups"].items()}
        return {**c, "resolved": resolved}

    old = read_config(out) if (Path(out) / CONFIG).is_file() else None
    if old is not None and same({**(assumed or {}), **old}) != same(new := json.loads(json.dumps(config))):
        raise ConfigError((explain and explain(old, new)) or
                          f"{out} holds a run with another configuration; choose another --out")
    return old


# where config.yaml lists the settings of ``ignore`` (how a run executes) that a resumed invocation changed
RESUMED = "resumed_execution"


def _picked(config: dict, keys: tuple[str, ...]) -> dict:
    """The values of ``keys`` (top-level or dotted) in ``config``, flattened by key."""
    out = {}
    for key in keys:
        section, _, name = key.partition(".")
        if not name:
            out[key] = config.get(key)
        elif isinstance(config.get(section), dict):
            out[key] = config[section].get(name)
    return out


def _epochs_done(out: Path) -> int:
    """The last epoch a run directory's ``epochs.csv`` holds (its last committed epoch; 0 without one)."""
    path = out / "epochs.csv"
    lines = path.read_text().splitlines() if path.is_file() else []
    try:  # its first column; a row per epoch where every epoch was validated
        return int(lines[-1].split(",", 1)[0]) if len(lines) > 1 else 0
    except ValueError:
        return len(lines) - 1


def start_run(out: Path, config: dict[str, Any], ignore: tuple[str, ...] = (),
              explain: Callable[[dict, dict], str | None] | None = None,
              assumed: Mapping[str, Any] | None = None) -> None:
    """Write ``config.yaml`` (with the versions of this environment) and ``checkpoints/`` in the locked
    run directory ``out``, once :func:`check_run_dir` has passed. A resumed run keeps the first
    invocation's values of ``ignore`` (what its first epochs ran with) and appends each later invocation's
    changed ones to ``resumed_execution`` with the first epoch they ran (``from_epoch``; a finished run,
    which trains nothing more, adds none), so the record says what every epoch ran with. Staged files of
    a write that was killed (``.NAME.tmp-PID``) are removed: nobody else writes here while ``out`` is locked.

    Raises:
        ConfigError: ``out`` holds another run (:func:`check_run_dir`).
    """
    old = check_run_dir(out, config, ignore, explain, assumed)
    for folder in (out, out / "plots"):
        remove_staged(folder, locked=True)
    config = dict(config)
    if old is not None:
        then, now = _picked(old, ignore), _picked(json.loads(json.dumps(config)), ignore)
        history = list(old.get(RESUMED) or [])
        last = {**then, **{k: v for h in history for k, v in h.items() if k != "from_epoch"}}
        # a change counts from the first epoch it runs; a finished run trains none
        changed = {} if (out / "metrics.json").is_file() else {k: v for k, v in now.items() if last.get(k) != v}
        if changed:
            changed = {"from_epoch": _epochs_done(out) + 1, **changed}
        config = {**config, **{k: old[k] for k in ignore if "." not in k and k in old}}
        for key in (k for k in ignore if "." in k):
            section, _, name = key.partition(".")
            if isinstance(config.get(section), dict) and key in then:
                config[section] = {**config[section], name: then[key]}
        if history or changed:
            config[RESUMED] = history + ([changed] if changed else [])
    write_config(out, {**config, **run_versions(old)})
    (out / CHECKPOINTS).mkdir(exist_ok=True)


def check_head_inputs(head: Head, texts: TextBatch, videos: VideoBatch) -> None:
    """Before anything is written: ``head`` (a throwaway or the run's, untouched) takes batches of the run's
    shapes, through its loss and its evaluation, so that a config that does not fit the data (T-MASS's W with
    fewer frames than the videos have, a seqTransf shorter than them) stops the command before the run
    directory exists, not at the first step. Runs in eval mode without gradients, the random stream kept.

    Raises:
        ConfigError: the head's own message, or one naming the head and the shapes.
    """
    was_training = head.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            head.eval()
            head.loss(texts, videos)
            head.similarity(head.encode_texts(texts), head.encode_videos(videos))
    except TvrpipeError:
        raise
    except (RuntimeError, ValueError, IndexError) as e:
        raise ConfigError(f"{head.name} does not take this data (videos {tuple(videos.frames.shape)}, word tokens "
                          f"{tuple(texts.tokens.shape)}): {' '.join(str(e).split())[:200]}; check its --set options "
                          "against the features' frames and width") from None
    finally:
        head.train(was_training)


def lr_groups(groups: Mapping[str, list[nn.Parameter]], lr: float, lr_source: str,
              group_lr: Mapping[str, float], group_source: Callable[[str], str]) -> dict[str, dict[str, Any]]:
    """The learning rate each parameter group trains at, and where it comes from: ``{group: {"lr", "source"}}``
    for every group of ``groups`` that has a trainable parameter (an empty group trains at no rate; a run
    of no step records ``{}``: nothing trained at any rate). A
    group named in ``group_lr`` trains at its own rate (its source from ``group_source(name)``), the others
    at ``lr`` (``lr_source``). This, not the options, is what a run records as its learning rates."""
    return {g: ({"lr": float(group_lr[g]), "source": group_source(g)} if g in group_lr
                else {"lr": float(lr), "source": lr_source})
            for g, params in groups.items() if any(p.requires_grad for p in params)}


def setting_source(setting: str, recipe: Mapping[str, Any] | None, option: str) -> str:
    """Where a setting's value came from: the recipe a run records (:meth:`Recipe.record`), unless ``option``
    overrode it (``setting`` among its overridden settings; a group's own rate is ``group_lr.<group>``)."""
    if recipe and setting not in (recipe.get("overridden") or ()):
        return f"recipe {recipe['name']}"
    return option


def base_lr(rates: Mapping[str, Mapping[str, Any]], lr: float, lr_source: str,
            steps: int) -> tuple[float | None, str]:
    """``(lr, source)`` of a run of ``steps`` optimiser steps whose groups train at ``rates``
    (:func:`lr_groups`): ``lr`` when some group trains at it, else None, with a source that says why (no
    step at all, every group has a rate of its own, or the head has nothing to train)."""
    if steps == 0:
        return None, "none: no training step (0 epochs)"
    if any(r["source"] == lr_source for r in rates.values()):
        return lr, lr_source
    if not rates:
        return None, "none: the head has no trainable parameter"
    return None, f"none: every parameter group trains at a rate of its own ({', '.join(rates)})"


def describe_lrs(rates: Mapping[str, Mapping[str, Any]]) -> str:
    """The learning rates of :func:`lr_groups` for people: ``lr 0.001 (--lr)`` when every group trains at
    one rate from one source, else ``lr head 3e-05 (--group-lr), radius 3e-05 (recipe tmass-msrvtt)``."""
    if not rates:
        return "no training step"
    pairs = {(r["lr"], r["source"]) for r in rates.values()}
    if len(pairs) == 1:
        lr, source = pairs.pop()
        return f"lr {lr:g} ({source})"
    return "lr " + ", ".join(f"{g} {r['lr']:g} ({r['source']})" for g, r in rates.items())


def group_rates(opt: torch.optim.Optimizer | None, prefix: str = "lr_") -> dict[str, float]:
    """The rate each named group of ``opt`` (its ``name`` key) stepped at last, as ``{prefix + name: lr}``:
    an epoch's learning-rate columns, read from the optimiser rather than the options."""
    return {f"{prefix}{g['name']}": float(g["lr"]) for g in (opt.param_groups if opt else [])}


class RunLoop:
    """The epochs of one run in ``out``: resume, progress, rows, selection, checkpoints, results.

    Args:
        out: the run directory (locked by the caller, ``config.yaml`` written by :func:`start_run`).
        schedule: epochs and learning rate.
        models: ``{prefix: write}``: each model's weights, written as ``<prefix>last.safetensors`` every
            epoch and copied to ``<prefix>best.safetensors`` when validation improves (``""``: the head;
            finetune adds ``"clip_"``).
        rank, world: this process among data-parallel workers; rank 0 validates and writes.
        on_epoch: called with each epoch's row once it is committed.
    """

    def __init__(self, out: Path, schedule: Schedule, models: Mapping[str, WriteWeights], rank: int = 0,
                 world: int = 1, on_epoch: Callable[[dict], None] | None = None) -> None:
        self.out, self.schedule, self.models = Path(out), schedule, dict(models)
        self.rank, self.world, self.on_epoch = rank, world, on_epoch
        self.checkpoints = Checkpoints(self.out / CHECKPOINTS)
        self.rows: list[dict] = []
        self.best: dict | None = None  # {"epoch", "key", "val", "sha256"} of the selected epoch
        self.untrained: dict | None = None  # the validation scores of the untrained models (epoch 0)
        self.best_score: float | None = None
        self.since_best = self.halvings = 0
        self.stopped = False
        self.start_epoch = 0
        self._bar = self._task = None
        self.losses: list[float] = []  # the step losses since the last validation, and each loss term's
        self.terms: dict[str, list[float]] = {}

    # ---- resume
    def resume(self, restore: Callable[[dict], None], barrier: Callable[[], None] = lambda: None) -> dict | None:
        """Continue after the last committed epoch, if there is one: rank 0 completes (or drops) an
        interrupted epoch's files and checks them, then (after ``barrier``) every rank reads the state;
        ``restore(state)`` loads the trainer's weights and optimiser. Returns the state (None: a new run).

        Raises:
            RunError: the checkpoints are damaged (a TvrpipeError from ``restore`` keeps its message).
        """
        if not (self.checkpoints.folder / Checkpoints.STATE).is_file():
            return None
        try:
            state = self.checkpoints.load("cpu") if self.rank == 0 else None
            barrier()
            if self.rank != 0:
                state = self.checkpoints.load("cpu", check=False)
            restore(state)
        except TvrpipeError:
            raise
        except Exception as e:
            raise RunError(f"{self.out}: cannot resume, its checkpoints are damaged ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:160]}); delete {self.checkpoints.folder} to train from "
                           "scratch") from None
        self.start_epoch, self.best, self.rows = state["epoch"] + 1, state["best"], rows_from_state(state)
        self.untrained = state.get("untrained")  # None: a run begun before the untrained models competed
        if self.schedule.total is None:  # early stopping's count, kept by open-ended runs
            self.best_score, self.since_best = state["best_score"], state["since_best"]
            self.halvings, self.stopped = state["halvings"], state["stopped"]
        if self.rank == 0:
            log.info("resuming %s from epoch %d", self.out, self.start_epoch)
            if self.rows:  # the log of the last committed epoch, had the run stopped before writing it
                write_epochs(self.out, self.rows)
        return state

    def begin(self, validate: Callable[[], dict]) -> None:
        """Before the first epoch of a new run, on rank 0: the untrained models, validated and written as the
        best (epoch 0). An epoch is then selected only where it beats its start on validation, so a run never
        returns a head worse than the one it started from (a learning rate that wrecks a head selects epoch 0).
        Early stopping still counts from the first trained epoch: heads that dip before they climb are not cut.
        A resumed run keeps the selection it recorded."""
        if self.rank != 0 or self.start_epoch > 0 or self.best is not None:
            return
        val = self.untrained = validate()
        self.checkpoints.folder.mkdir(parents=True, exist_ok=True)
        sha = {prefix: write(self.checkpoints.folder / f"{prefix}{BEST}") for prefix, write in self.models.items()}
        self.best = {"epoch": 0, "key": list(Scores.from_dict(val).selection_key()), "val": val, "sha256": sha[""]}

    # ---- the loop
    @contextmanager
    def progress(self, title: str, enabled: bool = True) -> Iterator[None]:
        """A progress bar over the steps left (time remaining, the trainer's line of ``info``)."""
        from tvrpipe.progress import progress_bar

        left = self.schedule.steps_per_epoch * max(0, self.schedule.epochs - self.start_epoch)
        bar = progress_bar(field="info", eta=True, enabled=enabled)
        with bar:
            self._bar, self._task = bar, bar.add_task(title, total=left, info="")
            try:
                yield
            finally:
                self._bar = self._task = None

    def advance(self, info: str) -> None:
        """One step done; ``info`` is shown beside the bar."""
        if self._bar is not None:
            self._bar.update(self._task, advance=1, info=info)

    def epochs(self) -> Iterator[int]:
        """The epochs left to train (0-based), until the schedule ends or early stopping stops it."""
        for epoch in range(self.start_epoch, self.schedule.epochs):
            if self.stopped:
                return
            yield epoch

    def record(self, total: torch.Tensor, terms: Mapping[str, Any]) -> float:
        """A step's loss and its terms, for the epoch's row; returns the loss."""
        self.losses.append(float(total.detach()))
        for k, v in terms.items():
            self.terms.setdefault(k, []).append(float(v))
        return self.losses[-1]

    def validates(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` ends with validation and :meth:`end_epoch` (:meth:`Schedule.validates`)."""
        return self.schedule.validates(epoch)

    def lr(self, epoch: int, step: int) -> float:
        """The lr multiplier of a step (halvings included)."""
        return self.schedule.multiplier(epoch, step, self.halvings)

    def validation_info(self) -> str:
        """Where validation stands, for the progress line ("" before the first epoch)."""
        if not (self.rows and self.best):
            return ""
        return f" | val R@1 {self.rows[-1]['val_t2v_R@1']:.1f} (best {self.best['val']['t2v']['R@1']:.1f})"

    def end_epoch(self, epoch: int, val: dict, extras: Mapping[str, Any], state: Mapping[str, Any]) -> dict:
        """Rank 0, after epoch ``epoch``'s validation ``val`` (an epoch that :meth:`validates`): its row (the
        mean of the losses :meth:`record` saw since the last validation, ``extras``: the trainer's own columns),
        its checkpoints and the selection, early stopping (the epochs since the last validation count as epochs
        without a better score), and one commit with the trainer's resume ``state`` (optimiser, ...); then ``epochs.csv``.
        Returns the row."""
        scores = Scores.from_dict(val)
        row = {"epoch": epoch + 1, "loss": float(np.mean(self.losses)) if self.losses else float("nan"),
               **{f"loss_{k}": float(np.mean(v)) for k, v in self.terms.items()},
               **{f"val_t2v_{k}": v for k, v in val["t2v"].items() if k != "n"},
               **{f"val_v2t_{k}": v for k, v in val["v2t"].items() if k != "n"},
               **scores.readout_columns(), **extras}
        self.rows.append(row)
        self.losses, self.terms = [], {}
        for prefix, write in self.models.items():
            self.checkpoints.stage(f"{prefix}{LAST}", write)
        if self.best is None or scores.selection_key() > tuple(self.best["key"]):
            sha = {prefix: self.checkpoints.stage_copy(f"{prefix}{BEST}", f"{prefix}{LAST}") for prefix in self.models}
            self.best = {"epoch": epoch + 1, "key": list(scores.selection_key()), "val": val, "sha256": sha[""]}
        score = progress_score(scores)
        if self.best_score is None or score > self.best_score:
            self.best_score, self.since_best = score, 0
        else:
            gap = epoch + 1 - (self.rows[-2]["epoch"] if len(self.rows) > 1 else 0)  # epochs since the last validation
            self.since_best += gap  # in epochs
            if self.schedule.total is None:  # open-ended: halve on plateaus, stop when patience runs out
                if self.since_best // self.schedule.plateau > (self.since_best - gap) // self.schedule.plateau:
                    self.halvings += 1
                self.stopped = self.since_best >= self.schedule.patience
        stopping = {"best_score": self.best_score, "since_best": self.since_best, "halvings": self.halvings,
                    "stopped": self.stopped} if self.schedule.total is None else {}
        self.checkpoints.commit({"epoch": epoch, "best": self.best, "untrained": self.untrained,
                                 "rows": json.dumps(self.rows), **stopping, **state})
        write_epochs(self.out, self.rows)
        if self.on_epoch is not None:
            self.on_epoch(row)
        return row

    # ---- the end
    def selected(self, validate: Callable[[], dict]) -> dict:
        """The selected epoch, ``best``; with no epoch trained (``--epochs 0``) the untrained models,
        validated and saved as best. Checks that ``best.safetensors`` is the file validation chose.

        Raises:
            RunError: the best checkpoint changed after it was written.
        """
        folder = self.checkpoints.folder
        if self.best is None:  # zero epochs without begin(): evaluate the untrained (zero-shot) models
            val = validate()
            sha = {prefix: write(folder / f"{prefix}{BEST}") for prefix, write in self.models.items()}
            self.best = {"epoch": 0, "key": None, "val": val, "sha256": sha[""]}
        path = folder / BEST
        if self.best.get("sha256") and path.is_file() and file_sha256(path) != self.best["sha256"]:
            raise RunError(f"{path} changed after it was written (sha256 mismatch); delete {self.out} and train again")
        return self.best

    def write_results(self, method: str, validation: str, test: dict, schedule: Mapping[str, Any],
                      train: Mapping[str, Any], extras: Mapping[str, Any] = {}) -> dict:  # noqa: B006 (read only)
        """``metrics.json``, one shape for both trainers: the selected epoch, its validation and test scores, the
        checkpoint, ``schedule`` (what trained: ``lr_groups``, ``batch_size``, ``description``; ``epochs_run``, the
        last epoch trained, is added), ``train`` (throughput), then the trainer's ``extras``; and the plots."""
        best = self.best
        metrics = {"method": method, "selected_epoch": best["epoch"], "selection": SELECTION,
                   "validation": validation, "val": best["val"], "test": test,
                   # what selection compared the epochs against: the untrained models on validation
                   **({"untrained_val": self.untrained} if self.untrained is not None else {}),
                   "checkpoint": {"file": f"{CHECKPOINTS}/{BEST}", "sha256": best.get("sha256")},
                   "schedule": {**schedule, "epochs_run": self.rows[-1]["epoch"] if self.rows else 0},
                   "train": dict(train), **extras}
        write_metrics(self.out, metrics)
        if self.rows:
            write_plots(self.out, self.rows, Scores.from_dict(best["val"]).readout_groups())
        return metrics
