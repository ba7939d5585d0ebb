"""``tvrpipe bench extract`` runs end to end (tiny model and videos) and reports sane numbers."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys

import pytest
import yaml

# the bench-convergence tests' store (64 train videos, D = 16) and trainer (stops within 6 epochs)
TINY_STORE = dict(train_videos=64, val_videos=100, test_videos=16, captions_per_train_video=2, frames=4,
                  max_words=6, embed_dim=16, seed=2)
TINY_TRAINER = dict(batch_size=32, min_steps=4, patience=2, max_epochs=6)


def test_bench_extract_cli(tmp_path):
    out = tmp_path / "b"
    r = subprocess.run(
        [sys.executable, "-m", "tvrpipe", "bench", "extract", "--out", str(out), "--videos", "4",
         "--width", "96", "--height", "64", "--seconds", "1", "--fps", "12", "--model", "tvrpipe-tiny",
         "--batch-size", "1", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = " ".join(r.stdout.split())
    res = json.loads((tmp_path / "r.json").read_text())
    for key in ("decode", "encode", "bound", "naive"):
        assert res[key] > 0, key
    # both executors ran, each in its own process; 4 tiny videos are too little work for a marginal rate to rise
    # above the noise: the bench reports either a positive rate or NaN (said so in its output), never a negative one
    assert list(res["pipelines"]) == ["local", "ray"]
    for name, run in res["pipelines"].items():
        assert run["marginal"] > 0 or (run["marginal"] != run["marginal"] and "too little work" in text), name
        assert run["end_to_end"] == pytest.approx(4 / run["seconds"]) and 0 < run["encoder_busy"] <= 1
        assert res["vs_peer_end_to_end"][name] == pytest.approx(res["peer_seconds"] / run["seconds"])
        steps = run["startup"]
        assert list(steps)[:3] == ["python", "checks", "workers"] and {"weights", "first_decode", "first_batch"} <= set(steps)
        assert steps["workers"] <= steps["first_decode"] <= steps["first_batch"] and steps["weights"] <= steps["first_batch"]
        assert 0 < steps["python"] and max(steps.values()) < run["seconds"], steps
        assert f"tvrpipe {name} / peer: end to end" in text and "first video decoded at" in text
    # the shared-CPU bound is below both stages and equals its formula
    assert res["bound"] < min(res["decode"], res["encode"])
    assert abs(1 / res["bound"] - (1 / res["decode"] + 1 / res["encode"])) < 1e-9
    local = res["pipelines"]["local"]["marginal"]
    if local > 0:
        assert abs(res["vs_bound"] - local / res["bound"]) < 1e-9
    assert "pipeline / bound" in text and "pipeline / naive" in text
    # the peer loop ran in its own process; its start-up steps are in order, from that process's start
    assert res["peer"] > 0 and 0 < res["peer_end_to_end"] == pytest.approx(4 / res["peer_seconds"])
    assert list(res["peer_startup"]) == ["python", "imports", "weights", "first_video"]
    times = list(res["peer_startup"].values())
    assert 0 < times[0] and times == sorted(times) and times[-1] < res["peer_seconds"]
    d, e = res["decode"], res["encode"]
    assert res["ceiling"] == pytest.approx((res["cpus"] / d + 1 / e) / (1 / d + 1 / e))
    assert len(list((out / "videos").glob("bench_*.mp4"))) == 4
    assert not (out / "features").exists()  # measurement stores are removed


def test_bench_rejects_too_few_videos(cli, tmp_path):
    r = cli("bench", "extract", "--out", tmp_path, "--videos", "3", "--batch-size", "4")
    assert r.exit_code == 1 and "--videos must be at least 2 x --batch-size (8), got 3" in r.output
    r = cli("bench", "extract", "--out", tmp_path / "b", "--precision", "fp16")  # before any video is rendered
    assert r.exit_code == 1 and "--precision fp16 needs --device cuda" in r.output
    assert not (tmp_path / "b").exists()


def test_bench_convergence_tables_and_curves(tmp_path):
    import csv

    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(train_videos=96, val_videos=32, test_videos=16, captions_per_train_video=2, frames=4,
                   max_words=6, embed_dim=16, seed=1)
    from tvrpipe.heads.base import head_class

    lr0 = head_class("xpool").default_lr
    lrs = (lr0, lr0 * 10)
    from tvrpipe.training.fit import TrainConfig

    base = TrainConfig(batch_size=32, min_steps=10, patience=3, max_epochs=12)  # small: seconds, not minutes
    rows = bench_convergence(tmp_path, {"tiny": spec}, ["xpool"], lrs=lrs, epochs=(2,), progress=False, train=base)
    with open(tmp_path / "results.csv") as f:
        runs = list(csv.DictReader(f))
    assert [(r["schedule"], float(r["lr"])) for r in runs] == [
        ("epochs=2", lrs[0]), ("epochs=2", lrs[1]), ("open", lrs[0]), ("open", lrs[1]), ("default", lr0)]
    grid = max(float(r["val_r1"]) for r in runs if r["schedule"] == "epochs=2")
    default = next(r for r in runs if r["schedule"] == "default")
    assert rows[0]["grid_best_r1"] == grid and rows[0]["default_r1"] == float(default["val_r1"])
    assert rows[0]["gap"] == grid - float(default["val_r1"])
    # the default run is the open-ended run at the head's default lr (same configuration and seed)
    same = next(r for r in runs if r["schedule"] == "open" and float(r["lr"]) == lr0)
    assert same["val_r1"] == default["val_r1"] and same["epochs_run"] == default["epochs_run"]
    with open(tmp_path / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert sum(r["schedule"] == "epochs=2" for r in curves) == 4  # two runs x two epochs
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # a second bench in the same directory reuses the recorded runs (a long bench resumes)
    again = bench_convergence(tmp_path, {"tiny": spec}, ["xpool"], lrs=lrs, epochs=(2,), progress=False, train=base)
    assert again == rows


def test_bench_eval_cli_reports_time_and_memory_per_head(cli, tmp_path, monkeypatch):
    """`tvrpipe bench eval` on a tiny size: each head evaluated in its own process through the
    engine, on random features; untrained heads on random features sit near chance."""
    import tvrpipe.bench.heads as tb

    monkeypatch.setitem(tb.EVAL_SIZES, "tiny", (90, 30))  # 3 captions per video (multi-caption, as MSVD)
    r = cli("bench", "eval", "--method", "tmass", "--method", "meanpool", "--size", "tiny", "--dim", "16",
            "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(x["size"], x["method"], x["n_texts"], x["n_videos"]) for x in rows] == [
        ("tiny", "tmass", 90, 30), ("tiny", "meanpool", 90, 30)]
    for x in rows:
        assert x["seconds"] > 0 and x["extra_gb"] >= 0
        assert x["scores_gb"] == 90 * 30 * 4 / 2**30
        assert 0 <= x["t2v_R@1"] <= 40  # chance is 1/30: no signal in random features
    assert rows[0]["official_seconds"] is None  # the official figures are for the 1k-A size only


def test_bench_eval_rejects_unknown_size(cli):
    r = cli("bench", "eval", "--size", "huge")
    assert r.exit_code == 1 and "--size 'huge' is not one of: msrvtt1k, msvd" in r.output


def test_bench_allocator_cli_times_a_step_with_and_without_the_tuning(cli, tmp_path):
    """`tvrpipe bench allocator`: each head steps in two fresh processes, one tuned as train-head
    tunes it and one on glibc's defaults; with the defaults, X-Pool's (B, B, D) temporaries (4 MiB
    at D = 64) are faulted in afresh every step, tuned they are reused."""
    r = cli("bench", "allocator", "--method", "xpool", "--dim", "64", "--steps", "3",
            "--json", tmp_path / "new" / "a.json")  # --json's folder is created
    assert r.exit_code == 0, r.output
    (row,) = json.loads((tmp_path / "new" / "a.json").read_text())
    assert (row["method"], row["dim"], row["batch_size"]) == ("xpool", 64, 128)
    assert row["speedup"] == pytest.approx(row["step_seconds_default"] / row["step_seconds_tuned"])
    assert row["peak_rss_gb_tuned"] > 0 and row["peak_rss_gb_default"] > 0
    if platform.libc_ver()[0] == "glibc":
        assert row["allocator"].startswith("glibc: blocks up to")
        assert row["faults_per_step_default"] > max(1024, 4 * row["faults_per_step_tuned"]), row  # 1,024 pages a block
    assert "xpool" in r.output and f"{row['speedup']:.2f}x" in r.output
    r = cli("bench", "allocator", "--steps", "0")
    assert r.exit_code == 2 and "--steps must be >= 1" in r.output


def test_bench_step_cli_reports_each_heads_rate_against_the_reference(cli, tmp_path):
    """`tvrpipe bench step`: train-head's step for each head and width beside the reference head's (X-Pool's
    by default), in a fresh process, and the ratio of their step times; with --features, on train-head's first
    batch of a store (its width, frames and caption lengths), where --dim is refused."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    r = cli("bench", "step", "--method", "prota", "--dim", "8", "--dim", "16", "--steps", "1", "--batch-size", "4",
            "--words", "5", "--frames", "3", "--json", tmp_path / "s.json")
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(row["dim"], row["method"], row["versus"]) for row in rows] == [(8, "prota", "xpool"), (16, "prota", "xpool")]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["step_seconds"] / row["versus_step_seconds"])
        assert row["ratio"] == pytest.approx(row["versus_samples_per_s"] / row["samples_per_s"])
        assert row["samples_per_s"] == pytest.approx(4 / row["step_seconds"])
        assert (row["frames"], row["words"], row["features"]) == (3, 5, None)
        assert f"{row['ratio']:.2f}x" in r.output
    store = generate_store(tmp_path / "store", GenSpec(**TINY_STORE))
    r = cli("bench", "step", "--method", "prota", "--features", store, "--steps", "1", "--batch-size", "8",
            "--json", tmp_path / "f.json")
    assert r.exit_code == 0, r.output
    (row,) = json.loads((tmp_path / "f.json").read_text())
    assert (row["method"], row["dim"], row["frames"], row["batch_size"], row["features"]) == ("prota", 16, 4, 8,
                                                                                               str(store))
    assert 1 <= row["words"] <= TINY_STORE["max_words"]
    r = cli("bench", "step", "--features", store, "--dim", "64")
    assert r.exit_code == 1 and "--dim: with --features" in r.output, r.output
    r = cli("bench", "step", "--method", "nohead")
    assert r.exit_code == 1 and "nohead" in r.output, r.output


