"""Heads: registry-driven checks for every head, and each baseline against a slow reference.

The generic tests run over ``list_heads()``, so a new head is covered as soon as it registers.
The references are written from the papers' equations (loops over pairs, words and frames in
NumPy float64, with the head's weights copied out) and share no code with the heads.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tvrpipe.errors import ConfigError
from tvrpipe.heads import TextBatch, VideoBatch, create_head, list_heads
from tvrpipe.heads.base import head_class

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths

D, L, NF = 16, 7, 5  # embed dim, tokens per caption, frames per video
HEADS = list_heads()


def batches(n_t: int, n_v: int, seed: int = 0, d: int = D,
            dtype=torch.float32) -> tuple[TextBatch, VideoBatch]:
    """Random raw features with store-style masks (real positions first, then padding).

    Captions keep 3..L tokens (SOT, >= 1 word, EOT); videos keep 1..F frames; the first text and
    the first video are full-length, every other one is padded.
    """
    g = torch.Generator().manual_seed(seed)
    n_tok = torch.randint(3, L, (n_t,), generator=g)
    n_tok[0] = L
    n_frm = torch.randint(1, NF, (n_v,), generator=g)
    n_frm[0] = NF
    texts = TextBatch(
        tokens=torch.randn(n_t, L, d, generator=g, dtype=dtype),
        token_mask=torch.arange(L) < n_tok[:, None],
        sentence=torch.randn(n_t, d, generator=g, dtype=dtype),
    )
    videos = VideoBatch(torch.randn(n_v, NF, d, generator=g, dtype=dtype), torch.arange(NF) < n_frm[:, None])
    return texts, videos


def perturbed(name: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A head whose parameters are moved off their special initial values (zero, identity)."""
    torch.manual_seed(seed)
    head = create_head(name, embed_dim=D, **overrides).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return head.eval()


def sim(head, texts: TextBatch, videos: VideoBatch) -> torch.Tensor:
    with torch.no_grad():
        return head.similarity(head.encode_texts(texts), head.encode_videos(videos))


def slice_emb(emb: dict, idx) -> dict:
    return {k: v[idx] for k, v in emb.items()}


# -- registry ---------------------------------------------------------------------------------


def test_baselines_are_registered():
    assert {"meanpool", "seqtransf", "tokenwise", "xpool"} <= set(HEADS)


@pytest.mark.parametrize("name", HEADS)
def test_unknown_config_key_is_named(name):
    with pytest.raises(ConfigError, match="bogus_key"):
        create_head(name, embed_dim=D, bogus_key=1)


@pytest.mark.parametrize("name", HEADS)
def test_no_config_field_takes_nan_and_only_declared_ones_take_infinity(name):
    """Every float field of every head: NaN is refused (it passes any range check, then silently turns a
    term off); an infinity too, unless the field declares it means something (ProTA's hard-max
    temperatures)."""
    from tvrpipe.config import INFINITE_OK

    fields = [f for f in dataclasses.fields(head_class(name).Config) if f.type in (float, "float")]
    assert fields
    for f in fields:
        with pytest.raises(ConfigError, match=rf"\.{f.name}=nan: .*(finite number|NaN is not a value)"):
            create_head(name, embed_dim=D, **{f.name: float("nan")})
        if f.metadata.get(INFINITE_OK):
            assert getattr(create_head(name, embed_dim=D, **{f.name: float("inf")}).config, f.name) == float("inf")
        else:
            with pytest.raises(ConfigError, match=rf"\.{f.name}=inf: it must be a finite number"):
                create_head(name, embed_dim=D, **{f.name: float("inf")})


def test_unknown_head_is_named():
    with pytest.raises(ConfigError, match="no_such_head"):
        create_head("no_such_head")


@pytest.mark.parametrize("name", HEADS)
def test_every_config_field_names_its_source(name):
    cls = head_class(name).Config
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        src = inspect.getsource(klass)
        for field in klass.__annotations__:
            line = re.search(rf"^\s+{field}:.*$", src, re.MULTILINE)
            assert line and "#" in line.group(0), f"{klass.__name__}.{field} has no source comment"


