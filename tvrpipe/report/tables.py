"""The papers' tables from runs: rows of runs that differ only in their seed (mean ± std), named by
the settings that tell them apart; ``report.md`` and ``report.csv``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from tvrpipe.environment import versions_text
from tvrpipe.evaluation.metrics import bootstrap_recall, paired_recall_difference
from tvrpipe.files import gb
from tvrpipe.report.runs import DIRECTIONS, RunRecord, Skipped
from tvrpipe.rundir import METRICS, ordered_variants
from tvrpipe.training.finetune.config import EXECUTION as FINETUNE_EXECUTION
from tvrpipe.training.recipes import Published
from tvrpipe.training.settings import EXECUTION_FIELDS as TRAIN_EXECUTION

HIGHER_IS_BETTER = {"R@1": True, "R@5": True, "R@10": True, "MdR": False, "MnR": False}
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
# settings that do not change what a run learns: runs differing only in these share a row
# how a run executed, never what it learnt: runs that differ only in these share a row (and its paired tests), and
# the runs table shows them; data (in memory or streamed) is a section of config.yaml of its own, outside identity
_NOT_IDENTITY = frozenset({"seed", *TRAIN_EXECUTION, *FINETUNE_EXECUTION})
_HASH = re.compile(r"^[0-9a-f]{32,}$")


@dataclass
class Row:
    """One row of the tables: runs identical but for their seed and how they ran.

    Runs of one seed that differ only in how they ran (device, batches, prefetching) are repeats of one
    experiment, not more seeds: a row's values are one per seed, the mean of that seed's runs, so its mean and
    sample std are over seeds.
    """

    label: str
    method: str
    runs: list[RunRecord]
    identity: dict[str, Any]

    def seed_runs(self, variant: str = "raw", direction: str = "t2v") -> list[list[RunRecord]]:
        """The row's runs that report this score variant, one list per seed (in seed order; each seed's runs in
        directory order)."""
        groups: dict[Any, list[RunRecord]] = {}
        for r in self.runs:
            if r.scores(variant, direction) is not None:
                groups.setdefault(r.seed, []).append(r)
        return [sorted(g, key=lambda r: str(r.dir)) for g in groups.values()]

    def values(self, variant: str, direction: str, metric: str) -> list[float]:
        """The metric of each seed that reports this score variant (the mean of its runs), in seed order."""
        return [float(np.mean([float(r.scores(variant, direction)[metric]) for r in runs]))
                for runs in self.seed_runs(variant, direction)]

    @property
    def seeds(self) -> list[int | None]:
        """The row's distinct seeds, in order."""
        return list(dict.fromkeys(r.seed for r in self.runs))

    def ranked_run(self, direction: str) -> RunRecord | None:
        """The run whose test ranks stand for a row of one seed (its bootstrap interval and paired tests): the
        first by directory name of that seed's runs that kept their ranks; None for a row of several seeds (they
        show their spread instead) or without ranks."""
        seeds = self.seed_runs("raw", direction)
        if len(seeds) != 1:
            return None
        return next((r for r in seeds[0] if r.test_ranks is not None), None)

    def interval(self, variant: str, direction: str) -> tuple[float, float] | None:
        """The 95 % bootstrap interval of R@1 over the test queries (:func:`bootstrap_recall`) of a row of one seed,
        raw scores only, from :meth:`ranked_run`'s ranks; None otherwise."""
        run = self.ranked_run(direction) if variant == "raw" else None
        return None if run is None else bootstrap_recall(run.test_ranks[direction], k=1)

    @cached_property  # read once: every table and CSV line of the row asks
    def published(self) -> PublishedRow | None:
        """The paper's published row for the recipe the row's runs trained from, or why it is left out
        (:func:`published_row`); None when no run of the row was trained from a recipe."""
        return published_row([r.config.get("recipe") for r in self.runs])


