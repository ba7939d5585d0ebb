"""The quickstart's breakdown of test captions by difficulty (the end-to-end run is in test_cli.py)."""

import numpy as np
import pandas as pd
import pytest

from tvrpipe.errors import ConfigError
from tvrpipe.quickstart import difficulty_masks


def _attributes(rows):
    return pd.DataFrame(rows, columns=["video_id", "scene", "group"])


def test_difficulty_masks_by_hand():
    # a: single scene, alone; b: two scenes; c and its near-duplicate d; e: near-duplicate of f, which is
    # not in the split (so e has no near-duplicate there); g: three scenes with a near-duplicate h
    attrs = _attributes([
        ("a", 0, "a"), ("b", 0, "b"), ("b", 1, "b"), ("c", 0, "c"), ("d", 0, "c"), ("e", 0, "f"), ("f", 0, "f"),
        ("g", 0, "g"), ("g", 1, "g"), ("g", 2, "g"), ("h", 0, "g"), ("h", 1, "g"), ("h", 2, "g"),
    ])
    videos = np.array(["a", "b", "c", "d", "e", "g", "h"])
    text_video = np.array([0, 0, 1, 2, 3, 4, 5, 6])  # two captions of a
    m = difficulty_masks(attrs, videos, text_video)
    assert m["plain"].tolist() == [True, True, False, False, False, True, False, False]
    assert m["multi_scene"].tolist() == [False, False, True, False, False, False, True, True]
    assert m["near_duplicate"].tolist() == [False, False, False, True, True, False, True, True]


def test_difficulty_masks_names_a_missing_video():
    with pytest.raises(ConfigError, match="no row for video 'z'"):
        difficulty_masks(_attributes([("a", 0, "a")]), np.array(["a", "z"]), np.array([0, 1]))
