"""train-head on a generated feature store: learning above chance, protocol, run directory, resume."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from tvrpipe.environment import versions
from tvrpipe.errors import ConfigError, RunError
from tvrpipe.features.store import StoreError
from tvrpipe.heads.base import list_heads
from tvrpipe.rundir import load_head
from tvrpipe.training import core
from tvrpipe.training import fit as fit_module
from tvrpipe.training.evaluate import evaluate_run
from tvrpipe.training.fit import TrainConfig, fit
from tvrpipe.worlds.features import GenSpec, generate_store

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths

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
    assert cfg["versions"] == versions() and "resumed_with" not in cfg  # the software behind the numbers
    # the generated store has no val split: validation is carved from train, and said so
    assert m["validation"].startswith("carved from train: 32 videos")  # 20 % of 160: below the 500 floor
    assert m["val"]["t2v"]["n"] == 32
    assert 0 <= m["selected_epoch"] <= 3  # 0: no epoch beat the untrained head on validation
    assert m["selection"].startswith("validation")
    rows = (out / "epochs.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("epoch,loss")
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["test"]["t2v"] == m["test"]["t2v"]
    # what the wall times ran with: torch's threads and the allocator (tuned here unless not glibc)
    assert saved["train"]["threads"] == torch.get_num_threads() >= 1
    assert saved["train"]["allocator"].startswith(("glibc", "left as"))


@pytest.mark.parametrize("name", BASELINES)
def test_selection_uses_validation_not_test_and_the_untrained_head_competes(trained, name):
    """The selected epoch is the first with the best validation key, the untrained head (epoch 0) included:
    meanpool's ranking has nothing to learn (its scale only sharpens the loss), so it keeps epoch 0."""
    out, m = trained[name]
    with open(out / "epochs.csv") as f:
        rows = [(int(r["epoch"]), float(r["val_t2v_R@1"]), float(r["val_t2v_R@5"]), float(r["val_t2v_R@10"]))
                for r in csv.DictReader(f)]
    u = m["untrained_val"]["t2v"]
    candidates = [(0, u["R@1"], u["R@5"], u["R@10"]), *rows]
    best = max(candidates, key=lambda r: (r[1:], -r[0]))  # ties: the earlier epoch
    assert best[0] == m["selected_epoch"]
    if name == "meanpool":
        assert m["selected_epoch"] == 0 and m["val"] == m["untrained_val"]


def test_a_learning_rate_that_wrecks_the_head_keeps_the_untrained_head(store, tmp_path, cli):
    """Two epochs at lr 0.3 take X-Pool far below its start on validation: the run selects epoch 0, its test
    scores are the untrained head's, its best checkpoint is the untrained weights, and it says so."""
    untrained = fit(store, "xpool", tmp_path / "u", TrainConfig(epochs=0, batch_size=32, seed=0), progress=False)
    r = cli("train-head", "--features", store, "--method", "xpool", "--epochs", 2, "--batch-size", 32, "--lr", 0.3,
            "--out", tmp_path / "w")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "w" / "metrics.json").read_text())
    with open(tmp_path / "w" / "epochs.csv") as f:
        trained_r1 = [float(row["val_t2v_R@1"]) for row in csv.DictReader(f)]
    assert max(trained_r1) < m["untrained_val"]["t2v"]["R@1"] - 10  # the lr did wreck it
    assert m["selected_epoch"] == 0 and m["schedule"]["epochs_run"] == 2
    assert m["val"] == m["untrained_val"] == untrained["val"] and m["test"] == untrained["test"]
    assert (load_head(tmp_path / "w" / "checkpoints" / "best.safetensors").state_dict().keys()
            == load_head(tmp_path / "u" / "checkpoints" / "best.safetensors").state_dict().keys())
    for k, v in load_head(tmp_path / "w" / "checkpoints" / "best.safetensors").state_dict().items():
        torch.testing.assert_close(v, load_head(tmp_path / "u" / "checkpoints" / "best.safetensors").state_dict()[k],
                                   rtol=0, atol=0)  # the same seed's initial weights, stored as they were
    assert ("no epoch beat the untrained head on validation, so the run keeps it (epoch 0); where training at "
            "lr 0.3 made it worse, try a smaller one, e.g. --lr 0.03") in " ".join(r.output.split())


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


def test_every_run_records_the_zero_shot_row_on_its_test_set(trained, store, tmp_path, cli):
    """Beside its own test scores a run records zero-shot CLIP's on the same test set (meanpool untrained, as
    `--epochs 0` gives them), and train-head prints them as a row beside each direction's."""
    zero = fit(store, "meanpool", tmp_path / "zs", TrainConfig(epochs=0), progress=False)["test"]
    for name in BASELINES:
        _, m = trained[name]
        assert m["zero_shot"]["test"]["t2v"] == zero["t2v"] and m["zero_shot"]["test"]["v2t"] == zero["v2t"]
        assert m["zero_shot"]["head"].startswith("meanpool, untrained")
    r = cli("train-head", "--features", store, "--method", "tokenwise", "--epochs", 0, "--out", tmp_path / "t")
    lines = [" ".join(line.replace("│", " ").split()) for line in r.output.splitlines()]
    want = " ".join(f"{zero['t2v'][k]:.1f}" for k in ("R@1", "R@5", "R@10", "MdR", "MnR"))
    assert r.exit_code == 0 and f"t2v zero-shot {want}" in lines, r.output