def _killed(_):
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does


def test_a_benchmarks_process_answers_raises_or_is_reported_dead():
    """in_fresh_process: the result; the child's own exception; a child killed (as by the OOM
    killer) is a WorkerDiedError naming the measurement, where multiprocessing.Pool hung forever."""
    import math

    from tvrpipe.bench.extract import in_fresh_process
    from tvrpipe.errors import WorkerDiedError

    assert in_fresh_process(math.sqrt, 16.0, "sqrt") == 4.0
    with pytest.raises(ValueError, match="math domain error"):
        in_fresh_process(math.sqrt, -1.0, "sqrt")
    with pytest.raises(WorkerDiedError, match=r"^prota at msvd size: its process ended without an answer "
                                              r"\(killed by SIGKILL; the kernel's out-of-memory killer"):
        in_fresh_process(_killed, None, "prota at msvd size")
    with pytest.raises(WorkerDiedError, match=r"^exit: its process ended without an answer \(exit code 3\)"):
        in_fresh_process(os._exit, 3, "exit")


@pytest.mark.parametrize("command", ["extract", "train-head", "finetune", "eval", "allocator", "step"])
def test_bench_json_is_checked_before_the_measurement(cli, tmp_path, command, monkeypatch):
    import tvrpipe.bench.extract
    import tvrpipe.bench.finetune
    import tvrpipe.bench.heads

    def measured(*a, **k):
        raise AssertionError("measured before --json was checked")

    for module, name in ((tvrpipe.bench.extract, "bench_extract"), (tvrpipe.bench.heads, "bench_train_head"),
                         (tvrpipe.bench.finetune, "bench_finetune"), (tvrpipe.bench.heads, "bench_eval"),
                         (tvrpipe.bench.heads, "bench_allocator"), (tvrpipe.bench.heads, "bench_step")):
        monkeypatch.setattr(module, name, measured)
    def said(r):  # the message without rich's box and line breaks
        return " ".join(r.output.replace("\u2502", " ").split())

    r = cli("bench", command, "--json", tmp_path)
    assert r.exit_code == 1 and "is a folder; give a file name" in said(r), r.output
    (tmp_path / "a-file").write_text("")
    r = cli("bench", command, "--json", tmp_path / "a-file" / "r.json")
    assert r.exit_code == 1 and f"{tmp_path / 'a-file'} is a file, so the folder cannot be created" in said(r), r.output


