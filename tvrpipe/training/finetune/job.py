"""A finetune run's job, built from its manifest before anything is written: the data (the video table,
each split's rows), the head's config, the rate each parameter group trains at, and the record
``config.yaml`` holds. Everything a training process needs, picklable: Ray Train ships it to every
worker."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from tvrpipe.data.manifest import Manifest
from tvrpipe.errors import ConfigError
from tvrpipe.features.outputs import check_output_folder
from tvrpipe.heads.base import Copied, TextBatch, VideoBatch, clip_head_config, head_class
from tvrpipe.training.core import check_group_lr, check_head_inputs, lr_groups, setting_source
from tvrpipe.training.finetune.config import EXECUTION, FinetuneConfig
from tvrpipe.training.finetune.failures import check_files
from tvrpipe.training.videodata import TrainPairs, VideoTable, epoch_steps

if TYPE_CHECKING:  # a hint only: CLIP's module imports open_clip, which loads when a job is built, not on import
    from tvrpipe.features.clip import ClipBundle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FinetuneJob:
    """Everything a training process needs (:func:`build_job`), picklable (Ray Train ships it to every worker)."""

    out: str
    method: str
    head_cfg: Any
    cfg: FinetuneConfig
    table: VideoTable
    frames: int
    max_words: int
    train_videos: np.ndarray
    train_texts: np.ndarray
    text_video: np.ndarray  # (n_captions,) video row of every caption
    val: tuple[np.ndarray, np.ndarray]  # (video rows, caption rows)
    test: tuple[np.ndarray, np.ndarray]
    video_ids: np.ndarray
    caption_ids: np.ndarray
    val_source: str
    post: tuple[str, ...]
    progress: bool
    lr_groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # {group: {lr, source}}, what metrics.json records


def build_job(manifest_dir: str | os.PathLike[str], video_root: str | os.PathLike[str], method: str,
              out_dir: str | os.PathLike[str], cfg: FinetuneConfig, overrides: dict[str, Any] | None = None,
              post: tuple[str, ...] = (), progress: bool = True, recipe: dict[str, Any] | None = None):
    """The job of a finetune run (:func:`tvrpipe.training.finetune.finetune` takes the same arguments), checked as
    far as it can be before anything is written or Ray starts: the options, the manifest and its files, the
    weights, the head's parameter groups and inputs, the batch against the training set.

    Returns:
        ``(job, pairs, config, bundle)``: the :class:`FinetuneJob`, the training pairs an epoch draws from,
        what ``config.yaml`` records (the settings as the run uses them: the manifest's frames and words where
        not given, ``init_from_clip`` false where nothing would be copied; the resolved rates; how the run
        differs from its ``recipe``), and the run's CLIP, loaded here.

    Raises:
        ConfigError: an option, the manifest, the weights or the data do not allow the run, naming which.
    """
    from tvrpipe.data.manifest import check_max_words, open_manifest
    from tvrpipe.evaluation.engine import check_post
    from tvrpipe.features.clip import load_clip

    # ---- options (cfg checked itself), manifest and weights are checked before anything is written or Ray starts
    post = check_post(post)
    manifest, root, F, L = open_manifest(manifest_dir, video_root, out_dir, cfg.frames, cfg.max_words)
    check_output_folder(out_dir, "--out", may_be="a run")  # a run resumes; one inside another run's folder would not
    bundle = load_clip(cfg.model, cfg.pretrained, device="cpu", seed=cfg.seed)
    check_max_words(L, bundle.context_length)
    head_cfg, cfg, rates, copied = _resolve_settings(method, cfg, overrides, recipe, bundle, F, L)
    job = _assemble_job(out_dir, method, head_cfg, cfg, manifest, root, manifest_dir, post, progress, rates)
    pairs = train_pairs(job, recipe)  # the batch fits the training set: checked before the run directory is written
    check_files(job.table.paths, job.video_ids, {"training": job.train_videos, "test": job.test[0]}, root,
                cfg.max_failed_fraction)
    recipe = _recipe_record(recipe, manifest, cfg, head_cfg)
    return job, pairs, _config_record(job, manifest_dir, manifest, root, bundle, copied, recipe), bundle


def _resolve_settings(method: str, cfg: FinetuneConfig, overrides: dict[str, Any] | None,
                      recipe: dict[str, Any] | None, bundle: ClipBundle, F: int,
                      L: int) -> tuple[Any, FinetuneConfig, dict[str, dict[str, Any]], Copied | None]:
    """Settings stage: the head's config, the settings as the run uses them, each group's rate, what CLIP gives."""
    from tvrpipe.features.weights import resolve_pretrained

    head_cfg = clip_head_config(method, bundle.embed_dim, bundle.logit_scale, overrides)  # D, CLIP's scale
    # what the run uses: the manifest's frames and words where not given, a checkpoint by its absolute path (the
    # run's workers and a later `extract --pretrained` reach it from any folder)
    cfg = dataclasses.replace(cfg, frames=F, max_words=L, pretrained=resolve_pretrained(cfg.pretrained))
    rates, copied = probe_head(method, head_cfg, cfg, bundle, recipe)
    if cfg.init_from_clip and not copied:
        log.warning("--init-from-clip: %s, so nothing is copied: %s keeps its own initialisation", copied.reason,
                    method)
        cfg = dataclasses.replace(cfg, init_from_clip=False)
    return head_cfg, cfg, rates, copied


def _assemble_job(out_dir: str | os.PathLike[str], method: str, head_cfg: Any, cfg: FinetuneConfig,
                  manifest: Manifest, root: Path, manifest_dir: str | os.PathLike[str], post: tuple[str, ...],
                  progress: bool, rates: dict[str, dict[str, Any]]) -> FinetuneJob:
    """Data stage: the video table and each split's rows of the manifest, in the job a training process gets."""
    from tvrpipe.training.data import split_rows

    videos, captions = manifest.videos, manifest.captions
    vrow = pd.Series(np.arange(len(videos)), index=videos["video_id"])
    text_video = vrow.loc[captions["video_id"]].to_numpy()
    rows = split_rows(videos["split"].to_numpy(), captions["split"].to_numpy(), text_video, str(manifest_dir))
    starts = videos["start_s"] if "start_s" in videos else pd.Series(np.nan, index=videos.index)
    ends = videos["end_s"] if "end_s" in videos else pd.Series(np.nan, index=videos.index)
    table = VideoTable(np.array([str(root / p) for p in videos["path"]], dtype=object),
                       starts.astype(float).to_numpy(), ends.astype(float).to_numpy(),
                       captions["text"].astype(str).to_numpy(dtype=object))
    out = Path(out_dir)
    return FinetuneJob(out=str(out.resolve()), method=method, head_cfg=head_cfg, cfg=cfg, table=table,
                       frames=cfg.frames, max_words=cfg.max_words, train_videos=rows.train_videos,
                       train_texts=rows.train_texts, text_video=text_video, val=(rows.val_videos, rows.val_texts),
                       test=(rows.test_videos, rows.test_texts), video_ids=videos["video_id"].astype(str).to_numpy(),
                       caption_ids=captions["caption_id"].astype(str).to_numpy(), val_source=rows.val_source,
                       post=post, progress=progress, lr_groups=rates)


