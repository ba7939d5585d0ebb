"""``tvrpipe extract``, ``tvrpipe export``, ``tvrpipe features show`` and ``tvrpipe features verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from tvrpipe.cli.app import MAIN_PATH, TOOLS, app, console, finite_float, given_fields, new_app
from tvrpipe.errors import ConfigError
from tvrpipe.features.extract import ExtractConfig, encode_frames_value
from tvrpipe.features.extract.config import DEFAULT_VIDEOS_PER_CALL
from tvrpipe.features.workers import ENCODE_FRAMES_CAP, ENCODE_MEMORY_SHARE
from tvrpipe.search.first_stages import exportable_first_stages
from tvrpipe.search.index import EXPORTED

EX = ExtractConfig()  # the defaults, declared once: in ExtractConfig
features_app = new_app(help="Inspect feature stores.")
app.add_typer(features_app, name="features", rich_help_panel=TOOLS)


@app.command("extract", rich_help_panel=MAIN_PATH)
def extract_cmd(
    ctx: typer.Context,
    dataset: Annotated[Optional[str], typer.Option(
        help="Dataset (`tvrpipe manifest datasets`). Alone, its files are found under --data-root as "
             "docs/datasets.md lays them out, and its manifest is built there (or reused); with --manifest, "
             "checked against the manifest's.")] = None,
    manifest: Annotated[Optional[Path], typer.Option(
        help="Manifest directory (videos.parquet, captions.parquet); default: --dataset's under --data-root.")] = None,
    video_root: Annotated[Optional[Path], typer.Option(
        help="Folder the manifest's video paths are relative to; default: --dataset's under --data-root. With "
             "--dataset alone, the manifest's videos are checked there too (a manifest checked elsewhere is "
             "rebuilt).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Feature store directory; rerun the same command to resume (for a collection of your own videos: to "
             "update it after files were added, changed or removed, encoding only those). Default: "
             "features/<dataset>-<model>-<pretrained>, for a collection features/<its folder's name>-<model>-"
             "<pretrained> (features/: $TVRPIPE_FEATURES if set).")] = None,
    data_root: Annotated[Optional[Path], typer.Option(
        help="With --dataset and no --manifest: where datasets live, one folder each (data/msrvtt/...); default: "
             "$TVRPIPE_DATA, else data/.")] = None,
    model: Annotated[str, typer.Option(help="open_clip architecture, e.g. ViT-B-32, or tvrpipe-tiny.")] = EX.model,
    pretrained: Annotated[
        str, typer.Option(help="open_clip pretrained tag (e.g. openai), a local checkpoint file, or 'none' (seeded random).")
    ] = EX.pretrained,
    frames: Annotated[Optional[int], typer.Option(help="Frames per video (default: the dataset's, e.g. 12).")] = EX.frames,
    max_words: Annotated[Optional[int], typer.Option(help="Text tokens L (default: the dataset's, e.g. 32).")] = EX.max_words,
    batch_size: Annotated[Optional[int], typer.Option(
        help="Videos per encoder call (x frames = images per forward); default: sized by --encode-frames.")
    ] = EX.batch_size,
    encode_frames: Annotated[str, typer.Option(
        metavar="N|auto",
        help=f"Frames per encoder call (videos per call: N // frames, at least one), or auto: on cuda what fits "
             f"the GPU's free memory (each encoder measures a frame's cost with a probe call; "
             f"{ENCODE_MEMORY_SHARE:.0%} of the free memory, at most {ENCODE_FRAMES_CAP:,} frames), on cpu "
             f"{DEFAULT_VIDEOS_PER_CALL} videos. Not with --batch-size.")] = str(EX.encode_frames),
    address: Annotated[
        Optional[str], typer.Option(
            help="Run on Ray: a cluster's address ('auto' or host:port), or 'local' for a private Ray instance on "
                 "this machine. Default: RAY_ADDRESS if set, else no Ray: decoder processes (one per core) and the "
                 "encoders in this process (docs/extraction.md, \"Where it runs\").")
    ] = EX.address,
    device: Annotated[str, typer.Option(help="Encoder device: cpu or cuda (one GPU per encoder).")] = EX.device,
    precision: Annotated[str, typer.Option(
        help="What the encoders compute in: auto (fp16 autocast on cuda, fp32 on cpu), fp32, bf16 (on a CPU: "
             "the weights in bf16, 3-4x faster than fp32 where the CPU has AVX-512 BF16 or AMX; cosine >= 0.9999 "
             "to fp32, docs/performance.md), fp16 (cuda). Recorded in the store; a store is resumed in its own.")
    ] = EX.precision,
    decoders: Annotated[Optional[int], typer.Option(
        help="Decoder processes (default: one per CPU of this machine, or of the Ray cluster).")] = EX.decoders,
    encoders: Annotated[int, typer.Option(
        help="CLIP encoders, each loading the weights once (with --device cuda: one GPU each; without --address, "
             "this machine's cuda:0, cuda:1, ...).")] = EX.encoders,
    timeout: Annotated[float, typer.Option(
        parser=finite_float, help="Per-video decode timeout in seconds (at most 2,000,000).")] = EX.timeout_s,
    seed: Annotated[int, typer.Option(help="Seed of the random weights for --pretrained none.")] = EX.seed,
    video_shard: Annotated[int, typer.Option(help="Videos per shard (one Zarr chunk; the unit of resume).")] = EX.video_shard,
    text_shard: Annotated[int, typer.Option(help="Captions per shard.")] = EX.text_shard,
    overwrite: Annotated[
        bool, typer.Option(help="Delete the store in --out (whatever its settings) and extract from scratch.")
    ] = EX.overwrite,
    retry_failed: Annotated[
        bool, typer.Option(help="On a rerun, retry the videos recorded as failed (the rest is kept).")
    ] = EX.retry_failed,
    max_failed_fraction: Annotated[
        float, typer.Option(
            parser=finite_float, help="Exit 1, leaving the store incomplete and resumable, if more than this "
                                 "fraction of the videos failed.")
    ] = EX.max_failed_fraction,
) -> None:
    """Extract CLIP frame and text features of a manifest into a Zarr feature store (on this machine; on Ray with --address).

    Rerun the same command to resume an interrupted run, re-extract damaged shards and retry failed videos.
    """
    from tvrpipe.cluster import ray_running, stop_ray
    from tvrpipe.data.manifest import read_manifest
    from tvrpipe.features.extract import ExtractionError, extract
    from tvrpipe.features.store import default_features_dir

    if manifest is None:
        if dataset is None:
            raise ConfigError("give --dataset NAME (its files under --data-root, docs/datasets.md), or --manifest "
                              "and --video-root")
        from tvrpipe.data.layout import prepare_dataset
        from tvrpipe.worlds.videos import generate_dataset

        # --video-root, when given, is the folder the manifest's videos are checked in and extracted from
        lay = prepare_dataset(dataset, data_root, video_root=video_root, generate=generate_dataset)
        manifest, video_root = lay.manifest, lay.videos
        console.print(f"manifest: {manifest}; videos: {video_root}", highlight=False)
    elif video_root is None:
        raise ConfigError(f"--manifest {manifest}: give --video-root too (the folder its video paths are relative to)")
    elif data_root is not None:
        raise ConfigError(f"--data-root {data_root} finds --dataset's files when no --manifest is given; with "
                          f"--manifest {manifest} it would be ignored: drop one of them")
    m = read_manifest(manifest)
    have = m.meta.get("dataset")
    if dataset is not None and have != dataset:
        raise ConfigError(f"--dataset {dataset!r} but the manifest in {manifest} is {have!r}")
    if out is None:
        name = have or Path(manifest).resolve().parent.name
        if m.is_collection:  # named by its folder: two collections' updates must not replace each other's store
            name = Path(m.meta.get("video_root") or Path(video_root).resolve()).name
        out = default_features_dir(name, model, pretrained)
        console.print(f"features: {out}", highlight=False)
    # what the user gave; ExtractConfig holds every other default (what --help shows)
    cfg = ExtractConfig(**given_fields(ctx, ExtractConfig, {"timeout": "timeout_s"},
                                       convert={"encode_frames": encode_frames_value}))
    ours = not ray_running()  # a Ray this command starts is stopped when it is done (one it joined is left)
    try:
        summary = extract(manifest, video_root, out, cfg)
    except ExtractionError as e:
        for line in e.summary.lines():
            console.print(line, highlight=False)
        raise
    finally:
        if ours:
            stop_ray()
    for line in summary.lines():
        console.print(line, highlight=False)


@app.command("export", rich_help_panel=TOOLS)
def export_cmd(
    features: Annotated[Path, typer.Option(help="A complete feature store directory.")],
    out: Annotated[Path, typer.Option(help="Output: a file (hdf5: features.h5; parquet: videos.parquet) or, for npy and "
                                           "faiss, a new folder.")],
    format: Annotated[str, typer.Option(
        help="hdf5: the whole store in one file; npy or parquet: one pooled embedding per video (the meanpool "
             "head's: L2-normalised mean of the L2-normalised frames) with ids and provenance, for a vector "
             "index or a dataframe; faiss: a folder with a first stage's index of them (--first-stage; "
             "`tvrpipe search --index` reads it).")] = "hdf5",
    first_stage: Annotated[Optional[str], typer.Option(
        help=f"--format faiss: which index, one of {', '.join(exportable_first_stages())} (default: "
             f"{EXPORTED}; tvrpipe search --help says what each is).", show_default=False)] = None,
    first_stage_set: Annotated[Optional[list[str]], typer.Option(
        metavar="KEY=VALUE", help="--format faiss: a build setting of the index, KEY=VALUE (repeatable; docs/search.md lists them).",
        show_default=False)] = None,
) -> None:
    """Export a feature store: all of it to HDF5, or its pooled video embeddings to npy, Parquet or a search index."""
    from tvrpipe.features.export import POOLED_FORMATS, export_hdf5, export_pooled

    if format == "hdf5":
        console.print(f"wrote {export_hdf5(features, out, progress=True)}")
        return
    if (first_stage is not None or first_stage_set) and format != "faiss":
        option = "--first-stage" if first_stage is not None else "--first-stage-set"
        raise ConfigError(f"{option} is for --format faiss, not --format {format}")
    if format == "faiss":
        from tvrpipe.search.index import export_faiss

        path, left_out = export_faiss(features, out, *([first_stage] if first_stage is not None else []),
                                      settings=first_stage_set, progress=True)
    elif format not in POOLED_FORMATS:
        raise ConfigError(f"--format {format!r} is not supported; use hdf5, {', '.join(POOLED_FORMATS)} or faiss")
    else:
        path, left_out = export_pooled(features, out, format, progress=True)
    console.print(f"wrote {path}" + (f" ({left_out} videos without a decoded frame left out)" if left_out else ""),
                  highlight=False)


@features_app.command("show")
def show(features: Annotated[Path, typer.Argument(help="A feature store directory.")]) -> None:
    """Print a feature store's array shapes, provenance and failures."""
    from tvrpipe.features.store import open_store

    store = open_store(features)
    table = Table(title=str(features))
    for col in ("array", "shape", "dtype"):
        table.add_column(col)
    from tvrpipe.features.export import ARRAYS

    for name in ARRAYS:
        a = store.array(name)
        table.add_row(name, " x ".join(str(n) for n in a.shape), str(a.dtype))
    console.print(table)
    from tvrpipe.environment import versions_text

    prov = store.provenance
    for k in sorted(set(prov) - {"versions", "resumed_with"}):
        console.print(f"  {k}: {prov[k]}", markup=False)
    console.print(f"  versions: {versions_text(prov.get('versions'))}", markup=False)
    for other in prov.get("resumed_with") or []:  # rows written after a resume, in another environment
        console.print(f"  resumed with: {versions_text(other)}", markup=False)
    splits = store.videos.groupby("split").size().to_dict()
    console.print(f"videos per split: {splits}; failed videos: {len(store.failures)}")


