"""Errors raised by tvrpipe.

Library code raises a :class:`TvrpipeError` subclass whose message says what went wrong and
what to do about it; the CLI prints that message as one line and exits with code 1.
"""

from __future__ import annotations


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
