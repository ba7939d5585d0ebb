"""What a ``finetune`` run will do, before it does it (``finetune --dry-run``): the peak memory of a
training step per worker, with or without chunks, estimated from a few images and captions encoded
on this machine's CPU, and, given a GPU's memory, what a run needs to fit it.

The estimate adds up the tensors of a step:

- the weights, and for every trainable one its gradient and the optimiser's two moments (fp32);
- the step's input frames (uint8, as the loader delivers them) and the normalised float copy of the
  frames CLIP encodes at once (the worker's batch, or one chunk);
- the activations autograd saves for the backward pass: CLIP's for the pairs it encodes at once,
  the head's for the loss over the gathered batch, and in a chunked step the cached features'
  gradients.

A real step never holds all of these at once (the gradients grow as the saved activations are
freed), so the sum is an upper bound of the tensors, which leaves room for what it does not count:
the CUDA context (about 0.5 GB), the allocator's fragmentation and cuDNN / cuBLAS workspaces.

The saved activations are counted, by storage, with :func:`torch.autograd.graph.saved_tensors_hooks`
in real forward passes: CLIP's image tower on 2 and 4 images and its text tower on 2 and 4 captions
(what they save is a straight line in the count: every image and caption is encoded alone), and the
head's loss on 2, 3 and 4 pairs of random features of the run's shapes, fitted exactly by
``a + b n + c n^2`` (a loss holds n x n similarity tensors) and read at the gathered batch. So the
measurement costs a few images whatever the batch and the frames, and each of precision and gradient
checkpointing is measured both ways, for the advice. Under fp16 the CPU measures bf16 autocast,
whose activations have the same size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from tvrpipe.errors import ConfigError

SIZES = (2, 3, 4)  # pairs per measured step of the head
TOWER_SIZES = (2, 4)  # images, and captions, per measured pass of a CLIP tower
HALF = "bf16"  # what the CPU measures for a half precision (fp16 saves as many bytes)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one worker's training step at ``pairs`` pairs, CLIP encoding ``chunk`` at a time (see
    the module docstring)."""

    pairs: int
    chunk: int  # pairs CLIP encodes at once (``pairs``: the batch at once)
    gathered: int  # pairs of the head's loss (every worker's)
    weights: int
    gradients: int
    optimizer: int
    inputs: int
    activations: int  # clip + head + cached
    clip_activations: int
    head_activations: int
    cached: int  # a chunked step's gradients of the cached features
    seconds: float  # wall time of the measured passes

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.inputs + self.activations


@dataclass(frozen=True)
class StepMemory:
    """A step's memory as a function of the chunk, for one precision and checkpointing setting."""

    precision: str
    grad_checkpointing: bool
    pairs: int
    gathered: int
    frames: int
    max_words: int
    embed_dim: int
    image_bytes: int  # one image, uint8 (S x S x 3)
    weights: int
    gradients: int
    optimizer: int
    vision: tuple[float, float]  # saved bytes at n images: a + b n
    text: tuple[float, float]  # saved bytes at n captions: a + b n
    head: tuple[float, float, float]  # saved bytes of the loss at n pairs: a + b n + c n^2
    measured: dict = field(default_factory=dict)  # {"vision"|"text"|"head": ((n, bytes), ...)}
    seconds: float = 0.0

    def at(self, chunk: int | None = None) -> MemoryEstimate:
        """The estimate with CLIP encoding ``chunk`` pairs at a time (None, or at least the worker's pairs:
        the batch at once)."""
        c = self.pairs if not chunk or chunk >= self.pairs else int(chunk)
        line = lambda ab, n: ab[0] + ab[1] * n if n else 0.0  # noqa: E731
        clip = line(self.vision, c * self.frames) + line(self.text, c)
        n = self.gathered
        head = self.head[0] + self.head[1] * n + self.head[2] * n * n
        cached = self.pairs * (self.frames + self.max_words + 1) * self.embed_dim * 4 if c < self.pairs else 0
        clip_b, head_b = int(max(0.0, clip)), int(max(0.0, head))
        return MemoryEstimate(
            pairs=self.pairs, chunk=c, gathered=n, weights=self.weights, gradients=self.gradients,
            optimizer=self.optimizer,
            # the worker's uint8 frames, and the float32 normalised copy of what CLIP encodes at once
            inputs=self.pairs * self.frames * self.image_bytes + c * self.frames * self.image_bytes * 4,
            activations=clip_b + head_b + cached, clip_activations=clip_b, head_activations=head_b, cached=cached,
            seconds=self.seconds)

    def largest_chunk(self, budget: int) -> int | None:
        """The most pairs CLIP may encode at once for the step to fit ``budget`` bytes (None: not even one)."""
        if self.at(1).total > budget:
            return None
        lo, hi = 1, self.pairs  # the total grows with the chunk
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.at(mid).total <= budget else (lo, mid - 1)
        return lo


