"""``tvrpipe extract``, ``tvrpipe export`` and ``tvrpipe features show``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from tvrpipe.cli.app import app, new_app
from tvrpipe.errors import ConfigError

console = Console()
features_app = new_app(help="Inspect feature stores.")
app.add_typer(features_app, name="features")


@app.command("extract")
def extract_cmd(
    manifest: Annotated[Path, typer.Option(help="Manifest directory (videos.parquet, captions.parquet).")],
    video_root: Annotated[Path, typer.Option(help="Folder the manifest's video paths are relative to.")],
    out: Annotated[Path, typer.Option(help="Feature store directory; rerun the same command to resume.")],
    dataset: Annotated[
        Optional[str], typer.Option(help="Expected dataset name (checked against the manifest's).")
    ] = None,
    model: Annotated[str, typer.Option(help="open_clip architecture, e.g. ViT-B-32, or tvrpipe-tiny.")] = "ViT-B-32",
    pretrained: Annotated[
        str, typer.Option(help="open_clip pretrained tag (e.g. openai), a local checkpoint file, or 'none' (seeded random).")
    ] = "openai",
    frames: Annotated[Optional[int], typer.Option(help="Frames per video (default: the dataset's, e.g. 12).")] = None,
    max_words: Annotated[Optional[int], typer.Option(help="Text tokens L (default: the dataset's, e.g. 32).")] = None,
    batch_size: Annotated[int, typer.Option(help="Videos per encoder call (x frames = images per forward).")] = 16,
    address: Annotated[
        Optional[str], typer.Option(help="Ray cluster address ('auto' or host:port); default: RAY_ADDRESS or a local instance.")
    ] = None,
    device: Annotated[str, typer.Option(help="Encoder device: cpu or cuda (one GPU per encoder, fp16 autocast).")] = "cpu",
    decoders: Annotated[Optional[int], typer.Option(help="Decode actors (default: one per CPU).")] = None,
    encoders: Annotated[int, typer.Option(help="Encode actors (one per GPU on a GPU cluster).")] = 1,
    timeout: Annotated[float, typer.Option(help="Per-video decode timeout in seconds.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Seed of the random weights for --pretrained none.")] = 0,
    video_shard: Annotated[int, typer.Option(help="Videos per shard (one Zarr chunk; the unit of resume).")] = 64,
    text_shard: Annotated[int, typer.Option(help="Captions per shard.")] = 256,
    overwrite: Annotated[bool, typer.Option(help="Replace a store made with other settings.")] = False,
) -> None:
    """Extract CLIP frame and text features of a manifest into a Zarr feature store (Ray)."""
    from tvrpipe.pipeline.extract import ExtractConfig, extract
    from tvrpipe.pipeline.manifest import read_manifest

    if dataset is not None:
        have = read_manifest(manifest).meta.get("dataset")
        if have != dataset:
            raise ConfigError(f"--dataset {dataset!r} but the manifest in {manifest} is {have!r}")
    cfg = ExtractConfig(model=model, pretrained=pretrained, frames=frames, max_words=max_words,
                        batch_size=batch_size, device=device, address=address, decoders=decoders,
                        encoders=encoders, timeout_s=timeout, seed=seed, video_shard=video_shard,
                        text_shard=text_shard, overwrite=overwrite)
    summary = extract(manifest, video_root, out, cfg)
    for line in summary.lines():
        console.print(line)


@app.command("export")
def export_cmd(
    features: Annotated[Path, typer.Option(help="A complete feature store directory.")],
    out: Annotated[Path, typer.Option(help="Output file, e.g. features.h5.")],
    format: Annotated[str, typer.Option(help="Output format (hdf5).")] = "hdf5",
) -> None:
    """Export a feature store's arrays, ids and provenance to one file."""
    from tvrpipe.pipeline.export import export_hdf5

    if format != "hdf5":
        raise ConfigError(f"--format {format!r} is not supported; use hdf5")
    console.print(f"wrote {export_hdf5(features, out)}")


@features_app.command("show")
def show(features: Annotated[Path, typer.Argument(help="A feature store directory.")]) -> None:
    """Print a feature store's array shapes, provenance and failures."""
    from tvrpipe.pipeline.store import open_store

    store = open_store(features)
    table = Table(title=str(features))
    for col in ("array", "shape", "dtype"):
        table.add_column(col)
    from tvrpipe.pipeline.export import ARRAYS

    for name in ARRAYS:
        a = store.array(name)
        table.add_row(name, " x ".join(str(n) for n in a.shape), str(a.dtype))
    console.print(table)
    for k in sorted(store.provenance):
        console.print(f"  {k}: {store.provenance[k]}")
    splits = store.videos.groupby("split").size().to_dict()
    console.print(f"videos per split: {splits}; failed videos: {len(store.failures)}")