@pytest.mark.parametrize("method", ["tokenwise", "tmass"])  # tmass: dropout and sampled noise
def test_resume_after_interruption_matches_uninterrupted(store, tmp_path, interrupt_call, method):
    cfg = TrainConfig(epochs=3, batch_size=32, lr=1e-3, seed=1)
    full = fit(store, method, tmp_path / "full", cfg, progress=False)
    restore = interrupt_call(fit_module, "evaluate_split", 3)  # the untrained head's, epoch 1's, then epoch 2's
    with pytest.raises(KeyboardInterrupt):
        fit(store, method, tmp_path / "cut", cfg, progress=False)
    restore()
    state_path = tmp_path / "cut" / "checkpoints" / "state.pt"
    state = torch.load(state_path, weights_only=False)
    kept = json.loads(state["rows"])  # the rows are one JSON text, epoch 1's row as epochs.csv has it
    assert [r["epoch"] for r in kept] == [1] and kept[0]["val_t2v_R@1"] == pd.read_csv(
        tmp_path / "cut" / "epochs.csv")["val_t2v_R@1"][0]
    resumed = fit(store, method, tmp_path / "cut", cfg, progress=False)
    assert resumed["test"] == full["test"] and resumed["selected_epoch"] == full["selected_epoch"]
    rows = [pd.read_csv(tmp_path / run / "epochs.csv").drop(columns=["samples_per_s", "data_share", "seconds"])
            for run in ("full", "cut")]
    assert len(rows[1]) == 3
    pd.testing.assert_frame_equal(rows[0], rows[1])  # every epoch's losses and validation, bit for bit


@pytest.mark.parametrize("cut", ["before the state", "half-written state", "after the state", "before epochs.csv"])
def test_resume_after_interruption_inside_an_epochs_commit(tmp_path, monkeypatch, cut):
    """An epoch writes last.safetensors, best.safetensors (validation improved), state.pt and
    epochs.csv. Interrupted between any two of them, the resumed run equals the uninterrupted one:
    staged weights of an uncommitted epoch are dropped (that epoch is trained again from the state's
    weights), those of a committed one are moved into place. Before the commit protocol, an
    interruption before state.pt left epoch 2's weights beside epoch 1's state, and the resume
    trained epoch 2 again from them (another loss, another selected epoch)."""
    spec = GenSpec(train_videos=128, val_videos=48, test_videos=48, captions_per_train_video=2, frames=4,
                   max_words=4, embed_dim=16, noise=0.6, near_duplicates=0.1, seed=6)
    store = generate_store(tmp_path / "store", spec)  # validation improves at epochs 1 and 2, not at 3
    cfg = TrainConfig(epochs=3, batch_size=32, lr=3e-3, seed=1, prefetch=False)
    full = fit(store, "xpool", tmp_path / "full", cfg, progress=False)
    real_save, real_replace, real_rows, calls = torch.save, os.replace, core.write_epochs, []

    def save(obj, f, *a, **k):  # torch.save is called once an epoch, for state.pt
        calls.append(1)
        if len(calls) == 2 and cut == "before the state":
            raise KeyboardInterrupt
        real_save(obj, f, *a, **k)
        if len(calls) == 2 and cut == "half-written state":  # written, not yet renamed to state.pt
            raise KeyboardInterrupt

    def replace(src, dst):  # the renames of the staged files that follow epoch 2's state.pt
        if len(calls) == 2 and cut == "after the state" and str(src).endswith(".next"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    def rows(run, r):
        if len(r) == 2 and cut == "before epochs.csv":
            raise KeyboardInterrupt
        real_rows(run, r)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(core, "write_epochs", rows)
    with pytest.raises(KeyboardInterrupt):
        fit(store, "xpool", tmp_path / "cut", cfg, progress=False)
    monkeypatch.undo()
    ckpt = tmp_path / "cut" / "checkpoints"
    staged = sorted(p.name for p in ckpt.glob(".*.next"))
    assert staged == ([] if cut == "before epochs.csv" else [".best.safetensors.next", ".last.safetensors.next"])
    state = torch.load(ckpt / "state.pt", weights_only=False)
    assert state["epoch"] == (0 if cut in ("before the state", "half-written state") else 1)
    assert not list(ckpt.glob(".state.pt.tmp*"))  # an interrupted write of the state leaves no part of it
    assert sorted(state["files"]) == ["best.safetensors", "last.safetensors"]
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # a process that has ended: what kill -9 leaves mid-write is staged under its pid
    (ckpt / f".state.pt.tmp-{gone.pid}").write_bytes(b"cut off")
    resumed = fit(store, "xpool", tmp_path / "cut", cfg, progress=False)
    assert not list(ckpt.glob(".*.next")) and not list(ckpt.glob(".*.tmp*"))
    assert resumed["test"] == full["test"] and resumed["selected_epoch"] == full["selected_epoch"] == 2
    assert resumed["checkpoint"]["sha256"] == full["checkpoint"]["sha256"]
    rows = [pd.read_csv(tmp_path / run / "epochs.csv").drop(columns=["samples_per_s", "data_share", "seconds"])
            for run in ("full", "cut")]
    pd.testing.assert_frame_equal(rows[0], rows[1])


def test_resume_refuses_a_checkpoint_that_does_not_match_its_state(store, tmp_path):
    cfg = TrainConfig(epochs=2, batch_size=32, lr=1e-3, seed=1)
    fit(store, "xpool", tmp_path / "r", cfg, progress=False)
    last = tmp_path / "r" / "checkpoints" / "last.safetensors"
    last.write_bytes(last.read_bytes().replace(b"xpool", b"xPool"))  # still loads, no longer what was written
    with pytest.raises(RunError, match=r"cannot resume.*last.safetensors does not match the sha256 that state.pt "
                                       r"recorded for it\); delete .*checkpoints"):
        fit(store, "xpool", tmp_path / "r", cfg, progress=False)


def test_seed_step_seeds_the_cpu_stream_as_manual_seed_does_without_lazy_accelerator_seeds(monkeypatch):
    from tvrpipe.training.core import seed_step

    lazy = []  # torch.manual_seed queues a lazy seed (with a formatted stack) for an uninitialised CUDA
    real = torch.cuda.random._lazy_call
    monkeypatch.setattr(torch.cuda.random, "_lazy_call", lambda *a, **k: (lazy.append(1), real(*a, **k)))
    seed_step(7, 2, 5)
    ours = torch.rand(6)
    assert lazy == [] or torch.cuda.is_initialized()
    torch.manual_seed(int(np.random.SeedSequence([7, 2, 5]).generate_state(1)[0]))
    assert torch.equal(ours, torch.rand(6))
    assert lazy == [1] or torch.cuda.is_initialized()  # the probe sees torch.manual_seed's lazy call
    seed_step(7, 2, 6)
    assert not torch.equal(ours, torch.rand(6))  # another step, another stream


def test_a_run_resumed_in_another_environment_keeps_its_versions_and_lists_the_other(store, tmp_path, monkeypatch):
    from tvrpipe import environment

    cfg = TrainConfig(epochs=1, batch_size=32, lr=1e-3, seed=0)
    first = fit(store, "meanpool", tmp_path / "r", cfg, progress=False)
    upgraded = {**versions(), "torch": "9.9.9"}
    monkeypatch.setattr(environment, "versions", lambda: upgraded)
    again = fit(store, "meanpool", tmp_path / "r", cfg, progress=False)  # the same run, not another configuration
    assert again["test"] == first["test"]
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["versions"]["torch"] == torch.__version__ and saved["resumed_with"] == [upgraded]


def test_an_optimizer_state_for_other_parameters_is_refused_by_name(tmp_path):
    """A run started by a tvrpipe whose head had other parameters (prota's dead output biases) cannot
    continue training: said so, not reported as damaged checkpoints."""
    from tvrpipe.errors import RunError
    from tvrpipe.training.fit import load_optimizer_state

    before = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    old = torch.optim.AdamW(before)
    before[0].sum().backward()
    old.step()
    now = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2)) for _ in range(2)])
    with pytest.raises(RunError, match=r"cannot resume: its optimizer state is for 3 parameter tensors and the "
                                       r"head now has 2 .*tvrpipe evaluate.*Delete .*checkpoints"):
        load_optimizer_state(now, old.state_dict(), tmp_path)
    same = torch.optim.AdamW(before)
    load_optimizer_state(same, old.state_dict(), tmp_path)
    assert same.state_dict()["state"][0]["step"] == 1


