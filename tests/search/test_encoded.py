"""The head's encodings kept beside the store: equal to encoding the frames, the same ranking exhaustively and in
two stages, kept and reused per store state and checkpoint, and their refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_clip import as_tiny_clip_store

from tvrpipe.errors import ConfigError, WriteError
from tvrpipe.features.store import open_store
from tvrpipe.heads.base import create_head
from tvrpipe.rundir import BEST, CHECKPOINTS
from tvrpipe.search import encoded as encoded_mod
from tvrpipe.search.batches import text_batch, video_batch
from tvrpipe.search.encoded import ENCODED_DIR, head_encodings
from tvrpipe.search.engine import Searcher, exhaustive, search, two_stage
from tvrpipe.search.index import first_stage, searchable_rows

D = 32


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """A generated store: 40 train and 30 test videos of 2-4 frames, 8 words, D = 32."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=40, test_videos=30, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=D, seed=4, min_frames=2)
    return generate_store(tmp_path_factory.mktemp("gen") / "store", spec, video_shard=16, text_shard=64)


@pytest.fixture
def store(gen, tmp_path):
    shutil.copytree(gen, tmp_path / "store")
    return open_store(tmp_path / "store")


@pytest.fixture
def tiny_store(tmp_path):
    """A store of the tiny CLIP's width (D = 64) relabelled as extracted with it, so sentences can be encoded."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=24, test_videos=16, captions_per_train_video=1, frames=4, max_words=8,
                   embed_dim=64, seed=5)
    return as_tiny_clip_store(generate_store(tmp_path / "tiny", spec, video_shard=8, text_shard=16))


def _run(tmp_path, name: str, seed: int = 0):
    """A head with random weights and a run folder holding them (the encodings are keyed by its checkpoint)."""
    torch.manual_seed(seed)
    head = create_head(name, embed_dim=D).eval()
    run = tmp_path / f"{name}-{seed}"
    (run / CHECKPOINTS).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, run / CHECKPOINTS / BEST)
    return head, run


@pytest.mark.parametrize("name", ["prota", "uatvr"])
def test_kept_encodings_are_the_heads_and_rank_as_encoding_the_frames(store, tmp_path, name):
    """Every entry of the head's video encoding, for every searchable video, equals encoding its frames (to float
    rounding: other batches); the exhaustive search and the two stages give the same hits and scores from them."""
    head, run = _run(tmp_path, name)
    monkey_block = encoded_mod._BLOCK
    try:
        encoded_mod._BLOCK = 16  # several blocks, the last short
        enc = head_encodings(store, head, run)
    finally:
        encoded_mod._BLOCK = monkey_block
    rows = searchable_rows(store)
    np.testing.assert_array_equal(enc.rows, rows)
    with torch.inference_mode():
        want = head.encode_videos(video_batch(store, rows))
    assert set(enc.entries) == set(want)
    for k, v in want.items():
        assert enc.entries[k].dtype == v.numpy().dtype and enc.entries[k].shape == tuple(v.shape)
        np.testing.assert_allclose(enc.entries[k], v.numpy(), rtol=1e-5, atol=1e-6)
    texts = text_batch(store, np.flatnonzero(store.texts["split"].to_numpy() == "test"))
    full = exhaustive(head, texts, store, rows, 10)
    kept = exhaustive(head, texts, store, rows, 10, encoded=enc)
    np.testing.assert_array_equal(kept.rows, full.rows)
    np.testing.assert_allclose(kept.scores, full.scores, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept.uncertainty, full.uncertainty, rtol=1e-5, atol=1e-6, equal_nan=True)
    stage = first_stage(store, "exact", cache=False)
    frames, reads = two_stage(head, texts, store, stage, 5, 20), two_stage(head, texts, store, stage, 5, 20,
                                                                           encoded=enc)
    np.testing.assert_array_equal(reads.rows, frames.rows)
    np.testing.assert_allclose(reads.scores, frames.scores, rtol=1e-5, atol=1e-6)
    # a subset of rows, out of the stored order: each row's own encoding
    some = rows[[5, 0, 3]]
    got = enc.batch(some)
    np.testing.assert_array_equal(got["mask" if name == "prota" else "frame_mask"].numpy(),
                                  enc.entries["mask" if name == "prota" else "frame_mask"][[5, 0, 3]])
    with pytest.raises(ValueError, match="rows outside the encoded videos"):
        enc.batch(np.array([rows[-1] + 1]))


def test_a_kept_entry_is_read_from_its_file_as_indexing_it_reads(tmp_path):
    """Positions in any order, with runs, repeats and a single row; an entry of scalars and one of matrices."""
    rng = np.random.default_rng(0)
    for shape, dtype in (((50,), np.float32), ((50, 3, 4), np.float32), ((50, 2), np.bool_)):
        np.save(tmp_path / "e.npy", (rng.random(shape) * 10).astype(dtype))
        kept = np.load(tmp_path / "e.npy", mmap_mode="r")
        for pos in ([3, 4, 5, 9, 10, 0, 49], [7], [12, 11, 10, 10], list(range(50)), []):
            pos = np.array(pos, np.int64)
            got = encoded_mod._gather(kept, pos)
            assert got.shape == (len(pos), *shape[1:]) and got.dtype == dtype and not isinstance(got, np.memmap)
            np.testing.assert_array_equal(got, np.asarray(kept)[pos])
        del kept


def test_encodings_are_kept_reused_and_made_anew_for_another_checkpoint(store, tmp_path):
    head, run = _run(tmp_path, "prota")
    enc = head_encodings(store, head, run)
    (folder,) = (store.dir / ENCODED_DIR).iterdir()
    meta = json.loads((folder / "encoded.json").read_text())
    per_video = sum(v[0].nbytes for v in enc.entries.values())
    assert meta["method"] == "prota" and meta["bytes_per_video"] == per_video and meta["build_seconds"] > 0
    assert meta["bytes"] >= per_video * len(enc) and meta["entries"]["x"] == {"shape": [4, D], "dtype": "float32"}
    again = head_encodings(store, head, run)  # read back, not encoded again
    assert isinstance(again.entries["x"], np.memmap) and again.record["build_seconds"] == meta["build_seconds"]
    other, other_run = _run(tmp_path, "prota", seed=1)
    head_encodings(store, other, other_run)
    assert len(list((store.dir / ENCODED_DIR).iterdir())) == 2
    # damaged: encoded again, not read half
    x = np.array(enc.entries["x"])
    del enc, again
    (folder / "x.npy").write_bytes(b"not an array")
    fresh = head_encodings(store, head, run)
    np.testing.assert_allclose(fresh.entries["x"], x, rtol=1e-6, atol=1e-7)


def test_search_reads_the_encodings_and_refuses_without_a_run(store, tmp_path):
    """``search(encoded_videos=True)``: the same hits as the frames', said in Found; zero-shot is refused before
    anything is written; a two-stage search whose ranking is the first stage's (meanpool) encodes nothing."""
    head, run = _run(tmp_path, "prota")
    s = Searcher(store, head, "prota (run)", 8, None, run=run)
    texts = text_batch(store, np.arange(3))
    frames = search(s, ["a", "b", "c"], k=5, candidates=20, first_stage="exact", texts=texts)
    kept = search(s, ["a", "b", "c"], k=5, candidates=20, first_stage="exact", texts=texts, encoded_videos=True)
    assert kept.encoded and not frames.encoded
    assert [h.video_id for h in kept.hits] == [h.video_id for h in frames.hits]
    np.testing.assert_allclose([h.score for h in kept.hits], [h.score for h in frames.hits], rtol=1e-5, atol=1e-6)
    assert len(list((store.dir / ENCODED_DIR).iterdir())) == 1
    zero_shot = Searcher(store, create_head("meanpool", embed_dim=D).eval(), "zero-shot", 8, None)
    with pytest.raises(ConfigError, match="--encoded-videos keeps a trained head's encodings of the videos: give "
                                          "--run"):
        search(zero_shot, ["a"], candidates=20, texts=text_batch(store, np.arange(1)),
               encoded_videos=True)
    mean, mean_run = _run(tmp_path, "meanpool")
    found = search(Searcher(store, mean, "meanpool (run)", 8, None, run=mean_run), ["a"], k=3, candidates=10,
                   first_stage="exact", texts=text_batch(store, np.arange(1)), encoded_videos=True)
    assert not found.encoded and len(list((store.dir / ENCODED_DIR).iterdir())) == 1


