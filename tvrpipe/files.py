"""Files written whole or not at all (a temporary file and a rename), and their sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tvrpipe.errors import writing

if TYPE_CHECKING:
    import pandas as pd


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read 16 MiB at a time (a CLIP checkpoint is never all in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str, parents: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers never see half a file.
    ``parents``: create its missing folders first."""
    if parents:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):
            tmp.write_text(text)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a write that failed half-way (a full disk) leaves nothing


def atomic_write_parquet(df: pd.DataFrame, path: Path) -> None:
    """Write ``df`` as Parquet through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):
            df.to_parquet(tmp, index=False)
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shipped_folder(package: str, repository: str) -> Path:
    """A folder of data files that lives at the repository root (``repository``, e.g. ``manifests``) and
    ships inside the installed package as ``tvrpipe/<package>`` (pyproject's package-dir): the installed
    copy when there is one (a wheel), else the repository's (a checkout, an editable install)."""
    from importlib import resources

    packaged = resources.files("tvrpipe") / package
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[1] / repository
