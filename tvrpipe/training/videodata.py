"""Decoded video-caption batches for ``tvrpipe finetune``.

DataLoader workers decode with extraction's decoder (:class:`~tvrpipe.features.decode.DecodeWorker`:
decord then PyAV, resize at decode, a killable child process with a per-video timeout), so a
finetuned model sees frames prepared exactly as ``extract`` prepares them.

Sampling (docs/training.md, "End-to-end finetuning"):

- training: each epoch visits every training video once, in an order drawn from ``(seed, epoch)``,
  with one of its captions drawn at random; each frame is a random frame of its uniform segment
  (offsets drawn from ``(seed, epoch, video)``). All draws are made for the whole epoch before it
  is split into steps and ranks, so a step of N workers x b pairs sees exactly the pairs and frames
  that one process with N x b pairs sees.
- evaluation: the segment centres, extraction's sampling (``FRAME_SAMPLING``).

A video that fails to decode is skipped in training (the step runs on the rest of its batch) and
reported to the caller, which records it and leaves it out of later epochs; at evaluation it keeps
its place with no real frame, as ``extract`` stores it (zero features, all-False mask).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

# An item key: (video row, caption row or -1, epoch or -1 for evaluation sampling).
Key = tuple[int, int, int]


@dataclass(frozen=True)
class VideoTable:
    """The videos and captions a dataset reads: absolute paths, clip bounds, caption texts."""

    paths: np.ndarray  # (n_videos,) str
    start_s: np.ndarray  # (n_videos,) float, NaN = open
    end_s: np.ndarray  # (n_videos,) float, NaN = open
    texts: np.ndarray  # (n_captions,) str


class DecodedClips(Dataset):
    """Map-style dataset over :data:`Key` items: decodes the video, returns frames and the caption.

    Each process (the main one, or a DataLoader worker) opens its own decoder child on first use.

    Args:
        table: the videos and captions.
        frames: F, frames per video.
        image_size: S, the model's input size.
        seed: the run's seed (frame offsets of training items).
        timeout_s: per-video decode timeout.
    """

    def __init__(self, table: VideoTable, frames: int, image_size: int, seed: int, timeout_s: float) -> None:
        self.table, self.frames, self.image_size = table, frames, image_size
        self.seed, self.timeout_s = seed, timeout_s
        self._decoder = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.table.paths)

    def __getitem__(self, key: Key) -> dict:
        from tvrpipe.features.decode import DecodeFailure, DecodeWorker

        video, caption, epoch = key
        if self._pid != os.getpid():  # a fork copied the parent's decoder handle: start our own
            self._decoder, self._pid = DecodeWorker(self.timeout_s), os.getpid()
        offsets = frame_offsets(self.seed, epoch, video, self.frames) if epoch >= 0 else None
        start, end = float(self.table.start_s[video]), float(self.table.end_s[video])
        item = {"video": video, "caption": caption, "text": str(self.table.texts[caption]) if caption >= 0 else "",
                "frames": None, "mask": None, "error": ""}
        try:
            d = self._decoder.decode(self.table.paths[video], self.frames, self.image_size,
                                     None if np.isnan(start) else start, None if np.isnan(end) else end, offsets)
            item["frames"], item["mask"] = d.frames, d.mask
        except DecodeFailure as e:
            item["error"] = f"{e.kind}: {e.detail}"
        return item


def frame_offsets(seed: int, epoch: int, video: int, frames: int) -> np.ndarray:
    """The training offsets (F,) in [0, 1) of ``video`` in ``epoch``: independent of ranks and workers."""
    return np.random.default_rng([seed, epoch, video]).random(frames)


@dataclass
class ClipBatch:
    """A collated batch: uint8 frames (B, F, S, S, 3), their mask, captions, and what failed."""

    videos: np.ndarray  # (B,) video rows
    captions: np.ndarray  # (B,) caption rows (-1 at evaluation)
    frames: torch.Tensor  # uint8 (B, F, S, S, 3)
    frame_mask: torch.Tensor  # bool (B, F)
    texts: list[str]
    failed: list[tuple[int, str]]  # (video row, error) of the videos that did not decode


class Collate:
    """Stacks items into a :class:`ClipBatch`; failed videos are dropped (training) or kept with no
    real frame (evaluation, ``keep_failed``), as the store keeps them."""

    def __init__(self, frames: int, image_size: int, keep_failed: bool) -> None:
        self.frames, self.image_size, self.keep_failed = frames, image_size, keep_failed

    def __call__(self, items: Sequence[dict]) -> ClipBatch:
        failed = [(it["video"], it["error"]) for it in items if it["error"]]
        kept = list(items) if self.keep_failed else [it for it in items if not it["error"]]
        F, S = self.frames, self.image_size
        frames = np.zeros((len(kept), F, S, S, 3), np.uint8)
        mask = np.zeros((len(kept), F), bool)
        for i, it in enumerate(kept):
            if not it["error"]:
                frames[i], mask[i] = it["frames"], it["mask"]
        return ClipBatch(np.array([it["video"] for it in kept], np.int64),
                         np.array([it["caption"] for it in kept], np.int64),
                         torch.from_numpy(frames), torch.from_numpy(mask), [it["text"] for it in kept], failed)


class PlannedBatches(Sampler):
    """A batch sampler that yields the batches of the current plan (set before each epoch).

    It runs in the main process, so a DataLoader with persistent workers picks up each new plan.
    """

    def __init__(self) -> None:
        self.plan: list[list[Key]] = []

    def __iter__(self) -> Iterator[list[Key]]:
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


@dataclass(frozen=True)
class TrainPairs:
    """The training videos and, grouped by video, their captions (rows of the manifest tables)."""

    videos: np.ndarray  # (n,) video rows
    caption_rows: np.ndarray  # caption rows sorted by video
    first: np.ndarray  # (n,) where each video's captions start in caption_rows
    count: np.ndarray  # (n,) how many captions each video has

    @classmethod
    def build(cls, videos: np.ndarray, caption_rows: np.ndarray, caption_video: np.ndarray) -> TrainPairs:
        """``videos``: training video rows; ``caption_rows`` / ``caption_video``: their captions and
        each caption's video row. A video without a caption cannot be a training pair: left out."""
        pos = {int(v): i for i, v in enumerate(videos)}
        owner = np.array([pos.get(int(v), -1) for v in caption_video], np.int64)
        keep = owner >= 0
        order = np.argsort(owner[keep], kind="stable")
        rows, owner = caption_rows[keep][order], owner[keep][order]
        count = np.bincount(owner, minlength=len(videos))
        has = count > 0
        first = (np.cumsum(count) - count)[has]
        return cls(np.asarray(videos)[has], rows, first, count[has])


