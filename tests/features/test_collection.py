"""A collection without captions: a folder of videos as a manifest (nested folders, stable ids, files that
do not decode left out), its video-only store, and the incremental update that encodes only new and
changed files and equals a store extracted at once. Generated videos and the tiny CLIP, extracted on this
machine (the local executor)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError, ManifestError
from tvrpipe.features.clip import TINY_MODEL
from tvrpipe.features.collection import Cutting, build_collection
from tvrpipe.features.extract import ExtractConfig, driver, executor, extract
from tvrpipe.features.store import PREVIOUS, StoreError, open_store
from tvrpipe.worlds.videos import synthesize

VIDEO_ARRAYS = ("videos/frames", "videos/frame_mask", "videos/timestamps")
# before: 5 videos; after: b/removed.mp4 gone, b/changed.MP4 rewritten, b/new1.mp4 and d/new2.mov added.
# In id order, with 2 videos a shard, the update's shards are: both rows copied, both encoded, one of each.
BEFORE = {"a/k1.mp4": 0, "a/x/k2.mp4": 1, "b/changed.MP4": 2, "b/removed.mp4": 3, "c/kept3.mp4": 4}
AFTER_NEW = {"b/new1.mp4": 5, "d/new2.mov": 6}
CHANGED_TO = 7  # the synthetic video written over b/changed.MP4


def _cfg(**kw) -> ExtractConfig:
    base = dict(model=TINY_MODEL, pretrained="none", video_shard=2, batch_size=4, decoders=1, progress=False,
                timeout_s=30.0)
    return ExtractConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def synth_videos(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("synth")
    synthesize(d, 8, seed=3, progress=False)
    return sorted((d / "videos").glob("*.mp4"))


def _folder(root: Path, files: dict[str, int], synth: list[Path]) -> Path:
    for name, k in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(synth[k], root / name)
    return root


@pytest.fixture(scope="module")
def collection(synth_videos, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(folder, manifest, store) of the five videos of BEFORE."""
    d = tmp_path_factory.mktemp("coll")
    folder = _folder(d / "videos", BEFORE, synth_videos)
    build_collection(folder, d / "manifest", progress=False)
    s = extract(d / "manifest", folder, d / "store", _cfg())
    assert (s.videos_done, s.reused, s.failed, s.texts_total) == (5, 0, 0, 0)
    return folder, d / "manifest", d / "store"


# ------------------------------------------------------------------------------------- manifest


def test_manifest_of_nested_folders_with_stable_ids(synth_videos, tmp_path, monkeypatch):
    folder = _folder(tmp_path / "v", {**BEFORE, ".hidden/h.mp4": 0, ".h.mp4": 1}, synth_videos)
    b = build_collection(folder, tmp_path / "m", progress=False)
    m = read_manifest(tmp_path / "m")
    assert m.is_collection and (b.probed, b.known, b.undecodable, b.not_videos) == (5, 0, 0, 0)
    assert list(m.videos.video_id) == sorted(BEFORE) == list(m.videos.path)  # relative, posix, with extension
    assert set(m.videos.split) == {"test"} and m.videos[["start_s", "end_s"]].isna().all().all()
    assert len(m.captions) == 0 and list(pd.read_parquet(tmp_path / "m" / "captions.parquet").columns) == [
        "caption_id", "video_id", "text", "split"]
    meta = json.loads((tmp_path / "m" / "meta.json").read_text())
    assert {k: meta[k] for k in ("kind", "dataset", "video_root", "frames", "max_words", "skipped")} == {
        "kind": "collection", "dataset": "collection", "video_root": str(folder.resolve()), "frames": 12,
        "max_words": 32, "skipped": [
            {"path": ".h.mp4", "reason": "hidden (its name starts with a dot)"},
            {"path": ".hidden/", "reason": "a hidden folder (its name starts with a dot): not looked into"}]}
    files = pd.read_parquet(tmp_path / "m" / "files.parquet")
    assert list(files.video_id) == sorted(BEFORE)
    assert files.bytes.dtype == np.int64 and files.mtime_ns.dtype == np.int64
    assert list(files.bytes) == [(folder / p).stat().st_size for p in sorted(BEFORE)]
    assert list(files.mtime_ns) == [(folder / p).stat().st_mtime_ns for p in sorted(BEFORE)]
    before = {n: (tmp_path / "m" / n).read_bytes() for n in ("videos.parquet", "files.parquet", "meta.json")}

    # a rebuild probes nothing that did not change, and writes the same bytes
    monkeypatch.setattr("tvrpipe.features.decode.probe_video", lambda p: pytest.fail(f"probed {p} again"))
    b = build_collection(folder, tmp_path / "m", progress=False)
    assert (b.probed, b.known) == (0, 5)
    assert {n: (tmp_path / "m" / n).read_bytes() for n in before} == before
    assert not [p.name for p in (tmp_path / "m").iterdir() if ".tmp-" in p.name]


def test_what_is_not_a_decodable_video_is_skipped_and_listed(synth_videos, tmp_path):
    folder = _folder(tmp_path / "v", {"a/ok.mp4": 0, "ok2.webm": 1}, synth_videos)  # content decides, not the name
    (folder / "notes.txt").write_text("my videos")
    (folder / "a" / "broken.mp4").write_bytes(synth_videos[2].read_bytes()[:300])  # a header, cut
    (folder / "a" / "empty.MOV").write_bytes(b"")
    b = build_collection(folder, tmp_path / "m", progress=False)
    assert list(b.manifest.videos.video_id) == ["a/ok.mp4", "ok2.webm"]
    assert (b.undecodable, b.not_videos) == (2, 1)
    skipped = {s["path"]: s["reason"] for s in read_manifest(tmp_path / "m").meta["skipped"]}
    assert skipped.keys() == {"a/broken.mp4", "a/empty.MOV", "notes.txt"}
    assert skipped["a/broken.mp4"].startswith("unreadable: ") and skipped["a/empty.MOV"].startswith("empty: ")
    assert skipped["notes.txt"] == "not a video file (.txt)"
    # a skipped video is not probed again while it is unchanged; fixed, it joins the collection
    assert build_collection(folder, tmp_path / "m", progress=False).probed == 0
    shutil.copyfile(synth_videos[2], folder / "a" / "broken.mp4")
    b = build_collection(folder, tmp_path / "m", progress=False)
    assert b.probed == 1 and "a/broken.mp4" in set(b.manifest.videos.video_id)


