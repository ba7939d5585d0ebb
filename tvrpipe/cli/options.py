"""What several commands share: the options train-head and sweep both take (one definition of each
option's type and help), the parsers of repeatable items (``--set``, ``--group-lr``, ``--post``), the
table of an evaluation's scores, and the line a recipe run prints. No command lives here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.table import Table

from tvrpipe.cli.app import console, finite_float
from tvrpipe.config import parse_fields, split_item
from tvrpipe.errors import ConfigError
from tvrpipe.rundir import METRICS, POST_PROCESSINGS, Scores

if TYPE_CHECKING:
    from tvrpipe.data.manifest import Manifest


# train-head's schedule and post-processing options, shared with `tvrpipe sweep` (one definition of
# each option's type and help; their defaults are TrainConfig's, read where they are used)
EpochsOption = Annotated[Optional[int], typer.Option(
    help="Train exactly this many epochs (warmup + cosine). Default: until validation stops improving "
         "(--patience, at most --max-epochs).")]
MaxEpochsOption = Annotated[int, typer.Option(
    help="Cap on epochs when --epochs is not given (k times it on a store of few steps an epoch, where "
         "validation runs every k epochs: see --patience).")]
PatienceOption = Annotated[int, typer.Option(
    help="Without --epochs: stop after this many epochs without a better validation score (t2v R@1+R@5+R@10; "
         "the lr halves every 3 such epochs), validating after every epoch. On a store of fewer than 300 / "
         "patience optimizer steps an epoch, validation runs after each of the first k epochs, then every k-th, "
         "k = 300 / (patience x steps an epoch) rounded up (13 at 3 steps an epoch), and patience, the 3 and "
         "--max-epochs count periods of k epochs, so that patience covers 300 steps.")]
BatchSizeOption = Annotated[int, typer.Option(help="Pairs per step (one caption per video).")]
LrOption = Annotated[Optional[float], typer.Option(parser=finite_float,
    help="Learning rate. Default: the head's, at the features' width D (`tvrpipe heads` lists them).")]
WeightDecayOption = Annotated[float, typer.Option(parser=finite_float, help="Weight decay.")]
PostOption = Annotated[Optional[list[str]], typer.Option(
    help="Also report test metrics after dsl or qbnorm (repeatable).")]


def parse_overrides(method: str, items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> typed overrides for ``method``'s config (unknown keys fail)."""
    from tvrpipe.heads.base import head_class

    return parse_fields(head_class(method).Config, items, method)


def parse_group_lr(items: list[str]) -> dict[str, float]:
    """``--group-lr NAME=LR`` items -> ``{NAME: LR}``."""
    groups: dict[str, float] = {}
    for item in items:
        name, raw = split_item(item, "--group-lr")
        if name in groups:
            raise ConfigError(f"--group-lr {name} is given twice ({name}={groups[name]:g} and {item}); give each "
                              "group once")
        try:
            groups[name] = finite_float(raw)
        except typer.BadParameter as e:
            raise ConfigError(f"--group-lr {item}: {e.message}") from None
    return groups


def parse_post(post: list[str]) -> tuple[str, ...]:
    """--post's values, checked against the post-processings evaluation knows."""
    bad = [p for p in post if p not in POST_PROCESSINGS]
    if bad:
        raise ConfigError(f"--post {bad[0]!r} is not one of: {', '.join(POST_PROCESSINGS)}")
    return tuple(post)


def print_metrics(title: str, metrics: dict, zero_shot: dict | None = None) -> None:
    """An evaluation's scores as a table (one row per direction and score variant; ``zero_shot``: the raw
    scores of zero-shot CLIP on the same split, a row beside each direction's), then the head's readouts."""
    scores = Scores.from_dict(metrics)
    reference = Scores.from_dict(zero_shot).metrics if zero_shot else {}
    table = Table(title=title)
    for col in ("", *METRICS):
        table.add_column(col, justify="right")
    for key in sorted(scores.metrics):
        table.add_row(key, *(f"{scores.metrics[key][c]:.1f}" for c in METRICS))
        if key in reference:
            table.add_row(f"{key} zero-shot", *(f"{reference[key][c]:.1f}" for c in METRICS), style="dim")
    console.print(table)
    if scores.dsl_not_applicable:
        console.print(f"no DSL: {scores.dsl_not_applicable}", highlight=False)
    for name, r in scores.readouts.items():  # the head's uncertainty readouts
        values = ", ".join(f"{k} {v:.4g}" for k, v in r.items()) if isinstance(r, dict) else f"{r:.4g}"
        console.print(f"readout {name}: {values}")


def apply_recipe(ctx: typer.Context, name: str, method: str | None, set_items: list[str], options: dict[str, Any],
                 keys: dict[str, str] | None = None):
    """The recipe ``name`` applied to a command's ``options`` (in place, :func:`tvrpipe.training.recipes.apply`)
    with the options the user gave explicitly, and its line printed.

    Returns:
        ``(recipe, method, head overrides, what the run records of the recipe)``.
    """
    from tvrpipe.cli.app import explicit_options
    from tvrpipe.training.recipes import apply

    r, method, overrides, record = apply(name, method, explicit_options(ctx), set_items, options, keys)
    shown = r.name if record["shipped"] else f"{r.name} ({r.path})"  # a file of the user's is named by its path
    overridden = record["overridden"]
    console.print(f"recipe {shown}" + (f"; overridden: {', '.join(overridden)}" if overridden else ""),
                  highlight=False, soft_wrap=True)
    return r, method, overrides, record


def print_counts(manifest: Manifest, title: str) -> None:
    """Print a manifest's per-split counts as a table."""
    table = Table(title=title)
    for col in ("split", "videos", "captions"):
        table.add_column(col, justify="left" if col == "split" else "right")
    counts = manifest.counts()
    for r in counts.itertuples():
        table.add_row(r.split, f"{r.videos:,}", f"{r.captions:,}")
    table.add_row("all", f"{counts.videos.sum():,}", f"{counts.captions.sum():,}", style="bold")
    console.print(table)
