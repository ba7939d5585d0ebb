"""``tvrpipe bench serve``: the served latencies at a tiny size through the CLI, the hits served against
``tvrpipe search``'s ranking of the same queries, and the refusals of bad options before anything is made."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("uvicorn", reason="tvrpipe serve needs the 'serve' extra (make install installs it)")


def _search_hits(store, run, queries, k, candidates):
    """``tvrpipe search``'s hits (:func:`~tvrpipe.search.engine.search`) of ``queries`` over ``store``, the queries'
    stored embeddings given as their encoding; with ``run``, its selected head in place of zero-shot CLIP's."""
    from tvrpipe.bench.serve import StoredCaptions
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.search.engine import open_searcher, search

    searcher = open_searcher(store)
    if run is not None:
        searcher = replace(searcher, head=load_head(run / CHECKPOINTS / BEST).eval())
    found = search(searcher, queries, k, candidates, "exact", texts=StoredCaptions(store)(queries))
    by_query = {q: [] for q in queries}
    for h in found.hits:
        by_query[h.query].append((h.video_id, h.score))
    return [by_query[q] for q in queries]


def _ids(hits):
    return [v for v, _ in hits]


def test_bench_serve_cli_times_each_request_and_serves_searchs_hits(cli, tmp_path):
    """300 videos, D = 32, 20 requests per arm, xpool trained 1 epoch, the tiny CLIP's text tower: every figure
    positive and ordered, and each arm's served hits (ids and scores) are those `tvrpipe search` ranks for the
    same queries with the same head, K and first stage."""
    from tvrpipe.search.engine import ZERO_SHOT

    out = tmp_path / "b"
    r = cli("bench", "serve", "--out", out, "--videos", "300", "--queries", "20", "--dim", "32", "--train-videos",
            "64", "--train-epochs", "1", "--candidates", "40", "--text-model", "tvrpipe-tiny", "--json",
            tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "r.json").read_text())
    assert res == json.loads((out / "serve" / "results.json").read_text())
    assert (res["videos"], res["queries"], res["dim"], res["top_k"], res["candidates"]) == (300, 20, 32, 10, 40)
    assert res["first_stage"] == "exact" and res["text_model"] == "tvrpipe-tiny" and "127.0.0.1" in res["transport"]
    assert 0 < res["text_p50_ms"] <= res["text_p95_ms"] and res["text_mean_ms"] > 0
    assert [a["arm"] for a in res["arms"]] == ["zero-shot", "xpool"]
    run = out / "runs" / "benchmark-64-d32-s0" / "xpool-1ep"
    assert res["trained"]["xpool"]["epochs_run"] == 1 and res["trained"]["xpool"]["run"] == str(run)
    assert res["arms"][0]["ranked_by"] == ZERO_SHOT and res["arms"][1]["ranked_by"] == f"xpool ({run})"
    for a in res["arms"]:
        assert 0 < a["p50_ms"] <= a["p95_ms"] <= a["max_ms"] and 0 < a["mean_ms"] <= a["max_ms"]
        assert 0 < a["lookup_ms"] < a["mean_ms"] and a["start_seconds"] > 0
        assert 0 < a["clip_p50_ms"] <= a["clip_p95_ms"]
    assert "with real CLIP p50" in r.output and "xpool (trained 1 epochs" in r.output

    served = json.loads((out / "serve" / "hits.json").read_text())
    queries = served["queries"]
    assert len(queries) == len(set(queries)) == 20
    store = out / "stores" / "collection-300-d32-s0"
    for arm, run_dir in (("zero-shot", None), ("xpool", run)):
        want = _search_hits(store, run_dir, queries, 10, 40)
        got = served["arms"][arm]
        assert [[h["video_id"] for h in q] for q in got] == [[v for v, _ in q] for q in want], arm
        assert [h["score"] for q in got for h in q] == pytest.approx([s for q in want for _, s in q], abs=1e-6)
    # the heads rank differently: the comparison above is of two rankings, not one twice
    assert served["arms"]["zero-shot"] != served["arms"]["xpool"]


def test_a_server_given_stored_captions_serves_a_generated_store(tmp_path):
    """The encoder injected into open_server: a caption id is searched as its stored embeddings, anything else is
    400 naming it, and no CLIP is loaded (a generated store has none)."""
    from starlette.testclient import TestClient

    from tvrpipe.bench.search import collection_spec
    from tvrpipe.bench.serve import StoredCaptions
    from tvrpipe.search.serve import make_app, open_server
    from tvrpipe.worlds.features import generate_store

    store = generate_store(tmp_path / "c", collection_spec(60, 16, frames=4, words=8))
    lookup = StoredCaptions(store)
    server = open_server(store, candidates=20, encode=lookup)
    client = TestClient(make_app(server), base_url="http://127.0.0.1:8000")  # a Host the app answers by default
    r = client.get("/search", params={"q": "gv_00007#0", "k": 3})
    assert r.status_code == 200, r.text
    assert [h["video_id"] for h in r.json()["hits"]] == _ids(_search_hits(store, None, ["gv_00007#0"], 3, 20)[0])
    assert len(lookup.seconds) == 1 and server.searcher._bundle is None
    r = client.get("/search", params={"q": "a dog runs"})
    assert r.status_code == 400 and "'a dog runs' is not a caption id of" in r.json()["error"]
    # without it, a generated store is refused at start, as tvrpipe serve refuses it
    from tvrpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="features are of no CLIP"):
        open_server(store)


def test_bench_serve_refuses_bad_options_before_any_store(cli, tmp_path):
    out = tmp_path / "b"
    for args, said in ((("--videos", "5"), "--videos 5: the collection needs at least 10 videos"),
                       (("--videos", "20", "--queries", "16"), "--queries 16: between 1 and --videos (20) less the 5"),
                       (("--queries", "0"), "--queries 0: between 1 and --videos"),
                       (("--candidates", "0"), "--candidates 0: between 1 and --videos"),
                       (("--train-epochs", "0"), "--train-epochs 0: at least 1"),
                       (("--train-videos", "8"), "--train-videos 8: at least 16"),
                       (("--dim", "0"), "--dim 0: at least 1"),
                       (("--method", "nope"), "unknown method 'nope'"),
                       (("--first-stage", "nope"), "--first-stage 'nope': choose one of"),
                       (("--first-stage-set", "nprobe=4"), "first stage exact has no setting 'nprobe'"),
                       (("--text-model", "nope"), "--text-model 'nope': not an open_clip architecture")):
        r = cli("bench", "serve", "--out", out, *args)
        assert r.exit_code == 1 and said in r.output, (args, r.output)
    r = cli("bench", "serve", "--out", out, "--json", tmp_path)
    assert r.exit_code == 1 and "is a folder" in r.output
    assert not out.exists()
