"""What a run records is what it did: learning rates per parameter group, CLIP initialisation, the recipe and
how the run differs from it, the published row the report shows beside it, and a dry run that refuses what the
run refuses. Each through the CLI, on generated data and the tiny CLIP."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from test_recipes import TINY_TMASS, changed, write_recipe

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _base_lrs(run: Path) -> list[float]:
    groups = torch.load(run / "checkpoints" / "state.pt", weights_only=False)["optimizer"]["param_groups"]
    return sorted({g["base_lr"] for g in groups})


def _finetune(synth: Path, out: Path, *args) -> list:
    return ["finetune", "--manifest", synth / "manifest", "--video-root", synth / "videos", "--out", out,
            "--model", "tvrpipe-tiny", "--pretrained", "none", "--loader-workers", "0", *args]


# ------------------------------------------------------------------------------ learning rates


def test_train_head_records_the_rate_each_group_trained_at(store, tmp_path, cli):
    """--group-lr head=... covers every parameter of xpool: no parameter trains at the default lr, so the
    run neither records nor prints it as the rate it trained at."""
    from tvrpipe.heads.base import head_class

    out = tmp_path / "run"
    result = cli("train-head", "--method", "xpool", "--features", store, "--out", out, "--epochs", "1",
                 "--group-lr", "head=3e-5", "--no-prefetch")
    assert result.exit_code == 0, result.output
    default = head_class("xpool").lr_for(32)
    assert default != 3e-5
    text = " ".join(result.output.split())
    assert "(lr 3e-05 (--group-lr))" in text and f"{default:g}" not in text
    for record in (_config(out)["resolved"], _metrics(out)["schedule"]):
        assert record["lr"] is None and "every parameter group trains at a rate of its own" in record["lr_source"]
        assert record["lr_groups"] == {"head": {"lr": 3e-5, "source": "--group-lr"}}
    assert _base_lrs(out) == [3e-5]
    with open(out / "epochs.csv") as f:
        row = next(csv.DictReader(f))
    assert "lr" not in row and 0 < float(row["lr_head"]) <= 3e-5  # the rate the optimiser stepped at last


def test_train_head_names_each_groups_rate_and_source(store, tmp_path, cli):
    out = tmp_path / "run"
    result = cli("train-head", "--method", "tmass", "--features", store, "--out", out, "--epochs", "1",
                 "--lr", "1e-3", "--group-lr", "radius=1e-2", "--no-prefetch")
    assert result.exit_code == 0, result.output
    assert "lr head 0.001 (--lr), radius 0.01 (--group-lr)" in " ".join(result.output.split())
    resolved = _config(out)["resolved"]
    assert (resolved["lr"], resolved["lr_source"]) == (1e-3, "--lr")
    assert resolved["lr_groups"] == {"head": {"lr": 1e-3, "source": "--lr"}, "radius": {"lr": 1e-2, "source": "--group-lr"}}
    with open(out / "epochs.csv") as f:
        row = next(csv.DictReader(f))
    assert float(row["lr_radius"]) == pytest.approx(10 * float(row["lr_head"]))


def test_finetune_records_each_groups_rate_from_the_optimiser(synth, tmp_path, cli):
    """A frozen CLIP trains at no rate: no clip group is recorded, and an epoch's rates are the optimiser's."""
    out = tmp_path / "run"
    result = cli(*_finetune(synth, out, "--method", "tmass", "--epochs", "1", "--batch-size", "4",
                            "--epoch-pairs", "videos", "--head-lr", "1e-4",
                            "--group-lr", "head=2e-4", "--group-lr", "radius=4e-4"))
    assert result.exit_code == 0, result.output
    expected = {"head": {"lr": 2e-4, "source": "--group-lr"}, "radius": {"lr": 4e-4, "source": "--group-lr"}}
    assert _config(out)["resolved"]["lr_groups"] == expected and _metrics(out)["schedule"]["lr_groups"] == expected
    assert _base_lrs(out) == [2e-4, 4e-4]  # nothing at --head-lr 1e-4, nothing for CLIP
    with open(out / "epochs.csv") as f:
        row = next(csv.DictReader(f))
    assert "lr_clip" not in row and float(row["lr_radius"]) == pytest.approx(2 * float(row["lr_head"]))
    assert "lr head 0.0002 (--group-lr), radius 0.0004 (--group-lr)" in " ".join(result.output.split())


def test_a_group_lr_given_twice_is_refused(store, tmp_path, cli):
    result = cli("train-head", "--method", "tmass", "--features", store, "--out", tmp_path / "r", "--epochs", "1",
                 "--group-lr", "radius=1e-3", "--group-lr", "radius=1e-2")
    assert result.exit_code == 1
    assert "--group-lr radius is given twice (radius=0.001 and radius=1e-2); give each group once" in \
        " ".join(result.output.split())
    result = cli("train-head", "--method", "tmass", "--features", store, "--out", tmp_path / "r", "--epochs", "1",
                 "--set", "num_samples=3", "--set", "num_samples=4")
    assert result.exit_code == 1 and "--set num_samples is given twice" in result.output
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------ initialisation from CLIP


@pytest.mark.parametrize("method, overrides, reason", [
    ("xpool", [], "xpool has no module that starts from CLIP"),
    # the tiny CLIP's text transformer has 2 heads of width 64
    ("seqtransf", ["--set", "num_heads=4"], "attention heads differ (CLIP's text transformer 2, the head's 4)"),
])
def test_init_from_clip_that_copies_nothing_is_recorded_as_nothing(synth, tmp_path, cli, method, overrides, reason):
    out = tmp_path / "run"
    result = cli(*_finetune(synth, out, "--method", method, "--epochs", "0", "--init-from-clip", *overrides))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"--init-from-clip: {reason}, so nothing is copied: {method} keeps its own initialisation" in text
    config = _config(out)
    assert config["finetune"]["init_from_clip"] is False
    assert config["resolved"]["init_from_clip"] == f"nothing: {reason}"


def test_init_from_clip_records_what_it_copied(synth, tmp_path, cli):
    out = tmp_path / "run"
    result = cli(*_finetune(synth, out, "--method", "seqtransf", "--epochs", "0", "--init-from-clip",
                            "--set", "num_heads=2"))
    assert result.exit_code == 0, result.output
    config = _config(out)
    assert config["finetune"]["init_from_clip"] is True
    assert config["resolved"]["init_from_clip"] == ["block 0", "block 1", "positions 0-76"]


def test_finetune_records_the_frames_and_words_it_used(synth, tmp_path, cli):
    """Without --frames and --max-words the run takes the manifest's, and records those numbers."""
    from tvrpipe.data.manifest import read_manifest

    meta = read_manifest(synth / "manifest").meta
    out = tmp_path / "run"
    assert cli(*_finetune(synth, out, "--method", "meanpool", "--epochs", "0")).exit_code == 0
    ft = _config(out)["finetune"]
    assert (ft["frames"], ft["max_words"]) == (meta["frames"], meta["max_words"])


