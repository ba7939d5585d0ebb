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

``--video-root`` replaces the layout's video folder, for the build's checks as for extraction; a
manifest checked in another folder is rebuilt. A dry run builds in a scratch folder the caller
removes, so it checks everything a build checks and writes nothing under the data root.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
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
                    progress: bool = True, *, video_root: str | os.PathLike[str] | None = None,
                    scratch: str | os.PathLike[str] | None = None,
                    generate: Callable[[Path, bool], object] | None = None) -> DatasetLayout:
    """The dataset's manifest under the data root, ready: reused when it was built from the annotation
    files there as they are now, with its videos checked in the same video folder; else built from them
    (checking every video under the video folder); the synthetic dataset is generated once. The default
    split set's manifest is ``<dataset>/manifest``, another's ``<dataset>/manifest-<split set>``.

    Args:
        dataset: a dataset with a layout (``tvrpipe manifest datasets``).
        root: the data root (default ``$TVRPIPE_DATA``, else ``data``).
        split_set: default: the spec's.
        progress: show the synthetic dataset's progress bar.
        video_root: the user's video folder (``--video-root``), in place of the layout's: the videos are
            checked there and the returned layout names it.
        scratch: a dry run: whatever would be built under the data root (the manifest, the synthetic
            dataset) is built in this folder instead, with every check of a real build, and the returned
            layout points there; nothing under the data root is written. The caller removes the folder.
        generate: makes a generated dataset (its videos and manifest) in the folder it is given, with or
            without a progress bar; the commands pass :func:`tvrpipe.worlds.videos.generate_dataset`. The
            data floor renders nothing itself. None: a generated dataset not made yet is an error naming
            the command that makes it.

    Returns:
        Where the manifest and the videos are.

    Raises:
        ConfigError: a file of the layout is missing, or ``video_root`` is given for a generated dataset:
            one line naming it and what to pass instead.
        ManifestError: an annotation file is malformed, or videos are missing (naming the command that
            builds the manifest without them).

    Example:
        >>> lay = prepare_dataset("msrvtt", "data", video_root="/mnt/videos/msrvtt")  # doctest: +SKIP
        >>> lay.manifest, lay.videos  # doctest: +SKIP
        (PosixPath('data/msrvtt/manifest'), PosixPath('/mnt/videos/msrvtt'))
    """
    from tvrpipe.data.datasets import build_manifest, load_spec

    lay = dataset_layout(dataset, root)
    default = load_spec(dataset).default_split_set
    where = _where(dataset, root)
    if lay.annotations is None:  # generated
        if video_root is not None:
            raise ConfigError(f"--video-root {video_root}: the {dataset} dataset is generated with its videos under the "
                              f"data root ({lay.videos}); leave --video-root out, or pass --manifest and --video-root "
                              "of a dataset made by `tvrpipe synth --out DIR`")
        if (lay.manifest / "videos.parquet").is_file():
            return lay
        if scratch is not None:
            folder = Path(scratch) / dataset
            lay = dataclasses.replace(lay, folder=folder, videos=folder / lay.videos.relative_to(lay.folder),
                                      manifest=folder / MANIFEST_DIR)
        if generate is None:
            raise ConfigError(f"{dataset}: the generated dataset is not in {lay.folder} yet: make it with "
                              f"`tvrpipe synth --out {lay.folder}`")
        generate(lay.folder, progress)
        return lay
    if split_set and split_set != default:  # another split set's manifest lives beside the default's
        lay = dataclasses.replace(lay, manifest=lay.folder / f"{MANIFEST_DIR}-{split_set}")
    if video_root is not None:
        lay = dataclasses.replace(lay, videos=Path(video_root))
    if _manifest_current(lay, split_set or default, layout_videos=video_root is None):
        return lay
    if not lay.annotations.is_dir():
        raise ConfigError(f"{dataset}: annotation folder {lay.annotations} not found {where}")
    if not lay.videos.is_dir():
        if video_root is not None:
            raise ConfigError(f"--video-root {video_root}: not a directory; point it at the folder that holds the "
                              f"{dataset} videos")
        raise ConfigError(f"{dataset}: video folder {lay.videos} not found {where}")
    out = lay.manifest if scratch is None else Path(scratch) / lay.manifest.name
    build_manifest(dataset, lay.annotations, out, split_set, video_root=lay.videos,
                   missing_advice=_missing_advice(lay, split_set if split_set != default else None))
    return dataclasses.replace(lay, manifest=out)


def _where(dataset: str, root: str | os.PathLike[str] | None) -> str:
    """Which data root the layout was looked for under and what would look elsewhere: a --data-root the
    user gave is named as such (passing it is no advice then); else whether $TVRPIPE_DATA or the default
    gave the root."""
    if root is not None:
        return (f"(the {dataset} layout under --data-root {root}, docs/datasets.md: put the files there, or point "
                f"--data-root at the folder that holds {dataset}/)")
    env = os.environ.get(DATA_ROOT_ENV)
    source = f"${DATA_ROOT_ENV}={env}" if env is not None else f"the default data root {data_root()}/"
    return (f"(the {dataset} layout under {source}, docs/datasets.md: put the files there, or point --data-root "
            f"or ${DATA_ROOT_ENV} at the folder that holds {dataset}/)")


def _missing_advice(lay: DatasetLayout, split_set: str | None) -> str:
    """What to do about missing videos, in options every command that prepares a dataset has (extract,
    finetune): put them in the folder, or build the manifest without them, which is then reused."""
    import shlex

    cmd = ["tvrpipe", "manifest", "build", "--dataset", lay.dataset, "--annotations", str(lay.annotations),
           "--video-root", str(lay.videos), *(["--split-set", split_set] if split_set else []), "--allow-missing",
           "--out", str(lay.manifest)]
    return (f"put them in that folder (or pass --video-root with the folder that holds them), or drop them: "
            f"`{shlex.join(cmd)}` builds the manifest without them, and this command then uses it")


def _manifest_current(lay: DatasetLayout, split_set: str | None, layout_videos: bool = True) -> bool:
    """Whether ``lay.manifest`` was built for this dataset and split set from the annotation files that
    are there now (unchanged sha256), with its videos checked in ``lay.videos``; a manifest whose
    annotation folder is gone is kept as it is. A manifest that does not record where its videos were
    checked (built before tvrpipe recorded it) counts as checked in the layout's folder: current only
    when ``layout_videos``."""
    from tvrpipe.files import file_sha256

    try:
        meta = json.loads((lay.manifest / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    if meta.get("dataset") != lay.dataset or (split_set and meta.get("split_set") != split_set):
        return False
    if lay.annotations is None or not lay.annotations.is_dir():
        return True  # nothing to rebuild it from; its paths are relative, so a moved video folder still serves
    if "video_root" in meta:
        if meta["video_root"] is None or Path(meta["video_root"]) != lay.videos.resolve():
            return False
    elif not layout_videos:
        return False
    files = meta.get("annotation_files") or {}
    return all((lay.annotations / name).is_file() and file_sha256(lay.annotations / name) == sha
               for name, sha in files.items())
