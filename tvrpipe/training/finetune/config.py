"""``tvrpipe finetune``'s settings: what a run computes (``finetune`` in config.yaml) and how it executes
(``execution``, which a resumed run may change)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tvrpipe.config import above, at_least, check_fields, one_of, within
from tvrpipe.errors import ConfigError
from tvrpipe.features.decode import check_timeout
from tvrpipe.training.settings import EPOCH_PAIRS, OPTIMIZERS, check_lr_values

PRECISIONS = ("fp32", "fp16", "bf16")


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


# Settings that decide how a run executes, not what it computes: a rerun may change them and resume.
EXECUTION = ("num_workers", "use_gpu", "address", "cpus_per_worker", "loader_workers", "chunk_size", "eval_batch",
             "timeout_s", "max_failed_fraction")
RESUMABLE = ("execution",)  # the config.yaml sections a resumed run may change (how and where it runs)
