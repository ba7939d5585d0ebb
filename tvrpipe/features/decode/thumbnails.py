"""Frames at given times (:func:`frames_at`), upright and scaled, for showing a few frames of a video
(the search page's thumbnails); no crop, no timeout."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.features.decode.failure import DecodeFailure, check_file, describe
from tvrpipe.features.decode.probe import display_rotation, ffmpeg_name, frame_rate, pyav_frames, video_stream


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
    check_file(path)

    def scaled(frame: Any) -> np.ndarray:  # swscale bilinear to `height`, then the display rotation
        rotation = display_rotation(frame)
        w, h = (frame.height, frame.width) if rotation in (90, 270) else (frame.width, frame.height)
        new_w = max(1, round(w * height / h))
        coded_w, coded_h = (height, new_w) if rotation in (90, 270) else (new_w, height)
        image = frame.reformat(width=coded_w, height=coded_h, format="rgb24", interpolation="BILINEAR")
        image = image.to_ndarray()  # (coded_h, coded_w, 3)
        return np.ascontiguousarray(np.rot90(image, rotation // 90) if rotation else image)

    out: list[np.ndarray | None] = [None] * len(want)
    try:
        with av.open(ffmpeg_name(path)) as container:
            stream = video_stream(container, path)
            stream.codec_context.thread_count = 1
            t0, time_base, rate = stream.start_time or 0, float(stream.time_base), frame_rate(stream)
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
                    for k, frame in enumerate(pyav_frames(av, container, stream)):
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
        raise DecodeFailure("unreadable", path, describe(exc)) from None
    return out
