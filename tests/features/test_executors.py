"""The two executors of ``tvrpipe extract``: on this machine without Ray (the default) and on Ray (``--address``).
For the same manifest and options both write the same bytes: every array chunk and table of the store has the same
sha256 (a benchmark manifest with bad videos, a collection cut into windows and into shots, an update, a resume
after kill -9 in the middle of a shard). The local executor keeps what the Ray path promises: a hung or crashed
decoder is killed and its video recorded, Ctrl-C leaves nothing half-written and a rerun resumes, a GPU
out-of-memory error splits the call, and Ray is never imported."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from broken_videos import synth_with_broken_videos

from tvrpipe.data.manifest import make_tables, read_manifest, write_manifest
from tvrpipe.errors import ConfigError
from tvrpipe.features.clip import TINY_MODEL
from tvrpipe.features.collection import Cutting, build_collection
from tvrpipe.features.extract import ExtractConfig, extract
from tvrpipe.features.store import StoreError, open_store, verify_store


def _cfg(**kw) -> ExtractConfig:
    base = dict(model=TINY_MODEL, pretrained="none", video_shard=4, text_shard=16, batch_size=3, progress=False,
                timeout_s=30.0, max_failed_fraction=0.5)
    return ExtractConfig(**{**base, **kw})


def digests(out: Path) -> dict[str, str]:
    """sha256 of every array chunk and table of the store in ``out`` (metadata and markers left out)."""
    files = [p for p in (out / "features.zarr").rglob("*") if p.is_file() and p.name != "zarr.json"]
    files += [out / name for name in ("videos.parquet", "texts.parquet", "failures.parquet")]
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def assert_same_bytes(a: Path, b: Path) -> None:
    da, db = digests(a), digests(b)
    assert da.keys() == db.keys()
    differ = sorted(k for k in da if da[k] != db[k])
    assert not differ, differ


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Synthetic videos, a zero-byte and a corrupt one (recorded as failed)."""
    return synth_with_broken_videos(tmp_path_factory.mktemp("data"), 10, seed=3)