@dataclass(frozen=True)
class PublishedRow:
    """What the report prints under a row trained from a recipe.

    Attributes:
        name: the recipe's name.
        numbers: the paper's published numbers, as the recipe held them when the runs trained; None
            when the row is left out.
        differs: the settings in which the runs differ from the recipe (overridden, or fixed by the
            trainer: train-head never trains CLIP), named in the row's label.
        left_out: why the published row is not printed (the runs are not the experiment it describes).
    """

    name: str
    numbers: Published | None
    differs: tuple[str, ...] = ()
    left_out: str = ""


def published_row(records: Sequence[dict | None]) -> PublishedRow | None:
    """The published row that describes runs whose ``config.yaml`` recorded ``records`` (their ``recipe``
    blocks, :meth:`~tvrpipe.training.recipes.Recipe.record`), or why there is none.

    The numbers are the ones the recipe held when the runs trained (its file's sha256 is recorded beside
    them), never those of a file of the same name today. They are printed only where every run trained from
    the same recipe file on its dataset, split set, backbone and weights; a run that changed other
    settings keeps the row, which names them.
    """
    if not any(records):
        return None
    first = next(r for r in records if r)
    # a shipped recipe by its name; a file of the user's by its path (it may bear a shipped recipe's name)
    name = str(first.get("name")) if first.get("shipped", True) else str(first.get("path"))
    if any(not r or r.get("sha256") != first.get("sha256") for r in records):
        return PublishedRow(name, None, left_out="the row's runs were not all trained from one recipe file")
    snapshot = first.get("published", _MISSING)
    if snapshot is _MISSING:  # recorded before runs kept their recipe's numbers: only an unchanged file has them
        return PublishedRow(name, None, left_out="the run predates the check of a run's data and backbone against "
                                                 "its recipe; train it again to compare it with the paper")
    if snapshot is None:
        return PublishedRow(name, None, left_out="its paper prints no row for this recipe")
    mismatch = list(dict.fromkeys(m for r in records for m in r.get("mismatch") or ()))
    if mismatch:
        return PublishedRow(name, None, left_out="the paper's row is another experiment: " + "; ".join(mismatch))
    differs = tuple(dict.fromkeys(k for r in records for k in (r.get("differs") or {})))
    numbers = Published(str(snapshot["source"]), str(snapshot["backbone"]),
                        {d: snapshot[d] for d in DIRECTIONS if snapshot.get(d)}, str(snapshot.get("note") or ""))
    return PublishedRow(name, numbers, differs)


_MISSING = object()


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
        """Score variants any run of the section reports, in :data:`~tvrpipe.rundir.SCORE_VARIANTS`
        order (raw first), then any other by name."""
        return ordered_variants({v for run in self.runs for v in run.test.variants()} | {"raw"})


# ---------------------------------------------------------------------------------------------- rows


def _identity(run: RunRecord) -> dict[str, Any]:
    """Everything that defines what a run learnt, flattened; the seed and execution settings left out."""
    flat: dict[str, Any] = {"mode": run.mode}
    flat.update({f"store.{k}": v for k, v in (run.config.get("provenance") or {}).items()})
    flat.update({f"head.{k}": v for k, v in (run.config.get("head") or {}).items()})
    section = "finetune" if "finetune" in run.config else "train"
    settings = run.settings
    flat.update({f"{section}.{k}": v for k, v in settings.items() if k not in _NOT_IDENTITY})
    resolved = run.config.get("resolved") or {}
    if isinstance(resolved.get("lr_groups"), dict):  # the rates the groups trained at, not the options behind them
        for k in ("lr", "group_lr", "head_lr", "clip_lr"):
            flat.pop(f"{section}.{k}", None)
        rates = {g: r["lr"] for g, r in resolved["lr_groups"].items()}
        flat[f"{section}.lr"] = (None if not rates else next(iter(rates.values())) if len(set(rates.values())) == 1
                                 else rates)
    elif resolved.get("lr") is not None and settings.get("lr") is None:  # a head's default_lr, which can change
        flat["train.lr"] = resolved["lr"]
    if resolved.get("batch_size") is not None:  # the batch used (every training video, when fewer)
        flat[f"{section}.batch_size"] = resolved["batch_size"]
    if section == "train" and settings.get("epochs") == 0:  # nothing trained: only the head and the data count
        flat = {k: v for k, v in flat.items() if not k.startswith("train.") or k == "train.epochs"}
    if run.config.get("max_steps") is not None:
        flat["train.max_steps"] = run.config["max_steps"]
    return flat


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str) and _HASH.match(v):
        return v[:8]
    return str(v)


