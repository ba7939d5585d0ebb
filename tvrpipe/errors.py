"""Errors raised by tvrpipe.

Library code raises a :class:`TvrpipeError` subclass whose message says what went wrong and
what to do about it; the CLI prints that message as one line and exits with code 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


class TvrpipeError(Exception):
    """Base class of every error tvrpipe raises on purpose."""


class ConfigError(TvrpipeError):
    """An option, a spec or a configuration value is invalid."""


class ManifestError(TvrpipeError):
    """An annotation file or a manifest is missing, malformed or inconsistent."""


class VideoError(TvrpipeError):
    """A video cannot be written or read."""


class LockError(TvrpipeError):
    """Another process is writing the same feature store or run directory."""


class NonFiniteError(TvrpipeError):
    """A loss, a similarity score, a feature or a weight is NaN or infinite."""


class RunError(TvrpipeError):
    """A run directory is missing a file or holds a damaged one."""


class WorkerDiedError(TvrpipeError):
    """A process doing part of the work ended without returning (killed, out of memory, crashed)."""


class DownloadError(TvrpipeError):
    """Pretrained weights are not on this machine and their host does not answer (no network, a firewall)."""


class WriteError(TvrpipeError):
    """A file could not be written: a full disk, a read-only or unwritable folder, a quota."""


_FULL_DISK = ("No space left", "StorageFull", "os error 28", "Errno 28", "Disk quota exceeded", "os error 122",
              "file write failed")


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if any(s in text for s in _FULL_DISK):
        return "no space left on the device"
    return f"{type(e).__name__}: {text[:160]}"


@contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """``with writing(path):`` the one place where a failure to write ``path`` becomes a one-line
    :class:`WriteError` naming it: an ``OSError`` (ENOSPC, EROFS, EACCES, EDQUOT) or whatever a library
    raises instead (safetensors' ``SafetensorError``, torch.save's ``RuntimeError`` from its stream
    writer, zarr's and pyarrow's own errors). tvrpipe's own errors and Ctrl-C pass through.

    Example:
        >>> with writing("runs/x/metrics.json"):  # doctest: +SKIP
        ...     Path("runs/x/metrics.json").write_text("{}")
    """
    try:
        yield
    except TvrpipeError:
        raise
    except Exception as e:
        raise WriteError(f"{path}: cannot write it ({_why(e)}); make room on the disk or fix the folder's "
                         "permissions, then rerun the same command (what was finished is kept)") from e
