"""The distilled first stage: its segments and its ranking against NumPy, learning the head's ranking better than
zero-shot CLIP's, its cache, and its refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import open_store
from tvrpipe.heads.base import create_head
from tvrpipe.search.batches import text_batch
from tvrpipe.search.distilled import DISTILLED_DIR, fit_scorer, head_stage, teacher_scores
from tvrpipe.search.first_stages import stage_config
from tvrpipe.search.first_stages.distilled import Distilled, Scorer, segment_means
from tvrpipe.search.index import searchable_rows

D = 32
FAST = ["steps=150", "dim=16", "captions=400", "videos=200"]


def test_segment_means_against_numpy():
    """Contiguous blocks of the valid frames in order (5 frames in 3: 2, 2, 1); a video with fewer valid frames
    than segments gives its empty segment the mean of all its frames."""
    rng = np.random.default_rng(0)
    f = rng.normal(size=(2, 5, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0]], bool)
    got = segment_means(f, mask, 3)
    u = f / np.linalg.norm(f, axis=-1, keepdims=True)
    want = np.stack([
        [u[0, :2].mean(0), u[0, 2:4].mean(0), u[0, 4]],
        [u[1, 0], u[1, 2], (u[1, 0] + u[1, 2]) / 2],
    ])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_distilled_top_is_the_exact_ranking_by_the_best_segment():
    rng = np.random.default_rng(1)
    n, S, Dd, d = 300, 3, 24, 8
    scorer = Scorer(rng.normal(size=(Dd, d)).astype(np.float32), rng.normal(size=(Dd, d)).astype(np.float32), S)
    frames = rng.normal(size=(n, 6, Dd)).astype(np.float32)
    mask = rng.random((n, 6)) < 0.8
    mask[:, 0] = True
    vectors = scorer.videos(frames, mask)
    index = Distilled.over(vectors, stage_config("distilled"), scorer)
    q = rng.normal(size=(5, Dd)).astype(np.float32)
    qm = q / np.linalg.norm(q, axis=1, keepdims=True) @ scorer.query_map
    qm /= np.linalg.norm(qm, axis=1, keepdims=True)
    best = (qm @ vectors.T).reshape(5, n, S).max(2)  # (Q, n)
    for k in (1, 10, 300):
        pos, scores = index.top(q, k)
        np.testing.assert_array_equal(pos, np.argsort(-best, 1, kind="stable")[:, :k])
        np.testing.assert_allclose(scores, np.take_along_axis(best, pos, 1), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """A generated store with the calibrated world's share: 200 train videos (2 captions each), 100 test."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=200, test_videos=100, captions_per_train_video=2, frames=4, max_words=8,
                   embed_dim=D, seed=3, min_frames=2)
    return generate_store(tmp_path_factory.mktemp("gen") / "store", spec)


def _teacher():
    """An X-Pool head far from zero-shot CLIP: random weights, so its ranking is its own."""
    torch.manual_seed(0)
    head = create_head("xpool", embed_dim=D).eval()
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return head


def test_the_scorer_learns_the_heads_ranking_far_better_than_zero_shot_ranks_it(gen):
    """Held-out test captions: the head's top 5 of the 100 test videos sit within the distilled scorer's top 20
    far more often than within zero-shot CLIP's pooled top 20 (which, for this head, is near chance: 0.2)."""
    torch.set_num_threads(1)
    store = open_store(gen)
    head = _teacher()
    scorer, record = fit_scorer(head, store, stage_config("distilled", FAST))
    assert record["head_pairs"] == 400 * 200 and record["rank_p95"] < record["zero_shot_rank_p95"]
    vrows = np.flatnonzero(store.videos["split"].to_numpy() == "test")
    trows = np.flatnonzero(store.texts["split"].to_numpy() == "test")
    texts = text_batch(store, trows)
    want = np.argsort(-teacher_scores(head, texts, store, vrows), 1, kind="stable")[:, :5]
    frames, mask = store.read("videos/frames", vrows), store.read("videos/frame_mask", vrows)
    index = Distilled.over(scorer.videos(frames, mask), stage_config("distilled", FAST), scorer)
    got, _ = index.top(texts.sentence.numpy(), 20)
    seg = segment_means(frames, mask, 1)[:, 0]
    pooled = seg / np.linalg.norm(seg, axis=1, keepdims=True)
    zero_shot = np.argsort(-(texts.sentence.numpy() @ pooled.T), 1, kind="stable")[:, :20]
    share = lambda short: float(np.mean([np.isin(w, s).mean() for w, s in zip(want, short)]))  # noqa: E731
    distilled, zs = share(got), share(zero_shot)
    assert distilled > 0.5 and distilled > zs + 0.25, (distilled, zs)


