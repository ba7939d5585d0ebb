"""``tvrpipe quickstart``: the whole pipeline, offline, on generated videos (docs/design.md, "Synthetic data
and the offline quickstart").

synth (the benchmark, and as many other videos of the same world: the tiny CLIP's training data, so
the benchmark stays unseen and the zero-shot row is zero-shot) -> finetune --end-to-end a tiny CLIP
from random weights on those -> extract the benchmark with it -> train-head for
every registered head (plus the zero-shot row: meanpool untrained) -> one results table, and t2v R@1
of each head by difficulty (:data:`DIFFICULTIES`: which kind of test caption it gains or loses on) ->
``tvrpipe report`` (Markdown tables, plots, a retrieval gallery) in ``report/``.

Choices (docs/quickstart.md): the tiny CLIP (``tvrpipe-tiny``, D = 64) is finetuned with the
parameter-free meanpool head, so that no head is favoured by the features; the learning rates are
1e-3 (from random weights, the papers' 1e-6 would not move it); heads train with batch 32 on the
small store (a batch of 128 would leave one step per epoch); the tiny CLIP's captions are written in a
short style and the benchmark's in a descriptive one (``synth.SHORT_TEMPLATES``, ``DESCRIPTIVE_TEMPLATES``),
as web alt-text differs from MSR-VTT's sentences: that shift is a share of the benchmark a head can learn.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.rundir import Scores

log = logging.getLogger(__name__)

# Subsets of the test captions by what makes them hard (the synthetic benchmark knows; a caption can be in
# both the second and the third): where each head gains or loses against the zero-shot row.
DIFFICULTIES = {
    "plain": "single-scene video, no near-duplicate in the test split",
    "multi_scene": "multi-scene video, the caption describes one scene (intra-pair uncertainty)",
    "near_duplicate": "a near-duplicate of the video is in the test split (inter-pair uncertainty)",
}


@dataclass(frozen=True)
class QuickstartPlan:
    """How big each stage is; ``fast`` is the plan of ``--fast``."""

    videos: int = 200
    pretrain_videos: int = 200  # CLIP's own training set, disjoint from the benchmark (its "web data")
    finetune_epochs: int = 10
    head_batch: int = 32
    max_epochs: int = 60
    min_steps: int = 300  # steps without improvement before a head stops (TrainConfig.min_steps)

    @classmethod
    def fast(cls) -> QuickstartPlan:
        # ~80 train videos are 2 steps an epoch at batch 32: patience of 100 steps is already 50 epochs
        return cls(videos=120, pretrain_videos=120, finetune_epochs=4, head_batch=32, max_epochs=20, min_steps=100)


@dataclass
class QuickstartResult:
    out: Path
    rows: list[dict] = field(default_factory=list)  # one per head: method, kind, t2v/v2t metrics, difficulty
    captions: dict[str, int] = field(default_factory=dict)  # test captions per difficulty (and "all")
    report: Path | None = None  # report.md (tvrpipe report over the runs)
    search: dict = field(default_factory=dict)  # the closing search: query, run, hits, the true video's rank

    def table_rows(self, post: str = "") -> list[dict]:
        """Rows of raw (``post=""``) or post-processed (``"dsl"``) test metrics."""
        variant = post or "raw"
        return [{"method": r["method"], **scores.columns(variant)} for r in self.rows
                if (scores := Scores.from_dict(r["test"])).get(variant) is not None]


def run_quickstart(out: str | os.PathLike[str], plan: QuickstartPlan = QuickstartPlan(), seed: int = 0,
                   stage: Callable[[str], None] = lambda title: None, progress: bool = True) -> QuickstartResult:
    """Run every stage into ``out``; rerunning resumes (each stage resumes or skips finished work).

    Args:
        out: working directory: ``data/``, ``pretrain/``, ``finetune/``, ``features/``, ``runs/``, ``results.csv``,
            ``report/``, ``search.json``.
        plan: sizes of the stages.
        seed: seed of every stage.
        stage: called with a title as each stage starts (the CLI prints it).
        progress: show progress bars.
    """
    import pandas as pd

    from tvrpipe.features.clip import TINY_MODEL
    from tvrpipe.features.extract import ExtractConfig, extract
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import list_heads
    from tvrpipe.report import write_report
    from tvrpipe.training.data import load_split
    from tvrpipe.training.finetune import FinetuneConfig, finetune
    from tvrpipe.training.fit import TrainConfig, fit
    from tvrpipe.worlds.videos import ATTRIBUTES_FILE, DESCRIPTIVE_TEMPLATES, SHORT_TEMPLATES, synthesize

    out = Path(out)
    data = out / "data"
    stage(f"1. synthetic datasets: {plan.videos} benchmark videos, {plan.pretrain_videos} for CLIP (tvrpipe synth)")
    if not (data / "manifest" / "videos.parquet").is_file():
        synthesize(data, plan.videos, seed, caption_templates=DESCRIPTIVE_TEMPLATES, progress=progress)
    pre = out / "pretrain"
    # other videos from the same world, another seed; single-scene, as CLIP's image-caption pairs are; their
    # captions short alt-text-like phrases, the benchmark's an annotator's fuller sentences: the dataset shift
    # between CLIP's pre-training text and a benchmark's, which zero-shot keeps and a trained head can learn
    if not (pre / "manifest" / "videos.parquet").is_file():
        synthesize(pre, plan.pretrain_videos, seed + 1_000_003, multi_scene_fraction=0.0,
                   caption_templates=SHORT_TEMPLATES, progress=progress)
    stage(f"2. train {TINY_MODEL} end to end from random weights on {plan.pretrain_videos} other videos, "
          f"{plan.finetune_epochs} epochs (tvrpipe finetune --end-to-end)")
    ft = finetune(pre / "manifest", pre / "videos", "meanpool", out / "finetune",
                  FinetuneConfig(end_to_end=True, model=TINY_MODEL, pretrained="none", epochs=plan.finetune_epochs,
                                 epoch_pairs="videos", batch_size=16, clip_lr=1e-3, head_lr=1e-3, seed=seed),
                  progress=progress)
    stage("3. CLIP features with the finetuned weights (tvrpipe extract)")
    extract(data / "manifest", data / "videos", out / "features",
            ExtractConfig(model=ft["export"]["model"], pretrained=str(out / "finetune" / ft["export"]["file"]),
                          seed=seed, progress=progress))
    result = QuickstartResult(out)
    stage(f"4. train-head for every head: {', '.join(list_heads())} (tvrpipe train-head)")
    runs = [("zero-shot", "meanpool", TrainConfig(epochs=0, seed=seed))]  # meanpool untrained
    runs += [(h, h, TrainConfig(batch_size=plan.head_batch, max_epochs=plan.max_epochs, min_steps=plan.min_steps,
                                seed=seed))
             for h in list_heads()]
    for label, method, cfg in runs:
        run = out / "runs" / (method if cfg.epochs != 0 else "zero-shot")
        metrics = fit(out / "features", method, run, cfg, post=("dsl",), progress=progress)
        result.rows.append({"method": label, "run": str(run), "selected_epoch": metrics["selected_epoch"],
                            "test": metrics["test"]})
    _write_csv(result, out / "results.csv")
    test = load_split(open_store(out / "features"), "test")
    masks = difficulty_masks(pd.read_parquet(data / ATTRIBUTES_FILE), test.video_ids, test.text_video)
    result.captions = {"all": test.n_texts, **{k: int(m.sum()) for k, m in masks.items()}}
    for row in result.rows:
        row["difficulty"] = r1_by_difficulty(Path(row["run"]), test, masks)
    _write_difficulty_csv(result, out / "difficulty.csv")
    stage("5. report: the papers' tables and plots, with a retrieval gallery (tvrpipe report)")
    result.report = write_report([out / "runs", out / "finetune"], out / "report", video_root=data / "videos",
                                 manifest=data / "manifest", seed=seed)
    best = max((r for r in result.rows if r["method"] != "zero-shot"),
               key=lambda r: Scores.from_dict(r["test"]).selection_key())
    stage(f"6. search: the best head by test t2v R@1 ({best['method']}) ranks every video of the store for one "
          "test caption (tvrpipe search)")
    result.search = closing_search(out, best, test, masks["plain"])
    return result


def closing_search(out: Path, best: dict, test, plain: np.ndarray, k: int = 5) -> dict:
    """``tvrpipe search`` with the run ``best`` (a row of :attr:`QuickstartResult.rows`) for the first test
    caption of a plain video (one scene, no near-duplicate in the split: one right answer), over every video
    of the store; where its video ranks among the ``k`` hits (None: not among them). Written to search.json."""
    import json

    from tvrpipe.data.manifest import read_manifest
    from tvrpipe.search.engine import open_searcher, search

    captions = read_manifest(out / "data" / "manifest").captions.set_index("caption_id")["text"]
    i = int(np.flatnonzero(plain)[0]) if plain.any() else 0
    query, truth = str(captions[test.caption_ids[i]]), str(test.video_ids[test.text_video[i]])
    searcher = open_searcher(out / "features", best["run"])
    hits = search(searcher, [query], k=k, first_stage="exact").hits
    found = next((h.rank for h in hits if h.video_id == truth), None)
    record = {"method": best["method"], "run": best["run"], "query": query, "true_video": truth,
              "found_at": found, "videos": int(searcher.store.provenance["n_videos"]),
              "hits": [h.record() for h in hits]}
    (out / "search.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _write_csv(result: QuickstartResult, path: Path) -> None:
    rows = [{"post": post or "raw", **r} for post in ("", "dsl") for r in result.table_rows(post)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def difficulty_masks(attributes, video_ids, text_video) -> dict[str, np.ndarray]:
    """Which captions of a split fall under each of :data:`DIFFICULTIES` (boolean arrays, one per caption).

    Args:
        attributes: ``attributes.parquet`` of ``tvrpipe synth`` (one row per video and scene, with
            ``group``: a near-duplicate shares its original's).
        video_ids: the split's videos; near-duplicates count only when both are among them.
        text_video: each caption's index into ``video_ids``.
    """
    per_video = attributes.groupby("video_id").agg(scenes=("scene", "nunique"), group=("group", "first"))
    missing = sorted(set(video_ids) - set(per_video.index))
    if missing:
        raise ConfigError(f"attributes.parquet has no row for video {str(missing[0])!r} of the split")
    per_video = per_video.loc[list(video_ids)]
    in_split = per_video["group"].map(per_video["group"].value_counts())  # videos of the group in the split
    caption_video = np.asarray(text_video)
    multi = per_video["scenes"].to_numpy()[caption_video] > 1
    dup = in_split.to_numpy()[caption_video] > 1
    return {"plain": ~multi & ~dup, "multi_scene": multi, "near_duplicate": dup}


def r1_by_difficulty(run: Path, split, masks: dict[str, np.ndarray]) -> dict[str, float | None]:
    """Text-to-video R@1 (percent) of a run's selected checkpoint over all captions of ``split`` and over
    each subset in ``masks`` (None for an empty one); the same scores and tie rule as its test metrics."""
    from tvrpipe.evaluation.metrics import t2v_ranks
    from tvrpipe.rundir import BEST, CHECKPOINTS
    from tvrpipe.training.evaluate import checkpoint_similarity

    sim = checkpoint_similarity(run / CHECKPOINTS / BEST, split)
    hit = t2v_ranks(sim, split.text_video) == 1
    return {"all": 100.0 * float(hit.mean()),
            **{k: 100.0 * float(hit[m].mean()) if m.any() else None for k, m in masks.items()}}


def _write_difficulty_csv(result: QuickstartResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["method", "difficulty", "captions", "t2v R@1"])
        w.writeheader()
        for r in result.rows:
            for k, n in result.captions.items():
                w.writerow({"method": r["method"], "difficulty": k, "captions": n,
                            "t2v R@1": "" if r["difficulty"][k] is None else r["difficulty"][k]})