# ------------------------------------------------------------------------------ the dry run


def test_dry_run_refuses_what_the_run_refuses(synth, tmp_path, cli):
    """A run directory of another configuration, and one another process is writing, stop the dry run as
    they stop the run; neither is written to."""
    from tvrpipe.lock import DirLock

    out = tmp_path / "run"
    assert cli(*_finetune(synth, out, "--method", "meanpool", "--epochs", "0")).exit_code == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    args = _finetune(synth, out, "--method", "meanpool", "--epochs", "0", "--seed", "1")
    for dry in (["--dry-run"], []):
        result = cli(*args, *dry)
        assert result.exit_code == 1 and "holds a run with another configuration" in result.output, result.output
    lock = DirLock(out)
    try:
        for dry in (["--dry-run"], []):
            result = cli(*_finetune(synth, out, "--method", "meanpool", "--epochs", "0"), *dry)
            assert result.exit_code == 1 and "is being written by pid" in result.output, result.output
    finally:
        lock.release()
    assert cli(*_finetune(synth, out, "--method", "meanpool", "--epochs", "0", "--dry-run")).exit_code == 0
    after = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.name != ".tvrpipe.lock"}
    assert after == {p: t for p, t in before.items() if p.name != ".tvrpipe.lock"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16 is measured as bf16 on the CPU, named fp16
def test_dry_run_of_a_gpu_run_plans_it_then_fails_as_the_run_would(synth, tmp_path, cli, precision):
    result = cli(*_finetune(synth, tmp_path / "run", "--method", "meanpool", "--epochs", "0", "--use-gpu",
                            "--precision", precision, "--dry-run"))
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "estimated peak memory per worker" in text, result.output
    assert "--use-gpu: no CUDA device is available here" in text and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ recipes: what they describe


def test_a_recipe_file_is_checked_as_it_loads(tmp_path, cli):
    for where, value, message in [
        ("dataset", "msrvt", "dataset 'msrvt' is not a dataset tvrpipe knows"),
        ("split_set", {"value": "10k", "source": "x"}, "split_set '10k' is not a split set of synthetic (synthetic)"),
        ("settings.group_lr", {"value": {"fusion": 1e-4}, "source": "x"},
         "settings.group_lr names 'fusion', which is not a parameter group of tmass (head, radius)"),
    ]:
        path = write_recipe(tmp_path / "r.yaml", changed(TINY_TMASS, where, value))
        result = cli("recipes", "show", path)
        assert result.exit_code == 1 and f"{path}: {message}" in " ".join(result.output.split()), result.output
    msrvtt = write_recipe(tmp_path / "m.yaml", changed(changed(TINY_TMASS, "dataset", "msrvtt"), "split_set",
                                                        {"value": "9k", "source": "x"}))
    assert cli("recipes", "show", msrvtt).exit_code == 0


def test_a_run_records_how_it_differs_from_its_recipe(store, synth, tmp_path, cli):
    """train-head on a generated store with a recipe made for the synthetic videos: the store is another
    dataset, said at train time and recorded; train-head never trains CLIP, which the record says too."""
    recipe = write_recipe(tmp_path / "tiny-tmass.yaml", TINY_TMASS)
    out = tmp_path / "head"
    result = cli("train-head", "--recipe", recipe, "--features", store, "--out", out, "--no-prefetch")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "will not print the paper's published row beside it" in text
    record = _config(out)["recipe"]
    assert "dataset: the recipe's synthetic, this run's synthetic-features" in record["mismatch"]
    assert record["differs"]["end_to_end"] == {"recipe": True, "run": False}
    assert record["path"] == str(recipe.resolve()) and record["published"]["t2v"]["R@1"] == 50.2
    # finetune on the recipe's own data: nothing of what it describes differs; the explicit --epochs does
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "ft", "--epochs", "0", "--loader-workers", "0", "--dry-run")
    assert result.exit_code == 0 and "will not print" not in result.output, result.output
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "ft", "--epochs", "0", "--loader-workers", "0")
    assert result.exit_code == 0, result.output
    record = _config(tmp_path / "ft")["recipe"]
    assert record["mismatch"] == [] and record["differs"] == {"epochs": {"recipe": 1, "run": 0}}


