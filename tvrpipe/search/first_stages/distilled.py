"""The distilled first stage: a small scorer fitted to rank as a run's head ranks, so that the head's best
videos are near the top of a short shortlist.

The pooled first stages rank by zero-shot CLIP's cosine (a video's mean frame against the query's sentence). A
trained head ranks otherwise: it learned the dataset's captions, and a head that pools frames by the sentence
(X-Pool, T-MASS, UATVR, ProTA, DUQ) scores the frames a caption names, so its best videos can lie deeper in the
zero-shot list than any affordable K. This first stage scores with a scorer distilled from the head (the
field's answer to a precise scorer too slow to run on everything, as ColBERT's late interaction and a distilled
student are):

- the video: its valid frames (L2-normalised) cut into ``segments`` contiguous blocks, each block's mean
  mapped by ``V`` (D x ``dim``) and L2-normalised: ``segments`` vectors a video (a segment with no frame takes
  the mean of all of them);
- the query: its sentence embedding (L2-normalised) mapped by ``Q`` (D x ``dim``) and L2-normalised;
- the score: the best segment's inner product (a late interaction over segments: a caption naming one scene
  of a video finds that scene, which a mean dilutes).

``Q`` and ``V`` are fitted to the head, not to captions' videos: on ``captions`` captions of the run's own
train split against ``videos`` of its train videos, the head scores every pair; each caption's scores,
standardised, give a target distribution softmax(z / ``temperature``), and the scorer's softmax(scale x score)
(scale learnt) is fitted to it by the KL divergence, with Adam (``steps`` steps of ``batch`` captions, learning
rate ``lr``), from the principal axes of the segments and sentences. Labels are never read: the head is the
teacher, whatever it learned.

The index is every searchable video's segment vectors (float32, ``segments`` x ``dim`` x 4 bytes a video: 1.5 GB
at a million videos with the defaults, read from a memory map) ranked exactly; a query's ``k`` best videos are
the first ``k`` distinct videos of its ``segments`` x ``k`` best segments, which is the exact top ``k`` by the
best segment. Building it costs the teacher's scores (captions x videos head evaluations), the fit, and one
pass over the store's frames. :mod:`tvrpipe.search.distilled` builds, keeps and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tvrpipe.config import above, at_least
from tvrpipe.search.first_stages.base import (
    HeadAwareIndex,
    StageConfig,
    normalised,
    register_first_stage,
)
from tvrpipe.search.first_stages.exact import exact_top


def segment_means(frames: np.ndarray, mask: np.ndarray, segments: int) -> np.ndarray:
    """``(n, segments, D)`` float32: each video's valid frames, L2-normalised, cut into ``segments`` contiguous
    blocks of (nearly) equal size in order, each block's mean; a block with no frame (fewer valid frames than
    segments) takes the mean of all the video's valid frames. Rows are not normalised here."""
    f = normalised(frames)
    m = np.asarray(mask, bool)
    valid = m.sum(1, keepdims=True)
    block = ((np.cumsum(m, 1) - 1) * segments) // np.maximum(valid, 1)  # each valid frame's block, in order
    member = ((block[..., None] == np.arange(segments)) & m[..., None]).astype(np.float32)  # (n, L, S)
    count = member.sum(1)  # (n, S)
    sums = np.einsum("nls,nld->nsd", member, f)
    whole = (f * m[..., None]).sum(1) / np.maximum(valid, 1)
    return np.where(count[..., None] > 0, sums / np.maximum(count, 1)[..., None], whole[:, None, :]).astype(np.float32)


@dataclass
class Scorer:
    """The distilled scorer: ``query_map`` and ``video_map`` (D x d, float32) and the segments per video."""

    query_map: np.ndarray
    video_map: np.ndarray
    segments: int

    def queries(self, sentences: np.ndarray) -> np.ndarray:
        """``(Q, d)`` unit rows: the sentences (normalised) mapped."""
        return normalised(normalised(sentences) @ self.query_map)

    def videos(self, frames: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``(n x segments, d)`` unit rows: each video's segments, in order, mapped (video i's are rows
        ``i * segments`` to ``(i + 1) * segments``)."""
        return self.from_segments(segment_means(frames, mask, self.segments))

    def from_segments(self, seg: np.ndarray) -> np.ndarray:
        """:meth:`videos` of :func:`segment_means` already taken: ``(n, segments, D)`` to ``(n x segments, d)``."""
        return normalised((normalised(seg) @ self.video_map).reshape(-1, self.video_map.shape[1]))


@register_first_stage("distilled")
class Distilled(HeadAwareIndex):
    """A run's head distilled into a late-interaction scorer over segment vectors, ranked exactly."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        segments: int = at_least(1, 3)  # choice: a few scenes a video (the generated world's multi-scene have 3)
        dim: int = at_least(1, 128)  # choice: 128 matched 512 in recall at a quarter of the index (docs/search.md)
        captions: int = at_least(1, 2000)  # teacher captions of the run's train split (head scores: captions x videos)
        videos: int = at_least(1, 2000)  # teacher videos of the run's train split
        steps: int = at_least(1, 300)  # choice: 100 to 1,000 steps changed recall by under 0.02 (docs/search.md)
        batch: int = at_least(1, 256)  # captions a step
        lr: float = above(0, 1e-3)
        temperature: float = above(0, 0.25)  # of the standardised head scores: the target weighs each caption's top few
        seed: int = 0

    summary = ("a scorer distilled from the run's head (needs --run): segment vectors of each video against a "
               "mapped sentence, their best segment ranked exactly; built once per run and store")

    @property
    def scorer(self) -> Scorer:
        return self.source

    def __len__(self) -> int:
        return len(self.pooled) // self.scorer.segments

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best videos by their best segment; ``queries`` are sentence embeddings (mapped here)."""
        S = self.scorer.segments
        k = min(k, len(self))
        pos, scores = exact_top(self.pooled, self.scorer.queries(queries), min(S * k, len(self.pooled)))
        video = pos // S
        out_p = np.empty((len(video), k), np.int64)
        out_s = np.empty((len(video), k), np.float32)
        for q in range(len(video)):  # a video's first (best) segment in the ranking is its score
            _, first = np.unique(video[q], return_index=True)
            first = np.sort(first)[:k]
            out_p[q], out_s[q] = video[q, first], scores[q, first]
        return out_p, out_s

    def describe(self) -> str:
        c = self.config
        return (f"distilled: {c.segments} segments x {c.dim} dims a video, the best segment's cosine with the "
                f"mapped sentence, exact")
