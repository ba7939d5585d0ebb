"""Optional post-processing of a similarity matrix: dual softmax (DSL) and QB-Norm.

Both change the scores with information beyond one (query, gallery item) pair, so tvrpipe
reports them under their own keys (``t2v_dsl``, ``t2v_qbnorm``, ...) next to the raw numbers,
never in their place (docs/design.md, "Evaluation protocol").

Dual softmax at inference (DSL; Cheng et al. 2021, "Improving Video-Text Retrieval by
Multi-Stream Corpus Alignment and Dual Softmax Loss", arXiv:2109.04290). The inference rule we
follow is the one of the public code that reports it, e.g. UATVR ``main_task_retrieval.py``
(``--DSL``; github.com/bofang98/UATVR)::

    t2v = sim   * softmax(sim,   dim=0) * n_text    # sim already x logit_scale (= 100)
    v2t = sim.T * softmax(sim.T, dim=0) * n_video

i.e. text-to-video scores are multiplied by a prior that is a softmax over the *text* axis
(how strongly this video prefers this caption over the other test captions), and
video-to-text scores by a softmax over the *video* axis. Our ``sim`` is the head's unscaled
similarity, so ``temperature=100`` reproduces CLIP's saturated logit scale; the constant factors
``n_text`` / ``n_video`` / ``logit_scale`` do not change any ranking and are dropped. The prior
uses every test query at once (a test-set prior, the same thing DUQ's evaluation always does
silently): that is why it is reported separately. We compute it in float64: with
``temperature=100`` the prior ``exp(100 s - logsumexp)`` can underflow float32 to exact zeros
(once a caption trails a column's best by ~1 in cosine), which would tie and, ties counting
against the model, cost ranks the official (arbitrary tie-breaking) code does not lose.
CAMoE's training-time ``DSL.py`` (github.com/starmemda/CAMoE) uses the same product with the
softmax over ``dim=0``.

QB-Norm with the dynamic inverted softmax (Bogolin et al., "Cross Modal Retrieval with Querybank
Normalisation", CVPR 2022; official code github.com/ioanacroi/qb-norm,
``dynamic_inverted_softmax.py``). A querybank ``B`` of *training* queries is scored against the
test gallery. With ``s(q, g)`` the similarity and ``beta`` the inverse temperature (20 in the
official README for all but CLIP2Video and LSMDC-CLIP4Clip):

- activation set ``A`` = gallery items that are among the top-``k`` of at least one bank query;
- a test query ``q`` is normalised iff its top-1 gallery item lies in ``A``; then for every ``g``
  ``s'(q, g) = exp(beta s(q, g)) / sum_{b in B} exp(beta s(b, g))``; otherwise ``s'(q, g) = s(q, g)``.

As in the official code (``get_index_to_normalize`` looks at ``argsort(-sims)[:, 0]``) the test
query's *top-1* decides, while ``k`` sizes the activation set. Our choices, none of which changes
a ranking the official code produces on tie-free inputs:

- normalised rows hold the logarithm of the paper's score, ``beta s(q, g) - logsumexp_b beta
  s(b, g)``: the same order within the row, but no overflow (``exp(20 s)`` overflows float32 as
  soon as ``s > 4.4``, e.g. for logit-scaled heads); rows are only ever compared within
  themselves (query-wise ranking), never across queries;
- ties: the bank's top-``k`` includes every item tied with its ``k``-th score, and a test query is
  normalised when *any* item tied at its maximum is in ``A`` (the official ``argsort`` breaks ties
  by memory order, which would make the result depend on the video order);
- the querybank is summarised in a stream (:class:`QueryBankAccumulator`): a running
  ``logsumexp`` and activation mask per gallery item, so a 180k-caption bank never has to be held
  as one matrix;
- the result is float64 (as is DSL's): log-domain scores of float32 inputs would otherwise
  round to spurious ties, and ties count against the model;
- the official code writes into its input array (``test_test_normalized = test_test``); ours
  returns a new matrix.

For video-to-text the roles swap: the queries are test videos, the gallery the test captions and
the bank a set of training *videos* (:func:`apply_qb_norm` on ``sim.T``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from tvrpipe.evaluation.metrics import BLOCK_ROWS, as_tensor

log = logging.getLogger(__name__)

DSL_TEMPERATURE = 100.0  # CLIP's logit scale (exp(4.6052)), the scale UATVR's DSL runs at
QB_BETA = 20.0  # beta, official qb-norm README ("The value used for the inverse temperature is 20")
QB_K = 1  # k, official dynamic_inverted_softmax.py default

M = TypeVar("M", np.ndarray, Tensor)


def _like(result: Tensor, sim: Any) -> Any:
    """``result`` as the same kind (NumPy array or tensor) as the input ``sim``."""
    return result.numpy() if isinstance(sim, np.ndarray) else result


def dual_softmax(sim: M, temperature: float = DSL_TEMPERATURE, dim: int = 0, *,
                 block_rows: int = BLOCK_ROWS) -> M:
    """Dual-softmax re-scoring ``sim * softmax(temperature * sim, dim)``.

    Args:
        sim: ``(n_text, n_video)`` similarities (NumPy or torch; the result is of the same kind,
            float64).
        temperature: multiplier inside the softmax (100 = CLIP's logit scale).
        dim: the axis of the prior: ``0`` (over texts) for text-to-video ranking, ``1`` (over
            videos) for video-to-text ranking.
        block_rows: rows per block; memory beyond the output is one block.

    Example:
        >>> dual_softmax(np.array([[0.6, 0.5], [0.9, 0.2]]), temperature=10.0).round(3)
        array([[0.028, 0.476],
               [0.857, 0.009]])
    """
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 (prior over texts, t2v) or 1 (over videos, v2t), got {dim}")
    s = as_tensor(sim)
    out = torch.empty(s.shape, dtype=torch.float64)

    def blocks():
        for a in range(0, s.shape[0], block_rows):
            yield a, s[a : a + block_rows].to(torch.float64)

    if dim == 0:
        # Column-wise logsumexp over all texts, streamed over row blocks.
        lse = torch.full((s.shape[1],), -torch.inf, dtype=torch.float64)
        for _, block in blocks():
            lse = torch.logaddexp(lse, torch.logsumexp(temperature * block, dim=0))
        for a, block in blocks():
            out[a : a + block_rows] = block * torch.exp(temperature * block - lse)
    else:
        for a, block in blocks():
            out[a : a + block_rows] = block * torch.softmax(temperature * block, dim=1)
    return _like(out, sim)


@dataclass(frozen=True)
class QueryBankSummary:
    """What QB-Norm needs of a querybank, per gallery item."""

    log_norm: Tensor  # (n_gallery,) float64: log sum_b exp(beta * s(b, g))
    active: Tensor  # (n_gallery,) bool: g is in the top-k of at least one bank query
    n_bank: int
    k: int
    beta: float


class QueryBankAccumulator:
    """Streams blocks of bank-vs-gallery similarities into a :class:`QueryBankSummary`.

    Example:
        >>> acc = QueryBankAccumulator(n_gallery=3, k=1, beta=20.0)
        >>> acc.update(np.array([[0.9, 0.1, 0.2], [0.8, 0.3, 0.1]]))
        >>> acc.summary().active.tolist()
        [True, False, False]
    """

    def __init__(self, n_gallery: int, k: int = QB_K, beta: float = QB_BETA) -> None:
        if k < 1:
            raise ValueError(f"QB-Norm k must be >= 1, got {k}")
        self.k, self.beta, self.n_bank = k, float(beta), 0
        # float64: the normaliser sums up to ~1e5 exponentials of large arguments
        self.log_norm = torch.full((n_gallery,), -torch.inf, dtype=torch.float64)
        self.active = torch.zeros(n_gallery, dtype=torch.bool)

    def update(self, bank_sim: Any) -> None:
        """Add ``(n_bank_block, n_gallery)`` similarities of bank queries to the gallery."""
        b = as_tensor(bank_sim).to(torch.float64)
        if b.shape[1] != self.log_norm.shape[0]:
            n_gallery = self.log_norm.shape[0]
            raise ValueError(f"bank block has {b.shape[1]} gallery columns, expected {n_gallery}")
        if b.shape[0] == 0:
            return
        n_nan = int(torch.isnan(b).sum())
        if n_nan:
            raise ValueError(f"querybank similarities have {n_nan} NaN value(s)")
        self.log_norm = torch.logaddexp(self.log_norm, torch.logsumexp(self.beta * b, dim=0))
        kth = b.topk(min(self.k, b.shape[1]), dim=1).values[:, -1:]  # (n_bank_block, 1)
        self.active |= (b >= kth).any(0)  # ties with the k-th score are in the top-k
        self.n_bank += b.shape[0]

    def summary(self) -> QueryBankSummary:
        return QueryBankSummary(self.log_norm.clone(), self.active.clone(), self.n_bank, self.k, self.beta)


def querybank_summary(querybank_sim: Any, k: int = QB_K, beta: float = QB_BETA, *,
                      block_rows: int = BLOCK_ROWS) -> QueryBankSummary:
    """Summarise a whole ``(n_bank, n_gallery)`` querybank similarity matrix."""
    qb = as_tensor(querybank_sim)
    acc = QueryBankAccumulator(qb.shape[1], k=k, beta=beta)
    for a in range(0, qb.shape[0], block_rows):
        acc.update(qb[a : a + block_rows])
    return acc.summary()


def apply_qb_norm(sim: M, summary: QueryBankSummary, *, block_rows: int = BLOCK_ROWS) -> M:
    """Dynamic inverted softmax of the rows (queries) of ``sim`` against a summarised bank.

    Rows whose top-1 gallery item is in the activation set become ``beta * s - log_norm``
    (the log of the paper's inverted softmax); the others keep their raw scores. Compare the
    result only within rows.
    """
    s = as_tensor(sim)
    if s.shape[1] != summary.log_norm.shape[0]:
        raise ValueError(f"sim has {s.shape[1]} gallery columns, the querybank {summary.log_norm.shape[0]}")
    out = s.to(torch.float64, copy=True)  # never writes into the caller's matrix
    n_normalised = 0
    for a in range(0, s.shape[0], block_rows):
        block = s[a : a + block_rows]  # (b, n_gallery)
        top1 = block == block.max(dim=1, keepdim=True).values  # every item tied at the maximum
        normalise = (top1 & summary.active).any(1)  # (b,)
        if normalise.any():
            rows = block[normalise].to(torch.float64)
            out[a : a + block_rows][normalise] = summary.beta * rows - summary.log_norm
            n_normalised += int(normalise.sum())
    log.debug("QB-Norm normalised %d of %d queries (bank of %d, k=%d, beta=%g)", n_normalised,
              s.shape[0], summary.n_bank, summary.k, summary.beta)
    return _like(out, sim)


def qb_norm(sim: M, querybank_sim: Any, k: int = QB_K, beta: float = QB_BETA) -> M:
    """QB-Norm with the dynamic inverted softmax (Bogolin et al., CVPR 2022).

    Args:
        sim: ``(n_query, n_gallery)`` test similarities (rows are the queries).
        querybank_sim: ``(n_bank, n_gallery)`` similarities of training queries to the same test
            gallery.
        k: a gallery item is in the activation set if it is in the top-``k`` of some bank query.
        beta: inverse temperature of the inverted softmax.

    Returns:
        The re-scored matrix, float64, same kind (NumPy / torch) as ``sim``; only row-wise ranking
        is meaningful.

    Example:
        >>> sim = np.array([[0.9, 0.8], [0.1, 0.7]])
        >>> bank = np.array([[0.95, 0.2]])  # the bank's top-1 is gallery item 0, a hub
        >>> qb_norm(sim, bank, beta=20.0).argmax(1).tolist()  # query 0 is normalised
        [1, 1]
    """
    return apply_qb_norm(sim, querybank_summary(querybank_sim, k=k, beta=beta))
