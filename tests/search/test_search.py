"""The search engine on a generated store: the first stage against NumPy, the two stages against the exhaustive
search for every head, the index cache and its refusals, and the errors of bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import open_store
from tvrpipe.heads.base import create_head, list_heads
from tvrpipe.search import index as index_mod
from tvrpipe.search.engine import (
    Searcher,
    check_queries,
    exhaustive,
    hits_of,
    read_queries,
    search,
    two_stage,
)
from tvrpipe.search.index import (
    INDEX_DIR,
    exact_top,
    export_faiss,
    exported_stage,
    faiss_available,
    first_stage,
    pooled_rows,
    store_key,
)
from tvrpipe.training.data import load_split

pytestmark = pytest.mark.numerics

D = 32


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """A generated store: 48 train and 40 test videos, 4 frames, 8 words, D = 32."""
    from tvrpipe.features.genstore import GenSpec, generate_store

    spec = GenSpec(train_videos=48, test_videos=40, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=D, seed=3, min_frames=2)
    return generate_store(tmp_path_factory.mktemp("gen") / "store", spec, video_shard=16, text_shard=64)


@pytest.fixture
def store(gen, tmp_path):
    """A private copy (tests write the index beside it)."""
    shutil.copytree(gen, tmp_path / "store")
    return open_store(tmp_path / "store")


@pytest.fixture(scope="module")
def captions(gen):
    """The test captions as a query batch, and the store row of each caption's video."""
    s = open_store(gen)
    split = load_split(s, "test")
    texts = split.text_batch(np.arange(split.n_texts))
    row_of = {v: i for i, v in enumerate(s.videos["video_id"])}
    return texts, np.array([row_of[v] for v in split.video_ids[split.text_video]])


def _writable(store):
    import zarr

    return zarr.open_group(store.dir / "features.zarr", mode="a", zarr_format=3)


def _head(name: str):
    torch.manual_seed(0)
    return create_head(name, embed_dim=D).eval()