@pytest.mark.parametrize("command", ["extract", "train-head", "finetune", "convergence", "worlds", "search"])
def test_bench_out_is_checked_before_anything_is_made(cli, tmp_path, command):
    def said(r):  # the message without rich's box and line breaks
        return " ".join(r.output.replace("\u2502", " ").split())

    (tmp_path / "a-file").write_text("kept")
    r = cli("bench", command, "--out", tmp_path / "a-file")
    assert r.exit_code == 1 and f"--out {tmp_path / 'a-file'} is a file" in said(r), r.output
    assert (tmp_path / "a-file").read_text() == "kept"
    store = tmp_path / "store"
    (store / "features.zarr").mkdir(parents=True)  # the marker a feature store writes first
    for out in (store, store / "bench"):
        r = cli("bench", command, "--out", out)
        assert r.exit_code == 1 and "a feature store" in said(r) and "write into a folder of its own" in said(r), r.output
    assert sorted(p.name for p in store.iterdir()) == ["features.zarr"]


def test_bench_convergence_only_default_runs_the_default_alone_and_resumes(tmp_path, caplog):
    import csv

    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.training.fit import TrainConfig
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(**TINY_STORE)
    base = TrainConfig(**TINY_TRAINER)
    with caplog.at_level("WARNING", logger="tvrpipe.bench.convergence"):
        rows = bench_convergence(tmp_path, {"tiny": spec}, ["meanpool", "xpool"], progress=False, train=base,
                                 only_default=True)
    with open(tmp_path / "results.csv") as f:
        runs = list(csv.DictReader(f))
    assert [(r["method"], r["schedule"]) for r in runs] == [("meanpool", "default"), ("xpool", "default")]
    with open(tmp_path / "runs" / "tiny" / "xpool" / "default-0.001" / "epochs.csv") as f:
        epochs = list(csv.DictReader(f))
    lines = [r.getMessage() for r in caplog.records if ": epoch " in r.getMessage() and " xpool " in r.getMessage()]
    assert lines == [f"tiny xpool default lr 0.001: epoch {e['epoch']}, val R@1 {float(e['val_t2v_R@1']):.1f} "
                     f"({float(e['seconds']):.0f} s)" for e in epochs]  # one progress line per epoch
    assert all(r["grid_best_r1"] is None and r["gap"] is None for r in rows)
    assert 1 <= rows[1]["default_selected_epoch"] <= rows[1]["default_epochs_run"] <= 6
    assert bench_convergence(tmp_path, {"tiny": spec}, ["meanpool", "xpool"], progress=False, train=base,
                             only_default=True) == rows  # recorded runs are reused, not retrained


@pytest.fixture
def tiny_convergence_size(monkeypatch):
    """`bench convergence --size tiny`: a store of 64 train videos, D = 16, and a trainer that stops
    within 6 epochs, so the command runs end to end in seconds."""
    import functools

    import tvrpipe.bench.convergence as conv
    import tvrpipe.training.fit as fit_module
    from tvrpipe.worlds.features import GenSpec

    monkeypatch.setitem(conv.PRESETS, "tiny", GenSpec(**TINY_STORE))
    monkeypatch.setattr(fit_module, "TrainConfig", functools.partial(fit_module.TrainConfig, **TINY_TRAINER))


def test_bench_convergence_cli_only_default_prints_the_default_run(cli, tmp_path, tiny_convergence_size):
    """`tvrpipe bench convergence --only-default` end to end on a tiny store: one default run per
    head, no grid, tables written and the default's row printed."""
    import csv

    r = cli("bench", "convergence", "--out", tmp_path, "--size", "tiny", "--method", "meanpool", "--only-default")
    assert r.exit_code == 0, r.output
    with open(tmp_path / "results.csv") as f:
        assert [(x["store"], x["method"], x["schedule"]) for x in csv.DictReader(f)] == [("tiny", "meanpool", "default")]
    assert "meanpool" in r.output and (tmp_path / "summary.csv").is_file()
    r = cli("bench", "convergence", "--out", tmp_path, "--size", "huge", "--only-default")
    assert r.exit_code == 1 and "--size 'huge' is not one of: small, medium, msrvtt9k" in r.output
    r = cli("bench", "convergence", "--out", tmp_path / "new", "--size", "tiny", "--method", "nope")
    assert r.exit_code == 1 and "unknown method 'nope'; known: duq, meanpool" in r.output, r.output
    assert "from scratch" not in r.output and not (tmp_path / "new").exists()  # refused before any store