def test_default_lr_is_read_per_width():
    """A {D: lr} default: exact at a measured width, geometric in between (log lr linear in log D),
    the nearest measured width's lr outside; one number is the same at every width."""
    from tvrpipe.heads.base import Head

    class Table(Head):
        default_lr = {64: 3e-3, 512: 3e-4, 256: 1e-3}

    class One(Head):
        default_lr = 2e-4

    assert Table.lr_for(64) == 3e-3 and Table.lr_for(256) == 1e-3 and Table.lr_for(512) == 3e-4
    assert Table.lr_for(16) == 3e-3 and Table.lr_for(1024) == 3e-4  # clamped, not extrapolated
    assert Table.lr_for(128) == pytest.approx((3e-3 * 1e-3) ** 0.5)  # 128 = sqrt(64 x 256)
    assert Table.lr_for(384) == pytest.approx(1e-3 * 0.3 ** (np.log(1.5) / np.log(2)))
    assert One.lr_for(16) == One.lr_for(768) == 2e-4
    assert Table.lr_text() == "0.003 at D=64, 0.001 at D=256, 0.0003 at D=512" and One.lr_text() == "0.0002"


@pytest.mark.parametrize("bad", [0.0, -1e-3, float("nan"), {}, {64: 0.0}, {0: 1e-3}, {64.5: 1e-3}, "1e-3"])
def test_a_bad_default_lr_fails_at_registration(bad):
    from tvrpipe.heads.base import Head, register_head

    class Bad(Head):
        default_lr = bad

    with pytest.raises(TypeError, match="Bad.default_lr must be a positive learning rate or a non-empty"):
        register_head("bad_default_lr")(Bad)
    assert "bad_default_lr" not in list_heads()


@pytest.mark.parametrize("name", HEADS)
def test_every_heads_default_lr_is_positive_at_every_width(name):
    for d in (16, 64, 128, 512, 768, 1024):
        assert 1e-6 <= head_class(name).lr_for(d) <= 1e-1


# -- generic behaviour, every head ------------------------------------------------------------


@pytest.mark.parametrize("name", HEADS)
def test_training_step_reaches_every_parameter(name):
    """Finite loss, finite gradients, and every parameter gets a gradient that is not rounding noise.

    Heads may start from a deliberately degenerate point (seqtransf zero-initialises its output
    projections so that it equals meanpool, which leaves the blocks' other weights without
    gradient at step 0). So one SGD step is taken first, then every gradient is checked.

    In float64, so that a parameter whose exact gradient is zero (a bias before a shift-invariant
    softmax) shows as rounding noise, ~1e-16 of the largest gradient, on every CPU; the smallest real
    gradient of any head here is ~2e-8 of the largest (duq's aggregation blocks), far above the floor.
    A float32 check of "> 0" would pass or fail a dead parameter by the CPU's rounding.
    """
    torch.manual_seed(0)
    head = create_head(name, embed_dim=D).double().train()
    texts, videos = batches(6, 6, dtype=torch.float64)
    for step in range(2):
        head.zero_grad()
        out = head.loss(texts, videos)
        assert torch.isfinite(out.total), (step, out.total)
        assert out.terms and all(torch.isfinite(v).all() for v in out.terms.values())
        out.total.backward()
        for pname, p in head.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), (step, pname)
        if step == 0:  # a plain SGD step (torch.optim's first use imports dynamo: seconds)
            with torch.no_grad():
                for p in head.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
    missing = [pname for pname, p in head.named_parameters() if p.grad is None]
    assert not missing, f"{name}: {missing} got no gradient"
    largest = max(float(p.grad.abs().max()) for p in head.parameters())
    for pname, p in head.named_parameters():
        assert float(p.grad.abs().max()) > 1e-12 * largest, f"{name}.{pname} got a zero gradient (rounding noise only)"


