"""Video decoding: F frames per video, resized at decode time, centre-cropped to S x S.

Decode is the extraction bottleneck (docs/design.md, "Extraction"), so the fast path does as little
as it can: a cheap PyAV probe for the frame size, then one decord ``VideoReader`` opened with
``num_threads=1`` and the target size (FFmpeg scales while decoding), ONE sorted ``get_batch``
per video, and a centre crop by slicing. When decord fails, PyAV decodes the file sequentially
before the video is declared failed. :class:`DecodeWorker` runs all of this in a killable child
process with a per-video wall-clock timeout: decord can spin forever in native code on a file
whose frame count lies (dmlc/decord#373, #375), where no Python-level timeout reaches it.

Sampling (``FRAME_SAMPLING``): split the video's ``n`` frames (or the frames inside the clip's
``[start_s, end_s)``) into ``F`` equal segments and take each segment's centre frame,
``floor((i + 0.5) * n / F)``. This is the test-time "uniform" mode of X-Pool and T-MASS (from
Frozen-in-Time), whose integer arithmetic picks the same frame or the one before; CLIP4Clip's
``linspace(0, n - 1, F)`` instead includes the first and last frames. A video with fewer than
``F`` frames gives all its frames, padded with zero frames and ``mask = False``; frames are never
repeated to fill ``F``. Training (``tvrpipe finetune``) passes ``offsets`` to take a random frame of
each segment instead (the "rand" mode of X-Pool and T-MASS), drawn by the caller from its seed.

Choices where the papers and codebases are silent or differ:

- Resize: the short side goes to ``S`` and the long side to ``int(S * long / short)``, as
  torchvision's ``Resize(S)`` (which CLIP's preprocessing uses); then the torchvision centre crop.
  The interpolation is FFmpeg's (swscale) **bilinear**, not CLIP's bicubic: decord 0.6 builds the
  filter ``scale=W:H`` with no flags, and the default flags of that filter in its bundled FFmpeg
  4.1 are ``bilinear`` (swscale's bilinear widens its kernel when downscaling, so it is
  antialiased, like PIL's). The PyAV fallback asks swscale for bilinear too, so both readers
  agree to within about 1 grey level (they differ in FFmpeg version and conversion order).
- Display rotation (phone videos) is applied by both readers, so frames come out upright; the
  probe decodes the first frame to read the rotation (measured: +0.5 ms at 320x240, +5 ms at
  1280x720, under 1 % of a 12-frame decode). Non-square pixels (sample aspect ratio) are
  ignored, as decord, PIL and CLIP pipelines do.
- Timestamps are seconds on the video stream's own timeline (its first frame at about 0, as
  players show it and as decord reports it), not relative to ``start_s``: a clip's frames keep
  their file time. Both readers use presentation timestamps (``pts - stream.start_time``).
- decord silently returns the previous frame for frames it cannot decode (its "fault tolerance"
  cache); tvrpipe opens it with a near-zero tolerance so that this raises instead, and then
  falls back to PyAV. A retry inside decord is not safe: on a file whose frame count lies, decord
  returned frames one or more positions early about one time in fifty, with no error. decord 0.6
  also fails for a few output widths of at most 144 px (a row-padding bug); those go straight to
  PyAV.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError, VideoError

log = logging.getLogger(__name__)

FRAME_SAMPLING = "uniform-segment-centre"  # recorded in store provenance
MAX_TIMEOUT_S = 2_000_000  # --timeout's limit: the decoder process is waited for in milliseconds, a C int
RESIZE_INTERPOLATION = "bilinear"  # swscale's, at decode (see the module docstring)

_READERS = ("decord", "pyav")  # tried in this order
# decord raises once more than this fraction of the video's frames were substituted by a cached
# neighbour; any positive value below 1 / n_frames means "raise on the first substitution".
_NO_DUPLICATES = "1e-9"
# Frame times of the two readers are compared and clip bounds applied with this slack (seconds):
# far below one frame period, above float32 rounding of decord's timestamps.
_TIME_EPS = 1e-4
# A new decoder process needs a while to import numpy, PyAV and decord, more on a busy host;
# this does not count against the per-video timeout.
_STARTUP_TIMEOUT_S = 120.0
_DETAIL_MAX_CHARS = 600


def check_timeout(seconds: float) -> None:
    """``--timeout`` (extract's and finetune's per-video decode limit): > 0 and at most MAX_TIMEOUT_S.

    Raises:
        ConfigError: outside those bounds (an infinity included, NaN too).
    """
    if not 0 < seconds <= MAX_TIMEOUT_S:  # the decoder waits in whole milliseconds (a C int)
        raise ConfigError(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:,} seconds (23 days), got {seconds}")


class DecodeFailure(VideoError):
    """A video could not be decoded; ``kind`` says why, in a machine-readable word.

    Kinds: ``"missing"`` (no such file), ``"empty"`` (zero bytes), ``"unreadable"`` (neither
    reader could open or decode it, or the decoder process died), ``"no_frames"`` (it opens but
    has no decodable video frame, or none inside the clip range), ``"timeout"`` (the decoder
    process was killed after the per-video timeout).

    Args:
        kind: One of :attr:`KINDS`.
        path: The video file.
        detail: What went wrong (made one line).

    Example:
        >>> err = DecodeFailure("empty", "v.mp4", "the file has zero bytes")
        >>> err.kind, str(err)
        ('empty', 'cannot decode v.mp4 (empty): the file has zero bytes')
    """

    KINDS = ("missing", "empty", "unreadable", "no_frames", "timeout")

    def __init__(self, kind: str, path: str | os.PathLike[str], detail: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown DecodeFailure kind {kind!r}; expected one of {self.KINDS}")
        self.kind = kind
        self.path = str(path)
        self.detail = _one_line(detail)
        super().__init__(f"cannot decode {self.path} ({kind}): {self.detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle their args by default; ours has a different __init__ signature.
        return (type(self), (self.kind, self.path, self.detail))


@dataclass(frozen=True, eq=False)  # eq=False: numpy arrays have no single truth value
class DecodedVideo:
    """The sampled frames of one video (or clip), resized and centre-cropped.

    Attributes:
        frames: uint8 ``[F, S, S, 3]`` RGB; zeros where padded.
        mask: bool ``[F]``; False where padded (the video had fewer than F frames).
        timestamps: float32 ``[F]`` presentation time of each frame in seconds from the start of
            the file's video stream; NaN where padded.
        reader: ``"decord"`` or ``"pyav"``, whichever produced the frames.
    """

    frames: np.ndarray  # uint8 (F, S, S, 3)
    mask: np.ndarray  # bool (F,)
    timestamps: np.ndarray  # float32 (F,)
    reader: str


def sample_indices(n_frames: int, num: int, offsets: np.ndarray | None = None) -> np.ndarray:
    """Pick ``num`` frames of ``n_frames``: one frame in each of ``num`` equal segments.

    Without ``offsets`` (extraction and evaluation) it is each segment's centre frame,
    ``idx_i = floor((i + 0.5) * n_frames / num)``. With ``offsets`` u_i in [0, 1) (training-time
    sampling, the papers' "rand" mode) it is frame ``floor(u_i * size_i)`` of segment i, whose
    ``size_i`` frames are those k with ``floor(k * num / n_frames) = i``. When the video is shorter than ``num`` frames every frame is returned once
    (the caller pads; frames are never repeated).

    Args:
        n_frames: Number of frames to choose from (>= 0).
        num: Number of frames wanted (>= 1).
        offsets: Optional float ``[num]`` positions inside the segments, each in [0, 1).

    Returns:
        int64 ``[min(num, n_frames)]``, sorted, unique; a pure function of the arguments.

    Example:
        >>> sample_indices(100, 4).tolist()
        [12, 37, 62, 87]
        >>> sample_indices(100, 4, np.array([0.0, 0.0, 0.99, 0.5])).tolist()
        [0, 25, 74, 87]
        >>> sample_indices(3, 4).tolist()
        [0, 1, 2]
    """
    if n_frames < 0 or num < 1:
        raise ValueError(f"sample_indices needs n_frames >= 0 and num >= 1, got {n_frames}, {num}")
    if n_frames <= num:
        return np.arange(n_frames, dtype=np.int64)
    i = np.arange(num, dtype=np.int64)
    if offsets is None:
        # Integer form of floor((i + 0.5) * n / num): exact, no float rounding at segment centres.
        return (2 * i + 1) * n_frames // (2 * num)
    u = np.asarray(offsets, dtype=np.float64)
    if u.shape != (num,) or not ((u >= 0) & (u < 1)).all():
        raise ValueError(f"offsets must be {num} numbers in [0, 1), got {np.asarray(offsets).tolist()}")
    # Segment i holds the frames k with floor(k num / n) = i, i.e. [ceil(i n / num), ceil((i + 1) n / num)),
    # at least one since n > num; u picks one of them uniformly (sorted and unique by construction).
    lo = -(-i * n_frames // num)
    size = -(-(i + 1) * n_frames // num) - lo
    return lo + np.minimum(np.floor(u * size).astype(np.int64), size - 1)


def resize_dims(width: int, height: int, image_size: int) -> tuple[int, int]:
    """Output size of an aspect-preserving resize of the short side to ``image_size``.

    Same rounding as torchvision's ``Resize(image_size)``: the long side becomes
    ``int(image_size * long / short)`` (truncated).

    Args:
        width: Input width in pixels.
        height: Input height in pixels.
        image_size: Target length of the short side.

    Returns:
        ``(new_width, new_height)``.

    Example:
        >>> resize_dims(320, 240, 224)
        (298, 224)
    """
    if width < 1 or height < 1 or image_size < 1:
        raise ValueError(f"resize_dims needs positive sizes, got {width}x{height} -> {image_size}")
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(image_size * long / short)
    return (image_size, new_long) if width <= height else (new_long, image_size)


def decode_video(
    path: str | os.PathLike[str],
    num_frames: int,
    image_size: int,
    start_s: float | None = None,
    end_s: float | None = None,
    offsets: np.ndarray | None = None,
) -> DecodedVideo:
    """Decode ``num_frames`` uniformly sampled frames of a video, in this process.

    decord first (resize during decode, one sorted ``get_batch``); PyAV if decord fails. Use
    :class:`DecodeWorker` to get a wall-clock timeout.

    Args:
        path: The video file.
        num_frames: F, the number of frames wanted.
        image_size: S; frames are resized (short side) and centre-cropped to S x S.
        start_s: If given, only frames presented at or after this time (seconds) are sampled.
        end_s: If given, only frames presented before this time are sampled. None or NaN means
            the bound is open.
        offsets: None for the segment centres (extraction, evaluation), or F numbers in [0, 1)
            placing each frame inside its segment (training; see :func:`sample_indices`).

    Returns:
        The frames, their mask and timestamps, and the reader that produced them.

    Raises:
        DecodeFailure: The video is missing, empty, unreadable or has no frame in range.

    Example:
        >>> video = decode_video("video0.mp4", num_frames=12, image_size=224)  # doctest: +SKIP
        >>> video.frames.shape, int(video.mask.sum())  # doctest: +SKIP
        ((12, 224, 224, 3), 12)
    """
    return _decode(path, num_frames, image_size, start_s, end_s, _READERS, offsets)


class DecodeWorker:
    """A decoder child process with a per-video wall-clock timeout.

    The child is a fresh Python interpreter (``subprocess`` + exec, never a bare fork: the
    parent may hold threads, e.g. Ray's or torch's; and unlike multiprocessing's "spawn" it does
    not re-import the caller's ``__main__``, so scripts need no ``if __name__ == "__main__"``
    guard). It starts on the first :meth:`decode`, imports PyAV and decord itself, and serves
    requests over a socket pair with pickled messages. A request that takes longer than
    ``timeout_s`` gets the child killed; a request whose child dies (a crash in a codec) gets it
    reaped. Either way the request is retried once in a fresh child with PyAV alone, since these
    are decord's known failure modes (it spins forever on files whose frame count lies); if that
    fails too the video fails with kind ``"timeout"`` or ``"unreadable"``. So a hopeless video
    costs at most ``2 * timeout_s``. The child exits by itself when the parent goes away. One
    request at a time: use one worker per thread.

    Args:
        timeout_s: Wall-clock limit for one decode attempt, in seconds (child start-up excluded).

    Example:
        >>> with DecodeWorker(timeout_s=60) as worker:  # doctest: +SKIP
        ...     video = worker.decode("video0.mp4", 12, 224)
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None  # our end of the socket pair
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int | None:
        """Process id of the running child, or None before the first decode / after close."""
        return self._proc.pid if self._proc is not None else None

    def decode(
        self,
        path: str | os.PathLike[str],
        num_frames: int,
        image_size: int,
        start_s: float | None = None,
        end_s: float | None = None,
        offsets: np.ndarray | None = None,
    ) -> DecodedVideo:
        """Decode one video in the child process; same arguments and result as :func:`decode_video`.

        Raises:
            DecodeFailure: As :func:`decode_video`, plus kind ``"timeout"`` when no attempt
                finished within ``timeout_s``, and ``"unreadable"`` when the decoder died.
            VideoError: The child process could not start (an environment problem).
        """
        _check_sizes(num_frames, image_size)
        request = (str(path), int(num_frames), int(image_size), start_s, end_s)
        offsets = None if offsets is None else np.asarray(offsets, dtype=np.float64)
        video, lost = self._attempt(request, _READERS, offsets)
        if video is not None:
            return video
        log.debug("retrying with PyAV alone after: %s", lost)
        video, lost_again = self._attempt(request, ("pyav",), offsets)
        if video is not None:
            return video
        detail = f"{lost.detail}; then with PyAV alone: {lost_again.detail}"
        raise DecodeFailure(lost_again.kind, path, detail)

    def close(self) -> None:
        """Stop the child process (politely, then by force). The worker stays usable."""
        if self._finalizer is not None:
            self._finalizer()  # runs _shutdown once
        self._proc = self._conn = self._finalizer = None

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _attempt(
        self, request: tuple, readers: tuple[str, ...], offsets: np.ndarray | None
    ) -> tuple[DecodedVideo, None] | tuple[None, DecodeFailure]:
        """One request in the child. Failures the child reports are raised; losing the child
        (timeout, crash) is returned, so that the caller can retry."""
        path, how = request[0], "+".join(readers)
        conn = self._ensure_started()
        try:
            conn.send((*request, readers, offsets))
        except OSError:  # the child died between requests: start another and resend once
            self._kill()
            conn = self._ensure_started()
            conn.send((*request, readers, offsets))
        if not conn.poll(self.timeout_s):
            self._kill()
            detail = f"no result within {self.timeout_s:g} s ({how}); decoder process killed"
            return None, DecodeFailure("timeout", path, detail)
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            code = self._kill()
            return None, DecodeFailure("unreadable", path, f"decoder process died (exit code {code}) ({how})")
        if status == "ok":
            return payload, None
        raise payload

    def _ensure_started(self) -> Connection:
        if self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._kill()
        ours, theirs = socket.socketpair()
        with theirs:
            # The child imports tvrpipe from wherever this process does.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                # decord and FFmpeg print their own lines for a bad file; its failure is recorded
                # and reported by tvrpipe, so their lines show only with -v (INFO logging)
                stderr=None if logging.getLogger().getEffectiveLevel() <= logging.INFO else subprocess.DEVNULL,
            )
        conn = Connection(ours.detach())
        finalizer = weakref.finalize(self, _shutdown, proc, conn, True)
        try:
            if not conn.poll(_STARTUP_TIMEOUT_S):
                raise VideoError(f"the decoder process did not start within {_STARTUP_TIMEOUT_S:g} s")
            status, payload = conn.recv()
            if status != "ready":
                raise payload
        except BaseException as exc:
            finalizer.detach()
            code = _shutdown(proc, conn, False)
            if isinstance(exc, (EOFError, OSError)):
                raise VideoError(f"the decoder process exited while starting (exit code {code})") from None
            raise
        self._proc, self._conn, self._finalizer = proc, conn, finalizer  # only a ready child
        return conn

    def _kill(self) -> int | None:
        """Stop the child at once (no goodbye); return its exit code."""
        proc, conn = self._proc, self._conn
        if self._finalizer is not None:
            self._finalizer.detach()
        self._proc = self._conn = self._finalizer = None
        return _shutdown(proc, conn, False) if proc is not None else None


