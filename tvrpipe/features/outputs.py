"""Where a command may write: checked for every output before any is written.

A command's outputs never land on its inputs or inside a folder tvrpipe made for another purpose: a
search's ``--json`` inside the store it searched would replace the store's own ``videos.parquet``, and an
``extract --out`` pointed at the manifest folder would write the store over the manifest. Every output
path is checked first (not a folder, not inside a tvrpipe folder, its folder there or creatable, writable),
so that one bad path fails the command before the first file lands, not after.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from tvrpipe.data.manifest import META_FILE, VIDEOS_FILE
from tvrpipe.errors import ConfigError
from tvrpipe.features.store import PREVIOUS, PROGRESS, SIDECARS, STORE_NAME
from tvrpipe.files import special_file
from tvrpipe.lock import LOCK_NAME, check_writable, nearest_existing
from tvrpipe.rundir import CONFIG, EPOCHS, METRICS_FILE

# What a store's folder holds besides its arrays and tables: its lock, its progress, the store an
# update replaces, the search index (and their staging names, which start with a dot)
_STORE_ENTRIES = frozenset({STORE_NAME, *SIDECARS, LOCK_NAME, PROGRESS, PREVIOUS, f"{PREVIOUS}.tmp", "search-index"})


def folder_kind(folder: str | os.PathLike[str]) -> str | None:
    """What tvrpipe made ``folder`` for ("a feature store", "a manifest", "a run"), or None.

    By the files each writes first: a store its ``features.zarr``, a manifest its ``videos.parquet``
    beside ``meta.json``, a run its ``config.yaml`` beside ``metrics.json`` or ``epochs.csv``.
    """
    p = Path(folder)
    if (p / STORE_NAME).exists():
        return "a feature store"
    if (p / VIDEOS_FILE).is_file() and (p / META_FILE).is_file():
        return "a manifest"
    if (p / CONFIG).is_file() and ((p / METRICS_FILE).is_file() or (p / EPOCHS).is_file()):
        return "a run"
    return None


def enclosing_folder(path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """The nearest folder above ``path`` (resolved; ``path`` itself excluded) that tvrpipe made, with its
    kind (:func:`folder_kind`), or None."""
    p = Path(os.path.abspath(path))
    for parent in Path(os.path.realpath(p.parent)), *Path(os.path.realpath(p.parent)).parents:
        kind = folder_kind(parent)
        if kind is not None:
            return parent, kind
    return None


def check_output_files(outputs: Mapping[str, str | os.PathLike[str] | None],
                       inputs: Mapping[str, str | os.PathLike[str] | None] | None = None) -> None:
    """Check every output file of a command before any is written (``{option: path}``, None: not asked).

    Each must be a file name (not a folder), outside every one of ``inputs`` (``{option: folder}``) and
    every folder tvrpipe made (a store, a manifest, a run), not one of the others, and in a folder that
    exists or can be made and is writable. Creates nothing.

    Raises:
        ConfigError: naming the option, its path and what to do.
    """
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        p = Path(path)
        real = os.path.realpath(p)
        if p.is_dir():
            raise ConfigError(f"{option} {p} is a folder; give a file name")
        kind = special_file(p)
        if kind:  # written by a rename, it would be replaced by a regular file
            raise ConfigError(f"{option} {p} is {kind}, not a file; give a file name")
        for in_option, folder in (inputs or {}).items():
            if folder is not None and Path(real).is_relative_to(os.path.realpath(folder)):
                raise ConfigError(f"{option} {p} is inside {in_option} {folder}, an input of this command; "
                                  "write it outside that folder")
        inside = enclosing_folder(p)
        if inside is not None:
            raise ConfigError(f"{option} {p} is inside {inside[1]} ({inside[0]}), which tvrpipe made for another "
                              "purpose; write it outside that folder")
        if real in seen:
            raise ConfigError(f"{option} and {seen[real]} name the same file {p}; give each its own")
        seen[real] = option
        if p.exists() and not os.access(p, os.W_OK):
            raise ConfigError(f"{option} {p}: the file exists and cannot be written; choose another name")
        ancestor = nearest_existing(p.parent)
        if not ancestor.is_dir():
            raise ConfigError(f"{option} {p}: {ancestor} is a file, so the folder cannot be created; choose another "
                              "path")
        check_writable(p.parent, option)


def check_output_folder(out: str | os.PathLike[str], option: str = "--out", may_be: str | None = None) -> None:
    """An output folder of a command (``--out``): not a folder tvrpipe made for another purpose (a store, a
    manifest, a run; ``may_be`` names the one kind it may be, to be updated), nor inside one.

    Raises:
        ConfigError: naming the option and what the folder is.
    """
    kind = folder_kind(out) if Path(out).is_dir() else None
    if kind is not None and kind != may_be:
        raise ConfigError(f"{option} {out} is {kind}; write into a folder of its own")
    inside = enclosing_folder(out)
    if inside is not None:
        raise ConfigError(f"{option} {out} is inside {inside[1]} ({inside[0]}); write into a folder of its own")


def check_store_out(out: str | os.PathLike[str], inputs: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """``extract --out``: a new or empty folder, or a feature store (to resume or update), never a manifest,
    a run, one of the command's ``inputs`` (``{option: folder}``), or a folder that holds other files.

    Raises:
        ConfigError: naming ``--out`` and what it holds.
    """
    p = Path(out)
    real = os.path.realpath(p)
    for option, folder in inputs.items():
        if folder is not None and (real == os.path.realpath(folder)
                                   or Path(os.path.realpath(folder)).is_relative_to(real)):
            raise ConfigError(f"--out {p} holds {option} {folder}, an input of this command; a store goes into a "
                              "folder of its own (e.g. features/NAME)")
    inside = enclosing_folder(p)
    if inside is not None:
        raise ConfigError(f"--out {p} is inside {inside[1]} ({inside[0]}); a store goes into a folder of its own "
                          "(e.g. features/NAME)")
    if not p.is_dir():
        return
    kind = folder_kind(p)
    if kind == "a feature store":
        return
    if kind is not None:
        raise ConfigError(f"--out {p} is {kind}; a store goes into a folder of its own (e.g. features/NAME)")
    others = sorted(e.name for e in os.scandir(p) if e.name not in _STORE_ENTRIES and not e.name.startswith("."))
    if others:
        raise ConfigError(f"--out {p} holds {len(others)} entr{'ies' if len(others) > 1 else 'y'} that are not a "
                          f"feature store's (e.g. {others[0]}); give a new folder, or an existing store to resume or "
                          "update it")
