"""The trainers' settings, importable without torch (the CLI reads their defaults for ``--help``):
train-head's :class:`TrainConfig`, and the choices both trainers share (optimisers, what an epoch
pairs, learning-rate checks). finetune's settings are :mod:`tvrpipe.training.finetune.config`."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvrpipe.config import above, at_least, check_fields, field_types, one_of, within
from tvrpipe.errors import ConfigError, RunError

OPTIMIZERS = ("adamw", "adam")
EPOCH_PAIRS = ("captions", "videos")
# TrainConfig's fields that decide how a run executes, not what it learns: a resumed run may change them, and
# the report never tells runs apart by them (the memory budget only picks how the data is read, which the run
# records under data: mode, order, buffer)
EXECUTION_FIELDS = ("device", "prefetch", "eval_batch", "block_texts", "memory_budget")


def check_lr_values(group_lr: Mapping[str, float]) -> None:
    """Raise :class:`ConfigError` unless every learning rate of ``group_lr`` ({group: lr}) is a finite number >= 0."""
    for g, lr in group_lr.items():
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ConfigError(f"--group-lr {g}={lr}: a learning rate must be a finite number >= 0")


@dataclass(frozen=True)
class TrainConfig:
    """Trainer settings; defaults follow the papers where they agree, and validation elsewhere.

    With ``epochs`` None (the default) a run trains until validation stops improving: linear
    warmup over the first epoch, then a constant learning rate, halved after ``plateau`` epochs
    without a better validation score (t2v R@1 + R@5 + R@10), stopping after ``patience`` such
    epochs (at most ``max_epochs``), validated after every epoch; on a store with few steps an epoch,
    validation runs every k epochs and these three count periods of k epochs, so that patience covers
    ``min_steps`` optimizer steps (:func:`~tvrpipe.training.fit.open_ended_epochs`). The checkpoint is
    still selected on t2v (R@1, R@5, R@10). With ``epochs`` set, the schedule is the papers' warmup
    + cosine over exactly that many epochs. ``lr`` None takes the head's ``default_lr`` at the
    store's width D (:meth:`Head.lr_for`). The evidence for these defaults is in docs/training.md
    (``tvrpipe bench convergence``).
    """

    # choice: until validation stops improving; papers: 5 end-to-end. 0: evaluate the untrained head
    epochs: int | None = at_least(0, None, option="--epochs", why="0: evaluate the untrained head")
    # choice: cap of a run without --epochs (stopping comes far earlier on the grid)
    max_epochs: int = at_least(1, 60, option="--max-epochs")
    # choice: epochs without a better validation score before stopping (docs/training.md)
    patience: int = at_least(1, 8, option="--patience")
    plateau: int = at_least(1, 3)  # choice: epochs without a better validation score before the lr halves
    # choice: no stop before this many optimizer steps without a better validation score: progress per
    # epoch depends on the steps in an epoch, so on a store with fewer than min_steps / patience steps
    # an epoch, validation runs every k epochs and patience, plateau and max_epochs count periods of k
    # epochs (open_ended_epochs)
    min_steps: int = at_least(0, 300)
    # CLIP4Clip Sec. 4.1: batch 128
    batch_size: int = at_least(2, 128, option="--batch-size", why="a contrastive batch needs negatives")
    # None: the head's default_lr at the store's D (validation curves, docs/training.md)
    lr: float | None = above(0, None, option="--lr")
    # a learning rate of its own for a group of the head's parameters (Head.param_groups), e.g.
    # {"radius": 3e-5} for T-MASS (Sec. 4.1); the head's other groups train at lr
    group_lr: dict[str, float] = field(default_factory=dict, metadata={"option": "--group-lr"})
    # X-Pool / T-MASS: AdamW; UATVR Sec. 4.1: Adam (weight decay as an L2 term of the gradient)
    optimizer: str = one_of(OPTIMIZERS, "adamw", option="--optimizer")
    weight_decay: float = at_least(0, 0.2, option="--weight-decay")  # X-Pool Sec. 4 / CLIP: AdamW weight decay 0.2
    # CLIP4Clip: warmup proportion 0.1, then cosine (runs with --epochs)
    warmup_fraction: float = within(0.0, 1.0, 0.1)
    seed: int = 0
    # CLIP4Clip Sec. 3.2 (and ProTA, UATVR's DSA): a temporal transformer starts from CLIP's text transformer;
    # here from the CLIP the store was extracted with (Head.init_from_clip); off: the head's own initialisation
    init_from_clip: bool = False
    eval_batch: int = at_least(1, 256)  # items per encode call at evaluation
    block_texts: int = at_least(1, 256)  # texts per similarity block at evaluation (memory bound)
    device: str = "cpu"
    prefetch: bool = True  # choice: build the next batch in a thread (see docs/performance.md for 2-core CPUs)
    # bytes the splits may hold in memory: above it they are streamed from the store (training/stream.py);
    # None: half of the memory this process may use (RAM, or a lower cgroup or ulimit limit)
    memory_budget: int | None = above(0, None, option="--memory-budget")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option (every field's declared range, then
        the device); reads and creates nothing. A TrainConfig that exists has passed it."""
        check_fields(self, "train")
        check_lr_values(self.group_lr)
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"--device must be cpu or cuda (cuda:N), got {self.device!r}")


