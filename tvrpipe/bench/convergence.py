"""``tvrpipe bench convergence``: does ``train-head``'s default schedule train every head to its
validation optimum? The evidence for the trainer's defaults (docs/training.md).

For each generated store size and each head, three kinds of run, all selected on validation only:

- the **grid**: the papers' schedule (warmup + cosine) for every learning rate in ``lrs`` and
  every epoch count in ``epochs``; its best validation t2v R@1 is the target (a bench run with
  ``no_grid``, for stores where a run costs hours, compares the open-ended runs alone and their
  best is the target);
- the **open-ended schedule at each learning rate** (no ``--epochs``: warmup, constant lr halved
  on plateaus, early stopping): which learning rate it needs, i.e. the head's ``default_lr``;
- the **default**: ``TrainConfig()`` as ``train-head`` runs it with no schedule option.

Outputs in ``out_dir``: ``results.csv`` (one row per run: store, method, schedule, lr, best
validation R@1/R@5, selected epoch, epochs run, seconds), ``curves.csv`` (validation R@1 per
epoch of every run), ``curves.png`` (per store and head: the open-ended curves per learning rate,
the default's, and the grid's best as a line) and ``summary.csv`` (per store and head: the grid's
best and the default, the gap in R@1 points, the default's epochs and wall time). Nothing is
chosen on the test split: each run's ``metrics.json`` has its test metrics (``fit`` evaluates the
selected epoch on test once, at the end), but the bench reads validation only. Rerunning in the same directory reuses the runs already recorded there, in the
tables or as completed run directories, and resumes a run it was interrupted in from its last epoch
(a run's ``seconds`` then sum its epochs' wall times over the sessions); delete the directory after
changing the trainer or a head. The tables keep the runs of other heads and sizes benched there earlier.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from tvrpipe.bench.room import Needs, check_room, stores_needs
from tvrpipe.errors import ConfigError, RunError
from tvrpipe.lock import DirLock
from tvrpipe.rundir import CHECKPOINTS, METRICS_FILE, RunResults, read_epochs, read_results
from tvrpipe.worlds.features import PRESETS, GenSpec, generate_store

log = logging.getLogger(__name__)

LRS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
EPOCHS = (5, 15, 40)


@dataclass
class Run:
    """One training run of the bench."""

    store: str
    method: str
    schedule: str  # "epochs=N" (grid), "open" (no --epochs) or "default"
    lr: float
    val_r1: float
    val_r5: float
    selected_epoch: int
    epochs_run: int
    seconds: float
    curve: list[tuple[int, float]]  # (epoch, validation t2v R@1) of every validated epoch


def _run(store_dir: Path, store: str, method: str, schedule: str, lr: float | None, lr_used: float,
         epochs: int | None, run_dir: Path, base) -> Run:
    """Train one run (``lr`` None: the head's default at the store's width, which is ``lr_used``)."""
    from tvrpipe.training.fit import fit

    cfg = replace(base, epochs=epochs, lr=lr)
    name = f"{store} {method} {schedule} lr {lr_used:g}"

    def epoch_line(row: dict) -> None:  # a 9k run takes hours: one line per epoch shows where it is
        log.warning("%s: epoch %d, val R@1 %.1f (%.0f s)", name, row["epoch"], row["val_t2v_R@1"], row["seconds"])

    try:  # a run interrupted by an earlier bench resumes from its last epoch
        m = fit(store_dir, method, run_dir, cfg, progress=False, on_epoch=epoch_line)
    except (ConfigError, RunError) as e:  # trained under another configuration, or damaged: from scratch
        log.warning("%s: not resumed (%s); training it from scratch", run_dir, e)
        shutil.rmtree(run_dir, ignore_errors=True)
        m = fit(store_dir, method, run_dir, cfg, progress=False, on_epoch=epoch_line)
    seconds = m["train"]["seconds"]  # summed over the sessions of a resumed run
    curve = _curve(run_dir)
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)  # keep the logs, not the weights
    val = RunResults.from_dict(m).val.get("raw", "t2v")
    return Run(store, method, schedule, lr_used, val["R@1"], val["R@5"], m["selected_epoch"],
               m["schedule"]["epochs_run"], seconds, curve)


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    """(epoch, validation t2v R@1) of each row of a run's ``epochs.csv``: every epoch, or every k-th on a store of
    few steps an epoch (docs/training.md)."""
    epochs = read_epochs(run_dir)
    return [(int(e), float(r1)) for e, r1 in zip(epochs["epoch"], epochs["val_t2v_R@1"])]


def bench_convergence(
    out_dir: str | os.PathLike[str],
    sizes: list[str] | dict[str, GenSpec] | None = None,
    methods: list[str] | None = None,
    lrs: tuple[float, ...] = LRS,
    epochs: tuple[int, ...] = EPOCHS,
    progress: bool = True,
    train=None,
    only_default: bool = False,
    no_grid: bool = False,
) -> list[dict]:
    """Run the grid, the open-ended schedule per lr and the default; write tables and curves.

    Args:
        out_dir: working directory (stores are generated once and reused).
        sizes: names of :data:`~tvrpipe.worlds.features.PRESETS` (default: small and medium), or ``{name: GenSpec}``.
        methods: heads (default: every registered head).
        lrs: learning rates of the grid and of the open-ended runs.
        epochs: epoch counts of the grid.
        progress: progress bars while generating stores.
        train: the trainer settings every run starts from (default ``TrainConfig()``, as
            ``train-head`` runs); each run sets its own ``epochs`` and ``lr``.
        only_default: run only the default (no grid, no open-ended runs per lr): what
            ``train-head`` costs with no schedule option, on stores too large for the grid.
        no_grid: run the open-ended schedule at each of ``lrs`` and the default, but not the
            fixed-epoch grid: on a store where the grid costs hours per run (msrvtt9k), the
            learning rates are compared by the open-ended runs alone, and the best of them (the
            default's run, the open-ended schedule at the default lr, among them) is the target the
            default is measured against. Excludes ``only_default``.

    Returns:
        The summary rows (per store and head: grid best, default, gap).

    Example:
        >>> bench_convergence("bench/convergence", ["small"], ["xpool"])  # doctest: +SKIP
    """
    from tvrpipe.heads.base import list_heads
    from tvrpipe.training.fit import TrainConfig

    out = Path(out_dir)
    sizes, methods = _checked(out, sizes, methods or list_heads(), lrs, only_default, no_grid)
    base = train or TrainConfig()
    with DirLock(out, wait=True):  # the tables are shared with benches of other heads in the same --out
        done = _load(out)  # runs of an earlier, interrupted bench in the same directory are reused
    runs: list[Run] = []
    for size, spec in sizes.items():
        # wait=True: benches of other heads started in parallel in the same --out share its stores
        store_dir = generate_store(out / "stores" / size, spec, progress=progress, wait=True,
                                   made_by="tvrpipe bench convergence")
        for method in methods:
            for schedule, lr, e in _schedules(lrs, epochs, only_default, no_grid):
                run = _run_or_reuse(out, store_dir, size, spec, method, schedule, lr, e, base, runs, done)
                runs.append(run)
                log.warning("%s %s %s lr %g: val R@1 %.1f (epoch %d of %d, %.0f s)", size, method, schedule,
                            run.lr, run.val_r1, run.selected_epoch, run.epochs_run, run.seconds)
                _merge_tables(out, runs)
    _merge_tables(out, runs, final=True)
    return _summary(runs)


def _checked(out: Path, sizes, methods: list[str], lrs, only_default: bool, no_grid: bool):
    """The options checked before any store is generated (an unknown size or head, a refused --lr, the room):
    the sizes' specs and the heads."""
    from tvrpipe.errors import ConfigError
    from tvrpipe.heads.base import head_class
    from tvrpipe.training.fit import TrainConfig

    if only_default and no_grid:
        raise ConfigError("--only-default and --no-grid exclude each other: --only-default runs the default "
                          "alone, --no-grid the open-ended run at each --lr as well")
    for lr in lrs:  # each is a run's --lr: refused here, before the stores are generated, as the run would refuse it
        TrainConfig(lr=lr)
    if not isinstance(sizes, dict):
        names = sizes or ["small", "medium"]
        unknown = [s for s in names if s not in PRESETS]
        if unknown:
            raise ConfigError(f"--size {unknown[0]!r} is not one of: {', '.join(PRESETS)}")
        sizes = {name: PRESETS[name] for name in names}
    for method in methods:  # an unknown head fails here, before hours of store generation
        head_class(method)
    check_room("bench convergence", out, stores_needs({out / "stores" / size: spec for size, spec in sizes.items()})
               + Needs(memory=max(spec.store_bytes() for spec in sizes.values()),
                       memory_what="the largest store's features, trained in memory"), "--size")
    return sizes, methods


def _schedules(lrs, epochs, only_default: bool, no_grid: bool) -> list[tuple[str, float | None, int | None]]:
    """Each head's runs: (schedule, lr, epochs) of the grid, the open-ended run at each lr, and the default."""
    plan = [] if only_default or no_grid else [(f"epochs={e}", lr, e) for lr in lrs for e in epochs]
    plan += [] if only_default else [("open", lr, None) for lr in lrs]
    return plan + [("default", None, None)]


def _run_or_reuse(out: Path, store_dir: Path, size: str, spec, method: str, schedule: str, lr: float | None,
                  e: int | None, base, runs: list[Run], done: dict) -> Run:
    """One run: the open-ended run at the default lr stands for the default (the same configuration and seed),
    a run of an earlier bench in ``out`` is reused, any other is trained."""
    from tvrpipe.heads.base import head_class

    lr_used = head_class(method).lr_for(spec.embed_dim) if lr is None else lr
    # the open-ended run at the default lr, of this bench or an earlier one
    same = [r for r in [*runs, *done.values()] if (r.store, r.method, r.schedule, r.lr) ==
            (size, method, "open", lr_used)]
    if schedule == "default" and same:  # the same configuration and seed: the same run
        return replace(same[0], schedule="default")
    if (size, method, schedule, lr_used) in done:
        return done[(size, method, schedule, lr_used)]
    # a default run's folder names its lr: a changed default_lr is a new run
    return _run(store_dir, size, method, schedule, lr, lr_used, e,
                out / "runs" / size / method / f"{schedule}-{lr_used}", base)


def _merge_tables(out: Path, runs: list[Run], final: bool = False) -> None:
    """Write ``runs`` and every run the directory already has (other heads and sizes, of earlier
    benches or of one running beside this one: the tables are read again under ``out``'s lock, so a
    parallel bench's rows are kept); ``final``: the summary tables and ``curves.png`` too."""
    with DirLock(out, wait=True):
        every = _with_earlier(runs, _load(out))
        _write(out, every, _summary(every) if final else None)
        if final:
            _plot(out / "curves.png", every)


def _with_earlier(runs: list[Run], done: dict[tuple[str, str, str, float], Run]) -> list[Run]:
    mine = {(r.store, r.method, r.schedule, r.lr) for r in runs}
    return runs + [r for key, r in done.items() if key not in mine]


def _load(out: Path) -> dict[tuple[str, str, str, float], Run]:
    """Runs recorded in ``results.csv`` / ``curves.csv`` by an earlier bench in ``out``, and runs
    whose directory is complete but which the tables lack (see :func:`_recover`)."""
    runs = _load_tables(out)
    _recover(out, runs)
    widths = {store: _store_width(out, store) for store, _, schedule, _ in runs if schedule == "default"}
    return {key: r for key, r in runs.items()
            if key[2] != "default" or _current_default(key[1], key[3], widths[key[0]])}


def _store_width(out: Path, store: str) -> int | None:
    """D of the bench's store ``store`` (its provenance), or None where it cannot be read (deleted)."""
    from tvrpipe.features.store import StoreError, store_attributes

    try:
        return int(store_attributes(out / "stores" / store)["embed_dim"])
    except (StoreError, KeyError):
        return None


def _current_default(method: str, lr: float, width: int | None) -> bool:
    """A recorded default run is train-head's default only while ``lr`` is still the head's
    ``default_lr`` at the store's ``width``; after a change it is an open-ended run at another lr,
    and the default is rerun."""
    from tvrpipe.errors import ConfigError
    from tvrpipe.heads.base import head_class

    if width is None:  # the store is gone: keep what was measured
        return True
    try:
        return head_class(method).lr_for(width) == lr
    except ConfigError:  # a head no longer registered: keep what was measured
        return True


def _recover(out: Path, runs: dict[tuple[str, str, str, float], Run]) -> None:
    """Add the completed run directories (``runs/<store>/<method>/<schedule>-<lr>/metrics.json``)
    missing from ``runs``: rebuilt from their metrics.json and epochs.csv, so that a bench of a subset
    of the heads keeps the others' rows in the tables. Their seconds are those metrics.json records."""
    for metrics in sorted(out.glob(f"runs/*/*/*/{METRICS_FILE}")):
        run_dir = metrics.parent
        schedule = run_dir.name.split("-", 1)[0]  # "epochs=5", "open" or "default"; the rest is the lr
        try:
            results = read_results(run_dir)
            key = (run_dir.parent.parent.name, run_dir.parent.name, schedule, float(results.raw["schedule"]["lr"]))
            if key in runs:
                continue
            curve = _curve(run_dir)
            val = results.val.get("raw", "t2v")
            ran = results.epochs_run if results.epochs_run is not None else (curve[-1][0] if curve else 0)
            runs[key] = Run(*key, val["R@1"], val["R@5"], results.selected_epoch, ran,
                            results.raw["train"]["seconds"], curve)
        except (OSError, KeyError, TypeError, ValueError, RunError) as e:  # an unreadable leftover is retrained
            log.warning("%s: not reused (%s)", run_dir, e)


def _load_tables(out: Path) -> dict[tuple[str, str, str, float], Run]:
    if not (out / "results.csv").is_file() or not (out / "curves.csv").is_file():
        return {}
    curves: dict[tuple, list[tuple[int, float]]] = {}
    with open(out / "curves.csv") as f:
        for r in csv.DictReader(f):
            curves.setdefault((r["store"], r["method"], r["schedule"], float(r["lr"])), []).append(
                (int(r["epoch"]), float(r["val_r1"])))
    runs = {}
    with open(out / "results.csv") as f:
        for r in csv.DictReader(f):
            key = (r["store"], r["method"], r["schedule"], float(r["lr"]))  # default runs too (--only-default resumes)
            runs[key] = Run(r["store"], r["method"], r["schedule"], float(r["lr"]), float(r["val_r1"]),
                            float(r["val_r5"]), int(r["selected_epoch"]), int(r["epochs_run"]),
                            float(r["seconds"]), curves.get(key, []))
    return runs


def _summary(runs: list[Run]) -> list[dict]:
    rows = []
    for store, method in dict.fromkeys((r.store, r.method) for r in runs):
        mine = [r for r in runs if (r.store, r.method) == (store, method)]
        grid = [r for r in mine if r.schedule.startswith("epochs=")]
        default = [r for r in mine if r.schedule == "default"]
        if not default:
            continue
        d = default[0]
        opened = max((r for r in mine if r.schedule == "open"), key=lambda r: r.val_r1, default=None)
        # the target: the grid's best; on a store benched without the grid, the best open-ended lr, the
        # default's own among them (it is the open-ended schedule at the default lr)
        if grid:
            g = max(grid, key=lambda r: r.val_r1)
        else:
            g = max(opened, d, key=lambda r: r.val_r1) if opened else None
        rows.append({"store": store, "method": method, "grid_best_r1": g.val_r1 if g else None,
                     "grid_best": f"{'open' if not grid else g.schedule} lr {g.lr:g}" if g else None,
                     "default_r1": d.val_r1, "gap": g.val_r1 - d.val_r1 if g else None, "default_lr": d.lr,
                     "default_epochs_run": d.epochs_run, "default_selected_epoch": d.selected_epoch, "default_seconds": round(d.seconds, 1),
                     "best_open_lr": opened.lr if opened else None})
    return rows


def _write(out: Path, runs: list[Run], summary: list[dict] | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["store", "method", "schedule", "lr", "val_r1", "val_r5", "selected_epoch", "epochs_run", "seconds"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in runs:
            w.writerow([getattr(r, k) if k != "seconds" else round(r.seconds, 1) for k in fields])
    with open(out / "curves.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["store", "method", "schedule", "lr", "epoch", "val_r1"])
        for r in runs:
            for epoch, v in r.curve:
                w.writerow([r.store, r.method, r.schedule, r.lr, epoch, v])
    if summary is not None:
        with open(out / "summary.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(summary[0]) if summary else ["store"])
            w.writeheader()
            w.writerows(summary)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))


def _plot(path: Path, runs: list[Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stores = list(dict.fromkeys(r.store for r in runs))
    methods = list(dict.fromkeys(r.method for r in runs))
    fig, axes = plt.subplots(len(stores), len(methods), figsize=(3.6 * len(methods), 2.9 * len(stores)),
                             squeeze=False)
    for i, store in enumerate(stores):
        for j, method in enumerate(methods):
            ax = axes[i][j]
            mine = [r for r in runs if (r.store, r.method) == (store, method)]
            for r in mine:
                if r.schedule == "open" and r.curve:
                    ax.plot(*zip(*r.curve), lw=1, label=f"lr {r.lr:g}")
                elif r.schedule == "default" and r.curve:
                    ax.plot(*zip(*r.curve), "k--", lw=1.5, label="default")
            grid = [r for r in mine if r.schedule.startswith("epochs=")]
            if grid:
                g = max(grid, key=lambda r: r.val_r1)
                ax.axhline(g.val_r1, color="grey", lw=0.8, ls=":", label=f"grid best ({g.schedule}, lr {g.lr:g})")
            ax.set_title(f"{method} / {store}", fontsize=9)
            ax.set_xlabel("epoch", fontsize=8)
            ax.set_ylabel("val t2v R@1", fontsize=8)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