@pytest.mark.parametrize("name", HEADS)
def test_similarity_shape_and_video_permutation(name):
    head = perturbed(name)
    texts, videos = batches(5, 7)
    s = sim(head, texts, videos)
    assert s.shape == (5, 7) and torch.isfinite(s).all()
    perm = torch.tensor([3, 0, 6, 2, 5, 1, 4])
    s_perm = sim(head, texts, VideoBatch(videos.frames[perm], videos.frame_mask[perm]))
    torch.testing.assert_close(s_perm, s[:, perm], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", HEADS)
def test_blocks_equal_full_matrix(name):
    head = perturbed(name)
    texts, videos = batches(5, 7)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        full = head.similarity(te, ve)
        # The engine slices blocks out of embeddings encoded once...
        rows = [torch.cat([head.similarity(slice_emb(te, ti), slice_emb(ve, vi))
                           for vi in (slice(0, 3), slice(3, 7))], dim=1)
                for ti in (slice(0, 2), slice(2, 5))]
        torch.testing.assert_close(torch.cat(rows), full, atol=1e-5, rtol=0)
        # ...and encodes items in chunks whose outputs it concatenates.
        chunks = [head.encode_videos(VideoBatch(videos.frames[i], videos.frame_mask[i]))
                  for i in (slice(0, 4), slice(4, 7))]
        ve_chunked = {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}
        torch.testing.assert_close(head.similarity(te, ve_chunked), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fill", ["huge", "nan"])
@pytest.mark.parametrize("name", HEADS)
def test_padding_never_contributes(name, fill):
    head = perturbed(name)
    texts, videos = batches(5, 7)
    g = torch.Generator().manual_seed(1)

    def junk(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if fill == "nan":
            return torch.where(mask.unsqueeze(-1), x, torch.full_like(x, float("nan")))
        value = 1e6 * torch.randn(x.shape, generator=g)
        return torch.where(mask.unsqueeze(-1), x, value)

    assert (~texts.token_mask).any() and (~videos.frame_mask).any()
    texts_j = TextBatch(junk(texts.tokens, texts.token_mask), texts.token_mask, texts.sentence)
    videos_j = VideoBatch(junk(videos.frames, videos.frame_mask), videos.frame_mask)
    torch.testing.assert_close(sim(head, texts_j, videos_j), sim(head, texts, videos), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", HEADS)
def test_padded_item_equals_its_unpadded_self(name):
    """A padded caption/video scores exactly as the same item cut to its real tokens/frames, so
    padding is neither junk-sensitive nor treated as a zero-valued frame or token."""
    head = perturbed(name)
    texts, videos = batches(5, 7)
    full = sim(head, texts, videos)
    for i in range(5):
        n = int(texts.token_mask[i].sum())
        one = TextBatch(texts.tokens[i:i + 1, :n], texts.token_mask[i:i + 1, :n], texts.sentence[i:i + 1])
        torch.testing.assert_close(sim(head, one, videos)[0], full[i], atol=1e-5, rtol=0)
    for j in range(7):
        n = int(videos.frame_mask[j].sum())
        one = VideoBatch(videos.frames[j:j + 1, :n], videos.frame_mask[j:j + 1, :n])
        torch.testing.assert_close(sim(head, texts, one)[:, 0], full[:, j], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", HEADS)
def test_training_loss_ignores_trailing_padding_columns(name):
    """The trainer leaves out the token columns that are padding in every caption of a batch
    (``SplitData.text_batch(trim=True)``): in training mode, random draws included, the loss and
    every gradient must be those of the batch with the columns (to float rounding: shorter tensors
    reorder sums; uatvr's and prota's gradients then differ by ~1e-6)."""
    texts, videos = batches(6, 6)
    mask = texts.token_mask.clone()
    mask[:, 5:] = False  # columns 5.. are padding in every caption (the first was full length)
    padded = TextBatch(texts.tokens, mask, texts.sentence)
    trimmed = TextBatch(texts.tokens[:, :5].clone(), mask[:, :5].clone(), texts.sentence)
    head = perturbed(name).train()
    results = []
    for batch in (padded, trimmed):
        head.zero_grad()
        torch.manual_seed(3)
        out = head.loss(batch, videos)
        out.total.backward()
        results.append((out.total.detach(), {n: p.grad.clone() for n, p in head.named_parameters()
                                             if p.grad is not None}))
    (loss_p, grads_p), (loss_t, grads_t) = results
    torch.testing.assert_close(loss_t, loss_p, atol=1e-5, rtol=1e-5)
    assert grads_t.keys() == grads_p.keys() and grads_p
    for n in grads_p:
        torch.testing.assert_close(grads_t[n], grads_p[n], atol=1e-5, rtol=1e-4, msg=f"{name}.{n}")


@pytest.mark.parametrize("name", HEADS)
def test_eval_is_deterministic(name):
    head = perturbed(name)
    texts, videos = batches(4, 5)
    assert torch.equal(sim(head, texts, videos), sim(head, texts, videos))


@pytest.mark.parametrize("name", HEADS)
def test_logit_scale_starts_at_clip_init(name):
    head = create_head(name, embed_dim=D)
    assert head.logit_scale.requires_grad
    assert head.logits_scale().item() == pytest.approx(1 / 0.07, rel=1e-5)


# -- references written from the papers --------------------------------------------------------


def np64(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float64).numpy()


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_meanpool_matches_reference():
    head = perturbed("meanpool", dtype=torch.float64)
    texts, videos = batches(5, 7, dtype=torch.float64)
    t, fr, fm = np64(texts.sentence), np64(videos.frames), videos.frame_mask.numpy()
    ref = np.zeros((5, 7))
    for i in range(5):
        for j in range(7):
            v = np.mean([unit(fr[j, m]) for m in range(NF) if fm[j, m]], axis=0)  # CLIP4Clip meanP
            ref[i, j] = unit(t[i]) @ unit(v)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), ref, atol=1e-10)


def test_seqtransf_untrained_equals_meanpool():
    texts, videos = batches(5, 7)
    seq = create_head("seqtransf", embed_dim=D).eval()
    mean = create_head("meanpool", embed_dim=D).eval()
    torch.testing.assert_close(sim(seq, texts, videos), sim(mean, texts, videos), atol=1e-6, rtol=0)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def torch_encoder_layers(blocks, n_heads: int, ln_eps: float) -> list:
    """PyTorch's own pre-LN encoder layers (float64) carrying the weights of a head's blocks."""
    layers = []
    for blk in blocks:
        layer = torch.nn.TransformerEncoderLayer(D, n_heads, dim_feedforward=4 * D, dropout=0.0,
                                                 activation=_quick_gelu, batch_first=True,
                                                 norm_first=True, dtype=torch.float64, layer_norm_eps=ln_eps)
        with torch.no_grad():
            layer.self_attn.in_proj_weight.copy_(blk.in_proj.weight)
            layer.self_attn.in_proj_bias.copy_(blk.in_proj.bias)
            layer.self_attn.out_proj.weight.copy_(blk.out_proj.weight)
            layer.self_attn.out_proj.bias.copy_(blk.out_proj.bias)
            layer.linear1.load_state_dict(blk.c_fc.state_dict())
            layer.linear2.load_state_dict(blk.c_proj.state_dict())
            layer.norm1.load_state_dict(blk.ln_1.state_dict())
            layer.norm2.load_state_dict(blk.ln_2.state_dict())
        layers.append(layer.train())  # train mode with dropout 0: the plain (non-fast-path) maths
    return layers


def test_seqtransf_matches_torch_encoder_on_unpadded_frames():
    """Reference: PyTorch's own pre-LN encoder layers with the head's weights, run on each video's
    real frames only (no mask at all), then the residual, normalisation, mean and cosine."""
    head = perturbed("seqtransf", dtype=torch.float64, num_layers=2, num_heads=2)
    texts, videos = batches(5, 7, dtype=torch.float64)
    layers = torch_encoder_layers(head.blocks, 2, head.config.ln_eps)
    pos = head.frame_position_embeddings.weight
    ref = torch.zeros(5, 7, dtype=torch.float64)
    with torch.no_grad():
        for j in range(7):
            n = int(videos.frame_mask[j].sum())
            z = videos.frames[j, :n]  # (n, D) real frames only
            x = (z + pos[:n])[None]
            for layer in layers:
                x = layer(x)
            v = F.normalize(F.normalize(x[0] + z, dim=-1).mean(0), dim=0)  # CLIP4Clip: residual, mean
            ref[:, j] = F.normalize(texts.sentence, dim=-1) @ v
    torch.testing.assert_close(sim(head, texts, videos), ref, atol=1e-10, rtol=0)


def test_seqtransf_layer_norm_is_clip4clips_tf_style():
    """CLIP4Clip's module_cross.LayerNorm puts eps = 1e-12 inside the square root (the whole
    difference found side by side against the official seqTransf)."""
    head = create_head("seqtransf", embed_dim=D)
    assert {m.eps for m in head.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-12}
    x = torch.randn(3, D, dtype=torch.float64)
    ln = head.blocks[0].ln_1.double()
    u, s = x.mean(-1, keepdim=True), (x - x.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
    torch.testing.assert_close(ln(x), (x - u) / torch.sqrt(s + 1e-12), atol=1e-12, rtol=0)


def test_seqtransf_rejects_too_many_frames():
    head = create_head("seqtransf", embed_dim=D, max_frames=3)
    _, videos = batches(2, 2)
    with pytest.raises(ConfigError, match="max_frames"):
        head.encode_videos(videos)


def _tokenwise_reference(texts: TextBatch, videos: VideoBatch, drop_sot: bool) -> np.ndarray:
    tok, tm = np64(texts.tokens), texts.token_mask.numpy()
    fr, fm = np64(videos.frames), videos.frame_mask.numpy()
    ref = np.zeros((len(texts), len(videos)))
    for i in range(len(texts)):
        real = [n for n in range(L) if tm[i, n]]
        words = real[1:] if drop_sot else real  # Eq. 7 sums over n=1..N: no w^0 (SOT)
        for j in range(len(videos)):
            frames = [m for m in range(NF) if fm[j, m]]
            c = {(n, m): unit(tok[i, n]) @ unit(fr[j, m]) for n in words for m in frames}
            t2v = np.mean([max(c[n, m] for m in frames) for n in words])
            v2t = np.mean([max(c[n, m] for n in words) for m in frames])
            ref[i, j] = (t2v + v2t) / 2
    return ref


@pytest.mark.parametrize("drop_sot", [True, False])
def test_tokenwise_matches_reference(drop_sot):
    head = perturbed("tokenwise", dtype=torch.float64, drop_sot=drop_sot)
    texts, videos = batches(5, 7, dtype=torch.float64)
    ref = _tokenwise_reference(texts, videos, drop_sot)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), ref, atol=1e-10)


def test_tokenwise_ignores_padding_even_when_all_similarities_are_negative():
    # Word and frames pointing away from each other: every real cosine is < 0. A padded slot
    # treated as 0 (as the official code's multiplicative mask does) would win the max.
    head = create_head("tokenwise", embed_dim=D, drop_sot=False).eval()
    e = torch.zeros(D)
    e[0] = 1.0
    texts = TextBatch(torch.stack([e, e, e])[None], torch.tensor([[True, False, False]]), e[None])
    videos = VideoBatch(torch.stack([-e, -e])[None], torch.tensor([[True, False]]))
    assert sim(head, texts, videos).item() == pytest.approx(-1.0)


def _layer_norm(x: np.ndarray, ln: torch.nn.LayerNorm) -> np.ndarray:
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + ln.eps) * np64(ln.weight) + np64(ln.bias)


def _xpool_reference(head, texts: TextBatch, videos: VideoBatch) -> np.ndarray:
    """X-Pool per (text, video) pair: LN -> Q, K, V -> softmax over real frames -> W_O -> LN ->
    FC + residual -> LN -> cosine with the raw sentence."""
    z = xpool_pooled_reference(head, texts, videos)
    return np.einsum("td,tvd->tv", unit(np64(texts.sentence)), unit(z))


def xpool_pooled_reference(head, texts: TextBatch, videos: VideoBatch) -> np.ndarray:
    """z_{v|t} of every (text, video) pair, (n_text, n_video, D), from X-Pool's equations."""
    wq, wk, wv, wo = (np64(m.weight) for m in (head.q_proj, head.k_proj, head.v_proj, head.out_proj))
    bq, bk, bv, bo = (np64(m.bias) if m.bias is not None else 0.0  # proj_bias: the official code's biases
                      for m in (head.q_proj, head.k_proj, head.v_proj, head.out_proj))
    w_fc, b_fc = np64(head.linear_proj.weight), np64(head.linear_proj.bias)
    h = head.config.num_heads
    dh = D // h
    ref = np.zeros((len(texts), len(videos), head.config.embed_dim))
    for i in range(len(texts)):
        c_t = np64(texts.sentence[i])
        q = _layer_norm(c_t, head.layer_norm1) @ wq.T + bq  # Q_t
        for j in range(len(videos)):
            c_v = np64(videos.frames[j])[videos.frame_mask[j].numpy()]  # real frames only
            k = _layer_norm(c_v, head.layer_norm1) @ wk.T + bk  # K_v
            v = _layer_norm(c_v, head.layer_norm1) @ wv.T + bv  # V_v
            heads_out = []
            for hh in range(h):
                sl = slice(hh * dh, (hh + 1) * dh)
                logits = k[:, sl] @ q[sl] / np.sqrt(dh)
                att = np.exp(logits - logits.max())
                heads_out.append((att / att.sum()) @ v[:, sl])
            r = _layer_norm(np.concatenate(heads_out) @ wo.T + bo, head.layer_norm2)  # r_{v|t}
            ref[i, j] = _layer_norm(r @ w_fc.T + b_fc + r, head.layer_norm3)  # z_{v|t}
    return ref


@pytest.mark.parametrize("num_heads,proj_bias", [(1, False), (2, False), (1, True), (2, True)])
def test_xpool_matches_reference(num_heads, proj_bias):
    head = perturbed("xpool", dtype=torch.float64, num_heads=num_heads, proj_bias=proj_bias)
    texts, videos = batches(5, 7, dtype=torch.float64)
    ref = _xpool_reference(head, texts, videos)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        factored = head.similarity(te, ve)  # eval: the closed form
        pooled = head._similarity_pooled(te, ve)  # the explicit z_{v|t} used in training
    np.testing.assert_allclose(factored.numpy(), ref, atol=1e-10)
    np.testing.assert_allclose(pooled.numpy(), ref, atol=1e-10)


def test_xpool_float32_closed_form_matches_reference():
    head = perturbed("xpool")
    texts, videos = batches(5, 7)
    ref = _xpool_reference(head, texts, videos)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), ref, atol=1e-4)


