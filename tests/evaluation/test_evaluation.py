"""Evaluation: metrics against independent NumPy references, the block engine, DSL and QB-Norm.

The references below are written from the definitions in docs/protocol.md (summed up in docs/design.md,
"Evaluation protocol") in a different style from the library (sorting and Python loops instead of
blockwise counting).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tvrpipe.errors import ConfigError
from tvrpipe.evaluation import (
    EvalInputs,
    EvalOptions,
    QueryBankAccumulator,
    apply_qb_norm,
    dual_softmax,
    encode_all,
    evaluate_head,
    evaluate_similarity,
    qb_norm,
    querybank_summary,
    retrieval_metrics,
    similarity_matrix,
    slice_emb,
    t2v_ranks,
    v2t_ranks,
)
from tvrpipe.heads.base import Emb, Head, HeadConfig, TextBatch, VideoBatch

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths

# --------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------


def ref_t2v_ranks(sim: np.ndarray, text_video: np.ndarray) -> np.ndarray:
    """Sort each row (stable), then move the ground truth behind every video tied with it."""
    ranks = []
    for i, row in enumerate(sim):
        g = text_video[i]
        order = list(np.argsort(-row, kind="stable"))
        pos = order.index(g)
        tied_behind = sum(1 for j in order[pos + 1 :] if row[j] == row[g])
        ranks.append(pos + 1 + tied_behind)
    return np.array(ranks)


def ref_v2t_ranks(sim: np.ndarray, text_video: np.ndarray) -> np.ndarray:
    """Per video, walk the captions best first (other videos' captions first on ties)."""
    ranks = []
    for j in range(sim.shape[1]):
        own = {i for i in range(sim.shape[0]) if text_video[i] == j}
        if not own:
            continue
        order = sorted(range(sim.shape[0]), key=lambda k: (-sim[k, j], k in own))
        first_own = next(r for r, k in enumerate(order) if k in own)
        ranks.append(first_own + 1)  # everything before it belongs to other videos
    return np.array(ranks)


def ref_metrics(ranks: np.ndarray) -> dict:
    r = sorted(int(x) for x in ranks)
    n = len(r)
    med = r[n // 2] if n % 2 else (r[n // 2 - 1] + r[n // 2]) / 2
    out = {f"R@{k}": 100.0 * sum(x <= k for x in r) / n for k in (1, 5, 10)}
    return {**out, "MdR": float(med), "MnR": sum(r) / n, "n": n}


def ref_dual_softmax(sim: np.ndarray, temperature: float, axis: int) -> np.ndarray:
    e = np.exp(temperature * sim.astype(np.float64))
    return sim * (e / e.sum(axis=axis, keepdims=True))


def ref_qb_norm_official(test: np.ndarray, bank: np.ndarray, k: int, beta: float) -> np.ndarray:
    """The logic of ioanacroi/qb-norm dynamic_inverted_softmax.py, in ratio form (no overflow here)."""
    retrieved = np.unique(np.argsort(-bank, axis=1)[:, :k].reshape(-1))
    out = test.astype(np.float64).copy()
    norm = np.exp(beta * bank).sum(axis=0)
    for i in range(test.shape[0]):
        if np.argsort(-test[i])[0] in retrieved:
            out[i] = np.exp(beta * test[i]) / norm
    return out


def _random_assignment(rng: np.random.Generator, n_videos: int, per_video: int) -> np.ndarray:
    tv = np.repeat(np.arange(n_videos), per_video)
    return tv[rng.permutation(tv.size)]  # captions in shuffled order


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def test_hand_made_ties_count_against_the_model():
    sim = np.array([[0.5, 0.5, 0.1], [0.2, 0.9, 0.9], [0.3, 0.3, 0.3]])
    tv = np.array([0, 1, 2])
    assert t2v_ranks(sim, tv).tolist() == [2, 2, 3]
    # video 2's own caption (0.3) is beaten by caption 1 (0.9); columns 0 and 1 are won
    assert v2t_ranks(sim, tv).tolist() == [1, 1, 2]
    constant = np.zeros((4, 4))
    assert t2v_ranks(constant, np.arange(4)).tolist() == [4, 4, 4, 4]
    assert v2t_ranks(constant, np.arange(4)).tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize("decimals", [None, 1])
def test_one_caption_per_video_matches_reference(decimals):
    rng = np.random.default_rng(0)
    sim = rng.standard_normal((60, 60))
    if decimals is not None:
        sim = sim.round(decimals)  # many ties
    tv = rng.permutation(60)
    np.testing.assert_array_equal(t2v_ranks(sim, tv), ref_t2v_ranks(sim, tv))
    np.testing.assert_array_equal(v2t_ranks(sim, tv), ref_v2t_ranks(sim, tv))
    # one caption per video: v2t is t2v on the transpose
    inv = np.argsort(tv)
    np.testing.assert_array_equal(v2t_ranks(sim, tv), ref_t2v_ranks(sim.T, inv))
    got = evaluate_similarity(sim, tv)
    assert got["t2v"] == pytest.approx(ref_metrics(ref_t2v_ranks(sim, tv)))
    assert got["v2t"] == pytest.approx(ref_metrics(ref_v2t_ranks(sim, tv)))


@pytest.mark.parametrize("decimals", [None, 1])
def test_multi_caption_matches_reference(decimals):
    rng = np.random.default_rng(1)
    tv = _random_assignment(rng, n_videos=20, per_video=5)
    sim = rng.standard_normal((tv.size, 20)) + 1.5 * np.eye(20)[tv]  # some signal
    if decimals is not None:
        sim = sim.round(decimals)
    t2v, v2t = t2v_ranks(sim, tv), v2t_ranks(sim, tv)
    np.testing.assert_array_equal(t2v, ref_t2v_ranks(sim, tv))
    np.testing.assert_array_equal(v2t, ref_v2t_ranks(sim, tv))
    assert len(t2v) == 100 and len(v2t) == 20
    # blocks of 7 rows give the same ranks as one block
    np.testing.assert_array_equal(t2v_ranks(sim, tv, block_rows=7), t2v)
    np.testing.assert_array_equal(v2t_ranks(sim, tv, block_rows=7), v2t)
    # torch input, float32, gives the same as NumPy float32
    s32 = sim.astype(np.float32)
    np.testing.assert_array_equal(t2v_ranks(torch.from_numpy(s32), torch.from_numpy(tv)), t2v_ranks(s32, tv))
    np.testing.assert_array_equal(v2t_ranks(torch.from_numpy(s32), tv), v2t_ranks(s32, tv))


def test_own_captions_do_not_count_against_each_other():
    # video 0 has captions 0 and 1; caption 1 is better than caption 0 but both are correct
    sim = np.array([[0.8, 0.0], [0.9, 0.0], [0.85, 0.5]])
    tv = np.array([0, 0, 1])
    assert v2t_ranks(sim, tv).tolist() == [1, 1]
    # a tie between the best own caption and another video's caption is lost
    sim[2, 0] = 0.9
    assert v2t_ranks(sim, tv).tolist() == [2, 1]


def test_video_without_caption_is_a_distractor_only():
    rng = np.random.default_rng(2)
    tv = np.array([0, 0, 2, 3, 3, 3])  # video 1 has no caption
    sim = rng.standard_normal((6, 4))
    v2t = v2t_ranks(sim, tv)
    assert len(v2t) == 3
    np.testing.assert_array_equal(v2t, ref_v2t_ranks(sim, tv))
    sim[:, 1] = 10.0  # the caption-less video beats every caption's own video
    assert t2v_ranks(sim, tv).min() >= 2


def test_single_video():
    sim = np.array([[0.1], [0.7], [0.3]])
    tv = np.zeros(3, dtype=int)
    assert t2v_ranks(sim, tv).tolist() == [1, 1, 1]
    assert v2t_ranks(sim, tv).tolist() == [1]
    res = evaluate_similarity(sim, tv)
    assert res["t2v"]["R@1"] == 100.0 and res["v2t"]["n"] == 1


def test_retrieval_metrics_percent_median_mean():
    m = retrieval_metrics(np.array([1, 2, 6, 11]))
    assert m == {"R@1": 25.0, "R@5": 50.0, "R@10": 75.0, "MdR": 4.0, "MnR": 5.0, "n": 4}
    assert json.loads(json.dumps(m)) == m  # plain Python numbers, ready for metrics.json
    assert retrieval_metrics(np.arange(1, 1001))["R@5"] == 0.5  # 100 * 5 / 1000, no 0.500...01
    assert retrieval_metrics([3])["MdR"] == 3.0
    with pytest.raises(ValueError):
        retrieval_metrics([])
    with pytest.raises(ValueError):
        retrieval_metrics([0, 1])


def test_nan_raises_with_count():
    sim = np.ones((5, 4))
    sim[1, 2] = sim[3, 0] = np.nan
    for fn in (t2v_ranks, v2t_ranks):
        with pytest.raises(ValueError, match="2 NaN"):
            fn(sim, np.arange(5) % 4, block_rows=2)


def test_bad_text_video_raises():
    with pytest.raises(ValueError, match="one entry per text"):
        t2v_ranks(np.zeros((3, 3)), [0, 1])
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        t2v_ranks(np.zeros((3, 3)), [0, 1, 3])


# --------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------

D, F_FRAMES, L_TOKENS = 8, 4, 5


class AttnPoolHead(Head):
    """Test head, X-Pool-like: each video's frames are attention-pooled given the text.

    sim[t, v] = cos(q_t, sum_f softmax_f(scale_t <q_t, frame_vf>) frame_vf) over real frames.
    Multi-key embeddings (``query`` + ``scale``; ``frames`` + ``mask``) exercise block slicing.
    A dropout on the text side makes train and eval mode differ.
    """

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__(HeadConfig(embed_dim=D))
        self.proj = nn.Linear(D, D)
        self.drop = nn.Dropout(dropout)
        self.scale_from_tokens = nn.Linear(D, 1)

    def encode_texts(self, texts: TextBatch) -> Emb:
        m = texts.token_mask.float()[..., None]
        tok_mean = (texts.tokens * m).sum(1) / m.sum(1).clamp(min=1)
        scale = 1.0 + F.softplus(self.scale_from_tokens(tok_mean))[:, 0]  # (B,)
        return {"query": F.normalize(self.drop(self.proj(texts.sentence)), dim=-1), "scale": scale}

    def encode_videos(self, videos: VideoBatch) -> Emb:
        return {"frames": F.normalize(videos.frames, dim=-1), "mask": videos.frame_mask}

    def similarity(self, text_emb: Emb, video_emb: Emb) -> Tensor:
        q, scale = text_emb["query"], text_emb["scale"]
        logits = torch.einsum("td,vfd->tvf", q, video_emb["frames"]) * scale[:, None, None]
        logits = logits.masked_fill(~video_emb["mask"][None], -torch.inf)
        pooled = torch.einsum("tvf,vfd->tvd", logits.softmax(-1), video_emb["frames"])
        return torch.einsum("td,tvd->tv", q, F.normalize(pooled, dim=-1))


def _texts(n: int, seed: int) -> TextBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(L_TOKENS)[None] < torch.randint(1, L_TOKENS + 1, (n, 1), generator=g)
    return TextBatch(torch.randn(n, L_TOKENS, D, generator=g), mask, torch.randn(n, D, generator=g))


def _videos(n: int, seed: int) -> VideoBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(F_FRAMES)[None] < torch.randint(1, F_FRAMES + 1, (n, 1), generator=g)
    return VideoBatch(torch.randn(n, F_FRAMES, D, generator=g), mask)


def _split(batch, size: int) -> list:
    n = len(batch)
    fields = [f for f in ("tokens", "token_mask", "sentence", "frames", "frame_mask") if hasattr(batch, f)]
    return [type(batch)(*(getattr(batch, f)[a : a + size] for f in fields)) for a in range(0, n, size)]


def _take(batch: VideoBatch, idx: np.ndarray) -> VideoBatch:
    return VideoBatch(batch.frames[idx], batch.frame_mask[idx])


@pytest.fixture
def head() -> AttnPoolHead:
    torch.manual_seed(0)
    return AttnPoolHead().eval()


def test_encode_all_concatenates_in_order(head):
    texts = _texts(11, seed=1)
    whole = head.encode_texts(texts)
    got = encode_all(head.encode_texts, _split(texts, 4))
    assert set(got) == {"query", "scale"}
    for k in whole:
        torch.testing.assert_close(got[k], whole[k])
    with pytest.raises(ValueError, match="no batches"):
        encode_all(head.encode_texts, [])


def test_slice_emb():
    emb = {"a": torch.arange(10), "b": torch.arange(20).reshape(10, 2)}
    s = slice_emb(emb, 3, 6)
    assert s["a"].tolist() == [3, 4, 5] and s["b"].shape == (3, 2)


def test_block_engine_equals_full_matrix(head):
    texts, videos = _texts(11, seed=1), _videos(13, seed=2)
    t_emb = encode_all(head.encode_texts, _split(texts, 4))
    v_emb = encode_all(head.encode_videos, _split(videos, 5))
    with torch.no_grad():
        full = head.similarity(head.encode_texts(texts), head.encode_videos(videos))
    blocked = similarity_matrix(head, t_emb, v_emb, block_texts=3, block_videos=5)
    assert blocked.dtype == torch.float32 and blocked.shape == (11, 13)
    # other block and batch shapes sum in other orders: ~10 float32 roundings (1e-6 of |x|) on each path
    torch.testing.assert_close(blocked, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(similarity_matrix(head, t_emb, v_emb), blocked, rtol=1e-5, atol=1e-6)


def test_permuting_videos_permutes_columns_and_keeps_metrics(head):
    rng = np.random.default_rng(3)
    n_v = 13
    tv = rng.integers(0, n_v, size=30)  # multi-caption, uneven, some videos without captions
    texts, videos = _texts(30, seed=4), _videos(n_v, seed=5)
    bank = _split(_texts(9, seed=6), 4)
    vbank = _split(_videos(7, seed=7), 3)
    opts = EvalOptions(block_texts=4, block_videos=5, post=("dsl", "qbnorm"), return_sim=True)
    base = evaluate_head(head, EvalInputs(_split(texts, 8), _split(videos, 5), tv, querybank=bank,
                                          video_querybank=vbank), opts)
    perm = rng.permutation(n_v)  # new column c holds old video perm[c]
    new_index = np.argsort(perm)
    permuted = evaluate_head(head, EvalInputs(_split(texts, 8), _split(_take(videos, perm), 5), new_index[tv],
                                              querybank=bank, video_querybank=vbank), opts)
    torch.testing.assert_close(permuted["sim"], base["sim"][:, perm])
    for key in ("t2v", "v2t", "t2v_dsl", "v2t_dsl", "t2v_qbnorm", "v2t_qbnorm"):
        assert permuted[key] == pytest.approx(base[key]), key
    assert base["n_texts"] == 30 and base["n_videos"] == n_v
    assert base["v2t"]["n"] == len(np.unique(tv))


def test_evaluate_head_eval_mode_determinism_and_post_keys():
    torch.manual_seed(0)
    head = AttnPoolHead(dropout=0.5).train()
    texts, videos = _texts(12, seed=8), _videos(6, seed=9)
    tv = np.arange(12) % 6
    bank_texts = _texts(10, seed=10)

    def run() -> dict:
        return evaluate_head(head, EvalInputs(_split(texts, 5), _split(videos, 4), tv, querybank=_split(bank_texts, 3)),
                             EvalOptions(block_texts=5, block_videos=4, post=["dsl", "qbnorm"], return_sim=True))

    first, second = run(), run()
    assert head.training  # mode restored
    torch.testing.assert_close(first["sim"], second["sim"], rtol=0, atol=0)
    head.eval()
    with torch.no_grad():
        ref = head.similarity(head.encode_texts(texts), head.encode_videos(videos)).numpy()
        bank = head.similarity(head.encode_texts(bank_texts), head.encode_videos(videos)).numpy()
    np.testing.assert_allclose(first["sim"].numpy(), ref, rtol=1e-5, atol=1e-6)  # other batch shapes, as above
    assert set(first) == {"t2v", "v2t", "n_texts", "n_videos", "t2v_dsl", "v2t_dsl", "t2v_qbnorm", "sim"}
    sim = first["sim"].numpy()
    assert first["t2v"] == pytest.approx(ref_metrics(ref_t2v_ranks(sim, tv)))
    assert first["v2t"] == pytest.approx(ref_metrics(ref_v2t_ranks(sim, tv)))
    dsl_t2v = ref_dual_softmax(sim, 100.0, axis=0)
    assert first["t2v_dsl"] == pytest.approx(ref_metrics(ref_t2v_ranks(dsl_t2v, tv)))
    dsl_v2t = ref_dual_softmax(sim, 100.0, axis=1)
    assert first["v2t_dsl"] == pytest.approx(ref_metrics(ref_v2t_ranks(dsl_v2t, tv)))
    assert first["t2v_qbnorm"] == pytest.approx(retrieval_metrics(t2v_ranks(qb_norm(sim, bank), tv)))


def test_every_metric_key_is_written_by_a_row_of_the_variant_table(head, monkeypatch):
    """An evaluation's metric keys are ``score_key(row.name, direction)`` for the rows of the variant table that
    apply, one per direction a row scores: a row added to the table adds its keys, a row taken out takes its
    keys along, whatever ``post`` asks for."""
    from tvrpipe.errors import NonFiniteError
    from tvrpipe.evaluation import VARIANTS, ScoreVariant, engine
    from tvrpipe.rundir import SCORE_VARIANTS, score_key

    assert [v.name for v in VARIANTS] == ["raw", "rerank", "dsl", "qbnorm"]
    assert {v.name for v in VARIANTS} == set(SCORE_VARIANTS)
    tv = np.arange(10) % 7
    texts, videos, bank, vbank = _texts(10, seed=1), _videos(7, seed=2), _texts(5, seed=3), _videos(4, seed=4)
    opts = EvalOptions(block_texts=4, block_videos=3, post=("dsl", "qbnorm"), return_sim=True)

    def run() -> dict:
        return evaluate_head(head, EvalInputs(_split(texts, 4), _split(videos, 3), tv, querybank=_split(bank, 2),
                                              video_querybank=_split(vbank, 2)), opts)

    def metric_keys(res: dict) -> set[str]:
        return {k for k, v in res.items() if isinstance(v, dict) and "R@1" in v}

    full = run()  # this head declares no re-ranking: its row does not apply
    assert metric_keys(full) == {score_key(v, d) for v in ("raw", "dsl", "qbnorm") for d in ("t2v", "v2t")}

    without_dsl = tuple(v for v in VARIANTS if v.name != "dsl")
    monkeypatch.setattr(engine, "VARIANTS", without_dsl)
    assert metric_keys(run()) == metric_keys(full) - {"t2v_dsl", "v2t_dsl"}

    def negated(s):  # one direction only: the row writes that direction's key alone
        yield "t2v", -s.sim

    extra = (ScoreVariant("negated", "negated", lambda s: True, negated),
             ScoreVariant("never", "never", lambda s: False, negated))
    monkeypatch.setattr(engine, "VARIANTS", without_dsl + extra)
    res = run()
    assert metric_keys(res) == metric_keys(full) - {"t2v_dsl", "v2t_dsl"} | {"t2v_negated"}
    assert res["t2v_negated"] == pytest.approx(ref_metrics(ref_t2v_ranks(-res["sim"].numpy(), tv)))
    for key in metric_keys(res) - {"t2v_negated"}:
        assert res[key] == full[key], key

    def broken(s):
        yield "v2t", s.sim * float("nan")

    monkeypatch.setattr(engine, "VARIANTS", (ScoreVariant("broken", "broken", lambda s: True, broken),))
    with pytest.raises(NonFiniteError, match=r"broken \(v2t\) scores"):
        run()


def test_evaluate_head_rejects_bad_options(head):
    texts, videos = _split(_texts(4, seed=1), 2), _split(_videos(4, seed=2), 2)
    with pytest.raises(ValueError, match="querybank"):
        evaluate_head(head, EvalInputs(texts, videos, np.arange(4)), EvalOptions(post=("qbnorm",)))
    with pytest.raises(ConfigError, match="unknown post-processing"):
        evaluate_head(head, EvalInputs(texts, videos, np.arange(4)), EvalOptions(post=("dsl", "rerank")))
    with pytest.raises(ValueError, match="text_video"):
        evaluate_head(head, EvalInputs(texts, videos, np.arange(3)))


# --------------------------------------------------------------------------------------------
# Dual softmax
# --------------------------------------------------------------------------------------------


def test_dual_softmax_hand_computed_2x2():
    sim = np.array([[1.0, 0.0], [0.5, 1.0]])
    e = math.exp
    expected = np.array([
        [1.0 * e(1) / (e(1) + e(0.5)), 0.0],
        [0.5 * e(0.5) / (e(1) + e(0.5)), 1.0 * e(1) / (e(0) + e(1))],
    ])
    np.testing.assert_allclose(dual_softmax(sim, temperature=1.0), expected, rtol=1e-12)
    # a hub: raw, caption 0 prefers video 0 (0.6 > 0.5) though its video is 1; video 0 prefers
    # caption 1 much more, so the text prior moves caption 0 to video 1
    hub = np.array([[0.6, 0.5], [0.9, 0.2]])
    tv = np.array([1, 0])
    assert t2v_ranks(hub, tv).tolist() == [2, 1]
    assert t2v_ranks(dual_softmax(hub, temperature=10.0), tv).tolist() == [1, 1]


@pytest.mark.parametrize("dim", [0, 1])
def test_dual_softmax_matches_numpy_reference(dim):
    rng = np.random.default_rng(5)
    sim = rng.uniform(-0.2, 0.6, size=(9, 7))
    got = dual_softmax(sim, temperature=100.0, dim=dim, block_rows=2)
    np.testing.assert_allclose(got, ref_dual_softmax(sim, 100.0, axis=dim), rtol=1e-10)
    t = dual_softmax(torch.from_numpy(sim).float(), temperature=100.0, dim=dim)
    assert isinstance(t, Tensor) and t.dtype == torch.float64
    np.testing.assert_allclose(t.numpy(), got, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------
# QB-Norm
# --------------------------------------------------------------------------------------------


def test_qb_norm_hand_made_activation_set():
    beta = 20.0
    bank = np.array([[0.9, 0.1, 0.2], [0.8, 0.3, 0.1]])  # top-1 of both bank queries: item 0
    sim = np.array([[0.7, 0.6, 0.1],  # top-1 is item 0, in the activation set: normalised
                    [0.2, 0.5, 0.4]])  # top-1 is item 1, not in it: unchanged
    out = qb_norm(sim, bank, k=1, beta=beta)
    log_norm = np.log(np.exp(beta * bank).sum(axis=0))
    np.testing.assert_allclose(out[0], beta * sim[0] - log_norm, rtol=1e-12)
    # the paper's score exp(beta s) / sum_b exp(beta s_b) is the exponential of ours
    np.testing.assert_allclose(np.exp(out[0]), np.exp(beta * sim[0]) / np.exp(beta * bank).sum(0), rtol=1e-12)
    np.testing.assert_array_equal(out[1], sim[1])
    assert out[0].argmax() == 1  # the hub (item 0) loses query 0
    # k=2: the bank's top-2 are {0, 2} and {0, 1}, so item 1 is active and query 1 is normalised too
    out2 = qb_norm(sim, bank, k=2, beta=beta)
    np.testing.assert_allclose(out2[1], beta * sim[1] - log_norm, rtol=1e-12)


def test_qb_norm_empty_or_irrelevant_bank_leaves_scores_unchanged():
    rng = np.random.default_rng(6)
    sim = rng.standard_normal((8, 5))
    np.testing.assert_array_equal(qb_norm(sim, np.zeros((0, 5))), sim)
    # a bank whose top-1 is always a gallery item that no test query ranks first
    never_first = int(np.setdiff1d(np.arange(5), sim.argmax(1))[0])
    bank = np.full((4, 5), -1.0)
    bank[:, never_first] = 1.0
    out = qb_norm(sim, bank, k=1)
    np.testing.assert_array_equal(out, sim)


def test_qb_norm_matches_official_logic_and_streams():
    rng = np.random.default_rng(7)
    n_g = 12
    sim = rng.uniform(-0.3, 0.5, size=(40, n_g))
    bank = rng.uniform(-0.3, 0.5, size=(30, n_g)) + 0.3 * (np.arange(n_g) < 3)  # three hubs
    for k in (1, 2):
        ours = qb_norm(sim, bank, k=k, beta=20.0)
        official = ref_qb_norm_official(sim, bank, k=k, beta=20.0)
        # same ordering within every query (ours is the log of theirs on normalised rows)
        np.testing.assert_array_equal(np.argsort(-ours, axis=1), np.argsort(-official, axis=1))
        tv = rng.integers(0, n_g, size=40)
        np.testing.assert_array_equal(t2v_ranks(ours, tv), ref_t2v_ranks(official, tv))
    acc = QueryBankAccumulator(n_g, k=2, beta=20.0)
    for a in range(0, 30, 7):
        acc.update(torch.from_numpy(bank[a : a + 7]))
    whole = querybank_summary(bank, k=2, beta=20.0)
    torch.testing.assert_close(acc.summary().log_norm, whole.log_norm)
    assert torch.equal(acc.summary().active, whole.active) and acc.summary().n_bank == 30
    # the streamed log-normaliser (a logaddexp chain over blocks of 7) and one logsumexp differ by ulps of
    # ~20 (float64: ~1e-14), and beta s - log_norm cancels to values near 0: an absolute floor too
    np.testing.assert_allclose(apply_qb_norm(sim, acc.summary()), qb_norm(sim, bank, k=2), rtol=1e-12, atol=1e-12)


def test_qb_norm_large_scores_do_not_overflow():
    sim = np.array([[100.0, 90.0], [10.0, 20.0]], dtype=np.float32)  # logit-scaled
    bank = np.array([[95.0, 5.0]], dtype=np.float32)
    out = qb_norm(sim, bank, beta=20.0)
    assert np.isfinite(out).all() and out[0].argmax() == 1


def test_dsl_is_not_applied_to_distance_scores():
    """DSL's sim x prior inverts a ranking of negative distances (the reason ProTA opts out):
    here the matched pairs (the diagonal, distance 0.1) end last after DSL."""
    sim = -np.array([[0.1, 0.5, 0.6], [0.5, 0.1, 0.7], [0.6, 0.7, 0.1]])
    tv = np.arange(3)
    assert ref_metrics(ref_t2v_ranks(sim, tv))["R@1"] == 100.0
    assert ref_metrics(ref_t2v_ranks(ref_dual_softmax(sim, 100.0, axis=0), tv))["R@1"] == 0.0

    from tvrpipe.heads.prota import Config as ProTAConfig
    from tvrpipe.heads.prota import ProTA

    texts, videos = _split(_texts(6, seed=1), 3), _split(_videos(6, seed=2), 3)
    torch.manual_seed(0)  # the heads' weights, whatever ran before
    head = ProTA(ProTAConfig(embed_dim=D, num_heads=1, num_layers=1))
    res = evaluate_head(head, EvalInputs(texts, videos, np.arange(6)), EvalOptions(post=("dsl",)))
    assert "t2v_dsl" not in res and "v2t_dsl" not in res
    assert "negative W2 distances" in res["dsl_not_applicable"]
    cosine = ProTA(ProTAConfig(embed_dim=D, num_heads=1, num_layers=1, probabilistic=False, kl_weight=0.0,
                               margin_weight=0.0))
    assert cosine.dsl_not_applicable is None
    res = evaluate_head(cosine, EvalInputs(texts, videos, np.arange(6)), EvalOptions(post=("dsl",), return_sim=True))
    assert "dsl_not_applicable" not in res
    assert res["t2v_dsl"] == pytest.approx(
        ref_metrics(ref_t2v_ranks(ref_dual_softmax(res["sim"].numpy(), 100.0, axis=0), np.arange(6))))


def test_bootstrap_intervals_of_recall_against_their_definition():
    """The interval is the central 95 % of R@1 over resamples of the queries: degenerate where every query
    agrees, about the normal approximation's width for many queries, and a paired difference of a run with
    itself is exactly 0; bad input is refused."""
    from tvrpipe.evaluation.metrics import bootstrap_recall, paired_recall_difference

    assert bootstrap_recall([1] * 50) == (100.0, 100.0) and bootstrap_recall([3] * 50) == (0.0, 0.0)
    rng = np.random.default_rng(0)
    ranks = np.where(rng.random(2000) < 0.3, 1, 2)  # R@1 = p near 0.3 over 2,000 queries
    p = float(np.mean(ranks == 1))
    lo, hi = bootstrap_recall(ranks)
    half = 100 * 1.96 * math.sqrt(p * (1 - p) / len(ranks))  # the normal approximation's half width
    assert lo < 100 * p < hi and abs((hi - lo) / 2 - half) < 0.2 * half
    assert paired_recall_difference(ranks, ranks) == (0.0, 0.0, 0.0)
    better = np.where(rng.random(2000) < 0.5, 1, ranks)  # the same queries, half of them moved to rank 1
    d, lo, hi = paired_recall_difference(better, ranks)
    assert d == pytest.approx(100 * (np.mean(better == 1) - p)) and 0 < lo < d < hi
    with pytest.raises(ValueError, match="non-empty 1-D"):
        bootstrap_recall([])
    with pytest.raises(ValueError, match="one length"):
        paired_recall_difference([1, 2], [1])
