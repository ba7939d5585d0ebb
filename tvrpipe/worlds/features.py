"""Synthetic feature stores: CLIP-like features from a latent model, with no videos and no CLIP.

``generate_store`` writes a complete feature store (the same Zarr layout, chunking, sidecars,
markers and provenance keys as ``tvrpipe extract``, written through :class:`StoreWriter`) whose
features come from a known latent model, so heads can be trained, benchmarked and scaled (up to
MSR-VTT size: 9,000 train videos x 180,000 captions) in seconds instead of GPU-hours.

The latent model (all choices; no paper defines it). Content lives in a random
``intrinsic_dim``-dimensional subspace of R^D (real CLIP features are strongly anisotropic; it also
keeps the difficulty from changing with D), plus a small full-rank residual:

- a bank of ``concepts`` random unit vectors ``c_k`` (the "words" of the world);
- a scene is ``concept_words`` concepts (object, action, setting, ...) plus the video's offset:
  ``z = normalise(sum_p c_{k_p} / sqrt(P) + OFFSET * o_v)``, ``o_v`` a random unit vector that all
  scenes of the video share (its shots share their setting and look); a multi-scene video (a
  ``multi_scene`` fraction) is ``scenes`` scenes in a row, each a contiguous block of its valid
  frames; the others are one scene;
- near-duplicates (inter-pair uncertainty): a fraction of the videos of each split copy another
  video of the same split (its concepts and offsets) and change ONE concept of one scene;
- frames: ``A_v * (z_scene + jitter_t + style_v + eps_t + r) + mu_v``: a smooth per-video
  temporal jitter, a per-video "style" in a low-rank nuisance subspace (camera, lighting: constant
  over the video, so mean pooling cannot remove it but a learned projection can), small i.i.d.
  noise (frames of one shot are close views), the residual ``r``, a shared mean ``mu_v`` (CLIP's
  cone), a scale giving norms of about ``NORM``;
- captions describe the whole video (``z`` = normalised mean of its scenes) or ONE scene of it
  (intra-pair uncertainty: every caption with "scene", a ``partial_captions`` fraction of a
  multi-scene video's captions with "mixed"); sentence = ``A_t * (z + style_t + eps + r) + mu_t``
  with a text mean ``mu_t`` and a text style subspace of their own; each caption of a video has
  its own noise (paraphrases); a caption is a much noisier view of its content than a frame (a
  sentence names a few things of a video);
- the learnable share (``caption_shift``): a dataset's captions are not the alt-texts CLIP learned on,
  so captions say their content turned by a fixed rotation of the content subspace (the same for
  every caption: sentence and content words); the zero-shot cosine loses cos(angle) of its signal,
  which a head that learns the inverse map on either side gets back;
- shared sources (``shared_sources``): a fraction of the val and test videos are other clips of a
  train video's source (its concepts and look, one concept changed), as in MSR-VTT's 1k-A split;
- the two means lie outside the content subspace and meet at cosine ``MEAN_ALIGN``: CLIP's
  modality gap (unrelated sentence and frame still have cosine ~0.15);
- word tokens: SOT (a constant vector, as in causal CLIP), then content words (noisy copies of
  the described concepts, noisier than the sentence: CLIP aligns only EOT with images) and stop
  words (noisy copies of a small generic bank) in random order, then EOS, which equals the
  sentence exactly: 2 + content + 1..~8 stop words valid tokens (at most L; content words that
  do not fit are cut, as a long caption is), the rest zero, mask False.

``noise`` scales the per-coordinate standard deviation of the observation noise (``noise *
NOISE_UNIT`` for captions, ``FRAME_NOISE`` times that per frame). The constants are calibrated so
that :data:`CALIBRATED`'s world (D = 512, 1,000 test videos) shows real CLIP ViT-B/32's statistics
on MSR-VTT 1k-A (:mod:`tvrpipe.worlds.stats` holds the targets and their sources;
``tvrpipe synth --describe`` measures them): zero-shot t2v R@1 about 31 for mean pooling, 26 for
the middle frame, 18 for token-wise matching; cosines 0.86 between frames of one video, 0.49
between frames of two videos, 0.51 between sentences, 0.30 between a sentence and its frames,
0.15 between a sentence and other frames. Harder: ``noise`` up, ``near_duplicates`` up,
``caption_describes="scene"``.

Randomness: global latents come from ``default_rng([seed, 0])``; the noise of rows
``[64 b, 64 b + 64)`` of each kind from ``default_rng([seed, kind, b])``, so the arrays depend on
the spec, not on the shard sizes (up to float rounding), and shards are generated and written one
at a time (peak memory: the latents plus a few shards). The full-rank residual and the noise of
word tokens, which would cost D normals per row, are sums of two vectors drawn from fixed banks
of ``BANK`` vectors instead (frame and caption noise are fresh normals in the intrinsic space).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.data.manifest import CAPTION_COLUMNS, VIDEO_COLUMNS
from tvrpipe.errors import ConfigError
from tvrpipe.features.store import Shard, StoreWriter, make_provenance, manifest_sha256
from tvrpipe.files import atomic_write_parquet

log = logging.getLogger(__name__)

MODEL = "synthetic-features"
DATASET = "synthetic-features"
SPLIT_SET = "generated"
LATENT_VIDEOS = "latent_videos.parquet"
LATENT_TEXTS = "latent_texts.parquet"
MADE_BY = "tvrpipe synth --features-only"  # the command that repairs the store (the repair hints name it)

# The world of every benchmark (presets, bench search): the fields calibrated to real CLIP
# ViT-B/32 on MSR-VTT (see the module doc); a learnable share sized on the frozen seqTransf row
# (+7.6 R@1: a 22 degree turn, which an exact inverse turns into +8.2; its noise holds mean pooling's
# R@1 at 31); val/test videos that share a source with train videos at MSR-VTT 1k-A's rate (37.2 %,
# MDMMT Tab. 11); multi-scene videos, partial captions and near-duplicates at rates no paper
# measures, so chosen: 30 % of videos of 3 shots, half of their captions about one shot, 10 %
# near-duplicates. docs/synthetic.md ("The learnable share") has the measurements.
CALIBRATED = dict(noise=0.92, caption_shift=22.0, scenes=3, multi_scene=0.3, caption_describes="mixed",
                  partial_captions=0.5, near_duplicates=0.1, shared_sources=0.372)
# The same statistics with one scene per video and whole-video captions (its noise gives mean
# pooling's R@1 31; its frames are closer to each other than real CLIP's, 0.94).
ONE_SCENE = dict(noise=0.97, caption_shift=22.0, scenes=1, multi_scene=1.0, caption_describes="whole",
                 partial_captions=0.5, near_duplicates=0.0, shared_sources=0.372)

BLOCK = 64  # rows per random stream (choice: independent of shard sizes)
NOISE_UNIT = 0.30  # per-coordinate caption noise std at noise=1 (calibrated, see module doc)
OFFSET = 0.5  # the video's offset in a scene latent, relative to its unit concept part
JITTER = 0.2  # temporal jitter norm, relative to the unit scene latent
FRAME_NOISE = 0.06  # frame noise / caption noise (frames of one shot are close views)
WORD_NOISE = 1.8  # content-word noise / caption noise (CLIP aligns only EOT with images)
STYLE = 0.43  # per-coordinate std of the style inside its subspace, in units of the noise
STYLE_RANK = 8  # D / STYLE_RANK dimensions of nuisance subspace per modality
STOP_WORDS = 32  # generic (stop) word bank size
MEAN_STOP_WORDS = 4  # Poisson mean of the stop words of a caption (plus one)
RESIDUAL = 0.3  # norm of the isotropic full-rank residual outside the intrinsic subspace
BANK = 4096  # noise vectors to draw pairs from (4096^2 combinations; see _embed)
MEAN_OFFSET = 1.1  # norm of the frames' shared mean, relative to the unit signal (CLIP's cone)
MEAN_OFFSET_T = 1.02  # the text mean's norm, relative to a sentence's centred norm (2.7 at noise 1, D = 512)
MEAN_ALIGN = 0.31  # cosine between the frame mean and the text mean directions
NORM = 10.0  # typical norm of a stored embedding (ViT-B/32 projected features are ~10)
_VIDEOS, _TEXTS = 1, 2


@dataclass(frozen=True)
class GenSpec:
    """What a synthetic store holds and how hard it is; every field is recorded in provenance.

    Attributes:
        train_videos: videos of the train split.
        val_videos: videos of the val split; 0 means none (train-head carves one, as for 9k).
        test_videos: videos of the test split.
        captions_per_train_video: captions per train video (MSR-VTT: 20).
        captions_per_test_video: captions per val/test video; > 1 is a multi-caption set (MSVD).
        captioned_test_videos: if set, only the first this many test videos have captions; the others are
            gallery videos alone. A collection searched by a sample of queries needs no caption per video:
            at a million videos of D = 512 their word tokens would be 32 of the store's 44 GB.
        frames: F.
        max_words: L (SOT and EOT included).
        embed_dim: D (512 for ViT-B/32).
        scenes: scenes of a multi-scene video (contiguous frame blocks).
        multi_scene: fraction of the videos that have ``scenes`` scenes; the others have one.
        caption_describes: "whole" (all scenes), "scene" (one random scene per caption) or "mixed"
            (a caption of a multi-scene video describes one scene with probability
            ``partial_captions``, else the whole video).
        partial_captions: with "mixed", the probability that a caption of a multi-scene video is partial.
        near_duplicates: fraction of each split's videos that copy another video but one concept.
        shared_sources: fraction of the val and test videos that are another clip of a train video's source:
            they copy a train video (its concepts, scenes and look) but one concept, as 37 % of MSR-VTT 1k-A's
            test videos share a YouTube source with training videos (MDMMT, arXiv 2103.10699, Tab. 11).
        noise: observation noise (difficulty), per coordinate in units of ``NOISE_UNIT``.
        caption_shift: the learnable share, in degrees: captions (sentences and content words) describe their
            content rotated by this angle in fixed random planes of the content subspace (a dataset's captions
            are not the image-text pairs CLIP learned on). The zero-shot cosine of a caption and its content is
            cos(angle) times what it was; a head that learns the rotation's inverse on either side gets it back.
        min_frames: if set, each video has a random length in [min_frames, frames] (padded).
        concepts: size of the concept bank.
        concept_words: concepts per scene (content words of a caption describing it).
        intrinsic_dim: dimension of the subspace of R^D that carries content and noise
            (min with D); real CLIP features are strongly anisotropic, and it makes difficulty
            depend on ``noise``, not on D.
        seed: everything random derives from it.
    """

    train_videos: int = 200
    val_videos: int = 0
    test_videos: int = 100
    captions_per_train_video: int = 5
    captions_per_test_video: int = 1
    captioned_test_videos: int | None = None
    frames: int = 12
    max_words: int = 32
    embed_dim: int = 64
    scenes: int = 1
    multi_scene: float = 1.0
    caption_describes: str = "whole"
    partial_captions: float = 0.5
    near_duplicates: float = 0.0
    shared_sources: float = 0.0
    noise: float = 0.5
    caption_shift: float = 0.0
    min_frames: int | None = None
    concepts: int = 512
    concept_words: int = 3
    intrinsic_dim: int = 64
    seed: int = 0

    def validate(self, option: str | None = None) -> None:
        """Raise :class:`ConfigError` naming the first invalid field (as ``GenSpec.FIELD``; with ``option``, as
        the option the user typed: ``--set FIELD``)."""
        try:
            self._validate()
        except ConfigError as e:
            if option is None:
                raise
            raise ConfigError(str(e).replace("GenSpec.", f"{option} ").replace("GenSpec:", f"{option}:")) from None

    def _validate(self) -> None:
        for name in ("train_videos", "val_videos", "test_videos"):
            if getattr(self, name) < 0:
                raise ConfigError(f"GenSpec.{name} must be >= 0, got {getattr(self, name)}")
        if self.train_videos + self.val_videos + self.test_videos == 0:
            raise ConfigError("GenSpec: no videos at all; set train_videos or test_videos")
        for name in ("captions_per_train_video", "captions_per_test_video", "frames", "embed_dim", "scenes",
                     "concepts", "concept_words", "intrinsic_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"GenSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.captioned_test_videos is not None and not 0 <= self.captioned_test_videos <= self.test_videos:
            raise ConfigError(f"GenSpec.captioned_test_videos must be between 0 and test_videos ({self.test_videos}), "
                              f"got {self.captioned_test_videos}")
        if self.max_words < 2:
            raise ConfigError(f"GenSpec.max_words must be >= 2 (SOT and EOT), got {self.max_words}")
        if self.caption_describes not in ("whole", "scene", "mixed"):
            raise ConfigError(
                f"GenSpec.caption_describes must be 'whole', 'scene' or 'mixed', got {self.caption_describes!r}"
            )
        for name in ("multi_scene", "partial_captions"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"GenSpec.{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.near_duplicates < 1.0:
            raise ConfigError(f"GenSpec.near_duplicates must be in [0, 1), got {self.near_duplicates}")
        if not 0.0 <= self.shared_sources <= 1.0:
            raise ConfigError(f"GenSpec.shared_sources must be in [0, 1], got {self.shared_sources}")
        if self.noise < 0:
            raise ConfigError(f"GenSpec.noise must be >= 0, got {self.noise}")
        if not 0.0 <= self.caption_shift <= 90.0:
            raise ConfigError(f"GenSpec.caption_shift must be an angle in [0, 90] degrees, got {self.caption_shift}")
        shortest = self.frames if self.min_frames is None else self.min_frames
        if not shortest <= self.frames:
            raise ConfigError(f"GenSpec: min_frames ({self.min_frames}) must be <= frames ({self.frames})")
        if self.scenes > shortest:
            what = "frames" if self.min_frames is None else "min_frames"
            raise ConfigError(
                f"GenSpec: a multi-scene video shows each of its scenes ({self.scenes}) in a frame of its own, and "
                f"{what} is {shortest}; set scenes={shortest} or fewer (scenes=1: one scene per video), or more {what}")
        if self.concepts < 2 and (self.near_duplicates > 0 or self.shared_sources > 0):
            raise ConfigError("GenSpec: near_duplicates and shared_sources need at least 2 concepts")

    @property
    def n_texts(self) -> int:
        """The captions the store holds: ``captions_per_train_video`` a training video, ``captions_per_test_video``
        a validation or a captioned test one."""
        return (self.train_videos * self.captions_per_train_video
                + (self.val_videos + self.captioned_tests) * self.captions_per_test_video)

    @property
    def captioned_tests(self) -> int:
        """The test videos that have captions (all but where ``captioned_test_videos`` says fewer)."""
        return self.test_videos if self.captioned_test_videos is None else self.captioned_test_videos

    def store_bytes(self) -> int:
        """The bytes :func:`generate_store` writes for this spec, a little over: the float16 frames, sentences and
        word tokens, their masks and timestamps, and the tables and latents (a few hundred bytes a row, measured:
        97-334), plus the metadata."""
        videos = self.train_videos + self.val_videos + self.test_videos
        D, F, L, T = self.embed_dim, self.frames, self.max_words, self.n_texts
        return videos * F * (2 * D + 5) + T * (2 * D + L * (2 * D + 1)) + 400 * (videos + T) + 2**20

    def memory_bytes(self) -> int:
        """The resident memory :func:`generate_store` reaches for this spec, a little over: its tables and latents,
        about 1 kB a video or caption (measured: 2.0 kB for a video and its caption), and a shard at a time."""
        videos = self.train_videos + self.val_videos + self.test_videos
        shard = 64 * self.frames * self.embed_dim * 4 * 4 + 256 * self.max_words * self.embed_dim * 4 * 2
        return 1200 * (videos + self.n_texts) + shard + 200 * 2**20

    def to_dict(self) -> dict:
        """The spec as a JSON-ready dict. ``captioned_test_videos`` is left out when unset, so that a store
        written before the field existed keeps its recorded spec and its identity."""
        d = dataclasses.asdict(self)
        if d["captioned_test_videos"] is None:
            del d["captioned_test_videos"]
        return d

    def sha256(self) -> str:
        """A hash of the spec: the store's ``weights_sha256`` (different specs never mix)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


