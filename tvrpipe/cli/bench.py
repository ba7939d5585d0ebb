"""``tvrpipe bench``: speed and memory benchmarks, reported as ratios measured in one run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from tvrpipe.bench.extract import BenchVideos, bench_extract
from tvrpipe.bench.finetune import MSRVTT_LIKE, bench_finetune
from tvrpipe.bench.heads import bench_allocator, bench_eval, bench_step, bench_train_head
from tvrpipe.bench.moments import bench_moments
from tvrpipe.bench.search import bench_search
from tvrpipe.bench.serve import bench_serve
from tvrpipe.bench.streamed import bench_streamed
from tvrpipe.bench.worlds import bench_worlds
from tvrpipe.cli.app import BENCHMARKS, app, console, defaults_of, finite_float, new_app, refuse_unused
from tvrpipe.search.first_stages import first_stage_help

# each option's default is the benchmark function's (or its videos'), declared there once
BV, BX, BF, BT, BE, BA, BS = (BenchVideos(), defaults_of(bench_extract), defaults_of(bench_finetune),
                              defaults_of(bench_train_head), defaults_of(bench_eval), defaults_of(bench_allocator),
                              defaults_of(bench_search))
BW, BM, BO = defaults_of(bench_worlds), defaults_of(bench_streamed), defaults_of(bench_moments)
BR, BP = defaults_of(bench_serve), defaults_of(bench_step)


def _json_target(path: Optional[Path]) -> Optional[Path]:
    """``--json``'s check, before the measurement (which may take hours) rather than after: a file name whose
    folder exists or can be made, writable, outside the folders tvrpipe made. Nothing is created until the
    measurement is written."""
    from tvrpipe.features.outputs import check_output_files

    check_output_files({"--json": path})
    return path


def _work_dir(path: Path) -> Path:
    """A bench's ``--out``, checked before anything is generated: a folder (or a name for one) that is not, and
    is not inside, a store, manifest or run tvrpipe made for another purpose."""
    from tvrpipe.errors import ConfigError
    from tvrpipe.features.outputs import check_output_folder

    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {path} is a file; a bench's --out is a working folder: choose another path")
    check_output_folder(path)
    return path


JsonOut = Annotated[Optional[Path], typer.Option(
    "--json", help="Also write the measurements as JSON to this file (its folder is created).",
    callback=_json_target)]


def _write_json(path: Optional[Path], data) -> None:
    if path is not None:
        from tvrpipe.files import atomic_write_text

        atomic_write_text(path, json.dumps(data, indent=2) + "\n", parents=True)


bench_app = new_app(help="Benchmarks: throughput ratios measured in one run (see docs/performance.md).")
app.add_typer(bench_app, name="bench", rich_help_panel=BENCHMARKS)


@bench_app.command("extract")
def bench_extract_cmd(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory (videos are rendered once and reused).")] = Path(
        "bench/extract"
    ),
    videos: Annotated[int, typer.Option(help="Number of generated videos.")] = BV.count,
    width: Annotated[int, typer.Option(help="Video width in pixels.")] = BV.width,
    height: Annotated[int, typer.Option(help="Video height in pixels.")] = BV.height,
    seconds: Annotated[float, typer.Option(parser=finite_float, help="Video length in seconds.")] = BV.seconds,
    fps: Annotated[int, typer.Option(help="Video frame rate.")] = BV.fps,
    model: Annotated[str, typer.Option(help="open_clip architecture (random weights).")] = BX.model,
    device: Annotated[str, typer.Option(help="Encoder device: cpu or cuda.")] = BX.device,
    batch_size: Annotated[int, typer.Option(help="Videos per encoder call.")] = BX.batch_size,
    precision: Annotated[str, typer.Option(
        help="tvrpipe's encode precision, as `extract --precision` (the peer loop stays in fp32).")] = BX.precision,
    long_video: Annotated[Optional[float], typer.Option(
        parser=finite_float, metavar="SECONDS",
        help="Instead: a generated file this long (e.g. 3600) cut into --window moments, decoded as extraction "
             "decodes a collection's moments, against one decode pass of the file.", show_default=False)] = None,
    window: Annotated[float, typer.Option(
        parser=finite_float, help="With --long-video: the moments' length in seconds.")] = BO.window,
    stride: Annotated[Optional[float], typer.Option(
        parser=finite_float, help="With --long-video: a moment starts every STRIDE seconds (default: the window).",
        show_default=False)] = None,
    json_out: JsonOut = None,
) -> None:
    """Measure extraction under each executor (this machine without Ray; Ray, where installed) against its
    bound (decode-only, encode-only), a naive loop and the loop a user would write instead (open_clip + PyAV),
    with each one's start-up; with --long-video, a long file's moments
    against one decode pass of it."""
    if long_video is not None:
        refuse_unused(ctx, ("videos", "width", "height", "seconds", "fps", "model", "device", "batch_size", "precision"),
                      "--long-video measures decoding alone, on its own generated file")
        r = bench_moments(out, long_video, window, stride)
        for line in r.lines():
            console.print(line, highlight=False)
        _write_json(json_out, r.record())
        return
    refuse_unused(ctx, ("window", "stride"), "they cut --long-video's file")

    r = bench_extract(out, BenchVideos(count=videos, width=width, height=height, seconds=seconds, fps=fps),
                      model=model, device=device, batch_size=batch_size, precision=precision)
    for line in r.lines():
        console.print(line)
    _write_json(json_out, r.record())


@bench_app.command("train-head")
def bench_train_head_cmd(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory (the 5.9 GB scale store is generated once).")] = Path(
        "bench/train-head"
    ),
    method: Annotated[Optional[list[str]], typer.Option(help="Heads to measure (repeatable; default: all).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps per method.")] = BT.steps,
    batch_size: Annotated[int, typer.Option(help="Pairs per training step.")] = BT.batch_size,
    prefetch: Annotated[bool, typer.Option(help="Train with batch prefetching (as train-head does by default).")] = BT.prefetch,
    streamed: Annotated[bool, typer.Option(
        "--streamed", help="Instead: train on a store larger than --memory-budget, streamed, and compare streamed "
                           "with in-memory training on a store that fits (one head: --method, default xpool).")
    ] = False,
    memory_budget: Annotated[str, typer.Option(
        metavar="SIZE", help="With --streamed: the budget the large store is streamed under (e.g. 2GB).")] = "1GB",
    store_factor: Annotated[float, typer.Option(
        help="With --streamed: the large store's features as a multiple of the budget.")] = BM.factor,
    epochs: Annotated[int, typer.Option(help="With --streamed: epochs of each run.")] = BM.epochs,
    json_out: JsonOut = None,
) -> None:
    """Per head at MSR-VTT 9k/1k-A scale: samples/s, data share, test evaluation time and memory; with
    --streamed, training on a store larger than memory."""
    from rich.table import Table

    if streamed:
        _bench_streamed(ctx, out, method, batch_size, memory_budget, store_factor, epochs, json_out)
        return
    refuse_unused(ctx, ("memory_budget", "store_factor", "epochs"), "they belong to --streamed")

    rows = bench_train_head(out, method, steps, batch_size, prefetch=prefetch)
    table = Table(title="train-head at MSR-VTT 9k / 1k-A scale")
    for col in ("method", "samples/s", "data share", "test eval (s)", "eval extra (GB)", "peak RSS (GB)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["method"], f"{r['samples_per_s']:.0f}", f"{100 * r['data_share']:.1f} %",
                      f"{r['test_eval_seconds']:.2f}", f"{r['test_eval_extra_gb']:.2f}", f"{r['peak_rss_gb']:.2f}")
    console.print(table)
    for r in rows:  # the heads whose official code was measured at the same size
        if r["official_seconds"]:
            console.print(f"{r['method']} evaluation vs the official code ({r['official_seconds']:.0f} s, "
                          f"{r['official_peak_gb']} GB): {r['official_seconds'] / r['test_eval_seconds']:.1f}x "
                          f"faster, {r['test_eval_extra_gb']:.2f} GB extra")
    _write_json(json_out, rows)


def _bench_streamed(ctx: typer.Context, out: Path, method: Optional[list[str]], batch_size: int, memory_budget: str,
                    store_factor: float, epochs: int, json_out: Optional[Path]) -> None:
    """``bench train-head --streamed``: its three runs and the targets they meet."""
    from tvrpipe.config import parse_memory
    from tvrpipe.errors import ConfigError

    refuse_unused(ctx, ("steps", "prefetch"), "--streamed trains whole epochs with train-head's defaults")
    if method and len(method) > 1:
        raise ConfigError("--streamed measures one head: give --method once")
    budget = parse_memory(memory_budget, "--memory-budget")
    r = bench_streamed(out, budget, store_factor, method[0] if method else BM.method, epochs, batch_size)
    g = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    mark = lambda ok: "yes" if ok else "NO"  # noqa: E731
    console.print(f"{r.method}: a store of {r.large_videos:,} training videos, {g(r.large_needs)} of features in memory "
                  f"({r.store_factor:.1f}x the {g(r.budget)} budget; {g(r.large_disk)} on disk), streamed for "
                  f"{epochs} epoch(s) at {r.large_samples_per_s:,.0f} samples/s ({r.large_data['order']})")
    console.print(f"  peak RSS {g(r.large_peak)} vs budget + model {g(r.budget + r.model_peak)} (model alone "
                  f"{g(r.model_peak)}): under {mark(r.under_budget)}; the budget held one evaluation of "
                  f"{r.large_test_videos:,} test videos ({g(r.large_evaluation)}) and the store's tables "
                  f"({g(r.large_tables)}); the streamed epoch alone, without a model, adds {g(r.stream_added)}")
    console.print(f"{r.small_videos:,} training videos ({g(r.small_needs)}), in memory vs streamed: "
                  f"{r.memory_samples_per_s:,.0f} vs {r.streamed_samples_per_s:,.0f} samples/s = "
                  f"{r.throughput_ratio:.2f}x (target >= 0.8: {mark(r.throughput_ratio >= 0.8)}); peak RSS "
                  f"{g(r.memory_peak)} vs {g(r.streamed_peak)}")
    console.print(f"  last trained epoch: loss {r.memory_loss:.3f} vs {r.streamed_loss:.3f}, validation t2v R@1 "
                  f"{r.memory_val_r1:.1f} vs {r.streamed_val_r1:.1f} on {r.val_n} captions (untrained "
                  f"{r.untrained_val_r1:.1f}; noise sd of a difference {r.noise_sd:.1f}): both trained "
                  f"{mark(r.both_trained)}, within 2 sd of each other {mark(r.within_noise)}")
    _write_json(json_out, r.record())


@bench_app.command("finetune")
def bench_finetune_cmd(
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory (videos are rendered once and reused).")] = Path(
        "bench/finetune"
    ),
    model: Annotated[str, typer.Option(help="open_clip architecture (random weights), e.g. ViT-B-32 or tvrpipe-tiny.")] = BF.model,
    method: Annotated[str, typer.Option(help="Head trained with CLIP.")] = BF.method,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = BF.device,
    precision: Annotated[str, typer.Option(help="fp32, fp16 (GPU) or bf16.")] = BF.precision,
    batch_size: Annotated[int, typer.Option(help="Pairs per step.")] = BF.batch_size,
    frames: Annotated[int, typer.Option(help="Frames per video.")] = BF.frames,
    steps: Annotated[int, typer.Option(help="Training steps measured (the first is left out of steady state).")] = BF.steps,
    grad_checkpointing: Annotated[bool, typer.Option("--grad-checkpointing", help="Activation checkpointing.")] = BF.grad_checkpointing,
    chunk_size: Annotated[Optional[int], typer.Option(
        help="Pairs CLIP encodes at a time (finetune --chunk-size; default: the batch at once).")] = BF.chunk_size,
    loader_workers: Annotated[Optional[int], typer.Option(help="Decoding processes (default: the CPUs, at most 8).")] = BF.loader_workers,
    width: Annotated[int, typer.Option(help="Video width in pixels.")] = MSRVTT_LIKE.width,
    height: Annotated[int, typer.Option(help="Video height in pixels.")] = MSRVTT_LIKE.height,
    seconds: Annotated[float, typer.Option(parser=finite_float, help="Video length in seconds.")] = MSRVTT_LIKE.seconds,
    json_out: JsonOut = None,
) -> None:
    """End-to-end finetuning: clips/s, data-loading share of step time and peak memory."""

    videos = BenchVideos(**{**asdict(MSRVTT_LIKE), "width": width, "height": height, "seconds": seconds})
    r = bench_finetune(out, model, method, device, precision, batch_size, frames, steps, videos,
                       grad_checkpointing, loader_workers, chunk_size)
    for line in r.lines():
        console.print(line, highlight=False)
    _write_json(json_out, asdict(r))


@bench_app.command("convergence")
def bench_convergence_cmd(
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory (stores are generated once and reused; benches "
                                           "of other heads may share it, side by side).")] = Path(
        "bench/convergence"
    ),
    size: Annotated[
        Optional[list[str]], typer.Option(help="Store sizes: small, medium, msrvtt9k (repeatable; default: small, medium).")
    ] = None,
    method: Annotated[Optional[list[str]], typer.Option(help="Heads (repeatable; default: all).")] = None,
    lr: Annotated[Optional[list[float]], typer.Option(
        parser=finite_float, help="Learning rates (repeatable; default 1e-4 .. 1e-2).")] = None,
    epochs: Annotated[Optional[list[int]], typer.Option(help="Grid epoch counts (repeatable; default 5, 15, 40).")] = None,
    only_default: Annotated[bool, typer.Option(
        help="Run only train-head's default (no grid): its cost and curve on stores too large for the grid.")] = False,
    no_grid: Annotated[bool, typer.Option(
        help="Run the open-ended schedule at each --lr and the default, not the fixed-epoch grid; the best "
             "open-ended lr is then the target (msrvtt9k, where a run takes hours).")] = False,
) -> None:
    """Does train-head's default schedule reach the best validation R@1 of a grid of lrs x epochs?"""
    from rich.table import Table

    from tvrpipe.bench.convergence import EPOCHS, LRS, bench_convergence

    rows = bench_convergence(out, size, method, tuple(lr or LRS), tuple(epochs or EPOCHS),
                             only_default=only_default, no_grid=no_grid)
    table = Table(title=f"validation t2v R@1: default schedule vs grid ({out / 'summary.csv'}, curves.png)")
    for col in ("store", "method", "grid best", "(run)", "default", "gap", "default lr", "epochs", "seconds",
                "best open lr"):
        table.add_column(col, justify="right")
    for r in rows:
        def num(x, fmt):
            return "-" if x is None else format(x, fmt)

        table.add_row(r["store"], r["method"], num(r["grid_best_r1"], ".1f"), r["grid_best"] or "-",
                      f"{r['default_r1']:.1f}", num(r["gap"], "+.1f"), f"{r['default_lr']:g}",
                      str(r["default_epochs_run"]), f"{r['default_seconds']:.0f}", num(r["best_open_lr"], "g"))
    console.print(table)


