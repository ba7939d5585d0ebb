"""DUQ: Eq. 3, 6, 7, 10-15 against closed forms, Monte Carlo and loops; Eq. 16 as a
head-declared re-ranking of the full matrix, checked against a direct computation; ablations,
readouts and learning on a store with near-duplicates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_heads import D, batches, np64, perturbed, sim, unit

from tvrpipe.errors import ConfigError
from tvrpipe.evaluation.engine import EvalInputs, EvalOptions, evaluate_head
from tvrpipe.evaluation.metrics import retrieval_metrics, t2v_ranks, v2t_ranks
from tvrpipe.heads import VideoBatch, create_head
from tvrpipe.heads.duq import evidential_mse, uncertainty_mass

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths


def test_eq6_is_the_dirichlet_expectation_of_the_squared_error():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(3, 5, generator=g, dtype=torch.float64) * 2 - 1  # cosines
    y = torch.eye(3, 5, dtype=torch.float64)
    closed = evidential_mse(s, y)
    alpha = torch.relu(s) + 1
    for i in range(3):  # Monte Carlo over p ~ Dir(alpha_i) of Eq. 4
        with torch.random.fork_rng():  # seeded draws, whatever ran before (Dirichlet takes no generator)
            torch.manual_seed(i)
            p = torch.distributions.Dirichlet(alpha[i]).sample((200_000,))
        mc = ((y[i] - p) ** 2).sum(-1).mean()
        assert float(closed[i]) == pytest.approx(float(mc), abs=3e-3)
        a, strength = alpha[i].numpy(), float(alpha[i].sum())
        ph = a / strength
        var = a * (strength - a) / (strength ** 2 * (strength + 1))
        eq5 = np.sum(y[i].numpy() ** 2 - 2 * y[i].numpy() * ph + var + ph ** 2)  # Eq. 5 term by term
        assert float(closed[i]) == pytest.approx(eq5, rel=1e-12)


def test_eq3_uncertainty_mass():
    s = torch.tensor([[0.5, -0.2, 0.9], [-1.0, -0.5, 0.0]], dtype=torch.float64)
    np.testing.assert_allclose(uncertainty_mass(s, 1).numpy(), [3 / (1.5 + 1 + 1.9), 3 / 3])
    np.testing.assert_allclose(uncertainty_mass(s, 0).numpy(), [2 / (1.5 + 1), 2 / (1 + 1), 2 / (1.9 + 1)])


def _samples(mu, log_sigma, eps):
    return unit(np64(mu)[:, None] + np.exp(np64(log_sigma))[:, None] * eps)  # Eq. 9, normalised for cosines


def test_training_terms_match_loops():
    """Eq. 1, 7 (on S), 10-11 (max off the diagonal, min on it), 12, 13 (y = 1 - I), 14, 15."""
    head = perturbed("duq", dtype=torch.float64, xpool_dropout=0.0, num_samples=3).train()
    texts, videos = batches(4, 4, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    eps = tuple(torch.randn(4, 3, D, generator=g, dtype=torch.float64) for _ in range(2))
    out = head.loss(texts, videos, eps=eps)
    te, ve = head.encode_texts(texts), head.encode_videos(videos)
    lam = float(head.logits_scale().detach())
    with torch.no_grad():
        s = np64(head.xpool.similarity(te, ve))
    zt, zv = _samples(te["p_mu"].detach(), te["p_log_sigma"].detach(), eps[0].numpy()), \
        _samples(ve["p_mu"].detach(), ve["p_log_sigma"].detach(), eps[1].numpy())
    dmat = np.zeros((4, 4))
    for i in range(4):
        for j in range(4):
            d = [1 - zt[i, m] @ zv[j, n] for m in range(3) for n in range(3)]
            dmat[i, j] = min(d) if i == j else max(d)

    def infonce(x):
        def ce(m):
            m = m - m.max(1, keepdims=True)
            return -np.mean(np.diag(m) - np.log(np.exp(m).sum(1)))
        return (ce(x) + ce(x.T)) / 2

    def eq7(m, y):
        def rows(m):
            alpha = np.maximum(m, 0) + 1
            strength = alpha.sum(1, keepdims=True)
            p = alpha / strength
            return ((y - p) ** 2 + p * (1 - p) / (strength + 1)).sum(1)
        return (rows(m).sum() + rows(m.T).sum()) / len(m)

    eye = np.eye(4)
    kl = sum(0.5 * np.sum(np.exp(2 * ls) + mu ** 2 - 1 - 2 * ls, -1)
             for mu, ls in ((np64(te["p_mu"]), np64(te["p_log_sigma"])), (np64(ve["p_mu"]), np64(ve["p_log_sigma"]))))
    ref = {"s": infonce(lam * s), "s_u": eq7(s, eye), "d": infonce(-lam * dmat), "d_u": eq7(dmat, 1 - eye),
           "kl": kl.mean()}
    for k, v in ref.items():
        assert float(out.terms[k]) == pytest.approx(v, rel=1e-9), k
    total = ref["s"] + ref["s_u"] + 0.1 * (ref["d"] + ref["d_u"]) + 1e-4 * ref["kl"]
    assert float(out.total.detach()) == pytest.approx(total, rel=1e-9)


def rerank_reference(head, texts, videos) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 16 written directly on the full matrix: d = mean over the K x K fixed samples of Eq. 10,
    u over each query's candidates (rows for t2v, columns for v2t)."""
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        s = np64(head.similarity(te, ve))
    eps = np64(head.noise)  # (2, K, D): texts, videos
    zt = _samples(te["p_mu"], te["p_log_sigma"], eps[0])
    zv = _samples(ve["p_mu"], ve["p_log_sigma"], eps[1])
    n_t, n_v = s.shape
    d = np.array([[np.mean([1 - a @ b for a in zt[i] for b in zv[j]]) for j in range(n_v)] for i in range(n_t)])
    g1, g2 = head.config.gamma1, head.config.gamma2
    out = []
    for axis in (1, 0):
        u_s = s.shape[axis] / (np.maximum(s, 0) + 1).sum(axis)
        u_d = s.shape[axis] / (np.maximum(d, 0) + 1).sum(axis)
        f = np.exp(-g1 * u_d) * np.exp(-g2 * u_s)
        out.append((f[:, None] if axis == 1 else f[None, :]) * (1 - d) * s)
    return out[0], out[1]


