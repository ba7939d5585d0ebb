"""``tvrpipe report``: finished runs as the papers' result tables, with plots and a retrieval gallery.

Input: run directories written by ``tvrpipe train-head`` (:func:`tvrpipe.training.fit.fit`),
``tvrpipe finetune`` or a sweep, or folders holding such runs at any depth. Output, in one folder:

- ``report.md``: per dataset (its test split and validation source named), the papers' table
  "Method | R@1 | R@5 | R@10 | MdR | MnR" for text-to-video and for video-to-text: raw scores
  first, then each post-processing (DSL, QB-Norm) and each head-declared re-ranking (e.g. DUQ's
  Eq. 16) in a table of its own, never mixed with raw; the heads' uncertainty readouts on test;
  which epoch each run selected on validation; the skipped runs with the reason.
- ``report.csv``: the same numbers, unrounded.
- ``curves.png`` (validation t2v R@1 and training loss per epoch), ``r1.png`` (test t2v R@1 per
  row with the seed spread), ``uncertainty.png`` (each readout against validation R@1 across
  epochs, as UATVR's Fig. 3; runs that log readouts only) and ``gallery.png`` (top-5 videos of a
  few test captions as middle-frame thumbnails; only when the videos can be read).

Rows: runs that differ only in their seed (``train.seed`` / ``finetune.seed``) or in settings
that do not change what is learnt (device, block sizes, prefetching) form one row, reported as
mean ± sample standard deviation over the seeds (``ddof=1``: the spread one more seed would
show; a row of one run has no ±). Each row is named by its method plus the settings that tell it
apart from the other rows of that method, e.g. ``xpool (num_heads=2)``. Nothing here depends on
which head a run holds: readouts are whatever a run logged (``val_<name>[_<kind>]`` columns of
``epochs.csv``, ``readouts`` in ``metrics.json``), post-processings whatever ``t2v_<name>`` /
``v2t_<name>`` keys its test metrics hold.
"""

from __future__ import annotations

import json
import logging
import os
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.environment import ENVIRONMENT_KEYS, versions_text
from tvrpipe.errors import ConfigError, RunError, TvrpipeError

log = logging.getLogger(__name__)

METRICS = ("R@1", "R@5", "R@10", "MdR", "MnR")
HIGHER_IS_BETTER = {"R@1": True, "R@5": True, "R@10": True, "MdR": False, "MnR": False}
DIRECTIONS = {"t2v": "Text-to-video", "v2t": "Video-to-text"}
# how each score variant is titled, and what it is; a variant not listed here is titled by its key
SCORE_TITLES = {
    "raw": ("raw scores", ""),
    "dsl": ("after DSL", ("Dual softmax over all test queries: post-processing that uses the test set's other "
                          "queries; not comparable with raw scores.")),
    "qbnorm": ("after QB-Norm", ("Querybank normalisation with the training captions as the bank: "
                                 "post-processing; not comparable with raw scores.")),
    "rerank": ("after the head's re-ranking", ("The head's own re-ranking of the full score matrix "
                                               "(`Head.rerank`, e.g. DUQ Eq. 16); not comparable with raw scores.")),
}
SCORE_ORDER = ("raw", "dsl", "qbnorm", "rerank")
# settings that do not change what a run learns: runs differing only in these share a row
_NOT_IDENTITY = frozenset({"seed", "device", "prefetch", "eval_batch", "block_texts"})
_HASH = re.compile(r"^[0-9a-f]{32,}$")
GALLERY_TOP = 5
THUMB_SIZE = 128  # thumbnail side in pixels (decoded at this size, centre-cropped)


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

    def scores(self, variant: str, direction: str) -> dict | None:
        """Test metrics of one score variant (``raw``, ``dsl``, ...) and direction, if reported."""
        key = direction if variant == "raw" else f"{direction}_{variant}"
        m = self.metrics.get("test", {}).get(key)
        return m if isinstance(m, dict) and "R@1" in m else None

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


@dataclass
class Row:
    """One row of the tables: runs identical but for their seed."""

    label: str
    method: str
    runs: list[RunRecord]
    identity: dict[str, Any]

    def values(self, variant: str, direction: str, metric: str) -> list[float]:
        """The metric over the row's runs that report this score variant (in seed order)."""
        return [float(s[metric]) for r in self.runs if (s := r.scores(variant, direction)) is not None]

    @property
    def seeds(self) -> list[int | None]:
        return [r.seed for r in self.runs]


@dataclass
class Section:
    """The rows of one dataset (one manifest: same test split)."""

    dataset: str
    split_set: str | None
    manifest_sha256: str | None
    rows: list[Row]

    @property
    def title(self) -> str:
        if self.split_set and self.split_set != self.dataset:
            return f"{self.dataset} (split set {self.split_set})"
        return self.dataset

    @property
    def runs(self) -> list[RunRecord]:
        return [r for row in self.rows for r in row.runs]

    def variants(self) -> list[str]:
        """Score variants any run of the section reports, raw first, then in :data:`SCORE_ORDER`."""
        found = {"raw"}
        for run in self.runs:
            for key, m in run.metrics.get("test", {}).items():
                if isinstance(m, dict) and "R@1" in m and "_" in key and key.split("_", 1)[0] in DIRECTIONS:
                    found.add(key.split("_", 1)[1])
        return [v for v in SCORE_ORDER if v in found] + sorted(found - set(SCORE_ORDER))


@dataclass(frozen=True)
class GalleryQuery:
    """One gallery caption and what the run retrieved for it.

    Attributes:
        caption_id: the caption.
        text: its text (``None`` without a manifest).
        video_id: its ground-truth video.
        rank: 1-based rank of the ground truth among all test videos (ties count against the model).
        score: the ground truth's raw score.
        top: the top-ranked ``(video_id, raw score)`` pairs, best first.
    """

    caption_id: str
    text: str | None
    video_id: str
    rank: int
    score: float
    top: list[tuple[str, float]]


