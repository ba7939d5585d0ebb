"""The FAISS IVF-PQ first stage (``faiss-ivfpq``): an index that need not fit in RAM.

``IndexIVFPQ`` (Jegou et al., "Product quantization for nearest neighbor search", TPAMI 2011) with inner
product over the L2-normalised pooled embeddings: a coarse quantizer of ``nlist`` centroids splits the videos
into lists, and each video is kept as ``m`` one-byte codes of its residual (``m`` bytes a video, against
``4 D`` for the vectors). A query scans the ``nprobe`` lists nearest to it; the index's ``refine x k`` best
are then scored exactly against ``pooled.npy`` (a memory map: only those rows are read), and the ``k`` best
of those kept, so the scores are cosines and the order is exact among the candidates.

Memory. Building holds the training sample (at most ``train_size`` vectors), one block of ``block`` vectors
and the codes (``m + 8`` bytes a video with its id); :meth:`FaissIVFPQ.load` maps the saved index with
``IO_FLAG_MMAP``, so the lists stay on disk and only the probed ones are paged in; RAM holds the coarse
centroids (``nlist x D`` float32) and the PQ codebooks. Below ``ivf_from`` videos a flat index (exact) is
built instead, as ``faiss-hnsw`` does below its threshold: too few vectors train the codebooks poorly, and so
few fit in RAM anyway.

Choices where FAISS gives a range, not a value: ``nlist`` = 4 sqrt(n) (FAISS' guideline: 4 to 16 sqrt(n)),
at most the sample / 39 (FAISS warns below 39 training vectors a centroid); ``m`` = D / 4 (4 dimensions a
sub-quantizer: at D = 512, 128 bytes a video); 8 bits a code (256 centroids a sub-quantizer, FAISS' usual).
``refine`` = 4: the re-scoring is what lifts recall from the codes' own order (docs/search.md gives the
figures and the test that measures them); ``nprobe`` = 32 is a floor, raised per search so the probed lists
hold twice the candidates on average, and to ``probe_share`` = 0.3 of the lists. A query is a sentence and the
lists hold videos: across CLIP's modality gap the query lies outside the videos' distribution, and the lists
nearest to it hold few of its best videos (on the calibrated generated world at a million videos the 64 lists
of that average rule kept 63 % of the exact top 10 in a shortlist of 200; 30 % of the lists kept all of it,
docs/search.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tvrpipe.config import at_least, within
from tvrpipe.errors import ConfigError
from tvrpipe.search.first_stages.base import StageConfig, register_first_stage
from tvrpipe.search.first_stages.exact import exact_where_short
from tvrpipe.search.first_stages.faiss_hnsw import FaissIndex, faiss_kind

MIN_PER_LIST = 39  # FAISS' k-means wants at least 39 training vectors a centroid (it warns below)


@register_first_stage("faiss-ivfpq")
class FaissIVFPQ(FaissIndex):
    """Inverted lists of product-quantised codes, memory-mapped from disk; candidates re-scored exactly."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        ivf_from: int = at_least(2, 10_000)  # 39 x 256: FAISS' floor of training vectors for 8-bit codes
        nlist: int | None = at_least(1, None)  # None: 4 sqrt(n) (FAISS' guideline 4-16 sqrt(n)), <= sample / 39
        m: int | None = at_least(1, None)  # sub-quantizers, a divisor of D; None: D / 4 (4 dims each; choice)
        nbits: int = within(1, 16, 8)  # bits a code: 256 centroids a sub-quantizer, FAISS' usual
        train_size: int = at_least(2, 131_072)  # sampled training vectors at most (choice: 256 MiB at D = 512)
        block: int = at_least(1, 65_536)  # vectors added per call: building holds one block and the sample
        seed: int = 0  # the training sample's draw
        nprobe: int = at_least(1, 32)  # lists scanned a query (choice), raised to hold twice refine x k on average
        probe_share: float = within(0, 1, 0.3)  # and at least this share of the lists (measured: docs/search.md)
        refine: int = at_least(1, 4)  # the index's refine x k best re-scored exactly (choice: docs/search.md)

    summary = ("a FAISS IVF-PQ index memory-mapped from disk (codes of m bytes a video), its refine x K best "
               "re-scored exactly; approximate (needs faiss-cpu)")
    search_fields = ("nprobe", "probe_share", "refine")
    mmap = True  # the inverted lists stay on disk: only the lists a query probes are paged in

    @classmethod
    def build(cls, pooled: np.ndarray, config: StageConfig | None = None) -> FaissIVFPQ:
        import faiss

        config = config or cls.Config()
        n, d = pooled.shape
        if n < config.ivf_from:
            return cls.flat(pooled, config)
        m = config.m or max(1, d // 4)
        if d % m:
            raise ConfigError(f"first stage faiss-ivfpq: m={m} does not divide D={d}; give m a divisor of {d}")
        want = config.nlist or max(1, round(4 * math.sqrt(n)))
        sample = min(n, config.train_size, max(256 * want, MIN_PER_LIST * 2**config.nbits))
        nlist = max(1, min(want, sample // MIN_PER_LIST))
        nbits = min(config.nbits, int(math.log2(sample)))  # k-means needs a vector per centroid at least
        rows = np.sort(np.random.default_rng(config.seed).choice(n, sample, replace=False))
        train = np.ascontiguousarray(pooled[rows], dtype=np.float32)  # a memory map reads only these rows
        index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
        index.train(train)
        del train
        for a in range(0, n, config.block):
            index.add(np.ascontiguousarray(pooled[a : a + config.block], dtype=np.float32))
        return cls(pooled, config, index)

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.pooled)
        want = min(n, self.config.refine * k)
        if hasattr(self.index, "nprobe"):  # enough lists to hold twice the candidates on average, and the share
            nlist = self.index.nlist
            self.index.nprobe = min(nlist, max(self.config.nprobe, math.ceil(self.config.probe_share * nlist),
                                               math.ceil(2 * want * nlist / n)))
        _, found = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), want)
        idx = np.full((len(queries), k), -1, np.int64)
        scores = np.full((len(queries), k), -np.inf, np.float32)
        for i, cand in enumerate(found):
            cand = np.sort(cand[cand >= 0])  # in row order: a sequential read of the memory map, and ties by row
            s = self.pooled[cand] @ queries[i]  # (candidates,) the exact cosines
            best = np.argsort(-s, kind="stable")[:k]
            idx[i, : len(best)], scores[i, : len(best)] = cand[best], s[best]
        return exact_where_short(idx, scores, self.pooled, queries, k)

    def describe(self) -> str:
        if not hasattr(self.index, "nlist"):
            return f"faiss-ivfpq: {faiss_kind(self.index)} (exact below {self.config.ivf_from:,} videos)"
        pq = self.index.pq
        return (f"faiss-ivfpq: {faiss_kind(self.index)} nlist={self.index.nlist} m={pq.M} nbits={pq.nbits} "
                f"nprobe=max({self.config.nprobe}, {self.config.probe_share:g} x nlist, lists holding 2 x refine x k) "
                f"refine={self.config.refine}")
