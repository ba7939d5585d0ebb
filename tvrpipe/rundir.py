"""A run directory: the one module that reads and writes it, and the typed schema of its results.

Layout (``tvrpipe train-head``, ``tvrpipe finetune`` and every sweep run)::

    runs/<name>/
      config.yaml        the resolved configuration, with the versions the run ran with
      metrics.json       the results (:class:`RunResults`): selected epoch, validation and test scores
      epochs.csv         one row per epoch: losses, validation metrics and readouts, lr, throughput
      checkpoints/       best.safetensors (the selected head), last.safetensors, state.pt (resume);
                         finetune adds clip_best / clip_last.safetensors
      plots/             loss.png, val_r1.png, readouts.png (heads that log readouts)
      eval_<split>.json  ``tvrpipe evaluate``'s scores (:class:`Scores`)
      failures.csv       finetune: videos that failed to decode
      clip.safetensors   finetune --end-to-end: the selected CLIP, for ``tvrpipe extract --pretrained``

Scores are keyed ``t2v`` / ``v2t`` (raw) and ``t2v_<variant>`` / ``v2t_<variant>`` for each
post-processing (:data:`POST_PROCESSINGS`) and a head's own re-ranking (``rerank``);
:meth:`Scores.columns` and :meth:`RunResults.columns` are the one flattening of them into table columns.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import shutil
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tvrpipe.errors import NonFiniteError, RunError, TvrpipeError
from tvrpipe.files import atomic_write, atomic_write_text, file_sha256, move_into_place, remove_staged

if TYPE_CHECKING:
    import torch

    from tvrpipe.heads.base import Head

CONFIG = "config.yaml"
METRICS_FILE = "metrics.json"
EPOCHS = "epochs.csv"
TEST_RANKS = "test_ranks.npz"  # each test query's raw rank: the report's error bars and paired tests
CHECKPOINTS = "checkpoints"
BEST = "best.safetensors"
LAST = "last.safetensors"
PLOTS = "plots"

METRICS = ("R@1", "R@5", "R@10", "MdR", "MnR")
DIRECTIONS = ("t2v", "v2t")
POST_PROCESSINGS = ("dsl", "qbnorm")  # what --post accepts (evaluation/post.py)
# every score variant a run can report, in the order tables show them ("rerank": Head.rerank)
SCORE_VARIANTS = ("raw", *POST_PROCESSINGS, "rerank")
SELECTION = "validation t2v (R@1, R@5, R@10)"


def score_key(variant: str, direction: str) -> str:
    """The key of a score variant in an evaluation's dict: ``t2v`` (raw), ``t2v_dsl``, ..."""
    return direction if variant == "raw" else f"{direction}_{variant}"


def ordered_variants(found: set[str]) -> list[str]:
    """Score variants in the order tables show them: :data:`SCORE_VARIANTS`, then any other by name."""
    return [v for v in SCORE_VARIANTS if v in found] + sorted(found - set(SCORE_VARIANTS))


