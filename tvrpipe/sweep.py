"""``tvrpipe sweep``: a grid of ``train-head`` runs (methods x config values x seeds) as Ray tasks.

Every combination is one Ray task (``num_cpus`` / ``num_gpus`` per task, so GPU fractions share a
device on a cluster) that calls :func:`tvrpipe.training.fit.fit` into its own, normal run
directory. So:

- a rerun skips the runs that finished with the same configuration and resumes the interrupted
  ones from their last epoch (``fit`` resumes a run directory whose config matches);
- one failing run (a bad config value, a diverged loss, a crashed worker) does not stop the
  others; it is listed at the end with its error, and in the tables with ``status = failed``;
- the results are collected into ``runs.parquet`` / ``runs.csv`` (one row per run) and
  ``results.parquet`` / ``results.csv`` (one row per method and config, mean and standard
  deviation over seeds: sample standard deviation, ``ddof = 1``, empty with one seed).

``--set key=v1,v2`` sweeps a field: ``train.KEY`` is a trainer field (``lr``, ``epochs``,
``batch_size``, ...), ``METHOD.KEY`` a field of one head, and a bare ``KEY`` the trainer's field if
it has one, else the field of every listed head that has it (a head without it runs once). Seeds
come from ``--seeds`` only.

The store and the run directories must be on storage every node of the cluster reads and writes
(docs/cluster.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tvrpipe.config import field_types, parse_memory, parse_value, split_item
from tvrpipe.errors import ConfigError, RunError, TvrpipeError
from tvrpipe.lock import locked
from tvrpipe.rundir import read_results

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class SweepRun:
    """One combination: a method, its head overrides, trainer overrides and a seed."""

    method: str
    seed: int
    head: dict[str, Any] = field(default_factory=dict)  # head config overrides
    train: dict[str, Any] = field(default_factory=dict)  # trainer overrides (on top of the sweep's base)

    @property
    def swept(self) -> dict[str, Any]:
        """The swept values, as columns: ``KEY`` for head fields, ``train.KEY`` for trainer fields."""
        return {**{k: v for k, v in sorted(self.head.items())},
                **{f"train.{k}": v for k, v in sorted(self.train.items())}}

    @property
    def name(self) -> str:
        """The run directory's name: ``method[__key=value...]__seed<N>`` (file-system safe)."""
        parts = [self.method] + [f"{k}={_safe(v)}" for k, v in self.swept.items()] + [f"seed{self.seed}"]
        return "__".join(parts)


