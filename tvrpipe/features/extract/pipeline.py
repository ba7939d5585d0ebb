"""The encoding of one run (:class:`Pipeline`): the loop that drives an executor's decoders and encoders and
writes whole shards, with the caption shards fed in between, and the decodes sent while the encoders load the
weights (:func:`decode_early`).

An encoder call's videos are fixed by the plan alone: the rows to do of one shard, in store order, cut into
calls of ``videos_per_call`` (:func:`encode_calls`). A video's features therefore never depend on which
decoder finished first, on the executor (:mod:`~tvrpipe.features.extract.executor`), or on where a run was
interrupted (a shard is redone whole): the same manifest and options give the same bytes. A CPU's float32
matmuls may round a row differently in a batch of other size or neighbours; fixed calls leave them nothing
to differ on."""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.errors import NonFiniteError
from tvrpipe.features.arrays import nonfinite_rows
from tvrpipe.features.extract.config import ExtractConfig, ExtractSummary, check_weights
from tvrpipe.features.extract.executor import Executor
from tvrpipe.features.extract.plan import Plan, decode_groups, progress_display, rows_for, video_items
from tvrpipe.features.store import STORE_NAME, Shard, StoreWriter
from tvrpipe.features.weights import guess_image_size


class _ShardBuffer:
    """Collects rows that arrive in any order; yields a shard's arrays once all its rows are in.

    A shard being retried (``partial``: shard index -> the number of its rows being redone)
    starts from its stored arrays, read by ``load`` when its first row arrives (so at most the
    shards in flight are in memory), and waits only for its retried rows.
    """

    def __init__(self, shards, width: dict[str, tuple[tuple[int, ...], Any]],
                 partial: dict[int, int] | None = None, load=None) -> None:
        self.of_row = {}
        for s in shards:
            for r in range(s.start, s.stop):
                self.of_row[r] = s
        self.width = width
        self.partial, self.load = partial or {}, load
        self.filled: dict[int, int] = Counter()
        self.data: dict[int, dict[str, np.ndarray]] = {}

    def add(self, row: int, values: dict[str, Any]) -> Any:
        s = self.of_row[row]
        n = s.stop - s.start
        if s.index not in self.data:
            if s.index in self.partial:
                self.data[s.index] = self.load(s)
                self.filled[s.index] = n - self.partial[s.index]
            else:
                self.data[s.index] = {k: np.full((n, *shape), fill, dtype=np.asarray(fill).dtype if dt is None else dt)
                                      for k, (shape, fill, dt) in self.width.items()}
        for k, v in values.items():
            self.data[s.index][k][row - s.start] = v
        self.filled[s.index] += 1
        if self.filled[s.index] == n:
            return s, self.data.pop(s.index)
        return None


