"""Feature-store splits as head batches: rows read once into float16 memory, batches cast on use.

A split's arrays are read chunk by chunk into float16 NumPy arrays (the store's dtype), so the
whole store is never copied to float32: only a batch is, when it becomes a
:class:`~tvrpipe.heads.base.TextBatch` / :class:`~tvrpipe.heads.base.VideoBatch`.

Validation: a store with a ``val`` split uses it. One without (MSR-VTT 9k, Charades) gets a
validation set carved from train deterministically (:func:`split_rows`: 10 % of the train videos,
at least 500 where that is at most 20 % of them, at most 1,000), chosen by a permutation seeded with a fixed seed independent of the
training seed, so runs with different seeds select on the same videos. Carved videos keep their
first caption as the query (like MSR-VTT's 1k-A test) and leave training. Which one was used is
recorded in the run's metrics.

Every embedding read is checked for NaN and infinity (a damaged chunk whose size is intact reads
as garbage floats): a non-finite row stops the run with an error naming the array, the rows, their
ids and the shard, before any training step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import FeatureStore
from tvrpipe.heads.base import TextBatch, VideoBatch

CARVE_SEED = 20240501  # fixed: the carved validation set does not depend on the training seed


def as_float32(a: np.ndarray) -> torch.Tensor:
    """A float16 array as a float32 tensor: cast by NumPy, which is several times faster at it than torch on
    the CPU (9.5 vs 1.1 ms for a batch of 128 x 12 x 512 frames on a 2-core machine); the values are the same."""
    return torch.from_numpy(a.astype(np.float32))


def real_width(token_mask: np.ndarray) -> int:
    """How many leading token columns hold a real token of some caption (at least 1): the columns
    after them are padding in every row of ``token_mask`` ``(n, L)``."""
    real = np.flatnonzero(token_mask.any(0))
    return max(int(real[-1]) + 1 if real.size else 0, 1)


class SplitBatches(ABC):
    """A split's evaluation batches, in order, from its ``text_batch`` / ``video_batch`` and its sizes: shared by
    the split in memory (:class:`SplitData`) and the split read from the store on use
    (:class:`~tvrpipe.training.stream.StoreSplit`), so both cut the same batches."""

    @property
    @abstractmethod
    def n_texts(self) -> int: ...

    @property
    @abstractmethod
    def n_videos(self) -> int: ...

    @abstractmethod
    def text_batch(self, idx: np.ndarray, tokens: bool = True, trim: bool = False) -> TextBatch: ...

    @abstractmethod
    def video_batch(self, idx: np.ndarray) -> VideoBatch: ...

    def text_batches(self, batch_size: int, tokens: bool = True) -> Iterator[TextBatch]:
        """Every caption once, in order."""
        for a in range(0, self.n_texts, batch_size):
            yield self.text_batch(np.arange(a, min(a + batch_size, self.n_texts)), tokens)

    def video_batches(self, batch_size: int) -> Iterator[VideoBatch]:
        """Every video once, in order."""
        for a in range(0, self.n_videos, batch_size):
            yield self.video_batch(np.arange(a, min(a + batch_size, self.n_videos)))


@dataclass
class SplitData(SplitBatches):
    """One split of a store in memory (float16), with each caption's video column.

    Attributes:
        name: split name (``train``, ``val``, ``test``; ``val`` may be carved from train).
        frames, frame_mask: videos of the split, ``(n_v, F, D)`` float16 and ``(n_v, F)``.
        tokens, token_mask, sentence: captions of the split; tokens and mask ``(n_t, L', ...)`` end
            with the split's last real token (L' <= the store's L, see :func:`real_width`); L' = 0
            for a split loaded without tokens (:func:`load_rows`).
        text_video: ``(n_t,)`` index into this split's videos of each caption's video.
        video_ids, caption_ids: ids, for reports.
    """

    name: str
    frames: np.ndarray
    frame_mask: np.ndarray
    tokens: np.ndarray
    token_mask: np.ndarray
    sentence: np.ndarray
    text_video: np.ndarray
    video_ids: np.ndarray
    caption_ids: np.ndarray

    @property
    def n_videos(self) -> int:
        return len(self.video_ids)

    @property
    def n_texts(self) -> int:
        return len(self.caption_ids)

    def text_batch(self, idx: np.ndarray, tokens: bool = True, trim: bool = False) -> TextBatch:
        """Captions ``idx`` as a float32 TextBatch (word tokens empty ``(B, 0, D)`` if not ``tokens``).

        With ``trim``, the token columns after the batch's last real token (padding in every caption)
        are left out, at least one column kept: a head gives the same result without them, since
        padding never enters its computation, and does less work (training batches; an evaluation
        concatenates batches, which must then share one length).
        """
        sentence = as_float32(self.sentence[idx])
        if not tokens:
            return TextBatch.of_sentences(sentence)
        if self.tokens.shape[1] == 0:  # a split loaded with tokens keeps at least one column
            raise ValueError(f"the {self.name} split was loaded without word tokens (load_split(..., "
                             "tokens=False)); load it with tokens for a head that reads them")
        mask_np = self.token_mask[idx]
        length = real_width(mask_np) if trim else mask_np.shape[1]
        tok = as_float32(self.tokens[idx, :length])
        mask = torch.from_numpy(np.ascontiguousarray(mask_np[:, :length]))
        return TextBatch(tokens=tok, token_mask=mask, sentence=sentence)

    def video_batch(self, idx: np.ndarray) -> VideoBatch:
        """Videos ``idx`` as a float32 VideoBatch."""
        return VideoBatch(frames=as_float32(self.frames[idx]),
                          frame_mask=torch.from_numpy(self.frame_mask[idx]))



def text_columns(store: FeatureStore, name: str, video_rows: np.ndarray, text_rows: np.ndarray) -> np.ndarray:
    """``(n_t,)``: each caption's column among ``video_rows`` (both sorted store rows of the split ``name``).

    Raises:
        ValueError: a caption whose video is not among ``video_rows``.
    """
    col = np.full(len(store.videos), -1, dtype=np.int64)
    col[video_rows] = np.arange(len(video_rows))
    text_video = col[store.texts["video_row"].to_numpy()[text_rows]]
    if (text_video < 0).any():
        raise ValueError(f"{store.dir}: caption row {text_rows[text_video < 0][0]} has its video outside the "
                         f"{name} rows")
    return text_video


def load_rows(store: FeatureStore, name: str, video_rows: np.ndarray, text_rows: np.ndarray,
              tokens: bool = True) -> SplitData:
    """The features of store rows ``video_rows`` and ``text_rows`` (every caption's video among them).

    With ``tokens`` False the word tokens are not read (a head with ``uses_tokens = False`` never
    sees them; at MSR-VTT 9k they are gigabytes): the split holds ``(n_t, 0, D)`` tokens and an
    ``(n_t, 0)`` mask, and :meth:`SplitData.text_batch` refuses to make token batches from it.

    Raises:
        NonFiniteError: a loaded feature is NaN or infinite.
    """
    video_rows, text_rows = np.sort(video_rows), np.sort(text_rows)
    text_video = text_columns(store, name, video_rows, text_rows)
    g = store.group
    # the token columns after the split's last real token are padding in every caption: not loaded
    # (padding never enters a head; SplitData.text_batch(trim=True) does the same per batch)
    reads = [("videos/frames", video_rows, None), ("videos/frame_mask", video_rows, None),
             ("texts/sentence", text_rows, None)]
    if tokens:
        mask = store.read("texts/token_mask", text_rows)
        width = real_width(mask)
        arrays = {"texts/token_mask": np.ascontiguousarray(mask[:, :width])}
        reads.append(("texts/tokens", text_rows, width))
    else:
        arrays = {"texts/token_mask": np.zeros((len(text_rows), 0), dtype=bool),
                  "texts/tokens": np.zeros((len(text_rows), 0, g["texts/tokens"].shape[-1]), np.float16)}
    for array, rows, cols in reads:
        arrays[array] = store.read(array, rows, cols)  # float arrays checked finite as they load
    return SplitData(
        name=name,
        frames=arrays["videos/frames"],
        frame_mask=arrays["videos/frame_mask"],
        tokens=arrays["texts/tokens"],
        token_mask=arrays["texts/token_mask"],
        sentence=arrays["texts/sentence"],
        text_video=text_video,
        video_ids=store.videos["video_id"].to_numpy()[video_rows],
        caption_ids=store.texts["caption_id"].to_numpy()[text_rows],
    )


@dataclass(frozen=True)
class Splits:
    """The train, validation and test splits of a store, and how validation was made."""

    train: SplitData
    val: SplitData
    test: SplitData
    val_source: str  # "val split" or "carved from train: N videos, first caption each"


@dataclass(frozen=True)
class SplitRows:
    """Row indices (into a store's or a manifest's video and caption tables) of each split."""

    train_videos: np.ndarray
    train_texts: np.ndarray
    val_videos: np.ndarray
    val_texts: np.ndarray
    test_videos: np.ndarray
    test_texts: np.ndarray
    val_source: str  # "val split" or "carved from train: N videos, first caption each"


def split_rows(
    video_split: np.ndarray, text_split: np.ndarray, text_video_row: np.ndarray, where: str,
    carve_fraction: float = 0.1, carve_max: int = 1000, need_test: bool = True, *, carve_floor: int = 500,
    carve_floor_fraction: float = 0.2,
) -> SplitRows:
    """The train / validation / test rows of a video table and its captions.

    The ``val`` split when there is one, else ``carve_fraction`` of the train videos, but at least
    ``carve_floor`` where that is no more than ``carve_floor_fraction`` of them (else that fraction),
    and at most ``carve_max``, chosen with :data:`CARVE_SEED`, keeping their first caption each: 900
    videos of MSR-VTT 9k, 400 of 2,000, 100 of 500. Why a floor: the paired noise of two scorers'
    R@1 on 200 validation videos is 3.0 points (sd), on 500 1.7 and on 900 1.2 (docs/training.md,
    ``scripts/paired_noise.py``), and the selection compares epochs a point or two apart. Shared by
    ``train-head`` (store rows) and ``finetune`` (manifest rows), so both select on the same videos.

    Args:
        video_split, text_split: ``train`` / ``val`` / ``test`` of each video and caption.
        text_video_row: the row of each caption's video.
        where: the store or manifest, for error messages.

    Raises:
        ConfigError: there are no captions, or a split the trainer needs is empty.
    """
    v_split, t_split, t_vrow = np.asarray(video_split), np.asarray(text_split), np.asarray(text_video_row)
    if len(t_split) == 0:  # a collection of one's own videos: searched with a head trained elsewhere
        raise ConfigError(f"{where} has no captions: a head is trained and evaluated on captioned videos; train on a "
                          "captioned benchmark, then search these videos with that run (`tvrpipe search`)")
    train_v = np.flatnonzero(v_split == "train")
    if len(train_v) < 2:
        raise ConfigError(f"{where}: the train split has {len(train_v)} videos; need at least 2")
    if (v_split == "val").any():
        val_v, val_t = np.flatnonzero(v_split == "val"), np.flatnonzero(t_split == "val")
        source = "val split"
    else:
        floor = min(carve_floor, int(round(carve_floor_fraction * len(train_v))))
        n = max(1, min(carve_max, max(int(round(carve_fraction * len(train_v))), floor)))
        if n >= len(train_v):
            raise ConfigError(f"{where}: too few train videos ({len(train_v)}) to carve a validation set")
        val_v = np.sort(np.random.default_rng(CARVE_SEED).permutation(train_v)[:n])
        in_val = np.isin(t_vrow, val_v) & (t_split == "train")
        first = np.unique(t_vrow[in_val], return_index=True)[1]
        val_t = np.flatnonzero(in_val)[first]
        train_v = np.setdiff1d(train_v, val_v)
        source = f"carved from train: {n} videos, first caption each (seed {CARVE_SEED})"
    train_t = np.flatnonzero((t_split == "train") & np.isin(t_vrow, train_v))
    test_v, test_t = np.flatnonzero(v_split == "test"), np.flatnonzero(t_split == "test")
    if need_test and len(test_v) == 0:
        raise ConfigError(f"{where}: there is no test split")
    return SplitRows(train_v, train_t, val_v, val_t, test_v, test_t, source)


def check_captioned(store: FeatureStore) -> None:
    """Raise :class:`ConfigError` for a store without captions (a collection of one's own videos): a head
    trains and is evaluated on captioned videos; such a store is searched with a head trained elsewhere."""
    if len(store.texts) == 0:
        raise ConfigError(
            f"{store.dir} has no captions (a collection of videos, nothing to train or evaluate a head on): train a "
            f"head on a captioned benchmark, then search this store with it: `tvrpipe search \"...\" --run RUN "
            f"--features {store.dir}`")


def store_split_rows(
    store: FeatureStore, carve_fraction: float = 0.1, carve_max: int = 1000, need_test: bool = True
) -> SplitRows:
    """:func:`split_rows` of a feature store's tables.

    Raises:
        ConfigError: the store has no captions (:func:`check_captioned`), or a split the trainer needs is empty.
    """
    check_captioned(store)
    return split_rows(store.videos["split"].to_numpy(), store.texts["split"].to_numpy(),
                      store.texts["video_row"].to_numpy(), str(store.dir), carve_fraction, carve_max, need_test=need_test)


def load_split(
    store: FeatureStore, split: str, rows: SplitRows | None = None, text_subset: np.ndarray | None = None,
    tokens: bool = True,
) -> SplitData:
    """Load one split (``train``, ``val`` or ``test``) and nothing else: evaluating on test needs no
    train features, which at MSR-VTT scale are gigabytes of word tokens.

    Args:
        store: the feature store.
        split: which split.
        rows: the store's :func:`store_split_rows` (computed when None).
        text_subset: positions among the split's captions to load (default: all of them).
        tokens: load the word tokens (False for a head that reads only the sentence, see
            :func:`load_rows`).

    Raises:
        ConfigError: ``split`` is not a split; the store has no train split, or no test split and
            ``split`` is test.
    """
    if split not in ("train", "val", "test"):
        raise ConfigError(f"split must be train, val or test, got {split!r}")
    rows = rows or store_split_rows(store, need_test=split == "test")
    texts = getattr(rows, f"{split}_texts")
    return load_rows(store, split, getattr(rows, f"{split}_videos"),
                     texts if text_subset is None else np.sort(texts)[text_subset], tokens)


def load_splits(
    store: FeatureStore, carve_fraction: float = 0.1, carve_max: int = 1000, need_test: bool = True,
    tokens: bool = True,
) -> Splits:
    """Load train, validation (the store's or carved from train) and test splits; ``tokens`` as in
    :func:`load_split`.

    Raises:
        ConfigError: a split the trainer needs is empty.
    """
    rows = store_split_rows(store, carve_fraction, carve_max, need_test)
    return Splits(*(load_split(store, name, rows, tokens=tokens) for name in ("train", "val", "test")),
                  val_source=rows.val_source)


class CaptionPairs:
    """The (video, caption) pairs of ``train-head``'s epochs: an epoch visits every training video once,
    in a random order, each with one of its captions drawn at random (no video twice in a batch, so
    InfoNCE has no false negatives). The draws depend only on (seed, epoch): a resumed run draws the same.

    Args:
        text_video: each caption's video row.
        n_videos: the videos of the split.
    """

    def __init__(self, text_video: np.ndarray, n_videos: int) -> None:
        self.n_videos = n_videos
        self.by_video = np.argsort(text_video, kind="stable")  # caption rows grouped by video
        self.counts = np.bincount(text_video, minlength=n_videos)
        self.first = np.cumsum(self.counts) - self.counts  # where each video's captions start in by_video

    def epoch(self, seed: int, epoch: int, steps: int, batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``steps`` batches of (video rows, caption rows), ``batch`` pairs each."""
        rng = np.random.default_rng([seed, epoch])
        order = rng.permutation(self.n_videos)
        for s in range(steps):
            vids = order[s * batch : (s + 1) * batch]
            yield vids, self.by_video[self.first[vids] + (rng.random(len(vids)) * self.counts[vids]).astype(np.int64)]
