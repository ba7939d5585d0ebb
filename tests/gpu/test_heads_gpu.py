"""Every registered head on the GPU against the same head on the CPU: a training step, evaluation, and
autocast. The CPU result is computed in the same test, from the same weights, batch and noise.

Tolerances. fp32 on both devices (TF32 off) differs only in the order of reductions: each op's relative
error is ~1e-7 sqrt(n) for n-term sums (n <= a few hundred here), and the chain from features to the
loss is a few dozen ops, so losses, gradients and scores agree to ~1e-5 of their scale; 1e-4 leaves a
10x margin, while a real CPU/GPU difference (a mask built on the wrong device, dropout left on, another
kernel's semantics) moves them by 1e-2 or more. Under autocast the matmuls round to fp16 (11-bit
mantissa, 5e-4 relative) or bf16 (8 bits, 4e-3): through the same chain, ~10 roundings, the scores stay
within 2e-2 (fp16) and 5e-2 (bf16) of fp32, relative to their largest value.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from tvrpipe.evaluation.engine import EvalInputs, EvalOptions, evaluate_head
from tvrpipe.heads.base import TextBatch, VideoBatch, create_head, head_class, list_heads

pytestmark = pytest.mark.gpu

D, F, L = 32, 6, 8
HEADS = list_heads()


def no_dropout(method: str) -> dict:
    """Overrides that turn a head's dropout off: its masks come from the device's own generator."""
    fields = {f.name for f in dataclasses.fields(head_class(method).Config)}
    return {k: 0.0 for k in ("dropout", "xpool_dropout") if k in fields}


def batch(n: int, seed: int) -> tuple[TextBatch, VideoBatch]:
    """n random caption/video pairs with padded tokens and frames (CPU, float32)."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(3, L + 1, (n,), generator=g)
    frames = torch.randint(2, F + 1, (n,), generator=g)
    token_mask = torch.arange(L) < words[:, None]
    frame_mask = torch.arange(F) < frames[:, None]
    tokens = torch.randn(n, L, D, generator=g) * token_mask[..., None]
    return (TextBatch(tokens, token_mask, torch.randn(n, D, generator=g)),
            VideoBatch(torch.randn(n, F, D, generator=g) * frame_mask[..., None], frame_mask))


def scores(head, texts: TextBatch, videos: VideoBatch) -> torch.Tensor:
    with torch.no_grad():
        return head.similarity(head.encode_texts(texts), head.encode_videos(videos)).float().cpu()


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> tuple[bool, float]:
    """``a`` and ``b`` agree within ``rel`` of ``a``'s largest magnitude (at least 1e-6 absolute)."""
    err = float((a.double() - b.double().cpu()).abs().max()) if a.numel() else 0.0
    return err <= rel * max(float(a.abs().max()) if a.numel() else 0.0, 1e-6 / rel), err


@pytest.mark.parametrize("method", HEADS)
def test_every_parameter_and_buffer_follows_the_head_to_the_device(method, device):
    head = create_head(method, embed_dim=D).to(device)
    stray = [n for n, t in [*head.named_parameters(), *head.named_buffers()] if t.device.type != device.type]
    assert not stray, f"{method}: {stray} stayed on the CPU after .to({device})"
    head.train()
    texts, videos = batch(6, seed=1)
    out = head.loss(texts.to(device), videos.to(device))  # a tensor made on the CPU inside the head fails here
    assert out.total.device.type == device.type and torch.isfinite(out.total)