@dataclass(frozen=True)
class Scores:
    """One evaluation (``metrics.json``'s ``val`` and ``test``, ``eval_<split>.json``): retrieval metrics
    per score variant and direction, the head's readouts, and the sizes of the split.

    Attributes:
        metrics: ``{score key: {"R@1": ..., "R@5", "R@10", "MdR", "MnR"}}`` (:func:`score_key`).
        readouts: the head's mean uncertainty readouts, ``{name: value}`` or ``{name: {kind: value}}``.
        n_texts, n_videos: the queries and videos scored.
        dsl_not_applicable: why the head reports no DSL, if it says so.
    """

    metrics: dict[str, dict[str, float]]
    readouts: dict[str, Any]
    n_texts: int | None = None
    n_videos: int | None = None
    dsl_not_applicable: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Scores:
        """Read an evaluation's dict (what :func:`tvrpipe.evaluation.engine.evaluate_head` returns); keys
        that are not scores (``sim``, ``split``) are left out."""
        metrics = {k: dict(v) for k, v in d.items()
                   if isinstance(v, Mapping) and k.split("_", 1)[0] in DIRECTIONS and "R@1" in v}
        return cls(metrics, dict(d.get("readouts") or {}), d.get("n_texts"), d.get("n_videos"),
                   d.get("dsl_not_applicable"))

    def get(self, variant: str = "raw", direction: str = "t2v") -> dict[str, float] | None:
        """The metrics of one score variant and direction (None when not reported)."""
        return self.metrics.get(score_key(variant, direction))

    def variants(self) -> list[str]:
        """The score variants reported, in table order (:func:`ordered_variants`)."""
        return ordered_variants({k.split("_", 1)[1] if "_" in k else "raw" for k in self.metrics})

    def selection_key(self) -> tuple[float, float, float]:
        """What selects the epoch: t2v (R@1, R@5, R@10), compared in that order."""
        t = self.metrics["t2v"]
        return (t["R@1"], t["R@5"], t["R@10"])

    def columns(self, variant: str | None = None, prefix: str = "") -> dict[str, float]:
        """Flat table columns. Every variant: ``{prefix}t2v R@1``, ``{prefix}t2v_dsl R@1``, ... ; one
        ``variant``: its metrics under the raw names (``{prefix}t2v R@1``, ...)."""
        keys = sorted(self.metrics) if variant is None else \
            [score_key(variant, d) for d in DIRECTIONS if score_key(variant, d) in self.metrics]
        out = {}
        for key in keys:
            name = key if variant is None else key.split("_", 1)[0]
            out.update({f"{prefix}{name} {m}": self.metrics[key][m] for m in METRICS if m in self.metrics[key]})
        return out

    def readout_columns(self, prefix: str = "val_") -> dict[str, float]:
        """``{prefix}<name>`` for item readouts, ``{prefix}<name>_<kind>`` for pair and query readouts
        (``epochs.csv``'s readout columns)."""
        flat = {}
        for name, r in self.readouts.items():
            flat.update({f"{prefix}{name}_{kind}": v for kind, v in r.items()} if isinstance(r, dict)
                        else {f"{prefix}{name}": r})
        return flat

    def readout_groups(self) -> dict[str, list[str]]:
        """``{readout: [kinds]}`` (``[""]`` for a single value): what ``readouts.png`` draws."""
        return {name: list(r) if isinstance(r, dict) else [""] for name, r in self.readouts.items()}


@dataclass(frozen=True)
class RunResults:
    """A finished run's ``metrics.json``, typed: the selected epoch and its validation scores, the test
    scores of that epoch, and how the run went (``raw`` keeps the whole file: schedule, throughput,
    provenance and export of a finetune run)."""

    method: str
    selected_epoch: int
    val: Scores
    test: Scores
    epochs_run: int | None
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, m: Mapping[str, Any]) -> RunResults:
        epochs_run = (m.get("schedule") or {}).get("epochs_run", (m.get("train") or {}).get("epochs_run"))
        return cls(str(m.get("method")), m.get("selected_epoch"), Scores.from_dict(m.get("val") or {}),
                   Scores.from_dict(m.get("test") or {}), epochs_run, dict(m))

    def columns(self) -> dict[str, Any]:
        """One row of a results table: the selected epoch, epochs run, validation t2v R@1 and every
        test score (``t2v R@1``, ``t2v_dsl R@1``, ...)."""
        val = self.val.get("raw", "t2v") or {}
        return {"selected_epoch": self.selected_epoch, "epochs_run": self.epochs_run,
                "val t2v R@1": val.get("R@1"), **self.test.columns()}


# ---------------------------------------------------------------------------------------------- files


