"""``tvrpipe sweep``: the grid it plans, its tables, and a run against a real ``ray start --head`` cluster."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from tvrpipe.errors import ConfigError
from tvrpipe.sweep import plan_sweep, summarize
from tvrpipe.worlds.features import GenSpec, generate_store

BIN = Path(sys.executable).parent
STORE = GenSpec(train_videos=40, val_videos=10, test_videos=20, captions_per_train_video=2,
                captions_per_test_video=1, frames=4, max_words=6, embed_dim=16, concepts=30, intrinsic_dim=8)


def test_plan_sweeps_each_key_only_where_it_applies():
    runs = plan_sweep(["meanpool", "xpool"], [0, 1], ["num_heads=1,2", "train.lr=1e-3,1e-2"])
    names = sorted(r.name for r in runs)
    # meanpool has no num_heads: 2 lrs x 2 seeds; xpool: 2 num_heads x 2 lrs x 2 seeds
    assert len(runs) == 4 + 8
    assert "meanpool__train.lr=0.001__seed0" in names
    assert "xpool__num_heads=2__train.lr=0.01__seed1" in names
    x = next(r for r in runs if r.name == "xpool__num_heads=2__train.lr=0.01__seed1")
    assert (x.method, x.seed, x.head, x.train) == ("xpool", 1, {"num_heads": 2}, {"lr": 0.01})
    assert x.swept == {"num_heads": 2, "train.lr": 0.01}
    # a bare trainer key, a method-scoped key, JSON values with commas inside brackets
    runs = plan_sweep(["xpool"], [3], ["batch_size=16,32", "xpool.dropout=0.0"])
    assert [(r.train, r.head) for r in runs] == [({"batch_size": 16}, {"dropout": 0.0}),
                                                 ({"batch_size": 32}, {"dropout": 0.0})]


@pytest.mark.parametrize("methods,seeds,sets,message", [
    (["nope"], [0], [], "--methods: unknown head 'nope'"),
    (["xpool"], [], [], "must be non-empty"),
    (["xpool"], [0, 0], [], "each entry once"),
    (["meanpool"], [0], ["num_heads=1,2"], "no listed method has a config key 'num_heads'"),
    (["xpool"], [0], ["seed=1,2"], "seeds are swept with --seeds"),
    (["xpool"], [0], ["tmass.num_heads=1"], "'tmass' is neither 'train' nor a method of --methods"),
    (["xpool"], [0], ["num_heads=1,x"], "--set num_heads=x: not a valid int"),
    # the key as typed, and the type in words (not train's field name, nor `float | None`)
    (["xpool"], [0], ["train.lr=abc"], "--set train.lr=abc: not a valid float or none"),
    (["xpool"], [0], ["xpool.num_heads=x"], "--set xpool.num_heads=x: not a valid int"),
    (["xpool"], [0], ["train.memory_budget=abc"], "--set train.memory_budget 'abc': give a size above 0"),
    (["xpool"], [0], ["train.lr=1e-3,1e-3"], "a value is listed twice"),
    (["xpool"], [0], ["lr"], "--set expects key=value"),
])
def test_plan_rejects_bad_options(methods, seeds, sets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_sweep(methods, seeds, sets)


def test_summarize_mean_and_sample_std_over_seeds():
    table = pd.DataFrame([
        {"run": "a0", "method": "a", "seed": 0, "k": 1, "status": "done", "error": "", "t2v R@1": 10.0},
        {"run": "a1", "method": "a", "seed": 1, "k": 1, "status": "skipped", "error": "", "t2v R@1": 14.0},
        {"run": "a2", "method": "a", "seed": 2, "k": 1, "status": "done", "error": "", "t2v R@1": 15.0},
        {"run": "b0", "method": "a", "seed": 0, "k": 2, "status": "failed", "error": "x", "t2v R@1": np.nan},
        {"run": "c0", "method": "c", "seed": 0, "k": np.nan, "status": "done", "error": "", "t2v R@1": 7.0},
    ])
    res = summarize(table).set_index(["method", "k"])
    a = res.loc[("a", 1)]
    assert a["n_seeds"] == 3 and a["failed"] == 0
    assert a["t2v R@1 mean"] == pytest.approx(13.0)
    assert a["t2v R@1 std"] == pytest.approx(np.std([10.0, 14.0, 15.0], ddof=1))
    b = res.loc[("a", 2)]
    assert b["n_seeds"] == 0 and b["failed"] == 1 and np.isnan(b["t2v R@1 mean"])
    c = res.loc[("c", np.nan)] if ("c", np.nan) in res.index else res.xs("c", level="method").iloc[0]
    assert c["t2v R@1 mean"] == 7.0 and np.isnan(c["t2v R@1 std"])  # one seed: no spread


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head():
    """A real local Ray cluster from ``ray start --head`` (token authentication on), torn down after."""
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    log = Path(temp) / "head.log"
    with log.open("w") as f:
        head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard",
             "false", "--disable-usage-stats", "--temp-dir", temp, "--block"],
            stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, f"ray start failed:\n{log.read_text()[-2000:]}"
            assert time.time() < deadline, f"ray start did not come up:\n{log.read_text()[-2000:]}"
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        os.killpg(head.pid, signal.SIGKILL)  # the whole session: gcs, raylet, workers
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def _sweep(args, env):
    return subprocess.run([str(BIN / "tvrpipe"), "sweep", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_run_at_an_earlier_default_lr_or_on_a_replaced_store_is_not_complete(tmp_path, monkeypatch):
    """After a head's default_lr changes, a sweep reruns (rather than skips) the runs that relied on
    it, and fit refuses their directory with a message that names both learning rates. A store
    regenerated at the same path is another store: its old runs are not complete either."""
    import dataclasses

    from tvrpipe.features.store import IDENTITY_KEYS, open_store
    from tvrpipe.heads.base import head_class
    from tvrpipe.sweep import _is_complete
    from tvrpipe.training.fit import TrainConfig, fit, store_head_config

    store = generate_store(tmp_path / "store", STORE)
    train = TrainConfig(epochs=1, batch_size=8)
    fit(store, "xpool", tmp_path / "run", train, progress=False)
    head = dataclasses.asdict(store_head_config(open_store(store), "xpool"))
    args = (tmp_path / "run", "xpool", head, dataclasses.asdict(train), (tmp_path / "store").resolve(), ())
    assert _is_complete(*args)
    identity = {k: open_store(store).provenance.get(k) for k in IDENTITY_KEYS}
    assert _is_complete(*args, identity)
    assert not _is_complete(*args, {**identity, "manifest_sha256": "0" * 64})  # the store replaced in place
    monkeypatch.setattr(head_class("xpool"), "default_lr", {16: 1e-3, 512: 1e-4})  # a table, the same lr at D=16
    assert _is_complete(*args)  # only the lr's label changed ("xpool.default_lr at D=16"): the same run
    assert fit(store, "xpool", tmp_path / "run", train, progress=False)["schedule"]["lr"] == 1e-3
    monkeypatch.setattr(head_class("xpool"), "default_lr", {16: 2e-3, 512: 1e-4})
    assert not _is_complete(*args)
    with pytest.raises(ConfigError, match=r"run was trained at lr 0.001 \(xpool.default_lr at D=16\), and xpool.default_lr "
                                          r"at D=16 is now 0.002; choose another --out \(add --lr 0.001 to"):
        fit(store, "xpool", tmp_path / "run", train, progress=False)


def test_sweep_on_a_ray_start_cluster(tmp_path, ray_head, interrupt_call):
    address, env = ray_head
    store = generate_store(tmp_path / "store", STORE)
    out = tmp_path / "sweep"
    args = ["--features", store, "--methods", "meanpool,xpool", "--seeds", "0,1", "--set", "num_heads=1,3",
            "--epochs", "2", "--batch-size", "16", "--post", "dsl", "--address", address, "--out", out]

    # an interrupted run (stopped after its first epoch), which the sweep must resume, not restart
    import tvrpipe.training.fit as fitmod
    from tvrpipe.training.fit import TrainConfig, fit

    restore = interrupt_call(fitmod, "evaluate_split", 3)  # the untrained head, epoch 1, then stops in epoch 2
    interrupted = out / "xpool__num_heads=1__seed1"
    with pytest.raises(KeyboardInterrupt):
        fit(store, "xpool", interrupted, TrainConfig(epochs=2, batch_size=16, seed=1), {"num_heads": 1}, ("dsl",),
            progress=False)
    restore()
    first_epoch = pd.read_csv(interrupted / "epochs.csv")
    assert len(first_epoch) == 1 and not (interrupted / "metrics.json").exists()

    r = _sweep(args, env)
    assert r.returncode == 1, r.stdout + r.stderr  # two runs fail, the others finish
    text = " ".join(r.stdout.split())
    for seed in (0, 1):
        assert (f"failed xpool__num_heads=3__seed{seed}: xpool: embed_dim 16 is not divisible by num_heads 3"
                in text), text
    assert "4 trained, 0 already complete (skipped), 2 failed" in text
    resumed = pd.read_csv(interrupted / "epochs.csv")
    assert len(resumed) == 2 and resumed.iloc[0]["loss"] == first_epoch.iloc[0]["loss"]

    runs = pd.read_csv(out / "runs.csv")
    assert sorted(runs["run"]) == sorted(["meanpool__seed0", "meanpool__seed1"] + [
        f"xpool__num_heads={h}__seed{s}" for h in (1, 3) for s in (0, 1)])
    assert pd.read_parquet(out / "runs.parquet")["run"].tolist() == runs["run"].tolist()
    done = runs[runs["status"] == "done"]
    assert len(done) == 4
    for _, row in done.iterrows():  # each row is its run directory's metrics.json
        metrics = json.loads((out / row["run"] / "metrics.json").read_text())
        assert row["t2v R@1"] == pytest.approx(metrics["test"]["t2v"]["R@1"])
        assert row["v2t_dsl MnR"] == pytest.approx(metrics["test"]["v2t_dsl"]["MnR"])
        config = (out / row["run"] / "config.yaml").read_text()
        assert f"seed: {row['seed']}" in config
    results = pd.read_parquet(out / "results.parquet")
    assert pd.read_csv(out / "results.csv").shape == results.shape
    x1 = results[(results["method"] == "xpool") & (results["num_heads"] == 1)].iloc[0]
    per_seed = [json.loads((out / f"xpool__num_heads=1__seed{s}" / "metrics.json").read_text())["test"]["t2v"]["R@1"]
                for s in (0, 1)]
    assert x1["n_seeds"] == 2
    assert x1["t2v R@1 mean"] == pytest.approx(np.mean(per_seed))
    assert x1["t2v R@1 std"] == pytest.approx(np.std(per_seed, ddof=1))
    x3 = results[(results["method"] == "xpool") & (results["num_heads"] == 3)].iloc[0]
    assert x3["n_seeds"] == 0 and x3["failed"] == 2

    # a rerun skips what is complete and retries only the failures
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.json")}
    r = _sweep(args, env)
    assert r.returncode == 1
    assert "0 trained, 4 already complete (skipped), 2 failed" in " ".join(r.stdout.split())
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/metrics.json")} == stamps

    # without --address a command starts its own Ray, even with a `ray start` cluster on this machine
    local_env = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    r = _sweep(["--features", store, "--methods", "meanpool", "--seeds", "5", "--epochs", "1", "--out",
                tmp_path / "local"], local_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "local" / "meanpool__seed5" / "metrics.json").is_file()

    # a memory budget below the store's splits: each run streams them, as train-head does, and says so
    r = _sweep(["--features", store, "--methods", "meanpool", "--seeds", "6", "--epochs", "1", "--batch-size", "8",
                "--memory-budget", "20kB", "--out", tmp_path / "streamed"], local_env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = yaml.safe_load((tmp_path / "streamed" / "meanpool__seed6" / "config.yaml").read_text())["data"]
    assert data["mode"] == "streamed" and data["budget"] == "20.0 kB (--memory-budget)"


def test_sweep_names_an_unreachable_cluster(tmp_path):
    store = generate_store(tmp_path / "store", STORE)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    r = _sweep(["--features", store, "--methods", "meanpool", "--seeds", "0", "--epochs", "1",
                "--address", f"127.0.0.1:{_free_port()}", "--out", tmp_path / "o"], env)
    assert r.returncode == 1
    assert "--address 127.0.0.1:" in r.stderr and "cannot connect to the Ray cluster" in r.stderr, r.stderr


def test_a_second_sweep_into_the_same_out_is_refused_while_the_first_runs(tmp_path, cli):
    """The sweep holds its --out's lock, as stores and runs do: two sweeps cannot fail each other's runs or
    overwrite each other's runs.csv. Nothing is started (no Ray) when the lock is held."""
    from tvrpipe.lock import DirLock

    store = generate_store(tmp_path / "s", GenSpec(train_videos=8, test_videos=4, frames=4, max_words=6,
                                                   embed_dim=8, seed=0))
    first = DirLock(tmp_path / "w", "--out")  # the first sweep, holding its --out
    try:
        r = cli("sweep", "--features", store, "--methods", "meanpool", "--seeds", "0", "--out", tmp_path / "w")
        text = " ".join(r.output.split())
        assert r.exit_code == 1 and f"{tmp_path / 'w'} is being written by" in text and "another --out" in text, r.output
        assert not (tmp_path / "w" / "runs.csv").exists() and not (tmp_path / "w" / "meanpool__seed0").exists()
    finally:
        first.release()


def test_a_swept_memory_budget_reads_sizes_as_train_head_does():
    from tvrpipe.config import parse_memory

    [run] = plan_sweep(["xpool"], [0], ["train.memory_budget=2GB"])
    assert run.train["memory_budget"] == parse_memory("2GB", "--memory-budget") == 2 * 10**9
    runs = plan_sweep(["xpool"], [0], ["train.memory_budget=3,none"])
    assert [r.train["memory_budget"] for r in runs] == [3 * 2**30, None]  # a bare number is GiB, as train-head's