def _run(store, out, method="xpool"):
    from tvrpipe.training.fit import TrainConfig, fit

    fit(store, method, out, TrainConfig(epochs=1, batch_size=64), progress=False)
    return out


def test_a_distilled_stage_is_kept_reused_and_rebuilt_for_other_settings(gen, tmp_path):
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head

    shutil.copytree(gen, tmp_path / "store")
    store = open_store(tmp_path / "store")
    run = _run(tmp_path / "store", tmp_path / "run")
    head = load_head(run / CHECKPOINTS / BEST).eval()
    config = stage_config("distilled", [*FAST[1:], "steps=5"])
    stage = head_stage(store, head, run, "distilled", config)
    assert len(stage) == len(searchable_rows(store)) and stage.pooled.shape == (len(stage) * 3, 16)
    (folder,) = (tmp_path / "store" / DISTILLED_DIR).iterdir()
    meta = json.loads((folder / "distilled.json").read_text())
    assert meta["method"] == "xpool" and meta["settings"]["steps"] == 5 and meta["fit"]["head_pairs"] == 400 * 200
    assert meta["bytes"] >= (folder / "vectors.npy").stat().st_size > len(stage) * 3 * 16 * 4
    again = head_stage(store, head, run, "distilled", config)  # read back, not fitted again: the same maps
    np.testing.assert_array_equal(again.index.scorer.query_map, stage.index.scorer.query_map)
    assert isinstance(again.pooled, np.memmap)
    head_stage(store, head, run, "distilled", stage_config("distilled", [*FAST[1:], "steps=6"]))
    assert len(list((tmp_path / "store" / DISTILLED_DIR).iterdir())) == 2
    # a store whose folder cannot be written: built in memory, its record says so
    unkept = head_stage(store, head, run, "distilled", stage_config("distilled", [*FAST[1:], "steps=7"]), cache=False)
    assert unkept.record["bytes"] == 0 and unkept.record["build_seconds"] > 0 and not isinstance(unkept.pooled,
                                                                                                 np.memmap)
    assert len(list((tmp_path / "store" / DISTILLED_DIR).iterdir())) == 2
    # a run whose store has moved: said with what to use instead, before anything is fitted or written
    import yaml

    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    config = yaml.safe_load((moved / "config.yaml").read_text())
    config["features"] = str(tmp_path / "gone")
    (moved / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=f"--run {moved} trained on {tmp_path / 'gone'}, which the distilled first "
                                          "stage learns the head on, and it cannot be opened .*use a pooled first "
                                          "stage \\(--first-stage exact\\)"):
        head_stage(store, head, moved, "distilled", stage_config("distilled", [*FAST[1:], "steps=8"]))
    assert len(list((tmp_path / "store" / DISTILLED_DIR).iterdir())) == 2