def test_bench_convergence_cli_no_grid_runs_open_ended_lrs(cli, tmp_path, tiny_convergence_size):
    """`tvrpipe bench convergence --no-grid --lr X`: the open-ended run at X and the default, no
    fixed-epoch run; the printed table names the best open lr; --only-default with it is refused."""
    import csv

    from tvrpipe.heads.base import head_class

    default_lr = head_class("xpool").default_lr
    r = cli("bench", "convergence", "--out", tmp_path, "--size", "tiny", "--method", "xpool", "--no-grid",
            "--lr", str(default_lr / 10))
    assert r.exit_code == 0, r.output
    with open(tmp_path / "results.csv") as f:
        runs = list(csv.DictReader(f))
    assert sorted((x["schedule"], float(x["lr"])) for x in runs) == [
        ("default", default_lr), ("open", default_lr / 10)]
    best = max(runs, key=lambda x: float(x["val_r1"]))  # the default is the open-ended run at its own lr
    with open(tmp_path / "summary.csv") as f:
        (summary,) = list(csv.DictReader(f))
    assert summary["grid_best"] == f"open lr {float(best['lr']):g}" and "open lr" in r.output
    default = next(x for x in runs if x["schedule"] == "default")
    assert float(summary["gap"]) == pytest.approx(float(best["val_r1"]) - float(default["val_r1"]), abs=0.06)
    assert float(summary["gap"]) >= 0
    r = cli("bench", "convergence", "--out", tmp_path, "--size", "tiny", "--no-grid", "--only-default")
    assert r.exit_code == 1 and "--only-default and --no-grid exclude each other" in r.output


def test_bench_convergence_keeps_other_heads_and_recovers_runs_missing_from_the_tables(tmp_path):
    """A bench of one head in a directory keeps the other heads' rows; completed run directories
    missing from the tables (lost by an older bench) are reused, not retrained."""
    import csv

    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(**TINY_STORE)
    from tvrpipe.training.fit import TrainConfig

    base = TrainConfig(**TINY_TRAINER)
    both = bench_convergence(tmp_path, {"tiny": spec}, ["meanpool", "xpool"], lrs=(1e-3,), epochs=(2,),
                             progress=False, train=base)
    assert bench_convergence(tmp_path, {"tiny": spec}, ["meanpool"], lrs=(1e-3,), epochs=(2,), progress=False,
                             train=base) == both[:1]
    with open(tmp_path / "results.csv") as f:
        assert {r["method"] for r in csv.DictReader(f)} == {"meanpool", "xpool"}
    with open(tmp_path / "summary.csv") as f:
        assert [r["method"] for r in csv.DictReader(f)] == ["meanpool", "xpool"]
    # the tables lost, the run directories kept: every grid and open run is rebuilt from them
    stamp = {p: p.stat().st_mtime for p in tmp_path.glob("runs/*/*/*/metrics.json")}
    (tmp_path / "results.csv").unlink()
    (tmp_path / "curves.csv").unlink()
    again = bench_convergence(tmp_path, {"tiny": spec}, ["meanpool", "xpool"], lrs=(1e-3,), epochs=(2,),
                              progress=False, train=base)
    assert {p: p.stat().st_mtime for p in tmp_path.glob("runs/*/*/*/metrics.json")} == stamp  # nothing retrained
    for a, b in zip(again, both):
        assert {k: v for k, v in a.items() if k != "default_seconds"} == \
            {k: v for k, v in b.items() if k != "default_seconds"}


def test_bench_convergence_keeps_the_rows_of_a_bench_running_beside_it(tmp_path, monkeypatch):
    """Two benches of different heads in one --out (two terminals): the runs the other one finishes
    while this one trains are in the tables this one writes (they are read again at each write)."""
    import csv
    import shutil

    import tvrpipe.bench.convergence as conv
    from tvrpipe.training.fit import TrainConfig
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(**TINY_STORE)
    base = TrainConfig(**TINY_TRAINER)
    other = conv.bench_convergence(tmp_path / "other", {"tiny": spec}, ["meanpool"], progress=False, train=base,
                                   only_default=True)
    out = tmp_path / "shared"
    run = conv._run

    def run_while_the_other_bench_finishes(*args, **kwargs):  # its run lands after this bench read the tables
        shutil.copytree(tmp_path / "other" / "runs", out / "runs", dirs_exist_ok=True)
        return run(*args, **kwargs)

    monkeypatch.setattr(conv, "_run", run_while_the_other_bench_finishes)
    mine = conv.bench_convergence(out, {"tiny": spec}, ["xpool"], progress=False, train=base, only_default=True)
    with open(out / "results.csv") as f:
        assert sorted(r["method"] for r in csv.DictReader(f)) == ["meanpool", "xpool"]
    with open(out / "summary.csv") as f:
        assert sorted(r["method"] for r in csv.DictReader(f)) == ["meanpool", "xpool"]
    assert [r["method"] for r in mine] == ["xpool"] and other[0]["method"] == "meanpool"


def test_bench_convergence_follows_a_changed_default_lr(tmp_path, monkeypatch):
    """After a head's default_lr changes, the recorded default is no longer the default: the open-ended
    run at the new lr (already measured) becomes it, or a default run at the new lr is trained in a
    folder named by its lr; the old default's row leaves the tables."""
    import csv

    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.fit import TrainConfig
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(**TINY_STORE)
    base = TrainConfig(**TINY_TRAINER)
    xpool = head_class("xpool")
    old, new, newer = xpool.default_lr, xpool.default_lr * 3, xpool.default_lr / 3

    def bench(**kw):
        bench_convergence(tmp_path, {"tiny": spec}, ["xpool"], lrs=(old, new), epochs=(2,), progress=False,
                          train=base, **kw)
        with open(tmp_path / "results.csv") as f:
            return {(r["schedule"], float(r["lr"])): r for r in csv.DictReader(f)}

    first = bench()
    assert ("default", old) in first
    monkeypatch.setattr(xpool, "default_lr", new)
    stamp = {p: p.stat().st_mtime for p in tmp_path.glob("runs/*/*/*/metrics.json")}
    second = bench(only_default=True)
    assert ("default", old) not in second
    assert second[("default", new)]["val_r1"] == first[("open", new)]["val_r1"]
    assert {p: p.stat().st_mtime for p in tmp_path.glob("runs/*/*/*/metrics.json")} == stamp  # none retrained
    monkeypatch.setattr(xpool, "default_lr", newer)  # no run at this lr yet: trained beside the old default
    third = bench(only_default=True)
    assert sorted(k for k in third if k[0] == "default") == [("default", newer)]
    assert json.loads((tmp_path / "runs" / "tiny" / "xpool" / f"default-{newer}" / "metrics.json").read_text(
    ))["schedule"]["lr"] == newer
    folders = sorted(p.name for p in (tmp_path / "runs" / "tiny" / "xpool").glob("default-*"))
    assert folders == [f"default-{newer}"]


