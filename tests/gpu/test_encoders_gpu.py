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


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_extract_encoders_in_each_precision_against_the_cpu_in_fp32(precision, device, tmp_path, fp32_exact, record):
    """extract's encoder process (its weights from a checkpoint file, built without a random init) in
    each --precision on the GPU, against the same encoder on the CPU in fp32; with the frames per second
    of each, at extract's default batch (16 videos x 12 frames)."""
    import time

    from safetensors.torch import save_file

    from tvrpipe.features.workers import ClipEncoder

    path = tmp_path / "b32.safetensors"
    save_file({k: v.contiguous() for k, v in load_clip("ViT-B-32", "none", seed=0).model.state_dict().items()},
              str(path))
    cpu, gpu = ClipEncoder("ViT-B-32", str(path), "cpu", 0, 4, "fp32"), \
        ClipEncoder("ViT-B-32", str(path), device.type, 0, 1, precision)
    assert gpu.facts() == cpu.facts()
    frames = np.random.default_rng(0).integers(0, 256, (192, 224, 224, 3), np.uint8)
    video = {"row": 0, "frames": frames[:12], "mask": np.ones(12, bool), "timestamps": np.zeros(12, np.float32),
             "error": ""}
    a, b = cpu.encode_videos(video)["emb"][0], gpu.encode_videos(video)["emb"][0]
    ta, tb = cpu.encode_texts(CAPTIONS, 16), gpu.encode_texts(CAPTIONS, 16)
    batch = [{**video, "frames": frames[12 * i:12 * (i + 1)]} for i in range(16)]
    gpu.encode_videos(*batch)  # warm-up at the measured shape
    t = time.perf_counter()
    for _ in range(5):
        gpu.encode_videos(*batch)
    rate = 5 * 192 / (time.perf_counter() - t)
    r = {"frames_cosine_min": float(cosines(torch.from_numpy(a), torch.from_numpy(b)).min()),
         "sentence_cosine_min": float(cosines(torch.from_numpy(ta["sentence"]), torch.from_numpy(tb["sentence"])).min()),
         "frames_per_second": rate}
    record(f"extract encoder ViT-B-32 {precision} on {device.type} vs cpu fp32", **r)
    assert r["frames_cosine_min"] > 0.99 and r["sentence_cosine_min"] > 0.99, r
