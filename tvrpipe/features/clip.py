"""CLIP backbones for extraction: load an open_clip model, encode frames and word tokens.

Radford et al., "Learning Transferable Visual Models From Natural Language Supervision" (2021),
through open_clip (https://github.com/mlfoundations/open_clip, 3.x). The feature store
(docs/design.md, "Feature store") keeps three things per item, all computed here:

- frames: the projected image [CLS] embedding of each frame, ``model.encode_image`` (N, D);
- word tokens: ``ln_final(x) @ text_projection`` at every text position (M, L, D), the input of
  token-wise heads (UATVR Eq. 7, ProTA, DUQ's local aggregation);
- sentence: the EOS token, which is exactly ``model.encode_text`` (M, D).

None of them is L2-normalised: the store keeps raw projections and heads normalise as their
paper says. Weights come from an open_clip pretrained tag, a local checkpoint, or a seeded
random init (``"none"``); ``weights_sha256`` identifies them in the store's provenance.

Choices where open_clip leaves room:

- Text is encoded at length ``L = max_words`` (not padded to the model's 77): the text tower is
  causal, so every position ``< L`` sees exactly what it would see in a 77-long padded sequence,
  and the EOS output equals ``encode_text`` of the zero-padded ids (tested). Models with a
  bidirectional text tower (SigLIP, HF text encoders, CoCa) are refused for that reason.
- The token mask runs from SOT to the pooled EOT position inclusive, not ``ids != 0``: in CLIP's
  BPE the id 0 (the padding id) is also the word piece "!" (e.g. "!~" -> [0, 349]).
- A pretrained tag trained with QuickGELU (e.g. ViT-B-32 ``openai``) builds the model with
  QuickGELU. open_clip 3.3's ``create_model`` only warns about the mismatch and builds GELU,
  which silently degrades the features.
- Random init runs under a forked RNG seeded with ``seed``: same seed, same weights, and the
  caller's global RNG state is left untouched.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import open_clip
import torch
from open_clip.pretrained import get_pretrained_cfg
from open_clip.transformer import text_global_pool

from tvrpipe.errors import ConfigError
from tvrpipe.features.weights import MODEL_CONFIG_DIR, check_checkpoint, check_download, looks_like_path

log = logging.getLogger(__name__)

TINY_MODEL = "tvrpipe-tiny"
_TEXT_POOLS = ("argmax", "eos")
_SHOW = 8  # how many valid names/tags an error message lists


@dataclass(frozen=True)
class ClipBundle:
    """A loaded CLIP model and what the feature store records about it.

    Attributes:
        model: The open_clip model, in eval mode, gradients off, on ``device``.
        model_name: open_clip architecture name, e.g. ``"ViT-B-32"`` or ``"tvrpipe-tiny"``.
        pretrained: The open_clip tag, the checkpoint path as given, or ``"none"``.
        weights_sha256: sha256 over the state dict (names, dtypes, shapes and bytes, in sorted
            key order): the same weights always give the same hash, however they were loaded.
        image_size: Side of the square input image the vision tower expects.
        mean: Per-channel normalisation mean (RGB, on the [0, 1] scale).
        std: Per-channel normalisation std (RGB, on the [0, 1] scale).
        embed_dim: D, the width of the projected embeddings.
        context_length: The text tower's context length (the largest usable ``max_words``).
        device: Where the model lives.
        quick_gelu_forced: The tag's weights need QuickGELU and the architecture name does not say
            so: their checkpoint loads with the ``-quickgelu`` name (``tvrpipe finetune``'s export).
        logit_scale: CLIP's learned contrastive scale as its parameter stores it (the log of the
            multiplier: log 100 for OpenAI's weights), or None for a model without one. The papers'
            heads reuse this scale, so every head starts from it (:func:`tvrpipe.heads.base.clip_head_config`).
    """

    model: torch.nn.Module
    model_name: str
    pretrained: str
    weights_sha256: str
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    embed_dim: int
    context_length: int
    device: torch.device
    quick_gelu_forced: bool = False  # built with QuickGELU for its tag (the plain name builds GELU)
    logit_scale: float | None = None


def register_tiny_config() -> None:
    """Register tvrpipe's model configs (``tvrpipe-tiny``) with open_clip; idempotent.

    ``tvrpipe-tiny`` is a standard open_clip ``CLIP`` (ViT vision tower, causal text transformer,
    CLIP BPE tokenizer) with D=64, 64x64 images and two layers per tower: it takes the same code
    path as ViT-B-32 at a few milliseconds per batch on a CPU, for tests and the quickstart.
    """
    if TINY_MODEL not in open_clip.list_models():
        open_clip.add_model_config(MODEL_CONFIG_DIR)


def load_clip(
    model_name: str = "ViT-B-32",
    pretrained: str = "openai",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> ClipBundle:
    """Load an open_clip model for feature extraction.

    Args:
        model_name: An open_clip architecture (``open_clip.list_models()``) or ``"tvrpipe-tiny"``.
        pretrained: Where the weights come from: ``"none"`` (random init seeded with ``seed``), a
            path to a local checkpoint (a state dict saved with ``torch.save`` or safetensors, or
            open_clip's ``{"state_dict": ...}`` layout) for the architecture ``model_name``, or an
            open_clip pretrained tag such as ``"openai"`` (downloads on a connected machine).
            A checkpoint of QuickGELU weights needs a ``-quickgelu`` architecture name.
        device: Where to put the model, e.g. ``"cpu"`` or ``"cuda"``.
        seed: Seed of the random init when ``pretrained="none"``.

    Returns:
        The model in eval mode with gradients off, and its provenance.

    Raises:
        ConfigError: Unknown model or tag, unsupported text tower, missing or unreadable
            checkpoint, unavailable device.
        DownloadError: A tag's weights are not cached here and their host does not answer
            (:func:`~tvrpipe.features.weights.check_download`), in seconds rather than after
            open_clip's minutes of retries.

    Example:
        >>> bundle = load_clip("tvrpipe-tiny", "none", seed=0)
        >>> bundle.embed_dim, bundle.image_size
        (64, 64)
    """
    register_tiny_config()
    torch_device = _resolve_device(device)
    cfg = _model_config(model_name)
    checkpoint, tag, quick_gelu = _weights_source(model_name, pretrained, cfg)
    model = _create_model(model_name, tag, quick_gelu, seed, skip_init=pretrained != "none")
    if checkpoint is not None:
        _load_checkpoint(model, model_name, checkpoint)
    model.eval().requires_grad_(False)
    sha = state_dict_sha256(model)
    model.to(torch_device)
    image_size, pp = _image_preprocessing(model, model_name)
    return ClipBundle(
        model=model,
        model_name=model_name,
        pretrained=pretrained,
        weights_sha256=sha,
        image_size=image_size,
        mean=_triple(pp["mean"]),
        std=_triple(pp["std"]),
        embed_dim=int(cfg["embed_dim"]),
        context_length=int(model.context_length),
        device=torch_device,
        quick_gelu_forced=quick_gelu,
        logit_scale=clip_logit_scale(model),
    )


def _weights_source(model_name: str, pretrained: str, cfg: dict) -> tuple[str | None, str | None, bool]:
    """Plan stage: ``(checkpoint, tag, quick_gelu)`` for ``--pretrained``; a bad one fails before any load."""
    quick_gelu = False
    checkpoint: str | None = None
    tag: str | None = None
    if pretrained == "none":
        pass
    elif os.path.isfile(pretrained):
        checkpoint = pretrained
        exported_for = _exported_model(checkpoint)
        if exported_for is not None and exported_for != model_name:
            raise ConfigError(
                f"--pretrained {checkpoint} was exported by tvrpipe finetune for --model {exported_for}, not "
                f"{model_name!r}; pass --model {exported_for}"
            )
    elif looks_like_path(pretrained):
        check_checkpoint(pretrained)
    else:
        tag_cfg = get_pretrained_cfg(model_name, pretrained)
        if not tag_cfg:
            tags = open_clip.list_pretrained_tags_by_model(model_name)
            valid = ", ".join(tags) if tags else "none (use a checkpoint path or 'none')"
            raise ConfigError(
                f"--pretrained: unknown tag {pretrained!r} for model {model_name!r}; valid tags: {valid}"
            )
        tag = pretrained
        quick_gelu = bool(tag_cfg.get("quick_gelu", False)) and not cfg.get("quick_gelu", False)
        check_download(model_name, tag)  # open_clip would retry a download that cannot succeed for minutes
    return checkpoint, tag, quick_gelu


def _create_model(
    model_name: str, tag: str | None, quick_gelu: bool, seed: int, skip_init: bool
) -> torch.nn.Module:
    """Build stage: the open_clip model on the CPU, with a tag's weights or a seeded random init."""
    # open_clip initialises every model from the global RNG (then overwrites it when loading
    # weights): fork it so the init is seeded and the caller's RNG state is left alone.
    with torch.random.fork_rng(devices=[]), _init_skipped(skip_init):
        torch.manual_seed(seed)
        try:
            return open_clip.create_model(
                model_name, pretrained=tag, device="cpu", force_quick_gelu=quick_gelu
            )
        except RuntimeError as exc:
            if tag is None:
                raise
            raise ConfigError(
                f"--pretrained {tag}: cannot fetch or load the weights of {model_name!r} ({_reason(exc)}); "
                f"offline, pass a local checkpoint file instead: --pretrained /path/to/file.safetensors (or .pt)"
            ) from exc


def _load_checkpoint(model: torch.nn.Module, model_name: str, checkpoint: str) -> None:
    """Load stage: overwrite every weight of ``model`` from a local checkpoint file."""
    try:
        open_clip.load_checkpoint(model, checkpoint, strict=True)
    except Exception as exc:  # torch.load / safetensors / load_state_dict all raise differently
        raise ConfigError(
            f"--pretrained: cannot load checkpoint {checkpoint} into {model_name!r} ({_reason(exc)}); "
            f"give a state dict saved from this architecture"
        ) from exc


def _image_preprocessing(model: torch.nn.Module, model_name: str) -> tuple[int, dict]:
    """Preprocess stage: the image side and open_clip's preprocessing config; refuses non-square input."""
    pp = open_clip.get_model_preprocess_cfg(model)
    size = pp["size"]
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    if height != width:
        raise ConfigError(
            f"--model: {model_name!r} expects {height}x{width} images; use a model with square input"
        )
    if pp.get("resize_mode", "shortest") != "shortest":
        log.warning(
            "%s was trained with resize_mode=%s; tvrpipe's decoder resizes the short side and "
            "centre-crops", model_name, pp["resize_mode"],
        )
    return int(height), pp


def _reason(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s text, at most ``limit`` characters, shortened at a word's end."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= limit else line[:limit].rsplit(" ", 1)[0] + " ..."


def weights_facts(bundle: ClipBundle) -> dict[str, Any]:
    """What a feature store's provenance takes from the loaded weights: their sha256, D, the image
    size and preprocessing, the text context length and CLIP's logit scale (plain values: an
    extraction's encoder processes report them to the driver, and :mod:`tvrpipe.features.weights`
    keeps them on disk)."""
    return {"weights_sha256": bundle.weights_sha256, "embed_dim": bundle.embed_dim,
            "image_size": bundle.image_size, "preprocessing": preprocess_description(bundle),
            "context_length": bundle.context_length, "logit_scale": bundle.logit_scale}


# torch.nn.init's in-place initialisers, which module constructors call through the module's attributes
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextmanager
def _init_skipped(skip: bool) -> Iterator[None]:
    """Build a model without drawing its random initial weights when a checkpoint overwrites them all
    next (open_clip loads a tag's or a file's weights with ``strict=True``: every parameter and
    persistent buffer is replaced, and a missing one is an error). Drawing them is most of a load
    (0.75 of 1.1 s for ViT-B-32 on 2 cores) and every value drawn is thrown away. Buffers computed
    rather than drawn (the causal attention mask) are built as usual."""
    if not skip:
        yield
        return
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _unchanged)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def clip_logit_scale(model: torch.nn.Module) -> float | None:
    """The log of ``model``'s learned contrastive scale (its ``logit_scale`` parameter), or None."""
    scale = getattr(model, "logit_scale", None)
    return float(scale.detach().float().reshape(-1)[0]) if isinstance(scale, torch.Tensor) else None


def encode_frames(
    bundle: ClipBundle, frames: torch.Tensor | np.ndarray, *, autocast: bool | None = None
) -> torch.Tensor:
    """Encode decoded frames into projected [CLS] embeddings.

    The decoder has already resized and centre-cropped the frames to ``bundle.image_size``; this
    scales them to [0, 1], normalises with the model's mean/std and runs ``model.encode_image``.

    Args:
        bundle: The loaded model.
        frames: uint8 RGB frames, shape (N, H, W, 3) with H = W = ``bundle.image_size``.
        autocast: Mixed precision; ``None`` means fp16 autocast on CUDA and none on CPU
            (``True`` on CPU uses bf16).

    Returns:
        float32 CPU tensor (N, D): raw projections, NOT L2-normalised.

    Example:
        >>> bundle = load_clip("tvrpipe-tiny", "none")
        >>> encode_frames(bundle, np.zeros((12, 64, 64, 3), np.uint8)).shape
        torch.Size([12, 64])
    """
    frames = _check_frames(bundle, torch.as_tensor(frames))
    if frames.shape[0] == 0:
        return torch.zeros(0, bundle.embed_dim)
    with torch.inference_mode(), _autocast(bundle.device, autocast):
        emb = image_features(bundle, frames).float().cpu()  # (N, D)
    return emb.clone()  # a normal tensor, not an inference tensor, for callers that need autograd


def image_features(bundle: ClipBundle, frames: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
    """The frame [CLS] projections of uint8 frames, differentiable: extraction's computation.

    :func:`encode_frames` runs this under ``inference_mode``; ``tvrpipe finetune`` runs it with
    gradients (``model`` is then the live, possibly wrapped, model), so a head sees the same inputs
    from the live CLIP as from the store.

    Args:
        bundle: The loaded model (image size, mean/std and device).
        frames: uint8 RGB frames (N, S, S, 3), S = ``bundle.image_size``, on any device.
        model: The CLIP to run (default ``bundle.model``).

    Returns:
        (N, D) on ``bundle.device``, in the autocast dtype if one is active.
    """
    _check_frames(bundle, frames)
    mean = torch.tensor(bundle.mean, device=bundle.device).view(1, 3, 1, 1)
    std = torch.tensor(bundle.std, device=bundle.device).view(1, 3, 1, 1)
    x = frames.to(bundle.device).permute(0, 3, 1, 2).float() / 255.0  # (N, 3, H, W)
    model = model or bundle.model
    # a model cast to bf16 (extract --precision bf16 on a CPU) takes its input in its own dtype
    dtype = next(model.parameters()).dtype
    x = (x - mean) / std
    return model.encode_image(x if dtype == torch.float32 else x.to(dtype))  # (N, D)


def _check_frames(bundle: ClipBundle, frames: torch.Tensor) -> torch.Tensor:
    size = bundle.image_size
    if frames.dtype != torch.uint8 or frames.ndim != 4 or tuple(frames.shape[1:]) != (size, size, 3):
        raise ValueError(
            f"encode_frames expects uint8 frames (N, {size}, {size}, 3), got "
            f"{frames.dtype} {tuple(frames.shape)}"
        )
    return frames


def tokenize(bundle: ClipBundle, texts: Sequence[str], max_words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise captions with the model's tokenizer, truncated to ``max_words`` tokens.

    ``max_words`` counts every position, SOT and EOT included (the papers' ``max_words``);
    a longer text is cut and its last kept token replaced by EOT, as open_clip does.

    Args:
        bundle: The loaded model.
        texts: M captions.
        max_words: L, at least 2 and at most ``bundle.context_length``.

    Returns:
        ``(ids, mask)``: long (M, L) token ids, zero-padded; bool (M, L), True from SOT to EOT
        inclusive and False on padding.

    Raises:
        ConfigError: ``max_words`` out of range.

    Example:
        >>> ids, mask = tokenize(load_clip("tvrpipe-tiny", "none"), ["a red circle"], 32)
        >>> ids.shape, int(mask.sum())
        (torch.Size([1, 32]), 5)
    """
    if not 2 <= max_words <= bundle.context_length:
        raise ConfigError(
            f"--max-words must be between 2 and {bundle.context_length} "
            f"(the context length of {bundle.model_name}), got {max_words}"
        )
    if isinstance(texts, str):
        raise TypeError("tokenize expects a sequence of captions, not one string")
    if len(texts) == 0:
        return torch.zeros(0, max_words, dtype=torch.long), torch.zeros(0, max_words, dtype=torch.bool)
    ids = _tokenizer(bundle.model_name)(list(texts), context_length=max_words).long()  # (M, L)
    return ids, token_mask(bundle.model, ids)


def encode_text_tokens(
    bundle: ClipBundle, token_ids: torch.Tensor, *, autocast: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode token ids into projected word tokens and the sentence embedding.

    The forward is open_clip's ``CLIP.encode_text`` run on a sequence of length L instead of the
    context length (positional embedding and causal mask cut to L), keeping every position:
    ``tokens = ln_final(x) @ text_projection``. Because attention is causal, ``sentence`` equals
    ``model.encode_text`` of the same ids zero-padded to the context length.

    Args:
        bundle: The loaded model.
        token_ids: long (M, L) ids from :func:`tokenize`, L <= ``bundle.context_length``.
        autocast: Mixed precision; ``None`` means fp16 autocast on CUDA and none on CPU.

    Returns:
        ``(tokens, sentence)``: float32 CPU tensors (M, L, D) and (M, D), not L2-normalised.
        Padding positions (after EOT) of ``tokens`` are zeroed.

    Example:
        >>> bundle = load_clip("tvrpipe-tiny", "none")
        >>> tokens, sentence = encode_text_tokens(bundle, tokenize(bundle, ["a cat"], 16)[0])
        >>> tokens.shape, sentence.shape
        (torch.Size([1, 16, 64]), torch.Size([1, 64]))
    """
    if token_ids.ndim != 2 or not 1 <= token_ids.shape[1] <= bundle.context_length:
        raise ValueError(
            f"encode_text_tokens expects ids (M, L) with 1 <= L <= {bundle.context_length}, "
            f"got {tuple(token_ids.shape)}"
        )
    n, length = token_ids.shape
    if n == 0:
        return torch.zeros(0, length, bundle.embed_dim), torch.zeros(0, bundle.embed_dim)
    with torch.inference_mode(), _autocast(bundle.device, autocast):
        tokens, sentence = text_features(bundle, token_ids)
        tokens, sentence = tokens.float().cpu(), sentence.float().cpu()
    return tokens.clone(), sentence.clone()  # normal tensors, not inference tensors


def text_features(
    bundle: ClipBundle, token_ids: torch.Tensor, model: torch.nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Word tokens and sentence embedding of token ids, differentiable: extraction's computation.

    :func:`encode_text_tokens` runs this under ``inference_mode``; ``tvrpipe finetune`` runs it
    with gradients on the live ``model``.

    Args:
        bundle: The loaded model (device; ``model`` defaults to ``bundle.model``).
        token_ids: long (M, L) ids from :func:`tokenize`.
        model: The CLIP to run.

    Returns:
        ``(tokens, sentence)``: (M, L, D) with padding positions zeroed, and (M, D), on
        ``bundle.device``, in the autocast dtype if one is active.
    """
    model = model or bundle.model
    length = token_ids.shape[1]
    ids = token_ids.long().to(bundle.device)  # (M, L)
    cast_dtype = model.transformer.get_cast_dtype()
    x = model.token_embedding(ids).to(cast_dtype)  # (M, L, W)
    x = x + model.positional_embedding[:length].to(cast_dtype)
    x = model.transformer(x, attn_mask=model.attn_mask[:length, :length])  # causal
    x = model.ln_final(x)  # (M, L, W)
    # Pool before projecting, exactly as encode_text does, so the sentence is bit-for-bit
    # its computation; the projected token at the EOS position equals it up to rounding.
    pooled = text_global_pool(x, ids, model.text_pool_type, eos_token_id=model.text_eos_id)  # (M, W)
    tokens = _project_text(model, x)  # (M, L, D)
    sentence = _project_text(model, pooled)  # (M, D)
    mask = token_mask(model, ids)  # (M, L)
    return tokens * mask.unsqueeze(-1).to(tokens.dtype), sentence


def preprocess_description(bundle: ClipBundle) -> str:
    """Describe the image preprocessing in one line, for the store's provenance.

    Args:
        bundle: The loaded model.

    Returns:
        E.g. ``"resize short side to 224 (bilinear, at decode; model trained with bicubic), centre
        crop 224, scale to [0, 1], normalise mean=(0.48145466, ...) std=(0.26862954, ...)"``.
        The resize is the decoder's (FFmpeg swscale, see :mod:`tvrpipe.features.decode`), which
        is bilinear; the model's own preprocessing interpolation is named beside it.
    """
    from tvrpipe.features.decode import RESIZE_INTERPOLATION

    pp = open_clip.get_model_preprocess_cfg(bundle.model)
    trained = pp.get("interpolation", "bicubic")
    s = bundle.image_size
    return (
        f"resize short side to {s} ({RESIZE_INTERPOLATION}, at decode; model trained with {trained}), "
        f"centre crop {s}, scale to [0, 1], normalise mean={bundle.mean} std={bundle.std}"
    )


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"--device: {device!r} is not a torch device; use 'cpu' or 'cuda'") from exc
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA device is available here; use --device cpu")
    return torch_device


def _model_config(model_name: str) -> dict:
    """The architecture config, checked to be a CLIP whose text tower tvrpipe can slice."""
    cfg = open_clip.get_model_config(model_name) if ":" not in model_name else None
    if cfg is None:
        names = open_clip.list_models()
        some = [TINY_MODEL] + [n for n in ("ViT-B-32", "ViT-B-16", "ViT-L-14") if n in names]
        raise ConfigError(
            f"--model: unknown model {model_name!r}; use an open_clip architecture such as "
            f"{', '.join(some)} (all {len(names)}: open_clip.list_models())"
        )
    text_cfg = cfg.get("text_cfg", {})
    unsupported = (
        cfg.get("custom_text")
        or "multimodal_cfg" in cfg
        or text_cfg.get("hf_model_name")
        or text_cfg.get("no_causal_mask")
        or text_cfg.get("embed_cls")
        or text_cfg.get("pool_type", "argmax") not in _TEXT_POOLS
    )
    if unsupported:
        raise ConfigError(
            f"--model: {model_name!r} has a custom or bidirectional text tower, which tvrpipe's word "
            f"tokens do not support; use a standard CLIP such as ViT-B-32, ViT-B-16 or ViT-L-14"
        )
    return cfg


def _exported_model(checkpoint: str) -> str | None:
    """The architecture name ``tvrpipe finetune`` wrote into an exported safetensors checkpoint
    (its QuickGELU variant for QuickGELU weights), or None for any other checkpoint."""
    if not checkpoint.lower().endswith(".safetensors"):
        return None
    try:
        from safetensors import safe_open

        with safe_open(checkpoint, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # not readable as safetensors: load_checkpoint reports it
        return None
    return meta.get("model") if str(meta.get("source", "")).startswith("tvrpipe finetune") else None


def state_dict_sha256(model: torch.nn.Module) -> str:
    """sha256 over (name, dtype, shape, bytes) of every state-dict entry, in sorted key order."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\t{str(t.dtype).removeprefix('torch.')}\t{tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _triple(values: Sequence[float]) -> tuple[float, float, float]:
    a, b, c = (float(v) for v in values)
    return (a, b, c)


@lru_cache(maxsize=8)
def _tokenizer(model_name: str):
    # Building the BPE tokenizer reads its vocabulary (~0.1 s): once per model, not per batch.
    return open_clip.get_tokenizer(model_name)


def token_mask(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """True from SOT to the pooled EOT position inclusive, on ids (M, L) of ``model``'s tokenizer."""
    if model.text_pool_type == "eos":
        end = (ids == model.text_eos_id).int().argmax(dim=-1)  # (M,)
    else:  # argmax: EOT has the largest id in CLIP's vocabulary
        end = ids.argmax(dim=-1)  # (M,)
    positions = torch.arange(ids.shape[1], device=ids.device)  # (L,)
    return positions.unsqueeze(0) <= end.unsqueeze(1)  # (M, L)


def _project_text(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    projection = model.text_projection
    if projection is None:
        return x
    if isinstance(projection, torch.nn.Linear):
        return projection(x)
    return x @ projection


def _autocast(device: torch.device, enabled: bool | None) -> AbstractContextManager:
    if enabled is None:
        enabled = device.type == "cuda"
    if not enabled:
        return nullcontext()
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)
