"""``fit``: train a head on a cached feature store; ``evaluate_run``: score a trained run.

The loop reads top to bottom: data, model, optimiser, schedule, loop, validation, checkpoint.

Protocol (DESIGN.md, "Evaluation protocol"): the epoch is selected on the **validation** split
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
resume state are committed together (:class:`Checkpoints`), so a run cut anywhere resumes to the
uninterrupted result.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

from tvrpipe.environment import ENVIRONMENT_KEYS, run_versions
from tvrpipe.errors import ConfigError, NonFiniteError, RunError, TvrpipeError, writing
from tvrpipe.heads.base import Head, HeadConfig, clip_head_config, create_head, head_class
from tvrpipe.lock import check_writable, locked
from tvrpipe.features.store import atomic_write_text, file_sha256, open_store, store_identity
from tvrpipe.training.allocator import tune_allocator
from tvrpipe.training.data import SplitData, Splits, load_split, load_splits, store_split_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Trainer settings; defaults follow the papers where they agree, and validation elsewhere.

    With ``epochs`` None (the default) a run trains until validation stops improving: linear
    warmup over the first epoch, then a constant learning rate, halved after ``plateau`` epochs
    without a better validation score (t2v R@1 + R@5 + R@10), stopping after ``patience`` such
    epochs (at most ``max_epochs``); on a store with few steps an epoch these three scale up so that
    patience covers ``min_steps`` optimizer steps (:func:`open_ended_epochs`). The checkpoint is
    still selected on t2v (R@1, R@5, R@10). With ``epochs`` set, the schedule is the papers' warmup
    + cosine over exactly that many epochs. ``lr`` None takes the head's ``default_lr`` at the
    store's width D (:meth:`Head.lr_for`). The evidence for these defaults is in docs/training.md
    (``tvrpipe bench convergence``).
    """

    epochs: int | None = None  # choice: until validation stops improving (issue 8); papers: 5 end-to-end
    max_epochs: int = 60  # choice: cap of a run without --epochs (stopping comes far earlier on the grid)
    patience: int = 8  # choice: epochs without a better validation score before stopping (docs/training.md)
    plateau: int = 3  # choice: epochs without a better validation score before the lr halves
    # choice: no stop before this many optimizer steps without a better validation score: progress per
    # epoch depends on the steps in an epoch, so on a store with fewer than min_steps / patience steps
    # an epoch, patience, plateau and max_epochs all scale up by the same factor (open_ended_epochs)
    min_steps: int = 300
    batch_size: int = 128  # CLIP4Clip Sec. 4.1: batch 128
    lr: float | None = None  # None: the head's default_lr at the store's D (validation curves, docs/training.md)
    weight_decay: float = 0.2  # X-Pool Sec. 4 / CLIP: AdamW weight decay 0.2
    warmup_fraction: float = 0.1  # CLIP4Clip: warmup proportion 0.1, then cosine (runs with --epochs)
    seed: int = 0
    eval_batch: int = 256  # items per encode call at evaluation
    block_texts: int = 256  # texts per similarity block at evaluation (memory bound)
    device: str = "cpu"
    prefetch: bool = True  # choice: build the next batch in a thread (see docs/performance.md for 2-core CPUs)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option; reads and creates nothing."""
        if self.epochs is not None and self.epochs < 0:
            raise ConfigError(f"--epochs must be >= 0 (0: evaluate the untrained head), got {self.epochs}")
        for opt, value in (("--max-epochs", self.max_epochs), ("--patience", self.patience),
                           ("plateau", self.plateau)):
            if value < 1:
                raise ConfigError(f"{opt} must be >= 1, got {value}")
        if self.min_steps < 0:
            raise ConfigError(f"min_steps must be >= 0, got {self.min_steps}")
        if self.batch_size < 2:
            raise ConfigError(f"--batch-size must be >= 2 (a contrastive batch needs negatives), got {self.batch_size}")
        if self.lr is not None and (not self.lr > 0 or not math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a finite number > 0, got {self.lr}")
        if not self.weight_decay >= 0 or not math.isfinite(self.weight_decay):
            raise ConfigError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0.0 <= self.warmup_fraction <= 1.0:
            raise ConfigError(f"warmup_fraction must be between 0 and 1, got {self.warmup_fraction}")
        for opt, value in (("eval_batch", self.eval_batch), ("block_texts", self.block_texts)):
            if value < 1:
                raise ConfigError(f"{opt} must be >= 1, got {value}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"--device must be cpu or cuda (cuda:N), got {self.device!r}")


def open_ended_epochs(train: TrainConfig, steps_per_epoch: int) -> tuple[int, int, int]:
    """(patience, plateau, max_epochs) in epochs for a run without ``epochs``, on a store of
    ``steps_per_epoch`` optimizer steps an epoch.

    Progress per epoch depends on the steps in it, so all three count epochs of at least
    ``min_steps / patience`` steps: on a store with fewer steps an epoch they are multiplied by
    ``f = min_steps / (patience * steps_per_epoch)`` (rounded up), which makes patience cover
    ``min_steps`` steps. ``f`` is at least 1 (bigger stores keep the configured epochs). E.g. the
    defaults (8, 3, 60, 300 steps): 63 steps an epoch (MSR-VTT 9k) -> (8, 3, 60); 15 -> (20, 8, 150);
    3 -> (100, 38, 750).

    Example:
        >>> open_ended_epochs(TrainConfig(), 15)
        (20, 8, 150)
    """
    f = max(1.0, train.min_steps / (train.patience * steps_per_epoch))
    patience, plateau, max_epochs = (math.ceil(round(n * f, 6))  # round: 10.000000001 is 10 epochs
                                     for n in (train.patience, train.plateau, train.max_epochs))
    return patience, plateau, max(max_epochs, patience + 1)


def _schedule(step: int, total: int | None, warmup: int, halvings: int = 0) -> float:
    """The lr multiplier at global ``step``: warmup, then cosine to ``total`` steps, or (``total``
    None: a run until validation stops improving) constant, halved ``halvings`` times."""
    if step < warmup:
        return (step + 1) / warmup * (0.5 ** halvings if total is None else 1.0)
    if total is None:
        return 0.5 ** halvings
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def resolved_lr(method: str, train: TrainConfig, embed_dim: int) -> tuple[float, str]:
    """The learning rate a run on features of width ``embed_dim`` uses and where it comes from
    (``--lr``, or the head's ``default_lr``: read at that width where the head gives one per width)."""
    if train.lr is not None:
        return train.lr, "--lr"
    cls = head_class(method)
    width = f" at D={embed_dim}" if isinstance(cls.default_lr, Mapping) else ""
    return cls.lr_for(embed_dim), f"{method}.default_lr{width}"


def _evaluate(head: Head, split: SplitData, cfg: TrainConfig, post=(), querybank: SplitData | None = None,
              readouts: bool = True) -> dict:
    from tvrpipe.evaluation.engine import evaluate_head

    dev = torch.device(cfg.device)
    return evaluate_head(
        head,
        (b.to(dev) for b in split.text_batches(cfg.eval_batch, head.uses_tokens)),
        (b.to(dev) for b in split.video_batches(cfg.eval_batch)),
        split.text_video,
        block_texts=cfg.block_texts,
        device=cfg.device,
        post=post,
        querybank=None if querybank is None else (b.to(dev) for b in querybank.text_batches(cfg.eval_batch,
                                                                                           head.uses_tokens)),
        text_ids=split.caption_ids,
        video_ids=split.video_ids,
        readouts=readouts,
    )


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


def _key(metrics: dict) -> tuple[float, float, float]:
    t = metrics["t2v"]
    return (t["R@1"], t["R@5"], t["R@10"])


def _progress_score(metrics: dict) -> float:
    """What early stopping watches: validation t2v R@1 + R@5 + R@10 (choice: smoother than R@1
    alone on a few hundred validation videos, so noise neither stops a run nor halves its lr)."""
    t = metrics["t2v"]
    return t["R@1"] + t["R@5"] + t["R@10"]


def save_weights(state_dict: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str],
                 what: str) -> str:
    """Write ``state_dict`` to ``path`` as safetensors, through a temporary file and a rename;
    returns the file's sha256.

    The bytes depend only on the tensors and ``metadata``: safetensors writes the metadata keys in
    an order that changes from process to process (a Rust HashMap), so the header is rewritten with
    them sorted, at its own length (no tensor moves). Two identical runs write identical files.

    Raises:
        NonFiniteError: a weight is NaN or infinite (such a state is never written); ``what``
            names the model in the message.
        WriteError: the file cannot be written (a full disk, ...), naming ``path``.
    """
    state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise NonFiniteError(f"{what}: weights {', '.join(bad[:5])} are NaN or infinite; not saved to {path}")
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        _write_safetensors(state, tmp, metadata)
        os.replace(tmp, path)
    return file_sha256(path)


def _write_safetensors(state: Mapping[str, torch.Tensor], tmp: Path, metadata: dict[str, str]) -> None:
    """safetensors' file, its metadata keys rewritten in sorted order (:func:`save_weights`)."""
    save_file(state, str(tmp), metadata=metadata)
    with open(tmp, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
            text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
            if len(text) <= n:  # the same keys and values: the same length, or less with padding dropped
                f.seek(8)
                f.write(text.ljust(n))  # safetensors pads its header with spaces too


def _save_checkpoint(head: Head, path: Path) -> str:
    """Write the head's weights (head name and config inside); returns the file's sha256.

    Raises:
        NonFiniteError: a weight is NaN or infinite (such a state is never written).
    """
    metadata = {"head": head.name, "config": json.dumps(dataclasses.asdict(head.config))}
    return save_weights(head.state_dict(), path, metadata, head.name)


def store_head_config(store, method: str, overrides: dict[str, Any] | None = None) -> HeadConfig:
    """The config of ``method`` trained on ``store``: D and the CLIP's logit scale from the store's
    provenance (:func:`clip_head_config`), then the user's ``overrides`` (unknown keys fail)."""
    return clip_head_config(method, int(store.provenance["embed_dim"]), store.provenance.get("logit_scale"),
                            overrides)


def load_head(checkpoint: str | os.PathLike[str], device: str = "cpu") -> Head:
    """Rebuild a head from a safetensors checkpoint written by :func:`fit` (name + config inside).

    Raises:
        RunError: the file is missing, not a checkpoint of this format, or does not fit its head.
        NonFiniteError: a weight is NaN or infinite.
    """
    from safetensors import safe_open

    path = Path(checkpoint)
    if not path.is_file():
        raise RunError(f"{path}: no such checkpoint; if its training was interrupted, rerun the same "
                       "`tvrpipe train-head` (it resumes), else delete the run directory and train it again")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        head = create_head(meta["head"], **json.loads(meta["config"]))
        head.load_state_dict(load_file(str(path), device=device))
    except TvrpipeError:
        raise
    except Exception as e:  # safetensors, JSON, missing metadata, shape mismatch
        raise RunError(f"{path} is damaged ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                       "delete the run directory and train it again") from None
    bad = [k for k, v in head.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise NonFiniteError(f"{path}: weights {', '.join(bad[:5])} are NaN or infinite; "
                             "delete the run directory and train it again")
    return head.to(device).eval()


def checkpoint_similarity(checkpoint: str | os.PathLike[str], split: SplitData,
                          device: str = "cpu") -> np.ndarray:
    """The raw float32 ``(n_text, n_video)`` scores of a checkpoint (:func:`load_head`) on every caption
    and video of ``split``, through the evaluation engine: the scores behind a run's metrics there."""
    from tvrpipe.evaluation.engine import encode_all, similarity_matrix

    head = load_head(checkpoint, device)
    video_emb = encode_all(head.encode_videos, split.video_batches(256), device)
    text_emb = encode_all(head.encode_texts, split.text_batches(256, head.uses_tokens), device)
    return similarity_matrix(head, text_emb, video_emb, device=device).numpy()


def _read_config(run: Path) -> dict:
    """A run's config.yaml, checked for the keys evaluation and resuming need."""
    path = run / "config.yaml"
    if not path.is_file():
        raise RunError(f"{run}: not a run directory (no config.yaml); train one with `tvrpipe train-head`")
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise RunError(f"{path} is not valid YAML{line}; restore it or train the run again "
                       "into a new --out") from None
    need = ("method", "head", "train", "features", "provenance")  # a finetune run has "finetune" for "train"
    missing = [k for k in need if not isinstance(config, dict) or (
        k not in config and not (k == "train" and "finetune" in config))]
    if missing:
        raise RunError(f"{path} lacks {', '.join(missing)}; restore it or train the run again into a new --out")
    return config


def _nonfinite_loss(out_loss, epoch: int, step: int, vids: np.ndarray, caps: np.ndarray, split: SplitData,
                    last_epoch: int) -> NonFiniteError:
    terms = ", ".join(f"{k} {float(v):.4g}" for k, v in out_loss.terms.items())

    def names(ids: np.ndarray) -> str:
        return ", ".join(map(str, ids[:5])) + (f" (+{len(ids) - 5} more)" if len(ids) > 5 else "")
    kept = f"epoch {last_epoch}" if last_epoch else "no epoch"
    return NonFiniteError(
        f"epoch {epoch} step {step}: the loss is {float(out_loss.total.detach())} ({terms}) on the batch of "
        f"videos {names(split.video_ids[vids])} and captions {names(split.caption_ids[caps])}; their features "
        f"are finite, so training diverged: lower --lr and train into a new --out (the run keeps {kept} "
        "as its last finite checkpoint)"
    )


def write_rows(rows: list[dict], path: Path) -> None:
    """The per-epoch log as CSV (columns of the last row), written atomically."""
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=list(rows[-1]))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, text.getvalue())


def rows_from_state(state: dict) -> list[dict]:
    """The epoch rows of a resume state (``state.pt``). They are kept as one JSON text (floats
    round-trip exactly): pickled as a list, every value is a separate object for torch.save, so
    rewriting the state each epoch took O(epochs^2) time (1.1 s of a 174-epoch run of 4-step
    epochs). A state written before that holds the list itself."""
    rows = state["rows"]
    return json.loads(rows) if isinstance(rows, str) else rows


class Checkpoints:
    """A run's ``checkpoints/`` folder, changed one epoch at a time, as one commit.

    An epoch writes several files (the head's last weights, its best when validation improved,
    finetune's CLIP beside them) and the resume state, ``state.pt``. Each file is replaced
    atomically, but not all of them at once: a run interrupted between them would hold epoch e's
    weights beside epoch e-1's state, and resuming would train epoch e again from epoch e's weights
    with epoch e-1's optimiser (and a best checkpoint the state knows nothing of). So an epoch's
    files are written under staging names (``.NAME.next``); ``commit`` then writes the state with
    every file's sha256 (the commit point) and renames the staged files into place. ``load`` finishes
    the renames of a committed epoch, drops the staged files of an uncommitted one, and checks every
    file the state names against its sha256.
    """

    STATE = "state.pt"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str, str] = {}  # name -> sha256 of the committed files
        self._staged: dict[str, str] = {}

    def _next(self, name: str) -> Path:
        return self.folder / f".{name}.next"

    def stage(self, name: str, write: Callable[[Path], str]) -> str:
        """Write file ``name`` of this epoch with ``write(path)`` (which returns its sha256) under its
        staging name; it takes ``name``'s place at :meth:`commit`. Returns the sha256."""
        self._staged[name] = write(self._next(name))
        return self._staged[name]

    def stage_copy(self, name: str, source: str) -> str:
        """Stage ``name`` as a copy of ``source`` (staged this epoch, or committed)."""
        src = self._next(source) if source in self._staged else self.folder / source
        sha = self._staged.get(source) or self.files[source]

        def copy(path: Path) -> str:
            tmp = path.with_name(f"{path.name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
            return sha
        return self.stage(name, copy)

    def commit(self, state: dict) -> None:
        """Write ``state`` (with the sha256 of every file, as ``files``) as ``state.pt``, then move
        this epoch's staged files into place."""
        files = {**self.files, **self._staged}
        tmp = self.folder / f".{self.STATE}.tmp"
        with writing(self.folder / self.STATE):
            torch.save({**state, "files": files}, tmp)
            os.replace(tmp, self.folder / self.STATE)
        for name in self._staged:
            os.replace(self._next(name), self.folder / name)
        self.files, self._staged = files, {}

    def load(self, map_location: str | None = None, check: bool = True) -> dict | None:
        """The last committed state (None when there is none), its files completed and checked
        (``check=False``: read as they are, for a process beside the one that checked them).

        Raises:
            ValueError: a file the state names is missing or does not match its sha256.
        """
        path = self.folder / self.STATE
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=False, map_location=map_location)
        files = state.get("files") or {}  # a state written before commits recorded files: none to check
        self.files = dict(files)
        if not check:
            return state
        for staged in self.folder.glob(".*.next"):
            name = staged.name[1:-len(".next")]
            if name in files and file_sha256(staged) == files[name]:
                os.replace(staged, self.folder / name)  # committed, not yet moved into place
            else:
                staged.unlink()  # an epoch that was not committed
        for partial in self.folder.glob(".*.tmp"):  # a file cut off as it was written
            partial.unlink()
        for name, sha in files.items():
            if not (self.folder / name).is_file():
                raise ValueError(f"{name} is missing")
            if file_sha256(self.folder / name) != sha:
                raise ValueError(f"{name} does not match the sha256 that {self.STATE} recorded for it")
        return state


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict, out: Path) -> None:
    """Resume ``opt`` from a checkpoint's optimizer state.

    Raises:
        RunError: the state was saved for other parameters: the run was started by a tvrpipe whose head
            had other parameters (e.g. prota before its token-weight MLPs lost their dead output bias).
            Its weights still load (``tvrpipe evaluate``); its training cannot continue.
    """
    have = [len(g["params"]) for g in opt.param_groups]
    was = [len(g["params"]) for g in saved.get("param_groups", [])]
    if have != was:
        raise RunError(f"{out}: cannot resume: its optimizer state is for {sum(was)} parameter tensors and the "
                       f"head now has {sum(have)} (the run was started by an earlier tvrpipe whose head had other "
                       f"parameters); its checkpoints still load for `tvrpipe evaluate`. Delete "
                       f"{out / 'checkpoints'} to train it again with this version")
    opt.load_state_dict(saved)