def _safe(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def _split_values(raw: str) -> list[str]:
    """``"1,2,[3,4]"`` -> ``["1", "2", "[3,4]"]``: commas inside brackets or braces do not split."""
    out, depth, cur = [], 0, ""
    for ch in raw:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [v.strip() for v in out]


def _train_value(name: str, raw: str, key: str) -> Any:
    """One swept value of the trainer field ``name`` (``key`` as typed): a memory budget as train-head's
    --memory-budget takes it (``2GB``; a bare number is GiB; ``none``: the default), any other field by its type."""
    if name == "memory_budget" and raw.strip().lower() not in ("none", "null"):
        return parse_memory(raw, f"--set {key}")
    from tvrpipe.training.settings import TrainConfig

    return parse_value(TrainConfig, name, raw, "train", shown=key)


def _once(axes: dict[str, list[Any]], name: str, key: str) -> None:
    """A field swept by two ``--set`` items would take the last one's values silently: refused."""
    if name in axes:
        raise ConfigError(f"--set {key}: {name} is set twice; list all its values in one item ({name}=a,b)")


def plan_sweep(methods: Sequence[str], seeds: Sequence[int], sets: Sequence[str] = ()) -> list[SweepRun]:
    """Every combination of ``methods`` x the ``--set`` values that apply to each x ``seeds``.

    Args:
        methods: registered heads.
        seeds: one run per seed for every other combination.
        sets: ``"key=v1,v2"`` items (see the module docstring for ``train.`` and ``METHOD.`` keys).

    Raises:
        ConfigError: an unknown method or key, a key no listed method has, a key that is both a
            trainer and a head field without a prefix, ``seed`` in ``--set``, a badly typed value.

    Example:
        >>> [r.name for r in plan_sweep(["xpool"], [0, 1], ["train.lr=1e-3,1e-2"])]  # doctest: +SKIP
        ['xpool__train.lr=0.001__seed0', 'xpool__train.lr=0.001__seed1', ...]
    """
    from tvrpipe.heads.base import head_class, list_heads
    from tvrpipe.training.fit import TrainConfig

    if not methods:
        raise ConfigError("--methods is empty; give one or more of: " + ", ".join(list_heads()))
    unknown = [m for m in methods if m not in list_heads()]
    if unknown:
        raise ConfigError(f"--methods: unknown head {unknown[0]!r}; registered: {', '.join(list_heads())}")
    if len(set(methods)) != len(methods) or len(set(seeds)) != len(seeds) or not seeds:
        raise ConfigError("--methods and --seeds must be non-empty and list each entry once")
    train_fields = field_types(TrainConfig)
    head_fields = {m: field_types(head_class(m).Config) for m in methods}
    train_axes: dict[str, list[Any]] = {}
    head_axes: dict[str, dict[str, list[Any]]] = {m: {} for m in methods}
    for item in sets:
        key, raw = split_item(item)
        scope, _, name = key.rpartition(".")
        if name == "seed" and scope in ("", "train"):
            raise ConfigError("--set seed=...: seeds are swept with --seeds")
        if scope == "train" or (not scope and name in train_fields):
            if not scope and any(name in f for f in head_fields.values()):
                raise ConfigError(f"--set {key}: both a trainer field and a head field; write train.{name} "
                                  f"or METHOD.{name}")
            _once(train_axes, name, key)
            train_axes[name] = [_train_value(name, v, key) for v in _split_values(raw)]
        elif scope:
            if scope not in head_axes:
                raise ConfigError(f"--set {key}: {scope!r} is neither 'train' nor a method of --methods "
                                  f"({', '.join(methods)})")
            _once(head_axes[scope], name, key)
            head_axes[scope][name] = [parse_value(head_class(scope).Config, name, v, scope, shown=key)
                                      for v in _split_values(raw)]
        else:
            having = [m for m in methods if name in head_fields[m]]
            if not having:
                raise ConfigError(f"--set {key}: no listed method has a config key {name!r}, nor the trainer "
                                  "(`tvrpipe heads` lists each head's keys)")
            for m in having:
                _once(head_axes[m], name, key)
                head_axes[m][name] = [parse_value(head_class(m).Config, name, v, m, shown=key)
                                      for v in _split_values(raw)]
    for axes in (train_axes, *head_axes.values()):
        for name, values in axes.items():
            if len(set(map(json.dumps, values))) != len(values):
                raise ConfigError(f"--set {name}: a value is listed twice")
    runs = []
    for m in methods:
        axes = {**{("train", k): v for k, v in train_axes.items()}, **{("head", k): v for k, v in head_axes[m].items()}}
        for combo in itertools.product(*axes.values()):
            chosen = dict(zip(axes, combo))
            for seed in seeds:
                runs.append(SweepRun(m, int(seed), head={k: v for (w, k), v in chosen.items() if w == "head"},
                                     train={k: v for (w, k), v in chosen.items() if w == "train"}))
    return runs


@dataclass
class SweepResult:
    """What a sweep did: one row per run (status ``done`` / ``skipped`` / ``failed``) and the tables."""

    out: Path
    rows: list[dict[str, Any]]
    results: pd.DataFrame  # per method and config, mean and std over seeds

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] == "failed"]


def _run_one(features: str, method: str, run_dir: str, train: dict[str, Any], head: dict[str, Any],
             post: tuple[str, ...]) -> dict[str, Any]:
    """A Ray task: one ``fit`` (resuming if the run directory holds its interrupted run)."""
    from tvrpipe.training.fit import TrainConfig, fit

    return fit(features, method, run_dir, TrainConfig(**train), head, post, progress=False)


def _is_complete(run_dir: Path, method: str, head_cfg: dict[str, Any], train: dict[str, Any], features: Path,
                 post: tuple[str, ...], provenance: dict[str, Any] | None = None) -> bool:
    """The run finished with this configuration (its metrics.json is written last by ``fit``), at the
    learning rate this configuration resolves to now: a run without ``lr`` trained at a head's
    earlier ``default_lr`` is not this run (``fit`` then says so), and neither is one trained on a
    store that has since been replaced at the same path (``provenance``: the store's identity now)."""
    from tvrpipe.rundir import read_config, recorded
    from tvrpipe.training.fit import TrainConfig, resolved_lr

    try:
        config = read_config(run_dir)
        if recorded(run_dir, "test") is None:
            return False
    except RunError:  # no run yet, or damaged files: fit says what is wrong when it runs
        return False
    same = json.loads(json.dumps({"method": method, "head": head_cfg, "train": train, "features": str(features),
                                  "post": list(post), **({"provenance": provenance} if provenance is not None else {})}))
    lr, _ = resolved_lr(method, TrainConfig(**train), head_cfg["embed_dim"])
    return all(config.get(k) == v for k, v in same.items()) and (config.get("resolved") or {}).get("lr") == lr


