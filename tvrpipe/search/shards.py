"""The first stage of a search split over Ray actors: ``tvrpipe search`` and ``tvrpipe serve`` with ``--shards N
--address ADDRESS``.

The store's searchable videos (those with a decoded frame, told from the frame masks alone) are cut into N
contiguous runs of rows; each run is one Ray actor (:class:`ShardActor`) that reads the frames of its own rows
from the store, pools them as the one-index first stage does (:func:`~tvrpipe.features.export.pooled_embeddings`)
and builds the first stage over them (:mod:`tvrpipe.search.first_stages`), so no process holds every video's
embedding. A query batch goes to every shard, each answers its own top k (:meth:`FirstStage.top`), and the
driver merges them (:func:`merge_top`): by score, equal scores by store row, as the one index orders them. With an
exact first stage the merged top k is the one index's, hit for hit; an approximate one (HNSW, IVF-PQ) is built
per shard, over fewer videos, so its misses differ from the one index's (and ``hnsw_from``/``ivf_from`` compare a
shard's size, not the store's).

:class:`ShardedFirstStage` has the interface :func:`~tvrpipe.search.engine.two_stage` takes of a first stage
(``top``, ``rows``, ``len``): the head re-ranks the merged shortlist on the driver, as it does one index's. A
choice: the head's work is the shortlist's K videos per query batch, whatever the collection's size, and the
driver holds the head and the encoded queries already; the shards carry what grows with the collection (its
pooled embeddings and their index). Re-ranking on the shards would send the head and the queries' tokens to
every actor for the same scores.

Shards keep no index beside the store (``search-index/`` is the one index's): each actor pools its rows and
builds its index when it starts, which ``tvrpipe serve`` pays once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import FeatureStore, open_store
from tvrpipe.search.first_stages import first_stage_class, resolve_first_stage, stage_config
from tvrpipe.search.first_stages.base import Settings, StageConfig
from tvrpipe.search.index import FirstStage, searchable_rows

log = logging.getLogger(__name__)

LOCAL = "local"  # --address local: a Ray started in this process (cluster.ray_address)


def check_sharding(shards: int | None, address: str | None, candidates: int | None, index: Any = None) -> None:
    """``--shards`` and ``--address`` given together, ``--shards`` at least 1, with ``--candidates`` (the shards
    rank only the shortlist) and without ``--index`` (one folder this process reads): checked before anything is
    read or Ray is started.

    Raises:
        ConfigError: naming the option and what to give.
    """
    if shards is None and address is None:
        return
    if shards is None:
        raise ConfigError(f"--address {address}: the search runs on Ray only for a first stage split into shards; "
                          "give --shards N too, or leave out --address")
    if address is None:
        raise ConfigError(f"--shards {shards}: give --address too, the Ray cluster the shards run on (auto, "
                          f"HOST:PORT, or {LOCAL}: a Ray started in this process)")
    if shards < 1:
        raise ConfigError(f"--shards {shards}: split the first stage over at least 1 Ray actor")
    if index is not None:
        raise ConfigError(f"--index {index} is read whole by this process; leave out --shards to search it, or "
                          "--index to split the store's first stage over shards")
    if candidates is None:
        raise ConfigError(f"--shards {shards} splits the first stage, which ranks only with --candidates K: "
                          "without it the head scores every video in this process; give --candidates")


def shard_bounds(n: int, shards: int) -> np.ndarray:
    """Where each of ``shards`` contiguous parts of ``n`` positions starts, and ``n``: ``(shards + 1,)``, the
    parts' sizes differing by one at most."""
    return np.r_[0, np.cumsum([len(p) for p in np.array_split(np.arange(n), shards)])].astype(np.int64)


