"""``tvrpipe finetune``: a head on live CLIP features, CLIP frozen or (``--end-to-end``) unfrozen."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tvrpipe.cli.app import PAPERS, app, console, finite_float, given_fields, refuse_unused
from tvrpipe.cli.options import apply_recipe, parse_group_lr, parse_overrides, parse_post, print_metrics
from tvrpipe.errors import ConfigError
from tvrpipe.training.finetune.config import FinetuneConfig

FT = FinetuneConfig()  # the defaults, declared once: in FinetuneConfig


@app.command("finetune", rich_help_panel=PAPERS)
def finetune_cmd(
    ctx: typer.Context,
    method: Annotated[Optional[str], typer.Option(help="Head to train (see `tvrpipe heads`); default: the recipe's.")] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="Manifest directory (tvrpipe manifest build / synth); default with --recipe: the recipe's dataset "
             "under --data-root (built there if need be).")] = None,
    video_root: Annotated[Optional[Path], typer.Option(
        help="Folder the manifest's video paths are relative to; default with --recipe: the dataset's videos "
             "under --data-root.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Run directory; rerun the same command to resume. Default with --recipe: runs/<recipe>.")] = None,
    recipe: Annotated[Optional[str], typer.Option(
        help="A paper's protocol for one dataset (`tvrpipe recipes`): every setting below that is not given "
             "explicitly comes from it, and the run records it.")] = None,
    data_root: Annotated[Optional[Path], typer.Option(
        help="With --recipe and no --manifest: where datasets live, one folder each (docs/datasets.md); "
             "default: $TVRPIPE_DATA, else data/.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check everything a run checks before it writes, print what it will do (settings, the "
                          "learning rate of each parameter group, split counts, steps, images per step, estimated "
                          "peak memory per worker, from a few images encoded on the CPU) and stop; writes nothing. Exits 1 where the "
                          "run would stop (with --use-gpu on a machine without CUDA, after the plan).")] = False,
    gpu_memory: Annotated[Optional[str], typer.Option(
        help="With --dry-run: a GPU's memory per worker (24GiB, 40GB, 81559MiB; a bare number is GiB). The plan says "
             "whether a step fits it, the largest --chunk-size that does, and which of --precision, "
             "--grad-checkpointing and --chunk-size the run needs to fit at all.")] = None,
    end_to_end: Annotated[
        bool, typer.Option("--end-to-end/--frozen-clip", help="Unfreeze both CLIP towers (the papers' setting); "
                           "--frozen-clip (the default without a recipe) keeps CLIP frozen and trains only the head, on "
                           "live features.")
    ] = FT.end_to_end,
    model: Annotated[str, typer.Option(help="open_clip architecture, e.g. ViT-B-32, or tvrpipe-tiny.")] = FT.model,
    pretrained: Annotated[
        str, typer.Option(help="open_clip pretrained tag (e.g. openai), a local checkpoint file, or 'none' (seeded random).")
    ] = FT.pretrained,
    epochs: Annotated[int, typer.Option(help="Epochs (warmup 10 %, then cosine); the epoch is selected on validation.")] = FT.epochs,
    epoch_pairs: Annotated[str, typer.Option(
        help="What an epoch visits: 'captions', every training caption with its video once (the papers' epoch; no "
             "video twice in a batch unless one has about as many captions as the epoch has batches), or 'videos', "
             "one random caption per video (train-head's epoch).")] = FT.epoch_pairs,
    batch_size: Annotated[int, typer.Option(help="Pairs per step over all workers.")] = FT.batch_size,
    frames: Annotated[Optional[int], typer.Option(help="Frames per video (default: the dataset's, e.g. 12).")] = FT.frames,
    max_words: Annotated[Optional[int], typer.Option(help="Text tokens L (default: the dataset's, e.g. 32).")] = FT.max_words,
    optimizer: Annotated[str, typer.Option(
        help="adamw (weight decay decoupled) or adam (weight decay as an L2 term of the gradient).")] = FT.optimizer,
    clip_lr: Annotated[float, typer.Option(
        parser=finite_float, help="Learning rate of the CLIP towers (with --end-to-end).")] = FT.clip_lr,
    head_lr: Annotated[float, typer.Option(
        parser=finite_float, help="Learning rate of the head.")] = FT.head_lr,
    group_lr: Annotated[Optional[list[str]], typer.Option(
        help="NAME=LR: a learning rate of its own for one of the head's parameter groups, e.g. radius=3e-5 for "
             "tmass (T-MASS Sec. 4.1); the head's other groups train at --head-lr (repeatable; `tvrpipe heads` "
             "lists each head's groups).")] = None,
    weight_decay: Annotated[float, typer.Option(parser=finite_float,
        help="Weight decay, on weight matrices only: gains, biases, embeddings and the head's logit scale are "
             "exempt (docs/training.md).")] = FT.weight_decay,
    grad_clip: Annotated[float, typer.Option(
        parser=finite_float, help="Gradient norm clip (0: none).")] = FT.grad_clip,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Head config override key=value (repeatable).")
    ] = None,
    num_workers: Annotated[
        int, typer.Option(help="0: train in this process; N: N Ray Train workers (DDP, negatives gathered across "
                               "them; --batch-size is split between them).")
    ] = FT.num_workers,
    use_gpu: Annotated[bool, typer.Option("--use-gpu", help="One GPU per worker (or for this process).")] = FT.use_gpu,
    address: Annotated[
        Optional[str], typer.Option(help="Ray cluster to join ('auto' or host:port); --out must be on storage every "
                                         "node reaches.")
    ] = FT.address,
    precision: Annotated[str, typer.Option(help="fp32, fp16 (GPU, with a gradient scaler) or bf16 autocast of CLIP.")] = FT.precision,
    grad_checkpointing: Annotated[
        bool, typer.Option("--grad-checkpointing", help="Recompute CLIP activations in backward (less memory).")
    ] = FT.grad_checkpointing,
    chunk_size: Annotated[
        Optional[int], typer.Option(help="Pairs CLIP encodes at a time on each worker: the step still computes the whole "
                                         "batch's gradient (every negative), with CLIP's activations for one chunk "
                                         "in memory instead of the batch's (docs/training.md). Default: the batch "
                                         "at once.")
    ] = FT.chunk_size,
    init_from_clip: Annotated[
        bool, typer.Option("--init-from-clip/--no-init-from-clip",
                           help="Start the head's temporal transformer from CLIP's text transformer (CLIP4Clip seqTransf, "
                                "ProTA, UATVR's DSA), where widths and heads agree.")
    ] = FT.init_from_clip,
    loader_workers: Annotated[
        Optional[int], typer.Option(help="Decoding processes per worker (default: its CPUs, at most 8).")
    ] = FT.loader_workers,
    cpus_per_worker: Annotated[
        Optional[int], typer.Option(help="CPUs per Ray Train worker (default: the cluster's CPUs split evenly).")
    ] = FT.cpus_per_worker,
    seed: Annotated[int, typer.Option(help="Random seed (init, sampling, --pretrained none).")] = FT.seed,
    timeout: Annotated[float, typer.Option(
        parser=finite_float, help="Per-video decode timeout in seconds (at most 2,000,000).")] = FT.timeout_s,
    max_failed_fraction: Annotated[float, typer.Option(
        parser=finite_float, help="Exit 1 if more than this fraction of the training (or test) videos is missing "
                                  "or fails to decode: before anything is written when the files are not there, "
                                  "else after the epoch that found them (it is kept; rerun to resume).")] = FT.max_failed_fraction,
    post: Annotated[
        Optional[list[str]], typer.Option(help="Also report test metrics after dsl or qbnorm (repeatable).")
    ] = None,
) -> None:
    """Train a head on live CLIP features of decoded videos; select on validation; evaluate on test.

    With --end-to-end both CLIP towers train too and the selected CLIP is exported as OUT/clip.safetensors,
    which `tvrpipe extract --pretrained` loads. Rerun the same command to resume after the last complete epoch.
    """
    from tvrpipe.training.core import describe_lrs
    from tvrpipe.training.finetune import finetune

    # what the user gave; FinetuneConfig holds every other default (what --help shows)
    options = given_fields(ctx, FinetuneConfig, {"timeout": "timeout_s"},
                           {"group_lr": lambda v: parse_group_lr(v or [])})
    record = None
    if recipe is None:
        missing = [f"--{k.replace('_', '-')}" for k, v in (("method", method), ("manifest", manifest),
                                                             ("video_root", video_root), ("out", out)) if v is None]
        if missing:
            raise ConfigError(f"give {', '.join(missing)}, or a --recipe (`tvrpipe recipes`)")
        if data_root is not None:
            raise ConfigError(f"--data-root {data_root} finds a recipe's dataset; without --recipe the data is "
                              f"--manifest {manifest} and --video-root {video_root}: drop --data-root")
        overrides = parse_overrides(method, set_ or [])
    else:
        r, method, overrides, record = apply_recipe(ctx, recipe, method, set_ or [], options)
        if manifest is None:
            import tempfile

            from tvrpipe.data.layout import prepare_dataset
            from tvrpipe.worlds.videos import generate_dataset

            # a dry run builds a manifest it needs in a scratch folder, removed when the command ends
            scratch = ctx.with_resource(tempfile.TemporaryDirectory(prefix="tvrpipe-dry-run-")) if dry_run else None
            lay = prepare_dataset(r.dataset, data_root, r.split_set.value, video_root=video_root, scratch=scratch,
                                  generate=generate_dataset)
            manifest, video_root = lay.manifest, lay.videos
        elif video_root is None:
            raise ConfigError(f"--manifest {manifest}: give --video-root too")
        elif data_root is not None:
            raise ConfigError(f"--data-root {data_root} finds the recipe's dataset when no --manifest is given; with "
                              f"--manifest {manifest} it would be ignored: drop one of them")
        out = out if out is not None else Path("runs") / r.name
    cfg = FinetuneConfig(**options)
    if not cfg.end_to_end:
        refuse_unused(ctx, ("clip_lr", "grad_checkpointing"), "CLIP stays frozen without --end-to-end, so it would "
                      "have no effect; give --end-to-end, or leave it out")
    if cfg.epochs == 0:
        refuse_unused(ctx, ("batch_size", "epoch_pairs", "optimizer", "clip_lr", "head_lr", "group_lr", "weight_decay",
                            "grad_clip", "grad_checkpointing", "chunk_size"),
                      "--epochs 0 trains nothing (the untrained models are evaluated); leave it out")
    if cfg.num_workers == 0:
        refuse_unused(ctx, ("address", "cpus_per_worker"), "only Ray Train workers use it (--num-workers N); give "
                      "--num-workers, or leave it out")
    budget = None
    if gpu_memory is not None:
        if not dry_run:
            raise ConfigError("--gpu-memory is the dry run's question (does a step fit this GPU?); give --dry-run, "
                              "or leave it out")
        from tvrpipe.config import parse_memory

        budget = parse_memory(gpu_memory)
    metrics = finetune(manifest, video_root, method, out, cfg, overrides, parse_post(post or []), recipe=record,
                       dry_run=dry_run, gpu_memory=budget)
    if dry_run:
        print_plan(metrics)
        if metrics["gpu"]:  # the plan is for a machine with the GPUs; here the run itself would stop
            raise ConfigError(f"{metrics['gpu']} (the dry run above plans the run for a machine with them)")
        return
    sch = metrics["schedule"]
    console.print(f"selected epoch {metrics['selected_epoch']} of {sch['epochs_run']} on {metrics['validation']} "
                  f"({describe_lrs(sch['lr_groups'])})"
                  + (f"; {metrics['failed_videos']} videos failed to decode (see {out / 'failures.csv'})"
                     if metrics["failed_videos"] else ""), highlight=False)
    print_metrics(f"{method}: test ({out / 'metrics.json'})", metrics["test"])
    if metrics.get("export"):
        console.print(f"finetuned CLIP: {out / metrics['export']['file']}; extract with it: "
                      f"{metrics['export']['extract']}", highlight=False, soft_wrap=True)


def print_plan(plan: dict) -> None:
    """What ``finetune --dry-run`` found: the settings, the data, the steps and the estimated memory."""
    from tvrpipe.training.core import describe_lrs
    from tvrpipe.training.recipes import mismatch_warning

    cfg = plan["config"]
    recipe = cfg.get("recipe")
    console.print(f"dry run of finetune {plan['method']}" + (f" (recipe {recipe['name']})" if recipe else "")
                  + f"; nothing was written; the run would write {plan['out']}", highlight=False, soft_wrap=True)
    for section in ("finetune", "execution"):
        console.print(f"{section}: " + ", ".join(f"{k}={v}" for k, v in cfg[section].items()), highlight=False,
                      soft_wrap=True)
    console.print("head: " + ", ".join(f"{k}={v}" for k, v in cfg["head"].items()), highlight=False, soft_wrap=True)
    resolved = cfg["resolved"]
    console.print(f"learning rates: {describe_lrs(resolved['lr_groups'])}", highlight=False, soft_wrap=True)
    if resolved["init_from_clip"] is not None:
        init = resolved["init_from_clip"]
        console.print("from CLIP: " + (", ".join(init) if isinstance(init, list) else init), highlight=False,
                      soft_wrap=True)
    if recipe and recipe.get("mismatch"):
        console.print(f"note: {mismatch_warning(recipe)}", highlight=False, soft_wrap=True)
    console.print("data: " + "; ".join(f"{s} {c['videos']} videos / {c['captions']} captions"
                                       for s, c in plan["splits"].items()) + f" (validation: {plan['validation']})",
                  highlight=False, soft_wrap=True)
    console.print(f"steps: {plan['steps_per_epoch']} an epoch x {plan['epochs']} epochs = {plan['total_steps']}; "
                  f"{plan['pairs_per_step']} pairs, {plan['images_per_step']} images a step "
                  f"({plan['images_per_step_per_worker']} on each of {plan['workers']} worker(s))", highlight=False)
    m = plan["memory"]
    gb = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    chunked = m["chunk"] < m["pairs"]
    how = (f"CLIP encoding {m['chunk']} of its {m['pairs']} pairs at a time; the batch at once: "
           f"{gb(m['unchunked_total'])}" if chunked else f"CLIP encoding its {m['pairs']} pairs at once")
    console.print(f"estimated peak memory per worker: {gb(m['total'])} ({how}; an estimate: weights {gb(m['weights'])}, "
                  f"gradients {gb(m['gradients'])}, optimiser {gb(m['optimizer'])}, input frames {gb(m['inputs'])}, "
                  f"activations {gb(m['activations'])}: CLIP {gb(m['clip_activations'])}, the head over "
                  f"{m['gathered']} pairs {gb(m['head_activations'])}"
                  + (f", cached features {gb(m['cached'])}" if chunked else "")
                  + f"; measured on {m['seconds']:.1f} s of CPU passes; a GPU adds its context, about 0.5 GiB)",
                  highlight=False, soft_wrap=True)
    fit = plan.get("fit")
    if fit:
        budget = gb(fit["budget"])
        largest = fit["largest_chunk"]
        chunk_line = ("not one pair at a time fits as set" if largest is None else
                      f"the largest --chunk-size that fits: {largest}" + (" (the batch at once)" if largest >= m["pairs"]
                                                                          else ""))
        if fit["fits"]:
            verdict = f"fits {budget} per worker"
        elif fit["needs"]:
            verdict = f"does not fit {budget} per worker as set; it fits with {' '.join(fit['needs'])}"
        else:
            verdict = (f"does not fit {budget} per worker with any precision, gradient checkpointing or chunk size "
                       "tvrpipe offers: lower --frames or --batch-size, or use more workers (--num-workers)")
        console.print(f"GPU memory: the step {verdict}; {chunk_line}", highlight=False, soft_wrap=True)
