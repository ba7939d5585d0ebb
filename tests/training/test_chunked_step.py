"""finetune's chunked step (training.step): CLIP encoding the batch a chunk at a time gives the whole
batch's gradient and AdamW step, for every head, CLIP frozen or end to end, bf16 and gradient
checkpointing; CLIP's second pass of a chunk replays its first pass's random state."""

from __future__ import annotations

import pytest
import torch

from tvrpipe.features.clip import load_clip
from tvrpipe.heads.base import clip_head_config, head_class, list_heads
from tvrpipe.training.core import seed_step
from tvrpipe.training.live import LiveModel, param_groups
from tvrpipe.training.step import chunks, step_gradients

B, F, L = 6, 3, 12
TEXTS = ["a dog runs on the grass", "a red car", "someone cooks pasta", "two people talk",
         "a cat sleeps", "waves at the beach"]
LR = 1e-3


def make_model(method: str, end_to_end: bool = True, precision: str = "fp32", checkpointing: bool = False):
    bundle = load_clip("tvrpipe-tiny", "none", seed=0)
    torch.manual_seed(1)
    head = head_class(method)(clip_head_config(method, bundle.embed_dim, bundle.logit_scale, None))
    model = LiveModel(bundle, head, end_to_end, precision)
    model.clip.requires_grad_(end_to_end)
    if checkpointing:
        model.clip.set_grad_checkpointing(True)
    model.train()
    if not end_to_end:
        model.clip.eval()
    return model