def _recipe_record(recipe: dict[str, Any] | None, manifest: Manifest, cfg: FinetuneConfig,
                   head_cfg: Any) -> dict[str, Any] | None:
    """Recipe stage: how the run differs from its ``recipe``: the manifest's data, and every setting as cfg runs it."""
    if not recipe:
        return recipe
    from tvrpipe.training.recipes import OPTION_SETTINGS, deviations

    return deviations(recipe, {"dataset": manifest.meta.get("dataset"), "split_set": manifest.meta.get("split_set"),
                               # CLIP's rate only where CLIP trains
                               **{k: getattr(cfg, k) for k in OPTION_SETTINGS if k != "clip_lr" or cfg.end_to_end},
                               "head": dataclasses.asdict(head_cfg)})


def _config_record(job: FinetuneJob, manifest_dir: str | os.PathLike[str], manifest: Manifest, root: Path,
                   bundle: ClipBundle, copied: Copied | None, recipe: dict[str, Any] | None) -> dict[str, Any]:
    """Record stage: what ``config.yaml`` holds of the run (its settings as it uses them, and what they resolved to)."""
    from tvrpipe.features.clip import preprocess_description
    from tvrpipe.features.decode import FRAME_SAMPLING
    from tvrpipe.features.store import manifest_sha256

    cfg, videos, captions = job.cfg, manifest.videos, manifest.captions
    settings = dataclasses.asdict(cfg)
    return {
        "method": job.method,
        "head": dataclasses.asdict(job.head_cfg),
        "finetune": {k: v for k, v in settings.items() if k not in EXECUTION},
        "execution": {k: settings[k] for k in EXECUTION},
        "post": list(job.post),
        "manifest": str(Path(manifest_dir).resolve()),
        "video_root": str(root.resolve()),
        "features": None,  # live features: evaluate needs a store extracted with the run's CLIP
        # what a store must match for `tvrpipe evaluate` (metrics.json adds the finetuned weights' hash)
        "provenance": {"frames": job.frames, "max_words": job.max_words, "embed_dim": bundle.embed_dim,
                       "frame_sampling": FRAME_SAMPLING, "image_size": bundle.image_size,
                       "preprocessing": preprocess_description(bundle),
                       "manifest_sha256": manifest_sha256(videos, captions)},
        "validation": job.val_source,
        # what ran, where the options alone do not say it: each parameter group's rate, what CLIP initialised
        "resolved": {"lr_groups": job.lr_groups,
                     "init_from_clip": list(copied) if copied else (f"nothing: {copied.reason}" if copied is not None
                                                                    else None)},
        **({"recipe": recipe} if recipe else {}),
    }


