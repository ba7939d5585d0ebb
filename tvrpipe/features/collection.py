"""A collection: a folder of the user's own videos, no annotations, as a manifest that extract reads.

``tvrpipe manifest build --videos FOLDER --out DIR`` lists every video file under ``FOLDER``, in
any subfolder, whose extension is one of :data:`~tvrpipe.data.manifest.VIDEO_EXTENSIONS` (any
case); names starting with a dot (hidden files and folders) are left out. Each video's id is its
path relative to the folder (``trips/2024/beach.mp4``), so ids are stable across rebuilds and
across machines that hold the same folder. Every video is split ``test``; there are no captions.

Each video file is probed once (:func:`~tvrpipe.features.decode.probe_video`: it opens and a frame
decodes); a file that does not decode is left out and listed in ``meta.json`` ``"skipped"`` with
the reason, as is every file that is not a video. The manifest's ``files.parquet`` records each
video's size and modification time (ns): a rebuild into the same ``--out`` probes only the files
whose fingerprint changed since (a rebuild of a folder of 100,000 videos is a walk and a ``stat``
per file), and extract compares the folder against it (:func:`check_unchanged`), so that a file
changed or removed since the build is never read as if it were the one the manifest names. Size
plus modification time is the test make and rsync use: a file rewritten with the same size within
the file system's time resolution goes unnoticed.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from tvrpipe.data.manifest import (
    COLLECTION,
    FILES_FILE,
    META_FILE,
    VIDEOS_FILE,
    Manifest,
    make_tables,
    write_manifest,
)
from tvrpipe.errors import ConfigError, ManifestError

log = logging.getLogger(__name__)

SPLIT = "test"  # a collection is searched, never trained on
_SHOW = 3  # files an error message names
_PROBE_THREADS = 8  # PyAV releases the GIL while it reads and decodes: threads overlap the probes


@dataclass(frozen=True)
class FolderScan:
    """The files under a folder, as paths relative to it (posix form), sorted.

    Attributes:
        videos: files with a video extension.
        others: every other file (hidden ones left out).
    """

    videos: list[str]
    others: list[str]


def scan_folder(folder: str | os.PathLike[str], skip: tuple[str | os.PathLike[str], ...] = ()) -> FolderScan:
    """Every file under ``folder``, recursively, split into video files (an extension of
    :data:`~tvrpipe.data.manifest.VIDEO_EXTENSIONS`, any case) and the rest. Names starting with a
    dot are skipped, folders too, and the folders ``skip`` (a manifest written inside the folder);
    links to folders are followed, once each (a link back up is not).

    Raises:
        ManifestError: ``folder`` is not a directory.
    """
    from tvrpipe.data.manifest import VIDEO_EXTENSIONS

    root = Path(folder)
    if not root.is_dir():
        raise ManifestError(f"--videos {root}: not a directory")
    videos, others = [], []
    seen = {os.path.realpath(root), *(os.path.realpath(p) for p in skip)}
    for here, dirs, names in os.walk(root, followlinks=True):
        keep = []
        for d in sorted(dirs):
            real = os.path.realpath(os.path.join(here, d))
            if not d.startswith(".") and real not in seen:
                seen.add(real)
                keep.append(d)
        dirs[:] = keep
        rel = Path(here).relative_to(root)
        for name in names:
            if name.startswith(".") or not os.path.isfile(os.path.join(here, name)):  # a dangling link, a socket
                continue
            path = (rel / name).as_posix()
            (videos if Path(name).suffix.lower() in VIDEO_EXTENSIONS else others).append(path)
    return FolderScan(sorted(videos), sorted(others))


def fingerprint(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(bytes, mtime_ns)`` of a file (of a link's target)."""
    st = os.stat(path)
    return int(st.st_size), int(st.st_mtime_ns)


@dataclass(frozen=True)
class CollectionBuild:
    """What :func:`build_collection` did.

    Attributes:
        manifest: the manifest as written (``meta["skipped"]`` lists the files left out).
        probed: video files probed by this build.
        known: video files whose fingerprint equals the previous build's into the same folder: not
            probed again.
        undecodable: video files left out because they do not decode.
        not_videos: files left out because their extension is not a video's.
    """

    manifest: Manifest
    probed: int
    known: int
    undecodable: int
    not_videos: int