def test_a_folder_without_a_decodable_video_is_one_line_and_writes_nothing(synth_videos, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".DS_Store").write_text("x")
    with pytest.raises(ManifestError, match=r"^no video file \(\.3gp, .*\.mp4.*\) under .*empty: it holds no file"):
        build_collection(empty, tmp_path / "m", progress=False)
    (empty / "notes.txt").write_text("x")
    (empty / "b.csv").write_text("x")
    with pytest.raises(ManifestError, match=r"empty: it holds 2 files, e\.g\. b\.csv, notes\.txt$"):
        build_collection(empty, tmp_path / "m", progress=False)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.mp4").write_bytes(b"not a video at all" * 20)
    (bad / "b.mp4").write_bytes(b"")
    with pytest.raises(ManifestError, match=r"^none of the 2 video files under .*bad decodes: a\.mp4 \(unreadable: "
                                            r".*\), b\.mp4 \(empty: the file has zero bytes\)$"):
        build_collection(bad, tmp_path / "m", progress=False)
    with pytest.raises(ManifestError, match="not a directory"):
        build_collection(tmp_path / "nope", tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def _deep_file(folder: Path, data: bytes) -> str:
    """A video file nested so deep that its absolute path is over PATH_MAX (made through folder
    descriptors: no path that long can be opened by name); returns its relative path."""
    part = "d" * 250
    depth = 4096 // (len(part) + 1) + 1  # over 4096 bytes below the folder alone
    fd = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir(part, dir_fd=fd)
            fd, up = os.open(part, os.O_RDONLY, dir_fd=fd), fd
            os.close(up)
        f = os.open("deep.mp4", os.O_WRONLY | os.O_CREAT, dir_fd=fd)
        os.write(f, data)
        os.close(f)
        os.symlink("..", "up", dir_fd=fd)  # a link back up: not followed, not listed
    finally:
        os.close(fd)
    return "/".join([part] * depth + ["deep.mp4"])


def test_every_file_is_in_the_manifest_or_skipped_with_its_reason(synth_videos, tmp_path, cli, monkeypatch):
    """Odd files are listed in meta.json's skipped, one reason each, and the folder is still built: a broken
    link, a loop of links, a FIFO, a name that is not UTF-8, a path over PATH_MAX, a path Windows reads as
    another drive. A ':' in a name is an ordinary file, read even from a relative --videos (FFmpeg would take
    `a:` for a protocol). Hidden files are listed too, a hidden folder as one entry."""
    folder = _folder(tmp_path / "v", {"a:b.mp4": 0, "sub/ok.mp4": 1, "C:/x.mp4": 2, ".h.mp4": 3}, synth_videos)
    (folder / ".git").mkdir()
    (folder / "notes.txt").write_text("my videos")
    (folder / "dangling.mp4").symlink_to(folder / "nowhere.mp4")
    (folder / "loop.mp4").symlink_to("loop.mp4")
    os.mkfifo(folder / "pipe.mp4")
    fd = os.open(os.fsencode(folder) + b"/caf\xe9.mp4", os.O_WRONLY | os.O_CREAT)  # Latin-1 bytes
    os.write(fd, synth_videos[4].read_bytes())
    os.close(fd)
    deep = _deep_file(folder, synth_videos[5].read_bytes())
    out = tmp_path / "m"
    monkeypatch.chdir(folder)

    r = cli("manifest", "build", "--videos", ".", "--out", out)
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert (f"collection of 2 videos, no captions -> {out} (2 files probed, 0 unchanged since the last build) "
            "skipped 9 files (0 video files that do not decode, 1 not videos, 6 that cannot be opened as named, 2 "
            f"hidden files and folders (names starting with a dot)); the reasons are in {out}/meta.json, e.g. "
            "C:/x.mp4: ") in text
    assert list(pd.read_parquet(out / "videos.parquet").video_id) == ["a:b.mp4", "sub/ok.mp4"]
    skipped = {s["path"]: s["reason"] for s in json.loads((out / "meta.json").read_text())["skipped"]}
    length = len(os.fsencode(folder)) + 1 + len(deep)
    assert skipped == {
        ".git/": "a hidden folder (its name starts with a dot): not looked into",
        ".h.mp4": "hidden (its name starts with a dot)",
        "C:/x.mp4": "its path reads as leaving the folder on Windows (a backslash, or a drive such as 'C:/'), "
                    "which a manifest refuses: rename it to include it",
        "caf\\xe9.mp4": "its name is not UTF-8 text (a legacy encoding such as Latin-1?): rename it in UTF-8 to "
                         "include it",
        "dangling.mp4": "broken link: what it points to does not exist",
        "loop.mp4": "broken link: a loop of links",
        "notes.txt": "not a video file (.txt)",
        "pipe.mp4": "not a regular file (a FIFO)",
        deep: f"path too long: {length} bytes from /, over the system's limit of 4095 (PATH_MAX), so no program "
              "can open it by name; move it to a shallower folder or shorten its names to include it",
    }
    # a rebuild probes nothing and says the same
    before = (out / "meta.json").read_bytes()
    r = cli("manifest", "build", "--videos", ".", "--out", out)
    assert r.exit_code == 0 and "(0 files probed, 2 unchanged since the last build)" in " ".join(r.output.split())
    assert (out / "meta.json").read_bytes() == before


def test_a_folder_of_only_unusable_videos_names_them(tmp_path, cli):
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / "dangling.mp4").symlink_to(folder / "nowhere.mp4")
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m")
    assert r.exit_code == 1 and (f"no video file (.3gp, .avi, .flv, .m4v, .mkv, .mov, .mp4, .mpeg, .mpg, .webm, "
                                 f".wmv) under {folder}: it holds 1 files, e.g. dangling.mp4 (broken link: what it "
                                 "points to does not exist)") in " ".join(r.output.split()), r.output
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------------------------- extract


def test_a_collection_gives_a_video_only_store(collection, same_rows):
    folder, manifest, store_dir = collection
    store = open_store(store_dir)
    prov = store.provenance
    assert prov["kind"] == "collection" and prov["dataset"] == "collection" and prov["seed"] == 0
    assert prov["video_root"] == str(folder.resolve()) and (prov["n_videos"], prov["n_texts"]) == (5, 0)
    assert store.array("texts/tokens").shape == (0, 32, prov["embed_dim"]) and len(store.texts) == 0
    assert store.array("videos/frame_mask")[:].any(axis=1).all()
    files = read_manifest(manifest).files
    assert list(store.videos.columns) == ["video_id", "split", "path", "start_s", "end_s", "bytes", "mtime_ns"]
    pd.testing.assert_frame_equal(store.videos[["video_id", "bytes", "mtime_ns"]], files, check_dtype=False)


