"""Opening a video with FFmpeg through PyAV: its stream, frame rate and display rotation, its size
(probed cheaply before decord opens it), and :func:`probe_video` (whether extract can decode it)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tvrpipe.features.decode.failure import DecodeFailure, check_file, describe

log = logging.getLogger(__name__)

def probe_size(path: Path) -> tuple[int, int]:
    """Display width and height of the first video stream, cheaply (one frame decoded, for the
    rotation). Falls back to decord's first frame when PyAV cannot open the file."""
    import av

    try:
        # skip_frame=all: the stream-info probe reads the headers without decoding frames.
        with av.open(ffmpeg_name(path), options={"threads": "1", "skip_frame": "all"}) as container:
            stream = video_stream(container, path)
            codec = stream.codec_context
            width, height, rotation = codec.width, codec.height, 0
            codec.skip_frame, codec.thread_count = "DEFAULT", 1
            for packet in container.demux(stream):
                try:  # decode the first packet and flush, so no reordering delay
                    frames = codec.decode(packet) + codec.decode(None)
                except av.FFmpegError:
                    frames = []
                if frames:
                    width, height, rotation = frames[0].width, frames[0].height, display_rotation(frames[0])
                break
    except av.FFmpegError as exc:
        import decord

        log.debug("%s: PyAV cannot probe it (%s); asking decord", path, exc)
        height, width = decord.VideoReader(ffmpeg_name(path), num_threads=1).next().shape[:2]
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
        check_file(p)
        try:
            with av.open(ffmpeg_name(p), options={"threads": "1"}) as container:
                stream = video_stream(container, p)
                stream.codec_context.thread_count = 1
                for _ in pyav_frames(av, container, stream):
                    return None
        except DecodeFailure:
            raise
        except Exception as exc:  # PyAV's errors, and whatever a damaged container makes it raise
            why = exc.strerror if isinstance(exc, av.FFmpegError) and exc.strerror else describe(exc)
            raise DecodeFailure("unreadable", p, why) from None
        raise DecodeFailure("no_frames", p, "no frame of its video stream decodes")
    except DecodeFailure as e:
        return f"{e.kind}: {e.detail}"


def probe_duration(path: str | os.PathLike[str]) -> float:
    """Seconds from the video stream's first frame to its end, as :func:`probe_video`'s reader (PyAV) sees it:
    the end of the last packet (its presentation time plus its duration), read from the packet index without
    decoding a frame. The container's declared duration is not used: it counts the audio too, and a stream
    cut at a non-keyframe declares frames that are never shown.

    Raises:
        DecodeFailure: the file does not open, or its video stream has no packet.

    Example:
        >>> probe_duration("videos/beach.mp4")  # doctest: +SKIP
        23.04
    """
    import av

    p = Path(path)
    check_file(p)
    try:
        with av.open(ffmpeg_name(p), options={"threads": "1"}) as container:
            stream = video_stream(container, p)
            t0, time_base, end, n = stream.start_time or 0, float(stream.time_base), None, 0
            try:
                for packet in container.demux(stream):
                    if not packet.size or packet.is_discard:
                        continue
                    n += 1
                    if packet.pts is not None:
                        stop = (packet.pts - t0 + (packet.duration or 0)) * time_base
                        end = stop if end is None else max(end, stop)
            except av.FFmpegError:  # a truncated file: what could be read
                pass
            if end is None and n:
                end = n / frame_rate(stream)
    except DecodeFailure:
        raise
    except Exception as exc:
        raise DecodeFailure("unreadable", p, describe(exc)) from None
    if not end or end <= 0:
        raise DecodeFailure("no_frames", p, "its video stream has no packet")
    return float(end)


def video_stream(container: Any, path: Path) -> Any:
    if not container.streams.video:
        raise DecodeFailure("no_frames", path, "the file has no video stream")
    return container.streams.video[0]


def frame_rate(stream: Any) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 25.0


def display_rotation(frame: Any) -> int:
    """Counter-clockwise display rotation of a PyAV frame, as 0, 90, 180 or 270."""
    rotation = round(frame.rotation or 0) % 360
    return rotation if rotation in (90, 180, 270) else 0


def pyav_frames(av: Any, container: Any, stream: Any) -> Iterator[Any]:
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


def ffmpeg_name(path: str | os.PathLike[str]) -> str:
    """The name under which FFmpeg (PyAV, decord) opens ``path``: absolute, because FFmpeg reads a relative
    name whose first part holds a ':' as a protocol (``a:b.mp4``: "Protocol not found"), while on POSIX
    that is an ordinary file name."""
    return os.path.abspath(path)