ZERO_SHOT_START_KEY = "head.zero_shot_start"


def _not_in_papers(identity: dict[str, Any]) -> str:
    """The mark of a run that trained something no paper does (train-head --zero-shot-start)."""
    return " + zero-shot start (not in the papers)" if identity.get(ZERO_SHOT_START_KEY) else ""


def _labels(method: str, identities: list[dict[str, Any]]) -> list[str]:
    """Name each group of one method by the settings that tell it apart from the others.

    A group shows a setting when some other group has that setting with another value (settings
    that only one of two groups has, such as a finetune run's against a train-head run's, are
    told apart by ``mode``), in the order mode, head, trainer, store.
    """
    if len(identities) == 1:  # a finetune run still says so: its row never reads like a train-head one
        mode = identities[0].get("mode", "train-head")
        return [(method if mode == "train-head" else f"{method} ({mode})") + _not_in_papers(identities[0])]
    order = {"mode": 0, "head": 1, "train": 2, "finetune": 2, "store": 3}
    values = [{k: json.dumps(v, sort_keys=True, default=str) for k, v in ident.items()} for ident in identities]
    shown: list[list[str]] = []
    for i, mine in enumerate(values):
        keys = [k for k in mine if k != ZERO_SHOT_START_KEY
                and any(k in other and other[k] != mine[k] for j, other in enumerate(values) if j != i)]
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
        labels.append((f"{method} ({', '.join(parts)})" if parts else method) + _not_in_papers(ident))
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


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1; None for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else None


# ---------------------------------------------------------------------------------------------- tables


def _cell(values: list[float], digits: int = 1) -> str:
    mean, std = mean_std(values)
    if not np.isfinite(mean):  # e.g. a readout over "incorrect" queries when every query was correct
        return "n/a"
    return f"{mean:.{digits}f}" if std is None else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _table(section: Section, variant: str, direction: str) -> list[str]:
    """Markdown lines of one paper-style table; the best mean of each column in bold."""
    rows = [row for row in section.rows if row.values(variant, direction, "R@1")]
    if not rows:
        return []
    means = {m: [mean_std(row.values(variant, direction, m))[0] for row in rows] for m in METRICS}
    best = {m: (max if HIGHER_IS_BETTER[m] else min)(v) for m, v in means.items()}
    head = "| Method | seeds | " + " | ".join(f"{m}{'↑' if HIGHER_IS_BETTER[m] else '↓'}" for m in METRICS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(METRICS)]
    for i, row in enumerate(rows):
        cells = []
        for m in METRICS:
            text = _cell(row.values(variant, direction, m))
            text = f"**{text}**" if len(rows) > 1 and means[m][i] == best[m] else text
            interval = row.interval(variant, direction) if m == "R@1" else None
            cells.append(text if interval is None else f"{text} [{interval[0]:.1f}, {interval[1]:.1f}]")
        lines.append(f"| {row.label} | {_seeds_cell(row, variant, direction)} | " + " | ".join(cells) + " |")
        published = row.published if variant == "raw" else None  # the papers print raw scores
        if published and published.left_out:
            lines.append(f"| ↳ no published row (recipe {published.name}): {published.left_out} | – | "
                         + " | ".join("–" for _ in METRICS) + " |")
        elif published and direction in published.numbers.metrics:
            values = published.numbers.metrics[direction]
            lines.append(f"| {_published_label(published)} | – | "
                         + " | ".join("–" if values[m] is None else f"{values[m]:.1f}" for m in METRICS) + " |")
        elif published:
            lines.append(f"| ↳ no published row (recipe {published.name}): its paper prints no {direction} row | – | "
                         + " | ".join("–" for _ in METRICS) + " |")
    return lines


def _seeds_cell(row: Row, variant: str, direction: str) -> str:
    """The seeds behind a row's cells: their count, and the runs where a seed ran more than once (averaged into
    its one value)."""
    seeds = row.seed_runs(variant, direction)
    runs = sum(map(len, seeds))
    return str(len(seeds)) if runs == len(seeds) else f"{len(seeds)} ({runs} runs)"