# ----------------------------------------------------------------------------- implementation


def _decode(
    path: str | os.PathLike[str],
    num_frames: int,
    image_size: int,
    start_s: float | None,
    end_s: float | None,
    readers: Sequence[str],
    offsets: np.ndarray | None = None,
) -> DecodedVideo:
    """decode_video with a choice of readers, tried in order (the worker retries with PyAV)."""
    _check_sizes(num_frames, image_size)
    if offsets is not None:
        sample_indices(num_frames + 1, num_frames, offsets)  # checks the offsets before any reader runs
    start_s, end_s = _bound(start_s), _bound(end_s)
    path = Path(path)
    _check_file(path)
    if start_s is not None and end_s is not None and end_s <= start_s:
        raise DecodeFailure("no_frames", path, f"empty clip range [{start_s:g}, {end_s:g}) s")
    errors, kind = [], "unreadable"
    for reader in readers:
        try:
            video = _READ[reader](path, num_frames, image_size, start_s, end_s, offsets)
        except DecodeFailure as failure:
            # A reader that opened the file and found no frame (in range) makes it "no_frames".
            kind = "no_frames" if failure.kind == "no_frames" else kind
            errors.append(f"{reader}: {failure.detail}")
        except Exception as exc:  # any reader error means: try the next reader
            errors.append(f"{reader}: {_describe(exc)}")
        else:
            if errors:
                log.debug("%s: decoded by %s after %s", path, reader, "; ".join(errors))
            return video
    raise DecodeFailure(kind, path, "; ".join(errors))


