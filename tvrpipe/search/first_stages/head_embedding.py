"""The head-embedding first stage: the run's head's own video embedding, indexed, where the head has one.

A head whose score is the inner product of a sentence embedding and a video embedding that does not depend on
the query (CLIP4Clip's meanP and seqTransf: :attr:`~tvrpipe.heads.base.Head.embedding_keys`) ranks exactly as an
index of its video embeddings does. This first stage holds that index (every searchable video encoded by the head
once, float32, D x 4 bytes a video: 2 GB at a million videos of D = 512, read from a memory map) and ranks it
exactly against the head's own encoding of the query, so a two-stage search needs no re-ranking: its hits and
scores are the head's exhaustive search's (up to float rounding). Building it costs one pass of the head over
every video, what one exhaustive search costs. :mod:`tvrpipe.search.distilled` builds, keeps and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tvrpipe.search.first_stages.base import (
    HeadAwareIndex,
    StageConfig,
    register_first_stage,
)
from tvrpipe.search.first_stages.exact import exact_top


@register_first_stage("head-embedding")
class HeadEmbedding(HeadAwareIndex):
    """A head's query-independent video embeddings, ranked exactly against its encoding of the query."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        pass

    summary = ("the run's head's own video embedding, indexed, for a head that has one (meanpool, seqtransf; needs "
               "--run): exact, its ranking is the head's")
    ranks_as_head = True

    @property
    def head(self) -> Any:
        return self.source

    def queries(self, sentences: np.ndarray) -> np.ndarray:
        """The head's text embedding of each sentence (its :attr:`embedding_keys` text side), ``(Q, D)``."""
        import torch

        from tvrpipe.heads.base import TextBatch

        texts = TextBatch.of_sentences(torch.from_numpy(np.asarray(sentences, np.float32)))
        with torch.inference_mode():
            q = self.head.encode_texts(texts)[self.head.indexable()[0]]
        return np.ascontiguousarray(q.float().numpy())

    def top(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return exact_top(self.pooled, self.queries(queries), min(k, len(self.pooled)))

    def describe(self) -> str:
        return f"head-embedding: {self.head.name}'s video embedding, exact"


def check_indexable(head: Any, name: str = "head-embedding") -> None:
    """Refuse a head with no query-independent video embedding, naming the first stage to use instead.

    Raises:
        ConfigError: naming the head and the heads that have one.
    """
    from tvrpipe.errors import ConfigError
    from tvrpipe.heads.base import head_class, list_heads

    if head.indexable() is None:
        have = [n for n in list_heads() if head_class(n).embedding_keys is not None]
        raise ConfigError(f"--first-stage {name}: {head.name} has no video embedding that is the same for every "
                          f"query (its score depends on the query's words or pools frames by the sentence; "
                          f"{', '.join(have)} have one); use --first-stage "
                          + ("late-interaction" if head.token_wise_keys is not None else "distilled"))



