"""The first stages built from a run's head, kept beside the searched store: the distilled one
(:mod:`tvrpipe.search.first_stages.distilled`: fitted to the head on the run's own store, applied to the
searched store), the late-interaction one (:mod:`tvrpipe.search.first_stages.late_interaction`: a token-wise
head's own interaction over a few segments a video) and the head's own video embedding
(:mod:`tvrpipe.search.first_stages.head_embedding`).

    <store>/search-distilled/<key>/
      scorer.npz       the distilled stage's query and video maps (D x d) and the segments a video; the
                       late-interaction stage's axes (D x d) and segments
      vectors.npy      float32 (n x vectors a video, d): the searchable videos' vectors (read as a memory map)
      rows.npy         int64 (n,): their rows in the store
      distilled.json   what it was built from (the store's key, the run, its checkpoint's sha256, the build
                       settings), the fit's record and the build's cost

``key`` hashes the store's key (:func:`tvrpipe.search.index.store_key`), the checkpoint's sha256, the first stage
and its build settings, so a store extracted again, another run or other settings build anew; each is built once
and reused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tvrpipe.errors import ConfigError, WriteError
from tvrpipe.features.store import FeatureStore, open_store
from tvrpipe.files import NpyWriter, atomic_replace_folder, file_sha256
from tvrpipe.heads.base import Head, TextBatch, VideoBatch
from tvrpipe.search.batches import text_batch, video_batch
from tvrpipe.search.encoded import EncodedVideos, read_encodings
from tvrpipe.search.first_stages.base import normalised
from tvrpipe.search.first_stages.distilled import Distilled, Scorer, segment_means
from tvrpipe.search.first_stages.head_embedding import HeadEmbedding, check_indexable
from tvrpipe.search.first_stages.late_interaction import (
    LateInteraction,
    TokenProjection,
    check_token_wise,
    head_video_vectors,
    head_words,
    segment_token_wise,
)
from tvrpipe.search.index import finish_kept, searchable_rows, store_key

log = logging.getLogger(__name__)

DISTILLED_DIR = "search-distilled"
_BLOCK = 4096  # videos read at a time (their frames: 50 MB at F = 12, D = 512 in float16)
_TEACHER_BLOCK = 256  # videos encoded, and captions and videos scored, at a time while teaching


@torch.inference_mode()
def teacher_scores(head: Head, texts: TextBatch, store: FeatureStore, rows: np.ndarray,
                   progress: bool = False) -> np.ndarray:
    """The head's scores of every caption of ``texts`` against every video of ``rows``: ``(C, V)`` float32, by the
    evaluation's block-wise similarity (every video encoded once, then blocks of captions x videos)."""
    from tvrpipe.evaluation.engine import encode_all, similarity_matrix, slice_emb
    from tvrpipe.progress import progress_bar

    te = head.encode_texts(texts)
    ve = encode_all(head.encode_videos, (video_batch(store, rows[a : a + _TEACHER_BLOCK])
                                         for a in range(0, len(rows), _TEACHER_BLOCK)))
    out = np.empty((len(texts), len(rows)), np.float32)
    with progress_bar(enabled=progress, transient=True) as bar:
        task = bar.add_task(f"distilling {head.name}: its scores of {len(texts):,} x {len(rows):,} pairs",
                            total=len(texts))
        for a in range(0, len(texts), _TEACHER_BLOCK):
            b = min(a + _TEACHER_BLOCK, len(texts))
            out[a:b] = similarity_matrix(head, slice_emb(te, a, b), ve, block_videos=_TEACHER_BLOCK).numpy()
            bar.advance(task, b - a)
    return out


def _principal_axes(x: np.ndarray, d: int) -> np.ndarray:
    """``(D, d)``: the first ``d`` principal axes of the rows of ``x`` (centred); fewer rows or dims than ``d``
    are filled out with the remaining unit axes, so the map is always D x d."""
    _, _, vt = np.linalg.svd(x - x.mean(0), full_matrices=False)
    axes = vt[:d].T
    if axes.shape[1] < d:
        axes = np.concatenate([axes, np.eye(x.shape[1], d - axes.shape[1], dtype=axes.dtype)], 1)
    return np.ascontiguousarray(axes, np.float32)