def _previous(out: Path, root: str) -> dict[str, tuple[int, int, str | None]]:
    """What the last build into ``out`` found for each video file of the same folder:
    path -> (bytes, mtime_ns, None if it decoded else the reason). Empty when there is no such build
    (or its files cannot be read: then everything is probed again)."""
    try:
        meta = json.loads((out / META_FILE).read_text())
        if meta.get("kind") != COLLECTION or meta.get("video_root") != root:
            return {}
        videos = pq.read_table(out / VIDEOS_FILE, columns=["video_id", "path"]).to_pandas()
        files = pq.read_table(out / FILES_FILE).to_pandas().merge(videos, on="video_id")
    except Exception:  # missing or damaged: probe everything again
        return {}
    known: dict[str, tuple[int, int, str | None]] = {
        str(p): (int(b), int(m), None) for p, b, m in zip(files["path"], files["bytes"], files["mtime_ns"])}
    for s in meta.get("skipped") or []:
        if isinstance(s, dict) and {"path", "bytes", "mtime_ns", "reason"} <= set(s):
            known[str(s["path"])] = (int(s["bytes"]), int(s["mtime_ns"]), str(s["reason"]))
    return known


def build_collection(videos_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                     progress: bool = True) -> CollectionBuild:
    """Write the manifest of every decodable video file under ``videos_dir`` into ``out_dir``.

    ``video_id`` and ``path`` are the file's path relative to ``videos_dir`` (posix form, with its
    extension); ``split`` is ``test``; ``start_s``/``end_s`` are null; ``captions.parquet`` is empty.
    ``meta.json`` records ``kind`` and ``dataset`` (``"collection"``), ``video_root`` (the folder,
    absolute), the sampling defaults ``frames`` and ``max_words`` (the custom spec's) and
    ``skipped``: each file left out, ``{"path", "reason"}`` (plus ``bytes`` and ``mtime_ns`` for a
    video file that does not decode, so that a rebuild does not probe it again while unchanged).
    ``files.parquet`` holds each video's ``bytes`` and ``mtime_ns``.

    Args:
        videos_dir: the folder of videos.
        out_dir: the manifest's folder; a collection built there before from the same folder
            saves probing the files that did not change since.
        progress: show a progress bar while probing.

    Raises:
        ManifestError: ``videos_dir`` is not a folder, holds no video file, or none that decodes
            (nothing is written then).

    Example:
        >>> build = build_collection("~/my-videos", "data/mine/manifest")  # doctest: +SKIP
        >>> len(build.manifest.videos), build.manifest.meta["skipped"][:1]  # doctest: +SKIP
        (812, [{'path': 'notes.txt', 'reason': 'not a video file (.txt)'}])
    """
    from tvrpipe.data.datasets import load_spec
    from tvrpipe.data.manifest import VIDEO_EXTENSIONS
    from tvrpipe.features.decode import probe_video

    root, out = Path(videos_dir).expanduser(), Path(out_dir)
    scan = scan_folder(root, skip=(out,))
    root_abs = str(root.resolve())
    if not scan.videos:
        held = (f"it holds {len(scan.others)} files, e.g. {', '.join(scan.others[:_SHOW])}" if scan.others
                else "it holds no file (hidden files and folders are skipped)")
        raise ManifestError(f"no video file ({', '.join(sorted(VIDEO_EXTENSIONS))}) under {root}: {held}")
    before = _previous(out, root_abs)
    prints: dict[str, tuple[int, int]] = {}
    reasons: dict[str, str | None] = {}
    to_probe = []
    for path in scan.videos:
        try:
            prints[path] = fingerprint(root / path)
        except OSError as e:  # removed since the walk, or unreadable
            reasons[path] = f"unreadable: cannot stat it ({e.strerror or e})"
            continue
        old = before.get(path)
        if old is not None and old[:2] == prints[path]:
            reasons[path] = old[2]
        else:
            to_probe.append(path)
    known = len(scan.videos) - len(to_probe) - sum(p not in prints for p in scan.videos)
    reasons.update(zip(to_probe, _probe_all([root / p for p in to_probe], probe_video, progress)))
    good = [p for p in scan.videos if p in prints and reasons[p] is None]
    bad = [p for p in scan.videos if reasons[p] is not None]
    if not good:
        shown = ", ".join(f"{p} ({reasons[p]})" for p in bad[:_SHOW]) + (
            f" and {len(bad) - _SHOW} more" if len(bad) > _SHOW else "")
        raise ManifestError(f"none of the {len(bad)} video files under {root} decodes: {shown}")
    skipped: list[dict[str, Any]] = [
        {"path": p, "reason": reasons[p], **({"bytes": prints[p][0], "mtime_ns": prints[p][1]} if p in prints else {})}
        for p in bad]
    skipped += [{"path": p, "reason": f"not a video file ({Path(p).suffix.lower() or 'no extension'})"}
                for p in scan.others]
    skipped.sort(key=lambda s: s["path"])
    spec = load_spec("custom")  # the same sampling defaults as a table of one's own videos
    meta = {"kind": COLLECTION, "dataset": COLLECTION, "video_root": root_abs, "frames": spec.frames,
            "max_words": spec.max_words, "skipped": skipped}
    videos, captions = make_tables([{"video_id": p, "path": p, "split": SPLIT} for p in good], [])
    files = pd.DataFrame({"video_id": good, "bytes": [prints[p][0] for p in good],
                          "mtime_ns": [prints[p][1] for p in good]}).astype({"bytes": "int64", "mtime_ns": "int64"})
    m = write_manifest(out, videos, captions, meta, source=str(root), files=files)
    if bad:
        log.info("%d of %d video files under %s do not decode and were left out (listed in %s)", len(bad),
                    len(scan.videos), root, out / META_FILE)
    return CollectionBuild(m, probed=len(to_probe), known=known, undecodable=len(bad), not_videos=len(scan.others))


