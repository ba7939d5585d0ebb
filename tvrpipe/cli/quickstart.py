"""``tvrpipe quickstart``: the offline end-to-end demo on generated data."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from tvrpipe.cli.app import TOOLS, app, console
from tvrpipe.quickstart import QuickstartPlan


@app.command("quickstart", rich_help_panel=TOOLS)
def quickstart(
    out: Annotated[Path, typer.Option(help="Working directory for the generated data, features and runs.")] = Path(
        "quickstart"
    ),
    fast: Annotated[bool, typer.Option("--fast", help="A smaller run (fewer videos and epochs): a few minutes.")] = False,
    videos: Annotated[Optional[int], typer.Option(
        help=f"Synthetic benchmark videos (default {QuickstartPlan().videos}; {QuickstartPlan.fast().videos} with --fast); "
             "the tiny CLIP trains on as many others.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed of every stage.")] = 0,
) -> None:
    """Run the pipeline offline on generated videos: synth -> finetune -> extract -> train-head -> report -> search
    (CPU, minutes).

    Rerun the same command to resume: each stage skips or resumes what is done.
    """
    from tvrpipe.quickstart import DIFFICULTIES, run_quickstart
    from tvrpipe.rundir import METRICS

    plan = QuickstartPlan.fast() if fast else QuickstartPlan()
    if videos is not None:
        plan = dataclasses.replace(plan, videos=videos, pretrain_videos=videos)
    result = run_quickstart(out, plan, seed, stage=lambda title: console.rule(title))
    console.rule("results: test split")
    for post, what in (("", "raw scores"), ("dsl", "after DSL (dual softmax: post-processing, reported apart)")):
        rows = result.table_rows(post)
        for direction, name in (("t2v", "text-to-video"), ("v2t", "video-to-text")):
            table = Table(title=f"{name}, {what}")
            table.add_column("head", no_wrap=True)
            for m in METRICS:
                table.add_column(m, justify="right")
            for r in rows:
                table.add_row(r["method"], *(f"{r[f'{direction} {m}']:.1f}" for m in METRICS))
            skipped = {r["method"]: r["test"][f"{post}_not_applicable"] for r in result.rows
                       if post and f"{post}_not_applicable" in r["test"]}
            if skipped:  # the head's own reason (Head.dsl_not_applicable), as metrics.json records it
                table.caption = "; ".join(f"no {post.upper()} for {m}: {why}" for m, why in skipped.items())
            console.print(table)
    table = Table(title="text-to-video R@1 by difficulty (test captions; raw scores)")
    table.add_column("head", no_wrap=True)
    for k, n in result.captions.items():
        table.add_column(f"{k.replace('_', '-')} ({n})", justify="right")
    for r in result.rows:
        table.add_row(r["method"], *("-" if r["difficulty"][k] is None else f"{r['difficulty'][k]:.1f}"
                                     for k in result.captions))
    table.caption = "; ".join(f"{k.replace('_', '-')}: {what}" for k, what in DIFFICULTIES.items())
    console.print(table)
    console.print(f"results: {out / 'results.csv'} (by difficulty: {out / 'difficulty.csv'}); runs "
                  f"(metrics.json, epochs.csv, plots/): {out / 'runs'}; "
                  f"finetuned CLIP: {out / 'finetune' / 'clip.safetensors'}", highlight=False, soft_wrap=True)
    found = result.search
    table = Table(title=f"tvrpipe search \"{found['query']}\" --run {found['run']} (of {found['videos']} videos)")
    for col in ("rank", "video", "score"):
        table.add_column(col, justify="right" if col != "video" else "left")
    for h in found["hits"]:
        table.add_row(str(h["rank"]), h["video_id"] + (" (the caption's video)" if h["video_id"] == found["true_video"]
                                                       else ""), f"{h['score']:.4f}")
    console.print(table)
    console.print(f"the caption's video {found['true_video']} is " + (
        f"hit {found['found_at']} of {len(found['hits'])}" if found["found_at"] else
        f"not among the top {len(found['hits'])}") + f" ({out / 'search.json'})", highlight=False)
    console.print(f"report: {result.report} (tables like the papers', curves, R@1, uncertainty and a retrieval "
                  f"gallery: {', '.join(sorted(p.name for p in result.report.parent.glob('*.png')))})",
                  highlight=False, soft_wrap=True)
