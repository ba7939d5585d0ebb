"""``tvrpipe bench extract``: how close the extraction pipeline gets to what its resources allow.

Measured in one run, on generated H.264 videos (realistic decode cost: 720p, long GOP as in
web video) and ViT-B-32 with random weights (realistic encode cost):

- **decode-only**: ``decode_video`` in one process per core, videos/s (d);
- **encode-only**: ``encode_frames`` on batches of F x batch-size frames, videos/s (e);
- **bound**: where decode and encode share the same CPU cores (as on a workstation without a
  GPU) one second of the machine does either, so the bound is ``1 / (1/d + 1/e)``; with a GPU
  encoding, it is ``min(d, e)``;
- **pipeline**: ``tvrpipe extract`` (Ray Data) in steady state: the marginal rate
  ``(N - n) / (T_N - T_n)`` of a run over all N videos and a run over the first n (one encoder
  batch), in the same Ray session, so the fixed costs (actor start-up, model loads, the driver's
  provenance load) cancel; the end-to-end rate of the N-video run is reported beside it;
- **naive loop**: decode one video, encode it, write it, sequentially.

Targets: pipeline >= 0.8 x bound and >= 1.5 x naive.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tvrpipe.data.manifest import make_tables, write_manifest
from tvrpipe.errors import ConfigError, WorkerDiedError

log = logging.getLogger(__name__)


def in_fresh_process(fn, arg, what: str):
    """``fn(arg)`` in a fresh spawned process: its own imports, allocator and peak memory, which
    the benchmarks measure. The caller gets the result, or the exception ``fn`` raised.

    Raises:
        WorkerDiedError: the process ended without an answer, naming ``what`` and how it ended
            (multiprocessing.Pool would wait forever for the lost task instead).
    """
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_answer, args=(fn, arg, send), daemon=True)
    proc.start()
    send.close()  # the child holds the only sending end: its death ends the pipe
    try:
        ok, value = receive.recv()
    except EOFError:
        proc.join()
        raise WorkerDiedError(f"{what}: its process ended without an answer ({_ending(proc.exitcode)})") from None
    finally:
        receive.close()
    proc.join()
    if not ok:
        raise value
    return value


def _answer(fn, arg, send) -> None:
    try:
        answer = (True, fn(arg))
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        import pickle
        import traceback

        try:
            pickle.dumps(e)
            answer = (False, e)
        except Exception:  # an exception that does not pickle: its text crosses instead
            answer = (False, RuntimeError(traceback.format_exc()))
    send.send(answer)
    send.close()


def _ending(exitcode: int | None) -> str:
    import signal

    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = "; the kernel's out-of-memory killer sends it when memory runs out (see `dmesg`)" \
            if name == "SIGKILL" else ""
        return f"killed by {name}{why}"
    return f"exit code {exitcode}"


@dataclass(frozen=True)
class BenchVideos:
    """Shape of the generated benchmark videos."""

    count: int = 16
    width: int = 1280
    height: int = 720
    seconds: float = 10.0
    fps: int = 30
    gop: int = 250  # x264's default keyint: sampled frames need most of the GOP decoded


@dataclass
class ExtractBench:
    """One benchmark run's measurements (videos/s unless named otherwise)."""

    device: str
    cpus: int
    model: str
    frames: int
    videos: dict
    decode: float
    encode: float
    bound: float
    pipeline: float
    pipeline_end_to_end: float
    naive: float
    seconds_small: float  # extract() over the first batch_size videos
    seconds_full: float  # extract() over all videos

    @property
    def vs_bound(self) -> float:
        return self.pipeline / self.bound

    @property
    def vs_naive(self) -> float:
        return self.pipeline / self.naive

    def lines(self) -> list[str]:
        f = self.frames
        return [
            f"videos: {self.videos['count']} x {self.videos['width']}x{self.videos['height']}, "
            f"{self.videos['seconds']:g} s at {self.videos['fps']} fps (GOP {self.videos['gop']}); "
            f"{self.model}, {f} frames/video, device {self.device}, {self.cpus} CPUs",
            f"decode-only   {self.decode:7.3f} videos/s  ({self.decode * f:7.1f} frames/s)",
            f"encode-only   {self.encode:7.3f} videos/s  ({self.encode * f:7.1f} frames/s)",
            f"bound         {self.bound:7.3f} videos/s  "
            + ("(1 / (1/decode + 1/encode): shared CPU)" if self.device == "cpu" else "(min(decode, encode))"),
            f"pipeline      {self.pipeline:7.3f} videos/s  (marginal rate; "
            f"{self.pipeline_end_to_end:.3f} end to end with actor start-up; runs of "
            f"{self.seconds_small:.1f} s and {self.seconds_full:.1f} s)",
            f"naive loop    {self.naive:7.3f} videos/s",
            ("pipeline: too little work to measure a marginal rate; use more or longer videos; "
             if self.pipeline != self.pipeline else "")
            + f"pipeline / bound = {self.vs_bound:.2f} (target >= 0.8); "
            f"pipeline / naive = {self.vs_naive:.2f} (target >= 1.5)",
        ]


