"""Recipes: one paper's training protocol on one dataset, as data (``recipes/<name>.yaml``).

A recipe holds every setting of a ``finetune`` run (backbone, frames, words, sampling, optimiser,
learning rate per parameter group, schedule, batch, epochs, precision) and the head's config
overrides, each value with its source, plus the numbers the paper publishes for that row::

    paper: T-MASS (Wang et al., CVPR 2024)
    method: tmass
    dataset: msrvtt
    split_set: {value: 9k, source: "Sec. 4.1: 9k training videos, 1k-A test"}
    settings:
      batch_size: {value: 32, source: "Sec. 4.1: batch size 32"}
      group_lr: {value: {radius: 3.0e-5}, source: "Sec. 4.1: ..."}
      ...
    head:
      num_samples: {value: 20, source: "Sec. 4.1: M = 20"}
    published:
      source: "Table 1"
      backbone: ViT-B/32
      t2v: {R@1: 50.2, R@5: 75.3, R@10: 85.1, MdR: 1.0, MnR: 11.9}
      v2t: null

A source is a paper's section or table, the official code's file, or ``choice: ...`` where both
are silent. A recipe may also name how its run executes, where no paper does: ``chunk_size`` (pairs
CLIP encodes at a time, ``finetune --chunk-size``) lets a batch fit a smaller GPU and changes
nothing the run computes, so it is never among the settings a run differs in. ``finetune --recipe NAME`` and ``train-head --recipe NAME`` take every value an option
does not give explicitly (:func:`resolve`); the run records the recipe's name and hash beside the
resolved values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tvrpipe.config import load_yaml
from tvrpipe.errors import ConfigError
from tvrpipe.files import shipped_folder
from tvrpipe.rundir import METRICS

# Every setting a recipe holds, in the order `recipes show` prints them. Each is a FinetuneConfig
# field but for the two tvrpipe implements one way only, which a recipe records so that a reader sees
# the paper's value beside ours (docs/reproduce.md says where they differ).
SETTINGS = ("model", "pretrained", "end_to_end", "frames", "max_words", "frame_sampling", "epoch_pairs",
            "batch_size", "epochs", "optimizer", "clip_lr", "head_lr", "group_lr", "weight_decay",
            "warmup_fraction", "schedule", "grad_clip", "precision", "init_from_clip")
IMPLEMENTED = {
    "frame_sampling": ("uniform",),  # F segments of equal length: a random frame in each (training), its centre (evaluation)
    "schedule": ("cosine",),  # linear warmup over warmup_fraction of the steps, then cosine decay to 0
}
OPTION_SETTINGS = tuple(k for k in SETTINGS if k not in IMPLEMENTED)  # each a finetune option of the same name
# what a recipe may add: how the run executes, not what it computes (no paper gives it, a run records it, and it
# is no part of the experiment: never among the settings a run differs in)
EXECUTION_SETTINGS = ("chunk_size",)
# what train-head takes from a recipe (the rest belongs to the features, fixed when they were extracted)
TRAIN_HEAD = {"batch_size": "batch_size", "epochs": "epochs", "optimizer": "optimizer", "head_lr": "lr",
              "group_lr": "group_lr", "weight_decay": "weight_decay", "warmup_fraction": "warmup_fraction",
              "init_from_clip": "init_from_clip"}
DIRECTIONS = ("t2v", "v2t")

log = logging.getLogger(__name__)


def recipes_dir() -> Path:
    """Directory holding the recipe files (``recipes/`` at the repository root, ``tvrpipe/_recipes`` installed)."""
    return shipped_folder("_recipes", "recipes")


def list_recipes() -> list[str]:
    """Names of the shipped recipes (file stems)."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


@dataclass(frozen=True)
class Sourced:
    """A recipe value and where it comes from."""

    value: Any
    source: str


