"""Configs that check themselves, and ``key=value`` option parsing into their typed fields (heads'
``--set``, the generator's ``--set``, ``tvrpipe sweep --set key=v1,v2``).

A config field declares what it accepts where it is defined::

    num_samples: int = at_least(1, 20)          # an int >= 1, default 20
    dropout: float = within(0.0, 1.0, 0.3, below=True)  # 0 <= dropout < 1
    radius: str = one_of(("linear", "scalar"), "linear")

and the dataclass's ``__post_init__`` calls :func:`check_fields`, which refuses NaN everywhere, an
infinity unless the field allows it, and any value outside the field's declared range, with one
message form: ``<owner>: <field> must be >= 1, got 0`` (or the CLI option, ``--batch-size must be
>= 2, got 1``, where the field names one).

User-written YAML (recipes, dataset specs) is read with :func:`load_yaml`, which refuses a key given
twice in one mapping (plain ``yaml.safe_load`` keeps the last one silently).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from tvrpipe.errors import ConfigError

# a dataclass field whose metadata holds this key (True) may be infinite (e.g. a softmax temperature,
# where inf is the hard max); NaN is never a value of any field
INFINITE_OK = "infinite_ok"
ALLOWS_INFINITY = {INFINITE_OK: True}  # ``dataclasses.field(default=..., metadata=ALLOWS_INFINITY)``


RULE = "rule"  # metadata key of a field's declared range (at_least, above, within, one_of)


def _field(default: Any, rule: tuple, option: str | None, why: str, infinite: bool) -> Any:
    meta = {RULE: rule, "option": option, "why": why, **(ALLOWS_INFINITY if infinite else {})}
    return dataclasses.field(default=default, metadata=meta)


def at_least(low: float, default: Any, *, option: str | None = None, why: str = "", infinite: bool = False) -> Any:
    """A field whose value is >= ``low`` (None passes: an optional field left unset)."""
    return _field(default, ("at_least", low), option, why, infinite)


def above(low: float, default: Any, *, option: str | None = None, why: str = "", infinite: bool = False) -> Any:
    """A field whose value is > ``low``."""
    return _field(default, ("above", low), option, why, infinite)


def within(low: float, high: float, default: Any, *, below: bool = False, option: str | None = None,
           why: str = "") -> Any:
    """A field whose value is between ``low`` and ``high`` (``below``: strictly under ``high``)."""
    return _field(default, ("within", low, high, below), option, why, False)


def one_of(choices: tuple[str, ...], default: str, *, option: str | None = None, why: str = "") -> Any:
    """A field whose value is one of ``choices``."""
    return _field(default, ("one_of", tuple(choices)), option, why, False)


def _broken(rule: tuple, v: Any) -> str | None:
    """What ``v`` violates of ``rule`` (None: it conforms)."""
    kind = rule[0]
    if kind == "one_of":
        return None if v in rule[1] else f"must be one of {', '.join(rule[1])}, got {v!r}"
    if kind == "at_least":
        return None if v >= rule[1] else f"must be >= {rule[1]:g}, got {v}"
    if kind == "above":
        return None if v > rule[1] else f"must be > {rule[1]:g}, got {v}"
    low, high, below = rule[1:]
    if below:
        return None if low <= v < high else f"must be in [{low:g}, {high:g}), got {v}"
    return None if low <= v <= high else f"must be between {low:g} and {high:g}, got {v}"


def check_fields(config: Any, owner: str) -> None:
    """Check every field of the dataclass instance ``config``: no NaN, no infinity unless the field
    allows it, and the range the field declares (:func:`at_least`, :func:`above`, :func:`within`,
    :func:`one_of`). Messages name the field's CLI option where it has one, else ``owner: field``.

    Raises:
        ConfigError: the first field that fails.
    """
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        name = f.metadata.get("option") or f"{owner}: {f.name}"
        check_finite(v, f"{owner}.{f.name}={v!r}" if not f.metadata.get("option") else f"{name}={v!r}",
                     bool(f.metadata.get(INFINITE_OK)))
        rule = f.metadata.get(RULE)
        if rule is None or v is None:
            continue
        problem = _broken(rule, v)
        if problem:
            why = f.metadata.get("why")
            raise ConfigError(f"{name} {problem}{f' ({why})' if why else ''}")


def infinite_ok(cls: type, key: str) -> bool:
    """Whether the field ``key`` of the dataclass ``cls`` takes infinity as a value (its metadata says so)."""
    return any(f.name == key and f.metadata.get(INFINITE_OK) for f in dataclasses.fields(cls))


def check_finite(value: Any, what: str, inf_ok: bool = False) -> None:
    """Refuse NaN anywhere in ``value`` (a number, or a list or dict of them), and infinities unless
    ``inf_ok``: NaN passes every range check (``nan > 0`` and ``nan < 0`` are both False) and then
    silently turns a term off or a run into NaNs.

    Raises:
        ConfigError: naming ``what`` (e.g. ``--set alpha=nan``).
    """
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not inf_ok):
            allowed = "NaN is not a value" if inf_ok else "it must be a finite number (not NaN or an infinity)"
            raise ConfigError(f"{what}: {allowed}")
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_finite(v, what, inf_ok)
    elif isinstance(value, dict):
        for v in value.values():
            check_finite(v, what, inf_ok)


def field_types(cls: type) -> dict[str, Any]:
    """``{field: type}`` of the dataclass ``cls`` (annotations resolved): its fields only, not its class
    variables (a head's ``owner``), which no option sets."""
    hints = typing.get_type_hints(cls)
    if not dataclasses.is_dataclass(cls):
        return hints
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(kind: Any) -> str:
    """A field's type as a message says it: ``float``, ``int or none``, ``list``."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if len(typing.get_args(kind)) == 2 and len(args) == 1:
        return f"{type_name(args[0])} or none"
    origin = typing.get_origin(kind)
    return getattr(origin or kind, "__name__", str(kind))


def parse_value(cls: type, key: str, raw: str, owner: str, option: str = "--set", shown: str | None = None) -> Any:
    """``raw`` typed as the field ``key`` of the dataclass ``cls``: bool, int, float and str as
    such (an optional number also takes ``none`` or ``null``), anything else as JSON (e.g. a list).
    NaN is refused everywhere, an infinity unless the field's metadata allows it (:data:`INFINITE_OK`).

    Raises:
        ConfigError: ``key`` is not a field of ``cls`` (naming ``owner`` and the valid keys), or
            ``raw`` is not a value of its type, or not finite (naming ``option``, the option the user typed,
            and ``shown``, the key as typed: ``train.lr`` in a sweep; default ``key``).
    """
    shown = key if shown is None else shown
    hints = field_types(cls)
    if key not in hints:
        raise ConfigError(f"{owner}: unknown config key {key!r}; valid: {', '.join(sorted(hints))}")
    kind = hints[key]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(kind)) == 2 and args[0] in (int, float):  # e.g. float | None
            value = None if raw.strip().lower() in ("none", "null") else args[0](raw)
        else:
            value = kind(raw) if kind in (int, float, str) else json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"{option} {shown}={raw}: not a valid {type_name(kind)}") from e
    check_finite(value, f"{option} {shown}={raw}", infinite_ok(cls, key) if dataclasses.is_dataclass(cls) else False)
    return value


def split_item(item: str, option: str = "--set") -> tuple[str, str]:
    """``"key=value"`` -> ``(key, value)``; raises :class:`ConfigError` naming ``option`` on anything else."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{option} expects key=value, got {item!r}")
    return key, raw