def _published_label(published: PublishedRow) -> str:
    differs = f"; the runs differ in {', '.join(published.differs)}" if published.differs else ""
    return f"↳ published ({published.numbers.source}; recipe {published.name}{differs})"


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
        names: dict[str, list[list[float]]] = {}  # readout -> each seed's values (one per run of it)
        for runs in row.seed_runs():
            seen: dict[str, list[float]] = {}
            for run in runs:
                for name, r in (run.metrics["test"].get("readouts") or {}).items():
                    for kind, v in (r.items() if isinstance(r, dict) else [("", r)]):
                        seen.setdefault(f"{name} ({kind})" if kind else name, []).append(float(v))
            for name, values in seen.items():
                names.setdefault(name, []).append(values)
        lines += [f"| {row.label} | {name} | {_cell([float(np.mean(v)) for v in per_seed], 4)} |"
                  for name, per_seed in names.items()]
    return ["| Method | readout | mean on test |", "|---|---|---:|", *lines] if lines else []


def _link(path: Path, out: Path) -> str:
    rel = os.path.relpath(path.resolve(), out.resolve())
    return f"[{path}]({rel.replace(os.sep, '/')})"


def _runs_table(section: Section, out: Path) -> list[str]:
    lines = ["| Method | seed | selected epoch | epochs run | ran with | versions | run |",
             "|---|---:|---:|---:|---|---|---|"]
    for row in section.rows:
        for r in row.runs:
            lines.append(f"| {row.label} | {r.seed} | {r.metrics.get('selected_epoch', '?')} | {_epochs_run(r)} | "
                         f"{execution_text(r.config)} | {_versions_cell(r.config)} | {_link(r.dir, out)} |")
    return lines


def _epochs_run(r) -> int:
    """The last epoch a run trained: its ``epochs.csv``'s last row (a row per validated epoch: one per epoch, or
    one every k on a store of few steps an epoch, docs/training.md)."""
    return int(r.epochs["epoch"].iloc[-1]) if len(r.epochs) else 0


def execution_text(config: dict) -> str:
    """How a run executed, from its config.yaml: the execution settings that tell runs of one row apart (device,
    memory budget, prefetch, workers...) and its data mode, e.g. ``cpu, streamed, memory_budget=2.0 MB``."""
    if "finetune" in config:
        ex = dict(config.get("execution") or {})
        parts = ["gpu" if ex.pop("use_gpu", False) else "cpu"]
        parts += [f"{k}={_fmt_value(v)}" for k, v in ex.items() if k in ("num_workers", "address") and v]
    else:
        train = config.get("train") or {}
        parts = [str(train.get("device", "cpu")), str((config.get("data") or {}).get("mode", "in memory"))]
        if train.get("memory_budget") is not None:
            parts.append(f"memory_budget={gb(train['memory_budget'])}")
        if train.get("prefetch") is False:
            parts.append("no prefetch")
    return ", ".join(parts).replace("|", "\\|")


def _versions_cell(config: dict) -> str:
    """The software a run was trained with (its config's ``versions``), and any it was resumed with."""
    text = versions_text(config.get("versions"))
    for other in config.get("resumed_with") or []:
        text += f"; resumed with {versions_text(other)}"
    return text.replace("|", "\\|")


