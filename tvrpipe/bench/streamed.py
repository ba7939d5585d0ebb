"""``tvrpipe bench train-head --streamed``: training on a store larger than the memory it may use.

Three runs, each in a process of its own (peak memory is its own):

1. **Larger than the budget.** A generated store whose training features (what an in-memory run would hold)
   are ``factor`` times ``--memory-budget`` trains one epoch streamed under that budget. Its peak resident
   memory is compared with the budget plus the model: the peak of the same run on a store with the same
   shapes and the same validation and test sets but only two batches of training videos (the head, its
   optimizer, a step's activations and evaluation: all that does not grow with the store). The data path alone
   is also measured: one streamed epoch in a process without a model, and the memory it adds.
2. **Both ways on a store that fits.** A smaller generated store (its features a quarter of the budget)
   trains the same epochs in memory and streamed (a budget of a third of its features, so its shuffle buffer
   holds the same share of the split as run 1's). Throughput is samples/s of the training steps, batch
   building included; validation R@1 is compared with the binomial noise of the difference of two runs on the
   same validation captions.

Targets: peak RSS under budget + model; streamed throughput >= 0.8x in memory; validation R@1 within noise.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tvrpipe.bench.extract import in_fresh_process
from tvrpipe.bench.room import Needs, check_room, stores_needs
from tvrpipe.features.genstore import GenSpec, generate_store
from tvrpipe.progress import stages

COMMAND = "bench train-head --streamed"
VIDEO_SHARD = 64  # generate_store's videos per chunk: a read block is whole chunks
COMMAND_NAME = f"tvrpipe {COMMAND}"


def _fit_one(args: tuple[str, str, str, int, int, int | None, int]) -> dict:
    """One train-head run in a fresh process: its metrics, data record and peak RSS."""
    import torch
    import yaml

    from tvrpipe.training.fit import TrainConfig, fit

    store, method, run, epochs, batch, budget, seed = args
    torch.set_num_threads(os.cpu_count() or 1)
    shutil.rmtree(run, ignore_errors=True)
    metrics = fit(store, method, run, TrainConfig(epochs=epochs, batch_size=batch, memory_budget=budget, seed=seed),
                  progress=False)
    data = yaml.safe_load((Path(run) / "config.yaml").read_text())["data"]
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "data": data,
            "samples_per_s": metrics["train"]["samples_per_s"], "data_share": metrics["train"]["data_share"],
            "val_r1": metrics["val"]["t2v"]["R@1"], "val_n": metrics["val"]["t2v"]["n"],
            "seconds": metrics["train"]["seconds"]}


def _stream_alone(args: tuple[str, str, int, int]) -> dict:
    """In a fresh process with no model: one streamed epoch of ``store`` under ``budget``, and the resident memory
    it adds to the process (its peak minus the resident set once the store is open and the epoch planned)."""
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.allocator import tune_allocator
    from tvrpipe.training.data import store_split_rows
    from tvrpipe.training.stream import StreamedPairs, open_splits, plan_data

    store, method, batch, budget = args
    tune_allocator()  # as fit does
    s = open_store(store)
    rows, tokens = store_split_rows(s), head_class(method).uses_tokens
    plan = plan_data(s, rows, tokens, batch, budget)
    pairs = StreamedPairs(open_splits(s, rows, plan, tokens).train, plan, tokens)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = 0
    for vids, *_ in pairs.epoch(0, 0, pairs.split.n_videos // batch, batch):
        n += len(vids)
    return {"added": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, "pairs": n}


def _needs(store: Path, method: str, batch: int, budget: int | None) -> tuple[int, bool]:
    """What the store's splits would hold in memory for ``method``, and whether ``budget`` streams them."""
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.data import store_split_rows
    from tvrpipe.training.stream import plan_data

    s = open_store(store)
    plan = plan_data(s, store_split_rows(s), head_class(method).uses_tokens, batch, budget)
    return plan.needs, plan.streamed


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@dataclass(frozen=True)
class StreamedBench:
    """The figures of :func:`bench_streamed` (bytes, samples/s, R@1 points)."""

    method: str
    budget: int
    large_needs: int
    large_disk: int
    large_videos: int
    model_peak: int
    stream_added: int
    large_peak: int
    large_samples_per_s: float
    large_data: dict
    small_videos: int
    small_needs: int
    memory_samples_per_s: float
    streamed_samples_per_s: float
    memory_val_r1: float
    streamed_val_r1: float
    val_n: int
    memory_peak: int
    streamed_peak: int

    @property
    def store_factor(self) -> float:
        return self.large_needs / self.budget

    @property
    def under_budget(self) -> bool:
        return self.large_peak <= self.budget + self.model_peak

    @property
    def throughput_ratio(self) -> float:
        return self.streamed_samples_per_s / self.memory_samples_per_s

    @property
    def noise_sd(self) -> float:
        """The sd (points) of the difference of two runs' R@1 on ``val_n`` captions, as independent binomials."""
        p = min(max((self.memory_val_r1 + self.streamed_val_r1) / 200, 1 / self.val_n), 1 - 1 / self.val_n)
        return 100 * math.sqrt(2 * p * (1 - p) / self.val_n)

    @property
    def within_noise(self) -> bool:
        return abs(self.memory_val_r1 - self.streamed_val_r1) <= 2 * self.noise_sd

    def record(self) -> dict:
        return {**asdict(self), "store_factor": self.store_factor, "under_budget": self.under_budget,
                "throughput_ratio": self.throughput_ratio, "noise_sd": self.noise_sd,
                "within_noise": self.within_noise}


