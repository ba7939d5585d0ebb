"""The run's head's encoding of every searchable video, kept beside the store: a search reads it instead of the
frames, so the head's per-video work is done once, not once a query.

A head's score is ``similarity(encode_texts(t), encode_videos(v))``. Where ``encode_videos`` is heavy and the same
for every query (ProTA's and UATVR's transformer over frames: 2-3 ms a video on 2 cores), it is most of a
re-ranking's time: ProTA re-ranking 200 candidates spends 95 % of its second encoding them. Kept here, a search
reads the candidates' encodings (every entry of the head's video encoding, in its dtype) from the files
(:func:`_gather`), and only the sentence's side and the pair scores are left to compute. The ranking is the
head's own (up to float rounding): the same encodings, computed once.

    <store>/search-encoded/<key>/
      <entry>.npy    one per entry of the head's video encoding, ``(n, ...)``: the searchable videos'
      rows.npy       int64 (n,): their rows in the store, sorted
      encoded.json   what it was built from (the store's key, the run, its checkpoint's sha256, the head), each
                     entry's shape and dtype, the bytes a video and the build's cost

``key`` hashes the store's key (:func:`tvrpipe.search.index.store_key`) and the checkpoint's sha256: a store
extracted again or another run builds anew. Building it costs one pass of the head over every video (what one
exhaustive search costs) and its size is the head's encoding, not the frames': ProTA's is 53 kB a video at
F = 12, D = 512 (5.3 GB at 100,000 videos), UATVR's 35 kB; so it is worth keeping for a head whose video side is
heavy, and not for one whose encoding is its frames (X-Pool, DUQ, T-MASS, token-wise: larger than the frames and
no faster). docs/search.md has the measured figures.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tvrpipe.errors import ConfigError, WriteError
from tvrpipe.features.store import FeatureStore
from tvrpipe.files import DISK_SPARE, NpyWriter, atomic_replace_folder, file_sha256, free_disk, gb
from tvrpipe.heads.base import Head
from tvrpipe.search.batches import video_batch
from tvrpipe.search.index import check_searchable, finish_kept, searchable_rows, store_key

log = logging.getLogger(__name__)

ENCODED_DIR = "search-encoded"
_BLOCK = 256  # videos encoded at a time (ProTA: 14 MB of encodings a block)


@dataclass
class EncodedVideos:
    """A head's encodings of a store's searchable videos.

    Attributes:
        rows: their store rows, sorted.
        entries: each entry of the head's video encoding, ``(len(rows), ...)`` (memory maps where kept).
        record: what they were built from and what building them cost (``encoded.json``).
    """

    rows: np.ndarray
    entries: dict[str, np.ndarray]
    record: dict

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, rows: np.ndarray, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The encodings of store rows ``rows`` (each a searchable video), in their order, as ``encode_videos``
        returns them."""
        pos = np.searchsorted(self.rows, rows)
        if len(rows) and (pos.max() >= len(self.rows) or not np.array_equal(self.rows[pos], rows)):
            raise ValueError("rows outside the encoded videos")
        return {k: torch.from_numpy(_gather(v, pos)).to(device) for k, v in self.entries.items()}