def _report(runs: Path, out: Path) -> tuple[list[str], pd.DataFrame]:
    from tvrpipe.report import write_report

    path = write_report([runs], out)
    return path.read_text().splitlines(), pd.read_csv(path.parent / "report.csv")


def test_the_report_shows_the_published_row_the_run_trained_against(store, synth, tmp_path, cli, monkeypatch):
    """The numbers are those of the recipe file the run trained from (a user's file named like a shipped
    recipe, or named otherwise), as it was then: a file edited later, or a shipped one of the same name, does
    not change them. A run on another dataset shows no published row, and the report says why."""
    from tvrpipe.training import recipes as recipes_module

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    write_recipe(shipped / "tiny-tmass.yaml", changed(TINY_TMASS, "published.t2v.R@1", 99.9))
    monkeypatch.setattr(recipes_module, "recipes_dir", lambda: shipped)
    (tmp_path / "mine").mkdir()
    mine = write_recipe(tmp_path / "mine" / "tiny-tmass.yaml", changed(TINY_TMASS, "published.t2v.R@1", 41.5))
    other_doc = changed(TINY_TMASS, "published.t2v.R@1", 33.3)
    other = write_recipe(tmp_path / "mine" / "my-tmass.yaml", other_doc)
    runs = tmp_path / "runs"
    data = ["--manifest", synth / "manifest", "--video-root", synth / "videos", "--loader-workers", "0"]
    for recipe, out, extra in ((mine, "a", []), (other, "b", ["--max-words", "6"])):
        result = cli("finetune", "--recipe", recipe, *data, "--out", runs / out, "--epochs", "0", *extra)
        assert result.exit_code == 0, result.output
    write_recipe(other, changed(other_doc, "published.t2v.R@1", 12.3))  # edited after the run
    # the same user file on a store the recipe is not made for
    result = cli("train-head", "--recipe", mine, "--features", store, "--out", runs / "c", "--no-prefetch",
                 "--epochs", "1")
    assert result.exit_code == 0, result.output
    lines, rows = _report(runs, tmp_path / "report")
    published = [x for x in lines if x.startswith("| ↳ published")]
    assert len(published) == 2, lines
    # a file of the user's is named by its path, never as the shipped recipe of the same name
    assert any(f"recipe {mine.resolve()}; the runs differ in epochs)" in x and "| 41.5 | 75.3 |" in x
               for x in published)
    assert any(f"recipe {other.resolve()}; the runs differ in max_words, epochs)" in x and "| 33.3 | 75.3 |" in x
               for x in published)
    notes = [x for x in lines if x.startswith(f"| ↳ no published row (recipe {mine.resolve()})")]
    assert any("another experiment: dataset: the recipe's synthetic, this run's synthetic-features" in x for x in notes)
    assert any("its paper prints no v2t row" in x for x in notes)  # the recipe publishes t2v only
    pub = rows[rows["scores"] == "published"]
    assert sorted(pub["R@1"]) == [33.3, 41.5] and not (pub["R@1"] == 99.9).any()


