"""``tvrpipe bench serve``: the latency of ``tvrpipe serve``, one query at a time, over a real socket.

What runs:

1. **The stores and the heads of** ``tvrpipe bench search`` (:mod:`tvrpipe.bench.search`): its generated
   collection (default 100,000 videos; 12 frames, 32 words, D = 512 as ViT-B/32) and benchmark, in the same
   ``<out>/stores`` cache, and each head of ``methods`` trained on the benchmark as that bench trains it (same
   ``<out>/runs``): a ``bench search`` run's stores and heads in the same ``--out`` are reused, and the reverse.
2. **Queries**: ``queries`` captions of the collection drawn at random (seeded), and :data:`WARMUP` others.
3. **Per arm, in a fresh process**: the server built by :func:`~tvrpipe.search.serve.open_server` as ``tvrpipe
   serve --features COLLECTION [--run RUN] --candidates K --first-stage S`` builds it (store, head and first
   stage loaded once; start-up timed), with one difference: its query encoder. A generated store has no CLIP,
   so the server is given (``encode``) :class:`StoredCaptions`, a lookup of each caption's stored embeddings
   (word tokens, mask, sentence: what ``Searcher.encode`` returns for a real store's CLIP). A trained head is
   then put in place of the zero-shot one, loaded as bench search loads it (its selected checkpoint):
   ``open_searcher`` refuses a run trained on another generated store, even of the same world, since a
   generated store's identity (its ``weights_sha256``) hashes its split sizes too. uvicorn serves
   the app on 127.0.0.1 (a socket bound to a free port; a thread of that process). A client in the same
   process (``http.client``, one keep-alive connection, as a browser holds one) sends the :data:`WARMUP`
   requests, then each query once, one at a time, as ``GET /search?q=CAPTION_ID&k=10``; each request is
   timed from its send to its JSON body read and parsed: **p50, p95, mean** (ms). The arms: zero-shot CLIP
   (no run: the untrained meanpool head re-ranks the shortlist, which ranks as the first stage does) and each
   trained head of ``methods``, each at the same K.
4. **The text tower**, in a fresh process: an open_clip ``text_model`` (default ViT-B-32) with random weights
   (nothing downloaded; a CLIP's cost does not depend on its weights) encodes each query alone as
   ``Searcher.encode`` does (tokenise to L = 32 positions, encode, round to float16), as many queries as the
   arms are sent: p50, p95, mean. Its cost does not depend on the sentence: every query is L positions.

**With real CLIP** (the estimate reported per arm): for the i-th request, its latency less the time the
lookup took in it, plus the text tower's i-th time; p50 and p95 over the requests.

The measurements are written to ``<out>/serve/results.json`` (``<out>/results.json`` is bench search's), the
hits served to ``<out>/serve/hits.json`` (per arm, per query: video id and score), for checks against
``tvrpipe search``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError, RunError

log = logging.getLogger(__name__)

WARMUP = 5  # requests before the timed ones: the first pays lazy imports, allocations and cold pages
DEFAULT_CANDIDATES = 1000  # the K bench search found xpool needs for recall@10 0.95 at 100,000 (performance.md)
TEXT_MODEL = "ViT-B-32"  # the architecture of the stores' D = 512
ZERO_SHOT = "zero-shot"


@dataclass
class ServeArm:
    """One served arm: a head (or zero-shot CLIP) behind the server, its latency per request.

    Attributes:
        arm: ``zero-shot`` or the head's name.
        ranked_by: what the server says ranks (its ``ranked_by``: the run and its method, or zero-shot CLIP).
        start_seconds: :func:`~tvrpipe.search.serve.open_server`: the store, the head and the first stage loaded.
        p50_ms, p95_ms, mean_ms, max_ms: a request's latency, send to parsed body, over the queries.
        lookup_ms: the mean time of the stored-caption lookup inside a request (what real CLIP replaces).
        clip_p50_ms, clip_p95_ms: with real CLIP: per query, latency - lookup + the text tower's time.
    """

    arm: str
    ranked_by: str
    start_seconds: float
    p50_ms: float
    p95_ms: float
    mean_ms: float
    max_ms: float
    lookup_ms: float
    clip_p50_ms: float
    clip_p95_ms: float


@dataclass
class ServeBench:
    """One bench's measurements: the setting, the first stage, the text tower, each head's training and arms."""

    videos: int
    queries: int
    dim: int
    top_k: int
    candidates: int
    first_stage: str  # what ran: the first stage's own description
    transport: str
    text_model: str
    text_p50_ms: float
    text_p95_ms: float
    text_mean_ms: float
    train_videos: int
    train_epochs: int | None  # None: until validation stopped improving (train-head's default)
    # method -> {"test_R@1", "seconds", "run", "epochs_run", "selected_epoch"} (bench search's record)
    trained: dict[str, dict] = field(default_factory=dict)
    arms: list[ServeArm] = field(default_factory=list)
    cpus: int = 0
    threads: int = 0

    def arm(self, name: str) -> ServeArm:
        return next(a for a in self.arms if a.arm == name)

    def record(self) -> dict:
        """The measurements as JSON-ready data (``results.json``, ``--json``)."""
        return asdict(self)

    def lines(self) -> list[str]:
        """The setting, the text tower and, per arm, its latency and the estimate with real CLIP."""
        out = [f"{self.videos:,} generated videos (F = 12, L = 32, D = {self.dim}), {self.queries} queries one at a "
               f"time, top {self.top_k}, K = {self.candidates} (first stage: {self.first_stage}); {self.transport}; "
               f"{self.cpus} CPUs, {self.threads} torch threads",
               f"text tower ({self.text_model}, random weights), one query: p50 {self.text_p50_ms:.1f} ms, p95 "
               f"{self.text_p95_ms:.1f} ms"]
        for a in self.arms:
            t = self.trained.get(a.arm)
            trained = "" if t is None else (f" (trained {t['epochs_run']} epochs, benchmark test R@1 "
                                            f"{t['test_R@1']:.1f} %)")
            out.append(f"{a.arm}{trained}: p50 {a.p50_ms:.1f} ms, p95 {a.p95_ms:.1f} ms, mean {a.mean_ms:.1f} ms "
                       f"(lookup {a.lookup_ms:.1f} ms); with real CLIP p50 {a.clip_p50_ms:.1f} ms, p95 "
                       f"{a.clip_p95_ms:.1f} ms; started in {a.start_seconds:.1f} s")
        return out


# ------------------------------------------------------------------------------------------ the query encoder


class StoredCaptions:
    """The query encoder of a server over a generated store (:attr:`~tvrpipe.search.serve.Server.encode`): a
    caption id of the store -> its stored word tokens, mask and sentence, as float32 from the store's float16,
    which is what ``Searcher.encode`` returns for a store extracted with a CLIP (it rounds to float16 as the
    store holds captions). :attr:`seconds` holds each call's time.

    Example:
        >>> server = open_server(store_dir, encode=StoredCaptions(store_dir))  # doctest: +SKIP
        >>> server.search(["gv_00012#0"], 5).hits[0].video_id  # doctest: +SKIP
        'gv_00012'
    """

    def __init__(self, store_dir: str | os.PathLike[str]):
        from tvrpipe.features.store import open_store

        self.store = open_store(store_dir)
        self.rows = {str(c): i for i, c in enumerate(self.store.texts["caption_id"])}
        self.seconds: list[float] = []

    def __call__(self, queries: Sequence[str]):
        from tvrpipe.heads.base import TextBatch
        from tvrpipe.search.batches import text_batch
        from tvrpipe.search.engine import check_queries

        t = time.perf_counter()
        check_queries(queries)
        missing = [q for q in queries if q not in self.rows]
        if missing:
            raise ConfigError(f"{missing[0]!r} is not a caption id of {self.store.dir}: a generated store has no CLIP, "
                              "so its queries are its captions' stored embeddings, asked for by caption id")
        rows = np.array([self.rows[q] for q in queries])
        order = np.argsort(rows)
        got = text_batch(self.store, rows[order])  # the store reads sorted rows
        back = np.argsort(order)
        texts = TextBatch(got.tokens[back], got.token_mask[back], got.sentence[back])
        self.seconds.append(time.perf_counter() - t)
        return texts


# ------------------------------------------------------------------------------------------- the arms


@dataclass(frozen=True)
class _Arm:
    store: str
    method: str
    run: str | None
    candidates: int
    first_stage: str
    settings: tuple[str, ...]
    queries: tuple[str, ...]
    warmup: tuple[str, ...]
    top_k: int


def _served(job: _Arm) -> dict:
    """One arm in this (fresh) process: the server as ``tvrpipe serve`` builds it, behind uvicorn on a socket of
    127.0.0.1, and each query sent once, one at a time, over one keep-alive connection."""
    import http.client
    import threading
    from urllib.parse import urlencode

    import torch
    import uvicorn

    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.search.serve import listen, make_app, open_server

    lookup = StoredCaptions(job.store)
    t = time.perf_counter()
    server = open_server(job.store, first_stage=job.first_stage, candidates=job.candidates,
                         first_stage_settings=job.settings, encode=lookup)
    if job.run is not None:
        head = load_head(Path(job.run) / CHECKPOINTS / BEST).eval()
        s = server.current.searcher
        server.current = replace(server.current, searcher=replace(s, head=head, label=f"{job.method} ({job.run})"))
    start = time.perf_counter() - t
    listener = listen("127.0.0.1", 0)  # a free port, held from here: no other process can take it before uvicorn
    sock, port = listener.sock, listener.port
    uv = uvicorn.Server(uvicorn.Config(make_app(server, listener.hosts()), host="127.0.0.1", port=port,
                                       log_level="warning", access_log=False))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not uv.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RunError(f"the server of {server.searcher.label} did not start on 127.0.0.1:{port}")
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

        def get(q: str) -> dict:
            conn.request("GET", "/search?" + urlencode({"q": q, "k": job.top_k}))
            r = conn.getresponse()
            body = json.loads(r.read())
            if r.status != 200:
                raise RunError(f"GET /search?q={q}: {r.status} {body.get('error')}")
            return body

        for q in job.warmup:
            get(q)
        lookup.seconds.clear()
        latency, hits = [], []
        for q in job.queries:
            t = time.perf_counter()
            body = get(q)
            latency.append(time.perf_counter() - t)
            hits.append([{"video_id": h["video_id"], "score": h["score"]} for h in body["hits"]])
        conn.close()
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()
    return {"start": start, "latency": latency, "lookup": list(lookup.seconds), "hits": hits,
            "stage": server.stage.describe(), "ranked_by": server.searcher.label, "threads": torch.get_num_threads()}


@dataclass(frozen=True)
class _Tower:
    model: str
    max_words: int
    queries: tuple[str, ...]
    warmup: tuple[str, ...]


def _text_tower(job: _Tower) -> list[float]:
    """Each query encoded alone by a random-weight CLIP, as ``Searcher.encode`` encodes it; seconds per query."""
    from tvrpipe.features.clip import encode_text_tokens, load_clip, tokenize

    bundle = load_clip(job.model, "none", device="cpu", seed=0)

    def encode(q: str) -> None:
        ids, _ = tokenize(bundle, [q], job.max_words)
        tokens, sentence = encode_text_tokens(bundle, ids)
        tokens.half().float(), sentence.half().float()  # the rounding Searcher.encode does

    for q in job.warmup:
        encode(q)
    out = []
    for q in job.queries:
        t = time.perf_counter()
        encode(q)
        out.append(time.perf_counter() - t)
    return out


# ------------------------------------------------------------------------------------------ the bench


def _check(videos: int, queries: int, candidates: int, train_videos: int, train_epochs: int | None,
           dim: int) -> None:
    from tvrpipe.bench.search import check_training
    from tvrpipe.search.serve import DEFAULT_TOP_K

    if videos < DEFAULT_TOP_K:
        raise ConfigError(f"--videos {videos}: the collection needs at least {DEFAULT_TOP_K} videos (the hits of a "
                          "request)")
    if not 1 <= queries <= videos - WARMUP:
        raise ConfigError(f"--queries {queries}: between 1 and --videos ({videos}) less the {WARMUP} warm-up queries")
    if not 1 <= candidates <= videos:  # as bench search bounds its K
        raise ConfigError(f"--candidates {candidates}: between 1 and --videos ({videos}): the shortlist the head "
                          "re-ranks")
    check_training(train_videos, train_epochs, dim)


def _check_text_model(name: str) -> None:
    import open_clip

    from tvrpipe.features.clip import TINY_MODEL, register_tiny_config

    register_tiny_config()
    if open_clip.get_model_config(name) is None:
        raise ConfigError(f"--text-model {name!r}: not an open_clip architecture; e.g. ViT-B-32, or {TINY_MODEL} "
                          "(open_clip.list_models() lists them)")


def _ms(seconds: Sequence[float] | np.ndarray, q: float) -> float:
    return 1000.0 * float(np.percentile(np.asarray(seconds), q))


def bench_serve(
    out_dir: str | os.PathLike[str],
    videos: int = 100_000,
    queries: int = 200,
    methods: Sequence[str] = ("xpool",),
    candidates: int = DEFAULT_CANDIDATES,
    first_stage: str = "exact",
    first_stage_settings: Sequence[str] = (),
    train_videos: int = 2000,
    train_epochs: int | None = None,
    dim: int = 512,
    text_model: str = TEXT_MODEL,
    seed: int = 0,
    progress: bool = True,
) -> ServeBench:
    """Generate (once) bench search's collection and benchmark, train each head (once), then serve zero-shot
    CLIP and each head, each in a fresh process behind uvicorn, and time each query's request; time the text
    tower apart. ``<out>/serve/results.json`` gets the result, ``<out>/serve/hits.json`` the hits served.

    Args:
        out_dir: working directory: ``stores/`` and ``runs/`` (bench search's, reused), ``serve/results.json``,
            ``serve/hits.json``.
        videos: videos of the served collection.
        queries: held-out captions sent, one request each.
        methods: trained heads served, beside zero-shot CLIP (which is always served).
        candidates: K, the shortlist every arm's head re-ranks (``tvrpipe serve --candidates``).
        first_stage: a registered first stage or ``auto``, as ``tvrpipe serve --first-stage``.
        first_stage_settings: its ``KEY=VALUE`` settings (``--first-stage-set``).
        train_videos: captioned train videos of the heads' benchmark.
        train_epochs: epochs each head trains; None: until validation stops improving (train-head's default).
        dim: D, the embedding width (ViT-B/32: 512).
        text_model: the open_clip architecture whose text tower is timed (random weights).
        seed: the generated world and the draw of the queries.
        progress: progress bars.

    Raises:
        ConfigError: an option out of range, an unknown head, first stage or text model.

    Example:
        >>> bench = bench_serve("bench/search", methods=["xpool"])  # doctest: +SKIP
        >>> bench.arm("zero-shot").p50_ms  # doctest: +SKIP
    """
    from tvrpipe.bench.extract import in_fresh_process
    from tvrpipe.bench.search import WORDS
    from tvrpipe.progress import progress_bar

    plan = _plan(out_dir, videos, queries, methods, candidates, first_stage, first_stage_settings, train_videos,
                 train_epochs, dim, seed, text_model)
    names = tuple(f"query {i}" for i in range(queries + WARMUP))  # L positions whatever the words
    tower = in_fresh_process(_text_tower, _Tower(text_model, WORDS, names[WARMUP:], names[:WARMUP]),
                             f"{text_model} text tower")
    warmup, asked = _stores(plan, progress)
    bench = ServeBench(
        videos=videos, queries=queries, dim=dim, top_k=plan.top_k, candidates=candidates, first_stage="",
        transport="uvicorn on 127.0.0.1 (a thread of the arm's process), one keep-alive connection, one request "
                  "at a time, timed from send to parsed JSON",
        text_model=text_model, text_p50_ms=_ms(tower, 50), text_p95_ms=_ms(tower, 95),
        text_mean_ms=1000.0 * float(np.mean(tower)), train_videos=train_videos, train_epochs=train_epochs,
        cpus=os.cpu_count() or 1)
    served_hits: dict[str, list] = {}
    with progress_bar(elapsed=True, enabled=progress) as bar:
        task = bar.add_task("serve bench", total=1 + 2 * len(plan.methods))
        for arm in (ZERO_SHOT, *plan.methods):
            served_hits[arm] = _serve_arm(plan, bench, arm, asked, warmup, tower, bar, task)
            _write(plan.out, bench, asked, served_hits)
    return bench


@dataclass
class _Plan:
    """What a serve bench measures, checked before any store is generated or tower loaded."""

    out: Path
    coll_dir: Path
    bench_dir: Path | None  # None: zero-shot only, no benchmark
    coll_spec: Any
    methods: list[str]
    candidates: int | None
    kind: str
    settings: tuple[str, ...]
    queries: int
    train_videos: int
    train_epochs: int | None
    seed: int
    top_k: int


def _plan(out_dir, videos, queries, methods, candidates, first_stage, first_stage_settings, train_videos, train_epochs,
          dim, seed, text_model) -> _Plan:
    """Every option checked (an unknown head, first stage, setting or text model fails here), and the room."""
    from tvrpipe.bench.room import check_room
    from tvrpipe.bench.search import QUERY_POOL, benchmark_spec, collection_spec, search_needs
    from tvrpipe.heads.base import head_class
    from tvrpipe.search.first_stages import resolve_first_stage, stage_config
    from tvrpipe.search.serve import DEFAULT_TOP_K

    _check(videos, queries, candidates, train_videos, train_epochs, dim)
    methods = list(dict.fromkeys(methods))
    for m in methods:
        head_class(m)
    kind = resolve_first_stage(first_stage)
    first_stage_settings = tuple(first_stage_settings)
    stage_config(kind, first_stage_settings)
    out = Path(out_dir)
    _check_text_model(text_model)
    coll_spec = collection_spec(videos, dim, seed=seed, captioned=max(QUERY_POOL, queries + WARMUP))
    stores = (f"collection-{videos}-d{dim}-s{seed}", f"benchmark-{train_videos}-d{dim}-s{seed}")
    check_room("bench serve", out, search_needs(out, coll_spec, benchmark_spec(coll_spec, train_videos) if methods
                                                else None, stores), "--videos, --train-videos or --dim")
    return _Plan(out, out / "stores" / stores[0], out / "stores" / stores[1] if methods else None, coll_spec, methods,
                 candidates, kind, first_stage_settings, queries, train_videos, train_epochs, seed, DEFAULT_TOP_K)


def _stores(plan: _Plan, progress: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The collection (and the heads' benchmark) generated once; the warm-up and the timed requests' caption ids."""
    from tvrpipe.bench.search import benchmark_spec
    from tvrpipe.features.store import open_store
    from tvrpipe.worlds.features import generate_store

    generate_store(plan.coll_dir, plan.coll_spec, progress=progress, wait=True, made_by="tvrpipe bench serve")
    if plan.bench_dir is not None:
        generate_store(plan.bench_dir, benchmark_spec(plan.coll_spec, plan.train_videos), progress=progress,
                       wait=True, made_by="tvrpipe bench serve")
    ids = open_store(plan.coll_dir).texts["caption_id"].astype(str).to_numpy()
    drawn = np.random.default_rng([plan.seed, 46]).choice(len(ids), plan.queries + WARMUP, replace=False)
    return tuple(ids[drawn[:WARMUP]]), tuple(ids[drawn[WARMUP:]])


def _serve_arm(plan: _Plan, bench: ServeBench, arm: str, asked, warmup, tower, bar, task) -> list:
    """One arm: its head trained (or reused), then served in a fresh process and timed; its row added to
    ``bench``; the hits it served."""
    from tvrpipe.bench.extract import in_fresh_process
    from tvrpipe.bench.search import bench_run_dir, trained_run

    run = None
    if arm != ZERO_SHOT:
        bar.update(task, description=f"{arm}: training on the benchmark")
        run_dir = bench_run_dir(plan.out, plan.bench_dir, arm, plan.train_epochs)
        bench.trained[arm] = trained_run(plan.bench_dir, arm, run_dir, plan.train_epochs)
        run = str(run_dir)
        bar.advance(task)
    bar.update(task, description=f"{arm}: served, {plan.queries} requests")
    r = in_fresh_process(_served, _Arm(str(plan.coll_dir), arm, run, plan.candidates, plan.kind, plan.settings, asked,
                                       warmup, plan.top_k), f"{arm} served")
    latency, lookup = np.asarray(r["latency"]), np.asarray(r["lookup"])
    if len(lookup) != len(latency):
        raise RunError(f"{arm}: {len(lookup)} lookups for {len(latency)} requests: the server encoded "
                       "queries it was not sent")
    with_clip = latency - lookup + np.asarray(tower)
    bench.arms.append(ServeArm(
        arm=arm, ranked_by=r["ranked_by"], start_seconds=r["start"], p50_ms=_ms(latency, 50),
        p95_ms=_ms(latency, 95), mean_ms=1000.0 * float(latency.mean()), max_ms=1000.0 * float(latency.max()),
        lookup_ms=1000.0 * float(lookup.mean()), clip_p50_ms=_ms(with_clip, 50),
        clip_p95_ms=_ms(with_clip, 95)))
    bench.first_stage, bench.threads = r["stage"], r["threads"]
    log.info("%s", bench.arms[-1])
    bar.advance(task)
    return r["hits"]


def _write(out: Path, bench: ServeBench, queries: Sequence[str], hits: dict[str, list]) -> None:
    from tvrpipe.files import atomic_write_text

    atomic_write_text(out / "serve" / "hits.json", json.dumps({"queries": list(queries), "arms": hits}) + "\n",
                      parents=True)
    atomic_write_text(out / "serve" / "results.json", json.dumps(bench.record(), indent=2) + "\n")