def test_bench_convergence_reads_a_per_width_default_lr_at_each_stores_width(tmp_path, monkeypatch):
    """With a {D: lr} default_lr, each store's default run trains at its own width's lr, and a rerun
    keeps both as the current defaults (nothing retrained)."""
    import csv

    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.fit import TrainConfig
    from tvrpipe.worlds.features import GenSpec

    monkeypatch.setattr(head_class("xpool"), "default_lr", {16: 2e-3, 32: 5e-4})
    sizes = {"d16": GenSpec(**TINY_STORE), "d32": GenSpec(**{**TINY_STORE, "embed_dim": 32})}

    def bench():
        bench_convergence(tmp_path, sizes, ["xpool"], progress=False, train=TrainConfig(**TINY_TRAINER),
                          only_default=True)
        with open(tmp_path / "results.csv") as f:
            return {r["store"]: float(r["lr"]) for r in csv.DictReader(f) if r["schedule"] == "default"}

    assert bench() == {"d16": 2e-3, "d32": 5e-4}
    for store, lr in (("d16", 2e-3), ("d32", 5e-4)):
        m = json.loads((tmp_path / "runs" / store / "xpool" / f"default-{lr}" / "metrics.json").read_text())
        assert (m["schedule"]["lr"], m["schedule"]["lr_source"]) == (lr, f"xpool.default_lr at D={store[1:]}")
    stamp = {p: p.stat().st_mtime for p in tmp_path.glob("runs/*/*/*/metrics.json")}
    assert bench() == {"d16": 2e-3, "d32": 5e-4}
    assert {p: p.stat().st_mtime for p in tmp_path.glob("runs/*/*/*/metrics.json")} == stamp


def test_bench_finetune_names_its_own_options_before_rendering(cli, tmp_path):
    r = cli("bench", "finetune", "--out", tmp_path / "b", "--model", "tvrpipe-tiny", "--precision", "fp16")
    assert r.exit_code == 1 and "--precision fp16 needs --device cuda" in r.output and "--use-gpu" not in r.output
    assert not (tmp_path / "b").exists()


