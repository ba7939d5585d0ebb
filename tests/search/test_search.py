"""The search engine on a generated store: the first stage against NumPy, the two stages against the exhaustive
search for every head, the index cache and its refusals, and the errors of bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tiny_clip import as_tiny_clip_store

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import open_store
from tvrpipe.heads.base import create_head, list_heads
from tvrpipe.search import index as index_mod
from tvrpipe.search.engine import (
    Found,
    Searcher,
    check_queries,
    exhaustive,
    hits_of,
    read_queries,
    search,
    two_stage,
)
from tvrpipe.search.first_stages import exact as exact_mod
from tvrpipe.search.first_stages import faiss_hnsw as hnsw_mod
from tvrpipe.search.first_stages.faiss_hnsw import faiss_available
from tvrpipe.search.index import (
    INDEX_DIR,
    exact_top,
    export_faiss,
    exported_stage,
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
    from tvrpipe.worlds.features import GenSpec, generate_store

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
    monkeypatch.setattr(exact_mod, "_BLOCK", 16)  # four blocks, the last short
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

    stage = index_mod.FirstStage(emb, np.arange(30), hnsw_mod.FaissHNSW(emb, hnsw_mod.FaissHNSW.Config(), Short()))
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
    read = []

    class Recording:  # the store, recording which rows' frames are read
        def __getattr__(self, name):
            return getattr(store, name)

        def read(self, name, rows):
            read.extend(rows if name == "videos/frames" else [])
            return store.read(name, rows)

    short = two_stage(head, texts, Recording(), stage, 10, 12)
    for q in range(len(texts)):
        assert set(short.rows[q]) <= set(stage.rows[pos[q]])
    # the head reads the frames of the shortlisted videos only, each once
    assert sorted(read) == sorted(set(stage.rows[pos].ravel())) and len(read) < len(stage)
    recall = [np.mean([len(set(two_stage(head, texts, store, stage, 10, K).rows[q]) & set(full.rows[q])) / 10
                       for q in range(len(texts))]) for K in (10, 30, len(stage))]
    assert recall[0] <= recall[1] <= recall[2] == 1.0


def test_meanpool_keeps_the_first_stages_ranking_and_reads_no_frame(store, captions):
    """meanpool's score is the first stage's cosine: the two stages keep the first stage's top k, which is what
    the head's own scores of the shortlist rank, and no frame of the store is read."""
    texts, _ = captions
    head = _head("meanpool")
    stage = first_stage(store, "exact", cache=False)
    read = []

    class Recording:  # the store, recording what is read
        def __getattr__(self, name):
            return getattr(store, name)

        def read(self, name, rows):
            read.append(name)
            return store.read(name, rows)

    fast = two_stage(head, texts, Recording(), stage, 5, 20)
    assert read == [] and fast.candidates == 20 and np.isnan(fast.uncertainty).all()
    pos, _ = stage.top(texts.sentence.numpy(), 20)
    with torch.inference_mode():  # the head's own scores of each query's shortlist, from the store's frames
        sim = head.similarity(head.encode_texts(texts), head.encode_videos(_all_videos(store))).float().numpy()
    for q in range(len(texts)):
        short = stage.rows[pos[q]]
        want = sorted(short, key=lambda r: (-sim[q, r], r))[:5]
        np.testing.assert_allclose(fast.scores[q], sim[q, want], rtol=1e-5, atol=1e-6)
        assert set(fast.rows[q]) <= set(short)
        np.testing.assert_allclose(sim[q, fast.rows[q]], sim[q, want], rtol=1e-5, atol=1e-6)  # equal up to ties


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
def test_faiss_first_stage_equals_exact_below_hnsw_and_recalls_above(store, captions):
    q = captions[0].sentence.numpy()
    exact = first_stage(store, "exact", cache=False)
    flat = first_stage(store, "faiss", cache=False)
    e_idx, e_s = exact.top(q, 10)
    f_idx, f_s = flat.top(q, 10)
    np.testing.assert_allclose(f_s, e_s, rtol=1e-5, atol=1e-6)
    assert (f_idx == e_idx).mean() > 0.99  # equal up to ties of float rounding
    hnsw = first_stage(store, "faiss", cache=False, settings={"hnsw_from": 10})
    assert hasattr(hnsw.index.index, "hnsw") and "IndexHNSWFlat M=32" in hnsw.describe()
    h_idx, _ = hnsw.top(q, 10)
    assert np.mean([len(set(h_idx[i]) & set(e_idx[i])) / 10 for i in range(len(q))]) > 0.9