def _error_text(e: BaseException) -> str:
    """One line for a failed task: a tvrpipe error's own message, else the exception's type and text."""
    cause = getattr(e, "cause", None)  # RayTaskError wraps the task's exception
    err = cause if isinstance(cause, BaseException) else e
    if isinstance(err, TvrpipeError):
        return " ".join(str(err).split())
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1].strip() if lines else ''}"[:500]



def run_sweep(
    features: str | os.PathLike[str],
    runs: Sequence[SweepRun],
    out: str | os.PathLike[str],
    train: Any = None,
    post: tuple[str, ...] = (),
    address: str | None = None,
    cpus_per_run: float = 1.0,
    gpus_per_run: float = 0.0,
    progress: bool = True,
) -> SweepResult:
    """Run ``runs`` as Ray tasks into ``out/<run name>/`` and collect the tables.

    Args:
        features: a complete feature store, at the same path on every node.
        runs: the combinations (:func:`plan_sweep`).
        out: the sweep directory (run directories, ``runs.*``, ``results.*``); rerun to resume.
        train: the base :class:`~tvrpipe.training.fit.TrainConfig` (``--set train.KEY`` and the
            seed override it per run).
        post: post-processing reported beside raw test metrics (``dsl``, ``qbnorm``).
        address: a Ray cluster (``auto``, ``HOST:PORT``, ``ray://...``); None starts Ray on this
            machine unless ``RAY_ADDRESS`` is set.
        cpus_per_run, gpus_per_run: Ray resources of one run (a fraction of a GPU lets several
            runs share one); with GPUs the runs train on ``cuda``.
        progress: show a progress bar over runs.

    Returns:
        A :class:`SweepResult`; failed runs are in it, not raised.

    Raises:
        ConfigError: bad options, before anything starts.
        StoreError: the store is missing or damaged.

    Example:
        >>> run_sweep("features/msrvtt", plan_sweep(["xpool", "tmass"], [0, 1, 2]), "runs/sweep")  # doctest: +SKIP
    """
    from tvrpipe.features.outputs import check_output_folder
    from tvrpipe.features.store import check_not_a_store, open_store, store_identity
    from tvrpipe.lock import check_writable
    from tvrpipe.training.data import check_captioned
    from tvrpipe.training.fit import TrainConfig

    base = train or TrainConfig()
    if not cpus_per_run > 0 or not math.isfinite(cpus_per_run):
        raise ConfigError(f"--cpus-per-run must be > 0, got {cpus_per_run}")
    if not gpus_per_run >= 0 or not math.isfinite(gpus_per_run):
        raise ConfigError(f"--gpus-per-run must be >= 0, got {gpus_per_run}")
    if not runs:
        raise ConfigError("the sweep has no runs")
    if gpus_per_run > 0:
        base = dataclasses.replace(base, device="cuda")  # checked again as it is made
    check_writable(out, "--out")
    check_not_a_store(out, "a sweep")
    check_output_folder(out)
    store = open_store(features)
    check_captioned(store)  # before --out is made: every run of the grid would fail alike
    identity = store_identity(store.provenance)  # what fit records as the run's store
    features = Path(features).resolve()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with locked(out, "--out"):  # a second sweep into this --out is refused while this one runs
        return _sweep(runs, out, base, store, identity, features, post, address, cpus_per_run, gpus_per_run, progress)