def _spec(videos: int, frames: int, words: int, dim: int, seed: int, val: int = 0) -> GenSpec:
    # one caption a training video: a streamed epoch reads one anyway, and the store's disk stays near its features
    return GenSpec(train_videos=videos, val_videos=val, test_videos=500, captions_per_train_video=1, frames=frames,
                   max_words=words, embed_dim=dim, seed=seed)


def bench_streamed(out_dir: str | os.PathLike[str], budget: int = 10**9, factor: float = 3.0, method: str = "tokenwise",
                   epochs: int = 1, batch_size: int = 128, frames: int = 12, words: int = 8, dim: int = 512,
                   seed: int = 0, progress: bool = True) -> StreamedBench:
    """Run the three measurements of the module docstring under ``out_dir`` (stores generated once, reused).

    Example:
        >>> bench_streamed("bench/streamed", budget=2 * 10**9).record()  # doctest: +SKIP
    """
    from tvrpipe.bench.heads import at_least_each
    from tvrpipe.errors import ConfigError
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.data import store_split_rows
    from tvrpipe.training.stream import BUFFER_SHARE, block_size, gb

    at_least_each({"--epochs": (epochs, 1), "--batch-size": (batch_size, 2)})
    if not factor >= 1:
        raise ConfigError(f"--store-factor must be >= 1, got {factor}")
    uses_tokens = head_class(method).uses_tokens
    out = Path(out_dir)
    # a training pair's in-memory bytes (video, caption, its tokens), to size the stores before making them
    each = frames * dim * 2 + frames + dim * 2 + (words * (dim * 2 + 1) if uses_tokens else 0)
    # the streamed runs' shuffle buffer must hold a batch and a read block (as plan_data refuses it), said before the
    # stores are generated
    buffer = int(budget * BUFFER_SHARE) // each
    if buffer < batch_size + block_size(VIDEO_SHARD, buffer):
        raise ConfigError(f"--memory-budget {gb(budget)}: a streamed run's shuffle buffer ({BUFFER_SHARE:.0%} of it) "
                          f"must hold a batch and a read block ({batch_size + block_size(VIDEO_SHARD, buffer)} pairs "
                          f"of {each:,} bytes); give a larger --memory-budget or a smaller --batch-size")
    large_videos = math.ceil(factor * budget / each * 1.02) + 1500  # + the carved validation and test videos
    small_videos = max(4 * batch_size, int(budget / 4 / each))
    specs = {f"large-{large_videos}": _spec(large_videos, frames, words, dim, seed),
             f"small-{small_videos}": _spec(small_videos, frames, words, dim, seed),
             # the model alone's store: its validation set is carved from the large one's, up to 1,000 videos
             "model-*": _spec(2 * batch_size, frames, words, dim, seed, val=1000)}
    budget_needs = Needs(memory=budget, memory_what="the --memory-budget")
    check_room(COMMAND, out, stores_needs({out / name: spec for name, spec in specs.items()}) + budget_needs,
               "--memory-budget or --store-factor")
    large = generate_store(out / f"large-{large_videos}", specs[f"large-{large_videos}"],
                           progress=progress, made_by=COMMAND_NAME)
    small = generate_store(out / f"small-{small_videos}", specs[f"small-{small_videos}"],
                           progress=progress, made_by=COMMAND_NAME)
    large_needs, streamed = _needs(large, method, batch_size, budget)
    if not streamed:
        raise ConfigError(f"the large store ({large_needs:,} bytes) fits the budget: nothing to stream")
    small_needs, _ = _needs(small, method, batch_size, None)
    # the model alone: the large run's validation (carved: up to 1,000 videos) and test sets, two batches of training
    val = len(store_split_rows(open_store(large)).val_videos)
    alone = generate_store(out / f"model-{val}", _spec(2 * batch_size, frames, words, dim, seed, val=val),
                           progress=False, made_by=COMMAND_NAME)
    runs = {  # each in a process of its own, minutes each: a bar of the stages, with the time they take
        "model": (_fit_one, (str(alone), method, str(out / "runs" / "model"), epochs, batch_size, None, seed),
                  f"{method}: the model alone"),
        "alone": (_stream_alone, (str(large), method, batch_size, budget), f"{method}: the streamed epoch alone"),
        "big": (_fit_one, (str(large), method, str(out / "runs" / "large-streamed"), epochs, batch_size, budget,
                           seed), f"{method}: streamed, larger than the budget"),
        "mem": (_fit_one, (str(small), method, str(out / "runs" / "small-memory"), epochs, batch_size, None, seed),
                f"{method}: in memory"),
        "stream": (_fit_one, (str(small), method, str(out / "runs" / "small-streamed"), epochs, batch_size,
                              small_needs // 3, seed), f"{method}: streamed, a store that fits")}
    named = {what: key for key, (_, _, what) in runs.items()}
    done = {named[what]: in_fresh_process(*runs[named[what]]) for what in stages(list(named), progress)}
    model, alone_stream = done["model"]["peak_rss"], done["alone"]["added"]
    big, mem, stream = done["big"], done["mem"], done["stream"]
    if mem["data"]["mode"] != "in memory" or stream["data"]["mode"] != "streamed" or big["data"]["mode"] != "streamed":
        raise RuntimeError(f"the runs read their data otherwise than planned: {mem['data']}, {stream['data']}, "
                           f"{big['data']}")
    return StreamedBench(
        method=method, budget=budget, large_needs=large_needs, large_disk=_disk_bytes(large), large_videos=large_videos,
        model_peak=model, stream_added=alone_stream, large_peak=big["peak_rss"], large_samples_per_s=big["samples_per_s"], large_data=big["data"],
        small_videos=small_videos, small_needs=small_needs, memory_samples_per_s=mem["samples_per_s"],
        streamed_samples_per_s=stream["samples_per_s"], memory_val_r1=mem["val_r1"], streamed_val_r1=stream["val_r1"],
        val_n=mem["val_n"], memory_peak=mem["peak_rss"], streamed_peak=stream["peak_rss"])
