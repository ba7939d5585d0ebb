"""The retrieval gallery: the top videos of a few test captions, as middle-frame thumbnails."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.report.plots import pyplot, wrap_text

log = logging.getLogger(__name__)
GALLERY_TOP = 5
THUMB_SIZE = 128  # thumbnail side in pixels (decoded at this size, centre-cropped)


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
    from tvrpipe.features.store import StoreError, open_store
    from tvrpipe.rundir import read_config
    from tvrpipe.training.data import load_split, store_split_rows
    from tvrpipe.training.evaluate import checkpoint_similarity

    if queries < 1:
        raise ConfigError(f"--queries must be >= 1, got {queries}")
    run = Path(run_dir)
    config = read_config(run)
    if not config.get("features"):
        raise GalleryUnavailable(f"{run} was trained on live CLIP features (finetune) and names no feature "
                                 "store; choose a train-head run with --gallery-run")
    try:
        store = open_store(config["features"], expect=config["provenance"])
    except StoreError as e:
        raise GalleryUnavailable(f"the feature store of {run} cannot be read ({e})") from None
    man = read_manifest(manifest) if manifest is not None else None
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
    from tvrpipe.features.decode import decode_video

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
    plt = pyplot()
    green = "#1a9e3a"
    thumbs = _thumbnails(g)
    n = len(g.queries)
    fig = plt.figure(figsize=(2.0 * (GALLERY_TOP + 1.3), 2.75 * n + 0.8))
    head, *subfigs = fig.subfigures(n + 1, 1, height_ratios=(0.8, *[2.75] * n))
    head.text(0.5, 0.7, wrap_text(f"Retrieval gallery of {g.run}", 110), ha="center", va="center", fontsize=10,
              fontweight="bold")
    head.text(0.5, 0.35, f"the top-{GALLERY_TOP} test videos of each caption by raw score (middle frames); "
              "green: the correct video", ha="center", va="center", fontsize=9)
    for sub, q in zip(subfigs, g.queries):
        caption = f"\u201c{q.text}\u201d" if q.text is not None else f"caption {q.caption_id}"
        sub.suptitle(wrap_text(f"{caption}  \u2014  correct video ({q.video_id}) at rank {q.rank}", 100),
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