def test_bad_settings_and_searches_without_a_run_a_shortlist_or_in_shards_are_refused(gen, tmp_path):
    from tvrpipe.search.engine import Searcher, search
    from tvrpipe.search.index import first_stage

    with pytest.raises(ConfigError, match="--first-stage-set of distilled: steps must be >= 1, got 0"):
        stage_config("distilled", ["steps=0"])
    with pytest.raises(ConfigError, match="--first-stage-set of distilled: lr must be > 0, got 0.0"):
        stage_config("distilled", ["lr=0"])
    store = open_store(gen)
    refusal = "--first-stage distilled is fitted to a run's head: give --run"
    with pytest.raises(ConfigError, match=refusal):
        first_stage(store, "distilled", cache=False)
    zero_shot = Searcher(store, create_head("meanpool", embed_dim=D).eval(), "zero-shot", 8, None)
    texts = text_batch(store, np.arange(2))
    with pytest.raises(ConfigError, match=refusal):
        search(zero_shot, ["a", "b"], candidates=10, first_stage="distilled", texts=texts)
    run = Searcher(store, _teacher(), "xpool (runs/r)", 8, None, run=tmp_path / "r")
    with pytest.raises(ConfigError, match="--first-stage distilled shortlists the videos the head re-ranks: give "
                                          "--candidates K"):
        search(run, ["a", "b"], first_stage="distilled", texts=texts)
    with pytest.raises(ConfigError, match="--first-stage distilled runs in this process: leave out --shards 2"):
        search(run, ["a", "b"], candidates=10, first_stage="distilled", texts=texts, shards=2, address="local")
    assert not (gen / DISTILLED_DIR).exists()


def test_a_heads_own_embedding_ranks_as_its_exhaustive_search_and_is_kept(gen, tmp_path):
    """seqtransf's video embedding, indexed: the two stages at K = 10 keep the first stage's hits, which are the
    exhaustive search's, scores to float rounding; a head without such an embedding is refused, naming the ones
    with one."""
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.search.engine import exhaustive, keeps_first_stage, two_stage

    shutil.copytree(gen, tmp_path / "store")
    store = open_store(tmp_path / "store")
    run = _run(tmp_path / "store", tmp_path / "run", "seqtransf")
    head = load_head(run / CHECKPOINTS / BEST).eval()
    config = stage_config("head-embedding")
    stage = head_stage(store, head, run, "head-embedding", config)
    assert stage.pooled.shape == (len(searchable_rows(store)), D) and keeps_first_stage(head, stage)
    texts = text_batch(store, np.flatnonzero(store.texts["split"].to_numpy() == "test"), tokens=False)
    full = exhaustive(head, texts, store, stage.rows, 10)
    two = two_stage(head, texts, store, stage, 10, 10)
    np.testing.assert_array_equal(two.rows, full.rows)
    np.testing.assert_allclose(two.scores, full.scores, rtol=1e-5, atol=1e-6)
    (folder,) = (tmp_path / "store" / DISTILLED_DIR).iterdir()
    meta = json.loads((folder / "distilled.json").read_text())
    assert meta["first_stage"] == "head-embedding" and meta["fit"] is None and meta["build_seconds"] > 0
    assert isinstance(head_stage(store, head, run, "head-embedding", config).pooled, np.memmap)  # read back
    xpool = _run(tmp_path / "store", tmp_path / "xpool")
    with pytest.raises(ConfigError, match="--first-stage head-embedding: xpool has no video embedding that is the "
                                          "same for every query .* meanpool, seqtransf have one\\); use "
                                          "--first-stage distilled"):
        head_stage(store, load_head(xpool / CHECKPOINTS / BEST).eval(), xpool, "head-embedding", config)


