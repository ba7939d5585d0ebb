"""The first stage split over Ray actors (``--shards N --address ADDRESS``): the merge against the exact top k of
every video at once; ``tvrpipe search`` and ``tvrpipe serve`` with 2 shards on a local Ray against one index (the
same hits, zero-shot and with a trained head); each shard holding only its own rows; the option refusals."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest
from tiny_clip import as_tiny_clip_store

from tvrpipe.search.first_stages.base import normalised
from tvrpipe.search.first_stages.exact import exact_top
from tvrpipe.search.first_stages.faiss_hnsw import faiss_available
from tvrpipe.search.shards import merge_top, shard_bounds

QUERIES = ("a dog runs on a beach", "a man cooks pasta", "two cars race at night")
STAGES = ["exact"] + (["faiss-hnsw"] if faiss_available() else [])


def test_merged_shard_tops_are_the_exact_top_of_every_video_ties_by_row():
    """Each part's exact top k, merged, is the exact top k of all the rows: equal scores (duplicated videos, one of
    them straddling a shard boundary) ordered by row, as one index orders them, also at the cut."""
    rng = np.random.default_rng(0)
    emb = normalised(rng.standard_normal((103, 16)))
    emb[[7, 50, 51, 90]] = emb[3]  # ties, across shards and at a boundary
    q = normalised(np.vstack([emb[3] + 0.01 * rng.standard_normal(16), rng.standard_normal((4, 16))]))
    for shards in (1, 2, 3, 7):
        bounds = shard_bounds(len(emb), shards)
        assert bounds[0] == 0 and bounds[-1] == len(emb) and np.diff(bounds).max() - np.diff(bounds).min() <= 1
        for k in (1, 3, 5, 20):
            parts = [exact_top(emb[a:b], q, min(k, b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
            pos, scores = merge_top(parts, bounds[:-1], k)
            want_pos, want_scores = exact_top(emb, q, k)
            np.testing.assert_array_equal(pos, want_pos)
            np.testing.assert_allclose(scores, want_scores, atol=1e-6)


# ------------------------------------------------------------------ on a local Ray, through the CLI and the server


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module (a start costs seconds): `--address local` joins it, and leaves it running."""
    from tvrpipe.cluster import ray_init

    ray_init(None, num_cpus=2)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of the tiny CLIP's width (D = 64), relabelled as extracted with it: 40 videos, 4 frames."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=24, test_videos=16, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=64, seed=11)
    return as_tiny_clip_store(generate_store(tmp_path_factory.mktemp("shards") / "store", spec, video_shard=8,
                                             text_shard=16))


@pytest.fixture(scope="module")
def run(store, tmp_path_factory):
    """An X-Pool run trained one epoch on the store: a head that re-ranks the shortlist unlike zero-shot CLIP."""
    from tvrpipe.training.fit import TrainConfig, fit

    out = tmp_path_factory.mktemp("run") / "xpool"
    fit(store, "xpool", out, TrainConfig(epochs=1, batch_size=8), progress=False)
    return out


def _hits(cli, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    r = cli("search", *QUERIES, "--top-k", "5", "--candidates", "10", "--json", out, *args)
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text()), " ".join(r.output.split())


# the FAISS one in make test-all (about 14 s, its Ray shards started again): the exact one runs by default
@pytest.mark.parametrize("stage", [pytest.param(s, marks=pytest.mark.slow) if s != "exact" else s for s in STAGES])
def test_two_shards_find_the_hits_of_one_index_zero_shot_and_with_a_trained_head(ray_local, store, run, stage,
                                                                                 tmp_path, cli):
    """`--address local --shards 2`: the same rows and scores as one index, for zero-shot CLIP and an X-Pool run
    (the head re-ranks the merged shortlist of 10 out of 40 videos), and the output says the shards ranked."""
    ranked = []
    for who in ([], ["--run", run]):
        args = ["--features", store, "--first-stage", stage, *who]
        one, _ = _hits(cli, tmp_path, "one", *args)
        two, said = _hits(cli, tmp_path, "two", *args, "--address", "local", "--shards", "2")
        ranked.append([(h["query"], h["rank"], h["video_id"]) for h in one])
        assert [(h["query"], h["rank"], h["video_id"]) for h in two] == ranked[-1]
        assert [h["score"] for h in two] == pytest.approx([h["score"] for h in one], abs=1e-5)
        assert len(one) == 5 * len(QUERIES)
        assert "the first stage's 10 best of 40 searchable videos (in 2 Ray shards)" in said
    assert ranked[0] != ranked[1]  # the run's head re-ranked the shortlist its own way