@bench_app.command("worlds")
def bench_worlds_cmd(
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory (stores and runs; rerun to resume).")] = Path(
        "bench/worlds"),
    world: Annotated[Optional[list[str]], typer.Option(
        help="onescene, multiscene (1,000 test videos, sized by --train-videos and --dim), or a world of fixed "
             "size: the synth presets small, medium, msrvtt9k, or search (bench search's benchmark) "
             "(repeatable; default onescene and multiscene).")] = None,
    method: Annotated[Optional[list[str]], typer.Option(
        help="Heads (repeatable; default every head with parameters that change a ranking).")] = None,
    train_videos: Annotated[int, typer.Option(help="Train videos of onescene and multiscene (x 4 captions).")] = BW.train_videos,
    dim: Annotated[int, typer.Option(help="Feature width D of onescene and multiscene (512: ViT-B/32, the "
                                          "calibration's).")] = BW.dim,
    max_epochs: Annotated[Optional[int], typer.Option(
        help=f"Cap of each run's shortened schedule (epochs; default {BW.max_epochs}).")] = None,
    patience: Annotated[Optional[int], typer.Option(
        help=f"Epochs without a better validation score before a shortened run stops (default {BW.patience}).")] = None,
    full_schedule: Annotated[bool, typer.Option(
        "--full-schedule", help="Train with train-head's own default schedule (what `tvrpipe train-head` runs: "
                                "patience of at least 300 steps, validation every k epochs on small stores) "
                                "instead of the shortened one.")] = BW.full_schedule,
    set_: Annotated[Optional[list[str]], typer.Option(
        "--set", help="Generator field=value set on every world (repeatable), e.g. multi_scene=0.1 for a sweep, "
                      "caption_shift=0 for the world without its learnable share; give each setting its own --out.")] = None,
    zero_shot_start: Annotated[bool, typer.Option(
        "--zero-shot-start/--no-zero-shot-start",
        help="Also train each head from zero-shot CLIP (not in the papers).")] = BW.zero_shot_start,
) -> None:
    """Does each head beat zero-shot CLIP on the calibrated worlds, with its defaults (and with --zero-shot-start)?"""
    from rich.table import Table

    from tvrpipe.config import parse_fields
    from tvrpipe.errors import ConfigError
    from tvrpipe.worlds.features import GenSpec

    if full_schedule and (max_epochs is not None or patience is not None):
        raise ConfigError("--max-epochs and --patience size the shortened schedule; --full-schedule trains with "
                          "train-head's own: give one or the other")
    fields = parse_fields(GenSpec, set_ or [], "--set", "--set")
    rows = bench_worlds(out, world, method, train_videos, dim, BW.max_epochs if max_epochs is None else max_epochs,
                        BW.patience if patience is None else patience, fields=fields,
                        zero_shot_start=zero_shot_start, full_schedule=full_schedule)
    table = Table(title=f"test t2v R@1 against zero-shot CLIP on the same queries ({out / 'worlds.md'})")
    for col in ("world", "head", "start", "epoch", "test R@1 [95 %]", "zero-shot", "difference [95 %]", "verdict"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r.world, r.method, "zero-shot" if r.zero_shot_start else "paper's",
                      f"{r.selected_epoch}/{r.epochs_run}", f"{r.test_r1:.1f} [{r.test_low:.1f}, {r.test_high:.1f}]",
                      f"{r.zero_shot_r1:.1f}", f"{r.diff:+.1f} [{r.diff_low:+.1f}, {r.diff_high:+.1f}]", r.verdict)
    console.print(table)