def test_other_config_in_same_run_dir_is_refused(store, tmp_path):
    fit(store, "meanpool", tmp_path / "r", TrainConfig(epochs=1, batch_size=32), progress=False)
    with pytest.raises(ConfigError, match="holds a run with another configuration"):
        fit(store, "meanpool", tmp_path / "r", TrainConfig(epochs=2, batch_size=32), progress=False)


def test_a_value_the_head_refuses_writes_nothing_and_the_corrected_command_runs(store, tmp_path, cli):
    """The head's own checks run before the run directory is written: no config.yaml is left behind
    to refuse the corrected command as "another configuration"."""
    out = tmp_path / "r"
    r = cli("train-head", "--features", store, "--method", "xpool", "--out", out, "--epochs", "1",
            "--set", "dropout=1.5")
    assert r.exit_code == 1 and "dropout" in r.output and not out.exists(), r.output
    r = cli("train-head", "--features", store, "--method", "xpool", "--out", out, "--epochs", "1",
            "--set", "dropout=0.2")
    assert r.exit_code == 0, r.output


def test_train_head_cli(store, tmp_path, cli):
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "c", "--epochs", "1",
            "--batch-size", "32", "--set", "embed_dim=32")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "selected epoch 0 of 1" in text and "t2v" in text  # meanpool's ranking has nothing to learn: a tie
    assert "no epoch beat the untrained head on validation, so the run keeps it (epoch 0)" in text
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "d", "--set", "nope=1")
    assert r.exit_code == 1 and "unknown config key 'nope'" in r.output
    r = cli("train-head", "--features", store, "--method", "xpool", "--out", tmp_path / "d", "--set",
            "embed_dim=100000000")  # a head 100M wide was built before the features' width was compared
    assert r.exit_code == 1 and "--set embed_dim=100000000: the features of" in " ".join(r.output.split())
    # a class variable of the config (its owner's name, for messages) is no key a user can set, nor listed as one
    r = cli("train-head", "--features", store, "--method", "xpool", "--out", tmp_path / "d", "--set", "owner=x")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "unknown config key 'owner'" in text and "owner," not in text.split("valid:")[1]
    r = cli("train-head", "--features", store, "--method", "nosuch", "--out", tmp_path / "d")
    assert r.exit_code == 1 and "unknown method 'nosuch'; known: duq, meanpool" in r.output
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "d", "--post", "x")
    assert r.exit_code == 1 and "--post 'x' is not one of: dsl, qbnorm" in r.output
    r = cli("train-head", "--features", tmp_path / "none", "--method", "meanpool", "--out", tmp_path / "d")
    assert r.exit_code == 1 and "no feature store here" in r.output
    r = cli("heads")
    assert r.exit_code == 0 and all(n in r.output for n in BASELINES)
    text = " ".join(r.output.split())  # the console wraps long lines
    assert "(default lr 0.003 at D=64, 0.0003 at D=512)" in text and "(default lr 0.001)" in text  # uatvr, xpool
    assert "parameter groups (finetune --group-lr): head, radius" in text  # tmass


