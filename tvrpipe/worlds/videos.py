"""Synthetic text-video data: coloured shapes moving on a grey background, with captions.

``tvrpipe synth`` (and the offline quickstart) need a dataset that is real enough to run the
whole pipeline on -- H.264 mp4 files that decord decodes, a manifest, several captions per
video -- and small enough to build in seconds on a laptop CPU. It must also be *hard in the
ways the uncertainty methods claim to help with*, in controlled amounts:

- **Multi-scene videos** (``multi_scene_fraction``) model *intra-pair* uncertainty: a video of
  2-3 scenes (each a different shape, colour and motion) whose captions describe only one of
  them, as an MSR-VTT caption describes one moment of a clip. A text embedding should match
  part of the video, not all of it (UATVR, T-MASS, ProTA's video-side distributions).
- **Near-duplicate distractors** (``distractor_fraction``) model *inter-pair* uncertainty: a
  copy of another video (same background, same trajectory) that differs in exactly one
  attribute of the described scene -- colour, shape or direction of motion. Its captions name
  its own attributes, so one word separates the right video from its near-duplicate. A
  distractor and its original share ``group`` and always land in the same split, so they
  compete in the same test set.
- **Paraphrased captions** (``captions_per_video``): each caption draws a sentence template,
  a synonym of the shape ("circle", "round disc", "ball") and a paraphrase of the motion
  ("moves to the left", "slides left", "travels leftward"); colour words are fixed, so colour
  is the one attribute a bag-of-words model reads for free.

Everything is drawn from one ``numpy.random.default_rng(seed)`` into a *plan* (attributes,
trajectories, background seeds, captions, splits) before anything is rendered; rendering is a
pure function of the plan. The same seed therefore gives byte-identical tables and identical
decoded frames. The encoder runs single-threaded (libx264 ``threads=1``, bitexact muxing), so
the mp4 bytes are reproducible too on a given FFmpeg/x264 build.

Output layout (``out_dir``)::

    videos/synth_00000.mp4 ...    H.264, yuv420p, size x size, fps frames per second
    attributes.parquet            one row per (video, scene): what is drawn, and when
    manifest/                     videos.parquet, captions.parquet, meta.json (the contract)

Videos are written first (each under a temporary name, then renamed), the attributes next and
the manifest last, so a run that fails leaves no manifest pointing at missing or stale files.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import av
import decord
import numpy as np
import pandas as pd
import pyarrow as pa

import tvrpipe
from tvrpipe.data.manifest import (
    CAPTIONS_FILE,
    META_FILE,
    SPLITS,
    VIDEOS_FILE,
    Manifest,
    make_tables,
    write_manifest,
    write_parquet,
)
from tvrpipe.errors import ConfigError, VideoError, WriteError
from tvrpipe.files import atomic_write
from tvrpipe.progress import track

log = logging.getLogger(__name__)

VIDEOS_DIR = "videos"
MANIFEST_DIR = "manifest"
ATTRIBUTES_FILE = "attributes.parquet"
ID_PREFIX = "synth_"
DATASET_VIDEOS = 200  # `tvrpipe synth`'s default --videos, and the data root's synthetic dataset

# --- the visual vocabulary -------------------------------------------------------------------

SHAPES = ("circle", "square", "triangle", "cross", "star")
# RGB fills chosen far apart (>= ~120 in RGB distance) so that the decoded colour of a shape
# is unambiguous after yuv420p chroma subsampling and lossy coding.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
    "purple": (170, 60, 210),
    "white": (235, 235, 235),
}
# Image coordinates: x grows to the right, y grows downwards, so "up" means y decreases.
DIRECTIONS = ("left", "right", "up", "down")
BACKGROUND = 60  # grey level of the background
NOISE_STD = 4.0  # static per-video texture, so frames are not flat and videos not identical
RADIUS_RANGE = (0.13, 0.18)  # object size r, as a fraction of the frame size
EXTENT = 1.2  # every shape lies within EXTENT * r of its centre (the triangle and star reach it)

# --- the caption grammar ---------------------------------------------------------------------

SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "round disc", "ball"),
    "square": ("square", "box", "block"),
    "triangle": ("triangle", "triangular shape", "wedge"),
    "cross": ("cross", "plus sign", "plus shape"),
    "star": ("star", "five-pointed star", "star shape"),
}
# Each paraphrase as (finite verb phrase, gerund phrase), for the two kinds of template.
MOTION_WORDS: dict[str, tuple[tuple[str, str], ...]] = {
    "left": (
        ("moves to the left", "moving to the left"),
        ("slides left", "sliding left"),
        ("travels leftward", "travelling leftward"),
        ("drifts toward the left side", "drifting toward the left side"),
        ("heads left", "heading left"),
    ),
    "right": (
        ("moves to the right", "moving to the right"),
        ("slides right", "sliding right"),
        ("travels rightward", "travelling rightward"),
        ("drifts toward the right side", "drifting toward the right side"),
        ("heads right", "heading right"),
    ),
    "up": (
        ("moves up", "moving up"),
        ("rises", "rising"),
        ("slides upward", "sliding upward"),
        ("travels toward the top", "travelling toward the top"),
        ("drifts up", "drifting up"),
    ),
    "down": (
        ("moves down", "moving down"),
        ("falls", "falling"),
        ("slides downward", "sliding downward"),
        ("travels toward the bottom", "travelling toward the bottom"),
        ("drifts down", "drifting down"),
    ),
}
TEMPLATES = (
    "{a} {colour} {shape} {moves}",
    "the {colour} {shape} {moves}",
    "there is {a} {colour} {shape} {moving} on a grey background",
    "{a} {colour} {shape} is {moving}",
    "we see {a} {colour} {shape} that {moves}",
    "a video of {a} {colour} {shape} {moving}",
    "in this clip {a} {colour} {shape} {moves}",
    "{a} {colour} {shape} {moving} across a dark background",
)
# Two styles of caption, as a benchmark's differ from the web pairs CLIP learned from: short alt-text-like
# phrases (what the quickstart's tiny CLIP is trained on) and an annotator's fuller sentences (the quickstart's
# benchmark). Which words a style adds is a shift between CLIP's text space and the benchmark's that zero-shot
# CLIP cannot undo and a head trained on the benchmark can learn.
SHORT_TEMPLATES = (0, 1, 3)
DESCRIPTIVE_TEMPLATES = (2, 4, 5, 6, 7)
ALL_TEMPLATES = tuple(range(len(TEMPLATES)))  # synth's default: every style
# Every (template, shape synonym, motion paraphrase) triple gives a distinct sentence.
MAX_CAPTIONS = len(TEMPLATES) * min(map(len, SHAPE_WORDS.values())) * min(map(len, MOTION_WORDS.values()))
MAX_WORDS = 32

# --- encoding --------------------------------------------------------------------------------

CODEC = "libx264"
PIX_FMT = "yuv420p"
CRF = 20
PRESET = "veryfast"
# No B-frames: decode order equals display order, which keeps frame-accurate seeking simple
# for every reader; a keyframe each second keeps random access cheap.
X264_PARAMS = "bframes=0"

# Frame sizes that decord 0.6 misreads: frames come back with 4 or 6 "channels" (row padding
# taken for pixels) and get_batch can fail (dmlc/decord#93, #336). Measured on this build for
# every even size from 16 to 640; the first video is also read back as a check (_check_readable).
DECORD_BAD_SIZES = frozenset({16, 24, 48, 72})

# Manifest defaults for extract (meta.json): the papers' 12 frames and 32 words.
DEFAULT_FRAMES = 12


@dataclass(frozen=True)
class Scene:
    """One object crossing the frame; centre coordinates are in pixels."""

    shape: str
    colour: str
    direction: str
    lane: float  # position across the direction of motion, in [0, 1]
    radius: float  # size r in pixels (a circle's radius; see _shape_mask)

    def endpoints(self, size: int) -> tuple[float, float, float, float]:
        """Centre at the scene's first and last frame, ``(x0, y0, x1, y1)``.

        The object enters one margin and leaves at the other, fully visible throughout; the
        lane fixes the other coordinate, so a distractor that changes only the direction keeps
        the lane.
        """
        lo = EXTENT * self.radius + 1.0
        hi = size - lo
        across = lo + self.lane * (hi - lo)
        if self.direction == "left":
            return hi, across, lo, across
        if self.direction == "right":
            return lo, across, hi, across
        if self.direction == "up":
            return across, hi, across, lo
        return across, lo, across, hi  # down


@dataclass(frozen=True)
class VideoPlan:
    """Everything needed to render one video and write its rows."""

    kind: str  # "single" | "multi_scene" | "distractor"
    scenes: tuple[Scene, ...]
    described: int  # index of the scene the captions describe
    texture_seed: int
    source: int = -1  # for a distractor, the index of its original in the plan list
    video_id: str = ""
    group: str = ""
    split: str = ""
    captions: tuple[str, ...] = ()


def video_frame_count(n_scenes: int, scene_seconds: float, fps: int) -> int:
    """Frames in a video of ``n_scenes`` scenes: ``n_scenes * scene_seconds * fps``."""
    return n_scenes * _frames_per_scene(scene_seconds, fps)


def _frames_per_scene(scene_seconds: float, fps: int) -> int:
    return int(round(scene_seconds * fps))


# --- validation ------------------------------------------------------------------------------


def _validate(
    n_videos: int,
    seed: int,
    size: int,
    fps: int,
    scene_seconds: float,
    captions_per_video: int,
    multi_scene_fraction: float,
    distractor_fraction: float,
    split_fractions: Sequence[float],
    caption_templates: Sequence[int] | None = None,
) -> None:
    def integer(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return int(value)

    if integer("--videos", n_videos) < 1:
        raise ConfigError(f"--videos must be >= 1, got {n_videos}")
    if integer("--seed", seed) < 0:
        raise ConfigError(f"--seed must be >= 0, got {seed}")
    if integer("--size", size) < 16 or size % 2:
        raise ConfigError(f"--size must be an even number >= 16 (yuv420p needs even sides), got {size}")
    if size in DECORD_BAD_SIZES:
        raise ConfigError(
            f"--size {size} is misread by decord (frames come back with the wrong number of "
            f"channels, dmlc/decord#336); use another even size, e.g. {size + 2} or 64"
        )
    if integer("--fps", fps) < 1:
        raise ConfigError(f"--fps must be >= 1, got {fps}")
    if not scene_seconds > 0:
        raise ConfigError(f"--scene-seconds must be > 0, got {scene_seconds}")
    frames = scene_seconds * fps
    if abs(frames - round(frames)) > 1e-6 or round(frames) < 2:
        raise ConfigError(
            f"--scene-seconds x --fps must be a whole number of frames >= 2, got "
            f"{scene_seconds} x {fps} = {frames:g}"
        )
    max_captions = MAX_CAPTIONS
    if caption_templates is not None:
        t = list(caption_templates)
        if not t or len(set(t)) != len(t) or not all(
                isinstance(i, (int, np.integer)) and 0 <= i < len(TEMPLATES) for i in t):
            raise ConfigError(f"caption_templates must be distinct indices of the {len(TEMPLATES)} caption "
                              f"templates (0 to {len(TEMPLATES) - 1}), got {t}")
        max_captions = MAX_CAPTIONS // len(TEMPLATES) * len(t)
    if not 1 <= integer("--captions-per-video", captions_per_video) <= max_captions:
        raise ConfigError(
            f"--captions-per-video must be between 1 and {max_captions}, got {captions_per_video}"
        )
    for name, value in (
        ("--multi-scene-fraction", multi_scene_fraction),
        ("--distractor-fraction", distractor_fraction),
    ):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be in [0, 1], got {value}")
    fr = tuple(split_fractions)
    if len(fr) != 3 or not all(0.0 <= f <= 1.0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ConfigError(
            f"--split-fractions must be three numbers in [0, 1] (train, val, test) summing to 1, "
            f"got {fr}"
        )


# --- the plan: every random draw happens here ------------------------------------------------

# One-attribute variants of a scene: another shape, another colour or another direction.
_N_CHANGES = (len(SHAPES) - 1) + (len(COLOURS) - 1) + (len(DIRECTIONS) - 1)


def _kind_counts(n: int, multi_scene_fraction: float, distractor_fraction: float) -> tuple[int, int, int]:
    """(single, multi-scene, distractor) counts; fractions are of all ``n`` videos.

    A distractor needs an original, and an original has only ``_N_CHANGES`` (12) one-attribute
    variants, so distractors are capped at ``n * 12 / 13`` (which also keeps >= 1 original);
    multi-scene videos take what is left after the distractors.
    """
    n_distr = min(_round_half_up(distractor_fraction * n), n * _N_CHANGES // (_N_CHANGES + 1))
    if n_distr < _round_half_up(distractor_fraction * n):
        log.warning("only %d of %d videos can be distractors (each original has %d variants)",
                    n_distr, n, _N_CHANGES)
    n_multi = min(_round_half_up(multi_scene_fraction * n), n - n_distr)
    return n - n_distr - n_multi, n_multi, n_distr


def _round_half_up(x: float) -> int:
    return int(np.floor(x + 0.5))


def _original(rng: np.random.Generator, n_scenes: int, size: int) -> tuple[tuple[Scene, ...], int]:
    """Scenes that differ pairwise in shape, colour and direction; and which one is described."""
    shapes = rng.choice(len(SHAPES), n_scenes, replace=False)
    colours = rng.choice(len(COLOURS), n_scenes, replace=False)
    directions = rng.choice(len(DIRECTIONS), n_scenes, replace=False)
    palette = list(COLOURS)
    scenes = tuple(
        Scene(
            shape=SHAPES[s],
            colour=palette[c],
            direction=DIRECTIONS[d],
            lane=float(rng.uniform(0.0, 1.0)),
            radius=float(size * rng.uniform(*RADIUS_RANGE)),
        )
        for s, c, d in zip(shapes, colours, directions)
    )
    return scenes, int(rng.integers(n_scenes))


def _changes(scene: Scene) -> list[tuple[str, str]]:
    """Every (attribute, new value) that changes exactly one attribute of ``scene``."""
    return (
        [("shape", s) for s in SHAPES if s != scene.shape]
        + [("colour", c) for c in COLOURS if c != scene.colour]
        + [("direction", d) for d in DIRECTIONS if d != scene.direction]
    )


def _key(scene: Scene) -> tuple[str, str, str]:
    return scene.shape, scene.colour, scene.direction


def _distractors(rng: np.random.Generator, originals: list[VideoPlan], n: int) -> list[VideoPlan]:
    """``n`` near-duplicates, each an original with one attribute of its described scene changed.

    Variants within a group are distinct (no two videos of a group draw the same thing in the
    described scene), so every distractor is told apart from every other member of its group
    by one word of its captions.
    """
    used = [{_key(o.scenes[o.described])} for o in originals]
    out = []
    for _ in range(n):
        open_ = [i for i, o in enumerate(originals) if len(used[i]) <= len(_changes(o.scenes[o.described]))]
        src = open_[int(rng.integers(len(open_)))]
        orig = originals[src]
        target = orig.scenes[orig.described]
        options = [(a, v) for a, v in _changes(target) if _key(replace(target, **{a: v})) not in used[src]]
        attr, value = options[int(rng.integers(len(options)))]
        changed = replace(target, **{attr: value})
        used[src].add(_key(changed))
        scenes = tuple(changed if k == orig.described else s for k, s in enumerate(orig.scenes))
        # Same background texture and trajectories: a near-duplicate in every other respect.
        out.append(replace(orig, kind="distractor", scenes=scenes, source=src))
    return out


def _split_targets(n: int, fractions: Sequence[float]) -> list[int]:
    """Video counts per split by largest remainder (they sum to ``n``; ties go to train first)."""
    raw = [f * n for f in fractions]
    counts = [int(np.floor(r)) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return counts


def _assign_splits(rng: np.random.Generator, groups: dict[str, list[int]], n: int,
                   fractions: Sequence[float]) -> dict[str, str]:
    """Whole groups to splits, in random order, each to the split furthest below its target."""
    targets = _split_targets(n, fractions)
    filled = [0] * len(SPLITS)
    names = list(groups)
    out = {}
    for g in (names[i] for i in rng.permutation(len(names))):
        k = max(range(len(SPLITS)), key=lambda i: (targets[i] - filled[i], -i))
        filled[k] += len(groups[g])
        out[g] = SPLITS[k]
    return out


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _captions(rng: np.random.Generator, scene: Scene, k: int, templates: Sequence[int]) -> tuple[str, ...]:
    """``k`` distinct paraphrases describing ``scene``, each from one of ``templates`` (indices of TEMPLATES)."""
    n_shape, n_motion = len(SHAPE_WORDS[scene.shape]), len(MOTION_WORDS[scene.direction])
    picks = rng.choice(len(templates) * n_shape * n_motion, k, replace=False)
    out = []
    for p in picks:
        t, rest = divmod(int(p), n_shape * n_motion)
        s, m = divmod(rest, n_motion)
        moves, moving = MOTION_WORDS[scene.direction][m]
        out.append(
            TEMPLATES[templates[t]].format(
                a=_article(scene.colour),
                colour=scene.colour,
                shape=SHAPE_WORDS[scene.shape][s],
                moves=moves,
                moving=moving,
            )
        )
    return tuple(out)


def plan_videos(
    n_videos: int,
    seed: int,
    size: int,
    captions_per_video: int,
    multi_scene_fraction: float,
    distractor_fraction: float,
    split_fractions: Sequence[float],
    caption_templates: Sequence[int] | None = None,
) -> list[VideoPlan]:
    """Draw every video's attributes, captions and split from one seeded generator.

    Returns the plans in id order (``synth_00000`` first). Arguments are as in
    :func:`synthesize` and are assumed valid.
    """
    templates = ALL_TEMPLATES if caption_templates is None else tuple(caption_templates)
    rng = np.random.default_rng(seed)
    n_single, n_multi, n_distr = _kind_counts(n_videos, multi_scene_fraction, distractor_fraction)
    originals = []
    for kind in ["multi_scene"] * n_multi + ["single"] * n_single:
        n_scenes = int(rng.integers(2, 4)) if kind == "multi_scene" else 1
        scenes, described = _original(rng, n_scenes, size)
        originals.append(VideoPlan(kind, scenes, described, int(rng.integers(2**32))))
    plans = originals + _distractors(rng, originals, n_distr)

    # Shuffle so that neither kind nor group can be read off the id.
    order = rng.permutation(len(plans))
    width = max(5, len(str(n_videos - 1)))
    ids = {int(j): f"{ID_PREFIX}{i:0{width}d}" for i, j in enumerate(order)}
    groups: dict[str, list[int]] = {}
    for j, p in enumerate(plans):
        groups.setdefault(ids[p.source if p.source >= 0 else j], []).append(j)
    split_of = _assign_splits(rng, dict(sorted(groups.items())), n_videos, split_fractions)

    out = []
    for j in map(int, order):
        p = plans[j]
        group = ids[p.source if p.source >= 0 else j]
        out.append(
            replace(
                p,
                video_id=ids[j],
                group=group,
                split=split_of[group],
                captions=_captions(rng, p.scenes[p.described], captions_per_video, templates),
            )
        )
    return out


# --- rendering -------------------------------------------------------------------------------


def _shape_mask(shape: str, dx: np.ndarray, dy: np.ndarray, r: float) -> np.ndarray:
    """Pixels inside ``shape`` of size ``r``; ``dx``, ``dy`` are offsets from its centre.

    Sizes are set so the shapes look about equally big: the pointed shapes (triangle, star)
    reach out to ``EXTENT * r`` to make up for their smaller area.
    """
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        h = 0.85 * r  # about the circle's area
        return (np.abs(dx) <= h) & (np.abs(dy) <= h)
    if shape == "cross":
        arm = 0.33 * r
        return ((np.abs(dx) <= r) & (np.abs(dy) <= arm)) | ((np.abs(dy) <= r) & (np.abs(dx) <= arm))
    if shape == "triangle":
        # Equilateral, pointing up, vertices at distance EXTENT * r: three half-planes, each
        # edge at half that distance, its outward normal pointing away from the opposite vertex.
        inside = np.ones(dx.shape, dtype=bool)
        for a in (-90.0, 30.0, 150.0):  # vertex angles; -90 is up (image y grows downwards)
            t = np.deg2rad(a + 180.0)
            inside &= dx * np.cos(t) + dy * np.sin(t) <= 0.5 * EXTENT * r
        return inside
    if shape == "star":
        # Five points, one up; fold the angle into the sector between an outer vertex (angle 0,
        # distance EXTENT * r) and the next inner vertex (angle 36 deg, distance 0.5 r), then
        # test which side of the edge joining them the point lies on.
        ang = np.mod(np.arctan2(dx, -dy), 2 * np.pi / 5)
        ang = np.minimum(ang, 2 * np.pi / 5 - ang)
        d = np.hypot(dx, dy)
        px, py = d * np.sin(ang), d * np.cos(ang)  # (0, 1) points at the outer vertex
        ox, oy = 0.0, EXTENT * r
        ix, iy = 0.5 * r * np.sin(np.pi / 5), 0.5 * r * np.cos(np.pi / 5)
        # Origin side of the edge O->I: same sign of the cross product as the origin's.
        cross = (ix - ox) * (py - oy) - (iy - oy) * (px - ox)
        origin = (ix - ox) * (0 - oy) - (iy - oy) * (0 - ox)
        return cross * origin >= 0
    raise ValueError(f"unknown shape {shape!r}")


def render_frames(plan: VideoPlan, size: int, frames_per_scene: int) -> np.ndarray:
    """The RGB frames of one video, ``(T, size, size, 3)`` uint8; a pure function of the plan."""
    trng = np.random.default_rng(plan.texture_seed)
    texture = BACKGROUND + trng.normal(0.0, NOISE_STD, (size, size, 1))
    background = np.clip(np.rint(np.repeat(texture, 3, axis=2)), 0, 255).astype(np.uint8)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5  # pixel centres
    frames = np.empty((len(plan.scenes) * frames_per_scene, size, size, 3), dtype=np.uint8)
    for k, scene in enumerate(plan.scenes):
        x0, y0, x1, y1 = scene.endpoints(size)
        colour = np.array(COLOURS[scene.colour], dtype=np.uint8)
        for t in range(frames_per_scene):
            a = t / (frames_per_scene - 1)
            cx, cy = x0 + a * (x1 - x0), y0 + a * (y1 - y0)
            frame = frames[k * frames_per_scene + t]
            frame[:] = background
            frame[_shape_mask(scene.shape, xx - cx, yy - cy, scene.radius)] = colour
    return frames


def write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    """Encode RGB frames to H.264 mp4 at ``path``, atomically (temporary name, then rename).

    Raises:
        VideoError: the encoder failed.
    """
    def encode(tmp: Path) -> None:
        with av.open(str(tmp), "w", format="mp4", options={"fflags": "+bitexact"}) as container:
            stream = container.add_stream(CODEC, rate=fps)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = PIX_FMT
            stream.thread_count = 1  # x264's frame threads make the bitstream depend on timing
            stream.codec_context.gop_size = fps
            stream.options = {"crf": str(CRF), "preset": PRESET, "threads": "1", "x264-params": X264_PARAMS}
            for i, rgb in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts = i
                container.mux(stream.encode(frame))
            container.mux(stream.encode())

    try:
        atomic_write(path, encode)
    except WriteError as e:  # the encoder's failure or the disk's: the video is what could not be made
        raise VideoError(f"cannot write {path}: {e.__cause__}") from e.__cause__


def _check_readable(path: Path, n_frames: int, size: int) -> None:
    """Read a written video back the way extract will (decord), so a bad size fails early.

    Raises:
        VideoError: decord sees a different frame count or frame shape.
    """
    vr = decord.VideoReader(str(path), num_threads=1)
    shape = vr[0].shape
    if len(vr) != n_frames or tuple(shape) != (size, size, 3):
        raise VideoError(
            f"{path}: decord reads {len(vr)} frames of shape {tuple(shape)}, expected {n_frames} of "
            f"{(size, size, 3)}; try another --size (decord misreads some frame widths)"
        )


# --- tables ----------------------------------------------------------------------------------

_ATTRIBUTE_SCHEMA = pa.schema(
    [
        ("video_id", pa.string()),
        ("scene", pa.int64()),
        ("shape", pa.string()),
        ("colour", pa.string()),
        ("direction", pa.string()),
        ("start_frame", pa.int64()),  # first frame of the scene
        ("end_frame", pa.int64()),  # one past its last frame (Python slice convention)
        ("kind", pa.string()),
        ("group", pa.string()),
        ("described", pa.bool_()),
        ("x0", pa.float64()),  # object centre (pixels) at start_frame ...
        ("y0", pa.float64()),
        ("x1", pa.float64()),  # ... and at end_frame - 1
        ("y1", pa.float64()),
        ("radius", pa.float64()),
    ]
)


def attribute_rows(plans: Sequence[VideoPlan], size: int, frames_per_scene: int) -> pd.DataFrame:
    """One row per (video, scene): the ground truth behind every video and caption."""
    rows = []
    for p in plans:
        for k, s in enumerate(p.scenes):
            x0, y0, x1, y1 = s.endpoints(size)
            rows.append(
                {
                    "video_id": p.video_id,
                    "scene": k,
                    "shape": s.shape,
                    "colour": s.colour,
                    "direction": s.direction,
                    "start_frame": k * frames_per_scene,
                    "end_frame": (k + 1) * frames_per_scene,
                    "kind": p.kind,
                    "group": p.group,
                    "described": k == p.described,
                    "x0": x0,
                    "y0": y0,
                    "x1": x1,
                    "y1": y1,
                    "radius": s.radius,
                }
            )
    return pd.DataFrame(rows, columns=_ATTRIBUTE_SCHEMA.names)


def _write_table(table: pd.DataFrame, schema: pa.Schema, path: Path) -> None:
    atomic_write(path, lambda tmp: write_parquet(table, schema, tmp))


def _clear_previous(out: Path, keep: set[str]) -> None:
    """Remove an earlier synth run's manifest (first, so a failure leaves none) and stale videos.

    Raises:
        ConfigError: ``out`` holds a manifest that synth did not write.
    """
    mdir = out / MANIFEST_DIR
    present = [mdir / f for f in (VIDEOS_FILE, CAPTIONS_FILE, META_FILE) if (mdir / f).exists()]
    if present:
        try:
            dataset = json.loads((mdir / META_FILE).read_text()).get("dataset")
        except (OSError, ValueError, AttributeError):
            dataset = None
        if dataset != "synthetic":
            raise ConfigError(
                f"{out} already holds a manifest that synth did not write (dataset {dataset!r}); "
                "choose another --out"
            )
        log.info("replacing the synthetic dataset in %s", out)
        for f in present:
            f.unlink()
    vdir = out / VIDEOS_DIR
    if vdir.is_dir():
        stale = re.compile(rf"{ID_PREFIX}\d+\.mp4")
        for f in vdir.iterdir():
            if stale.fullmatch(f.name) and f.stem not in keep:
                f.unlink()


# --- the entry point -------------------------------------------------------------------------


def synthesize(
    out_dir: str | os.PathLike[str],
    n_videos: int,
    seed: int = 0,
    *,
    size: int = 64,
    fps: int = 8,
    scene_seconds: float = 2.0,
    captions_per_video: int = 3,
    multi_scene_fraction: float = 0.3,
    distractor_fraction: float = 0.3,
    split_fractions: tuple[float, float, float] = (0.7, 0.1, 0.2),
    caption_templates: Sequence[int] | None = None,
    progress: bool = True,
) -> Manifest:
    """Render a synthetic text-video dataset and write its manifest.

    Args:
        out_dir: where ``videos/``, ``attributes.parquet`` and ``manifest/`` go. An earlier
            synthetic dataset there is replaced; any other manifest there is an error.
        n_videos: number of videos, distractors included.
        seed: seed of the one generator every random choice comes from.
        size: frame width and height in pixels (even, >= 16).
        fps: frames per second.
        scene_seconds: length of one scene; ``scene_seconds * fps`` must be a whole number.
        captions_per_video: distinct paraphrased captions per video.
        multi_scene_fraction: fraction of all videos with 2-3 scenes, one of them captioned.
        distractor_fraction: fraction of all videos that are near-duplicates of another video,
            differing in one attribute of the captioned scene.
        split_fractions: train, val and test fractions; a distractor group stays in one split.
        caption_templates: which sentence templates captions are written from (indices of ``TEMPLATES``;
            default all): :data:`SHORT_TEMPLATES` or :data:`DESCRIPTIVE_TEMPLATES` give a style of caption.
        progress: show a progress bar.

    Returns:
        The manifest as written (paths relative to ``out_dir/videos``).

    Raises:
        ConfigError: an argument is out of range (the message names the CLI option).
        VideoError: a video could not be encoded.

    Example:
        >>> m = synthesize(tmp_path / "synth", 20, seed=0, progress=False)  # doctest: +SKIP
        >>> m.counts()  # doctest: +SKIP
           split  videos  captions
        0  train      14        42
        1    val       2         6
        2   test       4        12
    """
    _validate(n_videos, seed, size, fps, scene_seconds, captions_per_video,
              multi_scene_fraction, distractor_fraction, split_fractions, caption_templates)
    out = Path(out_dir)
    frames_per_scene = _frames_per_scene(scene_seconds, fps)
    plans = plan_videos(n_videos, seed, size, captions_per_video, multi_scene_fraction,
                        distractor_fraction, split_fractions, caption_templates)
    _write_videos(out, plans, size, fps, frames_per_scene, progress)
    _write_table(attribute_rows(plans, size, frames_per_scene), _ATTRIBUTE_SCHEMA, out / ATTRIBUTES_FILE)
    videos, captions = _manifest_tables(plans)
    meta = _meta(plans, n_videos=n_videos, seed=seed, size=size, fps=fps, scene_seconds=scene_seconds,
                 captions_per_video=captions_per_video, multi_scene_fraction=multi_scene_fraction,
                 distractor_fraction=distractor_fraction, split_fractions=split_fractions,
                 caption_templates=caption_templates)
    manifest = write_manifest(out / MANIFEST_DIR, videos, captions, meta, source="synth")
    log.info("synthesised %d videos (%s) into %s", len(plans),
             ", ".join(f"{k}: {v}" for k, v in meta["synth"]["kinds"].items()), out)
    return manifest


def generate_dataset(folder: str | os.PathLike[str], progress: bool = True) -> None:
    """The data root's ``synthetic`` dataset: ``tvrpipe synth``'s defaults (:data:`DATASET_VIDEOS`, seed 0) written to
    ``folder``. ``prepare_dataset`` calls it, passed in by the commands, when the dataset is first asked for."""
    synthesize(folder, DATASET_VIDEOS, progress=progress)


def _write_videos(out: Path, plans: Sequence[VideoPlan], size: int, fps: int, frames_per_scene: int,
                  progress: bool) -> None:
    """Render stage: clear an earlier run, then render, encode and spot-check every video."""
    _clear_previous(out, {p.video_id for p in plans})
    vdir = out / VIDEOS_DIR
    vdir.mkdir(parents=True, exist_ok=True)
    # Sequential on purpose: a 64x64 video renders and encodes in ~10 ms, so a process pool
    # would spend more on start-up and pickling than it saves at the sizes synth is used for.
    for i, p in enumerate(track(plans, "synth: videos", enabled=progress)):
        frames = render_frames(p, size, frames_per_scene)
        write_mp4(vdir / f"{p.video_id}.mp4", frames, fps)
        if i == 0:
            _check_readable(vdir / f"{p.video_id}.mp4", len(frames), size)


def _manifest_tables(plans: Sequence[VideoPlan]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table stage: the manifest's videos and captions tables, one row per video and per caption."""
    return make_tables(
        [{"video_id": p.video_id, "path": f"{p.video_id}.mp4", "split": p.split} for p in plans],
        [
            {"caption_id": f"{p.video_id}#{k}", "video_id": p.video_id, "text": text, "split": p.split}
            for p in plans
            for k, text in enumerate(p.captions)
        ],
    )


