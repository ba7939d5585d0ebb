"""``tvrpipe bench train-head``: training and evaluation cost per head at MSR-VTT 9k / 1k-A scale.

On a generated store the size of MSR-VTT 9k/1k-A (9,000 train videos x 12 x 512 frames,
180,000 captions x 32 x 512 tokens, 1,000 test pairs; ~5.9 GB of float16), each head runs in a
process of its own (so peak memory is its own) and reports:

- training samples/s and the share of step time spent building batches (target < 10 %);
- the full 1,000 x 1,000 test evaluation time and the memory it adds (resident set sampled
  every 10 ms during the evaluation, minus the resident set before it);
- the process's peak resident memory (the split arrays are float16: never a float32 copy).

For scale: the official X-Pool evaluation code on random features of the 1k-A size took 63 s
and peaked at 8.4 GB on this machine (issue 4). Target: X-Pool >= 5x faster, < 2 GB extra.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import threading
import time
from pathlib import Path

from tvrpipe.pipeline.genstore import GenSpec, generate_store

MSRVTT_9K = GenSpec(train_videos=9000, val_videos=0, test_videos=1000, captions_per_train_video=20,
                    captions_per_test_video=1, frames=12, max_words=32, embed_dim=512, seed=0)
XPOOL_OFFICIAL = {"eval_seconds": 63.0, "peak_gb": 8.4}


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

    from tvrpipe.pipeline.store import open_store
    from tvrpipe.training.data import load_splits
    from tvrpipe.training.fit import TrainConfig, _evaluate, fit, load_head

    store_dir, method, steps, batch, run_dir, prefetch = args
    torch.set_num_threads(os.cpu_count() or 1)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: fit() would resume a finished one
    cfg = TrainConfig(epochs=1, batch_size=batch, seed=0, prefetch=prefetch)  # one epoch capped at `steps` steps: enough for a rate
    t = time.perf_counter()
    metrics = fit(store_dir, method, run_dir, cfg, progress=False, max_steps=steps)
    fit_seconds = time.perf_counter() - t
    splits = load_splits(open_store(store_dir))
    head = load_head(Path(run_dir) / "checkpoints" / "best.safetensors")
    with _PeakRss() as mem:
        t = time.perf_counter()
        _evaluate(head, splits.test, cfg)
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
    from tvrpipe.heads.base import list_heads

    out = Path(out_dir)
    store = generate_store(out / "store", spec, progress=True)
    results = []
    ctx = mp.get_context("spawn")
    for method in methods or list_heads():
        with ctx.Pool(1) as pool:
            results.append(pool.apply(_one_method, ((str(store), method, steps, batch_size,
                                                      str(out / "runs" / method), prefetch),)))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return results
