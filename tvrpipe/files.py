"""Files written whole or not at all (a temporary file and a rename), their sha256, and the staged names
that a writer killed before its rename leaves behind."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tvrpipe.errors import WriteError, writing

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

STALE_AFTER_S = 3600.0  # a staged name lives for the seconds its writer takes to write and rename it
_STAGED = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<pid>\d+)")


def staged_name(name: str, pid: int | None = None, kind: str = "tmp") -> str:
    """The name under which process ``pid`` (default: this one) stages ``name`` before renaming it into place
    (``kind`` ``tmp``), or sets an old ``name`` aside while it replaces it (``old``): ``.NAME.tmp-PID``."""
    return f".{name}.{kind}-{os.getpid() if pid is None else pid}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (this process included: another of its threads may be
    writing; a staged name of a pid reused since is left to the age limit)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True


def remove_staged(folder: str | os.PathLike[str], names: Iterable[str] | None = None,
                  locked: bool = False) -> list[Path]:
    """Remove what writers killed before their rename (``kill -9``, a power cut, a lost node) left in
    ``folder``: the files and folders named by :func:`staged_name` (of ``names`` only, where given) whose
    process is gone or that are older than :data:`STALE_AFTER_S`; with ``locked`` (the caller holds the
    folder's lock, so nobody else writes there) every one. Another name is never touched, nor a live
    writer's; one that cannot be removed (a read-only folder) is left. Returns what was removed."""
    wanted = None if names is None else set(names)
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:  # no folder (yet), or none readable: nothing of ours to remove
        return []
    for p in entries:
        m = _STAGED.fullmatch(p.name)
        if m is None or (wanted is not None and m["name"] not in wanted):
            continue
        try:
            if not (locked or not pid_alive(int(m["pid"])) or time.time() - p.lstat().st_mtime > STALE_AFTER_S):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except FileNotFoundError:
            continue  # its own writer renamed or removed it meanwhile
        except OSError as e:
            log.debug("%s: left in place (%s)", p, e)
    if removed:
        log.info("removed %d staged file(s) of an interrupted write in %s: %s", len(removed), folder,
                 ", ".join(p.name for p in removed[:5]))
    return removed


def gb(n: float) -> str:
    """Bytes for messages and records, in decimal units: 3.44 TB, 1.23 GB, 45.6 MB, 7.8 kB, 512 bytes."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.{2 if unit in ('GB', 'TB') else 1}f} {unit}"
    return f"{int(n)} bytes"


DISK_SPARE = 2**30  # choice: a disk keeps a GiB free after what a command plans to write (logs, the OS's own writes)


def free_disk(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system ``path`` is (or would be created) on."""
    from tvrpipe.lock import nearest_existing

    return shutil.disk_usage(nearest_existing(path)).free


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read 16 MiB at a time (a CLIP checkpoint is never all in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


class NpyWriter:
    """A ``.npy`` file of ``shape`` and ``dtype`` filled in row order, a block at a time: ``writer[a:b] = block``
    with ``a`` the first row not yet written, as into an array. Written through the file rather than a memory
    map: the pages a map writes count in the process's resident memory until it is unmapped (a million
    videos' ProTA encodings are 53 GB), a file's writes only in the page cache, which the kernel writes back
    and reclaims. Used as a context manager, it checks on leaving that every row was written.
    """

    def __init__(self, path: str | os.PathLike[str], dtype: Any, shape: tuple[int, ...]):
        import numpy as np

        self.path, self.dtype, self.shape = Path(path), np.dtype(dtype), tuple(int(s) for s in shape)
        self.written = 0
        with writing(self.path):
            self._f = open(self.path, "wb")
            try:
                np.lib.format.write_array_header_1_0(self._f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                                "fortran_order": False, "shape": self.shape})
            except BaseException:
                self._f.close()
                raise

    def __len__(self) -> int:
        return self.shape[0]

    def __setitem__(self, key: slice, block: Any) -> None:
        import numpy as np

        start, stop, step = key.indices(self.shape[0]) if isinstance(key, slice) else (None, None, None)
        if start != self.written or step != 1:
            raise ValueError(f"{self.path.name}: rows are written in order; rows {key} given, row "
                             f"{self.written:,} is next")
        block = np.ascontiguousarray(block, dtype=self.dtype)
        if block.shape != (stop - start, *self.shape[1:]):
            raise ValueError(f"{self.path.name}: a block of shape {block.shape} for rows {start:,}-{stop - 1:,} "
                             f"of {self.shape}")
        with writing(self.path):
            self._f.write(memoryview(block.reshape(-1).view(np.uint8)))
        self.written = stop

    def close(self) -> None:
        with writing(self.path):
            self._f.close()

    def __enter__(self) -> NpyWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if exc[0] is None and self.written != self.shape[0]:
            raise ValueError(f"{self.path.name}: {self.written:,} of {self.shape[0]:,} rows written")


def _discard(tmp: Path) -> None:
    """Remove what a write that failed half-way (a full disk, Ctrl-C) left under a staged name: a file or a
    folder."""
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def special_file(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a folder (links followed): ``a device``,
    ``a pipe``, ``a socket``; None otherwise."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def atomic_write(path: Path, write: Callable[[Path], object], parents: bool = False) -> None:
    """Write ``path`` with ``write(tmp)`` under its staged name (:func:`staged_name`), then rename it into place:
    readers never see half a file. ``write`` may make a file or a folder at ``tmp``. ``parents``: create its
    missing folders first. A failure to write becomes a :class:`~tvrpipe.errors.WriteError` naming ``path``;
    tvrpipe's own errors, raised by ``write``, pass through.

    A symbolic link is written through (its target is replaced, the link kept); a path that is a device, a pipe
    or a socket is refused: a rename would put a regular file in its place (``/dev/null`` for every program).

    Example:
        >>> atomic_write(Path("out/emb.npy"), lambda tmp: np.save(tmp, emb), parents=True)  # doctest: +SKIP
    """
    if os.path.islink(path):
        path = Path(os.path.realpath(path))
    kind = special_file(path)
    if kind:
        raise WriteError(f"{path} is not a regular file ({kind}); write to a file name instead")
    if parents:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(staged_name(path.name))
    try:
        with writing(path):
            write(tmp)
            os.replace(tmp, path)
    finally:
        _discard(tmp)


def atomic_replace_folder(folder: Path, write: Callable[[Path], object]) -> None:
    """Replace the folder ``folder`` (or make it) by the one ``write(tmp)`` makes under its staged name: the old
    folder is set aside (:func:`staged_name` ``old``), the new one renamed into place, then the old one
    removed, so a reader finds either folder whole, never a mix (a search cache rebuilt while another search
    reads it). A failure becomes a :class:`~tvrpipe.errors.WriteError` naming ``folder``."""
    tmp = folder.with_name(staged_name(folder.name))
    old = folder.with_name(staged_name(folder.name, kind="old"))
    try:
        with writing(folder):
            _discard(tmp)
            write(tmp)
            if folder.exists():
                os.replace(folder, old)
            os.replace(tmp, folder)
    finally:
        _discard(tmp)
        _discard(old)


def atomic_write_all(folder: Path, writes: Iterable[tuple[str, Callable[[Path], object]]]) -> None:
    """Write several files of ``folder`` that belong together (a manifest's tables and its ``meta.json``):
    every one under its staged name first, then all renamed into place, so a failure before the renames
    leaves the folder's earlier files as they were. ``writes``: ``(name, write)`` pairs, as
    :func:`atomic_write`'s ``write``."""
    staged: list[tuple[Path, Path]] = []
    try:
        for name, write in writes:
            tmp = folder / staged_name(name)
            staged.append((tmp, folder / name))
            with writing(folder / name):
                write(tmp)
    except BaseException:
        for tmp, _ in staged:
            _discard(tmp)
        raise
    for tmp, final in staged:
        with writing(final):
            os.replace(tmp, final)


def move_into_place(staged: Path, final: Path) -> None:
    """The last step of a write staged and committed elsewhere (a run's checkpoint files once its state records
    their sha256, a store set aside whole before an update): rename ``staged`` to ``final``, replacing it. A
    failure becomes a :class:`~tvrpipe.errors.WriteError` naming ``final``. Every rename into place in tvrpipe
    is here or in the writers above (the layout test holds it)."""
    with writing(final):
        os.replace(staged, final)


def atomic_write_text(path: Path, text: str, parents: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_text(text), parents)


def atomic_write_parquet(df: pd.DataFrame, path: Path) -> None:
    """Write ``df`` as Parquet through a temporary file and a rename (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def shipped_folder(package: str, repository: str) -> Path:
    """A folder of data files that lives at the repository root (``repository``, e.g. ``manifests``) and
    ships inside the installed package as ``tvrpipe/<package>`` (pyproject's package-dir): the installed
    copy when there is one (a wheel), else the repository's (a checkout, an editable install)."""
    from importlib import resources

    packaged = resources.files("tvrpipe") / package
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[1] / repository
