"""The evaluation engine: encode every item once, build the similarity matrix block by block.

A head's ``encode_texts`` / ``encode_videos`` do the per-item work; ``similarity`` does the
per-pair work (text-conditioned heads pool each video once per caption there). The engine calls
``similarity`` on ``block_texts x block_videos`` slices of the embeddings, so peak memory is set
by the block sizes and the head, never by ``n_text x n_video x D``; only the float32
``(n_text, n_video)`` score matrix itself is held, on the CPU.

The engine is stateless and draws no random numbers: a stochastic head (UATVR, DUQ, T-MASS
sampling) must be deterministic in ``eval()`` mode, which is the head's job (seeded sampling);
:func:`evaluate_head` only switches the head to eval mode and restores its mode afterwards.

Post-processing (``post=("dsl", "qbnorm")``) is computed from the same raw matrix and reported
under its own keys (see :mod:`tvrpipe.evaluation.post`). QB-Norm's querybank is streamed: each
batch of training captions is encoded, scored against the test videos with the same block engine,
and folded into a running summary, so a 180k-caption bank costs one batch of memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tvrpipe.errors import ConfigError, NonFiniteError
from tvrpipe.evaluation.metrics import retrieval_metrics, t2v_ranks, v2t_ranks
from tvrpipe.evaluation.post import (
    DSL_TEMPERATURE,
    QB_BETA,
    QB_K,
    QueryBankAccumulator,
    QueryBankSummary,
    apply_qb_norm,
    dual_softmax,
)
from tvrpipe.heads.base import Emb, Head, Reranked, TextBatch, VideoBatch
from tvrpipe.rundir import POST_PROCESSINGS

log = logging.getLogger(__name__)



class EvaluationConfigError(ConfigError, ValueError):
    """An evaluation option is invalid (a ConfigError for the CLI, a ValueError for callers)."""


def emb_len(emb: Emb) -> int:
    """Number of items in ``emb`` (the common first dimension of its tensors)."""
    if not emb:
        raise ValueError("an embedding dict must hold at least one tensor")
    sizes = {k: v.shape[0] for k, v in emb.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"embedding tensors disagree on the number of items: {sizes}")
    return next(iter(sizes.values()))


def slice_emb(emb: Emb, start: int, stop: int) -> Emb:
    """Items ``start:stop`` of every tensor of ``emb`` (views, no copy)."""
    return {k: v[start:stop] for k, v in emb.items()}


def _to(emb: Emb, device: torch.device | str) -> Emb:
    return {k: v.to(device, non_blocking=True) for k, v in emb.items()}


@torch.no_grad()
def encode_all(encode: Callable[[Any], Emb], batches: Iterable[TextBatch] | Iterable[VideoBatch],
               device: torch.device | str = "cpu") -> Emb:
    """Encode every batch once and concatenate the embeddings, on the CPU.

    Args:
        encode: ``head.encode_texts`` or ``head.encode_videos``.
        batches: ``TextBatch`` / ``VideoBatch`` objects (anything with ``.to(device)``), in item order.
        device: where ``encode`` runs.

    Returns:
        One ``Emb`` whose tensors hold all items in the order of the batches.

    Example:
        >>> emb = encode_all(head.encode_videos, video_batches)  # doctest: +SKIP
    """
    chunks: dict[str, list[Tensor]] = {}
    for i, batch in enumerate(batches):
        emb = encode(batch.to(device))
        emb_len(emb)
        if chunks and set(emb) != set(chunks):
            raise ValueError(f"batch {i} encoded to keys {sorted(emb)}, earlier batches to {sorted(chunks)}")
        for k, v in emb.items():
            chunks.setdefault(k, []).append(v.detach().cpu())
    if not chunks:
        raise ValueError("encode_all got no batches: nothing to evaluate")
    # One key at a time, its chunks released as soon as they are copied: the peak is all the
    # embeddings plus one key's chunks, not twice all the embeddings.
    return {k: torch.cat(chunks.pop(k)) for k in list(chunks)}


@torch.no_grad()
def _similarity_blocks(head: Head, text_emb: Emb, video_emb: Emb, block_texts: int, block_videos: int,
                       device: torch.device | str):
    """Yield ``(a, b, rows)``: float32 CPU similarities of texts ``a:b`` to all videos."""
    if block_texts < 1 or block_videos < 1:
        raise ValueError(f"block sizes must be >= 1, got {block_texts} x {block_videos}")
    n_t, n_v = emb_len(text_emb), emb_len(video_emb)
    for a in range(0, n_t, block_texts):
        b = min(a + block_texts, n_t)
        t = _to(slice_emb(text_emb, a, b), device)
        rows = torch.empty(b - a, n_v, dtype=torch.float32)
        for c in range(0, n_v, block_videos):
            d = min(c + block_videos, n_v)
            s = head.similarity(t, _to(slice_emb(video_emb, c, d), device))
            if tuple(s.shape) != (b - a, d - c):
                raise ValueError(f"{type(head).__name__}.similarity returned shape {tuple(s.shape)} "
                                 f"for a block of {b - a} texts x {d - c} videos")
            rows[:, c:d] = s.detach().float().cpu()
        yield a, b, rows


@torch.no_grad()
def similarity_matrix(head: Head, text_emb: Emb, video_emb: Emb, *, block_texts: int = 256,
                      block_videos: int = 4096, device: torch.device | str = "cpu") -> Tensor:
    """The float32 ``(n_text, n_video)`` similarity on the CPU, computed block by block.

    Each block is ``head.similarity(slice_emb(text_emb, a, b), slice_emb(video_emb, c, d))`` on
    ``device``; memory beyond the result is one block of the head's work.

    Example:
        >>> sim = similarity_matrix(head, text_emb, video_emb, block_texts=128)  # doctest: +SKIP
    """
    out = torch.empty(emb_len(text_emb), emb_len(video_emb), dtype=torch.float32)
    for a, b, rows in _similarity_blocks(head, text_emb, video_emb, block_texts, block_videos, device):
        out[a:b] = rows
    return out


@torch.no_grad()
def pair_readout_means(head: Head, text_emb: Emb, video_emb: Emb, text_video: np.ndarray, *,
                       block_texts: int = 256, block_videos: int = 4096,
                       device: torch.device | str = "cpu") -> dict[str, dict[str, float]]:
    """Means of the head's ``pair_readouts`` over matching and over non-matching pairs.

    Computed on the blocks of the similarity engine (bounded memory). A caption matches the
    video ``text_video`` names; every other (caption, video) pair is non-matching. Returns
    ``{name: {"match": mean, "nonmatch": mean}}``, empty for a head without readouts.

    Example:
        >>> pair_readout_means(head, text_emb, video_emb, text_video)  # doctest: +SKIP
        {'radius_l1': {'match': 3.1, 'nonmatch': 4.7}}
    """
    n_t, n_v = emb_len(text_emb), emb_len(video_emb)
    tv = torch.as_tensor(np.asarray(text_video), dtype=torch.long)
    sums: dict[str, list[float]] = {}  # name -> [sum over matching, sum over all pairs]
    for a in range(0, n_t, block_texts):
        b = min(a + block_texts, n_t)
        t = _to(slice_emb(text_emb, a, b), device)
        for c in range(0, n_v, block_videos):
            d = min(c + block_videos, n_v)
            out = head.pair_readouts(t, _to(slice_emb(video_emb, c, d), device))
            if not out:
                return {}
            col = tv[a:b] - c  # (b - a,) matching column inside this block, if any
            inside = (col >= 0) & (col < d - c)
            for name, x in out.items():
                if tuple(x.shape) != (b - a, d - c):
                    raise ValueError(f"{type(head).__name__}.pair_readouts[{name!r}] has shape {tuple(x.shape)} "
                                     f"for a block of {b - a} texts x {d - c} videos")
                x = x.detach().double().cpu()
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0] += float(x[inside.nonzero().flatten(), col[inside]].sum())
                acc[1] += float(x.sum())
    n_match = n_t
    n_non = n_t * n_v - n_match
    return {name: {"match": m / max(n_match, 1), "nonmatch": (total - m) / n_non if n_non else float("nan")}
            for name, (m, total) in sums.items()}


def query_readout_means(reranked: Reranked, sim: Tensor, text_video: np.ndarray) -> dict[str, dict[str, float]]:
    """Means of a re-ranking's per-query readouts over queries whose raw top-1 is correct and the rest.

    Returns ``{f"{name}_{direction}": {"correct": mean, "incorrect": mean}}`` (NaN for an empty group).
    """
    top1 = {"t2v": t2v_ranks(sim, text_video) == 1, "v2t": v2t_ranks(sim, text_video) == 1}
    captioned = torch.as_tensor(np.bincount(text_video, minlength=sim.shape[1]) > 0)  # v2t queries
    out = {}
    for direction, values in reranked.query_readouts.items():
        ok = torch.as_tensor(np.asarray(top1[direction]))
        for name, x in values.items():
            x = x.detach().double().cpu()
            x = x[captioned] if direction == "v2t" else x
            out[f"{name}_{direction}"] = {"correct": float(x[ok].mean()) if ok.any() else float("nan"),
                                          "incorrect": float(x[~ok].mean()) if (~ok).any() else float("nan")}
    return out


@torch.no_grad()
def _text_querybank(head: Head, querybank: Iterable[TextBatch], video_emb: Emb, *, k: int, beta: float,
                    block_texts: int, block_videos: int, device: torch.device | str) -> QueryBankSummary:
    """Stream training captions against the test videos into a QB-Norm summary (gallery = videos)."""
    acc = QueryBankAccumulator(emb_len(video_emb), k=k, beta=beta)
    for batch in querybank:
        bank_emb = head.encode_texts(batch.to(device))  # one batch, kept on device
        for _, _, rows in _similarity_blocks(head, bank_emb, video_emb, block_texts, block_videos, device):
            acc.update(rows)
    return acc.summary()


@torch.no_grad()
def _video_querybank(head: Head, querybank: Iterable[VideoBatch], text_emb: Emb, *, k: int, beta: float,
                     block_texts: int, block_videos: int, device: torch.device | str) -> QueryBankSummary:
    """Stream training videos against the test captions into a QB-Norm summary (gallery = texts)."""
    acc = QueryBankAccumulator(emb_len(text_emb), k=k, beta=beta)
    for batch in querybank:
        bank_emb = head.encode_videos(batch.to(device))
        # (n_text, n_bank_batch), computed with texts as rows as the head expects, then bank-major
        sims = similarity_matrix(head, text_emb, bank_emb, block_texts=block_texts,
                                 block_videos=block_videos, device=device)
        acc.update(sims.T)
    return acc.summary()


def _names(ids: Sequence[str] | None, idx: np.ndarray, what: str) -> str:
    shown = [str(ids[i]) if ids is not None else f"{what} {i}" for i in idx[:5]]
    return ", ".join(shown) + (f" (+{len(idx) - 5} more)" if len(idx) > 5 else "")


def check_finite(sim: Tensor, what: str, text_ids: Sequence[str] | None = None,
                 video_ids: Sequence[str] | None = None) -> Tensor:
    """``sim`` if every score is finite; else :class:`NonFiniteError` naming the rows and columns involved."""
    bad = ~torch.isfinite(sim)
    if not bad.any():
        return sim
    rows = torch.nonzero(bad.any(1)).flatten().numpy()
    cols = torch.nonzero(bad.any(0)).flatten().numpy()
    raise NonFiniteError(
        f"{int(bad.sum())} of {sim.shape[0]} x {sim.shape[1]} {what} scores are NaN or infinite, for "
        f"{len(rows)} captions ({_names(text_ids, rows, 'caption row')}) and {len(cols)} videos "
        f"({_names(video_ids, cols, 'video row')}); no metric is computed from them. The head's weights or "
        "these features hold NaN/inf: check the store with `tvrpipe features verify`, and retrain if the "
        "checkpoint is damaged"
    )


def check_post(post: Sequence[str]) -> tuple[str, ...]:
    if isinstance(post, str):
        post = (post,)
    unknown = sorted(set(post) - set(POST_PROCESSINGS))
    if unknown:
        known = ", ".join(POST_PROCESSINGS)
        raise EvaluationConfigError(f"unknown post-processing {unknown}; known: {known}")
    return tuple(dict.fromkeys(post))


@torch.no_grad()
def evaluate_head(
    head: Head,
    text_batches: Iterable[TextBatch],
    video_batches: Iterable[VideoBatch],
    text_video: np.ndarray,
    *,
    block_texts: int = 256,
    block_videos: int = 4096,
    device: torch.device | str = "cpu",
    post: Sequence[str] = (),
    querybank: Iterable[TextBatch] | None = None,
    video_querybank: Iterable[VideoBatch] | None = None,
    dsl_temperature: float = DSL_TEMPERATURE,
    qb_k: int = QB_K,
    qb_beta: float = QB_BETA,
    return_sim: bool = False,
    text_ids: Sequence[str] | None = None,
    video_ids: Sequence[str] | None = None,
    readouts: bool = False,
    ranks: bool = False,
) -> dict[str, Any]:
    """Evaluate a head on a test split: raw t2v / v2t metrics, plus requested post-processing.

    A NaN or infinite score stops the evaluation with :class:`~tvrpipe.errors.NonFiniteError`
    naming the captions and videos involved: no metric is computed from non-finite scores.

    Args:
        head: any head (``encode_texts``, ``encode_videos``, ``similarity``); put in eval mode
            for the call and restored to its previous mode afterwards.
        text_batches: the test captions, in the order of ``text_video``.
        video_batches: the test videos, in column order.
        text_video: ``(n_text,)`` column index of each caption's video.
        block_texts, block_videos: block sizes of the similarity engine.
        device: where the head runs; the score matrix is kept float32 on the CPU.
        post: any of ``"dsl"`` (dual softmax), ``"qbnorm"`` (QB-Norm, dynamic inverted softmax).
        querybank: training captions for ``"qbnorm"`` (text-to-video; required with it).
        video_querybank: training videos for video-to-text QB-Norm (optional): without it
            ``v2t_qbnorm`` is not reported, since a text bank cannot normalise caption scores.
        dsl_temperature: softmax multiplier of DSL (100 = CLIP's logit scale).
        qb_k, qb_beta: QB-Norm activation-set size and inverse temperature.
        return_sim: also return the raw float32 matrix under ``"sim"``.
        text_ids, video_ids: ids of the captions and videos, to name them in errors (default: indices).
        readouts: also report the head's ``pair_readouts`` averaged over matching and non-matching
            pairs (``{name: {"match", "nonmatch"}}``) and its ``item_readouts`` (``{name: value}``),
            and the means of a re-ranking's per-query readouts over correct and incorrect raw top-1
            retrievals (``{name_direction: {"correct", "incorrect"}}``), under ``"readouts"``.
        ranks: also return each query's raw rank (int32, in query order: the captions for t2v, the videos
            with a caption for v2t) under ``"ranks"``, ``{"t2v", "v2t"}``, for error bars over queries.

    Returns:
        ``{"t2v": {...}, "v2t": {...}, "n_texts": int, "n_videos": int}`` plus ``"t2v_dsl"``,
        ``"v2t_dsl"`` for DSL and ``"t2v_qbnorm"`` (and ``"v2t_qbnorm"`` with a video
        querybank) for QB-Norm; each metrics dict has R@1, R@5, R@10 (percent), MdR, MnR, n;
        ``"readouts"`` when asked for and the head has some; ``"t2v_rerank"`` and ``"v2t_rerank"``
        when the head declares a re-ranking (:meth:`Head.rerank`).

    Example:
        >>> res = evaluate_head(head, texts, videos, text_video, post=("dsl",))  # doctest: +SKIP
        >>> res["t2v"]["R@1"], res["t2v_dsl"]["R@1"]  # doctest: +SKIP
    """
    post = check_post(post)
    if "qbnorm" in post and querybank is None:
        raise EvaluationConfigError(
            "QB-Norm needs a querybank: pass querybank= (TextBatches of training captions), "
            "or drop 'qbnorm' from post"
        )
    was_training = head.training
    head.train(False)
    try:
        t0 = time.perf_counter()
        text_emb = encode_all(head.encode_texts, text_batches, device)
        video_emb = encode_all(head.encode_videos, video_batches, device)
        n_t, n_v = emb_len(text_emb), emb_len(video_emb)
        tv = np.asarray(text_video)
        if tv.shape != (n_t,):
            raise ValueError(f"text_video has shape {tv.shape}, but the text batches hold {n_t} captions")
        t1 = time.perf_counter()
        sim = similarity_matrix(head, text_emb, video_emb, block_texts=block_texts,
                                block_videos=block_videos, device=device)
        t2 = time.perf_counter()
        names = (text_ids, video_ids)
        check_finite(sim, "similarity", *names)
        raw = {"t2v": t2v_ranks(sim, tv), "v2t": v2t_ranks(sim, tv)}
        result: dict[str, Any] = {
            "t2v": retrieval_metrics(raw["t2v"]),
            "v2t": retrieval_metrics(raw["v2t"]),
            "n_texts": n_t,
            "n_videos": n_v,
        }
        if ranks:
            result["ranks"] = {d: np.asarray(r, dtype=np.int32) for d, r in raw.items()}
        reranked = head.rerank(sim, text_emb, video_emb)
        if reranked is not None:  # a head-declared step over the full matrix, reported apart from raw
            for direction, ranks in (("t2v", t2v_ranks), ("v2t", v2t_ranks)):
                m = check_finite(getattr(reranked, direction), f"re-ranked ({direction})", *names)
                result[f"{direction}_rerank"] = retrieval_metrics(ranks(m, tv))
        if readouts:
            means = pair_readout_means(head, text_emb, video_emb, tv, block_texts=block_texts,
                                       block_videos=block_videos, device=device)
            means.update(head.item_readouts(text_emb, video_emb))
            if reranked is not None:
                means.update(query_readout_means(reranked, sim, tv))
            if means:
                result["readouts"] = means
        if "dsl" in post and head.dsl_not_applicable:
            result["dsl_not_applicable"] = head.dsl_not_applicable
            log.info("%s: no DSL: %s", head.name, head.dsl_not_applicable)  # recorded in the result
        elif "dsl" in post:
            t2v_dsl = check_finite(dual_softmax(sim, dsl_temperature, dim=0), "DSL (t2v)", *names)
            v2t_dsl = check_finite(dual_softmax(sim, dsl_temperature, dim=1), "DSL (v2t)", *names)
            result["t2v_dsl"] = retrieval_metrics(t2v_ranks(t2v_dsl, tv))
            result["v2t_dsl"] = retrieval_metrics(v2t_ranks(v2t_dsl, tv))
        if "qbnorm" in post:
            bank = _text_querybank(head, querybank, video_emb, k=qb_k, beta=qb_beta,
                                   block_texts=block_texts, block_videos=block_videos, device=device)
            result["t2v_qbnorm"] = retrieval_metrics(t2v_ranks(check_finite(apply_qb_norm(sim, bank),
                                                                            "QB-Norm (t2v)", *names), tv))
            if video_querybank is not None:
                vbank = _video_querybank(head, video_querybank, text_emb, k=qb_k, beta=qb_beta,
                                         block_texts=block_texts, block_videos=block_videos, device=device)
                # videos are the queries: normalise the rows of sim.T, rank back in (text, video) layout
                v2t_qb = check_finite(apply_qb_norm(sim.T, vbank).T, "QB-Norm (v2t)", *names)
                result["v2t_qbnorm"] = retrieval_metrics(v2t_ranks(v2t_qb, tv))
            else:
                log.info("v2t QB-Norm skipped: it needs a bank of training videos (video_querybank=)")
        log.info("evaluated %d texts x %d videos: encode %.2fs, similarity %.2fs, metrics+post %.2fs",
                 n_t, n_v, t1 - t0, t2 - t1, time.perf_counter() - t2)
        if return_sim:
            result["sim"] = sim
        return result
    finally:
        head.train(was_training)