class _TextFeed:
    """Caption shards sent to the encoders and written as their features come back, while the videos
    decode. At most two shards per encoder are in flight: finished ones wait (in Ray's object store, or
    in this process) until written, and a video batch queues behind no more than two shards."""

    def __init__(self, writer, texts: pd.DataFrame, shards: list[Shard], executor: Executor, max_words: int, bar,
                 summary: ExtractSummary) -> None:
        self.writer, self.executor, self.max_words, self.bar, self.summary = writer, executor, max_words, bar, summary
        self.text = texts["text"].astype(str).to_numpy()
        self.caption_ids = texts["caption_id"].to_numpy()
        self.todo = list(reversed(shards))  # popped from the end: in order
        self.flight: dict[Any, Shard] = {}
        self.turn = 0
        self.task = bar.add_task("texts", total=sum(s.stop - s.start for s in shards), rate="") if shards else None
        self.t0 = time.perf_counter()

    def send(self) -> None:
        """Send shards to the encoders, in turn, up to the limit."""
        while self.todo and len(self.flight) < 2 * self.executor.encoders:
            s = self.todo.pop()
            k = self.turn % self.executor.encoders
            self.turn += 1
            self.flight[self.executor.encode_texts(k, self.text[s.start:s.stop].tolist(), self.max_words)] = s

    def take(self, ref) -> None:
        """Write the shard whose features ``ref`` (one of :attr:`flight`, finished) holds."""
        self._write(self.flight.pop(ref), self.executor.result(ref))

    def finish(self) -> None:
        """Send and write every shard left."""
        self.send()
        while self.flight:
            self.take(self.executor.wait(list(self.flight))[0])
            self.send()

    def _write(self, s: Shard, d: dict[str, np.ndarray]) -> None:
        check_weights(d, self.writer.provenance, "text")
        bad = np.flatnonzero(nonfinite_rows(d["tokens"]) | nonfinite_rows(d["sentence"]))
        if len(bad):  # never stored as if it were a feature; the shard stays pending
            caps = self.caption_ids[s.start + bad]
            raise NonFiniteError(
                f"the text encoder returned NaN or infinity for captions {', '.join(map(str, caps[:5]))}"
                f" ({len(bad)} in {s}); with --device cuda try --device cpu (fp16 overflow)"
            )
        self.writer.write_texts(s, d["tokens"], d["token_mask"], d["sentence"])
        self.summary.encode_seconds += float(d.get("encode_s", 0.0))
        self.summary.texts_done += s.stop - s.start
        self.bar.update(self.task, advance=s.stop - s.start,
                        rate=f"{self.summary.texts_done / (time.perf_counter() - self.t0):.0f} texts/s")


def encode_calls(jobs: list[tuple[Shard, np.ndarray | None]], per_call: int) -> list[np.ndarray]:
    """The encoder calls of a plan's video jobs: each shard's rows to do, in store order, cut into runs of
    ``per_call`` (a shard's last call may hold fewer). Decided by the plan alone, never by timing.

    Example:
        >>> jobs = [(Shard("videos", 0, 0, 5), None), (Shard("videos", 1, 5, 10), np.array([6, 9]))]
        >>> [c.tolist() for c in encode_calls(jobs, 2)]
        [[0, 1], [2, 3], [4], [6, 9]]
    """
    calls = []
    for s, rows in jobs:
        todo = np.arange(s.start, s.stop) if rows is None else np.sort(np.asarray(rows))
        calls += [todo[i : i + per_call] for i in range(0, len(todo), per_call)]
    return calls


@dataclass
class Early:
    """Decodes sent before the weights' facts are known: ``refs`` maps each call's first handle to (decoder, its
    rows, the handles of its videos)."""

    image_size: int
    refs: dict[Any, tuple[int, tuple[int, ...], list]]


def decode_early(executor: Executor, cfg: ExtractConfig, out: Path, videos: pd.DataFrame, root: Path,
                 F: int, by_file: bool = False) -> Early | None:
    """Send the decoders as many videos as the first two calls per encoder hold (two per decoder at least)
    while the encoders load the weights, seconds in which the decoders would wait: only for a new store,
    where every row is to do, and only when the image size can be read from the architecture's file
    (checked against the encoder's report; if they differ, these decodes are dropped)."""
    size = guess_image_size(cfg.model)
    fresh = cfg.overwrite or not (out / STORE_NAME / "zarr.json").is_file()
    if size is None or not fresh or len(videos) == 0:
        return None
    # as many as the first calls hold: the cores a loading encoder leaves idle decode them
    n = min(len(videos), max(2 * executor.decoders, 2 * cfg.videos_per_call(F) * executor.encoders))
    groups = decode_groups(video_items(videos.iloc[:n].assign(row=np.arange(n)), root), by_file)
    # a CPU encoder imports torch and loads the weights on one core: one decoder fewer leaves it that core (on 2
    # cores its load took 1.5x longer beside two busy decoders), and the decoders still decode on the others
    share = executor.decoders - 1 if cfg.device == "cpu" and executor.decoders > 1 else executor.decoders
    refs = {}
    for i, group in enumerate(groups):  # by_file: a file's moments as one call, as the pipeline sends them
        k = i % share
        sent = executor.decode(k, group, F, size)
        refs[sent[0]] = (k, tuple(item["row"] for item in group), sent)
    return Early(size, refs)


