"""Frame pooling shared by heads and by the zero-shot row every head can start from (``Head`` in base.py).

``mean_video`` is CLIP4Clip's parameter-free meanP video (heads/meanpool.py gives its paper and choices): the
L2-normalised masked mean of the L2-normalised frames. It lives here, below both the base class and the meanpool
head, so that neither imports the other for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tvrpipe.heads.losses import masked_mean


def mean_video(frames: Tensor, frame_mask: Tensor) -> Tensor:
    """L2-normalised masked mean of L2-normalised frames: (B, F, D), (B, F) -> (B, D)."""
    frame_mask = frame_mask.bool()
    frames = torch.where(frame_mask.unsqueeze(-1), frames, torch.zeros_like(frames))  # padding never enters
    video = masked_mean(F.normalize(frames, dim=-1), frame_mask, dim=1)  # (B, D)
    return F.normalize(video, dim=-1)