def write_test_ranks(run: Path, ranks: Mapping[str, Any], caption_ids: Any, video_ids: Any) -> None:
    """Write ``test_ranks.npz``: the raw rank of each test query (``ranks``: ``{"t2v", "v2t"}``, in the split's
    caption and video order) and the ids of those captions and videos, so that two runs are compared query by
    query only where they ranked the same queries. Through a temporary file and a rename."""
    import numpy as np

    arrays = {"t2v": np.asarray(ranks["t2v"], dtype=np.int32), "v2t": np.asarray(ranks["v2t"], dtype=np.int32),
              "caption_ids": np.asarray(caption_ids, dtype=str), "video_ids": np.asarray(video_ids, dtype=str)}

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object: savez would append ".npz" to a staged name
            np.savez(f, **arrays)

    atomic_write(Path(run) / TEST_RANKS, write)


def read_test_ranks(run: Path) -> dict[str, Any] | None:
    """A run's ``test_ranks.npz`` as ``{"t2v", "v2t", "caption_ids", "video_ids"}`` arrays, or None: a run
    that predates it, or a file that does not read (the report then leaves the run's error bars out)."""
    import numpy as np

    try:
        with np.load(Path(run) / TEST_RANKS, allow_pickle=False) as f:
            return {k: f[k] for k in ("t2v", "v2t", "caption_ids", "video_ids")}
    except (OSError, ValueError, KeyError):
        return None


def check_checkpoint_sha(run: Path, metrics: dict) -> None:
    """The run's selected checkpoint is the one its training recorded in ``metrics.json`` (where it did).

    Raises:
        RunError: the file's sha256 differs (damaged or replaced).
    """
    best_path = run / CHECKPOINTS / BEST
    checkpoint = metrics.get("checkpoint")
    want = checkpoint.get("sha256") if isinstance(checkpoint, dict) else None
    if want and best_path.is_file() and file_sha256(best_path) != want:
        raise RunError(f"{best_path} does not match the sha256 recorded in {run / 'metrics.json'}: the "
                       "checkpoint is damaged or was replaced; delete the run directory and train it again")


def read_metrics(run: Path) -> dict | None:
    """A run's ``metrics.json`` (None before training finished).

    Raises:
        RunError: the file is not JSON.
    """
    path = Path(run) / METRICS_FILE
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise RunError(f"{path} is damaged (not JSON); delete the run directory and train it again") from None
    return metrics if isinstance(metrics, dict) else None


def read_results(run: Path) -> RunResults | None:
    """A finished run's results (None before training finished)."""
    metrics = read_metrics(run)
    return None if metrics is None else RunResults.from_dict(metrics)


def write_metrics(run: Path, metrics: Mapping[str, Any], name: str = METRICS_FILE) -> None:
    """Write ``metrics.json`` (or ``eval_<split>.json`` by ``name``) atomically."""
    atomic_write_text(Path(run) / name, json.dumps(metrics, indent=2))


def write_config(run: Path, config: Mapping[str, Any]) -> None:
    """Write ``config.yaml`` atomically, in the order of ``config``."""
    atomic_write_text(Path(run) / CONFIG, yaml.safe_dump(dict(config), sort_keys=False))


def save_weights(state_dict: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str],
                 what: str) -> str:
    """Write ``state_dict`` to ``path`` as safetensors, through a temporary file and a rename;
    returns the file's sha256.

    The bytes depend only on the tensors and ``metadata``: safetensors writes the metadata keys in
    an order that changes from process to process (a Rust HashMap), so the header is rewritten with
    them sorted, at its own length (no tensor moves). Two identical runs write identical files.

    Raises:
        NonFiniteError: a weight is NaN or infinite (such a state is never written); ``what``
            names the model in the message.
        WriteError: the file cannot be written (a full disk, ...), naming ``path``.
    """
    import torch

    state = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise NonFiniteError(f"{what}: weights {', '.join(bad[:5])} are NaN or infinite; not saved to {path}")
    atomic_write(path, lambda tmp: _write_safetensors(state, tmp, metadata))
    return file_sha256(path)


