"""The Zarr feature store: layout, shards and markers, resume, provenance refusal (no Ray)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import zarr

from tvrpipe.features.store import STORE_NAME, StoreError, StoreWriter, make_provenance, open_store

F, L, D = 3, 4, 5


def _prov(**kw):
    base = dict(model="m", pretrained="none", weights_sha256="a" * 64, frames=F, max_words=L, embed_dim=D,
                frame_sampling="uniform-segment-centre", image_size=32, preprocessing="p", manifest_sha256="b" * 64)
    return make_provenance(**{**base, **kw})


def _tables(nv=7, nt=10):
    videos = pd.DataFrame({"video_id": [f"v{i}" for i in range(nv)], "split": "test",
                           "path": [f"v{i}.mp4" for i in range(nv)]})
    texts = pd.DataFrame({"caption_id": [f"c{i}" for i in range(nt)], "video_id": [f"v{i % nv}" for i in range(nt)],
                          "video_row": [i % nv for i in range(nt)], "split": "test"})
    return videos, texts


def _fill(w: StoreWriter, rng, only=None):
    for s in w.pending("videos"):
        if only is not None and s.index not in only:
            continue
        n = s.stop - s.start
        fails = [{"video_id": f"v{s.start}", "stage": "decode", "error": "empty: x"}] if s.index == 0 else []
        w.write_videos(s, rng.normal(size=(n, F, D)), np.ones((n, F), bool), np.zeros((n, F)), fails)
    if only is None:
        for s in w.pending("texts"):
            n = s.stop - s.start
            w.write_texts(s, rng.normal(size=(n, L, D)), np.ones((n, L), bool), rng.normal(size=(n, D)))


def test_layout_dtypes_chunks_and_roundtrip(tmp_path):
    v, t = _tables()
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4) as w:
        assert [(s.start, s.stop) for s in w.shards("videos")] == [(0, 3), (3, 6), (6, 7)]
        rng = np.random.default_rng(0)
        _fill(w, rng)
        failures = w.finalize()
    assert list(failures.video_id) == ["v0"]
    store = open_store(tmp_path)
    frames = store.array("videos/frames")
    assert frames.shape == (7, F, D) and frames.dtype == np.float16 and frames.chunks == (3, F, D)
    assert store.array("texts/tokens").shape == (10, L, D)
    assert store.array("texts/sentence").dtype == np.float16
    assert store.array("videos/frame_mask").dtype == bool
    # uncompressed, as docs/design.md ("Feature store") says (fp16 embeddings barely compress)
    meta = json.loads((tmp_path / STORE_NAME / "videos" / "frames" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes"]
    assert store.provenance["complete"] is True and store.provenance["frames"] == F
    pd.testing.assert_frame_equal(store.videos, v)
    assert list(store.failures.columns) == ["video_id", "stage", "error"]


def test_written_values_read_back(tmp_path):
    v, t = _tables(nv=4, nt=4)
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=2, text_shard=2) as w:
        x = np.arange(2 * F * D, dtype=np.float32).reshape(2, F, D) / 7
        s = w.shards("videos")[1]
        w.write_videos(s, x, np.array([[1, 1, 0], [1, 0, 0]], bool), np.full((2, F), 0.5), [])
        g = zarr.open_group(tmp_path / STORE_NAME, mode="r")
        np.testing.assert_array_equal(g["videos/frames"][2:4], x.astype(np.float16))
        assert g["videos/frame_mask"][3].tolist() == [True, False, False]
        assert [p.index for p in w.pending("videos")] == [0]


def _read_store(tmp_path):
    v, t = _tables(nv=7, nt=10)
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4) as w:
        _fill(w, np.random.default_rng(5))
        w.finalize()
    store = open_store(tmp_path)
    return store, {name: np.asarray(store.array(name)[:]) for name in ("videos/frames", "texts/tokens",
                                                                        "texts/token_mask")}


def test_the_store_reads_rows_in_any_order_one_chunk_at_a_time(tmp_path):
    store, whole = _read_store(tmp_path)
    rows = np.array([6, 0, 4, 4, 2])  # unsorted, a repeat, rows of three chunks
    np.testing.assert_array_equal(store.read("videos/frames", rows), whole["videos/frames"][rows])
    np.testing.assert_array_equal(store.read("texts/tokens", [9, 1], width=2), whole["texts/tokens"][[9, 1], :2])
    assert store.read("texts/token_mask", np.array([], int)).shape == (0, L)
    # the store's chunks are raw bytes: each run of consecutive rows is one read in place, chunk by chunk in row
    # order, and nothing goes through Zarr
    import unittest.mock

    import tvrpipe.features.arrays as arrays

    reads = []
    real = arrays.os.pread
    row_bytes = whole["videos/frames"][0].nbytes

    def counted(fd, n, offset):
        reads.append((n // row_bytes, offset // row_bytes))
        return real(fd, n, offset)

    zarr_reads = unittest.mock.Mock(side_effect=AssertionError("read through Zarr"))
    with unittest.mock.patch.object(arrays.os, "pread", counted), \
            unittest.mock.patch.object(store.array("videos/frames").__class__, "__getitem__", zarr_reads):
        got = store.read("videos/frames", np.array([5, 0, 1, 3, 4]))
    np.testing.assert_array_equal(got, whole["videos/frames"][[5, 0, 1, 3, 4]])
    assert reads == [(2, 0), (3, 0)]  # rows 0-1 of chunk 0, then rows 3-5 (0-2 of chunk 1): one read each


def test_the_store_streams_chunk_aligned_blocks(tmp_path):
    store, whole = _read_store(tmp_path)
    blocks = list(store.blocks("videos/frames"))
    assert [list(r) for r, _ in blocks] == [[0, 1, 2], [3, 4, 5], [6]]  # the shards of 3 videos
    np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), whole["videos/frames"])
    two = list(store.blocks("texts/tokens", rows=np.array([1, 2, 5, 9]), chunks=2))  # blocks of 2 shards (8 rows)
    assert [list(r) for r, _ in two] == [[1, 2, 5], [9]]
    np.testing.assert_array_equal(two[0][1], whole["texts/tokens"][[1, 2, 5]])
    with pytest.raises(ValueError, match="sorted, unique rows"):
        list(store.blocks("videos/frames", rows=np.array([3, 1])))


def test_a_nonfinite_row_is_named_by_its_id_and_shard(tmp_path):
    from tvrpipe.errors import NonFiniteError

    store, _ = _read_store(tmp_path)
    frames = zarr.open_array(tmp_path / STORE_NAME / "videos" / "frames", mode="r+")
    bad = np.array(frames[4])
    bad[1, 2] = np.inf
    frames[4] = bad
    with pytest.raises(NonFiniteError, match=r"videos/frames holds NaN or infinite values in 1 rows \(v4; first: "
                                             r"row 4 in shard videos/1 \(rows 3-5\)\)"):
        store.read("videos/frames", np.array([6, 4, 0]))
    with pytest.raises(NonFiniteError, match=r"\(v4;"):
        list(store.blocks("videos/frames"))
    assert store.read("videos/frames", np.array([4]), check=False)[0, 1, 2] == np.inf
    np.testing.assert_array_equal(store.read("videos/frames", [0, 5]), np.asarray(frames[[0, 5]]))  # others read


def test_resume_reuses_completed_shards(tmp_path):
    v, t = _tables()
    rng = np.random.default_rng(1)
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4) as w:
        _fill(w, rng, only={0})
        with pytest.raises(StoreError, match="not complete yet"):
            w.finalize()
    with pytest.raises(StoreError, match="has not finished.*resume"):
        open_store(tmp_path)
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=99, text_shard=99) as w2:  # chunking: the store's
        assert [s.index for s in w2.pending("videos")] == [1, 2]
        _fill(w2, rng)
        assert list(w2.finalize().video_id) == ["v0"]  # the first run's failure survives the resume


def test_other_provenance_is_refused_unless_overwrite(tmp_path):
    v, t = _tables()
    StoreWriter(tmp_path, v, t, _prov()).close()
    with pytest.raises(StoreError, match=r"other settings \(frames: store has 3, expected 8\).*--overwrite"):
        StoreWriter(tmp_path, v, t, _prov(frames=8))
    with StoreWriter(tmp_path, v, t, _prov(frames=8), overwrite=True) as w:
        assert w.root["videos/frames"].shape == (7, 8, D)


def test_reader_refuses_mismatch_and_missing(tmp_path):
    v, t = _tables()
    with StoreWriter(tmp_path / "s", v, t, _prov()) as w:
        _fill(w, np.random.default_rng(2))
        w.finalize()
    with pytest.raises(StoreError, match=r"model: store has 'm', expected 'ViT-B-32'"):
        open_store(tmp_path / "s", expect={"model": "ViT-B-32"})
    assert open_store(tmp_path / "s", expect={"model": "m", "frames": F}).provenance["model"] == "m"
    with pytest.raises(StoreError, match="no feature store here"):
        open_store(tmp_path / "nothing")


def test_store_records_its_versions_and_a_resume_in_another_environment(tmp_path, monkeypatch):
    """The software that made the rows: ``versions`` when created; a resume that writes rows in another
    environment adds it to ``resumed_with`` (once); reopening the complete store adds nothing."""
    import importlib.metadata

    import torch

    import tvrpipe
    from tvrpipe import environment

    v, t = _tables()
    rng = np.random.default_rng(3)
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4) as w:
        _fill(w, rng, only={0})
    made = zarr.open_group(tmp_path / STORE_NAME, mode="r").attrs.asdict()
    assert made["versions"]["torch"] == torch.__version__ and made["versions"]["tvrpipe"] == tvrpipe.__version__
    assert made["versions"]["zarr"] == importlib.metadata.version("zarr") and "resumed_with" not in made
    first = made["versions"]
    upgraded = {**first, "torch": "9.9.9"}
    monkeypatch.setattr(environment, "versions", lambda: upgraded)
    for _ in range(2):
        with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4):
            pass
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4) as w:
        _fill(w, rng)
        w.finalize()
    prov = open_store(tmp_path).provenance
    assert prov["versions"] == first and prov["resumed_with"] == [upgraded]
    monkeypatch.setattr(environment, "versions", lambda: {**first, "numpy": "0.0"})
    StoreWriter(tmp_path, v, t, _prov()).close()  # complete: no row is written in this environment
    assert open_store(tmp_path).provenance["resumed_with"] == [upgraded]


def test_a_full_disk_while_writing_a_shard_names_its_chunk(tmp_path, monkeypatch):
    """extract's writes (in the driver) name the file the disk refused, and the shard stays pending."""
    import errno

    from tvrpipe.errors import WriteError

    v, t = _tables()
    with StoreWriter(tmp_path, v, t, _prov(), video_shard=3, text_shard=4) as w:
        def full(self, key, value):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(zarr.Array, "__setitem__", full)
        s = w.shards("videos")[1]
        with pytest.raises(WriteError, match=rf"{tmp_path}/features\.zarr/videos/frames/c/1/0/0: cannot write it "
                                             r"\(No space left on device\); make room on the disk"):
            w.write_videos(s, np.zeros((3, F, D)), np.ones((3, F), bool), np.zeros((3, F)), [])
        monkeypatch.undo()
        assert 1 in [p.index for p in w.pending("videos")]