def make_bench_videos(out_dir: Path, spec: BenchVideos, seed: int = 0) -> Path:
    """Render the benchmark videos once (reused when ``spec`` is unchanged); returns the manifest dir."""
    import av

    videos = out_dir / "videos"
    stamp = out_dir / "bench_videos.json"
    want = json.dumps({**asdict(spec), "seed": seed}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == want:
        return out_dir / "manifest"
    videos.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = int(spec.seconds * spec.fps)
    h, w = spec.height, spec.width
    # A textured background that pans plus a moving block: enough motion and detail that the
    # encoder produces realistic P-frames (a flat image would decode unrealistically fast).
    base = rng.integers(0, 256, size=(h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)
    base = np.kron(base, np.ones((8, 8, 1), np.uint8))
    rows = []
    for k in range(spec.count):
        path = videos / f"bench_{k:04d}.mp4"
        tmp = path.with_name(f".{path.name}.tmp")
        with av.open(str(tmp), "w", format="mp4") as c:
            s = c.add_stream("libx264", rate=spec.fps)
            s.width, s.height, s.pix_fmt = w, h, "yuv420p"
            s.options = {"preset": "ultrafast", "crf": "23", "g": str(spec.gop)}
            for i in range(n):
                dy, dx = (i + k) % 8, (2 * i + k) % 8
                img = base[dy : dy + h, dx : dx + w].copy()
                x = int((i / n) * (w - 120))
                img[h // 3 : h // 3 + 120, x : x + 120] = (255, 40 * (k % 6), 0)
                for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        os.replace(tmp, path)
        rows.append(k)
    v, c = make_tables(
        [{"video_id": f"bench_{k:04d}", "path": f"bench_{k:04d}.mp4", "split": "test"} for k in rows],
        [{"caption_id": f"bench_{k:04d}#0", "video_id": f"bench_{k:04d}", "text": "a red block moves right",
          "split": "test"} for k in rows],
    )
    write_manifest(out_dir / "manifest", v, c, {"dataset": "bench", "split_set": "bench", "frames": 12,
                                                "max_words": 32})
    stamp.write_text(want)
    return out_dir / "manifest"


def _first_videos(manifest: Path, n: int, out: Path) -> Path:
    """A manifest of the first ``n`` videos of ``manifest`` (for the fixed-cost run)."""
    from tvrpipe.data.manifest import read_manifest

    m = read_manifest(manifest)
    keep = m.videos.video_id.iloc[:n]
    write_manifest(out, m.videos[m.videos.video_id.isin(keep)], m.captions[m.captions.video_id.isin(keep)], m.meta)
    return out


def _decode_one(args: tuple[str, int, int]):
    from tvrpipe.features.decode import decode_video

    path, frames, size = args
    return int(decode_video(path, frames, size).mask.sum())


def _decode_only(paths: list[str], frames: int, size: int, procs: int) -> float:
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # not multiprocessing.Pool: it waits forever for the task of a worker that died
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as pool:
        try:
            list(pool.map(_decode_one, [(paths[0], frames, size)] * procs))  # start-up and imports, untimed
            t = time.perf_counter()
            list(pool.map(_decode_one, [(p, frames, size) for p in paths]))
        except BrokenProcessPool:
            raise WorkerDiedError("decode-only: a decoding process ended without an answer (killed or out "
                                  "of memory; see `dmesg`)") from None
        return len(paths) / (time.perf_counter() - t)


def _encode_only(bundle, frames: int, batch_videos: int, repeats: int) -> float:
    from tvrpipe.features.clip import encode_frames

    S = bundle.image_size
    x = np.random.default_rng(0).integers(0, 256, size=(batch_videos * frames, S, S, 3), dtype=np.uint8)
    encode_frames(bundle, x)  # warm-up at the measured batch shape (allocator, thread pool)
    t = time.perf_counter()
    for _ in range(repeats):
        encode_frames(bundle, x)
    return repeats * batch_videos / (time.perf_counter() - t)


def _naive(bundle, paths: list[str], frames: int, out: Path) -> float:
    import zarr

    from tvrpipe.features.clip import encode_frames
    from tvrpipe.features.decode import decode_video

    g = zarr.open_group(out, mode="w", zarr_format=3)
    arr = g.create_array("frames", shape=(len(paths), frames, bundle.embed_dim), chunks=(1, frames, bundle.embed_dim),
                         dtype="float16", compressors=None)
    t = time.perf_counter()
    for i, p in enumerate(paths):
        d = decode_video(p, frames, bundle.image_size)
        emb = np.zeros((frames, bundle.embed_dim), np.float16)
        emb[d.mask] = encode_frames(bundle, d.frames[d.mask]).numpy()
        arr[i] = emb
    return len(paths) / (time.perf_counter() - t)


def _timed_extract(manifest: Path, videos: Path, out: Path, cfg) -> float:
    from tvrpipe.features.extract import extract

    shutil.rmtree(out, ignore_errors=True)  # always a full extraction, never a resume
    t = time.perf_counter()
    extract(manifest, videos, out, cfg)
    seconds = time.perf_counter() - t
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def bench_extract(
    out_dir: str | os.PathLike[str],
    spec: BenchVideos = BenchVideos(),
    model: str = "ViT-B-32",
    device: str = "cpu",
    frames: int = 12,
    batch_size: int = 4,
) -> ExtractBench:
    """Run the extraction benchmark (see the module docstring) and return its measurements.

    Example:
        >>> r = bench_extract("bench/extract")  # doctest: +SKIP
        >>> print("\\n".join(r.lines()))  # doctest: +SKIP
    """
    import torch

    from tvrpipe.cluster import cluster_cpus, ray_init
    from tvrpipe.features.clip import load_clip
    from tvrpipe.features.extract import ExtractConfig

    if spec.count < 2 * batch_size:
        raise ConfigError(f"--videos must be at least 2 x --batch-size ({2 * batch_size}), got {spec.count}")
    out = Path(out_dir)
    cpus = os.cpu_count() or 1
    log.info("rendering %d benchmark videos (once)", spec.count)
    manifest = make_bench_videos(out, spec)
    paths = [str(p) for p in sorted((out / "videos").glob("bench_*.mp4"))]

    torch.set_num_threads(cpus)
    bundle = load_clip(model, "none", device=device)
    S = bundle.image_size
    decode = _decode_only(paths, frames, S, cpus)
    encode = _encode_only(bundle, frames, batch_size, repeats=max(3, spec.count // batch_size))
    naive = _naive(bundle, paths, frames, out / "naive.zarr")
    del bundle
    bound = 1.0 / (1.0 / decode + 1.0 / encode) if device == "cpu" else min(decode, encode)

    ray_init(None)
    cfg = ExtractConfig(model=model, pretrained="none", device=device, frames=frames, batch_size=batch_size,
                        video_shard=batch_size, progress=False)
    small = _first_videos(manifest, batch_size, out / "manifest_small")
    t_small = _timed_extract(small, out / "videos", out / "features", cfg)
    t_full = _timed_extract(manifest, out / "videos", out / "features", cfg)
    # A workload too small to rise above run-to-run noise has no marginal rate to report.
    pipeline = (spec.count - batch_size) / (t_full - t_small) if t_full > t_small else float("nan")
    if not pipeline == pipeline:
        log.warning("the full run (%.1f s) was not slower than the small one (%.1f s): too little work to "
                    "measure; use more or longer --videos", t_full, t_small)
    return ExtractBench(device=device, cpus=cluster_cpus(), model=model, frames=frames, videos=asdict(spec),
                        decode=decode, encode=encode, bound=bound, pipeline=pipeline,
                        pipeline_end_to_end=spec.count / t_full, naive=naive,
                        seconds_small=t_small, seconds_full=t_full)
