"""``tvrpipe recipes`` and ``tvrpipe recipes show NAME``: the papers' protocols, one per (paper, dataset)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from tvrpipe.cli.app import PAPERS, app, console, new_app

recipes_app = new_app(help="The papers' training protocols, one recipe per (paper, dataset): `finetune --recipe NAME` "
                           "runs one, `train-head --recipe NAME` trains its head the same way on cached features.",
                      no_args_is_help=False)
app.add_typer(recipes_app, name="recipes", rich_help_panel=PAPERS)


@recipes_app.callback(invoke_without_command=True)
def recipes_list(ctx: typer.Context) -> None:
    """List the recipes: head, dataset, backbone, frames, batch, epochs, learning rates and the paper's t2v R@1."""
    if ctx.invoked_subcommand is not None:
        return
    from tvrpipe.training.recipes import list_recipes, load_recipe

    table = Table(title="recipes (tvrpipe recipes show NAME; tvrpipe finetune --recipe NAME)")
    for col in ("name", "head", "dataset", "backbone", "F", "batch", "epochs", "lr clip / head", "paper R@1"):
        table.add_column(col, overflow="fold", no_wrap=col == "name")
    for name in list_recipes():
        r = load_recipe(name)
        v = r.values()
        lr = f"{v['clip_lr']:g} / {v['head_lr']:g}" + "".join(f", {g} {x:g}" for g, x in v["group_lr"].items())
        pub = r.published.metrics.get("t2v", {}).get("R@1") if r.published else None
        table.add_row(name, r.method, f"{r.dataset} {r.split_set.value}", v["model"], str(v["frames"]),
                      str(v["batch_size"]), str(v["epochs"]), lr, "-" if pub is None else f"{pub:.1f}")
    console.print(table)


@recipes_app.command("show")
def show(name: Annotated[str, typer.Argument(help="A recipe (`tvrpipe recipes`) or a recipe file.")]) -> None:
    """Print a recipe resolved: every setting with its source, the head's whole config, the published row."""
    from tvrpipe.heads.base import head_class
    from tvrpipe.rundir import METRICS
    from tvrpipe.training.recipes import load_recipe

    r = load_recipe(name)
    console.print(Text.assemble((r.name, "bold"), f": {r.paper}; head {r.method}; {r.dataset}, split set "
                                f"{r.split_set.value} ({r.split_set.source})\n{r.path} (sha256 {r.sha256[:12]})"),
                  soft_wrap=True)
    table = Table(title="settings (an explicit finetune option overrides one)")
    for col in ("setting", "value", "source"):
        table.add_column(col)
    for k, s in r.settings.items():
        table.add_row(k, str(s.value), s.source)
    console.print(table)
    head = Table(title=f"head config ({r.method}); the rest are the head's defaults (docs/methods.md)")
    for col in ("field", "value", "source"):
        head.add_column(col)
    defaults = head_class(r.method).Config()
    for f in dataclasses.fields(defaults):
        if f.name in r.head:
            head.add_row(f.name, str(r.head[f.name].value), r.head[f.name].source)
        elif f.name in ("embed_dim", "logit_scale_init"):
            head.add_row(f.name, "from CLIP", "the run's CLIP: its width, its learned logit scale")
        else:
            head.add_row(f.name, str(getattr(defaults, f.name)), "the head's default")
    console.print(head)
    if r.published is None:
        console.print("published: none for this row")
        return
    pub = Table(title=f"published ({r.published.source}, {r.published.backbone})")
    for col in ("", *METRICS):
        pub.add_column(col, justify="right")
    for d, row in r.published.metrics.items():
        pub.add_row(d, *("-" if row[m] is None else f"{row[m]:.1f}" for m in METRICS))
    console.print(pub)
    if r.published.note:
        console.print(f"note: {r.published.note}", highlight=False)


@recipes_app.command("memory")
def memory(
    names: Annotated[Optional[list[str]], typer.Argument(help="Recipes or recipe files (default: every recipe).")] = None,
    gpu_memory: Annotated[Optional[list[str]], typer.Option(
        help="A GPU's memory per worker (repeatable; default 24GiB, 40GiB and 80GiB).")] = None,
    num_workers: Annotated[int, typer.Option(min=1, help="Ray Train workers sharing the batch.")] = 1,
) -> None:
    """Each recipe's estimated peak memory per worker with its batch at once, and the largest --chunk-size that
    fits each GPU memory (as `finetune --dry-run --gpu-memory` estimates it, without a dataset: random weights)."""
    from tvrpipe.config import parse_memory
    from tvrpipe.progress import track
    from tvrpipe.training.plan import recipe_memory
    from tvrpipe.training.recipes import list_recipes, load_recipe

    budgets = [(g, parse_memory(g)) for g in (gpu_memory or ["24GiB", "40GiB", "80GiB"])]
    recipes = [load_recipe(n) for n in (names or list_recipes())]
    rows = [recipe_memory(r, [b for _, b in budgets], num_workers)
            for r in track(recipes, "measuring", transient=True, enabled=len(recipes) >= 2)]
    table = Table(title=f"peak memory per worker ({num_workers} worker(s); an estimate: the GPU adds its context, "
                        "about 0.5 GiB) and the largest --chunk-size that fits")
    for col in ("recipe", "pairs x frames", "precision", "batch at once", *(f"chunk for {g}" for g, _ in budgets)):
        table.add_column(col, justify="left" if col == "recipe" else "right")
    for m in rows:
        cells = []
        for _, b in budgets:
            c = m["largest_chunk"][b]
            cells.append("none" if c is None else "all" if c >= m["pairs"] else str(c))
        table.add_row(m["name"], f"{m['pairs']} x {m['frames']}", m["precision"] + (" + ckpt" if m["grad_checkpointing"]
                                                                                  else ""),
                      f"{m['unchunked'] / 2**30:.1f} GiB", *cells)
    console.print(table)
