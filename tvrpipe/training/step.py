"""The gradients of one ``finetune`` step: the head's loss over the whole (gathered) batch, CLIP
encoding the batch at once or ``chunk`` pairs at a time.

A contrastive loss is not a sum over pairs, so accumulating the gradients of smaller batches trains
with fewer negatives. The chunked step computes the whole batch's gradient instead (Gao et al.,
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"; open_clip's
``--accum-freq``), in four steps:

1. CLIP encodes every chunk without a graph;
2. the head's loss runs over the whole batch on those features (gathered from every worker, as
   unchunked), and its backward stops at them: the head's gradients, and the loss's gradient with
   respect to each feature;
3. CLIP encodes each chunk again, with its graph, replaying the random state of its first pass;
4. each chunk's features backpropagate the cached gradients into CLIP's parameters.

The gradient is the whole batch's, up to float summation order; the memory is CLIP's activations
for one chunk, plus the head's for the batch. Under the fp16 gradient scaler the loss is scaled
once, and the cached gradients carry the scale into CLIP. With several workers the gradients are
averaged once per step, as DistributedDataParallel does for the unchunked step, and not per chunk.

Everything random in a step is what the unchunked step draws: the frames are sampled before the
batch reaches this module, the head draws its noise from the random state the step was seeded
with (:func:`~tvrpipe.training.core.seed_step`), in both paths, whatever CLIP's forward consumed,
and CLIP's second pass of a chunk replays the random state of its first.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn as nn

from tvrpipe.heads.base import TextBatch, VideoBatch
from tvrpipe.training.core import RngState, rng_state, set_rng_state
from tvrpipe.training.live import LiveModel, gather_pairs


def chunks(n: int, size: int | None) -> list[slice]:
    """The pairs ``0..n`` cut into runs of ``size`` (the last may be shorter); one run without ``size``."""
    if not size or size >= n:
        return [slice(0, n)]
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    (scaler.scale(loss) if scaler is not None else loss).backward()


def step_gradients(model: LiveModel, wrapped: nn.Module, frames: torch.Tensor, frame_mask: torch.Tensor,
                   texts: list[str], max_words: int, chunk: int | None = None,
                   scaler: torch.amp.GradScaler | None = None, train: bool = True,
                   check: Callable[[torch.Tensor, dict], None] = lambda total, terms: None) -> tuple[torch.Tensor, dict]:
    """Accumulate into ``.grad`` the gradient of the head's loss over the step's batch (every worker's
    pairs), from this worker's ``frames`` / ``frame_mask`` / ``texts``, and return ``(loss, terms)``.

    Args:
        model: the live model (CLIP and the head).
        wrapped: ``model``, or it under DistributedDataParallel with several workers.
        chunk: pairs CLIP encodes at a time on this worker (None, or at least this worker's pairs: all at
            once). The gradient is the same either way.
        scaler: the fp16 gradient scaler (its scale multiplies every gradient, as unscaled by the step).
        train: False: the loss only (nothing trains), no backward.
        check: called with the loss and its terms before any backward (it raises on a non-finite loss).

    The random state at the call is the step's (``seed_step``): the head draws from it in both paths.
    """
    device = model.bundle.device
    head_rng = rng_state(device)
    parts = chunks(len(texts), chunk)
    # with several workers the path follows the option alone, never this worker's count of decoded pairs: every
    # rank must enter the same collectives (a worker whose videos all failed still takes part in the step)
    distributed = wrapped is not model
    if not train or not chunk or (len(parts) == 1 and not distributed):  # one forward and backward, through DDP
        total, terms = wrapped(frames, frame_mask, texts, max_words, head_rng)
        check(total, terms)
        if train:
            _backward(total, scaler)
        return total, terms
    ddp_off = wrapped.no_sync() if distributed else nullcontext()
    with ddp_off:  # the gradients are averaged once, below, not by DDP's hooks in each chunk's backward
        total, terms = _chunked(model, frames, frame_mask, texts, max_words, parts, scaler, head_rng, check)
    if distributed:
        average_gradients(model)
    return total, terms


def _chunked(model: LiveModel, frames: torch.Tensor, frame_mask: torch.Tensor, texts: list[str], max_words: int,
             parts: list[slice], scaler, head_rng: RngState, check) -> tuple[torch.Tensor, dict]:
    device = model.bundle.device
    first: list[tuple[RngState, TextBatch, VideoBatch]] = []
    with torch.no_grad():  # 1. every chunk's features, without a graph
        for s in parts:
            state = rng_state(device)
            t, v = model.features(frames[s], frame_mask[s], texts[s], max_words)
            first.append((state, t, v))
    # 2. the whole batch's loss on leaves that stop its backward at the features
    tokens = torch.cat([t.tokens for _, t, _ in first]).requires_grad_(model.end_to_end)
    sentence = torch.cat([t.sentence for _, t, _ in first]).requires_grad_(model.end_to_end)
    video = torch.cat([v.frames for _, _, v in first]).requires_grad_(model.end_to_end)
    local_t = TextBatch(tokens, torch.cat([t.token_mask for _, t, _ in first]), sentence)
    local_v = VideoBatch(video, torch.cat([v.frame_mask for _, _, v in first]))
    t, v = gather_pairs(local_t, local_v)
    set_rng_state(head_rng, device)
    out = model.head.loss(t, v)
    check(out.total, out.terms)
    _backward(out.total, scaler)
    if not model.end_to_end:  # a frozen CLIP: the features need no gradient
        return out.total.detach(), out.terms
    # 3-4. each chunk again, with its graph and its first pass's random state, backpropagating the cache
    grads = (tokens.grad, sentence.grad, video.grad)
    for (state, _, _), s in zip(first, parts):
        set_rng_state(state, device)
        tc, vc = model.features(frames[s], frame_mask[s], texts[s], max_words)
        # a head that reads no word tokens leaves them no gradient; a chunk of videos without a decoded frame
        # has zero features that CLIP did not compute
        pairs = [(o, g[s]) for o, g in zip((tc.tokens, tc.sentence, vc.frames), grads)
                 if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return out.total.detach(), out.terms


def average_gradients(model: nn.Module) -> None:
    """Average every trainable parameter's gradient over the data-parallel workers in one collective per
    dtype (what DDP does once per step); a parameter no worker gave a gradient keeps none, one that only some
    did counts zero on the others."""
    import torch.distributed as dist

    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    dist.all_reduce(has)
    used = [p for p, h in zip(params, has.tolist()) if h > 0]
    for p in used:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for dtype in {p.grad.dtype for p in used}:
        same = [p for p in used if p.grad.dtype == dtype]
        flat = torch.cat([p.grad.reshape(-1) for p in same])
        dist.all_reduce(flat)
        flat /= world
        i = 0
        for p in same:
            n = p.grad.numel()
            p.grad.copy_(flat[i: i + n].view_as(p.grad))
            i += n
