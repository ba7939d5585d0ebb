"""The evaluation engine: encode every item once, build the similarity matrix block by block.

A head's ``encode_texts`` / ``encode_videos`` do the per-item work; ``similarity`` does the
per-pair work (text-conditioned heads pool each video once per caption there). The engine calls
``similarity`` on ``block_texts x block_videos`` slices of the embeddings, so peak memory is set
by the block sizes and the head, never by ``n_text x n_video x D``; only the float32
``(n_text, n_video)`` score matrix itself is held, on the CPU.

The engine is stateless and draws no random numbers: a stochastic head (UATVR, DUQ, T-MASS
sampling) must be deterministic in ``eval()`` mode, which is the head's job (seeded sampling);
:func:`evaluate_head` only switches the head to eval mode and restores its mode afterwards.

What an evaluation reports is a table, :data:`VARIANTS`: the raw scores, the head's own re-ranking,
and the post-processing (``post=("dsl", "qbnorm")``), each computed from the same raw matrix and
reported under its own keys (see :mod:`tvrpipe.evaluation.post`). A row (:class:`ScoreVariant`) says
when it applies and yields the matrices it ranks; :func:`evaluate_head` checks each one finite, ranks
it and writes its metrics under ``score_key(name, direction)``, the same for every row. QB-Norm's
querybank is streamed: each batch of training captions is encoded, scored against the test videos
with the same block engine, and folded into a running summary, so a 180k-caption bank costs one
batch of memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
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
from tvrpipe.rundir import DIRECTIONS, POST_PROCESSINGS, score_key

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
def _text_querybank(head: Head, querybank: Iterable[TextBatch], video_emb: Emb, o: EvalOptions) -> QueryBankSummary:
    """Stream training captions against the test videos into a QB-Norm summary (gallery = videos)."""
    acc = QueryBankAccumulator(emb_len(video_emb), k=o.qb_k, beta=o.qb_beta)
    for batch in querybank:
        bank_emb = head.encode_texts(batch.to(o.device))  # one batch, kept on device
        for _, _, rows in _similarity_blocks(head, bank_emb, video_emb, o.block_texts, o.block_videos, o.device):
            acc.update(rows)
    return acc.summary()


@torch.no_grad()
def _video_querybank(head: Head, querybank: Iterable[VideoBatch], text_emb: Emb, o: EvalOptions) -> QueryBankSummary:
    """Stream training videos against the test captions into a QB-Norm summary (gallery = texts)."""
    acc = QueryBankAccumulator(emb_len(text_emb), k=o.qb_k, beta=o.qb_beta)
    for batch in querybank:
        bank_emb = head.encode_videos(batch.to(o.device))
        # (n_text, n_bank_batch), computed with texts as rows as the head expects, then bank-major
        sims = similarity_matrix(head, text_emb, bank_emb, block_texts=o.block_texts,
                                 block_videos=o.block_videos, device=o.device)
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
    """``post`` as a tuple without repeats (a lone name is a one-name tuple), every name known.

    Raises:
        EvaluationConfigError: a name that is not in :data:`~tvrpipe.rundir.POST_PROCESSINGS`.
    """
    if isinstance(post, str):
        post = (post,)
    unknown = sorted(set(post) - set(POST_PROCESSINGS))
    if unknown:
        known = ", ".join(POST_PROCESSINGS)
        raise EvaluationConfigError(f"unknown post-processing {unknown}; known: {known}")
    return tuple(dict.fromkeys(post))


@dataclass(frozen=True)
class EvalInputs:
    """What :func:`evaluate_head` scores: the test split, and the training items QB-Norm normalises with.

    Attributes:
        texts: the test captions (``TextBatch`` objects), in the order of ``text_video``.
        videos: the test videos (``VideoBatch`` objects), in column order.
        text_video: ``(n_text,)`` column index of each caption's video.
        text_ids, video_ids: ids of the captions and videos, to name them in errors (default: indices).
        querybank: training captions for ``"qbnorm"`` (text-to-video; required with it).
        video_querybank: training videos for video-to-text QB-Norm (optional): without it
            ``v2t_qbnorm`` is not reported, since a text bank cannot normalise caption scores.
    """

    texts: Iterable[TextBatch]
    videos: Iterable[VideoBatch]
    text_video: np.ndarray
    text_ids: Sequence[str] | None = None
    video_ids: Sequence[str] | None = None
    querybank: Iterable[TextBatch] | None = None
    video_querybank: Iterable[VideoBatch] | None = None


@dataclass(frozen=True)
class EvalOptions:
    """How :func:`evaluate_head` scores: the engine's blocks and device, post-processing, what it returns.

    Attributes:
        block_texts, block_videos: block sizes of the similarity engine.
        device: where the head runs; the score matrix is kept float32 on the CPU.
        post: any of ``"dsl"`` (dual softmax), ``"qbnorm"`` (QB-Norm, dynamic inverted softmax); checked
            and made a tuple without repeats as the options are built (:func:`check_post`).
        dsl_temperature: softmax multiplier of DSL (100 = CLIP's logit scale).
        qb_k, qb_beta: QB-Norm activation-set size and inverse temperature.
        readouts: also report the head's ``pair_readouts`` averaged over matching and non-matching
            pairs (``{name: {"match", "nonmatch"}}``) and its ``item_readouts`` (``{name: value}``),
            and the means of a re-ranking's per-query readouts over correct and incorrect raw top-1
            retrievals (``{name_direction: {"correct", "incorrect"}}``), under ``"readouts"``.
        ranks: also return each query's raw rank (int32, in query order: the captions for t2v, the videos
            with a caption for v2t) under ``"ranks"``, ``{"t2v", "v2t"}``, for error bars over queries.
        return_sim: also return the raw float32 matrix under ``"sim"``.
    """

    block_texts: int = 256
    block_videos: int = 4096
    device: torch.device | str = "cpu"
    post: Sequence[str] = ()
    dsl_temperature: float = DSL_TEMPERATURE
    qb_k: int = QB_K
    qb_beta: float = QB_BETA
    readouts: bool = False
    ranks: bool = False
    return_sim: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "post", check_post(self.post))


@dataclass(frozen=True)
class Scoring:
    """What a score variant reads: the raw scores of an evaluation and what they were computed from."""

    head: Head
    sim: Tensor  # (n_text, n_video) float32 on the CPU, raw, finite
    text_emb: Emb
    video_emb: Emb
    text_video: np.ndarray  # (n_text,) column of each caption's video
    reranked: Reranked | None  # the head's own re-ranking (Head.rerank), None for most heads
    inputs: EvalInputs
    options: EvalOptions


@dataclass(frozen=True)
class ScoreVariant:
    """One row of :data:`VARIANTS`: a way to score the test split, reported apart from the others.

    :func:`evaluate_head` ranks every matrix that ``scores`` yields and writes its metrics under
    ``score_key(name, direction)`` (``t2v``, ``v2t_dsl``, ...); nothing else writes a metric key.

    Attributes:
        name: the variant's name, one of :data:`~tvrpipe.rundir.SCORE_VARIANTS`.
        label: how a :class:`~tvrpipe.errors.NonFiniteError` names its scores; None for the raw scores,
            which are checked as they are computed.
        wanted: whether this evaluation asks for it (the options, or the head for its re-ranking).
        scores: ``(direction, (n_text, n_video) scores)`` pairs, one at a time, so that only one
            post-processed matrix is held at once; a direction it cannot score is left out.
        not_applicable: why the head opts out of a variant it is asked for (recorded under
            ``"<name>_not_applicable"``), or None.
    """

    name: str
    label: str | None
    wanted: Callable[[Scoring], bool]
    scores: Callable[[Scoring], Iterator[tuple[str, Tensor]]]
    not_applicable: Callable[[Scoring], str | None] = lambda s: None


def _raw_scores(s: Scoring) -> Iterator[tuple[str, Tensor]]:
    yield "t2v", s.sim
    yield "v2t", s.sim


def _reranked_scores(s: Scoring) -> Iterator[tuple[str, Tensor]]:
    yield "t2v", s.reranked.t2v
    yield "v2t", s.reranked.v2t


def _dsl_scores(s: Scoring) -> Iterator[tuple[str, Tensor]]:
    # the prior runs over the texts for t2v and over the videos for v2t (evaluation/post.py)
    yield "t2v", dual_softmax(s.sim, s.options.dsl_temperature, dim=0)
    yield "v2t", dual_softmax(s.sim, s.options.dsl_temperature, dim=1)


def _qbnorm_scores(s: Scoring) -> Iterator[tuple[str, Tensor]]:
    yield "t2v", apply_qb_norm(s.sim, _text_querybank(s.head, s.inputs.querybank, s.video_emb, s.options))
    if s.inputs.video_querybank is None:
        log.info("v2t QB-Norm skipped: it needs a bank of training videos (video_querybank=)")
        return
    bank = _video_querybank(s.head, s.inputs.video_querybank, s.text_emb, s.options)
    # videos are the queries: normalise the rows of sim.T, rank back in (text, video) layout
    yield "v2t", apply_qb_norm(s.sim.T, bank).T


# Every score variant an evaluation can report, in the order it computes them (tables order them by
# rundir.SCORE_VARIANTS). A new variant is one row here.
VARIANTS: tuple[ScoreVariant, ...] = (
    ScoreVariant("raw", None, lambda s: True, _raw_scores),
    ScoreVariant("rerank", "re-ranked", lambda s: s.reranked is not None, _reranked_scores),
    ScoreVariant("dsl", "DSL", lambda s: "dsl" in s.options.post, _dsl_scores,
                 not_applicable=lambda s: s.head.dsl_not_applicable),
    ScoreVariant("qbnorm", "QB-Norm", lambda s: "qbnorm" in s.options.post, _qbnorm_scores),
)

RANKS = {"t2v": t2v_ranks, "v2t": v2t_ranks}  # direction -> the ranks of its queries in a (text, video) matrix


def readout_means(s: Scoring) -> dict[str, Any]:
    """The head's readouts on the test split (:attr:`EvalOptions.readouts`), empty for a head without any."""
    o = s.options
    means: dict[str, Any] = pair_readout_means(s.head, s.text_emb, s.video_emb, s.text_video,
                                               block_texts=o.block_texts, block_videos=o.block_videos,
                                               device=o.device)
    means.update(s.head.item_readouts(s.text_emb, s.video_emb))
    if s.reranked is not None:
        means.update(query_readout_means(s.reranked, s.sim, s.text_video))
    return means