def _write_safetensors(state: Mapping[str, torch.Tensor], tmp: Path, metadata: dict[str, str]) -> None:
    """safetensors' file, its metadata keys rewritten in sorted order (:func:`save_weights`)."""
    from safetensors.torch import save_file

    save_file(state, str(tmp), metadata=metadata)
    with open(tmp, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        if "__metadata__" in header:
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
            text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
            if len(text) <= n:  # the same keys and values: the same length, or less with padding dropped
                f.seek(8)
                f.write(text.ljust(n))  # safetensors pads its header with spaces too


def save_head(head: Head, path: Path) -> str:
    """Write the head's weights (head name and config inside); returns the file's sha256.

    Raises:
        NonFiniteError: a weight is NaN or infinite (such a state is never written).
    """
    metadata = {"head": head.name, "config": json.dumps(dataclasses.asdict(head.config))}
    return save_weights(head.state_dict(), path, metadata, head.name)


def load_head(checkpoint: str | os.PathLike[str], device: str = "cpu") -> Head:
    """Rebuild a head from a safetensors checkpoint written by :func:`fit` (name + config inside).

    Raises:
        RunError: the file is missing, not a checkpoint of this format, or does not fit its head.
        NonFiniteError: a weight is NaN or infinite.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from tvrpipe.heads.base import create_head

    path = Path(checkpoint)
    if not path.is_file():
        raise RunError(f"{path}: no such checkpoint; if its training was interrupted, rerun the same "
                       "`tvrpipe train-head` (it resumes), else delete the run directory and train it again")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        head = create_head(meta["head"], **json.loads(meta["config"]))
        head.load_state_dict(load_file(str(path), device=device))
    except TvrpipeError:
        raise
    except Exception as e:  # safetensors, JSON, missing metadata, shape mismatch
        raise RunError(f"{path} is damaged ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                       "delete the run directory and train it again") from None
    bad = [k for k, v in head.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise NonFiniteError(f"{path}: weights {', '.join(bad[:5])} are NaN or infinite; "
                             "delete the run directory and train it again")
    return head.to(device).eval()


def checkpoint_head(checkpoint: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """The head name and config a checkpoint written by :func:`save_head` records, from its header alone (no
    weights are read).

    Raises:
        RunError: the file is missing or its header is not a head checkpoint's.
    """
    from safetensors import safe_open

    path = Path(checkpoint)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        name, config = meta["head"], json.loads(meta["config"])
    except Exception as e:  # missing, safetensors, JSON, missing metadata
        raise RunError(f"{path} is damaged or missing ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
                       "delete the run directory and train it again") from None
    if not isinstance(config, dict):
        raise RunError(f"{path} is damaged (its head config is not a mapping); delete the run directory and train "
                       "it again")
    return str(name), config


def check_head_record(run: Path, config: Mapping[str, Any], name: str, head_config: Mapping[str, Any]) -> None:
    """The run's ``config.yaml`` (``config``) records the head its selected checkpoint holds (``name`` and
    ``head_config``, :func:`checkpoint_head` or the loaded head's): the same method and, for every setting it
    records, the same value. An edited record would otherwise pass unnoticed (evaluation builds the head from
    the checkpoint) and the report would file the run's scores under another head or setting.

    Raises:
        RunError: naming ``config.yaml``, the key, and what the checkpoint holds.
    """
    path, best = Path(run) / CONFIG, Path(run) / CHECKPOINTS / BEST
    if config["method"] != name:
        raise RunError(f"{path}: method is {_shown(config['method'])} but the selected checkpoint {best} holds the "
                       f"head {name!r}; restore config.yaml or train the run again into a new --out")
    saved = json.loads(json.dumps(dict(head_config), default=str))
    for key, value in config["head"].items():
        if key not in saved:
            raise RunError(f"{path}: head.{key} is not a setting of the head {name!r} the selected checkpoint "
                           f"{best} holds; restore config.yaml or train the run again into a new --out")
        if json.loads(json.dumps(value, default=str)) != saved[key]:
            raise RunError(f"{path}: head.{key} is {_shown(value)} but the selected checkpoint {best} was trained "
                           f"with {_shown(saved[key])}; restore config.yaml or train the run again into a new --out")


def read_config(run: Path) -> dict:
    """A run's config.yaml, checked for the keys evaluation, resuming and the report need and for the type of
    every key they read (:func:`check_config`).

    Raises:
        RunError: no config.yaml, not YAML, a key missing or of the wrong type; the message names the file and
            the key.
    """
    path = Path(run) / CONFIG
    if not path.is_file():
        raise RunError(f"{run}: not a run directory (no config.yaml); train one with `tvrpipe train-head`")
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise RunError(f"{path} is not valid YAML{line}; restore it or train the run again "
                       "into a new --out") from None
    need = ("method", "head", "train", "features", "provenance")  # a finetune run has "finetune" for "train"
    missing = [k for k in need if not isinstance(config, dict) or (
        k not in config and not (k == "train" and "finetune" in config))]
    if missing:
        raise RunError(f"{path} lacks {', '.join(missing)}; restore it or train the run again into a new --out")
    check_config(path, config)
    return config


# the type of each top-level key of config.yaml that some reader uses (the trainer sections are typed by their
# config classes, :func:`check_config`); a key not listed is only recorded
CONFIG_TYPES: dict[str, Any] = {
    "method": str, "head": dict, "train": dict, "finetune": dict, "execution": dict, "features": str | None,
    "provenance": dict, "resolved": dict, "data": dict, "post": list[str], "manifest": str | None,
    "video_root": str | None, "validation": str | None, "max_steps": int | None, "recipe": dict | None,
    "versions": dict | None, "resumed_with": list[dict] | None,
}
_RESOLVED_TYPES: dict[str, Any] = {"lr": float | None, "batch_size": int | None, "lr_groups": dict[str, dict] | None}
_RECIPE_TYPES: dict[str, Any] = {"name": str | None, "path": str | None, "sha256": str | None,
                                 "shipped": bool | None, "published": dict | None, "mismatch": list[str] | None,
                                 "differs": dict | None}


def check_config(path: Path, config: Mapping[str, Any]) -> None:
    """Refuse a ``config.yaml`` (at ``path``) one of whose keys has a value of the wrong type: the top-level keys
    (:data:`CONFIG_TYPES`) and what the report reads of ``resolved``, ``data`` and ``recipe`` (the trainer sections'
    fields are typed by the trainers' configs, which live above this module:
    :func:`tvrpipe.training.recorded.trainer_config`).
    A damaged record would otherwise be read as a default, or fail as a traceback far from the file. Unknown keys
    pass (a run written by another tvrpipe); the values' ranges are checked where a trainer section is rebuilt
    (:func:`tvrpipe.training.recorded.trainer_config`).

    Raises:
        RunError: naming ``path``, the key and the value found.
    """
    check_types(path, "", config, CONFIG_TYPES)
    if not str(config["method"]).strip():
        raise RunError(f"{path}: method is empty; restore it or train the run again into a new --out")
    resolved = config.get("resolved") or {}
    check_types(path, "resolved.", resolved, _RESOLVED_TYPES)
    for group, rate in (resolved.get("lr_groups") or {}).items():
        check_types(path, f"resolved.lr_groups.{group}.", rate, {"lr": float | None})
    check_types(path, "data.", config.get("data") or {}, {"mode": str | None})
    recipe = config.get("recipe") or {}
    check_types(path, "recipe.", recipe, _RECIPE_TYPES)
    published = recipe.get("published")
    if published is not None:
        check_types(path, "recipe.published.", published,
                    {"source": str, "backbone": str, **{d: dict[str, float | None] | None for d in DIRECTIONS}})
        absent = [k for k in ("source", "backbone") if k not in published]
        if absent:
            raise RunError(f"{path}: recipe.published lacks {', '.join(absent)}; restore it or train the run again "
                           "into a new --out")


def check_types(path: Path, prefix: str, values: Any, types: Mapping[str, Any]) -> None:
    """Refuse a mapping ``values`` (``prefix`` names it in ``path``, e.g. ``train.``) that is not a mapping, or one of
    whose keys listed in ``types`` (``{key: type hint}``) holds a value of another type (:func:`fits`).

    Raises:
        RunError: naming ``path``, the key and the value found.
    """
    if not isinstance(values, Mapping):
        raise RunError(f"{path}: {prefix.rstrip('.')} is {_shown(values)}, not a mapping of settings; restore it or "
                       "train the run again into a new --out")
    for key, hint in types.items():
        if key in values and not fits(values[key], hint):
            raise RunError(f"{path}: {prefix}{key} is {_shown(values[key])}, not {type_text(hint)}; restore it or "
                           "train the run again into a new --out")


def fits(value: Any, hint: Any) -> bool:
    """Whether ``value``, as YAML or JSON reads it, is of the type ``hint`` (a config field's annotation: bool, int,
    float (an int is a float), str, ``X | None``, ``dict[K, V]``, ``list[X]``, ``tuple[...]`` (a list is a tuple),
    ``Literal``); an annotation of another kind is not judged (True)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if hint is dict or origin is dict:
        return isinstance(value, Mapping) and (not args or all(fits(k, args[0]) and fits(v, args[1])
                                                               for k, v in value.items()))
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args))
        return not args or all(fits(v, args[0]) for v in value)
    return True


