"""The weights' facts a store records, known without loading the weights: the cache's keys, reads
and writes, and the versions read without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tvrpipe.errors import ConfigError
from tvrpipe.features.weights import (
    cache_dir,
    cached_facts,
    check_checkpoint,
    guess_image_size,
    remember_facts,
    weights_key,
)

FACTS = {"weights_sha256": "ab" * 32, "embed_dim": 64, "image_size": 64, "preprocessing": "resize ...",
         "context_length": 77, "logit_scale": 2.6592}


def test_the_key_names_the_weights(tmp_path):
    ckpt = tmp_path / "clip.safetensors"
    ckpt.write_bytes(b"x" * 10)
    keys = {weights_key("tvrpipe-tiny", "none", 0), weights_key("tvrpipe-tiny", "none", 1),
            weights_key("ViT-B-32", "none", 0), weights_key("ViT-B-32", "openai", 0),
            weights_key("ViT-B-32", "laion2b_s34b_b79k", 0), weights_key("ViT-B-32", str(ckpt), 0)}
    assert len(keys) == 6
    assert weights_key("ViT-B-32", "openai", 0) == weights_key("ViT-B-32", "openai", 5)  # the seed: only for none
    assert weights_key("ViT-B-32", str(ckpt), 0) == weights_key("ViT-B-32", str(ckpt), 0)
    before = weights_key("ViT-B-32", str(ckpt), 0)
    time.sleep(0.01)
    ckpt.write_bytes(b"y" * 10)  # rewritten in place (finetune's exported CLIP): another entry
    os.utime(ckpt, ns=(time.time_ns(), time.time_ns()))
    assert weights_key("ViT-B-32", str(ckpt), 0) != before


def test_facts_are_kept_and_a_bad_cache_only_costs_a_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TVRPIPE_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    key = weights_key("tvrpipe-tiny", "none", 0)
    assert cached_facts(key) is None
    remember_facts(key, {**FACTS, "versions": {"torch": "x"}})  # only the facts are kept
    assert cached_facts(key) == FACTS
    (tmp_path / "cache" / "weights" / f"{key}.json").write_text("{not json")
    assert cached_facts(key) is None
    (tmp_path / "cache" / "weights" / f"{key}.json").write_text('{"embed_dim": 64}')  # an entry lacking facts
    assert cached_facts(key) is None
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("TVRPIPE_CACHE", str(blocked))
    remember_facts(key, FACTS)  # not writable: skipped, not an error
    assert cached_facts(key) is None
    monkeypatch.delenv("TVRPIPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tvrpipe"


@pytest.mark.parametrize("value", ["missing.pt", "some/dir/weights", "w.SAFETENSORS"])
def test_a_missing_checkpoint_is_refused_without_torch(value):
    with pytest.raises(ConfigError, match=f"--pretrained: checkpoint not found: {value}"):
        check_checkpoint(value)
    check_checkpoint("openai")  # a tag: checked by the encoder that loads it
    check_checkpoint("none")


def test_versions_are_read_without_importing_torch():
    code = ("import sys; from tvrpipe.environment import versions; v = versions(); "
            "assert 'torch' not in sys.modules, 'torch imported'; import torch; "
            "assert versions() == v, (versions(), v); print(v['torch'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    import torch

    assert out.stdout.strip() == str(torch.__version__)


def test_the_image_size_is_read_from_the_architecture_file():
    from tvrpipe.features.clip import load_clip

    assert guess_image_size("tvrpipe-tiny") == load_clip("tvrpipe-tiny", "none").image_size == 64
    assert guess_image_size("ViT-B-32") == 224 and guess_image_size("ViT-L-14-336") == 336
    assert guess_image_size("no-such-model") is None and guess_image_size("hf-hub:org/model") is None