@dataclass
class Gallery:
    """What ``gallery.png`` shows: the run, its test captions chosen, their top-ranked videos."""

    run: Path
    queries: list[GalleryQuery]
    video_root: Path
    paths: dict[str, str] = field(default_factory=dict)  # video_id -> path relative to video_root
    clips: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # video_id -> (start, end)
    failed: set[str] = field(default_factory=set)  # videos that failed to decode at extraction


class GalleryUnavailable(TvrpipeError):
    """The gallery cannot be drawn (no store, no videos); the report says why and goes on."""


# ---------------------------------------------------------------------------------------------- runs


def find_runs(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[RunRecord], list[Skipped]]:
    """Every run directory under ``paths`` (themselves runs, or folders holding runs at any depth).

    A directory with ``config.yaml`` naming a ``method`` is a run; one without ``metrics.json``
    (unfinished) or with damaged files is skipped with the reason. Runs are not searched inside.

    Raises:
        ConfigError: a path does not exist, or holds no run (finished or not).

    Example:
        >>> runs, skipped = find_runs(["runs/"])  # doctest: +SKIP
    """
    from tvrpipe.training.fit import _read_config

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
                config = _read_config(here)
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
    mpath = d / "metrics.json"
    if not mpath.is_file():
        return Skipped(d, "unfinished: no metrics.json (training did not reach its test evaluation; rerun the "
                          "same command to resume it)")
    try:
        metrics = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError):
        return Skipped(d, f"{mpath} is damaged (not JSON)")
    if not isinstance(metrics, dict) or not isinstance(metrics.get("test"), dict) or not all(
            isinstance(metrics["test"].get(k), dict) for k in DIRECTIONS):
        return Skipped(d, f"{mpath} has no test t2v / v2t metrics")
    lost = [f"{k} {m}" for k in DIRECTIONS for m in METRICS if not isinstance(metrics["test"][k].get(m), (int, float))]
    if lost:  # counted in a row's runs, it would drop out of the raw tables alone
        return Skipped(d, f"{mpath} is damaged: no test {', '.join(lost[:3])}")
    epath = d / "epochs.csv"
    ran = (metrics.get("schedule") or {}).get("epochs_run", metrics.get("selected_epoch") or 0)
    if not epath.is_file() and ran:
        return Skipped(d, f"{epath} is missing ({mpath} says {ran} epochs ran): the curves and the runs table "
                          "need it; train the run again")
    try:
        epochs = pd.read_csv(epath) if epath.is_file() else pd.DataFrame({"epoch": []})
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError):
        return Skipped(d, f"{epath} is damaged (not CSV)")
    dataset, split_set = _dataset_of(config)
    return RunRecord(d, config, metrics, epochs, dataset, split_set)


def _dataset_of(config: dict) -> tuple[str, str | None]:
    """The dataset and split set a run's features came from: the store's attrs (train-head) or the
    manifest's meta.json (finetune); ``("?", None)`` when neither can be read any more."""
    from tvrpipe.pipeline.store import StoreError, store_attributes

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
    from tvrpipe.pipeline.store import manifest_sha256

    try:
        m = _read_manifest(manifest)
    except (TvrpipeError, OSError, ValueError) as e:  # a damaged manifest: the dataset is unknown, the report goes on
        log.info("%s: %s", manifest, e)
        return None
    return manifest_sha256(m.videos, m.captions)


# ---------------------------------------------------------------------------------------------- rows


def _identity(run: RunRecord) -> dict[str, Any]:
    """Everything that defines what a run learnt, flattened; the seed and execution settings left out."""
    flat: dict[str, Any] = {"mode": run.mode}
    flat.update({f"store.{k}": v for k, v in (run.config.get("provenance") or {}).items()})
    flat.update({f"head.{k}": v for k, v in (run.config.get("head") or {}).items()})
    section = "finetune" if "finetune" in run.config else "train"
    settings = run.settings
    if section == "finetune":
        settings.setdefault("epoch_pairs", "videos")  # a run from before the option trained on those
    flat.update({f"{section}.{k}": v for k, v in settings.items() if k not in _NOT_IDENTITY})
    resolved = (run.config.get("resolved") or {}).get("lr")
    if resolved is not None and settings.get("lr") is None:  # a head's default_lr, which can change
        flat["train.lr"] = resolved
    if run.config.get("max_steps") is not None:
        flat["train.max_steps"] = run.config["max_steps"]
    return flat


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str) and _HASH.match(v):
        return v[:8]
    return str(v)


def _labels(method: str, identities: list[dict[str, Any]]) -> list[str]:
    """Name each group of one method by the settings that tell it apart from the others.

    A group shows a setting when some other group has that setting with another value (settings
    that only one of two groups has, such as a finetune run's against a train-head run's, are
    told apart by ``mode``), in the order mode, head, trainer, store.
    """
    if len(identities) == 1:  # a finetune run still says so: its row never reads like a train-head one
        mode = identities[0].get("mode", "train-head")
        return [method if mode == "train-head" else f"{method} ({mode})"]
    order = {"mode": 0, "head": 1, "train": 2, "finetune": 2, "store": 3}
    values = [{k: json.dumps(v, sort_keys=True, default=str) for k, v in ident.items()} for ident in identities]
    shown: list[list[str]] = []
    for i, mine in enumerate(values):
        keys = [k for k in mine if any(k in other and other[k] != mine[k] for j, other in enumerate(values) if j != i)]
        shown.append(sorted(keys, key=lambda k: (order.get(k.split(".")[0], 4), k)))
    def leaf(k: str) -> str:
        return k.split(".", 1)[-1]

    full = {k for keys in shown for k in keys}
    clash = {leaf(k) for k in full if sum(leaf(j) == leaf(k) for j in full) > 1}  # e.g. head.lr and train.lr
    labels = []
    for ident, keys in zip(identities, shown):
        parts = [str(ident[k]) if k == "mode" else f"{k if leaf(k) in clash else leaf(k)}={_fmt_value(ident[k])}"
                 for k in keys]
        parts = parts[:4] + ([f"+{len(parts) - 4} more"] if len(parts) > 4 else [])
        labels.append(f"{method} ({', '.join(parts)})" if parts else method)
    for i, label in enumerate(labels):  # left alike (should not happen): numbered, still distinct
        if labels.count(label) > 1:
            labels[i] = f"{label} [{labels[:i + 1].count(label)}]"
    return labels


