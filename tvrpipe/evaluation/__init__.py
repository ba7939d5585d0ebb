"""Evaluation: retrieval metrics, the chunked similarity engine, DSL / QB-Norm post-processing.

- :mod:`~tvrpipe.evaluation.metrics`: ranks (ties count against the model) and R@K / MdR / MnR
  from a similarity matrix, text-to-video and multi-caption video-to-text;
- :mod:`~tvrpipe.evaluation.engine`: encode each item once, compute ``head.similarity`` block by
  block, evaluate a head (:func:`evaluate_head`) over a table of score variants (:data:`VARIANTS`);
- :mod:`~tvrpipe.evaluation.post`: dual softmax and QB-Norm, reported under their own keys.

The run directory the trainers write and the readers read is :mod:`tvrpipe.rundir`.

Names load on first use, so that importing the package does not import torch.

See docs/design.md, "Evaluation protocol", and docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    **dict.fromkeys(("POST_PROCESSINGS", "VARIANTS", "EvalInputs", "EvalOptions", "EvaluationConfigError",
                     "ScoreVariant", "emb_len", "encode_all", "evaluate_head", "similarity_matrix", "slice_emb"),
                    "tvrpipe.evaluation.engine"),
    **dict.fromkeys(("evaluate_similarity", "retrieval_metrics", "t2v_ranks", "v2t_ranks"),
                    "tvrpipe.evaluation.metrics"),
    **dict.fromkeys(("QueryBankAccumulator", "QueryBankSummary", "apply_qb_norm", "dual_softmax", "qb_norm",
                     "querybank_summary"), "tvrpipe.evaluation.post"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tvrpipe.evaluation' has no attribute {name!r}")
