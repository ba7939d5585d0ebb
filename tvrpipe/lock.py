"""One writer at a time: an advisory lock on the directory a command writes.

The lock is ``flock`` on ``<dir>/.tvrpipe.lock``. It belongs to the open file, so the kernel
drops it when the holder exits, however it exits (Ctrl-C, SIGKILL, out of memory, a lost job):
a crashed writer never leaves a stuck lock, and there is nothing to clean up by hand. The file's
text names the holder (pid, host, start time, command) for the message a second writer gets.
Linux emulates ``flock`` with POSIX record locks on NFS, so the lock also holds between the nodes
of a cluster that share the filesystem.

Writers that take it: :class:`~tvrpipe.features.store.StoreWriter` (``tvrpipe extract`` and
generated stores) and the training run directory (``tvrpipe train-head``, ``tvrpipe evaluate``).
``tvrpipe bench convergence`` waits for its stores' locks instead of being refused (``wait=True``),
and holds its own directory's lock only while it rereads and rewrites its tables.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tvrpipe.errors import ConfigError, LockError

LOCK_NAME = ".tvrpipe.lock"

log = logging.getLogger(__name__)


def _holder() -> str:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python"
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"pid {os.getpid()} on {socket.gethostname()} since {started} ({command[:200]})"


def _new_dirs(path: Path) -> list[Path]:
    """The directories ``path.mkdir(parents=True)`` would create, deepest first."""
    out: list[Path] = []
    p = path.absolute()
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


class DirLock:
    """An exclusive lock on ``directory`` (created if needed), held until :meth:`release`.

    Args:
        directory: the directory about to be written.
        option: the option that named it (``--out``), for messages.
        wait: if another process holds the lock, log who and block until it is released (Ctrl-C
            still interrupts), instead of raising :class:`LockError`.

    Raises:
        LockError: another live process holds the lock (and not ``wait``); the message names it.
        ConfigError: the directory cannot be created or written.
    """

    def __init__(self, directory: str | os.PathLike[str], option: str = "--out", wait: bool = False) -> None:
        self.dir, self.option = Path(directory), option
        self._fd = -1
        self._created = _new_dirs(self.dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._remove_created()
            raise ConfigError(
                f"{option} {self.dir}: cannot write there ({e.strerror}); choose a writable directory"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "another process"
            if not wait:
                os.close(self._fd)
                self._fd = -1
                raise LockError(
                    f"{self.dir} is being written by {holder}; wait for it to finish or choose another {option}"
                ) from None
            log.warning("%s is being written by %s; waiting for it to finish", self.dir, holder)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:  # Ctrl-C while waiting
                os.close(self._fd)
                self._fd = -1
                raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, _holder().encode(), 0)

    def release(self) -> None:
        """Unlock; a directory this lock created and nothing else wrote to is removed again."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, 0)
            if self._created and [p.name for p in self.dir.iterdir()] == [LOCK_NAME]:
                (self.dir / LOCK_NAME).unlink()  # still holding the lock: nobody else is inside
                self._remove_created()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def _remove_created(self) -> None:
        for p in self._created:  # deepest first; stops at the first one something else wrote into
            try:
                p.rmdir()
            except OSError:
                return

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.release()


def lock_holder(directory: str | os.PathLike[str]) -> str | None:
    """Who holds ``directory``'s lock (the holder's own line: pid, host, start time, command), or None when
    nobody does. Creates and writes nothing: the lock file is opened read-only (a reader's or a dry run's
    check)."""
    try:
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDONLY)
    except OSError:  # no lock file (or none readable): nobody holds it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # closing drops the shared lock, if taken
    return None


def check_unlocked(directory: str | os.PathLike[str], option: str = "--out") -> None:
    """Raise :class:`LockError` if another process holds ``directory``'s lock, as :class:`DirLock` would,
    without creating or writing anything (a dry run's check)."""
    holder = lock_holder(directory)
    if holder is not None:
        raise LockError(f"{Path(directory)} is being written by {holder}; wait for it to finish or choose another "
                        f"{option}")


@contextmanager
def locked(directory: str | os.PathLike[str], option: str = "--out") -> Iterator[Path]:
    """``with locked(run_dir):`` hold :class:`DirLock` on ``run_dir`` for the block."""
    lock = DirLock(directory, option)
    try:
        yield lock.dir
    finally:
        lock.release()


def nearest_existing(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute, or its nearest ancestor that exists: where it would be created."""
    ancestor = Path(path).absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    return ancestor


def check_writable(path: str | os.PathLike[str], option: str = "--out") -> None:
    """Raise :class:`ConfigError` if the directory ``path`` could not be created or written.

    Tried for real, and nothing is left: the folders missing on the way are made, a hidden file is created in
    ``path`` and removed, then the folders made are removed again. A permission check alone passes where
    writing fails: root passes every one, on a read-only file system or under ``/proc`` too.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {p}: is a file, not a directory")
    ancestor = nearest_existing(p)
    if not ancestor.is_dir():
        raise ConfigError(f"{option} {p}: {ancestor} is a file, so the directory cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {p}: cannot write there ({ancestor} is not writable); choose a writable directory")
    made: list[Path] = []
    try:
        for folder in reversed([q for q in (p.absolute(), *p.absolute().parents) if q not in ancestor.parents
                                and q != ancestor]):
            folder.mkdir()
            made.append(folder)
        fd, probe = tempfile.mkstemp(prefix=".tvrpipe-write-check-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{option} {p}: cannot write there ({e.filename or p}: {e.strerror or e}); choose a "
                          "writable directory") from None
    finally:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