def batch(n: int = B, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    S = 64  # tvrpipe-tiny's image size
    frames = torch.randint(0, 256, (n, F, S, S, 3), dtype=torch.uint8, generator=gen)
    mask = torch.ones(n, F, dtype=torch.bool)
    mask[1, 2:] = False  # a video with fewer decoded frames than F
    return frames, mask, TEXTS[:n]


def gradients(model: LiveModel, chunk: int | None, frames, mask, texts) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    seed_step(0, 0, 0)
    loss, _ = step_gradients(model, model, frames, mask, texts, L, chunk)
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    """Each parameter's gradient equal up to float summation order: a chunk's matrix products add the
    same terms in another order (~1e-7 relative in fp32 per sum), and a gradient built by cancellation
    keeps the error of the terms it cancelled, so the error is taken against the largest gradient of
    that tensor and, for a tensor whose gradient is all small, against the largest of all."""
    assert a.keys() == b.keys()
    largest = max(float(g.abs().max()) for g in a.values())
    for k in a:
        scale = max(float(a[k].abs().max()), 1e-3 * largest)
        err = float((a[k] - b[k]).abs().max())
        assert err <= rtol * scale, f"{k}: {err:.3g} against {scale:.3g}"


def assert_same_adamw_step(before: dict, grads_a: dict, grads_b: dict, after_a: dict, after_b: dict) -> None:
    """AdamW's first step moves each weight by lr g / (|g| + eps) (plus the decay, the same in both): from
    two gradients that differ by float order, the steps differ by at most lr |ga - gb| / (max|g| + eps),
    x2 for the rounding of the update; a gradient of pure float noise (|g| ~ its error: a key bias's is 0
    in exact arithmetic, a softmax ignoring a shift common to every key) may flip sign, up to 2 lr."""
    for k in after_a:
        if k not in grads_a:
            assert torch.equal(after_a[k], after_b[k]), k
            continue
        ga, gb = grads_a[k], grads_b[k]
        bound = 2 * LR * (ga - gb).abs() / (torch.maximum(ga.abs(), gb.abs()) + 1e-8)
        diff = (after_a[k] - after_b[k]).abs()
        assert bool((diff <= bound.clamp(max=2 * LR) + 1e-7 + 1e-6 * before[k].abs()).all()), k


@pytest.mark.parametrize("method", list_heads())
def test_a_chunked_adamw_step_equals_the_whole_batch_step_for_every_head(method):
    frames, mask, texts = batch()
    results = {}
    for chunk in (None, 4, 1):  # 4 does not divide the batch of 6
        model = make_model(method)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(param_groups(model, LR, LR, 0.2))
        loss, grads = gradients(model, chunk, frames, mask, texts)
        opt.step()
        results[chunk] = loss, grads, {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, grads, params = results[None]
    clip_grads = [k for k in grads if k.startswith("clip.")]
    head_grads = [k for k in grads if k.startswith("head.")]
    assert clip_grads and (head_grads or method == "meanpool")  # both CLIP and the head have gradients
    for chunk in (4, 1):
        c_loss, c_grads, c_params = results[chunk]
        assert c_loss == pytest.approx(loss, rel=1e-6)
        assert_same_gradients(grads, c_grads, 1e-4)
        assert_same_adamw_step(before, grads, c_grads, params, c_params)
        moved = sum(float((c_params[k] - before[k]).abs().max()) > 0.5 * LR for k in clip_grads)
        assert moved > len(clip_grads) // 2  # the step did move CLIP


@pytest.mark.parametrize("method", ["xpool", "tmass"])
def test_a_frozen_clip_chunked_equals_whole_and_clip_gets_no_gradient(method):
    frames, mask, texts = batch()
    whole = gradients(make_model(method, end_to_end=False), None, frames, mask, texts)
    chunked = gradients(make_model(method, end_to_end=False), 2, frames, mask, texts)
    assert chunked[0] == pytest.approx(whole[0], rel=1e-6)
    assert not any(k.startswith("clip.") for k in chunked[1])
    assert_same_gradients(whole[1], chunked[1], 1e-5)


def test_bf16_autocast_and_gradient_checkpointing_chunked_equal_whole():
    """bf16 keeps 8 bits of mantissa, and a matrix product over another batch shape may round its output
    to another bf16 neighbour: the chunked gradient is as close to the whole batch's bf16 gradient as
    bf16 itself is to fp32, not closer."""
    frames, mask, texts = batch()
    fp32 = gradients(make_model("seqtransf", checkpointing=True), None, frames, mask, texts)[1]
    whole = gradients(make_model("seqtransf", precision="bf16", checkpointing=True), None, frames, mask, texts)
    chunked = gradients(make_model("seqtransf", precision="bf16", checkpointing=True), 4, frames, mask, texts)
    assert chunked[0] == pytest.approx(whole[0], rel=1e-2)
    largest = max(float(g.abs().max()) for g in fp32.values())
    for k in fp32:
        bf16_error = float((whole[1][k] - fp32[k]).abs().max())
        chunk_error = float((chunked[1][k] - whole[1][k]).abs().max())
        assert chunk_error <= 2 * bf16_error + 1e-4 * largest, k


def test_the_head_draws_the_noise_of_the_whole_batch_step():
    """T-MASS samples its stochastic text embedding in the loss: chunking must not move that draw,
    even though CLIP ran (and could have drawn) twice as often before it."""
    frames, mask, texts = batch()
    a = make_model("tmass")
    b = make_model("tmass")
    la, ga = gradients(a, None, frames, mask, texts)
    lb, gb = gradients(b, 3, frames, mask, texts)
    assert la == pytest.approx(lb, rel=1e-6)
    assert_same_gradients(ga, gb, 1e-4)
    seed_step(0, 0, 1)  # another step's noise gives another loss: the draw is really there
    other = float(make_model("tmass")(frames, mask, texts, L)[0].detach())
    assert other != pytest.approx(la, rel=1e-6)


def test_clip_s_second_pass_replays_the_random_state_of_its_first():
    """With a stochastic CLIP (patch dropout), the cached gradients belong to the first pass's
    features: the chunked gradient equals autograd's through chunks drawn in the same order."""
    from open_clip.transformer import PatchDropout

    frames, mask, texts = batch()

    def stochastic() -> LiveModel:
        m = make_model("meanpool")
        m.clip.visual.patch_dropout = PatchDropout(0.5)
        return m

    model = stochastic()
    _, chunked = gradients(model, 2, frames, mask, texts)
    ref = stochastic()
    ref.zero_grad(set_to_none=True)
    seed_step(0, 0, 0)
    from tvrpipe.heads.base import TextBatch, VideoBatch

    parts = [ref.features(frames[s], mask[s], texts[s], L) for s in chunks(B, 2)]  # the chunks' draws, in order
    t = TextBatch(*(torch.cat([getattr(p[0], f) for p in parts]) for f in ("tokens", "token_mask", "sentence")))
    v = VideoBatch(*(torch.cat([getattr(p[1], f) for p in parts]) for f in ("frames", "frame_mask")))
    ref.head.loss(t, v).total.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert_same_gradients(want, chunked, 1e-4)
    # without the replay the second pass drops other patches: a gradient of features the loss never saw
    no_replay = stochastic()
    no_replay.zero_grad(set_to_none=True)
    seed_step(0, 0, 0)
    import tvrpipe.training.step as step

    real = step.set_rng_state
    step.set_rng_state = lambda state, device: None
    try:
        step_gradients(no_replay, no_replay, frames, mask, texts, L, 2)
    finally:
        step.set_rng_state = real
    wrong = {n: p.grad for n, p in no_replay.named_parameters() if p.grad is not None}
    with pytest.raises(AssertionError):
        assert_same_gradients(want, wrong, 1e-4)


def test_a_chunk_whose_videos_have_no_decoded_frame_trains_as_the_whole_batch():
    frames, mask, texts = batch()
    mask[2] = False  # no frame of this video: a chunk of one holds no frame for CLIP to encode
    whole = gradients(make_model("xpool"), None, frames, mask, texts)
    chunked = gradients(make_model("xpool"), 1, frames, mask, texts)
    assert chunked[0] == pytest.approx(whole[0], rel=1e-6)
    assert_same_gradients(whole[1], chunked[1], 1e-4)


def test_chunks_cover_the_batch_in_order():
    assert chunks(6, None) == [slice(0, 6)] and chunks(6, 6) == [slice(0, 6)] and chunks(6, 10) == [slice(0, 6)]
    assert chunks(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)]
    assert chunks(0, 3) == [slice(0, 0)]
