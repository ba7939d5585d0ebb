"""``tvrpipe synth``: render a synthetic text-video dataset (real H.264 mp4 + manifest), or with
``--features-only`` write a generated feature store (no videos; MSR-VTT scale in seconds)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from tvrpipe.cli.app import TOOLS, app, console, defaults_of, explicit_options, finite_float
from tvrpipe.cli.options import print_counts
from tvrpipe.errors import ConfigError
from tvrpipe.worlds.videos import DATASET_VIDEOS, synthesize

SY = defaults_of(synthesize)  # each option's default is synthesize's, declared there once
# The rendering options: with --features-only they do not apply.
_VIDEO_OPTIONS = ("videos", "size", "fps", "scene_seconds", "captions_per_video", "multi_scene_fraction",
                  "distractor_fraction")


@app.command("synth", rich_help_panel=TOOLS)
def synth(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(help="Output directory: videos/, manifest/, attributes.parquet (or, with "
                                           "--features-only, a feature store).")],
    videos: Annotated[int, typer.Option(help="Number of videos to render.")] = DATASET_VIDEOS,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same manifest bytes and frames.")] = SY.seed,
    size: Annotated[int, typer.Option(help="Frame width and height in pixels (even).")] = SY.size,
    fps: Annotated[int, typer.Option(help="Frames per second.")] = SY.fps,
    scene_seconds: Annotated[float, typer.Option(
        parser=finite_float, help="Length of one scene in seconds.")] = SY.scene_seconds,
    captions_per_video: Annotated[int, typer.Option(help="Paraphrased captions per video.")] = SY.captions_per_video,
    multi_scene_fraction: Annotated[
        float, typer.Option(
            parser=finite_float, help="Fraction of multi-scene videos whose captions describe one scene only.")
    ] = SY.multi_scene_fraction,
    distractor_fraction: Annotated[
        float, typer.Option(
            parser=finite_float, help="Fraction of near-duplicate videos differing in one attribute from another.")
    ] = SY.distractor_fraction,
    features_only: Annotated[
        bool, typer.Option("--features-only", help="Write a generated feature store instead of videos: CLIP-like "
                                                   "features with known ground truth, for train-head at any scale.")
    ] = False,
    preset: Annotated[
        Optional[str], typer.Option(help="With --features-only: the store's sizes and difficulty, one of small, medium, "
                                         "msrvtt9k (default small; docs/synthetic.md).")
    ] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="With --features-only: a generator field key=value "
                                                        "(repeatable), e.g. noise=0.8, near_duplicates=0.2, scenes=3.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="With --features-only: replace a store already in --out.")] = False,
    describe: Annotated[
        bool, typer.Option("--describe", help="Measure the feature store in --out (generated or extracted; with "
                                              "--features-only, the one just written) and print its statistics beside "
                                              "real CLIP ViT-B/32's on MSR-VTT, with their sources. Writes nothing.")
    ] = False,
    split: Annotated[str, typer.Option(help="With --describe: the split measured.")] = "test",
) -> None:
    """Render coloured moving shapes as mp4 files with captions from a grammar (offline test data).

    With --features-only, write a generated feature store instead (`tvrpipe train-head --features OUT`).
    With --describe, measure a feature store against real CLIP's statistics.
    """
    if "split" in explicit_options(ctx) and not describe:
        raise ConfigError("--split applies with --describe")
    if describe and not features_only:
        given = [n for n in (*_VIDEO_OPTIONS, "seed", "preset", "set_", "overwrite") if n in explicit_options(ctx)]
        if given:
            option = "--set" if given[0] == "set_" else "--" + given[0].replace("_", "-")
            raise ConfigError(f"{option} makes data; --describe alone only reads the feature store in --out "
                              f"(add --features-only to generate one and describe it)")
        describe_store(out, split)
        return
    if features_only:
        given = [n for n in _VIDEO_OPTIONS if n in explicit_options(ctx)]
        if given:
            option = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{option} sets rendered videos; with --features-only use --preset and --set "
                              f"(e.g. --set train_videos=9000 --set near_duplicates=0.2)")
        _features_only(out, preset or "small", set_ or [], seed, overwrite)
        if describe:
            describe_store(out, split)
        return
    if preset is not None or set_ or overwrite:
        raise ConfigError("--preset, --set and --overwrite apply with --features-only")
    from tvrpipe.bench.room import Needs, check_room, videos_needs

    # a multi-scene video has up to 3 scenes, rendered whole before it is encoded (and a copy as it is written)
    frames = int(3 * scene_seconds * fps) + 1
    check_room("synth", out, videos_needs(videos, size, size, 3 * scene_seconds, fps)
               + Needs(memory=2 * frames * size * size * 3, memory_what=f"a video's {frames:,} frames of {size}x{size}"),
               "--videos, --size, --fps or --scene-seconds")
    m = synthesize(
        out, videos, seed, size=size, fps=fps, scene_seconds=scene_seconds,
        captions_per_video=captions_per_video, multi_scene_fraction=multi_scene_fraction,
        distractor_fraction=distractor_fraction,
    )
    print_counts(m, f"synthetic videos in {out / 'videos'}, manifest in {out / 'manifest'}")


def _features_only(out: Path, preset: str, items: list[str], seed: int, overwrite: bool) -> None:
    import dataclasses

    from tvrpipe.config import parse_fields
    from tvrpipe.features.store import open_store
    from tvrpipe.worlds.features import PRESETS, GenSpec, generate_store

    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not one of: {', '.join(PRESETS)}")
    spec = dataclasses.replace(PRESETS[preset], seed=seed, **parse_fields(GenSpec, items, "--set", "--set"))
    spec.validate("--set")
    from tvrpipe.bench.room import check_room, stores_needs

    check_room("synth --features-only", out, stores_needs({out: spec}), "--preset's sizes or the --set that grow them")
    generate_store(out, spec, progress=True, overwrite=overwrite)
    store = open_store(out)
    splits = store.videos["split"].value_counts()
    texts = store.texts["split"].value_counts()
    parts = ", ".join(f"{s} {splits.get(s, 0)} videos / {texts.get(s, 0)} captions" for s in ("train", "val", "test")
                      if splits.get(s, 0))
    console.print(f"generated feature store in {out}: {parts}; D = {spec.embed_dim}, F = {spec.frames}, "
                  f"L = {spec.max_words}, noise {spec.noise:g}, near-duplicates {spec.near_duplicates:g}, "
                  f"{_scenes(spec)}", highlight=False)
    console.print(f"train a head on it: tvrpipe train-head --features {shlex.quote(str(out))} --method xpool --out runs/xpool",
                  highlight=False)


def describe_store(out: Path, split: str) -> None:
    """Print the world statistics of the store in ``out`` beside real CLIP's (``--describe``)."""
    from rich.table import Table

    from tvrpipe.features.store import open_store
    from tvrpipe.worlds.stats import TARGETS, measure, table

    store = open_store(out)
    measured = measure(store, split)
    t = Table(title=f"{out}: split {split}, {measured['gallery']} videos, the first caption of each as a query; "
                    f"zero-shot t2v R@1 in %; cosines of raw features", title_justify="left")
    for col, just in (("statistic [source]", "left"), ("this store", "right"), ("real CLIP ViT-B/32", "right"),
                      ("within", "left")):
        t.add_column(col, justify=just)
    for i, (label, m, target, ok, _) in enumerate(table(measured), 1):
        t.add_row(f"{label} [{i}]", m, target, ok)
    console.print(t)
    if measured["gallery"] != 1000:
        console.print(f"R@1 falls as the gallery grows: the targets are for 1,000 videos (MSR-VTT 1k-A), this split has "
                      f"{measured['gallery']}.")
    for i, target in enumerate(TARGETS, 1):
        console.print(f"[{i}] {target.kind}: {target.source}")
    generator = store.provenance.get("generator")
    if isinstance(generator, dict):
        _describe_structure(generator, len(TARGETS))


