"""tvrpipe.features.clip against open_clip itself: loading, weights hashing, frames, text tokens.

Everything runs on the tiny registered config with random or test-written weights; no download.
"""

from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from open_clip.transformer import QuickGELU
from safetensors.torch import save_file

from tvrpipe.errors import ConfigError
from tvrpipe.features.clip import (
    TINY_MODEL,
    ClipBundle,
    encode_frames,
    encode_text_tokens,
    load_clip,
    preprocess_description,
    register_tiny_config,
    tokenize,
)

pytestmark = pytest.mark.numerics  # floats that depend on the CPU: `make test` runs these under other code paths

TEXTS = ["a red circle moves to the left", "two blue squares bounce", "wow !~ a green triangle"]
SOT, EOT = 49406, 49407


@pytest.fixture(scope="module")
def tiny() -> ClipBundle:
    return load_clip(TINY_MODEL, "none", seed=0)


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(5, 64, 64, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny: ClipBundle):
    """The tiny model's weights written as torch.save, open_clip {"state_dict"} and safetensors."""
    root = tmp_path_factory.mktemp("ckpt")
    state = {k: v.detach().clone().contiguous() for k, v in tiny.model.state_dict().items()}
    torch.save(state, root / "plain.pt")
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, root / "wrapped.pt")
    save_file(state, str(root / "weights.safetensors"))
    return root


def _padded(ids: torch.Tensor, context_length: int = 77) -> torch.Tensor:
    out = torch.zeros(ids.shape[0], context_length, dtype=torch.long)
    out[:, : ids.shape[1]] = ids
    return out


# --------------------------------------------------------------------------------------- loading


def test_tiny_loads_with_the_configured_sizes(tiny: ClipBundle):
    assert isinstance(tiny.model, open_clip.CLIP)  # the same class, so the same path, as ViT-B-32
    assert (tiny.model_name, tiny.pretrained) == (TINY_MODEL, "none")
    assert (tiny.embed_dim, tiny.image_size, tiny.context_length) == (64, 64, 77)
    assert tiny.mean == pytest.approx(OPENAI_DATASET_MEAN) and tiny.std == pytest.approx(OPENAI_DATASET_STD)
    assert tiny.device == torch.device("cpu")
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert len(tiny.weights_sha256) == 64
    text = preprocess_description(tiny)
    assert "short side to 64" in text and "centre crop 64" in text and str(tiny.mean) in text


def test_register_tiny_config_is_idempotent():
    register_tiny_config()
    n_paths = len(open_clip.factory._MODEL_CONFIG_PATHS)
    register_tiny_config()
    assert len(open_clip.factory._MODEL_CONFIG_PATHS) == n_paths
    assert open_clip.list_models().count(TINY_MODEL) == 1


def test_random_init_is_seeded_and_leaves_the_global_rng_alone(tiny: ClipBundle, frames):
    state = torch.get_rng_state()
    again = load_clip(TINY_MODEL, "none", seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert again.weights_sha256 == tiny.weights_sha256
    assert torch.equal(encode_frames(again, frames), encode_frames(tiny, frames))
    other = load_clip(TINY_MODEL, "none", seed=1)
    assert other.weights_sha256 != tiny.weights_sha256


@pytest.mark.parametrize("name", ["plain.pt", "wrapped.pt", "weights.safetensors"])
def test_local_checkpoint_gives_the_same_weights(tiny: ClipBundle, tiny_ckpt, frames, name):
    path = str(tiny_ckpt / name)
    loaded = load_clip(TINY_MODEL, path, seed=123)  # the seed must not matter once weights load
    assert loaded.pretrained == path
    assert loaded.weights_sha256 == tiny.weights_sha256
    assert torch.equal(encode_frames(loaded, frames), encode_frames(tiny, frames))
    ids, _ = tokenize(loaded, TEXTS, 16)
    assert torch.equal(encode_text_tokens(loaded, ids)[1], encode_text_tokens(tiny, ids)[1])


def test_sha_changes_with_any_weight(tiny: ClipBundle, tiny_ckpt, tmp_path):
    state = torch.load(tiny_ckpt / "plain.pt")
    state["logit_scale"] = state["logit_scale"] + 1.0
    torch.save(state, tmp_path / "changed.pt")
    changed = load_clip(TINY_MODEL, str(tmp_path / "changed.pt"))
    assert changed.weights_sha256 != tiny.weights_sha256
    # the bundle reports the checkpoint's learned scale, which heads start from (clip_head_config)
    assert changed.logit_scale == pytest.approx(tiny.logit_scale + 1.0, abs=1e-6)


def test_garbage_checkpoint_is_a_config_error_naming_the_path(tmp_path):
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ConfigError, match="garbage.pt") as err:
        load_clip(TINY_MODEL, str(path))
    assert "\n" not in str(err.value)


