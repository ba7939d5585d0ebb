"""Shot boundaries of a video file, found with PySceneDetect (the optional ``shots`` extra): where a collection's
files are cut with ``manifest build --shots``.

PySceneDetect's ``ContentDetector`` (its default detector: a cut where the mean change of hue, saturation and
luminance between two frames, 0-255, exceeds ``threshold``, default 27, and at least ``min_scene_len`` = 15
frames after the last cut) reads the file through its PyAV backend (PyAV is extract's fallback reader already;
the detector itself needs OpenCV, which the extra brings, headless). Each cut is the first frame of a new shot;
its time is that frame's presentation time on the stream's timeline (the times extraction samples by, from the
packet index), floored to the millisecond, so that the frame falls in the new shot and the frame before it in the
shot before, whatever the rounding.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.features.decode.failure import DecodeFailure, check_file, describe
from tvrpipe.features.decode.probe import ffmpeg_name

SHOT_THRESHOLD = 27.0  # PySceneDetect ContentDetector's default
INSTALL = "pip install 'tvrpipe[shots]' (in a checkout: make install, or uv sync --extra shots)"


def require_scenedetect() -> Any:
    """The ``scenedetect`` module, or a one-line error naming the extra that installs it.

    Raises:
        ConfigError: PySceneDetect (or the OpenCV its detector needs) is not installed.
    """
    try:
        import cv2  # noqa: F401  (ContentDetector's colour conversions)
        import scenedetect
    except ImportError as exc:
        raise ConfigError(f"--shots needs PySceneDetect and OpenCV, not installed here ({exc.name} is missing): "
                          f"{INSTALL}") from None
    return scenedetect


def detect_cuts(path: str | os.PathLike[str], threshold: float = SHOT_THRESHOLD) -> list[float]:
    """The times (seconds, floored to the millisecond) at which a new shot starts in ``path``, in order; empty for
    a file of one shot.

    Raises:
        ConfigError: PySceneDetect is not installed (:func:`require_scenedetect`).
        DecodeFailure: the file cannot be read or the detector fails on it (kind ``unreadable``).

    Example:
        >>> detect_cuts("videos/trip.mp4")  # doctest: +SKIP
        [4.2, 11.16]
    """
    scenedetect = require_scenedetect()
    from tvrpipe.features.decode.readers import packet_times

    p = Path(path)
    check_file(p)
    try:
        video = scenedetect.open_video(ffmpeg_name(p), backend="pyav")
        manager = scenedetect.SceneManager()
        manager.add_detector(scenedetect.ContentDetector(threshold=float(threshold)))
        manager.detect_scenes(video, show_progress=False)
        starts = [start for start, _ in manager.get_scene_list()[1:]]
        offset = _start_offset(p)
    except Exception as exc:
        raise DecodeFailure("unreadable", p, f"shot detection failed: {describe(exc)}") from None
    if not starts:
        return []
    times = packet_times(p)  # float64 (n,), what extraction samples by
    out = []
    for start in starts:
        t = float(start.pts * start.time_base) - offset  # the detector's time is the stream's pts
        k = int(np.argmin(np.abs(times - t))) if len(times) else None
        cut = times[k] if k is not None else t
        out.append(math.floor(cut * 1000 + 1e-6) / 1000)
    return sorted(set(c for c in out if c > 0))


def _start_offset(path: Path) -> float:
    """The video stream's start time in seconds (its first frame's pts), which the frame times subtract."""
    import av

    from tvrpipe.features.decode.probe import video_stream

    with av.open(ffmpeg_name(path)) as container:
        stream = video_stream(container, path)
        return float((stream.start_time or 0) * stream.time_base)