@features_app.command("verify")
def verify(features: Annotated[Path, typer.Argument(help="A feature store directory.")]) -> None:
    """Check every chunk of a store against its checksum and scan the embeddings for NaN/inf."""
    from tvrpipe.errors import NonFiniteError
    from tvrpipe.features.store import StoreError, open_store, verify_store

    report = verify_store(features)
    console.print(f"{features}: {report.shards} shards, {report.bytes / 1e9:.3f} GB checked in "
                  f"{report.seconds:.1f} s" + ("" if report.complete else
                                               f"; extraction unfinished: {report.not_written} shards to go"),
                  highlight=False)
    for d in report.damage:
        console.print(f"  damaged: {d}", highlight=False)
    if report.damage:
        raise StoreError(
            f"{features}: {len(report.damage)} damaged shard(s), e.g. {report.damage[0]}; repair by running "
            f"`{report.made_by}` again with the same options and --out: it re-extracts exactly those shards"
        )
    if report.tables:
        raise StoreError(report.tables)
    bad = {k: v for k, v in report.nonfinite.items() if v}
    if bad:
        store = open_store(features)
        parts = []
        for name, rows in bad.items():
            table = store.videos if name.startswith("videos") else store.texts
            ids = table.iloc[rows[:3]].iloc[:, 0].tolist()
            parts.append(f"{name}: {len(rows)} rows, e.g. row {rows[0]} ({ids[0]}) in {store.shard_of(name, rows[0])}")
        raise NonFiniteError(
            f"{features}: the checksums match but the extractor stored non-finite values ({'; '.join(parts)}); "
            "re-extract with --overwrite (with --device cuda, try --device cpu: fp16 overflow)"
        )
    console.print("ok: every chunk matches its checksum and every embedding is finite")
