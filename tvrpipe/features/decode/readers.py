"""The two readers, decord (resize during decode, one sorted ``get_batch``) and PyAV (sequential decode,
the fallback), and :func:`decode_video`, which tries them in that order in this process."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.features.decode.failure import DecodeFailure, check_file, describe
from tvrpipe.features.decode.probe import (
    display_rotation,
    ffmpeg_name,
    frame_rate,
    probe_size,
    pyav_frames,
    video_stream,
)
from tvrpipe.features.decode.sampling import (
    TIME_EPS,
    DecodedVideo,
    assemble,
    centre_crop,
    check_sizes,
    clip_bound,
    pick_frames,
    resize_dims,
    sample_indices,
)

log = logging.getLogger(__name__)

RESIZE_INTERPOLATION = "bilinear"  # swscale's, at decode (see the package docstring)
READERS = ("decord", "pyav")  # tried in this order
# decord raises once more than this fraction of the video's frames were substituted by a cached
# neighbour; any positive value below 1 / n_frames means "raise on the first substitution".
_NO_DUPLICATES = "1e-9"


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
    return decode_with_readers(path, num_frames, image_size, start_s, end_s, READERS, offsets)


def decode_with_readers(
    path: str | os.PathLike[str],
    num_frames: int,
    image_size: int,
    start_s: float | None,
    end_s: float | None,
    readers: Sequence[str],
    offsets: np.ndarray | None = None,
) -> DecodedVideo:
    """decode_video with a choice of readers, tried in order (the worker retries with PyAV)."""
    check_sizes(num_frames, image_size)
    if offsets is not None:
        sample_indices(num_frames + 1, num_frames, offsets)  # checks the offsets before any reader runs
    start_s, end_s = clip_bound(start_s), clip_bound(end_s)
    path = Path(path)
    check_file(path)
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
            errors.append(f"{reader}: {describe(exc)}")
        else:
            if errors:
                log.debug("%s: decoded by %s after %s", path, reader, "; ".join(errors))
            return video
    raise DecodeFailure(kind, path, "; ".join(errors))


def decode_moments(
    path: str | os.PathLike[str],
    num_frames: int,
    image_size: int,
    bounds: Sequence[tuple[float | None, float | None]],
    reader: OpenFile | None = None,
) -> list[DecodedVideo | DecodeFailure]:
    """Several clips (moments) of one file, decoded from one open of it: each clip's frames as
    :func:`decode_video` of that clip alone gives them, or its :class:`DecodeFailure`.

    decord opens the file once, reads the frame times once, and decodes the union of the frames the clips
    sample in time order (:func:`read_order`): from one sampled frame to the next it decodes forward without
    converting the frames between, and into the next group of pictures it decodes on through the keyframe
    rather than seek to it (decord's seek, back to the start and then to the keyframe, costs more than the rest
    of a group of pictures); a frame two or more groups of pictures ahead is sought, so that moments far apart
    skip what no moment samples. With ``reader`` (an :class:`OpenFile` kept across calls, as the decoder process
    keeps one) the file stays open between calls and a call decodes on from where the last one stopped: a long
    file's moments, sent in time order a few per call, are one pass over the file. Where that fails (decord
    cannot read the file, a frame does not decode), every clip is decoded alone with :func:`decode_video`'s
    readers, so a failure is each clip's own, as if decoded alone.

    Args:
        path: the video file.
        num_frames, image_size: F and S, as :func:`decode_video`.
        bounds: ``(start_s, end_s)`` of each clip (None or NaN: open).
        reader: the open file to decode from, left open for the next call; None: opened for this call only.

    Returns:
        One result per clip, in the order of ``bounds``.

    Example:
        >>> [v.frames.shape for v in decode_moments("long.mp4", 12, 224, [(0, 10), (10, 20)])]  # doctest: +SKIP
        [(12, 224, 224, 3), (12, 224, 224, 3)]
    """
    check_sizes(num_frames, image_size)
    path = Path(path)
    clips = [(clip_bound(a), clip_bound(b)) for a, b in bounds]
    own = reader is None
    reader = OpenFile() if reader is None else reader
    try:
        return _moments_decord(path, num_frames, image_size, clips, reader)
    except Exception as exc:
        reader.close()  # where decord stopped is not known: the next call opens the file again
        log.debug("%s: decoding its %d moments together failed (%s); each alone", path, len(clips), describe(exc))
    finally:
        if own:
            reader.close()
    out: list[DecodedVideo | DecodeFailure] = []
    for start, end in clips:
        try:
            out.append(decode_with_readers(path, num_frames, image_size, start, end, READERS))
        except DecodeFailure as failure:
            out.append(failure)
    return out


class OpenFile:
    """A decord reader of one file kept open across :func:`decode_moments` calls, and the frame it decodes next.

    It is kept while the calls name the same file, unchanged (device, inode, size, modification time), at the
    same output size; another file closes it and opens that one. The decoder process keeps one, so that a long
    file's calls of a few moments each open the file once (decord indexes every packet of a file as it opens
    it: about a second for an hour of video) and decode on from where the last call stopped.

    Example:
        >>> reader = OpenFile()
        >>> first = decode_moments("long.mp4", 12, 224, [(0, 10), (10, 20)], reader)  # doctest: +SKIP
        >>> then = decode_moments("long.mp4", 12, 224, [(20, 30), (30, 40)], reader)  # doctest: +SKIP
        >>> reader.close()
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self.vr: Any = None
        self.times = np.zeros(0)  # float64 (n,): each frame's time (s), in presentation order
        self.keys = np.zeros(0, np.int64)  # the keyframes' indices, as decord seeks by them
        self.position = 0  # the frame decord decodes next

    def open(self, path: Path, image_size: int) -> None:
        """Read ``path`` at ``image_size`` from now on: the reader as it is if it already does, else a new one."""
        st = path.stat()
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, image_size)
        if key == self._key:
            return
        self.close()
        self.vr, self.times = _decord_reader(path, image_size)
        self.keys = np.asarray(self.vr.get_key_indices(), np.int64)
        self.position, self._key = 0, key  # decord stands at the first frame once it has indexed the file

    def read(self, frames: np.ndarray, image_size: int, chunk: int = 64) -> np.ndarray:
        """The centre crops of ``frames`` (sorted, unique), uint8 ``(len(frames), S, S, 3)``, decoded in
        :func:`read_order` from where the reader stands, ``chunk`` frames a ``get_batch`` (bounded memory)."""
        order = read_order(frames, self.keys, self.position)
        crops = np.empty((len(frames), image_size, image_size, 3), np.uint8)
        row = np.searchsorted(frames, order)  # each frame read's row in crops; a bridging frame has none
        mine = frames[np.minimum(row, len(frames) - 1)] == order
        for a in range(0, len(order), chunk):
            batch = centre_crop(self.vr.get_batch(order[a:a + chunk]).asnumpy(), image_size)
            crops[row[a:a + chunk][mine[a:a + chunk]]] = batch[mine[a:a + chunk]]
            self.position = int(order[min(a + chunk, len(order)) - 1]) + 1
        return crops

    def close(self) -> None:
        self.vr, self._key, self.position = None, None, 0