def test_memory_mapped_split_is_float16(store):
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import load_splits

    s = load_splits(open_store(store))
    assert s.train.tokens.dtype == np.float16 and s.train.frames.dtype == np.float16
    assert s.train.n_videos == 128 and s.val.n_videos == 32 and s.test.n_videos == N_TEST  # 20 % carved
    assert not set(s.train.video_ids) & set(s.val.video_ids)


def test_load_split_loads_one_split_as_load_splits_does(store, monkeypatch):
    """load_split reads only the rows of its split (evaluating test reads no train features), with
    the same arrays as load_splits; text_subset keeps the chosen captions and all their videos."""
    import tvrpipe.training.data as data
    from tvrpipe.features.store import open_store

    s = open_store(store)
    every = data.load_splits(s)
    read = []
    real = type(s).read
    monkeypatch.setattr(type(s), "read", lambda self, name, rows, width=None, check=True:
                        read.append(len(rows)) or real(self, name, rows, width, check))
    test = data.load_split(s, "test")
    n = every.test.n_texts
    # token mask, frames, frame mask, tokens, sentence
    assert read == [n, N_TEST, N_TEST, n, n] and n < every.train.n_texts
    for name in ("frames", "frame_mask", "tokens", "token_mask", "sentence", "text_video", "video_ids", "caption_ids"):
        np.testing.assert_array_equal(getattr(test, name), getattr(every.test, name))
    some = data.load_split(s, "test", text_subset=np.array([1, 7, 30]))
    np.testing.assert_array_equal(some.caption_ids, every.test.caption_ids[[1, 7, 30]])
    np.testing.assert_array_equal(some.sentence, every.test.sentence[[1, 7, 30]])
    np.testing.assert_array_equal(some.video_ids[some.text_video], every.test.video_ids[every.test.text_video[[1, 7, 30]]])
    assert some.n_videos == N_TEST
    with pytest.raises(ConfigError, match="split must be train, val or test, got 'testing'"):
        data.load_split(s, "testing")
    with pytest.raises(ValueError, match="its video outside the test rows"):
        data.load_rows(s, "test", np.arange(2), np.arange(len(s.texts)))


def test_a_split_is_loaded_up_to_its_last_real_token(tmp_path):
    """Token columns that are padding in every caption of a split are not loaded (nor kept in memory);
    every real token is, unchanged."""
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import load_split

    spec = GenSpec(train_videos=24, test_videos=8, captions_per_train_video=2, frames=4, max_words=24,
                   embed_dim=16, seed=0)
    s = open_store(generate_store(tmp_path / "gs", spec))
    mask, tokens = np.asarray(s.array("texts/token_mask")[:]), np.asarray(s.array("texts/tokens")[:])
    for name in ("train", "test"):
        split = load_split(s, name)
        rows = s.texts.index[s.texts["caption_id"].isin(split.caption_ids)].to_numpy()
        width = int(mask[rows].sum(1).max())  # the store's masks are real tokens first, then padding
        assert width < 24 and split.tokens.shape == (len(rows), width, 16)
        assert split.token_mask.shape == (len(rows), width)
        np.testing.assert_array_equal(split.token_mask, mask[rows, :width])
        np.testing.assert_array_equal(split.tokens, tokens[rows, :width])
        assert split.token_mask.sum() == mask[rows].sum()


def test_a_split_loaded_without_tokens_holds_none_and_refuses_token_batches(store):
    """A sentence head's split: no word tokens read ((n_t, 0, D)), everything else as loaded with
    them, and sentence batches the same; a token batch from it is an error, not empty tokens."""
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import load_split

    s = open_store(store)
    full, bare = load_split(s, "train"), load_split(s, "train", tokens=False)
    assert bare.tokens.shape == (full.n_texts, 0, 32) and bare.token_mask.shape == (full.n_texts, 0)
    for name in ("frames", "frame_mask", "sentence", "text_video", "video_ids", "caption_ids"):
        np.testing.assert_array_equal(getattr(bare, name), getattr(full, name))
    idx = np.array([0, 5, 7])
    a, b = full.text_batch(idx, tokens=False), bare.text_batch(idx, tokens=False, trim=True)
    assert a.tokens.shape == b.tokens.shape == (3, 0, 32) and torch.equal(a.sentence, b.sentence)
    with pytest.raises(ValueError, match="the train split was loaded without word tokens"):
        bare.text_batch(idx)


