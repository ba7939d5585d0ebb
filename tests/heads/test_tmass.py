"""T-MASS: Eq. 5-10 against direct per-pair loops written from the paper, limiting
cases, leak-free and order-free sampled inference, the radius readout, and learning.

The references loop over pairs and samples in NumPy float64 with the head's weights copied out;
X-Pool's pooled video comes from the X-Pool reference of test_heads (written from its equations).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_heads import D, batches, np64, perturbed, sim, unit, xpool_pooled_reference

from tvrpipe.errors import ConfigError
from tvrpipe.heads import TextBatch, VideoBatch, create_head

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths


def radius_reference(head, texts: TextBatch, videos: VideoBatch) -> np.ndarray:
    """R of every pair (Eq. 6-7 and Tab. 5), (n_text, n_video, D): S over the real frames only."""
    cfg = head.config
    out = np.zeros((len(texts), len(videos), cfg.embed_dim))
    for i in range(len(texts)):
        t = unit(np64(texts.sentence[i]))
        for j in range(len(videos)):
            frames = np64(videos.frames[j])[videos.frame_mask[j].numpy()]
            s = unit(frames) @ t if len(frames) else np.zeros(0)  # S_1..S_F' (Eq. 6)
            if cfg.radius == "linear":  # exp(S W + b), W: (F, D); only real frames' rows
                w = np64(head.radius_proj.weight).T  # (num_frames, D)
                b = np64(head.radius_proj.bias) if head.radius_proj.bias is not None else 0.0  # radius_bias
                out[i, j] = np.exp(s @ w[: len(s)] + b)
            else:
                mean_s = s.mean() if len(s) else 0.0
                theta = float(head.theta.detach()) if cfg.radius == "scalar" else 1.0
                out[i, j] = np.exp(theta * mean_s)
    return out


def score_reference(head, texts: TextBatch, videos: VideoBatch) -> np.ndarray:
    """Eq. 10 per pair: the max over the M fixed draws of cos(t + R * eps_m, z_{v|t})."""
    z = xpool_pooled_reference(head, texts, videos)
    r = radius_reference(head, texts, videos)
    eps = np64(head.noise)  # (M, D)
    out = np.zeros((len(texts), len(videos)))
    for i in range(len(texts)):
        t = np64(texts.sentence[i])
        for j in range(len(videos)):
            out[i, j] = max(unit(t + r[i, j] * e) @ unit(z[i, j]) for e in eps)
    return out


@pytest.mark.parametrize("radius", ["linear", "scalar", "mean"])
def test_radius_variants_match_their_formulas(radius):
    head = perturbed("tmass", dtype=torch.float64, radius=radius)
    texts, videos = batches(4, 6, dtype=torch.float64)
    assert (~videos.frame_mask).any()  # padded videos included
    with torch.no_grad():
        r = head.radius(head.encode_texts(texts), head.encode_videos(videos))
    np.testing.assert_allclose(r.numpy(), radius_reference(head, texts, videos), rtol=1e-12)


@pytest.mark.parametrize("radius", ["linear", "scalar", "mean"])
@pytest.mark.parametrize("prior", ["normal", "uniform"])
@pytest.mark.parametrize("radius_bias", [True, False])
def test_sampled_inference_matches_per_pair_loop(radius, prior, radius_bias):
    head = perturbed("tmass", dtype=torch.float64, radius=radius, prior=prior, num_samples=7, radius_bias=radius_bias)
    texts, videos = batches(5, 6, dtype=torch.float64)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), score_reference(head, texts, videos), atol=1e-10)


def test_official_projection_biases_match_the_per_pair_loop():
    """proj_bias (the official code's q/k/v/out biases): Eq. 10 still matches the loop written from
    the equations, which adds the biases (training: test_loss_terms_match_per_pair_loops)."""
    head = perturbed("tmass", dtype=torch.float64, proj_bias=True, num_samples=7)
    assert all(m.bias.abs().max().item() > 0 for m in (head.q_proj, head.k_proj, head.v_proj, head.out_proj))
    texts, videos = batches(5, 6, dtype=torch.float64)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), score_reference(head, texts, videos), atol=1e-10)


def test_float32_sampled_inference_matches_reference():
    head = perturbed("tmass")
    texts, videos = batches(5, 6)
    np.testing.assert_allclose(sim(head, texts, videos).numpy(), score_reference(head, texts, videos), atol=1e-4)


def test_prior_draws_are_what_the_config_says():
    normal = create_head("tmass", embed_dim=64, num_samples=500).noise
    uniform = create_head("tmass", embed_dim=64, num_samples=500, prior="uniform").noise
    assert normal.shape == (500, 64)
    assert abs(float(normal.mean())) < 0.02 and abs(float(normal.std()) - 1) < 0.02
    assert float(uniform.min()) >= 0 and float(uniform.max()) < 1 and abs(float(uniform.mean()) - 0.5) < 0.01


def test_zero_samples_or_zero_radius_is_xpool():
    """M = 0 scores t itself: exactly X-Pool with the same weights; R -> 0 gives the same scores."""
    head = perturbed("tmass", num_samples=0)
    xpool = create_head("xpool", embed_dim=D).eval()
    xpool.load_state_dict({k: v for k, v in head.state_dict().items() if k in xpool.state_dict()})
    texts, videos = batches(5, 6)
    assert torch.equal(sim(head, texts, videos), sim(xpool, texts, videos))
    tiny = perturbed("tmass")
    with torch.no_grad():
        tiny.radius_proj.bias.fill_(-60.0)  # R = exp(S W - 60) ~ 1e-26
    xpool.load_state_dict({k: v for k, v in tiny.state_dict().items() if k in xpool.state_dict()})
    torch.testing.assert_close(sim(tiny, texts, videos), sim(xpool, texts, videos), atol=1e-6, rtol=0)


def test_a_pairs_score_ignores_the_other_items_and_the_blocks():
    """A pair's sampled score is the same whichever other texts and videos share its block, in
    whatever order, and whatever the chunking (common random numbers, no per-call noise)."""
    head = perturbed("tmass")
    texts, videos = batches(7, 9, seed=3)
    full = sim(head, texts, videos)
    keep_t, keep_v = torch.tensor([5, 0, 3]), torch.tensor([8, 2, 4, 1])
    sub = sim(head, TextBatch(texts.tokens[keep_t], texts.token_mask[keep_t], texts.sentence[keep_t]),
              VideoBatch(videos.frames[keep_v], videos.frame_mask[keep_v]))
    # other block shapes, other summation orders: each path is within ~2.4e-7 of float64 here (M = 20
    # noise matmuls), so two paths within ~5e-7; 5e-6 leaves a margin for other CPUs' kernels
    torch.testing.assert_close(sub, full[keep_t][:, keep_v], atol=5e-6, rtol=0)
    import tvrpipe.heads.tmass as tm

    budget = tm._PAIR_BUDGET
    try:
        tm._PAIR_BUDGET = 1  # one pair per tile
        torch.testing.assert_close(sim(head, texts, videos), full, atol=5e-6, rtol=0)
    finally:
        tm._PAIR_BUDGET = budget
    # the same noise for the same seed, in a fresh head; another seed draws other noise
    again = create_head("tmass", embed_dim=D)
    again.load_state_dict(head.state_dict())
    assert torch.equal(sim(again.eval(), texts, videos), full)
    other = create_head("tmass", embed_dim=D, noise_seed=1)
    other.load_state_dict(head.state_dict())
    assert not torch.equal(sim(other.eval(), texts, videos), full)


def test_sampling_only_raises_scores_and_more_samples_never_lower_them():
    """Eq. 10 is a max over samples: M = 20 draws include the first 5 (same seed), so the score
    is >= the M = 5 score for every pair."""
    texts, videos = batches(5, 6)
    few = perturbed("tmass", num_samples=5)
    many = perturbed("tmass", num_samples=20)
    assert torch.equal(many.noise[:5], few.noise)
    assert (sim(many, texts, videos) >= sim(few, texts, videos) - 1e-6).all()


def test_video_with_more_frames_than_w_rows_is_a_clear_error():
    head = create_head("tmass", embed_dim=D, num_frames=3)
    _, videos = batches(2, 2)
    with pytest.raises(ConfigError, match="num_frames=5"):
        head.encode_videos(videos)


@pytest.mark.parametrize("key,value,msg", [("radius", "cubic", "radius must be one of"),
                                           ("prior", "laplace", "prior must be one of"),
                                           ("num_samples", -1, "num_samples must be >= 0"),
                                           ("train_radius", "some", "train_radius must be one of"),
                                           ("alpha", -1.0, r"tmass: alpha must be >= 0, got -1.0")])
def test_bad_config_is_named(key, value, msg):
    with pytest.raises(ConfigError, match=msg):
        create_head("tmass", embed_dim=D, **{key: value})


def test_a_config_that_trains_nothing_is_refused_as_it_is_made():
    from tvrpipe.heads.tmass import Config

    with pytest.raises(ConfigError, match="tmass: the loss weights alpha, w_s, w_ce must not all be 0"):
        Config(embed_dim=D, alpha=0.0, w_s=0.0, w_ce=0.0)  # no head built: the config checks itself


# -- training: Eq. 5, 8, 9 and the Tab. 6a switches ------------------------------------------------


def loss_reference(head, texts, videos, eps: np.ndarray, paired: bool = False) -> dict[str, float]:
    """L_s, L_sup, L_ce from per-pair loops (no dropout), with this step's eps (B, D)."""
    z = xpool_pooled_reference(head, texts, videos)  # (B, B, D)
    r = radius_reference(head, texts, videos)  # (B, B, D)
    t = np64(texts.sentence)
    b = len(t)
    scale = float(head.logits_scale().detach())
    cos = {k: np.zeros((b, b)) for k in ("s", "sup", "ce")}
    for i in range(b):
        for j in range(b):
            rad = r[i, i] if paired else r[i, j]
            v_sup = z[i, i] if paired else z[i, j]
            t_s = t[i] + rad * eps[i]  # Eq. 5
            t_sup = t[i] + (v_sup - t[i]) / np.linalg.norm(v_sup - t[i]) * rad  # Eq. 8
            cos["s"][i, j] = unit(t_s) @ unit(z[i, j])
            cos["sup"][i, j] = unit(t_sup) @ unit(z[i, j])
            cos["ce"][i, j] = unit(t[i]) @ unit(z[i, j])

    def infonce(logits):  # symmetric cross-entropy, diagonal positives
        def ce(x):
            x = x - x.max(1, keepdims=True)
            return -np.mean(np.diag(x) - np.log(np.exp(x).sum(1)))
        return (ce(logits) + ce(logits.T)) / 2

    return {k: infonce(scale * c) for k, c in cos.items()}


@pytest.mark.parametrize("train_radius,proj_bias", [("pairs", False), ("paired", False), ("pairs", True)])
def test_loss_terms_match_per_pair_loops(train_radius, proj_bias):
    head = perturbed("tmass", dtype=torch.float64, dropout=0.0, w_ce=0.5, train_radius=train_radius,
                     proj_bias=proj_bias).train()
    texts, videos = batches(5, 5, dtype=torch.float64)
    eps = torch.randn(5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    out = head.loss(texts, videos, eps=eps)
    ref = loss_reference(head, texts, videos, eps.numpy(), paired=train_radius == "paired")
    for k in ("s", "sup", "ce"):
        assert float(out.terms[k]) == pytest.approx(ref[k], rel=1e-10), k
    assert float(out.total.detach()) == pytest.approx(ref["s"] + 1.2 * ref["sup"] + 0.5 * ref["ce"], rel=1e-10)


@pytest.mark.parametrize("weights,terms", [
    ({"w_s": 0.0, "alpha": 0.0, "w_ce": 1.0}, {"ce"}),  # Tab. 6a row 1 (X-Pool; with num_samples=0)
    ({"w_s": 1.0, "alpha": 0.0, "w_ce": 1.0}, {"s", "ce"}),  # row 2
    ({"w_s": 1.0, "alpha": 0.0}, {"s"}),  # row 3
    ({}, {"s", "sup"}),  # row 4: the final model
])
def test_ablation_switches_select_the_loss_terms(weights, terms):
    head = create_head("tmass", embed_dim=D, **weights).train()
    texts, videos = batches(4, 4)
    assert set(head.loss(texts, videos).terms) == terms


def test_table_6a_row_1_is_xpool_training():
    """t_s off, L_ce only: the loss is X-Pool's on the same weights (dropout off)."""
    head = perturbed("tmass", dropout=0.0, w_s=0.0, alpha=0.0, w_ce=1.0).train()
    xpool = create_head("xpool", embed_dim=D, dropout=0.0)
    xpool.load_state_dict({k: v for k, v in head.state_dict().items() if k in xpool.state_dict()})
    texts, videos = batches(4, 4)
    torch.testing.assert_close(head.loss(texts, videos).total, xpool.train().loss(texts, videos).total)


def test_training_draws_follow_the_prior_and_train_mode_similarity_samples():
    """Without explicit eps, each loss call draws fresh noise (from torch's seeded RNG), scaled by
    prior_std; train-mode similarity is one draw of t_s against each pair's pooled video."""
    head = perturbed("tmass", dropout=0.0, prior_std=1e-9).train()
    texts, videos = batches(4, 4)
    xpool = create_head("xpool", embed_dim=D, dropout=0.0).train()
    xpool.load_state_dict({k: v for k, v in head.state_dict().items() if k in xpool.state_dict()})
    # prior_std -> 0: t_s = t, so the train-mode similarity is X-Pool's cosine (radius ~ 1 here)
    torch.testing.assert_close(head.similarity(head.encode_texts(texts), head.encode_videos(videos)).detach(),
                               xpool.similarity(xpool.encode_texts(texts), xpool.encode_videos(videos)).detach(),
                               atol=1e-6, rtol=0)
    noisy = perturbed("tmass", dropout=0.0).train()
    torch.manual_seed(0)
    a = noisy.loss(texts, videos).terms["s"]
    b = noisy.loss(texts, videos).terms["s"]
    torch.manual_seed(0)
    assert float(a) != float(b) and float(noisy.loss(texts, videos).terms["s"]) == float(a)
    with pytest.raises(ConfigError, match="prior_std"):
        create_head("tmass", embed_dim=D, prior_std=0.0)


def test_eval_similarity_keeps_gradients_when_asked():
    head = perturbed("tmass")
    texts, videos = batches(3, 4)
    s = head.similarity(head.encode_texts(texts), head.encode_videos(videos))
    s.sum().backward()  # no in-place product on a tensor autograd needs
    assert head.radius_proj.weight.grad is not None and torch.isfinite(head.radius_proj.weight.grad).all()
    with torch.no_grad():
        torch.testing.assert_close(head.similarity(head.encode_texts(texts), head.encode_videos(videos)), s.detach())


def test_pair_readout_is_the_radius_l1_and_the_engine_splits_match_from_nonmatch():
    from tvrpipe.evaluation.engine import EvalInputs, EvalOptions, evaluate_head

    head = perturbed("tmass")
    texts, videos = batches(6, 4)
    text_video = np.array([0, 1, 2, 3, 0, 2])
    with torch.no_grad():
        l1 = head.pair_readouts(head.encode_texts(texts), head.encode_videos(videos))["radius_l1"].numpy()
    r = radius_reference(head, texts, videos)
    np.testing.assert_allclose(l1, np.abs(r).sum(-1), rtol=1e-5)
    match = np.zeros_like(l1, dtype=bool)
    match[np.arange(6), text_video] = True
    res = evaluate_head(head, EvalInputs([texts], [videos], text_video),
                        EvalOptions(block_texts=4, block_videos=3, readouts=True))
    assert res["readouts"]["radius_l1"]["match"] == pytest.approx(l1[match].mean(), rel=1e-5)
    assert res["readouts"]["radius_l1"]["nonmatch"] == pytest.approx(l1[~match].mean(), rel=1e-5)
    assert "readouts" not in evaluate_head(create_head("xpool", embed_dim=D), EvalInputs([texts], [videos], text_video),
                                           EvalOptions(readouts=True))


def test_learns_multi_scene_store_far_above_chance_and_logs_the_radius(tmp_path):
    from tvrpipe.training.fit import TrainConfig, fit
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=400, val_videos=60, test_videos=100, captions_per_train_video=4, scenes=2,
                   caption_describes="scene", embed_dim=32, intrinsic_dim=32, frames=8, seed=1)
    store = generate_store(tmp_path / "store", spec)
    m = fit(store, "tmass", tmp_path / "run", TrainConfig(epochs=8, batch_size=64),
            overrides={"num_frames": 8}, progress=False)
    assert m["test"]["t2v"]["R@1"] > 10 * (100 / 100)  # chance: 1 %
    assert set(m["val"]["readouts"]["radius_l1"]) == {"match", "nonmatch"}
    import csv

    rows = list(csv.DictReader(open(tmp_path / "run" / "epochs.csv")))
    assert {"loss_s", "loss_sup", "val_radius_l1_match", "val_radius_l1_nonmatch"} <= set(rows[0])
    assert (tmp_path / "run" / "plots" / "readouts.png").stat().st_size > 1000