def read_order(frames: np.ndarray, keys: np.ndarray, position: int) -> np.ndarray:
    """The frames to ask decord for, in order, to decode ``frames`` (sorted, unique) from ``position``, given the
    keyframes ``keys``: ``frames``, and before each frame that lies in the group of pictures right after the one
    decord stands in, that group's last frame before the keyframe. decord reaches a frame of its own group by
    decoding forward (the frames between are not converted) but seeks to any frame of another group, back to
    the start of the file and then to its keyframe; asked for the frame just before the keyframe, it decodes
    on through it instead. A frame two or more groups ahead, or behind, is sought.

    Example:
        >>> read_order(np.array([2, 9, 30]), np.array([0, 8, 16, 24, 32]), 0).tolist()  # 9: next group; 30: far
        [2, 7, 9, 30]
    """
    if not len(keys):  # decord then takes the file as one group of pictures: it never seeks forward
        return np.asarray(frames, np.int64)
    group = np.searchsorted(keys, np.asarray(frames), "right") - 1
    out, at = [], int(position)
    for f, there in zip((int(x) for x in frames), group.tolist()):
        here = int(np.searchsorted(keys, at, "right")) - 1
        if f > at and there == here + 1:
            out.append(int(keys[there]) - 1)  # at or after `at`: decord stands in the group before
        out.append(f)
        at = f + 1
    return np.asarray(out, np.int64)


def _decord_reader(path: Path, image_size: int) -> tuple[Any, np.ndarray]:
    """A decord reader of ``path`` that outputs frames at their resized size for ``image_size``, and its frames'
    times in seconds (float64)."""
    import decord

    width, height = probe_size(path)
    new_w, new_h = resize_dims(width, height, image_size)
    if not _decord_can_output(new_w):
        raise RuntimeError(f"decord 0.6 cannot return frames {new_w} px wide (its row-padding bug)")
    vr = _open_decord(decord, path, new_w, new_h)
    return vr, _decord_times(vr)


def _moments_decord(path: Path, num_frames: int, image_size: int,
                    clips: list[tuple[float | None, float | None]], reader: OpenFile) -> list[DecodedVideo | DecodeFailure]:
    """:func:`decode_moments`'s one open: what :func:`_read_decord` does for one clip, for all of them."""
    check_file(path)
    reader.open(path, image_size)
    times = reader.times
    picks: list[np.ndarray | DecodeFailure] = []
    for start, end in clips:
        if start is not None and end is not None and end <= start:
            picks.append(DecodeFailure("no_frames", path, f"empty clip range [{start:g}, {end:g}) s"))
            continue
        try:
            picks.append(pick_frames(times, num_frames, start, end, path))
        except DecodeFailure as failure:  # as decode_video's: decord found no frame, so PyAV's index finds none
            picks.append(_read_alone(path, num_frames, image_size, start, end, failure))
    wanted = np.unique(np.concatenate([p for p in picks if isinstance(p, np.ndarray)] or [np.zeros(0, np.int64)]))
    if not len(wanted):
        return picks  # no clip has a frame to decode: each is its failure or decoded alone
    crops = reader.read(wanted, image_size)  # (k, S, S, 3), in time order
    return [p if not isinstance(p, np.ndarray) else
            assemble(crops[np.searchsorted(wanted, p)], times[p], num_frames, "decord") for p in picks]


