"""``tvrpipe train-head``, ``tvrpipe evaluate`` and ``tvrpipe heads``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from tvrpipe.cli.app import MAIN_PATH, TOOLS, app, explicit_options, finite_float, refuse_unused
from tvrpipe.config import parse_fields, split_item
from tvrpipe.errors import ConfigError
from tvrpipe.rundir import METRICS, POST_PROCESSINGS, Scores

console = Console()

# train-head's schedule and post-processing options, shared with `tvrpipe sweep` (one definition of
# each option's type and help; the defaults, TrainConfig's, are given where they are used)
EpochsOption = Annotated[Optional[int], typer.Option(
    help="Train exactly this many epochs (warmup + cosine). Default: until validation stops improving "
         "(--patience, at most --max-epochs).")]
MaxEpochsOption = Annotated[int, typer.Option(
    help="Cap on epochs when --epochs is not given (scaled up with --patience on stores of few steps an epoch).")]
PatienceOption = Annotated[int, typer.Option(
    help="Without --epochs: stop after this many epochs without a better validation score (t2v R@1+R@5+R@10; "
         "the lr halves every 3 such epochs). On a store of fewer than 300 / patience optimizer steps an "
         "epoch, patience, the 3 and --max-epochs scale up by the same factor, so that patience covers "
         "300 steps.")]
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


def apply_recipe(ctx: typer.Context, name: str, method: str | None, set_items: list[str], options: dict[str, Any],
                 keys: dict[str, str] | None = None):
    """The recipe ``name`` applied to a command's ``options`` (in place): every recipe setting of ``keys``
    ({setting: option}, default: finetune's) that the user did not give explicitly takes the recipe's value;
    ``--set`` items win over the recipe's head config.

    Returns:
        ``(recipe, method, head overrides, what the run records of the recipe)``.

    Raises:
        ConfigError: ``--method`` names another head than the recipe's.
    """
    from tvrpipe.training.recipes import load_recipe, resolve

    r = load_recipe(name)
    if method is not None and method != r.method:
        raise ConfigError(f"--method {method}: recipe {r.name} trains {r.method}; leave --method out")
    given = explicit_options(ctx)
    values, overridden = resolve(r, {k: v for k, v in options.items() if k in given}, keys)
    options.update(values)
    explicit_head = parse_overrides(r.method, set_items)
    from tvrpipe.heads.base import head_class

    # against what the recipe's head would be: its own value of a field, else the head's default
    defaults = {f.name: f.default for f in dataclasses.fields(head_class(r.method).Config)}
    overridden += [f"head.{k}" for k, v in explicit_head.items()
                   if v != (r.head[k].value if k in r.head else defaults.get(k))]
    record = r.record(overridden)
    name = r.name if record["shipped"] else f"{r.name} ({r.path})"  # a file of the user's is named by its path
    console.print(f"recipe {name}" + (f"; overridden: {', '.join(sorted(overridden))}" if overridden else ""),
                  highlight=False, soft_wrap=True)
    return r, r.method, {**r.head_overrides(), **explicit_head}, record


def parse_post(post: list[str]) -> tuple[str, ...]:
    """--post's values, checked against the post-processings evaluation knows."""
    bad = [p for p in post if p not in POST_PROCESSINGS]
    if bad:
        raise ConfigError(f"--post {bad[0]!r} is not one of: {', '.join(POST_PROCESSINGS)}")
    return tuple(post)


def print_metrics(title: str, metrics: dict) -> None:
    """An evaluation's scores as a table (one row per direction and score variant), then the head's readouts."""
    scores = Scores.from_dict(metrics)
    table = Table(title=title)
    for col in ("", *METRICS):
        table.add_column(col, justify="right")
    for key in sorted(scores.metrics):
        table.add_row(key, *(f"{scores.metrics[key][c]:.1f}" for c in METRICS))
    console.print(table)
    if scores.dsl_not_applicable:
        console.print(f"no DSL: {scores.dsl_not_applicable}", highlight=False)
    for name, r in scores.readouts.items():  # the head's uncertainty readouts
        values = ", ".join(f"{k} {v:.4g}" for k, v in r.items()) if isinstance(r, dict) else f"{r:.4g}"
        console.print(f"readout {name}: {values}")


@app.command("train-head", rich_help_panel=MAIN_PATH)
def train_head(
    ctx: typer.Context,
    method: Annotated[Optional[str], typer.Option(help="Head to train (see `tvrpipe heads`); default: the recipe's.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Run directory; rerun the same command to resume. Default with --recipe: runs/<recipe>-head.")] = None,
    features: Annotated[Optional[Path], typer.Option(
        help="A complete feature store (tvrpipe extract). Default: the one store under features/ (or under "
             "$TVRPIPE_FEATURES); with several there, it lists them.")] = None,
    recipe: Annotated[Optional[str], typer.Option(
        help="Train as a paper's recipe does (`tvrpipe recipes`): its head config, batch, epochs, optimiser, "
             "learning rates per parameter group, weight decay and warmup, unless given explicitly; the features "
             "fix the rest (backbone, frames, words).")] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Head config override key=value (repeatable).")
    ] = None,
    epochs: EpochsOption = None,
    max_epochs: MaxEpochsOption = 60,
    patience: PatienceOption = 8,
    batch_size: BatchSizeOption = 128,
    optimizer: Annotated[str, typer.Option(
        help="adamw (weight decay decoupled) or adam (weight decay as an L2 term of the gradient).")] = "adamw",
    lr: LrOption = None,
    group_lr: Annotated[Optional[list[str]], typer.Option(
        help="NAME=LR: a learning rate of its own for one of the head's parameter groups (e.g. radius=3e-5 for "
             "tmass); the other groups train at --lr (repeatable; `tvrpipe heads` lists the groups).")] = None,
    weight_decay: WeightDecayOption = 0.2,
    seed: Annotated[int, typer.Option(help="Random seed (init, sampling).")] = 0,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    prefetch: Annotated[
        bool, typer.Option(help="Build the next batch in a background thread (off may be faster on 2-core CPUs).")
    ] = True,
    post: PostOption = None,
) -> None:
    """Train a retrieval head on cached features; select on validation; evaluate on test."""
    from tvrpipe.training.core import describe_lrs
    from tvrpipe.training.fit import TrainConfig, fit

    options = dict(epochs=epochs, max_epochs=max_epochs, patience=patience, batch_size=batch_size, optimizer=optimizer,
                   lr=lr, group_lr=parse_group_lr(group_lr or []), weight_decay=weight_decay, seed=seed,
                   device=device, prefetch=prefetch)
    record = None
    if recipe is None:
        if method is None or out is None:
            raise ConfigError("give --method and --out, or a --recipe (`tvrpipe recipes`)")
        overrides = parse_overrides(method, set_ or [])
    else:
        from tvrpipe.training.recipes import TRAIN_HEAD

        r, method, overrides, record = apply_recipe(ctx, recipe, method, set_ or [], options, TRAIN_HEAD)
        out = out if out is not None else Path("runs") / f"{r.name}-head"
    if options["epochs"] == 0:
        refuse_unused(ctx, ("batch_size", "optimizer", "lr", "group_lr", "weight_decay"),
                      "--epochs 0 trains nothing (the untrained head is evaluated); leave it out")
    if options["epochs"] is not None:
        whence = "--epochs" if "epochs" in explicit_options(ctx) else f"recipe {recipe}"
        refuse_unused(ctx, ("max_epochs", "patience"), "they shape a run until validation stops improving, and this "
                      f"one trains exactly {options['epochs']} epochs ({whence}); leave them out")
    cfg = TrainConfig(**options)  # the options first: a bad one is named before the store is looked for
    if features is None:
        from tvrpipe.features.store import default_store

        features = default_store()
        console.print(f"features: {features}", highlight=False)
    metrics = fit(features, method, out, cfg, overrides, parse_post(post or []), recipe=record)
    sch = metrics["schedule"]
    console.print(f"selected epoch {metrics['selected_epoch']} of {sch['epochs_run']} on {metrics['validation']}"
                  f" ({describe_lrs(sch['lr_groups'])}{', stopped early' if sch['stopped_early'] else ''})",
                  highlight=False)
    print_metrics(f"{method}: test ({out / 'metrics.json'})", metrics["test"])