def saved_activation_bytes(step, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves while ``step()`` runs its forward pass, without
    the storages whose data pointers are in ``exclude`` (the weights)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude and ptr:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def fit_quadratic(points: list[tuple[int, int]]) -> np.ndarray:
    """``(a, b, c)`` of ``a + b n + c n^2`` through three ``(n, bytes)`` points; a negative curvature
    (measurement noise) is dropped for the straight line through the ends."""
    n = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    a, b, c = np.linalg.solve(np.stack([np.ones_like(n), n, n * n], 1), y)
    if c < 0:
        b = (y[-1] - y[0]) / (n[-1] - n[0])
        a, c = y[0] - b * n[0], 0.0
    return np.array([a, b, c])


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """``(a, b)`` of the line through two ``(n, bytes)`` points."""
    (n0, y0), (n1, y1) = points
    b = (y1 - y0) / (n1 - n0)
    return float(y0 - b * n0), float(b)


def head_activation_bytes(head, n: int, frames: int, max_words: int, dim: int, exclude: set[int]) -> int:
    """Bytes autograd saves in ``head``'s loss over ``n`` pairs of random features (with gradients, as the
    live CLIP's are end-to-end)."""
    from tvrpipe.heads.base import TextBatch, VideoBatch

    gen = torch.Generator().manual_seed(n)
    texts = TextBatch(torch.randn(n, max_words, dim, generator=gen, requires_grad=True),
                      torch.ones(n, max_words, dtype=torch.bool), torch.randn(n, dim, generator=gen, requires_grad=True))
    videos = VideoBatch(torch.randn(n, frames, dim, generator=gen, requires_grad=True),
                        torch.ones(n, frames, dtype=torch.bool))
    return saved_activation_bytes(lambda: head.loss(texts, videos).total.backward(), exclude)


def measure_step(model, texts: list[str], frames: int, max_words: int, pairs: int, checkpointing: bool,
                 gathered: int | None = None, optimizer_states: int = 2,
                 settings: list[tuple[str, bool]] | None = None) -> dict[tuple[str, bool], StepMemory]:
    """Measure ``model`` (a :class:`~tvrpipe.training.live.LiveModel` on the CPU, its CLIP checkpointing
    its activations where ``checkpointing``) for a step of ``pairs`` pairs on this worker and ``gathered``
    in the head's loss (default ``pairs``), with the captions ``texts`` (cycled): one :class:`StepMemory`
    per ``(precision, grad_checkpointing)`` of ``settings`` (default: the model's own). ``optimizer_states``:
    fp32 tensors the optimiser keeps per weight. The model is left as it was given."""
    own = (model.precision, checkpointing)
    settings = settings or [own]
    S = model.bundle.image_size
    D = model.bundle.embed_dim
    params = list(model.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    trainable = [p for p in params if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    was_training = model.training
    model.train()
    head = [(n, head_activation_bytes(model.head, n, frames, max_words, D, exclude)) for n in SIZES]
    model.zero_grad(set_to_none=True)
    towers = {}  # (precision, checkpointing) -> the image and text towers' (n, saved bytes)
    for precision, ckpt in settings:
        model.precision = "fp32" if precision == "fp32" else HALF
        model.clip.set_grad_checkpointing(ckpt)
        vision, text = [], []
        for n in TOWER_SIZES:
            pixels = torch.randint(0, 256, (n, 1, S, S, 3), dtype=torch.uint8, generator=gen)
            mask = torch.ones(n, 1, dtype=torch.bool)
            captions = [texts[i % len(texts)] for i in range(n)]

            def images() -> None:
                v = model.encode_videos(pixels, mask).frames
                if v.requires_grad:
                    v.sum().backward()

            def words() -> None:
                t = model.encode_texts(captions, max_words)
                if t.sentence.requires_grad:
                    (t.sentence.sum() + t.tokens.sum()).backward()
            vision.append((n, saved_activation_bytes(images, exclude)))
            text.append((n, saved_activation_bytes(words, exclude)))
            model.zero_grad(set_to_none=True)
        towers[(precision, ckpt)] = vision, text
    model.precision = own[0]
    model.clip.set_grad_checkpointing(own[1])
    model.train(was_training)
    seconds = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in params)
    gradients = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = optimizer_states * sum(p.numel() * 4 for p in trainable)
    return {(precision, ckpt): StepMemory(
        precision=precision, grad_checkpointing=ckpt, pairs=pairs, gathered=gathered or pairs, frames=frames,
        max_words=max_words, embed_dim=D, image_bytes=S * S * 3, weights=weights, gradients=gradients,
        optimizer=optimizer, vision=fit_line(vision), text=fit_line(text), head=tuple(fit_quadratic(head)),
        measured={"vision": tuple(vision), "text": tuple(text), "head": tuple(head)}, seconds=seconds)
        for (precision, ckpt), (vision, text) in towers.items()}


def estimate_step_memory(model, texts: list[str], frames: int, max_words: int, pairs: int,
                         optimizer_states: int = 2, gathered: int | None = None, chunk: int | None = None,
                         checkpointing: bool = False) -> MemoryEstimate:
    """The estimate of one worker's step for ``model`` as it is set (its precision; ``checkpointing``: whether
    its CLIP checkpoints): :func:`measure_step` read at ``chunk``."""
    [m] = measure_step(model, texts, frames, max_words, pairs, checkpointing, gathered, optimizer_states).values()
    return m.at(chunk)


def advise(steps: dict[tuple[str, bool], StepMemory], precision: str, checkpointing: bool, chunk: int | None,
           budget: int, half: str = "bf16") -> dict:
    """Whether the run fits ``budget`` bytes per worker as set, the largest chunk that fits with its precision
    and checkpointing, and otherwise the fewest changes that make it fit.

    Args:
        steps: the measured variants (:func:`measure_step`), by ``(precision, grad_checkpointing)``; those of
            :func:`variants`.
        precision, checkpointing, chunk: the run's.
        budget: bytes per worker.
        half: the half precision to name (fp16 on a GPU).

    Returns:
        ``{"budget", "fits", "total", "largest_chunk", "needs"}``: ``largest_chunk`` None when not one pair
        at a time fits as set; ``needs`` the options to add (``[]`` when it fits as set, None when nothing
        tvrpipe offers makes it fit).
    """
    own = steps[(precision, checkpointing)]
    total = own.at(chunk).total
    needs: list[str] | None = []
    if total > budget:
        needs = None
        for p, k in variants(precision, checkpointing):  # chunks alone, then checkpointing, then precision, then both
            c = steps[(p, k)].largest_chunk(budget)
            if c is None:
                continue
            needs = (([f"--precision {half}"] if p != precision else []) + (["--grad-checkpointing"] if k != checkpointing
                                                                             else [])
                     + ([f"--chunk-size {c}"] if c < own.pairs else []))
            break
    return {"budget": budget, "fits": total <= budget, "total": total, "largest_chunk": own.largest_chunk(budget),
            "needs": needs}


def variants(precision: str, checkpointing: bool) -> list[tuple[str, bool]]:
    """The settings :func:`advise` weighs, fewest changes first: the run's, with gradient checkpointing, then
    (an fp32 run) in half precision without and with it."""
    out = [(precision, checkpointing), (precision, True)]
    if precision == "fp32":
        out += [(HALF, checkpointing), (HALF, True)]
    return list(dict.fromkeys(out))


def recipe_memory(recipe, budgets: list[int], workers: int = 1) -> dict:
    """A recipe's step per worker (of ``workers``) without a dataset: CLIP of its backbone with random weights
    (the memory does not depend on them), its head, frames, words, batch, precision and checkpointing, measured
    as the dry run measures them. ``{"name", "pairs", "frames", "precision", "grad_checkpointing", "unchunked":
    bytes, "chunk": the recipe's, "at_chunk": bytes, "largest_chunk": {budget: chunk or None}}``."""
    from tvrpipe.features.clip import load_clip
    from tvrpipe.heads.base import clip_head_config, head_class
    from tvrpipe.training.live import LiveModel

    v = recipe.values()
    bundle = load_clip(v["model"], "none", device="cpu", seed=0)
    with torch.random.fork_rng(devices=[]):
        head = head_class(recipe.method)(clip_head_config(recipe.method, bundle.embed_dim, bundle.logit_scale,
                                                          recipe.head_overrides()))
    model = LiveModel(bundle, head, v["end_to_end"], "fp32" if v["precision"] == "fp32" else HALF)
    model.clip.requires_grad_(v["end_to_end"])
    if v["batch_size"] % workers:
        raise ConfigError(f"--num-workers {workers}: recipe {recipe.name}'s batch of {v['batch_size']} pairs is the "
                          "global batch and must split evenly between the workers")
    pairs = v["batch_size"] // workers
    [step] = measure_step(model, ["a person is explaining something to another person on a sunny day"], v["frames"],
                          v["max_words"], pairs, bool(v.get("grad_checkpointing", False)), gathered=v["batch_size"]
                          ).values()
    chunk = v.get("chunk_size")
    return {"name": recipe.name, "pairs": pairs, "frames": v["frames"], "precision": v["precision"],
            "grad_checkpointing": bool(v.get("grad_checkpointing", False)), "unchunked": step.at(None).total,
            "chunk": chunk, "at_chunk": step.at(chunk).total,
            "largest_chunk": {b: step.largest_chunk(b) for b in budgets}}
