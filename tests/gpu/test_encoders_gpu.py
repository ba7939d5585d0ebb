"""extract's encoder functions on the GPU (fp16 autocast, extraction's default there) against the CPU in
fp32, from the same seeded weights: the tiny model, and ViT-B-32 with random weights (no download).

Tolerances: fp16 keeps 11 mantissa bits (relative rounding 4.9e-4 per op); a transformer of a few
blocks accumulates a few 1e-3 of relative error, so each embedding keeps a cosine above 0.999 with its
fp32 counterpart (tiny: 2 blocks) and above 0.99 (ViT-B-32: 12 blocks and width 768), while a wrong
normalisation, resize or mask would drop the cosine far lower.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tvrpipe.features.clip import TINY_MODEL, encode_frames, encode_text_tokens, load_clip, tokenize

pytestmark = pytest.mark.gpu

CAPTIONS = ["a red square moves left", "two blue circles bounce on a green floor", "a cat"]


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double().flatten(0, -2), b.double().flatten(0, -2)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp(min=1e-12)


def compare(model: str, device: torch.device, n_frames: int) -> dict:
    cpu, gpu = load_clip(model, "none", "cpu", seed=0), load_clip(model, "none", device, seed=0)
    for (name, a), b in zip(cpu.model.state_dict().items(), gpu.model.state_dict().values()):
        assert torch.equal(a, b.cpu()), f"{model}: {name} differs: the seeded init is not the same on {device}"
    frames = np.random.default_rng(0).integers(0, 256, (n_frames, cpu.image_size, cpu.image_size, 3), np.uint8)
    exact, mixed = encode_frames(cpu, frames, autocast=False), encode_frames(gpu, frames)  # fp16 on CUDA
    ids, mask = tokenize(cpu, CAPTIONS, 16)
    (tok_exact, sen_exact), (tok_mixed, sen_mixed) = (encode_text_tokens(cpu, ids, autocast=False),
                                                      encode_text_tokens(gpu, ids))
    real = mask.bool()
    return {"frames_cosine_min": float(cosines(exact, mixed).min()),
            "frames_max_abs_diff": float((exact - mixed).abs().max()),
            "frames_max_abs": float(exact.abs().max()),
            "tokens_cosine_min": float(cosines(tok_exact[real], tok_mixed[real]).min()),
            "sentence_cosine_min": float(cosines(sen_exact, sen_mixed).min()),
            "sentence_max_abs_diff": float((sen_exact - sen_mixed).abs().max())}


def test_tiny_model_fp16_on_the_gpu_matches_fp32_on_the_cpu(device, fp32_exact, record):
    r = compare(TINY_MODEL, device, 8)
    record("encoders tvrpipe-tiny fp16 vs cpu fp32", **r)
    for k in ("frames_cosine_min", "tokens_cosine_min", "sentence_cosine_min"):
        assert r[k] > 0.999, r


def test_vit_b32_random_weights_fp16_on_the_gpu_against_fp32_on_the_cpu(device, fp32_exact, record):
    r = compare("ViT-B-32", device, 4)
    record("encoders ViT-B-32 (random weights) fp16 vs cpu fp32", **r)
    for k in ("frames_cosine_min", "tokens_cosine_min", "sentence_cosine_min"):
        assert r[k] > 0.99, r