def test_adding_changing_and_removing_files_encodes_only_what_changed(collection, synth_videos, tmp_path,
                                                                      same_rows, monkeypatch):
    """The key promise: after the folder changes, manifest build + extract into the same --out copies the
    unchanged videos bit for bit, encodes the new and the changed ones, drops the removed one, and gives
    the store that an extraction of the final folder at once gives. An update interrupted after the old
    store was moved aside is resumed from it."""
    folder, manifest, store_dir = tmp_path / "videos", tmp_path / "manifest", tmp_path / "store"
    src_folder, _, src_store = collection
    shutil.copytree(src_folder, folder)  # copy2: sizes and modification times kept
    shutil.copytree(src_store, store_dir, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    old = open_store(store_dir)
    old_rows = {v: i for i, v in enumerate(old.videos.video_id)}
    old_frames = old.array("videos/frames")[:]

    (folder / "b" / "removed.mp4").unlink()
    _folder(folder, AFTER_NEW, synth_videos)
    changed = folder / "b" / "changed.MP4"
    shutil.copyfile(synth_videos[CHANGED_TO], changed)  # another video under the same name
    st = changed.stat()
    os.utime(changed, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    build_collection(folder, manifest, progress=False)

    # interrupted right after the old store was moved aside: the rerun takes its rows from there
    monkeypatch.setattr(driver, "write_copied", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        extract(manifest, folder, store_dir, _cfg())
    assert (store_dir / PREVIOUS / "features.zarr").is_dir()
    monkeypatch.undo()

    s = extract(manifest, folder, store_dir, _cfg())
    assert (s.reused, s.videos_done, s.videos_skipped, s.failed, s.videos_total) == (3, 3, 0, 0, 6), s.lines()
    assert "3 extracted, 3 reused" in s.lines()[0]
    assert not (store_dir / PREVIOUS).exists() and not list(store_dir.glob(".previous*"))
    new = open_store(store_dir)
    assert new.provenance["manifest_sha256"] != old.provenance["manifest_sha256"]
    ids = list(new.videos.video_id)
    assert ids == sorted({*BEFORE, *AFTER_NEW} - {"b/removed.mp4"})
    frames = new.array("videos/frames")[:]
    for v in ("a/k1.mp4", "a/x/k2.mp4", "c/kept3.mp4"):  # copied bit for bit
        np.testing.assert_array_equal(frames[ids.index(v)], old_frames[old_rows[v]])

    at_once = tmp_path / "at-once"
    build_collection(folder, at_once / "manifest", progress=False)
    s = extract(at_once / "manifest", folder, at_once / "store", _cfg())
    assert (s.videos_done, s.reused) == (6, 0)
    ref = open_store(at_once / "store")
    assert ref.provenance["manifest_sha256"] == new.provenance["manifest_sha256"]
    pd.testing.assert_frame_equal(new.videos, ref.videos)
    for name in VIDEO_ARRAYS:
        same_rows(new, ref, name)
    # the changed file's features are its new content's: they differ from what the store held before
    row = ids.index("b/changed.MP4")
    assert not np.allclose(frames[row].astype(np.float32), old_frames[old_rows["b/changed.MP4"]].astype(np.float32),
                           atol=1e-2)


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_an_interrupted_move_is_finished_and_copies_start_no_worker(collection, tmp_path, monkeypatch):
    """The store's files were being moved aside (into the staging folder) when the process died: the next
    update finishes the move and copies every row from there; with nothing to encode, no worker starts."""
    _, manifest, src_store = collection
    out = tmp_path / "store"
    shutil.copytree(src_store, out, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    (out / ".previous.tmp").mkdir()
    for name in ("features.zarr", "videos.parquet"):  # the rest is still in out
        (out / name).rename(out / ".previous.tmp" / name)
    monkeypatch.setattr(driver, "start_executor", lambda *a, **kw: pytest.fail("workers started"))
    s = extract(manifest, collection[0], out, _cfg())
    assert (s.reused, s.videos_done, s.videos_skipped) == (5, 0, 0)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src_store.iterdir())
    a, b = open_store(out), open_store(src_store)
    for name in VIDEO_ARRAYS:
        np.testing.assert_array_equal(a.array(name)[:], b.array(name)[:])
    pd.testing.assert_frame_equal(a.videos, b.videos)


def test_an_update_in_another_precision_is_refused_before_anything_moves(collection, tmp_path):
    src_folder, _, src_store = collection
    folder, out = tmp_path / "videos", tmp_path / "store"
    shutil.copytree(src_folder, folder)
    shutil.copytree(src_store, out, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    (folder / "b" / "removed.mp4").unlink()
    build_collection(folder, tmp_path / "manifest", progress=False)
    with pytest.raises(StoreError, match=r"computed in fp32, and an update reuses them only in the same precision.*"
                                         r"rerun with --precision fp32, or pass --overwrite"):
        extract(tmp_path / "manifest", folder, out, _cfg(precision="bf16"))
    assert not list(out.glob(".previous*")) and open_store(out).provenance["n_videos"] == 5


def test_a_folder_changed_since_its_manifest_is_refused_before_any_worker(collection, tmp_path, monkeypatch, caplog):
    """A file changed or removed since the manifest was built: one line naming them and the rebuild, and no
    Ray. A file added since: a warning, and the store is left as it is."""
    src_folder, manifest, store_dir = collection
    folder, out = tmp_path / "videos", tmp_path / "store"
    shutil.copytree(src_folder, folder)
    shutil.copytree(store_dir, out, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    monkeypatch.setattr(driver, "start_executor", lambda *a, **kw: pytest.fail("workers started"))
    shutil.copyfile(folder / "a" / "k1.mp4", folder / "extra.mp4")
    with caplog.at_level(logging.WARNING, logger="tvrpipe.features.collection"):
        s = extract(manifest, folder, out, _cfg())  # complete: nothing to do
    assert (s.videos_done, s.videos_skipped) == (0, 5)
    assert "1 video file(s) under" in caplog.text and "extra.mp4" in caplog.text
    assert f"tvrpipe manifest build --videos {folder} --out {manifest}" in caplog.text

    (folder / "b" / "removed.mp4").unlink()
    with (folder / "a" / "k1.mp4").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ConfigError, match=rf"^2 of 5 video files of the collection in {manifest} changed or were "
                                          rf"removed under {folder} since its manifest was built \(changed 1: "
                                          r"a/k1\.mp4; gone 1: b/removed\.mp4\); rebuild it with `tvrpipe manifest "
                                          rf"build --videos {folder} --out {manifest}`"):
        extract(manifest, folder, out, _cfg())


def test_train_head_refuses_a_store_without_captions(collection, tmp_path, cli):
    _, _, store_dir = collection
    r = cli("train-head", "--features", store_dir, "--method", "meanpool", "--out", tmp_path / "run")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "has no captions" in text, r.output
    assert f'search this store with it: `tvrpipe search "..." --run RUN --features {store_dir}`' in text
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------- search


def test_search_of_a_collection_and_a_changed_file_refused(collection, tmp_path, cli):
    """Zero-shot search ranks every video of the collection, names its files, and draws their thumbnails from
    the folder the store records; once a file changes under it, search refuses (nothing served stale)."""
    import zarr

    folder, manifest, store_dir = collection
    r = cli("search", "a red circle", "a red circle", "--features", store_dir, "--top-k", 5, "--json",
            tmp_path / "h.json", "--html", tmp_path / "h.html")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "(all 5 searchable videos scored by the head)" in out and "1 repeated query searched once" in out
    hits = json.loads((tmp_path / "h.json").read_text())
    assert sorted(h["path"] for h in hits) == sorted(BEFORE) and [h["rank"] for h in hits] == [1, 2, 3, 4, 5]
    assert all(h["video_id"] == h["path"] and h["start_s"] is None for h in hits)
    assert (tmp_path / "h.html").read_text().count('src="data:image/jpeg;base64,') == 5 * 4

    copy, moved = tmp_path / "videos", tmp_path / "store"
    shutil.copytree(folder, copy)
    shutil.copytree(store_dir, moved, ignore=shutil.ignore_patterns(".tvrpipe.lock", "search-index"))
    for path in BEFORE:  # the copy's files keep the originals' times: the store describes them
        os.utime(copy / path, ns=(os.stat(folder / path).st_atime_ns, os.stat(folder / path).st_mtime_ns))
    zarr.open_group(str(moved / "features.zarr"), mode="a").attrs["video_root"] = str(copy)
    r = cli("search", "a red circle", "--features", moved)
    assert r.exit_code == 0, r.output
    with (copy / "c" / "kept3.mp4").open("ab") as f:
        f.write(b"\0")
    r = cli("search", "a red circle", "--features", moved)
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "1 videos of the collection in --features" in text and "changed 1: c/kept3.mp4" in text
    # the commands as they run: the manifest folder and CLIP the store records
    assert (f"`tvrpipe manifest build --videos {copy} --out {manifest.resolve()}` and `tvrpipe extract --manifest "
            f"{manifest.resolve()} --video-root {copy} --out {moved} --model tvrpipe-tiny --pretrained none --frames 12 "
            "--max-words 32 --video-shard 2`") in text
    # --video-root: where the files are now, checked there (the originals are as extracted; the copy is not)
    r = cli("search", "a red circle", "--features", moved, "--video-root", folder)
    assert r.exit_code == 0, r.output
    zarr.open_group(str(moved / "features.zarr"), mode="a").attrs["video_root"] = str(tmp_path / "gone")
    r = cli("search", "a red circle", "--features", moved, "--video-root", copy)
    assert r.exit_code == 1 and "changed 1: c/kept3.mp4" in " ".join(r.output.split()), r.output
    r = cli("search", "a red circle", "--features", moved, "--video-root", tmp_path / "nowhere")
    assert r.exit_code == 1 and f"--video-root {tmp_path / 'nowhere'} is not a folder" in " ".join(r.output.split())


# ------------------------------------------------------------------------------- the weights' facts


def _removed_one(collection, tmp_path) -> tuple[Path, Path, Path]:
    """(folder, manifest, store): a copy of the collection's store, and the folder less b/removed.mp4, whose
    update copies every row (nothing to encode)."""
    src_folder, _, src_store = collection
    folder, out = tmp_path / "videos", tmp_path / "store"
    shutil.copytree(src_folder, folder)
    shutil.copytree(src_store, out, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    (folder / "b" / "removed.mp4").unlink()
    build_collection(folder, tmp_path / "manifest", progress=False)
    return folder, tmp_path / "manifest", out


def _cache_entry(tmp_path, monkeypatch, **edits) -> Path:
    """A cache of this test's own holding the tiny CLIP's true facts, with ``edits``; its entry's path."""
    from tvrpipe.features.clip import load_clip, weights_facts
    from tvrpipe.features.weights import remember_facts, weights_key

    monkeypatch.setenv("TVRPIPE_CACHE", str(tmp_path / "cache"))
    key = weights_key(TINY_MODEL, "none", 0)
    remember_facts(key, {**weights_facts(load_clip(TINY_MODEL, "none", seed=0)), **edits})
    return tmp_path / "cache" / "weights" / f"{key}.json"


def test_an_update_that_only_copies_takes_no_fact_from_an_edited_cache(collection, tmp_path, monkeypatch):
    """A cache entry edited to another logit scale: the new store records the store it replaces' (the true
    weights'), and the entry is rewritten with the true facts."""
    folder, manifest, out = _removed_one(collection, tmp_path)
    true_scale = open_store(out).provenance["logit_scale"]
    entry = _cache_entry(tmp_path, monkeypatch, logit_scale=true_scale + 1.5)
    monkeypatch.setattr(driver, "start_executor", lambda *a, **kw: pytest.fail("workers started"))
    s = extract(manifest, folder, out, _cfg())
    assert (s.reused, s.videos_done) == (4, 0)
    assert open_store(out).provenance["logit_scale"] == true_scale
    assert json.loads(entry.read_text())["logit_scale"] == true_scale


def test_a_cache_entry_of_other_weights_does_not_advise_overwrite(collection, tmp_path, monkeypatch, caplog):
    """A cached sha256 that disagrees with the store: the weights are loaded to decide, and they are the
    store's; the update runs (no --overwrite advice, which would delete a good store)."""
    folder, manifest, out = _removed_one(collection, tmp_path)
    want = open_store(out).provenance["weights_sha256"]
    _cache_entry(tmp_path, monkeypatch, weights_sha256="0" * 64)
    with caplog.at_level(logging.WARNING):
        s = extract(manifest, folder, out, _cfg())
    assert (s.reused, s.videos_done) == (4, 0)
    new = open_store(out).provenance
    assert new["weights_sha256"] == want and new["n_videos"] == 4
    assert "--overwrite" not in caplog.text


@pytest.mark.parametrize("damage", ["folder", "garbage", "wrong types", "missing", "other key"])
def test_an_unusable_cache_entry_is_one_warning_and_a_load(collection, tmp_path, monkeypatch, caplog, damage):
    _, manifest, src_store = collection
    out = tmp_path / "store"
    shutil.copytree(src_store, out, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    entry = _cache_entry(tmp_path, monkeypatch)
    good = json.loads(entry.read_text())
    if damage == "folder":
        entry.unlink()
        entry.mkdir()
    elif damage == "garbage":
        entry.write_text("{not json")
    elif damage == "wrong types":
        entry.write_text(json.dumps({**good, "embed_dim": "64", "logit_scale": float("nan")}))
    elif damage == "missing":
        entry.write_text(json.dumps({k: v for k, v in good.items() if k != "preprocessing"}))
    else:  # an entry copied under another name
        entry.write_text(json.dumps({**good, "key": "ab" * 32}))
    monkeypatch.setattr(driver, "start_executor", lambda *a, **kw: pytest.fail("workers started"))
    with caplog.at_level(logging.WARNING, logger="tvrpipe.features.weights"):
        s = extract(manifest, collection[0], out, _cfg())  # complete: nothing to do but learn the facts
    assert (s.videos_done, s.videos_skipped) == (0, 5)
    read = [r.getMessage() for r in caplog.records if "ignored, the weights are loaded instead" in r.getMessage()]
    assert len(read) == 1 and str(entry) in read[0], caplog.text
    if damage == "folder":  # it cannot be replaced either: a warning, never a failed run
        assert entry.is_dir() and "weights facts not cached in" in caplog.text
    else:
        assert json.loads(entry.read_text()) == good


# ------------------------------------------------------------------------------- --pretrained


def test_a_relative_checkpoint_is_recorded_by_its_absolute_path(collection, tmp_path, monkeypatch):
    """A store records the checkpoint it was made from by a path that reaches it from any folder."""
    from safetensors.torch import save_file

    from tvrpipe.features.clip import load_clip

    folder, manifest, _ = collection
    (tmp_path / "ckpt").mkdir()
    state = {k: v.contiguous() for k, v in load_clip(TINY_MODEL, "none", seed=4).model.state_dict().items()}
    save_file(state, str(tmp_path / "ckpt" / "clip.safetensors"))
    monkeypatch.chdir(tmp_path)
    extract(manifest, folder, "store", _cfg(pretrained="ckpt/clip.safetensors"))
    prov = open_store(tmp_path / "store").provenance
    assert prov["pretrained"] == str((tmp_path / "ckpt" / "clip.safetensors").resolve())
    assert prov["weights_sha256"] == load_clip(TINY_MODEL, "ckpt/clip.safetensors").weights_sha256
    # a store made when the path was recorded as given resumes: the sha256 names the weights
    import zarr

    zarr.open_group(tmp_path / "store" / "features.zarr", mode="a").attrs["pretrained"] = "ckpt/clip.safetensors"
    s = extract(manifest, folder, "store", _cfg(pretrained="ckpt/clip.safetensors"))
    assert (s.videos_done, s.videos_skipped) == (0, 5)


def test_weights_that_cannot_be_downloaded_fail_in_seconds_before_a_model_loads(collection, tmp_path, monkeypatch):
    """ViT-B-32 openai, in no local cache, and a host that refuses: one line naming the model, the tag, the
    host and --pretrained with a file, before any model loads (and before the store is created)."""
    import time

    import huggingface_hub.constants as hf

    from tvrpipe.errors import DownloadError

    folder, manifest, _ = collection
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # open_clip's own cache: ~/.cache/clip
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(hf, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    for name in ("https_proxy", "HTTPS_PROXY", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    encoders = []
    monkeypatch.setattr(executor, "ClipEncoder", lambda *a: encoders.append(a))
    t0 = time.perf_counter()
    with pytest.raises(DownloadError, match=r"^--pretrained openai: the weights of ViT-B-32 openai are not in this "
                                            r"machine's open_clip or Hugging Face cache and cannot be downloaded "
                                            r"from 127\.0\.0\.1 \(no connection within 5 s: .*\); on a machine "
                                            r"without network, download them elsewhere and pass the file: "
                                            r"--pretrained /path/to/file\.safetensors \(or \.pt\)$"):
        extract(manifest, folder, tmp_path / "store", _cfg(model="ViT-B-32", pretrained="openai"))
    assert time.perf_counter() - t0 < 30 and not encoders
    assert not (tmp_path / "store" / "features.zarr").exists()


# --- moments: a collection's files cut into fixed windows -------------------------------------------------------

def _long_video(path: Path, seconds: float, fps: int = 8, seed: int = 0) -> Path:
    """An H.264 file of ``seconds`` (a whole number of frames at ``fps``) whose frames all differ."""
    from tvrpipe.worlds.videos import write_mp4

    n = int(round(seconds * fps))
    rng = np.random.default_rng(seed)
    frames = np.repeat(rng.integers(0, 255, (n, 1, 1, 3), dtype=np.uint8), 32, axis=1).repeat(32, axis=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_mp4(path, frames, fps)
    return path


@pytest.mark.parametrize("duration, window, stride, want", [
    (23.0, 10, 5, [(0, 10), (5, 15), (10, 20), (15, 23)]),
    (23.0, 10, None, [(0, 10), (10, 20), (20, 23)]),  # stride = window
    (20.2, 10, 10, [(0, 10), (10, 20.2)]),  # a tail under TAIL_S goes to the window before it
    (20.6, 10, 10, [(0, 10), (10, 20), (20, 20.6)]),
    (4.2, 10, 5, [(0, 4.2)]),  # shorter than a window: one moment
    (10.0, 10, 5, [(0, 10)]),
    (7.0, 2.5, 2.5, [(0, 2.5), (2.5, 5), (5, 7)]),
])
def test_fixed_windows_and_their_last_moment(duration, window, stride, want):
    from tvrpipe.features.collection import Cutting

    assert Cutting(window, stride).bounds(duration) == [(float(a), float(b)) for a, b in want]


@pytest.mark.parametrize("window, stride, message", [
    ("10s", "11s", "--stride 11s is longer than --window 10s: the gaps between windows would be parts of the videos"),
    ("0", None, "--window 0: a window must last a positive number of seconds"),
    ("10s", "-5", "--stride -5: a stride must be a positive number of seconds"),
    ("ten", None, "--window 'ten': give a duration such as 10s, 2.5m or 1h"),
    ("10s", "5x", "--stride '5x': give a duration such as 10s"),
    (None, "5s", "--stride needs --window"),
    ("whole", "5s", "--stride with --window whole"),
])
def test_a_bad_window_or_stride_names_the_option(window, stride, message):
    from tvrpipe.features.collection import cutting_of

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cutting_of(window, stride)


# Each message of the cutting options names the option the user typed, never one a default came from (a stride
# taken from the window is not blamed for the window).
_FLOOR = "a moment this short may hold no frame of a video (two frames of a video of 2 frames a second are 0.5s " \
         "apart), and extract would fail it; give at least 0.5s"


@pytest.mark.parametrize("args, message", [
    (["--window", "0.0001"], f"--window 0.0001s: {_FLOOR}"),
    (["--window", "1e999"], "--window '1e999': give a duration such as 10s, 2.5m or 1h"),  # an infinity parses
    (["--window", "0.1"], f"--window 0.1s: {_FLOOR}"),
    (["--window", "0.499"], f"--window 0.499s: {_FLOOR}"),
    (["--window", "0.2", "--stride", "0.1"], f"--window 0.2s: {_FLOOR}"),
    (["--window", "10s", "--stride", "0.1"], "--stride 0.1s: moments would start less than 0.5s apart, closer than two "
                                             "frames of a video of 2 frames a second, so that neighbours could hold the "
                                             "same frames; give at least 0.5s"),
    (["--window", "10s", "--stride", "0.0001"], "--stride 0.0001s: moments would start less than 0.5s apart"),
    (["--window", "0"], "--window 0: a window must last a positive number of seconds"),
    (["--window", "-1m"], "--window -60: a window must last a positive number of seconds"),
    (["--window", "nan"], "--window 'nan': give a duration such as 10s"),
    (["--window", "10", "--stride", "0"], "--stride 0: a stride must be a positive number of seconds"),
    (["--window", "10", "--stride", "20"], "--stride 20s is longer than --window 10s"),
    (["--window", "abc"], "--window 'abc': give a duration such as 10s, 2.5m or 1h"),
    (["--window", "10", "--stride", "x"], "--stride 'x': give a duration such as 10s"),
    (["--stride", "0.1"], "--stride needs --window: give the window length too"),
    (["--stride", "5s"], "--stride needs --window: give the window length too"),
    (["--window", "whole", "--stride", "5"], "--stride with --window whole: whole files are not cut"),
    (["--window", "whole", "--shots"], "--shots with --window whole: whole files are not cut into shots"),
    (["--window", "whole", "--shot-threshold", "20"], "--shot-threshold with --window whole: whole files are not cut"),
    (["--shot-threshold", "20"], "--shot-threshold needs --shots: it is the shot detector's threshold"),
    (["--window", "10s", "--shot-threshold", "20"], "--shot-threshold needs --shots"),
    (["--shots", "--window", "0.2"], f"--window 0.2s: with --shots, a shot longer than it is cut into windows of it, "
                                     f"and {_FLOOR}"),
    (["--shots", "--window", "0"], "--window 0: a window must last a positive number of seconds"),
    (["--shots", "--stride", "5"], "--stride with --shots: shots are cut where the picture changes"),
    (["--shots", "--shot-threshold", "nan"], "--shot-threshold nan: the detector's threshold is a mean change"),
])
def test_each_cutting_message_names_the_option_typed_in_one_line_before_anything_is_written(tmp_path, cli, args,
                                                                                           message):
    (tmp_path / "v").mkdir()
    r = cli("manifest", "build", "--videos", tmp_path / "v", "--out", tmp_path / "m", *args)
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and f"error: {message}" in text, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    typed = {a for a in args if a.startswith("--")}
    blamed = text.removeprefix("error: ").split()[0]
    assert blamed in typed, (blamed, typed)
    assert not (tmp_path / "m").exists()


# --- no moment without a frame ------------------------------------------------------------------------------


def _check_cut(bounds: list[tuple[float, float]], duration: float, window: float, stride: float | None) -> None:
    """The rules of a cutting, checked on its output: the moments cover the file from 0 to its end without a gap;
    each starts ``stride`` after the one before (to the millisecond); none is shorter than the floor unless it is
    the whole file; none is longer than the window plus the tail."""
    from tvrpipe.features.collection import MIN_MOMENT_S, TAIL_S

    end = round(duration, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == end
    ms = [(round(a * 1000), round(b * 1000)) for a, b in bounds]
    for (a, b), (c, d) in zip(ms, ms[1:]):
        assert c <= b and c > a, bounds  # no gap, in order
        if stride is not None:
            assert abs((c - a) - stride * 1000) <= 1, bounds
    for a, b in ms:
        assert b - a >= round(min(MIN_MOMENT_S, window) * 1000) or (a, b) == (0, round(end * 1000)), bounds
        assert b - a <= round((window + TAIL_S) * 1000) + 1 or len(bounds) == 1, bounds


def test_no_moment_a_cutting_makes_is_shorter_than_the_floor():
    """Windows, strides and durations over a grid and at random (to the millisecond): every moment spans at least
    MIN_MOMENT_S (the tail rule included) unless it is the whole file, and the moments cover the file."""
    from tvrpipe.features.collection import MIN_MOMENT_S, TAIL_S, Cutting

    assert TAIL_S == MIN_MOMENT_S == 0.5
    rng = np.random.default_rng(0)
    cases = [(d, w, s) for d in (0.001, 0.3, 0.5, 0.8, 1.0, 1.001, 2.0, 7.3, 20.2, 20.499, 20.5, 20.501, 61.0)
             for w in (0.5, 0.501, 0.7, 1.0, 2.5, 10.0) for s in (0.5, 0.6, w)]
    for _ in range(2000):
        w = round(float(rng.uniform(0.5, 12)), 3)
        cases.append((round(float(rng.uniform(0.001, 80)), 3), w, round(float(rng.uniform(0.5, w)), 3)))
    for duration, window, stride in cases:
        if stride > window:
            continue
        _check_cut(Cutting(window, stride).bounds(duration), duration, window, stride)


def test_a_shot_cut_by_the_window_cap_leaves_no_piece_under_the_floor():
    from tvrpipe.features.collection import MIN_MOMENT_S, Cutting

    rng = np.random.default_rng(1)
    for _ in range(500):
        duration = round(float(rng.uniform(1, 120)), 3)
        cuts = sorted(round(float(c), 3) for c in rng.uniform(0, duration, rng.integers(0, 8)))
        window = round(float(rng.uniform(0.5, 15)), 3)
        bounds = Cutting(window, shots=True).shot_bounds(cuts, duration)
        edges = [0.0, *sorted({c for c in cuts if 0 < c < duration}), duration]
        assert bounds[0][0] == 0 and bounds[-1][1] == round(duration, 3)
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:])), bounds  # end to end
        for a, b in bounds:
            shot = next((lo, hi) for lo, hi in zip(edges, edges[1:]) if lo <= a < hi)
            # a piece is the whole shot, or at least the floor long (the cap's tail rule)
            assert (a, b) == shot or round((b - a) * 1000) >= MIN_MOMENT_S * 1000, (a, b, shot, window)
            assert round((b - a) * 1000) <= round((window + MIN_MOMENT_S) * 1000) + 1 or (a, b) == shot


@pytest.mark.parametrize("fps, seconds, window, stride", [
    (8, 23.0, 0.5, 0.5),
    (8, 7.0, 0.5, None),
    (2, 9.5, 0.5, 0.5),  # a frame every 0.5 s: the floor holds exactly one each
    (2, 12.0, 0.7, 0.6),
    (25, 4.0, 0.5, 0.5),
])
def test_every_moment_at_the_floor_holds_frames_when_decoded(tmp_path, fps, seconds, window, stride):
    """A 0.1 s window of an 8 fps file held no frame in one moment of five (extract failed them as no_frames):
    such a window is refused now, and every moment of the shortest windows and strides allowed decodes, at 2 fps
    (one frame every floor) and above."""
    from tvrpipe.features.collection import Cutting
    from tvrpipe.features.decode import DecodedVideo, DecodeWorker, probe_duration

    path = _long_video(tmp_path / "v.mp4", seconds, fps=fps)
    cutting = Cutting(window, stride)
    bounds = cutting.bounds(probe_duration(path))
    with DecodeWorker(30) as w:
        got = w.decode_moments(path, 4, 64, bounds)
    failed = [(b, g.detail) for b, g in zip(bounds, got) if not isinstance(g, DecodedVideo)]
    assert not failed, failed
    assert all(bool(g.mask.any()) for g in got)


def test_a_too_short_window_is_refused_before_the_folder_is_read(tmp_path, cli, monkeypatch):
    _long_video(tmp_path / "v" / "a.mp4", 2.0)
    monkeypatch.setattr("tvrpipe.features.decode.probe_video", lambda p: pytest.fail(f"probed {p}"))
    r = cli("manifest", "build", "--videos", tmp_path / "v", "--out", tmp_path / "m", "--window", "0.1")
    assert r.exit_code == 1 and "--window 0.1s: a moment this short may hold no frame" in " ".join(r.output.split())
    assert not (tmp_path / "m").exists()


def test_cutting_of_parses_units():
    from tvrpipe.features.collection import Cutting, cutting_of

    assert cutting_of("1.5m", "30") == Cutting(90.0, 30.0)
    assert cutting_of("10s", None) == Cutting(10.0, 10.0)
    assert cutting_of(None, None) is None and cutting_of("whole", None) == Cutting()


def test_manifest_of_moments_rows_ids_and_a_rebuild_without_probing(synth_videos, tmp_path, monkeypatch, cli):
    folder = tmp_path / "v"
    _long_video(folder / "trips" / "long.mp4", 23.0)  # 184 frames at 8 fps: ends at 23 s
    _long_video(folder / "short.mp4", 4.0, seed=1)  # shorter than a window
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--window", "10s", "--stride", "5s")
    assert r.exit_code == 0, r.output
    assert "collection of 5 moments of 2 videos (10s windows every 5s), no captions" in " ".join(r.output.split())
    m = read_manifest(tmp_path / "m")
    assert list(m.videos.video_id) == ["short.mp4#t=0,4", "trips/long.mp4#t=0,10", "trips/long.mp4#t=10,20",
                                       "trips/long.mp4#t=15,23", "trips/long.mp4#t=5,15"]  # sorted by id
    v = m.videos.set_index("video_id")
    assert v.loc["trips/long.mp4#t=15,23", ["path", "start_s", "end_s"]].tolist() == ["trips/long.mp4", 15.0, 23.0]
    assert v.loc["short.mp4#t=0,4", ["path", "start_s", "end_s"]].tolist() == ["short.mp4", 0.0, 4.0]
    files = m.files.set_index("video_id")
    size = (folder / "trips/long.mp4").stat().st_size
    assert (files.loc[[i for i in v.index if i.startswith("trips/")], "bytes"] == size).all()
    assert m.meta["moments"] == {"window_s": 10.0, "stride_s": 5.0}
    before = {n: (tmp_path / "m" / n).read_bytes() for n in ("videos.parquet", "files.parquet", "meta.json")}

    # a rebuild without --window keeps the recorded cutting and probes nothing unchanged (not even a duration)
    monkeypatch.setattr("tvrpipe.features.decode.probe_video", lambda p: pytest.fail(f"probed {p} again"))
    monkeypatch.setattr("tvrpipe.features.decode.probe_duration", lambda p: pytest.fail(f"timed {p} again"))
    b = build_collection(folder, tmp_path / "m", progress=False)
    assert (b.probed, b.known) == (0, 2)
    assert {n: (tmp_path / "m" / n).read_bytes() for n in before} == before

    # another cutting of unchanged files takes their durations from the last build; whole files drop the bounds
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--window", "20s")
    assert r.exit_code == 0, r.output
    assert list(read_manifest(tmp_path / "m").videos.video_id) == [
        "short.mp4#t=0,4", "trips/long.mp4#t=0,20", "trips/long.mp4#t=20,23"]
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--window", "whole")
    m = read_manifest(tmp_path / "m")
    assert list(m.videos.video_id) == ["short.mp4", "trips/long.mp4"] and "moments" not in m.meta
    assert m.videos[["start_s", "end_s"]].isna().all().all()


# --- the recorded cutting: a damaged record is an error, not whole files -------------------------------------

_NAME_IT = ("build the manifest again naming the cutting: --window DURATION (with --stride), --shots, or --window "
            "whole for one row per file (every file is then probed again)")


@pytest.mark.parametrize("record, why", [
    (5, "it is a number, not an object"),
    ("10s", "it is a string, not an object"),
    (None, "it is null, not an object"),
    ([10, 5], "it is a list, not an object"),
    ({"window_s": "abc", "stride_s": 5.0}, 'window_s is "abc", not a number'),
    ({"window_s": 10.0}, "stride_s is missing"),
    ({"stride_s": 5.0}, "window_s is missing"),
    ({"window_s": 10.0, "stride_s": True}, "stride_s is true, not a number"),
    ({"window_s": None, "stride_s": 5.0}, "window_s is null, not a number"),
    # the record's keys, not options the user did not type this time
    ({"window_s": 10.0, "stride_s": 20.0}, "stride_s 20s is longer than window_s 10s"),
    ({"window_s": 0.1, "stride_s": 0.1}, "window_s 0.1s: a moment this short may hold no frame"),
    ({"window_s": -1, "stride_s": 5.0}, "window_s -1: a window must last a positive number of seconds"),
    ({"shots": "yes", "threshold": 27.0, "window_s": None}, 'shots is "yes", not true'),
    ({"shots": False, "threshold": 27.0, "window_s": None}, "shots is false, not true"),
    ({"shots": True, "window_s": None}, "threshold is missing"),
    ({"shots": True, "threshold": "27", "window_s": None}, 'threshold is "27", not a number'),
    ({"shots": True, "threshold": 27.0, "window_s": "10s"}, 'window_s is "10s", not a number'),
    ({"shots": True, "threshold": 500.0, "window_s": None}, "threshold 500: the detector's threshold"),
])
def test_a_damaged_moments_record_is_an_error_naming_the_file(record, why):
    from tvrpipe.features.collection import Cutting

    with pytest.raises(ManifestError) as e:
        Cutting.recorded({"kind": "collection", "moments": record}, "m/meta.json")
    text = str(e.value)
    assert text.startswith(f"m/meta.json: its moments record {json.dumps(record)} is damaged (") and why in text, text
    assert text.endswith(f"so the last build's cutting is unknown; {_NAME_IT}"), text


def test_a_recorded_cutting_is_read_back_and_no_record_is_whole_files():
    from tvrpipe.features.collection import Cutting

    for cutting in (Cutting(10.0, 5.0), Cutting(2.5), Cutting(shots=True), Cutting(30.0, shots=True, threshold=20.0)):
        assert Cutting.recorded({"moments": cutting.record()}, "meta.json") == cutting
    assert Cutting.recorded({"kind": "collection"}, "meta.json") == Cutting()
    assert Cutting.recorded({"moments": {"window_s": 10, "stride_s": 5}}, "meta.json") == Cutting(10.0, 5.0)


def _built(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    folder = tmp_path / "v"
    _long_video(folder / "a.mp4", 23.0)
    _long_video(folder / "b.mp4", 4.0, seed=1)
    build_collection(folder, tmp_path / "m", progress=False, cutting=Cutting(10.0, 5.0))
    return folder, tmp_path / "m", {n: (tmp_path / "m" / n).read_bytes() for n in ("videos.parquet", "files.parquet")}


@pytest.mark.parametrize("damage, message", [
    (lambda meta: {**meta, "moments": {"window_s": "abc", "stride_s": 5.0}},
     'its moments record {"window_s": "abc", "stride_s": 5.0} is damaged (window_s is "abc", not a number)'),
    (lambda meta: {**meta, "moments": 5}, "its moments record 5 is damaged (it is a number, not an object)"),
    (lambda meta: "{" + json.dumps(meta)[:40], "not valid JSON (Expecting"),
    (lambda meta: "", "not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    (lambda meta: [meta], "it holds a list, not a JSON object"),
    (lambda meta: b"\xff{}", "line 1: not UTF-8 text"),
    # read as another folder's or kind's manifest, these silently dropped the recorded cutting
    (lambda meta: {**meta, "video_root": 5}, "video_root is 5, not a folder's path or null"),
    (lambda meta: {**meta, "kind": "zzz"}, 'kind is "zzz", not "collection"'),
])
def test_a_rebuild_over_a_damaged_meta_json_is_refused_naming_it_and_writes_nothing(tmp_path, cli, damage, message):
    """A rebuild that keeps the last build's cutting cannot know it from a damaged meta.json: it stops, naming the
    file, what is wrong and what to do, where it used to cut whole files and an update then reused them."""
    folder, out, before = _built(tmp_path)
    meta_path = out / "meta.json"
    damaged = damage(json.loads(meta_path.read_text()))
    if isinstance(damaged, bytes):
        meta_path.write_bytes(damaged)
    else:
        meta_path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    written = meta_path.read_bytes()
    r = cli("manifest", "build", "--videos", folder, "--out", out)
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and text.startswith(f"error: {meta_path}") and message in text, r.output
    assert _NAME_IT in text and len(r.output.strip().splitlines()) == 1, r.output
    assert meta_path.read_bytes() == written
    assert {n: (out / n).read_bytes() for n in before} == before


def test_a_named_cutting_sets_a_damaged_meta_json_aside_and_probes_every_file(tmp_path, caplog):
    folder, out, _ = _built(tmp_path)
    (out / "meta.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="tvrpipe.features.collection"):
        b = build_collection(folder, out, progress=False, cutting=Cutting(20.0))
    assert (b.probed, b.known) == (2, 0) and b.cutting == Cutting(20.0)
    assert f"{out / 'meta.json'} is damaged and set aside: the cutting given is used and every file is probed " \
           "again" in caplog.text
    m = read_manifest(out)
    assert m.meta["moments"] == {"window_s": 20.0, "stride_s": 20.0}
    assert list(m.videos.video_id) == ["a.mp4#t=0,20", "a.mp4#t=20,23", "b.mp4#t=0,4"]


def test_damaged_tables_keep_the_recorded_cutting_and_damaged_probe_notes_are_probed_again(tmp_path):
    """What the last build probed is a saving only: a damaged files.parquet or skipped list is probed again, while
    the cutting still comes from meta.json."""
    folder, out, _ = _built(tmp_path)
    (out / "files.parquet").write_bytes(b"PAR1 cut short")
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "skipped": 5, "one_shot": "x"}))
    b = build_collection(folder, out, progress=False)
    assert (b.probed, b.known) == (2, 0) and b.cutting == Cutting(10.0, 5.0)
    assert read_manifest(out).meta["moments"] == {"window_s": 10.0, "stride_s": 5.0}
    (out / "meta.json").write_text(json.dumps({**json.loads((out / "meta.json").read_text()),
                                               "skipped": [{"path": "x.mp4", "bytes": "abc", "mtime_ns": 1,
                                                            "reason": "r"}]}))
    b = build_collection(folder, out, progress=False)
    assert (b.probed, b.known) == (0, 2)


def test_window_without_videos_is_refused(tmp_path, cli):
    r = cli("manifest", "build", "--dataset", "custom", "--annotations", tmp_path / "a.csv", "--out", tmp_path / "m",
            "--window", "10s")
    assert r.exit_code == 1
    assert "--window cuts the files of a collection into moments: give it with --videos" in " ".join(r.output.split())


def test_moments_decode_together_as_each_alone(tmp_path):
    """One open of a file for all its moments gives each moment exactly the frames of decoding it alone."""
    from tvrpipe.features.collection import Cutting
    from tvrpipe.features.decode import DecodeFailure, DecodeWorker

    path = _long_video(tmp_path / "long.mp4", 23.0)
    bounds = [*Cutting(10.0, 5.0).bounds(23.0), (3.3, 3.4), (30.0, 40.0)]  # one without a frame, one past the end
    with DecodeWorker(30) as w:
        together = w.decode_moments(path, 12, 160, bounds)
        for (start, end), got in zip(bounds, together):
            try:
                alone = w.decode(path, 12, 160, start, end)
            except DecodeFailure as e:
                assert isinstance(got, DecodeFailure) and (got.kind, got.detail) == (e.kind, e.detail)
                continue
            assert got.reader == alone.reader == "decord"
            np.testing.assert_array_equal(got.frames, alone.frames)
            np.testing.assert_array_equal(got.mask, alone.mask)
            np.testing.assert_array_equal(got.timestamps, alone.timestamps)
    assert [int(v.mask.sum()) for v in together[:4]] == [12, 12, 12, 12]
    assert [round(float(v.timestamps[0]), 3) for v in together[:4]] == [0.375, 5.375, 10.375, 15.25]
    assert isinstance(together[5], DecodeFailure) and together[5].kind == "no_frames"


def test_a_collection_of_moments_is_extracted_and_updated_file_by_file(tmp_path, same_rows, monkeypatch):
    """A file's moments are decoded in one call (the store equals one whose moments are decoded one by one),
    and an update re-encodes only the moments of a changed file, copying the others'."""
    from tvrpipe.features.extract import pipeline

    folder = tmp_path / "v"
    _long_video(folder / "a.mp4", 12.0, seed=1)
    _long_video(folder / "b.mp4", 7.0, seed=2)
    build_collection(folder, tmp_path / "m", progress=False, cutting=__import__(
        "tvrpipe.features.collection", fromlist=["Cutting"]).Cutting(4.0, 2.0))
    calls = []
    real = executor.LocalExecutor.decode  # the pipeline's calls, and those sent while the weights load
    monkeypatch.setattr(executor.LocalExecutor, "decode",
                        lambda self, k, g, *a: calls.append(len(g)) or real(self, k, g, *a))
    s = extract(tmp_path / "m", folder, tmp_path / "s", _cfg(frames=4))
    assert (s.videos_done, s.failed) == (8, 0), s.lines()
    assert sorted(calls) == [3, 5]  # b: 0-4 2-6 4-7; a: 0-4 ... 8-12, one decoder call each
    got = open_store(tmp_path / "s")
    assert list(got.videos.video_id) == ["a.mp4#t=0,4", "a.mp4#t=2,6", "a.mp4#t=4,8", "a.mp4#t=6,10", "a.mp4#t=8,12",
                                         "b.mp4#t=0,4", "b.mp4#t=2,6", "b.mp4#t=4,7"]

    monkeypatch.setattr(pipeline, "decode_groups", lambda items, by_file: [[i] for i in items])
    s = extract(tmp_path / "m", folder, tmp_path / "alone", _cfg(frames=4))
    alone = open_store(tmp_path / "alone")
    for name in VIDEO_ARRAYS:
        same_rows(got, alone, name)
    monkeypatch.undo()

    # b.mp4 changes: its moments are cut again and encoded; a.mp4's are copied
    old_frames = got.array("videos/frames")[:]
    _long_video(folder / "b.mp4", 5.0, seed=3)
    build_collection(folder, tmp_path / "m", progress=False)  # keeps the recorded 4s/2s cutting
    s = extract(tmp_path / "m", folder, tmp_path / "s", _cfg(frames=4))
    assert (s.reused, s.videos_done, s.failed) == (5, 2, 0), s.lines()
    new = open_store(tmp_path / "s")
    assert list(new.videos.video_id)[5:] == ["b.mp4#t=0,4", "b.mp4#t=2,5"]
    np.testing.assert_array_equal(new.array("videos/frames")[:5], old_frames[:5])

    # search returns moments: a file, its bounds; --per-video keeps the best N moments of each file, and the k kept
    # are the k best under that limit (the full ranking with a file's extra moments skipped)
    from tvrpipe.search.engine import open_searcher, search

    searcher = open_searcher(tmp_path / "s", video_root=folder)
    full = search(searcher, ["a grey square"], k=7).hits
    assert sorted((h.path, h.start_s, h.end_s) for h in full) == sorted(
        (p, float(a), float(b)) for p, a, b in [("a.mp4", 0, 4), ("a.mp4", 2, 6), ("a.mp4", 4, 8), ("a.mp4", 6, 10),
                                                 ("a.mp4", 8, 12), ("b.mp4", 0, 4), ("b.mp4", 2, 5)])
    for n, k in ((1, 2), (2, 3), (3, 7)):
        want, per = [], {}
        for h in full:
            if per.get(h.path, 0) < n and len(want) < k:
                per[h.path] = per.get(h.path, 0) + 1
                want.append(h.video_id)
        got = search(searcher, ["a grey square"], k=k, per_video=n).hits
        assert [h.video_id for h in got] == want and [h.rank for h in got] == list(range(1, len(want) + 1))
    assert len(search(searcher, ["a grey square"], k=3, per_video=1).hits) == 2  # two files: two hits at most
    with pytest.raises(ConfigError, match="--per-video 0: keep at least 1 hit of a file"):
        search(searcher, ["a grey square"], k=3, per_video=0)