def test_eq16_rerank_matches_direct_computation_and_reports_apart():
    head = perturbed("duq", dtype=torch.float64, gamma1=0.7, gamma2=0.4)
    texts, videos = batches(6, 5, dtype=torch.float64)
    t2v_ref, v2t_ref = rerank_reference(head, texts, videos)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        rr = head.rerank(head.similarity(te, ve), te, ve)
    np.testing.assert_allclose(rr.t2v.numpy(), t2v_ref, atol=1e-12)
    np.testing.assert_allclose(rr.v2t.numpy(), v2t_ref, atol=1e-12)
    tv = np.array([0, 1, 2, 3, 4, 0])
    res = evaluate_head(head, EvalInputs([texts], [videos], tv),
                        EvalOptions(block_texts=4, block_videos=2, readouts=True))
    assert res["t2v_rerank"] == retrieval_metrics(t2v_ranks(torch.from_numpy(t2v_ref), tv))
    assert res["v2t_rerank"] == retrieval_metrics(v2t_ranks(torch.from_numpy(v2t_ref), tv))
    raw = sim(head, texts, videos)
    assert res["t2v"] == retrieval_metrics(t2v_ranks(raw, tv))  # raw numbers are the raw scores
    assert {"u_s_t2v", "u_d_t2v", "u_s_v2t", "u_d_v2t"} <= set(res["readouts"])
    top1 = t2v_ranks(raw, tv) == 1
    u_s = 5 / (np.maximum(raw.numpy(), 0) + 1).sum(1)
    for kind, sel in (("correct", top1), ("incorrect", ~top1)):
        want = u_s[sel].mean() if sel.any() else float("nan")
        # the engine computes u_s in float32 from float32 scores, the reference in float64: a few
        # float32 roundings (6e-8 each) apart
        np.testing.assert_allclose(res["readouts"]["u_s_t2v"][kind], want, rtol=1e-6)
    off = evaluate_head(create_head("duq", embed_dim=D, rerank=False),
                        EvalInputs([texts.to("cpu", torch.float32)], [videos.to("cpu", torch.float32)], tv))
    assert "t2v_rerank" not in off and "v2t_rerank" not in off


def test_gammas_zero_leave_the_distance_product():
    head = perturbed("duq", gamma1=0.0, gamma2=0.0)
    texts, videos = batches(4, 5)
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        s = head.similarity(te, ve)
        rr = head.rerank(s, te, ve)
    torch.testing.assert_close(rr.t2v, (1 - head.distance(te, ve)) * s)
    torch.testing.assert_close(rr.v2t, rr.t2v)