def test_fit_loads_word_tokens_only_for_heads_that_read_them(store, tmp_path, monkeypatch):
    from tvrpipe.training import stream

    seen = {}

    def spy(st, name, rows, **kwargs):
        seen.setdefault(method, set()).add(kwargs.get("tokens", True))
        return load_split(st, name, rows, **kwargs)

    load_split = stream.load_split
    monkeypatch.setattr(stream, "load_split", spy)  # how the in-memory splits are loaded
    for method in ("xpool", "tokenwise"):
        m = fit(store, method, tmp_path / method, TrainConfig(epochs=1, batch_size=32), progress=False)
        assert m["test"]["t2v"]["n"] == N_TEST
    assert seen == {"xpool": {False}, "tokenwise": {True}}


def test_text_batch_trim_drops_only_columns_padded_in_every_caption(store):
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import load_split

    train = load_split(open_store(store), "train")
    lengths = train.token_mask.sum(1)
    assert train.token_mask.shape[1] == 8 and lengths[np.argsort(lengths)[:5]].max() < lengths.max()
    short, longest = np.argsort(lengths)[:5], int(np.argmax(lengths))
    for idx in (short, np.append(short, longest)):
        batch, full = train.text_batch(idx, trim=True), train.text_batch(idx)
        k = int(lengths[idx].max())  # the store's masks are real tokens first, then padding
        assert batch.tokens.shape == (len(idx), k, 32) and batch.token_mask.shape == (len(idx), k)
        np.testing.assert_array_equal(batch.tokens.numpy(), full.tokens[:, :k].numpy())
        np.testing.assert_array_equal(batch.token_mask.numpy(), full.token_mask[:, :k].numpy())
        assert not full.token_mask[:, k:].any()
    empty = train.text_batch(short, tokens=False, trim=True)  # heads without tokens get none either way
    assert empty.tokens.shape == (5, 0, 32)


def test_prefetch_does_not_change_training(store, tmp_path):
    a = fit(store, "xpool", tmp_path / "a", TrainConfig(epochs=1, batch_size=32, prefetch=True), progress=False)
    b = fit(store, "xpool", tmp_path / "b", TrainConfig(epochs=1, batch_size=32, prefetch=False), progress=False)
    assert a["test"] == b["test"] and a["val"] == b["val"]


# ------------------------------------------------------------ schedule: early stopping, defaults


REAL_EVALUATE = fit_module.evaluate_split


def _scripted_validation(monkeypatch, r1_by_epoch, interrupt_at=None, untrained=0.0):
    """Validation returns R@1 from a script (one value per trained epoch; ``untrained`` for the untrained head
    that selection compares them with); test is evaluated for real."""
    real = REAL_EVALUATE
    seen = {"val": 0, "begin": False}
    real_begin = core.RunLoop.begin

    def begin(self, validate):
        seen["begin"] = True
        try:
            real_begin(self, validate)
        finally:
            seen["begin"] = False

    def scripted(head, split, cfg, *a, **kw):
        out = real(head, split, cfg, *a, **kw)
        if split.name != "val":
            return out
        if seen["begin"]:
            out["t2v"] = {**out["t2v"], "R@1": untrained, "R@5": 0.0, "R@10": 0.0}
            return out
        seen["val"] += 1
        if interrupt_at is not None and seen["val"] == interrupt_at:
            raise KeyboardInterrupt
        r1 = r1_by_epoch[seen["val"] - 1]
        out["t2v"] = {**out["t2v"], "R@1": r1, "R@5": 0.0, "R@10": 0.0}
        return out

    monkeypatch.setattr(fit_module, "evaluate_split", scripted)
    monkeypatch.setattr(core.RunLoop, "begin", begin)


R1_SCRIPT = [10, 20, 30, 25, 26, 30, 28, 29, 27, 40, 41]  # best at epoch 3; epoch 6 only ties it


def test_early_stopping_stops_after_patience_and_halves_on_plateaus(store, tmp_path, monkeypatch):
    _scripted_validation(monkeypatch, R1_SCRIPT)
    cfg = TrainConfig(batch_size=32, lr=1e-3, patience=6, plateau=2, max_epochs=30, min_steps=0)
    m = fit(store, "xpool", tmp_path / "r", cfg, progress=False)
    assert m["selected_epoch"] == 3 and m["val"]["t2v"]["R@1"] == 30  # a tie is not an improvement
    sch = m["schedule"]
    assert sch["epochs_run"] == 9 and sch["stopped_early"] and sch["lr_halvings"] == 3
    with open(tmp_path / "r" / "epochs.csv") as f:
        lrs = [float(r["lr_head"]) for r in csv.DictReader(f)]
    # constant after the warmup epoch, halved after epochs 5 and 7 (2 and 4 epochs without improvement)
    assert lrs[1] == pytest.approx(1e-3) and lrs[4] == pytest.approx(1e-3)
    assert lrs[5] == pytest.approx(5e-4) and lrs[6] == pytest.approx(5e-4) and lrs[7] == pytest.approx(2.5e-4)
    assert lrs[0] == pytest.approx(1e-3)  # the warmup ends at the last step of epoch 1