def test_an_encoding_that_depends_on_the_batch_a_full_disk_and_a_read_only_store_are_refused(store, tmp_path, monkeypatch):
    head, run = _run(tmp_path, "prota")
    monkeypatch.setattr(encoded_mod, "_BLOCK", 1)

    def cut(videos):  # to the batch's longest video, as a head that drops padding would
        n = int(videos.frame_mask.sum(1).max())
        return {"frames": videos.frames[:, :n]}

    monkeypatch.setattr(head, "encode_videos", cut)
    lengths = store.array("videos/frame_mask")[:].sum(1)
    first_other = int(np.flatnonzero(lengths != lengths[0])[0])
    with pytest.raises(ConfigError, match=f"prota's video encoding 'frames' has shape \\({lengths[first_other]}, "
                                          f"{D}\\) for videos {first_other}-{first_other} and \\({lengths[0]}, {D}\\) "
                                          "for the first ones: it depends on the batch"):
        head_encodings(store, head, run)
    monkeypatch.undo()
    head, run = _run(tmp_path, "prota", seed=2)
    monkeypatch.setattr(encoded_mod, "free_disk", lambda path: 10**6)
    with pytest.raises(ConfigError, match="--encoded-videos: prota's encodings of 70 videos take .* and the disk of "
                                          f"{store.dir} has 1.0 MB free; search without --encoded-videos"):
        head_encodings(store, head, run)
    assert not (store.dir / ENCODED_DIR).exists() or not any((store.dir / ENCODED_DIR).iterdir())
    monkeypatch.undo()

    def unwritable(folder, write):
        raise WriteError(f"{folder}: could not write (Read-only file system)")

    monkeypatch.setattr(encoded_mod, "atomic_replace_folder", unwritable)
    with pytest.raises(ConfigError, match=f"--encoded-videos: prota's encodings are kept beside the store, and "
                                          f"{store.dir / ENCODED_DIR}/.*: could not write \\(Read-only file system\\); "
                                          "search without --encoded-videos, or extract the store where you can write"):
        head_encodings(store, head, run)


