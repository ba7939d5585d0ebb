"""tvrpipe.files: writes that readers see whole or not at all, and what an interrupted one leaves."""

from __future__ import annotations

import pytest

from tvrpipe.errors import ConfigError, WriteError
from tvrpipe.files import atomic_replace_folder, atomic_write, atomic_write_all


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_atomic_write_makes_a_file_or_a_folder_and_leaves_nothing_when_it_fails(tmp_path):
    atomic_write(tmp_path / "a" / "x.txt", lambda tmp: tmp.write_text("new"), parents=True)
    assert (tmp_path / "a" / "x.txt").read_text() == "new" and _names(tmp_path / "a") == ["x.txt"]

    def folder(tmp):
        tmp.mkdir()
        (tmp / "e.npy").write_text("1")

    atomic_write(tmp_path / "a" / "emb", folder)
    assert _names(tmp_path / "a" / "emb") == ["e.npy"]

    def half(tmp):
        tmp.mkdir()
        (tmp / "part").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteError, match=r"x\.txt: cannot write it \(.*No space left"):
        atomic_write(tmp_path / "a" / "x.txt", lambda tmp: half(tmp))
    assert (tmp_path / "a" / "x.txt").read_text() == "new" and _names(tmp_path / "a") == ["emb", "x.txt"]

    def refused(tmp):
        raise ConfigError("--out: not that")

    with pytest.raises(ConfigError, match="not that"):  # tvrpipe's own errors pass through as they are
        atomic_write(tmp_path / "a" / "y.txt", refused)


def test_atomic_write_all_renames_only_when_every_file_is_written(tmp_path):
    (tmp_path / "videos.parquet").write_text("old videos")

    def boom(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteError, match="meta.json"):
        atomic_write_all(tmp_path, [("videos.parquet", lambda t: t.write_text("new videos")), ("meta.json", boom)])
    assert _names(tmp_path) == ["videos.parquet"] and (tmp_path / "videos.parquet").read_text() == "old videos"
    atomic_write_all(tmp_path, [("videos.parquet", lambda t: t.write_text("new videos")),
                                ("meta.json", lambda t: t.write_text("{}"))])
    assert _names(tmp_path) == ["meta.json", "videos.parquet"]
    assert (tmp_path / "videos.parquet").read_text() == "new videos"


def test_atomic_replace_folder_swaps_a_whole_folder(tmp_path):
    cache = tmp_path / "search-index"

    def fill(text):
        def write(tmp):
            tmp.mkdir()
            (tmp / "index.json").write_text(text)
        return write

    atomic_replace_folder(cache, fill("first"))
    (cache / "stale.bin").write_text("of the first build")
    atomic_replace_folder(cache, fill("second"))
    assert _names(cache) == ["index.json"] and (cache / "index.json").read_text() == "second"
    assert _names(tmp_path) == ["search-index"]  # neither the staged nor the old folder is left

    def fails(tmp):
        tmp.mkdir()
        raise OSError(30, "Read-only file system")

    with pytest.raises(WriteError, match="search-index"):
        atomic_replace_folder(cache, fails)
    assert (cache / "index.json").read_text() == "second" and _names(tmp_path) == ["search-index"]