def test_early_stopping_resumes_to_the_same_stop(store, tmp_path, monkeypatch):
    cfg = TrainConfig(batch_size=32, lr=1e-3, patience=6, plateau=2, max_epochs=30, min_steps=0)
    _scripted_validation(monkeypatch, R1_SCRIPT)
    full = fit(store, "xpool", tmp_path / "full", cfg, progress=False)
    _scripted_validation(monkeypatch, R1_SCRIPT, interrupt_at=6)
    with pytest.raises(KeyboardInterrupt):
        fit(store, "xpool", tmp_path / "cut", cfg, progress=False)
    _scripted_validation(monkeypatch, R1_SCRIPT[5:])  # epochs 6.. after the resume
    resumed = fit(store, "xpool", tmp_path / "cut", cfg, progress=False)
    assert resumed["schedule"] == full["schedule"] and resumed["selected_epoch"] == 3
    assert resumed["test"] == full["test"]
    assert (tmp_path / "cut" / "epochs.csv").read_text().splitlines()[1:] != []
    again = fit(store, "xpool", tmp_path / "cut", cfg, progress=False)  # a finished run stays finished
    assert again["schedule"]["epochs_run"] == 9


def test_explicit_epochs_and_lr_win_and_are_recorded(store, tmp_path):
    from tvrpipe.heads.base import head_class

    m = fit(store, "seqtransf", tmp_path / "a", TrainConfig(epochs=2, lr=5e-3, batch_size=32), progress=False)
    assert m["schedule"]["lr"] == 5e-3 and m["schedule"]["lr_source"] == "--lr"
    assert m["schedule"]["epochs_run"] == 2 and not m["schedule"]["stopped_early"]
    assert m["schedule"]["description"].startswith("2 epochs: warmup")
    cfg = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())
    assert cfg["resolved"]["lr"] == 5e-3 and cfg["train"]["epochs"] == 2
    m = fit(store, "seqtransf", tmp_path / "b", TrainConfig(epochs=1, batch_size=32), progress=False)
    assert m["schedule"]["lr"] == head_class("seqtransf").default_lr
    assert m["schedule"]["lr_source"] == "seqtransf.default_lr"
    cfg = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    assert cfg["resolved"]["lr_source"] == "seqtransf.default_lr"


def test_a_default_lr_per_width_is_read_at_the_stores_width(store, tmp_path, monkeypatch):
    """A head whose default_lr is a {D: lr} table trains at the lr of the store's width (D = 32
    here, between the measured 16 and 64: the geometric interpolation), says which width it read,
    and --lr still wins."""
    from tvrpipe.heads.base import head_class

    monkeypatch.setattr(head_class("xpool"), "default_lr", {16: 1e-2, 64: 1e-4})
    m = fit(store, "xpool", tmp_path / "a", TrainConfig(epochs=1, batch_size=32), progress=False)
    assert m["schedule"]["lr"] == pytest.approx(1e-3)  # half-way between 16 and 64 in log D
    assert m["schedule"]["lr_source"] == "xpool.default_lr at D=32"
    cfg = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())
    assert cfg["resolved"]["lr_source"] == "xpool.default_lr at D=32"
    m = fit(store, "xpool", tmp_path / "b", TrainConfig(epochs=1, batch_size=32, lr=5e-3), progress=False)
    assert (m["schedule"]["lr"], m["schedule"]["lr_source"]) == (5e-3, "--lr")


def test_open_ended_epochs_scale_with_steps_per_epoch():
    from tvrpipe.training.fit import open_ended_epochs

    d = TrainConfig()  # patience 8, plateau 3, max 60, min_steps 300: k = 300 / (8 * steps), rounded up
    assert open_ended_epochs(d, 63) == (8, 3, 60, 1)  # MSR-VTT 9k (8,100 train videos / 128): every epoch validated
    assert open_ended_epochs(d, 38) == (8, 3, 60, 1)  # 300 / 304
    assert open_ended_epochs(d, 15) == (24, 9, 180, 3)  # 2.5 -> validated every 3 epochs
    assert open_ended_epochs(d, 3) == (104, 39, 780, 13)  # 12.5 -> every 13 epochs (39 steps)
    assert open_ended_epochs(d, 25) == (16, 6, 120, 2)  # 1.5
    assert open_ended_epochs(d, 75 / 8) == (32, 12, 240, 4)  # exactly 4 (no float excess rounds it to 5)
    assert open_ended_epochs(replace(d, min_steps=0), 1) == (8, 3, 60, 1)
    # patience always covers min_steps steps, counts whole periods, and the cap leaves room for it
    for steps in range(1, 80):
        p, q, m, k = open_ended_epochs(d, steps)
        assert p * steps >= 300 and (k - 1) * 8 * steps < 300
        assert (p, q) == (8 * k, 3 * k) and m == 60 * k
    assert open_ended_epochs(TrainConfig(max_epochs=2, patience=3, min_steps=40), 4) == (12, 12, 16, 4)


