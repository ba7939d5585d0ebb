"""Every bench sizes its plan and refuses one that does not fit the disk or the memory, in one line, before it
makes anything."""

from __future__ import annotations

import pytest

from tvrpipe.bench import room
from tvrpipe.bench.room import Needs, check_room, still_to_write, stores_needs
from tvrpipe.errors import ConfigError
from tvrpipe.worlds.features import GenSpec, generate_store

FREE = 10 * 2**30  # the disk each test pretends to have


@pytest.fixture
def small_disk(monkeypatch):
    monkeypatch.setattr(room, "free_disk", lambda path: FREE)


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("spec", [
    GenSpec(train_videos=300, test_videos=50, frames=6, max_words=8, embed_dim=32),
    GenSpec(train_videos=120, val_videos=30, test_videos=40, captions_per_train_video=3, captions_per_test_video=2,
            frames=12, max_words=16, embed_dim=64, scenes=2),
])
def test_a_stores_estimate_covers_what_it_writes_and_not_much_more(spec, tmp_path):
    generate_store(tmp_path / "s", spec)
    written = room.folder_bytes(tmp_path / "s")
    assert written <= spec.store_bytes() <= 1.5 * written + 2**20, (written, spec.store_bytes())
    # a store already there is not written again; a missing one is written whole
    assert still_to_write([(tmp_path / "s", spec.store_bytes())]) == spec.store_bytes() - written
    assert still_to_write([(tmp_path / "none", 123)]) == 123


def test_check_room_refuses_disk_and_memory_naming_the_options(small_disk, monkeypatch, tmp_path):
    check_room("bench x", tmp_path / "out", Needs(disk=FREE - 2 * 2**30, memory=2**20), "--videos")
    with pytest.raises(ConfigError, match=r"bench x: its plan writes 10.74 GB \(2 stores\) and the disk of .* has "
                                          r"10.74 GB free; lower --videos, or give an --out on a larger disk"):
        check_room("bench x", tmp_path / "out", Needs(disk=FREE, disk_what="2 stores"), "--videos")
    monkeypatch.setattr("tvrpipe.training.stream.memory_limit", lambda: (4 * 10**9, "cgroup limit (/sys/x)"))
    with pytest.raises(ConfigError, match=r"bench x: its plan holds 5.00 GB in memory \(the budget\) and this process "
                                          r"may use 4.00 GB \(the cgroup limit \(/sys/x\)\); lower --budget"):
        check_room("bench x", None, Needs(memory=5 * 10**9, memory_what="the budget"), "--budget")
    assert not (tmp_path / "out").exists()


def test_parts_of_a_plan_add_their_disk_and_take_the_larger_memory():
    a, b = Needs(10, 5, "videos", "decoding"), Needs(3, 7, "a store", "training")
    assert a + b == Needs(13, 7, "videos and a store", "training")
    specs = {"x": GenSpec(train_videos=10), "y": GenSpec(train_videos=1000)}
    n = stores_needs(specs)
    assert n.disk == sum(s.store_bytes() for s in specs.values()) and n.memory == specs["y"].memory_bytes()


@pytest.mark.parametrize("args, said", [
    (["train-head", "--streamed", "--memory-budget", "1TB"], "bench train-head --streamed: its plan writes"),
    (["search", "--videos", "100000000", "--method", "xpool"], "bench search: its plan writes"),
    (["serve", "--videos", "100000000", "--method", "xpool"], "bench serve: its plan writes"),
    (["worlds", "--train-videos", "50000000"], "bench worlds: its plan writes"),
    (["extract", "--videos", "100000", "--seconds", "600"], "bench extract: its plan writes"),
    (["extract", "--long-video", "100000000"], "bench extract --long-video: its plan writes"),
    (["finetune", "--steps", "100000"], "bench finetune: its plan writes"),
    (["eval", "--dim", "100000"], "bench eval: its plan holds"),
    (["allocator", "--batch-size", "100000"], "bench allocator: its plan holds"),
    (["train-head", "--batch-size", "100000000"], "bench train-head: its plan holds"),
    (["extract", "--batch-size", "1000", "--videos", "2000", "--width", "64", "--height", "64", "--seconds", "1"],
     "bench extract: its plan holds"),
    (["finetune", "--frames", "100000000"], "bench finetune: its plan holds"),
    (["finetune", "--loader-workers", "100000"], "--loader-workers 100000: at most 4 x"),
    (["train-head", "--streamed", "--memory-budget", "1KB"], "--memory-budget 1.0 kB: a streamed run's shuffle"),
    (["convergence", "--lr", "-1"], "--lr must be > 0"),
    (["serve", "--candidates", "100000000000", "--method", "xpool"], "--candidates 100000000000: between 1 and"),
])
def test_every_bench_refuses_a_plan_too_large_before_making_anything(cli, small_disk, tmp_path, args, said):
    out = tmp_path / "out"
    with_out = args if args[0] in ("eval", "allocator") else [*args, "--out", out]
    r = cli("bench", *with_out)
    assert r.exit_code == 1 and _flat(r.output).startswith(f"error: {said}"), r.output
    assert len(r.output.strip().splitlines()) <= 3 and "Traceback" not in r.output  # one line, wrapped at most
    assert not out.exists()


def test_an_out_that_cannot_be_made_says_so_not_that_its_disk_is_full(cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = cli("bench", "search", "--out", blocker / "b")
    assert r.exit_code == 1 and f"{blocker} is a file" in _flat(r.output) and "free" not in r.output, r.output


def test_a_plan_that_fits_runs(cli, tmp_path):
    """The check lets an ordinary plan through, and counts a store already made as written."""
    r = cli("bench", "worlds", "--out", tmp_path / "w", "--world", "onescene", "--method", "meanpool",
            "--train-videos", "40", "--dim", "16", "--max-epochs", "1")
    assert r.exit_code == 0, r.output
    store = tmp_path / "w" / "stores" / "onescene"
    assert room.folder_bytes(store) > 0
    from tvrpipe.bench.worlds import world_spec
    assert stores_needs({store: world_spec("onescene", 40, 16)}).disk == 0


def test_bench_search_counts_the_heads_encodings_in_its_plan(cli, small_disk, tmp_path, monkeypatch):
    """--encoded-videos adds each head's encodings (their size from an untrained head: prota's 53.4 kB a video at
    F = 12, D = 512) to the plan: a collection that fits without them is refused with them, naming the option."""
    from tvrpipe.bench.search import collection_spec, encodings_bytes

    assert encodings_bytes(["prota"], 512, 12) == 53_368
    videos = 300_000  # its stores and index fit in FREE, prota's encodings (16 GB) do not
    assert collection_spec(videos, 512).store_bytes() < FREE < videos * 53_368
    out = tmp_path / "out"

    def generate(*args, **kwargs):  # a plan let through would start here: fail at once, not after gigabytes
        raise AssertionError("the plan was let through")

    monkeypatch.setattr("tvrpipe.bench.search.generate_store", generate)
    r = cli("bench", "search", "--out", out, "--videos", str(videos), "--method", "prota", "--encoded-videos")
    said = _flat(r.output)
    assert r.exit_code == 1 and "the heads' encodings of the videos (--encoded-videos)" in said, r.output
    assert "or leave out --encoded-videos" in said and not out.exists()