def test_xpool_untrained_is_identity_attention_pooling():
    # Identity projections (official init): the query is LN(t), keys and values are LN(f).
    head = create_head("xpool", embed_dim=D).eval()
    texts, videos = batches(3, 4)
    with torch.no_grad():
        z = head.pooled_videos(head.encode_texts(texts), head.encode_videos(videos))  # (3, 4, D)
    assert z.shape == (3, 4, D)
    ref = _xpool_reference(head, texts, videos)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), ref, atol=1e-4)


def test_xpool_dropout_only_in_training():
    head = create_head("xpool", embed_dim=D)
    texts, videos = batches(4, 4)
    head.train()
    torch.manual_seed(0)
    a = sim(head, texts, videos)
    torch.manual_seed(1)
    b = sim(head, texts, videos)
    assert not torch.equal(a, b)  # dropout 0.3 on FC's output
    head.eval()
    assert torch.equal(sim(head, texts, videos), sim(head, texts, videos))


def test_xpool_video_without_frames_is_finite():
    head = perturbed("xpool")
    texts, videos = batches(3, 3)
    videos = VideoBatch(videos.frames, videos.frame_mask.clone())
    videos.frame_mask[1] = False
    assert torch.isfinite(sim(head, texts, videos)).all()


def test_public_api_reexports():
    import tvrpipe
    from tvrpipe import create_head as ch
    from tvrpipe import evaluate, extract, fit
    from tvrpipe import list_heads as lh

    assert lh() == list_heads() and "xpool" in lh()
    assert ch("meanpool", embed_dim=8).config.embed_dim == 8
    assert callable(extract) and callable(fit) and callable(evaluate)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tvrpipe.nope  # noqa: B018


