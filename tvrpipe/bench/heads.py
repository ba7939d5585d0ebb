"""``tvrpipe bench train-head``: training and evaluation cost per head at MSR-VTT 9k / 1k-A scale.

On a generated store the size of MSR-VTT 9k/1k-A (9,000 train videos x 12 x 512 frames,
180,000 captions x 32 x 512 tokens, 1,000 test pairs; ~5.9 GB of float16), each head runs in a
process of its own (so peak memory is its own) and reports:

- training samples/s and the share of step time spent building batches (target < 10 %);
- the full 1,000 x 1,000 test evaluation time and the memory it adds (resident set sampled
  every 10 ms during the evaluation, minus the resident set before it);
- the process's peak resident memory (the split arrays are float16: never a float32 copy).

For scale: the official X-Pool evaluation code on random features of the 1k-A size took 63 s
and peaked at 8.4 GB on a 2-core machine. Target: X-Pool >= 5x faster, < 2 GB extra.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import threading
import time
from pathlib import Path

from tvrpipe.bench.extract import in_fresh_process
from tvrpipe.bench.room import Needs, batch_needs, check_room, stores_needs
from tvrpipe.progress import stages
from tvrpipe.worlds.features import GenSpec, generate_store

MSRVTT_9K = GenSpec(train_videos=9000, val_videos=0, test_videos=1000, captions_per_train_video=20,
                    captions_per_test_video=1, frames=12, max_words=32, embed_dim=512, seed=0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Samples the resident set every 10 ms while active."""

    def __enter__(self) -> "_PeakRss":
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_bytes())


def _one_method(args: tuple[str, str, int, int, str, bool]) -> dict:
    import torch

    from tvrpipe.features.store import open_store
    from tvrpipe.rundir import BEST, CHECKPOINTS, load_head
    from tvrpipe.training.data import load_split
    from tvrpipe.training.evaluate import evaluate_split
    from tvrpipe.training.fit import TrainConfig, fit

    store_dir, method, steps, batch, run_dir, prefetch = args
    torch.set_num_threads(os.cpu_count() or 1)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: fit() would resume a finished one
    cfg = TrainConfig(epochs=1, batch_size=batch, seed=0, prefetch=prefetch)  # one epoch capped at `steps` steps: enough for a rate
    t = time.perf_counter()
    metrics = fit(store_dir, method, run_dir, cfg, progress=False, max_steps=steps)
    fit_seconds = time.perf_counter() - t
    test = load_split(open_store(store_dir), "test")
    head = load_head(Path(run_dir) / CHECKPOINTS / BEST)
    with _PeakRss() as mem:
        t = time.perf_counter()
        evaluate_split(head, test, cfg.device, cfg.eval_batch, cfg.block_texts)
        eval_seconds = time.perf_counter() - t
    return {
        "method": method,
        "samples_per_s": metrics["train"]["samples_per_s"],
        "data_share": metrics["train"]["data_share"],
        "test_eval_seconds": eval_seconds,
        "test_eval_extra_gb": (mem.peak - mem.start) / 2**30,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "fit_seconds": fit_seconds,
        "n_test": metrics["test"]["t2v"]["n"],
        "prefetch": prefetch,
    }


def bench_train_head(out_dir: str | os.PathLike[str], methods: list[str] | None = None, steps: int = 20,
                     batch_size: int = 128, spec: GenSpec = MSRVTT_9K, prefetch: bool = True) -> list[dict]:
    """Generate (once) the scale store, then measure each method in its own process.

    Example:
        >>> rows = bench_train_head("bench/train-head", ["xpool"])  # doctest: +SKIP
    """
    from tvrpipe.heads.base import head_class, list_heads

    at_least_each({"--steps": (steps, 1), "--batch-size": (batch_size, 2)})
    for method in methods or []:
        head_class(method)  # an unknown head fails before the scale store is generated
    out = Path(out_dir)
    check_room("bench train-head", out, stores_needs({out / "store": spec}) + Needs(
        memory=spec.store_bytes(), memory_what="the store's features, trained in memory")
        + batch_needs(batch_size, spec.frames, spec.max_words, spec.embed_dim), "--batch-size")
    store = generate_store(out / "store", spec, progress=True, made_by="tvrpipe bench train-head")
    results = []
    for method in stages(methods or list_heads()):
        row = in_fresh_process(_one_method, (str(store), method, steps, batch_size, str(out / "runs" / method),
                                             prefetch), method)
        results.append({**row, **_official(method)})  # its test split is the 1k-A size
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def at_least_each(options: dict[str, tuple[int, int]]) -> None:
    """Refuse an option below its least value (``{option: (value, least)}``), before a benchmark starts."""
    from tvrpipe.errors import ConfigError

    for option, (value, least) in options.items():
        if value < least:
            raise ConfigError(f"{option} must be >= {least}, got {value}")


