"""ProTA: Eq. 1-11 against per-pair loops that build the full (N + M)^2 Gram matrix of
Eq. 4, the loss of Eq. 12-16 against a loop, the kernel, W2 and margin properties the paper
states, limiting cases (the LdA row with a hard max is ``tokenwise``; constant variance is the
deterministic head on distances), ablation switches, readouts, and learning; the fused pair
scores (``pairs.py``, a hand-written backward pass) against the direct formulation with autograd,
values and gradients, in float64 and at float32's own error.

The references are NumPy float64 loops written from the paper; the video tokens come from
PyTorch's own encoder layers carrying the head's weights, run on each video's real frames only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_heads import D, batches, np64, perturbed, sim, torch_encoder_layers, unit

from tvrpipe.errors import ConfigError
from tvrpipe.heads import TextBatch, VideoBatch, create_head
from tvrpipe.heads.prota import (
    gram_matrix,
    gram_of_cosines,
    rbf_kernels,
    safe_sqrt,
    soft_max_aggregate,
    w2_similarity,
)
from tvrpipe.heads.prota.pairs import PairSettings, pair_scores
from tvrpipe.heads.tokenwise import masked_normalize

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths


def mlp_np(mlp, x: np.ndarray) -> np.ndarray:
    w1, b1, w2 = (np64(p) for p in (mlp[0].weight, mlp[0].bias, mlp[2].weight))
    b2 = 0.0 if mlp[2].bias is None else np64(mlp[2].bias)
    return np.maximum(x @ w1.T + b1, 0) @ w2.T + b2


def kernels_np(a: np.ndarray, b: np.ndarray, cfg) -> np.ndarray:
    """Eq. 3 written out: the mean of R Gaussian kernels with bandwidths s^2 mul^(k - (R-1)/2)."""
    if cfg.gram == "dot":
        return a @ b.T
    d2 = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    r = cfg.num_kernels
    return np.mean([np.exp(-d2 / (2 * cfg.kernel_sigma2 * cfg.kernel_mul ** (k - (r - 1) / 2))) for k in range(r)], 0)


def softmax_np(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def soft_max_np(x: np.ndarray, temperature: float) -> float:
    return float(x.max()) if math.isinf(temperature) else float((x * softmax_np(temperature * x)).sum())


def items_reference(head, texts: TextBatch, videos: VideoBatch):
    """Per item: (tokens used by Eq. 1/10 and the Gram, spread for Eq. 10 or None, mu, variance)."""
    cfg = head.config
    layers = torch_encoder_layers(head.blocks, head.blocks[0].heads if len(head.blocks) else 1, cfg.ln_eps)
    raw_t = [np64(texts.tokens[i][texts.token_mask[i]]) for i in range(len(texts))]
    raw_v = []
    with torch.no_grad():
        for j in range(len(videos)):
            z = videos.frames[j][videos.frame_mask[j]]
            x = (z + head.frame_position_embeddings.weight[: len(z)])[None]
            for layer in layers:
                x = layer(x)
            raw_v.append(np64(x[0] + z))  # CLIP4Clip residual
    out = []
    for raws, mean, var in ((raw_t, getattr(head, "text_mean", None), getattr(head, "text_var", None)),
                            (raw_v, getattr(head, "video_mean", None), getattr(head, "video_var", None))):
        side = []
        for f in raws:
            f = unit(f)
            if cfg.probabilistic:
                mu = unit(f + mlp_np(mean, f) if cfg.mean_residual else mlp_np(mean, f))
                log_var = mlp_np(var, f)
                spread = np.exp(0.5 * log_var) if cfg.w2_spread == "std" else np.exp(log_var)
                side.append((mu, spread, mu, np.exp(log_var)))
            else:
                side.append((f, None, None, None))
        out.append(side)
    return out


def prota_reference(head, texts: TextBatch, videos: VideoBatch) -> np.ndarray:
    """Eq. 1-8 (or 9-11) per pair, with the full Gram matrix of the joint tokens."""
    cfg = head.config
    ts, vs = items_reference(head, texts, videos)
    out = np.zeros((len(ts), len(vs)))
    for i, (t, t_sp, _, _) in enumerate(ts):
        for j, (v, v_sp, _, _) in enumerate(vs):
            n, m = len(t), len(v)
            g = kernels_np(np.concatenate([t, v]), np.concatenate([t, v]), cfg)  # (N + M)^2, Eq. 3-4
            if cfg.probabilistic:  # Eq. 10
                s = -np.array([[math.sqrt(((t[a] - v[b]) ** 2).sum() + ((t_sp[a] - v_sp[b]) ** 2).sum())
                                for b in range(m)] for a in range(n)])
            else:
                s = t @ v.T  # Eq. 1
            l_t2v = np.array([soft_max_np(s[a], cfg.lam) for a in range(n)])  # Eq. 2
            l_v2t = np.array([soft_max_np(s[:, b], cfg.lam) for b in range(m)])
            h_t2v = np.array([soft_max_np(g[a, n:], cfg.xi) for a in range(n)]) if cfg.inter else np.ones(n)  # Eq. 6
            h_v2t = np.array([soft_max_np(g[n + b, :n], cfg.xi) for b in range(m)]) if cfg.inter else np.ones(m)
            if cfg.intra:  # Eq. 5 with G_tt f_t / N
                div_t, div_v = (n, m) if cfg.gram_aggregation == "mean" else (1, 1)
                h_tt = softmax_np(mlp_np(head.text_weight, g[:n, :n] @ t / div_t)[:, 0])
                h_vv = softmax_np(mlp_np(head.video_weight, g[n:, n:] @ v / div_v)[:, 0])
            else:
                h_tt, h_vv = np.full(n, 1 / n), np.full(m, 1 / m)
            hat_t = h_t2v * h_tt / (np.abs(h_t2v) * h_tt).sum()  # Eq. 7, normalised over the tokens
            hat_v = h_v2t * h_vv / (np.abs(h_v2t) * h_vv).sum()
            out[i, j] = ((l_t2v * hat_t).sum() + (l_v2t * hat_v).sum()) / 2  # Eq. 8
    return out


@pytest.mark.parametrize("overrides", [
    {},  # ProTA: Eq. 9-11
    {"probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0},  # DPA: Eq. 1-8
    {"probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0, "gram": "dot", "gram_aggregation": "sum"},
    {"w2_spread": "variance", "mean_residual": False, "lam": float("inf"), "num_kernels": 3, "kernel_mul": 3.0},
    {"intra": False, "xi": float("inf")},
])
def test_similarity_matches_loop_with_full_gram(overrides):
    head = perturbed("prota", dtype=torch.float64, num_layers=2, num_heads=2, **overrides)
    texts, videos = batches(4, 5, dtype=torch.float64)
    torch.testing.assert_close(sim(head, texts, videos), torch.from_numpy(prota_reference(head, texts, videos)),
                               atol=1e-9, rtol=0)


def test_training_similarity_equals_tiled_evaluation():
    head = perturbed("prota", dtype=torch.float64, num_layers=1, num_heads=2)
    texts, videos = batches(6, 6, dtype=torch.float64)
    te, ve = head.encode_texts(texts), head.encode_videos(videos)
    with torch.enable_grad():
        train = head.similarity(te, ve).detach()  # one tensor, autograd on
    torch.testing.assert_close(sim(head, texts, videos), train, atol=1e-12, rtol=0)


def test_rbf_gram_is_symmetric_with_unit_diagonal_and_matches_eq3():
    cfg = create_head("prota", embed_dim=D).config
    f = torch.nn.functional.normalize(torch.randn(9, D, dtype=torch.float64), dim=-1)
    g = gram_matrix(f, cfg)
    torch.testing.assert_close(g, g.t(), atol=1e-14, rtol=0)
    # a unit vector's cosine with itself is 1 only to a few ulps (how many depends on the BLAS path),
    # and exp(2 g0 (cos - 1)) carries that error over: the diagonal is 1 to rounding, not bit for bit
    torch.testing.assert_close(g.diagonal(), torch.ones(9, dtype=torch.float64), atol=1e-14, rtol=0)
    torch.testing.assert_close(g, torch.from_numpy(kernels_np(np64(f), np64(f), cfg)), atol=1e-12, rtol=0)
    assert (g > 0).all() and (g <= 1).all()
    # the squaring shortcut (mul = 2) and the direct exps (other mul) agree with Eq. 3
    cos = f @ f.t()
    for mul, r in ((2.0, 5), (2.0, 1), (1.5, 4)):
        ref = np.mean([np.exp(-(2 - 2 * np64(cos)) / (2 * mul ** (k - (r - 1) / 2))) for k in range(r)], 0)
        torch.testing.assert_close(rbf_kernels(cos, r, 1.0, mul), torch.from_numpy(ref).clamp(max=1), atol=1e-12, rtol=0)


def test_w2_similarity_is_zero_for_identical_and_falls_with_distance():
    g = torch.Generator().manual_seed(0)
    mu, sd = torch.randn(D, generator=g, dtype=torch.float64), torch.rand(D, generator=g, dtype=torch.float64)
    assert float(w2_similarity(mu, sd, mu, sd)) == 0.0
    direction = torch.randn(D, generator=g, dtype=torch.float64)
    values = [float(w2_similarity(mu, sd, mu + a * direction, sd)) for a in (0.0, 0.1, 0.5, 1.0, 3.0)]
    assert values == sorted(values, reverse=True) and values[-1] < values[1] < 0
    spreads = [float(w2_similarity(mu, sd, mu, sd + a)) for a in (0.0, 0.2, 1.0)]
    assert spreads == sorted(spreads, reverse=True)
    # the closed form: -sqrt(|dmu|^2 + |dsd|^2) (sqrt taken with a 1e-6 guard that vanishes at 0)
    assert float(w2_similarity(mu, sd, mu + 1.0, sd + 2.0)) == pytest.approx(-math.sqrt(D * 5), abs=1e-6)


def test_identical_token_distributions_score_zero_in_the_head():
    """Eq. 10 inside the head: a caption whose single token equals a video's single frame
    distribution has s^p = 0, the largest value Eq. 10 can take.

    The head expands |a - b|^2 as |a|^2 + |b|^2 - 2ab, so the squared distance of identical
    distributions is 0 only to the rounding of sums of size m (a few ulps of m per term, D + 4 terms),
    and its square root to sqrt of that: the bound is computed from m and the dtype, not fixed."""
    torch.manual_seed(0)
    head = create_head("prota", embed_dim=D, num_layers=0, intra=False, inter=False).eval()
    with torch.no_grad():  # same W^mean / W^var for both sides
        for a, b in ((head.video_mean, head.text_mean), (head.video_var, head.text_var)):
            b.load_state_dict(a.state_dict())
    x = torch.randn(1, 1, D, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        h, y = head.to(dtype), x.to(dtype)
        with torch.no_grad():
            te = h.encode_texts(TextBatch(y, torch.ones(1, 1, dtype=torch.bool), y[:, 0]))
            ve = h.encode_videos(VideoBatch(y.clone(), torch.ones(1, 1, dtype=torch.bool)))
            s = h.similarity(te, ve)
        m = float(te["spread_sq"].sum() + ve["spread_sq"].sum() + 4 + 2 * (te["spread"] * ve["spread"]).abs().sum())
        assert abs(float(s)) <= math.sqrt(4 * (D + 4) * torch.finfo(dtype).eps * m), (dtype, float(s), m)


def test_soft_max_aggregate_limits():
    x = torch.tensor([[0.1, 0.5, -0.2, 9.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False]])
    assert float(soft_max_aggregate(x, valid, float("inf"), dim=1)) == 0.5  # padding never wins the max
    assert float(soft_max_aggregate(x, valid, 1e4, dim=1)) == pytest.approx(0.5, abs=1e-12)
    assert float(soft_max_aggregate(x, valid, 1e-9, dim=1)) == pytest.approx(0.4 / 3, abs=1e-8)  # the mean
    e = np.exp(100 * np.array([0.1, 0.5, -0.2]))
    assert float(soft_max_aggregate(x, valid, 100.0, dim=1)) == pytest.approx(float((np.array([0.1, 0.5, -0.2]) * e).sum() / e.sum()))


def test_lda_row_with_hard_max_is_tokenwise():
    """Tab. 1's LdA with lambda = max, uniform weights and no SOS is UATVR's Eq. 7 (``tokenwise``),
    with the temporal transformer at its identity start."""
    head = create_head("prota", embed_dim=D, intra=False, inter=False, probabilistic=False, kl_weight=0.0,
                       margin_weight=0.0, lam=float("inf"), drop_sot=True).eval()
    texts, videos = batches(5, 6)
    torch.testing.assert_close(sim(head, texts, videos), sim(create_head("tokenwise", embed_dim=D), texts, videos),
                               atol=1e-6, rtol=0)


def test_constant_variance_is_the_deterministic_head_on_distances():
    """Zero-variance limit: with every token's variance equal, Eq. 10 is -|mu_t - mu_v|, and with the
    means at their residual start (mu = f), S^p is Eq. 8 with s = -|f_t - f_v| = -sqrt(2 - 2 cos)."""
    torch.manual_seed(0)
    prob = create_head("prota", embed_dim=D, num_layers=1, num_heads=2).eval()
    with torch.no_grad():
        for mlp in (prob.text_var, prob.video_var):
            mlp[2].weight.zero_()
        for mlp in (prob.text_weight, prob.video_weight, prob.blocks[0].out_proj, prob.blocks[0].c_proj):
            for p in mlp.parameters():
                p.add_(0.3 * torch.randn_like(p))
    det = create_head("prota", embed_dim=D, num_layers=1, num_heads=2, probabilistic=False, kl_weight=0.0,
                      margin_weight=0.0).eval()
    det.load_state_dict(prob.state_dict(), strict=False)
    texts, videos = batches(4, 5)
    with torch.no_grad():
        te, ve = det.encode_texts(texts), det.encode_videos(videos)
        pe, pv = prob.encode_texts(texts), prob.encode_videos(videos)
        torch.testing.assert_close(pe["x"], te["x"])
        torch.testing.assert_close(pe["weight"], te["weight"])
        cos = torch.einsum("tld,vfd->tlvf", te["x"], ve["x"])
        expected = dpa_direct(-(2 - 2 * cos).clamp(min=0).sqrt(), gram_of_cosines(cos, det.config), te["mask"],
                              ve["mask"], te["weight"], ve["weight"], 100.0, 100.0)
        torch.testing.assert_close(prob.similarity(pe, pv), expected, atol=2e-3, rtol=0)


def loss_reference(head, texts: TextBatch, videos: VideoBatch) -> dict[str, float]:
    cfg = head.config
    s = prota_reference(head, texts, videos)  # S^p, (B, B)
    ts, vs = items_reference(head, texts, videos)
    scale = head.logits_scale().item()

    def pooled(mu, var):  # the mixture of the token Gaussians, moment-matched
        mean = mu.mean(0)
        return mean, (var + mu ** 2).mean(0) - mean ** 2

    def kl(p, q):
        return 0.5 * float((p[1] / q[1] + (q[0] - p[0]) ** 2 / q[1] - 1 + np.log(q[1]) - np.log(p[1])).sum())

    def kl_prior(mu, var):  # Eq. 12 per token, mean over tokens
        return float(np.mean([0.5 * (var[a] + mu[a] ** 2 - 1 - np.log(var[a])).sum() for a in range(len(mu))]))

    b = len(ts)
    l_t2v = l_v2t = 0.0
    for i in range(b):
        pt, pv = pooled(ts[i][2], ts[i][3]), pooled(vs[i][2], vs[i][3])
        m_t2v, m_v2t = math.exp(-kl(pt, pv)), math.exp(-kl(pv, pt))  # Eq. 14
        row = scale * s[i].copy()
        row[i] -= scale * cfg.margin_weight * m_t2v  # Eq. 13: S^d
        l_t2v -= row[i] - np.log(np.exp(row).sum())
        col = scale * s[:, i].copy()
        col[i] -= scale * cfg.margin_weight * m_v2t
        l_v2t -= col[i] - np.log(np.exp(col).sum())
    contra = (l_t2v + l_v2t) / (2 * b)  # Eq. 15
    kl_term = 0.5 * (np.mean([kl_prior(t[2], t[3]) for t in ts]) + np.mean([kl_prior(v[2], v[3]) for v in vs]))
    return {"contra": contra, "kl": kl_term, "total": contra + cfg.kl_weight * kl_term}


@pytest.mark.parametrize("margin_weight", [5e-4, 0.5])
def test_loss_matches_loop(margin_weight):
    head = perturbed("prota", dtype=torch.float64, num_layers=1, num_heads=2, margin_weight=margin_weight).train()
    texts, videos = batches(4, 4, dtype=torch.float64)
    out = head.loss(texts, videos)
    ref = loss_reference(head, texts, videos)
    assert float(out.terms["contra"]) == pytest.approx(ref["contra"], abs=1e-9)
    assert float(out.terms["kl"]) == pytest.approx(ref["kl"], abs=1e-9)
    assert out.total.item() == pytest.approx(ref["total"], abs=1e-9)


def test_margin_grows_as_the_pair_kl_shrinks_and_raises_the_loss():
    """Eq. 14: a pair whose distributions are closer (smaller KL) gets a larger margin m, and
    Eq. 13 then asks more of it (a larger loss at the same similarity)."""
    head = create_head("prota", embed_dim=D)
    g = torch.Generator().manual_seed(0)
    mu_t, var = torch.randn(1, D, generator=g), torch.full((1, D), 0.5)
    direction = torch.randn(1, D, generator=g)
    margins, kls = [], []
    for a in (2.0, 1.0, 0.5, 0.1, 0.0):
        te = {"pool_mu": mu_t, "pool_var": var}
        ve = {"pool_mu": mu_t + a * direction, "pool_var": var * (1 + a)}
        m_t2v, m_v2t = head.pair_margins(te, ve)
        margins.append(float((m_t2v + m_v2t) / 2))
        kls.append(-math.log(float(m_t2v)))
    # identical distributions: KL 0 up to the expansion's float32 cancellation (terms ~ sum mu^2 / var ~ 30,
    # a few ulps of that: ~1e-5), which the clamp at 0 hides only when it rounds below
    assert kls == sorted(kls, reverse=True) and kls[-1] == pytest.approx(0.0, abs=1e-4)
    assert margins == sorted(margins) and margins[-1] == pytest.approx(1.0, abs=1e-4)
    # the KL is asymmetric, so the two directions' margins differ
    m_t2v, m_v2t = head.pair_margins({"pool_mu": mu_t, "pool_var": var}, {"pool_mu": mu_t + direction, "pool_var": 3 * var})
    assert float(m_t2v) != pytest.approx(float(m_v2t), rel=1e-3)


def test_margin_is_a_detached_indicator_unless_asked():
    """The margin changes the loss's value either way; only with ``margin_grad`` does its own
    gradient (through the pooled distributions) reach W^var."""
    texts, videos = batches(4, 4)
    totals, grads = [], []
    for grad in (False, True):
        torch.manual_seed(0)
        head = create_head("prota", embed_dim=D, margin_weight=1.0, kl_weight=0.0, margin_grad=grad).train()
        out = head.loss(texts, videos)
        out.total.backward()
        totals.append(out.total.item())
        grads.append(head.text_var[0].weight.grad.clone())
    torch.manual_seed(0)
    plain = create_head("prota", embed_dim=D, margin_weight=0.0, kl_weight=0.0).train()
    assert totals[0] == totals[1] != pytest.approx(plain.loss(texts, videos).total.item(), abs=1e-6)
    assert not torch.allclose(grads[0], grads[1], atol=1e-9)


@pytest.mark.parametrize("overrides,params,terms", [
    ({"intra": False, "inter": False, "probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0},
     {"text_weight": False, "text_mean": False}, {"contra"}),  # LdA
    ({"inter": False, "probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0, "gram": "dot"},
     {"text_weight": True, "text_mean": False}, {"contra"}),  # LdA + G-dagger intra
    ({"probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0}, {"text_weight": True, "text_mean": False},
     {"contra"}),  # DPA
    ({"kl_weight": 0.0, "margin_weight": 0.0}, {"text_weight": True, "text_mean": True}, {"contra"}),  # DPA-s
    ({"margin_weight": 0.0}, {"text_weight": True, "text_mean": True}, {"contra", "kl"}),  # + L^kl
    ({}, {"text_weight": True, "text_mean": True}, {"contra", "kl"}),  # + AC: ProTA
])
def test_ablation_rows(overrides, params, terms):
    head = create_head("prota", embed_dim=D, **overrides).train()
    names = {n.split(".")[0] for n, _ in head.named_parameters()}
    for module, present in params.items():
        assert (module in names) == present, module
    out = head.loss(*batches(4, 4))
    assert set(out.terms) == terms
    torch.testing.assert_close(out.total.detach(), out.terms["contra"] + head.config.kl_weight * out.terms.get("kl", 0))


def test_token_weight_mlps_have_no_output_bias_and_old_checkpoints_load(tmp_path):
    """Eq. 5's MLP feeds a softmax over tokens, which a constant shift leaves unchanged: its output bias
    could never learn (zero gradient), so there is none. A checkpoint written while it existed loads
    (the bias is dropped) and scores exactly as the head without it."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    from tvrpipe.heads.prota import TokenMLP
    from tvrpipe.rundir import load_head

    head = perturbed("prota", num_layers=1, num_heads=2)
    assert head.text_weight[2].bias is None and head.video_weight[2].bias is None
    texts, videos = batches(5, 6)
    x = F.normalize(texts.tokens, dim=-1)
    with_bias = TokenMLP(D, 2 * D, 1)  # the layout before: the same layers and an output bias
    with torch.no_grad():
        with_bias.load_state_dict({**head.text_weight.state_dict(), "2.bias": torch.tensor([3.0])})
        torch.testing.assert_close(head._intra_weights(x, texts.token_mask, with_bias),
                                   head._intra_weights(x, texts.token_mask, head.text_weight), atol=1e-6, rtol=0)
    old = tmp_path / "old.safetensors"
    shifted = {"text_weight.2.bias": torch.tensor([3.0]), "video_weight.2.bias": torch.tensor([-7.5])}
    save_file({**head.state_dict(), **shifted}, str(old),
              metadata={"head": "prota", "config": json.dumps(dataclasses.asdict(head.config))})
    loaded = load_head(old)
    assert not set(shifted) & set(loaded.state_dict())
    torch.testing.assert_close(sim(loaded, texts, videos), sim(head, texts, videos), atol=0, rtol=0)


