"""finetune's chunked step (``--chunk-size``) on the GPU: under fp16 with the gradient scaler and under
bf16 a chunked step's gradients are as close to the whole batch's as that precision is to fp32, and a
step's peak memory falls with the chunk size (ViT-B-32 random weights, the papers' 12 frames)."""

from __future__ import annotations

import pytest
import torch

from tvrpipe.features.clip import TINY_MODEL, load_clip
from tvrpipe.heads.base import clip_head_config, head_class
from tvrpipe.training.core import seed_step
from tvrpipe.training.live import LiveModel
from tvrpipe.training.step import step_gradients

pytestmark = pytest.mark.gpu

CAPTIONS = ["a dog runs on the grass", "a red car drives", "someone cooks pasta", "two people talk",
            "a cat sleeps on a sofa", "waves at the beach", "a man plays guitar", "children play football"]


def live(method: str, precision: str, device: torch.device, model: str = TINY_MODEL) -> LiveModel:
    bundle = load_clip(model, "none", device=device, seed=0)
    torch.manual_seed(1)
    head = head_class(method)(clip_head_config(method, bundle.embed_dim, bundle.logit_scale, None))
    m = LiveModel(bundle, head.to(bundle.device), True, precision)
    m.clip.requires_grad_(True)
    return m.train()


def inputs(n: int, frames: int, size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (n, frames, size, size, 3), dtype=torch.uint8, generator=gen)
    return pixels, torch.ones(n, frames, dtype=torch.bool), [CAPTIONS[i % len(CAPTIONS)] for i in range(n)]


def grads(model: LiveModel, chunk: int | None, batch, scaler=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    seed_step(0, 0, 0)
    step_gradients(model, model, *batch, 16, chunk, scaler)
    scale = float(scaler.get_scale()) if scaler is not None else 1.0
    return {n: p.grad.float().cpu() / scale for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("method", ["xpool", "tmass", "prota"])
def test_chunked_gradients_under_autocast_are_as_close_as_the_precision_allows(method, precision, device, fp32_exact,
                                                                                record):
    batch = inputs(8, 4, load_clip(TINY_MODEL, "none").image_size)
    fp32 = grads(live(method, "fp32", device), None, batch)
    # a scale of 2^10, not the scaler's first 2^16: a fp16 sum in CLIP's backward (the positional embedding's,
    # over a chunk's frames) at 2^16 can overflow in one path and not the other, and the scaler then skips that
    # step and halves its scale, as it does in any fp16 run; the gradients compared are those of a step taken
    scaler = (lambda: torch.amp.GradScaler(device.type, init_scale=2.0**10)) if precision == "fp16" else (lambda: None)
    whole = grads(live(method, precision, device), None, batch, scaler())
    chunked = grads(live(method, precision, device), 3, batch, scaler())  # 3 + 3 + 2
    largest = max(float(g.abs().max()) for g in fp32.values())
    worst = 0.0
    for k in fp32:
        precision_error = float((whole[k] - fp32[k]).abs().max())
        chunk_error = float((chunked[k] - whole[k]).abs().max())
        assert chunk_error <= 2 * precision_error + 1e-4 * largest, (k, chunk_error, precision_error)
        worst = max(worst, chunk_error / (precision_error + 1e-4 * largest))
    record(f"chunked step {method} {precision}", worst_chunk_error_over_allowed=worst)


def test_the_peak_memory_of_a_step_falls_with_the_chunk_size(device, record):
    """ViT-B-32 (random weights) + xpool end to end in fp16, 32 pairs x 12 frames: CLIP's activations for
    one chunk instead of the batch's."""
    if device.type != "cuda":
        pytest.skip("the peak is measured by CUDA's allocator")
    model = live("xpool", "fp16", device, "ViT-B-32")
    batch = inputs(32, 12, model.bundle.image_size)
    peaks = {}
    for chunk in (None, 8, 2):
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        seed_step(0, 0, 0)
        step_gradients(model, model, *batch, 32, chunk, torch.amp.GradScaler("cuda"))
        peaks[chunk] = torch.cuda.max_memory_allocated(device) / 2**30
    record("chunked step peak memory", model="ViT-B-32", pairs=32, frames=12, precision="fp16",
           peak_gib={str(k): v for k, v in peaks.items()})
    assert peaks[None] > peaks[8] > peaks[2]
    assert peaks[2] < 0.5 * peaks[None]