@pytest.mark.parametrize("name", list_heads())
def test_uses_tokens_flag_is_truthful(name):
    """A head that says it ignores word tokens gives the same scores when they are left out.
    (Parameters are moved off their initial values: a zero-initialised branch reads tokens too.)"""
    head = perturbed(name)
    t = TextBatch(torch.randn(3, 5, 16), torch.ones(3, 5, dtype=torch.bool), torch.randn(3, 16))
    v = VideoBatch(torch.randn(4, 6, 16), torch.ones(4, 6, dtype=torch.bool))
    full = head.similarity(head.encode_texts(t), head.encode_videos(v))
    empty = TextBatch(torch.zeros(3, 0, 16), torch.zeros(3, 0, dtype=torch.bool), t.sentence)
    if head.uses_tokens:  # then other tokens must give other text embeddings (scores, or a re-ranking's inputs)
        other = TextBatch(torch.randn(3, 5, 16), t.token_mask, t.sentence)
        a, b = head.encode_texts(t), head.encode_texts(other)
        assert any(not torch.allclose(a[k], b[k]) for k in a)
    else:
        torch.testing.assert_close(head.similarity(head.encode_texts(empty), head.encode_videos(v)), full)


@pytest.mark.parametrize("name", HEADS)
def test_metrics_do_not_change_with_video_order_or_blocks(name):
    """Every head through the evaluation engine: permuting the test videos and changing the block
    and chunk sizes leaves every metric as it was. Scores move by float rounding only (a few ulps),
    which moves no rank among distinct items (docs/protocol.md)."""
    from tvrpipe.evaluation import EvalInputs, EvalOptions, evaluate_head

    head = perturbed(name)
    n_t, n_v = 23, 13
    texts, videos = batches(n_t, n_v, seed=2)
    rng = np.random.default_rng(1)
    tv = rng.integers(0, n_v, size=n_t)  # several captions per video, some videos without any
    post = ("dsl",) if head.dsl_not_applicable is None else ()
    base = evaluate_head(head, EvalInputs([texts], [videos], tv),
                         EvalOptions(block_texts=n_t, block_videos=n_v, post=post))
    perm = rng.permutation(n_v)  # new column c holds old video perm[c]
    chunks = [VideoBatch(videos.frames[perm[a : a + 4]], videos.frame_mask[perm[a : a + 4]]) for a in range(0, n_v, 4)]
    text_chunks = [TextBatch(texts.tokens[a : a + 5], texts.token_mask[a : a + 5], texts.sentence[a : a + 5])
                   for a in range(0, n_t, 5)]
    other = evaluate_head(head, EvalInputs(text_chunks, chunks, np.argsort(perm)[tv]),
                          EvalOptions(block_texts=4, block_videos=3, post=post))
    keys = [k for k in base if k.startswith(("t2v", "v2t"))]
    assert {"t2v", "v2t"} <= set(keys) and keys == [k for k in other if k.startswith(("t2v", "v2t"))]
    for key in keys:
        assert other[key] == base[key], (name, key)


