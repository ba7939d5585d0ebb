"""The encoding of one run (:class:`Pipeline`): the loop that drives the decoders and encoders and writes
whole shards, with the caption shards fed in between."""

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
from tvrpipe.features.extract.actors import Early, Workers
from tvrpipe.features.extract.config import ExtractSummary, check_weights
from tvrpipe.features.extract.plan import (
    Plan,
    decode_groups,
    progress_display,
    rows_for,
    send_decode,
    video_items,
)
from tvrpipe.features.store import Shard, StoreWriter


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
    decode. At most two shards per encoder are in flight: finished ones wait in Ray's object store
    until written, and a video batch queues behind no more than two shards."""

    def __init__(self, writer, texts: pd.DataFrame, shards: list[Shard], encoders: list, max_words: int, bar,
                 summary: ExtractSummary) -> None:
        self.writer, self.encoders, self.max_words, self.bar, self.summary = writer, encoders, max_words, bar, summary
        self.text = texts["text"].astype(str).to_numpy()
        self.caption_ids = texts["caption_id"].to_numpy()
        self.todo = list(reversed(shards))  # popped from the end: in order
        self.flight: dict[Any, Shard] = {}
        self.turn = 0
        self.task = bar.add_task("texts", total=sum(s.stop - s.start for s in shards), rate="") if shards else None
        self.t0 = time.perf_counter()

    def send(self) -> None:
        """Send shards to the encoders, in turn, up to the limit."""
        while self.todo and len(self.flight) < 2 * len(self.encoders):
            s = self.todo.pop()
            encoder = self.encoders[self.turn % len(self.encoders)]
            self.turn += 1
            self.flight[encoder.encode_texts.remote(self.text[s.start:s.stop].tolist(), self.max_words)] = s

    def take(self, ref) -> None:
        """Write the shard whose features ``ref`` (one of :attr:`flight`, finished) holds."""
        import ray

        self._write(self.flight.pop(ref), ray.get(ref))

    def finish(self) -> None:
        """Send and write every shard left."""
        import ray

        self.send()
        while self.flight:
            ready, _ = ray.wait(list(self.flight), num_returns=1)
            self.take(ready[0])
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
        self.summary.texts_done += s.stop - s.start
        self.bar.update(self.task, advance=s.stop - s.start,
                        rate=f"{self.summary.texts_done / (time.perf_counter() - self.t0):.0f} texts/s")


@dataclass
class Pipeline:
    """One run's encoding: the actors, the store's writer, the summary it counts into, and what the manifest
    gives (videos, captions, the video root, F, L) as its state; :meth:`run` encodes a :class:`Plan`'s
    captions and videos and writes their shards, with the progress bars and the caption feed it opens.

    Every decoder has two videos in flight (one decoding, the next waiting). A decoded video stays in
    Ray's object store until ``videos_per_call`` of them go to an encoder as one call (the frames pass
    from decoder to encoder, never through this process); each encoder has up to two batches in
    flight, so it never waits for the hand-over. An encoder with nothing to do gets what is decoded
    without waiting for a whole batch (the first videos are encoded while the next decode). Decoded
    videos waiting for an encoder are capped at two batches per encoder: the frames are the memory.
    """

    writer: StoreWriter  # where the rows go; its provenance gives D and the weights' sha256
    workers: Workers
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
    bar: Any = field(default=None, init=False)  # the progress bars, while :meth:`run` runs
    feed: _TextFeed | None = field(default=None, init=False)
    ids: np.ndarray = field(init=False)  # video_id by row, for the failures' records

    def __post_init__(self) -> None:
        self.ids = self.videos["video_id"].to_numpy()

    def run(self, plan: Plan, early: Early | None = None, progress: bool = True) -> int:
        """Decode and encode the rows of ``plan.jobs`` and write their shards, the caption shards of
        ``plan.texts`` in between; returns the videos processed. ``early``: decodes already sent
        (:func:`~tvrpipe.features.extract.actors.decode_early`); those of rows in the jobs are kept."""
        with progress_display(progress) as self.bar:
            self.feed = _TextFeed(self.writer, self.texts, plan.texts, self.workers.encoders, self.max_words,
                                  self.bar, self.summary)
            done = self._videos(plan, early) if plan.jobs else 0
            self.feed.finish()
        return done

    def _videos(self, plan: Plan, early: Early | None) -> int:
        import ray

        B, F, feed = self.videos_per_call, self.frames, self.feed
        rows = video_items(rows_for(plan.jobs, self.videos), self.root)
        task = self.bar.add_task("videos", total=len(rows), rate="")
        decoders, encoders = self.workers.decoders, self.workers.encoders
        decoding: dict[Any, tuple[int, list]] = {}  # a call's first ref -> its decoder, and the refs of its videos
        encoding: dict[Any, int] = {}  # ref -> its encoder
        decoded: list = []  # refs of decoded videos, in the order they finished
        if early is not None:
            todo = {item["row"] for item in rows}
            kept = {ref: call for ref, call in early.refs.items() if set(call[1]) <= todo}
            decoding = {ref: (k, refs) for ref, (k, _, refs) in kept.items()}
            sent = {row for _, done, _ in kept.values() for row in done}
            rows = [item for item in rows if item["row"] not in sent]
        items = deque(decode_groups(rows, self.by_file))  # a decoder call each

        buf = _ShardBuffer([s for s, _ in plan.jobs],
                           {"emb": ((F, self.writer.provenance["embed_dim"]), 0, np.float16),
                            "mask": ((F,), False, bool), "timestamps": ((F,), np.nan, np.float32)},
                           partial={s.index: len(rows) for s, rows in plan.jobs if rows is not None},
                           load=lambda shard: plan.kept(self.writer, shard))
        failures: dict[int, list[dict[str, str]]] = {}
        t0 = time.perf_counter()
        done = 0
        while items or decoding or decoded or encoding:
            while items and len(decoding) < 2 * len(decoders) and len(decoded) < 2 * B * len(encoders):
                k = _least_busy({ref: k for ref, (k, _) in decoding.items()}, len(decoders))
                refs = send_decode(decoders[k], items.popleft(), F, self.image_size)
                decoding[refs[0]] = (k, refs)
            last = not items and not decoding  # nothing more will be decoded: a short batch goes too
            # a whole batch, the last one, or what is decoded for an encoder that has nothing to do
            while decoded and len(encoding) < 2 * len(encoders) and (
                    len(decoded) >= B or last or len(set(encoding.values())) < len(encoders)):
                k = _least_busy(encoding, len(encoders))
                encoding[encoders[k].encode_videos.remote(*decoded[:B])] = k
                del decoded[:B]
            feed.send()
            ready, _ = ray.wait([*decoding, *encoding, *feed.flight], num_returns=1)
            for ref in ready:
                if ref in decoding:
                    decoded += decoding.pop(ref)[1]  # the call's videos, all finished with its first
                elif ref in feed.flight:
                    feed.take(ref)
                else:
                    del encoding[ref]
                    batch = ray.get(ref)
                    self._write(batch, buf, failures)
                    done += len(batch["row"])
                    dt = time.perf_counter() - t0
                    rate = f"{done / dt:.1f} videos/s, {self.summary.frames_done / dt:.0f} frames/s"
                    self.bar.update(task, advance=len(batch["row"]), rate=rate)
        return done

    def _write(self, batch: dict[str, np.ndarray], buf: _ShardBuffer,
               failures: dict[int, list[dict[str, str]]]) -> None:
        """Buffer an encoded batch's rows (``failures``: the failed ones' records, by shard) and write each
        shard they complete."""
        if not self.summary.first_videos:
            self.first()
            self.summary.first_videos = len(batch["row"])
        check_weights(batch, self.writer.provenance, "image")
        for i, row in enumerate(batch["row"]):
            row = int(row)
            err = str(batch["error"][i])
            shard = buf.of_row[row]
            if err:
                stage = "encode" if err.startswith("nonfinite") else "decode"
                failures.setdefault(shard.index, []).append(
                    {"video_id": str(self.ids[row]), "stage": stage, "error": err})
            full = buf.add(row, {"emb": batch["emb"][i], "mask": batch["mask"][i],
                                 "timestamps": batch["timestamps"][i]})
            if full:
                s, d = full
                self.writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], failures.pop(s.index, []))
        self.summary.frames_done += int(batch["mask"].sum())


def _least_busy(calls: dict[Any, int], actors: int) -> int:
    """The actor (an index below ``actors``) with the fewest of ``calls`` (ref -> actor) in flight."""
    load = Counter(calls.values())
    return min(range(actors), key=load.__getitem__)