def _meta(
    plans: Sequence[VideoPlan],
    *,
    n_videos: int,
    seed: int,
    size: int,
    fps: int,
    scene_seconds: float,
    captions_per_video: int,
    multi_scene_fraction: float,
    distractor_fraction: float,
    split_fractions: Sequence[float],
    caption_templates: Sequence[int] | None,
) -> dict[str, Any]:
    """Record stage: meta.json's contents, the settings and kind counts that reproduce the dataset."""
    kinds = pd.Series([p.kind for p in plans]).value_counts()
    # Key order is meta.json's byte order: keep it stable so the same seed gives the same file.
    return {
        "dataset": "synthetic",
        "split_set": "synthetic",
        "frames": DEFAULT_FRAMES,
        "max_words": MAX_WORDS,
        "video_root": f"../{VIDEOS_DIR}",
        "synth": {
            "n_videos": n_videos,
            "seed": seed,
            "size": size,
            "fps": fps,
            "scene_seconds": scene_seconds,
            "captions_per_video": captions_per_video,
            "multi_scene_fraction": multi_scene_fraction,
            "distractor_fraction": distractor_fraction,
            "split_fractions": list(split_fractions),
            "caption_templates": [int(i) for i in (ALL_TEMPLATES if caption_templates is None else caption_templates)],
            "kinds": {k: int(kinds.get(k, 0)) for k in ("single", "multi_scene", "distractor")},
            "codec": CODEC,
            "crf": CRF,
            "preset": PRESET,
        },
        "tvrpipe_version": tvrpipe.__version__,
    }