_TYPE_TEXT = {bool: "true or false", int: "an integer", float: "a number", str: "text", dict: "a mapping",
              list: "a list", tuple: "a list", type(None): "null"}


def type_text(hint: Any) -> str:
    """A type hint in words, as a message names what a value should have been: ``an integer or null``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(type_text(a) for a in typing.get_args(hint)))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    base = typing.get_origin(hint) or hint
    text = _TYPE_TEXT.get(base, getattr(base, "__name__", str(base)))
    if base is dict and typing.get_args(hint):
        text += f" of {type_text(typing.get_args(hint)[1]).removeprefix('a ').removeprefix('an ')}s"
    elif base in (list, tuple) and typing.get_args(hint) and typing.get_args(hint)[-1] is not Ellipsis:
        text += f" of {type_text(typing.get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}s"
    return text


def _shown(value: Any) -> str:
    """A value as a message quotes it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def write_epochs(run: Path, rows: list[dict]) -> None:
    """The per-epoch log, ``epochs.csv`` (columns of the last row), written atomically."""
    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=list(rows[-1]))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(Path(run) / EPOCHS, text.getvalue())


def read_epochs(run: Path):
    """``epochs.csv`` as a DataFrame (no rows when there is none: a run of zero epochs).

    Raises:
        RunError: the file is not CSV.
    """
    import pandas as pd

    path = Path(run) / EPOCHS
    if not path.is_file():
        return pd.DataFrame({"epoch": []})
    try:
        return pd.read_csv(path)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError):
        raise RunError(f"{path} is damaged (not CSV)") from None