def test_bench_finetune_cli_reports_throughput_share_and_memory(cli, tmp_path):
    r = cli("bench", "finetune", "--out", tmp_path / "b", "--model", "tvrpipe-tiny", "--method", "meanpool",
            "--steps", "3", "--batch-size", "2", "--frames", "4", "--width", "96", "--height", "64",
            "--seconds", "1", "--loader-workers", "1", "--chunk-size", "1", "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["chunk_size"] == 1 and "chunks of 1" in r.output  # the run trained a pair at a time
    assert yaml.safe_load((tmp_path / "b" / "run" / "config.yaml").read_text())["execution"]["chunk_size"] == 1
    assert res["clips_per_s"] > 0 and res["clips_per_s_epoch"] > 0
    assert 0 <= res["data_share"] <= 1 and 0 <= res["data_share_epoch"] <= 1
    assert 0.1 < res["peak_rss_gb"] < 24 and res["peak_gpu_gb"] is None
    assert res["videos"]["count"] == 2 * 3 + 4 and res["steps"] == 3
    assert "clips/s" in r.output and "data share" in r.output and "peak resident memory" in r.output
    import pandas as pd

    row = pd.read_csv(tmp_path / "b" / "run" / "epochs.csv").iloc[-1]
    assert res["clips_per_s"] == row["clips_per_s_steady"]  # the bench reports the run's own measurement


def test_bench_convergence_resumes_an_interrupted_run_and_sums_its_seconds(tmp_path, interrupt_call):
    """A bench interrupted inside a run resumes that run from its last epoch (the epochs already
    trained are kept, not retrained) and reports the wall time of all its epochs."""
    import csv

    import tvrpipe.training.fit as fit_module
    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.training.fit import TrainConfig
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(**TINY_STORE)
    base = TrainConfig(**TINY_TRAINER)
    restore = interrupt_call(fit_module, "evaluate_split", 4)  # the untrained head, epochs 1 and 2, then Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        bench_convergence(tmp_path, {"tiny": spec}, ["xpool"], progress=False, train=base, only_default=True)
    run = next((tmp_path / "runs" / "tiny" / "xpool").glob("default-*"))
    with open(run / "epochs.csv") as f:
        before = list(csv.DictReader(f))
    assert [r["epoch"] for r in before] == ["1", "2"] and not (run / "metrics.json").exists()

    restore()
    rows = bench_convergence(tmp_path, {"tiny": spec}, ["xpool"], progress=False, train=base, only_default=True)
    with open(run / "epochs.csv") as f:
        after = list(csv.DictReader(f))
    assert after[:2] == before  # resumed: the first two epochs (and their seconds) are not retrained
    assert len(after) == rows[0]["default_epochs_run"] > 2
    assert rows[0]["default_seconds"] == pytest.approx(sum(float(r["seconds"]) for r in after), abs=0.06)
    m = json.loads((run / "metrics.json").read_text())
    assert m["train"]["seconds"] == pytest.approx(sum(float(r["seconds"]) for r in after))


def test_bench_convergence_no_grid_compares_open_ended_lrs(tmp_path):
    """--no-grid: the open-ended run at each lr and the default, no fixed-epoch run; the summary's
    target is then the best open-ended run, and the gap is measured against it."""
    import csv

    from tvrpipe.bench.convergence import bench_convergence
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.fit import TrainConfig
    from tvrpipe.worlds.features import GenSpec

    spec = GenSpec(**TINY_STORE)
    base = TrainConfig(**TINY_TRAINER)
    default_lr = head_class("xpool").default_lr
    lrs = (default_lr / 10, default_lr)
    rows = bench_convergence(tmp_path, {"tiny": spec}, ["xpool"], lrs=lrs, progress=False, train=base, no_grid=True)
    with open(tmp_path / "results.csv") as f:
        runs = list(csv.DictReader(f))
    assert sorted((r["schedule"], float(r["lr"])) for r in runs) == [
        ("default", default_lr), ("open", default_lr / 10), ("open", default_lr)]
    best = max((r for r in runs if r["schedule"] == "open"), key=lambda r: float(r["val_r1"]))
    default = next(r for r in runs if r["schedule"] == "default")
    assert default["val_r1"] == next(r["val_r1"] for r in runs if (r["schedule"], float(r["lr"])) ==
                                     ("open", default_lr))  # the same run, reused
    assert rows[0]["grid_best"] == f"open lr {float(best['lr']):g}"
    assert rows[0]["gap"] == pytest.approx(float(best["val_r1"]) - float(default["val_r1"]))
    assert len(list((tmp_path / "runs" / "tiny" / "xpool").iterdir())) == 2  # no fixed-epoch run


def test_bench_search_cli_measures_both_searches_and_their_recall(cli, tmp_path):
    """`tvrpipe bench search` end to end at a tiny size (600 videos, D = 32, two heads trained two epochs):
    every arm timed and measured in its own process; the two stages' recall@10 against the exhaustive top 10
    is 1.0 at K = the collection, never falls as K grows, and names the K reaching 0.95; a rerun reuses the
    stores and the trained runs."""
    out = tmp_path / "b"

    def bench(*args):
        return cli("bench", "search", "--out", out, "--videos", "600", "--queries", "6", "--dim", "32",
                   "--train-videos", "64", "--train-epochs", "2", *args)

    r = bench("--candidates", "20", "--candidates", "600", "--method", "meanpool",
              "--method", "xpool", "--latency-queries", "3", "--first-stage", "exact", "--json", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "r.json").read_text())
    assert res == json.loads((out / "results.json").read_text())
    assert (res["videos"], res["queries"], res["dim"], res["candidates"]) == (600, 6, 32, [20, 600])
    assert res["first_stage"] == "exact" and res["index_seconds"] > 0 and res["first_stage_seconds"] > 0
    assert 0.05 < res["index_peak_gb"] < 8 and (res["exhaustive_queries"], res["latency_queries"]) == (6, 3)
    hit = [res["first_stage_hit"][k] for k in ("20", "600")]
    assert hit == sorted(hit) and hit[-1] == 1.0  # every query's video is in a shortlist of the whole collection
    assert list(res["trained"]) == ["meanpool", "xpool"]
    assert all(0 <= t["test_R@1"] <= 100 and t["epochs_run"] == 2 and 0 <= t["selected_epoch"] <= 2
               for t in res["trained"].values())
    said = " ".join(r.output.split())
    assert res["train_epochs"] == 2 and "heads trained 2 epochs on 64 videos" in said
    assert "6 held-out queries searched as one batch (exhaustively: 6 of them), 3 also one at a time" in said
    assert "xpool: trained 2 epochs (selected" in r.output
    for method in ("meanpool", "xpool"):
        rows = [x for x in res["rows"] if x["method"] == method]
        assert [x["candidates"] for x in rows] == [None, 20, 600]
        for x in rows:
            assert x["seconds"] > 0 and x["qps"] == pytest.approx(6 / x["seconds"])
            assert x["peak_gb"] > 0 and (x["extra_gb"] is None or x["extra_gb"] >= 0)
            assert 0 <= x["r1"] <= x["r10"] <= 100
            # one query alone, timed for the two stages (3 queries): a median at most the 95th percentile
            assert (x["p50_ms"] is None) == (x["candidates"] is None)
            assert x["p50_ms"] is None or 0 < x["p50_ms"] <= x["p95_ms"]
        full, two = rows[0], rows[1:]
        assert full["recall"] == 1.0 and full["encoded"] == 600
        if method == "meanpool":  # its scores are the first stage's cosines: the two stages encode no video
            assert all(x["encoded"] == 0 for x in two)
        else:
            assert all(x["encoded"] <= min(600, 6 * x["candidates"]) for x in two) and two[-1]["encoded"] == 600
        recall = [x["recall"] for x in two]
        assert recall == sorted(recall) and recall[-1] == 1.0  # K = n: the exhaustive search itself
        assert (two[-1]["r1"], two[-1]["r10"]) == (full["r1"], full["r10"])
        assert res["k_reaching"][method] == next(x["candidates"] for x in two if x["recall"] >= 0.95)
    # meanpool ranks as the first stage does (the same pooled cosine): its top 10 is in any shortlist of 10+
    assert res["k_reaching"]["meanpool"] == 20
    assert "exhaustive" in r.output and "meanpool: K = 20 reaches recall@10" in r.output
    chunks = "stores/*/features.zarr/*/*/c/**/*"
    stores = {p: p.stat().st_mtime for p in out.glob(chunks) if p.is_file()}
    runs = {p: p.stat().st_mtime for p in out.glob("runs/*/*/metrics.json")}
    assert {p.relative_to(out).parts[1] for p in stores} == {"collection-600-d32-s0", "benchmark-64-d32-s0"}
    assert {p.parent.name for p in runs} == {"meanpool-2ep", "xpool-2ep"}
    # a rerun: the stores and the run are reused; the exhaustive search runs on 2 of the 6 queries; xpool encodes
    # every video once and its searches read those encodings: the same hits as from the frames
    first = {x["candidates"]: x for x in res["rows"] if x["method"] == "xpool"}
    r = bench("--candidates", "600", "--method", "xpool", "--exhaustive-queries", "2", "--latency-queries", "0",
              "--first-stage", "exact", "--encoded-videos")
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    full, two = res["rows"]
    assert res["exhaustive_queries"] == 2 and full["qps"] == pytest.approx(2 / full["seconds"])
    assert two["qps"] == pytest.approx(6 / two["seconds"]) and two["recall"] == 1.0 and two["p50_ms"] is None
    assert (two["r1"], two["r10"]) == (first[600]["r1"], first[600]["r10"])
    from tvrpipe.bench.search import encodings_bytes

    enc = res["trained"]["xpool"]["encoded"]
    assert res["encoded_videos"] and enc["seconds"] > 0 and enc["peak_gb"] > 0
    assert enc["bytes_per_video"] == encodings_bytes(["xpool"], 32, res["frames"])
    assert enc["bytes"] >= 600 * enc["bytes_per_video"] and "xpool: every video encoded once in" in r.output
    assert len(list(out.glob("stores/collection-600-d32-s0/search-encoded/*/encoded.json"))) == 1
    assert {p: p.stat().st_mtime for p in out.glob(chunks) if p.is_file()} == stores
    assert {p: p.stat().st_mtime for p in out.glob("runs/*/*/metrics.json")} == runs
    # the distilled first stage: fitted to xpool after its (reused) training, its build measured; the zero-shot
    # shortlist's recall it is compared with is the first run's two-stage recall with the exact pooled stage
    xpool_exact = {x["candidates"]: x["recall"] for x in (json.loads((tmp_path / "r.json").read_text()))["rows"]
                   if x["method"] == "xpool"}
    r = bench("--candidates", "20", "--candidates", "600", "--method", "xpool", "--first-stage-set", "steps=5",
              "--first-stage-set", "dim=8", "--latency-queries", "0")  # head (xpool's: distilled): the default
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    built = res["trained"]["xpool"]["first_stage"]
    assert res["first_stage"].startswith("head, built for each head") and built["seconds"] > 0 and built["bytes"] > 600 * 3 * 8 * 4
    assert built["fit"]["head_pairs"] > 0 and built["describe"].startswith("distilled: 3 segments x 8 dims")
    assert res["zero_shot_recall"]["xpool"] == {"20": pytest.approx(xpool_exact[20]), "600": 1.0}
    assert [x["recall"] for x in res["rows"]][-1] == 1.0 and "its first stage's / the zero-shot pooled shortlist" in r.output