def _read_alone(path: Path, num_frames: int, image_size: int, start: float | None, end: float | None,
                failure: DecodeFailure) -> DecodedVideo | DecodeFailure:
    """A clip in which decord found no frame, decoded alone (PyAV's packet index may still find one)."""
    try:
        return decode_with_readers(path, num_frames, image_size, start, end, READERS)
    except DecodeFailure as again:
        return again


def _read_decord(
    path: Path, num_frames: int, image_size: int, start_s: float | None, end_s: float | None,
    offsets: np.ndarray | None = None,
) -> DecodedVideo:
    vr, times = _decord_reader(path, image_size)
    idx = pick_frames(times, num_frames, start_s, end_s, path, offsets)
    # No retry inside decord when this fails: on a file whose frame count lies (more packets than
    # decodable frames) a second get_batch, even one clamped to the frames that do decode, returned
    # frames one or more positions early in about 2 % of tries (measured, 300 tries), silently. The
    # caller moves on to PyAV, whose sequential decode gets these files right.
    batch = vr.get_batch(idx).asnumpy()  # uint8 (k, new_h, new_w, 3)
    return assemble(centre_crop(batch, image_size), times[idx], num_frames, "decord")


def _open_decord(decord: Any, path: Path, width: int, height: int) -> Any:
    return decord.VideoReader(
        ffmpeg_name(path), num_threads=1, width=width, height=height, fault_tol=_NO_DUPLICATES
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
    times = packet_times(path)  # float64 (n,), presentation order
    idx = pick_frames(times, num_frames, start_s, end_s, path, offsets)
    crops, decoded_times = _pyav_decode(path, idx, times, image_size)
    if crops is None:
        if not decoded_times:
            raise DecodeFailure("no_frames", path, f"none of its {len(times)} frames decodes")
        log.warning("%s: %d of its %d frames decode; sampling among those",
                    path, len(decoded_times), len(times))
        times = np.asarray(decoded_times)
        idx = pick_frames(times, num_frames, start_s, end_s, path, offsets)
        crops, _ = _pyav_decode(path, idx, times, image_size)
        if crops is None:
            raise RuntimeError("PyAV decoded different frames in two passes over the file")
    return assemble(crops, times[idx], num_frames, "pyav")


def packet_times(path: Path) -> np.ndarray:
    """Presentation times (s) of the video stream's packets, sorted: float64 [n]."""
    import av

    with av.open(ffmpeg_name(path)) as container:
        stream = video_stream(container, path)
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
        return np.arange(len(pts)) / frame_rate(stream)


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
    with av.open(ffmpeg_name(path)) as container:
        stream = video_stream(container, path)
        stream.codec_context.thread_count = 1  # one core per decode, like decord's path
        t0, time_base, rate = stream.start_time or 0, stream.time_base, frame_rate(stream)
        for frame in pyav_frames(av, container, stream):
            k = len(times)
            t = (frame.pts - t0) * float(time_base) if frame.pts is not None else k / rate
            times.append(t)
            # Ordinal k is frame k of the packet index only while their times agree; a packet
            # that decoded to nothing shifts every later ordinal.
            aligned = aligned and k < len(expected_times) and abs(t - expected_times[k]) < TIME_EPS
            if aligned and k in want:
                crops[want[k]] = _pyav_resize_crop(frame, image_size)
                found += 1
                if found == len(idx):
                    return crops, times
    return None, times


def _pyav_resize_crop(frame: Any, image_size: int) -> np.ndarray:
    """One PyAV frame -> uint8 [S, S, 3]: swscale bilinear resize, display rotation, centre crop."""
    rotation = display_rotation(frame)
    width, height = (frame.height, frame.width) if rotation in (90, 270) else (frame.width, frame.height)
    new_w, new_h = resize_dims(width, height, image_size)
    coded_w, coded_h = (new_h, new_w) if rotation in (90, 270) else (new_w, new_h)
    image = frame.reformat(
        width=coded_w, height=coded_h, format="rgb24", interpolation="BILINEAR"
    ).to_ndarray()  # (coded_h, coded_w, 3)
    if rotation:
        image = np.rot90(image, rotation // 90)  # counter-clockwise, as decord's transpose filters
    return centre_crop(image[None], image_size)[0]


_READ = {"decord": _read_decord, "pyav": _read_pyav}