@pytest.mark.parametrize("name", list_heads())
def test_parameter_groups_hold_every_trainable_parameter_once(name):
    """Head.param_groups (finetune's --group-lr): a partition of the trainable parameters, one group
    named ``head`` at least, so every parameter trains at exactly one learning rate."""
    head = create_head(name, embed_dim=D)
    groups = head.param_groups()
    assert "head" in groups
    ids = [id(p) for params in groups.values() for p in params]
    assert len(ids) == len(set(ids)), f"{name}: a parameter in two groups"
    assert set(ids) == {id(p) for p in head.parameters() if p.requires_grad}


def test_tmass_radius_group_is_the_radius_module():
    linear = create_head("tmass", embed_dim=D)
    assert {id(p) for p in linear.param_groups()["radius"]} == {id(p) for p in linear.radius_proj.parameters()}
    scalar = create_head("tmass", embed_dim=D, radius="scalar")
    assert [id(p) for p in scalar.param_groups()["radius"]] == [id(scalar.theta)]


@pytest.fixture(scope="module")
def vit_b32():
    from tvrpipe.features.clip import load_clip

    return load_clip("ViT-B-32", "none", seed=0).model  # random weights: what is copied, not what it is worth


def _equal_to_clip_text_blocks(blocks, clip) -> None:
    for i, dst in enumerate(blocks):
        src = clip.transformer.resblocks[i]
        pairs = [(dst.in_proj.weight, src.attn.in_proj_weight), (dst.in_proj.bias, src.attn.in_proj_bias),
                 (dst.out_proj.weight, src.attn.out_proj.weight), (dst.ln_1.weight, src.ln_1.weight),
                 (dst.ln_2.bias, src.ln_2.bias), (dst.c_fc.weight, src.mlp.c_fc.weight),
                 (dst.c_proj.bias, src.mlp.c_proj.bias)]
        for a, b in pairs:
            assert torch.equal(a, b), f"block {i}"


