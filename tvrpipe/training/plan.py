"""What a ``finetune`` run will do, before it does it (``finetune --dry-run``): the peak memory of a
training step per worker, estimated from short steps measured on this machine's CPU.

The estimate adds up the tensors of a step:

- the weights, and for every trainable one its gradient and the optimiser's two moments (fp32);
- the step's input frames (uint8, as the loader delivers them) and their normalised float copy;
- the activations autograd saves for the backward pass.

A real step never holds all of these at once (the gradients grow as the saved activations are
freed), so the sum is an upper bound of the tensors, which leaves room for what it does not count:
the CUDA context (about 0.5 GB), the allocator's fragmentation and cuDNN / cuBLAS workspaces.

The saved activations are counted, by storage, with :func:`torch.autograd.graph.saved_tensors_hooks`
in real forward passes of 2, 3 and 4 pairs (the same model, frames, words, precision and gradient
checkpointing), fitted exactly by ``a + b n + c n^2`` (a head's loss holds n x n similarity
tensors) and read at the worker's batch. With several workers the head's loss runs over the gathered
global batch: its share, measured alone on random features, is read at that size. Under fp16 the
CPU measures bf16 autocast, whose activations have the same size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

SIZES = (2, 3, 4)  # pairs per measured step


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one worker's training step at ``pairs`` pairs (see the module docstring)."""

    pairs: int
    weights: int
    gradients: int
    optimizer: int
    inputs: int
    activations: int
    activations_per_pair: float  # the fit's slope at ``pairs`` (bytes per added pair)
    measured: tuple[tuple[int, int], ...]  # (pairs, saved activation bytes) of each measured step
    seconds: float  # wall time of the measured steps

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.inputs + self.activations


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


def estimate_step_memory(model, texts: list[str], frames: int, max_words: int, pairs: int,
                         optimizer_states: int = 2, gathered: int | None = None) -> MemoryEstimate:
    """Measure forward passes of ``model`` (a :class:`~tvrpipe.training.live.LiveModel` on the CPU) at
    :data:`SIZES` pairs with random frames and the captions ``texts`` (cycled), and read the fit at
    ``pairs`` (one worker's batch). ``optimizer_states``: fp32 tensors the optimiser keeps per weight.
    ``gathered``: the pairs the head's loss sees (every worker's, gathered; default ``pairs``): the head's
    own share, measured alone on random features, is then read at that size instead."""
    S = model._bundle.image_size
    params = list(model.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    trainable = [p for p in params if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    measured = []
    t0 = time.perf_counter()
    model.train()
    for n in SIZES:
        frames_u8 = torch.randint(0, 256, (n, frames, S, S, 3), dtype=torch.uint8, generator=gen)
        mask = torch.ones(n, frames, dtype=torch.bool)
        batch_texts = [texts[i % len(texts)] for i in range(n)]

        def step() -> None:
            loss, _ = model(frames_u8, mask, batch_texts, max_words)
            loss.backward()
        measured.append((n, saved_activation_bytes(step, exclude)))
        model.zero_grad(set_to_none=True)
    a, b, c = fit_quadratic(measured)
    activations = a + b * pairs + c * pairs * pairs
    if gathered is not None and gathered != pairs:  # the head's loss runs over the gathered batch
        head = fit_quadratic([(n, head_activation_bytes(model.head, n, frames, max_words, model._bundle.embed_dim,
                                                        exclude)) for n in SIZES])
        at = lambda n: head[0] + head[1] * n + head[2] * n * n  # noqa: E731
        activations += at(gathered) - at(pairs)
        model.zero_grad(set_to_none=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    return MemoryEstimate(
        pairs=pairs, weights=weight_bytes, gradients=trainable_bytes,
        optimizer=optimizer_states * sum(p.numel() * 4 for p in trainable),
        inputs=pairs * frames * S * S * 3 * (1 + 4),  # uint8 frames and their float32 normalised copy
        activations=int(max(0.0, activations)), activations_per_pair=float(b + 2 * c * pairs),
        measured=tuple(measured), seconds=time.perf_counter() - t0)