def test_a_large_collection_captions_only_its_query_pool():
    """bench search's collection: up to QUERY_POOL videos all have a caption (the spec as before); beyond it only
    the pool does, or as many as the queries asked for; the benchmark the heads train on is captioned whole."""
    from tvrpipe.bench.search import QUERY_POOL, benchmark_spec, collection_spec

    assert collection_spec(6000, 64).captioned_test_videos is None
    big = collection_spec(1_000_000, 512)
    assert (big.captioned_test_videos, big.n_texts) == (QUERY_POOL, QUERY_POOL)
    assert big.store_bytes() < 14 * 10**9  # the frames' 12 GB and a little: not the 44 GB of a caption per video
    assert collection_spec(1_000_000, 512, captioned=20_000).n_texts == 20_000
    assert benchmark_spec(big, 2000).captioned_test_videos is None


def test_bench_search_refuses_bad_options_before_any_store(cli, tmp_path):
    out = tmp_path / "b"
    for args, said in ((("--candidates", "5"), "--candidates 5: each K must be between 10"),
                       (("--videos", "600", "--candidates", "700"), "--candidates 700: each K must be between 10"),
                       (("--queries", "0"), "--queries 0: between 1 and --videos"),
                       (("--queries", "8", "--exhaustive-queries", "9"), "--exhaustive-queries 9: between 1 and --queries"),
                       (("--latency-queries", "-1"), "--latency-queries -1: between 0 and --queries"),
                       (("--train-epochs", "0"), "--train-epochs 0: at least 1 (leave it out to train until"),
                       (("--method", "nope"), "unknown method 'nope'"),
                       (("--first-stage-set", "nprobe=4"), "first stage distilled has no setting 'nprobe'; known: batch")):
        r = cli("bench", "search", "--out", out, *args)
        assert r.exit_code == 1 and said in r.output, r.output
    r = cli("bench", "search", "--out", out, "--json", tmp_path)
    assert r.exit_code == 1 and "is a folder" in r.output
    assert not out.exists()


def test_bench_worlds_sets_each_head_beside_zero_shot_with_intervals(cli, tmp_path):
    """One world, one head, tiny: both variants trained, each row's interval and paired difference equal to a
    bootstrap of the runs' own test ranks, the zero-shot start's untrained validation equal to zero-shot CLIP's,
    the table written, and a rerun reads the runs instead of training them again."""
    import numpy as np

    from tvrpipe.bench.worlds import bench_worlds
    from tvrpipe.evaluation.metrics import bootstrap_recall, paired_recall_difference
    from tvrpipe.rundir import read_metrics, read_test_ranks

    out = tmp_path / "w"
    r = cli("bench", "worlds", "--out", out, "--world", "onescene", "--method", "xpool", "--train-videos", 40,
            "--dim", 16, "--max-epochs", 2, "--patience", 1)
    assert r.exit_code == 0, r.output
    rows = json.loads((out / "worlds.json").read_text())
    assert [(x["method"], x["zero_shot_start"]) for x in rows] == [("xpool", False), ("xpool", True)]
    runs = out / "runs" / "onescene"
    zero = read_test_ranks(runs / "zero-shot")["t2v"]
    assert len(zero) == 1000  # the targets' gallery: MSR-VTT 1k-A's size
    for x, name in zip(rows, ("xpool", "xpool-zero-shot-start")):
        ranks = read_test_ranks(runs / name)["t2v"]
        assert x["test_r1"] == pytest.approx(100 * np.mean(ranks == 1))
        assert (x["test_low"], x["test_high"]) == pytest.approx(bootstrap_recall(ranks))
        assert (x["diff"], x["diff_low"], x["diff_high"]) == pytest.approx(paired_recall_difference(ranks, zero))
        assert x["verdict"] == ("beats zero-shot" if x["diff_low"] > 0 else "trails zero-shot" if x["diff_high"] < 0
                                else "within noise")
        assert x["epochs_run"] <= 2
    assert rows[1]["untrained_val_r1"] == pytest.approx(read_metrics(runs / "zero-shot")["val"]["t2v"]["R@1"])
    assert "| onescene | xpool | zero-shot start |" in (out / "worlds.md").read_text()
    again = bench_worlds(out, ["onescene"], ["xpool"], 40, 16, 2, 1, progress=False)
    assert [x.test_r1 for x in again] == [x["test_r1"] for x in rows]
    r = cli("bench", "worlds", "--out", out, "--world", "nowhere")
    assert r.exit_code == 1 and "--world 'nowhere' is not one of: onescene, multiscene" in r.output