def test_a_shipped_recipe_changed_since_the_run_leaves_its_row_out(tmp_path):
    """A run recorded before runs kept their recipe's numbers: only its name and hash are known, so the
    report leaves the row out rather than print numbers it cannot tie to the run."""
    from tvrpipe.report.tables import published_row

    old = {"name": "tmass-msrvtt", "sha256": "0" * 64, "overridden": []}
    row = published_row([old])
    assert row.numbers is None and "predates" in row.left_out
    row = published_row([old, None])
    assert row.numbers is None and "not all trained from one recipe file" in row.left_out
    assert published_row([None, None]) is None


def test_published_rows_of_two_recipe_files_are_not_mixed():
    from tvrpipe.report.tables import published_row

    base = {"name": "x", "overridden": [], "published": {"source": "T", "backbone": "b", "t2v": None,
                                                          "v2t": {"R@1": 1.0}}, "mismatch": [], "differs": {}}
    row = published_row([{**base, "sha256": "a"}, {**base, "sha256": "b"}])
    assert row.numbers is None and "not all trained from one recipe file" in row.left_out
    row = published_row([{**base, "sha256": "a"}, {**base, "sha256": "a", "differs": {"batch_size": {}}}])
    assert row.numbers.metrics == {"v2t": {"R@1": 1.0}} and row.differs == ("batch_size",)


def test_the_shipped_recipes_record_their_published_rows():
    from tvrpipe.training.recipes import list_recipes, load_recipe

    for name in list_recipes():
        r = load_recipe(name)
        rec = r.record()
        assert rec["sha256"] == r.sha256 and rec["dataset"] == r.dataset and rec["settings"] == r.values()
        if r.published is not None:
            assert {d: rec["published"][d] for d in r.published.metrics} == r.published.metrics


# ------------------------------------------------------------------------------ options that would have no effect


def test_options_without_effect_are_refused_not_recorded(store, synth, tmp_path, cli):
    """--clip-lr and --grad-checkpointing with a frozen CLIP, --max-epochs and --patience with a fixed
    number of epochs, and a trainer field given both as an option and by sweep's --set."""
    result = cli(*_finetune(synth, tmp_path / "f", "--method", "meanpool", "--epochs", "0", "--clip-lr", "5e-6",
                            "--grad-checkpointing"))
    assert result.exit_code == 1
    assert "--clip-lr, --grad-checkpointing: CLIP stays frozen without --end-to-end" in " ".join(result.output.split())
    result = cli("train-head", "--method", "xpool", "--features", store, "--out", tmp_path / "t", "--epochs", "1",
                 "--patience", "2")
    assert result.exit_code == 1 and "--patience: they shape a run until validation stops improving, and this one " \
        "trains exactly 1 epochs (--epochs)" in " ".join(result.output.split())
    result = cli("sweep", "--features", store, "--methods", "xpool", "--seeds", "0", "--lr", "0.5",
                 "--set", "train.lr=1e-3", "--out", tmp_path / "s")
    assert result.exit_code == 1 and "--lr: --set sweeps it too" in " ".join(result.output.split())
    assert not any((tmp_path / d).exists() for d in ("f", "t", "s"))