def epoch_steps(pairs: TrainPairs, global_batch: int, epoch_pairs: str = "captions") -> int:
    """Steps of an epoch (before videos known not to decode are left out): every training caption
    once (``captions``, the papers' epoch) or one caption per video (``videos``)."""
    n = len(pairs.caption_rows) if epoch_pairs == "captions" else len(pairs.videos)
    return n // global_batch


def epoch_plan(pairs: TrainPairs, seed: int, epoch: int, global_batch: int, rank: int, world: int,
               skip: frozenset[int] = frozenset(), max_steps: int | None = None,
               epoch_pairs: str = "captions") -> list[list[Key]]:
    """This rank's batches for ``epoch``: the whole epoch is drawn first, then cut into global
    batches of ``global_batch`` pairs (the last partial one dropped), of which this rank takes the
    ``rank``-th of ``world`` equal slices. Videos in ``skip`` (known not to decode) are left out.

    ``epoch_pairs``: ``captions`` pairs every training caption with its video once, as the papers'
    loaders do (X-Pool, T-MASS, DUQ and CLIP4Clip list all (video, caption) pairs), with a video's
    captions spread evenly over the epoch (:func:`_caption_order`), so no video is twice in a batch
    (no false negative for the contrastive loss), where a shuffle of all pairs puts one in about
    one batch of 32 in 20 on MSR-VTT. ``videos`` takes one random caption per video
    (``train-head``'s epoch: 1/20 of the papers' on MSR-VTT).
    """
    rng = np.random.default_rng([seed, epoch])
    if epoch_pairs == "videos":
        order = rng.permutation(len(pairs.videos))
        pick = (rng.random(len(pairs.videos)) * pairs.count).astype(np.int64)  # a caption per video
        order = np.array([i for i in order if int(pairs.videos[i]) not in skip], np.int64)
        caption = pairs.first[order] + pick[order]
    else:
        order, caption = _caption_order(pairs, rng, skip)
    steps = len(order) // global_batch
    if max_steps is not None:
        steps = min(steps, max_steps)
    local = global_batch // world
    plan = []
    for s in range(steps):
        part = slice(s * global_batch + rank * local, s * global_batch + (rank + 1) * local)
        plan.append([(int(pairs.videos[i]), int(pairs.caption_rows[c]), epoch)
                     for i, c in zip(order[part], caption[part])])
    return plan


def _caption_order(pairs: TrainPairs, rng: np.random.Generator,
                   skip: frozenset[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every (video, caption) pair once (:func:`epoch_plan`): the videos' indices and their captions'
    positions in ``caption_rows``, in epoch order. A video's c captions (in a random order) sit at
    evenly spaced points of the epoch, ``(k + u) / c`` for k < c with a random phase u, and the
    pairs are taken in the order of their points: consecutive captions of a video lie about an
    epoch / c apart, so a batch holds a video twice only where a video has about as many captions
    as the epoch has batches (never on the benchmarks: MSR-VTT 20 captions, 5,000 batches)."""
    owner = np.repeat(np.arange(len(pairs.videos)), pairs.count)  # caption position -> video index
    by_key = np.lexsort((rng.random(len(owner)), owner))  # each video's captions in a random order
    k = np.empty(len(owner), np.int64)
    k[by_key] = np.arange(len(owner)) - pairs.first[owner[by_key]]
    point = (k + rng.random(len(pairs.videos))[owner]) / pairs.count[owner]
    keep = np.array([int(v) not in skip for v in pairs.videos], bool)[owner]
    caption = np.flatnonzero(keep)[np.argsort(point[keep], kind="stable")]
    return owner[caption], caption
