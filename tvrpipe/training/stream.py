"""How ``train-head`` reads a store: the whole split in memory, or streamed from the store when it does not fit.

In memory (what a split that fits gets): :func:`~tvrpipe.training.data.load_splits` reads every row once into
float16 arrays, and an epoch visits the training videos in a permutation (:class:`~tvrpipe.training.data.CaptionPairs`).

Streamed (a split larger than the memory budget): nothing is read whole. An epoch reads the training videos in
blocks of whole store chunks (or parts of one), the blocks in a random order, each video with one of its
captions drawn at random; the pairs pour into a shuffle buffer, and each batch is drawn from the buffer at
random (the shard order plus shuffle buffer of WebDataset and embedding-reader). Reads stay sequential within a
block; only the chosen captions are read (:func:`~tvrpipe.features.arrays.read_rows` reads rows in place). The
validation and test splits are read in batches whenever they are evaluated (:class:`StoreSplit`).

Which mode a run takes: :func:`plan_data`, from the bytes the in-memory split would hold and the memory budget
(``--memory-budget``, default half of the memory this process may use). The run records the mode, the order and
the buffer in its ``config.yaml`` (``data``). Both modes draw from the run's seed and the epoch only, so a resumed
run draws the same; they draw differently from each other (the buffer's order is not a permutation's).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import FeatureStore
from tvrpipe.files import gb
from tvrpipe.heads.base import TextBatch, VideoBatch
from tvrpipe.training.data import (
    CaptionPairs,
    SplitBatches,
    SplitData,
    SplitRows,
    Splits,
    as_float32,
    load_split,
    real_width,
    text_columns,
)

MEMORY_SHARE = 0.5  # the default budget: this share of the memory the process may use
BUFFER_SHARE = 0.5  # of a streamed run's budget, the shuffle buffer's; the rest is reads in flight and batches
SPLITS = ("train", "val", "test")
IN_MEMORY_ORDER = "every training video once an epoch, in a random permutation"

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_limits(root: Path = CGROUP_ROOT, membership: Path = Path("/proc/self/cgroup")) -> list[tuple[int, Path]]:
    """The memory limits set on this process's cgroup and on every cgroup above it (a container's, a
    ``systemd-run -p MemoryMax=`` scope's): cgroup v2's ``memory.max`` and v1's ``memory.limit_in_bytes``,
    read at the process's own path under ``root`` and at each parent up to ``root``. "max" and v1's
    no-limit value (about 2^63) are no limit."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    places = []  # (controller folder, the process's path in it, the limit file)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            places.append((root, path, "memory.max"))
        elif "memory" in controllers.split(","):
            places.append((root / "memory", path, "memory.limit_in_bytes"))
    if not places:  # no membership to read: the root folders alone
        places = [(root, "/", "memory.max"), (root / "memory", "/", "memory.limit_in_bytes")]
    found = []
    for base, path, name in places:
        here = base / path.strip("/")
        for folder in (here, *here.parents):
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                text = ""
            if text.isdigit() and int(text) < 2**60:
                found.append((int(text), folder / name))
            if folder == base:
                break
    return found