def rows_from_state(state: dict) -> list[dict]:
    """The epoch rows of a resume state (``state.pt``), kept there as one JSON text: floats round-trip
    exactly, and torch.save writes one object, not one per value (rewriting a list of rows each epoch
    would take O(epochs^2) time)."""
    return json.loads(state["rows"])


class Checkpoints:
    """A run's ``checkpoints/`` folder, changed one epoch at a time, as one commit.

    An epoch writes several files (the head's last weights, its best when validation improved,
    finetune's CLIP beside them) and the resume state, ``state.pt``. Each file is replaced
    atomically, but not all of them at once: a run interrupted between them would hold epoch e's
    weights beside epoch e-1's state, and resuming would train epoch e again from epoch e's weights
    with epoch e-1's optimiser (and a best checkpoint the state knows nothing of). So an epoch's
    files are written under staging names (``.NAME.next``); ``commit`` then writes the state with
    every file's sha256 (the commit point) and renames the staged files into place. ``load`` finishes
    the renames of a committed epoch, drops the staged files of an uncommitted one, and checks every
    file the state names against its sha256.
    """

    STATE = "state.pt"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str, str] = {}  # name -> sha256 of the committed files
        self._staged: dict[str, str] = {}

    def _next(self, name: str) -> Path:
        return self.folder / f".{name}.next"

    def stage(self, name: str, write: Callable[[Path], str]) -> str:
        """Write file ``name`` of this epoch with ``write(path)`` (which returns its sha256) under its
        staging name; it takes ``name``'s place at :meth:`commit`. Returns the sha256."""
        self._staged[name] = write(self._next(name))
        return self._staged[name]

    def stage_copy(self, name: str, source: str) -> str:
        """Stage ``name`` as a copy of ``source`` (staged this epoch, or committed)."""
        src = self._next(source) if source in self._staged else self.folder / source
        sha = self._staged.get(source) or self.files[source]

        def copy(path: Path) -> str:
            atomic_write(path, lambda tmp: shutil.copyfile(src, tmp))
            return sha
        return self.stage(name, copy)

    def commit(self, state: dict) -> None:
        """Write ``state`` (with the sha256 of every file, as ``files``) as ``state.pt``, then move
        this epoch's staged files into place."""
        import torch

        files = {**self.files, **self._staged}
        atomic_write(self.folder / self.STATE, lambda tmp: torch.save({**state, "files": files}, tmp))
        for name in self._staged:
            move_into_place(self._next(name), self.folder / name)
        self.files, self._staged = files, {}

    def load(self, map_location: str | None = None, check: bool = True) -> dict | None:
        """The last committed state (None when there is none), its files completed and checked
        (``check=False``: read as they are, for a process beside the one that checked them).

        Raises:
            ValueError: a file the state names is missing or does not match its sha256.
        """
        import torch

        path = self.folder / self.STATE
        if not path.is_file():
            return None
        state = torch.load(path, weights_only=False, map_location=map_location)
        files = state["files"]
        self.files = dict(files)
        if not check:
            return state
        for staged in self.folder.glob(".*.next"):
            name = staged.name[1:-len(".next")]
            if name in files and file_sha256(staged) == files[name]:
                move_into_place(staged, self.folder / name)  # committed, not yet moved into place
            else:
                staged.unlink()  # an epoch that was not committed
        remove_staged(self.folder)  # a file cut off as it was written (its writer is gone)
        for partial in self.folder.glob(".*.tmp"):  # the same, in a run written before staged names had a pid
            partial.unlink()
        for name, sha in files.items():
            if not (self.folder / name).is_file():
                raise ValueError(f"{name} is missing")
            if file_sha256(self.folder / name) != sha:
                raise ValueError(f"{name} does not match the sha256 that {self.STATE} recorded for it")
        return state