@dataclass(frozen=True)
class Published:
    """The numbers a paper publishes for a recipe's row: ``{direction: {metric: value or None}}``."""

    source: str
    backbone: str
    metrics: dict[str, dict[str, float | None]]
    note: str = ""


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe (see the module docstring for the file)."""

    name: str
    path: Path
    paper: str
    method: str
    dataset: str
    split_set: Sourced
    settings: dict[str, Sourced]
    head: dict[str, Sourced]
    published: Published | None
    sha256: str

    def values(self) -> dict[str, Any]:
        """``{setting: value}`` of every setting."""
        return {k: s.value for k, s in self.settings.items()}

    def head_overrides(self) -> dict[str, Any]:
        return {k: s.value for k, s in self.head.items()}

    def record(self, overridden: Iterable[str] = ()) -> dict[str, Any]:
        """What a run trained from this recipe records in its ``config.yaml``: the file (name, path, sha256),
        the settings the options overrode, and what the recipe said when the run started (its dataset,
        split set and settings, and the published row), so that the report compares the run with the recipe
        it trained from, not with whatever file bears that name later. The trainer adds how the run
        differs from the recipe (:func:`deviations`)."""
        pub = self.published
        return {"name": self.name, "path": str(self.path.resolve()), "sha256": self.sha256,
                "shipped": self.path.resolve().parent == recipes_dir().resolve(),  # or a file of the user's
                "overridden": sorted(overridden), "paper": self.paper, "method": self.method, "dataset": self.dataset,
                "split_set": self.split_set.value, "settings": self.values(), "head": self.head_overrides(),
                "published": None if pub is None else {"source": pub.source, "backbone": pub.backbone,
                                                       "note": pub.note, **pub.metrics}}


def _sourced(raw: Any, where: str) -> Sourced:
    if not isinstance(raw, Mapping) or set(raw) != {"value", "source"}:
        raise ConfigError(f"{where}: expected {{value: ..., source: \"...\"}}, got {raw!r}")
    source = raw["source"]
    if not isinstance(source, str) or not source.strip():
        raise ConfigError(f"{where}: the source must be a paper section or table, a code file or 'choice: ...'")
    return Sourced(raw["value"], source.strip())


def _typed(value: Any, kind: Any, where: str) -> Any:
    """``value`` as the type ``kind`` of a config field (an int where a float is asked is a float);
    YAML reads ``3e-5`` as a string (it wants ``3.0e-5``), which is refused here by name.

    Raises:
        ConfigError: ``value`` is not of that type.
    """
    args = typing.get_args(kind)
    if type(None) in args:
        if value is None:
            return None
        kind = next(a for a in args if a is not type(None))
    origin = typing.get_origin(kind)
    ok = True
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        ok = isinstance(value, str)
    elif origin is dict:
        ok = isinstance(value, Mapping)
        if ok:
            key_kind, value_kind = typing.get_args(kind)
            return {_typed(k, key_kind, where): _typed(v, value_kind, f"{where}.{k}") for k, v in value.items()}
    elif origin in (tuple, list):
        ok = isinstance(value, (list, tuple))
    if not ok:
        hint = " (YAML reads 3e-5 as text: write 3.0e-5)" if isinstance(value, str) and kind is float else ""
        raise ConfigError(f"{where}: {value!r} is not a {getattr(kind, '__name__', kind)}{hint}")
    return value


def _published(raw: Any, where: str) -> Published | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not {"source", "backbone", *DIRECTIONS} <= set(raw) or \
            set(raw) - {"source", "backbone", "note", *DIRECTIONS}:
        raise ConfigError(f"{where}: expected source, backbone, t2v, v2t (and an optional note)")
    metrics = {}
    for d in DIRECTIONS:
        row = raw[d]
        if row is None:
            continue
        if not isinstance(row, Mapping) or set(row) != set(METRICS):
            raise ConfigError(f"{where}.{d}: expected the metrics {', '.join(METRICS)} (null where not printed)")
        for m, v in row.items():
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise ConfigError(f"{where}.{d}.{m}: {v!r} is not a number")
            if v is not None and m.startswith("R@") and not 0 <= v <= 100:
                raise ConfigError(f"{where}.{d}.{m} {v} is not a recall in [0, 100]")
            if v is not None and not m.startswith("R@") and v < 1:  # MdR, MnR: the best rank is 1
                raise ConfigError(f"{where}.{d}.{m} {v} is not a rank >= 1")
        metrics[d] = {m: None if row[m] is None else float(row[m]) for m in METRICS}
    if not metrics:
        raise ConfigError(f"{where}: neither t2v nor v2t is given")
    return Published(str(raw["source"]), str(raw["backbone"]), metrics, str(raw.get("note") or ""))


def load_recipe(name: str | Path) -> Recipe:
    """The recipe ``name`` (a shipped recipe's name, or a path to a YAML file of the same form).

    Raises:
        ConfigError: unknown recipe, or a file that is not a complete recipe (naming the file and key).
    """
    from tvrpipe.heads.base import head_class, list_heads

    path = Path(name)
    if path.is_file() and path.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--recipe {name}: a recipe file is YAML ending in .yaml (`tvrpipe recipes show "
                          f"tmass-msrvtt` shows the form)")
    if not path.is_file():
        path = recipes_dir() / f"{name}.yaml"
        if not path.is_file():
            raise ConfigError(f"--recipe {name}: no such recipe; `tvrpipe recipes` lists them "
                              f"({', '.join(list_recipes())})")
    text = path.read_bytes()
    try:
        raw = load_yaml(text, path)  # a key given twice is refused, not last-wins
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    keys = {"paper", "method", "dataset", "split_set", "settings", "head", "published"}
    if not isinstance(raw, Mapping) or set(raw) != keys:
        got = set(raw) if isinstance(raw, Mapping) else set()
        raise ConfigError(f"{path}: a recipe has the keys {', '.join(sorted(keys))}"
                          + (f"; missing {', '.join(sorted(keys - got))}" if keys - got else "")
                          + (f"; unknown {', '.join(sorted(got - keys))}" if got - keys else ""))
    method = str(raw["method"])
    if method not in list_heads():
        raise ConfigError(f"{path}: method {method!r} is not a head ({', '.join(list_heads())})")
    settings_raw = raw["settings"] if isinstance(raw["settings"], Mapping) else {}
    missing = [k for k in SETTINGS if k not in settings_raw]
    unknown = sorted(set(settings_raw) - set(SETTINGS) - set(EXECUTION_SETTINGS))
    if missing or unknown:
        raise ConfigError(f"{path}: settings " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(unknown)}"] if unknown else [])))
    from tvrpipe.config import field_types
    from tvrpipe.training.finetune import FinetuneConfig

    types = field_types(FinetuneConfig)
    settings = {}
    for k in (*SETTINGS, *(k for k in EXECUTION_SETTINGS if k in settings_raw)):
        item = _sourced(settings_raw[k], f"{path}: settings.{k}")
        settings[k] = Sourced(_typed(item.value, types.get(k, str), f"{path}: settings.{k}"), item.source)
    for k, allowed in IMPLEMENTED.items():
        if settings[k].value not in allowed:
            raise ConfigError(f"{path}: settings.{k} {settings[k].value!r}: tvrpipe implements {', '.join(allowed)}")
    head_raw = raw["head"] or {}
    if not isinstance(head_raw, Mapping):
        raise ConfigError(f"{path}: head must map config fields to {{value, source}}")
    head_types = field_types(head_class(method).Config)
    bad = sorted(set(head_raw) - set(head_types))
    if bad:
        raise ConfigError(f"{path}: head.{bad[0]} is not a field of {method}'s config")
    head = {}
    for k, v in head_raw.items():
        item = _sourced(v, f"{path}: head.{k}")
        head[k] = Sourced(_typed(item.value, head_types[k], f"{path}: head.{k}"), item.source)
    recipe = Recipe(name=path.stem, path=path, paper=str(raw["paper"]), method=method, dataset=str(raw["dataset"]),
                    split_set=_sourced(raw["split_set"], f"{path}: split_set"), settings=settings, head=head,
                    published=_published(raw["published"], f"{path}: published"),
                    sha256=hashlib.sha256(text).hexdigest())
    try:  # every value within its option's range, as a run checks it (use_gpu: a recipe may ask for fp16)
        FinetuneConfig(**resolve(recipe, {})[0], use_gpu=True)
        head_config = head_class(method).Config(**recipe.head_overrides())
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    _check_data(recipe)
    _check_groups(recipe, head_config)
    return recipe


def _check_data(recipe: Recipe) -> None:
    """The recipe's dataset is a dataset spec and its split set one of that spec's, checked as the file
    loads (a run would otherwise fail later, naming no recipe).

    Raises:
        ConfigError: naming the file, the key and the values allowed.
    """
    from tvrpipe.data.datasets import list_datasets, load_spec

    if recipe.dataset not in list_datasets():
        raise ConfigError(f"{recipe.path}: dataset {recipe.dataset!r} is not a dataset tvrpipe knows "
                          f"({', '.join(list_datasets())})")
    # a dataset without split sets (synthetic) names its one split by itself, as its manifests record it
    allowed = list(load_spec(recipe.dataset).split_sets) or [recipe.dataset]
    split_set = recipe.split_set.value
    if split_set not in allowed:
        raise ConfigError(f"{recipe.path}: split_set {split_set!r} is not a split set of {recipe.dataset} "
                          f"({', '.join(allowed)})")


def _check_groups(recipe: Recipe, head_config) -> None:
    """Every group the recipe's ``group_lr`` names is one of its head's parameter groups (a small head is
    built for its group names, without touching the random stream).

    Raises:
        ConfigError: naming the file and the groups the head has.
    """
    import torch

    from tvrpipe.heads.base import head_class

    group_lr = recipe.settings["group_lr"].value or {}
    if not group_lr:
        return
    with torch.random.fork_rng(devices=[]):  # the groups' names do not depend on the width: a small head
        try:
            groups = head_class(recipe.method)(dataclasses.replace(head_config, embed_dim=64)).param_groups()
        except (ConfigError, TypeError, ValueError, RuntimeError):  # a config that needs its own width
            groups = head_class(recipe.method)(head_config).param_groups()
    unknown = sorted(set(group_lr) - set(groups))
    if unknown:
        raise ConfigError(f"{recipe.path}: settings.group_lr names {unknown[0]!r}, which is not a parameter group of "
                          f"{recipe.method} ({', '.join(groups)})")


# What makes a run the experiment a paper's row describes: the report prints that row beside a run only
# where all four agree with the recipe (a run that changed other settings shows it, naming them).
IDENTITY = ("dataset", "split_set", "model", "pretrained")


def _backbone(model: Any) -> str:
    """An architecture's name without open_clip's ``-quickgelu`` (the same weights under either name)."""
    text = str(model)
    return text[: -len("-quickgelu")] if text.endswith("-quickgelu") else text


def deviations(record: Mapping[str, Any], ran: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` (:meth:`Recipe.record`) completed with how the run differs from its recipe.

    Args:
        record: what the run records of its recipe.
        ran: what the run trained with, by recipe key: ``dataset``, ``split_set``, ``model`` and
            ``pretrained`` (of its store or manifest and CLIP), each setting it has (a trainer without
            a setting, e.g. train-head's ``clip_lr``, leaves it out), and ``head``: its head's config.

    Returns:
        The record with ``mismatch`` (the keys of :data:`IDENTITY` that differ, in words: the published row
        does not describe such a run; a warning says so) and ``differs`` ({setting: {"recipe": value, "run": value}}: the
        other settings that ran otherwise, overridden or fixed by the trainer).
    """
    wanted = {"dataset": record["dataset"], "split_set": record["split_set"],
              **{k: record["settings"].get(k) for k in ("model", "pretrained")}}
    mismatch = []
    for key in IDENTITY:
        want, have = wanted[key], ran.get(key)
        if (_backbone(want) != _backbone(have)) if key == "model" else want != have:
            mismatch.append(f"{key}: the recipe's {want}, this run's {have}")
    settings = record["settings"]
    differs = {k: {"recipe": settings[k], "run": v} for k, v in ran.items()
               if k not in IDENTITY and k in settings and k != "group_lr" and v != settings[k]}
    if "group_lr" in ran:  # by the rate each group trains at: a group given the head's rate differs in nothing
        want, have = settings["group_lr"] or {}, ran["group_lr"] or {}
        head_want, head_have = settings["head_lr"], ran.get("head_lr", settings["head_lr"])
        if any(want.get(g, head_want) != have.get(g, head_have) for g in {*want, *have}):
            differs["group_lr"] = {"recipe": want, "run": have}
    if ran.get("head"):  # the head's config against the recipe's (its values, else the head's defaults)
        from tvrpipe.heads.base import head_class

        defaults = {f.name: f.default for f in dataclasses.fields(head_class(record["method"]).Config)}
        given = record.get("head") or {}
        for k, v in ran["head"].items():
            want = given.get(k, defaults.get(k))
            if (k in given or f"head.{k}" in record["overridden"]) and v != want:
                differs[f"head.{k}"] = {"recipe": want, "run": v}
    # a copy of its own (YAML would write a value shared with the settings as an alias)
    record = json.loads(json.dumps({**record, "mismatch": mismatch, "differs": differs}))
    if (warning := mismatch_warning(record)) is not None:  # said as the run starts, not only in the report
        log.warning("%s", warning)
    return record


def mismatch_warning(record: Mapping[str, Any]) -> str | None:
    """The line a run prints when it is not the experiment its recipe's published row describes."""
    if not record.get("mismatch"):
        return None
    return (f"recipe {record['name']} is {record['dataset']} ({record['split_set']}) with "
            f"{record['settings'].get('model')} {record['settings'].get('pretrained')}, and this run differs ("
            + "; ".join(record["mismatch"]) + "): the report will not print the paper's published row beside it")


def resolve(recipe: Recipe, explicit: Mapping[str, Any], keys: Mapping[str, str] | None = None) -> tuple[dict, list[str]]:
    """The settings of a run from ``recipe``: each of ``keys`` ({recipe setting: option field}, default
    every setting under its own name) from the recipe, unless ``explicit`` (the options the user gave,
    by field) has it. ``group_lr`` merges per group, the explicit group winning.

    Returns:
        ``(values by field, the recipe settings the options overrode)``.
    """
    keys = keys or {k: k for k in (*OPTION_SETTINGS, *EXECUTION_SETTINGS)}
    values, overridden = {}, []
    for setting, option in keys.items():
        if setting not in recipe.settings:  # an execution setting the recipe does not name
            continue
        value = recipe.settings[setting].value
        if option in explicit:
            given = explicit[option]
            if setting == "group_lr":  # per group: the recipe's other groups keep their rates; a group given
                # the rate it has in the recipe anyway (its own, else the head's) overrides nothing
                head_lr = recipe.settings["head_lr"].value
                overridden += [f"group_lr.{g}" for g, lr in given.items() if value.get(g, head_lr) != lr]
                value = {**value, **given}
            else:
                if given != value:
                    overridden.append(setting)
                value = given
        values[option] = value
    return values, overridden


def finetune_config(recipe: Recipe, explicit: Mapping[str, Any]):
    """``(FinetuneConfig, overridden settings)`` of ``recipe`` with the ``explicit`` options on top
    (fields outside the recipe, e.g. ``use_gpu``, come from ``explicit`` or their defaults)."""
    from tvrpipe.training.finetune import FinetuneConfig

    values, overridden = resolve(recipe, explicit)
    return FinetuneConfig(**{**explicit, **values}), overridden


def apply(name: str | Path, method: str | None, explicit: Iterable[str], set_items: list[str], options: dict[str, Any],
          keys: Mapping[str, str] | None = None) -> tuple[Recipe, str, dict[str, Any], dict[str, Any]]:
    """The recipe ``name`` applied to a command's ``options`` ({field: value}, in place): every recipe setting of
    ``keys`` ({setting: option field}, default: finetune's) that is not among the ``explicit`` fields (those the
    user gave) takes the recipe's value; ``set_items`` (``--set key=value``) win over the recipe's head config.

    Returns:
        ``(recipe, method, head overrides, what the run records of the recipe)`` (:meth:`Recipe.record`).

    Raises:
        ConfigError: ``method`` names another head than the recipe's; an unknown recipe or head field.
    """
    from tvrpipe.config import parse_fields
    from tvrpipe.heads.base import head_class

    r = load_recipe(name)
    if method is not None and method != r.method:
        raise ConfigError(f"--method {method}: recipe {r.name} trains {r.method}; leave --method out")
    given = set(explicit)
    values, overridden = resolve(r, {k: v for k, v in options.items() if k in given}, keys)
    options.update(values)
    explicit_head = parse_fields(head_class(r.method).Config, set_items, r.method)
    # against what the recipe's head would be: its own value of a field, else the head's default
    defaults = {f.name: f.default for f in dataclasses.fields(head_class(r.method).Config)}
    overridden += [f"head.{k}" for k, v in explicit_head.items()
                   if v != (r.head[k].value if k in r.head else defaults.get(k))]
    return r, r.method, {**r.head_overrides(), **explicit_head}, r.record(overridden)