@bench_app.command("eval")
def bench_eval_cmd(
    method: Annotated[Optional[list[str]], typer.Option(help="Heads to measure (repeatable; default: all).")] = None,
    size: Annotated[
        Optional[list[str]], typer.Option(help="Test-set sizes: msrvtt1k (1,000 x 1,000), msvd (27,763 x 670); repeatable.")
    ] = None,
    dim: Annotated[int, typer.Option(help="Embedding width D (ViT-B/32: 512).")] = BE.dim,
    device: Annotated[str, typer.Option(help="cpu or cuda (cuda:N).")] = BE.device,
    json_out: JsonOut = None,
) -> None:
    """Per head: evaluation time and memory on random features of the MSR-VTT 1k-A and MSVD test sizes."""
    from rich.table import Table

    from tvrpipe.training.fit import TrainConfig

    TrainConfig(device=device)  # the trainer's check of the device option
    rows = bench_eval(method, size, dim=dim, device=device)
    cuda = device.startswith("cuda")
    table = Table(title=f"evaluation through the block engine on {device} (random features, F = 12, L = 32)")
    # the official code's figures were measured on a 2-core CPU: a comparison for CPU runs only
    last = "GPU peak GB" if cuda else "official (2-core CPU)"
    for col in ("size", "method", "captions x videos", "seconds", "extra GB", "beyond scores GB", last):
        table.add_column(col, justify="right")
    for r in rows:
        if cuda:
            extra = f"{r['peak_gpu_gb']:.2f}"
        else:
            extra = (f"{r['official_seconds']:.0f} s, {r['official_peak_gb']} GB: "
                     f"{r['official_seconds'] / r['seconds']:.0f}x faster" if r["official_seconds"] else "")
        table.add_row(r["size"], r["method"], f"{r['n_texts']:,} x {r['n_videos']:,}", f"{r['seconds']:.2f}",
                      f"{r['extra_gb']:.2f}", f"{r['extra_beyond_scores_gb']:.2f}", extra)
    console.print(table)
    seconds = {(r["size"], r["method"]): r["seconds"] for r in rows}
    for (s, m), sec in seconds.items():  # the token-level heads against the plain token-wise score (target <= 2x)
        if m in ("uatvr", "prota") and (s, "tokenwise") in seconds:
            console.print(f"{s}: {m} / tokenwise = {sec / seconds[(s, 'tokenwise')]:.1f}x the evaluation time")
    _write_json(json_out, rows)