def _read_decord(
    path: Path, num_frames: int, image_size: int, start_s: float | None, end_s: float | None,
    offsets: np.ndarray | None = None,
) -> DecodedVideo:
    import decord

    width, height = _probe_size(path)
    new_w, new_h = resize_dims(width, height, image_size)
    if not _decord_can_output(new_w):
        raise RuntimeError(f"decord 0.6 cannot return frames {new_w} px wide (its row-padding bug)")
    vr = _open_decord(decord, path, new_w, new_h)
    times = _decord_times(vr)  # float64 (n,)
    idx = _pick(times, num_frames, start_s, end_s, path, offsets)
    # No retry inside decord when this fails: on a file whose frame count lies (more packets than
    # decodable frames) a second get_batch, even one clamped to the frames that do decode, returned
    # frames one or more positions early in about 2 % of tries (measured, 300 tries), silently. The
    # caller moves on to PyAV, whose sequential decode gets these files right.
    batch = vr.get_batch(idx).asnumpy()  # uint8 (k, new_h, new_w, 3)
    return _assemble(_centre_crop(batch, image_size), times[idx], num_frames, "decord")


def _open_decord(decord: Any, path: Path, width: int, height: int) -> Any:
    return decord.VideoReader(
        _ffmpeg_name(path), num_threads=1, width=width, height=height, fault_tol=_NO_DUPLICATES
    )


