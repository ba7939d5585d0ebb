"""``tvrpipe manifest``: build and inspect dataset manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from tvrpipe.cli.app import MAIN_PATH, app, console, new_app
from tvrpipe.cli.options import print_counts
from tvrpipe.data.datasets import build_manifest, list_datasets, load_spec
from tvrpipe.data.manifest import META_FILE, read_manifest
from tvrpipe.errors import ConfigError
from tvrpipe.features.decode.shots import SHOT_THRESHOLD

manifest_app = new_app(help="Build and inspect dataset manifests (videos.parquet + captions.parquet).")
app.add_typer(manifest_app, name="manifest", rich_help_panel=MAIN_PATH)


@manifest_app.command("build")
def build(
    out: Annotated[Path, typer.Option(help="Output directory for videos.parquet, captions.parquet, meta.json "
                                           "(and files.parquet for --videos).")],
    dataset: Annotated[Optional[str], typer.Option(
        help=f"Dataset spec name: {', '.join(list_datasets())}. Give it with --annotations, or give --videos.")] = None,
    annotations: Annotated[Optional[Path], typer.Option(
        help="The dataset's annotation directory (for 'custom': the CSV/Parquet table).")] = None,
    videos: Annotated[Optional[Path], typer.Option(
        help="A folder of your own videos, no annotations: every video file under it (any subfolder; hidden ones "
             "left out) that decodes becomes a video of a collection without captions, its id the path relative "
             "to the folder. Rerun into the same --out after adding or changing files: only those are probed, "
             "and extract then encodes only them.")] = None,
    split_set: Annotated[
        Optional[str], typer.Option(help="Split set, e.g. 9k, 7k or full for msrvtt (default: the spec's).")
    ] = None,
    video_root: Annotated[
        Optional[Path],
        typer.Option(help="If given, check every video exists under it (extension-insensitive) and resolve paths."),
    ] = None,
    allow_missing: Annotated[
        bool, typer.Option(help="With --video-root: drop missing videos (listed in meta.json) instead of failing.")
    ] = False,
    window: Annotated[Optional[str], typer.Option(
        help="With --videos: cut each file into moments this long (10s, 2.5m, 1h; seconds without a unit), one row "
             "each, id 'path#t=START,END'; the last moment ends at the file's end, and a file shorter than a window "
             "is one moment. At least 0.5s (a shorter moment may hold no frame). 'whole' goes back to one row per "
             "file. With --shots: the longest a moment may be (a "
             "longer shot is cut into windows of this length). Default: the last build's cutting into --out, "
             "else whole files.")] = None,
    stride: Annotated[Optional[str], typer.Option(
        help="With --window: a moment starts every STRIDE (at least 0.5s, at most the window: overlapping or end "
             "to end). Default: the window.")] = None,
    shots: Annotated[bool, typer.Option(
        "--shots", help="With --videos: cut each file at its shot boundaries (PySceneDetect's ContentDetector, "
                        "the 'shots' extra: pip install 'tvrpipe[shots]'), a moment per shot, id 'path#t=START,END'; "
                        "a file where no cut is found, or detection fails, is one shot (listed in meta.json "
                        "one_shot).")] = False,
    shot_threshold: Annotated[Optional[float], typer.Option(
        help="With --shots: the detector's threshold, the mean change of hue, saturation and luminance (0-255) "
             f"between two frames that makes a cut; lower finds more cuts. Default: {SHOT_THRESHOLD:g} "
             "(PySceneDetect's).",
        show_default=False)] = None,
) -> None:
    """Build a manifest from a dataset's annotation files, or from a folder of your own videos (--videos)."""
    if videos is not None:
        others = [name for name, value in (("--dataset", dataset), ("--annotations", annotations),
                                          ("--split-set", split_set), ("--video-root", video_root),
                                          ("--allow-missing", allow_missing or None)) if value is not None]
        if others:
            raise ConfigError(f"--videos builds a collection from a folder, without annotations; {', '.join(others)} "
                              "belong to a dataset's annotation files: give one or the other")
        from tvrpipe.features.collection import build_collection, cutting_of
        from tvrpipe.features.outputs import check_output_folder

        cutting = cutting_of(window, stride, shots, shot_threshold)
        check_output_folder(out, may_be="a manifest")
        b = build_collection(videos, out, cutting=cutting)
        skipped = b.manifest.meta["skipped"]
        n_files = b.manifest.videos["path"].nunique()
        what = (f"{len(b.manifest.videos):,} moments of {n_files:,} videos ({b.cutting.describe()})"
                if b.cutting.moments
                else f"{len(b.manifest.videos):,} videos")
        console.print(Text(f"collection of {what}, no captions -> {out} "
                           f"({b.probed:,} files probed, {b.known:,} unchanged since the last build)"))
        one_shot = b.manifest.meta.get("one_shot") or []
        if one_shot:
            failed = sum("detection failed" in str(s["reason"]) for s in one_shot)
            console.print(Text(f"{len(one_shot):,} videos are one shot each ({len(one_shot) - failed:,} with no shot "
                               f"boundary found, {failed:,} where detection failed); they are listed in "
                               f"{out / META_FILE} (one_shot), e.g. {one_shot[0]['path']}: {one_shot[0]['reason']}",
                               style="yellow"))
        if skipped:
            kinds = [f"{b.undecodable:,} video files that do not decode", f"{b.not_videos:,} not videos",
                     f"{b.unusable:,} that cannot be opened as named",
                     f"{b.hidden:,} hidden files and folders (names starting with a dot)"]
            shown = next((s for s in skipped if not str(s["path"]).startswith(".")), skipped[0])
            console.print(f"skipped {len(skipped):,} files ({', '.join(kinds)}); the reasons are in "
                          f"{out / META_FILE}, e.g. {shown['path']}: {shown['reason']}", style="yellow")
        return
    given = [name for name, value in (("--window", window), ("--stride", stride), ("--shots", shots or None),
                                      ("--shot-threshold", shot_threshold)) if value is not None]
    if given:
        raise ConfigError(f"{given[0]} cuts the files of a collection into moments: give it with --videos (a "
                          "dataset's clips come from its annotations)")
    if dataset is None or annotations is None:
        raise ConfigError("give --dataset and --annotations (a benchmark or a table of your own), or --videos FOLDER "
                          "(a folder of videos without captions)")
    if allow_missing and video_root is None:
        raise ConfigError("--allow-missing drops the videos not found under --video-root: give --video-root too "
                          "(without it no video is looked for)")
    from tvrpipe.features.outputs import check_output_folder

    check_output_folder(out, may_be="a manifest")
    m = build_manifest(dataset, annotations, out, split_set, video_root, allow_missing)
    print_counts(m, f"{dataset} ({m.meta['split_set']}) -> {out}")
    if m.meta.get("missing_videos"):
        console.print(f"dropped {len(m.meta['missing_videos'])} missing videos (see {out}/meta.json)", style="yellow")