def _ranks(scores: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Each ``top[q, j]`` video's rank (0: first) in ``scores[q]``: the videos scoring above it."""
    return (scores[:, None, :] > np.take_along_axis(scores, top, 1)[:, :, None]).sum(2)


def fit_scorer(head: Head, store: FeatureStore, config: Distilled.Config,
               progress: bool = False) -> tuple[Scorer, dict[str, Any]]:
    """Fit the distilled scorer to ``head`` on ``store``'s train split (module doc of
    :mod:`tvrpipe.search.first_stages.distilled`); the scorer and the fit's record: its seconds, the head
    evaluations it cost, the final loss and, on the tenth of the captions held out of the fit, the 95th
    percentile rank (as a share of the teacher videos) of the head's top 10 under the scorer and under zero-shot
    CLIP's cosine with the normalised mean of the video's segments (its pooled embedding but for each segment's
    normalisation).

    Raises:
        ConfigError: the store's train split has fewer than 10 videos with frames, or no caption.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng([config.seed, 57])
    vrows, trows = _train_sample(store, config, rng, Distilled.name)
    texts = text_batch(store, trows, tokens=head.uses_tokens)
    target = teacher_scores(head, texts, store, vrows, progress)
    segs = np.concatenate([segment_means(store.read("videos/frames", vrows[a : a + _BLOCK]),
                                         store.read("videos/frame_mask", vrows[a : a + _BLOCK]), config.segments)
                           for a in range(0, len(vrows), _BLOCK)])
    segs = normalised(segs)
    sent = normalised(texts.sentence.numpy())
    axes = _principal_axes(np.concatenate([segs.reshape(-1, segs.shape[-1]), sent]), config.dim)
    held = rng.permutation(len(trows))[: max(1, len(trows) // 10)]
    fit = np.setdiff1d(np.arange(len(trows)), held) if len(trows) > 1 else held
    qmap, vmap, loss = _fit_maps(sent[fit], segs, target[fit], axes, config, progress)
    scorer = Scorer(qmap, vmap, config.segments)
    vec = scorer.from_segments(segs).reshape(len(vrows), config.segments, -1)
    student = np.einsum("qd,nsd->qns", scorer.queries(sent[held]), vec).max(2)
    record = {"seconds": time.perf_counter() - t0, "captions": int(len(trows)), "videos": int(len(vrows)),
              "head_pairs": int(len(trows) * len(vrows)), "loss": loss, "held_out_captions": int(len(held)),
              **_rank_record(target[held], student, sent[held], segs)}
    return scorer, record


def _train_sample(store: FeatureStore, config: Any, rng: np.random.Generator, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``config.videos`` train videos with frames and ``config.captions`` of their captions, drawn from ``store``
    (sorted store rows of each).

    Raises:
        ConfigError: fewer than 10 such videos, or no caption.
    """
    split_v = store.videos["split"].to_numpy()
    searchable = searchable_rows(store)
    vrows = searchable[split_v[searchable] == "train"]
    trows = np.flatnonzero(store.texts["split"].to_numpy() == "train")
    trows = trows[np.isin(store.texts["video_row"].to_numpy()[trows], vrows)]
    if len(vrows) < 10 or not len(trows):
        raise ConfigError(f"{store.dir}: the {name} first stage is built from the run's head on its store's train "
                          f"split, which has {len(vrows)} videos with frames and {len(trows)} captions (needs 10 and 1)")
    vrows = np.sort(rng.choice(vrows, min(config.videos, len(vrows)), replace=False))
    trows = np.sort(rng.choice(trows, min(config.captions, len(trows)), replace=False))
    return vrows, trows


def _rank_record(target: np.ndarray, student: np.ndarray, sentences: np.ndarray, segs: np.ndarray) -> dict[str, float]:
    """How deep the head's top 10 (by ``target``, captions x videos) lie in a first stage's ranking (``student``)
    and in zero-shot CLIP's (the sentence's cosine with the normalised mean of the video's ``segs``, each
    normalised: near, not equal to, the pooled embedding): the 95th percentile rank, as a share of the videos."""
    top = np.argsort(-target, 1, kind="stable")[:, : min(10, target.shape[1])]
    zero_shot = normalised(sentences) @ normalised(normalised(segs).mean(1)).T
    share = lambda r: float(np.percentile(r, 95)) / target.shape[1]  # noqa: E731
    return {"rank_p95": share(_ranks(student, top)), "zero_shot_rank_p95": share(_ranks(zero_shot, top))}


def fit_projection(head: Head, store: FeatureStore, config: LateInteraction.Config,
                   progress: bool = False) -> tuple[TokenProjection, dict[str, Any]]:
    """The late-interaction stage's projection (module doc of :mod:`tvrpipe.search.first_stages.late_interaction`)
    for ``head``, from ``store``'s train split: the principal axes of its sampled videos' segments and captions'
    words as the head encodes them. The record: its seconds, and the 95th percentile rank of the head's top 10
    of each sampled caption under the stage's score and under zero-shot CLIP's (:func:`_rank_record`), which costs
    the head's scores of the captions x videos.

    Raises:
        ConfigError: the store's train split has fewer than 10 videos with frames, or no caption.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng([config.seed, 57])
    vrows, trows = _train_sample(store, config, rng, LateInteraction.name)
    texts = text_batch(store, trows)
    words, counts = head_words(head, texts)  # unit length, in the head's own space
    segs, raw = [], []  # the head's vectors' segments (the index's), the frames' own (zero-shot's)
    for a in range(0, len(vrows), _BLOCK):
        frames, mask = store.read("videos/frames", vrows[a : a + _BLOCK]), store.read("videos/frame_mask",
                                                                                      vrows[a : a + _BLOCK])
        segs.append(segment_means(*head_video_vectors(head, frames, mask), config.segments))
        raw.append(segment_means(frames, mask, config.segments))
    segs = np.concatenate(segs)
    axes = _principal_axes(np.concatenate([normalised(segs).reshape(-1, segs.shape[-1]), words]), config.dim)
    projection = TokenProjection(head, axes, config.segments)
    target = teacher_scores(head, texts, store, vrows, progress)
    vectors = projection.from_segments(segs).reshape(len(vrows), config.segments, -1)
    student = segment_token_wise(projection.project(words), counts, vectors)
    record = {"seconds": time.perf_counter() - t0, "captions": int(len(trows)), "videos": int(len(vrows)),
              "head_pairs": int(len(trows) * len(vrows)),
              **_rank_record(target, student, texts.sentence.numpy(), np.concatenate(raw))}
    return projection, record


def _fit_maps(sent: np.ndarray, segs: np.ndarray, target: np.ndarray, axes: np.ndarray, config: Distilled.Config,
              progress: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """Adam on the KL divergence between softmax(standardised head scores / temperature) and softmax(scale x
    best-segment cosine), both maps starting at ``axes``; the maps and the last step's loss."""
    from tvrpipe.progress import progress_bar

    gen = torch.Generator().manual_seed(config.seed)
    z = torch.from_numpy(target)
    z = (z - z.mean(1, keepdim=True)) / z.std(1, keepdim=True).clamp_min(1e-6)
    want = torch.softmax(z / config.temperature, 1)
    t, v = torch.from_numpy(sent), torch.from_numpy(np.ascontiguousarray(segs))
    qmap = torch.tensor(axes, requires_grad=True)
    vmap = torch.tensor(axes, requires_grad=True)
    log_scale = torch.tensor(float(np.log(30.0)), requires_grad=True)  # choice: CLIP's scale at its start, ~e^3.4
    opt = torch.optim.Adam([qmap, vmap, log_scale], lr=config.lr)
    loss = torch.tensor(float("nan"))
    with progress_bar(enabled=progress, transient=True) as bar:
        task = bar.add_task("distilling: fitting the scorer", total=config.steps)
        for _ in range(config.steps):
            pick = torch.randint(0, len(t), (min(config.batch, len(t)),), generator=gen)
            q = torch.nn.functional.normalize(t[pick] @ qmap, dim=-1)
            vv = torch.nn.functional.normalize(v.reshape(-1, v.shape[-1]) @ vmap, dim=-1)  # (n x S, d)
            s = (q @ vv.T).view(len(q), v.shape[0], v.shape[1]).max(2).values * log_scale.exp()
            loss = -(want[pick] * torch.log_softmax(s, 1)).sum(1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.advance(task)
    return qmap.detach().numpy().copy(), vmap.detach().numpy().copy(), loss.item()


# ------------------------------------------------------------------------------------------- the cache


def _run_store(run: Path, config: dict) -> FeatureStore:
    features = config.get("features")
    if not features:
        raise ConfigError(f"--run {run}: its config.yaml names no feature store, which the distilled first stage "
                          f"learns the head on")
    try:
        return open_store(features)
    except Exception as e:  # noqa: BLE001  (a moved or damaged store: said with what to do)
        raise ConfigError(f"--run {run} trained on {features}, which the distilled first stage learns the head on, "
                          f"and it cannot be opened ({e}); use a pooled first stage (--first-stage exact)") from e


def distilled_key(skey: str, checkpoint_sha: str, config: Any, name: str = Distilled.name) -> str:
    """The cache folder's name: the store's state (``skey``, :func:`~tvrpipe.search.index.store_key`), the head's
    weights, the first stage and its build settings."""
    ident = {"store": skey, "checkpoint": checkpoint_sha, "settings": dataclasses.asdict(config)}
    if name != Distilled.name:  # the distilled stage's folders keep the name they had before there were others
        ident["first_stage"] = name
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class _Recipe:
    """How a head-fitted first stage makes its vectors and its index: ``per_video`` vectors of ``dim`` a video
    from ``encode(frames, mask)``, or from the head's kept encodings of the videos by ``from_encoded(batch)``
    where the vectors are the head's own (None: from the frames only); ``index(vectors)``; ``scorer``: the
    distilled maps (None: the head's own)."""

    per_video: int
    dim: int
    encode: Callable[[np.ndarray, np.ndarray], np.ndarray]
    index: Callable[[np.ndarray], Any]
    scorer: Scorer | TokenProjection | None = None
    from_encoded: Callable[[dict[str, torch.Tensor]], np.ndarray] | None = None


def _recipe(name: str, head: Head, store: FeatureStore, config: Any, scorer: Any) -> _Recipe:
    if name == Distilled.name:
        return _Recipe(scorer.segments, config.dim, scorer.videos, lambda v: Distilled.over(v, config, scorer), scorer)
    if name == LateInteraction.name:
        vkey, mkey = head.token_wise_keys[2:]

        def segments(e: dict[str, torch.Tensor]) -> np.ndarray:
            vectors, mask = e[vkey].float().numpy(), e[mkey].numpy().astype(bool)
            return scorer.from_segments(segment_means(vectors, mask, scorer.segments))

        return _Recipe(scorer.segments, scorer.axes.shape[1], scorer.videos,
                       lambda v: LateInteraction.over(v, config, scorer), scorer, segments)
    _, video_key = head.indexable()

    @torch.inference_mode()
    def encode(frames: np.ndarray, mask: np.ndarray) -> np.ndarray:
        batch = VideoBatch(torch.from_numpy(frames.astype(np.float32)), torch.from_numpy(mask))
        return head.encode_videos(batch)[video_key].float().numpy()

    return _Recipe(1, int(store.array("videos/frames").shape[2]), encode,
                   lambda v: HeadEmbedding.over(v, config, head), None, lambda e: e[video_key].float().numpy())


def head_stage(store: FeatureStore, head: Head, run: str | os.PathLike[str], name: str, config: Any,
               cache: bool = True, progress: bool = False, rebuild: bool = False) -> Any:
    """The first stage ``name`` fitted to ``run``'s ``head`` over ``store`` (``distilled``: a scorer fitted on the
    run's store and applied to every searchable video of ``store``; ``late-interaction``: the head's video
    vectors of every searchable video in segments, projected on axes taken from the run's store;
    ``head-embedding``: every searchable video encoded by the head): read from ``<store>/search-distilled/`` where it was built for this store state,
    checkpoint, first stage and settings, else built and kept there (where the folder is writable and ``cache``);
    ``rebuild``: built anew (and kept) even where it was kept (a bench timing the build). The late-interaction and
    head-embedding stages read the head's encodings of the videos where they are kept for this store and
    checkpoint (``--encoded-videos``, :mod:`tvrpipe.search.encoded`) instead of encoding every video again.

    Returns:
        A :class:`~tvrpipe.search.index.FirstStage` (pooled: its vectors; index: the first stage).

    Raises:
        ConfigError: the run's store cannot be opened, or its train split cannot teach (:func:`fit_scorer`); a
            head with no video embedding of its own for ``head-embedding``, or that does not score token-wise for
            ``late-interaction``; no video of ``store`` has a decoded
            frame.
    """
    from tvrpipe.rundir import BEST, CHECKPOINTS, read_config
    from tvrpipe.search.index import FirstStage, check_searchable

    if name == HeadEmbedding.name:
        check_indexable(head)
    if name == LateInteraction.name:
        check_token_wise(head)
    run = Path(run)
    sha = file_sha256(run / CHECKPOINTS / BEST)
    skey = store_key(store)  # once: a fifth of a second at a million videos
    folder = Path(store.dir) / DISTILLED_DIR / distilled_key(skey, sha, config, name)
    kept = None if rebuild else _load(folder, name, head, store, config)
    if kept is not None:
        return kept
    t0 = time.perf_counter()
    fit = {Distilled.name: fit_scorer, LateInteraction.name: fit_projection}.get(name)
    scorer, record = fit(head, _run_store(run, read_config(run)), config, progress) if fit else (None, None)
    recipe = _recipe(name, head, store, config, scorer)
    rows = searchable_rows(store)
    check_searchable(store, rows)
    encoded = read_encodings(store, skey, sha) if recipe.from_encoded is not None else None
    meta = {"store_key": skey, "run": str(run.resolve()), "checkpoint_sha256": sha, "method": head.name,
            "first_stage": name, "settings": dataclasses.asdict(config), "fit": record,
            "from_encodings": encoded is not None}

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        if isinstance(scorer, Scorer):
            np.savez(tmp / "scorer.npz", query_map=scorer.query_map, video_map=scorer.video_map,
                     segments=np.int64(scorer.segments))
        elif scorer is not None:
            np.savez(tmp / "scorer.npz", axes=scorer.axes, segments=np.int64(scorer.segments))
        with NpyWriter(tmp / "vectors.npy", np.float32, (len(rows) * recipe.per_video, recipe.dim)) as vectors:
            _fill(store, rows, recipe, vectors, progress, encoded)
        finish_kept(tmp, rows, "distilled.json", meta, t0)

    if cache:
        try:
            atomic_replace_folder(folder, write)
            kept = _load(folder, name, head, store, config)
            if kept is not None:
                return kept
        except (OSError, WriteError) as e:
            log.info("%s: the %s first stage is not kept (%s); it is built again next time", folder, name, e)
    vectors = np.empty((len(rows) * recipe.per_video, recipe.dim), np.float32)
    _fill(store, rows, recipe, vectors, progress, encoded)
    # not kept: nothing on disk, and the build is paid again next time
    return FirstStage(vectors, rows, recipe.index(vectors),
                      record={**meta, "build_seconds": time.perf_counter() - t0, "bytes": 0})


def _fill(store: FeatureStore, rows: np.ndarray, recipe: _Recipe, out: np.ndarray | NpyWriter, progress: bool,
          encoded: EncodedVideos | None = None) -> None:
    """``out`` (n x per video, d) gets the vectors of ``rows``, a block of videos at a time: from ``encoded`` (the
    head's kept encodings) where given, else from the frames."""
    from tvrpipe.progress import progress_bar

    S = recipe.per_video
    with progress_bar(enabled=progress, transient=True) as bar:
        what = f"the head's kept encodings of {len(rows):,} videos" if encoded is not None else f"{len(rows):,} videos"
        task = bar.add_task(f"the first stage's vectors of {what}", total=len(rows))
        for a in range(0, len(rows), _BLOCK):
            part = rows[a : a + _BLOCK]
            if encoded is not None:
                out[a * S : (a + len(part)) * S] = recipe.from_encoded(encoded.batch(part))
            else:
                out[a * S : (a + len(part)) * S] = recipe.encode(store.read("videos/frames", part),
                                                                 store.read("videos/frame_mask", part))
            bar.advance(task, len(part))


def _load(folder: Path, name: str, head: Head, store: FeatureStore, config: Any) -> Any:
    """The kept first stage in ``folder``, or None where there is none whole (built again then)."""
    from tvrpipe.search.index import FirstStage

    try:
        meta = json.loads((folder / "distilled.json").read_text())
        scorer = None
        if name == Distilled.name:
            z = np.load(folder / "scorer.npz")
            scorer = Scorer(z["query_map"], z["video_map"], int(z["segments"]))
        elif name == LateInteraction.name:
            z = np.load(folder / "scorer.npz")
            scorer = TokenProjection(head, z["axes"], int(z["segments"]))
        vectors, rows = np.load(folder / "vectors.npy", mmap_mode="r"), np.load(folder / "rows.npy")
    except (OSError, ValueError, KeyError) as e:
        if folder.exists():
            log.warning("%s: the %s first stage cannot be read (%s); building it again", folder, name, e)
        return None
    recipe = _recipe(name, head, store, config, scorer)
    if len(vectors) != len(rows) * recipe.per_video:
        return None
    return FirstStage(vectors, rows, recipe.index(vectors), record=meta)