def _gather(array: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``array[pos]`` as a new array. A kept entry (a memory map) is read from its file, one read per run of
    consecutive positions, rather than through the map: a page the map touches counts in the process's resident
    memory, and the kernel maps pages around it too (measured: 6,000 random rows of ProTA's 5.3 GB of encodings,
    0.32 GB of data, left 4.9 GB resident through the map and 0.35 GB read from the file, in the same time)."""
    if not isinstance(array, np.memmap) or array.filename is None:
        return np.ascontiguousarray(array[pos])
    out = np.empty((len(pos), *array.shape[1:]), array.dtype)
    if not len(pos) or not out.nbytes:
        return out
    per = out[0].nbytes
    flat = memoryview(out.reshape(-1).view(np.uint8))
    starts = np.flatnonzero(np.diff(pos, prepend=-2) != 1)  # each run of consecutive positions
    ends = np.append(starts[1:], len(pos))
    with open(array.filename, "rb", buffering=0) as f:
        for a, b in zip(starts.tolist(), ends.tolist()):
            f.seek(array.offset + int(pos[a]) * per)
            done, want = a * per, b * per
            while done < want:  # a read may return less than asked (2 GB at most on Linux)
                got = f.readinto(flat[done:want])
                if not got:
                    raise OSError(f"{array.filename}: shorter than its header says")
                done += got
    return out


def encoded_folder(store: FeatureStore, skey: str, checkpoint_sha: str) -> Path:
    """Where the encodings of ``store`` (its state: ``skey``, :func:`~tvrpipe.search.index.store_key`, read
    once by the caller: a fifth of a second at a million videos) by the head of ``checkpoint_sha`` are kept."""
    ident = {"store": skey, "checkpoint": checkpoint_sha}
    return Path(store.dir) / ENCODED_DIR / hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def read_encodings(store: FeatureStore, skey: str, checkpoint_sha: str) -> EncodedVideos | None:
    """The encodings kept for this store state (``skey``) and checkpoint (sha256), or None where there are none
    whole; nothing is encoded."""
    return _load(encoded_folder(store, skey, checkpoint_sha))


def head_encodings(store: FeatureStore, head: Head, run: str | os.PathLike[str], progress: bool = False,
                   rebuild: bool = False) -> EncodedVideos:
    """``run``'s ``head``'s encodings of every searchable video of ``store``: read from ``<store>/search-encoded/``
    where they were kept for this store state and checkpoint, else encoded and kept there. ``rebuild``: encoded
    anew even where kept (a bench timing it).

    Raises:
        ConfigError: no video of ``store`` has a decoded frame; the disk under the store cannot hold the
            encodings (checked before any is written: their size is a block's times the videos); they cannot be
            written there (a read-only store), or read back.
    """
    from tvrpipe.rundir import BEST, CHECKPOINTS

    run = Path(run)
    sha = file_sha256(run / CHECKPOINTS / BEST)
    skey = store_key(store)
    folder = encoded_folder(store, skey, sha)
    kept = None if rebuild else _load(folder)
    if kept is not None:
        return kept
    t0 = time.perf_counter()
    rows = searchable_rows(store)
    check_searchable(store, rows)
    first = _encode(head, store, rows[:_BLOCK])
    per_video = sum(v[0].nbytes for v in first.values())
    meta = {"store_key": skey, "run": str(run.resolve()), "checkpoint_sha256": sha, "method": head.name,
            "entries": {k: {"shape": list(v.shape[1:]), "dtype": str(v.dtype)} for k, v in first.items()},
            "bytes_per_video": per_video}
    _check_disk(folder, per_video * len(rows), head.name, len(rows))

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        with contextlib.ExitStack() as files:
            out = {k: files.enter_context(NpyWriter(tmp / f"{k}.npy", v.dtype, (len(rows), *v.shape[1:])))
                   for k, v in first.items()}
            _fill(head, store, rows, out, first, progress)
        finish_kept(tmp, rows, "encoded.json", meta, t0)

    # encodings that cannot be kept are refused, not held for this search alone: every video encoded for one
    # search is more work than the candidates' frames it would otherwise encode
    try:
        atomic_replace_folder(folder, write)
    except (OSError, WriteError) as e:
        raise ConfigError(f"--encoded-videos: {head.name}'s encodings are kept beside the store, and {e}; search "
                          f"without --encoded-videos, or extract the store where you can write") from e
    kept = _load(folder)
    if kept is None:
        raise ConfigError(f"--encoded-videos: {folder} was written but cannot be read back; search without "
                          f"--encoded-videos, or remove it and search again")
    return kept


@torch.inference_mode()
def _encode(head: Head, store: FeatureStore, rows: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v.cpu().numpy() for k, v in head.encode_videos(video_batch(store, rows)).items()}


def _fill(head: Head, store: FeatureStore, rows: np.ndarray, out: dict[str, NpyWriter],
          first: dict[str, np.ndarray], progress: bool) -> None:
    """``out`` gets the encodings of ``rows``, a block at a time (``first``: the first block's, already made)."""
    from tvrpipe.progress import progress_bar

    with progress_bar(enabled=progress, transient=True) as bar:
        task = bar.add_task(f"{head.name}: encoding {len(rows):,} videos once, for every search", total=len(rows))
        for a in range(0, len(rows), _BLOCK):
            block = first if a == 0 else _encode(head, store, rows[a : a + _BLOCK])
            for k, v in out.items():
                if block[k].shape[1:] != v.shape[1:]:  # an encoding cut to its batch's longest video
                    raise ConfigError(f"{head.name}'s video encoding {k!r} has shape {block[k].shape[1:]} for "
                                      f"videos {a:,}-{a + len(block[k]) - 1:,} and {v.shape[1:]} for the first "
                                      f"ones: it depends on the batch, so it cannot be kept; search without "
                                      f"--encoded-videos")
                v[a : a + len(block[k])] = block[k]
            bar.advance(task, len(block[next(iter(block))]))


def _check_disk(folder: Path, need: int, method: str, n: int) -> None:
    free = free_disk(folder)
    if need > free - DISK_SPARE:
        raise ConfigError(f"--encoded-videos: {method}'s encodings of {n:,} videos take {gb(need)} and the disk of "
                          f"{folder.parent.parent} has {gb(free)} free; search without --encoded-videos (the head "
                          f"then encodes each query's candidates), or free room")


def _load(folder: Path) -> EncodedVideos | None:
    """The kept encodings in ``folder``, or None where there are none whole (encoded again then)."""
    try:
        meta = json.loads((folder / "encoded.json").read_text())
        rows = np.load(folder / "rows.npy")
        entries = {k: np.load(folder / f"{k}.npy", mmap_mode="r") for k in meta["entries"]}
    except (OSError, ValueError, KeyError) as e:
        if folder.exists():
            log.warning("%s: the encoded videos cannot be read (%s); encoding them again", folder, e)
        return None
    if any(len(v) != len(rows) for v in entries.values()):
        return None
    return EncodedVideos(rows, entries, meta)