def _describe_structure(generator: dict, numbered: int) -> None:
    """The generated world's learnable share and rates beside the calibrated world's and MSR-VTT's published ones."""
    from rich.table import Table

    from tvrpipe.worlds.features import CALIBRATED
    from tvrpipe.worlds.stats import structure_rows

    t = Table(title="the world's structure (the generator's fields)", title_justify="left")
    for col, just in (("rate [source]", "left"), ("this store", "right"), ("calibrated world", "right"),
                      ("MSR-VTT", "left")):
        t.add_column(col, justify=just)
    rows = structure_rows(generator, CALIBRATED)
    for i, (label, mine, calibrated, published, _) in enumerate(rows, numbered + 1):
        t.add_row(f"{label} [{i}]", mine, calibrated, published)
    console.print(t)
    for i, row in enumerate(rows, numbered + 1):
        console.print(f"[{i}] {row[4]}")


def _scenes(spec) -> str:
    if spec.scenes == 1 or spec.multi_scene == 0:
        return "one scene per video"
    share = f"{spec.scenes} scenes per video" if spec.multi_scene == 1 else \
        f"{spec.multi_scene:.0%} of videos have {spec.scenes} scenes"
    captions = {"whole": "captions of the whole video", "scene": "each caption of one scene",
                "mixed": f"{spec.partial_captions:.0%} of their captions of one scene"}[spec.caption_describes]
    return f"{share}, {captions}"
