"""How a decode fails: :class:`DecodeFailure` and its one-line messages, the checks of the file and of
``--timeout`` made before any reader runs."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from tvrpipe.errors import ConfigError, VideoError

MAX_TIMEOUT_S = 2_000_000  # --timeout's limit: the decoder process is waited for in milliseconds, a C int
_DETAIL_MAX_CHARS = 600


def check_timeout(seconds: float) -> None:
    """``--timeout`` (extract's and finetune's per-video decode limit): > 0 and at most MAX_TIMEOUT_S.

    Raises:
        ConfigError: outside those bounds (an infinity included, NaN too).
    """
    if not 0 < seconds <= MAX_TIMEOUT_S:  # the decoder waits in whole milliseconds (a C int)
        raise ConfigError(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:,} seconds (23 days), got {seconds}")


class DecodeFailure(VideoError):
    """A video could not be decoded; ``kind`` says why, in a machine-readable word.

    Kinds: ``"missing"`` (no such file), ``"empty"`` (zero bytes), ``"unreadable"`` (neither
    reader could open or decode it, or the decoder process died), ``"no_frames"`` (it opens but
    has no decodable video frame, or none inside the clip range), ``"timeout"`` (the decoder
    process was killed after the per-video timeout).

    Args:
        kind: One of :attr:`KINDS`.
        path: The video file.
        detail: What went wrong (made one line).

    Example:
        >>> err = DecodeFailure("empty", "v.mp4", "the file has zero bytes")
        >>> err.kind, str(err)
        ('empty', 'cannot decode v.mp4 (empty): the file has zero bytes')
    """

    KINDS = ("missing", "empty", "unreadable", "no_frames", "timeout")

    def __init__(self, kind: str, path: str | os.PathLike[str], detail: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"unknown DecodeFailure kind {kind!r}; expected one of {self.KINDS}")
        self.kind = kind
        self.path = str(path)
        self.detail = _one_line(detail)
        super().__init__(f"cannot decode {self.path} ({kind}): {self.detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle their args by default; ours has a different __init__ signature.
        return (type(self), (self.kind, self.path, self.detail))


def check_file(path: Path) -> None:
    try:
        info = path.stat()
    except FileNotFoundError:
        raise DecodeFailure("missing", path, "no such file") from None
    except OSError as exc:
        raise DecodeFailure("unreadable", path, f"cannot stat it: {exc}") from None
    if stat.S_ISDIR(info.st_mode):
        raise DecodeFailure("unreadable", path, "it is a directory, not a video file")
    # Only regular files have a meaningful size (a FIFO or device reports 0).
    if stat.S_ISREG(info.st_mode) and info.st_size == 0:
        raise DecodeFailure("empty", path, "the file has zero bytes")


_DMLC_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+?:\d+: ")


def describe(exc: BaseException) -> str:
    """One line: the exception type and the first line of its message, minus decord's
    '[hh:mm:ss] /path/file.cc:123: ' prefixes and stack trace."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = _DMLC_PREFIX.sub("", lines[0]) if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _DETAIL_MAX_CHARS else text[: _DETAIL_MAX_CHARS - 3] + "..."