def test_bench_extract_long_video_times_its_moments_against_one_pass(cli, tmp_path):
    """A generated 40 s file cut into 10 s windows every 5 s: every moment decodes, both timings are measured
    and their ratio reported; the options of the other measurement are refused beside it."""
    out = tmp_path / "b"
    r = cli("bench", "extract", "--out", out, "--long-video", "40", "--window", "10", "--stride", "5",
            "--json", tmp_path / "m.json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "m.json").read_text())
    assert (res["moments"], res["window"], res["stride"], res["file_frames"]) == (7, 10.0, 5.0, 40 * 8)
    assert res["moments_seconds"] > 0 and res["one_pass_seconds"] > 0
    assert res["ratio"] == pytest.approx(res["moments_seconds"] / res["one_pass_seconds"])
    assert "cut into 7 moments (10 s every 5 s)" in " ".join(r.output.split())
    for args, said in ((("--long-video", "40", "--fps", "4"), "--fps: --long-video measures decoding alone"),
                       (("--stride", "5"), "--stride: they cut --long-video's file"),
                       (("--long-video", "40", "--window", "10", "--stride", "20"), "--stride 20s is longer than"),
                       # the stride a lone --window gives is not blamed for it
                       (("--long-video", "40", "--window", "0.1"), "error: --window 0.1s: a moment this short may hold "
                                                                   "no frame")):
        r = cli("bench", "extract", "--out", tmp_path / "c", *args)
        assert r.exit_code == 1 and said in " ".join(r.output.split()), r.output


def test_bench_streamed_trains_larger_than_its_budget_and_compares_both_ways(tmp_path):
    """`bench train-head --streamed` at a tiny size (D = 256, F = 4): the large store's features are at least 3x the
    budget and it streamed, its validation and test splits sized so that one evaluation is about a quarter of the
    budget, which its plan counted; the store that fits trained in memory and streamed; the figures are what the
    runs recorded (the last trained epoch's, not the selected one's), and the targets are computed from them. At
    a 3 MB budget the process's own noise (reading the store's tables costs it more than that) decides
    ``under_budget``: the slow test below asserts it at 100 MB."""
    import pandas as pd

    from tvrpipe.bench.streamed import bench_streamed
    from tvrpipe.files import gb

    r = bench_streamed(tmp_path / "b", budget=3_000_000, method="xpool", batch_size=32, frames=4, words=4, dim=256,
                       progress=False)
    assert r.large_needs >= 3 * r.budget and r.large_data["mode"] == "streamed"
    assert r.large_data["budget"] == "3.0 MB (--memory-budget)" and r.large_data["evaluation"] == gb(r.large_evaluation)
    assert 0.15 * r.budget < r.large_evaluation < 0.35 * r.budget and r.large_test_videos > 32
    assert r.memory_samples_per_s > 0 and r.streamed_samples_per_s > 0 and r.model_peak > 0 and r.large_peak > 0
    assert r.throughput_ratio == pytest.approx(r.streamed_samples_per_s / r.memory_samples_per_s)
    assert r.under_budget == (r.large_peak <= r.budget + r.model_peak)
    for mode, r1, loss in (("memory", r.memory_val_r1, r.memory_loss), ("streamed", r.streamed_val_r1, r.streamed_loss)):
        last = pd.read_csv(tmp_path / "b" / "runs" / f"small-{mode}" / "epochs.csv").iloc[-1]
        assert (r1, loss) == (last["val_t2v_R@1"], pytest.approx(last["loss"]))
    assert r.record()["within_noise"] == (abs(r.memory_val_r1 - r.streamed_val_r1) <= 2 * r.noise_sd)
    # the model alone took as many steps as the large run, in at most MODEL_EPOCHS epochs, its data streamed
    # through a buffer of MODEL_BUFFER batches
    from tvrpipe.bench.streamed import MODEL_BUFFER, MODEL_EPOCHS

    run = tmp_path / "b" / "runs" / "model"
    model = yaml.safe_load((run / "config.yaml").read_text())
    per_epoch = json.loads((run / "metrics.json").read_text())["schedule"]["validate_every_steps"]
    steps, epochs = r.large_videos // 32, model["train"]["epochs"]
    assert 1 <= epochs <= MODEL_EPOCHS and len(pd.read_csv(run / "epochs.csv")) == epochs
    assert steps <= epochs * per_epoch < steps + per_epoch
    assert model["data"]["mode"] == "streamed" and model["data"]["buffer_videos"] >= MODEL_BUFFER * 32


@pytest.mark.slow
def test_bench_streamed_stays_within_the_budget_plus_the_model(tmp_path):
    """At 100 MB, D = 512 (measured: a 1.69 GB peak against 1.76 GB for the budget plus the model), the large
    run's peak stays within the budget plus the model, its evaluation counted inside the budget."""
    from tvrpipe.bench.streamed import bench_streamed

    r = bench_streamed(tmp_path / "b", budget=100_000_000, method="xpool", batch_size=128, progress=False)
    assert r.large_data["mode"] == "streamed" and r.large_evaluation > 0.15 * r.budget
    assert r.under_budget, r.record()


def test_bench_streamed_refuses_options_of_the_other_measurement(cli, tmp_path):
    for args, said in ((("--streamed", "--steps", "5"), "--steps: --streamed trains whole epochs"),
                       (("--memory-budget", "1GB"), "--memory-budget: they belong to --streamed"),
                       (("--streamed", "--memory-budget", "lots"), "--memory-budget 'lots': give a size above 0"),
                       (("--streamed", "--method", "xpool", "--method", "duq"), "--streamed measures one head")):
        r = cli("bench", "train-head", "--out", tmp_path / "b", *args)
        assert r.exit_code == 1 and said in " ".join(r.output.split()), r.output
    assert not (tmp_path / "b").exists()
