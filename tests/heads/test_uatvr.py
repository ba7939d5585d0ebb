"""UATVR: Eq. 8 and Eq. 11 against direct loops, the KL against its closed form and
a Monte Carlo estimate, limiting cases (K = 1 with zero variance is InfoNCE; no extra tokens with
identity transformers is ``tokenwise``), ablation switches, the sigma readout, and learning.

The Eq. 8 reference runs PyTorch's own encoder layers (with the head's weights) on each item's
real tokens followed by its extra tokens, then loops over words and frames in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_heads import D, batches, np64, perturbed, sim, torch_encoder_layers, unit

from tvrpipe.errors import ConfigError
from tvrpipe.heads import TextBatch, VideoBatch, create_head
from tvrpipe.heads.losses import kl_to_standard_normal
from tvrpipe.heads.uatvr import multi_instance_infonce

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths


def dsa_reference(layers, positions, extra, x: torch.Tensor, first: int = 0) -> np.ndarray:
    """One item's real tokens x (n, D), at slots first..first+n-1 of its sequence, -> normalised
    [n real ; C extra] DSA outputs (NumPy)."""
    with torch.no_grad():
        h = torch.cat([x + positions[first:first + len(x)], extra])[None]  # (1, n + C, D): no padding
        for layer in layers:
            h = layer(h)
        h = h[0].clone()
        h[: len(x)] += x  # residual on the real slots only
    return unit(np64(h))


def eq8_reference(head, texts: TextBatch, videos: VideoBatch) -> np.ndarray:
    """Eq. 8 with means over the real and extra tokens, per pair, written as loops."""
    n_heads = head.config.num_heads
    tl = torch_encoder_layers(head.text_blocks, n_heads, head.config.ln_eps)
    vl = torch_encoder_layers(head.video_blocks, n_heads, head.config.ln_eps)
    words = []
    for i in range(len(texts)):
        real = texts.tokens[i][texts.token_mask[i]][1:]  # Eq. 8: n = 1..N, no SOT; words keep their slots 1..N
        words.append(dsa_reference(tl, head.word_position_embeddings.weight, head.text_tokens, real, first=1))
    frames = [dsa_reference(vl, head.frame_position_embeddings.weight, head.video_tokens,
                            videos.frames[j][videos.frame_mask[j]]) for j in range(len(videos))]
    out = np.zeros((len(texts), len(videos)))
    for i, w in enumerate(words):
        for j, f in enumerate(frames):
            c = w @ f.T  # (N + C_t, M + C_v) cosines
            out[i, j] = 0.5 * (np.mean([c[n].max() for n in range(len(w))]) +
                               np.mean([c[:, m].max() for m in range(len(f))]))
    return out


@pytest.mark.parametrize("share", [False, True])
def test_eq8_matches_loop_over_enlarged_sequences(share):
    head = perturbed("uatvr", dtype=torch.float64, num_layers=2, num_heads=2, share_transformer=share)
    texts, videos = batches(5, 6, dtype=torch.float64)
    assert (~videos.frame_mask).any() and (~texts.token_mask).any()
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), eq8_reference(head, texts, videos), atol=1e-10)
    assert (head.text_blocks is head.video_blocks) == share


def test_no_extra_tokens_and_identity_transformers_is_tokenwise():
    texts, videos = batches(5, 6)
    tokenwise = create_head("tokenwise", embed_dim=D).eval()
    identity = create_head("uatvr", embed_dim=D, extra_video_tokens=0, extra_text_tokens=0).eval()  # zero_init
    torch.testing.assert_close(sim(identity, texts, videos), sim(tokenwise, texts, videos), atol=1e-6, rtol=0)
    ti = create_head("uatvr", embed_dim=D, dsa=False, dua_weight=0.0, kl_weight=0.0).eval()  # Tab. 1 "TI"
    torch.testing.assert_close(sim(ti, texts, videos), sim(tokenwise, texts, videos), atol=1e-6, rtol=0)
    with_tokens = create_head("uatvr", embed_dim=D).eval()  # C_v = 3, C_t = 2 change the score
    assert not torch.allclose(sim(with_tokens, texts, videos), sim(tokenwise, texts, videos), atol=1e-3)


def test_eq11_matches_loop():
    g = torch.Generator().manual_seed(0)
    b, kr, kc = 3, 2, 4
    logits = torch.randn(b * kr, b * kc, generator=g, dtype=torch.float64)
    ref = []
    for a in range(b * kr):
        i = a // kr  # the anchor's item
        pos = sum(math.exp(logits[a, j]) for j in range(b * kc) if j // kc == i)
        ref.append(-math.log(pos / sum(math.exp(x) for x in logits[a].tolist())))
    assert float(multi_instance_infonce(logits, kr, kc)) == pytest.approx(np.mean(ref), rel=1e-12)


def test_one_sample_without_variance_is_plain_infonce():
    """K = 1 and sigma -> 0: every sample is mu, so L_DUA is the symmetric InfoNCE over mu_t mu_v^T."""
    head = perturbed("uatvr", num_samples=1, dua_temperature=0.5).train()
    with torch.no_grad():
        for dist in (head.text_dist, head.video_dist):
            dist.sigma_fc.bias.fill_(-60.0)  # sigma = e^-60
    texts, videos = batches(5, 5)
    out = head.loss(texts, videos)
    te, ve = head.encode_texts(texts), head.encode_videos(videos)
    from tvrpipe.heads.losses import symmetric_infonce

    ref = symmetric_infonce(te["mu"] @ ve["mu"].t() / 0.5)
    # two code paths (multi-instance vs plain InfoNCE) of a float32 log-sum-exp over 5 logits: a few ulps of
    # a loss of ~3 (one ulp 2.4e-7)
    torch.testing.assert_close(out.terms["dua"], ref.detach(), atol=0, rtol=1e-5)


def test_dua_loss_uses_the_given_samples():
    """Eq. 10 + Eq. 11 with explicit noise: x^(k) = mu + sigma eps^k; both directions averaged."""
    head = perturbed("uatvr", dtype=torch.float64, num_samples=3).train()
    texts, videos = batches(4, 4, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    eps = (torch.randn(4, 3, D, generator=g, dtype=torch.float64), torch.randn(4, 3, D, generator=g, dtype=torch.float64))
    out = head.loss(texts, videos, eps=eps)
    te, ve = head.encode_texts(texts), head.encode_videos(videos)
    with torch.no_grad():
        t = np64(te["mu"])[:, None] + np.exp(np64(te["log_sigma"]))[:, None] * eps[0].numpy()
        v = np64(ve["mu"])[:, None] + np.exp(np64(ve["log_sigma"]))[:, None] * eps[1].numpy()
    s = t.reshape(12, D) @ v.reshape(12, D).T

    def eq11(m):
        return np.mean([np.log(np.exp(m[a]).sum()) - np.log(np.exp(m[a][[j for j in range(12) if j // 3 == a // 3]]).sum())
                        for a in range(12)])

    assert float(out.terms["dua"]) == pytest.approx((eq11(s) + eq11(s.T)) / 2, rel=1e-10)
    kl = sum(0.5 * np.sum(np.exp(2 * ls) + mu ** 2 - 1 - 2 * ls, axis=-1)
             for mu, ls in ((np64(te["mu"]), np64(te["log_sigma"])), (np64(ve["mu"]), np64(ve["log_sigma"]))))
    assert float(out.terms["kl"]) == pytest.approx(kl.mean(), rel=1e-10)
    total = float(out.terms["dsa"]) + 1e-2 * float(out.terms["dua"]) + 1e-4 * float(out.terms["kl"])
    assert float(out.total.detach()) == pytest.approx(total, rel=1e-10)


def test_kl_closed_form_and_monte_carlo():
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(3, 5, generator=g, dtype=torch.float64)
    log_sigma = 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    closed = kl_to_standard_normal(mu, log_sigma)
    q, p = torch.distributions.Normal(mu, log_sigma.exp()), torch.distributions.Normal(0.0, 1.0)
    torch.testing.assert_close(closed, torch.distributions.kl_divergence(q, p).sum(-1))
    # the same sigma samples (a standard deviation) and regularises; seeded draws (reparameterised from
    # a generator: the global stream would make the data depend on the tests run before), and a
    # tolerance of 5 standard errors of each row's Monte Carlo mean, not a fixed one
    n = 200_000
    x = mu + log_sigma.exp() * torch.randn(n, *mu.shape, generator=g, dtype=torch.float64)
    log_ratio = (q.log_prob(x) - p.log_prob(x)).sum(-1)  # (n, 3)
    mc, se = log_ratio.mean(0), log_ratio.std(0) / n ** 0.5
    assert ((closed - mc).abs() <= 5 * se).all(), (closed, mc, se)
    assert float(kl_to_standard_normal(torch.zeros(1, 4), torch.zeros(1, 4))) == 0.0  # N(0, I) itself


def test_kl_of_a_known_sigma():
    """sigma = 0.3 on every channel (h_sigma's bias log 0.3, weights 0) and |mu| = 1: the KL is
    1/2 (D 0.09 + 1 - D - 2 D log 0.3)."""
    head = create_head("uatvr", embed_dim=D)
    with torch.no_grad():
        head.text_dist.sigma_fc.weight.zero_()
        head.text_dist.sigma_fc.bias.fill_(math.log(0.3))
    texts, _ = batches(2, 2)
    with torch.no_grad():
        te = head.encode_texts(texts)
    torch.testing.assert_close(te["log_sigma"].exp(), torch.full_like(te["log_sigma"], 0.3))
    kl = float(kl_to_standard_normal(te["mu"], te["log_sigma"])[0])
    assert kl == pytest.approx(0.5 * (D * 0.09 + 1.0 - D - 2 * D * math.log(0.3)), rel=1e-5)


@pytest.mark.parametrize("overrides,terms", [
    ({"dsa": False, "dua_weight": 0.0, "kl_weight": 0.0}, {"dsa"}),  # Tab. 1 TI
    ({"dua_weight": 0.0, "kl_weight": 0.0}, {"dsa"}),  # +DSA
    ({"kl_weight": 0.0}, {"dsa", "dua", "kl"}),  # +DUA (KL logged, weight 0)
    ({}, {"dsa", "dua", "kl"}),  # +KL: the final model
])
def test_ablation_rows(overrides, terms):
    head = create_head("uatvr", embed_dim=D, **overrides).train()
    texts, videos = batches(4, 4)
    out = head.loss(texts, videos)
    assert set(out.terms) == terms
    expected = out.terms["dsa"] + sum(head.config.dua_weight * out.terms["dua"] if k == "dua" else
                                      head.config.kl_weight * out.terms["kl"] if k == "kl" else 0 for k in terms)
    torch.testing.assert_close(out.total.detach(), expected)
    assert ("video_tokens" in dict(head.named_parameters())) == overrides.get("dsa", True)


@pytest.mark.parametrize("cv,ct", [(0, 0), (1, 4), (12, 2)])
def test_extra_token_counts(cv, ct):
    head = perturbed("uatvr", extra_video_tokens=cv, extra_text_tokens=ct)
    texts, videos = batches(3, 4)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
    assert te["tokens"].shape[1] == texts.tokens.shape[1] + ct and ve["frames"].shape[1] == videos.frames.shape[1] + cv
    assert te["token_mask"][:, -ct:].all() if ct else True
    assert ve["frame_mask"][:, videos.frames.shape[1]:].all()


def test_bad_config_is_named():
    with pytest.raises(ConfigError, match="num_samples"):
        create_head("uatvr", embed_dim=D, num_samples=0)
    with pytest.raises(ConfigError, match="kl_reduction"):
        create_head("uatvr", embed_dim=D, kl_reduction="max")
    with pytest.raises(ConfigError, match="max_len=90"):
        create_head("uatvr", embed_dim=D).encode_videos(VideoBatch(torch.randn(1, 90, D), torch.ones(1, 90, dtype=torch.bool)))


def test_sigma_readout_is_the_geometric_mean():
    head = perturbed("uatvr")
    texts, videos = batches(4, 3)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
    r = head.item_readouts(te, ve)
    all_sigma = np.concatenate([np.exp(np64(te["log_sigma"])).ravel(), np.exp(np64(ve["log_sigma"])).ravel()])
    assert r["sigma"] == pytest.approx(float(np.exp(np.log(all_sigma).mean())), rel=1e-9)
    assert r["sigma_text"] == pytest.approx(float(np.exp(np64(te["log_sigma"]).mean())), rel=1e-9)


def test_learns_far_above_chance_and_logs_sigma(tmp_path):
    import csv

    from tvrpipe.training.fit import TrainConfig, fit
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=300, val_videos=60, test_videos=100, captions_per_train_video=4, embed_dim=32,
                   intrinsic_dim=32, frames=8, max_words=10, seed=3)
    store = generate_store(tmp_path / "store", spec)
    m = fit(store, "uatvr", tmp_path / "run", TrainConfig(epochs=3, batch_size=64), progress=False)
    assert m["test"]["t2v"]["R@1"] > 15  # chance: 1 %; measured 28
    rows = list(csv.DictReader(open(tmp_path / "run" / "epochs.csv")))
    assert {"loss_dsa", "loss_dua", "loss_kl", "val_sigma", "val_sigma_text", "val_sigma_video"} <= set(rows[0])
    assert m["val"]["readouts"]["sigma"] > 0
    assert (tmp_path / "run" / "plots" / "readouts.png").stat().st_size > 1000
