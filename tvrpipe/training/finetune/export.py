"""What an end-to-end finetune run exports: the selected CLIP as an open_clip state dict in safetensors
(what ``tvrpipe extract --pretrained`` loads), carrying the logit scale its head learned, under the
architecture name that rebuilds it."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import torch
import torch.nn as nn

from tvrpipe.heads.base import Head
from tvrpipe.rundir import save_weights

CLIP_FILE = "clip.safetensors"



def save_clip(model: nn.Module, path: Path, meta: dict[str, str]) -> str:
    """An open_clip state dict in safetensors (what ``extract --pretrained`` loads); its sha256."""
    return save_weights(model.state_dict(), path, meta, "CLIP")


def export_clip(model, out: Path, method: str, end_to_end: bool) -> tuple[dict, dict | None]:
    """Rank 0, after the selected epoch's weights are loaded: the CLIP's provenance (its weights' hash and the
    architecture name that rebuilds it) and, end to end, its export (:data:`CLIP_FILE`, with the logit scale
    the head learned): ``(provenance, export or None)``."""
    from tvrpipe.features.clip import state_dict_sha256

    if end_to_end:
        adopt_head_scale(model.clip, model.head)
    name = extract_model_name(model.bundle)
    provenance = {"weights_sha256": state_dict_sha256(model.clip), "model": name}
    if not end_to_end:
        return provenance, None
    save_clip(model.clip, out / CLIP_FILE, {"model": name, "source": f"tvrpipe finetune --method {method}"})
    weights = shlex.quote(str((out / CLIP_FILE).absolute()))  # the command works from any folder, as printed
    return provenance, {"file": CLIP_FILE, "model": name, "weights_sha256": provenance["weights_sha256"],
                        "extract": f"tvrpipe extract --model {name} --pretrained {weights}"}


def adopt_head_scale(clip: nn.Module, head: Head) -> None:
    """Give the exported CLIP the logit scale its head learned (clamped at 100, as CLIP clamps its own).

    In the papers' code head and CLIP share one scale, ``clip.logit_scale``; here the head owns it and
    starts from CLIP's (:func:`clip_head_config`), so the export carries it back: ``extract`` records it
    in the store and every head trained on that store starts from it.
    """
    scale = getattr(clip, "logit_scale", None)
    if isinstance(scale, torch.Tensor):
        with torch.no_grad():
            scale.copy_(head.logit_scale.detach().clamp(max=math.log(100.0)).to(scale).reshape(scale.shape))


def extract_model_name(bundle) -> str:
    """The architecture name that rebuilds these weights in ``extract``: a QuickGELU model loaded from a
    tag (ViT-B-32 ``openai``) needs its ``-quickgelu`` name once the weights are a plain checkpoint."""
    return f"{bundle.model_name}-quickgelu" if bundle.quick_gelu_forced else bundle.model_name