def test_the_index_is_kept_beside_the_store_and_rebuilt_when_the_store_changes(store, monkeypatch):
    folder = store.dir / INDEX_DIR
    stage = first_stage(store, "exact")
    meta = json.loads((folder / "index.json").read_text())
    assert meta["store_key"] == store_key(store) and meta["videos"] == len(stage)
    calls = []
    monkeypatch.setattr(index_mod, "pooled_rows", lambda s, *a: calls.append(1) or pooled_rows(s, *a))
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
        # no --top-k given: the default is named as the default, not as an option the user never typed
        ({"candidates": 3}, f"--candidates 3 is fewer than the {min(10, n)} hits a query returns by default: give "
                            rf"at least {min(10, n)} candidates, or ask for fewer hits \(--top-k N\)"),
        ({"first_stage": "ann"}, r"--first-stage 'ann': choose one of auto, head, distilled, exact, faiss-hnsw \(or faiss\)"),
        ({"index": tmp_path, "first_stage": "exact"}, "is the first stage; leave out --first-stage exact"),
    ]:
        with pytest.raises(ConfigError, match=match):
            search(searcher, ["a dog"], texts=texts, **kwargs)
    with pytest.raises(ConfigError, match="query 2 is empty"):
        check_queries(["a dog", "  "])
    with pytest.raises(ConfigError, match="was generated by `tvrpipe synth --features-only`: its features are of no CLIP"):
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


# ------------------------------------------------------------------ the CLI on stores of a (tiny) CLIP


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A store of the tiny CLIP's width (D = 64): 24 train and 16 test videos, 4 frames, 8 words."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=24, test_videos=16, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=64, seed=5)
    out = generate_store(tmp_path_factory.mktemp("tiny") / "store", spec, video_shard=8, text_shard=16)
    return as_tiny_clip_store(out)


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "store", ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    return tmp_path / "store"


def _text(r) -> str:
    return " ".join(r.output.split())


def _dead_pid() -> int:
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now: what a kill -9 leaves behind
    return dead.pid


def test_a_search_removes_the_index_a_killed_search_was_keeping(tiny_copy, cli):
    """A search killed while it kept its index leaves `.search-index.tmp-PID` (and, killed between its renames,
    `.search-index.old-PID`); the next search removes those of processes that are gone, never a live one's."""
    import os

    dead = _dead_pid()
    left = [tiny_copy / f".{INDEX_DIR}.tmp-{dead}", tiny_copy / f".{INDEX_DIR}.old-{dead}"]
    live = tiny_copy / f".{INDEX_DIR}.tmp-{os.getppid()}"  # (not this process's: the search runs in it)
    for d in (*left, live):
        d.mkdir()
        (d / "pooled.npy").write_bytes(b"half a file")
    r = cli("search", "a dog", "--features", tiny_copy, "--top-k", 3)
    assert r.exit_code == 0, r.output
    assert not any(d.exists() for d in left)
    assert live.is_dir() and (tiny_copy / INDEX_DIR / "index.json").is_file()