def test_permuting_videos_permutes_raw_and_reranked_columns():
    head = perturbed("duq")
    texts, videos = batches(5, 6)
    perm = torch.tensor([4, 0, 5, 2, 1, 3])
    with torch.no_grad():
        te, ve = head.encode_texts(texts), head.encode_videos(videos)
        vp = head.encode_videos(VideoBatch(videos.frames[perm], videos.frame_mask[perm]))
        a, b = head.similarity(te, ve), head.similarity(te, vp)
        ra, rb = head.rerank(a, te, ve), head.rerank(b, te, vp)
    torch.testing.assert_close(b, a[:, perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(rb.t2v, ra.t2v[:, perm], atol=1e-6, rtol=0)
    torch.testing.assert_close(rb.v2t, ra.v2t[:, perm], atol=1e-6, rtol=0)


def test_inference_noise_is_fixed_by_the_seed_and_independent_per_modality():
    a, b = create_head("duq", embed_dim=D), create_head("duq", embed_dim=D)
    assert torch.equal(a.noise, b.noise) and a.noise.shape == (2, 7, D)
    assert not torch.allclose(a.noise[0], a.noise[1])
    assert not torch.equal(create_head("duq", embed_dim=D, noise_seed=1).noise, a.noise)


@pytest.mark.parametrize("overrides,terms", [
    ({"uncertainty_weight": 0.0, "distance_weight": 0.0, "kl_weight": 0.0}, {"s"}),  # Tab. 3 #1: L_S
    ({"distance_weight": 0.0, "kl_weight": 0.0}, {"s", "s_u"}),  # +L_S^U
    ({"distance_uncertainty": False}, {"s", "s_u", "d", "kl"}),  # +L_D
    ({"distance_infonce": False}, {"s", "s_u", "d_u", "kl"}),  # L_D^U without L_D (row #5)
    ({}, {"s", "s_u", "d", "d_u", "kl"}),  # +L_D + L_D^U: the full model
])
def test_ablation_rows(overrides, terms):
    head = create_head("duq", embed_dim=D, xpool_dropout=0.0, **overrides).train()
    texts, videos = batches(4, 4)
    torch.manual_seed(0)
    out = head.loss(texts, videos)
    assert set(out.terms) == terms
    c, t = head.config, out.terms
    want = t["s"] + c.uncertainty_weight * t.get("s_u", 0) + c.distance_weight * (t.get("d", 0) + t.get("d_u", 0)) \
        + c.kl_weight * t.get("kl", 0)
    torch.testing.assert_close(out.total.detach(), torch.as_tensor(want, dtype=out.total.dtype))


def test_zero_variance_distances_are_the_mean_cosines():
    """sigma -> 0: every sample is mu, so Eq. 11's min and max and the inference mean all equal
    1 - cos(mu_t, mu_v)."""
    head = perturbed("duq", dtype=torch.float64, xpool_dropout=0.0)
    with torch.no_grad():
        head.text_sigma.bias.fill_(-60.0)
        head.video_sigma.bias.fill_(-60.0)
    texts, videos = batches(4, 4, dtype=torch.float64)
    te, ve = head.encode_texts(texts), head.encode_videos(videos)
    ref = 1 - torch.nn.functional.normalize(te["p_mu"], dim=-1) @ torch.nn.functional.normalize(ve["p_mu"], dim=-1).t()
    torch.testing.assert_close(head.distance(te, ve), ref)
    head.train()
    eps = tuple(torch.randn(4, 7, D, dtype=torch.float64) for _ in range(2))
    out = head.loss(texts, videos, eps=eps)
    lam = head.logits_scale()
    from tvrpipe.heads.losses import symmetric_infonce

    torch.testing.assert_close(out.terms["d"], symmetric_infonce(-ref * lam).detach())


def test_gammas_cannot_change_a_rank_under_per_query_ranking():
    """u_s and u_d are per query, so Eq. 16's exponential factors are constant along every ranked list."""
    texts, videos = batches(6, 5)
    tv = np.array([0, 1, 2, 3, 4, 1])
    results = []
    for g in (0.0, 0.1, 5.0):
        head = perturbed("duq", gamma1=g, gamma2=g)
        r = evaluate_head(head, EvalInputs([texts], [videos], tv))
        results.append((r["t2v_rerank"], r["v2t_rerank"]))
    assert results[0] == results[1] == results[2]


def test_distance_branch_starts_at_the_zero_shot_alignment():
    """identity_init: mu_t = the sentence, mu_v = the mean frame, so with sigma -> 0 the inference
    distance is 1 - cos(sentence, mean frame) before any training."""
    head = create_head("duq", embed_dim=D, log_sigma_init=-60.0).eval()
    texts, videos = batches(4, 5)
    with torch.no_grad():
        d = head.distance(head.encode_texts(texts), head.encode_videos(videos))
    mean_frame = torch.stack([videos.frames[j][videos.frame_mask[j]].mean(0) for j in range(5)])
    ref = 1 - torch.nn.functional.normalize(texts.sentence, dim=-1) @ torch.nn.functional.normalize(mean_frame, dim=-1).t()
    torch.testing.assert_close(d, ref, atol=1e-5, rtol=0)


def test_text_gaussian_reads_the_words_without_the_start_token():
    """Sec. 3.1: F_t = [w_1, ..., w_Nt]. With drop_sot (default) the text Gaussian is the aggregation
    of the words and EOT only: changing the start token's feature changes nothing, and it equals
    drop_sot=False on the captions with their first position masked out."""
    head = perturbed("duq").eval()
    texts, _ = batches(4, 1)
    other = type(texts)(texts.tokens.clone(), texts.token_mask, texts.sentence)
    other.tokens[:, 0] += 5.0  # the start token
    with torch.no_grad():
        a, b = head.encode_texts(texts), head.encode_texts(other)
        torch.testing.assert_close(a["p_mu"], b["p_mu"])
        torch.testing.assert_close(a["p_log_sigma"], b["p_log_sigma"])
        keep_sot = perturbed("duq", drop_sot=False).eval()
        assert not torch.allclose(keep_sot.encode_texts(texts)["p_mu"], keep_sot.encode_texts(other)["p_mu"])
        shifted = type(texts)(texts.tokens, texts.token_mask & (torch.arange(texts.token_mask.shape[1]) > 0),
                              texts.sentence)
        torch.testing.assert_close(keep_sot.encode_texts(shifted)["p_mu"], a["p_mu"])


def test_bad_config_is_named():
    with pytest.raises(ConfigError, match="num_samples"):
        create_head("duq", embed_dim=D, num_samples=0)
    with pytest.raises(ConfigError, match="distance_reduction"):
        create_head("duq", embed_dim=D, distance_reduction="median")
    with pytest.raises(ConfigError, match="gamma1"):
        create_head("duq", embed_dim=D, gamma1=-1.0)


def test_learns_near_duplicate_store_far_above_chance(tmp_path):
    import csv

    from tvrpipe.training.fit import TrainConfig, fit
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=300, val_videos=60, test_videos=100, captions_per_train_video=4, near_duplicates=0.3,
                   embed_dim=32, intrinsic_dim=32, frames=8, max_words=10, seed=4)
    store = generate_store(tmp_path / "store", spec)
    m = fit(store, "duq", tmp_path / "run", TrainConfig(epochs=4, batch_size=64), progress=False)
    assert m["test"]["t2v"]["R@1"] > 15  # chance: 1 %; measured 40
    assert m["test"]["t2v_rerank"]["R@1"] > 15 and m["val"]["t2v_rerank"]["n"] == 60  # measured 49
    rows = list(csv.DictReader(open(tmp_path / "run" / "epochs.csv")))
    assert {"loss_s", "loss_s_u", "loss_d", "loss_d_u", "loss_kl", "val_u_s_t2v_correct",
            "val_u_d_t2v_incorrect"} <= set(rows[0])
    assert (tmp_path / "run" / "plots" / "readouts.png").stat().st_size > 1000


def test_train_head_cli_prints_reranked_rows_and_readouts(cli, tmp_path):
    from tvrpipe.worlds.features import GenSpec, generate_store

    store = generate_store(tmp_path / "store", GenSpec(train_videos=64, val_videos=16, test_videos=16,
                                                       captions_per_train_video=2, embed_dim=16, frames=4,
                                                       max_words=6, seed=2))
    r = cli("train-head", "--features", store, "--method", "duq", "--out", tmp_path / "run", "--epochs", "1",
            "--batch-size", "32")
    assert r.exit_code == 0, r.output
    assert "t2v_rerank" in r.output and "v2t_rerank" in r.output
    assert "readout u_s_t2v: correct" in r.output and "incorrect" in r.output


def test_local_aggregation_mean_equals_the_block_mean():
    """attention_block_mean (value and output projections after the mean) equals the plain
    masked mean of the attention block's output, padding included, and so does its gradient."""
    from tvrpipe.heads.duq import attention_block_mean
    from tvrpipe.heads.losses import masked_mean
    from tvrpipe.heads.seqtransf import ResidualAttentionBlock

    torch.manual_seed(0)
    block = ResidualAttentionBlock(16, 4, mlp_ratio=0, ln_eps=1e-5).double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 7, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(7)[None] < torch.tensor([[7], [1], [4], [6], [0]])  # the last item: all padding
    xm = torch.where(mask[..., None], x, torch.zeros_like(x))
    direct = masked_mean(block(xm, mask), mask, dim=1)
    fast = attention_block_mean(block, xm, mask)
    torch.testing.assert_close(fast, direct, rtol=1e-12, atol=1e-12)
    assert fast[4].abs().max() == 0  # an all-padded item averages to 0 either way
    g_direct = torch.autograd.grad(direct.square().sum(), [x, *block.parameters()], retain_graph=True)
    g_fast = torch.autograd.grad(fast.square().sum(), [x, *block.parameters()])
    for a, b in zip(g_direct, g_fast):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
