"""No silent corruption: damaged chunks, non-finite numbers, locks, option checks, broken runs,
unwritable outputs. Stores here are generated (no Ray, no videos); the extraction-level cases
(retry after a wrong root, repair by re-extraction) are in features/test_extract.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tvrpipe.errors import LockError, NonFiniteError, RunError
from tvrpipe.features.store import (
    ARRAYS,
    PROGRESS,
    STORE_NAME,
    StoreError,
    nonfinite_rows,
    open_store,
    verify_store,
)
from tvrpipe.lock import LOCK_NAME, DirLock
from tvrpipe.training.fit import TrainConfig, fit
from tvrpipe.worlds.features import GenSpec, generate_store

SPEC = GenSpec(train_videos=40, test_videos=12, captions_per_train_video=2, frames=4, max_words=6, embed_dim=16,
               seed=3)
VIDEO_SHARD, TEXT_SHARD = 8, 16
ALL_ARRAYS = [f"{kind}/{name}" for kind, names in ARRAYS.items() for name in names]


def _make(d: Path) -> Path:
    return generate_store(d, SPEC, video_shard=VIDEO_SHARD, text_shard=TEXT_SHARD)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _make(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    """A private copy of the pristine store, free to damage."""
    d = tmp_path / "store"
    shutil.copytree(pristine, d)
    (d / LOCK_NAME).unlink(missing_ok=True)
    return d


def _chunk(d: Path, array: str, index: int = 1) -> Path:
    kind, name = array.split("/")
    rest = "/0/0" if name in ("frames", "tokens") else "/0"
    return d / STORE_NAME / kind / name / "c" / f"{index}{rest}"


def _arrays(d: Path) -> dict[str, np.ndarray]:
    s = open_store(d)
    return {a: s.array(a)[:] for a in ALL_ARRAYS}


def _marker_times(d: Path) -> dict[str, int]:
    return {f"{p.parent.name}/{p.name}": p.stat().st_mtime_ns for p in (d / PROGRESS).rglob("*.json")}


# ---------------------------------------------------------------------------------- damage


def test_nonfinite_rows_matches_numpy():
    rng = np.random.default_rng(0)
    for dtype in (np.float16, np.float32):
        x = rng.normal(size=(50, 3, 4)).astype(dtype)
        x[3, 1, 2], x[7, 0, 0], x[11, 2, 3], x[12, 0, 1] = np.nan, np.inf, -np.inf, 65504 if dtype == np.float16 else 1e30
        ref = ~np.isfinite(x.astype(np.float64)).reshape(50, -1).all(1)
        np.testing.assert_array_equal(nonfinite_rows(x), ref)
        assert sorted(np.flatnonzero(nonfinite_rows(x))) == [3, 7, 11]


@pytest.mark.parametrize("array", ALL_ARRAYS)
@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_missing_or_truncated_chunk_is_refused_on_open_and_repaired(store, pristine, array, damage):
    chunk = _chunk(store, array)
    if damage == "deleted":
        chunk.unlink()
    else:
        chunk.write_bytes(chunk.read_bytes()[:-3])
    kind = array.split("/")[0]
    with pytest.raises(StoreError) as e:
        open_store(store)
    msg = str(e.value)
    assert f"{array} chunk c/1/" in msg and f"shard {kind}/1" in msg, msg
    assert ("is missing" if damage == "deleted" else "bytes but") in msg and ("were written" in msg or damage == "deleted")
    assert "again with the same options and --out" in msg and "re-extracts exactly the damaged shards" in msg
    before = _marker_times(store)
    _make(store)  # rerunning what made the store repairs exactly the damaged shard
    after = _marker_times(store)
    assert [k for k in before if before[k] != after[k]] == [f"{kind}/000001.json"]
    want = _arrays(pristine)
    for name, values in _arrays(store).items():
        np.testing.assert_array_equal(values, want[name], err_msg=name)


@pytest.mark.parametrize("array", ALL_ARRAYS)
def test_overwritten_chunk_fails_its_checksum_and_is_repaired(store, pristine, array):
    chunk = _chunk(store, array, 0)
    size = chunk.stat().st_size
    chunk.write_bytes(np.random.default_rng(1).bytes(size))  # same size: only the checksum can tell
    report = verify_store(store)
    assert not report.ok and len(report.damage) == 1
    kind = array.split("/")[0]
    assert str(report.damage[0]) == (f"{array} chunk {chunk.relative_to(store / STORE_NAME / array).as_posix()} "
                                     f"does not match its checksum, in shard {kind}/0 (rows 0-{VIDEO_SHARD - 1 if kind == 'videos' else TEXT_SHARD - 1})")
    before = _marker_times(store)
    _make(store)
    assert [k for k, t in _marker_times(store).items() if before[k] != t] == [f"{kind}/000000.json"]
    assert verify_store(store).ok
    np.testing.assert_array_equal(open_store(store).array(array)[:], open_store(pristine).array(array)[:])


def test_overwritten_embeddings_stop_training_naming_rows(store, tmp_path):
    chunk = _chunk(store, "videos/frames", 1)
    chunk.write_bytes(np.random.default_rng(2).bytes(chunk.stat().st_size))
    with pytest.raises(NonFiniteError) as e:
        fit(store, "meanpool", tmp_path / "run", TrainConfig(epochs=1, batch_size=8), progress=False)
    msg = str(e.value)
    assert "videos/frames holds NaN or infinite values" in msg and "shard videos/1 (rows 8-15)" in msg, msg
    assert "tvrpipe features verify" in msg
    assert not (tmp_path / "run").exists()  # no run directory from a damaged store


def test_damaged_marker_metadata_and_sidecar_are_one_line_errors(store):
    marker = store / PROGRESS / "texts" / "000002.json"
    marker.write_text("{not json")
    with pytest.raises(StoreError, match=r"completion marker .*000002.json is damaged, in shard texts/2"):
        open_store(store)
    marker.unlink()
    with pytest.raises(StoreError, match=r"its completion marker is missing, in shard texts/2"):
        open_store(store)
    _make(store)
    assert verify_store(store).ok
    (store / "texts.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(StoreError, match=r"texts.parquet is missing or damaged .*again with the same options"):
        open_store(store)
    _make(store)
    (store / STORE_NAME / "zarr.json").write_text("{")
    with pytest.raises(StoreError, match=r"metadata cannot be read .*--overwrite"):
        open_store(store)


def test_verify_reports_clean_store_and_cli(store, cli):
    report = verify_store(store)
    assert report.ok and report.complete and report.shards == 7 + 6  # 52 videos / 8, 92 texts / 16
    assert report.bytes == sum(p.stat().st_size for p in (store / STORE_NAME).rglob("c/*/*") if p.is_file()) + \
        sum(p.stat().st_size for p in (store / STORE_NAME).rglob("c/*/*/*") if p.is_file())
    r = cli("features", "verify", store)
    assert r.exit_code == 0 and "ok: every chunk matches its checksum" in r.output
    chunk = _chunk(store, "texts/sentence", 2)
    chunk.write_bytes(bytes(chunk.stat().st_size))
    r = cli("features", "verify", store)
    assert r.exit_code == 1
    assert "texts/sentence chunk c/2/0 does not match its checksum, in shard texts/2" in r.output
    assert "Traceback" not in r.output


def test_damaged_store_refused_by_every_reader_cli(store, tmp_path, cli):
    _chunk(store, "videos/frames", 2).unlink()
    for args in (["features", "show", store], ["export", "--features", store, "--out", tmp_path / "x.h5"],
                 ["train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "r"]):
        r = cli(*args)
        assert r.exit_code == 1, (args, r.output)
        assert "videos/frames chunk c/2/0/0 is missing" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.h5").exists() and not (tmp_path / "r").exists()


def test_nonfinite_features_with_valid_checksums_are_reported(tmp_path, monkeypatch):
    """A store whose writer stored NaN (checksums fine): verify names the rows, training stops."""
    from tvrpipe.worlds import features as genstore

    real = genstore._text_shard

    def poisoned(spec, lat, shard, n):
        tokens, mask, sent = real(spec, lat, shard, n)
        if shard.index == 1:
            sent = sent.copy()
            sent[3] = np.nan
        return tokens, mask, sent

    monkeypatch.setattr(genstore, "_text_shard", poisoned)
    d = _make(tmp_path / "nan")
    report = verify_store(d)
    assert not report.damage and report.nonfinite["texts/sentence"] == [TEXT_SHARD + 3]
    caption = open_store(d).texts.caption_id[TEXT_SHARD + 3]
    with pytest.raises(NonFiniteError, match=rf"texts/sentence holds NaN or infinite values in 1 rows \({caption};"):
        fit(d, "meanpool", tmp_path / "run", TrainConfig(epochs=1, batch_size=8), progress=False)


# ------------------------------------------------------------------------------ non-finite


def test_nonfinite_loss_stops_at_its_step_and_keeps_the_finite_epoch(pristine, tmp_path, monkeypatch):
    from tvrpipe.heads.xpool import XPool

    real, calls = XPool.loss, {"n": 0}
    steps = (40 - 4) // 8  # 36 train videos after carving 4 for validation, batch 8

    def nan_in_epoch_two(self, texts, videos):
        calls["n"] += self.training  # training steps only (the check of the head against the data runs in eval)
        out = real(self, texts, videos)
        if calls["n"] == steps + 3:  # epoch 2, step 3
            out.total = out.total * float("nan")
        return out

    monkeypatch.setattr(XPool, "loss", nan_in_epoch_two)
    with pytest.raises(NonFiniteError) as e:
        fit(pristine, "xpool", tmp_path / "run", TrainConfig(epochs=3, batch_size=8, lr=1e-3), progress=False)
    msg = str(e.value)
    assert msg.startswith("epoch 2 step 3: the loss is nan"), msg
    assert "on the batch of videos gv_" in msg and "and captions gv_" in msg and "lower --lr" in msg
    assert "the run keeps epoch 1" in msg
    state = torch.load(tmp_path / "run" / "checkpoints" / "state.pt", weights_only=False)
    assert state["epoch"] == 0 and state["best"]["epoch"] in (0, 1)  # nothing of epoch 2 was kept (0: the untrained head)
    from tvrpipe.rundir import load_head

    head = load_head(tmp_path / "run" / "checkpoints" / "best.safetensors")
    assert all(torch.isfinite(p).all() for p in head.parameters())
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_checkpoint_bytes_depend_only_on_the_weights_and_metadata(tmp_path):
    """safetensors writes metadata keys in a random order (a Rust HashMap); save_weights sorts them,
    so identical runs write identical checkpoints (and record the same sha256)."""
    import hashlib

    from safetensors import safe_open
    from safetensors.torch import load_file

    from tvrpipe.rundir import save_weights

    state = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(5, dtype=torch.float16)}
    # 8 keys (in the file sorted by chance 1 time in 40,320), values that JSON escapes
    meta = {k: f'{k} "q" \\ \u00e9\n' * i for i, k in enumerate("hgfedcba", 1)}
    sha = save_weights(state, tmp_path / "a.safetensors", meta, "test")
    raw = (tmp_path / "a.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert list(json.loads(raw[8:8 + n])["__metadata__"]) == sorted(meta)
    assert sha == hashlib.sha256(raw).hexdigest()
    loaded = load_file(str(tmp_path / "a.safetensors"))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
        assert f.metadata() == meta
    assert save_weights(state, tmp_path / "b.safetensors", dict(reversed(meta.items())), "test") == sha


def test_nonfinite_weights_are_never_saved(tmp_path):
    from tvrpipe.heads.base import create_head
    from tvrpipe.rundir import save_head

    head = create_head("xpool", embed_dim=8)
    with torch.no_grad():
        head.logit_scale.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="weights logit_scale are NaN or infinite; not saved"):
        save_head(head, tmp_path / "best.safetensors")
    assert not list(tmp_path.iterdir())


def test_nonfinite_score_names_caption_and_video():
    from tvrpipe.evaluation.engine import EvalInputs, evaluate_head
    from tvrpipe.heads.base import TextBatch, VideoBatch, create_head

    head = create_head("meanpool", embed_dim=4)
    rng = np.random.default_rng(0)
    sent = torch.tensor(rng.normal(size=(5, 4)), dtype=torch.float32)
    frames = torch.tensor(rng.normal(size=(5, 3, 4)), dtype=torch.float32)
    frames[2, 1, 0] = float("inf")  # video 2: its mean is infinite, its scores NaN
    texts = [TextBatch(torch.zeros(5, 0, 4), torch.zeros(5, 0, dtype=torch.bool), sent)]
    videos = [VideoBatch(frames, torch.ones(5, 3, dtype=torch.bool))]
    with pytest.raises(NonFiniteError) as e:
        evaluate_head(head, EvalInputs(texts, videos, np.arange(5), text_ids=[f"c{i}" for i in range(5)],
                                       video_ids=[f"v{i}" for i in range(5)]))
    msg = str(e.value)
    assert "5 of 5 x 5 similarity scores are NaN or infinite" in msg and "1 videos (v2)" in msg, msg
    assert "5 captions (c0, c1, c2, c3, c4)" in msg


# ------------------------------------------------------------------------------------ locks

HOLDER = """
import sys, time
from tvrpipe.lock import DirLock
lock = DirLock(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder():
    """Start a process that holds the lock on a directory; kill it (SIGKILL) on demand."""
    procs = []

    def start(d: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "locked"
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_second_writer_is_refused_naming_the_holder_and_crash_frees_it(pristine, tmp_path, holder):
    d = tmp_path / "busy"
    p = holder(d)
    with pytest.raises(LockError, match=rf"{d} is being written by pid {p.pid} on .* since .*wait for it"):
        generate_store(d, SPEC)
    with pytest.raises(LockError, match=rf"pid {p.pid}"):
        fit(pristine, "meanpool", d, TrainConfig(epochs=1, batch_size=8), progress=False)
    os.kill(p.pid, signal.SIGKILL)  # a crashed holder leaves no stuck lock
    p.wait()
    with DirLock(d):
        pass


def test_a_waiting_writer_blocks_until_the_holder_is_gone_then_finishes_the_store(tmp_path, holder, caplog):
    """generate_store(wait=True), as `bench convergence` calls it: a second bench on the same --out
    waits for the first one's lock instead of failing, then writes (or checks) the store itself."""
    import threading

    d = tmp_path / "shared"
    p = holder(d)
    result: list = []
    t = threading.Thread(target=lambda: result.append(generate_store(d, SPEC, wait=True)), daemon=True)
    with caplog.at_level("WARNING", logger="tvrpipe.lock"):
        t.start()
        t.join(1.5)
        assert t.is_alive() and not result  # blocked on the lock, nothing written
        assert not (d / STORE_NAME).exists()
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t.join(60)
    assert not t.is_alive() and result == [d]
    assert f"{d} is being written by pid {p.pid}" in caplog.text and "waiting for it to finish" in caplog.text
    assert open_store(d).array("videos/frames").shape[0] == SPEC.train_videos + SPEC.test_videos


def test_run_directory_locked_for_train_head_and_evaluate_cli(pristine, tmp_path, holder, cli):
    run = tmp_path / "run"
    fit(pristine, "meanpool", run, TrainConfig(epochs=1, batch_size=8), progress=False)
    p = holder(run)
    for args in (["train-head", "--features", pristine, "--method", "meanpool", "--out", run, "--epochs", "1",
                  "--batch-size", "8"], ["evaluate", "--run", run]):
        r = cli(*args)
        assert r.exit_code == 1 and f"is being written by pid {p.pid}" in r.output, r.output


def test_lock_leaves_nothing_behind_in_a_directory_it_created(tmp_path):
    with DirLock(tmp_path / "a" / "b"):
        assert (tmp_path / "a" / "b" / LOCK_NAME).is_file()
    assert not (tmp_path / "a").exists()
    with DirLock(tmp_path / "c"):
        (tmp_path / "c" / "kept").write_text("x")
    assert (tmp_path / "c" / "kept").is_file()


@pytest.mark.slow  # ~1 min of Ray start-up on 2 cores; `make test-all` runs it
def test_two_extract_processes_one_refused(tmp_path):
    """Two real `tvrpipe extract` processes on one --out: the second exits 1 naming the first."""
    from tvrpipe.features.clip import TINY_MODEL
    from tvrpipe.worlds.videos import synthesize

    synthesize(tmp_path / "s", 4, seed=1, progress=False)
    d = tmp_path / "s"
    out = tmp_path / "f"
    cmd = [sys.executable, "-m", "tvrpipe", "extract", "--manifest", str(d / "manifest"), "--video-root",
           str(d / "videos"), "--out", str(out), "--model", TINY_MODEL, "--pretrained", "none", "--decoders", "1"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / LOCK_NAME).is_file() and first.poll() is None:
        time.sleep(0.05)
    while time.time() < deadline and first.poll() is None and not (out / LOCK_NAME).read_text():
        time.sleep(0.05)
    try:
        # the second reaches the lock in seconds, while the first still starts Ray and extracts
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert first.poll() is None, "the first run ended before the second tried the lock"
        assert second.returncode == 1, second.stderr
        assert f"is being written by pid {first.pid}" in second.stderr
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and second.stderr.strip().endswith("choose another --out"), second.stderr
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert open_store(out).array("videos/frame_mask")[:].all()


# ---------------------------------------------------------------------------- broken runs


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    out = tmp_path / "run"
    fit(pristine, "xpool", out, TrainConfig(epochs=1, batch_size=8), progress=False)
    return out


def _evaluate_fails(cli, run: Path, message: str) -> None:
    r = cli("evaluate", "--run", run)
    assert r.exit_code == 1, r.output
    assert message in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_evaluate_on_broken_runs_is_one_line(run, cli):
    best = run / "checkpoints" / "best.safetensors"
    good = best.read_bytes()
    best.unlink()
    _evaluate_fails(cli, run, "best.safetensors: no such checkpoint")
    best.write_bytes(good[: len(good) // 2])
    _evaluate_fails(cli, run, "does not match the sha256 recorded")
    metrics = json.loads((run / "metrics.json").read_text())
    (run / "metrics.json").write_text(json.dumps({**metrics, "checkpoint": {}}))  # no sha recorded: parse fails
    _evaluate_fails(cli, run, "best.safetensors is damaged")
    best.write_bytes(good)
    assert cli("evaluate", "--run", run).exit_code == 0
    cfg = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text("method: [xpool\n  head: {")
    _evaluate_fails(cli, run, "config.yaml is not valid YAML at line")
    (run / "config.yaml").write_text("method: xpool\n")
    _evaluate_fails(cli, run, "config.yaml lacks head, train, features, provenance")
    (run / "config.yaml").write_text(cfg.replace("epochs:", "epoch_count:"))
    _evaluate_fails(cli, run, "its train section is not a trainer config")
    (run / "config.yaml").unlink()
    _evaluate_fails(cli, run, "not a run directory (no config.yaml)")


def test_resume_with_damaged_state_is_one_line(run, pristine, tmp_path):
    (run / "checkpoints" / "state.pt").write_bytes(b"garbage")
    (run / "metrics.json").unlink()
    with pytest.raises(RunError, match=r"cannot resume, its checkpoints are damaged .*delete .*checkpoints"):
        fit(pristine, "xpool", run, TrainConfig(epochs=1, batch_size=8), progress=False)


# --------------------------------------------------------------------- options and outputs


@pytest.mark.parametrize("args, message", [
    (["--epochs", "-1"], "--epochs must be >= 0"),
    (["--batch-size", "1"], "--batch-size must be >= 2"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "-1e-3"], "--lr must be > 0, got -0.001"),  # NaN: a usage error (test_cli)
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
])
def test_train_head_invalid_options_create_nothing(pristine, tmp_path, cli, args, message):
    r = cli("train-head", "--features", pristine, "--method", "meanpool", "--out", tmp_path / "run", *args)
    assert r.exit_code == 1 and message in r.output, r.output
    assert not (tmp_path / "run").exists()


@pytest.fixture
def unwritable(tmp_path):
    """A directory no process here can write into (chattr +i for root, chmod otherwise)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a directory unwritable here (root without chattr)")
    try:
        (d / "probe").mkdir()
    except OSError:
        pass
    else:
        pytest.skip("the directory stayed writable")
    yield d
    subprocess.run(["chattr", "-i", str(d)], capture_output=True)
    d.chmod(0o755)


def test_unwritable_outputs_are_one_line(pristine, unwritable, tmp_path, cli):
    cases = [
        (["train-head", "--features", pristine, "--method", "meanpool", "--out", unwritable / "run"], "--out"),
        (["export", "--features", pristine, "--out", unwritable / "x.h5"], "--out"),
    ]
    for args, option in cases:
        r = cli(*args)
        assert r.exit_code == 1, (args, r.output)
        assert option in r.output and "cannot write there" in r.output, r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert list(unwritable.iterdir()) == []
    # a path below a file can never be created (any user)
    (tmp_path / "file").write_text("x")
    r = cli("train-head", "--features", pristine, "--method", "meanpool", "--out", tmp_path / "file" / "run")
    assert r.exit_code == 1 and "is a file, so the directory cannot be created" in r.output


def test_extract_unwritable_out_is_one_line(unwritable, tmp_path, cli):
    from tvrpipe.features.clip import TINY_MODEL

    cli("synth", "--out", tmp_path / "s", "--videos", "2")
    r = cli("extract", "--manifest", tmp_path / "s" / "manifest", "--video-root", tmp_path / "s" / "videos",
            "--out", unwritable / "f", "--model", TINY_MODEL, "--pretrained", "none")
    assert r.exit_code == 1 and "--out" in r.output and "cannot write there" in r.output, r.output
    assert "Traceback" not in r.output and list(unwritable.iterdir()) == []


def test_os_errors_become_one_line_in_the_cli(monkeypatch, cli, pristine):
    from tvrpipe.features import store as store_module

    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device", "/data/features.zarr/c/0/0")

    monkeypatch.setattr(store_module, "verify_store", disk_full)
    r = cli("features", "verify", pristine)
    assert r.exit_code == 1 and "/data/features.zarr/c/0/0: No space left on device" in r.output
    assert "Traceback" not in r.output
