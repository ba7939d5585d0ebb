"""train-head on a generated feature store: learning above chance, protocol, run directory, resume."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml

from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import list_heads
from tvrpipe.pipeline.genstore import GenSpec, generate_store
from tvrpipe.pipeline.store import StoreError
from tvrpipe.training import fit as fit_module
from tvrpipe.training.fit import TrainConfig, evaluate_run, fit, load_head

N_TEST = 40
BASELINES = ["meanpool", "seqtransf", "tokenwise", "xpool"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    spec = GenSpec(train_videos=160, test_videos=N_TEST, captions_per_train_video=3, frames=6, max_words=8,
                   embed_dim=32, seed=0)
    return generate_store(tmp_path_factory.mktemp("gs"), spec, video_shard=32, text_shard=64)


@pytest.fixture(scope="module")
def trained(store, tmp_path_factory):
    runs = {}
    for name in BASELINES:
        out = tmp_path_factory.mktemp(name)
        metrics = fit(store, name, out, TrainConfig(epochs=3, batch_size=32, lr=1e-3, seed=0), progress=False)
        runs[name] = (out, metrics)
    return runs


@pytest.mark.parametrize("name", BASELINES)
def test_trained_baseline_far_above_chance(trained, name):
    _, m = trained[name]
    chance = 100.0 / N_TEST
    assert m["test"]["t2v"]["R@1"] > 5 * chance, m["test"]["t2v"]
    assert m["test"]["v2t"]["R@1"] > 5 * chance, m["test"]["v2t"]
    assert m["test"]["t2v"]["n"] == N_TEST


def test_every_registered_head_is_trained_here():
    assert set(BASELINES) <= set(list_heads())


def test_run_directory_contents(trained, store):
    out, m = trained["xpool"]
    for f in ("config.yaml", "metrics.json", "epochs.csv", "checkpoints/best.safetensors",
              "checkpoints/last.safetensors", "plots/loss.png", "plots/val_r1.png"):
        assert (out / f).is_file(), f
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["method"] == "xpool" and cfg["head"]["embed_dim"] == 32 and cfg["train"]["epochs"] == 3
    assert cfg["provenance"]["model"] == "synthetic-features"
    # the generated store has no val split: validation is carved from train, and said so
    assert m["validation"].startswith("carved from train: 16 videos")
    assert m["val"]["t2v"]["n"] == 16
    assert 1 <= m["selected_epoch"] <= 3
    assert m["selection"].startswith("validation")
    rows = (out / "epochs.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("epoch,loss")
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["test"]["t2v"] == m["test"]["t2v"]


def test_selection_uses_validation_not_test(trained):
    out, m = trained["meanpool"]
    with open(out / "epochs.csv") as f:
        rows = list(csv.DictReader(f))
    best = max(rows, key=lambda r: (float(r["val_t2v_R@1"]), float(r["val_t2v_R@5"]), float(r["val_t2v_R@10"])))
    assert int(best["epoch"]) == m["selected_epoch"]


def test_evaluate_run_reproduces_test_metrics(trained, store, cli):
    out, m = trained["tokenwise"]
    again = evaluate_run(out, "test")
    assert again["t2v"] == m["test"]["t2v"] and again["v2t"] == m["test"]["v2t"]
    r = cli("evaluate", "--run", out, "--split", "test", "--post", "dsl")
    assert r.exit_code == 0, r.output
    saved = json.loads((out / "eval_test.json").read_text())
    assert "t2v_dsl" in saved and saved["t2v"] == m["test"]["t2v"]  # post-processing beside, not folded


def test_evaluate_refuses_other_provenance(trained, tmp_path):
    out, _ = trained["meanpool"]
    other = generate_store(tmp_path / "o", GenSpec(train_videos=20, test_videos=10, frames=6, max_words=8,
                                                   embed_dim=32, seed=1))
    with pytest.raises(StoreError, match="weights_sha256: store has"):
        evaluate_run(out, "test", features=other)


def test_checkpoint_rebuilds_the_head(trained):
    out, _ = trained["seqtransf"]
    head = load_head(out / "checkpoints" / "best.safetensors")
    assert head.name == "seqtransf" and head.config.embed_dim == 32


def test_zero_epochs_is_zero_shot(store, tmp_path):
    m = fit(store, "meanpool", tmp_path / "zs", TrainConfig(epochs=0), progress=False)
    assert m["selected_epoch"] == 0 and m["test"]["t2v"]["R@1"] > 5 * 100.0 / N_TEST


def test_resume_after_interruption_matches_uninterrupted(store, tmp_path, monkeypatch):
    cfg = TrainConfig(epochs=3, batch_size=32, lr=1e-3, seed=1)
    full = fit(store, "tokenwise", tmp_path / "full", cfg, progress=False)
    real = fit_module._evaluate
    calls = {"n": 0}

    def interrupt_second_epoch(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(fit_module, "_evaluate", interrupt_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        fit(store, "tokenwise", tmp_path / "cut", cfg, progress=False)
    monkeypatch.setattr(fit_module, "_evaluate", real)
    resumed = fit(store, "tokenwise", tmp_path / "cut", cfg, progress=False)
    assert resumed["test"] == full["test"] and resumed["selected_epoch"] == full["selected_epoch"]
    assert len((tmp_path / "cut" / "epochs.csv").read_text().splitlines()) == 4


def test_other_config_in_same_run_dir_is_refused(store, tmp_path):
    fit(store, "meanpool", tmp_path / "r", TrainConfig(epochs=1, batch_size=32), progress=False)
    with pytest.raises(ConfigError, match="holds a run with another configuration"):
        fit(store, "meanpool", tmp_path / "r", TrainConfig(epochs=2, batch_size=32), progress=False)


def test_train_head_cli(store, tmp_path, cli):
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "c", "--epochs", "1",
            "--batch-size", "32", "--set", "embed_dim=32")
    assert r.exit_code == 0, r.output
    assert "selected epoch 1" in r.output and "t2v" in r.output
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "d", "--set", "nope=1")
    assert r.exit_code == 1 and "unknown config key 'nope'" in r.output
    r = cli("train-head", "--features", store, "--method", "nosuch", "--out", tmp_path / "d")
    assert r.exit_code == 1 and "unknown method 'nosuch'; known: meanpool" in r.output
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "d", "--post", "x")
    assert r.exit_code == 1 and "--post 'x' is not one of: dsl, qbnorm" in r.output
    r = cli("train-head", "--features", tmp_path / "none", "--method", "meanpool", "--out", tmp_path / "d")
    assert r.exit_code == 1 and "no feature store here" in r.output
    r = cli("heads")
    assert r.exit_code == 0 and all(n in r.output for n in BASELINES)


def test_memory_mapped_split_is_float16(store):
    from tvrpipe.pipeline.store import open_store
    from tvrpipe.training.data import load_splits

    s = load_splits(open_store(store))
    assert s.train.tokens.dtype == np.float16 and s.train.frames.dtype == np.float16
    assert s.train.n_videos == 144 and s.val.n_videos == 16 and s.test.n_videos == N_TEST
    assert not set(s.train.video_ids) & set(s.val.video_ids)


def test_prefetch_does_not_change_training(store, tmp_path):
    a = fit(store, "xpool", tmp_path / "a", TrainConfig(epochs=1, batch_size=32, prefetch=True), progress=False)
    b = fit(store, "xpool", tmp_path / "b", TrainConfig(epochs=1, batch_size=32, prefetch=False), progress=False)
    assert a["test"] == b["test"] and a["val"] == b["val"]
