"""tvrpipe.files: writes that readers see whole or not at all, and what an interrupted one leaves."""

from __future__ import annotations

import numpy as np
import pytest

from tvrpipe.errors import ConfigError, WriteError
from tvrpipe.files import NpyWriter, atomic_replace_folder, atomic_write, atomic_write_all


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


@pytest.mark.parametrize("dtype, tail", [(np.float32, (3, 4)), (np.float16, (5,)), (np.bool_, (2,)), (np.float32, ())])
def test_npy_writer_writes_the_blocks_in_order_as_numpy_reads_them(tmp_path, dtype, tail):
    rng = np.random.default_rng(0)
    want = (rng.standard_normal((11, *tail)) > 0.3 if dtype is np.bool_ else rng.standard_normal((11, *tail))).astype(dtype)
    with NpyWriter(tmp_path / "x.npy", dtype, want.shape) as w:
        for a, b in ((0, 4), (4, 4), (4, 10), (10, 11)):  # an empty block too
            w[a:b] = want[a:b]
    assert len(w) == 11 and w.written == 11
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), want)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert mapped.dtype == want.dtype and mapped.shape == want.shape
    np.testing.assert_array_equal(mapped[3:7], want[3:7])


def test_npy_writer_refuses_rows_out_of_order_a_wrong_shape_and_a_short_file(tmp_path):
    w = NpyWriter(tmp_path / "x.npy", np.float32, (6, 2))
    w[0:2] = np.ones((2, 2))
    with pytest.raises(ValueError, match=r"x.npy: rows are written in order; .* row 2 is next"):
        w[3:5] = np.ones((2, 2))
    with pytest.raises(ValueError, match=r"x.npy: a block of shape \(2, 3\) for rows 2-3 of \(6, 2\)"):
        w[2:4] = np.ones((2, 3))
    with pytest.raises(ValueError, match="x.npy: 4 of 6 rows written"):
        with w:
            w[2:4] = np.ones((2, 2))


def _rss_file_kb() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("RssFile:")), None)
    except OSError:
        return None


def test_npy_writer_leaves_the_written_pages_out_of_resident_memory(tmp_path):
    # the reason it exists: a memory map's written pages would count here until it is unmapped
    if _rss_file_kb() is None:
        pytest.skip("no RssFile in /proc/self/status on this system")
    block = np.ones((256, 8192), np.float32)  # 8 MiB
    before = _rss_file_kb()
    with NpyWriter(tmp_path / "big.npy", np.float32, (256 * 16, 8192)) as w:
        for i in range(16):
            w[i * 256 : (i + 1) * 256] = block
        during = _rss_file_kb()
    assert during - before < 32 * 1024, f"resident file pages grew by {during - before} kB writing 128 MiB"
    assert np.load(tmp_path / "big.npy", mmap_mode="r")[-1, -1] == 1.0
