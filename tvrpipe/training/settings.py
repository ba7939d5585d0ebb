"""The trainers' settings, importable without torch (the CLI reads their defaults for ``--help``):
train-head's :class:`TrainConfig`, and the choices both trainers share (optimisers, what an epoch
pairs, learning-rate checks). finetune's settings are :mod:`tvrpipe.training.finetune.config`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tvrpipe.config import above, at_least, check_fields, one_of, within
from tvrpipe.errors import ConfigError

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