@pytest.mark.parametrize("method", HEADS)
def test_a_training_step_and_evaluation_equal_the_cpu_in_fp32(method, device, fp32_exact, noise_on_cpu):
    torch.manual_seed(0)
    cpu = create_head(method, embed_dim=D, **no_dropout(method))
    gpu = copy.deepcopy(cpu).to(device)
    texts, videos = batch(8, seed=2)
    losses, grads, sims = {}, {}, {}
    for name, head, dev in (("cpu", cpu, torch.device("cpu")), ("gpu", gpu, device)):
        head.train()
        torch.manual_seed(3)  # the same noise on both (noise_on_cpu draws it on the CPU)
        out = head.loss(texts.to(dev), videos.to(dev))
        out.total.backward()
        losses[name] = out.total.detach().cpu()
        grads[name] = {n: p.grad.detach().cpu() for n, p in head.named_parameters() if p.grad is not None}
        opt = torch.optim.SGD(head.parameters(), lr=0.1)  # the update is proportional to the gradient
        opt.step()
        head.eval()
        sims[name] = scores(head, texts.to(dev), videos.to(dev))
    ok, err = close(losses["cpu"].reshape(1), losses["gpu"].reshape(1), 1e-4)
    assert ok, f"{method}: loss {float(losses['cpu'])} on the CPU, {float(losses['gpu'])} on {device} ({err:.2e})"
    assert grads["cpu"].keys() == grads["gpu"].keys()
    scale = max(float(g.abs().max()) for g in grads["cpu"].values()) if grads["cpu"] else 1.0
    for n, g in grads["cpu"].items():
        err = float((g - grads["gpu"][n]).abs().max())
        assert err <= 1e-4 * scale + 1e-9, f"{method}: gradient of {n} differs by {err:.2e} (scale {scale:.2e})"
    ok, err = close(sims["cpu"], sims["gpu"], 1e-4)
    assert ok, f"{method}: scores after the step differ by {err:.2e}"


@pytest.mark.parametrize("method", HEADS)
def test_evaluation_through_the_engine_equals_the_cpu(method, device, fp32_exact):
    torch.manual_seed(0)
    cpu = create_head(method, embed_dim=D).eval()
    gpu = copy.deepcopy(cpu).to(device)
    texts, videos = batch(40, seed=4)
    text_video = np.arange(40)
    res = {}
    for name, head, dev in (("cpu", cpu, "cpu"), ("gpu", gpu, device)):
        res[name] = evaluate_head(head, EvalInputs([texts.to(dev)], [videos.to(dev)], text_video),
                                  EvalOptions(block_texts=16, device=dev))
    for key in ("t2v", "v2t"):  # a near tie may flip between devices: one rank is 100 / 40 = 2.5 points
        for m in ("R@1", "R@5", "R@10"):
            assert abs(res["cpu"][key][m] - res["gpu"][key][m]) <= 2.5 + 1e-9, (method, key, m, res)
    assert res["cpu"].keys() == res["gpu"].keys()  # the same re-rankings and readouts


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("method", HEADS)
def test_under_autocast_losses_and_scores_are_finite_and_near_fp32(method, dtype, device, fp32_exact, noise_on_cpu):
    torch.manual_seed(0)
    head = create_head(method, embed_dim=D, **no_dropout(method)).to(device)
    texts, videos = (b.to(device) for b in batch(8, seed=5))
    half = torch.float16 if dtype == "fp16" else torch.bfloat16
    rel = 2e-2 if dtype == "fp16" else 5e-2
    head.train()
    torch.manual_seed(6)
    full = head.loss(texts, videos).total.detach().cpu()
    torch.manual_seed(6)
    with torch.autocast(device.type, dtype=half):
        out = head.loss(texts, videos)
        out.total.backward()
    mixed = out.total.detach().float().cpu()
    assert torch.isfinite(mixed), f"{method} under {dtype}: the loss is {float(mixed)}"
    if dtype == "bf16":  # fp32's range; fp16 gradients may overflow, which is what GradScaler is for
        bad = [n for n, p in head.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f"{method} under {dtype}: non-finite gradients of {bad}"
    assert abs(float(mixed) - float(full)) <= rel * max(1.0, abs(float(full))), (method, dtype, float(full), float(mixed))
    head.eval()
    exact = scores(head, texts, videos)
    with torch.autocast(device.type, dtype=half):
        approx = scores(head, texts, videos)
    assert torch.isfinite(approx).all(), f"{method} under {dtype}: non-finite scores"
    ok, err = close(exact, approx, rel)
    assert ok, f"{method} under {dtype}: scores differ from fp32 by {err:.2e}"