def test_each_shard_holds_only_its_own_rows_and_their_top_is_the_one_indexs(ray_local, store):
    import ray

    from tvrpipe.features.store import open_store
    from tvrpipe.search.index import first_stage
    from tvrpipe.search.shards import sharded_first_stage

    st = open_store(store)
    one = first_stage(st, "exact", cache=False)
    three = sharded_first_stage(st, "exact", (), 3, "local", 10)
    held = ray.get([a.rows.remote() for a in three.actors])
    assert [len(r) for r in held] == [14, 13, 13]
    np.testing.assert_array_equal(np.concatenate(held), one.rows)
    np.testing.assert_array_equal(three.rows, one.rows)
    q = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    pos, scores = three.top(q, 10)
    want_pos, want_scores = one.top(q, 10)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)
    assert three.describe() == "exact, in 3 Ray shards of 13-14 videos"


def test_serve_with_two_shards_answers_the_hits_of_one_index(ray_local, store, run):
    pytest.importorskip("starlette", reason="tvrpipe serve needs the 'serve' extra (make install installs it)")
    pytest.importorskip("httpx", reason="Starlette's TestClient needs httpx (the 'dev' extra)")
    from starlette.testclient import TestClient

    from tvrpipe.search.serve import make_app, open_server

    base = "http://127.0.0.1:8000"  # a Host the app answers by default: tvrpipe serve's default address
    one = TestClient(make_app(open_server(store, run, first_stage="exact", candidates=10)), base_url=base)
    two = TestClient(make_app(open_server(store, run, first_stage="exact", candidates=10, shards=2,
                                          address="local")), base_url=base)
    for q in QUERIES:
        a, b = (c.get("/search", params={"q": q, "k": 5}).json() for c in (one, two))
        assert [h["video_id"] for h in b["hits"]] == [h["video_id"] for h in a["hits"]]
        assert [h["score"] for h in b["hits"]] == pytest.approx([h["score"] for h in a["hits"]], abs=1e-5)
        assert (a["shards"], b["shards"]) == (None, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_sharding_is_one_line_naming_the_option_before_any_shard_is_built(store, cli, monkeypatch):
    from tvrpipe.search import shards as shards_mod

    monkeypatch.setattr(shards_mod, "ShardActor", None)  # a shard built would fail loudly
    port = _free_port()
    cases = [
        (["--shards", "2"], "--shards 2: give --address too, the Ray cluster the shards run on"),
        (["--address", "local"], "--address local: the search runs on Ray only for a first stage split into "
                                 "shards; give --shards N too"),
        (["--shards", "0", "--address", "local"], "--shards 0: split the first stage over at least 1 Ray actor"),
        (["--shards", "41", "--address", "local"], "--shards 41 is more than the 40 searchable videos of --features"),
        (["--shards", "2", "--address", "local", "--candidates", "40"],
         "--candidates 40 covers all 40 searchable videos"),
        (["--shards", "2", "--address", f"127.0.0.1:{port}"],
         f"--address 127.0.0.1:{port}: cannot connect to the Ray cluster"),
    ]
    for extra, message in cases:
        candidates = [] if "--candidates" in extra else ["--candidates", "10"]
        r = cli("search", "a dog", "--features", store, *candidates, *extra)
        assert r.exit_code == 1 and message in " ".join(r.output.split()), (extra, r.output)
    r = cli("search", "a dog", "--features", store, "--shards", "2", "--address", "local")
    assert r.exit_code == 1 and "which ranks only with --candidates K" in " ".join(r.output.split()), r.output
