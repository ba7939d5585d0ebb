"""Losses shared by heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def symmetric_infonce(logits: Tensor) -> Tensor:
    """Symmetric cross-entropy over a (B, B) logit matrix whose diagonal holds the positives.

    ``(CE(logits, diag) + CE(logits.T, diag)) / 2``: text-to-video and video-to-text InfoNCE
    (CLIP4Clip Eq. 6-8, X-Pool Eq. 5).
    """
    target = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    """Mean of ``x`` over ``dim`` counting only positions where ``mask`` is True (0 if none)."""
    m = mask.to(x.dtype).unsqueeze(-1) if x.dim() == mask.dim() + 1 else mask.to(x.dtype)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def kl_to_standard_normal(mu: Tensor, log_sigma: Tensor) -> Tensor:
    """KL(N(mu, diag sigma^2) || N(0, I)) per item: 1/2 sum(sigma^2 + mu^2 - 1 - 2 log sigma), (B,)."""
    return 0.5 * (torch.exp(2 * log_sigma) + mu.square() - 1 - 2 * log_sigma).sum(-1)