def test_train_head_records_the_batch_it_used(store, tmp_path, cli):
    """Fewer training videos than the default batch of 128: a step holds them all, and the run says so."""
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import load_splits

    n_train = load_splits(open_store(store), tokens=False).train.n_videos  # 64 less those carved for validation
    out = tmp_path / "run"
    assert cli("train-head", "--method", "meanpool", "--features", store, "--out", out, "--epochs", "1",
               "--no-prefetch").exit_code == 0
    assert _config(out)["train"]["batch_size"] == 128 and n_train < 128
    assert _config(out)["resolved"]["batch_size"] == _metrics(out)["schedule"]["batch_size"] == n_train


def test_a_run_of_no_step_records_no_learning_rate(store, tmp_path, cli):
    out = tmp_path / "run"
    result = cli("train-head", "--method", "xpool", "--features", store, "--out", out, "--epochs", "0")
    assert result.exit_code == 0, result.output
    assert "(no training step)" in result.output
    for record in (_config(out)["resolved"], _metrics(out)["schedule"]):
        assert record["lr"] is None and record["lr_groups"] == {} and "no training step (0 epochs)" in record["lr_source"]


def test_a_head_that_does_not_take_the_data_stops_before_anything_is_written(store, synth, tmp_path, cli):
    """T-MASS's W of R = exp(S W) has num_frames rows: with fewer than the videos' frames the run stops
    before its directory exists, so the corrected command then runs there."""
    out = tmp_path / "run"
    result = cli("train-head", "--method", "tmass", "--features", store, "--out", out, "--epochs", "1",
                 "--set", "num_frames=2")
    assert result.exit_code == 1 and "tmass: videos have 4 frame slots" in " ".join(result.output.split())
    assert not out.exists()
    assert cli("train-head", "--method", "tmass", "--features", store, "--out", out, "--epochs", "1",
               "--set", "num_frames=4", "--no-prefetch").exit_code == 0
    result = cli(*_finetune(synth, tmp_path / "ft", "--method", "tmass", "--epochs", "0", "--frames", "6",
                            "--set", "num_frames=4"))
    assert result.exit_code == 1 and "videos have 6 frame slots" in " ".join(result.output.split())
    assert not (tmp_path / "ft").exists()


def test_a_feature_store_is_not_a_run_directory(store, tmp_path, cli):
    result = cli("train-head", "--method", "meanpool", "--features", store, "--out", store, "--epochs", "0")
    assert result.exit_code == 1 and f"--out {store} is a feature store" in " ".join(result.output.split())
    assert not (Path(store) / "config.yaml").exists()


def test_a_resumed_run_keeps_what_its_epochs_ran_with(store, tmp_path, cli):
    """How a run executes may change on a resume; config.yaml keeps the first invocation's values and
    lists each later change, and leaves the staged file of a killed write behind no more."""
    out = tmp_path / "run"
    args = ["train-head", "--method", "meanpool", "--features", store, "--out", out, "--epochs", "2"]
    with pytest.raises(KeyboardInterrupt):  # cut after epoch 1, as Ctrl-C would
        fit_cut_after_one_epoch(store, out)
    (out / ".metrics.json.tmp-999999").write_text("{")  # what a write killed before its rename leaves
    assert cli(*args, "--prefetch").exit_code == 0
    config = _config(out)
    assert config["train"]["prefetch"] is False
    assert config["resumed_execution"] == [{"from_epoch": 2, "train.prefetch": True}]
    assert not list(out.glob(".*.tmp-*"))
    assert cli(*args, "--no-prefetch").exit_code == 0  # finished: it trains nothing more, and says nothing more
    assert _config(out)["resumed_execution"] == [{"from_epoch": 2, "train.prefetch": True}]


def fit_cut_after_one_epoch(store: Path, out: Path) -> None:
    """train-head --epochs 2 --no-prefetch, interrupted once its first epoch is committed."""
    from tvrpipe.training.fit import TrainConfig, fit

    def stop(row: dict) -> None:
        raise KeyboardInterrupt

    fit(store, "meanpool", out, TrainConfig(epochs=2, prefetch=False), progress=False, on_epoch=stop)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with fewer than 2 GPUs")