def load_optimizer_state(opt: torch.optim.Optimizer, saved: dict, out: Path) -> None:
    """Resume ``opt`` from a checkpoint's optimizer state.

    Raises:
        RunError: the state was saved for other parameters (a run started by a tvrpipe whose head had
            other parameters). Its weights still load (``tvrpipe evaluate``); its training cannot continue.
    """
    have = [len(g["params"]) for g in opt.param_groups]
    was = [len(g["params"]) for g in saved.get("param_groups", [])]
    if have != was:
        raise RunError(f"{out}: cannot resume: its optimizer state is for {sum(was)} parameter tensors and the "
                       f"head now has {sum(have)} (the run was started by an earlier tvrpipe whose head had other "
                       f"parameters); its checkpoints still load for `tvrpipe evaluate`. Delete "
                       f"{out / 'checkpoints'} to train it again with this version")
    base = [g.get("base_lr") for g in opt.param_groups]
    opt.load_state_dict(saved)
    for g, lr in zip(opt.param_groups, base):  # the configured learning rates, not the saved ones
        if lr is not None:
            g["base_lr"] = lr


def write_plots(run: Path, rows: list[dict], groups: dict[str, list[str]] | None = None) -> None:
    """``plots/``: loss.png, val_r1.png and, with ``groups`` ({readout: [kinds]}, "" for a single value),
    readouts.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(run) / PLOTS
    out.mkdir(exist_ok=True)
    epochs = [r["epoch"] for r in rows]
    for key, name, ylabel in (("loss", "loss.png", "training loss"), ("val_t2v_R@1", "val_r1.png", "val t2v R@1 (%)")):
        fig, ax = plt.subplots(figsize=(4.5, 3.2))
        ax.plot(epochs, [r[key] for r in rows], marker="o")
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    # the head's readouts (pair readouts: matching vs non-matching pairs; query readouts: correct vs
    # incorrect top-1; item readouts: one line) against validation R@1
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 3.4), squeeze=False)
        for ax, (name, kinds) in zip(axes[0], groups.items()):
            for kind, marker in zip(kinds, "osd^"):
                key = f"val_{name}_{kind}" if kind else f"val_{name}"
                ax.plot(epochs, [r[key] for r in rows], marker=marker, label=kind or name)
            ax.set_xlabel("epoch")
            ax.set_ylabel(f"val mean {name}")
            r1 = ax.twinx()
            r1.plot(epochs, [r["val_t2v_R@1"] for r in rows], color="grey", ls="--", label="val t2v R@1")
            r1.set_ylabel("val t2v R@1 (%)")
            lines = ax.get_legend_handles_labels()[0] + r1.get_legend_handles_labels()[0]
            ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "readouts.png", dpi=100)
        plt.close(fig)


def recorded(run: Path, key: str) -> Any:
    """``metrics.json[key]`` of a run (None before training finished)."""
    metrics = read_metrics(run)
    return None if metrics is None else metrics.get(key)


@dataclass(frozen=True)
class RunClip:
    """The CLIP a run learnt with, and where its weights are.

    Attributes:
        model: the open_clip architecture that rebuilds the weights.
        pretrained: an open_clip tag or a checkpoint file (``none``: random weights of ``seed``); None where the
            run does not record it.
        seed: the seed of random weights.
        source: where the weights come from, in words.
        features: the store the run trained on (a ``train-head`` run), None for live features (``finetune``).
        manifest: the manifest folder the run read its videos from (a ``finetune`` run), else None.
        video_root: its videos' folder (a ``finetune`` run), else None.
    """

    model: str
    pretrained: str | None
    seed: int
    source: str
    features: str | None = None
    manifest: str | None = None
    video_root: str | None = None


def run_clip(run: Path, config: Mapping[str, Any], metrics: Mapping[str, Any] | None) -> RunClip:
    """The CLIP of a run (its ``config.yaml`` and ``metrics.json``): a ``finetune --end-to-end`` run's exported
    CLIP (the run's file), another ``finetune`` run's frozen CLIP (the weights it started from), or the CLIP a
    ``train-head`` run's store was extracted with (its provenance, which the run records)."""
    prov = {**(config.get("provenance") or {}), **((metrics or {}).get("provenance") or {})}
    export = (metrics or {}).get("export")
    finetune = config.get("finetune")
    if isinstance(finetune, Mapping):
        live = {"manifest": config.get("manifest"), "video_root": config.get("video_root")}
        if isinstance(export, Mapping) and export.get("file"):
            file = str(Path(run) / export["file"])
            return RunClip(str(export.get("model") or prov.get("model")), file, 0,
                           f"its finetuned CLIP {file}", **live)
        model, pretrained = str(finetune.get("model")), str(finetune.get("pretrained"))
        return RunClip(model, pretrained, int(finetune.get("seed") or 0),
                       f"{model} {pretrained}, frozen while the run's head trained", **live)
    model, pretrained = str(prov.get("model")), prov.get("pretrained")
    features = config.get("features")
    return RunClip(model, None if pretrained is None else str(pretrained), 0,
                   f"{model} {pretrained}, as its store {features} was extracted", features=features)