# The presets (`tvrpipe synth --features-only --preset`, `bench convergence --size`, `bench worlds`): the
# calibrated world (real CLIP ViT-B/32's statistics on MSR-VTT, with multi-scene videos, partial captions and
# near-duplicates; CALIBRATED), 4 captions per train video, seed 4242; sizes differ in train and validation
# videos and in width. msrvtt9k has MSR-VTT 9k's sizes, onescene the same in the one-scene world.
_MEDIUM = GenSpec(train_videos=2000, val_videos=200, test_videos=200, captions_per_train_video=4,
                  embed_dim=64, intrinsic_dim=64, seed=4242, **CALIBRATED)
_MSRVTT = dict(train_videos=9000, val_videos=0, test_videos=1000, captions_per_train_video=20, embed_dim=512,
               seed=4242)  # validation carved by train-head
PRESETS: dict[str, GenSpec] = {
    "small": dataclasses.replace(_MEDIUM, train_videos=500, val_videos=100, test_videos=100),
    "medium": _MEDIUM,
    "msrvtt9k": GenSpec(**_MSRVTT, **CALIBRATED),
    "onescene": GenSpec(**_MSRVTT, **ONE_SCENE),
}


# ------------------------------------------------------------------------------ tables


def _tables(spec: GenSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The synthetic manifest: train, val, test videos (ids in that order), captions by video."""
    splits = np.repeat(["train", "val", "test"], [spec.train_videos, spec.val_videos, spec.test_videos])
    n = len(splits)
    vid = np.array([f"gv_{i:05d}" for i in range(n)], dtype=object)
    videos = pd.DataFrame({"video_id": vid, "path": "", "split": splits, "start_s": np.nan, "end_s": np.nan},
                          columns=list(VIDEO_COLUMNS))
    per = np.where(splits == "train", spec.captions_per_train_video, spec.captions_per_test_video)
    per[spec.train_videos + spec.val_videos + spec.captioned_tests:] = 0  # test videos with no caption
    rows = np.repeat(np.arange(n), per)
    k = np.arange(len(rows)) - np.repeat(np.cumsum(per) - per, per)
    cap_vid = vid[rows]
    captions = pd.DataFrame({
        "caption_id": [f"{v}#{j}" for v, j in zip(cap_vid, k)],
        "video_id": cap_vid,
        "text": [f"synthetic caption {j} of {v}" for v, j in zip(cap_vid, k)],
        "split": splits[rows],
    }, columns=list(CAPTION_COLUMNS))
    return videos, captions


# ------------------------------------------------------------------------------ latents


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _intrinsic(spec: GenSpec) -> int:
    """The content subspace's dimension: ``intrinsic_dim``, leaving two dimensions of R^D for the means."""
    return max(1, min(spec.intrinsic_dim, spec.embed_dim - 2))


def _orthonormal(rng: np.random.Generator, d: int, r: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((d, r)))
    return q.astype(np.float32)  # (D, r)


@dataclass
class _Latents:
    """Everything global (small: no per-frame or per-token array). d = intrinsic dimension."""

    basis: np.ndarray  # (D, d) orthonormal: the intrinsic subspace inside R^D
    residual: np.ndarray  # (BANK, D) full-rank residual vectors, norm RESIDUAL / sqrt(2)
    words: np.ndarray  # (K + STOP_WORDS, D) concepts then stop words, in R^D
    word_noise: np.ndarray  # (BANK, D) half the noise (intrinsic + residual) of a word token
    concepts: np.ndarray  # (K, d) unit
    stop: np.ndarray  # (STOP_WORDS, d) unit
    sot: np.ndarray  # (D,) stored SOT token
    mu_v: np.ndarray  # (D,) stored frame mean offset
    mu_t: np.ndarray  # (D,) stored text mean offset
    style_v: np.ndarray  # (d, R) video nuisance subspace
    style_t: np.ndarray  # (d, R) text nuisance subspace
    scale_v: float
    scale_t: float
    parts: np.ndarray  # (n_videos, S, P) concept ids
    z: np.ndarray  # (n_videos, S, d) unit scene latents
    z_whole: np.ndarray  # (n_videos, d) unit: what a whole-video caption describes
    dup_group: np.ndarray  # (n_videos,) row of the video a near-duplicate copies (own row otherwise)
    multi: np.ndarray  # (n_videos,) bool: the video has ``scenes`` scenes (else one, repeated in every slot)
    n_frames: np.ndarray  # (n_videos,) valid frames
    video_row: np.ndarray  # (n_texts,)
    scene: np.ndarray  # (n_texts,) described scene, -1 = whole video
    n_valid: np.ndarray  # (n_texts,) valid tokens
    shift: np.ndarray | None  # (d, d) rotation of the captions' content (``caption_shift``); None: no shift


def caption_rotation(spec: GenSpec, d: int) -> np.ndarray | None:
    """The fixed rotation of the caption space by ``spec.caption_shift`` degrees, (d, d), or None at 0 degrees.

    It turns every vector of the content subspace by the same angle, in d // 2 random orthogonal planes (a
    random basis, paired): cos(T z, z) = cos(angle) for every z (an odd d leaves one direction fixed, so
    there cos(T z, z) >= cos(angle)). It is orthogonal, so captions keep their own geometry (the cosines
    between sentences do not change) and a linear map on either side undoes it exactly. Drawn from a
    stream of its own, so that the rest of the world is the same at every angle.
    """
    if spec.caption_shift == 0:
        return None
    a = np.deg2rad(spec.caption_shift)
    basis = _orthonormal(np.random.default_rng([spec.seed, 3]), d, d).astype(np.float64)  # (d, d)
    turn = np.eye(d)
    for i in range(0, d - 1, 2):
        turn[i : i + 2, i : i + 2] = [[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]
    return (basis @ turn @ basis.T).astype(np.float32)


def _change_one_concept(rng: np.random.Generator, parts: np.ndarray, multi: np.ndarray, copies: np.ndarray,
                        K: int) -> None:
    """Change one concept of one scene of each copy (in place): what tells a near-duplicate from its original."""
    S, P, n = parts.shape[1], parts.shape[2], len(copies)
    j, p = rng.integers(0, S, n), rng.integers(0, P, n)
    j = np.where(multi[copies], j, 0)  # a one-scene video's scene is its scene 0
    parts[copies, j, p] = (parts[copies, j, p] + rng.integers(1, K, n)) % K


def _share_sources(spec: GenSpec, split: np.ndarray, parts: np.ndarray, offsets: np.ndarray, multi: np.ndarray,
                   dup_group: np.ndarray) -> None:
    """Make ``shared_sources`` of the val and test videos other clips of train videos' sources (in place).

    The clips are drawn among the videos that are no near-duplicate's copy or original, so that a split's own
    near-duplicates stay as they were drawn; from a stream of their own, so that the rest of the world is the
    same at every rate.
    """
    train = np.flatnonzero(split == "train")
    if spec.shared_sources == 0 or len(train) == 0:
        return
    rng = np.random.default_rng([spec.seed, 4])
    copy = dup_group != np.arange(len(split))
    paired = copy.copy()
    paired[dup_group[copy]] = True  # the originals of the split's near-duplicates
    for s in ("val", "test"):
        rows = np.flatnonzero(split == s)
        free = rows[~paired[rows]]
        n = min(int(round(spec.shared_sources * len(rows))), len(free))
        if n <= 0:
            continue
        copies = np.sort(rng.choice(free, size=n, replace=False))
        src = rng.choice(train, size=n, replace=n > len(train))
        parts[copies], offsets[copies], multi[copies], dup_group[copies] = parts[src], offsets[src], multi[src], src
        _change_one_concept(rng, parts, multi, copies, spec.concepts)


def _latents(spec: GenSpec, videos: pd.DataFrame, captions: pd.DataFrame) -> _Latents:
    """Every latent of the world, drawn in one order from the seed: its space, the videos' contents, then the
    captions' layout (each stage draws from the same generator, after the one before)."""
    rng = np.random.default_rng([spec.seed, 0])
    space = _space(spec, rng)
    parts, offsets, multi, dup_group, z = _video_contents(spec, rng, videos, space["concepts"])
    n_frames, video_row, scene, n_valid = _caption_layout(spec, rng, videos, captions, multi)
    return _Latents(
        **space, parts=parts, z=z.astype(np.float32), z_whole=_unit(z.mean(axis=1)).astype(np.float32),
        dup_group=dup_group, multi=multi, n_frames=n_frames, video_row=video_row, scene=scene, n_valid=n_valid,
    )


def _space(spec: GenSpec, rng: np.random.Generator) -> dict[str, Any]:
    """The world's space: its content basis, residual bank, concepts, stop words, styles, scales and modality
    means, the words' vectors and noise bank, and the start token."""
    D, K = spec.embed_dim, spec.concepts
    d = _intrinsic(spec)
    full = _orthonormal(rng, D, min(D, d + 2))
    basis, outside = full[:, :d], full[:, d:]  # content inside; the modality means outside (below)
    residual = (RESIDUAL / np.sqrt(2) * _unit(rng.standard_normal((BANK, D)))).astype(np.float32)
    concepts = _unit(rng.standard_normal((K, d))).astype(np.float32)
    stop = _unit(rng.standard_normal((STOP_WORDS, d))).astype(np.float32)
    R = max(1, d // STYLE_RANK)
    style_v, style_t = _orthonormal(rng, d, R), _orthonormal(rng, d, R)
    sigma = spec.noise * NOISE_UNIT
    # Expected squared norms of the centred parts; the scale gives stored norms of about NORM.
    # The mean offsets are as long as the (unit) signal, not the noise: their cross terms with the
    # noise act like per-item biases (hubness), which must stay small.
    var_v = 1 + JITTER**2 + (STYLE * sigma) ** 2 * R + (FRAME_NOISE * sigma) ** 2 * d + RESIDUAL**2
    var_t = 1 + (STYLE * sigma) ** 2 * R + sigma**2 * d + RESIDUAL**2
    # The text mean is sized to the sentence's own spread, so that the cosine of two unrelated sentences
    # (CLIP's text cone, 0.51) does not move with ``noise``: the cone is the encoder's, not the dataset's.
    mean_t = MEAN_OFFSET_T * np.sqrt(var_t)
    scale_v, scale_t = NORM / np.sqrt(var_v + MEAN_OFFSET**2), NORM / np.sqrt(var_t + mean_t**2)
    # The modality means point out of the content subspace (CLIP's cone is a direction of its own): a
    # mean inside it would add <mean, content> to every score, a per-item bias (hubness) as large as
    # the signal. They meet at MEAN_ALIGN, which sets the cosine of unrelated sentence and frame.
    if outside.shape[1] == 2:
        u_v, u_t = outside[:, 0], MEAN_ALIGN * outside[:, 0] + np.sqrt(1 - MEAN_ALIGN**2) * outside[:, 1]
    else:  # D < 3: no room outside
        u_v = u_t = _unit(rng.standard_normal(D))
    mu_v = (scale_v * MEAN_OFFSET * u_v).astype(np.float32)
    mu_t = (scale_t * mean_t * u_t).astype(np.float32)
    shift = caption_rotation(spec, d)
    said = concepts if shift is None else concepts @ shift.T  # the concepts as captions word them
    words = np.concatenate([said, stop]) @ basis.T  # (K + STOP_WORDS, D)
    word_noise = (WORD_NOISE * sigma / np.sqrt(2)) * rng.standard_normal((BANK, d)) @ basis.T
    word_noise += RESIDUAL / np.sqrt(2) * _unit(rng.standard_normal((BANK, D)))
    sot = (scale_t * np.sqrt(var_t) * _unit(rng.standard_normal(D)) + mu_t).astype(np.float32)
    return dict(basis=basis, residual=residual, words=words.astype(np.float32),
                word_noise=word_noise.astype(np.float32), concepts=concepts, stop=stop, sot=sot, mu_v=mu_v,
                mu_t=mu_t, style_v=style_v, style_t=style_t, scale_v=float(scale_v), scale_t=float(scale_t),
                shift=shift)


def _video_contents(spec: GenSpec, rng: np.random.Generator, videos: pd.DataFrame,
                    concepts: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each video's scenes: their concepts (``parts``), its offset, whether it is multi-scene, its
    near-duplicate group, and the scenes' unit content vectors ``z`` (nv, S, d)."""
    S, P, K, d = spec.scenes, spec.concept_words, spec.concepts, concepts.shape[1]
    nv = len(videos)
    parts = rng.integers(0, K, size=(nv, S, P))
    # one offset per video, shared by its scenes (the shots of a clip share their setting and look)
    offsets = np.repeat(_unit(rng.standard_normal((nv, 1, d))).astype(np.float32), S, axis=1)
    multi = (rng.random(nv) < spec.multi_scene) if S > 1 else np.zeros(nv, bool)
    # Near-duplicates: inside each split, copy a random original and change one concept.
    dup_group = np.arange(nv)
    split = videos["split"].to_numpy()
    for s in ("train", "val", "test"):
        rows = np.flatnonzero(split == s)
        n_dup = min(int(round(spec.near_duplicates * len(rows))), len(rows) - 1)
        if n_dup <= 0:
            continue
        perm = rng.permutation(rows)
        copies, originals = perm[:n_dup], perm[n_dup:]
        src = rng.choice(originals, size=n_dup, replace=n_dup > len(originals))
        parts[copies], offsets[copies], dup_group[copies], multi[copies] = parts[src], offsets[src], src, multi[src]
        _change_one_concept(rng, parts, multi, copies, K)
    _share_sources(spec, split, parts, offsets, multi, dup_group)
    # a one-scene video repeats its scene 0 in every scene slot: its frames all show it
    parts[~multi, 1:], offsets[~multi, 1:] = parts[~multi, :1], offsets[~multi, :1]
    z = _unit(concepts[parts].sum(axis=2) / np.sqrt(P) + OFFSET * offsets)  # (nv, S, d)
    return parts, offsets, multi, dup_group, z


def _caption_layout(spec: GenSpec, rng: np.random.Generator, videos: pd.DataFrame, captions: pd.DataFrame,
                    multi: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each video's frame count, and each caption's video row, the scene it describes (-1: the whole video)
    and its valid token count (SOT, words, EOS)."""
    S, P, F, L = spec.scenes, spec.concept_words, spec.frames, spec.max_words
    nv, nt = len(videos), len(captions)
    lo = F if spec.min_frames is None else spec.min_frames
    n_frames = rng.integers(lo, F + 1, size=nv)
    video_row = pd.Series(np.arange(nv), index=videos["video_id"]).loc[captions["video_id"]].to_numpy()
    # scene = the one scene a caption describes, -1 = the whole video (a one-scene video's captions)
    scene = rng.integers(0, S, size=nt)
    if spec.caption_describes == "whole":
        scene[:] = -1
    elif spec.caption_describes == "mixed":
        scene[rng.random(nt) >= spec.partial_captions] = -1
    scene[~multi[video_row]] = -1
    n_content = np.where(scene >= 0, P, S * P)
    n_content[~multi[video_row]] = P
    n_stop = 1 + rng.poisson(MEAN_STOP_WORDS - 1, size=nt)
    n_valid = np.minimum(L, 2 + n_content + n_stop)  # SOT, words, EOS
    return n_frames, video_row, scene, n_valid


def _embed(lat: _Latents, x: np.ndarray, pick: np.ndarray, scale: float, mu: np.ndarray) -> np.ndarray:
    """Intrinsic (m, d) -> stored (m, D): into R^D, plus a full-rank residual, scaled, plus the mean.

    The residual of a row is the sum of the two bank vectors ``pick`` (m, 2) names: full rank and
    as good as fresh Gaussian noise here, at a fraction of the cost of D normals per row. Called
    once per shard, not per block: a multithreaded BLAS call costs ~20 ms on a loaded machine
    whatever its size.
    """
    y = x @ lat.basis.T  # (m, D)
    y += lat.residual[pick[:, 0]]
    y += lat.residual[pick[:, 1]]
    y *= np.float32(scale)
    y += mu
    return y


# ------------------------------------------------------------------------------ rows


def _video_block(spec: GenSpec, lat: _Latents, a: int, b: int, block: int):
    """Video rows [a, b) in intrinsic space, from their own random stream.

    Returns:
        x (n, F, d) float32, mask (n, F), timestamps (n, F), residual picks (n, F, 2).
    """
    rng = np.random.default_rng([spec.seed, _VIDEOS, block])
    F, S, d = spec.frames, spec.scenes, lat.basis.shape[1]
    n, sigma = b - a, float(spec.noise * NOISE_UNIT)
    nf = lat.n_frames[a:b]
    t = np.arange(F)
    mask = t[None, :] < nf[:, None]  # (n, F)
    scene = np.minimum((t[None, :] * S) // nf[:, None], S - 1)  # (n, F) contiguous blocks
    x = lat.z[a:b][np.arange(n)[:, None], scene]  # (n, F, d)
    # smooth temporal jitter: a slow rotation in a random plane over the clip
    ab = _unit(rng.standard_normal((n, 2, d), dtype=np.float32))
    phase = (rng.uniform(0, 2 * np.pi, (n, 1)) + 2 * np.pi * t[None, :] / nf[:, None]).astype(np.float32)
    x += JITTER * (np.cos(phase)[..., None] * ab[:, None, 0] + np.sin(phase)[..., None] * ab[:, None, 1])
    style = rng.standard_normal((n, lat.style_v.shape[1]), dtype=np.float32) @ lat.style_v.T  # (n, d)
    x += np.float32(STYLE * sigma) * style[:, None]
    x += np.float32(FRAME_NOISE * sigma) * rng.standard_normal((n, F, d), dtype=np.float32)
    pick = rng.integers(0, BANK, size=(n, F, 2))
    stamps = np.where(mask, t[None, :] + 0.5, np.nan).astype(np.float32)
    return x, mask, stamps, pick


def _text_block(spec: GenSpec, lat: _Latents, a: int, b: int, block: int):
    """Text rows [a, b) from their own random stream: tokens but EOS are final, the sentence is not.

    Returns:
        tokens (n, L, D) float32 with EOS left zero, mask (n, L), sentence (n, d) intrinsic,
        residual picks (n, 2).
    """
    rng = np.random.default_rng([spec.seed, _TEXTS, block])
    L, S, P, (D, d) = spec.max_words, spec.scenes, spec.concept_words, lat.basis.shape
    n, sigma = b - a, float(spec.noise * NOISE_UNIT)
    vrow, scene, nvalid = lat.video_row[a:b], lat.scene[a:b], lat.n_valid[a:b]
    rows = np.arange(n)
    z = np.where((scene >= 0)[:, None], lat.z[vrow, np.maximum(scene, 0)], lat.z_whole[vrow])  # (n, d)
    if lat.shift is not None:
        z = z @ lat.shift.T  # the content as this dataset's captions say it
    style = rng.standard_normal((n, lat.style_t.shape[1]), dtype=np.float32) @ lat.style_t.T
    sent = z + np.float32(STYLE * sigma) * style
    sent += np.float32(sigma) * rng.standard_normal((n, d), dtype=np.float32)
    pick = rng.integers(0, BANK, size=(n, 2))

    tokens = np.zeros((n, L, D), np.float32)
    mask = np.arange(L)[None, :] < nvalid[:, None]
    tokens[:, 0] = lat.sot  # every caption has SOT..EOT: at least 2 valid tokens
    # content concepts: every scene's for a whole-video caption, one scene's otherwise;
    # content words come first, then stop words; the first n_mid are shuffled into the middle
    parts = lat.parts[vrow]  # (n, S, P)
    whole = (scene < 0) & lat.multi[vrow]  # the concepts of every scene; else those of one
    content = np.full((n, S * P), -1)
    content[whole] = parts[whole].reshape(-1, S * P)
    content[~whole, :P] = parts[rows[~whole], np.maximum(scene[~whole], 0)]
    M, C = L - 2, content.shape[1]
    W = max(M, C)
    n_mid = nvalid - 2
    kind = np.full((n, W), -1)  # word id: a concept, or -1 for a stop word
    kind[:, :C] = content
    keys = np.where(np.arange(W)[None, :] < n_mid[:, None], rng.random((n, W)), np.inf)
    kind = np.take_along_axis(kind, np.argsort(keys, axis=1)[:, :M], 1)  # (n, M)
    ri, ci = np.nonzero(np.arange(M)[None, :] < n_mid[:, None])
    ids = kind[ri, ci]
    ids = np.where(ids >= 0, ids, len(lat.concepts) + rng.integers(0, STOP_WORDS, len(ids)))
    # word = its concept (or stop word) + noise, all already in R^D, the noise a pair of bank
    # vectors: the ~10 tokens of a caption cost gathers and adds, not D normals and a matmul each
    wpick = rng.integers(0, BANK, size=(len(ids), 2))
    words = lat.words[ids]
    words += lat.word_noise[wpick[:, 0]]
    words += lat.word_noise[wpick[:, 1]]
    words *= np.float32(lat.scale_t)
    words += lat.mu_t
    tokens[ri, ci + 1] = words
    return tokens, mask, sent, pick


def _blocks(fn, spec: GenSpec, lat: _Latents, shard: Shard, n_total: int) -> list[np.ndarray]:
    """Rows of one shard assembled from the fixed-size random blocks that cover it."""
    parts = []
    for blk in range(shard.start // BLOCK, (shard.stop - 1) // BLOCK + 1):
        a, b = blk * BLOCK, min((blk + 1) * BLOCK, n_total)
        out = fn(spec, lat, a, b, blk)
        lo, hi = max(shard.start, a) - a, min(shard.stop, b) - a
        parts.append([o[lo:hi] for o in out])
    return [np.concatenate(p) if len(p) > 1 else p[0] for p in zip(*parts)]


def _video_shard(spec: GenSpec, lat: _Latents, shard: Shard, n_total: int):
    """Frames (n, F, D), mask, timestamps of one shard; padded frames stay exactly zero."""
    x, mask, stamps, pick = _blocks(_video_block, spec, lat, shard, n_total)
    frames = np.zeros((*mask.shape, lat.basis.shape[0]), np.float32)
    frames[mask] = _embed(lat, x[mask], pick[mask], lat.scale_v, lat.mu_v)
    return frames, mask, stamps


def _text_shard(spec: GenSpec, lat: _Latents, shard: Shard, n_total: int):
    """Tokens (n, L, D), mask, sentence (n, D) of one shard; EOS = sentence exactly."""
    tokens, mask, sent, pick = _blocks(_text_block, spec, lat, shard, n_total)
    sent = _embed(lat, sent, pick, lat.scale_t, lat.mu_t)
    tokens[np.arange(len(sent)), lat.n_valid[shard.start : shard.stop] - 1] = sent
    return tokens, mask, sent


# ------------------------------------------------------------------------------ public


def provenance_for(spec: GenSpec) -> dict:
    """The provenance a store generated from ``spec`` carries (identity keys included)."""
    videos, captions = _tables(spec)
    return _provenance(spec, videos, captions)


def _provenance(spec: GenSpec, videos: pd.DataFrame, captions: pd.DataFrame) -> dict:
    return make_provenance(
        dataset=DATASET, split_set=SPLIT_SET, model=MODEL, pretrained="none", weights_sha256=spec.sha256(),
        frames=spec.frames, max_words=spec.max_words, embed_dim=spec.embed_dim, frame_sampling="synthetic",
        image_size=0, preprocessing="synthetic", manifest_sha256=manifest_sha256(videos, captions),
        generator=spec.to_dict(),
    )


def generate_store(
    out_dir: str | os.PathLike[str],
    spec: GenSpec = GenSpec(),
    *,
    video_shard: int = 64,
    text_shard: int = 256,
    progress: bool = False,
    overwrite: bool = False,
    wait: bool = False,
    made_by: str = MADE_BY,
) -> Path:
    """Write a complete synthetic feature store (same layout as ``tvrpipe extract``'s).

    Shards are generated and written one at a time, so memory stays at a few shards even for
    MSR-VTT-sized stores; rerunning on a partial store resumes it, and on a damaged one
    regenerates exactly the damaged shards. Beside the store,
    ``latent_videos.parquet`` (row, video_id, dup_group, n_frames, scenes, concepts) and
    ``latent_texts.parquet`` (row, caption_id, video_row, scene, concepts) record the ground truth.

    Args:
        out_dir: the store's directory (``open_store(out_dir)`` reads it).
        spec: what to generate.
        video_shard: videos per shard / Zarr chunk.
        text_shard: texts per shard / Zarr chunk.
        progress: show a progress bar.
        overwrite: delete the store in ``out_dir`` (whatever its spec) and generate it afresh.
        wait: if another process is writing this store (a second bench on the same ``--out``),
            wait for it, then check and finish what it wrote, instead of raising ``LockError``.
        made_by: the command that makes the store (``tvrpipe bench search``), recorded in its provenance:
            the messages about the store name it, as what repairs it.

    Returns:
        ``out_dir`` as a Path.

    Example:
        >>> generate_store(tmp_path / "feats", GenSpec(scenes=3, caption_describes="scene"))  # doctest: +SKIP
        >>> open_store(tmp_path / "feats").array("texts/tokens").shape  # doctest: +SKIP
        (1100, 32, 64)
    """
    spec.validate()
    if video_shard <= 0 or text_shard <= 0:
        raise ConfigError(f"shard sizes must be > 0, got video_shard={video_shard}, text_shard={text_shard}")
    t0 = time.perf_counter()
    out = Path(out_dir)
    videos, captions = _tables(spec)
    lat = _latents(spec, videos, captions)
    texts = captions.assign(video_row=lat.video_row)[["caption_id", "video_id", "video_row", "split"]]
    with StoreWriter(out, videos[["video_id", "split", "path"]], texts, _provenance(spec, videos, captions),
                     video_shard, text_shard, overwrite, made_by=made_by, wait=wait) as writer:
        v_pending, t_pending = writer.pending("videos"), writer.pending("texts")
        from tvrpipe.progress import progress_bar

        with progress_bar(elapsed=True, enabled=progress) as bar:
            task = bar.add_task("videos", total=len(v_pending))
            for s in v_pending:
                frames, mask, stamps = _video_shard(spec, lat, s, len(videos))
                writer.write_videos(s, frames, mask, stamps, [])
                bar.advance(task)
            task = bar.add_task("texts", total=len(t_pending))
            for s in t_pending:
                tokens, mask, sent = _text_shard(spec, lat, s, len(texts))
                writer.write_texts(s, tokens, mask, sent)
                bar.advance(task)
        _write_latents(out, spec, videos, captions, lat)
        writer.finalize()
    log.info("generated %d videos, %d texts into %s in %.1f s", len(videos), len(texts), out,
             time.perf_counter() - t0)
    return out


def _write_latents(
    out: Path, spec: GenSpec, videos: pd.DataFrame, captions: pd.DataFrame, lat: _Latents
) -> None:
    nv = len(videos)
    S = spec.scenes
    shown = np.where(lat.multi, S, 1)  # a one-scene video's concepts are its scene 0's
    lv = pd.DataFrame({"row": np.arange(nv), "video_id": videos["video_id"], "dup_group": lat.dup_group,
                       "n_frames": lat.n_frames, "scenes": shown,
                       "concepts": [p[:k].ravel() for p, k in zip(lat.parts, shown)]})
    parts = lat.parts[lat.video_row]  # (n_texts, S, P)
    whole = (lat.scene < 0) & lat.multi[lat.video_row]
    concepts = [p.ravel() if w else p[max(j, 0)] for p, w, j in zip(parts, whole, lat.scene)]
    lt = pd.DataFrame({"row": np.arange(len(captions)), "caption_id": captions["caption_id"],
                       "video_row": lat.video_row, "scene": lat.scene, "concepts": concepts})
    for df, name in ((lv, LATENT_VIDEOS), (lt, LATENT_TEXTS)):
        atomic_write_parquet(df, out / name)