@bench_app.command("allocator")
def bench_allocator_cmd(
    method: Annotated[Optional[list[str]], typer.Option(help="Heads to measure (repeatable; default: all).")] = None,
    steps: Annotated[int, typer.Option(help="Timed training steps per head and allocator (after two warm-up steps).")] = BA.steps,
    batch_size: Annotated[int, typer.Option(help="Pairs per training step.")] = BA.batch_size,
    dim: Annotated[int, typer.Option(help="Embedding width D (ViT-B/32: 512).")] = BA.dim,
    json_out: JsonOut = None,
) -> None:
    """Per head: training step time with train-head's malloc tuning vs glibc's defaults (fresh processes)."""
    from rich.table import Table


    if steps < 1 or batch_size < 2 or dim < 1:
        raise typer.BadParameter("--steps must be >= 1, --batch-size >= 2 and --dim >= 1")
    rows = bench_allocator(method, steps, batch_size, dim=dim)
    table = Table(title=f"a training step of {batch_size} random pairs, D = {dim} (F = 12, L = 14)")
    for col in ("method", "s/step tuned", "s/step glibc", "speedup", "faults/step tuned", "faults/step glibc",
                "peak GB tuned", "peak GB glibc"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["method"], f"{r['step_seconds_tuned']:.3f}", f"{r['step_seconds_default']:.3f}",
                      f"{r['speedup']:.2f}x", f"{r['faults_per_step_tuned']:,.0f}",
                      f"{r['faults_per_step_default']:,.0f}", f"{r['peak_rss_gb_tuned']:.2f}",
                      f"{r['peak_rss_gb_default']:.2f}")
    console.print(table)
    console.print(f"tuned: {rows[0]['allocator']}" if rows else "no heads measured")
    _write_json(json_out, rows)