# ------------------------------------------------------------------------------ discovery (train-head without --features)


def _tiny_store(path):
    from tvrpipe.worlds.features import GenSpec, generate_store

    return generate_store(path, GenSpec(train_videos=16, test_videos=4, frames=4, max_words=6, embed_dim=8, seed=0))


def test_train_head_finds_a_store_reached_through_a_symbolic_link(tmp_path, monkeypatch, cli):
    """features/ holds only links: to a store kept elsewhere (found, by its name under features/), a second
    link to the same store (listed once), a link back to features/ (a cycle: not walked forever) and a
    dangling link (no folder)."""
    store = _tiny_store(tmp_path / "scratch" / "msrvtt-tiny")
    features = tmp_path / "features"
    features.mkdir()
    (features / "msrvtt").symlink_to(store, target_is_directory=True)
    (features / "zz-same-store").symlink_to(store, target_is_directory=True)
    (features / "loop").symlink_to(features, target_is_directory=True)
    (features / "gone").symlink_to(tmp_path / "nowhere", target_is_directory=True)
    monkeypatch.setenv("TVRPIPE_FEATURES", str(features))
    from tvrpipe.features.store import default_store, find_stores

    assert find_stores(features) == [features / "msrvtt"]
    r = cli("train-head", "--method", "meanpool", "--out", tmp_path / "run", "--epochs", "0")
    assert r.exit_code == 0, r.output
    assert f"features: {features / 'msrvtt'}" in " ".join(r.output.split())
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())  # trained on it
    # the same store, also at its real path under features/: listed once, by that path
    real = features / "real"
    store.rename(real)
    (features / "msrvtt").unlink()
    (features / "msrvtt").symlink_to(real, target_is_directory=True)
    (features / "zz-same-store").unlink()
    assert find_stores(features) == [real] and default_store() == real


