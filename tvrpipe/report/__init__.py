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
show; the runs of one seed are repeats of one experiment, averaged into one value first; a row
of one seed has no ±, and its raw R@1 the bootstrap interval of its first run by directory name).
Each row is named by its method plus the settings that tell it apart from the other rows of that
method, e.g. ``xpool (num_heads=2)``. Nothing here depends on
which head a run holds: readouts are whatever a run logged (``val_<name>[_<kind>]`` columns of
``epochs.csv``, ``readouts`` in ``metrics.json``), post-processings whatever ``t2v_<name>`` /
``v2t_<name>`` keys its test metrics hold.
"""


from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.report.gallery import (
    GALLERY_TOP,
    Gallery,
    GalleryQuery,
    GalleryUnavailable,
    gallery_data,
    plot_gallery,
)
from tvrpipe.report.plots import plot_curves, plot_r1, plot_uncertainty
from tvrpipe.report.runs import RunRecord, Skipped, find_runs
from tvrpipe.report.tables import Row, Section, csv_rows, group_runs, render_markdown

__all__ = ["Gallery", "GalleryQuery", "GalleryUnavailable", "Row", "RunRecord", "Section", "Skipped", "find_runs",
           "gallery_data", "group_runs", "plot_curves", "plot_gallery", "plot_r1", "plot_uncertainty",
           "render_markdown", "write_report"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- report


def _best_run(runs: list[RunRecord], manifest: str | os.PathLike[str] | None) -> RunRecord | None:
    """The run the gallery shows by default: among train-head runs (they name a store), those whose
    store was extracted from ``manifest`` when one is given (if any), the highest validation t2v
    (R@1, R@5, R@10): the protocol's selection key, so the test split picks nothing here either."""
    from tvrpipe.features.store import manifest_sha256

    candidates = [r for r in runs if r.config.get("features")]
    if manifest is not None and candidates:
        man = read_manifest(manifest)
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
    from tvrpipe.files import atomic_write_text

    found, skipped, chosen = _found_runs(runs, out, gallery_queries, gallery_run)
    sections = group_runs(found)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("curves.png", "r1.png", "uncertainty.png", "gallery.png"):  # no stale plot of an earlier report
        (out_dir / name).unlink(missing_ok=True)
    plots, notes = _plots(sections, out_dir)
    chosen = chosen or _best_run(found, manifest)
    if chosen is None:
        notes.append("gallery: no train-head run (with a feature store) to score; choose one with --gallery-run")
    else:
        _gallery(chosen, video_root, manifest, gallery_queries, seed, out_dir, plots, notes)
    text = render_markdown(sections, skipped, out_dir, plots, notes, runs)
    atomic_write_text(out_dir / "report.md", text)
    rows = csv_rows(sections)
    atomic_write_text(out_dir / "report.csv", pd.DataFrame(rows).to_csv(index=False))
    log.info("report of %d runs written to %s", len(found), out_dir / "report.md")
    return out_dir / "report.md"


def _found_runs(runs, out, gallery_queries: int, gallery_run):
    """The options checked, and the finished runs under ``runs``, those skipped (each logged), and the run
    ``--gallery-run`` names (None: not given).

    Raises:
        ConfigError: as :func:`write_report` says.
    """
    from tvrpipe.features.outputs import check_output_folder
    from tvrpipe.lock import check_writable

    if gallery_queries < 1:
        raise ConfigError(f"--queries must be >= 1, got {gallery_queries}")
    if not runs:
        raise ConfigError("name at least one run directory (or a folder that holds runs)")
    check_writable(out, "--out")
    check_output_folder(out)  # a report's plots would land among a run's, a manifest's or a store's files
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
    return found, skipped, chosen


def _plots(sections, out_dir: Path) -> tuple[dict[str, str], list[str]]:
    """The curves, R@1 and uncertainty plots drawn into ``out_dir``: each drawn plot's caption, and a note for
    each that had nothing to draw."""
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
    return plots, notes


def _gallery(chosen, video_root, manifest, gallery_queries: int, seed: int, out_dir: Path, plots: dict[str, str],
             notes: list[str]) -> None:
    """The gallery of ``chosen`` drawn into ``out_dir`` (its caption into ``plots``), or, where it cannot be (no
    store, no videos, a damaged checkpoint), why, into ``notes``: the tables still stand."""
    try:
        g = gallery_data(chosen.dir, video_root, manifest, gallery_queries, seed)
        plot_gallery(g, out_dir / "gallery.png")
        plots["gallery.png"] = (f"Retrieval gallery of {chosen.dir} ({chosen.method}): top-{GALLERY_TOP} test "
                                f"videos by raw score for {len(g.queries)} test captions (seed {seed}), middle "
                                "frames; green: the correct video")
    except TvrpipeError as e:
        log.warning("gallery skipped: %s", e)
        notes.append(f"gallery: {e}")