@app.command("evaluate", rich_help_panel=MAIN_PATH)
def evaluate(
    run: Annotated[Path, typer.Option(help="A run directory (tvrpipe train-head, or tvrpipe finetune with --features "
                                           "of a store extracted by its CLIP).")],
    split: Annotated[str, typer.Option(help="Split to evaluate: val or test (train for diagnostics).")] = "test",
    post: Annotated[Optional[list[str]], typer.Option(help="Post-processing: dsl or qbnorm (repeatable).")] = None,
    features: Annotated[
        Optional[Path], typer.Option(help="Feature store (default: the run's); its provenance must match.")
    ] = None,
) -> None:
    """Evaluate a trained run's selected checkpoint (raw scores, plus post-processing if asked)."""
    from tvrpipe.training.evaluate import evaluate_run

    metrics = evaluate_run(run, split, parse_post(post or []), features)
    print_metrics(f"{run}: {split} ({run / f'eval_{split}.json'})", metrics)


@app.command("heads", rich_help_panel=TOOLS)
def heads() -> None:
    """List the retrieval heads and their config fields with defaults."""
    import torch

    from tvrpipe.heads.base import head_class, list_heads

    for name in list_heads():
        cls = head_class(name)
        fields = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.Config))
        with torch.random.fork_rng(devices=[]):  # a small instance, for its parameter groups
            groups = ", ".join(cls(cls.Config(embed_dim=64)).param_groups())
        console.print(f"[bold]{name}[/]: {(cls.__doc__ or '').strip().splitlines()[0]} "
                      f"(default lr {cls.lr_text()}); parameter groups (finetune --group-lr): {groups}")
        console.print(f"    {fields}", highlight=False)