def test_checkpoint_of_another_architecture_is_a_config_error(tiny_ckpt, tmp_path):
    state = torch.load(tiny_ckpt / "plain.pt")
    del state["visual.proj"]
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(ConfigError, match="partial.pt") as err:
        load_clip(TINY_MODEL, str(tmp_path / "partial.pt"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["missing/dir/ckpt.pt", "ckpt.safetensors", "weights.bin"])
def test_missing_checkpoint_path(value):
    with pytest.raises(ConfigError, match="checkpoint not found"):
        load_clip(TINY_MODEL, value)


def test_unknown_tag_lists_the_valid_tags():
    with pytest.raises(ConfigError, match="unknown tag 'nope'.*openai.*laion2b_s34b_b79k"):
        load_clip("ViT-B-32", "nope")  # fails before any model is built or downloaded
    with pytest.raises(ConfigError, match="unknown tag 'openai' for model 'tvrpipe-tiny'"):
        load_clip(TINY_MODEL, "openai")


def test_unknown_or_unsupported_model():
    with pytest.raises(ConfigError, match="unknown model 'ViT-Q-99'.*tvrpipe-tiny.*ViT-B-32"):
        load_clip("ViT-Q-99", "none")
    with pytest.raises(ConfigError, match="bidirectional text tower"):
        load_clip("ViT-B-16-SigLIP", "none")  # refused from its config, before building it


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="--device cuda"):
        load_clip(TINY_MODEL, "none", device="cuda")


def test_pretrained_tag_path_offline(tiny: ClipBundle, tiny_ckpt, monkeypatch):
    """A tag goes through open_clip's own tag loading; its mean/std and QuickGELU are honoured.

    The tag is registered for the test with a local ``file``, which open_clip uses instead of
    downloading. open_clip 3.3 would build GELU for a QuickGELU tag (it only warns).
    """
    tag_cfg = {
        "url": "",
        "hf_hub": "",
        "file": str(tiny_ckpt / "plain.pt"),
        "mean": (0.5, 0.5, 0.5),
        "std": (0.25, 0.25, 0.25),
        "interpolation": "bicubic",
        "resize_mode": "shortest",
        "quick_gelu": True,
    }
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, TINY_MODEL, {"test_tag": tag_cfg})
    bundle = load_clip(TINY_MODEL, "test-tag")  # open_clip normalises '-' to '_' in tags
    assert bundle.pretrained == "test-tag"
    assert bundle.weights_sha256 == tiny.weights_sha256
    assert (bundle.mean, bundle.std) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert any(isinstance(m, QuickGELU) for m in bundle.model.modules())
    assert not any(isinstance(m, QuickGELU) for m in tiny.model.modules())


def test_tag_that_cannot_be_fetched_is_a_config_error(monkeypatch):
    missing = {"url": "", "hf_hub": "", "file": "", "mean": OPENAI_DATASET_MEAN, "std": OPENAI_DATASET_STD}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, TINY_MODEL, {"gone": missing})
    monkeypatch.setattr(
        open_clip.factory, "download_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError("offline"))
    )
    with pytest.raises(ConfigError, match="--pretrained gone: cannot fetch.*offline.*local checkpoint"):
        load_clip(TINY_MODEL, "gone")


# ---------------------------------------------------------------------------------------- frames


def test_encode_frames_matches_a_numpy_reference(tiny: ClipBundle, frames):
    x = (frames.astype(np.float32) / 255.0 - np.array(tiny.mean, np.float32)) / np.array(tiny.std, np.float32)
    with torch.no_grad():
        ref = tiny.model.encode_image(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous())  # (N, D)
    out = encode_frames(tiny, frames)
    assert out.shape == (5, tiny.embed_dim) and out.dtype == torch.float32 and out.device.type == "cpu"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.norm(dim=-1), torch.ones(5))  # raw projections, not normalised
    torch.testing.assert_close(encode_frames(tiny, torch.from_numpy(frames)), out, atol=0, rtol=0)
    assert not out.is_inference()


def test_encode_frames_validates_its_input(tiny: ClipBundle, frames):
    assert encode_frames(tiny, frames[:0]).shape == (0, tiny.embed_dim)
    with pytest.raises(ValueError, match="uint8 frames"):
        encode_frames(tiny, frames.astype(np.float32))
    with pytest.raises(ValueError, match=r"\(N, 64, 64, 3\)"):
        encode_frames(tiny, frames[:, :32])


def test_encode_frames_autocast_on_cpu_runs(tiny: ClipBundle, frames):
    out = encode_frames(tiny, frames, autocast=True)  # bf16 on CPU
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.testing.assert_close(out, encode_frames(tiny, frames), atol=0.1, rtol=0.1)


# ------------------------------------------------------------------------------------------ text


def test_sentence_equals_encode_text_of_padded_ids(tiny: ClipBundle):
    ids, mask = tokenize(tiny, TEXTS, 16)
    tokens, sentence = encode_text_tokens(tiny, ids)
    assert tokens.shape == (3, 16, 64) and sentence.shape == (3, 64)
    assert tokens.dtype == sentence.dtype == torch.float32
    with torch.no_grad():
        ref = tiny.model.encode_text(_padded(ids))  # (M, D), at the full context length
    # other sequence lengths, other GEMM shapes: a transformer's float32 rounding, ~1e-6 of |x| per path
    torch.testing.assert_close(sentence, ref, atol=1e-5, rtol=1e-5)
    eos = ids.argmax(dim=-1)
    torch.testing.assert_close(tokens[torch.arange(3), eos], sentence, atol=1e-5, rtol=1e-5)
    assert (tokens[~mask] == 0).all() and (tokens[mask].abs().sum(-1) > 0).all()
    assert not tokens.is_inference() and not sentence.is_inference()


