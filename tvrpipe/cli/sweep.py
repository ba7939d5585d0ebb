"""``tvrpipe sweep``: methods x config values x seeds as Ray tasks, one run directory each."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from tvrpipe.cli.app import PAPERS, app, console, finite_float, given_fields, refuse_unused
from tvrpipe.cli.options import (
    BatchSizeOption,
    EpochsOption,
    LrOption,
    MaxEpochsOption,
    PatienceOption,
    PostOption,
    WeightDecayOption,
    parse_post,
)
from tvrpipe.config import parse_memory
from tvrpipe.errors import ConfigError
from tvrpipe.training.settings import TrainConfig

TR = TrainConfig()  # the defaults, declared once: in TrainConfig


def _ints(option: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{option} expects comma-separated integers, e.g. 0,1,2; got {text!r}") from None


@app.command("sweep", rich_help_panel=PAPERS)
def sweep(
    ctx: typer.Context,
    features: Annotated[Path, typer.Option(help="A complete feature store, at this path on every node.")],
    methods: Annotated[
        Optional[str], typer.Option(help="Comma-separated heads, e.g. xpool,tmass (default: every registered head).")
    ] = None,
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds: one run of each combination per seed.")] = "0,1,2",
    set_: Annotated[
        Optional[list[str]], typer.Option(
            "--set", help="Sweep a field: key=v1,v2 (repeatable). train.KEY: a trainer field (lr, epochs, "
                          "batch_size, ...); METHOD.KEY: one head's field; KEY: the trainer's field, else every "
                          "listed head's that has it.")
    ] = None,
    out: Annotated[Path, typer.Option(help="Sweep directory: a run directory per run, runs.* and results.* tables; "
                                           "rerun to skip finished runs and resume interrupted ones.")] = Path(
        "runs/sweep"),
    address: Annotated[
        Optional[str], typer.Option(help="Ray cluster address (auto, HOST:PORT); default: RAY_ADDRESS, else Ray "
                                         "on this machine.")
    ] = None,
    cpus_per_run: Annotated[float, typer.Option(parser=finite_float, help="Ray CPUs per run.")] = 1.0,
    gpus_per_run: Annotated[
        float, typer.Option(
            parser=finite_float, help="Ray GPUs per run (a fraction such as 0.25 shares a GPU); > 0 trains on cuda.")
    ] = 0.0,
    epochs: EpochsOption = TR.epochs,
    max_epochs: MaxEpochsOption = TR.max_epochs,
    patience: PatienceOption = TR.patience,
    batch_size: BatchSizeOption = TR.batch_size,
    lr: LrOption = TR.lr,
    weight_decay: WeightDecayOption = TR.weight_decay,
    memory_budget: Annotated[Optional[str], typer.Option(
        metavar="SIZE",
        help="Memory each run's splits may hold (as train-head's --memory-budget; larger splits are streamed from "
             "the store). Ray then places at most a node's memory / SIZE runs on a node. Default: each run takes half "
             "of its node's memory, so give it when several runs share a node.")] = None,
    post: PostOption = None,
) -> None:
    """Train a grid of heads x config values x seeds as Ray tasks; tables with mean and std over seeds.

    Every run is a normal train-head run directory under --out. One failing run does not stop
    the others: it is listed at the end (and the command exits 1 after writing the tables).
    """
    from tvrpipe.heads.base import list_heads
    from tvrpipe.sweep import plan_sweep, run_sweep

    names = [m.strip() for m in methods.split(",") if m.strip()] if methods is not None else list_heads()
    runs = plan_sweep(names, _ints("--seeds", seeds), set_ or [])
    swept = {k for r in runs for k in r.train}  # trainer fields --set sweeps: they win over the options
    refuse_unused(ctx, sorted(swept), "--set sweeps it too, and its values would win; give it once")
    if epochs is not None or "epochs" in swept:
        refuse_unused(ctx, ("max_epochs", "patience"), "they shape a run until validation stops improving, and "
                      "these train a fixed number of epochs; leave them out")
    # what the user gave; TrainConfig holds every other default (what --help shows)
    cfg = TrainConfig(**given_fields(ctx, TrainConfig, convert={
        "memory_budget": lambda v: None if v is None else parse_memory(v, "--memory-budget")}))
    console.print(f"{len(runs)} runs ({len(names)} methods x {len(_ints('--seeds', seeds))} seeds"
                  f"{' x swept values' if set_ else ''}) into {out}", highlight=False)
    result = run_sweep(features, runs, out, cfg, parse_post(post or []), address, cpus_per_run, gpus_per_run)

    table = Table(title=f"test t2v, mean ± std over seeds ({out / 'results.csv'})")
    keys = [c for c in result.results.columns if c not in ("n_seeds", "failed") and not c.endswith((" mean", " std"))]
    for c in [*keys, "seeds", "R@1", "R@5", "R@10", "MdR", "MnR"]:
        table.add_column(c, justify="left" if c in keys else "right")
    for _, r in result.results.iterrows():
        def cell(m: str, r=r) -> str:
            mean, std = r.get(f"t2v {m} mean"), r.get(f"t2v {m} std")
            if mean is None or math.isnan(mean):
                return "-"
            return f"{mean:.1f}" + ("" if std is None or math.isnan(std) else f" ± {std:.1f}")
        table.add_row(*(("" if _missing(r[k]) else str(r[k])) for k in keys), f"{r['n_seeds']}",
                      *(cell(m) for m in ("R@1", "R@5", "R@10", "MdR", "MnR")))
    console.print(table)
    counts = {s: sum(row["status"] == s for row in result.rows) for s in ("done", "skipped", "failed")}
    console.print(f"{counts['done']} trained, {counts['skipped']} already complete (skipped), {counts['failed']} "
                  f"failed; per run: {out / 'runs.csv'}", highlight=False)
    if result.failed:
        for row in result.failed:
            console.print(Text.assemble(("failed", "red"), f" {row['run']}: {row['error']}"), soft_wrap=True)
        raise typer.Exit(1)


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