# ---- evaluation cost alone: ``tvrpipe bench eval`` ----------------------------------------------

# (captions, videos) of the standard test sets: MSR-VTT 1k-A and MSVD's multi-caption test split
EVAL_SIZES: dict[str, tuple[int, int]] = {"msrvtt1k": (1000, 1000), "msvd": (27763, 670)}
# The official code's inference on random features of the MSR-VTT 1k-A size, measured on this
# 2-core machine: seconds and peak resident memory (GB).
OFFICIAL_EVAL = {"xpool": (63.0, 8.4), "tmass": (517.0, 18.7)}


def _official(method: str | None) -> dict[str, float | None]:
    """The official code's evaluation seconds and peak GB at the 1k-A size, where it was measured."""
    seconds, peak = OFFICIAL_EVAL.get(method, (None, None))
    return {"official_seconds": seconds, "official_peak_gb": peak}


def _random_features(n_t: int, n_v: int, frames: int, words: int, dim: int, tokens: bool, seed: int):
    """CLIP-shaped random features in float16 (the trainer's in-memory format), masks with padding."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape):  # generated in slices: no float64 copy of the largest array
        out = np.empty(shape, np.float16)
        for a in range(0, shape[0], 1024):
            out[a:a + 1024] = rng.standard_normal((min(1024, shape[0] - a), *shape[1:]), np.float32)
        return out

    n_words = rng.integers(5, words + 1, n_t)
    n_frames = rng.integers(max(1, frames // 2), frames + 1, n_v)
    n_frames[: n_v // 2] = frames  # half the videos full, half padded
    return {
        "sentence": normal(n_t, dim),
        "tokens": normal(n_t, words, dim) if tokens else np.zeros((n_t, 0, dim), np.float16),
        "token_mask": np.arange(words if tokens else 0) < n_words[:, None],
        "frames": normal(n_v, frames, dim),
        "frame_mask": np.arange(frames) < n_frames[:, None],
        "text_video": (np.arange(n_t) * n_v) // n_t,  # captions grouped by video, every video captioned
    }


def _eval_bytes(n_t: int, n_v: int, frames: int, words: int, dim: int) -> int:
    """What :func:`_random_features` and the evaluation hold: the float16 features with their masks, the float32
    score matrix, and the encoded float32 sides (twice the features, over)."""
    features = n_t * (dim * 2 + words * (dim * 2 + 1)) + n_v * frames * (dim * 2 + 1)
    return 3 * features + n_t * n_v * 4


def _text_batch(x: dict, rows: slice):
    """Captions ``rows`` of :func:`_random_features` as a float32 TextBatch (cast per batch, as the trainer)."""
    import torch

    from tvrpipe.heads.base import TextBatch

    f32 = lambda a: torch.from_numpy(a).float()  # noqa: E731
    return TextBatch(f32(x["tokens"][rows]), torch.from_numpy(x["token_mask"][rows]), f32(x["sentence"][rows]))


def _video_batch(x: dict, rows: slice):
    """Videos ``rows`` of :func:`_random_features` as a float32 VideoBatch."""
    import torch

    from tvrpipe.heads.base import VideoBatch

    return VideoBatch(torch.from_numpy(x["frames"][rows]).float(), torch.from_numpy(x["frame_mask"][rows]))


def _eval_one(args: tuple[str, int, int, int, int, int, int, str]) -> dict:
    import torch

    from tvrpipe.evaluation.engine import EvalInputs, EvalOptions, evaluate_head
    from tvrpipe.heads.base import create_head

    method, n_t, n_v, frames, words, dim, block_texts, device = args
    cuda = device.startswith("cuda")
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    head = create_head(method, embed_dim=dim).eval().to(device)  # cost does not depend on the weights' values
    x = _random_features(n_t, n_v, frames, words, dim, head.uses_tokens, seed=0)
    texts = (_text_batch(x, slice(a, a + 256)).to(device) for a in range(0, n_t, 256))
    videos = (_video_batch(x, slice(a, a + 256)).to(device) for a in range(0, n_v, 256))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_gpu = torch.cuda.memory_allocated(device)
    with _PeakRss() as mem:
        t = time.perf_counter()
        res = evaluate_head(head, EvalInputs(texts, videos, x["text_video"]),
                            EvalOptions(block_texts=block_texts, device=device))
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t
    scores_gb = n_t * n_v * 4 / 2**30
    return {"method": method, "device": device, "n_texts": n_t, "n_videos": n_v, "seconds": seconds,
            "extra_gb": (mem.peak - mem.start) / 2**30, "scores_gb": scores_gb,
            "extra_beyond_scores_gb": (mem.peak - mem.start) / 2**30 - scores_gb,
            # the device's own peak beyond what was allocated before (the head's weights)
            "peak_gpu_gb": (torch.cuda.max_memory_allocated(device) - start_gpu) / 2**30 if cuda else None,
            "t2v_R@1": res["t2v"]["R@1"]}


def bench_eval(methods: list[str] | None = None, sizes: list[str] | None = None, frames: int = 12,
               words: int = 32, dim: int = 512, block_texts: int = 256, device: str = "cpu") -> list[dict]:
    """Evaluation time and memory per head on random features of the standard test-set sizes.

    Each (head, size) runs in a fresh process: random CLIP-shaped features (float16, padded
    masks) go through :func:`tvrpipe.evaluation.engine.evaluate_head` exactly as ``train-head``
    evaluates (encode once, similarity in blocks of ``block_texts`` captions, ranks), on ``device``.
    Memory is the resident set sampled every 10 ms during the evaluation minus the set before it (the
    features themselves are excluded); ``extra_beyond_scores_gb`` subtracts the float32 score matrix;
    on CUDA, ``peak_gpu_gb`` is the device's peak allocation during the evaluation.

    Example:
        >>> bench_eval(["tmass"], ["msrvtt1k"])  # doctest: +SKIP
    """
    from tvrpipe.errors import ConfigError
    from tvrpipe.heads.base import head_class, list_heads

    at_least_each({"--frames": (frames, 1), "--words": (words, 1), "--dim": (dim, 1), "--block-texts": (block_texts, 1)})
    for method in methods or []:
        head_class(method)
    sizes = sizes or list(EVAL_SIZES)
    unknown = [s for s in sizes if s not in EVAL_SIZES]
    if unknown:
        raise ConfigError(f"--size {unknown[0]!r} is not one of: {', '.join(EVAL_SIZES)}")
    largest = max(_eval_bytes(*EVAL_SIZES[size], frames, words, dim) for size in sizes)
    check_room("bench eval", None, Needs(memory=largest, memory_what="the largest size's features and scores"),
               "--size or --dim")
    rows = []
    plan = {f"{method} at {size} size ({EVAL_SIZES[size][0]:,} x {EVAL_SIZES[size][1]:,})": (method, size)
            for size in sizes for method in methods or list_heads()}
    for what in stages(list(plan)):
        method, size = plan[what]
        n_t, n_v = EVAL_SIZES[size]
        row = in_fresh_process(_eval_one, (method, n_t, n_v, frames, words, dim, block_texts, device), what)
        rows.append({"size": size, **row, **_official(method if size == "msrvtt1k" else None)})
    return rows


# ---- the trainer's allocator tuning: ``tvrpipe bench allocator`` -------------------------------


def _steps_one(args: tuple[str, bool, int, int, int, int, int]) -> dict:
    """Training steps of one head on one random batch, in a fresh process: time, faults, peak RSS."""
    import torch

    from tvrpipe.heads.base import create_head
    from tvrpipe.training.allocator import tune_allocator
    from tvrpipe.training.fit import TrainConfig

    method, tuned, steps, batch, frames, words, dim = args
    allocator = tune_allocator() if tuned else "glibc's defaults"  # before any large block exists
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    head = create_head(method, embed_dim=dim).train()
    x = _random_features(batch, batch, frames, words, dim, head.uses_tokens, seed=0)
    texts, videos = _text_batch(x, slice(None)), _video_batch(x, slice(None))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4, weight_decay=TrainConfig().weight_decay)  # as fit

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        head.loss(texts, videos).total.backward()
        opt.step()

    for _ in range(2):  # warm-up: lazy initialisation, the optimizer's state and the heap's growth to its
        step()  # steady size (it settles within two steps) are not the steady state
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - t) / steps
    return {"method": method, "tuned": tuned, "allocator": allocator, "step_seconds": seconds,
            "faults_per_step": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def bench_allocator(methods: list[str] | None = None, steps: int = 3, batch_size: int = 128, frames: int = 12,
                    words: int = 14, dim: int = 512) -> list[dict]:
    """Step time per head with the trainer's malloc tuning (:mod:`tvrpipe.training.allocator`) and
    with glibc's defaults, each in a fresh process, one after the other; ``speedup`` is their ratio.

    A batch of ``batch_size`` random CLIP-shaped pairs (``words`` token columns: a training batch
    of the generated 9k store's captions is cut at 12-18) trains for two warm-up steps and then
    ``steps`` timed steps. Page faults per step show where the time went: with glibc's defaults
    every large temporary is faulted in afresh each step.

    Example:
        >>> bench_allocator(["xpool"], dim=64)  # doctest: +SKIP
    """
    from tvrpipe.heads.base import list_heads

    check_room("bench allocator", None, batch_needs(batch_size, frames, words, dim), "--batch-size or --dim")
    rows = []
    for method in stages(methods or list_heads()):
        pair = {}
        for tuned in (True, False):
            pair[tuned] = in_fresh_process(_steps_one, (method, tuned, steps, batch_size, frames, words, dim),
                                           f"{method}, {'tuned' if tuned else 'glibc defaults'}")
        rows.append({"method": method, "dim": dim, "batch_size": batch_size,
                     **{f"{k}_{name}": pair[tuned][k] for tuned, name in ((True, "tuned"), (False, "default"))
                        for k in ("step_seconds", "faults_per_step", "peak_rss_gb")},
                     "allocator": pair[True]["allocator"],
                     "speedup": pair[False]["step_seconds"] / pair[True]["step_seconds"]})
    return rows


# ---- a training step against a reference head: ``tvrpipe bench step`` -------------------------------


def _step_inputs(method: str, features: str | None, batch: int, frames: int, words: int, dim: int):
    """The head and one training batch: as train-head builds them from a store (its config for the store, and the
    first batch of its training split: a video each with one of its captions, token columns cut at the batch's
    last real word), or at width ``dim`` on random CLIP-shaped features of the given sizes."""
    from tvrpipe.heads.base import create_head, head_class

    if features is None:
        head = create_head(method, embed_dim=dim)
        x = _random_features(batch, batch, frames, words, dim, head.uses_tokens, seed=0)
        return head, _text_batch(x, slice(None)), _video_batch(x, slice(None))
    from tvrpipe.features.store import open_store
    from tvrpipe.training.data import load_split
    from tvrpipe.training.fit import store_head_config
    from tvrpipe.training.stream import InMemoryPairs

    store = open_store(features)
    head = head_class(method)(store_head_config(store, method))
    split = load_split(store, "train", tokens=head.uses_tokens)
    _, _, texts, videos = next(InMemoryPairs(split, head.uses_tokens).epoch(0, 0, 1, min(batch, split.n_videos)))
    return head, texts, videos


def _step_rates(args: tuple[str, str, int, int, int, int, int, str | None]) -> dict:
    """Train-head's step for a head and the reference head, in one fresh process, their steps alternating so that
    both meet the same load: the allocator tuning of fit, torch's threads as train-head leaves them, AdamW with
    its weight decay; forward, loss, backward and the update, timed step by step."""
    import statistics

    import torch

    from tvrpipe.training.allocator import tune_allocator
    from tvrpipe.training.core import optimizer_step
    from tvrpipe.training.fit import TrainConfig

    method, versus, dim, steps, batch, frames, words, features = args
    allocator = tune_allocator()  # as fit, before any large block exists
    runs = {}
    for name in (versus, method):
        torch.manual_seed(0)
        head, texts, videos = _step_inputs(name, features, batch, frames, words, dim)
        opt = torch.optim.AdamW(head.train().parameters(), lr=1e-4, weight_decay=TrainConfig().weight_decay)
        for g in opt.param_groups:
            g["base_lr"] = g["lr"]
        runs[name] = (head, texts, videos, opt, [])
    for i in range(2 + steps):  # two warm-up steps: lazy initialisation, the optimizer's state, the heap's growth
        for head, texts, videos, opt, times in runs.values():
            t = time.perf_counter()
            optimizer_step(opt, head.loss(texts, videos).total, 1.0)
            if i >= 2:
                times.append(time.perf_counter() - t)
    head, texts, videos, _, times = runs[method]
    seconds, base = statistics.median(times), statistics.median(runs[versus][4])
    n = len(texts.sentence)
    return {"method": method, "dim": head.config.embed_dim, "batch_size": n, "words": texts.tokens.shape[1],
            "frames": videos.frames.shape[1], "step_seconds": seconds, "samples_per_s": n / seconds,
            "versus": versus, "versus_step_seconds": base, "versus_samples_per_s": n / base, "ratio": seconds / base,
            "threads": torch.get_num_threads(), "allocator": allocator, "features": features}


def bench_step(methods: list[str] | None = None, versus: str = "xpool", dims: list[int] | None = None,
               batch_size: int = 128, frames: int = 12, words: int = 32, steps: int = 5,
               features: str | os.PathLike[str] | None = None) -> list[dict]:
    """Training samples/s per head, and how many times slower than ``versus`` it trains, at each width in ``dims``.

    Each (width, head) runs in a fresh process train-head's step (forward, loss, backward, AdamW update) for the
    head and for ``versus``, their steps alternating, on one batch of ``batch_size`` random CLIP-shaped pairs
    (``frames`` frames, ``words`` token columns, padded masks) or, with ``features``, on train-head's first batch
    of that store's training split (its width, frames and the batch's caption lengths). A rate is the batch over
    the median of ``steps`` timed steps after two warm-up steps; ``ratio`` is the head's step time over
    ``versus``'s, measured side by side (on a busy machine a ratio holds better than either rate).

    Example:
        >>> bench_step(["prota"], dims=[64, 512])  # doctest: +SKIP
    """
    from tvrpipe.errors import ConfigError
    from tvrpipe.heads.base import head_class, list_heads

    at_least_each({"--steps": (steps, 1), "--batch-size": (batch_size, 2), "--frames": (frames, 1),
                   "--words": (words, 1), **({"--dim": (min(dims), 1)} if dims else {})})
    for method in [versus, *(methods or [])]:
        head_class(method)  # an unknown head fails before anything runs
    if features is not None:
        from tvrpipe.features.store import open_store

        if dims:
            raise ConfigError("--dim: with --features the store's width is the step's")
        dims, features = [int(open_store(features).provenance["embed_dim"])], str(features)
    dims = dims or [64, 512]
    check_room("bench step", None, batch_needs(batch_size, frames, words, max(dims)), "--batch-size or --dim")
    plan = {f"{method} and {versus} at D = {dim}": (method, dim) for dim in dims
            for method in (methods or [m for m in list_heads() if m != versus])}
    rows = []
    for what in stages(list(plan)):
        method, dim = plan[what]
        rows.append(in_fresh_process(_step_rates, (method, versus, dim, steps, batch_size, frames, words, features),
                                     what))
    return rows