@dataclass
class Pipeline:
    """One run's encoding: the executor, the store's writer, the summary it counts into, and what the manifest
    gives (videos, captions, the video root, F, L) as its state; :meth:`run` encodes a :class:`Plan`'s
    captions and videos and writes their shards, with the progress bars and the caption feed it opens.

    Every decoder has two calls in flight (one decoding, the next waiting), sent in store order. A decoded
    video waits until every video of its encoder call (:func:`encode_calls`) is decoded; the call then goes
    to the encoder with the fewest in flight (two at most each, so an encoder never waits for the hand-over).
    Decoded videos waiting for an encoder are capped at two calls per encoder: the frames are the memory.
    """

    writer: StoreWriter  # where the rows go; its provenance gives D and the weights' sha256
    executor: Executor
    summary: ExtractSummary  # counts what is encoded (texts, frames, the first batch)
    videos: pd.DataFrame  # the manifest's videos, in store order (video_id, path, start_s, end_s)
    texts: pd.DataFrame  # the manifest's captions, in store order (caption_id, text)
    root: Path  # the folder the videos' paths are relative to
    frames: int  # F
    max_words: int  # L
    image_size: int  # what the decoders resize and crop to: the encoders' model's
    videos_per_call: int  # decoded videos per encoder call
    first: Callable[[], None]  # called once, when the first videos come back encoded
    by_file: bool = False  # a collection: a file's moments are decoded together (plan.decode_groups)
    started: float = 0.0  # time.time() at the call's start: the first decoded frame's phase counts from it
    bar: Any = field(default=None, init=False)  # the progress bars, while :meth:`run` runs
    feed: _TextFeed | None = field(default=None, init=False)
    ids: np.ndarray = field(init=False)  # video_id by row, for the failures' records

    def __post_init__(self) -> None:
        self.ids = self.videos["video_id"].to_numpy()

    def run(self, plan: Plan, early: Early | None = None, progress: bool = True) -> int:
        """Decode and encode the rows of ``plan.jobs`` and write their shards, the caption shards of
        ``plan.texts`` in between; returns the videos processed. ``early``: decodes already sent
        (:func:`decode_early`); those of rows in the jobs are kept."""
        with progress_display(progress) as self.bar:
            self.feed = _TextFeed(self.writer, self.texts, plan.texts, self.executor, self.max_words,
                                  self.bar, self.summary)
            done = self._videos(plan, early) if plan.jobs else 0
            self.feed.finish()
        return done

    def _videos(self, plan: Plan, early: Early | None) -> int:
        ex, F, feed = self.executor, self.frames, self.feed
        rows = video_items(rows_for(plan.jobs, self.videos), self.root)
        task = self.bar.add_task("videos", total=len(rows), rate="")
        calls = encode_calls(plan.jobs, self.videos_per_call)
        call_of = {int(r): i for i, call in enumerate(calls) for r in call}
        missing = [len(call) for call in calls]  # videos of each call not decoded yet
        decoding: dict[Any, tuple[int, tuple[int, ...], list]] = {}  # first handle -> decoder, rows, handles
        decoded: dict[int, Any] = {}  # row -> its finished decode, until its call goes to an encoder
        ready: deque[int] = deque()  # calls whose every video is decoded, as they completed
        encoding: dict[Any, int] = {}  # handle -> its encoder
        if early is not None:
            decoding = {ref: call for ref, call in early.refs.items() if set(call[1]) <= call_of.keys()}
            sent = {row for _, done, _ in decoding.values() for row in done}
            rows = [item for item in rows if item["row"] not in sent]
        # a decoder call each, in store order: the calls' videos are decoded about together
        items = deque(sorted(decode_groups(rows, self.by_file), key=lambda group: min(i["row"] for i in group)))
        cap = 2 * self.videos_per_call * ex.encoders
        buf = _ShardBuffer([s for s, _ in plan.jobs],
                           {"emb": ((F, self.writer.provenance["embed_dim"]), 0, np.float16),
                            "mask": ((F,), False, bool), "timestamps": ((F,), np.nan, np.float32)},
                           partial={s.index: len(rows) for s, rows in plan.jobs if rows is not None},
                           load=lambda shard: plan.kept(self.writer, shard))
        failures: dict[int, list[tuple[int, dict[str, str]]]] = {}
        t0 = time.perf_counter()
        done = 0
        while items or decoding or decoded or encoding:
            # more decodes while the decoded videos are under the cap, or while none of them can go to an encoder
            while items and len(decoding) < 2 * ex.decoders and (len(decoded) < cap or not ready):
                k = _least_busy({ref: k for ref, (k, _, _) in decoding.items()}, ex.decoders)
                group = items.popleft()
                refs = ex.decode(k, group, F, self.image_size)
                decoding[refs[0]] = (k, tuple(item["row"] for item in group), refs)
            while ready and len(encoding) < 2 * ex.encoders:
                k = _least_busy(encoding, ex.encoders)
                encoding[ex.encode_videos(k, [decoded.pop(int(r)) for r in calls[ready.popleft()]])] = k
            feed.send()
            for ref in ex.wait([*decoding, *encoding, *feed.flight]):
                if ref in decoding:
                    _, call_rows, refs = decoding.pop(ref)  # the call's videos, all finished with its first
                    for row, handle in zip(call_rows, refs):
                        decoded[row] = handle
                        i = call_of[row]
                        missing[i] -= 1
                        if not missing[i]:
                            ready.append(i)
                elif ref in feed.flight:
                    feed.take(ref)
                else:
                    del encoding[ref]
                    batch = ex.result(ref)
                    self._write(batch, buf, failures)
                    done += len(batch["row"])
                    dt = time.perf_counter() - t0
                    rate = f"{done / dt:.1f} videos/s, {self.summary.frames_done / dt:.0f} frames/s"
                    self.bar.update(task, advance=len(batch["row"]), rate=rate)
        return done

    def _write(self, batch: dict[str, np.ndarray], buf: _ShardBuffer,
               failures: dict[int, list[tuple[int, dict[str, str]]]]) -> None:
        """Buffer an encoded batch's rows (``failures``: the failed ones' rows and records, by shard) and write
        each shard they complete, its failures in store order."""
        if not self.summary.first_videos:
            self.first()
            self.summary.first_videos = len(batch["row"])
        check_weights(batch, self.writer.provenance, "image")
        decoded = batch["mask"].any(axis=1)
        if decoded.any() and self.started:  # the first frame decoded, wherever its decoder ran
            first = float(np.min(batch["decoded_at"][decoded])) - self.started
            self.summary.phases["first_decode"] = min(self.summary.phases.get("first_decode", first), first)
        for i, row in enumerate(batch["row"]):
            row = int(row)
            err = str(batch["error"][i])
            shard = buf.of_row[row]
            if err:
                stage = "encode" if err.startswith("nonfinite") else "decode"
                failures.setdefault(shard.index, []).append(
                    (row, {"video_id": str(self.ids[row]), "stage": stage, "error": err}))
            full = buf.add(row, {"emb": batch["emb"][i], "mask": batch["mask"][i],
                                 "timestamps": batch["timestamps"][i]})
            if full:
                s, d = full
                records = [record for _, record in sorted(failures.pop(s.index, []), key=lambda f: f[0])]
                self.writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], records)
        self.summary.frames_done += int(batch["mask"].sum())
        self.summary.encode_seconds += float(batch.get("encode_s", 0.0))


def _least_busy(calls: dict[Any, int], actors: int) -> int:
    """The decoder or encoder (an index below ``actors``) with the fewest of ``calls`` (handle -> index) in flight."""
    load = Counter(calls.values())
    return min(range(actors), key=load.__getitem__)
