"""The weights' facts a store records, known without loading the weights: the cache's keys, reads
and writes, and the versions read without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tvrpipe.errors import ConfigError, DownloadError
from tvrpipe.features.weights import (
    cache_dir,
    cached_facts,
    check_checkpoint,
    check_download,
    confirmed_facts,
    guess_image_size,
    remember_facts,
    resolve_pretrained,
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


def test_cached_facts_count_only_where_the_store_records_the_same():
    store = {**{k: v for k, v in FACTS.items() if k != "context_length"}, "max_words": 32}
    assert confirmed_facts(FACTS, [store]) == FACTS
    assert confirmed_facts(FACTS, [store, store]) == FACTS
    assert confirmed_facts(None, [store]) is None
    assert confirmed_facts(FACTS, []) is None  # no store to confirm them: the weights are loaded
    assert confirmed_facts({**FACTS, "logit_scale": 4.0}, [store]) is None
    assert confirmed_facts({**FACTS, "weights_sha256": "cd" * 32}, [store]) is None
    assert confirmed_facts(FACTS, [{k: v for k, v in store.items() if k != "logit_scale"}]) is None  # an older store
    assert confirmed_facts({**FACTS, "context_length": 16}, [store]) is None  # max_words 32 would not fit


def test_a_checkpoint_is_recorded_by_its_resolved_path(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "clip.safetensors").write_bytes(b"x")
    monkeypatch.chdir(tmp_path / "ckpt")
    assert resolve_pretrained("../ckpt/clip.safetensors") == str(tmp_path.resolve() / "ckpt" / "clip.safetensors")
    assert resolve_pretrained("openai") == "openai" and resolve_pretrained("none") == "none"


@pytest.fixture
def no_download_cache(tmp_path, monkeypatch):
    """No weights in open_clip's or Hugging Face's cache, no proxy, and a Hub at a port where nothing listens."""
    import huggingface_hub.constants as hf

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(hf, "ENDPOINT", "http://127.0.0.1:9")
    for name in ("https_proxy", "HTTPS_PROXY", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hf"


def test_a_tag_that_cannot_be_downloaded_fails_in_seconds(no_download_cache, monkeypatch):
    from tvrpipe.features import weights

    t0 = time.perf_counter()
    with pytest.raises(DownloadError, match=r"^--pretrained openai: .* ViT-B-32 openai .* cannot be downloaded from "
                                            r"127\.0\.0\.1 \(no connection within 5 s: .*\); .*--pretrained "
                                            r"/path/to/file\.safetensors \(or \.pt\)$"):
        check_download("ViT-B-32", "openai")
    assert time.perf_counter() - t0 < 30
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not even asked
    monkeypatch.setattr(weights, "_connect", lambda *a: pytest.fail("connected"))
    with pytest.raises(DownloadError, match=r"from 127\.0\.0\.1 \(HF_HUB_OFFLINE is set\)"):
        check_download("ViT-B-32", "openai")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("https_proxy", "http://proxy.invalid:3128")  # the proxy is what must answer
    monkeypatch.setattr(weights, "_connect", lambda host, port, t: (_ for _ in ()).throw(TimeoutError("timed out")))
    with pytest.raises(DownloadError, match=r"no connection through the proxy proxy\.invalid:3128 within 5 s: "
                                            r"timed out"):
        check_download("ViT-B-32", "openai")
    for value in ("none", "no-such-tag", "missing.pt"):  # load_clip or check_checkpoint says what is wrong
        check_download("ViT-B-32", value)


def test_a_cached_tag_is_not_downloaded(no_download_cache, monkeypatch):
    from tvrpipe.features import weights

    monkeypatch.setattr(weights, "_connect", lambda *a: pytest.fail("connected"))
    # Hugging Face's cache layout: refs/main names the snapshot that holds the file
    repo = no_download_cache / "models--timm--vit_base_patch32_clip_224.openai"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "open_clip_model.safetensors").write_bytes(b"x")
    check_download("ViT-B-32", "openai")


def test_the_cli_fails_in_one_line_for_weights_it_cannot_download(no_download_cache, cli, tmp_path):
    """finetune loads the weights in its own process: the same line, before any video is read."""
    from tvrpipe.worlds.videos import synthesize

    synthesize(tmp_path / "d", 2, seed=0, progress=False)
    r = cli("finetune", "--manifest", tmp_path / "d" / "manifest", "--video-root", tmp_path / "d" / "videos",
            "--method", "meanpool", "--out", tmp_path / "run", "--model", "ViT-B-32", "--pretrained", "openai")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "cannot be downloaded from 127.0.0.1" in text, r.output
    assert "--pretrained /path/to/file.safetensors (or .pt)" in text and not (tmp_path / "run").exists()