def test_untrained_intra_weights_are_uniform():
    head = create_head("prota", embed_dim=D).eval()
    texts, _ = batches(4, 1)
    with torch.no_grad():
        w = head.encode_texts(texts)["weight"]
    n = texts.token_mask.sum(1, keepdim=True)
    torch.testing.assert_close(w, texts.token_mask / n)


def test_bad_config_is_named():
    with pytest.raises(ConfigError, match="kl_weight=0 --set margin_weight=0"):
        create_head("prota", embed_dim=D, probabilistic=False)
    with pytest.raises(ConfigError, match="gram must be one of rbf, dot"):
        create_head("prota", embed_dim=D, gram="cosine")
    with pytest.raises(ConfigError, match="num_kernels"):
        create_head("prota", embed_dim=D, num_kernels=0)
    with pytest.raises(ConfigError, match="max_frames=90"):
        create_head("prota", embed_dim=D).encode_videos(VideoBatch(torch.randn(1, 90, D), torch.ones(1, 90, dtype=torch.bool)))


def test_readouts_are_the_mean_token_variance_and_the_margin():
    head = perturbed("prota", dtype=torch.float64)
    texts, videos = batches(4, 3, dtype=torch.float64)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        r = head.item_readouts(te, ve)
        margin = head.pair_readouts(te, ve)["margin"]
    ts, vs = items_reference(head, texts, videos)
    assert r["var_text"] == pytest.approx(np.concatenate([t[3] for t in ts]).mean(), rel=1e-9)
    assert r["var_video"] == pytest.approx(np.concatenate([v[3] for v in vs]).mean(), rel=1e-9)
    assert margin.shape == (4, 3) and ((margin > 0) & (margin <= 1)).all()
    assert create_head("prota", embed_dim=D, probabilistic=False, kl_weight=0.0, margin_weight=0.0).item_readouts(te, ve) == {}