def test_two_stores_behind_links_are_both_named(tmp_path, monkeypatch, cli):
    features = tmp_path / "features"
    features.mkdir()
    for name in ("a", "b"):
        (features / name).symlink_to(_tiny_store(tmp_path / "elsewhere" / name), target_is_directory=True)
    monkeypatch.setenv("TVRPIPE_FEATURES", str(features))
    r = cli("train-head", "--method", "meanpool", "--out", tmp_path / "run")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "2 feature stores under" in text, r.output
    assert f"pass --features with one of {features / 'a'}, {features / 'b'}" in text
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ the row tables' contract


def _split_tables():
    """Seven videos, four train and three test, and ten captions, each in its video's split."""
    v, t = _tables(nv=7, nt=10)
    v["split"] = ["train"] * 4 + ["test"] * 3
    t["split"] = v["split"].to_numpy()[t["video_row"].to_numpy()]
    return v, t


def _reverse_test_rows(v, t):
    test = np.flatnonzero(t["split"].to_numpy() == "test")
    t.loc[test, "video_row"] = t["video_row"].to_numpy()[test[::-1]]


def _set(table, column, rows, value):
    def damage(v, t):
        frame = v if table == "videos" else t
        if not isinstance(value, int):  # text or null: the column holds them as they come
            frame[column] = frame[column].astype(object)
        frame.loc[rows, column] = value
    return damage