@manifest_app.command("show")
def show(manifest_dir: Annotated[Path, typer.Argument(help="A manifest directory.")]) -> None:
    """Print a manifest's videos and captions per split, and its sampling defaults."""
    m = read_manifest(manifest_dir)
    if m.is_collection:
        skipped = m.meta.get("skipped") or []
        console.print(f"{manifest_dir}: collection, no captions: {len(m.videos):,} videos from "
                      f"{m.meta.get('video_root', '?')}" + (f"; {len(skipped):,} files skipped (see meta.json)"
                                                            if skipped else ""), highlight=False)
    else:
        name = m.meta.get("dataset", "?")
        print_counts(m, f"{manifest_dir}: {name} ({m.meta.get('split_set', '?')})")
    if "frames" in m.meta:
        console.print(f"defaults: {m.meta['frames']} frames, {m.meta['max_words']} words")


@manifest_app.command("datasets")
def datasets() -> None:
    """List the dataset specs and their split sets and defaults."""
    table = Table(title="dataset specs (manifests/*.yaml)")
    for col in ("dataset", "title", "split sets", "frames", "words"):
        table.add_column(col)
    for name in list_datasets():
        spec = load_spec(name)
        sets = Text(", ").join(Text(s, "bold" if s == spec.default_split_set else "") for s in spec.split_sets) or "-"
        table.add_row(name, spec.raw.get("title", ""), sets, str(spec.frames), str(spec.max_words))
    console.print(table)