def test_learns_far_above_chance_and_logs_readouts(tmp_path):
    import csv

    from tvrpipe.training.fit import TrainConfig, fit
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=300, val_videos=60, test_videos=100, captions_per_train_video=4, embed_dim=32,
                   intrinsic_dim=32, frames=8, max_words=10, seed=3)
    store = generate_store(tmp_path / "store", spec)
    m = fit(store, "prota", tmp_path / "run", TrainConfig(epochs=3, batch_size=64, lr=1e-3), progress=False)
    assert m["test"]["t2v"]["R@1"] > 15  # chance: 1 %; tokenwise zero-shot 10; measured 24
    rows = list(csv.DictReader(open(tmp_path / "run" / "epochs.csv")))
    assert {"loss_contra", "loss_kl", "val_var_text", "val_var_video", "val_margin_match",
            "val_margin_nonmatch"} <= set(rows[0])
    assert m["val"]["readouts"]["var_text"] > 0
    assert (tmp_path / "run" / "plots" / "readouts.png").stat().st_size > 1000


def dpa_direct(low, gram, text_mask, frame_mask, text_weight, frame_weight, lam: float, xi: float):
    """Eq. 2, 6, 7, 8 written directly over (n_t, L, n_v, F) tensors, each soft maximum on its own
    (:func:`soft_max_aggregate`), for autograd: the head's computation before the fused pair scores."""
    words, frames = text_mask[:, :, None, None], frame_mask[None, None]
    l_t2v = soft_max_aggregate(low, frames, lam, dim=3)  # (n_t, L, n_v)
    l_v2t = soft_max_aggregate(low, words, lam, dim=1)  # (n_t, n_v, F)
    tiny = torch.finfo(low.dtype).tiny
    if gram is not None:
        h_t2v, h_v2t = soft_max_aggregate(gram, frames, xi, dim=3), soft_max_aggregate(gram, words, xi, dim=1)
        t_side = torch.einsum("tlv,tl->tv", l_t2v * h_t2v, text_weight) / \
            torch.einsum("tlv,tl->tv", h_t2v.abs(), text_weight).clamp(min=tiny)
        v_side = torch.einsum("tvf,vf->tv", l_v2t * h_v2t, frame_weight) / \
            torch.einsum("tvf,vf->tv", h_v2t.abs(), frame_weight).clamp(min=tiny)
    else:
        t_side = torch.einsum("tlv,tl->tv", l_t2v, text_weight)
        v_side = torch.einsum("tvf,vf->tv", l_v2t, frame_weight)
    zero = torch.zeros((), dtype=low.dtype)
    return (torch.where(frame_mask.any(1)[None], t_side, zero) + torch.where(text_mask.any(1)[:, None], v_side, zero)) / 2


