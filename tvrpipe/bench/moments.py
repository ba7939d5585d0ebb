"""``tvrpipe bench extract --long-video SECONDS``: decoding a long file's moments against one decode pass of it.

A generated H.264 file of ``SECONDS`` (320 x 240, 8 fps, a keyframe a second, content that changes every frame)
is cut into ``--window`` windows every ``--stride`` (:class:`~tvrpipe.features.collection.Cutting`), and timed two
ways, each in a fresh process on one core's worth of work:

- **moments**: what extraction's decoders do for a collection cut into moments, groups of 32 moments of the file
  at a time in time order from one open of it (:func:`~tvrpipe.features.decode.decode_moments` with the
  :class:`~tvrpipe.features.decode.readers.OpenFile` a decoder process keeps), F frames each at the model's
  image size;
- **one pass**: every frame of the file decoded once, in order, by the same reader (decord) at the same output size.

The ratio moments / one pass says what cutting a file into moments costs over reading it once (goal: within
1.3x). Decoding each moment alone, as a benchmark's clips are, is timed on the first group too, for scale.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tvrpipe.bench.extract import in_fresh_process
from tvrpipe.bench.room import check_room, videos_needs
from tvrpipe.progress import stages, track

GROUP = 32  # moments of one file a decoder call takes (extraction's)
WIDTH, HEIGHT, FPS = 320, 240, 8


def long_video(path: Path, seconds: float, fps: int = FPS, width: int = WIDTH, height: int = HEIGHT) -> Path:
    """An H.264 file of ``seconds`` whose frames all differ (a moving gradient and a frame counter's colour),
    written frame by frame (an hour never sits in memory) under a temporary name, then renamed; reused when there."""
    import av

    from tvrpipe.files import atomic_write

    if path.is_file():
        return path
    n = int(round(seconds * fps))
    x = np.arange(width, dtype=np.int32)[None, :, None]
    y = np.arange(height, dtype=np.int32)[:, None, None]

    def write(tmp: Path) -> None:
        with av.open(str(tmp), "w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=fps)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.codec_context.gop_size = fps
            for i in track(range(n), f"rendering a {seconds:g} s video"):
                rgb = ((x * 3 + y * 2 + i * np.array([5, 11, 17])) % 256).astype(np.uint8)
                for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, write)
    return path


def _moments(args: tuple[str, list[tuple[float, float]], int, int]) -> dict:
    from tvrpipe.features.decode import DecodedVideo
    from tvrpipe.features.decode.readers import OpenFile, decode_moments

    path, bounds, frames, size = args
    t = time.perf_counter()
    done = 0
    reader = OpenFile()  # kept across the calls, as the decoder process keeps it
    for a in range(0, len(bounds), GROUP):
        got = decode_moments(path, frames, size, bounds[a:a + GROUP], reader)
        done += sum(isinstance(v, DecodedVideo) for v in got)
    reader.close()
    return {"seconds": time.perf_counter() - t, "decoded": done}


def _alone(args: tuple[str, list[tuple[float, float]], int, int]) -> dict:
    from tvrpipe.features.decode import decode_video

    path, bounds, frames, size = args
    t = time.perf_counter()
    for start, end in bounds:
        decode_video(path, frames, size, start, end)
    return {"seconds": time.perf_counter() - t}


def _one_pass(args: tuple[str, int]) -> dict:
    import decord

    from tvrpipe.features.decode.probe import probe_size
    from tvrpipe.features.decode.sampling import resize_dims

    path, size = args
    w, h = resize_dims(*probe_size(Path(path)), size)
    t = time.perf_counter()
    vr = decord.VideoReader(path, width=w, height=h, num_threads=1)
    n = len(vr)
    for a in range(0, n, 256):
        vr.get_batch(list(range(a, min(a + 256, n)))).asnumpy()
    return {"seconds": time.perf_counter() - t, "frames": n}


@dataclass(frozen=True)
class MomentsBench:
    """The figures of :func:`bench_moments` (seconds)."""

    seconds: float
    window: float
    stride: float
    moments: int
    frames: int
    image_size: int
    file_frames: int
    moments_seconds: float
    one_pass_seconds: float
    alone_seconds_first_group: float
    alone_moments: int

    @property
    def ratio(self) -> float:
        return self.moments_seconds / self.one_pass_seconds

    def record(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}

    def lines(self) -> list[str]:
        per = self.alone_seconds_first_group / max(1, self.alone_moments)
        return [f"a {self.seconds:g} s file ({self.file_frames:,} frames, {WIDTH}x{HEIGHT} at {FPS} fps) cut into "
                f"{self.moments:,} moments ({self.window:g} s every {self.stride:g} s), {self.frames} frames each at "
                f"{self.image_size} px",
                f"moments decoded together: {self.moments_seconds:.1f} s; one decode pass of the file: "
                f"{self.one_pass_seconds:.1f} s; ratio {self.ratio:.2f}x (goal: <= 1.3x)",
                f"each moment decoded alone (the first {self.alone_moments}): {per:.2f} s a moment, "
                f"{per * self.moments:.0f} s for the file at that rate"]


def bench_moments(out_dir: str | os.PathLike[str], seconds: float = 3600.0, window: float = 10.0,
                  stride: float | None = None, frames: int = 12, image_size: int = 224) -> MomentsBench:
    """Time a long file's moments decoded as extraction decodes them against one decode pass of the file.

    Example:
        >>> bench_moments("bench/moments", seconds=600).ratio  # doctest: +SKIP
    """
    from tvrpipe.errors import ConfigError
    from tvrpipe.features.collection import Cutting

    if not seconds > 0:
        raise ConfigError(f"--long-video {seconds}: a positive number of seconds")
    cutting = Cutting(float(window), float(stride if stride is not None else window))  # checks window and stride
    check_room("bench extract --long-video", out_dir, videos_needs(1, WIDTH, HEIGHT, seconds, FPS),
               "--long-video's seconds")
    path = long_video(Path(out_dir) / f"long-{seconds:g}s.mp4", seconds)
    bounds = cutting.bounds(float(seconds))
    runs = {"moments decoded together": (_moments, (str(path), bounds, frames, image_size)),
            "one decode pass": (_one_pass, (str(path), image_size)),
            "moments decoded alone": (_alone, (str(path), bounds[:GROUP], frames, image_size))}
    together, one, alone = (in_fresh_process(*runs[what], what) for what in stages(list(runs)))
    if together["decoded"] != len(bounds):
        raise RuntimeError(f"{len(bounds) - together['decoded']} of {len(bounds)} moments of {path} did not decode")
    return MomentsBench(seconds=float(seconds), window=cutting.window_s, stride=cutting.stride_s, moments=len(bounds),
                        frames=frames, image_size=image_size, file_frames=one["frames"],
                        moments_seconds=together["seconds"], one_pass_seconds=one["seconds"],
                        alone_seconds_first_group=alone["seconds"], alone_moments=min(GROUP, len(bounds)))