def _same_run(a: dict, b: dict) -> bool:
    """Two run configs describe the same run: equal but for the label of the lr's source, which may
    change with tvrpipe (``xpool.default_lr`` becoming ``xpool.default_lr at D=512``)."""
    def strip(c: dict) -> dict:
        c = {k: v for k, v in c.items() if k not in ENVIRONMENT_KEYS}  # a run may resume in another environment
        return {**c, "resolved": {k: v for k, v in (c.get("resolved") or {}).items() if k != "lr_source"}}
    return strip(a) == strip(b)


def _flat_readouts(metrics: dict) -> dict[str, float]:
    """``val_<name>`` for item readouts, ``val_<name>_match`` / ``_nonmatch`` for pair readouts."""
    flat = {}
    for name, r in metrics.get("readouts", {}).items():
        flat.update({f"val_{name}_{kind}": v for kind, v in r.items()} if isinstance(r, dict) else {f"val_{name}": r})
    return flat


def _plots(rows: list[dict], out: Path, groups: dict[str, list[str]] | None = None) -> None:
    """loss.png, val_r1.png and, with ``groups`` ({readout: [kinds]}, "" for a single value), readouts.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(exist_ok=True)
    epochs = [r["epoch"] for r in rows]
    for key, name, ylabel in (("loss", "loss.png", "training loss"), ("val_t2v_R@1", "val_r1.png", "val t2v R@1 (%)")):
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        ax.plot(epochs, [r[key] for r in rows], marker="o")
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    # the head's readouts (pair readouts: matching vs non-matching pairs; query readouts: correct vs
    # incorrect top-1; item readouts: one line) against validation R@1
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.4), squeeze=False)
        for ax, (name, kinds) in zip(axes[0], groups.items()):
            for kind, marker in zip(kinds, "osd^"):
                key = f"val_{name}_{kind}" if kind else f"val_{name}"
                ax.plot(epochs, [r[key] for r in rows], marker=marker, label=kind or name)
            ax.set_xlabel("epoch")
            ax.set_ylabel(f"val mean {name}")
            r1 = ax.twinx()
            r1.plot(epochs, [r["val_t2v_R@1"] for r in rows], color="grey", ls="--", label="val t2v R@1")
            r1.set_ylabel("val t2v R@1 (%)")
            lines = ax.get_legend_handles_labels()[0] + r1.get_legend_handles_labels()[0]
            ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "readouts.png", dpi=100)
        plt.close(fig)


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
        on_epoch: called after each epoch, once it is saved, with its ``epochs.csv`` row (``bench
            convergence`` logs a line per epoch of its hours-long runs with it).

    Returns:
        The run's metrics (also in ``out_dir/metrics.json``).

    Example:
        >>> fit("features/msrvtt-vitb32", "xpool", "runs/xpool", TrainConfig(epochs=5))  # doctest: +SKIP
    """
    # ---- options and data (nothing is written before they are checked)
    train.validate()
    check_writable(out_dir, "--out")
    store = open_store(features)
    head_cfg = store_head_config(store, method, overrides)
    if store.provenance.get("logit_scale") is None and "generator" not in store.provenance \
            and "logit_scale_init" not in (overrides or {}):
        log.warning("%s records no learned CLIP logit scale (extracted before tvrpipe recorded it): %s starts "
                    "at CLIP's initial scale 1/0.07, not the learned one the papers reuse; run the same extract again "
                    "(it records the scale and re-extracts nothing), or pass --set logit_scale_init=LOG_SCALE "
                    "(4.6052 for OpenAI's CLIP)", features, method)
    splits: Splits = load_splits(store, tokens=head_class(method).uses_tokens)  # no word tokens for a sentence head
    train_split = splits.train
    if train_split.n_videos < 2:
        raise ConfigError("the training split needs at least 2 videos")
    out = Path(out_dir)
    tune_allocator()  # a step's large temporaries reused from the heap, not re-faulted (allocator.py)
    with locked(out, "--out"):
        return _train(store, splits, method, head_cfg, out, train, post, progress, max_steps, features, on_epoch)