def test_tokens_do_not_depend_on_max_words(tiny: ClipBundle):
    ids16, mask16 = tokenize(tiny, TEXTS, 16)
    ids77, mask77 = tokenize(tiny, TEXTS, 77)
    assert torch.equal(ids77[:, :16], ids16) and torch.equal(mask77[:, :16], mask16)
    tokens16, sentence16 = encode_text_tokens(tiny, ids16)
    tokens77, sentence77 = encode_text_tokens(tiny, ids77)
    torch.testing.assert_close(tokens16, tokens77[:, :16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sentence16, sentence77, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(sentence77, tiny.model.encode_text(ids77), atol=1e-5, rtol=1e-5)


def test_mask_covers_sot_words_and_eot(tiny: ClipBundle):
    ids, mask = tokenize(tiny, TEXTS, 16)
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape == (3, 16)
    assert (ids[:, 0] == SOT).all()
    assert torch.equal(mask[:2], ids[:2] != 0)
    # In CLIP's BPE "!~" is [0, 349]: a word piece with the padding id, still inside the mask.
    assert (ids[2][mask[2]] == 0).sum() == 1
    assert int(mask[2].sum()) == int(ids[2].argmax()) + 1


def test_long_text_is_truncated_with_eot_last(tiny: ClipBundle):
    long_text = " ".join(["red circle"] * 30)
    ids, mask = tokenize(tiny, [long_text, "a cat"], 8)
    assert ids.shape == (2, 8)
    assert ids[0, 0] == SOT and ids[0, -1] == EOT and mask[0].all()
    assert ids[1, :4].tolist()[0] == SOT and ids[1, 3] == EOT and mask[1].tolist() == [True] * 4 + [False] * 4
    _, sentence = encode_text_tokens(tiny, ids)
    with torch.no_grad():
        torch.testing.assert_close(sentence, tiny.model.encode_text(_padded(ids)), atol=1e-5, rtol=1e-5)


def test_tokenize_rejects_bad_max_words(tiny: ClipBundle):
    with pytest.raises(ConfigError, match="--max-words must be between 2 and 77"):
        tokenize(tiny, TEXTS, 78)
    with pytest.raises(ConfigError, match="--max-words"):
        tokenize(tiny, TEXTS, 1)
    ids, mask = tokenize(tiny, [], 12)
    assert ids.shape == mask.shape == (0, 12)
    tokens, sentence = encode_text_tokens(tiny, ids)
    assert tokens.shape == (0, 12, 64) and sentence.shape == (0, 64)


# ------------------------------------------------------------------------- a real architecture


def test_vit_b_32_random_init_text_and_frames():
    """The real ViT-B-32 architecture, random weights (~2 s on two cores, so not marked slow)."""
    bundle = load_clip("ViT-B-32", "none", seed=0)
    assert (bundle.embed_dim, bundle.image_size, bundle.context_length) == (512, 224, 77)
    ids, _ = tokenize(bundle, ["a man is cooking pasta", "two dogs play in the snow"], 32)
    tokens, sentence = encode_text_tokens(bundle, ids)
    assert tokens.shape == (2, 32, 512)
    with torch.no_grad():
        ref = bundle.model.encode_text(_padded(ids))
    torch.testing.assert_close(sentence, ref, atol=1e-5, rtol=1e-5)
    frames = np.random.default_rng(0).integers(0, 256, size=(2, 224, 224, 3), dtype=np.uint8)
    assert encode_frames(bundle, frames).shape == (2, 512)


def test_weights_a_checkpoint_replaces_are_not_drawn(tiny_ckpt, monkeypatch):
    """Loading a checkpoint builds the model without its random init (every weight is then replaced,
    strictly); a random init still draws them; torch's initialisers are restored either way."""
    import tvrpipe.features.clip as clip

    calls = []
    originals = {name: getattr(torch.nn.init, name) for name in clip._INITIALISERS}
    for name, fn in originals.items():
        monkeypatch.setattr(torch.nn.init, name, lambda t, *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(t, *a, **k))[1])
    counting = {name: getattr(torch.nn.init, name) for name in clip._INITIALISERS}
    load_clip(TINY_MODEL, str(tiny_ckpt / "plain.pt"))
    assert calls == []
    load_clip(TINY_MODEL, "none")
    assert "normal_" in calls
    with pytest.raises(ConfigError):
        load_clip(TINY_MODEL, str(tiny_ckpt.parent / "nothing.pt"))
    (tiny_ckpt / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot load checkpoint"):
        load_clip(TINY_MODEL, str(tiny_ckpt / "garbage.pt"))
    assert {name: getattr(torch.nn.init, name) for name in clip._INITIALISERS} == counting