# ---- a run's recorded trainer settings, rebuilt (evaluate, the report)


def trainer_config(run: Path, config: Mapping[str, Any], known_only: bool = False) -> Any:
    """The trainer settings a run's ``config.yaml`` (``config``) records, rebuilt and checked as the trainer checks
    its options: train-head's ``train`` as a :class:`TrainConfig`, finetune's ``finetune`` and ``execution`` as a
    :class:`FinetuneConfig`. Every problem is named as the file's key, never as the CLI option it stands for: the
    user typed no option, the file holds the value.

    Args:
        known_only: leave out keys that are not fields of the config (a run written by another tvrpipe) instead
            of refusing them.

    Raises:
        RunError: a key that is not a field (unless ``known_only``), a value of the wrong type or out of the field's
            range, or settings that do not go together, naming ``config.yaml`` and the key.
    """
    from tvrpipe.rundir import CONFIG
    from tvrpipe.training.finetune.config import FinetuneConfig

    path = Path(run) / CONFIG
    if "train" in config:
        return _section_config(path, {"train": config["train"]}, TrainConfig, "trainer config", known_only)
    return _section_config(path, {k: config.get(k) or {} for k in ("finetune", "execution")}, FinetuneConfig,
                           "finetune config", known_only)


def _section_config(path: Path, sections: Mapping[str, Any], cls: type, what: str, known_only: bool) -> Any:
    """``cls`` built from the sections of ``config.yaml`` (``{section: values}``); where it refuses them, its
    message is told as the file's key it names."""
    from tvrpipe.rundir import check_types

    hints = field_types(cls)
    values: dict[str, Any] = {}
    where: dict[str, str] = {}  # key -> its section
    for name, section in sections.items():
        check_types(path, f"{name}.", section, hints)
        unknown = sorted(map(str, set(section) - set(hints)))
        if unknown and not known_only:
            raise RunError(f"{path}: its {name} section is not a {what} (unknown key(s) {', '.join(unknown)}); "
                           "restore it or train the run again into a new --out")
        values.update({k: v for k, v in section.items() if k in hints})
        where.update({k: name for k in section if k in hints})
    try:
        return cls(**values)
    except ConfigError as e:
        key, problem = _named_key(str(e), cls)
        said = f"{where[key]}.{key} {problem}" if key in where else f"{' and '.join(sections)}: {e}"
        raise RunError(f"{path}: {said}; restore it or train the run again into a new --out") from None


def _named_key(message: str, cls: type) -> tuple[str | None, str]:
    """The field of the config class ``cls`` that its refusal ``message`` opens with (by its CLI option,
    ``--name``, or ``owner: name``), and the message without that name: ``--epochs must be >= 0, got -3`` ->
    ``("epochs", "must be >= 0, got -3")``; ``(None, message)`` where it names no field."""
    for f in dataclasses.fields(cls):
        names = [re.escape(n) for n in (f.metadata.get("option"), f"--{f.name.replace('_', '-')}") if n]
        m = re.match(rf"(?:{'|'.join(names)}|\w+(?:: |\.){re.escape(f.name)})(?=[ =:]|$)", message)
        if m is None:
            continue
        rest = message[m.end():]
        if rest.startswith("="):  # "--lr=nan: it must be ...": the key names it
            rest = rest.partition(": ")[2]
        return f.name, rest.strip().removeprefix("it ") or message
    return None, message