def test_exact_top_against_numpy_over_blocks(monkeypatch):
    rng = np.random.default_rng(0)
    emb, q = rng.standard_normal((50, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb[7] = emb[3]  # a tie: the lower row first
    q[0] = emb[3]
    monkeypatch.setattr(index_mod, "_BLOCK", 16)  # four blocks, the last short
    idx, s = exact_top(emb, q, 5)
    full = q @ emb.T
    for i in range(3):
        want = sorted(range(50), key=lambda j: (-full[i, j], j))[:5]
        assert idx[i].tolist() == want
        np.testing.assert_allclose(s[i], full[i, want], rtol=1e-6)
    assert idx[0, :2].tolist() == [3, 7]
    # ties at the cut, across blocks: of four identical videos, the first rows are kept
    emb[20] = emb[40] = emb[3]
    idx, _ = exact_top(emb, q, 3)
    assert idx[0].tolist() == [3, 7, 20]


def test_a_faiss_search_short_of_k_falls_back_to_the_exact_top():
    """HNSW may find fewer than k neighbours (label -1); those queries get the exact top k, never row -1."""
    rng = np.random.default_rng(1)
    emb = rng.standard_normal((30, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    q = rng.standard_normal((3, 8)).astype(np.float32)

    class Short:  # answers query 1 with two neighbours missing
        def search(self, x, k):
            idx, s = exact_top(emb, x, k)
            idx, s = idx.copy(), s.copy()
            idx[1, -2:], s[1, -2:] = -1, -np.inf
            idx[0, 0], idx[0, 1] = idx[0, 1], idx[0, 0]  # an answered query is kept as FAISS gave it
            return s, idx

    stage = index_mod.FirstStage(emb, np.arange(30), "faiss", Short())
    idx, s = stage.top(q, 5)
    want, want_s = exact_top(emb, q / np.linalg.norm(q, axis=1, keepdims=True), 5)
    assert idx[1].tolist() == want[1].tolist() and np.isfinite(s).all()
    assert idx[0].tolist() == [want[0, 1], want[0, 0], *want[0, 2:]]


def test_pooled_embeddings_are_the_meanpool_heads(store):
    pooled, rows = pooled_rows(store)
    frames = store.array("videos/frames")[:].astype(np.float32)
    mask = store.array("videos/frame_mask")[:]
    f = frames / np.maximum(np.linalg.norm(frames, axis=-1, keepdims=True), 1e-30)  # padding: zero rows
    m = (f * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    want = m / np.linalg.norm(m, axis=-1, keepdims=True)
    assert rows.tolist() == list(range(len(frames)))
    np.testing.assert_allclose(pooled, want, atol=2e-6)


@pytest.mark.parametrize("name", list_heads())
def test_two_stages_with_k_the_collection_equal_the_exhaustive_search(store, captions, name):
    texts, _ = captions
    head = _head(name)
    stage = first_stage(store, "exact", cache=False)
    n = len(stage)
    full = exhaustive(head, texts, store, stage.rows, 10)
    both = two_stage(head, texts, store, stage, 10, n)
    assert both.candidates == n
    np.testing.assert_array_equal(both.rows, full.rows)
    np.testing.assert_allclose(both.scores, full.scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both.uncertainty, full.uncertainty, rtol=1e-5, atol=1e-6, equal_nan=True)
    # and the exhaustive top 10 is the head's own full similarity matrix's top 10 (an independent ranking)
    with torch.inference_mode():
        sim = head.similarity(head.encode_texts(texts), head.encode_videos(
            _all_videos(store))).float().numpy()
    for q in range(len(sim)):
        want = sorted(range(n), key=lambda j: (-sim[q, j], j))[:10]
        np.testing.assert_allclose(sim[q, full.rows[q]], sim[q, want], rtol=1e-5, atol=1e-6)


def _all_videos(store):
    from tvrpipe.heads.base import VideoBatch

    return VideoBatch(torch.from_numpy(store.array("videos/frames")[:].astype(np.float32)),
                      torch.from_numpy(store.array("videos/frame_mask")[:]))


def test_a_short_list_keeps_only_first_stage_candidates_and_more_candidates_recall_more(store, captions):
    texts, _ = captions
    head = _head("xpool")
    stage = first_stage(store, "exact", cache=False)
    full = exhaustive(head, texts, store, stage.rows, 10)
    pos, _ = stage.top(texts.sentence.numpy(), 12)
    short = two_stage(head, texts, store, stage, 10, 12)
    for q in range(len(texts)):
        assert set(short.rows[q]) <= set(stage.rows[pos[q]])
    recall = [np.mean([len(set(two_stage(head, texts, store, stage, 10, K).rows[q]) & set(full.rows[q])) / 10
                       for q in range(len(texts))]) for K in (10, 30, len(stage))]
    assert recall[0] <= recall[1] <= recall[2] == 1.0


def test_zero_shot_search_ranks_the_captioned_video_above_chance(store, captions):
    """The generated store's captions share concepts with their videos: zero-shot cosine finds them."""
    texts, truth = captions
    searcher = Searcher(store, _head("meanpool"), "zero-shot", 8, None)
    result = search(searcher, [f"q{i}" for i in range(len(texts))], k=5, texts=texts)
    hits = result.hits
    assert result.exhaustive and result.candidates == result.searchable == store.provenance["n_videos"]
    found = np.mean([truth[q] in [h.row for h in hits[5 * q: 5 * q + 5]] for q in range(len(texts))])
    chance = 5 / store.provenance["n_videos"]
    assert found > 5 * chance, found


@pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed (pip install 'tvrpipe[search]')")
def test_faiss_first_stage_equals_exact_below_hnsw_and_recalls_above(store, captions, monkeypatch):
    q = captions[0].sentence.numpy()
    exact = first_stage(store, "exact", cache=False)
    flat = first_stage(store, "faiss", cache=False)
    e_idx, e_s = exact.top(q, 10)
    f_idx, f_s = flat.top(q, 10)
    np.testing.assert_allclose(f_s, e_s, rtol=1e-5, atol=1e-6)
    assert (f_idx == e_idx).mean() > 0.99  # equal up to ties of float rounding
    monkeypatch.setattr(index_mod, "HNSW_FROM", 10)
    hnsw = first_stage(store, "faiss", cache=False)
    assert hasattr(hnsw.index, "hnsw")
    h_idx, _ = hnsw.top(q, 10)
    assert np.mean([len(set(h_idx[i]) & set(e_idx[i])) / 10 for i in range(len(q))]) > 0.9


def test_the_index_is_kept_beside_the_store_and_rebuilt_when_the_store_changes(store, monkeypatch):
    folder = store.dir / INDEX_DIR
    stage = first_stage(store, "exact")
    meta = json.loads((folder / "index.json").read_text())
    assert meta["store_key"] == store_key(store) and meta["videos"] == len(stage)
    calls = []
    monkeypatch.setattr(index_mod, "pooled_rows", lambda s: calls.append(1) or pooled_rows(s))
    again = first_stage(store, "exact")
    assert calls == [] and np.array_equal(again.pooled, stage.pooled)  # read back, not computed
    # the store extracted again (another manifest): its key changes and the index is built anew
    _writable(store).attrs["manifest_sha256"] = "0" * 64
    changed = open_store(store.dir)
    first_stage(changed, "exact")
    assert calls == [1]
    assert json.loads((folder / "index.json").read_text())["store_key"] == store_key(changed) != meta["store_key"]


def test_the_index_is_rebuilt_when_a_shard_is_written_again(store):
    """An extract rerun that rewrites a video shard (a failed video recovered, another precision) leaves the
    store's identity as it was; the shard's marker changes, and with it the key."""
    from tvrpipe.features.store import PROGRESS

    first_stage(store, "exact")
    key = store_key(store)
    marker = store.dir / PROGRESS / "videos" / "000001.json"
    rec = json.loads(marker.read_text())
    rec["failures"] = [{"video_id": "x", "stage": "decode", "error": "timed out"}]  # the retry's new record
    marker.write_text(json.dumps(rec))
    assert store_key(store) != key
    first_stage(store, "exact")
    assert json.loads((store.dir / INDEX_DIR / "index.json").read_text())["store_key"] == store_key(store)


def test_an_index_built_while_the_store_changes_is_not_kept(store, monkeypatch):
    keys = iter(["before", "after"])
    monkeypatch.setattr(index_mod, "store_key", lambda s: next(keys))
    stage = first_stage(store, "exact")
    assert len(stage) > 0 and not (store.dir / INDEX_DIR).exists()


@pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed (pip install 'tvrpipe[search]')")
def test_an_exported_index_serves_its_store_and_is_refused_for_another(store, captions, tmp_path):
    out, left_out = export_faiss(store.dir, tmp_path / "idx")
    assert left_out == 0 and sorted(p.name for p in out.iterdir()) == [
        "faiss.index", "index.json", "pooled.npy", "provenance.json", "rows.npy", "videos.csv"]
    stage = exported_stage(out, store)
    q = captions[0].sentence.numpy()
    np.testing.assert_array_equal(stage.top(q, 5)[0], first_stage(store, "exact", cache=False).top(q, 5)[0])
    _writable(store).attrs["manifest_sha256"] = "1" * 64  # the store changed since the export
    with pytest.raises(ConfigError, match="was built from another store, or from .* before it changed"):
        exported_stage(out, open_store(store.dir))
    with pytest.raises(ConfigError, match="exists; choose a new folder"):
        export_faiss(store.dir, out)


def test_bad_input_is_one_line_naming_it(store, captions, tmp_path):
    texts, _ = captions
    searcher = Searcher(store, _head("meanpool"), "zero-shot", 8, None)
    n = store.provenance["n_videos"]
    for kwargs, match in [
        ({"k": n + 1}, rf"--top-k {n + 1} is more than the {n} videos of"),
        ({"k": 0}, "--top-k 0: ask for at least 1"),
        ({"k": 5, "candidates": 3}, "--candidates 3 is fewer than --top-k 5"),
        ({"first_stage": "ann"}, "--first-stage 'ann': choose one of auto, exact, faiss"),
        ({"index": tmp_path, "first_stage": "exact"}, "is the first stage; leave out --first-stage exact"),
    ]:
        with pytest.raises(ConfigError, match=match):
            search(searcher, ["a dog"], texts=texts, **kwargs)
    with pytest.raises(ConfigError, match="query 2 is empty"):
        check_queries(["a dog", "  "])
    with pytest.raises(ConfigError, match="generated without a CLIP"):
        searcher.encode(["a dog"])
    empty = tmp_path / "q.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="no query in it"):
        read_queries(empty)
    (tmp_path / "q2.txt").write_text("a dog\n# skipped\n\n  a cat  \n")
    assert read_queries(tmp_path / "q2.txt") == ["a dog", "a cat"]


def test_hits_carry_ids_paths_and_uncertainty(store, captions):
    texts, _ = captions
    head = _head("uatvr")
    stage = first_stage(store, "exact", cache=False)
    ranked = two_stage(head, texts, store, stage, 3, 20)
    hits = hits_of([f"q{i}" for i in range(len(texts))], ranked, store.videos)
    h = hits[0]
    assert (h.query, h.rank, h.video_id) == ("q0", 1, store.videos["video_id"].iat[h.row])
    with torch.inference_mode():
        te = head.encode_texts(texts)
        ve = head.encode_videos(_all_videos(store))
    sigma = np.exp((te["log_sigma"].mean(-1)[0] + ve["log_sigma"].mean(-1)[h.row]).item() / 2)
    assert h.uncertainty == pytest.approx(sigma, rel=1e-5)
    assert h.record()["uncertainty"] == h.uncertainty and h.record()["start_s"] is None


def test_first_stage_needs_a_video_with_frames(store):
    import zarr

    with zarr.config.set({"array.write_empty_chunks": True}):  # every video failed to decode
        _writable(store)["videos/frame_mask"][:] = False
    with pytest.raises(ConfigError, match="no video has a decoded frame"):
        first_stage(open_store(store.dir), "exact", cache=False)



def test_a_store_whose_clip_cannot_be_loaded_says_to_pass_pretrained(store):
    searcher = Searcher(store, _head("meanpool"), "zero-shot", 8, ("tvrpipe-tiny", "/nowhere/clip.safetensors", 0))
    with pytest.raises(ConfigError, match="cannot be loaded .*pass --pretrained with its checkpoint"):
        searcher.encode(["a dog"])


def test_a_hits_clip_bounds_for_people(capsys):
    from tvrpipe.cli.search import _print_hits
    from tvrpipe.search.results import Hit

    def hit(start, end):
        return Hit("q", 1, "v", "v.mp4", start, end, 0.5, None, 0)

    assert [hit(*b).clip() for b in ((None, None), (2.0, 4.25), (5.0, None), (None, 3.0), (float("nan"), 1.0))] == [
        "whole file", "2.0-4.2", "5.0-end", "start-3.0", "start-1.0"]
    assert hit(5.0, None).clip(2, " &ndash; ", " s") == "5.00 s &ndash; end"
    _print_hits("q", [hit(5.0, None), hit(None, None)])  # a clip with a start only prints, no traceback
    out = capsys.readouterr().out
    assert "5.0-end" in out and "whole file" in out



def test_a_run_of_quickgelu_weights_from_their_tag_shares_the_stores_architecture():
    """A run that loaded ViT-B-32 from the openai tag records ViT-B-32-quickgelu; a store extracted from the
    same tag records ViT-B-32: one architecture. A store of other weights under the plain name is another."""
    from tvrpipe.search.engine import same_architecture

    assert same_architecture("ViT-B-32", {"model": "ViT-B-32", "pretrained": "/w/clip.pt"})
    assert same_architecture("ViT-B-32-quickgelu", {"model": "ViT-B-32", "pretrained": "openai"})
    assert not same_architecture("ViT-B-32-quickgelu", {"model": "ViT-B-32", "pretrained": "laion2b_s34b_b79k"})
    assert not same_architecture("ViT-B-32-quickgelu", {"model": "ViT-B-32", "pretrained": "/w/clip.pt"})
    assert not same_architecture("ViT-B-16-quickgelu", {"model": "ViT-B-32", "pretrained": "openai"})