def _probe_all(paths: list[Path], probe, progress: bool) -> list[str | None]:
    if not paths:
        return []
    from rich.progress import track

    with ThreadPoolExecutor(max_workers=min(_PROBE_THREADS, os.cpu_count() or 1, len(paths))) as pool:
        return list(track(pool.map(probe, paths), total=len(paths), description="probing videos",
                          disable=not progress, transient=True))


def changed_files(rows: pd.DataFrame, root: Path) -> tuple[list[str], list[str]]:
    """The files of ``rows`` (columns path, bytes, mtime_ns) whose fingerprint under ``root`` differs now,
    and those gone: ``(changed, gone)``."""
    changed, gone = [], []
    for path, size, mtime in zip(rows["path"], rows["bytes"], rows["mtime_ns"]):
        try:
            now = fingerprint(root / path)
        except FileNotFoundError:
            gone.append(str(path))
            continue
        except OSError:
            changed.append(str(path))
            continue
        if now != (int(size), int(mtime)):
            changed.append(str(path))
    return changed, gone


def describe_changes(changed: list[str], gone: list[str]) -> str:
    """``changed 2: a.mp4, b.mp4; gone 1: c.mp4`` (the first few of each)."""
    return "; ".join(f"{what} {len(paths)}: {', '.join(paths[:_SHOW])}{' ...' if len(paths) > _SHOW else ''}"
                     for what, paths in (("changed", changed), ("gone", gone)) if paths)


def check_unchanged(manifest: Manifest, manifest_dir: str | os.PathLike[str],
                    video_root: str | os.PathLike[str]) -> None:
    """Before a collection is extracted: every video file is as the manifest's build found it (same
    size, same modification time), so that no feature is computed from, or kept for, another file
    under the same name. Video files under ``video_root`` that the manifest does not list (added
    since the build) are logged as a warning: they are not extracted.

    Raises:
        ConfigError: files changed or removed since the build; the message names how many, the
            first few, and the command that rebuilds the manifest.
    """
    root = Path(video_root)
    rows = manifest.files.merge(manifest.videos[["video_id", "path"]], on="video_id")
    changed, gone = changed_files(rows, root)
    rebuild = f"`tvrpipe manifest build --videos {root} --out {manifest_dir}`"
    if changed or gone:
        raise ConfigError(
            f"{len(changed) + len(gone)} of {len(rows)} video files of the collection in {manifest_dir} changed or "
            f"were removed under {root} since its manifest was built ({describe_changes(changed, gone)}); rebuild it "
            f"with {rebuild}, then rerun extract (the features of unchanged files are reused)")
    listed = set(manifest.videos["path"]) | {str(s.get("path")) for s in manifest.meta.get("skipped") or []
                                             if isinstance(s, dict)}
    new = [p for p in scan_folder(root).videos if p not in listed]
    if new:
        log.warning("%d video file(s) under %s are not in the manifest %s (added since it was built, e.g. %s): "
                    "they are not extracted; to add them, rebuild it with %s, then rerun extract", len(new), root,
                    manifest_dir, ", ".join(new[:_SHOW]), rebuild)