def _decord_can_output(width: int) -> bool:
    """False for the few narrow widths (all <= 144 px) that decord 0.6 mangles.

    decord takes an RGB frame as unpadded whenever FFmpeg's padded row length (``3 * width``
    rounded up as ``av_frame_get_buffer`` does, for a 32- or 64-byte alignment depending on the
    CPU) is a multiple of the width, and then fails with "The size must exactly match" (measured:
    8, 12, 16, 24, 48 and 72 px fail on a 32-byte machine).
    """
    for align in (32, 64):
        step = 1
        while True:  # FFmpeg widens the row to a multiple of `step` until its bytes align
            padded = -(-width // step) * step
            if (3 * padded) % align == 0 or step >= align:
                break
            step *= 2
        if padded != width and (3 * padded) % width == 0:
            return False
    return True


def _decord_times(vr: Any) -> np.ndarray:
    """Start time (s) of every frame, in presentation order: float64 [n]."""
    n = len(vr)
    times = vr.get_frame_timestamp(np.arange(n))[:, 0].astype(np.float64)
    # decord subtracts the stream's start_time even when it is unset (INT64_MIN): fall back to
    # frame index / average frame rate when its times are unusable.
    if n and not (np.isfinite(times).all() and np.abs(times).max() < 1e7):
        times = np.arange(n) / (vr.get_avg_fps() or 25.0)
    return times


def _read_pyav(
    path: Path, num_frames: int, image_size: int, start_s: float | None, end_s: float | None,
    offsets: np.ndarray | None = None,
) -> DecodedVideo:
    """Sequential PyAV decode: index the packets (no decoding), then decode once, keeping only
    the sampled frames. If fewer frames decode than there are packets (a corrupt or truncated
    file), the sample is redrawn from the frames that did decode and the file decoded again."""
    times = _pyav_packet_times(path)  # float64 (n,), presentation order
    idx = _pick(times, num_frames, start_s, end_s, path, offsets)
    crops, decoded_times = _pyav_decode(path, idx, times, image_size)
    if crops is None:
        if not decoded_times:
            raise DecodeFailure("no_frames", path, f"none of its {len(times)} frames decodes")
        log.warning("%s: %d of its %d frames decode; sampling among those",
                    path, len(decoded_times), len(times))
        times = np.asarray(decoded_times)
        idx = _pick(times, num_frames, start_s, end_s, path, offsets)
        crops, _ = _pyav_decode(path, idx, times, image_size)
        if crops is None:
            raise RuntimeError("PyAV decoded different frames in two passes over the file")
    return _assemble(crops, times[idx], num_frames, "pyav")


def _pyav_packet_times(path: Path) -> np.ndarray:
    """Presentation times (s) of the video stream's packets, sorted: float64 [n]."""
    import av

    with av.open(_ffmpeg_name(path)) as container:
        stream = _video_stream(container, path)
        pts = []
        try:
            for packet in container.demux(stream):
                # The last, empty packet only flushes the decoder; packets an edit list marks
                # as discarded (a stream cut at a non-keyframe) decode to no frame.
                if packet.size and not packet.is_discard:
                    pts.append(packet.pts)
        except av.FFmpegError:  # a truncated file: index what could be read
            pass
        if pts and None not in pts:
            return (np.sort(np.asarray(pts, dtype=np.float64)) - (stream.start_time or 0)) * float(
                stream.time_base
            )
        return np.arange(len(pts)) / _frame_rate(stream)


def _pyav_decode(
    path: Path, idx: np.ndarray, expected_times: np.ndarray, image_size: int
) -> tuple[np.ndarray | None, list[float]]:
    """Decode the file in order, keeping the frames at ordinals ``idx``.

    Returns:
        ``(crops, times)``: crops uint8 ``[len(idx), S, S, 3]`` if every wanted frame decoded
        where ``expected_times`` said it would, else None; times of the frames decoded (all of
        them when crops is None).
    """
    import av

    want = {int(k): row for row, k in enumerate(idx)}
    crops = np.empty((len(idx), image_size, image_size, 3), np.uint8)
    found, aligned, times = 0, True, []
    with av.open(_ffmpeg_name(path)) as container:
        stream = _video_stream(container, path)
        stream.codec_context.thread_count = 1  # one core per decode, like decord's path
        t0, time_base, rate = stream.start_time or 0, stream.time_base, _frame_rate(stream)
        for frame in _pyav_frames(av, container, stream):
            k = len(times)
            t = (frame.pts - t0) * float(time_base) if frame.pts is not None else k / rate
            times.append(t)
            # Ordinal k is frame k of the packet index only while their times agree; a packet
            # that decoded to nothing shifts every later ordinal.
            aligned = aligned and k < len(expected_times) and abs(t - expected_times[k]) < _TIME_EPS
            if aligned and k in want:
                crops[want[k]] = _pyav_resize_crop(frame, image_size)
                found += 1
                if found == len(idx):
                    return crops, times
    return None, times


def _pyav_frames(av: Any, container: Any, stream: Any) -> Iterator[Any]:
    """Decoded frames in presentation order, skipping packets the decoder rejects."""
    try:
        for packet in container.demux(stream):
            try:
                yield from packet.decode()
            except av.FFmpegError:  # a corrupt packet: the decoder resynchronises at the next one
                continue
    except av.FFmpegError:  # demuxing stopped early (truncated file): drain the decoder
        with contextlib.suppress(av.FFmpegError):
            yield from stream.codec_context.decode(None)


def _pyav_resize_crop(frame: Any, image_size: int) -> np.ndarray:
    """One PyAV frame -> uint8 [S, S, 3]: swscale bilinear resize, display rotation, centre crop."""
    rotation = _rotation(frame)
    width, height = (frame.height, frame.width) if rotation in (90, 270) else (frame.width, frame.height)
    new_w, new_h = resize_dims(width, height, image_size)
    coded_w, coded_h = (new_h, new_w) if rotation in (90, 270) else (new_w, new_h)
    image = frame.reformat(
        width=coded_w, height=coded_h, format="rgb24", interpolation="BILINEAR"
    ).to_ndarray()  # (coded_h, coded_w, 3)
    if rotation:
        image = np.rot90(image, rotation // 90)  # counter-clockwise, as decord's transpose filters
    return _centre_crop(image[None], image_size)[0]


def _probe_size(path: Path) -> tuple[int, int]:
    """Display width and height of the first video stream, cheaply (one frame decoded, for the
    rotation). Falls back to decord's first frame when PyAV cannot open the file."""
    import av

    try:
        # skip_frame=all: the stream-info probe reads the headers without decoding frames.
        with av.open(_ffmpeg_name(path), options={"threads": "1", "skip_frame": "all"}) as container:
            stream = _video_stream(container, path)
            codec = stream.codec_context
            width, height, rotation = codec.width, codec.height, 0
            codec.skip_frame, codec.thread_count = "DEFAULT", 1
            for packet in container.demux(stream):
                try:  # decode the first packet and flush, so no reordering delay
                    frames = codec.decode(packet) + codec.decode(None)
                except av.FFmpegError:
                    frames = []
                if frames:
                    width, height, rotation = frames[0].width, frames[0].height, _rotation(frames[0])
                break
    except av.FFmpegError as exc:
        import decord

        log.debug("%s: PyAV cannot probe it (%s); asking decord", path, exc)
        height, width = decord.VideoReader(_ffmpeg_name(path), num_threads=1).next().shape[:2]
        return width, height
    if width < 1 or height < 1:
        raise RuntimeError(f"the video stream reports size {width}x{height}")
    return (height, width) if rotation in (90, 270) else (width, height)


def probe_video(path: str | os.PathLike[str]) -> str | None:
    """Why extract could not decode ``path``, or None if it can: the file opens with PyAV (extract's
    fallback reader, so what it decodes extract decodes), has a video stream, and a frame of it
    decodes. Reads the headers and the packets up to the first frame that decodes (the whole file
    only when none does).

    Returns:
        None, or the reason as extract's failures record it: ``"kind: detail"`` with a kind of
        :class:`DecodeFailure` (``empty``, ``unreadable``, ``no_frames``, ...).

    Example:
        >>> probe_video("videos/notes.mp4")  # doctest: +SKIP
        'unreadable: InvalidDataError: [Errno 1094995529] Invalid data found when processing input'
    """
    import av

    p = Path(path)
    try:
        _check_file(p)
        try:
            with av.open(_ffmpeg_name(p), options={"threads": "1"}) as container:
                stream = _video_stream(container, p)
                stream.codec_context.thread_count = 1
                for _ in _pyav_frames(av, container, stream):
                    return None
        except DecodeFailure:
            raise
        except Exception as exc:  # PyAV's errors, and whatever a damaged container makes it raise
            why = exc.strerror if isinstance(exc, av.FFmpegError) and exc.strerror else _describe(exc)
            raise DecodeFailure("unreadable", p, why) from None
        raise DecodeFailure("no_frames", p, "no frame of its video stream decodes")
    except DecodeFailure as e:
        return f"{e.kind}: {e.detail}"


def _video_stream(container: Any, path: Path) -> Any:
    if not container.streams.video:
        raise DecodeFailure("no_frames", path, "the file has no video stream")
    return container.streams.video[0]


def _frame_rate(stream: Any) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 25.0


def _rotation(frame: Any) -> int:
    """Counter-clockwise display rotation of a PyAV frame, as 0, 90, 180 or 270."""
    rotation = round(frame.rotation or 0) % 360
    return rotation if rotation in (90, 180, 270) else 0


def _pick(
    times: np.ndarray, num_frames: int, start_s: float | None, end_s: float | None, path: Path,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """Sampled frame indices (int64 [<= F]) among the frames whose time is in [start_s, end_s)."""
    candidates = np.arange(len(times))
    if start_s is not None:
        candidates = candidates[times[candidates] >= start_s - _TIME_EPS]
    if end_s is not None:
        candidates = candidates[times[candidates] < end_s - _TIME_EPS]
    if candidates.size == 0:
        lo, hi = -np.inf if start_s is None else start_s, np.inf if end_s is None else end_s
        where = "" if start_s is None and end_s is None else f" in [{lo:g}, {hi:g}) s"
        span = f"; its {len(times)} frames span {times.min():.3f}-{times.max():.3f} s" if len(times) else ""
        raise DecodeFailure("no_frames", path, f"no frame{where}{span}")
    return candidates[sample_indices(candidates.size, num_frames, offsets)]


def _centre_crop(frames: np.ndarray, size: int) -> np.ndarray:
    """torchvision's CenterCrop on uint8 [N, H, W, 3] -> a view [N, S, S, 3] (H, W >= S)."""
    height, width = frames.shape[1:3]
    top = round((height - size) / 2.0)  # Python's round, as torchvision's
    left = round((width - size) / 2.0)
    return frames[:, top : top + size, left : left + size]


def _assemble(crops: np.ndarray, times: np.ndarray, num_frames: int, reader: str) -> DecodedVideo:
    """Pad k <= F frames to F: zero frames, mask False, NaN timestamps."""
    k, size = len(crops), crops.shape[1]
    frames = np.zeros((num_frames, size, size, 3), np.uint8)
    frames[:k] = crops
    mask = np.zeros(num_frames, bool)
    mask[:k] = True
    timestamps = np.full(num_frames, np.nan, np.float32)
    timestamps[:k] = times
    return DecodedVideo(frames=frames, mask=mask, timestamps=timestamps, reader=reader)


def _check_sizes(num_frames: int, image_size: int) -> None:
    if num_frames < 1 or image_size < 1:
        raise ValueError(f"num_frames and image_size must be >= 1, got {num_frames}, {image_size}")


def _bound(value: float | None) -> float | None:
    """A clip bound: None and NaN (a missing value in a manifest table) mean open."""
    return None if value is None or np.isnan(value) else float(value)


def _ffmpeg_name(path: str | os.PathLike[str]) -> str:
    """The name under which FFmpeg (PyAV, decord) opens ``path``: absolute, because FFmpeg reads a relative
    name whose first part holds a ':' as a protocol (``a:b.mp4``: "Protocol not found"), while on POSIX
    that is an ordinary file name."""
    return os.path.abspath(path)


def _check_file(path: Path) -> None:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise DecodeFailure("missing", path, "no such file") from None
    except OSError as exc:
        raise DecodeFailure("unreadable", path, f"cannot stat it: {exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise DecodeFailure("unreadable", path, "it is a directory, not a video file")
    # Only regular files have a meaningful size (a FIFO or device reports 0).
    if stat.S_ISREG(info.st_mode) and info.st_size == 0:
        raise DecodeFailure("empty", path, "the file has zero bytes")


_DMLC_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")


def _describe(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message, minus decord's
    '[hh:mm:ss] /path/file.cc:123: ' prefixes and stack trace."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = _DMLC_PREFIX.sub("", lines[0]) if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _DETAIL_MAX_CHARS else text[: _DETAIL_MAX_CHARS - 3] + "..."


_READ = {"decord": _read_decord, "pyav": _read_pyav}


# ----------------------------------------------------------------------------- decoder process


_CHILD_MAIN = "import sys; from tvrpipe.features.decode import _worker_main; _worker_main(*sys.argv[1:])"


def _worker_main(fd: str, parent_pid: str) -> None:
    """Body of the decoder process: serve (path, F, S, start_s, end_s, readers, offsets) requests
    arriving on the socket ``fd``; exit when the parent closes it or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(int(fd))
    threading.Thread(target=_exit_with_parent, args=(int(parent_pid),), daemon=True).start()
    try:
        import av  # noqa: F401
        import decord

        decord.logging.set_level(decord.logging.QUIET)  # failures are reported via DecodeFailure
    except Exception as exc:
        conn.send(("error", VideoError(f"the decoder process cannot import its readers: {_describe(exc)}")))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        try:
            reply: tuple[str, Any] = ("ok", _decode(*request))
        except Exception as exc:  # every error goes back to the parent
            reply = ("error", exc if _picklable(exc) else VideoError(_describe(exc)))
        conn.send(reply)


def _exit_with_parent(parent_pid: int) -> None:
    # A parent killed with SIGKILL cannot stop us, and a decode stuck in native code never
    # reads the closed socket; this thread still runs (decord's ctypes calls release the GIL).
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _shutdown(proc: subprocess.Popen, conn: Connection, polite: bool) -> int | None:
    """Stop a decoder process: ask it to exit (if polite), then SIGTERM, then SIGKILL."""
    if polite and proc.poll() is None:
        with contextlib.suppress(OSError):
            conn.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.5)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    conn.close()
    return proc.returncode


# ----------------------------------------------------------------------------- frames at given times


def frames_at(path: str | os.PathLike[str], times: Sequence[float], height: int) -> list[np.ndarray]:
    """The frames presented at ``times`` (seconds, on the timeline of :class:`DecodedVideo`'s
    timestamps), upright and scaled to ``height`` pixels with the aspect kept; for thumbnails.

    PyAV seeks to the keyframe before each time and decodes forward to the frame presented nearest
    it (a store's recorded timestamps are frame times, so that is the very frame extract sampled);
    a time past the last frame gives the last frame. Where a seek lands after its time (a
    file with a broken index), that time is decoded from the start of the file instead. No crop, no
    timeout: this is for showing a few frames, not for extraction.

    Args:
        path: The video file.
        times: Presentation times in seconds, in any order; finite.
        height: Output height in pixels (>= 1); the width follows the display aspect (rotation applied).

    Returns:
        One uint8 ``[height, W, 3]`` RGB array per time, in the order of ``times``.

    Raises:
        DecodeFailure: The file is missing, empty, unreadable, or no frame decodes.

    Example:
        >>> thumbs = frames_at("video0.mp4", [0.5, 2.0], height=96)  # doctest: +SKIP
        >>> thumbs[0].shape  # doctest: +SKIP
        (96, 128, 3)
    """
    import av

    path = Path(path)
    want = np.asarray(times, dtype=np.float64).reshape(-1)
    if height < 1 or not np.isfinite(want).all():
        raise ValueError(f"frames_at needs height >= 1 and finite times, got {height}, {want.tolist()}")
    _check_file(path)

    def scaled(frame: Any) -> np.ndarray:  # swscale bilinear to `height`, then the display rotation
        rotation = _rotation(frame)
        w, h = (frame.height, frame.width) if rotation in (90, 270) else (frame.width, frame.height)
        new_w = max(1, round(w * height / h))
        coded_w, coded_h = (height, new_w) if rotation in (90, 270) else (new_w, height)
        image = frame.reformat(width=coded_w, height=coded_h, format="rgb24", interpolation="BILINEAR")
        image = image.to_ndarray()  # (coded_h, coded_w, 3)
        return np.ascontiguousarray(np.rot90(image, rotation // 90) if rotation else image)

    out: list[np.ndarray | None] = [None] * len(want)
    try:
        with av.open(_ffmpeg_name(path)) as container:
            stream = _video_stream(container, path)
            stream.codec_context.thread_count = 1
            t0, time_base, rate = stream.start_time or 0, float(stream.time_base), _frame_rate(stream)
            # The frame nearest each time: the first at or after it less half a frame period (a
            # store's times are float32, a frame off after about 20 min at 25 fps otherwise).
            slack = 0.5 / rate
            for i in np.argsort(want, kind="stable"):
                target, found = want[i] - slack, None
                for from_start in (False, True):
                    # Seek to the keyframe at or before the target; from_start: to the file's start.
                    pts = t0 if from_start else t0 + int(np.floor(target / time_base))
                    container.seek(pts, stream=stream, backward=True, any_frame=False)
                    last, first = None, True
                    for k, frame in enumerate(_pyav_frames(av, container, stream)):
                        if frame.pts is None and not from_start:
                            break  # no frame times: count frames from the start instead
                        t = (frame.pts - t0) * time_base if frame.pts is not None else k / rate
                        if t >= target:
                            # A seek that lands after its target missed frames: retry from the start.
                            found = frame if (from_start or not first or t <= want[i] + slack) else None
                            break
                        last, first = frame, False
                    else:
                        found = last  # past the last frame: the last one
                    if found is not None:
                        break
                if found is None:
                    raise DecodeFailure("no_frames", path, f"no frame decodes at or before {want[i]:g} s")
                out[i] = scaled(found)
    except DecodeFailure:
        raise
    except Exception as exc:  # PyAV's errors, and anything else a broken file provokes
        raise DecodeFailure("unreadable", path, _describe(exc)) from None
    return out