def parse_fields(cls: type, items: list[str], owner: str, option: str = "--set") -> dict[str, Any]:
    """``["key=value", ...]`` -> values typed by the dataclass ``cls``'s fields (unknown keys fail,
    naming ``owner``; a malformed item or value names ``option``, the option the user typed).

    Example:
        >>> from tvrpipe.training.fit import TrainConfig
        >>> parse_fields(TrainConfig, ["lr=0.001", "prefetch=false"], "train")
        {'lr': 0.001, 'prefetch': False}
    """
    out: dict[str, Any] = {}
    for item in items:
        key, raw = split_item(item, option)
        if key in out:  # the last one would win silently
            raise ConfigError(f"{option} {key} is given twice ({key}={out[key]!r} and {item}); give each field once")
        out[key] = parse_value(cls, key, raw, owner, option)
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` whose mappings refuse a key given twice (its own keys: a key a ``<<`` merge
    brings in may still be overridden, as YAML intends)."""

    def __init__(self, stream: Any, path: str | Path) -> None:
        super().__init__(stream)
        self.path = path

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    twice = key in seen
                except TypeError:  # an unhashable key: SafeLoader refuses it below, as YAML
                    continue
                if twice:
                    raise ConfigError(f"{self.path} line {key_node.start_mark.line + 1}: key {key!r} is given "
                                      "twice; keep one")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str | bytes, path: str | Path) -> Any:
    """``text`` (the contents of the user-written YAML file ``path``) parsed as ``yaml.safe_load`` does,
    except that a key given twice in one mapping is refused rather than the last one kept silently.

    Raises:
        ConfigError: a key given twice, naming ``path``, the key and the line of its second use.
        yaml.YAMLError: ``text`` is not valid YAML (the caller names the file).

    Example:
        >>> load_yaml("a: 1\\nb: 2\\n", "x.yaml")
        {'a': 1, 'b': 2}
        >>> load_yaml("a: 1\\na: 2\\n", "x.yaml")
        Traceback (most recent call last):
        tvrpipe.errors.ConfigError: x.yaml line 2: key 'a' is given twice; keep one
    """
    loader = _UniqueKeyLoader(text, path)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


_UNITS = {"": 2**30, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9,
          "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_memory(text: str, option: str = "--gpu-memory") -> int:
    """``24GiB``, ``24GB``, ``40 GiB``, ``81559MiB`` (a bare number is GiB) -> bytes.

    Raises:
        ConfigError: not a size, or not above 0, naming ``option``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{option} {text!r}: give a size above 0 such as 24GiB, 40GB or 81559MiB (a bare number "
                          "is GiB)")
    return int(float(m.group(1)) * _UNITS[unit])