def _sweep(runs: Sequence[SweepRun], out: Path, base: Any, store: Any, identity: dict[str, Any], features: Path,
           post: tuple[str, ...], address: str | None, cpus_per_run: float, gpus_per_run: float,
           progress: bool) -> SweepResult:
    """:func:`run_sweep` with its options checked and ``out`` locked."""
    from tvrpipe.cluster import ray_init, require_gpus
    from tvrpipe.training.fit import store_head_config

    rows: dict[str, dict[str, Any]] = {}
    todo: list[tuple[SweepRun, dict[str, Any]]] = []
    for run in runs:
        swept = {k: v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)
                 for k, v in run.swept.items()}  # a list or dict value as JSON text (a table cell, a group key)
        row = {"run": run.name, "method": run.method, "seed": run.seed, **swept, "status": "", "error": ""}
        rows[run.name] = row
        try:
            tc = dataclasses.replace(base, seed=run.seed, **run.train)  # checks itself
            head_cfg = dataclasses.asdict(store_head_config(store, run.method, run.head))
        except (TvrpipeError, TypeError, ValueError) as e:  # one bad combination fails alone
            row.update(status="failed", error=_error_text(e))
            continue
        train_dict = dataclasses.asdict(tc)
        if _is_complete(out / run.name, run.method, head_cfg, train_dict, features, post, identity):
            row["status"] = "skipped"  # finished earlier with this configuration
        else:
            todo.append((run, train_dict))
    skipped = sum(r["status"] == "skipped" for r in rows.values())
    log.info("%d runs: %d to run, %d already complete", len(runs), len(todo), skipped)

    if todo:
        import ray

        ray_init(address)
        if gpus_per_run > 0:
            require_gpus(gpus_per_run, f"--gpus-per-run {gpus_per_run:g}", "use --gpus-per-run 0")
        # a run's splits hold at most its memory budget: Ray places no more runs on a node than its memory takes
        memory = {"memory": base.memory_budget} if base.memory_budget else {}
        task = ray.remote(_run_one).options(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_retries=0, **memory)
        pending = {task.remote(str(features), run.method, str(out / run.name), train_dict, run.head, tuple(post)): run
                   for run, train_dict in todo}
        from tvrpipe.progress import progress_bar

        bar = progress_bar(field="info", elapsed=True, enabled=progress)
        failed = 0
        try:
            with bar:
                t = bar.add_task("sweep", total=len(pending), info="")
                while pending:
                    ready, _ = ray.wait(list(pending), num_returns=1)
                    run = pending.pop(ready[0])
                    try:
                        ray.get(ready[0])
                        rows[run.name]["status"] = "done"
                    except Exception as e:  # the task's error (RayTaskError) or a lost worker
                        failed += 1
                        rows[run.name].update(status="failed", error=_error_text(e))
                        log.info("%s failed: %s", run.name, rows[run.name]["error"])
                    bar.update(t, advance=1, info=f"{failed} failed" if failed else "")
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise

    for name, row in rows.items():
        if row["status"] in ("done", "skipped"):
            row.update(read_results(out / name).columns())
    table = pd.DataFrame(list(rows.values()))
    for c in {k for run in runs for k in run.swept}:  # integer values stay integers beside a method without the key
        values = [run.swept[c] for run in runs if c in run.swept]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            table[c] = table[c].astype("Int64")
    results = summarize(table)
    _write_tables(table, results, out)
    return SweepResult(out, list(rows.values()), results)


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """Mean and standard deviation (``ddof = 1``) over seeds of every metric column, per method and
    swept values, from finished runs; ``n_seeds`` counts them and ``failed`` counts the others."""
    meta = {"run", "method", "seed", "status", "error"}
    metric_cols = [c for c in table.columns if c.startswith(("t2v", "v2t", "val ")) or c in ("selected_epoch",
                                                                                              "epochs_run")]
    keys = ["method"] + [c for c in table.columns if c not in meta and c not in metric_cols]
    ok = table["status"].isin(["done", "skipped"])
    out_rows = []
    for values, group in table.groupby(keys, dropna=False, sort=False):
        good = group[ok.loc[group.index]]
        row = dict(zip(keys, values if isinstance(values, tuple) else (values,)))
        row.update(n_seeds=len(good), failed=int(len(group) - len(good)))
        for c in metric_cols:
            x = pd.to_numeric(good[c], errors="coerce").dropna()
            row[f"{c} mean"] = float(x.mean()) if len(x) else float("nan")
            row[f"{c} std"] = float(x.std(ddof=1)) if len(x) > 1 else float("nan")
        out_rows.append(row)
    results = pd.DataFrame(out_rows)
    return results.astype({k: table[k].dtype for k in keys}) if len(results) else results


def _write_tables(table: pd.DataFrame, results: pd.DataFrame, out: Path) -> None:
    from tvrpipe.files import atomic_write_parquet, atomic_write_text

    for df, name in ((table, "runs"), (results, "results")):
        df = df.copy()
        for c in df.columns:  # a column mixing types (a head field of str and None values) as text in Parquet
            if df[c].dtype == object and c not in ("run", "method", "status", "error"):
                df[c] = df[c].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
        atomic_write_parquet(df, out / f"{name}.parquet")
        atomic_write_text(out / f"{name}.csv", df.to_csv(index=False))