def pair_inputs(seed: int = 0, n_t: int = 7, n_v: int = 6, length: int = 9, frames: int = 7, d: int = 8,
                empty: bool = True):
    """Raw tokens, spreads and intra weights (float64 leaves) with masks: the last column padding everywhere,
    the others of random lengths; with ``empty``, one text and one video without a real token."""
    g = torch.Generator().manual_seed(seed)
    text_mask = torch.arange(length) < torch.randint(1, length, (n_t,), generator=g)[:, None]
    frame_mask = torch.arange(frames) < torch.randint(1, frames, (n_v,), generator=g)[:, None]
    if empty:
        text_mask[2], frame_mask[3] = False, False
    leaves = [torch.randn(n_t, length, d, generator=g, dtype=torch.float64),
              torch.randn(n_v, frames, d, generator=g, dtype=torch.float64),
              0.3 * torch.randn(n_t, length, d, generator=g, dtype=torch.float64) * text_mask[..., None],
              0.3 * torch.randn(n_v, frames, d, generator=g, dtype=torch.float64) * frame_mask[..., None],
              torch.rand(n_t, length, generator=g, dtype=torch.float64) * text_mask,
              torch.rand(n_v, frames, generator=g, dtype=torch.float64) * frame_mask]
    return leaves, text_mask, frame_mask


