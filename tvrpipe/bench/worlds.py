"""``tvrpipe bench worlds``: every head against zero-shot CLIP on the calibrated generated worlds.

Two worlds with real CLIP ViT-B/32's statistics on MSR-VTT (:mod:`tvrpipe.worlds.stats`): one scene
per video with whole-video captions (``worlds.features.ONE_SCENE``), and the benchmark world with multi-scene
videos, partial captions and near-duplicates (``worlds.features.CALIBRATED``). On each, every trainable head is
trained with train-head's default lr and open-ended schedule, shortened for a CPU (patience ``patience``
epochs, at most ``max_epochs``, no scaling to 300 steps) or, with ``full_schedule``, train-head's defaults as they are,
then again with ``zero_shot_start`` (not in the papers), and its test t2v R@1 is set beside zero-shot
CLIP's on the same 1,000 test queries: a 95 % bootstrap interval over the queries, and the paired
bootstrap interval of the difference, which says whether the head beats zero-shot, trails it, or is
within noise of it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tvrpipe.bench.room import Needs, check_room, stores_needs
from tvrpipe.errors import ConfigError
from tvrpipe.worlds.features import CALIBRATED, ONE_SCENE, GenSpec, generate_store

log = logging.getLogger(__name__)

WORLDS = {"onescene": ONE_SCENE, "multiscene": CALIBRATED}
# Worlds of fixed sizes: the synth presets (train-head's stores of few and of many steps an epoch) and bench
# search's benchmark; --train-videos and --dim do not apply to them.
SIZED = ("small", "medium", "msrvtt9k", "search")
# meanpool and tokenwise have no parameter that changes a ranking: their untrained rows are the reference
HEADS = ("xpool", "seqtransf", "tmass", "uatvr", "prota", "duq")
MADE_BY = "tvrpipe bench worlds"


def world_spec(world: str, train_videos: int, dim: int, seed: int = 0, fields: dict | None = None) -> GenSpec:
    """The store of ``world``.

    ``onescene`` and ``multiscene``: ``train_videos`` train videos x 4 captions, a validation split of a quarter
    of that (at most 1,000), 1,000 test videos (MSR-VTT 1k-A's size, the targets' gallery), D = ``dim``. The
    :data:`SIZED` worlds keep their own sizes: the ``synth --features-only`` presets ``small``, ``medium`` and
    ``msrvtt9k`` (at ``seed``), and ``search``, the heads' benchmark of ``bench search`` (2,000 train videos,
    500 test, D = 512). ``fields``: generator fields set on top (``--set``), e.g. ``multi_scene`` for a sweep or
    ``caption_shift=0`` for the world without its learnable share.
    """
    from dataclasses import replace

    if world in WORLDS:
        spec = GenSpec(train_videos=train_videos, val_videos=min(1000, max(2, train_videos // 4)), test_videos=1000,
                       captions_per_train_video=4, embed_dim=dim, seed=seed, **WORLDS[world])
    elif world == "search":
        import inspect

        from tvrpipe.bench.search import bench_search, benchmark_spec, collection_spec

        default = {k: p.default for k, p in inspect.signature(bench_search).parameters.items()}
        spec = benchmark_spec(collection_spec(1000, default["dim"], seed=seed), default["train_videos"])
    elif world in SIZED:
        from tvrpipe.worlds.features import PRESETS

        spec = replace(PRESETS[world], seed=seed)
    else:
        raise ConfigError(f"--world {world!r} is not one of: {', '.join((*WORLDS, *SIZED))}")
    spec = replace(spec, **(fields or {}))
    spec.validate("--set")
    return spec


@dataclass
class Row:
    """One trained head on one world, against zero-shot CLIP on the same test queries."""

    world: str
    method: str
    zero_shot_start: bool
    lr: float
    selected_epoch: int
    epochs_run: int
    untrained_val_r1: float
    first_epoch_val_r1: float
    val_r1: float
    test_r1: float
    test_low: float
    test_high: float
    zero_shot_r1: float
    diff: float
    diff_low: float
    diff_high: float
    seconds: float
    full_schedule: bool = False

    @property
    def verdict(self) -> str:
        if self.diff_low > 0:
            return "beats zero-shot"
        if self.diff_high < 0:
            return "trails zero-shot"
        return "within noise"


def bench_worlds(out_dir: str | os.PathLike[str], worlds: list[str] | None = None, methods: list[str] | None = None,
                 train_videos: int = 1000, dim: int = 512, max_epochs: int = 20, patience: int = 4, seed: int = 0,
                 progress: bool = True, fields: dict | None = None, zero_shot_start: bool = True,
                 full_schedule: bool = False) -> list[Row]:
    """Train every head of ``methods`` with its defaults (and with ``zero_shot_start``) on each world.

    Runs already complete under ``out_dir`` are read, not trained again (rerun to resume). ``fields``: generator
    fields set on every world (see :func:`world_spec`); ``zero_shot_start``: also train each head from zero-shot;
    ``full_schedule``: train-head's own default schedule (``max_epochs`` and ``patience`` unused), what a user's
    ``tvrpipe train-head`` runs; its runs are kept apart (``NAME-full``) from the shortened schedule's.

    Returns:
        One :class:`Row` per (world, head, variant); also written to ``worlds.json`` and ``worlds.md``.
    """
    from tvrpipe.evaluation.metrics import bootstrap_recall, paired_recall_difference
    from tvrpipe.heads.base import head_class
    from tvrpipe.rundir import read_epochs, read_metrics, read_test_ranks
    from tvrpipe.training.fit import fit
    from tvrpipe.training.settings import TrainConfig

    worlds = worlds or list(WORLDS)
    methods = methods or list(HEADS)
    for method in methods:
        head_class(method)
    out = Path(out_dir)
    specs = {out / "stores" / world: world_spec(world, train_videos, dim, seed, fields) for world in worlds}
    check_room("bench worlds", out, stores_needs(specs) + Needs(
        memory=max(spec.store_bytes() for spec in specs.values()),
        memory_what="the largest world's features, trained in memory"), "--train-videos or --dim")
    rows: list[Row] = []
    for world in worlds:
        store = generate_store(out / "stores" / world, specs[out / "stores" / world], progress=progress,
                               wait=True, made_by=MADE_BY)

        def run(method: str, name: str, cfg: TrainConfig, overrides: dict) -> tuple[dict, Path]:
            d = out / "runs" / world / name
            m = read_metrics(d) if (d / "metrics.json").exists() else None
            if m is None:
                m = fit(store, method, d, cfg, overrides, progress=progress)
            return m, d

        _, zd = run("meanpool", "zero-shot", TrainConfig(epochs=0, seed=seed), {})
        zero = read_test_ranks(zd)["t2v"]
        zero_r1 = 100.0 * float((zero <= 1).mean())
        for method in methods:
            for zs in (False, True) if zero_shot_start else (False,):
                name = (f"{method}-zero-shot-start" if zs else method) + ("-full" if full_schedule else "")
                cfg = TrainConfig(seed=seed) if full_schedule else TrainConfig(
                    max_epochs=max_epochs, patience=patience, min_steps=0, seed=seed)
                m, d = run(method, name, cfg, {"zero_shot_start": True} if zs else {})
                first = read_epochs(d)["val_t2v_R@1"]
                ranks = read_test_ranks(d)["t2v"]
                lo, hi = bootstrap_recall(ranks)
                diff, dlo, dhi = paired_recall_difference(ranks, zero)
                row = Row(world=world, method=method, zero_shot_start=zs, lr=m["schedule"]["lr"],
                          selected_epoch=m["selected_epoch"], epochs_run=m["schedule"]["epochs_run"],
                          untrained_val_r1=m["untrained_val"]["t2v"]["R@1"],
                          first_epoch_val_r1=float(first.iloc[0]) if len(first) else float("nan"),
                          val_r1=m["val"]["t2v"]["R@1"],
                          test_r1=m["test"]["t2v"]["R@1"], test_low=lo, test_high=hi, zero_shot_r1=zero_r1,
                          diff=diff, diff_low=dlo, diff_high=dhi, seconds=m["train"]["seconds"],
                          full_schedule=full_schedule)
                rows.append(row)
                log.warning("%s %s%s: test R@1 %.1f [%.1f, %.1f], zero-shot %.1f: %s", world, method,
                            " (zero-shot start)" if zs else "", row.test_r1, lo, hi, zero_r1, row.verdict)
                _write(out, rows)
    return rows


def _write(out: Path, rows: list[Row]) -> None:
    from tvrpipe.files import atomic_write_text

    atomic_write_text(out / "worlds.json", json.dumps([{**asdict(r), "verdict": r.verdict} for r in rows], indent=1))
    lines = ["| world | head | start | schedule | lr | epoch (of) | val R@1 untrained → epoch 1 → selected | test R@1 [95 %] | "
             "zero-shot | difference [95 %] | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        start = "zero-shot start" if r.zero_shot_start else "paper's"
        schedule = "train-head's" if r.full_schedule else "short"
        lines.append(f"| {r.world} | {r.method} | {start} | {schedule} | {r.lr:g} | {r.selected_epoch} ({r.epochs_run}) | "
                     f"{r.untrained_val_r1:.1f} → {r.first_epoch_val_r1:.1f} → {r.val_r1:.1f} | {r.test_r1:.1f} [{r.test_low:.1f}, {r.test_high:.1f}]"
                     f" | {r.zero_shot_r1:.1f} | {r.diff:+.1f} [{r.diff_low:+.1f}, {r.diff_high:+.1f}] | {r.verdict} |")
    atomic_write_text(out / "worlds.md", "\n".join(lines) + "\n")