def _train(store, splits: Splits, method: str, head_cfg, out: Path, train: TrainConfig, post: tuple[str, ...],
           progress: bool, max_steps: int | None, features, on_epoch: Callable[[dict], None] | None) -> dict:
    """The training run proper, with the run directory locked."""
    train_split = splits.train
    lr, lr_source = resolved_lr(method, train, head_cfg.embed_dim)
    open_ended = train.epochs is None
    steps_per_epoch = max(1, train_split.n_videos // train.batch_size)
    if max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, max_steps)
    patience, plateau, max_epochs = open_ended_epochs(train, steps_per_epoch)
    schedule = (f"until validation t2v R@1+R@5+R@10 stops improving: warmup 1 epoch, lr halved after every "
                f"{plateau} epochs without improvement, stop after {patience} ({steps_per_epoch} steps an "
                f"epoch), at most {max_epochs} epochs"
                if open_ended else f"{train.epochs} epochs: warmup {train.warmup_fraction:g}, then cosine")
    config = {
        "method": method,
        "head": dataclasses.asdict(head_cfg),
        "train": dataclasses.asdict(train),
        "resolved": {"lr": lr, "lr_source": lr_source, "schedule": schedule},
        "post": list(post),
        "features": str(Path(features).resolve()),
        "provenance": store_identity(store.provenance),
        "validation": splits.val_source,
        "max_steps": max_steps,
    }
    cfg_path = out / "config.yaml"
    if cfg_path.is_file() and not _same_run(old := _read_config(out), new := json.loads(json.dumps(config))):
        was = old.get("resolved") or {}
        if [k for k in new if old.get(k) != new[k]] == ["resolved"] and was.get("lr") != lr:  # a changed default
            raise ConfigError(f"{out} was trained at lr {was.get('lr'):g} ({was.get('lr_source')}), and "
                              f"{lr_source} is now {lr:g}; choose another --out (add --lr {was.get('lr'):g} to train "
                              "as before)")
        raise ConfigError(f"{out} holds a run with another configuration; choose another --out")
    config.update(run_versions(old if cfg_path.is_file() else None))
    atomic_write_text(cfg_path, yaml.safe_dump(config, sort_keys=False))
    (out / "checkpoints").mkdir(exist_ok=True)

    # ---- model, optimiser, schedule
    device = torch.device(train.device)
    torch.manual_seed(train.seed)
    head = head_class(method)(head_cfg).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=train.weight_decay) if params else None
    batch = min(train.batch_size, train_split.n_videos)
    n_epochs = max_epochs if open_ended else train.epochs
    if open_ended:  # warmup over the first epoch, then constant (halved on plateaus)
        total, warmup = None, steps_per_epoch
    else:
        total, warmup = steps_per_epoch * n_epochs, max(1, int(train.warmup_fraction * steps_per_epoch * n_epochs))
    by_video = np.argsort(train_split.text_video, kind="stable")  # caption rows grouped by video
    counts = np.bincount(train_split.text_video, minlength=train_split.n_videos)
    first = np.cumsum(counts) - counts  # where each video's captions start in by_video

    # ---- resume
    rows: list[dict] = []
    start_epoch, best = 0, None
    best_score, since_best, halvings, stopped = None, 0, 0, False  # early stopping (runs without --epochs)
    ckpt = Checkpoints(out / "checkpoints")
    if (ckpt.folder / ckpt.STATE).is_file():
        try:
            state = ckpt.load()
            last = load_head(ckpt.folder / "last.safetensors", str(device))
            head.load_state_dict(last.state_dict())
            if opt:
                load_optimizer_state(opt, state["optimizer"], out)
            start_epoch, best, rows = state["epoch"] + 1, state["best"], rows_from_state(state)
            best_score, since_best = state["best_score"], state["since_best"]
            halvings, stopped = state["halvings"], state["stopped"]
        except TvrpipeError:
            raise
        except Exception as e:
            raise RunError(f"{out}: cannot resume, its checkpoints are damaged ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:160]}); delete {out / 'checkpoints'} to train from "
                           "scratch") from None
        log.info("resuming %s from epoch %d", out, start_epoch)
        if rows:  # the log of the last committed epoch, had the run stopped before writing it
            write_rows(rows, out / "epochs.csv")

    # ---- loop
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn(), disable=not progress)
    with bar:
        task = bar.add_task(method, total=steps_per_epoch * (n_epochs - start_epoch), info="")
        for epoch in range(start_epoch, n_epochs):
            if stopped:
                break
            t_epoch = time.perf_counter()
            head.train()
            rng = np.random.default_rng([train.seed, epoch])
            order = rng.permutation(train_split.n_videos)
            t_data = t_step = 0.0
            losses: list[float] = []
            terms: dict[str, list[float]] = {}

            def batches():  # one caption per video, drawn at random; built one step ahead
                for s in range(steps_per_epoch):
                    vids = order[s * batch : (s + 1) * batch]
                    caps = by_video[first[vids] + (rng.random(len(vids)) * counts[vids]).astype(np.int64)]
                    yield (vids, caps, train_split.text_batch(caps, head.uses_tokens, trim=True).to(device),
                           train_split.video_batch(vids).to(device))

            last_val = f" | val R@1 {rows[-1]['val_t2v_R@1']:.1f} (best {best['val']['t2v']['R@1']:.1f})" \
                if rows and best else ""  # the bar shows where validation stands
            t0 = time.perf_counter()
            for step, (vids, caps, texts, videos) in enumerate(_prefetch(batches()) if train.prefetch else batches()):
                n = len(vids)
                t1 = time.perf_counter()  # t1 - t0: time the step waited for its batch
                seed_step(train.seed, epoch, step)  # dropout and sampled noise: the same after a resume
                out_loss = head.loss(texts, videos)
                if not torch.isfinite(out_loss.total.detach()):  # before the step: the weights stay finite
                    raise _nonfinite_loss(out_loss, epoch + 1, step + 1, vids, caps, train_split, epoch)
                if opt:
                    for g in opt.param_groups:
                        g["lr"] = lr * _schedule(epoch * steps_per_epoch + step, total, warmup, halvings)
                    opt.zero_grad(set_to_none=True)
                    out_loss.total.backward()
                    opt.step()
                t2 = time.perf_counter()
                t_data, t_step = t_data + (t1 - t0), t_step + (t2 - t1)
                losses.append(float(out_loss.total.detach()))
                for k, v in out_loss.terms.items():
                    terms.setdefault(k, []).append(float(v))
                bar.update(task, advance=1, info=f"epoch {epoch + 1}/{n_epochs} loss {losses[-1]:.3f} "
                           f"{n / (t2 - t0):.0f} samples/s{last_val}")
                t0 = time.perf_counter()
            val = _evaluate(head, splits.val, train)
            row = {"epoch": epoch + 1, "loss": float(np.mean(losses)),
                   **{f"loss_{k}": float(np.mean(v)) for k, v in terms.items()},
                   **{f"val_t2v_{k}": v for k, v in val["t2v"].items() if k != "n"},
                   **{f"val_v2t_{k}": v for k, v in val["v2t"].items() if k != "n"},
                   **_flat_readouts(val),
                   "lr": opt.param_groups[0]["lr"] if opt else 0.0,
                   "samples_per_s": steps_per_epoch * batch / max(t_data + t_step, 1e-9),
                   "data_share": t_data / max(t_data + t_step, 1e-9),
                   "seconds": time.perf_counter() - t_epoch}  # wall time of the epoch, validation included
            rows.append(row)
            ckpt.stage("last.safetensors", lambda path: _save_checkpoint(head, path))
            if best is None or _key(val) > tuple(best["key"]):
                sha = ckpt.stage("best.safetensors", lambda path: _save_checkpoint(head, path))
                best = {"epoch": epoch + 1, "key": list(_key(val)), "val": val, "sha256": sha}
            if best_score is None or _progress_score(val) > best_score:
                best_score, since_best = _progress_score(val), 0
            else:
                since_best += 1
                if open_ended:
                    if since_best % plateau == 0:
                        halvings += 1
                    stopped = since_best >= patience
            ckpt.commit({"epoch": epoch, "best": best, "rows": json.dumps(rows), "best_score": best_score,
                         "since_best": since_best, "halvings": halvings, "stopped": stopped,
                         "optimizer": opt.state_dict() if opt else None})
            write_rows(rows, out / "epochs.csv")
            if on_epoch is not None:
                on_epoch(row)

    # ---- evaluation of the selected epoch on test
    if best is None:  # zero epochs: evaluate the untrained head (zero-shot)
        val = _evaluate(head, splits.val, train)
        best = {"epoch": 0, "key": None, "val": val,
                "sha256": _save_checkpoint(head, out / "checkpoints" / "best.safetensors")}
    best_path = out / "checkpoints" / "best.safetensors"
    if best.get("sha256") and best_path.is_file() and file_sha256(best_path) != best["sha256"]:
        raise RunError(f"{best_path} changed after it was written (sha256 mismatch); delete {out} and train again")
    selected = load_head(best_path, train.device)
    test = _evaluate(selected, splits.test, train, post=post,
                     querybank=splits.train if "qbnorm" in post else None)
    metrics = {"method": method, "selected_epoch": best["epoch"], "selection": "validation t2v (R@1, R@5, R@10)",
               "validation": splits.val_source, "val": best["val"], "test": test,
               "checkpoint": {"file": "checkpoints/best.safetensors", "sha256": best.get("sha256")},
               "schedule": {"lr": lr, "lr_source": lr_source, "description": schedule, "epochs_run": len(rows),
                            "stopped_early": stopped, "lr_halvings": halvings,
                            **({"patience_epochs": patience, "plateau_epochs": plateau,
                                "max_epochs": max_epochs} if open_ended else {})},
               "train": {"samples_per_s": float(np.mean([r["samples_per_s"] for r in rows])) if rows else None,
                         "data_share": float(np.mean([r["data_share"] for r in rows])) if rows else None,
                         "seconds": _train_seconds(rows),
                         # what the wall times above ran with (this session's; a resumed run may differ)
                         "threads": torch.get_num_threads(), "allocator": tune_allocator()}}
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
    if rows:
        groups = {name: list(r) if isinstance(r, dict) else [""] for name, r in best["val"].get("readouts", {}).items()}
        _plots(rows, out / "plots", groups)
    return metrics