def test_ray_train_workers_without_the_gpus_stop_before_anything_is_written(synth, tmp_path, cli, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for dry in (["--dry-run"], []):
        result = cli(*_finetune(synth, tmp_path / "run", "--method", "meanpool", "--epochs", "0", "--use-gpu",
                                "--num-workers", "2", *dry))
        text = " ".join(result.output.split())
        assert result.exit_code == 1 and "--use-gpu with --num-workers 2: needs 2 GPUs, and this machine has" in text
        assert not (tmp_path / "run").exists()


def test_missing_videos_are_named_without_a_list_that_was_not_written(synth, tmp_path, cli):
    videos = tmp_path / "videos"
    shutil.copytree(synth / "videos", videos)
    for p in sorted(videos.rglob("*.mp4"))[:12]:
        p.unlink()
    result = cli("finetune", "--method", "meanpool", "--manifest", synth / "manifest", "--video-root", videos,
                 "--out", tmp_path / "run", "--model", "tvrpipe-tiny", "--pretrained", "none", "--epochs", "0")
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "nothing was written" in text and "the first: " in text
    assert "failures.csv" not in text and not (tmp_path / "run").exists()


def test_head_overrides_and_user_files_are_named_beside_the_published_row(store, synth, tmp_path, cli,
                                                                          monkeypatch):
    from tvrpipe.training import recipes as recipes_module

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(recipes_module, "recipes_dir", lambda: shipped)
    (tmp_path / "mine").mkdir()
    mine = write_recipe(tmp_path / "mine" / "tiny-tmass.yaml", TINY_TMASS)
    runs = tmp_path / "runs"
    result = cli("finetune", "--recipe", mine, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", runs / "a", "--epochs", "0", "--loader-workers", "0", "--set", "alpha=0.8")
    assert result.exit_code == 0, result.output
    assert f"recipe tiny-tmass ({mine})" in " ".join(result.output.split())
    record = _config(runs / "a")["recipe"]
    assert record["shipped"] is False and record["differs"]["head.alpha"] == {"recipe": 1.2, "run": 0.8}
    lines, rows = _report(runs, tmp_path / "report")
    line = next(x for x in lines if x.startswith("| ↳ published"))
    assert f"recipe {mine.resolve()}; the runs differ in epochs, head.alpha)" in line
    # a row left out is in report.csv too, with its reason
    assert cli("train-head", "--recipe", mine, "--features", store, "--out", runs / "c", "--epochs", "1",
               "--no-prefetch").exit_code == 0
    _, rows = _report(runs, tmp_path / "report2")
    left = rows[rows["scores"] == "published-left-out"]
    assert sorted(left["direction"]) == ["t2v", "v2t"]  # beside each table the run is in
    assert left["runs"].str.contains("dataset: the recipe's synthetic, this run's synthetic-features").all()


# ------------------------------------------------------------------------------ a third look


def test_more_options_without_effect_are_refused(store, synth, tmp_path, cli):
    for args, message in [
        (("train-head", "--method", "xpool", "--features", store, "--out", tmp_path / "a", "--epochs", "0",
          "--lr", "0.5"), "--lr: --epochs 0 trains nothing"),
        (("train-head", "--method", "xpool", "--features", store, "--out", tmp_path / "a", "--epochs", "1",
          "--lr", "0.5", "--group-lr", "head=1e-3"),
         "--lr 0.5: every parameter group of xpool trains at its --group-lr rate (head), so --lr would train nothing"),
        (_finetune(synth, tmp_path / "a", "--method", "meanpool", "--epochs", "0", "--head-lr", "0.3"),
         "--head-lr: --epochs 0 trains nothing"),
        (_finetune(synth, tmp_path / "a", "--method", "meanpool", "--epochs", "1", "--cpus-per-worker", "2"),
         "--cpus-per-worker: only Ray Train workers use it"),
        (("sweep", "--features", store, "--methods", "meanpool", "--seeds", "0", "--epochs", "0", "--out", store),
         "is a feature store; a sweep goes into a folder of its own"),
    ]:
        result = cli(*args)
        assert result.exit_code == 1 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "a").exists() and not (Path(store) / "runs.csv").exists()


def test_a_group_given_the_rate_it_has_anyway_differs_in_nothing(synth, tmp_path, cli):
    recipe = write_recipe(tmp_path / "tiny-tmass.yaml", TINY_TMASS)  # head_lr 1e-5, radius 3e-5
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "run", "--loader-workers", "0", "--group-lr", "head=1e-5",
                 "--group-lr", "radius=3e-5", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "overridden" not in result.output.split("\n")[0]
    assert "lr clip 2e-06 (recipe tiny-tmass), head 1e-05 (recipe tiny-tmass), radius 3e-05 (recipe tiny-tmass)" \
        in " ".join(result.output.split())


def test_a_recipe_batch_that_does_not_fit_is_named_as_the_recipes(synth, tmp_path, cli):
    recipe = write_recipe(tmp_path / "b64.yaml", changed(TINY_TMASS, "settings.batch_size", {"value": 64, "source": "x"}))
    result = cli("finetune", "--recipe", recipe, "--manifest", synth / "manifest", "--video-root", synth / "videos",
                 "--out", tmp_path / "run", "--loader-workers", "0", "--dry-run")
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and f"recipe b64's batch_size 64 ({recipe.resolve()}) exceeds the" in text
    assert "lower it with --batch-size" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_device_that_is_not_here_is_one_line_and_evaluation_falls_back_to_the_cpu(store, tmp_path, cli):
    result = cli("train-head", "--method", "meanpool", "--features", store, "--out", tmp_path / "c", "--device", "cuda")
    assert result.exit_code == 1 and "--device cuda: no such CUDA device here (0 found); use --device cpu" in \
        " ".join(result.output.split())
    assert not (tmp_path / "c").exists()
    out = tmp_path / "run"
    assert cli("train-head", "--method", "meanpool", "--features", store, "--out", out, "--epochs", "0").exit_code == 0
    config = _config(out)
    config["train"]["device"] = "cuda"  # as a run trained on a GPU machine records it
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = cli("evaluate", "--run", out, "--split", "test")
    assert result.exit_code == 0, result.output
    evaluated = json.loads((out / "eval_test.json").read_text())
    assert evaluated["device"] == "cpu" and evaluated["features"] == str(Path(store).resolve())
    assert evaluated["t2v"] == _metrics(out)["test"]["t2v"]


def test_the_report_counts_seeds_not_runs_and_says_when_a_paper_prints_no_row(store, tmp_path, cli, monkeypatch):
    from tvrpipe.report.tables import published_row

    runs = tmp_path / "runs"
    for name, prefetch in (("a", "--prefetch"), ("b", "--no-prefetch")):  # the same seed twice, run otherwise
        assert cli("train-head", "--method", "meanpool", "--features", store, "--out", runs / name,
                   "--epochs", "0", prefetch).exit_code == 0
    lines, rows = _report(runs, tmp_path / "report")
    assert any(x.startswith("| meanpool | 1 (2 runs) |") for x in lines), lines
    assert set(rows[rows["scores"] == "raw"]["seeds"]) == {1}
    row = published_row([{"name": "m", "sha256": "a", "published": None, "overridden": []}])
    assert row.numbers is None and row.left_out == "its paper prints no row for this recipe"


# ------------------------------------------------------------------------------ a damaged record is an error


def _one_line_error(result, *parts: str) -> None:
    text = " ".join(result.output.split())
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for part in parts:
        assert part in text, (part, text)


# each edit of config.yaml, and what the error says after "RUN/config.yaml: "
DAMAGED_CONFIGS = {
    "head is text": (lambda c: c.update(head="x"), "head is 'x', not a mapping"),
    "train is text": (lambda c: c.update(train="x"), "train is 'x', not a mapping"),
    "seed is text": (lambda c: c["train"].update(seed="zero"), "train.seed is 'zero', not an integer"),
    "features is a number": (lambda c: c.update(features=5), "features is 5, not text or null"),
    "provenance is a list": (lambda c: c.update(provenance=[1]), "provenance is [1], not a mapping"),
    # what the checkpoint holds decides the head: a record that disagrees with it is refused, not ignored
    "another method": (lambda c: c.update(method="nope"), "method is 'nope' but the selected checkpoint"),
    "another head setting": (lambda c: c["head"].update(num_heads=3), "head.num_heads is 3 but the selected "
                                                                      "checkpoint"),
    "head setting of another type": (lambda c: c["head"].update(embed_dim="abc"), "head.embed_dim is 'abc'"),
    # named as the file's key, not as the option the user never typed
    "epochs out of range": (lambda c: c["train"].update(epochs=-3), "train.epochs must be >= 0, got -3"),
    "unknown device": (lambda c: c["train"].update(device="tpu"), "train.device must be cpu or cuda"),
}


def test_evaluate_and_search_refuse_a_damaged_config_naming_the_file_and_key(store, tmp_path, cli):
    """Each damaged key of a run's config.yaml is one line naming the file and the key, before anything is
    written: the run's eval_test.json keeps the scores it had."""
    out = tmp_path / "run"
    assert cli("train-head", "--method", "xpool", "--features", store, "--out", out, "--epochs", "1").exit_code == 0
    assert cli("evaluate", "--run", out).exit_code == 0
    for name, (edit, message) in DAMAGED_CONFIGS.items():
        run = tmp_path / name
        shutil.copytree(out, run)
        config = _config(run)
        edit(config)
        (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        scores = (run / "eval_test.json").read_bytes()
        _one_line_error(cli("evaluate", "--run", run), f"{run / 'config.yaml'}: {message}")
        assert (run / "eval_test.json").read_bytes() == scores, name
    run = tmp_path / "features is a number"
    _one_line_error(cli("search", "a red square", "--run", run), f"{run / 'config.yaml'}: features is 5")


def test_evaluate_refuses_a_store_whose_tables_are_damaged_and_a_split_without_captions(store, tmp_path, cli):
    """A store whose captions point at other videos' rows would be scored silently wrong (and overwrite the run's
    scores): it is refused naming the table, the row and what is wrong. A split with videos but no captions is
    one line too."""
    out = tmp_path / "run"
    assert cli("train-head", "--method", "meanpool", "--features", store, "--out", out, "--epochs", "0").exit_code == 0
    assert cli("evaluate", "--run", out).exit_code == 0
    scores = (out / "eval_test.json").read_bytes()
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    texts = pd.read_parquet(copy / "texts.parquet")
    good = texts.copy()
    test = np.flatnonzero(texts["split"].to_numpy() == "test")
    texts.loc[test, "video_row"] = texts["video_row"].to_numpy()[test[::-1]]  # the test rows reversed
    texts.to_parquet(copy / "texts.parquet")
    _one_line_error(cli("evaluate", "--run", out, "--features", copy), f"{copy / 'texts.parquet'} is damaged: row",
                    "video_row", "but the caption's video_id is")
    assert (out / "eval_test.json").read_bytes() == scores
    # every test caption moved to a training video (a store that keeps its contract): nothing to rank on test
    first = good.index[good["split"] == "train"][0]
    good.loc[test, ["video_id", "video_row", "split"]] = good.loc[first, ["video_id", "video_row", "split"]].to_list()
    good.to_parquet(copy / "texts.parquet")
    _one_line_error(cli("evaluate", "--run", out, "--features", copy), "the test split has no captions")
    assert (out / "eval_test.json").read_bytes() == scores


def test_a_recorded_trainer_section_is_checked_as_its_options_are_and_named_as_the_files_keys(tmp_path):
    """finetune's settings span two sections (finetune, execution): settings valid together pass, and a value out of
    range is named by its section and key, never by the option the user did not type."""
    from tvrpipe.errors import RunError
    from tvrpipe.training.recorded import trainer_config

    config = {"method": "meanpool", "finetune": {"precision": "fp16", "seed": 0}, "execution": {"use_gpu": True}}
    assert trainer_config(tmp_path, config).precision == "fp16"
    config["execution"]["num_workers"] = -1
    with pytest.raises(RunError, match=r"config.yaml: execution.num_workers must be >= 0, got -1; restore it"):
        trainer_config(tmp_path, config)
    config["execution"]["num_workers"] = 0
    config["finetune"]["timeout"] = 5  # not a setting of this tvrpipe: evaluation refuses it, the report reads past it
    with pytest.raises(RunError, match=r"its finetune section is not a finetune config \(unknown key\(s\) timeout\)"):
        trainer_config(tmp_path, config)
    assert trainer_config(tmp_path, config, known_only=True).seed == 0
    with pytest.raises(RunError, match=r"config.yaml: train.warmup_fraction must be between 0 and 1, got 2"):
        trainer_config(tmp_path, {"train": {"warmup_fraction": 2}})