@torch.no_grad()
def evaluate_head(head: Head, inputs: EvalInputs, options: EvalOptions = EvalOptions()) -> dict[str, Any]:
    """Evaluate a head on a test split: raw t2v / v2t metrics, and every other variant of :data:`VARIANTS`
    that applies (the head's re-ranking, the requested post-processing).

    A NaN or infinite score stops the evaluation with :class:`~tvrpipe.errors.NonFiniteError`
    naming the captions and videos involved: no metric is computed from non-finite scores.

    Args:
        head: any head (``encode_texts``, ``encode_videos``, ``similarity``); put in eval mode
            for the call and restored to its previous mode afterwards.
        inputs: the test split's captions and videos, and the querybanks (:class:`EvalInputs`).
        options: block sizes, device, post-processing and what to return besides the metrics
            (:class:`EvalOptions`).

    Returns:
        ``{"t2v": {...}, "v2t": {...}, "n_texts": int, "n_videos": int}`` plus, for each other variant
        that applies, its directions' metrics under :func:`~tvrpipe.rundir.score_key`: ``"t2v_rerank"``
        and ``"v2t_rerank"`` when the head declares a re-ranking (:meth:`Head.rerank`), ``"t2v_dsl"`` and
        ``"v2t_dsl"`` for DSL (or ``"dsl_not_applicable"``, the head's reason, where it opts out), and
        ``"t2v_qbnorm"`` (and ``"v2t_qbnorm"`` with a video querybank) for QB-Norm; each metrics dict has
        R@1, R@5, R@10 (percent), MdR, MnR, n. ``"ranks"``, ``"readouts"`` (when the head has some) and
        ``"sim"`` when the options ask for them.

    Example:
        >>> res = evaluate_head(head, EvalInputs(texts, videos, text_video),
        ...                     EvalOptions(post=("dsl",)))  # doctest: +SKIP
        >>> res["t2v"]["R@1"], res["t2v_dsl"]["R@1"]  # doctest: +SKIP
    """
    if "qbnorm" in options.post and inputs.querybank is None:
        raise EvaluationConfigError(
            "QB-Norm needs a querybank: pass querybank= (TextBatches of training captions), "
            "or drop 'qbnorm' from post"
        )
    was_training = head.training
    head.train(False)
    try:
        return _evaluate(head, inputs, options)
    finally:
        head.train(was_training)