def probe_head(method: str, head_cfg: Any, cfg: FinetuneConfig, bundle, recipe: dict[str, Any] | None):
    """Before anything is written, on a throwaway head (the run's random stream untouched): the rate each
    parameter group will train at (:func:`~tvrpipe.training.core.lr_groups`; CLIP's only end-to-end) and,
    with ``init_from_clip``, what the head copies from the run's CLIP (None without it).

    Raises:
        ConfigError: ``group_lr`` names a group the head does not have.
    """
    with torch.random.fork_rng(devices=[]):
        head = head_class(method)(head_cfg)
        groups = check_group_lr(head, cfg.group_lr)
        copied = head.init_from_clip(bundle.model) if cfg.init_from_clip else None
        D, F, L = bundle.embed_dim, cfg.frames, cfg.max_words  # two pairs of the run's shapes
        check_head_inputs(head, TextBatch(torch.randn(2, L, D), torch.ones(2, L, dtype=torch.bool), torch.randn(2, D)),
                          VideoBatch(torch.randn(2, F, D), torch.ones(2, F, dtype=torch.bool)))
    if cfg.epochs == 0:  # no step: nothing trains at any rate
        return {}, copied
    rates = ({"clip": {"lr": float(cfg.clip_lr), "source": setting_source("clip_lr", recipe, "--clip-lr")}}
             if cfg.end_to_end else {})
    rates.update(lr_groups(groups, cfg.head_lr, setting_source("head_lr", recipe, "--head-lr"), cfg.group_lr,
                           lambda g: setting_source(f"group_lr.{g}", recipe, "--group-lr")))
    return rates, copied


def train_pairs(job: FinetuneJob, recipe: dict[str, Any] | None = None) -> TrainPairs:
    """The (video, caption) pairs an epoch draws from.

    Raises:
        ConfigError: the batch exceeds the training videos (a batch holds no video twice), naming where the
            batch came from: ``--batch-size``, or the ``recipe`` the run records.
    """
    cfg = job.cfg
    pairs = TrainPairs.build(job.train_videos, job.train_texts, job.text_video[job.train_texts])
    if (cfg.batch_size > len(pairs.videos) or epoch_steps(pairs, cfg.batch_size, cfg.epoch_pairs) == 0) \
            and cfg.epochs > 0:
        given = setting_source("batch_size", recipe, "--batch-size")
        what = ("--batch-size" if given == "--batch-size" else
                f"{given}'s batch_size")  # a recipe's: the user never typed --batch-size
        where, how = ("", "") if given == "--batch-size" else (f" ({recipe['path']})", " with --batch-size")
        raise ConfigError(f"{what} {cfg.batch_size}{where} exceeds the {len(pairs.videos)} training videos; "
                          f"lower it{how}")
    return pairs


def steps_per_epoch(pairs: TrainPairs, cfg: FinetuneConfig) -> int:
    """Optimizer steps an epoch of ``pairs`` takes (at most ``max_steps``)."""
    steps = epoch_steps(pairs, cfg.batch_size, cfg.epoch_pairs)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)
