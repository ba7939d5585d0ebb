"""A collection: a folder of the user's own videos, no annotations, as a manifest that extract reads.

``tvrpipe manifest build --videos FOLDER --out DIR`` lists every video file under ``FOLDER``, in
any subfolder, whose extension is one of :data:`~tvrpipe.data.manifest.VIDEO_EXTENSIONS` (any
case); names starting with a dot (hidden files and folders) are left out, and listed. Each video's id is its
path relative to the folder (``trips/2024/beach.mp4``), so ids are stable across rebuilds and
across machines that hold the same folder. Every video is split ``test``; there are no captions.

Each video file is probed once (:func:`~tvrpipe.features.decode.probe_video`: it opens and a frame
decodes); a file that does not decode is left out and listed in ``meta.json`` ``"skipped"`` with
the reason, as is every file that is not a video and every one that cannot be opened as named (a
broken link, a name that is not UTF-8, a path over the system's limit; :func:`scan_folder`).
Hidden files and folders are counted, not listed. The manifest's ``files.parquet`` records each
video's size and modification time (ns): a rebuild into the same ``--out`` probes only the files
whose fingerprint changed since (a rebuild of a folder of 100,000 videos is a walk and a ``stat``
per file), and extract compares the folder against it (:func:`check_unchanged`), so that a file
changed or removed since the build is never read as if it were the one the manifest names. Size
plus modification time is the test make and rsync use: a file rewritten with the same size within
the file system's time resolution goes unnoticed.

**Moments.** With a :class:`Cutting` (``--window 10s --stride 5s``) each file becomes several rows, one per
moment: the same ``path``, the moment's bounds in ``start_s``/``end_s`` (the manifest's way of saying that a
row is a clip of a file, as a benchmark's clips are), and the id ``path#t=START,END`` (seconds, the W3C
Media Fragments notation that players read in a URL). Windows start at 0, ``stride``, ``2 stride``, ... and
are ``window`` long; the last one is the first that reaches the file's end (within :data:`TAIL_S`) and ends
there, so it is between ``window - stride + TAIL_S`` and ``window + TAIL_S`` long; a file shorter than a window
is one moment, the whole file. A file's duration is the end of its last video packet
(:func:`~tvrpipe.features.decode.probe_duration`). A stride longer than the window is refused: the gaps would be
parts of a video that no search can find. The cutting is recorded in ``meta.json`` (``moments``) and kept by a
rebuild that does not name one, so that the ``manifest build`` command other messages print keeps the moments;
an unchanged file's bounds are taken from the last build (its last moment ends at its end), so it is not probed
again. A ``moments`` record that is not one this module writes is an error naming ``meta.json``
(:meth:`Cutting.recorded`), never read as whole files.

**No moment without a frame.** Extraction samples F frames of those whose time falls in a moment's
``[start_s, end_s)`` (:func:`~tvrpipe.features.decode.sampling.pick_frames`): a moment shorter than the interval
between two of the video's frames may hold none, and extract then fails it (``no_frames``; one 0.1 s window in
five of an 8 fps video holds no frame). The frame interval is a property of each file, known only once
it is read, while the options are checked before anything is: so no moment a cutting makes is shorter than
:data:`MIN_MOMENT_S`, 0.5 s, the frame interval of a video of 2 frames a second. A ``--window`` or ``--stride``
below it is refused in one line naming the option (choice: refused, not widened, because a widened window is
another cutting than the one asked for, with other moment ids, and a printed notice of it is easily missed in a
script; the user retypes it knowingly); the tail rule uses the same bound (:data:`TAIL_S` =
:data:`MIN_MOMENT_S`), and a shot is cut by ``--window`` with the same rule, so its last piece is no shorter
either. What is shorter is a whole file or a whole shot, which holds its frames by construction. A video slower
than 2 frames a second (a time-lapse, a slide show, a screen recording with long still stretches) can still have
a moment without a frame; extract lists it as failed (``no_frames``).

**Shots.** With ``Cutting(shots=True)`` (``--shots``) a file is cut where PySceneDetect finds a cut
(:func:`~tvrpipe.features.decode.shots.detect_cuts`), a moment per shot written as a window is; with ``window_s``
(``--window``) a shot longer than the window is cut into windows of it, end to end from the shot's start, as
:meth:`Cutting.bounds` cuts a file. A file with no cut, or whose detection fails, is one shot, and is listed in
``meta.json`` ``one_shot`` with the reason. A rebuild with the same cutting keeps an unchanged file's shots (its
moments in the last build) and detects only new and changed files; another threshold or cap detects every file.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shlex
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from tvrpipe.data.manifest import (
    COLLECTION,
    FILES_FILE,
    META_FILE,
    VIDEOS_FILE,
    Manifest,
    json_type,
    make_tables,
    outside_root,
    read_meta,
    write_manifest,
)
from tvrpipe.errors import ConfigError, ManifestError

log = logging.getLogger(__name__)

SPLIT = "test"  # a collection is searched, never trained on
# choice: the shortest moment a cutting makes, the frame interval of a video of 2 frames a second: a shorter moment
# may hold no frame and fail extraction as no_frames (the module docstring, "No moment without a frame")
MIN_MOMENT_S = 0.5
# a tail shorter than the shortest moment goes to the window before it, so the last moment is no sliver either
TAIL_S = MIN_MOMENT_S
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
WHOLE = "whole"  # --window whole: back to one row per file
_SHOW = 3  # files an error message names
_PROBE_THREADS = 8  # PyAV releases the GIL while it reads and decodes: threads overlap the probes


@dataclass(frozen=True)
class FolderScan:
    """The files under a folder, as paths relative to it (posix form), sorted.

    Attributes:
        videos: files with a video extension that can be opened by name.
        others: every other file (hidden ones left out).
        unusable: ``(path, reason)`` of the entries that cannot be taken as named: broken links and
            loops of links, what is not a regular file (a FIFO, a socket, a device), video files
            whose name is not UTF-8 or whose path is over the system's limit, folders that cannot
            be listed. A path that is not UTF-8 is shown with its bytes escaped (``caf\\xe9.mp4``).
        hidden: files and folders whose name starts with a dot (``.DS_Store``, ``._x.mp4``, ``.git``),
            left out; a hidden folder is one entry (``.git/``), its contents not looked into.
    """

    videos: list[str]
    others: list[str]
    unusable: list[tuple[str, str]] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)


def _shown_path(path: str) -> str:
    """``path`` as it can be written and printed: itself when it is UTF-8 text, else its bytes with the
    ones that are not UTF-8 escaped (``caf\\xe9.mp4``; a name read from disk keeps them as surrogates)."""
    try:
        path.encode("utf-8")
        return path
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class Cutting:
    """How a collection's files are cut into moments: fixed windows of ``window_s`` seconds every ``stride_s``
    (None: one row per whole file), or, with ``shots``, at the shot boundaries PySceneDetect finds
    (``threshold``: its ContentDetector's), each shot longer than ``window_s`` (if given) cut into windows of
    ``window_s`` end to end.

    Example:
        >>> Cutting(10.0, 5.0).bounds(23.0)
        [(0.0, 10.0), (5.0, 15.0), (10.0, 20.0), (15.0, 23.0)]
        >>> Cutting(10.0).bounds(4.2)
        [(0.0, 4.2)]
        >>> Cutting(10.0, shots=True).shot_bounds([3.2, 26.0], 30.0)
        [(0.0, 3.2), (3.2, 13.2), (13.2, 23.2), (23.2, 26.0), (26.0, 30.0)]
    """

    window_s: float | None = None
    stride_s: float | None = None  # None: the window (windows end to end)
    shots: bool = False
    threshold: float | None = None  # with shots: ContentDetector's threshold (None: its default)

    def __post_init__(self) -> None:
        for name in ("window_s", "stride_s", "threshold"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        # each check names the option whose value fails it, and a stride is checked only where one was given: a
        # stride taken from the window is never blamed for the window
        if not self.shots:
            if self.threshold is not None:
                raise ConfigError("--shot-threshold needs --shots: it is the shot detector's threshold")
        else:
            self._check_shots()
            return
        if self.window_s is None:
            if self.stride_s is not None:
                raise ConfigError("--stride needs --window: give the window length too, e.g. --window 10s --stride 5s")
            return
        _check_window(self.window_s, shots=False)
        if self.stride_s is None:
            object.__setattr__(self, "stride_s", self.window_s)
            return
        if not (np.isfinite(self.stride_s) and self.stride_s > 0):
            raise ConfigError(f"--stride {self.stride_s:g}: a stride must be a positive number of seconds")
        if self.stride_s > self.window_s:
            raise ConfigError(f"--stride {self.stride_s:g}s is longer than --window {self.window_s:g}s: the gaps between "
                              "windows would be parts of the videos that no search finds; give a stride of at most "
                              "the window")
        if self.stride_s < MIN_MOMENT_S:
            raise ConfigError(f"--stride {self.stride_s:g}s: moments would start less than {MIN_MOMENT_S:g}s apart, "
                              f"closer than two frames of a video of 2 frames a second, so that neighbours could "
                              f"hold the same frames; give at least {MIN_MOMENT_S:g}s")

    def _check_shots(self) -> None:
        from tvrpipe.features.decode.shots import SHOT_THRESHOLD

        if self.stride_s is not None:
            raise ConfigError("--stride with --shots: shots are cut where the picture changes, not every STRIDE; "
                              "--window with --shots caps a long shot (cut into windows of that length end to end)")
        if self.window_s is not None:
            _check_window(self.window_s, shots=True)
        if self.threshold is None:
            object.__setattr__(self, "threshold", SHOT_THRESHOLD)
        if not (np.isfinite(self.threshold) and 0 < self.threshold <= 255):
            raise ConfigError(f"--shot-threshold {self.threshold:g}: the detector's threshold is a mean change of "
                              f"hue, saturation and luminance between frames, above 0 and at most 255 (default "
                              f"{SHOT_THRESHOLD:g}; lower finds more cuts)")

    @property
    def moments(self) -> bool:
        return self.window_s is not None or self.shots

    def record(self) -> dict[str, Any] | None:
        """What ``meta.json`` records as ``moments``."""
        if self.shots:
            return {"shots": True, "threshold": self.threshold, "window_s": self.window_s}
        return {"window_s": self.window_s, "stride_s": self.stride_s} if self.moments else None

    @classmethod
    def recorded(cls, meta: Mapping[str, Any], source: str | os.PathLike[str]) -> Cutting:
        """The cutting that a manifest's ``meta.json`` (the file ``source``, which errors name) records: whole files
        when it has no ``moments`` (a whole-file build writes none).

        Raises:
            ManifestError: a ``moments`` record that is not one :meth:`record` writes (not an object, a key missing,
                a value that is not a number, a cutting the options would refuse), naming ``source``, the record,
                what is wrong with it and what to do.

        Example:
            >>> Cutting.recorded({"moments": {"window_s": 10.0, "stride_s": 5.0}}, "m/meta.json")
            Cutting(window_s=10.0, stride_s=5.0, shots=False, threshold=None)
        """
        if "moments" not in meta:
            return cls()
        rec = meta["moments"]
        try:
            if not isinstance(rec, dict):
                raise ConfigError(f"it is {json_type(rec)}, not an object")
            if "shots" in rec:
                if rec["shots"] is not True:
                    raise ConfigError(f"shots is {json.dumps(rec['shots'], default=str)}, not true")
                return cls(_recorded_number(rec, "window_s", may_be_null=True), shots=True,
                           threshold=_recorded_number(rec, "threshold"))
            return cls(_recorded_number(rec, "window_s"), _recorded_number(rec, "stride_s"))
        except ConfigError as e:
            shown = json.dumps(rec, default=str)
            shown = shown if len(shown) <= 120 else shown[:117] + "..."
            # the record's own keys, not the options the user did not type this time
            why = str(e)
            for option, key in (("--window ", "window_s "), ("--stride ", "stride_s "), ("--shot-threshold ", "threshold ")):
                why = why.replace(option, key)
            raise ManifestError(f"{source}: its moments record {shown} is damaged ({why}), so the last build's cutting "
                                f"is unknown; {NAME_THE_CUTTING}") from None

    def describe(self) -> str:
        """``10s windows every 5s``, ``shots, threshold 27, at most 10s``: what the build printed says."""
        if self.shots:
            cap = f", at most {self.window_s:g}s" if self.window_s is not None else ""
            return f"shots, threshold {self.threshold:g}{cap}"
        return f"{self.window_s:g}s windows every {self.stride_s:g}s" if self.moments else "whole files"

    def shot_bounds(self, cuts: list[float], duration: float) -> list[tuple[float, float]]:
        """The moments ``(start_s, end_s)`` of a file of ``duration`` seconds whose shots start at ``cuts`` (seconds,
        after 0): one per shot, a shot longer than ``window_s`` cut into windows as :meth:`bounds` cuts a file
        (end to end from the shot's start, the last ending at the shot's end, a tail under :data:`TAIL_S` joining
        the window before it); no cut, one moment of the whole file."""
        end = round(float(duration), 3)
        edges = [0.0, *sorted(c for c in {round(float(c), 3) for c in cuts} if 0 < c < end), end]
        cap = Cutting(self.window_s) if self.window_s is not None else None
        out = []
        for a, b in zip(edges[:-1], edges[1:]):
            pieces = cap.bounds(b - a) if cap is not None else [(0.0, b - a)]
            out += [(round(a + s, 3), b if k == len(pieces) - 1 else round(a + e, 3))
                    for k, (s, e) in enumerate(pieces)]
        return out

    def bounds(self, duration: float) -> list[tuple[float, float]]:
        """The moments ``(start_s, end_s)`` of a file of ``duration`` seconds, to the millisecond (the module
        docstring): each ``window_s`` long but the last, which ends at the file's end and lasts at least
        :data:`TAIL_S` unless it is the whole file."""
        # whole milliseconds, so that the tail rule compares exactly what is written
        end = round(float(duration) * 1000)
        if not self.moments or end <= 0:
            return [(0.0, end / 1000)]
        window, tail = round(self.window_s * 1000), round(TAIL_S * 1000)
        out, k = [], 0
        while True:
            start = round(k * self.stride_s * 1000)
            if start + window >= end - tail:
                out.append((start / 1000, end / 1000))
                return out
            out.append((start / 1000, (start + window) / 1000))
            k += 1


NAME_THE_CUTTING = ("build the manifest again naming the cutting: --window DURATION (with --stride), --shots, or "
                    "--window whole for one row per file (every file is then probed again)")


def _check_window(window: float, shots: bool) -> None:
    if not (np.isfinite(window) and window > 0):
        raise ConfigError(f"--window {window:g}: a window must last a positive number of seconds")
    if window < MIN_MOMENT_S:
        cap = "with --shots, a shot longer than it is cut into windows of it, and " if shots else ""
        raise ConfigError(f"--window {window:g}s: {cap}a moment this short may hold no frame of a video (two frames "
                          f"of a video of 2 frames a second are {MIN_MOMENT_S:g}s apart), and extract would fail it; "
                          f"give at least {MIN_MOMENT_S:g}s")


def _recorded_number(rec: dict[str, Any], key: str, may_be_null: bool = False) -> float | None:
    """``rec[key]``, a number in a ``moments`` record (None where it may be null)."""
    if key not in rec:
        raise ConfigError(f"{key} is missing")
    value = rec[key]
    if value is None and may_be_null:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key} is {json.dumps(value, default=str)[:40]}, not a number")
    return float(value)


def parse_seconds(text: str, option: str) -> float:
    """``"10s"``, ``"10"``, ``"1.5m"``, ``"1h"`` -> seconds.

    Raises:
        ConfigError: not a number of seconds, minutes or hours; the message names ``option``.

    Example:
        >>> parse_seconds("2.5m", "--window")
        150.0
    """
    t = str(text).strip().lower()
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    try:
        value = float(number) * _UNITS[unit]
        if not math.isfinite(value):  # 1e999 parses, as an infinity
            raise ValueError(text)
    except (ValueError, KeyError):
        raise ConfigError(f"{option} {text!r}: give a duration such as 10s, 2.5m or 1h (seconds when no unit)") from None
    return value


def cutting_of(window: str | None, stride: str | None, shots: bool = False,
               threshold: float | None = None) -> Cutting | None:
    """The :class:`Cutting` that ``--window``/``--stride`` (or ``--shots``, ``--shot-threshold``, with ``--window``
    as the longest moment) ask for: None when none is given (keep the last build's), whole files for
    ``--window whole``.

    Raises:
        ConfigError: a value that is not a duration, or a cutting :class:`Cutting` refuses.
    """
    if window is None and stride is None and not shots and threshold is None:
        return None
    if window is not None and window.strip().lower() == WHOLE:
        if stride is not None:
            raise ConfigError("--stride with --window whole: whole files are not cut; leave --stride out")
        if shots or threshold is not None:
            typed = "--shots" if shots else "--shot-threshold"
            raise ConfigError(f"{typed} with --window whole: whole files are not cut into shots; with --shots, "
                              "--window is the longest a moment may be (a duration)")
        return Cutting()
    if shots or threshold is not None:
        return Cutting(None if window is None else parse_seconds(window, "--window"),
                       None if stride is None else parse_seconds(stride, "--stride"), shots, threshold)
    return Cutting(None if window is None else parse_seconds(window, "--window"),
                   None if stride is None else parse_seconds(stride, "--stride"))


def moment_id(path: str, start: float, end: float) -> str:
    """A moment's id: ``path#t=START,END`` (W3C Media Fragments; seconds, at most 3 decimals).

    Example:
        >>> moment_id("trips/beach.mp4", 10.0, 22.5)
        'trips/beach.mp4#t=10,22.5'
    """
    def fmt(x: float) -> str:
        return f"{x:.3f}".rstrip("0").rstrip(".")

    return f"{path}#t={fmt(start)},{fmt(end)}"


def _not_regular(mode: int) -> str:
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "")
    return f"not a regular file ({kind})" if kind else "not a regular file"


def scan_folder(folder: str | os.PathLike[str], skip: tuple[str | os.PathLike[str], ...] = ()) -> FolderScan:
    """Every file under ``folder``, recursively, split into video files (an extension of
    :data:`~tvrpipe.data.manifest.VIDEO_EXTENSIONS`, any case), the rest, and what cannot be taken
    (:attr:`FolderScan.unusable`, with the reason). Names starting with a dot are skipped, folders
    too, and the folders ``skip`` (a manifest written inside the folder); links to folders are
    followed, once each (a link back up is not).

    The walk holds each folder open (:func:`os.fwalk`), so that a tree nested deeper than the
    system's path limit is still listed to the end: its files are named as unusable, never lost.

    Raises:
        ManifestError: ``folder`` is not a directory.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ManifestError(f"--videos {root}: not a directory")
    limits = _path_limits(root)
    seen = _folder_ids((root, *skip))
    found = FolderScan([], [], [], [])  # filled folder by folder, sorted at the end
    for here, dirs, names, fd in os.fwalk(root, follow_symlinks=True):
        rel = Path(here).relative_to(root)
        dirs[:] = _folders_to_enter(rel, dirs, fd, seen, found)
        _classify_files(rel, names, fd, limits, found)
    return FolderScan(sorted(found.videos), sorted(found.others), sorted(found.unusable), sorted(found.hidden))


def _path_limits(root: Path) -> tuple[int, int]:
    """Scan plan: the bytes of ``root``'s longest absolute form and the system's path limit, ``(root_len, path_max)``."""
    # the path extract opens (the folder as given, made absolute) or search opens (the folder resolved)
    root_len = max(len(os.fsencode(os.path.abspath(root))), len(os.fsencode(root.resolve())))
    path_max = os.pathconf(root, "PC_PATH_MAX")  # bytes with the closing NUL: 4096 on Linux
    return root_len, path_max


def _folder_ids(folders: tuple[str | os.PathLike[str], ...]) -> set[tuple[int, int]]:
    """Scan plan: the ``(st_dev, st_ino)`` of the folders never entered (again): the root and those skipped."""
    seen: set[tuple[int, int]] = set()
    for p in folders:
        try:
            st = os.stat(p)
            seen.add((st.st_dev, st.st_ino))
        except OSError:
            pass  # a --out not made yet
    return seen


def _folders_to_enter(rel: Path, dirs: list[str], fd: int, seen: set[tuple[int, int]],
                      found: FolderScan) -> list[str]:
    """Walk stage, subfolders: those of folder ``rel`` (open as ``fd``) to enter, sorted; the hidden and the
    unlistable recorded in ``found``, and a folder already entered (a link back up) left out."""
    keep = []
    for d in sorted(dirs):
        if d.startswith("."):
            found.hidden.append(_shown_path((rel / d).as_posix()) + "/")
            continue
        try:
            st = os.stat(d, dir_fd=fd)
            os.close(os.open(d, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd))
        except OSError as e:
            found.unusable.append((_shown_path((rel / d).as_posix()) + "/",
                                   f"a folder that cannot be listed ({e.strerror or e}): its files are not looked at"))
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            keep.append(d)
    return keep


def _classify_files(rel: Path, names: list[str], fd: int, limits: tuple[int, int], found: FolderScan) -> None:
    """Walk stage, files: each file of folder ``rel`` (open as ``fd``) into its list of ``found``."""
    from tvrpipe.data.manifest import VIDEO_EXTENSIONS

    root_len, path_max = limits
    for name in names:
        if name.startswith("."):
            found.hidden.append(_shown_path((rel / name).as_posix()))
            continue
        path = (rel / name).as_posix()
        shown = _shown_path(path)
        try:
            st = os.stat(name, dir_fd=fd)
        except FileNotFoundError:
            if _is_link(name, fd):
                found.unusable.append((shown, "broken link: what it points to does not exist"))
            continue  # removed since the folder was listed
        except OSError as e:
            why = ("broken link: a loop of links" if e.errno == errno.ELOOP
                   else f"cannot stat it ({e.strerror or e})")
            found.unusable.append((shown, why))
            continue
        if not stat.S_ISREG(st.st_mode):
            found.unusable.append((shown, _not_regular(st.st_mode)))
            continue
        if Path(name).suffix.lower() not in VIDEO_EXTENSIONS:
            found.others.append(shown)
            continue
        if shown != path:  # parquet holds UTF-8 text only, and an id must name the file exactly
            found.unusable.append((shown, "its name is not UTF-8 text (a legacy encoding such as Latin-1?): rename "
                                          "it in UTF-8 to include it"))
            continue
        length = root_len + 1 + len(os.fsencode(path))
        if length >= path_max:
            found.unusable.append((shown, f"path too long: {length} bytes from /, over the system's limit of "
                                          f"{path_max - 1} (PATH_MAX), so no program can open it by name; move it "
                                          "to a shallower folder or shorten its names to include it"))
            continue
        found.videos.append(path)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


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
        unusable: entries left out because they cannot be taken as named (:attr:`FolderScan.unusable`,
            and video paths a manifest refuses).
        hidden: files and folders left out because their name starts with a dot (listed in ``skipped``, a
            hidden folder as one entry).
        cutting: how the files were cut (the one given, else the last build's).
    """

    manifest: Manifest
    probed: int
    known: int
    undecodable: int
    not_videos: int
    unusable: int = 0
    hidden: int = 0
    cutting: Cutting = field(default_factory=Cutting)


@dataclass(frozen=True)
class _Previous:
    """What the last build into the same ``--out`` from the same folder found (empty when there is none; its probes
    alone when its tables cannot be read: then every file is probed again)."""

    known: dict[str, tuple[int, int, str | None]] = field(default_factory=dict)  # path -> bytes, mtime_ns, reason
    durations: dict[str, float] = field(default_factory=dict)  # path -> duration, where it was cut into moments
    bounds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # path -> its moments, in order
    one_shot: dict[str, str] = field(default_factory=dict)  # path -> why --shots left it one moment
    cutting: Cutting = field(default_factory=Cutting)
    damaged: str | None = None  # why its meta.json cannot be read: its cutting is unknown, nothing of it is used


def _previous(out: Path, root: str) -> _Previous:
    """What the last build into ``out`` found for each video file of the same folder: its fingerprint and None if
    it decoded, else the reason; its duration and its moments where that build cut it into moments (its last
    moment ends at its end); and that build's cutting. A ``meta.json`` that cannot be read, or whose cutting is
    damaged, gives ``damaged`` (why) and nothing else: the build refuses to guess the cutting from it."""
    path = out / META_FILE
    if not path.is_file():
        return _Previous()
    try:
        meta = read_meta(path, lenient=("skipped", "one_shot"))  # damaged notes: probed again
    except ManifestError as e:
        return _Previous(damaged=f"{e}; the last build's cutting is unknown: {NAME_THE_CUTTING}")
    if meta.get("kind") != COLLECTION or meta.get("video_root") != root:
        return _Previous()
    try:
        cutting = Cutting.recorded(meta, path)
    except ManifestError as e:
        return _Previous(damaged=str(e))
    # the rest is what the last build probed, a saving only: whatever of it is damaged is probed again
    try:
        videos = pq.read_table(out / VIDEOS_FILE, columns=["video_id", "path", "start_s", "end_s"]).to_pandas()
        files = pq.read_table(out / FILES_FILE).to_pandas().merge(videos, on="video_id")
        known: dict[str, tuple[int, int, str | None]] = {
            str(p): (int(b), int(m), None) for p, b, m in zip(files["path"], files["bytes"], files["mtime_ns"])}
        cut = files.dropna(subset=["start_s", "end_s"]).sort_values(["path", "start_s", "end_s"])
        durations = {str(p): float(e) for p, e in cut.groupby("path")["end_s"].max().items()}
        bounds: dict[str, list[tuple[float, float]]] = {}
        for p, a, b in zip(cut["path"], cut["start_s"], cut["end_s"]):
            bounds.setdefault(str(p), []).append((float(a), float(b)))
    except Exception:  # missing or damaged tables
        return _Previous(cutting=cutting)
    for s in _entries(meta, "skipped", ("path", "bytes", "mtime_ns", "reason")):
        try:
            known[str(s["path"])] = (int(s["bytes"]), int(s["mtime_ns"]), str(s["reason"]))
        except (TypeError, ValueError):
            continue
    one_shot = {str(s["path"]): str(s["reason"]) for s in _entries(meta, "one_shot", ("path", "reason"))}
    return _Previous(known, durations, bounds, one_shot, cutting)


def _entries(meta: dict[str, Any], key: str, fields: tuple[str, ...]) -> list[dict[str, Any]]:
    """The entries of ``meta[key]``, a list of objects, that have ``fields`` (a damaged one is probed again)."""
    entries = meta.get(key)
    return [s for s in entries if isinstance(s, dict) and set(fields) <= set(s)] if isinstance(entries, list) else []


def build_collection(videos_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                     progress: bool = True, cutting: Cutting | None = None) -> CollectionBuild:
    """Write the manifest of every decodable video file under ``videos_dir`` into ``out_dir``.

    ``video_id`` and ``path`` are the file's path relative to ``videos_dir`` (posix form, with its
    extension); ``split`` is ``test``; ``start_s``/``end_s`` are null; ``captions.parquet`` is empty.
    ``meta.json`` records ``kind`` and ``dataset`` (``"collection"``), ``video_root`` (the folder,
    absolute), the sampling defaults ``frames`` and ``max_words`` (the custom spec's) and
    ``skipped``: each file left out, ``{"path", "reason"}`` (plus ``bytes`` and ``mtime_ns`` for a
    video file that does not decode, so that a rebuild does not probe it again while unchanged):
    files that are not videos, videos that do not decode, and what cannot be taken as named (broken
    links, names that are not UTF-8, paths over the system's limit: :func:`scan_folder`). Hidden
    files and folders are counted, not listed.
    ``files.parquet`` holds each video's ``bytes`` and ``mtime_ns``.

    Args:
        videos_dir: the folder of videos.
        out_dir: the manifest's folder; a collection built there before from the same folder
            saves probing the files that did not change since.
        progress: show a progress bar while probing.
        cutting: cut each file into moments (:class:`Cutting`; ``Cutting()`` for whole files); None keeps the
            cutting of the last build into ``out_dir`` (whole files when there is none).

    Raises:
        ManifestError: ``videos_dir`` is not a folder, holds no video file, or none that decodes; or no
            ``cutting`` is given and the last build's ``meta.json`` cannot be read or records a damaged one
            (nothing is written then).

    Example:
        >>> build = build_collection("~/my-videos", "data/mine/manifest")  # doctest: +SKIP
        >>> len(build.manifest.videos), build.manifest.meta["skipped"][:1]  # doctest: +SKIP
        (812, [{'path': 'notes.txt', 'reason': 'not a video file (.txt)'}])
    """
    from tvrpipe.data.datasets import load_spec
    from tvrpipe.features.decode import probe_video

    root, out = Path(videos_dir).expanduser(), Path(out_dir)
    scan = scan_folder(root, skip=(out,))
    root_abs = str(root.resolve())
    candidates, unusable = _plan_candidates(root, scan)
    previous = _previous(out, root_abs)
    cutting = _plan_cutting(out, previous, cutting)
    prints, reasons, to_probe = _fingerprint_all(root, candidates, previous.known)
    known = len(candidates) - len(to_probe) - sum(p not in prints for p in candidates)  # unchanged since the last build
    reasons.update(zip(to_probe, _probe_all([root / p for p in to_probe], probe_video, progress)))
    good, bad = _split_decoded(root, candidates, prints, reasons, unusable)
    skipped = _skipped_entries(scan, bad, reasons, prints, unusable)
    spec = load_spec("custom")  # the same sampling defaults as a table of one's own videos
    meta: dict[str, Any] = {"kind": COLLECTION, "dataset": COLLECTION, "video_root": root_abs,
                            "frames": spec.frames, "max_words": spec.max_words, "skipped": skipped}
    rows, cut_meta = _cut_rows(root, good, to_probe, previous, cutting, progress)
    meta.update(cut_meta)
    m = _write_collection(out, root, rows, prints, meta)
    return CollectionBuild(m, probed=len(to_probe), known=known, undecodable=len(bad), not_videos=len(scan.others),
                           unusable=len(unusable), hidden=len(scan.hidden), cutting=cutting)


def _plan_candidates(root: Path, scan: FolderScan) -> tuple[list[str], list[tuple[str, str]]]:
    """Plan stage: the video paths a manifest can name, and every entry left out as unusable, sorted.

    Raises:
        ManifestError: no video file a manifest can name; the message names a few of the files there.
    """
    from tvrpipe.data.manifest import VIDEO_EXTENSIONS

    # a file named `..\x.mp4` or (in a folder `C:`) `C:/x.mp4`: a legal name here, refused by the manifest
    # because Windows reads it as leaving the folder; the file is skipped, the folder still built
    refused = [(p, "its path reads as leaving the folder on Windows (a backslash, or a drive such as 'C:/'), "
                   "which a manifest refuses: rename it to include it") for p in scan.videos if outside_root(p)]
    candidates = [p for p in scan.videos if not outside_root(p)]
    unusable = sorted([*scan.unusable, *refused])
    if not candidates:
        held = [*scan.others, *(f"{p} ({why})" for p, why in unusable)]
        held_text = (f"it holds {len(held)} files, e.g. {', '.join(held[:_SHOW])}" if held
                     else "it holds no file (hidden files and folders are skipped)")
        raise ManifestError(f"no video file ({', '.join(sorted(VIDEO_EXTENSIONS))}) under {root}: {held_text}")
    return candidates, unusable


def _plan_cutting(out: Path, previous: _Previous, cutting: Cutting | None) -> Cutting:
    """Plan stage: the cutting of this build, the one given or else the last build's (``previous``).

    Raises:
        ManifestError: none is given and the last build's cannot be read.
    """
    if previous.damaged is not None:
        if cutting is None:  # the cutting to keep is unknown: never guessed as whole files
            raise ManifestError(previous.damaged)
        log.warning("%s is damaged and set aside: the cutting given is used and every file is probed again",
                    out / META_FILE)
    cutting = previous.cutting if cutting is None else cutting
    if cutting.shots:
        from tvrpipe.features.decode.shots import require_scenedetect

        require_scenedetect()  # before any file is probed
    return cutting


def _fingerprint_all(
    root: Path, candidates: list[str], before: dict[str, tuple[int, int, str | None]]
) -> tuple[dict[str, tuple[int, int]], dict[str, str | None], list[str]]:
    """Run stage, fingerprints: each candidate's ``(bytes, mtime_ns)``, the reasons known already (a file that
    cannot be stat'ed, an unchanged one's from the last build, ``before``) and the files left to probe."""
    prints: dict[str, tuple[int, int]] = {}
    reasons: dict[str, str | None] = {}
    to_probe = []
    for path in candidates:
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
    return prints, reasons, to_probe


def _split_decoded(root: Path, candidates: list[str], prints: dict[str, tuple[int, int]],
             reasons: dict[str, str | None], unusable: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Check stage: the candidates that decode and those that do not, ``(good, bad)``.

    Raises:
        ManifestError: none decodes; the message names a few of them, and of the ``unusable``.
    """
    good = [p for p in candidates if p in prints and reasons[p] is None]
    bad = [p for p in candidates if reasons[p] is not None]
    if not good:
        shown = ", ".join(f"{p} ({reasons[p]})" for p in bad[:_SHOW]) + (
            f" and {len(bad) - _SHOW} more" if len(bad) > _SHOW else "")
        also = (f"; {len(unusable)} more cannot be taken as named: "
                + ", ".join(f"{p} ({why})" for p, why in unusable[:_SHOW]) if unusable else "")
        raise ManifestError(f"none of the {len(bad)} video files under {root} decodes: {shown}{also}")
    return good, bad


def _skipped_entries(scan: FolderScan, bad: list[str], reasons: dict[str, str | None],
                     prints: dict[str, tuple[int, int]], unusable: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Record stage: ``meta.json``'s ``skipped``, each file left out with the reason, sorted by path."""
    skipped: list[dict[str, Any]] = [
        {"path": p, "reason": reasons[p], **({"bytes": prints[p][0], "mtime_ns": prints[p][1]} if p in prints else {})}
        for p in bad]
    skipped += [{"path": p, "reason": f"not a video file ({Path(p).suffix.lower() or 'no extension'})"}
                for p in scan.others]
    skipped += [{"path": p, "reason": why} for p, why in unusable]
    skipped += [{"path": p, "reason": "a hidden folder (its name starts with a dot): not looked into" if p.endswith("/")
                 else "hidden (its name starts with a dot)"} for p in scan.hidden]
    skipped.sort(key=lambda s: s["path"])
    return skipped


def _cut_rows(root: Path, good: list[str], to_probe: list[str], previous: _Previous, cutting: Cutting,
              progress: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run stage, cutting: the manifest rows of the ``good`` files as ``cutting`` cuts them, and what ``meta.json``
    records of it (``moments``, ``one_shot``); the last build's cuts kept for the files not probed again."""
    if cutting.shots:
        # an unchanged file keeps the shots the last build found with the same detector and cap
        kept = {p: b for p, b in previous.bounds.items() if p not in to_probe} if previous.cutting == cutting else {}
        rows, one_shot = _shot_moments(root, good, kept, previous.one_shot, cutting, progress)
        return rows, {"moments": cutting.record(), "one_shot": one_shot}
    if cutting.moments:
        durations = {p: d for p, d in previous.durations.items() if p not in to_probe}
        return _moments(root, good, durations, cutting, progress), {"moments": cutting.record()}
    return [{"video_id": p, "path": p, "split": SPLIT} for p in good], {}


def _write_collection(out: Path, root: Path, rows: list[dict[str, Any]], prints: dict[str, tuple[int, int]],
                      meta: dict[str, Any]) -> Manifest:
    """Write stage: the manifest of ``rows``, with each row's file fingerprint in ``files.parquet``."""
    videos, captions = make_tables(rows, [])
    files = pd.DataFrame({"video_id": [r["video_id"] for r in rows],
                          "bytes": [prints[r["path"]][0] for r in rows],
                          "mtime_ns": [prints[r["path"]][1] for r in rows]}).astype({"bytes": "int64", "mtime_ns": "int64"})
    m = write_manifest(out, videos, captions, meta, source=str(root), files=files)
    if meta["skipped"]:
        log.info("%d files under %s were left out (the reasons are in %s)", len(meta["skipped"]), root,
                 out / META_FILE)
    return m


def _moments(root: Path, paths: list[str], known: dict[str, float], cutting: Cutting,
             progress: bool) -> list[dict[str, Any]]:
    """The manifest rows of ``paths`` cut into moments: durations from ``known`` (an unchanged file's, from the
    last build), else probed (:func:`~tvrpipe.features.decode.probe_duration`)."""
    from tvrpipe.features.decode import DecodeFailure, probe_duration

    def duration(path: Path) -> float | str:
        try:
            return probe_duration(path)
        except DecodeFailure as e:  # it decoded a moment ago: changed since
            return f"{e.kind}: {e.detail}"

    found = _probe_new(root, paths, known, duration, progress, "probing durations")
    rows = []
    for p in paths:
        for start, end in cutting.bounds(known[p] if p in known else found[p]):
            rows.append({"video_id": moment_id(p, start, end), "path": p, "split": SPLIT,
                         "start_s": start, "end_s": end})
    return rows


def _shot_moments(root: Path, paths: list[str], kept: dict[str, list[tuple[float, float]]], notes: dict[str, str],
                  cutting: Cutting, progress: bool) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """The manifest rows of ``paths`` cut at their shots (:meth:`Cutting.shot_bounds`): ``kept`` moments for the
    files the last build cut the same way (``notes``: why it left some one moment), the others detected
    (:func:`~tvrpipe.features.decode.shots.detect_cuts`) and timed (the last shot ends at the file's end). Also
    the files left one moment, each ``{"path", "reason"}``: no cut found, or the detection failed (its error)."""
    from tvrpipe.features.decode import DecodeFailure, probe_duration
    from tvrpipe.features.decode.shots import detect_cuts

    def cut(path: Path) -> tuple[list[float], float, str | None] | str:
        try:
            duration = probe_duration(path)
        except DecodeFailure as e:  # it decoded a moment ago: changed since
            return f"{e.kind}: {e.detail}"
        try:
            cuts = detect_cuts(path, cutting.threshold)
        except DecodeFailure as e:
            return [], duration, f"shot detection failed ({e.detail}): the whole file is one shot"
        return cuts, duration, None if cuts else "no shot boundary found: the whole file is one shot"

    found = _probe_new(root, paths, kept, cut, progress, "finding shots")
    rows, one_shot = [], []
    for p in paths:
        if p in kept:
            bounds, why = kept[p], notes.get(p)
        else:
            cuts, duration, why = found[p]
            bounds = cutting.shot_bounds(cuts, duration)
        if why is not None:
            one_shot.append({"path": p, "reason": why})
        rows += [{"video_id": moment_id(p, a, b), "path": p, "split": SPLIT, "start_s": a, "end_s": b}
                 for a, b in bounds]
    return rows, one_shot


def _probe_new(root: Path, paths: list[str], known: Mapping[str, Any], probe, progress: bool,
               what: str) -> dict[str, Any]:
    """``probe(root / p)`` of each of ``paths`` not in ``known`` (the last build's), by path; a probe that returns a
    string is a file whose duration cannot be read, though it decoded a moment ago.

    Raises:
        ManifestError: naming the first such file.
    """
    todo = [p for p in paths if p not in known]
    found = dict(zip(todo, _probe_all([root / p for p in todo], probe, progress, what)))
    bad = [(p, d) for p, d in found.items() if isinstance(d, str)]
    if bad:
        raise ManifestError(f"{root / bad[0][0]}: its duration cannot be read ({bad[0][1]}); it changed while the "
                            "folder was read? build the manifest again")
    return found


def _probe_all(paths: list[Path], probe, progress: bool, what: str = "probing videos") -> list[Any]:
    if not paths:
        return []
    from tvrpipe.progress import track

    with ThreadPoolExecutor(max_workers=min(_PROBE_THREADS, os.cpu_count() or 1, len(paths))) as pool:
        return list(track(pool.map(probe, paths), what, total=len(paths), enabled=progress,
                          transient=True))


def changed_files(rows: pd.DataFrame, root: Path) -> tuple[list[str], list[str]]:
    """The files of ``rows`` (columns path, bytes, mtime_ns; a file's moments count once) whose fingerprint
    under ``root`` differs now, and those gone: ``(changed, gone)``."""
    changed, gone = [], []
    rows = rows.drop_duplicates("path")  # a file cut into moments is a row per moment
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
    rows = manifest.files.merge(manifest.videos[["video_id", "path"]], on="video_id").drop_duplicates("path")
    changed, gone = changed_files(rows, root)
    rebuild = f"`{shlex.join(['tvrpipe', 'manifest', 'build', '--videos', str(root), '--out', str(manifest_dir)])}`"
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