def test_an_extract_removes_what_killed_writers_left_in_its_store(tmp_path, cli):
    """`tvrpipe synth --features-only` (a StoreWriter, as extract) run again on its store removes the staged
    group, sidecar and search index of processes that are gone; a live process's stays."""
    import os

    out = tmp_path / "gen"
    args = ("synth", "--features-only", "--out", out, "--set", "train_videos=8", "--set", "test_videos=4",
            "--set", "embed_dim=8", "--set", "frames=2", "--set", "scenes=1", "--set", "max_words=4")
    assert cli(*args).exit_code == 0
    dead = _dead_pid()
    left = [out / f".features.zarr.tmp-{dead}", out / f".{INDEX_DIR}.tmp-{dead}"]
    for d in left:
        d.mkdir()
    (out / f".videos.parquet.tmp-{dead}").write_bytes(b"half")
    live = out / f".{INDEX_DIR}.tmp-{os.getpid()}"
    live.mkdir()
    r = cli(*args)
    assert r.exit_code == 0, r.output
    assert not any(p.exists() for p in (*left, out / f".videos.parquet.tmp-{dead}")) and live.is_dir()


def test_a_search_while_an_extract_writes_the_store_names_the_writer(tiny_copy, cli):
    """An extract holds the store's lock while it writes: a search meanwhile finds no store, an incomplete one, or
    (a collection's update) the old one moved into .previous; each says who is writing it, and writes nothing."""
    import os

    import zarr

    from tvrpipe.features.store import PREVIOUS, PROGRESS, SIDECARS, STORE_NAME
    from tvrpipe.lock import DirLock

    def listing():
        return sorted(p.name for p in tiny_copy.iterdir())

    # an update, mid-way: the store it replaces set aside, the new one not created yet
    (tiny_copy / PREVIOUS).mkdir()
    for name in (STORE_NAME, PROGRESS, *SIDECARS):
        os.replace(tiny_copy / name, tiny_copy / PREVIOUS / name)
    with DirLock(tiny_copy):
        before = listing()
        r = cli("search", "a dog", "--features", tiny_copy)
        assert r.exit_code == 1, r.output
        assert f"{tiny_copy}: the feature store is being updated by pid {os.getpid()} on " in _text(r)
        assert _text(r).endswith("rerun when it finishes") and "no feature store" not in _text(r)
        assert listing() == before
    # the updater was killed: the lock is free, .previous is still there
    r = cli("search", "a dog", "--features", tiny_copy)
    assert r.exit_code == 1 and "an update of the collection's store was interrupted" in _text(r), r.output
    assert "finish it by running `tvrpipe extract` again with the same options and --out" in _text(r)

    # an extract resuming an incomplete store
    for name in (STORE_NAME, PROGRESS, *SIDECARS):
        os.replace(tiny_copy / PREVIOUS / name, tiny_copy / name)
    (tiny_copy / PREVIOUS).rmdir()
    zarr.open_group(str(tiny_copy / STORE_NAME), mode="a").attrs["complete"] = False
    with DirLock(tiny_copy):
        r = cli("search", "a dog", "--features", tiny_copy)
        assert r.exit_code == 1 and f"is being written by pid {os.getpid()} on " in _text(r), r.output
        assert not (tiny_copy / INDEX_DIR).exists()


def test_a_generated_store_is_refused_before_anything_is_written_naming_its_maker(tmp_path, cli):
    from tvrpipe.worlds.features import GenSpec, generate_store

    out = tmp_path / "gen"
    assert cli("synth", "--features-only", "--out", out, "--set", "train_videos=8", "--set", "test_videos=4",
               "--set", "embed_dim=8").exit_code == 0
    before = sorted(p.name for p in out.iterdir())
    r = cli("search", "a dog", "--features", out)
    assert r.exit_code == 1, r.output
    assert (f"--features {out} was generated by `tvrpipe synth --features-only`: its features are of no CLIP, so no "
            "sentence can be encoded to search them; search a store of `tvrpipe extract`") in _text(r)
    assert "bench" not in _text(r)
    assert sorted(p.name for p in out.iterdir()) == before  # no search-index/
    bench = generate_store(tmp_path / "bench", GenSpec(train_videos=4, test_videos=2, embed_dim=8),
                           made_by="tvrpipe bench search")
    r = cli("search", "a dog", "--features", bench)
    assert r.exit_code == 1 and "was generated by `tvrpipe bench search`" in _text(r), r.output
    assert not (bench / INDEX_DIR).exists()


@pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed (pip install 'tvrpipe[search]')")
def test_the_cli_searches_with_any_registered_first_stage_and_its_settings(tiny_copy, cli):
    """`--first-stage faiss-ivfpq --first-stage-set ...` ranks as the exact stage where the shortlist holds every
    video; an unknown setting is refused in one line naming the ones there are, before any index is built."""
    r = cli("search", "a dog", "--features", tiny_copy, "--first-stage", "faiss-ivfpq", "--first-stage-set",
            "nprobe=4", "--first-stage-set", "ivf_from=2", "--json", tiny_copy.parent / "ivf.json")
    assert r.exit_code == 0, r.output
    r = cli("search", "a dog", "--features", tiny_copy, "--first-stage", "exact", "--json", tiny_copy.parent / "x.json")
    assert r.exit_code == 0, r.output
    assert (tiny_copy.parent / "ivf.json").read_text() == (tiny_copy.parent / "x.json").read_text()
    meta = json.loads((tiny_copy / INDEX_DIR / "index.json").read_text())
    assert meta["first_stage"]["name"] == "faiss-ivfpq" and meta["first_stage"]["settings"]["ivf_from"] == 2
    r = cli("search", "a dog", "--features", tiny_copy, "--first-stage", "faiss", "--first-stage-set", "nprobe=4")
    assert r.exit_code == 1 and "first stage faiss-hnsw has no setting 'nprobe'; known: ef_construction" in _text(r)
    # a value, an item or a repeat the parser refuses is blamed on the option typed, not on train-head's --set
    for items, said in ((["nprobe=abc"], "--first-stage-set nprobe=abc: not a valid int"),
                        (["nprobe"], "--first-stage-set expects key=value, got 'nprobe'"),
                        (["nprobe=1", "nprobe=2"], "--first-stage-set nprobe is given twice")):
        r = cli("search", "a dog", "--features", tiny_copy, "--first-stage", "faiss-ivfpq",
                *[a for i in items for a in ("--first-stage-set", i)])
        assert r.exit_code == 1 and said in _text(r) and "--set " not in _text(r), _text(r)


def test_faiss_missing_advises_the_install_that_works(tiny_copy, cli, monkeypatch):
    monkeypatch.setattr(hnsw_mod.FaissHNSW, "available", classmethod(lambda cls: False))
    r = cli("search", "a dog", "--features", tiny_copy, "--first-stage", "faiss")
    assert r.exit_code == 1, r.output
    assert ("--first-stage faiss needs faiss-cpu (tvrpipe's search extra): pip install faiss-cpu, or in tvrpipe's "
            "checkout pip install -e '.[search]', or use --first-stage exact") in _text(r)


def _run_on(store, out):
    from tvrpipe.training.fit import TrainConfig, fit

    fit(store, "meanpool", out, TrainConfig(epochs=0), progress=False)
    return out


