"""The report's figures: validation curves per epoch, test R@1 per row, and readouts against R@1."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.report.runs import RunRecord
from tvrpipe.report.tables import Section, mean_std

# ---------------------------------------------------------------------------------------------- plots


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(sections: list[Section]) -> dict[str, Any]:
    """One colour per row label, the same in every plot and section (never grey: grey is the loss's)."""
    plt = pyplot()
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
    plt = pyplot()
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
            ax.set_title(wrap_text(row.label + (f" ({n} seeds)" if n > 1 else ""), 40), fontsize=8.5)
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
    plt = pyplot()
    colours = _colours(sections)
    heights = [0.42 * len(s.rows) + 1.0 for s in sections]
    fig, axes = plt.subplots(len(sections), 1, figsize=(8.5, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, s in zip(axes[:, 0], sections):
        rows = [row for row in s.rows if row.values("raw", "t2v", "R@1")][::-1]  # first row on top
        for i, row in enumerate(rows):
            values = row.values("raw", "t2v", "R@1")
            mean, std = mean_std(values)
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
    plt = pyplot()
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
        ax.set_title(wrap_text(f"{s.title}: {title}" if several else title, 48), fontsize=9)
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


def wrap_text(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text
