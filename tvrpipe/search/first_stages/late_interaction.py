"""The late-interaction first stage: a token-wise head's own score, over a few segment vectors of each video
instead of its frames, in a subspace of principal axes.

A head that scores by token-wise interaction (tokenwise, uatvr: :attr:`~tvrpipe.heads.base.Head.token_wise_keys`)
compares every word of the query with every frame of the video, UATVR Eq. 7::

    s(t, v) = 1/2 * ( 1/N sum_n max_m <w^n, f^m>  +  1/M sum_m max_n <w^n, f^m> )

No vector of the sentence stands for that: the distilled first stage, whose query side is the sentence, never
sees the words, and its shortlists missed nearly all of tokenwise's top 10 (docs/search.md). This first stage
keeps the interaction, as ColBERT's late interaction does, and shrinks both sides:

- the video: the head's encoded video vectors (tokenwise: the frames; uatvr: its temporal transformer's outputs
  and extra tokens) cut into ``segments`` contiguous blocks, each block's mean projected on ``dim`` axes and
  L2-normalised (:func:`~tvrpipe.search.first_stages.distilled.segment_means`);
- the query: the head's encoded word vectors (its own mask: tokenwise leaves out the start token), projected
  on the same axes and L2-normalised;
- the score: the same equation with segments in the frames' place.

The axes are the principal axes of the run's own train split (``videos`` videos' segments and ``captions``
captions' words, as the head encodes them); nothing is fitted to the head's scores. With as many segments as
frames and ``dim`` = D the score is the head's own (tested). The index is every searchable video's segment
vectors (float32, ``segments`` x ``dim`` x 4 bytes a video: 1.5 GB at a million videos with the defaults, read
from a memory map), ranked exactly, a block of videos at a time. A query costs its words x ``segments`` x
``dim`` multiply-adds a video. :mod:`tvrpipe.search.distilled` builds, keeps and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tvrpipe.config import at_least
from tvrpipe.errors import ConfigError
from tvrpipe.search.first_stages.base import (
    HeadAwareIndex,
    StageConfig,
    normalised,
    register_first_stage,
)
from tvrpipe.search.first_stages.distilled import segment_means
from tvrpipe.search.first_stages.exact import top_by_blocks

_CELLS = 1 << 24  # word x segment scores held at once while ranking (64 MiB of float32)


def segment_token_wise(words: np.ndarray, counts: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """UATVR Eq. 7 with segments for frames: ``(Q, n)`` scores of Q queries against n videos.

    ``words``: ``(sum counts, d)`` the queries' word vectors, query after query (``counts[q]`` each);
    ``segments``: ``(n, S, d)``. A query with no word scores 0 (the equation's two means are empty)."""
    n, S, d = segments.shape
    c = (words @ segments.reshape(n * S, d).T).reshape(len(words), n, S)
    out = np.zeros((len(counts), n), np.float32)
    ends = np.cumsum(counts)
    for q, (a, b) in enumerate(zip(ends - counts, ends)):
        if b > a:
            cq = c[a:b]  # (words, n, S)
            out[q] = 0.5 * (cq.max(2).mean(0) + cq.max(0).mean(1))
    return out


@dataclass
class TokenProjection:
    """What the late-interaction stage is made with: the run's ``head`` (its encoders), the ``axes`` (D x d,
    float32) both sides are projected on, and the segments a video."""

    head: Any
    axes: np.ndarray
    segments: int

    def words(self, texts: Any) -> tuple[np.ndarray, np.ndarray]:
        """The head's word vectors of a TextBatch, projected and normalised: ``(sum of words, d)`` float32, query
        after query, and each query's count of words."""
        unit, counts = head_words(self.head, texts)
        return self.project(unit), counts

    def project(self, unit: np.ndarray) -> np.ndarray:
        """Unit vectors ``(n, D)`` on the axes, normalised: ``(n, d)``."""
        return normalised(unit @ self.axes)

    def videos(self, frames: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """``(n x segments, d)`` unit rows: each video's segments of the head's vectors, projected, in order."""
        return self.from_segments(segment_means(*head_video_vectors(self.head, frames, mask), self.segments))

    def from_segments(self, seg: np.ndarray) -> np.ndarray:
        """:func:`segment_means` already taken: ``(n, segments, D)`` to ``(n x segments, d)`` unit rows."""
        return self.project(normalised(seg).reshape(-1, seg.shape[-1]))


def head_words(head: Any, texts: Any) -> tuple[np.ndarray, np.ndarray]:
    """A token-wise head's encoded words of a TextBatch, unit length: ``(sum of words, D)`` float32, query after
    query, and each query's count of words (the head's own mask)."""
    import torch

    tkey, mkey = head.token_wise_keys[:2]
    with torch.inference_mode():
        e = head.encode_texts(texts)
    mask = e[mkey].cpu().numpy().astype(bool)
    return normalised(e[tkey].float().cpu().numpy()[mask]), mask.sum(1)


def head_video_vectors(head: Any, frames: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A token-wise head's encoded video vectors and their mask, ``(n, M, D)`` float32 and ``(n, M)`` bool."""
    import torch

    from tvrpipe.heads.base import VideoBatch

    vkey, mkey = head.token_wise_keys[2:]
    with torch.inference_mode():
        e = head.encode_videos(VideoBatch(torch.from_numpy(np.asarray(frames, np.float32)),
                                          torch.from_numpy(np.asarray(mask, bool))))
    return e[vkey].float().cpu().numpy(), e[mkey].cpu().numpy().astype(bool)


@register_first_stage("late-interaction")
class LateInteraction(HeadAwareIndex):
    """A token-wise head's interaction of the query's words with a few segment vectors a video, ranked exactly."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        segments: int = at_least(1, 3)  # choice: as the distilled stage's; 3 to 6 gave the same recall at 1 %
        dim: int = at_least(1, 128)  # choice: 128 matched 256 and 512 in recall; 64 lost (docs/search.md)
        captions: int = at_least(1, 500)  # of the run's train split: their words for the axes, and the record
        videos: int = at_least(1, 2000)  # of the run's train split: their segments for the axes, and the record
        seed: int = 0

    summary = ("a token-wise head's (tokenwise, uatvr; needs --run) interaction of the query's words with a few "
               "segment vectors of each video, ranked exactly; built once per run and store")

    @property
    def projection(self) -> TokenProjection:
        return self.source

    def __len__(self) -> int:
        return len(self.pooled) // self.projection.segments

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        raise ConfigError("--first-stage late-interaction ranks by the query's words, and this query has none "
                          "(a picture, or a sentence embedding alone)")

    def top_texts(self, texts: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best videos of each query of a TextBatch by the segment-wise interaction, best first."""
        words, counts = self.projection.words(texts)
        S, n = self.projection.segments, len(self)
        vectors = self.pooled.reshape(n, S, -1)
        block = max(1, _CELLS // max(1, len(words) * S))
        return top_by_blocks(n, len(counts), min(k, n),
                             lambda a, b: segment_token_wise(words, counts, np.asarray(vectors[a:b])), block)

    def describe(self) -> str:
        c = self.config
        return (f"late-interaction: {self.projection.head.name}'s words against {c.segments} segments x {c.dim} "
                f"dims a video (UATVR Eq. 7 over segments), exact")


def check_token_wise(head: Any) -> None:
    """Refuse a head whose score is not the token-wise interaction, naming the heads whose is.

    Raises:
        ConfigError: naming the head, the heads that score token-wise and the first stages to use instead.
    """
    from tvrpipe.heads.base import head_class, list_heads

    if head.token_wise_keys is None:
        have = [n for n in list_heads() if head_class(n).token_wise_keys is not None]
        raise ConfigError(f"--first-stage {LateInteraction.name}: {head.name} does not score by the token-wise "
                          f"interaction of words and frames ({', '.join(have)} do); use --first-stage distilled"
                          + (" or head-embedding" if head.indexable() is not None else ""))
