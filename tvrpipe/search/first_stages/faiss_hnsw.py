"""The FAISS first stage: an inner-product index, exact (``IndexFlatIP``) below :data:`HNSW_FROM` videos, HNSW
above it."""

from __future__ import annotations

import numpy as np

HNSW_FROM = 20_000  # below it a flat index is exact and fast enough (a matrix product over 20k x D)
HNSW_M = 32  # FAISS' usual graph degree for 512-d embeddings
HNSW_EF_CONSTRUCTION = 80


def faiss_available() -> bool:
    """Whether faiss-cpu is installed (the ``search`` extra)."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def build_faiss(emb: np.ndarray):
    """An inner-product FAISS index of ``emb`` (L2-normalised rows: inner product = cosine)."""
    import faiss

    n, d = emb.shape
    if n < HNSW_FROM:
        index = faiss.IndexFlatIP(d)
    else:
        index = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    index.add(np.ascontiguousarray(emb, dtype=np.float32))
    return index


def faiss_kind(index) -> str:
    """A FAISS index in words, for index.json and the bench."""
    return type(index).__name__
