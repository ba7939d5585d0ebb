"""Data the training tests share: a small synthetic video dataset and a small generated feature store
(each made once per test module)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """40 generated videos with their manifest (``tvrpipe synth``)."""
    from tvrpipe.worlds.videos import synthesize

    root = tmp_path_factory.mktemp("synth-data")
    synthesize(root, 40, seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A generated feature store: 64 training and 16 test videos, 4 frames, 8 words, D = 32."""
    from tvrpipe.worlds.features import GenSpec, generate_store

    spec = GenSpec(train_videos=64, test_videos=16, captions_per_train_video=2, frames=4, max_words=8,
                   embed_dim=32, seed=0)
    return generate_store(tmp_path_factory.mktemp("gen-store"), spec, video_shard=32, text_shard=64)