def memory_limit() -> tuple[int, str]:
    """The bytes this process may use and what sets them: the machine's RAM, or a lower limit of its cgroup
    (a container's, or any cgroup above it) or of ``ulimit -v``."""
    limits = [(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM")]
    limits += [(n, f"cgroup limit ({path})") for n, path in cgroup_limits()]
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft not in (resource.RLIM_INFINITY, -1) and soft > 0:
        limits.append((soft, "ulimit -v"))
    return min(limits)


def pair_bytes(store: FeatureStore, width: int) -> int:
    """The float16 bytes one (video, caption) pair holds in memory: frames, frame mask, sentence, and ``width``
    token columns with their mask (0 for a head that reads no word tokens)."""
    F, D = store.group["videos/frames"].shape[1:]
    return F * D * 2 + F + D * 2 + width * (D * 2 + 1)


def split_width(store: FeatureStore, text_rows: np.ndarray) -> int:
    """:func:`~tvrpipe.training.data.real_width` of captions ``text_rows`` (sorted), read block by block."""
    used = np.zeros(store.group["texts/token_mask"].shape[1], bool)
    for _, mask in store.blocks("texts/token_mask", np.sort(text_rows), chunks=16):
        used |= mask.any(0)
    return real_width(used[None])


@dataclass(frozen=True)
class DataPlan:
    """How a run reads its store (:func:`plan_data`).

    Attributes:
        streamed: False: every split in memory; True: streamed.
        needs: bytes the splits would hold in memory.
        budget, budget_source: the memory budget and where it comes from.
        evaluation: bytes one evaluation holds (:func:`evaluation_bytes`), kept out of the buffer's share.
        tables: bytes of the store's video and caption tables (:func:`table_bytes`), kept out of it too.
        buffer_videos, block_videos: a streamed run's shuffle buffer and read block, in videos (0 in memory).
        widths: each split's real token columns (:func:`split_width`), read once for the plan and kept for the
            splits read on use; empty for a head that reads no word tokens.
    """

    streamed: bool
    needs: int
    budget: int
    budget_source: str
    evaluation: int = 0
    tables: int = 0
    buffer_videos: int = 0
    block_videos: int = 0
    widths: Mapping[str, int] = field(default_factory=dict)

    @property
    def order(self) -> str:
        if not self.streamed:
            return IN_MEMORY_ORDER
        return (f"blocks of up to {self.block_videos:,} videos (whole store chunks, or part of one) in a random "
                f"order per epoch, each video with a random caption, through a shuffle buffer of "
                f"{self.buffer_videos:,} videos")

    def record(self) -> dict:
        """What the run's ``config.yaml`` says of its data (``data``)."""
        return {"mode": "streamed" if self.streamed else "in memory", "order": self.order,
                "needs": gb(self.needs), "budget": f"{gb(self.budget)} ({self.budget_source})",
                "evaluation": gb(self.evaluation), "tables": gb(self.tables),
                **({"buffer_videos": self.buffer_videos, "block_videos": self.block_videos} if self.streamed else {})}


def item_bytes(head: Any, frames: int, width: int) -> tuple[int, int]:
    """The bytes of ``head``'s embedding of one caption (``width`` token columns) and of one video (``frames``
    frames), as evaluation holds them: measured by encoding one of each."""
    F, D = frames, head.config.embed_dim
    gen = torch.Generator().manual_seed(0)
    text = TextBatch(torch.randn(1, width, D, generator=gen), torch.ones(1, width, dtype=torch.bool),
                     torch.randn(1, D, generator=gen))
    video = VideoBatch(torch.randn(1, F, D, generator=gen), torch.ones(1, F, dtype=torch.bool))
    if not head.uses_tokens:
        text = TextBatch.of_sentences(text.sentence)
    with torch.inference_mode():
        size = lambda emb: sum(v.numel() * v.element_size() for v in emb.values() if isinstance(v, torch.Tensor))  # noqa: E731
        return size(head.encode_texts(text)), size(head.encode_videos(video))


def evaluation_bytes(rows: SplitRows, per_text: int, per_video: int) -> int:
    """What one evaluation holds beside the model, for the larger of the validation and the test split: every
    caption's and video's embedding (``per_text`` and ``per_video`` bytes each: :func:`item_bytes`) and two float32
    n_text x n_video score matrices (the raw scores, and one variant's at a time: a direction's, DSL's)."""
    return max(len(t) * per_text + len(v) * per_video + 2 * 4 * len(t) * len(v)
               for t, v in ((rows.val_texts, rows.val_videos), (rows.test_texts, rows.test_videos)))


def table_bytes(store: FeatureStore) -> int:
    """The store's video and caption tables in memory (they grow with the store, whichever way its features are
    read)."""
    return int(store.videos.memory_usage(deep=True).sum() + store.texts.memory_usage(deep=True).sum())


def plan_data(store: FeatureStore, rows: SplitRows, uses_tokens: bool, batch: int, budget: int | None = None,
              head: Any = None) -> DataPlan:
    """In memory when the three splits, one evaluation and the store's tables fit ``budget`` bytes (default
    :data:`MEMORY_SHARE` of :func:`memory_limit`), else streamed, with a shuffle buffer of :data:`BUFFER_SHARE`
    of what the budget leaves beside the evaluation and the tables. The evaluation's embeddings are ``head``'s
    (:func:`item_bytes`); without a head, the features' own size in float32.

    Raises:
        ConfigError: the split does not fit and the budget cannot hold a streamed run's buffer (a batch and a
            read block) beside the evaluation and the tables.
    """
    if budget is None:
        limit, source = memory_limit()
        budget, budget_source = int(limit * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of {gb(limit)}, the {source}"
    else:
        budget_source = "--memory-budget"
    n_texts = len(rows.train_texts) + len(rows.val_texts) + len(rows.test_texts)
    videos = len(rows.train_videos) + len(rows.val_videos) + len(rows.test_videos)
    # one pass over each split's token masks; the widest is the union's width (the bytes counted), the train
    # split's sizes the buffer, and all three serve the splits read on use
    widths = {name: split_width(store, getattr(rows, f"{name}_texts")) for name in SPLITS} if uses_tokens else {}
    width = max(widths.values()) if widths and n_texts else 0
    F, D = store.group["videos/frames"].shape[1:]
    needs = videos * (F * D * 2 + F) + n_texts * (D * 2 + width * (D * 2 + 1))
    per_text, per_video = (item_bytes(head, F, width) if head is not None
                           else (D * 4 + width * (D * 4 + 1), F * (D * 4 + 1)))
    evaluation, tables = evaluation_bytes(rows, per_text, per_video), table_bytes(store)
    if needs + evaluation + tables <= budget:
        return DataPlan(False, needs, budget, budget_source, evaluation, tables, widths=widths)
    each = pair_bytes(store, widths.get("train", 0))
    chunk = store.group["videos/frames"].chunks[0]
    buffer = int(max(0, budget - evaluation - tables) * BUFFER_SHARE) // each
    block = block_size(chunk, max(buffer, 1))
    if buffer < batch + block:
        raise ConfigError(
            f"--memory-budget {gb(budget)}: the splits of {store.dir} need {gb(needs)} in memory; evaluating the "
            f"validation or test split holds {gb(evaluation)} and the store's tables {gb(tables)}, and streaming the "
            f"training split beside them needs a shuffle buffer of at least a batch and a read block "
            f"({batch + block} pairs of {each:,} bytes: {gb(evaluation + tables + (batch + block) * each / BUFFER_SHARE)}"
            f" of budget in all); give a larger --memory-budget or a smaller --batch-size")
    return DataPlan(True, needs, budget, budget_source, evaluation, tables, buffer, block, widths)


BLOCKS_IN_BUFFER = 16  # a full buffer mixes at least this many read blocks


def block_size(chunk: int, buffer: int) -> int:
    """Videos per read block: as many whole store chunks (``chunk`` videos each) as fit in 1/16 of the shuffle
    buffer, so each block is read in few calls and a full buffer mixes at least 16 blocks; part of one chunk
    when a chunk is larger than that."""
    share = max(1, buffer // BLOCKS_IN_BUFFER)
    return chunk * (share // chunk) if share >= chunk else share


class StoreSplit(SplitBatches):
    """A split read from the store when it is used: :class:`~tvrpipe.training.data.SplitData`'s batches without
    holding its arrays (a streamed run's validation and test splits, and its training split's queries for QB-Norm).
    Batches are read as the in-memory split would make them (same rows, same token width), so evaluation gives
    the same numbers either way."""

    def __init__(self, store: FeatureStore, name: str, video_rows: np.ndarray, text_rows: np.ndarray,
                 width: int | None = None) -> None:
        self.store, self.name = store, name
        self.video_rows, self.text_rows = np.sort(video_rows), np.sort(text_rows)
        self.text_video = text_columns(store, name, self.video_rows, self.text_rows)
        self.video_ids = store.videos["video_id"].to_numpy()[self.video_rows]
        self.caption_ids = store.texts["caption_id"].to_numpy()[self.text_rows]
        self._width = width  # the split's real token columns where already known (a plan's), else read on use

    @property
    def n_videos(self) -> int:
        return len(self.video_rows)

    @property
    def n_texts(self) -> int:
        return len(self.text_rows)

    @property
    def width(self) -> int:
        """The split's real token columns (read once, on first use)."""
        if self._width is None:
            self._width = split_width(self.store, self.text_rows)
        return self._width

    def text_batch(self, idx: np.ndarray, tokens: bool = True, trim: bool = False) -> TextBatch:
        """As :meth:`SplitData.text_batch`."""
        rows = self.text_rows[np.asarray(idx)]
        sentence = as_float32(self.store.read("texts/sentence", rows))
        if not tokens:
            return TextBatch.of_sentences(sentence)
        mask = self.store.read("texts/token_mask", rows, self.width)
        length = real_width(mask) if trim else mask.shape[1]
        tok = self.store.read("texts/tokens", rows, length)
        return TextBatch(as_float32(tok), torch.from_numpy(np.ascontiguousarray(mask[:, :length])),
                         sentence)

    def video_batch(self, idx: np.ndarray) -> VideoBatch:
        """As :meth:`SplitData.video_batch`."""
        rows = self.video_rows[np.asarray(idx)]
        return VideoBatch(as_float32(self.store.read("videos/frames", rows)),
                          torch.from_numpy(self.store.read("videos/frame_mask", rows)))


def open_splits(store: FeatureStore, rows: SplitRows, plan: DataPlan, uses_tokens: bool) -> Splits:
    """The train, validation and test splits as ``plan`` reads them: loaded (:func:`load_split`) or
    :class:`StoreSplit`."""
    if not plan.streamed:
        return Splits(*(load_split(store, name, rows, tokens=uses_tokens) for name in SPLITS),
                      val_source=rows.val_source)
    return Splits(*(StoreSplit(store, name, getattr(rows, f"{name}_videos"), getattr(rows, f"{name}_texts"),
                               plan.widths.get(name)) for name in SPLITS), val_source=rows.val_source)


class InMemoryPairs:
    """An in-memory split's epochs of (video columns, caption rows, texts, videos): :class:`CaptionPairs`'
    permutation, batches cut from the loaded arrays."""

    def __init__(self, split: SplitData, uses_tokens: bool) -> None:
        self.split, self.uses_tokens = split, uses_tokens
        self.pairs = CaptionPairs(split.text_video, split.n_videos)

    def epoch(self, seed: int, epoch: int, steps: int, batch: int) -> Iterator[tuple]:
        for vids, caps in self.pairs.epoch(seed, epoch, steps, batch):
            yield (vids, caps, self.split.text_batch(caps, self.uses_tokens, trim=True),
                   self.split.video_batch(vids))


class StreamedPairs:
    """A streamed split's epochs: blocks of videos in a random order into a shuffle buffer, batches drawn from it.

    Args:
        split: the training split (its rows).
        plan: the buffer and block sizes (:func:`plan_data`).
        uses_tokens: read the captions' word tokens.
    """

    def __init__(self, split: StoreSplit, plan: DataPlan, uses_tokens: bool) -> None:
        self.split, self.uses_tokens = split, uses_tokens
        self.buffer, self.block = plan.buffer_videos, plan.block_videos
        self.pairs = CaptionPairs(split.text_video, split.n_videos)
        self.seen_videos, self.seen_texts = np.zeros(split.n_videos, bool), np.zeros(split.n_texts, bool)
        chunk = split.store.group["videos/frames"].chunks[0]
        rows = split.video_rows
        # a block: the split's videos of whole consecutive store chunks (or of part of one), at most ``block``
        span = self.block if self.block % chunk == 0 else chunk
        cut = np.flatnonzero(np.diff(rows // span) != 0) + 1
        self.blocks = [piece for part in np.split(np.arange(len(rows)), cut)
                       for piece in np.array_split(part, -(-len(part) // self.block))]

    def _read(self, vids: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """The pairs of split videos ``vids`` (one block), each with a random caption."""
        p, s = self.pairs, self.split
        caps = p.by_video[p.first[vids] + (rng.random(len(vids)) * p.counts[vids]).astype(np.int64)]
        video_rows, text_rows = s.video_rows[vids], s.text_rows[caps]
        got = {"vid": vids, "cap": caps, "frames": self._checked("videos/frames", video_rows, vids, self.seen_videos),
               "frame_mask": s.store.read("videos/frame_mask", video_rows),
               "sentence": self._checked("texts/sentence", text_rows, caps, self.seen_texts)}
        if self.uses_tokens:
            got["token_mask"] = s.store.read("texts/token_mask", text_rows, s.width)
            got["tokens"] = self._checked("texts/tokens", text_rows, caps, self.seen_texts, s.width)
        self.seen_videos[vids] = True
        self.seen_texts[caps] = True
        return got

    def _checked(self, name: str, rows: np.ndarray, cols: np.ndarray, seen: np.ndarray,
                 width: int | None = None) -> np.ndarray:
        """Rows ``rows`` of ``name``, those not read before in this run checked finite (a row's bytes do not
        change between epochs; checking them again every epoch cost a tenth of a streamed batch)."""
        data = self.split.store.read(name, rows, width, check=False)
        new = ~seen[cols]
        if new.any():
            self.split.store.check_finite(name, data[new], rows[new])
        return data

    def epoch(self, seed: int, epoch: int, steps: int, batch: int) -> Iterator[tuple]:
        """``steps`` batches of ``batch`` pairs: (video columns, caption rows, TextBatch, VideoBatch)."""
        rng = np.random.default_rng([seed, epoch])
        order = iter(rng.permutation(len(self.blocks)))
        buf: dict[str, np.ndarray] = {}
        fill = 0
        for _ in range(steps):
            while fill < self.buffer and (b := next(order, None)) is not None:
                got = self._read(self.blocks[b], rng)
                if not buf:  # the buffer's arrays, once: a full buffer and one block more
                    buf = {k: np.empty((self.buffer + self.block, *v.shape[1:]), v.dtype) for k, v in got.items()}
                n = len(got["vid"])
                for k, v in got.items():
                    buf[k][fill : fill + n] = v
                fill += n
            if fill < batch:
                return  # the split's last videos: fewer than a batch (an in-memory epoch drops them too)
            pick = np.sort(rng.choice(fill, batch, replace=False))
            out = {k: v[pick] for k, v in buf.items()}
            # the buffer's last ``batch`` slots move into the picked ones that lie below them
            tail = np.setdiff1d(np.arange(fill - batch, fill), pick)
            holes = pick[pick < fill - batch]
            for v in buf.values():
                v[holes] = v[tail]
            fill -= batch
            yield out["vid"], out["cap"], self._batch(out), VideoBatch(as_float32(out["frames"]),
                                                                       torch.from_numpy(out["frame_mask"]))

    def _batch(self, out: dict[str, np.ndarray]) -> TextBatch:
        sentence = as_float32(out["sentence"])
        if not self.uses_tokens:
            return TextBatch.of_sentences(sentence)
        length = real_width(out["token_mask"])  # the batch's real columns, as an in-memory batch is trimmed
        return TextBatch(as_float32(out["tokens"][:, :length]),
                         torch.from_numpy(np.ascontiguousarray(out["token_mask"][:, :length])), sentence)
