"""The FAISS HNSW first stage (``faiss-hnsw``, also ``faiss``): an inner-product index, exact (``IndexFlatIP``)
below ``hnsw_from`` videos, HNSW (Malkov & Yashunin 2018, ``IndexHNSWFlat``) above it.

Its memory is the index, held whole in RAM: the float32 vectors again (``n x D x 4`` bytes) plus, for HNSW,
the graph (about ``2 M`` links of 4 bytes per video), beside the pooled embeddings the exact fallback reads.
The name ``faiss`` (what ``--first-stage`` called it first, and what index.json files written before the
registry record as ``"faiss": "<index type>"``) means this first stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from tvrpipe.config import at_least
from tvrpipe.search.first_stages.base import FirstStageIndex, StageConfig, register_first_stage
from tvrpipe.search.first_stages.exact import exact_where_short

FAISS_INDEX = "faiss.index"  # the file name other tools read (tvrpipe export --format faiss)

# faiss-cpu is all the `search` extra holds; tvrpipe is installed from a checkout, so the extra is not a name
# pip could fetch
NEEDS_FAISS = ("faiss-cpu (tvrpipe's search extra): pip install faiss-cpu, or in tvrpipe's checkout "
               "pip install -e '.[search]'")


def faiss_available() -> bool:
    """Whether faiss-cpu is installed (the ``search`` extra)."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def faiss_kind(index) -> str:
    """A FAISS index in words: its type."""
    return type(index).__name__


class FaissIndex(FirstStageIndex):
    """What every FAISS first stage shares (not registered itself): a FAISS index over the pooled embeddings,
    saved as :data:`FAISS_INDEX`; ``mmap``: loaded memory-mapped, its lists left on disk."""

    files = (FAISS_INDEX,)
    install = NEEDS_FAISS
    mmap: ClassVar[bool] = False

    def __init__(self, pooled: np.ndarray, config: StageConfig, index) -> None:
        super().__init__(pooled, config)
        self.index = index

    @classmethod
    def available(cls) -> bool:
        return faiss_available()

    @classmethod
    def flat(cls, pooled: np.ndarray, config: StageConfig) -> FaissIndex:
        """The exact inner-product index (``IndexFlatIP``) of ``pooled``: what a FAISS first stage builds below
        its size threshold, where an approximate index would save nothing."""
        import faiss

        index = faiss.IndexFlatIP(pooled.shape[1])
        index.add(np.ascontiguousarray(pooled, dtype=np.float32))
        return cls(pooled, config, index)

    def save(self, folder: Path) -> None:
        import faiss

        faiss.write_index(self.index, str(Path(folder) / FAISS_INDEX))

    @classmethod
    def load(cls, folder: Path, pooled: np.ndarray, config: StageConfig | None = None) -> FaissIndex:
        import faiss

        flags = faiss.IO_FLAG_MMAP if cls.mmap else 0
        return cls(pooled, config or cls.Config(), faiss.read_index(str(Path(folder) / FAISS_INDEX), flags))


@register_first_stage("faiss-hnsw", aliases=("faiss",))
class FaissHNSW(FaissIndex):
    """A FAISS inner-product index in RAM: flat (exact) for a small store, an HNSW graph for a large one."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        hnsw_from: int = at_least(1, 20_000)  # below it a flat index is exact and fast enough (20k x D products)
        m: int = at_least(2, 32)  # M, the graph degree: FAISS' usual value for 512-d embeddings
        ef_construction: int = at_least(1, 80)  # the build's beam; choice: FAISS' default is 40, 80 links better
        ef_search: int = at_least(1, 64)  # the search's beam, raised to k where k is larger (a smaller one truncates)

    summary = (f"a FAISS index in RAM: exact (IndexFlatIP) below {Config.hnsw_from:,} videos, HNSW above "
               "(needs faiss-cpu)")
    search_fields = ("ef_search",)
    auto_rank = 1  # auto's choice where faiss-cpu is installed

    @classmethod
    def build(cls, pooled: np.ndarray, config: StageConfig | None = None) -> FaissHNSW:
        import faiss

        config = config or cls.Config()
        n, d = pooled.shape
        if n < config.hnsw_from:
            return cls.flat(pooled, config)
        index = faiss.IndexHNSWFlat(d, config.m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = config.ef_construction
        index.add(np.ascontiguousarray(pooled, dtype=np.float32))
        return cls(pooled, config, index)

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if hasattr(self.index, "hnsw"):
            self.index.hnsw.efSearch = max(self.config.ef_search, k)  # the beam must hold k: efSearch < k truncates
        scores, idx = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        return exact_where_short(idx, scores, self.pooled, queries, k)

    def describe(self) -> str:
        if hasattr(self.index, "hnsw"):  # the graph's own settings: a loaded index may predate the config's
            hnsw = self.index.hnsw
            return (f"faiss-hnsw: {faiss_kind(self.index)} M={hnsw.nb_neighbors(1)} "
                    f"efConstruction={hnsw.efConstruction} efSearch=max({self.config.ef_search}, k)")
        return f"faiss-hnsw: {faiss_kind(self.index)} (exact below {self.config.hnsw_from:,} videos)"
