"""bench worlds' worlds: its own two at any size, the fixed-size ones (synth's presets, bench search's benchmark),
generator fields set on top, and the paper's start alone."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from tvrpipe.bench.search import bench_search, benchmark_spec, collection_spec
from tvrpipe.bench.worlds import bench_worlds, world_spec
from tvrpipe.errors import ConfigError
from tvrpipe.features.store import open_store
from tvrpipe.worlds.features import CALIBRATED, ONE_SCENE, PRESETS


def test_world_specs_are_the_worlds_they_name():
    own = world_spec("multiscene", 80, 32, seed=3)
    assert (own.train_videos, own.val_videos, own.test_videos, own.embed_dim, own.seed) == (80, 20, 1000, 32, 3)
    assert all(getattr(own, k) == v for k, v in CALIBRATED.items())
    assert all(getattr(world_spec("onescene", 80, 32), k) == v for k, v in ONE_SCENE.items())
    # the sized worlds keep their sizes whatever --train-videos and --dim say; the seed is bench worlds'
    for name in ("small", "medium", "msrvtt9k"):
        assert world_spec(name, 80, 32, seed=5) == replace(PRESETS[name], seed=5)
    default = {k: p.default for k, p in inspect.signature(bench_search).parameters.items()}
    search = world_spec("search", 80, 32, seed=2)
    assert search == benchmark_spec(collection_spec(1000, default["dim"], seed=2), default["train_videos"])
    assert (search.train_videos, search.embed_dim) == (2000, 512)


def test_fields_are_set_on_top_and_checked_as_set():
    spec = world_spec("small", 80, 32, fields={"multi_scene": 0.1, "caption_shift": 0.0})
    assert (spec.multi_scene, spec.caption_shift, spec.train_videos) == (0.1, 0.0, 500)
    with pytest.raises(ConfigError, match=r"--set multi_scene must be in \[0, 1\], got 1.5"):
        world_spec("multiscene", 80, 32, fields={"multi_scene": 1.5})
    with pytest.raises(ConfigError, match="--world 'tiny' is not one of: onescene, multiscene, small, medium"):
        world_spec("tiny", 80, 32)


def test_bench_worlds_trains_the_papers_start_alone_on_a_world_with_fields(tmp_path):
    rows = bench_worlds(tmp_path / "w", ["onescene"], ["xpool"], train_videos=40, dim=16, max_epochs=1, patience=1,
                        progress=False, fields={"caption_shift": 40.0}, zero_shot_start=False)
    assert [(r.method, r.zero_shot_start) for r in rows] == [("xpool", False)]
    store = open_store(tmp_path / "w" / "stores" / "onescene")
    assert store.provenance["generator"]["caption_shift"] == 40.0
    assert not (tmp_path / "w" / "runs" / "onescene" / "xpool-zero-shot-start").exists()


def test_bench_worlds_cli_sets_fields_and_leaves_out_the_zero_shot_start(cli, tmp_path):
    out = tmp_path / "w"
    r = cli("bench", "worlds", "--out", out, "--world", "onescene", "--method", "xpool", "--train-videos", 40,
            "--dim", 16, "--max-epochs", 1, "--patience", 1, "--set", "caption_shift=0", "--set", "noise=0.5",
            "--no-zero-shot-start")
    assert r.exit_code == 0, r.output
    generator = open_store(out / "stores" / "onescene").provenance["generator"]
    assert (generator["caption_shift"], generator["noise"]) == (0.0, 0.5)
    assert [p.name for p in (out / "runs" / "onescene").iterdir()] and \
        not (out / "runs" / "onescene" / "xpool-zero-shot-start").exists()
    for args, said in ((("--set", "multi_scene=2"), "--set multi_scene must be in [0, 1], got 2"),
                       (("--set", "colour=red"), "colour"),
                       (("--world", "huge"), "--world 'huge' is not one of")):
        r = cli("bench", "worlds", "--out", tmp_path / "x", *args)
        assert r.exit_code == 1 and said in " ".join(r.output.split()), r.output
        assert not (tmp_path / "x" / "runs").exists()


def test_full_schedule_is_train_heads_own_and_kept_apart(tmp_path, cli):
    from tvrpipe.rundir import read_metrics
    from tvrpipe.training.settings import TrainConfig

    rows = bench_worlds(tmp_path / "w", ["onescene"], ["xpool"], train_videos=40, dim=16, progress=False,
                        zero_shot_start=False, full_schedule=True)
    assert [(r.method, r.full_schedule) for r in rows] == [("xpool", True)]
    m = read_metrics(tmp_path / "w" / "runs" / "onescene" / "xpool-full")
    # an epoch is a pass over the 40 train videos, one step at batch 128: train-head validates every
    # ceil(300 / 8) = 38 epochs, where the shortened schedule validates every epoch
    assert m["schedule"]["validate_every_epochs"] == -(-TrainConfig().min_steps // TrainConfig().patience) == 38
    assert not (tmp_path / "w" / "runs" / "onescene" / "xpool").exists()
    assert "| onescene | xpool | paper's | train-head's |" in (tmp_path / "w" / "worlds.md").read_text()
    r = cli("bench", "worlds", "--out", tmp_path / "x", "--full-schedule", "--patience", 2)
    assert r.exit_code == 1 and "--full-schedule trains with train-head's own" in " ".join(r.output.split())
    assert not (tmp_path / "x").exists()