def group_runs(runs: Iterable[RunRecord]) -> list[Section]:
    """Runs grouped into sections (one per dataset manifest) and rows (identical but for the seed).

    Sections come in order of dataset name; rows in order of label; a row's runs in seed order.

    Example:
        >>> sections = group_runs(find_runs(["runs/"])[0])  # doctest: +SKIP
        >>> [row.label for row in sections[0].rows]  # doctest: +SKIP
        ['meanpool', 'xpool (num_heads=1)', 'xpool (num_heads=2)']
    """
    runs = list(runs)
    shas = [(run.config.get("provenance") or {}).get("manifest_sha256") for run in runs]
    # a run whose store is gone (or replaced) takes its dataset's name from a run of the same manifest
    named = {sha: (run.dataset, run.split_set) for run, sha in zip(runs, shas) if sha and run.dataset != "?"}
    by_section: dict[tuple, list[RunRecord]] = {}
    for run, sha in zip(runs, shas):
        dataset, split_set = named.get(sha, (run.dataset, run.split_set)) if run.dataset == "?" else (
            run.dataset, run.split_set)
        by_section.setdefault((dataset, split_set or "", sha or ""), []).append(run)
    sections = []
    for (dataset, split_set, sha), members in sorted(by_section.items(), key=lambda kv: kv[0]):
        groups: dict[str, list[RunRecord]] = {}
        for run in members:
            groups.setdefault(json.dumps(_identity(run), sort_keys=True, default=str), []).append(run)
        rows: list[Row] = []
        for method in sorted({g[0].method for g in groups.values()}):
            keyed = [(k, g) for k, g in groups.items() if g[0].method == method]
            idents = [json.loads(k) for k, _ in keyed]
            for label, (k, g), ident in zip(_labels(method, idents), keyed, idents):
                g = sorted(g, key=lambda r: (r.seed is None, r.seed if r.seed is not None else 0, str(r.dir)))
                rows.append(Row(label, method, g, ident))
        rows.sort(key=lambda r: r.label)
        sections.append(Section(dataset, split_set or None, sha or None, rows))
    titles = [s.title for s in sections]
    for s in sections:  # two manifests of one dataset name: tell them apart by their hash
        if titles.count(s.title) > 1 and s.manifest_sha256:
            s.dataset = f"{s.dataset} [manifest {s.manifest_sha256[:8]}]"
    return sections