def test_a_run_of_another_clip_is_told_where_its_clip_is_and_how_to_extract_with_it(tiny, tmp_path, cli):
    """The refusal names the run's weights (its store's CLIP; a finetune run's exported file) and the complete
    extract command of the searched store's videos with them, and the store the run trained on."""
    import yaml

    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=8, test_videos=4, frames=4, max_words=8, embed_dim=64, seed=2)
    own = as_tiny_clip_store(generate_store(tmp_path / "own", spec), seed=1)
    run = _run_on(own, tmp_path / "run")
    r = cli("search", "a dog", "--run", run, "--features", tiny)
    assert r.exit_code == 1, r.output
    assert f"--run {run} learnt with another CLIP than --features {tiny} holds (weights_sha256" in _text(r)
    assert (f"the run's CLIP is tvrpipe-tiny none, as its store {own.resolve()} was extracted; search a store of "
            f"these videos extracted with it: `tvrpipe extract --manifest MANIFEST_DIR --video-root VIDEO_DIR --out "
            f"NEW_STORE_DIR --model tvrpipe-tiny --pretrained none --seed 1 --frames 4 --max-words 8`, or the store "
            f"the run trained on (--features {own.resolve()})") in _text(r)

    # a finetune run end to end: its exported CLIP file
    ft = tmp_path / "ft"
    shutil.copytree(run, ft)
    config = yaml.safe_load((ft / "config.yaml").read_text())
    config.update(finetune={"end_to_end": True, "model": "tvrpipe-tiny", "pretrained": "none", "seed": 0},
                  features=None, manifest="/data/mine/manifest", video_root="/data/mine/videos")
    (ft / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = json.loads((ft / "metrics.json").read_text())
    metrics.update(export={"file": "clip.safetensors", "model": "tvrpipe-tiny"},
                   provenance={"weights_sha256": "f" * 64, "model": "tvrpipe-tiny"})
    (ft / "metrics.json").write_text(json.dumps(metrics))
    r = cli("search", "a dog", "--run", ft, "--features", tiny)
    assert r.exit_code == 1, r.output
    assert (f"the run's CLIP is its finetuned CLIP {ft / 'clip.safetensors'}; search a store of these videos "
            f"extracted with it: `tvrpipe extract --manifest MANIFEST_DIR --video-root VIDEO_DIR --out NEW_STORE_DIR "
            f"--model tvrpipe-tiny --pretrained {ft / 'clip.safetensors'} --frames 4 --max-words 8`") in _text(r)


def test_a_run_trained_on_a_generated_store_is_advised_what_works(gen, tiny, tmp_path, cli):
    run = _run_on(gen, tmp_path / "run")
    r = cli("search", "a dog", "--run", run, "--features", tiny)
    assert r.exit_code == 1, r.output
    assert "tvrpipe extract --" not in _text(r)  # extract cannot make generated features
    assert ("a generated store can only be searched by a run trained on a store generated the same way); a store "
            "of `tvrpipe extract` is searched by a run trained on features of its CLIP: train one on this store "
            f"(`tvrpipe train-head --features {tiny} --method meanpool --out NEW_RUN_DIR`)") in _text(r)


def test_a_changed_collection_is_told_the_complete_commands_that_update_its_store(tiny_copy, tmp_path, cli):
    """The collection's store records its manifest folder, video folder and extract settings: the advice is the
    two commands to run as printed (precision and shards included); without a recorded manifest, a placeholder."""
    import pandas as pd
    import zarr

    folder = tmp_path / "my videos"
    folder.mkdir()
    videos = pd.read_parquet(tiny_copy / "videos.parquet")
    videos["path"] = [f"{v}.mp4" for v in videos["video_id"]]
    for i, path in enumerate(videos["path"]):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(b"x" * (i + 1))
    stats = [(folder / p).stat() for p in videos["path"]]
    videos.assign(bytes=[s.st_size for s in stats], mtime_ns=[s.st_mtime_ns for s in stats]).to_parquet(
        tiny_copy / "videos.parquet", index=False)
    attrs = zarr.open_group(str(tiny_copy / "features.zarr"), mode="a").attrs
    attrs.update({"kind": "collection", "video_root": str(folder), "manifest": str(tmp_path / "m"),
                  "precision": "bf16"})
    assert cli("search", "a dog", "--features", tiny_copy, "--top-k", 2).exit_code == 0
    with (folder / videos["path"].iat[0]).open("ab") as f:
        f.write(b"\0")
    r = cli("search", "a dog", "--features", tiny_copy)
    assert r.exit_code == 1, r.output
    assert (f"update the store with `tvrpipe manifest build --videos '{folder}' --out {tmp_path / 'm'}` and "
            f"`tvrpipe extract --manifest {tmp_path / 'm'} --video-root '{folder}' --out {tiny_copy} --model "
            "tvrpipe-tiny --pretrained none --frames 4 --max-words 8 --precision bf16 --video-shard 8 "
            "--text-shard 16` (only changed and new videos are encoded)") in _text(r)
    del attrs["manifest"]
    r = cli("search", "a dog", "--features", tiny_copy)
    assert r.exit_code == 1 and "--out MANIFEST_DIR` and `tvrpipe extract --manifest MANIFEST_DIR --video-root" \
        in _text(r), r.output
    assert "MANIFEST_DIR: a folder for the collection's manifest (the store records none)" in _text(r)


# -------------------------------------------------------------------------------------------- --min-score


def _zero_shot_numpy(texts, store) -> np.ndarray:
    """cos(sentence, the normalised mean of each video's L2-normalised real frames), float64; -inf for a video
    with no real frame (never searchable)."""
    frames = store.array("videos/frames")[:].astype(np.float64)
    mask = store.array("videos/frame_mask")[:]
    s = texts.sentence.double().numpy()
    s /= np.linalg.norm(s, axis=1, keepdims=True)
    out = np.full((len(s), len(frames)), -np.inf)
    for j in range(len(frames)):
        if mask[j].any():
            real = frames[j][mask[j]]
            m = (real / np.linalg.norm(real, axis=1, keepdims=True)).mean(0)
            out[:, j] = s @ (m / np.linalg.norm(m))
    return out


def test_min_score_cuts_the_hits_below_it_after_ranking(store, captions):
    """The top k by the head (checked against NumPy), then the hits scoring below X cut: each query keeps the head
    of its list (ranks 1, 2, ...), a hit scoring exactly X stays, and a note per query says how many were cut."""
    from tvrpipe.heads.base import TextBatch

    texts, _ = captions
    texts = TextBatch(texts.tokens[:6], texts.token_mask[:6], texts.sentence[:6])
    queries = [f"q{i}" for i in range(6)]
    searcher = Searcher(store, _head("meanpool"), "zero-shot", 8, None)
    k = 6
    everything = search(searcher, queries, k=k, texts=texts)
    ref = _zero_shot_numpy(texts, store)
    for q, query in enumerate(queries):
        mine = [h for h in everything.hits if h.query == query]
        want = np.argsort(-ref[q], kind="stable")[:k]
        assert [h.row for h in mine] == want.tolist()
        np.testing.assert_allclose([h.score for h in mine], ref[q, want], atol=1e-5)
    x = next(h.score for h in everything.hits if h.query == "q0" and h.rank == 4)  # q0 keeps 4: its 4th scores x
    found = search(searcher, queries, k=k, texts=texts, min_score=x)
    assert found.hits == [h for h in everything.hits if h.score >= x]
    kept = {query: [h.rank for h in found.hits if h.query == query] for query in queries}
    assert kept["q0"] == [1, 2, 3, 4]
    assert all(ranks == list(range(1, len(ranks) + 1)) for ranks in kept.values())
    cut = {query: k - len(ranks) for query, ranks in kept.items() if len(ranks) < k}
    assert found.cut == cut and found.min_score == x and found.top_k == k
    assert found.note("q0") == f"2 of the top 6 hits scored below --min-score {x:.10g} and were cut"
    one = Found([], 6, 6, 0.5, {"q": 1}, 6)
    assert one.note("q") == "1 of the top 6 hits scored below --min-score 0.5 and was cut" and one.note("r") is None
    assert all(found.note(query) is None for query in queries if query not in cut)
    # above every score of the top 6: nothing left, and the note says so
    none = search(searcher, queries, k=k, texts=texts, min_score=1.0)
    assert none.hits == [] and none.cut == dict.fromkeys(queries, k)
    assert none.note("q3") == "no hit scored at least --min-score 1: all 6 of the top 6 cut"
    # with the two stages, the same cut of the same hits
    shortlist = {"k": k, "texts": texts, "candidates": 20, "first_stage": "exact"}
    two = search(searcher, queries, min_score=x, **shortlist)
    assert two.hits == [h for h in search(searcher, queries, **shortlist).hits if h.score >= x]


def test_a_min_score_outside_the_heads_scores_is_refused_before_anything_is_written(store, captions):
    texts, _ = captions
    cosine = Searcher(store, _head("meanpool"), "zero-shot", 8, None)
    words = create_head("meanpool", embed_dim=D).meaning()
    for x, what in ((1.5, "every hit"), (-1.25, "no hit")):
        with pytest.raises(ConfigError) as e:
            search(cosine, ["a dog"], k=3, texts=texts, min_score=x)
        assert str(e.value) == (f"--min-score {x:g} is outside the scores of zero-shot, which are from -1 to 1 "
                                f"({words}): it would cut {what}; each head scores on its own scale, so give a "
                                "value from -1 to 1")
    with pytest.raises(ConfigError, match="--min-score nan: a finite number is needed"):
        search(cosine, ["a dog"], k=3, texts=texts, min_score=float("nan"))
    assert not (store.dir / INDEX_DIR).exists()  # refused before the first stage was built
    prota = Searcher(store, _head("prota"), "prota (runs/p)", 8, None)
    with pytest.raises(ConfigError, match=r"--min-score 0.1 is outside the scores of prota \(runs/p\), which are at most "
                                          r"0 \(ProTA Eq. 11: .*\): it would cut every hit; .* give a value at most 0$"):
        search(prota, ["a dog"], k=3, texts=texts, min_score=0.1)
    assert len(search(prota, [f"q{i}" for i in range(len(texts))], k=3, texts=texts, min_score=-50.0).hits) > 0


def test_min_score_from_the_cli_cuts_the_table_the_files_and_the_page(tiny_copy, cli, tmp_path):
    queries = ("a red circle moves", "a dog")
    r = cli("search", *queries, "--features", tiny_copy, "--top-k", 5, "--json", tmp_path / "all.json")
    assert r.exit_code == 0, r.output
    every = json.loads((tmp_path / "all.json").read_text())
    x = every[2]["score"]  # the first query keeps its top 3
    out = {"--json": tmp_path / "cut.json", "--csv": tmp_path / "cut.csv", "--html": tmp_path / "cut.html"}
    r = cli("search", *queries, "--features", tiny_copy, "--top-k", 5, "--min-score", repr(x),
            *[a for kv in out.items() for a in kv])
    assert r.exit_code == 0, r.output
    kept = [h for h in every if h["score"] >= x]
    assert json.loads(out["--json"].read_text()) == kept
    assert len(out["--csv"].read_text().splitlines()) == 1 + len(kept)
    page = " ".join(out["--html"].read_text().split())
    for q in queries:
        n = 5 - sum(h["query"] == q for h in kept)
        note = (f"{n} of the top 5 hits scored below --min-score {x:.10g} and were cut" if n < 5 else
                f"no hit scored at least --min-score {x:.10g}: all 5 of the top 5 cut")
        assert (note in _text(r)) == (n > 0) and (f'<p class="note">{note}</p>' in page) == (n > 0), (q, n)
    assert "2 of the top 5 hits scored below" in _text(r)
    # above every score: each query is named with its note, the files hold no hit, the page a section per query
    r = cli("search", *queries, "--features", tiny_copy, "--top-k", 5, "--min-score", "1", "--json", out["--json"],
            "--html", out["--html"])
    assert r.exit_code == 0, r.output
    for q in queries:
        assert f"{q}: no hit scored at least --min-score 1: all 5 of the top 5 cut" in _text(r)
    assert json.loads(out["--json"].read_text()) == []
    page = out["--html"].read_text()
    assert page.count("<section>") == 2 and page.count("all 5 of the top 5 cut") == 2


def test_a_bad_min_score_from_the_cli_is_one_line_and_nothing_is_written(tiny_copy, cli, tmp_path):
    r = cli("search", "a dog", "--features", tiny_copy, "--min-score", "30", "--json", tmp_path / "h.json")
    assert r.exit_code == 1, r.output
    assert ("error: --min-score 30 is outside the scores of zero-shot CLIP (meanpool, untrained), which are from -1 "
            "to 1 (the cosine of the sentence embedding and the mean of the frame embeddings, from -1 to 1 (higher "
            "ranks first)): it would cut every hit; each head scores on its own scale, so give a value from -1 to "
            "1") in _text(r)
    assert not (tmp_path / "h.json").exists() and not (tiny_copy / INDEX_DIR).exists()
    r = cli("search", "a dog", "--features", tiny_copy, "--min-score", "nan")
    assert r.exit_code == 2 and "a finite number is needed" in r.output


def test_ranking_depth_covers_the_per_file_limit():
    """k x (the most moments of one file - N + 1) rows hold the k best hits with at most N of a file: each file
    kept skips at most its other moments."""
    import pandas as pd

    from tvrpipe.search.engine import ranking_depth

    videos = pd.DataFrame({"path": ["a"] * 5 + ["b"] * 2 + ["c"]})
    assert ranking_depth(videos, 3, None, 8) == 3
    assert ranking_depth(videos, 2, 1, 100) == 2 * 5 and ranking_depth(videos, 2, 1, 6) == 6  # capped by the shortlist
    assert ranking_depth(videos, 3, 5, 8) == 3
    # the worst case reaches it: a ranks its 5 moments first, then b, then c; k = 2, N = 1 needs a's first and b's
    order = ["a"] * 5 + ["b", "b", "c"]
    kept, seen = [], set()
    for depth, path in enumerate(order, 1):
        if path not in seen:
            seen.add(path)
            kept.append(depth)
    assert kept[1] <= ranking_depth(videos, 2, 1, 8)


def test_the_cli_searches_with_a_first_stage_distilled_from_the_run(tiny_copy, tmp_path, cli):
    """`--first-stage distilled --run RUN --candidates K`: fitted once to the run's head on the run's store (kept
    in the store's search-distilled/), then reused; the head re-ranks its shortlist, so a K of every video but one
    gives the head's own top hits in its own scores."""
    from tvrpipe.training.fit import TrainConfig, fit

    run = tmp_path / "run"
    fit(tiny_copy, "xpool", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    args = ("search", "a dog", "--features", tiny_copy, "--run", run, "--top-k", "3", "--first-stage", "distilled",
            "--first-stage-set", "steps=5", "--first-stage-set", "dim=8")
    r = cli(*args, "--candidates", "39", "--json", tmp_path / "d.json")
    assert r.exit_code == 0, r.output
    assert len(list((tiny_copy / "search-distilled").iterdir())) == 1
    r = cli("search", "a dog", "--features", tiny_copy, "--run", run, "--top-k", "3", "--json", tmp_path / "x.json")
    assert r.exit_code == 0, r.output
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("d.json", "x.json"))
    hits = lambda found: [(h["video_id"], round(h["score"], 5)) for h in found]  # noqa: E731
    assert hits(got) == hits(want) and len(hits(got)) == 3
    r = cli(*args, "--candidates", "5")
    assert r.exit_code == 0, r.output
    assert len(list((tiny_copy / "search-distilled").iterdir())) == 1  # reused
    r = cli("search", "a dog", "--features", tiny_copy, "--first-stage", "distilled", "--candidates", "5")
    assert r.exit_code == 1 and "--first-stage distilled is fitted to a run's head: give --run" in _text(r)


def test_the_cli_searches_a_token_wise_run_with_the_first_stage_made_for_it(tiny_copy, tmp_path, cli):
    """`--first-stage head` with a tokenwise run builds the late-interaction stage (its record in the kept
    folder) and, at a K of every video but one, gives the head's own top hits in its own scores; the query's words
    reach the first stage."""
    from tvrpipe.training.fit import TrainConfig, fit

    run = tmp_path / "run"
    fit(tiny_copy, "tokenwise", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    args = ("search", "a dog", "--features", tiny_copy, "--run", run, "--top-k", "3", "--first-stage", "head")
    r = cli(*args, "--candidates", "39", "--json", tmp_path / "h.json")
    assert r.exit_code == 0, r.output
    (kept,) = (tiny_copy / "search-distilled").iterdir()
    assert json.loads((kept / "distilled.json").read_text())["first_stage"] == "late-interaction"
    r = cli("search", "a dog", "--features", tiny_copy, "--run", run, "--top-k", "3", "--json", tmp_path / "x.json")
    assert r.exit_code == 0, r.output
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("h.json", "x.json"))
    hits = lambda found: [(h["video_id"], round(h["score"], 5)) for h in found]  # noqa: E731
    assert hits(got) == hits(want) and len(hits(got)) == 3

