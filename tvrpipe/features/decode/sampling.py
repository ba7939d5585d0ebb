"""Which frames a video gives and in what shape: segment sampling (``FRAME_SAMPLING``, the package
docstring), the clip's bounds, the resize and centre crop, and padding to F (:class:`DecodedVideo`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tvrpipe.features.decode.failure import DecodeFailure

FRAME_SAMPLING = "uniform-segment-centre"  # recorded in store provenance
# Frame times of the two readers are compared and clip bounds applied with this slack (seconds):
# far below one frame period, above float32 rounding of decord's timestamps.
TIME_EPS = 1e-4


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


def pick_frames(
    times: np.ndarray, num_frames: int, start_s: float | None, end_s: float | None, path: Path,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """Sampled frame indices (int64 [<= F]) among the frames whose time is in [start_s, end_s)."""
    candidates = np.arange(len(times))
    if start_s is not None:
        candidates = candidates[times[candidates] >= start_s - TIME_EPS]
    if end_s is not None:
        candidates = candidates[times[candidates] < end_s - TIME_EPS]
    if candidates.size == 0:
        lo, hi = -np.inf if start_s is None else start_s, np.inf if end_s is None else end_s
        where = "" if start_s is None and end_s is None else f" in [{lo:g}, {hi:g}) s"
        span = f"; its {len(times)} frames span {times.min():.3f}-{times.max():.3f} s" if len(times) else ""
        raise DecodeFailure("no_frames", path, f"no frame{where}{span}")
    return candidates[sample_indices(candidates.size, num_frames, offsets)]


def centre_crop(frames: np.ndarray, size: int) -> np.ndarray:
    """torchvision's CenterCrop on uint8 [N, H, W, 3] -> a view [N, S, S, 3] (H, W >= S)."""
    height, width = frames.shape[1:3]
    top = round((height - size) / 2.0)  # Python's round, as torchvision's
    left = round((width - size) / 2.0)
    return frames[:, top : top + size, left : left + size]


def assemble(crops: np.ndarray, times: np.ndarray, num_frames: int, reader: str) -> DecodedVideo:
    """Pad k <= F frames to F: zero frames, mask False, NaN timestamps."""
    k, size = len(crops), crops.shape[1]
    frames = np.zeros((num_frames, size, size, 3), np.uint8)
    frames[:k] = crops
    mask = np.zeros(num_frames, bool)
    mask[:k] = True
    timestamps = np.full(num_frames, np.nan, np.float32)
    timestamps[:k] = times
    return DecodedVideo(frames=frames, mask=mask, timestamps=timestamps, reader=reader)


def check_sizes(num_frames: int, image_size: int) -> None:
    if num_frames < 1 or image_size < 1:
        raise ValueError(f"num_frames and image_size must be >= 1, got {num_frames}, {image_size}")


def clip_bound(value: float | None) -> float | None:
    """A clip bound: None and NaN (a missing value in a manifest table) mean open."""
    return None if value is None or np.isnan(value) else float(value)