def test_min_steps_validates_every_k_epochs(store, tmp_path, monkeypatch):
    """144 train videos / 32 = 4 steps an epoch; min_steps 48 = 2 x (patience 6 x 4 steps): validation after
    epochs 1 and 2, then every 2 epochs (8 steps), patience 12 epochs, the lr halved after every 4 epochs
    without improvement, at most 60 epochs; a row of epochs.csv is a validated epoch, its loss and time those
    of the epochs since the last validation."""
    _scripted_validation(monkeypatch, [10, 20, 30] + [25] * 20)
    seen, scripted = [], fit_module.evaluate_split

    def counted(head, split, *a, **kw):
        seen.append(split.name)
        return scripted(head, split, *a, **kw)
    monkeypatch.setattr(fit_module, "evaluate_split", counted)
    cfg = TrainConfig(batch_size=32, lr=1e-3, patience=6, plateau=2, max_epochs=30, min_steps=48)
    m = fit(store, "xpool", tmp_path / "r", cfg, progress=False)
    sch = m["schedule"]
    assert (sch["patience_epochs"], sch["plateau_epochs"], sch["max_epochs"]) == (12, 4, 60)
    assert (sch["validate_every_epochs"], sch["validate_every_steps"]) == (2, 8)
    # validated at epochs 1, 2, 4 (best), 6, ... 16: 12 epochs without improvement
    assert sch["epochs_run"] == 16 and sch["stopped_early"] and m["selected_epoch"] == 4
    assert sch["lr_halvings"] == 3  # after epochs 8, 12 and 16
    assert "validated after each of the first 2 epochs, then every 2, 8 steps" in sch["description"]
    assert "stop after 12" in sch["description"]
    config = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert config["resolved"]["schedule"] == sch["description"]
    with open(tmp_path / "r" / "epochs.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, *range(2, 17, 2)]
    lrs = [float(r["lr_head"]) for r in rows]
    # a row's rate is its last step's: halved after the validations of epochs 8 and 12 (and 16, the stop)
    assert lrs[:5] == pytest.approx([1e-3] * 5) and lrs[5:7] == pytest.approx([5e-4] * 2)
    assert lrs[7:] == pytest.approx([2.5e-4] * 2)
    assert seen.count("val") == 1 + 9  # the untrained head, then epoch 1 and every 2 epochs
    # a store too small for min_steps within max_epochs trains past max_epochs to reach it
    _scripted_validation(monkeypatch, [10] * 40)
    m = fit(store, "xpool", tmp_path / "s", TrainConfig(batch_size=32, max_epochs=2, patience=3, min_steps=40),
            progress=False)
    assert m["schedule"]["epochs_run"] == 16 and m["schedule"]["stopped_early"]
    assert m["schedule"]["validate_every_epochs"] == 4
    with open(tmp_path / "s" / "epochs.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3, 4, 8, 12, 16]


def test_validating_every_k_epochs_resumes_to_the_same_run(store, tmp_path, monkeypatch):
    """Cut between two validations (after epoch 5; validated after epochs 1, 2, 4, 6, 8), the run resumes from
    its last commit (epoch 4) and trains epoch 5 again: weights, stop and selection equal the uninterrupted run's to the bit."""
    from tvrpipe.rundir import BEST, LAST
    from tvrpipe.training import core as core_module

    cfg = TrainConfig(batch_size=32, lr=1e-3, patience=3, plateau=2, max_epochs=4, min_steps=24)  # k = 2
    full = fit(store, "tmass", tmp_path / "full", cfg, progress=False)
    assert full["schedule"]["validate_every_epochs"] == 2

    real_lr = core_module.RunLoop.lr

    def cut(self, epoch, step):  # the first step of epoch 6: epochs 5's steps ran, epoch 4 was the last commit
        if epoch == 5:
            raise KeyboardInterrupt
        return real_lr(self, epoch, step)
    monkeypatch.setattr(core_module.RunLoop, "lr", cut)
    with pytest.raises(KeyboardInterrupt):
        fit(store, "tmass", tmp_path / "cut", cfg, progress=False)
    state = torch.load(tmp_path / "cut" / "checkpoints" / "state.pt", weights_only=False)
    assert state["epoch"] == 3  # 0-based: epoch 4, the last validated one
    monkeypatch.setattr(core_module.RunLoop, "lr", real_lr)
    resumed = fit(store, "tmass", tmp_path / "cut", cfg, progress=False)
    assert resumed["schedule"] == full["schedule"] and resumed["selected_epoch"] == full["selected_epoch"]
    assert resumed["test"] == full["test"] and resumed["val"] == full["val"]
    for name in (LAST, BEST):
        a = (tmp_path / "full" / "checkpoints" / name).read_bytes()
        assert a == (tmp_path / "cut" / "checkpoints" / name).read_bytes()
    drop = ("seconds", "samples_per_s", "data_share")  # wall times
    rows = [[{k: v for k, v in r.items() if k not in drop} for r in csv.DictReader(open(d / "epochs.csv"))]
            for d in (tmp_path / "full", tmp_path / "cut")]
    assert rows[0] == rows[1]


def test_train_head_without_features_uses_the_one_store_under_features(tmp_path, monkeypatch, cli):
    """`tvrpipe train-head --method M --out R`: the one store under features/ (or $TVRPIPE_FEATURES);
    none or several there is one line that says what to pass."""
    from tvrpipe.features.store import FEATURES_ROOT_ENV

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(FEATURES_ROOT_ENV, raising=False)
    r = cli("train-head", "--method", "meanpool", "--out", "runs/a", "--epochs", "0")
    assert r.exit_code == 1 and "no feature store under features/: pass --features DIR" in " ".join(r.output.split())
    spec = GenSpec(train_videos=16, test_videos=8, frames=4, max_words=6, embed_dim=8, seed=0)
    one = generate_store(tmp_path / "features" / "synthetic-tiny", spec)
    r = cli("train-head", "--method", "meanpool", "--out", "runs/a", "--epochs", "0")
    assert r.exit_code == 0, r.output
    assert f"features: {Path('features') / 'synthetic-tiny'}" in r.output
    assert yaml.safe_load((tmp_path / "runs" / "a" / "config.yaml").read_text())["features"] == str(one.resolve())
    generate_store(tmp_path / "features" / "other", spec)
    r = cli("train-head", "--method", "meanpool", "--out", "runs/b", "--epochs", "0")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "2 feature stores under features/: pass --features with one of" in text
    assert "features/other" in text and "features/synthetic-tiny" in text and not (tmp_path / "runs" / "b").exists()
    monkeypatch.setenv(FEATURES_ROOT_ENV, str(tmp_path / "features" / "other"))
    assert cli("train-head", "--method", "meanpool", "--out", "runs/c", "--epochs", "0").exit_code == 0


def test_zero_shot_start_begins_at_zero_shot_and_is_marked_not_in_the_papers(store, tmp_path, cli):
    """--zero-shot-start: the untrained head scores exactly zero-shot CLIP (g = 0), the gate trains, config.yaml
    says it is no paper's, and the report's row says so too."""
    r = cli("train-head", "--features", store, "--method", "prota", "--epochs", 2, "--batch-size", 32,
            "--zero-shot-start", "--out", tmp_path / "z")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "z" / "metrics.json").read_text())
    zero = fit(store, "meanpool", tmp_path / "zs", TrainConfig(epochs=0), progress=False)
    for d in ("t2v", "v2t"):  # g = 0: the start is zero-shot CLIP, whatever ProTA's init
        assert m["untrained_val"][d] == pytest.approx(zero["val"][d], abs=1e-9), d
    cfg = yaml.safe_load((tmp_path / "z" / "config.yaml").read_text())
    assert cfg["head"]["zero_shot_start"] is True and "no paper does this" in cfg["not_in_papers"]["zero_shot_start"]
    if m["selected_epoch"] > 0:
        assert m["zero_shot_gate"] != 0.0
    assert f"score = zero-shot cosine + {m['zero_shot_gate']:.3g} x the prota score" in " ".join(r.output.split())
    plain = cli("train-head", "--features", store, "--method", "prota", "--epochs", 1, "--batch-size", 32,
                "--out", tmp_path / "p")
    assert plain.exit_code == 0, plain.output
    assert "not_in_papers" not in yaml.safe_load((tmp_path / "p" / "config.yaml").read_text())
    r = cli("report", tmp_path / "z", tmp_path / "p", "--out", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "prota (epochs=2) + zero-shot start (not in the papers)" in text
    assert "| prota (epochs=1) |" in text


@pytest.mark.parametrize("n_train, carved", [(9000, 900), (20000, 1000), (2000, 400), (500, 100), (160, 32)])
def test_a_carved_validation_set_has_a_floor_of_500_videos_where_the_train_split_allows(n_train, carved):
    """10 % of the train videos, at least 500 where that is at most 20 % of them, at most 1,000: a paired R@1
    difference on 200 validation videos has an sd of 2.9 points, on 500 of 1.65 (docs/training.md)."""
    from tvrpipe.training.data import split_rows

    v = np.array(["train"] * n_train + ["test"] * 10)
    rows = split_rows(v, v, np.arange(len(v)), "store")
    assert len(rows.val_videos) == carved and len(rows.train_videos) == n_train - carved
    assert not set(rows.val_videos) & set(rows.train_videos)
    assert rows.val_source.startswith(f"carved from train: {carved} videos")


def test_a_recipe_that_starts_from_clip_on_a_generated_store_says_so_and_trains(store, tmp_path, cli):
    """seqtransf-msrvtt asks for init_from_clip (CLIP4Clip copies CLIP's text transformer); a generated store
    has no CLIP, so the run says so in one line and keeps the head's own initialisation; asked for without a
    recipe, --init-from-clip is refused there."""
    r = cli("train-head", "--features", store, "--recipe", "seqtransf-msrvtt", "--epochs", 1, "--batch-size", 32,
            "--set", "num_heads=2", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert said.count("starts seqtransf from CLIP") == 1, r.output
    assert "no CLIP made its features, so seqtransf keeps its own initialisation" in said
    cfg = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert cfg["train"]["init_from_clip"] is False and cfg["resolved"]["init_from_clip"] is None
    r = cli("train-head", "--features", store, "--method", "seqtransf", "--init-from-clip", "--epochs", 1,
            "--out", tmp_path / "x")
    assert r.exit_code == 1 and "no CLIP made its features" in " ".join(r.output.split())
