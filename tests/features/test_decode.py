"""Tests of tvrpipe.features.decode on small H.264 videos written here with PyAV.

Frame k of a "counter" video encodes k in two grey levels (top half: k // 16, bottom half:
k % 16, 16 levels apart, losslessly coded), so a test can read back WHICH frames were sampled.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest

from tvrpipe.errors import VideoError
from tvrpipe.features.decode import (
    FRAME_SAMPLING,
    DecodedVideo,
    DecodeFailure,
    DecodeWorker,
    decode_video,
    probe,
    readers,
    resize_dims,
    sample_indices,
    sampling,
)

FPS = 25
S = 64  # image size in these tests: decord-safe widths (see test_decord_row_padding_widths)


# ----------------------------------------------------------------------------- test videos


def counter_image(k: int, width: int, height: int) -> np.ndarray:
    """uint8 (height, width, 3): top half grey 8 + 16 * (k // 16), bottom half 8 + 16 * (k % 16)."""
    img = np.empty((height, width, 3), np.uint8)
    img[: height // 2] = 8 + 16 * (k // 16)
    img[height // 2 :] = 8 + 16 * (k % 16)
    return img


def textured_image(k: int, width: int, height: int) -> np.ndarray:
    """uint8 (height, width, 3): moving colour gradients and a moving box, to compare readers."""
    yy, xx = np.mgrid[0:height, 0:width]
    img = np.stack([(xx * 3 + 4 * k) % 256, (yy * 3 + 2 * k) % 256, ((xx + yy) * 2 + 6 * k) % 256], -1)
    x, y = (5 * k) % width, (3 * k) % height
    img[max(0, y - 8) : y + 8, max(0, x - 8) : x + 8] = (250, 30, 30)
    return img.astype(np.uint8)


def write_video(
    path: Path, n: int, width: int = 80, height: int = 64, image=counter_image, lossless: bool = True,
    options: dict[str, str] | None = None, muxer_options: dict[str, str] | None = None,
    extra_packets: int = 0,
) -> Path:
    """Write an H.264/yuv420p mp4 of ``n`` frames at 25 fps; frame k is ``image(k, width, height)``.

    ``extra_packets`` appends packets that hold only an access-unit delimiter: the container then
    counts ``n + extra_packets`` frames of which only ``n`` decode (a lying frame count).
    """
    with av.open(str(path), "w", options=muxer_options or {}) as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", **({"qp": "0"} if lossless else {}), **(options or {})}
        last = None
        for k in range(n):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image(k, width, height), format="rgb24")):
                container.mux(packet)
                last = packet
        for packet in stream.encode():
            container.mux(packet)
            last = packet
        step = int(1 / (FPS * last.time_base))
        for j in range(1, extra_packets + 1):
            packet = av.Packet(b"\x00\x00\x00\x02\x09\x10")  # a 2-byte AUD NAL unit, no picture
            packet.stream, packet.time_base = stream, last.time_base
            packet.pts, packet.dts, packet.duration = last.pts + j * step, last.dts + j * step, step
            container.mux(packet)
    return path


def read_counter(frames: np.ndarray) -> list[int]:
    """Frame numbers encoded in decoded counter frames (uint8 [N, S, S, 3])."""
    size = frames.shape[1]
    top = frames[:, size // 8 : 3 * size // 8].mean(axis=(1, 2, 3))
    bottom = frames[:, 5 * size // 8 : 7 * size // 8].mean(axis=(1, 2, 3))
    return [int(16 * round((t - 8) / 16) + round((b - 8) / 16)) for t, b in zip(top, bottom, strict=True)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("videos")
    return {
        "counter100": write_video(root / "counter100.mp4", 100),
        "counter5": write_video(root / "counter5.mp4", 5),
        "textured": write_video(root / "textured.mp4", 40, 96, 72, image=textured_image, lossless=False),
        "lying": write_video(root / "lying.mp4", 100, options={"g": "10", "bf": "0"}, extra_packets=10),
    }


# ----------------------------------------------------------------------------- sampling, sizes


def test_sample_indices_segment_centres():
    assert FRAME_SAMPLING == "uniform-segment-centre"
    # floor((i + 0.5) * n / num), computed by hand
    assert sample_indices(100, 12).tolist() == [4, 12, 20, 29, 37, 45, 54, 62, 70, 79, 87, 95]
    assert sample_indices(13, 12).tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    assert sample_indices(12, 12).tolist() == list(range(12))
    assert sample_indices(5, 12).tolist() == [0, 1, 2, 3, 4]  # never repeated: the caller pads
    assert sample_indices(0, 12).tolist() == []
    assert sample_indices(100, 12).dtype == np.int64


@pytest.mark.parametrize("n", [1, 7, 12, 13, 24, 25, 97, 1000, 12345])
def test_sample_indices_matches_float_definition(n):
    got = sample_indices(n, 12)
    if n <= 12:
        assert got.tolist() == list(range(n))
    else:
        assert got.tolist() == [int(np.floor((i + 0.5) * n / 12)) for i in range(12)]
        assert np.all(np.diff(got) > 0)


def test_resize_dims_matches_torchvision_resize():
    torch = pytest.importorskip("torch")
    tvf = pytest.importorskip("torchvision.transforms.functional")
    for width, height in [(96, 64), (64, 96), (320, 240), (1280, 720), (100, 100), (33, 17), (17, 33),
                          (1920, 1080), (640, 360), (123, 457), (101, 99)]:
        for size in (32, 64, 224, 336):
            out = tvf.resize(torch.zeros(1, height, width), size, antialias=True)
            assert resize_dims(width, height, size) == (out.shape[2], out.shape[1]), (width, height, size)


def test_centre_crop_matches_torchvision_center_crop():
    torch = pytest.importorskip("torch")
    tvf = pytest.importorskip("torchvision.transforms.functional")
    rng = np.random.default_rng(0)
    for height, width in [(64, 102), (64, 101), (64, 64), (99, 64), (224, 398), (224, 298)]:
        frames = rng.integers(0, 256, (2, height, width, 3), dtype=np.uint8)
        want = tvf.center_crop(torch.from_numpy(frames).permute(0, 3, 1, 2), [64, 64]).permute(0, 2, 3, 1)
        np.testing.assert_array_equal(sampling.centre_crop(frames, 64), want.numpy())


def test_decord_row_padding_widths():
    # measured on a 32-byte-aligned machine: decord 0.6 fails for exactly these widths in 8..129
    bad = [w for w in range(8, 130) if not readers._decord_can_output(w)]
    assert set(bad) >= {8, 12, 16, 24, 48, 72}
    assert max(w for w in range(1, 5000) if not readers._decord_can_output(w)) == 144
    for width, height in [(80, 64), (96, 72), (128, 80)]:  # the test videos' resized widths
        assert readers._decord_can_output(resize_dims(width, height, S)[0])


# ----------------------------------------------------------------------------- decode_video


def test_decode_video_samples_the_right_frames(videos):
    video = decode_video(videos["counter100"], 12, S)
    idx = sample_indices(100, 12)
    assert isinstance(video, DecodedVideo) and video.reader == "decord"
    assert video.frames.shape == (12, S, S, 3) and video.frames.dtype == np.uint8
    assert video.mask.dtype == bool and video.mask.all()
    assert read_counter(video.frames) == idx.tolist()
    assert video.timestamps.dtype == np.float32
    np.testing.assert_allclose(video.timestamps, idx / FPS, atol=1e-3)


def test_short_video_is_padded_not_repeated(videos):
    video = decode_video(videos["counter5"], 12, S)
    assert video.mask.tolist() == [True] * 5 + [False] * 7
    assert read_counter(video.frames[:5]) == [0, 1, 2, 3, 4]
    assert not video.frames[5:].any()
    np.testing.assert_allclose(video.timestamps[:5], np.arange(5) / FPS, atol=1e-3)
    assert np.isnan(video.timestamps[5:]).all()


def test_centre_crop_keeps_the_middle(tmp_path):
    # 128x80 -> resized to 102x64 -> the crop drops 19 resized columns (23.75 source columns) per
    # side: red 16-px borders must vanish; green stripes at source columns 28-31 and 96-99 must
    # land symmetrically inside the crop.
    def image(k, width, height):
        img = np.full((height, width, 3), 128, np.uint8)
        img[:, :16] = img[:, -16:] = (255, 0, 0)
        img[:, 28:32] = img[:, 96:100] = (0, 255, 0)
        return img

    path = write_video(tmp_path / "bordered.mp4", 3, 128, 80, image=image)
    assert resize_dims(128, 80, S) == (102, 64)
    for video in (decode_video(path, 3, S), readers._read_pyav(path, 3, S, None, None)):
        frames = video.frames.astype(int)
        assert (frames[..., 0] - frames[..., 1]).max() < 40, video.reader  # no red left
        green = np.clip(frames[..., 1] - frames[..., 0], 0, None).mean(axis=(0, 1))  # (S,) per column
        columns = np.arange(S)
        half = columns < S // 2
        left = (columns * green)[half].sum() / green[half].sum()  # stripe centres, in pixels
        right = (columns * green)[~half].sum() / green[~half].sum()
        assert abs(left - 4.4) <= 1.5 and abs(left + right - (S - 1)) <= 1.5, (video.reader, left, right)


def test_display_rotation_is_applied(tmp_path):
    # Coded 96x64 with the top half red and the bottom half blue, flagged "rotate 90 degrees
    # counter-clockwise" for display: players (and decord) show it 64x96 with red on the left.
    def image(k, width, height):
        img = np.zeros((height, width, 3), np.uint8)
        img[: height // 2] = (220, 20, 20)
        img[height // 2 :] = (20, 20, 220)
        return img

    path = tmp_path / "rotated.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 96, 64, "yuv420p"
        stream.set_display_rotation(90)
        for k in range(3):
            for packet in stream.encode(av.VideoFrame.from_ndarray(image(k, 96, 64), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    assert probe.probe_size(path) == (64, 96)
    a, b = decode_video(path, 3, S), readers._read_pyav(path, 3, S, None, None)
    assert a.reader == "decord"
    for video in (a, b):
        red_minus_blue = video.frames[..., 0].astype(int) - video.frames[..., 2]  # (3, S, S)
        assert (red_minus_blue[:, :, : S // 2 - 4] > 100).all()  # red on the left
        assert (red_minus_blue[:, :, S // 2 + 4 :] < -100).all()  # blue on the right
    assert np.abs(a.frames.astype(int) - b.frames.astype(int)).mean() < 3.0


def test_pyav_fallback_agrees_with_decord(videos):
    for name in ("counter100", "textured"):
        path = videos[name]
        a = readers._read_decord(path, 12, S, None, None)
        b = readers._read_pyav(path, 12, S, None, None)
        assert (a.reader, b.reader) == ("decord", "pyav")
        assert np.abs(a.frames.astype(int) - b.frames.astype(int)).mean() < 3.0, name
        np.testing.assert_array_equal(a.mask, b.mask)
        np.testing.assert_allclose(a.timestamps, b.timestamps, atol=1e-3)
    b = readers._read_pyav(videos["counter100"], 12, S, None, None)
    assert read_counter(b.frames) == sample_indices(100, 12).tolist()


@pytest.mark.parametrize("reader", ["decord", "pyav"])
def test_clip_range_samples_inside_it(videos, reader):
    video = readers.decode_with_readers(videos["counter100"], 12, S, 1.0, 2.0, (reader,))
    assert video.reader == reader
    # frames 25..49 have times in [1.0, 2.0); their segment centres, by hand:
    assert read_counter(video.frames) == [26, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48]
    assert ((video.timestamps >= 1.0) & (video.timestamps < 2.0)).all()
    np.testing.assert_allclose(video.timestamps, np.arange(26, 50, 2) / FPS, atol=1e-3)  # file time
    # an open start (NaN, as pandas gives for a missing value): frames 0..12
    video = readers.decode_with_readers(videos["counter100"], 12, S, float("nan"), 0.5, (reader,))
    assert read_counter(video.frames) == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]


def test_clip_range_without_frames(videos):
    with pytest.raises(DecodeFailure) as info:
        decode_video(videos["counter100"], 12, S, start_s=10.0, end_s=12.0)
    assert info.value.kind == "no_frames"
    with pytest.raises(DecodeFailure) as info:
        decode_video(videos["counter100"], 12, S, start_s=2.0, end_s=2.0)
    assert info.value.kind == "no_frames"


def test_lying_frame_count_goes_to_pyav(videos):
    # 110 packets, 100 pictures: decord's get_batch fails. A retry inside decord, clamped to the 100
    # decodable frames, returned frames shifted early about one time in fifty, silently; so PyAV
    # decodes such a file, every time, and samples among the 100 frames that exist.
    want = sample_indices(100, 12).tolist()
    for _ in range(5):
        video = decode_video(videos["lying"], 12, S)
        assert video.reader == "pyav" and read_counter(video.frames) == want
        np.testing.assert_allclose(video.timestamps, np.asarray(want) / FPS, atol=1e-3)
    decord = pytest.importorskip("decord")
    with pytest.raises(decord.DECORDError, match="packet"):  # decord's own error; PyAV then takes over
        readers._read_decord(videos["lying"], 12, S, None, None)


def test_truncated_download_falls_back_to_pyav(tmp_path):
    # The index (moov) is at the front, the data stops at 60 %: decord cannot even open the file,
    # PyAV decodes the frames that are there; the sample is drawn from those.
    full = write_video(
        tmp_path / "full.mp4", 100, options={"g": "10"}, muxer_options={"movflags": "+faststart"}
    )
    data = full.read_bytes()
    path = tmp_path / "truncated.mp4"
    path.write_bytes(data[: len(data) * 6 // 10])
    video = decode_video(path, 12, S)
    got = read_counter(video.frames)
    assert video.reader == "pyav" and video.mask.all()
    assert any(got == sample_indices(n, 12).tolist() for n in range(30, 80)), got
    np.testing.assert_allclose(video.timestamps, np.asarray(got) / FPS, atol=1e-3)


def test_corrupt_file_decodes_or_fails_cleanly(tmp_path):
    data = bytearray(write_video(tmp_path / "good.mp4", 100, options={"g": "10"}).read_bytes())
    rng = np.random.default_rng(2)
    for offset in rng.integers(len(data) // 4, len(data), 100):
        data[offset] ^= 0xFF
    path = tmp_path / "corrupt.mp4"
    path.write_bytes(bytes(data))
    try:
        video = decode_video(path, 12, S)
    except DecodeFailure as failure:
        assert failure.kind in ("unreadable", "no_frames")
    else:  # pixels may be garbage (the decoder conceals errors), the bookkeeping may not
        k = int(video.mask.sum())  # the frames that decoded, sampled and padded as usual
        assert video.frames.shape == (12, S, S, 3) and k >= 1 and video.mask[:k].all()
        assert np.all(np.diff(video.timestamps[:k]) > 0) and video.timestamps[k - 1] < 100 / FPS
        assert not video.frames[k:].any() and np.isnan(video.timestamps[k:]).all()


# ----------------------------------------------------------------------------- failures


def test_failure_kinds(tmp_path, videos):
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "random.mp4").write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    (tmp_path / "header.mp4").write_bytes(videos["counter5"].read_bytes()[:200])  # truncated mp4
    cases = {"empty.mp4": "empty", "random.mp4": "unreadable", "header.mp4": "unreadable",
             "missing.mp4": "missing"}
    for name, kind in cases.items():
        with pytest.raises(DecodeFailure) as info:
            decode_video(tmp_path / name, 12, S)
        failure = info.value
        assert isinstance(failure, VideoError) and failure.kind == kind, (name, failure)
        assert str(tmp_path / name) in str(failure) and kind in str(failure) and "\n" not in str(failure)
    with pytest.raises(DecodeFailure) as info:
        decode_video(tmp_path / "random.mp4", 12, S)
    assert "decord" in info.value.detail and "pyav" in info.value.detail  # both readers were tried


def test_decode_failure_pickles():
    failure = DecodeFailure("timeout", Path("/data/v.mp4"), "no result within 60 s;\ndecoder killed")
    again = pickle.loads(pickle.dumps(failure))
    assert type(again) is DecodeFailure
    assert (again.kind, again.path, again.detail, str(again)) == (
        failure.kind, failure.path, failure.detail, str(failure))
    assert str(again) == "cannot decode /data/v.mp4 (timeout): no result within 60 s; decoder killed"
    with pytest.raises(ValueError):
        DecodeFailure("bogus", "v.mp4", "")


# ----------------------------------------------------------------------------- DecodeWorker


def test_worker_decodes_like_in_process(videos):
    with DecodeWorker(timeout_s=30) as worker:
        assert worker.pid is None  # started lazily
        cases = [("counter100", (None, None)), ("counter5", (None, None)), ("counter100", (1.0, 2.0))]
        for name, clip in cases:
            here = decode_video(videos[name], 12, S, *clip)
            there = worker.decode(videos[name], 12, S, *clip)
            np.testing.assert_array_equal(there.frames, here.frames)
            np.testing.assert_array_equal(there.mask, here.mask)
            np.testing.assert_array_equal(there.timestamps, here.timestamps)  # NaN == NaN here
            assert there.reader == here.reader
        pid = worker.pid
        with pytest.raises(DecodeFailure) as info:  # failures come back as themselves
            worker.decode(videos["counter100"].with_name("missing.mp4"), 12, S)
        assert info.value.kind == "missing" and worker.pid == pid  # and the child survives
    assert worker.pid is None


def test_worker_times_out_on_a_hang_and_recovers(tmp_path, videos):
    fifo = tmp_path / "hang.mp4"
    os.mkfifo(fifo)  # opening it for reading blocks forever: no writer
    timeout = 1.0
    with DecodeWorker(timeout_s=timeout) as worker:
        worker.decode(videos["counter5"], 12, S)  # start the child outside the timed part
        start = time.monotonic()
        with pytest.raises(DecodeFailure) as info:
            worker.decode(fifo, 12, S)
        elapsed = time.monotonic() - start
        assert info.value.kind == "timeout" and str(fifo) in str(info.value)
        # one attempt with decord, one with PyAV alone, each killed after `timeout`
        assert 2 * timeout <= elapsed < 2 * timeout + 8, elapsed
        video = worker.decode(videos["counter100"], 12, S)
        assert read_counter(video.frames) == sample_indices(100, 12).tolist()


def test_worker_reports_a_dead_decoder_and_recovers(tmp_path, videos):
    fifo = tmp_path / "crash.mp4"
    os.mkfifo(fifo)
    with DecodeWorker(timeout_s=30) as worker:
        worker.decode(videos["counter5"], 12, S)
        stop, killed = threading.Event(), set()

        def crash_every_new_child():  # a "segfault in a codec" while it hangs on the FIFO
            while not stop.wait(0.2):
                pid = worker.pid
                if pid is not None and pid not in killed:
                    killed.add(pid)
                    os.kill(pid, signal.SIGSEGV)

        killer = threading.Thread(target=crash_every_new_child, daemon=True)
        killer.start()
        try:
            with pytest.raises(DecodeFailure) as info:
                worker.decode(fifo, 12, S)
        finally:
            stop.set()
            killer.join()
        assert info.value.kind == "unreadable"
        assert f"decoder process died (exit code {-signal.SIGSEGV})" in info.value.detail
        video = worker.decode(videos["counter5"], 12, S)
        assert read_counter(video.frames[:5]) == [0, 1, 2, 3, 4]


def test_worker_child_exits_with_its_parent(tmp_path, videos):
    # A parent killed with SIGKILL must not leave a decoder spinning (or hanging) forever.
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc")
    fifo = tmp_path / "hang.mp4"
    os.mkfifo(fifo)
    script = (
        "import sys; from tvrpipe.features.decode import DecodeWorker; w = DecodeWorker(100); "
        "w.decode(sys.argv[1], 2, 64); print(w.pid, flush=True); w.decode(sys.argv[2], 2, 64)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script, str(videos["counter5"]), str(fifo)],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5.0
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie does not count: nobody may reap it in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
