"""What a feature store records about its CLIP weights, known without loading them when it can be.

A store's provenance takes six facts from the weights (:func:`tvrpipe.features.clip.weights_facts`):
their sha256, D, the image size and preprocessing, the text context length and CLIP's logit scale.
The processes that encode load the weights anyway and report them; the driver of ``tvrpipe extract``
does not build a model of its own. Only a rerun of a complete store needs the facts before an
encoder starts (most often it has nothing left to do); it reads them from a small cache that every
extraction fills, so such a rerun starts neither Ray nor torch.

The cache is a folder of JSON files, ``$TVRPIPE_CACHE`` or else ``$XDG_CACHE_HOME/tvrpipe`` or
``~/.cache/tvrpipe``, under ``weights/``. An entry is keyed by what names the weights: the
architecture and the versions of tvrpipe, torch and open_clip, with the seed for a random init
(``--pretrained none``), the tag, or a checkpoint file's resolved path, size and modification time
(a file rewritten in place, as ``finetune`` does to its exported CLIP, gets a new entry). The cache
only spares work: a missing, unreadable or unwritable one means the weights are loaded instead.
The cache never decides what is written: a store's rows are checked against the sha256 their
encoder reports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tvrpipe.errors import ConfigError
from tvrpipe.files import atomic_write_text

log = logging.getLogger(__name__)

# tvrpipe's own architectures (tvrpipe-tiny), registered with open_clip by features.clip
MODEL_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
# suffixes that make a --pretrained value a checkpoint path rather than a tag
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
FACTS = ("weights_sha256", "embed_dim", "image_size", "preprocessing", "context_length", "logit_scale")


def cache_dir() -> Path:
    """Where cached facts live: ``$TVRPIPE_CACHE``, else ``$XDG_CACHE_HOME/tvrpipe``, else ``~/.cache/tvrpipe``."""
    if os.environ.get("TVRPIPE_CACHE"):
        return Path(os.environ["TVRPIPE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tvrpipe"


def weights_key(model: str, pretrained: str, seed: int) -> str:
    """The cache key of the weights ``--model``/``--pretrained``/``--seed`` name (see the module's text)."""
    from tvrpipe import __version__
    from tvrpipe.environment import versions

    v = versions()
    parts: dict[str, Any] = {"model": model, "tvrpipe": __version__, "torch": v["torch"], "open_clip": v["open_clip"]}
    if pretrained == "none":
        parts["seed"] = seed
    elif os.path.isfile(pretrained):
        st = os.stat(pretrained)
        parts["file"] = [os.path.realpath(pretrained), st.st_size, st.st_mtime_ns]
    else:
        parts["tag"] = pretrained
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _entry(key: str) -> Path:
    return cache_dir() / "weights" / f"{key}.json"


def cached_facts(key: str) -> dict[str, Any] | None:
    """The facts stored under ``key``, or None (none stored, or an entry that cannot be read)."""
    try:
        facts = json.loads(_entry(key).read_text())
    except (OSError, ValueError):
        return None
    return facts if isinstance(facts, dict) and set(FACTS) <= set(facts) else None


def remember_facts(key: str, facts: dict[str, Any]) -> None:
    """Store ``facts`` under ``key``; a cache that cannot be written is skipped (it only spares work)."""
    try:
        path = _entry(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({k: facts[k] for k in FACTS}, sort_keys=True))
    except OSError as e:
        log.debug("weights facts not cached in %s: %s", cache_dir(), e)



def looks_like_path(pretrained: str) -> bool:
    """``--pretrained`` names a file (a separator or a checkpoint suffix), not an open_clip tag."""
    return "/" in pretrained or os.sep in pretrained or pretrained.lower().endswith(CHECKPOINT_SUFFIXES)


def check_checkpoint(pretrained: str) -> None:
    """Refuse a ``--pretrained`` path to a file that does not exist (checked without torch, before Ray starts)."""
    if pretrained != "none" and looks_like_path(pretrained) and not os.path.isfile(pretrained):
        raise ConfigError(
            f"--pretrained: checkpoint not found: {pretrained}; give an existing checkpoint file, "
            f"an open_clip tag or 'none'"
        )


def guess_image_size(model: str) -> int | None:
    """The input size of ``model``'s image tower, read from its architecture file (tvrpipe's own or
    open_clip's ``model_configs/``) without importing open_clip; None where there is none (an
    ``hf-hub:`` model) or it is not square. Lets decoding start while the encoders load the weights;
    an encoder's report is what counts."""
    import importlib.util

    places = [MODEL_CONFIG_DIR]
    spec = importlib.util.find_spec("open_clip")
    if spec is not None and spec.submodule_search_locations:
        places.append(Path(next(iter(spec.submodule_search_locations))) / "model_configs")
    for folder in places:
        try:
            size = json.loads((folder / f"{model}.json").read_text())["vision_cfg"]["image_size"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(size, list) and len(size) == 2 and size[0] == size[1]:
            size = size[0]
        return size if isinstance(size, int) else None
    return None