@pytest.mark.parametrize("name, blocks, positions", [("seqtransf", "blocks", "frame_position_embeddings"),
                                                     ("prota", "blocks", "frame_position_embeddings"),
                                                     ("uatvr", "video_blocks", "frame_position_embeddings")])
def test_init_from_clip_copies_clip_text_transformer_into_the_temporal_one(vit_b32, name, blocks, positions):
    """CLIP4Clip's seqTransf initialisation (ProTA Supp. B; UATVR through CLIP4Clip): block i = CLIP's
    text block i, the positions = CLIP's first rows."""
    head = create_head(name, embed_dim=512)
    copied = head.init_from_clip(vit_b32)
    assert len([c for c in copied if "block" in c]) >= 4, copied
    _equal_to_clip_text_blocks(getattr(head, blocks), vit_b32)
    table = getattr(head, positions).weight
    assert torch.equal(table, vit_b32.positional_embedding[: table.shape[0]])
    texts, videos = batches(3, 3, d=512)
    assert torch.isfinite(head.loss(texts, videos).total)  # the copied transformer runs as the head's own


def test_init_from_clip_copies_nothing_where_it_does_not_fit(vit_b32):
    assert create_head("xpool", embed_dim=512).init_from_clip(vit_b32) == []  # no temporal transformer
    assert create_head("seqtransf", embed_dim=512, num_heads=16).init_from_clip(vit_b32) == []  # CLIP's has 8
    assert create_head("uatvr", embed_dim=512, dsa=False).init_from_clip(vit_b32) == []


