"""``key=value`` option parsing into typed dataclass fields (heads' ``--set``, the generator's
``--set``, ``tvrpipe sweep --set key=v1,v2``)."""

from __future__ import annotations

import json
import typing
from typing import Any

from tvrpipe.errors import ConfigError


def field_types(cls: type) -> dict[str, Any]:
    """``{field: type}`` of the dataclass ``cls`` (annotations resolved)."""
    return typing.get_type_hints(cls)


def parse_value(cls: type, key: str, raw: str, owner: str) -> Any:
    """``raw`` typed as the field ``key`` of the dataclass ``cls``: bool, int, float and str as
    such, anything else as JSON (e.g. ``null``, a list).

    Raises:
        ConfigError: ``key`` is not a field of ``cls`` (naming ``owner`` and the valid keys), or
            ``raw`` is not a value of its type.
    """
    hints = field_types(cls)
    if key not in hints:
        raise ConfigError(f"{owner}: unknown config key {key!r}; valid: {', '.join(sorted(hints))}")
    kind = hints[key]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        if kind in (int, float, str):
            return kind(raw)
        return json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"--set {key}={raw}: not a valid {getattr(kind, '__name__', kind)}") from e


def split_item(item: str) -> tuple[str, str]:
    """``"key=value"`` -> ``(key, value)``; raises :class:`ConfigError` on anything else."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    return key, raw


def parse_fields(cls: type, items: list[str], owner: str) -> dict[str, Any]:
    """``["key=value", ...]`` -> values typed by the dataclass ``cls``'s fields (unknown keys fail,
    naming ``owner``).

    Example:
        >>> from tvrpipe.training.fit import TrainConfig
        >>> parse_fields(TrainConfig, ["lr=0.001", "prefetch=false"], "train")
        {'lr': 0.001, 'prefetch': False}
    """
    out: dict[str, Any] = {}
    for item in items:
        key, raw = split_item(item)
        out[key] = parse_value(cls, key, raw, owner)
    return out
