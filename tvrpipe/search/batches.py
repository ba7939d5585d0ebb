"""A feature store's rows as the batches a head encodes: captions as a TextBatch, videos as a VideoBatch (float32),
read by every search path (the engine, the first stages built from a head, the kept encodings, the benches)."""

from __future__ import annotations

import numpy as np
import torch

from tvrpipe.features.store import FeatureStore
from tvrpipe.heads.base import TextBatch, VideoBatch


def text_batch(store: FeatureStore, rows: np.ndarray, tokens: bool = True) -> TextBatch:
    """Captions ``rows`` (sorted) of a store as a float32 TextBatch (word tokens only where ``tokens``)."""
    sentence = torch.from_numpy(store.read("texts/sentence", rows).astype(np.float32))
    if not tokens:
        return TextBatch.of_sentences(sentence)
    return TextBatch(torch.from_numpy(store.read("texts/tokens", rows).astype(np.float32)),
                     torch.from_numpy(store.read("texts/token_mask", rows)), sentence)


def video_batch(store: FeatureStore, rows: np.ndarray) -> VideoBatch:
    """Videos ``rows`` (sorted) of a store as a float32 VideoBatch."""
    return VideoBatch(torch.from_numpy(store.read("videos/frames", rows).astype(np.float32)),
                      torch.from_numpy(store.read("videos/frame_mask", rows)))