def _stats(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1; None for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else None


# ---------------------------------------------------------------------------------------------- tables


def _cell(values: list[float], digits: int = 1) -> str:
    mean, std = _stats(values)
    if not np.isfinite(mean):  # e.g. a readout over "incorrect" queries when every query was correct
        return "n/a"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _table(section: Section, variant: str, direction: str) -> list[str]:
    """Markdown lines of one paper-style table; the best mean of each column in bold."""
    rows = [row for row in section.rows if row.values(variant, direction, "R@1")]
    if not rows:
        return []
    means = {m: [_stats(row.values(variant, direction, m))[0] for row in rows] for m in METRICS}
    best = {m: (max if HIGHER_IS_BETTER[m] else min)(v) for m, v in means.items()}
    head = "| Method | seeds | " + " | ".join(f"{m}{'↑' if HIGHER_IS_BETTER[m] else '↓'}" for m in METRICS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(METRICS)]
    for i, row in enumerate(rows):
        cells = []
        for m in METRICS:
            text = _cell(row.values(variant, direction, m))
            cells.append(f"**{text}**" if len(rows) > 1 and means[m][i] == best[m] else text)
        lines.append(f"| {row.label} | {len(row.values(variant, direction, 'R@1'))} | " + " | ".join(cells) + " |")
    return lines


def _split_line(section: Section) -> str:
    sizes = sorted({(r.metrics["test"].get("n_videos"), r.metrics["test"].get("n_texts")) for r in section.runs},
                   key=str)
    size = "; ".join(f"{v} videos, {t} captions" for v, t in sizes)
    vals = sorted({str(r.metrics.get("validation") or r.config.get("validation") or "?") for r in section.runs})
    return (f"Test split: `test` ({size}), evaluated once per run with the checkpoint selected on validation. "
            f"Validation: {'; '.join(vals)}.")


def _readout_table(section: Section) -> list[str]:
    lines = []
    for row in section.rows:
        names: dict[str, list[float]] = {}
        for run in row.runs:
            for name, r in (run.metrics["test"].get("readouts") or {}).items():
                for kind, v in (r.items() if isinstance(r, dict) else [("", r)]):
                    names.setdefault(f"{name} ({kind})" if kind else name, []).append(float(v))
        lines += [f"| {row.label} | {name} | {_cell(v, 4)} |" for name, v in names.items()]
    return ["| Method | readout | mean on test |", "|---|---|---:|", *lines] if lines else []


def _link(path: Path, out: Path) -> str:
    rel = os.path.relpath(path.resolve(), out.resolve())
    return f"[{path}]({rel.replace(os.sep, '/')})"


def _runs_table(section: Section, out: Path) -> list[str]:
    lines = ["| Method | seed | selected epoch | epochs run | versions | run |", "|---|---:|---:|---:|---|---|"]
    for row in section.rows:
        for r in row.runs:
            lines.append(f"| {row.label} | {r.seed} | {r.metrics.get('selected_epoch', '?')} | {len(r.epochs)} | "
                         f"{_versions_cell(r.config)} | {_link(r.dir, out)} |")
    return lines


def _versions_cell(config: dict) -> str:
    """The software a run was trained with (its config's ``versions``), and any it was resumed with."""
    text = versions_text(config.get("versions"))
    for other in config.get("resumed_with") or []:
        text += f"; resumed with {versions_text(other)}"
    return text.replace("|", "\\|")


def _csv_rows(sections: list[Section]) -> list[dict]:
    rows = []
    for s in sections:
        for variant in s.variants():
            for direction in DIRECTIONS:
                for row in s.rows:
                    if not row.values(variant, direction, "R@1"):
                        continue
                    runs = [r for r in row.runs if r.scores(variant, direction) is not None]
                    rec = {"dataset": s.dataset, "split_set": s.split_set, "split": "test",
                           "n_videos": runs[0].metrics["test"].get("n_videos"),
                           "n_texts": runs[0].metrics["test"].get("n_texts"),
                           "scores": variant, "direction": direction, "row": row.label, "method": row.method,
                           "seeds": len(runs), "seed_values": " ".join(str(r.seed) for r in runs)}
                    for m in METRICS:
                        mean, std = _stats(row.values(variant, direction, m))
                        rec[m], rec[f"{m} std"] = mean, std
                    rec["runs"] = " ".join(str(r.dir) for r in runs)
                    rec["versions"] = " / ".join(dict.fromkeys(_versions_cell(r.config) for r in runs))
                    rows.append(rec)
    return rows


def render_markdown(sections: list[Section], skipped: list[Skipped], out: Path, plots: dict[str, str],
                    notes: list[str], sources: Sequence[str | os.PathLike[str]] = ()) -> str:
    """The text of ``report.md``.

    Args:
        sections: from :func:`group_runs`.
        skipped: from :func:`find_runs`.
        out: the report folder (links are relative to it).
        plots: ``{file name: caption}`` of the PNGs written.
        notes: lines about what could not be drawn (e.g. the gallery) and why.
        sources: the paths the runs were found under.
    """
    n_runs = sum(len(s.runs) for s in sections)
    n_rows = sum(len(s.rows) for s in sections)
    lines = ["# Retrieval report", ""]
    src = ", ".join(f"`{p}`" for p in sources)
    lines += [f"{n_runs} runs in {n_rows} rows" + (f", from {src}" if src else "")
              + (f"; {len(skipped)} skipped (listed at the end)" if skipped else "") + ".", "",
              ("Protocol: each run's epoch is selected on validation (t2v R@1, R@5, R@10), never on test; test is "
               "evaluated once. Raw scores and every post-processing or re-ranking are in tables of their own. "
               "Cells are the mean ± the sample standard deviation (ddof=1) over the seeds of a row (`seeds` "
               "column); a row of one seed has no ±. Recall in %, median and mean rank 1-based; the best mean of "
               "each column is in bold."), ""]
    for s in sections:
        lines += [f"## {s.title}", "", _split_line(s), ""]
        for variant in s.variants():
            for direction, name in DIRECTIONS.items():
                table = _table(s, variant, direction)
                if table:
                    title, what = SCORE_TITLES.get(variant, (f"after {variant}", ""))
                    lines += [f"### {name}, {title}", "", *([f"_{what}_", ""] if what else []), *table, ""]
        readouts = _readout_table(s)
        if readouts:
            lines += ["### Uncertainty readouts (test split)", "",
                      ("What each head logs about its uncertainty (pair readouts: mean over matching and "
                       "non-matching caption-video pairs; re-ranking readouts: over queries whose raw top-1 is "
                       "correct and the rest)."), "", *readouts, ""]
        lines += ["### Runs", "", *_runs_table(s, out), ""]
    if plots or notes:
        lines += ["## Plots", ""]
        for name, caption in plots.items():
            lines += [f"**{caption}**", "", f"![{name}]({name})", ""]
        lines += [f"- {n}" for n in notes]
        lines += [""] if notes else []
    if skipped:
        lines += ["## Skipped", "", *(f"- `{k.dir}`: {k.reason}" for k in skipped), ""]
    lines += ["The same numbers, unrounded: [report.csv](report.csv).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(sections: list[Section]) -> dict[str, Any]:
    """One colour per row label, the same in every plot and section (never grey: grey is the loss's)."""
    plt = _pyplot()
    labels = sorted({row.label for s in sections for row in s.rows})
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7] + list(plt.get_cmap("Dark2").colors)
    return {label: palette[i % len(palette)] for i, label in enumerate(labels)}


def _by_epoch(runs: list[RunRecord], column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Epochs, mean and sample std (0 where one run has that epoch) of ``column`` over ``runs``."""
    frames = [r.epochs[["epoch", column]] for r in runs if column in r.epochs.columns and len(r.epochs)]
    if not frames:
        return np.array([]), np.array([]), np.array([])
    g = pd.concat(frames).groupby("epoch")[column]
    return g.mean().index.to_numpy(), g.mean().to_numpy(), g.std(ddof=1).fillna(0.0).to_numpy()


def plot_curves(sections: list[Section], path: Path) -> bool:
    """``curves.png``: per row, validation t2v R@1 (mean over seeds, band ± std, a star at each
    run's selected epoch) and the training loss (grey, right axis) per epoch; one small panel per
    row, R@1 on one scale per dataset. Returns False (nothing written) when no run logged epochs."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    todo = [(s, [row for row in s.rows if any(len(r.epochs) for r in row.runs)]) for s in sections]
    todo = [(s, rows) for s, rows in todo if rows]
    if not todo:
        return False
    colours = _colours(sections)
    ncols = min(4, max(len(rows) for _, rows in todo))
    grid = [-(-len(rows) // ncols) for _, rows in todo]
    fig = plt.figure(figsize=(3.4 * ncols + 0.6, 2.7 * sum(grid) + 0.9 * len(todo) + 0.6))
    subfigs = np.atleast_1d(fig.subfigures(len(todo), 1, height_ratios=[g + 0.35 for g in grid]))
    for sub, (s, rows), nrows in zip(subfigs, todo, grid):
        sub.suptitle(s.title, fontsize=11, fontweight="bold")
        axes = sub.subplots(nrows, ncols, squeeze=False, gridspec_kw={"wspace": 0.55, "hspace": 0.55})
        r1_all = np.concatenate([r.epochs["val_t2v_R@1"].to_numpy() for row in rows for r in row.runs
                                 if "val_t2v_R@1" in r.epochs])
        pad = max(2.0, 0.08 * float(np.ptp(r1_all))) if len(r1_all) else 2.0
        for k, (ax, row) in enumerate(zip(axes.flat, rows)):
            colour = colours[row.label]
            n = sum(bool(len(r.epochs)) for r in row.runs)
            ep, mean, std = _by_epoch(row.runs, "val_t2v_R@1")
            marker = "o" if len(ep) <= 15 else None
            ax.plot(ep, mean, color=colour, lw=1.5, marker=marker, ms=3, zorder=3)
            if n > 1:
                ax.fill_between(ep, mean - std, mean + std, color=colour, alpha=0.25, lw=0, zorder=2)
            for r in row.runs:  # the epoch each run kept, chosen on validation
                sel = r.epochs[r.epochs["epoch"] == r.metrics.get("selected_epoch")]
                if len(sel):
                    ax.scatter(sel["epoch"], sel["val_t2v_R@1"], marker="*", s=90, color=colour,
                               edgecolors="black", linewidths=0.6, zorder=4)
            if len(r1_all):
                ax.set_ylim(float(r1_all.min()) - pad, float(r1_all.max()) + pad)
            loss_ax = ax.twinx()
            ep, mean, std = _by_epoch(row.runs, "loss")
            loss_ax.plot(ep, mean, color="0.45", lw=1.0, ls="--", zorder=1)
            if n > 1:
                loss_ax.fill_between(ep, mean - std, mean + std, color="0.6", alpha=0.2, lw=0)
            loss_ax.tick_params(axis="y", labelsize=7, colors="0.4")
            loss_ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(_wrap(row.label + (f" ({n} seeds)" if n > 1 else ""), 40), fontsize=8.5)
            ax.grid(alpha=0.3)
            if k % ncols == 0:
                ax.set_ylabel("val t2v R@1 (%)", fontsize=8)
            if k % ncols == ncols - 1 or k == len(rows) - 1:
                loss_ax.set_ylabel("training loss", fontsize=8, color="0.4")
            if k >= len(rows) - ncols:
                ax.set_xlabel("epoch", fontsize=8)
        for ax in axes.flat[len(rows):]:
            ax.set_visible(False)
    handles = [Line2D([], [], color="black", lw=1.5, label="validation t2v R@1 (mean over seeds)"),
               Patch(color="black", alpha=0.25, label="± std over seeds"),
               Line2D([], [], ls="", marker="*", ms=10, color="white", markeredgecolor="black",
                      label="epoch selected on validation"),
               Line2D([], [], color="0.45", ls="--", label="training loss (the head's total; right axis)")]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_r1(sections: list[Section], path: Path) -> None:
    """``r1.png``: test t2v R@1 (raw) per row, one horizontal bar each (long row names stay
    readable): bar = mean, error bar = sample std, dots = the seeds; one panel per dataset."""
    plt = _pyplot()
    colours = _colours(sections)
    heights = [0.42 * len(s.rows) + 1.0 for s in sections]
    fig, axes = plt.subplots(len(sections), 1, figsize=(8.5, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, s in zip(axes[:, 0], sections):
        rows = [row for row in s.rows if row.values("raw", "t2v", "R@1")][::-1]  # first row on top
        for i, row in enumerate(rows):
            values = row.values("raw", "t2v", "R@1")
            mean, std = _stats(values)
            ax.barh(i, mean, color=colours[row.label], alpha=0.8, height=0.7)
            if std is not None:
                ax.errorbar(mean, i, xerr=std, color="black", capsize=4, lw=1.2)
            offsets = np.linspace(-0.18, 0.18, len(values)) if len(values) > 1 else np.zeros(1)
            ax.scatter(values, i + offsets, color="black", s=14, zorder=3)
            text = f"{mean:.1f}" + (f" ± {std:.1f} ({len(values)} seeds)" if std is not None else "")
            ax.annotate(text, (max(values + [mean + (std or 0.0)]), i), xytext=(5, 0), textcoords="offset points",
                        va="center", fontsize=8)
        ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=8)
        ax.set_xlabel("test t2v R@1 (%), raw scores", fontsize=9)
        ax.set_title(s.title, fontsize=10)
        ax.set_xlim(0, 1.45 * max(max(r.values("raw", "t2v", "R@1")) for r in rows) + 1e-9)  # room for the text
        ax.grid(axis="x", alpha=0.3)
    fig.text(0.01, 0.005, "bar: mean over seeds; error bar: sample std (ddof=1); dots: individual seeds",
             fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_uncertainty(sections: list[Section], path: Path) -> bool:
    """``uncertainty.png``: each logged readout (x) against validation t2v R@1 (y), one point per
    epoch (colour = epoch; joined in order, per seed, up to 25 epochs); one panel per row and
    readout. False when no run logs readouts."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    panels = []
    for s in sections:
        for row in s.rows:
            names: dict[str, None] = {}
            for r in row.runs:
                names.update(dict.fromkeys(r.readout_series()))
            panels += [(s, row, name) for name in names]
    if not panels:
        return False
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols + 0.8, 3.8 * nrows), squeeze=False)
    max_epoch = max(int(r.epochs["epoch"].max()) for s, row, _ in panels for r in row.runs if len(r.epochs))
    norm = plt.Normalize(1, max(max_epoch, 2))
    cmap = plt.get_cmap("viridis")
    several = len(sections) > 1
    for ax, (s, row, name) in zip(axes.flat, panels):
        markers = {}
        for r in row.runs:
            cols = r.readout_series().get(name, [])
            for col in cols:
                kind = col[len(f"val_{name}_"):] if col != f"val_{name}" else ""
                marker = markers.setdefault(kind, "osD^v"[len(markers) % 5])
                x, y, ep = r.epochs[col].to_numpy(), r.epochs["val_t2v_R@1"].to_numpy(), r.epochs["epoch"].to_numpy()
                if len(ep) <= 25:  # the path in order; past that it hides the points (the colour gives the order)
                    ax.plot(x, y, color="grey", lw=0.8, alpha=0.6, zorder=1)
                ax.scatter(x, y, c=ep, cmap=cmap, norm=norm, marker=marker, s=22, zorder=2,
                           edgecolors="black", linewidths=0.3)
        for kind, marker in markers.items():
            if kind:
                ax.scatter([], [], marker=marker, color="white", edgecolors="black", label=kind)
        if any(markers):
            ax.legend(fontsize=7, loc="best")
        n = len(row.runs)
        title = f"{row.label}{f' ({n} seeds)' if n > 1 else ''}: {name}"
        ax.set_title(_wrap(f"{s.title}: {title}" if several else title, 48), fontsize=9)
        ax.set_xlabel(f"validation {name}", fontsize=9)
        ax.set_ylabel("validation t2v R@1 (%)", fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))  # readouts can differ in the 4th digit only
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    cax = fig.add_axes((0.945, 0.15, 0.012, 0.7))
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), cax=cax, label="epoch")
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


# ---------------------------------------------------------------------------------------------- gallery


def gallery_data(run_dir: str | os.PathLike[str], video_root: str | os.PathLike[str] | None = None,
                 manifest: str | os.PathLike[str] | None = None, queries: int = 4, seed: int = 0,
                 device: str = "cpu") -> Gallery:
    """The gallery of one run: a few test captions and their top-ranked test videos by raw score.

    The captions are the first ``queries`` of a permutation of the store's test captions drawn with
    ``numpy.random.default_rng(seed)`` (so more queries show the same captions and more), in store
    order. Each is scored against every test video with the run's selected checkpoint
    (``checkpoints/best.safetensors``) through the evaluation engine: the raw scores behind the
    run's test metrics (a pair's score does not depend on which other captions are scored, so only
    the chosen captions are read and encoded).

    Args:
        run_dir: a finished train-head run whose feature store is still where it was.
        video_root: the folder the store's video paths are relative to; default: the manifest's
            ``video_root`` (``meta.json``).
        manifest: a manifest folder (``captions.parquet``) for the caption texts and clip bounds.
        queries: how many test captions.
        seed: seed of the choice of captions.
        device: where the head runs.

    Raises:
        GalleryUnavailable: no store, no video root, none of the needed videos exists, or the
            manifest does not hold the store's captions.

    Example:
        >>> g = gallery_data("runs/xpool", video_root="data/videos", manifest="data/manifest")  # doctest: +SKIP
        >>> g.queries[0].top[0]  # doctest: +SKIP
        ('video7', 0.61)
    """
    from tvrpipe.evaluation.metrics import t2v_ranks
    from tvrpipe.pipeline.store import StoreError, open_store
    from tvrpipe.training.data import load_split, store_split_rows
    from tvrpipe.training.fit import _read_config, checkpoint_similarity

    if queries < 1:
        raise ConfigError(f"--queries must be >= 1, got {queries}")
    run = Path(run_dir)
    config = _read_config(run)
    if not config.get("features"):
        raise GalleryUnavailable(f"{run} was trained on live CLIP features (finetune) and names no feature "
                                 "store; choose a train-head run with --gallery-run")
    try:
        store = open_store(config["features"], expect=config["provenance"])
    except StoreError as e:
        raise GalleryUnavailable(f"the feature store of {run} cannot be read ({e})") from None
    man = _read_manifest(manifest) if manifest is not None else None
    root = _video_root(video_root, man, manifest)

    rows = store_split_rows(store)
    pick = np.random.default_rng(seed).permutation(len(rows.test_texts))[:queries]  # more queries: a superset
    split = load_split(store, "test", rows, text_subset=np.sort(pick))

    sim = checkpoint_similarity(run / "checkpoints" / "best.safetensors", split, device)  # (queries, n_videos)
    ranks = t2v_ranks(sim, split.text_video)
    texts = dict(zip(man.captions["caption_id"], man.captions["text"])) if man is not None else {}
    missing = [c for c in split.caption_ids if c not in texts] if man is not None else []
    if missing:
        raise GalleryUnavailable(f"--manifest {manifest} does not hold the captions of the store of {run} (e.g. "
                                 f"{missing[0]}); pass the manifest the store was extracted from")
    out = []
    for i in range(split.n_texts):
        order = np.argsort(-sim[i], kind="stable")[:GALLERY_TOP]
        truth = split.text_video[i]
        out.append(GalleryQuery(str(split.caption_ids[i]), texts.get(split.caption_ids[i]),
                                str(split.video_ids[truth]), int(ranks[i]), float(sim[i, truth]),
                                [(str(split.video_ids[j]), float(sim[i, j])) for j in order]))
    paths, clips = _video_paths(store, man)
    need = {v for q in out for v, _ in q.top} | {q.video_id for q in out}
    if not any(v in paths and (root / paths[v]).is_file() for v in need):
        example = next((str(root / paths[v]) for v in sorted(need) if v in paths), "no paths recorded")
        raise GalleryUnavailable(f"videos not reachable under {root} (e.g. {example}); pass --video-root, the "
                                 "folder the manifest's paths are relative to")
    return Gallery(run, out, root, {v: paths[v] for v in need if v in paths},
                   {v: clips[v] for v in need if v in clips}, set(store.failures["video_id"]) & need)


def _read_manifest(manifest: str | os.PathLike[str]):
    from tvrpipe.pipeline.manifest import read_manifest

    return read_manifest(manifest)


def _video_root(video_root, man, manifest) -> Path:
    if video_root is not None:
        root = Path(video_root)
        if not root.is_dir():
            raise GalleryUnavailable(f"videos not reachable under {root} (--video-root is not a directory)")
        return root
    if man is not None and man.meta.get("video_root"):
        return (Path(manifest) / man.meta["video_root"]).resolve()
    raise GalleryUnavailable("no video root: pass --video-root (and --manifest for the caption texts) to draw it")


def _video_paths(store, man) -> tuple[dict[str, str], dict[str, tuple[float | None, float | None]]]:
    """Each video's path (the store's sidecar, else the manifest's) and clip bounds (the manifest's)."""
    paths: dict[str, str] = {}
    clips: dict[str, tuple[float | None, float | None]] = {}
    if man is not None:
        v = man.videos
        paths.update(zip(v["video_id"], v["path"]))
        if "start_s" in v.columns and "end_s" in v.columns:
            for vid, a, b in zip(v["video_id"], v["start_s"], v["end_s"]):
                if pd.notna(a) or pd.notna(b):
                    clips[vid] = (float(a) if pd.notna(a) else None, float(b) if pd.notna(b) else None)
    if "path" in store.videos.columns:
        paths.update(zip(store.videos["video_id"], store.videos["path"]))
    return paths, clips


def _thumbnails(g: Gallery) -> dict[str, np.ndarray | str]:
    """Middle frame of each video of the gallery (uint8 S x S x 3), or why it could not be read.

    Decoded in this process (no killable worker: its start-up costs seconds, and these videos were
    decoded once already by ``tvrpipe extract``; those that failed there are not decoded again).
    """
    from tvrpipe.pipeline.decode import decode_video

    thumbs: dict[str, np.ndarray | str] = {}
    for vid in sorted({v for q in g.queries for v, _ in q.top} | {q.video_id for q in g.queries}):
        if vid in g.failed:
            thumbs[vid] = "failed at extraction"
        elif vid not in g.paths or not (g.video_root / g.paths[vid]).is_file():
            thumbs[vid] = "file missing"
        else:
            start, end = g.clips.get(vid, (None, None))
            try:  # one frame sampled = the centre of the one segment: the middle frame
                thumbs[vid] = decode_video(g.video_root / g.paths[vid], 1, THUMB_SIZE, start, end).frames[0]
            except TvrpipeError as e:
                log.warning("gallery: %s", e)
                thumbs[vid] = "cannot decode"
    return thumbs


def _thumb(ax, image: np.ndarray | str | None, colour: str, width: float) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    if isinstance(image, np.ndarray):
        ax.imshow(image)
    else:  # why there is no frame: file missing, failed at extraction, cannot decode
        ax.set_facecolor("0.85")
        ax.text(0.5, 0.5, image or "?", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    for spine in ax.spines.values():
        spine.set_color(colour)
        spine.set_linewidth(width)


def plot_gallery(g: Gallery, path: Path) -> None:
    """``gallery.png``: per caption, its top-5 videos by raw score (middle frames), the correct one
    framed in green; when the correct video ranks lower, it is shown apart on the right with its
    rank. The caption (or its id) and the rank of the correct video head each row."""
    plt = _pyplot()
    green = "#1a9e3a"
    thumbs = _thumbnails(g)
    n = len(g.queries)
    fig = plt.figure(figsize=(2.0 * (GALLERY_TOP + 1.3), 2.75 * n + 0.8))
    head, *subfigs = fig.subfigures(n + 1, 1, height_ratios=(0.8, *[2.75] * n))
    head.text(0.5, 0.7, _wrap(f"Retrieval gallery of {g.run}", 110), ha="center", va="center", fontsize=10,
              fontweight="bold")
    head.text(0.5, 0.35, f"the top-{GALLERY_TOP} test videos of each caption by raw score (middle frames); "
              "green: the correct video", ha="center", va="center", fontsize=9)
    for sub, q in zip(subfigs, g.queries):
        caption = f"\u201c{q.text}\u201d" if q.text is not None else f"caption {q.caption_id}"
        sub.suptitle(_wrap(f"{caption}  \u2014  correct video ({q.video_id}) at rank {q.rank}", 100),
                     fontsize=9, y=0.99)
        axes = sub.subplots(1, GALLERY_TOP + 2, gridspec_kw={"width_ratios": [1] * GALLERY_TOP + [0.3, 1]})
        axes[GALLERY_TOP].set_visible(False)  # a gap before the correct video, when shown apart
        for k, ax in enumerate(axes[:GALLERY_TOP]):
            if k >= len(q.top):
                ax.set_visible(False)
                continue
            vid, score = q.top[k]
            correct = vid == q.video_id
            _thumb(ax, thumbs.get(vid), green if correct else "0.7", 5 if correct else 0.8)
            ax.set_title(f"#{k + 1}" + ("  \u2713 correct" if correct else ""), fontsize=9,
                         color=green if correct else "black", fontweight="bold" if correct else "normal")
            ax.set_xlabel(f"{vid}\nscore {score:.3f}", fontsize=7)
        ax = axes[-1]
        if q.rank <= GALLERY_TOP:
            ax.set_visible(False)
            continue
        _thumb(ax, thumbs.get(q.video_id), green, 5)
        ax.set_title(f"\u2713 correct: #{q.rank}", fontsize=9, color=green, fontweight="bold")
        ax.set_xlabel(f"{q.video_id}\nscore {q.score:.3f}", fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- report


def _best_run(runs: list[RunRecord], manifest: str | os.PathLike[str] | None) -> RunRecord | None:
    """The run the gallery shows by default: among train-head runs (they name a store), those whose
    store was extracted from ``manifest`` when one is given (if any), the highest validation t2v
    (R@1, R@5, R@10): the protocol's selection key, so the test split picks nothing here either."""
    from tvrpipe.pipeline.store import manifest_sha256

    candidates = [r for r in runs if r.config.get("features")]
    if manifest is not None and candidates:
        man = _read_manifest(manifest)
        sha = manifest_sha256(man.videos, man.captions)
        candidates = [r for r in candidates if (r.config.get("provenance") or {}).get("manifest_sha256") == sha] \
            or candidates
    if not candidates:
        return None
    return max(candidates, key=lambda r: (tuple((r.metrics.get("val") or {}).get("t2v", {}).get(m, 0.0)
                                                for m in ("R@1", "R@5", "R@10")), str(r.dir)))


def write_report(
    runs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str] = "report",
    video_root: str | os.PathLike[str] | None = None,
    manifest: str | os.PathLike[str] | None = None,
    gallery_queries: int = 4,
    seed: int = 0,
    gallery_run: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``report.md``, ``report.csv`` and the PNG plots of the finished runs under ``runs``.

    Args:
        runs: run directories, or folders holding runs at any depth.
        out: the report folder (created; files in it are replaced).
        video_root: the videos' folder, for the gallery; default: the manifest's.
        manifest: a manifest folder, for the gallery's caption texts (else caption ids are shown).
        gallery_queries: test captions in the gallery.
        seed: seed of the choice of gallery captions.
        gallery_run: the run whose retrievals the gallery shows; default: the best validation t2v R@1.

    Returns:
        The path of ``report.md``.

    Raises:
        ConfigError: a path holds no run, no run is finished, or an option is invalid.

    Example:
        >>> write_report(["runs/"], "report", video_root="data/videos", manifest="data/manifest")  # doctest: +SKIP
        PosixPath('report/report.md')
    """
    from tvrpipe.lock import check_writable
    from tvrpipe.pipeline.store import atomic_write_text

    if gallery_queries < 1:
        raise ConfigError(f"--queries must be >= 1, got {gallery_queries}")
    if not runs:
        raise ConfigError("name at least one run directory (or a folder that holds runs)")
    check_writable(out, "--out")
    found, skipped = find_runs(runs)
    for s in skipped:
        log.warning("skipped %s: %s", s.dir, s.reason)
    if not found:
        raise ConfigError(f"no finished runs under {', '.join(map(str, runs))}: "
                          + "; ".join(f"{s.dir}: {s.reason}" for s in skipped[:3]))
    chosen = None
    if gallery_run is not None:
        chosen = next((r for r in found if r.dir.resolve() == Path(gallery_run).resolve()), None)
        if chosen is None:
            raise ConfigError(f"--gallery-run {gallery_run}: not one of the finished runs reported")
    sections = group_runs(found)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("curves.png", "r1.png", "uncertainty.png", "gallery.png"):  # no stale plot of an earlier report
        (out_dir / name).unlink(missing_ok=True)

    plots: dict[str, str] = {}
    notes: list[str] = []
    if plot_curves(sections, out_dir / "curves.png"):
        plots["curves.png"] = ("Validation t2v R@1 and training loss per epoch, per row (mean over seeds, band: ± std; "
                               "star: the epoch each run selected on validation)")
    else:
        notes.append("curves: no run logged epochs (zero-epoch runs only)")
    plot_r1(sections, out_dir / "r1.png")
    plots["r1.png"] = "Test t2v R@1 (raw) per row: mean, sample std, and each seed"
    if plot_uncertainty(sections, out_dir / "uncertainty.png"):
        plots["uncertainty.png"] = ("Uncertainty readouts against validation t2v R@1 across epochs "
                                    "(runs that log readouts; colour: epoch)")
    else:
        notes.append("uncertainty: no run logs uncertainty readouts")
    chosen = chosen or _best_run(found, manifest)
    if chosen is None:
        notes.append("gallery: no train-head run (with a feature store) to score; choose one with --gallery-run")
    else:
        try:
            g = gallery_data(chosen.dir, video_root, manifest, gallery_queries, seed)
            plot_gallery(g, out_dir / "gallery.png")
            plots["gallery.png"] = (f"Retrieval gallery of {chosen.dir} ({chosen.method}): top-{GALLERY_TOP} test "
                                    f"videos by raw score for {len(g.queries)} test captions (seed {seed}), middle "
                                    "frames; green: the correct video")
        except TvrpipeError as e:  # no store, no videos, a damaged checkpoint: the tables still stand
            log.warning("gallery skipped: %s", e)
            notes.append(f"gallery: {e}")
    text = render_markdown(sections, skipped, out_dir, plots, notes, runs)
    atomic_write_text(out_dir / "report.md", text)
    rows = _csv_rows(sections)
    atomic_write_text(out_dir / "report.csv", pd.DataFrame(rows).to_csv(index=False))
    log.info("report of %d runs written to %s", len(found), out_dir / "report.md")
    return out_dir / "report.md"
