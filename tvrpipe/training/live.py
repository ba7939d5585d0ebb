"""The live model of ``tvrpipe finetune``: CLIP and a head, the features of each batch computed by
the live CLIP through extraction's own functions, gathered over data-parallel workers with their
gradients, and the head's loss on them; and the optimiser's parameter groups."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from tvrpipe.heads.base import Head, TextBatch, VideoBatch
from tvrpipe.training.core import check_group_lr, set_rng_state


class _AllGather(torch.autograd.Function):
    """all_gather whose backward sums every worker's gradient of the gathered tensor and returns
    this worker's slice (what open_clip's ``gather_with_grad`` does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # every worker's loss depends on every worker's rows
        return grad[ctx.rank * ctx.rows: (ctx.rank + 1) * ctx.rows]


def pairs_in_step(n: int, world: int, device: torch.device) -> int:
    """The pairs of a step over all workers (``n`` on this one): a step with none is skipped on
    every worker alike (a loss over no pair is NaN, and a collective must be entered by all)."""
    if world == 1:
        return n
    import torch.distributed as dist

    total = torch.tensor([n], device=device)
    dist.all_reduce(total)
    return int(total)


def gather_pairs(texts: TextBatch, videos: VideoBatch) -> tuple[TextBatch, VideoBatch]:
    """Every worker's pairs, in rank order, with gradients flowing back to their worker.

    Workers may hold different numbers of pairs (skipped videos): rows are padded to the largest
    count for the collective and the padding is dropped after it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return texts, videos
    n = torch.tensor([len(videos)], device=videos.frames.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    most = max(sizes)
    keep = torch.cat([torch.arange(s, device=n.device) + r * most for r, s in enumerate(sizes)])

    def gather(x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros((most - x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        full = torch.cat([x, pad])
        if x.dtype == torch.bool:  # masks carry no gradient
            parts = [torch.empty_like(full, dtype=torch.uint8) for _ in sizes]
            dist.all_gather(parts, full.to(torch.uint8))
            return torch.cat(parts).bool()[keep]
        return _AllGather.apply(full)[keep]

    return (TextBatch(gather(texts.tokens), gather(texts.token_mask), gather(texts.sentence)),
            VideoBatch(gather(videos.frames), gather(videos.frame_mask)))


class LiveModel(nn.Module):
    """CLIP and a head: ``forward`` encodes a batch with the live CLIP through extraction's functions,
    gathers the pairs of every worker and returns the head's loss."""

    def __init__(self, bundle, head: Head, end_to_end: bool, precision: str) -> None:
        super().__init__()
        self.clip, self.head = bundle.model, head
        # public: step, plan, the loop and the export read the device, sizes and tokenizer from it
        self.bundle, self.end_to_end, self.precision = bundle, end_to_end, precision
        self.frozen_features: dict = {}  # evaluation features of a frozen CLIP, per split

    def autocast(self):
        from contextlib import nullcontext

        if self.precision == "fp32":
            return nullcontext()
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        return torch.autocast(self.bundle.device.type, dtype=dtype)

    def features(self, frames: torch.Tensor, frame_mask: torch.Tensor, texts: list[str],
                 max_words: int) -> tuple[TextBatch, VideoBatch]:
        """``TextBatch`` / ``VideoBatch`` as the store holds them (fp32, padding zeroed)."""
        return self.encode_texts(texts, max_words), self.encode_videos(frames, frame_mask)

    def _grad(self):
        return torch.set_grad_enabled(self.end_to_end and torch.is_grad_enabled())

    def encode_videos(self, frames: torch.Tensor, frame_mask: torch.Tensor) -> VideoBatch:
        """Frame [CLS] projections of uint8 frames (B, F, S, S, 3), zero where the mask is False."""
        from tvrpipe.features.clip import image_features

        frame_mask = frame_mask.to(self.bundle.device)
        B, F = frame_mask.shape
        if not frame_mask.any():  # every video of the batch failed to decode: nothing to encode
            return VideoBatch(torch.zeros(B, F, self.bundle.embed_dim, device=self.bundle.device), frame_mask)
        with self._grad(), self.autocast():
            emb = image_features(self.bundle, frames[frame_mask.cpu()], self.clip).float()  # (n_real, D)
        video = emb.new_zeros(B * F, emb.shape[-1]).index_copy(
            0, torch.nonzero(frame_mask.reshape(-1)).squeeze(1), emb).view(B, F, -1)  # (B, F, D)
        return VideoBatch(video, frame_mask)

    def encode_texts(self, texts: list[str], max_words: int) -> TextBatch:
        """Word tokens (zero after EOS), their mask and the EOS sentence of captions."""
        from tvrpipe.features.clip import text_features, tokenize

        ids, mask = tokenize(self.bundle, texts, max_words)
        with self._grad(), self.autocast():
            tokens, sentence = text_features(self.bundle, ids, self.clip)
        return TextBatch(tokens.float(), mask.to(self.bundle.device), sentence.float())

    def forward(self, frames: torch.Tensor, frame_mask: torch.Tensor, texts: list[str], max_words: int,
                head_rng: tuple | None = None):
        """The head's loss over every worker's pairs: ``(total, terms)``. ``head_rng``: the random state the
        head draws its noise from (:func:`~tvrpipe.training.core.rng_state`; default: where CLIP left it)."""
        t, v = gather_pairs(*self.features(frames, frame_mask, texts, max_words))
        if head_rng is not None:
            set_rng_state(head_rng, self.bundle.device)
        out = self.head.loss(t, v)  # heads run in fp32, outside autocast
        return out.total, out.terms


def param_groups(model: LiveModel, clip_lr: float, head_lr: float, weight_decay: float,
                 group_lr: Mapping[str, float] | None = None) -> list[dict]:
    """AdamW groups: CLIP's learning rate (end-to-end only); each of the head's groups
    (:meth:`~tvrpipe.heads.base.Head.param_groups`) at its ``group_lr``, else the head's; decay on weight
    matrices only (gains, biases, embeddings and the logit scale exempt; docs/training.md says how the
    sources differ).

    Raises:
        ConfigError: ``group_lr`` names a group the head does not have.
    """
    head_groups = check_group_lr(model.head, group_lr)
    names = {id(p): n for n, p in model.named_parameters()}
    parts = [("clip", list(model.clip.parameters()), clip_lr)] if model.end_to_end else []
    parts += [(g, params, (group_lr or {}).get(g, head_lr)) for g, params in head_groups.items()]
    groups = []
    for name, params, lr in parts:  # name: the group's, for the rates an epoch records (core.group_rates)
        named = [(names[id(p)], p) for p in params if p.requires_grad]
        exempt = lambda n, p: p.ndim < 2 or any(k in n for k in ("bn", "ln", "bias", "logit_scale", "embedding"))  # noqa: E731
        decay = [p for n, p in named if not exempt(n, p)]
        no_decay = [p for n, p in named if exempt(n, p)]
        groups += [{"params": decay, "lr": lr, "base_lr": lr, "weight_decay": weight_decay, "name": name},
                   {"params": no_decay, "lr": lr, "base_lr": lr, "weight_decay": 0.0, "name": name}]
    return [g for g in groups if g["params"]]
