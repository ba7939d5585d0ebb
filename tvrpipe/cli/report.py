"""``tvrpipe report``: finished runs as the papers' tables (Markdown + CSV) and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tvrpipe.cli.app import MAIN_PATH, app, console


@app.command("report", rich_help_panel=MAIN_PATH)
def report(
    runs: Annotated[list[Path], typer.Argument(
        help="Run directories (train-head, finetune), or folders holding runs at any depth (a sweep's --out).",
        show_default=False, metavar="RUNS")],
    out: Annotated[Path, typer.Option(help="Folder for report.md, report.csv and the PNG plots.")] = Path("report"),
    video_root: Annotated[Optional[Path], typer.Option(
        help="Folder the store's video paths are relative to, for the retrieval gallery. Default: the "
             "--manifest's video_root; without videos the gallery is skipped (the report says why).")] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="Manifest folder (captions.parquet) whose caption texts the gallery shows; without it, caption ids.")
    ] = None,
    gallery_run: Annotated[Optional[Path], typer.Option(
        help="The run whose retrievals the gallery shows. Default: the best validation t2v R@1 among train-head runs.")
    ] = None,
    queries: Annotated[int, typer.Option(help="Test captions shown in the gallery.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the choice of gallery captions.")] = 0,
) -> None:
    """Tables like the papers' (t2v and v2t, raw and post-processed apart, mean ± std over seeds) and plots.

    Writes report.md, report.csv, curves.png, r1.png, uncertainty.png (runs with uncertainty readouts)
    and gallery.png (when the videos can be read) into --out.
    """
    from tvrpipe.report import write_report

    path = write_report(runs, out, video_root=video_root, manifest=manifest, gallery_queries=queries, seed=seed,
                        gallery_run=gallery_run)
    pngs = sorted(p.name for p in path.parent.glob("*.png"))
    console.print(f"report: {path} (and {path.parent / 'report.csv'}); plots: {', '.join(pngs)}",
                  highlight=False, soft_wrap=True)