# the keys a result leads with, in the order metrics.json has always written them: the raw scores, the sizes,
# the ranks, the head's re-ranking, its readouts; then the post-processing in the table's order
_LEADING = ("t2v", "v2t", "n_texts", "n_videos", "ranks", "t2v_rerank", "v2t_rerank", "readouts")


def _in_record_order(result: dict[str, Any]) -> dict[str, Any]:
    return {**{k: result[k] for k in _LEADING if k in result}, **result}


def _evaluate(head: Head, inputs: EvalInputs, o: EvalOptions) -> dict[str, Any]:
    t0 = time.perf_counter()
    text_emb = encode_all(head.encode_texts, inputs.texts, o.device)
    video_emb = encode_all(head.encode_videos, inputs.videos, o.device)
    n_t, n_v = emb_len(text_emb), emb_len(video_emb)
    tv = np.asarray(inputs.text_video)
    if tv.shape != (n_t,):
        raise ValueError(f"text_video has shape {tv.shape}, but the text batches hold {n_t} captions")
    t1 = time.perf_counter()
    sim = similarity_matrix(head, text_emb, video_emb, block_texts=o.block_texts, block_videos=o.block_videos,
                            device=o.device)
    t2 = time.perf_counter()
    names = (inputs.text_ids, inputs.video_ids)
    check_finite(sim, "similarity", *names)
    s = Scoring(head, sim, text_emb, video_emb, tv, head.rerank(sim, text_emb, video_emb), inputs, o)
    result: dict[str, Any] = {"n_texts": n_t, "n_videos": n_v}
    ranks: dict[str, np.ndarray] = {}  # score key -> the ranks of its queries
    for variant in VARIANTS:
        if not variant.wanted(s):
            continue
        why = variant.not_applicable(s)
        if why:
            result[f"{variant.name}_not_applicable"] = why
            log.info("%s: no %s: %s", head.name, variant.label, why)  # recorded in the result
            continue
        for direction, scores in variant.scores(s):
            if variant.label is not None:
                check_finite(scores, f"{variant.label} ({direction})", *names)
            key = score_key(variant.name, direction)
            ranks[key] = RANKS[direction](scores, tv)
            result[key] = retrieval_metrics(ranks[key])
            del scores  # released before the next direction's scores are computed
    if o.ranks:
        result["ranks"] = {d: np.asarray(ranks[score_key("raw", d)], dtype=np.int32) for d in DIRECTIONS}
    if o.readouts and (means := readout_means(s)):
        result["readouts"] = means
    result = _in_record_order(result)
    log.info("evaluated %d texts x %d videos: encode %.2fs, similarity %.2fs, metrics+post %.2fs",
             n_t, n_v, t1 - t0, t2 - t1, time.perf_counter() - t2)
    if o.return_sim:
        result["sim"] = sim
    return result
