"""``tvrpipe train-head``, ``tvrpipe evaluate`` and ``tvrpipe heads``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.text import Text

from tvrpipe.cli.app import MAIN_PATH, TOOLS, app, console, explicit_options, given_fields, refuse_unused
from tvrpipe.cli.options import (
    BatchSizeOption,
    EpochsOption,
    LrOption,
    MaxEpochsOption,
    PatienceOption,
    PostOption,
    WeightDecayOption,
    apply_recipe,
    parse_group_lr,
    parse_overrides,
    parse_post,
    print_metrics,
)
from tvrpipe.config import parse_memory
from tvrpipe.errors import ConfigError
from tvrpipe.training.settings import TrainConfig

TR = TrainConfig()  # the defaults, declared once: in TrainConfig



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
    epochs: EpochsOption = TR.epochs,
    max_epochs: MaxEpochsOption = TR.max_epochs,
    patience: PatienceOption = TR.patience,
    batch_size: BatchSizeOption = TR.batch_size,
    optimizer: Annotated[str, typer.Option(
        help="adamw (weight decay decoupled) or adam (weight decay as an L2 term of the gradient).")] = TR.optimizer,
    lr: LrOption = TR.lr,
    group_lr: Annotated[Optional[list[str]], typer.Option(
        help="NAME=LR: a learning rate of its own for one of the head's parameter groups (e.g. radius=3e-5 for "
             "tmass); the other groups train at --lr (repeatable; `tvrpipe heads` lists the groups).")] = None,
    weight_decay: WeightDecayOption = TR.weight_decay,
    seed: Annotated[int, typer.Option(help="Random seed (init, sampling).")] = TR.seed,
    init_from_clip: Annotated[bool, typer.Option(
        "--init-from-clip/--no-init-from-clip",
        help="Start the head's temporal transformer (seqtransf, uatvr, prota) from the text transformer of the CLIP "
             "the store was extracted with, as CLIP4Clip does; config.yaml records what was copied.")
    ] = TR.init_from_clip,
    zero_shot_start: Annotated[bool, typer.Option(
        "--zero-shot-start",
        help="NOT PART OF THE PAPERS: score = cos(sentence, mean of the frames) + g x (the head's score), with g "
             "learned from 0, so training starts at zero-shot CLIP; any head. config.yaml records it under "
             "not_in_papers and the report marks the run.")] = False,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = TR.device,
    prefetch: Annotated[
        bool, typer.Option(help="Build the next batch in a background thread (off may be faster on 2-core CPUs).")
    ] = TR.prefetch,
    memory_budget: Annotated[Optional[str], typer.Option(
        metavar="SIZE",
        help="Memory the splits may hold, e.g. 2GB or 512MiB (a bare number is GiB). Splits that fit are read into "
             "memory; larger ones are streamed from the store in chunk-aligned blocks through a shuffle buffer of half "
             "the budget. Default: half of the memory this process may use (RAM, or a lower cgroup or ulimit "
             "limit). config.yaml records the mode and order (data).")] = None,
    post: PostOption = None,
) -> None:
    """Train a retrieval head on cached features; select on validation; evaluate on test."""
    from tvrpipe.rundir import read_config
    from tvrpipe.training.core import describe_lrs
    from tvrpipe.training.fit import fit

    # what the user gave; TrainConfig holds every other default (what --help shows)
    options = given_fields(ctx, TrainConfig, convert={
        "group_lr": lambda v: parse_group_lr(v or []),
        "memory_budget": lambda v: None if v is None else parse_memory(v, "--memory-budget")})
    record = None
    if recipe is None:
        if method is None or out is None:
            raise ConfigError("give --method and --out, or a --recipe (`tvrpipe recipes`)")
        overrides = parse_overrides(method, set_ or [])
    else:
        from tvrpipe.training.recipes import TRAIN_HEAD

        r, method, overrides, record = apply_recipe(ctx, recipe, method, set_ or [], options, TRAIN_HEAD)
        out = out if out is not None else Path("runs") / f"{r.name}-head"
    if zero_shot_start:
        overrides = {**overrides, "zero_shot_start": True}
    cfg = TrainConfig(**options)  # the options first: a bad one is named before the store is looked for
    if cfg.epochs == 0:
        refuse_unused(ctx, ("batch_size", "optimizer", "lr", "group_lr", "weight_decay"),
                      "--epochs 0 trains nothing (the untrained head is evaluated); leave it out")
    if cfg.epochs is not None:
        whence = "--epochs" if "epochs" in explicit_options(ctx) else f"recipe {recipe}"
        refuse_unused(ctx, ("max_epochs", "patience"), "they shape a run until validation stops improving, and this "
                      f"one trains exactly {cfg.epochs} epochs ({whence}); leave them out")
    if features is None:
        from tvrpipe.features.store import default_store

        features = default_store()
        console.print(f"features: {features}", highlight=False)
    metrics = fit(features, method, out, cfg, overrides, parse_post(post or []), recipe=record)
    data = read_config(out).get("data") or {}
    if data.get("mode") == "streamed":
        console.print(f"streamed from the store: its splits need {data['needs']}, above the memory budget of "
                      f"{data['budget']}; {data['order']}", highlight=False)
    sch = metrics["schedule"]
    every = sch.get("validate_every_epochs") or 1
    cadence = f", validated every {every} epochs ({sch['validate_every_steps']} steps)" if every > 1 else ""
    console.print(f"selected epoch {metrics['selected_epoch']} of {sch['epochs_run']} on {metrics['validation']}"
                  f" ({describe_lrs(sch['lr_groups'])}{', stopped early' if sch['stopped_early'] else ''}{cadence}); "
                  f"{_gallery('validation', metrics['val'])}, {_gallery('test', metrics['test'])}: R@K is read "
                  "against the gallery, so validation and test compare only at equal sizes")
    if metrics["selected_epoch"] == 0 and sch["epochs_run"] > 0:
        lr = sch.get("lr")
        smaller = (f"training at lr {lr:g} made it worse, try a smaller one, e.g. --lr {lr / 10:g}" if lr is not None
                   else f"training at {describe_lrs(sch['lr_groups'])} made it worse, try rates 10 times smaller")
        console.print(f"no epoch beat the untrained head on validation, so the run keeps it (epoch 0); where "
                      f"{smaller}", style="yellow")
    if "zero_shot_gate" in metrics:
        console.print(f"--zero-shot-start (not in the papers): score = zero-shot cosine + {metrics['zero_shot_gate']:.3g} "
                      f"x the {method} score at the selected epoch")
    print_metrics(f"{method}: test ({out / 'metrics.json'})", metrics["test"],
                  (metrics.get("zero_shot") or {}).get("test"))


def _gallery(split: str, scores: dict) -> str:
    """``split``'s gallery size: its videos (v2t's queries) and captions (t2v's)."""
    return f"{split} {scores['v2t']['n']:,} videos / {scores['t2v']['n']:,} captions"


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
    from tvrpipe.progress import progress_bar
    from tvrpipe.training.evaluate import evaluate_run

    with progress_bar(elapsed=True, transient=True) as bar:  # minutes on a large split, silent otherwise
        bar.add_task(f"evaluating {run} on {split}", total=None)
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
        console.print(Text.assemble((name, "bold"), f": {(cls.__doc__ or '').strip().splitlines()[0]} "
                                    f"(default lr {cls.lr_text()}); parameter groups (finetune --group-lr): {groups}"))
        console.print(f"    {fields}", highlight=False)
