"""The data root: each dataset's files in one documented place, so that ``tvrpipe extract --dataset
msrvtt`` (and ``finetune --recipe``) need no other option.

Under the data root (``--data-root``, else ``$TVRPIPE_DATA``, else ``data/``) a dataset lives in
``<root>/<dataset>/``, laid out as its spec's ``layout`` says (``manifests/<dataset>.yaml``), e.g.
for MSR-VTT::

    data/msrvtt/msrvtt_data/       the annotation files (CLIP4Clip's msrvtt_data.zip, unpacked)
    data/msrvtt/MSRVTT/videos/all/ the videos (Frozen-in-Time's MSRVTT.zip, unpacked)
    data/msrvtt/manifest/          written here from the two above (reused while they are unchanged)

The synthetic dataset has no files to fetch: ``data/synthetic/`` is generated (``tvrpipe synth``'s
defaults) the first time it is asked for.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tvrpipe.errors import ConfigError

DATA_ROOT_ENV = "TVRPIPE_DATA"
MANIFEST_DIR = "manifest"


def data_root(option: str | os.PathLike[str] | None = None) -> Path:
    """``option``, else ``$TVRPIPE_DATA``, else ``data``."""
    return Path(option if option is not None else os.environ.get(DATA_ROOT_ENV, "data"))


@dataclass(frozen=True)
class DatasetLayout:
    """Where a dataset's files are under the data root."""

    dataset: str
    folder: Path  # <root>/<dataset>
    annotations: Path | None  # None: a generated dataset
    videos: Path
    manifest: Path


def dataset_layout(dataset: str, root: str | os.PathLike[str] | None = None) -> DatasetLayout:
    """The documented layout of ``dataset`` under the data root ``root`` (see the module docstring).

    Raises:
        ConfigError: an unknown dataset, or one without a fixed layout (``custom``).
    """
    from tvrpipe.data.datasets import load_spec

    spec = load_spec(dataset)
    layout = spec.raw.get("layout")
    if not isinstance(layout, dict) or "videos" not in layout:
        raise ConfigError(f"dataset {dataset!r} has no fixed layout under a data root: pass --manifest and "
                          "--video-root (`tvrpipe manifest build` writes the manifest)")
    folder = data_root(root) / dataset
    annotations = folder / layout["annotations"] if layout.get("annotations") else None
    return DatasetLayout(dataset, folder, annotations, folder / layout["videos"], folder / MANIFEST_DIR)


def prepare_dataset(dataset: str, root: str | os.PathLike[str] | None = None, split_set: str | None = None,
                    progress: bool = True) -> DatasetLayout:
    """The dataset's manifest under the data root, ready: reused when it was built from the annotation
    files there as they are now, else built from them (checking every video under the layout's video
    folder); the synthetic dataset is generated once. The default split set's manifest is
    ``<dataset>/manifest``, another's ``<dataset>/manifest-<split set>``.

    Raises:
        ConfigError: a file of the layout is missing: one line naming it and what to pass instead.
    """
    from tvrpipe.data.datasets import build_manifest, load_spec

    lay = dataset_layout(dataset, root)
    default = load_spec(dataset).default_split_set
    if split_set and split_set != default and lay.annotations is not None:  # a generated dataset has one
        lay = dataclasses.replace(lay, manifest=lay.folder / f"{MANIFEST_DIR}-{split_set}")
    where = f"(the {dataset} layout under the data root {lay.folder.parent}: docs/datasets.md; or pass --data-root, " \
            f"or ${DATA_ROOT_ENV})"
    if lay.annotations is None:  # generated
        if not (lay.manifest / "videos.parquet").is_file():
            from tvrpipe.data.synth import synthesize

            synthesize(lay.folder, 200, seed=0, progress=progress)
        return lay
    if _manifest_current(lay, split_set or default):
        return lay
    if not lay.annotations.is_dir():
        raise ConfigError(f"{dataset}: annotation folder {lay.annotations} not found {where}")
    if not lay.videos.is_dir():
        raise ConfigError(f"{dataset}: video folder {lay.videos} not found {where}")
    build_manifest(dataset, lay.annotations, lay.manifest, split_set, video_root=lay.videos)
    return lay


def _manifest_current(lay: DatasetLayout, split_set: str | None) -> bool:
    """Whether ``lay.manifest`` was built for this dataset and split set from the annotation files that
    are there now (unchanged sha256; a manifest whose annotation folder is gone is kept as it is)."""
    from tvrpipe.files import file_sha256

    try:
        meta = json.loads((lay.manifest / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("dataset") != lay.dataset or (split_set and meta.get("split_set") != split_set):
        return False
    if lay.annotations is None or not lay.annotations.is_dir():
        return True
    files = meta.get("annotation_files") or {}
    return all((lay.annotations / name).is_file() and file_sha256(lay.annotations / name) == sha
               for name, sha in files.items())
