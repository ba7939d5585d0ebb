"""Evaluation: retrieval metrics, the chunked similarity engine, DSL / QB-Norm post-processing.

- :mod:`~tvrpipe.evaluation.metrics`: ranks (ties count against the model) and R@K / MdR / MnR
  from a similarity matrix, text-to-video and multi-caption video-to-text;
- :mod:`~tvrpipe.evaluation.engine`: encode each item once, compute ``head.similarity`` block by
  block, evaluate a head (:func:`evaluate_head`);
- :mod:`~tvrpipe.evaluation.post`: dual softmax and QB-Norm, reported under their own keys.

See DESIGN.md, "Evaluation protocol".
"""

from tvrpipe.evaluation.engine import (
    POST_PROCESSINGS,
    EvaluationConfigError,
    emb_len,
    encode_all,
    evaluate_head,
    similarity_matrix,
    slice_emb,
)
from tvrpipe.evaluation.metrics import evaluate_similarity, retrieval_metrics, t2v_ranks, v2t_ranks
from tvrpipe.evaluation.post import (
    QueryBankAccumulator,
    QueryBankSummary,
    apply_qb_norm,
    dual_softmax,
    qb_norm,
    querybank_summary,
)

__all__ = [
    "POST_PROCESSINGS",
    "EvaluationConfigError",
    "QueryBankAccumulator",
    "QueryBankSummary",
    "apply_qb_norm",
    "dual_softmax",
    "emb_len",
    "encode_all",
    "evaluate_head",
    "evaluate_similarity",
    "qb_norm",
    "querybank_summary",
    "retrieval_metrics",
    "similarity_matrix",
    "slice_emb",
    "t2v_ranks",
    "v2t_ranks",
]