# ------------------------------------------------------------------------------ zero_shot_start
# The opt-in start from zero-shot CLIP (not in the papers): score = cos(sentence, mean of the real
# frames) + g x (the head's score), g a parameter from 0, for every head.


def _zero_shot(texts, videos) -> np.ndarray:
    """cos(sentence, mean of each video's L2-normalised real frames), NumPy float64 loops."""
    s = texts.sentence.double().numpy()
    out = np.zeros((len(s), videos.frames.shape[0]))
    for j in range(videos.frames.shape[0]):
        real = videos.frames[j][videos.frame_mask[j]].double().numpy()
        m = (real / np.linalg.norm(real, axis=1, keepdims=True)).mean(0)
        for i in range(len(s)):
            out[i, j] = s[i] @ m / np.linalg.norm(s[i]) / np.linalg.norm(m)
    return out


@pytest.mark.parametrize("name", HEADS)
def test_starts_at_zero_shot_and_mixes_the_heads_score(name):
    texts, videos = batches(5, 4, seed=1)
    videos.frames[1, -1] = float("nan")  # padding holds anything; it never reaches the mean
    plain = perturbed(name)
    mixed = create_head(name, embed_dim=D, zero_shot_start=True).eval()
    missing, unexpected = mixed.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["zero_shot_gate"] and unexpected == []
    with torch.no_grad():
        # g = 0: exactly zero-shot CLIP, whatever the head's weights
        s0 = mixed.similarity(mixed.encode_texts(texts), mixed.encode_videos(videos)).double().numpy()
        np.testing.assert_allclose(s0, _zero_shot(texts, videos), atol=1e-5)
        mixed.zero_shot_gate.fill_(0.5)
        s = mixed.similarity(mixed.encode_texts(texts), mixed.encode_videos(videos)).double().numpy()
        head = plain.similarity(plain.encode_texts(texts), plain.encode_videos(videos)).double().numpy()
    np.testing.assert_allclose(s, _zero_shot(texts, videos) + 0.5 * head, atol=1e-5)
    assert "g = 0.5, learned from 0" in mixed.meaning() and "not in the papers" in mixed.meaning()
    assert plain.meaning() == plain.config_meaning()[0]


@pytest.mark.parametrize("name", HEADS)
def test_the_gate_learns_from_the_loss(name):
    torch.manual_seed(0)
    mixed = create_head(name, embed_dim=D, zero_shot_start=True).train()
    texts, videos = batches(4, 4, seed=2)
    mixed.loss(texts, videos).total.backward()
    assert mixed.zero_shot_gate.grad is not None and mixed.zero_shot_gate.grad.abs() > 0
    assert "zero_shot_gate" not in dict(create_head(name, embed_dim=D).named_parameters())
