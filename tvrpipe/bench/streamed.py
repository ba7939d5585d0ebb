"""``tvrpipe bench train-head --streamed``: training on a store larger than the memory it may use.

Three runs, each in a process of its own (peak memory is its own), on generated stores of the calibrated world
(whose learnable share moves a trained head's ranking):

1. **Larger than the budget.** A generated store whose training features (what an in-memory run would hold)
   are ``factor`` times ``--memory-budget`` trains one epoch streamed under that budget. Its validation and test
   splits are large: each as many videos as make one evaluation (the head's embeddings and two score matrices)
   about a quarter of the budget, which the plan keeps out of the shuffle buffer's share. Its peak resident
   memory is compared with the budget plus the model: the peak of a run of the same head, trained for as many
   steps as the large run, on a store of the same shapes whose training split gives those steps in at most
   :data:`MODEL_EPOCHS` epochs, streamed through a shuffle buffer of :data:`MODEL_BUFFER` batches, with one batch
   each of validation and test videos (the head, its optimizer, a step's activations, the streaming itself and
   what the allocator keeps after that many steps: what does not grow with the store or the budget). The data
   path alone is also measured: one streamed epoch in a process without a model, and the memory it adds.
2. **Both ways on a store that fits.** A smaller generated store (its features a quarter of the budget)
   trains the same epochs in memory and streamed (a budget of a third of its features beside its evaluation and
   tables, so its shuffle buffer holds the same share of the split as run 1's). Throughput is samples/s of the
   training steps, batch building included. Both runs are judged on the epochs they trained, not on the one
   selected (the untrained head competes in selection): the last epoch's loss and validation R@1, against the
   untrained validation R@1 and against each other (the binomial noise of the difference of two runs on the
   same validation captions).

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
from tvrpipe.progress import stages
from tvrpipe.worlds.features import CALIBRATED, GenSpec, generate_store

COMMAND = "bench train-head --streamed"
VIDEO_SHARD = 64  # generate_store's videos per chunk: a read block is whole chunks
COMMAND_NAME = f"tvrpipe {COMMAND}"
EVAL_SHARE = 0.25  # of the budget: about what one evaluation of the large store's validation or test split holds
# the model alone: its steps in few epochs (each validates and checkpoints: a thousand two-step epochs took 45 minutes
# at 1 GB), its data streamed through a buffer of a few batches, so that what it holds of its data stays small
MODEL_EPOCHS = 4
MODEL_BUFFER = 4


def _fit_one(args: tuple[str, str, str, int, int, int | None, int]) -> dict:
    """One train-head run in a fresh process: its metrics, data record, peak RSS, and its last trained epoch's loss
    and validation R@1 beside the untrained head's."""
    import pandas as pd
    import torch
    import yaml

    from tvrpipe.training.fit import TrainConfig, fit

    store, method, run, epochs, batch, budget, seed = args
    torch.set_num_threads(os.cpu_count() or 1)
    shutil.rmtree(run, ignore_errors=True)
    metrics = fit(store, method, run, TrainConfig(epochs=epochs, batch_size=batch, memory_budget=budget, seed=seed),
                  progress=False)
    data = yaml.safe_load((Path(run) / "config.yaml").read_text())["data"]
    last = pd.read_csv(Path(run) / "epochs.csv").iloc[-1]
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "data": data,
            "samples_per_s": metrics["train"]["samples_per_s"], "data_share": metrics["train"]["data_share"],
            "val_r1": float(last["val_t2v_R@1"]), "loss": float(last["loss"]),
            "untrained_r1": metrics["untrained_val"]["t2v"]["R@1"], "val_n": metrics["val"]["t2v"]["n"],
            "test_n": metrics["test"]["t2v"]["n"], "seconds": metrics["train"]["seconds"]}


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
    plan = plan_data(s, rows, tokens, batch, budget, _head(s, method))
    pairs = StreamedPairs(open_splits(s, rows, plan, tokens).train, plan, tokens)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    n = 0
    for vids, *_ in pairs.epoch(0, 0, pairs.split.n_videos // batch, batch):
        n += len(vids)
    return {"added": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, "pairs": n}


def _head(store, method: str):
    """A head of ``method`` for ``store`` (its embeddings size the plan's evaluation, as train-head's do)."""
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.fit import store_head_config

    return head_class(method)(store_head_config(store, method))


def model_budget(store: Path, method: str, batch: int) -> int:
    """A budget under which train-head streams ``store`` through a shuffle buffer of :data:`MODEL_BUFFER` batches,
    beside its evaluation and tables (the model alone's run)."""
    from tvrpipe.features.store import open_store
    from tvrpipe.training.stream import BUFFER_SHARE, pair_bytes

    plan = _plan(store, method, batch, None)
    each = pair_bytes(open_store(store), plan.widths.get("train", 0))
    return plan.evaluation + plan.tables + math.ceil(MODEL_BUFFER * batch * each / BUFFER_SHARE)


def _plan(store: Path, method: str, batch: int, budget: int | None):
    """The data plan train-head makes of ``store`` for ``method`` under ``budget``."""
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.data import store_split_rows
    from tvrpipe.training.stream import plan_data

    s = open_store(store)
    return plan_data(s, store_split_rows(s), head_class(method).uses_tokens, batch, budget, _head(s, method))


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
    large_test_videos: int
    large_evaluation: int  # what the plan counted for one evaluation (of the large test split)
    large_tables: int
    model_peak: int
    stream_added: int
    large_peak: int
    large_samples_per_s: float
    large_data: dict
    small_videos: int
    small_needs: int
    memory_samples_per_s: float
    streamed_samples_per_s: float
    memory_val_r1: float  # the last trained epoch's (not the selected one's)
    streamed_val_r1: float
    untrained_val_r1: float
    memory_loss: float  # the last trained epoch's mean loss
    streamed_loss: float
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

    @property
    def both_trained(self) -> bool:
        """Both runs' last trained epoch validates above the untrained head, by more than the noise."""
        return min(self.memory_val_r1, self.streamed_val_r1) > self.untrained_val_r1 + 2 * self.noise_sd

    def record(self) -> dict:
        return {**asdict(self), "store_factor": self.store_factor, "under_budget": self.under_budget,
                "throughput_ratio": self.throughput_ratio, "noise_sd": self.noise_sd,
                "within_noise": self.within_noise, "both_trained": self.both_trained}


def _spec(videos: int, frames: int, words: int, dim: int, seed: int, val: int = 0, test: int = 500) -> GenSpec:
    # one caption a training video: a streamed epoch reads one anyway, and the store's disk stays near its features
    return GenSpec(train_videos=videos, val_videos=val, test_videos=test, captions_per_train_video=1, frames=frames,
                   max_words=words, embed_dim=dim, seed=seed, **CALIBRATED)


def eval_videos(budget: int, per_text: int, per_video: int) -> int:
    """The test videos (one caption each) whose evaluation holds about :data:`EVAL_SHARE` of ``budget``: n with
    8 n^2 (two float32 score matrices) + n (``per_text`` + ``per_video``, the embeddings) = the share; at least 2."""
    share, b = EVAL_SHARE * budget, per_text + per_video
    return max(2, int((-b + math.sqrt(b * b + 32 * share)) / 16))


def bench_streamed(out_dir: str | os.PathLike[str], budget: int = 10**9, factor: float = 3.0, method: str = "xpool",
                   epochs: int = 1, batch_size: int = 128, frames: int = 12, words: int = 8, dim: int = 512,
                   seed: int = 0, progress: bool = True) -> StreamedBench:
    """Run the three measurements of the module docstring under ``out_dir`` (stores generated once, reused).

    Example:
        >>> bench_streamed("bench/streamed", budget=2 * 10**9).record()  # doctest: +SKIP
    """
    from tvrpipe.bench.heads import at_least_each
    from tvrpipe.errors import ConfigError

    at_least_each({"--epochs": (epochs, 1), "--batch-size": (batch_size, 2)})
    if not factor >= 1:
        raise ConfigError(f"--store-factor must be >= 1, got {factor}")
    out = Path(out_dir)
    specs = _specs(budget, factor, method, batch_size, frames, words, dim, seed, epochs)
    budget_needs = Needs(memory=budget, memory_what="the --memory-budget")
    check_room(COMMAND, out, stores_needs({out / name: spec for name, spec in specs.items()}) + budget_needs,
               "--memory-budget or --store-factor")
    stores = {name.split("-")[0]: generate_store(out / name, spec, progress=progress and name != "model",
                                                 made_by=COMMAND_NAME) for name, spec in specs.items()}
    large_plan = _plan(stores["large"], method, batch_size, budget)
    if not large_plan.streamed:
        raise ConfigError(f"the large store ({large_plan.needs:,} bytes) fits the budget: nothing to stream")
    small_plan = _plan(stores["small"], method, batch_size, None)
    # the small store streamed: a third of its features beside its evaluation and tables
    small_budget = small_plan.needs // 3 + small_plan.evaluation + small_plan.tables
    # the model alone takes as many steps as the large run (its store gives them in at most MODEL_EPOCHS epochs)
    steps = epochs * (specs_videos(specs, "large") // batch_size)
    model_epochs = math.ceil(steps / (specs_videos(specs, "model") // batch_size))
    runs = {  # each in a process of its own, minutes each: a bar of the stages, with the time they take
        "model": (_fit_one, (str(stores["model"]), method, str(out / "runs" / "model"), model_epochs, batch_size,
                             model_budget(stores["model"], method, batch_size), seed), f"{method}: the model alone"),
        "alone": (_stream_alone, (str(stores["large"]), method, batch_size, budget),
                  f"{method}: the streamed epoch alone"),
        "big": (_fit_one, (str(stores["large"]), method, str(out / "runs" / "large-streamed"), epochs, batch_size,
                           budget, seed), f"{method}: streamed, larger than the budget"),
        "mem": (_fit_one, (str(stores["small"]), method, str(out / "runs" / "small-memory"), epochs, batch_size, None,
                           seed), f"{method}: in memory"),
        "stream": (_fit_one, (str(stores["small"]), method, str(out / "runs" / "small-streamed"), epochs, batch_size,
                              small_budget, seed), f"{method}: streamed, a store that fits")}
    named = {what: key for key, (_, _, what) in runs.items()}
    done = {named[what]: in_fresh_process(*runs[named[what]]) for what in stages(list(named), progress)}
    big, mem, stream = done["big"], done["mem"], done["stream"]
    modes = {"mem": "in memory", "stream": "streamed", "big": "streamed", "model": "streamed"}
    if any(done[key]["data"]["mode"] != mode for key, mode in modes.items()):
        raise RuntimeError("the runs read their data otherwise than planned: "
                           + ", ".join(f"{key}: {done[key]['data']}" for key in modes))
    return StreamedBench(
        method=method, budget=budget, large_needs=large_plan.needs, large_disk=_disk_bytes(stores["large"]),
        large_videos=specs_videos(specs, "large"), large_test_videos=big["test_n"],
        large_evaluation=large_plan.evaluation, large_tables=large_plan.tables, model_peak=done["model"]["peak_rss"],
        stream_added=done["alone"]["added"], large_peak=big["peak_rss"], large_samples_per_s=big["samples_per_s"],
        large_data=big["data"], small_videos=specs_videos(specs, "small"), small_needs=small_plan.needs,
        memory_samples_per_s=mem["samples_per_s"], streamed_samples_per_s=stream["samples_per_s"],
        memory_val_r1=mem["val_r1"], streamed_val_r1=stream["val_r1"], untrained_val_r1=mem["untrained_r1"],
        memory_loss=mem["loss"], streamed_loss=stream["loss"], val_n=mem["val_n"], memory_peak=mem["peak_rss"],
        streamed_peak=stream["peak_rss"])


def specs_videos(specs: dict[str, GenSpec], kind: str) -> int:
    """The training videos of the ``kind`` store (``large``, ``small``, ``model``) of :func:`_specs`."""
    return next(spec.train_videos for name, spec in specs.items() if name.startswith(f"{kind}-"))


def _specs(budget: int, factor: float, method: str, batch: int, frames: int, words: int, dim: int,
           seed: int, epochs: int = 1) -> dict[str, GenSpec]:
    """The three stores' specs (by folder name): the large one (``factor`` x the budget of training features, a test
    split whose evaluation is about :data:`EVAL_SHARE` of the budget), the small one (a quarter of the budget) and
    the model alone's (as many training batches as give the large run's ``epochs`` epochs of steps in at most
    :data:`MODEL_EPOCHS` epochs, at least two; one batch each of validation and test videos).

    Raises:
        ConfigError: the budget cannot hold a streamed run's shuffle buffer (a batch and a read block) beside the
            large store's evaluation, said before any store is generated (as train-head's plan would refuse it).
    """
    from tvrpipe.errors import ConfigError
    from tvrpipe.files import gb
    from tvrpipe.heads.base import create_head
    from tvrpipe.training.stream import BUFFER_SHARE, block_size, item_bytes

    head = create_head(method, embed_dim=dim)
    # a training pair's in-memory bytes (video, caption, its tokens), and the head's embeddings of an evaluated
    # caption and video
    each = frames * dim * 2 + frames + dim * 2 + (words * (dim * 2 + 1) if head.uses_tokens else 0)
    per_text, per_video = item_bytes(head, frames, words if head.uses_tokens else 0)
    test = eval_videos(budget, per_text, per_video)  # the validation split as large: one evaluation at a time
    evaluation = 2 * 4 * test * test + test * (per_text + per_video)
    buffer = int(max(0, budget - evaluation) * BUFFER_SHARE) // each
    if buffer < batch + block_size(VIDEO_SHARD, max(buffer, 1)):
        raise ConfigError(f"--memory-budget {gb(budget)}: a streamed run's shuffle buffer ({BUFFER_SHARE:.0%} of what "
                          f"it leaves beside an evaluation of {gb(evaluation)}) must hold a batch and a read block "
                          f"({batch + block_size(VIDEO_SHARD, max(buffer, 1))} pairs of {each:,} bytes); give a "
                          f"larger --memory-budget or a smaller --batch-size")
    large = math.ceil(factor * budget / each * 1.02)
    small = max(4 * batch, int(budget / 4 / each))
    model = max(2, math.ceil(epochs * (large // batch) / MODEL_EPOCHS)) * batch
    return {f"large-{large}-t{test}": _spec(large, frames, words, dim, seed, val=test, test=test),
            f"small-{small}": _spec(small, frames, words, dim, seed),
            f"model-{model}": _spec(model, frames, words, dim, seed, val=batch, test=batch)}