@bench_app.command("step")
def bench_step_cmd(
    ctx: typer.Context,
    method: Annotated[Optional[list[str]], typer.Option(help="Heads to measure (repeatable; default: all).")] = None,
    versus: Annotated[str, typer.Option(help="The head every rate is compared with.")] = BP.versus,
    dim: Annotated[Optional[list[int]], typer.Option(
        help="Embedding widths D (repeatable; default: 64 and 512).")] = None,
    batch_size: Annotated[int, typer.Option(help="Pairs per training step.")] = BP.batch_size,
    frames: Annotated[int, typer.Option(help="Frames per video (F) of the random batch.")] = BP.frames,
    words: Annotated[int, typer.Option(help="Token columns (L) of the random batch's captions.")] = BP.words,
    steps: Annotated[int, typer.Option(help="Timed training steps per head and width (after two warm-up steps).")
                     ] = BP.steps,
    features: Annotated[Optional[Path], typer.Option(
        help="Instead of random features: train-head's first batch of this store's training split (its width, "
             "frames and the batch's caption lengths; e.g. `tvrpipe synth --features-only --preset small`).")] = None,
    json_out: JsonOut = None,
) -> None:
    """Per head and width: train-head's training step in samples/s, and how many times slower than --versus."""
    from rich.markup import escape
    from rich.table import Table

    if features is not None:
        refuse_unused(ctx, ("dim", "frames", "words"), "with --features the store's batch has its own width, "
                                                      "frames and caption lengths")
    rows = bench_step(method, versus, dim, batch_size, frames, words, steps, features)
    what = (f"train-head's first batch of {escape(str(features))}" if features is not None
            else f"{batch_size} random pairs, F = {frames}, L = {words}")
    table = Table(title=f"a training step (forward, loss, backward, AdamW): {what}")
    for col in ("D", "method", "batch x L x F", "s/step", "samples/s", f"{versus} samples/s", "x slower",
                "threads"):
        table.add_column(col, justify="right")
    for r in rows:
        words_read = r["words"] or "-"  # a head that reads no word tokens gets none
        table.add_row(str(r["dim"]), r["method"], f"{r['batch_size']} x {words_read} x {r['frames']}",
                      f"{r['step_seconds']:.3f}", f"{r['samples_per_s']:,.0f}", f"{r['versus_samples_per_s']:,.0f}",
                      f"{r['ratio']:.2f}x", str(r["threads"]))
    console.print(table)
    _write_json(json_out, rows)