DAMAGED_TABLES = {
    # a caption points at another video's row than the one it names: scored against the wrong video
    "rows reversed": (_reverse_test_rows, "texts.parquet",
                      r"row 4 and 1 more \(caption 'c4'\): video_row 6 is video 'v6' in videos.parquet, but the "
                      r"caption's video_id is 'v4'"),
    "row past the end": (_set("texts", "video_row", [2], 99999), "texts.parquet",
                         r"row 2 \(caption 'c2'\): video_row 99999 is not a row of videos.parquet \(0 to 6\)"),
    "negative row": (_set("texts", "video_row", [3], -1), "texts.parquet",
                     r"row 3 \(caption 'c3'\): video_row -1 is not a row of videos.parquet"),
    "row not a number": (_set("texts", "video_row", [3], None), "texts.parquet",
                         r"video_row holds .* values, not row numbers \(integers\)"),
    "unknown split": (_set("videos", "split", [1, 5], "bogus"), "videos.parquet",
                      r"row 1 and 1 more \(video 'v1'\): split 'bogus' is not one of train, val, test"),
    "video id twice": (_set("videos", "video_id", [4], "v0"), "videos.parquet",
                       r"row 4: video_id 'v0' is row 0's too \(video_id is unique\)"),
    "video id null": (_set("videos", "video_id", [3], None), "videos.parquet", r"row 3: no video_id"),
    "caption id twice": (_set("texts", "caption_id", [8, 9], "c1"), "texts.parquet",
                         r"row 8 and 1 more: caption_id 'c1' is row 1's too"),
    "caption id empty": (_set("texts", "caption_id", [0], ""), "texts.parquet", r"row 0: no caption_id"),
    # test captions filed under train: the test split would have videos but no caption
    "caption in another split": (_set("texts", "split", [4, 5, 6], "train"), "texts.parquet",
                                 r"row 4 and 2 more \(caption 'c4'\): split 'train', but its video 'v4' is in "
                                 r"'test' \(a caption's split is its video's\)"),
}


@pytest.mark.parametrize("name", list(DAMAGED_TABLES))
def test_row_tables_that_break_their_contract_are_refused_naming_the_file_and_row(tmp_path, name):
    """Every reader opens a store through open_store, which refuses tables it would read silently wrong; verify
    says so too; the writer refuses such tables before it writes anything."""
    from tvrpipe.features.store import verify_store

    damage, file, message = DAMAGED_TABLES[name]
    v, t = _split_tables()
    with StoreWriter(tmp_path / "s", v, t, _prov()) as w:
        _fill(w, np.random.default_rng(2))
        w.finalize()
    assert len(open_store(tmp_path / "s").texts) == 10
    damage(v, t)
    table = v if file == "videos.parquet" else t
    table.to_parquet(tmp_path / "s" / file)
    with pytest.raises(StoreError, match=rf"^{tmp_path / 's' / file} is damaged: {message}.*; run .* to rewrite it"):
        open_store(tmp_path / "s")
    report = verify_store(tmp_path / "s")
    assert not report.ok and file in report.tables
    with pytest.raises(StoreError, match=rf"the {file} to write breaks the store's contract: {message}"):
        StoreWriter(tmp_path / "new", v, t, _prov())
    assert not (tmp_path / "new").exists()


def test_a_collection_store_and_categorical_splits_keep_the_contract(tmp_path):
    """A collection's videos are all test and it has no captions; a split column read back as categories (Parquet
    dictionary encoding) compares by its values."""
    v, _ = _tables(nv=4, nt=0)
    t = pd.DataFrame({"caption_id": pd.Series([], dtype=str), "video_id": pd.Series([], dtype=str),
                      "video_row": pd.Series([], dtype=np.int64), "split": pd.Series([], dtype=str)})
    with StoreWriter(tmp_path / "c", v, t, _prov()) as w:
        _fill(w, np.random.default_rng(0))
        w.finalize()
    assert len(open_store(tmp_path / "c").videos) == 4
    v, t = _split_tables()
    with StoreWriter(tmp_path / "s", v, t, _prov()) as w:
        _fill(w, np.random.default_rng(2))
        w.finalize()
    v.assign(split=pd.Categorical(v["split"])).to_parquet(tmp_path / "s" / "videos.parquet")
    t.assign(split=pd.Categorical(t["split"], categories=["test", "train", "val"])).to_parquet(
        tmp_path / "s" / "texts.parquet")
    assert len(open_store(tmp_path / "s").texts) == 10