def seed_step(seed: int, epoch: int, step: int) -> None:
    """Seed torch's generators (dropout, a head's sampled noise) from (seed, epoch, step): a resumed
    run draws what the uninterrupted one drew, and every data-parallel rank draws the same.

    It seeds the CPU generator and each accelerator already in use, which are all a step can draw
    from. ``torch.manual_seed`` would also queue a lazy seed, holding a formatted stack, for every
    CUDA/XPU/MTIA backend not initialised: 0.8 ms a step on a CPU run. The head is on its device
    before the first step, so "in use" is known by then.
    """
    s = int(np.random.SeedSequence([seed, epoch, step]).generate_state(1)[0])
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(s)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(s)


def _train_seconds(rows: list[dict]) -> float | None:
    """Wall seconds of all epochs, summed over resumed sessions (None for a run resumed from a
    state written before epochs recorded their seconds)."""
    if any("seconds" not in r for r in rows):
        return None
    return float(sum(r["seconds"] for r in rows))


def evaluate_run(
    run_dir: str | os.PathLike[str],
    split: str = "test",
    post: tuple[str, ...] = (),
    features: str | os.PathLike[str] | None = None,
    train: TrainConfig | None = None,
) -> dict:
    """Evaluate a run's selected checkpoint on ``split``; writes ``eval_<split>.json`` in the run.

    The store must have the provenance the run was trained on (else StoreError); the checkpoint
    must match the sha256 that training recorded in ``metrics.json`` (else RunError).
    """
    run = Path(run_dir)
    if split not in ("train", "val", "test"):
        raise ConfigError(f"--split must be train, val or test, got {split!r}")
    config = _read_config(run)
    try:  # a finetune run has no trainer section: the defaults give evaluation's block sizes
        tc = train or TrainConfig(**config.get("train", {}))
    except TypeError as e:
        raise RunError(f"{run / 'config.yaml'}: its train section is not a trainer config ({e}); "
                       "restore it or train the run again into a new --out") from None
    tc.validate()
    with locked(run, "--run"):
        best_path = run / "checkpoints" / "best.safetensors"
        want = _recorded_sha256(run)
        if want and best_path.is_file() and file_sha256(best_path) != want:
            raise RunError(f"{best_path} does not match the sha256 recorded in {run / 'metrics.json'}: the "
                           "checkpoint is damaged or was replaced; delete the run directory and train it again")
        head = load_head(best_path, tc.device)
        if features is None and config["features"] is None:
            export = _recorded(run, "export")
            how = f" (`{export['extract']}`)" if isinstance(export, dict) and export.get("extract") else ""
            raise ConfigError(f"{run} was trained on live CLIP features (tvrpipe finetune): pass --features, a store "
                              f"extracted with the run's CLIP{how}")
        # a finetune run pins what it learnt with (its CLIP's weights hash) in metrics.json
        expect = {**config["provenance"], **(_recorded(run, "provenance") or {})}
        store = open_store(features or config["features"], expect=expect)
        rows = store_split_rows(store, need_test=split == "test")
        # only the split evaluated (and train for QB-Norm's bank), with word tokens only for a head that reads them
        data = load_split(store, split, rows, tokens=head.uses_tokens)
        if data.n_videos == 0:
            raise ConfigError(f"{store.dir}: the {split} split is empty")
        querybank = load_split(store, "train", rows, tokens=head.uses_tokens) if "qbnorm" in post else None
        metrics = {"split": split, "validation": rows.val_source,
                   **_evaluate(head, data, tc, post=post, querybank=querybank)}
        atomic_write_text(run / f"eval_{split}.json", json.dumps(metrics, indent=2))
    return metrics


def _recorded_sha256(run: Path) -> str | None:
    checkpoint = _recorded(run, "checkpoint")
    return checkpoint.get("sha256") if isinstance(checkpoint, dict) else None


def _recorded(run: Path, key: str) -> Any:
    """``metrics.json[key]`` of a run (None before training finished)."""
    path = run / "metrics.json"
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text())
        return metrics.get(key) if isinstance(metrics, dict) else None
    except ValueError:
        raise RunError(f"{path} is damaged (not JSON); delete the run directory and train it again") from None