@bench_app.command("search")
def bench_search_cmd(
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory: the generated stores (4.5 GB at 100,000 videos) and "
                                           "the trained runs are made once and reused; results.json.")] = Path(
        "bench/search"
    ),
    videos: Annotated[int, typer.Option(help="Videos of the searched collection.")] = BS.videos,
    queries: Annotated[int, typer.Option(help="Held-out captions searched, as one batch.")] = BS.queries,
    candidates: Annotated[Optional[list[int]], typer.Option(
        help=f"K, the first stage's shortlist per query (repeatable; default: "
             f"{', '.join(map(str, BS.candidates))}).")] = None,
    method: Annotated[Optional[list[str]], typer.Option(help="Heads to measure (repeatable; default: all).")] = None,
    first_stage: Annotated[str, typer.Option(
        help=f"The first stage, as tvrpipe search's. {first_stage_help()}.")
    ] = BS.first_stage,
    first_stage_set: Annotated[Optional[list[str]], typer.Option(
        metavar="KEY=VALUE", help="A setting of the first stage, as tvrpipe search's --first-stage-set (repeatable; "
                                  "e.g. nprobe=64 for faiss-ivfpq).", show_default=False)] = None,
    train_videos: Annotated[int, typer.Option(
        help="Captioned train videos of the benchmark the heads train on (same generated world).")] = BS.train_videos,
    train_epochs: Annotated[Optional[int], typer.Option(
        help="Epochs each head trains (warmup, then cosine). Default: until validation stops improving, as "
             "train-head trains by default.")] = BS.train_epochs,
    dim: Annotated[int, typer.Option(help="Embedding width D (ViT-B/32: 512).")] = BS.dim,
    exhaustive_queries: Annotated[Optional[int], typer.Option(
        help="Queries the exhaustive search runs (a random sample of --queries), over which recall@10 is "
             "averaged. Default: all; at a million videos a head's exhaustive search costs minutes a query.",
        show_default=False)] = BS.exhaustive_queries,
    latency_queries: Annotated[int, typer.Option(
        help="Queries each two-stage arm also searches one at a time, each timed: the p50 and p95 latency of "
             "one query (0: none).")] = BS.latency_queries,
    encoded_videos: Annotated[bool, typer.Option(
        "--encoded-videos", help="Each head encodes every video once after its training (timed, kept beside the "
        "collection) and its searches read those encodings instead of the frames, as tvrpipe search "
        "--encoded-videos.")] = BS.encoded_videos,
    json_out: JsonOut = None,
) -> None:
    """Per head, on a generated collection: queries/s and peak memory of the exhaustive search and of the two
    stages at each K, one query's latency (p50, p95), the recall of the two-stage top 10 against the exhaustive
    top 10, and the K reaching 0.95."""
    from rich.table import Table

    r = bench_search(out, videos, queries, tuple(candidates or BS.candidates), method, first_stage,
                     tuple(first_stage_set or ()), train_videos, train_epochs, dim,
                     exhaustive_queries=exhaustive_queries, latency_queries=latency_queries,
                     encoded_videos=encoded_videos)
    table = Table(title=f"search of {r.videos:,} videos, {r.queries} queries as one batch (first stage: "
                        f"{r.first_stage}); recall@10 against the exhaustive top 10")
    for col in ("method", "search", "qps", "speed-up", "one query p50 / p95 ms", "peak GB", "extra GB",
                "encodings read" if r.encoded_videos else "videos encoded", "recall@10", "R@1 %", "R@10 %"):
        table.add_column(col, justify="right")
    for m in r.methods():
        full, k95 = r.row(m, None), r.k_reaching(m)
        for x in (row for row in r.rows if row.method == m):
            search = "exhaustive" if x.candidates is None else f"K = {x.candidates}" + (" *" if x.candidates == k95 else "")
            alone = "-" if x.p50_ms is None else f"{x.p50_ms:,.0f} / {x.p95_ms:,.0f}"
            table.add_row(m, search, f"{x.qps:,.2f}", f"{x.qps / full.qps:,.1f}x", alone, f"{x.peak_gb:.2f}",
                          "-" if x.extra_gb is None else f"{x.extra_gb:.2f}", f"{x.encoded:,}", f"{x.recall:.3f}",
                          f"{x.r1:.1f}", f"{x.r10:.1f}")
    console.print(table)
    console.print("* the smallest K measured whose recall@10 reaches 0.95", highlight=False)
    for line in r.lines():
        console.print(line, highlight=False)
    _write_json(json_out, r.record())