def scores_and_gradients(leaves, text_mask, frame_mask, cfg, gram_floor: float, fused: bool, dtype,
                         backward: bool = True):
    """S of every pair from leaves (tokens l2-normalised as the head does, spreads' squared norms taken from
    them), and the gradients of a random weighting of S in every leaf, at the real positions (without
    ``backward``: S alone)."""
    lv = [x.detach().to(dtype).requires_grad_(backward) for x in leaves]
    raw_t, raw_v, spread_t, spread_v, text_weight, frame_weight = lv
    xt, xv = masked_normalize(raw_t, text_mask), masked_normalize(raw_v, frame_mask)
    spreads = (spread_t, spread_v) if cfg.probabilistic else (None, None)
    if fused:
        settings = PairSettings(cfg.lam, cfg.xi, cfg.inter, cfg.gram, cfg.num_kernels, cfg.kernel_sigma2,
                                cfg.kernel_mul, gram_floor)
        sq = (spread_t.square().sum(-1), spread_v.square().sum(-1)) if cfg.probabilistic else (None, None)
        s = pair_scores(xt, xv, text_mask, frame_mask, text_weight, frame_weight, settings, *spreads, *sq)
    else:
        cos = torch.einsum("tld,vfd->tlvf", xt, xv)  # Eq. 1
        low = cos
        if cfg.probabilistic:  # Eq. 10 from the differences
            low = -safe_sqrt((xt[:, :, None, None] - xv[None, None]).square().sum(-1)
                             + (spread_t[:, :, None, None] - spread_v[None, None]).square().sum(-1))
        gram = gram_of_cosines(cos, cfg) if cfg.inter else None
        s = dpa_direct(low, gram, text_mask, frame_mask, text_weight, frame_weight, cfg.lam, cfg.xi)
    if not backward:
        return s
    w = torch.randn(s.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (s * w.to(dtype)).sum().backward()
    # the intra weights' gradients at padding are never used (the head's weights are 0 there, whatever the logits)
    real = [text_mask[..., None], frame_mask[..., None], text_mask[..., None], frame_mask[..., None], text_mask,
            frame_mask]
    return s.detach().double(), [(x.grad if x.grad is not None else torch.zeros_like(x)).double() * m
                                 for x, m in zip(lv, real)]


PAIR_VARIANTS = [
    {},  # ProTA: Eq. 10, G_tv with R = 5 kernels, one shared exponential for Eq. 6
    {"probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0},  # DPA: Eq. 1
    {"gram": "dot"},  # G-dagger: Eq. 6 on the cosines, each direction with its own maximum
    {"lam": float("inf"), "xi": float("inf")},  # Tab. 10's max
    {"lam": 7.0, "kernel_mul": 3.0, "num_kernels": 3, "w2_spread": "variance"},
    {"inter": False, "intra": False},
]


@pytest.mark.parametrize("overrides", PAIR_VARIANTS)
def test_fused_pair_scores_and_gradients_equal_the_direct_formulation(overrides, monkeypatch):
    """The fused pair scores (blocks of texts, a hand-written backward pass) against the direct formulation
    with autograd, in float64: scores, and gradients in the tokens, the spreads (their squared norms
    included) and the intra weights. Blocks of two texts (the last one shorter), padding in every column's
    tail, a text and a video with no real token (but with the hard max, where the direct formulation's
    gradients are NaN: an empty row's maximum is float64's lowest, and inf x 0 reaches the intra weights;
    the fused gradients stay finite there)."""
    import tvrpipe.heads.prota.pairs as pairs

    head = create_head("prota", embed_dim=8, **overrides)
    monkeypatch.setattr(pairs, "_BLOCK_ELEMENTS", 2 * 9 * 7 * 6)
    hard = math.isinf(head.config.lam)
    if hard:
        empty = scores_and_gradients(*pair_inputs(), head.config, head._gram_floor, True, torch.float64)
        assert all(torch.isfinite(x).all() for x in [empty[0], *empty[1]])
    leaves, text_mask, frame_mask = pair_inputs(empty=not hard)
    fused = scores_and_gradients(leaves, text_mask, frame_mask, head.config, head._gram_floor, True, torch.float64)
    direct = scores_and_gradients(leaves, text_mask, frame_mask, head.config, head._gram_floor, False, torch.float64)
    torch.testing.assert_close(fused[0], direct[0], atol=1e-13, rtol=0)
    for name, a, b in zip(("tokens", "frames", "text spreads", "video spreads", "text weights", "frame weights"),
                          fused[1], direct[1]):
        assert b.abs().max() > 0 or (name.endswith("spreads") and not head.config.probabilistic), name
        torch.testing.assert_close(a, b, atol=1e-12 * float(b.abs().max()), rtol=0, msg=name)
    with torch.no_grad():  # evaluation: the same forward pass, to the bit, without keeping anything
        evaluated = scores_and_gradients(leaves, text_mask, frame_mask, head.config, head._gram_floor, True,
                                         torch.float64, backward=False)
    assert torch.equal(evaluated, fused[0])


@pytest.mark.parametrize("overrides", PAIR_VARIANTS[:3])
def test_fused_pair_scores_in_float32_err_as_the_direct_formulation_does(overrides):
    """In float32 the fused path's error (against the float64 direct formulation) is within 3x that of the
    direct formulation in float32 itself, for the scores and every gradient: the tolerance float32 justifies.
    (A soft maximum's gradient e (1 + lambda (x - y)) takes x - y in coordinates shifted by the row's
    maximum; taken from y, it lost a factor of 4.)"""
    head = create_head("prota", embed_dim=32, **overrides)
    leaves, text_mask, frame_mask = pair_inputs(seed=3, n_t=12, n_v=10, length=20, frames=12, d=32)
    args = (leaves, text_mask, frame_mask, head.config, head._gram_floor)
    truth = scores_and_gradients(*args, False, torch.float64)
    direct = scores_and_gradients(*args, False, torch.float32)
    fused = scores_and_gradients(*args, True, torch.float32)
    for name, t, a, b in zip(("scores", "tokens", "frames", "text spreads", "video spreads", "text weights",
                              "frame weights"), [truth[0], *truth[1]], [fused[0], *fused[1]], [direct[0], *direct[1]]):
        if t.abs().max() == 0:
            continue
        err_fused, err_direct = float((a - t).abs().max()), float((b - t).abs().max())
        assert err_fused <= 3 * err_direct + 1e-7 * float(t.abs().max()), (name, err_fused, err_direct)


def test_shared_exp_aggregation_is_exact_down_to_the_kernel_floor():
    """Eq. 6 in both directions with one exponential (fixed shift xi * 1): equal to each direction's own
    softmax in float32 even when every real pair of tokens is nearly opposite, where the kernels take their
    smallest value and exp(xi (g - 1)) its smallest (e^-87 at the defaults)."""
    head = create_head("prota", embed_dim=D, probabilistic=False, kl_weight=0.0, margin_weight=0.0)
    floor = head._gram_floor
    assert floor == pytest.approx(np.mean([math.exp(-4 / (2 * 2.0 ** (k - 2))) for k in range(5)]))
    cfg = head.config
    settings = PairSettings(cfg.lam, cfg.xi, cfg.inter, cfg.gram, cfg.num_kernels, cfg.kernel_sigma2,
                            cfg.kernel_mul, floor)
    assert settings.shared_exp and 75 < cfg.xi * (1 - floor) < 80  # the defaults sit near the check's edge
    g = torch.Generator().manual_seed(0)
    base = F.normalize(torch.randn(1, 1, D, generator=g, dtype=torch.float64), dim=-1)
    xt = F.normalize(base + 1e-2 * torch.randn(3, 4, D, generator=g, dtype=torch.float64), dim=-1)
    xv = F.normalize(-base + 1e-2 * torch.randn(5, 6, D, generator=g, dtype=torch.float64), dim=-1)
    text_mask = torch.arange(4) < torch.tensor([4, 2, 1])[:, None]
    frame_mask = torch.arange(6) < torch.tensor([6, 3, 1, 2, 6])[:, None]
    xt, xv = xt * text_mask[..., None], xv * frame_mask[..., None]
    tw = (text_mask / text_mask.sum(1, keepdim=True)).double()
    fw = (frame_mask / frame_mask.sum(1, keepdim=True)).double()
    cos = torch.einsum("tld,vfd->tlvf", xt, xv)
    assert float(cos[text_mask][:, frame_mask].max()) < -0.99
    with torch.no_grad():
        direct = dpa_direct(cos, gram_of_cosines(cos, cfg), text_mask, frame_mask, tw, fw, cfg.lam, cfg.xi)
        fused = pair_scores(xt.float(), xv.float(), text_mask, frame_mask, tw.float(), fw.float(), settings)
    torch.testing.assert_close(fused.double(), direct, rtol=1e-5, atol=0)


@pytest.mark.parametrize("probabilistic", [True, False])
def test_untrained_head_ranks_each_captions_noisy_twin_first(probabilistic):
    """Videos whose frames are their caption's tokens plus noise: the untrained head (identity
    transformer, uniform weights, means at the tokens) ranks each caption's twin first, with
    Eq. 10's negative distances as with cosines. Eq. 7's weights are normalised, so a better-
    aligned pair's larger inter-modality weight cannot lower its score (unnormalised, with
    negative s^p, 25 of these 30 twins came first)."""
    overrides = {} if probabilistic else {"probabilistic": False, "kl_weight": 0.0, "margin_weight": 0.0}
    head = create_head("prota", embed_dim=D, **overrides).eval()
    texts, _ = batches(30, 1)
    g = torch.Generator().manual_seed(5)
    frames = F.normalize(texts.tokens, dim=-1) + torch.randn(texts.tokens.shape, generator=g) / 4
    s = sim(head, texts, VideoBatch(frames, texts.token_mask.clone()))
    assert torch.equal(s.argmax(1), torch.arange(30))