def test_late_interaction_with_a_segment_a_frame_and_every_axis_ranks_as_the_token_wise_head():
    """With as many segments as frames and the axes a rotation of the whole space, the stage's score is UATVR
    Eq. 7 itself: its top k equals tokenwise's exhaustive ranking, scores to float rounding; a query with no word
    scores 0 everywhere."""
    from tvrpipe.heads.base import TextBatch, VideoBatch
    from tvrpipe.search.first_stages.late_interaction import LateInteraction, TokenProjection

    rng = np.random.default_rng(4)
    n, F, L, Dd = 120, 4, 6, 16
    head = create_head("tokenwise", embed_dim=Dd).eval()
    rotation = np.linalg.qr(rng.normal(size=(Dd, Dd)))[0].astype(np.float32)
    projection = TokenProjection(head, rotation, F)
    frames, mask = rng.normal(size=(n, F, Dd)).astype(np.float32), np.ones((n, F), bool)
    index = LateInteraction.over(projection.videos(frames, mask), stage_config("late-interaction"), projection)
    assert len(index) == n
    tm = np.arange(L)[None] < np.array([[4], [6], [3], [1]])  # the last: the start token alone, so no word
    texts = TextBatch(torch.from_numpy(rng.normal(size=(4, L, Dd)).astype(np.float32)), torch.from_numpy(tm),
                      torch.from_numpy(rng.normal(size=(4, Dd)).astype(np.float32)))
    with torch.inference_mode():
        want = head.similarity(head.encode_texts(texts), head.encode_videos(
            VideoBatch(torch.from_numpy(frames), torch.from_numpy(mask)))).numpy()
    for k in (1, 10, n):
        pos, scores = index.top_texts(texts, k)
        np.testing.assert_array_equal(pos[:3], np.argsort(-want[:3], 1, kind="stable")[:, :k])
        np.testing.assert_allclose(scores, np.take_along_axis(want, pos, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(index.top_texts(texts, 5)[1][3], 0)
    with pytest.raises(ConfigError, match="--first-stage late-interaction ranks by the query's words, and this "
                                          "query has none"):
        index.top(rng.normal(size=(1, Dd)).astype(np.float32), 3)


def test_late_interaction_finds_the_token_wise_heads_best_videos_where_zero_shot_does_not(gen, tmp_path):
    """A tokenwise run on the generated store: its kept stage's record places the head's top 10 of each sampled
    caption far higher than zero-shot CLIP's cosine does; the two stages at K = a fifth of the videos find most of
    the exhaustive top 5, more than zero-shot's shortlist of the same K; kept and read back; other heads refused."""
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.search.engine import exhaustive, two_stage
    from tvrpipe.search.index import first_stage

    shutil.copytree(gen, tmp_path / "store")
    store = open_store(tmp_path / "store")
    run = _run(tmp_path / "store", tmp_path / "run", "tokenwise")
    head = load_head(run / CHECKPOINTS / BEST).eval()
    config = stage_config("late-interaction", [f"dim={D}", "captions=200", "videos=200"])
    stage = head_stage(store, head, run, "late-interaction", config)
    assert stage.pooled.shape == (len(searchable_rows(store)) * 3, D)
    fit = stage.record["fit"]
    assert fit["head_pairs"] == 200 * 200 and fit["rank_p95"] < fit["zero_shot_rank_p95"] / 2, fit
    texts = text_batch(store, np.flatnonzero(store.texts["split"].to_numpy() == "test"))
    full = exhaustive(head, texts, store, stage.rows, 5).rows
    K = len(stage) // 5
    two = two_stage(head, texts, store, stage, 5, K).rows
    zero_shot = first_stage(store, "exact", cache=False)
    shortlist = zero_shot.rows[zero_shot.top(texts.sentence.numpy(), K)[0]]
    found = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(two, full)])
    zs = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(shortlist, full)])
    assert found > 0.9 and found > zs + 0.1, (found, zs)
    again = head_stage(store, head, run, "late-interaction", config)
    assert isinstance(again.pooled, np.memmap)
    np.testing.assert_array_equal(again.index.projection.axes, stage.index.projection.axes)
    with pytest.raises(ConfigError, match="--first-stage late-interaction: xpool does not score by the token-wise "
                                          "interaction of words and frames \\(tokenwise, uatvr do\\); use "
                                          "--first-stage distilled"):
        head_stage(store, _teacher(), run, "late-interaction", config)