@bench_app.command("serve")
def bench_serve_cmd(
    out: Annotated[Path, typer.Option(
        callback=_work_dir, help="Working directory, bench search's: its generated stores (4.5 GB at 100,000 videos) "
                                 "and trained runs are reused, or made once; serve/results.json, serve/hits.json.")
    ] = Path("bench/search"),
    videos: Annotated[int, typer.Option(help="Videos of the served collection.")] = BR.videos,
    queries: Annotated[int, typer.Option(help="Held-out captions sent, one request each, one at a time.")] = BR.queries,
    method: Annotated[Optional[list[str]], typer.Option(
        help=f"Trained heads served beside zero-shot CLIP (repeatable; default: {', '.join(BR.methods)}).")] = None,
    candidates: Annotated[int, typer.Option(
        help="K, the first stage's shortlist that each arm's head re-ranks (tvrpipe serve --candidates).")
    ] = BR.candidates,
    first_stage: Annotated[str, typer.Option(
        help=f"The first stage, as tvrpipe serve's. {first_stage_help()}.")] = BR.first_stage,
    first_stage_set: Annotated[Optional[list[str]], typer.Option(
        metavar="KEY=VALUE", help="A setting of the first stage, as tvrpipe serve's --first-stage-set (repeatable).",
        show_default=False)] = None,
    train_videos: Annotated[int, typer.Option(
        help="Captioned train videos of the benchmark the heads train on (same generated world).")] = BR.train_videos,
    train_epochs: Annotated[Optional[int], typer.Option(
        help="Epochs each head trains (warmup, then cosine). Default: until validation stops improving, as "
             "train-head trains by default.")] = BR.train_epochs,
    dim: Annotated[int, typer.Option(help="Embedding width D (ViT-B/32: 512).")] = BR.dim,
    text_model: Annotated[str, typer.Option(
        help="The open_clip architecture whose text tower is timed encoding one query (random weights).")
    ] = BR.text_model,
    json_out: JsonOut = None,
) -> None:
    """The latency of tvrpipe serve on a generated collection: per arm (zero-shot CLIP, each trained head), p50,
    p95 and mean of GET /search over a real socket, one query at a time, and with a CLIP text tower's time added."""
    from rich.table import Table
    from rich.text import Text

    r = bench_serve(out, videos, queries, tuple(method or BR.methods), candidates, first_stage,
                    tuple(first_stage_set or ()), train_videos, train_epochs, dim, text_model)
    table = Table(title=f"GET /search over {r.videos:,} videos, {r.queries} requests one at a time, K = "
                        f"{r.candidates} (first stage: {r.first_stage}); ms")
    for col in ("arm", "p50", "p95", "mean", "max", "with CLIP p50", "with CLIP p95", "start s"):
        table.add_column(col, justify="right")
    for a in r.arms:
        table.add_row(Text(a.arm), f"{a.p50_ms:.1f}", f"{a.p95_ms:.1f}", f"{a.mean_ms:.1f}", f"{a.max_ms:.1f}",
                      f"{a.clip_p50_ms:.1f}", f"{a.clip_p95_ms:.1f}", f"{a.start_seconds:.1f}")
    console.print(table)
    for line in r.lines():
        console.print(line, highlight=False, markup=False)
    _write_json(json_out, r.record())