def merge_top(parts: list[tuple[np.ndarray, np.ndarray]], offsets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each shard's ``(positions into its rows (Q, k_i), scores (Q, k_i))``, best first, merged into the ``k`` best
    ``(positions into every shard's rows in turn (Q, k), scores (Q, k))``: by score, equal scores by position (the
    shards' rows are contiguous runs in row order, so by store row), as the exact first stage orders one index."""
    pos = np.concatenate([p.astype(np.int64) + o for (p, _), o in zip(parts, offsets)], axis=1)
    scores = np.concatenate([s for _, s in parts], axis=1)
    order = np.lexsort((pos, -scores), axis=1)[:, :k]  # score descending, then position ascending
    return np.take_along_axis(pos, order, 1), np.take_along_axis(scores, order, 1)


class ShardActor:
    """One shard, in a Ray actor: the pooled embeddings of its own rows of the store and the first stage over them.

    Args:
        features_dir: the store (a path every node reaches).
        rows: the store rows of this shard (sorted, each with a decoded frame).
        kind: the registered first stage (resolved by the driver).
        config: its settings.
    """

    def __init__(self, features_dir: str, rows: np.ndarray, kind: str, config: StageConfig) -> None:
        from tvrpipe.features.export import pooled_embeddings

        store = open_store(features_dir)
        pooled, has = pooled_embeddings(store, which=rows)
        if not has.all():  # the driver read the masks of another state of the store
            raise ConfigError(f"--features {features_dir} changed while its shards were built (an extract running?); "
                              "search again when it is done")
        self.stage = FirstStage(pooled, np.asarray(rows, np.int64), first_stage_class(kind).build(pooled, config))

    def describe(self) -> str:
        return self.stage.describe()

    def rows(self) -> np.ndarray:
        return self.stage.rows

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.stage.top(queries, k)


@dataclass
class ShardedFirstStage:
    """The first stage over Ray actors, one per contiguous run of the searchable videos; the interface of
    :class:`~tvrpipe.search.index.FirstStage` that the search uses (:meth:`top`, :attr:`rows`, ``len``).

    Attributes:
        actors: the shards' actor handles, in row order (the actors end when the last handle is dropped).
        rows: every shard's store rows in turn: the searchable videos, in row order (int64, 8 bytes a video).
        bounds: where each shard's positions start in ``rows``, and ``len(rows)``.
        description: the shards' first stage, in words (:meth:`describe`).
        address: the Ray cluster they run on, as given.
    """

    actors: list[Any]
    rows: np.ndarray
    bounds: np.ndarray
    description: str
    address: str

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def shards(self) -> int:
        return len(self.actors)

    def describe(self) -> str:
        sizes = np.diff(self.bounds)
        each = f"{sizes[0]:,}" if sizes.min() == sizes.max() else f"{sizes.min():,}-{sizes.max():,}"
        return f"{self.description}, in {self.shards} Ray shard{'s' * (self.shards > 1)} of {each} videos"

    def top_texts(self, texts: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`top` of a TextBatch's sentence embeddings (the shards hold pooled first stages alone)."""
        return self.top(texts.sentence.cpu().numpy(), k)

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best videos of each query over every shard: ``(positions into rows (Q, k), cosines (Q, k))``,
        best first; each shard ranks the batch at once, in parallel."""
        import ray

        q = np.ascontiguousarray(queries, np.float32)
        k = min(k, len(self))
        ref = ray.put(q)  # one copy in the object store, read by every shard
        parts = ray.get([a.top.remote(ref, k) for a in self.actors])
        return merge_top(parts, self.bounds[:-1], k)


def sharded_first_stage(store: FeatureStore, kind: str, settings: Settings | None, shards: int, address: str,
                        candidates: int) -> ShardedFirstStage:
    """The store's first stage ``kind`` with ``settings``, split over ``shards`` Ray actors on the cluster at
    ``address`` (``local``: a Ray started in this process), each building its part from the store.

    Raises:
        ConfigError: ``shards`` more than the searchable videos; ``candidates`` covering every searchable video (the
            head then scores them all here, and the shards would rank nothing); the address unreachable; a shard that
            could not be built (its reason).
    """
    import ray

    from tvrpipe.cluster import check_reachable, ray_init

    name = resolve_first_stage(kind)
    config = stage_config(name, settings)
    rows = searchable_rows(store)
    if not len(rows):
        raise ConfigError(f"--features {store.dir}: no video has a decoded frame, so there is nothing to search "
                          f"(see {Path(store.dir) / 'failures.parquet'})")
    if shards > len(rows):
        raise ConfigError(f"--shards {shards} is more than the {len(rows):,} searchable videos of --features "
                          f"{store.dir}; ask for at most {len(rows):,}")
    if candidates >= len(rows):
        raise ConfigError(f"--candidates {candidates} covers all {len(rows):,} searchable videos of --features "
                          f"{store.dir}: the head scores every one in this process and the shards would rank "
                          "nothing; leave out --shards, or give fewer --candidates")
    if address != LOCAL:  # also where this process joined Ray before (a server reopening its store)
        check_reachable(address)
    ray_init(address, data=False)
    bounds = shard_bounds(len(rows), shards)
    where = str(Path(store.dir).resolve())
    # no CPU held: a shard answers in bursts, and a server reopening its store holds two sets for a moment
    actor = ray.remote(ShardActor).options(num_cpus=0, scheduling_strategy="SPREAD")
    actors = [actor.remote(where, rows[a:b], name, config) for a, b in zip(bounds[:-1], bounds[1:])]
    try:
        described = ray.get([a.describe.remote() for a in actors])
    except ray.exceptions.RayError as e:
        raise ConfigError(f"--shards {shards}: a shard could not be built on the Ray cluster at {address} "
                          f"({_cause(e)})") from None
    log.info("first stage %s over %d Ray shards at %s", described[0], shards, address)
    return ShardedFirstStage(actors, rows, bounds, described[0], address)


def _cause(e: Exception) -> str:
    """The last line of what a Ray actor raised (its own error where Ray carries it), whitespace folded."""
    cause = getattr(e, "cause", None) or getattr(getattr(e, "error", None), "cause", None) or e
    lines = [ln for ln in str(cause).splitlines() if ln.strip()]
    return " ".join((lines[-1] if lines else type(cause).__name__).split())[:300]

