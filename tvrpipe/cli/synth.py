"""``tvrpipe synth``: render a synthetic text-video dataset (real H.264 mp4 + manifest)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tvrpipe.cli.app import app
from tvrpipe.cli.manifest import print_counts


@app.command("synth")
def synth(
    out: Annotated[Path, typer.Option(help="Output directory: videos/, manifest/, attributes.parquet.")],
    videos: Annotated[int, typer.Option(help="Number of videos to render.")] = 200,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same manifest bytes and frames.")] = 0,
    size: Annotated[int, typer.Option(help="Frame width and height in pixels (even).")] = 64,
    fps: Annotated[int, typer.Option(help="Frames per second.")] = 8,
    scene_seconds: Annotated[float, typer.Option(help="Length of one scene in seconds.")] = 2.0,
    captions_per_video: Annotated[int, typer.Option(help="Paraphrased captions per video.")] = 3,
    multi_scene_fraction: Annotated[
        float, typer.Option(help="Fraction of multi-scene videos whose captions describe one scene only.")
    ] = 0.3,
    distractor_fraction: Annotated[
        float, typer.Option(help="Fraction of near-duplicate videos differing in one attribute from another.")
    ] = 0.3,
) -> None:
    """Render coloured moving shapes as mp4 files with captions from a grammar (offline test data)."""
    from tvrpipe.pipeline.synth import synthesize

    m = synthesize(
        out, videos, seed, size=size, fps=fps, scene_seconds=scene_seconds,
        captions_per_video=captions_per_video, multi_scene_fraction=multi_scene_fraction,
        distractor_fraction=distractor_fraction,
    )
    print_counts(m, f"synthetic videos in {out / 'videos'}, manifest in {out / 'manifest'}")
