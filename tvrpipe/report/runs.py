"""Finding and reading finished runs: every run directory under the paths given, with the
dataset it was tested on and the reason for each run left out."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

from tvrpipe import rundir
from tvrpipe.data.manifest import read_manifest
from tvrpipe.environment import ENVIRONMENT_KEYS
from tvrpipe.errors import ConfigError, RunError, TvrpipeError
from tvrpipe.rundir import METRICS, Scores
from tvrpipe.training.recorded import trainer_config

log = logging.getLogger(__name__)

DIRECTIONS = dict(zip(rundir.DIRECTIONS, ("Text-to-video", "Video-to-text")))  # their titles


@dataclass(frozen=True)
class RunRecord:
    """A finished run directory, read.

    Attributes:
        dir: the run directory.
        config: its ``config.yaml``.
        metrics: its ``metrics.json``.
        epochs: its ``epochs.csv`` (no rows for a run of zero epochs).
        dataset: the dataset and split set its features came from (``"?"`` when unknown).
        split_set: the split set (``None`` when unknown).
    """

    dir: Path
    config: dict
    metrics: dict
    epochs: pd.DataFrame
    dataset: str
    split_set: str | None

    @property
    def method(self) -> str:
        return str(self.config["method"])

    @property
    def mode(self) -> str:
        """``train-head`` (cached features), ``finetune end-to-end`` or ``finetune frozen CLIP``."""
        if "finetune" not in self.config:
            return "train-head"
        return "finetune end-to-end" if self.config["finetune"].get("end_to_end") else "finetune frozen CLIP"

    @property
    def settings(self) -> dict:
        """The trainer settings (``train``, or ``finetune`` for a finetune run)."""
        return dict(self.config.get("train") or self.config.get("finetune") or {})

    @property
    def seed(self) -> int | None:
        return self.settings.get("seed")

    @property
    def test(self) -> Scores:
        return Scores.from_dict(self.metrics.get("test") or {})

    def scores(self, variant: str, direction: str) -> dict | None:
        """Test metrics of one score variant (``raw``, ``dsl``, ...) and direction, if reported."""
        return self.test.get(variant, direction)

    @cached_property  # read once, on first use
    def test_ranks(self) -> dict | None:
        """Each raw test query's rank and the ids of the queries (``rundir.read_test_ranks``); None for a run
        without them (one trained before runs kept them, or a finetune run)."""
        return rundir.read_test_ranks(self.dir)

    def readout_series(self) -> dict[str, list[str]]:
        """``{readout: [columns of epochs.csv]}``: validation readouts logged per epoch.

        Named by ``metrics.json``'s ``val.readouts`` (``{name: {kind: value}}`` or ``{name: value}``);
        without it, every ``val_`` column that is not a t2v / v2t metric is a readout of its own.
        """
        cols = [c for c in self.epochs.columns if c.startswith("val_") and not c.startswith(("val_t2v_", "val_v2t_"))]
        named = self.metrics.get("val", {}).get("readouts") or {}
        out: dict[str, list[str]] = {}
        for name, r in named.items():
            want = [f"val_{name}_{kind}" for kind in r] if isinstance(r, dict) else [f"val_{name}"]
            have = [c for c in want if c in cols]
            if have:
                out[name] = have
        taken = {c for v in out.values() for c in v}
        out.update({c[4:]: [c] for c in cols if c not in taken})
        return out


@dataclass(frozen=True)
class Skipped:
    """A directory that looked like a run but cannot be reported, and why."""

    dir: Path
    reason: str


# ---------------------------------------------------------------------------------------------- runs


def find_runs(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[RunRecord], list[Skipped]]:
    """Every run directory under ``paths`` (themselves runs, or folders holding runs at any depth).

    A directory with ``config.yaml`` naming a ``method`` is a run; one without ``metrics.json``
    (unfinished) or with damaged files is skipped with the reason: a ``config.yaml`` whose keys are of the wrong
    type, name another method or head setting than its checkpoint holds, or a trainer setting out of its range
    included. Runs are not searched inside.

    Raises:
        ConfigError: a path does not exist, or holds no run (finished or not).

    Example:
        >>> runs, skipped = find_runs(["runs/"])  # doctest: +SKIP
    """
    from tvrpipe.rundir import read_config

    runs: list[RunRecord] = []
    skipped: list[Skipped] = []
    seen: set[Path] = set()
    identities: dict[str, Path] = {}  # run identity -> the first run found with it
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"{p}: no such run directory")
        if not p.is_dir():
            raise ConfigError(f"{p}: not a directory (pass run directories or folders that hold runs)")
        found = 0
        for d, subdirs, files in os.walk(p):
            subdirs.sort()
            here = Path(d)
            if "config.yaml" not in files:
                continue
            try:
                config = read_config(here)
            except RunError as e:
                if _looks_like_run(here):  # a run whose config is damaged: say so; anything else is not ours
                    skipped.append(Skipped(here, str(e)))
                    found += 1
                continue
            subdirs.clear()  # a run's own folders (checkpoints, plots, ray) hold no runs
            found += 1
            if here.resolve() in seen:
                continue
            seen.add(here.resolve())
            record = _read_run(here, config)
            if isinstance(record, RunRecord):
                same = identities.setdefault(_run_identity(record), here)
                if same != here:  # a copied run directory is not a second seed
                    record = Skipped(here, f"the same run as {same} (the same configuration, seed and store): "
                                           "counted once")
            (runs if isinstance(record, RunRecord) else skipped).append(record)
        if not found:
            raise ConfigError(f"{p}: no runs here (no directory with config.yaml and metrics.json at any depth); "
                              "pass run directories written by `tvrpipe train-head`, `tvrpipe finetune` or a "
                              "sweep, or a folder that holds them")
    return runs, skipped


def _run_identity(run: RunRecord) -> str:
    """What makes a run the same run wherever its directory is: its whole configuration, seed and store
    included (not the versions it ran with). A copy of a run directory has it; two seeds, or two runs
    reporting different post-processing of one training, do not."""
    return json.dumps({k: v for k, v in run.config.items() if k not in ENVIRONMENT_KEYS}, sort_keys=True, default=str)


def _looks_like_run(d: Path) -> bool:
    return (d / "checkpoints").is_dir() or (d / "metrics.json").is_file() or (d / "epochs.csv").is_file()


def _read_run(d: Path, config: dict) -> RunRecord | Skipped:
    mpath = d / rundir.METRICS_FILE
    if not mpath.is_file():
        return Skipped(d, "unfinished: no metrics.json (training did not reach its test evaluation; rerun the "
                          "same command to resume it)")
    try:
        metrics = rundir.read_metrics(d)  # None: JSON, but not an object
    except RunError:
        return Skipped(d, f"{mpath} is damaged (not JSON)")
    if not isinstance(metrics, dict) or not isinstance(metrics.get("test"), dict) or not all(
            isinstance(metrics["test"].get(k), dict) for k in DIRECTIONS):
        return Skipped(d, f"{mpath} has no test t2v / v2t metrics")
    lost = [f"{k} {m}" for k in DIRECTIONS for m in METRICS if not isinstance(metrics["test"][k].get(m), (int, float))]
    if lost:  # counted in a row's runs, it would drop out of the raw tables alone
        return Skipped(d, f"{mpath} is damaged: no test {', '.join(lost[:3])}")
    epath = d / rundir.EPOCHS
    ran = (metrics.get("schedule") or {}).get("epochs_run", metrics.get("selected_epoch") or 0)
    if not epath.is_file() and ran:
        return Skipped(d, f"{epath} is missing ({mpath} says {ran} epochs ran): the curves and the runs table "
                          "need it; train the run again")
    try:
        epochs = rundir.read_epochs(d)
    except RunError as e:
        return Skipped(d, str(e))
    best = d / rundir.CHECKPOINTS / rundir.BEST
    try:  # the header only; a checkpoint that does not read leaves the record unchecked (the tables do not need it)
        head = rundir.checkpoint_head(best) if best.is_file() else None
    except RunError:
        head = None
    try:  # an edited method, head or trainer setting would file the run's scores under another row
        if head is not None:
            rundir.check_head_record(d, config, *head)
        trainer_config(d, config, known_only=True)  # keys a later tvrpipe dropped: still reported
    except RunError as e:
        return Skipped(d, str(e))
    dataset, split_set = _dataset_of(config)
    return RunRecord(d, config, metrics, epochs, dataset, split_set)


def _dataset_of(config: dict) -> tuple[str, str | None]:
    """The dataset and split set a run's features came from: the store's attrs (train-head) or the
    manifest's meta.json (finetune); ``("?", None)`` when neither can be read any more."""
    from tvrpipe.features.store import StoreError, store_attributes

    attrs: dict = {}
    trained_on = (config.get("provenance") or {}).get("manifest_sha256")
    if config.get("features"):
        try:
            attrs = store_attributes(config["features"])
        except StoreError as e:
            log.info("%s; the run's dataset is unknown", e)
        if attrs and trained_on and attrs.get("manifest_sha256") != trained_on:  # the store was replaced since
            log.info("%s holds another store than the run was trained on; its dataset is unknown", config["features"])
            attrs = {}
    elif config.get("manifest"):
        path = Path(config["manifest"]) / "meta.json"
        try:
            attrs = json.loads(path.read_text())
        except (OSError, ValueError):
            log.info("%s: cannot read the manifest's meta.json; its dataset is unknown", path)
        now = _manifest_sha(config["manifest"]) if attrs and trained_on else None
        if now is not None and now != trained_on:  # the manifest was rewritten since
            log.info("%s holds another manifest than the run was trained on; its dataset is unknown",
                     config["manifest"])
            attrs = {}
    return str(attrs.get("dataset") or "?"), attrs.get("split_set")


def _manifest_sha(manifest: str) -> str | None:
    """The sha256 of the manifest in ``manifest`` now (None if it cannot be read)."""
    from tvrpipe.features.store import manifest_sha256

    try:
        m = read_manifest(manifest)
    except (TvrpipeError, OSError, ValueError) as e:  # a damaged manifest: the dataset is unknown, the report goes on
        log.info("%s: %s", manifest, e)
        return None
    return manifest_sha256(m.videos, m.captions)