def csv_rows(sections: list[Section]) -> list[dict]:
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
                           "seeds": len({r.seed for r in runs}), "seed_values": " ".join(str(r.seed) for r in runs)}
                    for m in METRICS:
                        mean, std = mean_std(row.values(variant, direction, m))
                        rec[m], rec[f"{m} std"] = mean, std
                    interval = row.interval(variant, direction)
                    rec["R@1 95% low"], rec["R@1 95% high"] = interval if interval else (None, None)
                    rec["runs"] = " ".join(str(r.dir) for r in runs)
                    rec["versions"] = " / ".join(dict.fromkeys(_versions_cell(r.config) for r in runs))
                    rec["ran with"] = " / ".join(dict.fromkeys(execution_text(r.config) for r in runs))
                    rows.append(rec)
                    published = row.published if variant == "raw" else None
                    line = {**{k: rec[k] for k in ("dataset", "split_set", "split", "direction", "method")},
                            "n_videos": None, "n_texts": None, "row": f"{row.label}: published", "seeds": 0,
                            "seed_values": "", "versions": "", "ran with": ""}
                    if published and published.left_out:  # said here too, not only in report.md
                        rows.append({**line, "scores": "published-left-out",
                                     **{k: None for m in METRICS for k in (m, f"{m} std")},
                                     "runs": f"recipe {published.name}: {published.left_out}"})
                    elif published and direction in published.numbers.metrics:
                        pub = published.numbers
                        differs = f"; the runs differ in {' '.join(published.differs)}" if published.differs else ""
                        rows.append({**line, "scores": "published",
                                     **{k: v for m, x in pub.metrics[direction].items()
                                        for k, v in ((m, x), (f"{m} std", None))},
                                     "runs": f"{pub.source} ({pub.backbone}), recipe {published.name}{differs}"})
    return rows


def paired_table(section: Section, direction: str = "t2v") -> list[str]:
    """Markdown lines: each pair of the section's rows of one seed that ranked the same test queries, the difference
    of their R@1 with its paired 95 % bootstrap interval (:func:`paired_recall_difference`), marked "within
    noise" where the interval covers 0. A row stands by the run its interval comes from (:meth:`Row.ranked_run`)."""
    rows = [(row, run) for row in section.rows if (run := row.ranked_run(direction)) is not None]
    lines = []
    for i, (a, run_a) in enumerate(rows):
        ra = run_a.test_ranks
        for b, run_b in rows[i + 1:]:
            rb = run_b.test_ranks
            if not np.array_equal(ra["caption_ids"], rb["caption_ids"]) or not np.array_equal(
                    ra["video_ids"], rb["video_ids"]):
                continue  # not the same queries: no pairing
            d, lo, hi = paired_recall_difference(ra[direction], rb[direction], k=1)
            verdict = "within noise" if lo <= 0 <= hi else ("a higher" if lo > 0 else "b higher")
            lines.append(f"| {a.label} | {b.label} | {d:+.1f} | [{lo:+.1f}, {hi:+.1f}] | {verdict} |")
    if not lines:
        return []
    return ["| a | b | R@1 a − b | 95 % interval | |", "|---|---|---:|---:|---|", *lines]


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
               "column; the runs of a seed that differ only in how they ran are averaged into one value); a row of "
               "one seed has no ±, and its raw R@1 has [the 95 % bootstrap interval over the test queries] instead, "
               "where a run kept its ranks (test_ranks.npz; of a seed run more than once, its first run by directory "
               "name). Recall in %, median and mean rank 1-based; the best mean of "
               "each column is in bold. Under a row trained from a recipe, ↳ published is what its paper prints "
               "for that row, as the recipe held it when the runs trained, naming the settings in which the runs "
               "differ from the recipe; it is left out, saying why, where the runs' dataset, split set, backbone or "
               "weights are not the recipe's (docs/reproduce.md says why ours may differ)."), ""]
    for s in sections:
        lines += [f"## {s.title}", "", _split_line(s), ""]
        for variant in s.variants():
            for direction, name in DIRECTIONS.items():
                table = _table(s, variant, direction)
                if table:
                    title, what = SCORE_TITLES.get(variant, (f"after {variant}", ""))
                    lines += [f"### {name}, {title}", "", *([f"_{what}_", ""] if what else []), *table, ""]
        for direction, name in DIRECTIONS.items():
            paired = paired_table(s, direction)
            if paired:
                lines += [f"### Which differences are noise: {name}, raw R@1", "",
                          ("Each pair of rows of one seed that ranked the same test queries (a seed run more "
                           "than once: its first run by directory name): the difference of their R@1 and "
                           "its 95 % interval from a paired bootstrap over the queries (2,000 resamples, each "
                           "drawing the queries once for both runs). Where the interval covers 0 the difference is "
                           "within the noise of this test set."), "", *paired, ""]
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
