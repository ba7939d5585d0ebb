"""``tvrpipe bench search``: the two stages of ``tvrpipe search`` against exhaustive head scoring, at the scale of
a real collection.

What runs:

1. **Two generated stores of one latent world** (:mod:`tvrpipe.worlds.features`; their :class:`GenSpec`
   differ only in the split sizes, so the concepts, subspaces, styles and scales are the same): the
   *collection*, ``videos`` videos (default 100,000; 12 frames, 32 words, D = 512 as ViT-B/32), one caption
   each, and a small *benchmark*, ``train_videos`` captioned train videos (5 captions each) and a test split
   of a quarter of that. Two stores, not one: ``fit`` evaluates the selected epoch on its store's test split
   once, which for a 100,000-video split is 10^10 (caption, video) pairs.
2. **Every head trained** on the benchmark as ``tvrpipe train-head`` trains it by default (``fit``: until
   validation stops improving; with ``train_epochs``, that many epochs of warmup then cosine; runs kept in
   ``<out>/runs`` and reused on a rerun): an untrained or undertrained head ranks worse than zero-shot CLIP,
   and the K it needs says nothing about the K a trained head needs.
3. **Queries**: ``queries`` captions of the collection drawn at random (seeded); neither they nor their
   videos were trained on. They are searched as one batch, as ``tvrpipe search --queries FILE`` does, over
   every video of the collection.
4. **The first stage** (:mod:`tvrpipe.search.index`, any of :mod:`tvrpipe.search.first_stages`) is built
   afresh from the collection and kept in ``<collection>/search-index/``; its build time (pooling every
   video's frames, and its index) is reported apart from the arms. The default, ``distilled``, is fitted to
   each head after its training (:mod:`tvrpipe.search.distilled`; its build time, size and peak per head),
   and the exact pooled first stage (zero-shot CLIP) is built too: its figures alone, and per head the recall
   its shortlists would have given.
5. **Per head, each arm in a fresh process**: the exhaustive search (the head scores every video,
   :func:`~tvrpipe.search.engine.exhaustive`) and the two stages at each K of ``candidates``
   (:func:`~tvrpipe.search.engine.two_stage`: the first stage's K best per query, re-ranked by the head).
   The process loads the head, the queries and (for the two stages) the first stage from its cache, runs one
   small warm-up search, then times the arm on all queries: **qps** = queries / wall seconds, first stage
   included. **Memory**: the kernel's high-water mark of the resident set (``VmHWM``), reset through
   ``/proc/self/clear_refs`` just before the arm, so ``peak`` is the process's resident peak during the arm
   (Python, torch, the head, the queries and, for the two stages, the first stage's embeddings or index
   included) and ``extra`` that peak minus the resident set just before the arm (what the search itself
   adds). Where the peak cannot be reset (not Linux), ``peak`` is the process's and ``extra`` is None.

Reported: per head and arm qps, peak and extra memory, the videos the head encoded (the exhaustive: all; the
two stages: the union of the queries' shortlists), **recall@10**: ``|two-stage top 10 & exhaustive top 10| /
10`` averaged over the queries, the smallest K whose recall reaches :data:`TARGET_RECALL` (None where no K
measured does), and the R@1 / R@10 of each query's own video (in %); for the first stage alone, its R@1 /
R@10 and the share of queries whose video is in its top K (the ceiling of the two stages' R@K), and for an
approximate first stage the overlap of its top K with the exact top K.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from tvrpipe.bench.room import Needs, check_room, stores_needs
from tvrpipe.errors import ConfigError, RunError
from tvrpipe.worlds.features import CALIBRATED, GenSpec, generate_store

log = logging.getLogger(__name__)

TOP = 10  # the hits compared: the "two-stage top 10 against the exhaustive top 10"
TARGET_RECALL = 0.95
CANDIDATES = (50, 100, 200, 500, 1000, 2000)  # K: the first stage's shortlist per query
FRAMES = 12  # F: ViT-B/32 extraction's default
WORDS = 32  # L: CLIP4Clip's max_words
CAPTIONS_PER_TRAIN_VIDEO = 5  # GenSpec's default; MSR-VTT has 20, which only slows generation here
QUERY_POOL = 10_000  # the collection's captioned videos, among which the queries are drawn (more when more are asked)
WARMUP_VIDEOS = 64  # videos of the warm-up search before each timed arm


@dataclass
class SearchRow:
    """One head's search by one arm, over the bench's queries.

    Attributes:
        method: the head.
        candidates: K, the first stage's shortlist per query; None: the exhaustive search.
        seconds: wall time of the search of every query (as one batch), first stage included.
        qps: queries / seconds.
        peak_gb: the arm's process's resident peak during the arm (GiB).
        extra_gb: that peak minus the resident set just before the arm (GiB); None where the peak could not be
            reset (it is then the process's).
        encoded: the distinct videos the head encoded (all of them; or the union of the shortlists).
        recall: recall@10 against the exhaustive top 10, mean over the queries the exhaustive search ran (1.0
            for the exhaustive).
        r1, r10: R@1 and R@10 of each query's own video, in % (over the queries the arm searched).
        p50_ms, p95_ms: the two stages' latency of one query searched alone (the interactive case), median
            and 95th percentile over the latency queries, in ms; None for the exhaustive search.
    """

    method: str
    candidates: int | None
    seconds: float
    qps: float
    peak_gb: float
    extra_gb: float | None
    encoded: int
    recall: float
    r1: float
    r10: float
    p50_ms: float | None = None
    p95_ms: float | None = None


@dataclass
class SearchBench:
    """One bench's measurements: the setting, the first stage, each head's training and its rows."""

    videos: int
    queries: int
    dim: int
    frames: int
    words: int
    candidates: list[int]
    first_stage: str  # what ran: the first stage's own description (exact, or its index and settings)
    index_seconds: float  # building the first stage from the store (pooling, and its index)
    index_peak_gb: float  # the resident peak of the process that built it (a fresh one)
    first_stage_seconds: float  # the first stage alone, top max(K) for every query (one batch)
    first_stage_r1: float  # zero-shot CLIP (mean-pooled) R@1 / R@10 of each query's video, in %
    first_stage_r10: float
    first_stage_hit: dict[int, float]  # K -> share of queries whose video is in the first stage's top K
    first_stage_exact: dict[int, float] | None  # approximate first stages: K -> mean |top K & exact top K| / K
    train_videos: int
    train_epochs: int | None  # None: until validation stopped improving (train-head's default)
    # method -> {"test_R@1", "seconds", "run", "epochs_run", "selected_epoch"}
    trained: dict[str, dict] = field(default_factory=dict)
    rows: list[SearchRow] = field(default_factory=list)
    # a head-aware first stage: method -> K -> the recall the pooled exact first stage would have given
    zero_shot_recall: dict[str, dict[int, float]] = field(default_factory=dict)
    exhaustive_queries: int = 0  # the queries the exhaustive search ran (a sample at a large collection)
    latency_queries: int = 0  # the queries each two-stage arm also searched one at a time
    cpus: int = 0
    threads: int = 0
    encoded_videos: bool = False  # the heads read their encodings kept beside the collection, not the frames

    def methods(self) -> list[str]:
        return list(dict.fromkeys(r.method for r in self.rows))

    def row(self, method: str, candidates: int | None) -> SearchRow:
        return next(r for r in self.rows if r.method == method and r.candidates == candidates)

    def recall(self, method: str) -> dict[int, float]:
        """K -> recall@10 of the two stages against the exhaustive search."""
        return {r.candidates: r.recall for r in self.rows if r.method == method and r.candidates is not None}

    def k_reaching(self, method: str, target: float = TARGET_RECALL) -> int | None:
        """The smallest K measured whose recall@10 reaches ``target`` (None: none does)."""
        return next((k for k, r in sorted(self.recall(method).items()) if r >= target), None)

    def record(self) -> dict:
        """The measurements as JSON-ready data (``results.json``, ``--json``), with the K reaching the target."""
        return {**asdict(self), "k_reaching": {m: self.k_reaching(m) for m in self.methods()}}

    def training(self) -> str:
        """How the heads trained, for people: ``5 epochs``, or ``until validation stopped improving``."""
        if self.train_epochs is not None:
            return f"{self.train_epochs} epochs"
        return "until validation stopped improving"

    def lines(self) -> list[str]:
        """The setting, the first stage and, per head, the K reaching the target and what it buys."""
        out = [
            f"{self.videos:,} generated videos (F = {self.frames}, L = {self.words}, D = {self.dim}), "
            f"{self.queries} held-out queries searched as one batch (exhaustively: {self.exhaustive_queries} of "
            f"them), {self.latency_queries} also one at a time; heads trained {self.training()} on "
            f"{self.train_videos:,} videos of the same world; {self.cpus} CPUs, {self.threads} torch threads",
            f"first stage: {self.first_stage}, built in {self.index_seconds:.1f} s (peak {self.index_peak_gb:.2f} "
            f"GB); alone "
            f"{self.queries / self.first_stage_seconds:,.0f} qps for its top {max(self.candidates)}; zero-shot "
            f"R@1 {self.first_stage_r1:.1f} %, R@10 {self.first_stage_r10:.1f} %; query's video in its top K: "
            + ", ".join(f"K={k} {100 * v:.0f} %" for k, v in self.first_stage_hit.items()),
        ]
        if self.first_stage_exact is not None:
            out.append("first stage against the exact top K: "
                       + ", ".join(f"K={k} {v:.3f}" for k, v in self.first_stage_exact.items()))
        for m in self.methods():
            k = self.k_reaching(m)
            ex = self.row(m, None)
            t = self.trained.get(m)
            if t is not None:
                out.append(f"{m}: trained {t['epochs_run']} epochs (selected {t['selected_epoch']}), benchmark test "
                           f"R@1 {t['test_R@1']:.1f} %")
            if t is not None and "first_stage" in t:
                fs = t["first_stage"]
                how = ("every video encoded by the head" if fs["fit"] is None else
                       f"fit {fs['fit']['seconds']:.1f} s on {fs['fit']['head_pairs']:,} head scores")
                if fs.get("from_encodings"):
                    how += ", its vectors read from the head's kept encodings"
                out.append(f"{m}: its first stage ({fs['describe']}) built in {fs['seconds']:.1f} s ({how}), "
                           f"{fs['bytes'] / 2**20:,.1f} MiB on disk, peak {fs['peak_gb']:.2f} GB")
            if t is not None and "encoded" in t:
                e = t["encoded"]
                out.append(f"{m}: every video encoded once in {e['seconds']:.1f} s, kept: {e['bytes'] / 1e9:,.2f} GB "
                           f"({e['bytes_per_video'] / 1e3:,.1f} kB a video), peak {e['peak_gb']:.2f} GB; its searches "
                           f"read those encodings, not the frames")
            if m in self.zero_shot_recall:
                out.append(f"{m}: recall@10 with its first stage's / the zero-shot pooled shortlist: " + ", ".join(
                    f"K={kk} {self.recall(m).get(kk, float('nan')):.3f} / {v:.3f}"
                    for kk, v in self.zero_shot_recall[m].items()))
            if k is None:
                out.append(f"{m}: no K measured reaches recall@10 {TARGET_RECALL} (best "
                           f"{max(self.recall(m).values()):.3f} at K = {max(self.recall(m))})")
                continue
            two = self.row(m, k)
            alone = "" if two.p50_ms is None else f"; one query alone p50 {two.p50_ms:,.0f} ms, p95 {two.p95_ms:,.0f} ms"
            out.append(f"{m}: K = {k} reaches recall@10 {two.recall:.3f}: {two.qps / ex.qps:,.1f}x the exhaustive "
                       f"qps ({two.qps:,.2f} vs {ex.qps:,.2f}), peak {two.peak_gb:.2f} vs {ex.peak_gb:.2f} GB, "
                       f"R@1 {two.r1:.1f} vs {ex.r1:.1f} %{alone}")
        return out


# ------------------------------------------------------------------------------------------------ stores


def collection_spec(videos: int, dim: int, frames: int = FRAMES, words: int = WORDS, seed: int = 0,
                    captioned: int = QUERY_POOL) -> GenSpec:
    """The searched collection: ``videos`` test videos in the calibrated world (real CLIP's statistics,
    multi-scene videos, partial captions, near-duplicates); the first ``captioned`` of them have one caption
    each, from which the queries are drawn. The rest are gallery videos alone: their captions would be most of
    the store (at a million videos of D = 512, 32 of 44 GB) and no search reads them."""
    return GenSpec(train_videos=0, val_videos=0, test_videos=videos, captions_per_test_video=1,
                   captioned_test_videos=None if captioned >= videos else captioned, frames=frames,
                   max_words=words, embed_dim=dim, seed=seed, **CALIBRATED)


def benchmark_spec(collection: GenSpec, train_videos: int) -> GenSpec:
    """The heads' training benchmark: the collection's world (every field but the split sizes), with
    ``train_videos`` train videos and a test split of a quarter of that (at most 1,000)."""
    return replace(collection, train_videos=train_videos, test_videos=max(2, min(1000, train_videos // 4)),
                   captions_per_train_video=CAPTIONS_PER_TRAIN_VIDEO, captioned_test_videos=None)


def _text_rows(texts, a: int, b: int):
    """Queries ``a`` to ``b`` of a TextBatch."""
    from tvrpipe.heads.base import TextBatch

    return TextBatch(texts.tokens[a:b], texts.token_mask[a:b], texts.sentence[a:b])


# ------------------------------------------------------------------------------------------ memory


def _proc_status(key: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def _reset_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    try:
        return _proc_status("VmHWM")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class _Arm:
    store: str
    checkpoint: str
    query_rows: np.ndarray
    rows: np.ndarray  # the searchable videos' store rows (the first stage's)
    candidates: int | None
    first_stage: str
    settings: tuple[str, ...] = ()  # the first stage's --first-stage-set items
    latency: int = 0  # the two stages: the first queries also searched one at a time, each timed
    run: str = ""  # the head's run: a distilled first stage is fitted to it
    encoded: bool = False  # the head reads its encodings kept beside the collection, not the frames


def _arm(job: _Arm) -> dict:
    """One arm in this (fresh) process: load, warm up, reset the memory peak, search every query as one batch,
    time it; then the first ``latency`` queries one at a time (the two stages), each timed."""
    import torch

    from tvrpipe.features.store import open_store
    from tvrpipe.rundir import load_head
    from tvrpipe.search.batches import text_batch
    from tvrpipe.search.encoded import head_encodings
    from tvrpipe.search.engine import exhaustive, first_stage_for, keeps_first_stage, two_stage

    torch.set_num_threads(os.cpu_count() or 1)
    store = open_store(job.store)
    head = load_head(job.checkpoint).eval()
    texts = text_batch(store, job.query_rows)
    stage = (first_stage_for(store, job.first_stage, job.settings, head, job.run or None)
             if job.candidates is not None else None)
    encoded = head_encodings(store, head, job.run) if job.encoded else None  # kept by the bench's build

    def search(t, rows=job.rows):
        if stage is None:
            return exhaustive(head, t, store, rows, TOP, encoded=encoded)
        return two_stage(head, t, store, stage, TOP, job.candidates, encoded=encoded)

    if stage is None:
        search(_text_rows(texts, 0, 2), job.rows[:WARMUP_VIDEOS])
    else:
        two_stage(head, _text_rows(texts, 0, 2), store, stage, TOP, min(job.candidates, WARMUP_VIDEOS),
                  encoded=encoded)
    gc.collect()
    reset = _reset_peak()
    before = _proc_status("VmRSS") if reset else None
    t = time.perf_counter()
    ranked = search(texts)
    seconds = time.perf_counter() - t
    alone = []
    for i in range(min(job.latency, len(texts)) if stage is not None else 0):
        t = time.perf_counter()
        search(_text_rows(texts, i, i + 1))
        alone.append(time.perf_counter() - t)
    peak = _peak_bytes()
    if stage is None:
        encoded = len(job.rows)
    elif keeps_first_stage(head, stage):  # the first stage's scores are kept: no video is encoded
        encoded = 0
    else:
        encoded = len(np.unique(stage.top_texts(texts, ranked.candidates)[0]))
    return {"seconds": seconds, "peak": peak, "extra": None if before is None else peak - before,
            "rows": ranked.rows, "encoded": int(encoded), "threads": torch.get_num_threads(), "alone": alone}


@dataclass(frozen=True)
class _Build:
    store: str
    first_stage: str
    settings: tuple[str, ...]
    run: str = ""  # a distilled first stage's run


def _build(job: _Build) -> dict:
    """The first stage built afresh from the store in this (fresh) process and kept beside it: its build time
    (pooling every video's frames, and its index; a distilled one's fit too), the process's resident peak and,
    for a distilled one, its record and its files' size."""
    from tvrpipe.features.store import open_store
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.search.distilled import head_stage
    from tvrpipe.search.first_stages import resolve_first_stage, stage_config
    from tvrpipe.search.index import INDEX_DIR, first_stage

    store = open_store(job.store)
    if job.run:
        head = load_head(Path(job.run) / CHECKPOINTS / BEST).eval()
        name = resolve_first_stage(job.first_stage, head)
        config = stage_config(name, job.settings)
        t = time.perf_counter()
        stage = head_stage(store, head, job.run, name, config, rebuild=True)  # this head's only: others kept
        return {"seconds": time.perf_counter() - t, "peak": _peak_bytes(), "describe": stage.describe(),
                "fit": stage.record["fit"], "bytes": stage.record["bytes"],
                "from_encodings": stage.record.get("from_encodings", False)}
    shutil.rmtree(Path(job.store) / INDEX_DIR, ignore_errors=True)
    t = time.perf_counter()
    stage = first_stage(store, job.first_stage, cache=True, settings=job.settings)
    return {"seconds": time.perf_counter() - t, "peak": _peak_bytes(), "describe": stage.describe()}


def _encode(job: _Arm) -> dict:
    """The head's encodings of every searchable video, made afresh in this (fresh) process and kept beside the
    collection for the arms: their time, the process's resident peak and their size on disk."""
    from tvrpipe.features.store import open_store
    from tvrpipe.rundir import load_head
    from tvrpipe.search.encoded import head_encodings

    store = open_store(job.store)
    head = load_head(job.checkpoint).eval()
    t = time.perf_counter()
    enc = head_encodings(store, head, job.run, rebuild=True)
    return {"seconds": time.perf_counter() - t, "peak_gb": _peak_bytes() / 2**30, "bytes": enc.record["bytes"],
            "bytes_per_video": enc.record["bytes_per_video"]}


# ------------------------------------------------------------------------------------------ training


def bench_run_dir(out: Path, bench_dir: Path, method: str, epochs: int | None) -> Path:
    """Where the search benches keep ``method``'s run on the benchmark ``bench_dir``: one per schedule, reused."""
    return out / "runs" / bench_dir.name / (f"{method}-open" if epochs is None else f"{method}-{epochs}ep")


def trained_run(store_dir: Path, method: str, run_dir: Path, epochs: int | None) -> dict:
    """Train ``method`` on the benchmark (``epochs`` None: until validation stops improving, as train-head;
    a finished run with the same settings is reused); its record."""
    from tvrpipe.rundir import RunResults, read_config, read_metrics
    from tvrpipe.training.fit import fit
    from tvrpipe.training.settings import TrainConfig

    cfg = TrainConfig(epochs=epochs, seed=0)
    m = read_metrics(run_dir) if (run_dir / "config.yaml").is_file() else None
    done = read_config(run_dir) if m is not None else {}
    # a finished run of the same settings is reused as it is (fit would test it again)
    if m is None or done.get("method") != method or (done.get("train") or {}).get("epochs") != epochs:
        try:  # an interrupted run resumes
            m = fit(store_dir, method, run_dir, cfg, progress=False)
        except (ConfigError, RunError) as e:  # trained under another configuration, or damaged: from scratch
            log.warning("%s: not resumed (%s); training it from scratch", run_dir, e)
            shutil.rmtree(run_dir, ignore_errors=True)
            m = fit(store_dir, method, run_dir, cfg, progress=False)
    results = RunResults.from_dict(m)
    return {"test_R@1": results.test.get("raw", "t2v")["R@1"], "seconds": m["train"]["seconds"],
            "epochs_run": m["schedule"]["epochs_run"], "selected_epoch": m["selected_epoch"], "run": str(run_dir)}


# ------------------------------------------------------------------------------------------ the bench


def search_needs(out: Path, coll_spec: GenSpec, bench_spec: GenSpec | None, stores: tuple[str, str]) -> Needs:
    """The search benches' plan: the collection and the benchmark (``stores``: their folder names under
    ``out/stores``; no benchmark spec: none), the first stage's files beside the collection (float32 mean-pooled
    embeddings, an index of the same size, its graph or lists), and in memory the embeddings, the index and a
    copy being built, or a store's generation."""
    videos, dim = coll_spec.train_videos + coll_spec.val_videos + coll_spec.test_videos, coll_spec.embed_dim
    specs = {out / "stores" / stores[0]: coll_spec, **({out / "stores" / stores[1]: bench_spec} if bench_spec else {})}
    index = videos * (dim * 4 * 2 + 256)
    return stores_needs(specs) + Needs(disk=index, memory=3 * videos * dim * 4, disk_what="the first stage's index",
                                       memory_what="the collection's embeddings and its index")


def check_training(train_videos: int, train_epochs: int | None, dim: int) -> None:
    """The options of the generated benchmark the heads train on (``--train-videos``, ``--train-epochs``,
    ``--dim``), as the search benches share them.

    Raises:
        ConfigError: naming the option.
    """
    if train_videos < 16:
        raise ConfigError(f"--train-videos {train_videos}: at least 16 (a validation set is carved from them)")
    if train_epochs is not None and train_epochs < 1:
        raise ConfigError(f"--train-epochs {train_epochs}: at least 1 (leave it out to train until validation stops "
                          f"improving)")
    if dim < 1:
        raise ConfigError(f"--dim {dim}: at least 1")


def _check(videos: int, queries: int, candidates: Sequence[int], train_videos: int, train_epochs: int | None,
           dim: int, exhaustive_queries: int | None = None, latency_queries: int = 0) -> list[int]:
    if videos < TOP:
        raise ConfigError(f"--videos {videos}: the collection needs at least {TOP} videos (the top {TOP} is compared)")
    if not 1 <= queries <= videos:
        raise ConfigError(f"--queries {queries}: between 1 and --videos ({videos})")
    if exhaustive_queries is not None and not 1 <= exhaustive_queries <= queries:
        raise ConfigError(f"--exhaustive-queries {exhaustive_queries}: between 1 and --queries ({queries})")
    if not 0 <= latency_queries <= queries:
        raise ConfigError(f"--latency-queries {latency_queries}: between 0 and --queries ({queries})")
    ks = sorted(set(int(k) for k in candidates))
    if not ks:
        raise ConfigError("--candidates: give at least one K")
    if ks[0] < TOP or ks[-1] > videos:
        raise ConfigError(f"--candidates {ks[0] if ks[0] < TOP else ks[-1]}: each K must be between {TOP} (the hits "
                          f"compared) and --videos ({videos})")
    check_training(train_videos, train_epochs, dim)
    return ks


def bench_search(
    out_dir: str | os.PathLike[str],
    videos: int = 100_000,
    queries: int = 64,
    candidates: Sequence[int] = CANDIDATES,
    methods: list[str] | None = None,
    first_stage: str = "head",
    first_stage_settings: Sequence[str] = (),
    train_videos: int = 2000,
    train_epochs: int | None = None,
    dim: int = 512,
    seed: int = 0,
    progress: bool = True,
    exhaustive_queries: int | None = None,
    latency_queries: int = 16,
    encoded_videos: bool = False,
) -> SearchBench:
    """Generate (once) the collection and the benchmark, train every head (once), then measure each head's
    exhaustive search and its two stages at each K, each in a fresh process; ``<out>/results.json`` gets
    the result.

    Args:
        out_dir: working directory: ``stores/`` (generated once, reused), ``runs/`` (reused), ``results.json``.
        videos: videos of the searched collection.
        queries: held-out captions searched (one batch); the exhaustive arm's cost grows with them.
        candidates: the K measured (each between 10 and ``videos``).
        methods: heads (default: every registered head).
        first_stage: a registered first stage or ``auto``
            (:func:`~tvrpipe.search.first_stages.resolve_first_stage`); by default ``head``: each head's own
            (head-embedding, late-interaction or distilled, :func:`~tvrpipe.search.first_stages.first_stage_for_head`), and the two stages' recall with zero-shot CLIP's exact pooled shortlist is reported beside it.
        first_stage_settings: ``KEY=VALUE`` settings of the first stage (``--first-stage-set``, as search's);
            an unknown one fails before anything is generated.
        train_videos: captioned train videos of the heads' benchmark.
        train_epochs: epochs each head trains (warmup then cosine); None: until validation stops improving,
            as ``tvrpipe train-head`` trains by default.
        dim: D, the embedding width (ViT-B/32: 512).
        seed: the generated world and the draw of the queries.
        progress: progress bars.
        exhaustive_queries: the queries (drawn at random among ``queries``) the exhaustive search runs, and so
            those recall@10 averages over; None: all. At a million videos a head's exhaustive search costs
            minutes a query, so it runs on a sample.
        latency_queries: the first queries each two-stage arm also searches one at a time, each timed (p50
            and p95 latency: the interactive case); 0: none.
        encoded_videos: each head encodes every video once, after its training (timed, kept beside the
            collection: :mod:`tvrpipe.search.encoded`), and its arms, the exhaustive one too, read those
            encodings instead of encoding frames (``tvrpipe search --encoded-videos``).

    Raises:
        ConfigError: an option out of range, an unknown head or first stage, or one whose library is missing.

    Example:
        >>> bench = bench_search("bench/search", videos=20_000, methods=["xpool"])  # doctest: +SKIP
        >>> bench.k_reaching("xpool")  # doctest: +SKIP
    """
    from tvrpipe.progress import progress_bar

    plan = _plan(out_dir, videos, queries, candidates, methods, first_stage, first_stage_settings, train_videos,
                 train_epochs, dim, seed, exhaustive_queries, latency_queries, encoded_videos)
    generate_store(plan.coll_dir, plan.coll_spec, progress=progress, wait=True, made_by="tvrpipe bench search")
    generate_store(plan.bench_dir, plan.bench_spec, progress=progress, wait=True, made_by="tvrpipe bench search")
    bench, shared = _zero_shot_stage(plan)
    with progress_bar(elapsed=True, enabled=progress) as bar:
        task = bar.add_task("search bench", total=len(plan.methods) * (2 + len(plan.ks)))
        for method in plan.methods:
            _measure_head(plan, shared, bench, method, bar, task)
            _write(plan.out, bench)
    _write(plan.out, bench)
    return bench


@dataclass
class _Plan:
    """What a search bench measures, checked before any store is generated."""

    out: Path
    coll_dir: Path
    bench_dir: Path
    coll_spec: GenSpec
    bench_spec: GenSpec
    methods: list[str]
    ks: list[int]
    kind: str  # the resolved first stage
    settings: tuple[str, ...]
    head_aware: bool  # a first stage fitted to each head (built per head, after its training)
    queries: int
    exhaustive_queries: int | None
    latency_queries: int
    train_videos: int
    train_epochs: int | None
    seed: int
    encoded: bool = False  # each head's arms read its encodings of the videos, made once


def encodings_bytes(methods: Sequence[str], dim: int, frames: int) -> int:
    """Bytes a video of every head's encoding together (``--encoded-videos`` keeps each), from an untrained head
    of each: the encoding's shapes do not depend on the weights."""
    import torch

    from tvrpipe.heads.base import VideoBatch, create_head

    video = VideoBatch(torch.zeros(1, frames, dim), torch.ones(1, frames, dtype=torch.bool))
    total = 0
    with torch.inference_mode():
        for m in methods:
            total += sum(v.numel() * v.element_size() for v in create_head(m, embed_dim=dim).eval()
                         .encode_videos(video).values())
    return total


def _plan(out_dir, videos, queries, candidates, methods, first_stage, first_stage_settings, train_videos,
          train_epochs, dim, seed, exhaustive_queries, latency_queries, encoded=False) -> _Plan:
    """Every option checked (an unknown head, first stage or setting fails here), and the room the stores need."""
    from tvrpipe.heads.base import create_head, head_class, list_heads
    from tvrpipe.search.first_stages import (
        FOR_HEAD,
        first_stage_class,
        first_stage_for_head,
        resolve_first_stage,
        stage_config,
    )

    ks = _check(videos, queries, candidates, train_videos, train_epochs, dim, exhaustive_queries, latency_queries)
    methods = methods or list_heads()
    for m in methods:
        head_class(m)
    first_stage_settings = tuple(first_stage_settings)
    if first_stage == FOR_HEAD:  # each head's own, resolved from the trained head; its settings checked for each now
        kind = FOR_HEAD
        for m in methods:
            stage_config(first_stage_for_head(create_head(m, embed_dim=dim)), first_stage_settings)
    else:
        kind = resolve_first_stage(first_stage)
        stage_config(kind, first_stage_settings)
    out = Path(out_dir)
    coll_spec = collection_spec(videos, dim, seed=seed, captioned=max(QUERY_POOL, queries))
    bench_spec = benchmark_spec(coll_spec, train_videos)
    names = (f"collection-{videos}-d{dim}-s{seed}", f"benchmark-{train_videos}-d{dim}-s{seed}")
    needs = search_needs(out, coll_spec, bench_spec, names)
    if encoded:  # each head's encodings beside the collection, made anew (timed) beside any kept before
        needs += Needs(disk=videos * encodings_bytes(methods, dim, coll_spec.frames),
                       disk_what="the heads' encodings of the videos (--encoded-videos)")
    check_room("bench search", out, needs, "--videos, --train-videos or --dim" + (", or leave out --encoded-videos"
                                                                                   if encoded else ""))
    return _Plan(out, out / "stores" / names[0], out / "stores" / names[1], coll_spec, bench_spec, methods, ks, kind,
                 first_stage_settings, kind == FOR_HEAD or first_stage_class(kind).head_aware, queries, exhaustive_queries,
                 latency_queries, train_videos, train_epochs, seed, encoded)


@dataclass
class _Shared:
    """What every head's arms share: the queries, the exhaustive sample, the searchable rows, zero-shot's list."""

    qrows: np.ndarray  # the queries' caption rows
    sample: np.ndarray  # the queries (positions) the exhaustive search runs
    truth: np.ndarray  # each query's video row
    rows: np.ndarray  # the searchable videos' store rows
    zero_shot_top: np.ndarray  # (Q, max K): the pooled first stage's shortlists, best first


def _zero_shot_stage(plan: _Plan) -> tuple[SearchBench, _Shared]:
    """The pooled first stage, built afresh in a process of its own (timed, its peak measured) and kept beside the
    collection for the arms' processes (a distilled first stage is built per head; the zero-shot figures are then
    the exact pooled stage's), the queries drawn, and the first stage's figures alone."""
    from tvrpipe.bench.extract import in_fresh_process
    from tvrpipe.features.store import open_store
    from tvrpipe.search.batches import text_batch
    from tvrpipe.search.first_stages.exact import exact_top
    from tvrpipe.search.index import first_stage as build_first_stage

    pooled_kind, pooled_settings = ("exact", ()) if plan.head_aware else (plan.kind, plan.settings)
    built = in_fresh_process(_build, _Build(str(plan.coll_dir), pooled_kind, pooled_settings),
                             "building the first stage")
    store = open_store(plan.coll_dir)
    stage = build_first_stage(store, pooled_kind, cache=True, settings=pooled_settings)
    what = built["describe"] if not plan.head_aware else f"{plan.kind}, built for each head (zero-shot figures: exact)"
    # the queries: held-out captions, and each one's video; the exhaustive search's sample of them
    rng = np.random.default_rng([plan.seed, 45])
    qrows = np.sort(rng.choice(len(store.texts), plan.queries, replace=False))
    sample = np.sort(rng.permutation(plan.queries)[: plan.exhaustive_queries or plan.queries])
    truth = store.texts["video_row"].to_numpy()[qrows]
    sentences = text_batch(store, qrows).sentence.numpy()
    ks = plan.ks
    t = time.perf_counter()
    pos, _ = stage.top(sentences, ks[-1])
    first_seconds = time.perf_counter() - t
    top = stage.rows[pos]  # (Q, max K) store rows, best first
    exact = None
    if not stage.index.exact:
        want = stage.rows[exact_top(stage.pooled, sentences / np.linalg.norm(sentences, axis=1, keepdims=True),
                                    ks[-1])[0]]
        exact = {k: float(np.mean([len(set(top[q, :k]) & set(want[q, :k])) / k for q in range(plan.queries)]))
                 for k in ks}
    spec = plan.coll_spec
    bench = SearchBench(
        videos=len(store.videos), queries=plan.queries, dim=spec.embed_dim, frames=spec.frames, words=spec.max_words,
        candidates=ks, first_stage=what, index_seconds=built["seconds"], index_peak_gb=built["peak"] / 2**30,
        first_stage_seconds=first_seconds, first_stage_r1=_r_at(top, truth, 1), first_stage_r10=_r_at(top, truth, TOP),
        first_stage_hit={k: _r_at(top, truth, k) / 100 for k in ks}, first_stage_exact=exact,
        train_videos=plan.train_videos, train_epochs=plan.train_epochs, exhaustive_queries=len(sample),
        latency_queries=plan.latency_queries, cpus=os.cpu_count() or 1, encoded_videos=plan.encoded)
    shared = _Shared(qrows, sample, truth, stage.rows, top)
    del stage, pos
    gc.collect()
    return bench, shared


def _measure_head(plan: _Plan, shared: _Shared, bench: SearchBench, method: str, bar, task) -> None:
    """One head: trained (or its run reused), its distilled first stage built where the bench measures one, then
    its exhaustive search and its two stages at each K, each in a fresh process; its rows added to ``bench``."""
    from tvrpipe.bench.extract import in_fresh_process
    from tvrpipe.rundir import BEST, CHECKPOINTS

    bar.update(task, description=f"{method}: training on the benchmark")
    run_dir = bench_run_dir(plan.out, plan.bench_dir, method, plan.train_epochs)
    bench.trained[method] = trained_run(plan.bench_dir, method, run_dir, plan.train_epochs)
    checkpoint = str(run_dir / CHECKPOINTS / BEST)
    if plan.encoded:  # first: a first stage made of the head's own vectors reads them instead of encoding again
        bar.update(task, description=f"{method}: encoding every video once")
        bench.trained[method]["encoded"] = in_fresh_process(
            _encode, _Arm(str(plan.coll_dir), checkpoint, shared.qrows[:0], shared.rows, None, plan.kind,
                          run=str(run_dir)), f"{method}: encoding every video")
    if plan.head_aware:
        bar.update(task, description=f"{method}: distilling its first stage")
        fs = in_fresh_process(_build, _Build(str(plan.coll_dir), plan.kind, plan.settings, str(run_dir)),
                              f"{method}: building its distilled first stage")
        bench.trained[method]["first_stage"] = {"seconds": fs["seconds"], "peak_gb": fs["peak"] / 2**30,
                                                "bytes": fs["bytes"], "fit": fs["fit"], "describe": fs["describe"],
                                                "from_encodings": fs["from_encodings"]}
    bar.advance(task)
    full = None
    for k in (None, *plan.ks):
        bar.update(task, description=f"{method}: {'exhaustive' if k is None else f'two stages, K = {k}'}")
        searched = shared.sample if k is None else np.arange(plan.queries)
        job = _Arm(str(plan.coll_dir), checkpoint, shared.qrows[searched], shared.rows, k, plan.kind, plan.settings,
                   plan.latency_queries, str(run_dir), plan.encoded)
        r = in_fresh_process(_arm, job, f"{method} search, {'exhaustive' if k is None else f'K = {k}'}")
        full = r["rows"] if k is None else full
        if k is None and plan.head_aware:  # the two stages' recall had the shortlist been zero-shot CLIP's
            bench.zero_shot_recall[method] = {kk: recall_in(shared.zero_shot_top[shared.sample, :kk], full)
                                              for kk in plan.ks}
        bench.rows.append(_row(method, k, r, searched, full, shared))
        bench.threads = r["threads"]
        log.info("%s", bench.rows[-1])
        bar.advance(task)


def _row(method: str, k: int | None, r: dict, searched: np.ndarray, full: np.ndarray, shared: _Shared) -> SearchRow:
    """An arm's measurements as a row (recall against the exhaustive top 10 ``full``, over its sample)."""
    alone = np.asarray(r["alone"]) * 1000
    return SearchRow(
        method=method, candidates=k, seconds=r["seconds"], qps=len(searched) / r["seconds"],
        peak_gb=r["peak"] / 2**30, extra_gb=None if r["extra"] is None else r["extra"] / 2**30,
        encoded=r["encoded"], recall=recall_at(r["rows"] if k is None else r["rows"][shared.sample], full),
        r1=_r_at(r["rows"], shared.truth[searched], 1), r10=_r_at(r["rows"], shared.truth[searched], TOP),
        p50_ms=float(np.percentile(alone, 50)) if len(alone) else None,
        p95_ms=float(np.percentile(alone, 95)) if len(alone) else None)


def recall_in(shortlist: np.ndarray, reference: np.ndarray) -> float:
    """The share of each query's ``reference`` top k (``(Q, k)``) in its ``shortlist`` (``(Q, K)``), averaged:
    the recall of two stages whose head re-ranks that shortlist (the head's top k of a shortlist holding them
    is them)."""
    return float(np.mean([np.isin(ref, short).mean() for short, ref in zip(shortlist, reference)]))


def recall_at(rows: np.ndarray, reference: np.ndarray) -> float:
    """``|rows[q] & reference[q]| / k`` averaged over the queries q (both ``(Q, k)``): the share of the
    reference's top k that a search found, in any order."""
    k = reference.shape[1]
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(rows, reference)]))


def _r_at(rows: np.ndarray, truth: np.ndarray, k: int) -> float:
    """R@k in %: the share of queries whose own video is among the first k of ``rows`` ``(Q, >= k)``."""
    return 100.0 * float(np.mean((rows[:, :k] == truth[:, None]).any(1)))


def _write(out: Path, bench: SearchBench) -> None:
    from tvrpipe.files import atomic_write_text

    atomic_write_text(out / "results.json", json.dumps(bench.record(), indent=2) + "\n")