def test_the_cli_searches_from_the_heads_kept_encodings(tiny_store, tmp_path, cli):
    """`--encoded-videos`: a prota run's encodings kept in the store's search-encoded/ on the first search, read by
    the next; the hits are those of encoding the frames; zero-shot is refused in one line."""
    from tvrpipe.training.fit import TrainConfig, fit

    run = tmp_path / "run"
    fit(tiny_store, "prota", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    args = ("search", "a dog", "--features", tiny_store, "--run", run, "--top-k", "3", "--candidates", "20")
    r = cli(*args, "--encoded-videos", "--json", tmp_path / "e.json")
    assert r.exit_code == 0, r.output
    assert "scored by the head, from its kept encodings" in " ".join(r.output.split())
    (kept,) = (tiny_store / "search-encoded").iterdir()
    assert json.loads((kept / "encoded.json").read_text())["method"] == "prota"
    r = cli(*args, "--json", tmp_path / "f.json")
    assert r.exit_code == 0, r.output
    assert "kept encodings" not in " ".join(r.output.split())
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("e.json", "f.json"))
    assert [h["video_id"] for h in got] == [h["video_id"] for h in want] and len(got) == 3
    np.testing.assert_allclose([h["score"] for h in got], [h["score"] for h in want], rtol=1e-5, atol=1e-6)
    r = cli("search", "a dog", "--features", tiny_store, "--candidates", "5", "--encoded-videos")
    assert r.exit_code == 1 and ("--encoded-videos keeps a trained head's encodings of the videos: give --run"
                                 in " ".join(r.output.split()))


def test_first_stages_of_the_heads_own_vectors_read_its_kept_encodings(store, tmp_path):
    """head-embedding (seqtransf) and late-interaction (uatvr) built where the head's encodings are kept read them
    (their record says so) and hold the vectors they would have encoded from the frames; the distilled stage,
    whose vectors are not the head's, ignores them."""
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.search.distilled import head_stage
    from tvrpipe.search.first_stages import stage_config
    from tvrpipe.training.fit import TrainConfig, fit

    for name, stage_name, settings in (("seqtransf", "head-embedding", ()),
                                       ("uatvr", "late-interaction", ("captions=20", "videos=20", "dim=8"))):
        run = tmp_path / name
        fit(store.dir, name, run, TrainConfig(epochs=1, batch_size=16), progress=False)
        head = load_head(run / CHECKPOINTS / BEST).eval()
        config = stage_config(stage_name, settings)
        frames = head_stage(store, head, run, stage_name, config, cache=False)
        assert frames.record["from_encodings"] is False
        head_encodings(store, head, run)
        kept = head_stage(store, head, run, stage_name, config, rebuild=True)
        assert kept.record["from_encodings"] is True
        np.testing.assert_allclose(kept.pooled, frames.pooled, rtol=1e-5, atol=1e-6)
    distilled = head_stage(store, head, run, "distilled", stage_config("distilled", ["steps=2", "dim=8",
                                                                                    "captions=20", "videos=20"]))
    assert distilled.record["from_encodings"] is False