@pytest.fixture(scope="module")
def local_store(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local") / "s"
    s = extract(data / "manifest", data / "videos", out, _cfg())
    assert (s.executor, s.videos_done, s.failed) == ("local", 10, 2)
    assert s.phases["workers"] <= s.phases["first_decode"] <= s.phases["first_batch"]
    return out


def test_both_executors_write_the_same_bytes(ray_session, data, local_store, tmp_path):
    s = extract(data / "manifest", data / "videos", tmp_path / "ray", _cfg(address="local"))
    assert (s.executor, s.videos_done, s.failed) == ("ray", 10, 2)
    assert_same_bytes(local_store, tmp_path / "ray")
    assert sorted(open_store(local_store).failures.video_id) == ["corrupt", "zero"]


def _collection(tmp_path: Path, data: Path, names: dict[str, int]) -> Path:
    folder = tmp_path / "videos"
    synth = sorted((data / "videos").glob("synth_*.mp4"))
    for name, k in names.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(synth[k], folder / name)
    return folder


# windows in make test-all (about 13 s): shots, the cutting with more to go wrong, runs by default
@pytest.mark.parametrize("cutting", [pytest.param(Cutting(2.0, 1.0), marks=pytest.mark.slow), Cutting(shots=True)],
                         ids=["windows", "shots"])
def test_a_collection_cut_into_moments_and_updated_gives_the_same_bytes(ray_session, data, tmp_path, cutting):
    """A collection cut into overlapping windows or at its shots, then updated after a file was added, one
    changed and one removed: the store of each step is the same under either executor."""
    folder = _collection(tmp_path, data, {"a/k1.mp4": 0, "a/k2.mp4": 1, "b/k3.mp4": 2, "b/gone.mp4": 3})
    build_collection(folder, tmp_path / "m", progress=False, cutting=cutting)
    cfg = _cfg(frames=4, video_shard=5)
    for name, address in (("local", None), ("ray", "local")):
        s = extract(tmp_path / "m", folder, tmp_path / name, _cfg(frames=4, video_shard=5, address=address))
        assert s.failed == 0 and s.videos_done == s.videos_total > 4, s.lines()
    assert_same_bytes(tmp_path / "local", tmp_path / "ray")
    # the update: one added, one changed in place (other bytes, other size), one removed
    shutil.copyfile(sorted((data / "videos").glob("synth_*.mp4"))[4], folder / "new.mp4")
    shutil.copyfile(sorted((data / "videos").glob("synth_*.mp4"))[5], folder / "a" / "k2.mp4")
    (folder / "b" / "gone.mp4").unlink()
    build_collection(folder, tmp_path / "m", progress=False)
    for name, address in (("local", None), ("ray", "local")):
        s = extract(tmp_path / "m", folder, tmp_path / name, _cfg(frames=4, video_shard=5, address=address))
        assert s.reused > 0 and s.videos_done > 0 and s.failed == 0, s.lines()
    assert_same_bytes(tmp_path / "local", tmp_path / "ray")
    assert cfg.frames == 4


def _cli(manifest: Path, videos: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tvrpipe", "extract", "--manifest", str(manifest), "--video-root", str(videos),
            "--out", str(out), "--model", TINY_MODEL, "--pretrained", "none", "--video-shard", "4", "--text-shard",
            "16", "--batch-size", "3", "--max-failed-fraction", "0.5", *extra]


@pytest.fixture
def stuck(data, tmp_path) -> tuple[Path, Path, Path]:
    """(manifest, videos, FIFO): ``data`` with a FIFO without a writer among the second shard's rows.
    A decoder that opens it waits until it is killed, so a run with a long --timeout cannot finish, however
    fast the machine; once the FIFO is replaced by a video, a rerun can."""
    videos = tmp_path / "videos"
    shutil.copytree(data / "videos", videos)
    os.mkfifo(videos / "stuck.mp4")
    m = read_manifest(data / "manifest")
    rows = m.videos.to_dict("records")
    rows.insert(5, {"video_id": "synth_00005a", "path": "stuck.mp4", "split": "train"})
    captions = [*m.captions.to_dict("records"), {"caption_id": "stuck#0", "video_id": "synth_00005a",
                                                   "text": "a video", "split": "train"}]
    v, c = make_tables(rows, captions)
    write_manifest(tmp_path / "m", v, c, m.meta)
    stuck_row = list(read_manifest(tmp_path / "m").videos.video_id).index("synth_00005a")
    assert 4 <= stuck_row < 8  # the second shard's
    return tmp_path / "m", videos, videos / "stuck.mp4"


def _unstick(fifo: Path, data: Path) -> None:
    fifo.unlink()
    shutil.copyfile(sorted((data / "videos").glob("synth_*.mp4"))[1], fifo)


def _when_first_shard_lands(proc: subprocess.Popen, out: Path) -> None:
    markers = out / "_progress" / "videos"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if markers.is_dir() and any(markers.iterdir()):
            return
        time.sleep(0.02)
    raise AssertionError(f"no shard was written (exit code {proc.poll()})")


def test_a_resume_after_kill_9_in_a_shard_gives_the_same_bytes(stuck, data, tmp_path):
    """kill -9 while the second shard is half decoded (one of its rows never finishes): the rerun redoes the unfinished
    shards whole, and the store equals one extracted at once, byte for byte."""
    manifest, videos, fifo = stuck
    out = tmp_path / "k"
    proc = subprocess.Popen(_cli(manifest, videos, out, "--decoders", "1", "--timeout", "600"),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _when_first_shard_lands(proc, out)
    time.sleep(0.5)  # the second shard's other rows decoded meanwhile, never written: it waits for the FIFO
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert sorted(p.name for p in (out / "_progress" / "videos").iterdir()) == ["000000.json"]
    with pytest.raises(StoreError, match="has not finished"):
        open_store(out)
    _unstick(fifo, data)
    r = subprocess.run(_cli(manifest, videos, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "4 already done" in " ".join(r.stdout.split()), r.stdout
    s = extract(manifest, videos, tmp_path / "at-once", _cfg())
    assert (s.videos_done, s.failed) == (11, 2)
    assert_same_bytes(tmp_path / "at-once", out)


def test_ctrl_c_leaves_nothing_half_written_and_a_rerun_resumes(stuck, data, tmp_path):
    """SIGINT in the middle (a decoder waiting on a video that never finishes): one line, exit 130, the decoder
    process gone with it, every shard written whole (its checksums hold); the same command finishes the store,
    equal to one extracted at once."""
    manifest, videos, fifo = stuck
    out = tmp_path / "c"
    # SIGINT as a terminal delivers it: a suite started in the background by a non-interactive shell has SIGINT
    # ignored, and its children inherit that
    proc = subprocess.Popen(_cli(manifest, videos, out, "--decoders", "1", "--timeout", "600"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _when_first_shard_lands(proc, out)
    time.sleep(0.5)
    children = _children(proc.pid)
    assert children  # the decoder process, waiting on the FIFO
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in output, output
    assert "Traceback" not in output, output
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)
    report = verify_store(out)
    assert not report.damage and not report.complete
    _unstick(fifo, data)
    r = subprocess.run(_cli(manifest, videos, out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "4 already done" in " ".join(r.stdout.split()), r.stdout + r.stderr[-2000:]
    extract(manifest, videos, tmp_path / "at-once", _cfg())
    assert_same_bytes(tmp_path / "at-once", out)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_no_ray_without_an_address(data, tmp_path):
    """The default executor never imports Ray (so never starts its processes), through the CLI as a user runs it."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom tvrpipe.cli.main import app\n"
            "r = CliRunner().invoke(app, sys.argv[1:])\nassert r.exit_code == 0, r.output\n"
            "assert 'ray' not in sys.modules, 'ray imported'\nprint('no ray')")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = _cli(data / "manifest", data / "videos", tmp_path / "s")[3:]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "no ray" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds the decoder by its open files in /proc")
def test_a_hung_and_a_crashed_decoder_are_killed_and_recorded_and_the_run_goes_on(data, tmp_path):
    """Two files that never finish decoding (FIFOs without a writer): one hangs until the timeout kills its
    decoder, the other's decoder crashes (SIGSEGV, as a codec would) each time it opens it. Both are recorded,
    with their kinds, and every other video is extracted."""
    root = tmp_path / "videos"
    shutil.copytree(data / "videos", root)
    for name in ("hang", "crash"):
        os.mkfifo(root / f"{name}.mp4")
    m = read_manifest(data / "manifest")
    extra = [{"video_id": v, "path": f"{v}.mp4", "split": "test"} for v in ("hang", "crash")]
    captions = [{"caption_id": f"{e['video_id']}#0", "video_id": e["video_id"], "text": "a video", "split": "test"}
                for e in extra]
    v, c = make_tables(m.videos.to_dict("records") + extra, m.captions.to_dict("records") + captions)
    write_manifest(tmp_path / "m", v, c, m.meta)
    stop = threading.Event()
    crash = str(root / "crash.mp4")

    def crash_its_decoder() -> None:
        while not stop.is_set():
            fd = os.open(crash, os.O_WRONLY)  # returns once a decoder opened the file to read it
            try:
                deadline = time.time() + 5
                while not stop.is_set() and time.time() < deadline and not _crash_reader(crash):
                    time.sleep(0.01)
            finally:
                os.close(fd)

    killer = threading.Thread(target=crash_its_decoder, daemon=True)
    killer.start()
    try:
        s = extract(tmp_path / "m", root, tmp_path / "s", _cfg(timeout_s=2.0))
    finally:
        stop.set()
        os.close(os.open(crash, os.O_RDONLY | os.O_NONBLOCK))  # the killer's open returns
        killer.join(10)
    assert (s.videos_done, s.failed) == (10, 4), s.lines()
    failures = open_store(tmp_path / "s").failures.set_index("video_id")["error"]
    assert failures["hang"].startswith("timeout: no result within 2 s")
    assert failures["crash"].startswith(f"unreadable: decoder process died (exit code {-signal.SIGSEGV})")


def _crash_reader(path: str) -> bool:
    """SIGSEGV the decoder process (a child of this one) that holds ``path`` open; whether one did."""
    for pid in _children(os.getpid()):
        try:
            if any(os.readlink(fd) == path for fd in Path(f"/proc/{pid}/fd").iterdir()):
                os.kill(pid, signal.SIGSEGV)
                return True
        except OSError:
            continue
    return False


def test_a_gpu_out_of_memory_error_splits_the_call(monkeypatch):
    """A call the GPU has no memory for is encoded in halves (the same features), and later calls start at the
    size that fitted; one frame that does not fit is one error naming the way out."""
    from tvrpipe.features import clip
    from tvrpipe.features.workers import ClipEncoder

    encoder = ClipEncoder(TINY_MODEL, "none", "cpu", seed=0, threads=1)
    frames = np.random.default_rng(0).integers(0, 256, (10, 64, 64, 3), np.uint8)
    want = encoder._encode(frames)
    real, sizes = clip.encode_frames, []

    def small_gpu(bundle, x, **kw):
        sizes.append(len(x))
        if len(x) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(bundle, x, **kw)

    monkeypatch.setattr(clip, "encode_frames", small_gpu)
    got = encoder._encode(frames)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2.0 ** -10, atol=2.0 ** -24)
    assert sizes == [10, 5, 3, 2, 3, 2] and encoder.max_frames == 3 and encoder.oom_splits == 2
    sizes.clear()
    encoder._encode(frames)
    assert sizes == [3, 3, 3, 1]  # started at the size that fitted
    monkeypatch.setattr(clip, "encode_frames", lambda *a, **kw: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError()))
    with pytest.raises(ConfigError, match=r"the GPU \(cpu\) has no memory left for one frame of 64 px: free it"):
        encoder._encode(frames[:1])


def test_local_gpus_are_counted_before_anything(monkeypatch):
    from tvrpipe.features.extract.executor import check_local_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--device cuda: this machine has no CUDA GPU that torch can use"):
        check_local_gpus(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_local_gpus(1)
    with pytest.raises(ConfigError, match=r"^--encoders 2 with --device cuda: one GPU each, and this machine has 1; "
                                          r"use --encoders 1"):
        check_local_gpus(2)


def test_encoder_calls_are_fixed_by_the_plan():
    """A call holds one shard's rows to do, in store order, ``per_call`` at a time: whatever finishes first."""
    from tvrpipe.features.extract.pipeline import encode_calls
    from tvrpipe.features.store import Shard

    jobs = [(Shard("videos", 0, 0, 4), None), (Shard("videos", 1, 4, 8), np.array([7, 5])), (Shard("videos", 2, 8, 9), None)]
    assert [c.tolist() for c in encode_calls(jobs, 3)] == [[0, 1, 2], [3], [5, 7], [8]]
    assert [c.tolist() for c in encode_calls(jobs, 10)] == [[0, 1, 2, 3], [5, 7], [8]]


def test_a_lane_runs_its_calls_in_order_and_a_stop_cancels_what_waits():
    """The local executor's threads: calls in the order sent, errors raised where the result is read; a stop
    cancels the calls that wait and ends the thread after the one it runs, and a stopped lane takes no call."""
    from tvrpipe.features.extract.executor import Lane

    lane, order, started, release = Lane("test"), [], threading.Event(), threading.Event()
    first = lane.submit(lambda: started.set() or release.wait(10) and order.append(1))
    second = lane.submit(order.append, 2)
    failing = lane.submit(lambda: 1 / 0)
    assert started.wait(10) and not first.done()
    lane.stop()
    release.set()
    assert lane.join(10)
    assert first.result() is None and order == [1]  # the running call finished; the waiting ones never ran
    assert second.cancelled() and failing.cancelled() and lane.submit(order.append, 3).cancelled()
    other = Lane("test2")
    with pytest.raises(ZeroDivisionError):
        other.submit(lambda: 1 / 0).result(10)
    assert [other.submit(order.append, k).result(10) for k in (4, 5)] == [None, None] and order == [1, 4, 5]
    other.stop()
    assert other.join(10)
