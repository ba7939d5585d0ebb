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
(a file rewritten in place, as ``finetune`` does to its exported CLIP, gets a new entry). An entry
records its own key, and is used only when that key is the one looked up and every fact is present,
of its type and finite. The cache only spares work: a missing entry means the weights are loaded
instead, and so does an unusable one (a folder, not JSON, a fact missing or of the wrong type: one
warning naming its file); a cache that cannot be written is a warning, never a failed run.
The cache never decides what is written: a store's rows are checked against the sha256 their
encoder reports, and a rerun takes cached facts only where the store it resumes or replaces records
the same (:func:`confirmed_facts`); else the weights are loaded to decide.

A ``--pretrained`` tag whose weights are not on this machine is downloaded by open_clip, which retries
for minutes where there is no network. :func:`check_download` asks first, in seconds, whether the
host answers (:class:`~tvrpipe.errors.DownloadError` otherwise).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tvrpipe.errors import ConfigError, DownloadError
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


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# what each fact must be for an entry to be used (logit_scale: None for a model without one)
_VALID = {
    "weights_sha256": lambda v: isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v),
    "embed_dim": _count,
    "image_size": _count,
    "preprocessing": lambda v: isinstance(v, str) and bool(v),
    "context_length": _count,
    "logit_scale": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
}


def cached_facts(key: str) -> dict[str, Any] | None:
    """The facts stored under ``key``, or None: none stored, or an entry that is not usable (unreadable, not
    JSON, recorded under another key, a fact missing, of the wrong type or not finite), which is logged once
    as a warning naming its file and ignored."""
    path = _entry(key)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # a folder in its place, no permission, not JSON or not UTF-8
        return _unusable(path, f"cannot be read ({type(e).__name__}: {e})")
    if not isinstance(entry, dict):
        return _unusable(path, "is not a JSON object")
    if entry.get("key") != key:
        return _unusable(path, "records another key than its file name")
    bad = [k for k in FACTS if k not in entry or not _VALID[k](entry[k])]
    if bad:
        return _unusable(path, f"lacks or holds an invalid {', '.join(bad)}")
    return {k: entry[k] for k in FACTS}


def _unusable(path: Path, why: str) -> None:
    log.warning("weights cache entry %s %s: ignored, the weights are loaded instead", path, why)
    return None


def remember_facts(key: str, facts: dict[str, Any]) -> None:
    """Store ``facts`` under ``key`` (with the key itself); a cache that cannot be written is a warning, never
    an error (it only spares work)."""
    path = _entry(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, **{k: facts[k] for k in FACTS}}, sort_keys=True))
    except Exception as e:  # OSError, the WriteError of atomic_write_text, facts that are not JSON
        log.warning("weights facts not cached in %s (%s); the next run loads the weights again", path, e)


def confirmed_facts(cached: Mapping[str, Any] | None, stores: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """``cached`` facts where every store in ``stores`` (the provenance of the store a rerun resumes, or that an
    update replaces) records each of them (but the context length, which none records) with the same value,
    and its max_words fits the context length; else None: the weights must be loaded to decide. A cache
    edited or written by another tvrpipe so never reaches a new store, and a cached sha256 that disagrees
    with a store does not make that store look like one of other settings."""
    if cached is None or not stores:
        return None
    for prov in stores:
        if any(k not in prov or prov[k] != cached[k] for k in FACTS if k != "context_length"):
            return None
        if not isinstance(prov.get("max_words"), int) or prov["max_words"] > cached["context_length"]:
            return None
    return dict(cached)


def resolve_pretrained(pretrained: str) -> str:
    """``--pretrained`` as a store or a run records it: a checkpoint file by its absolute, resolved path (a
    relative one reaches it only from the folder it was given in), a tag or ``none`` as given."""
    if pretrained != "none" and os.path.isfile(pretrained):
        return str(Path(pretrained).resolve())
    return pretrained


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


# how long the host of a tag's weights has to answer (open_clip's own download retries for minutes)
DOWNLOAD_TIMEOUT_S = 5.0


def _cached_download(pcfg: Mapping[str, Any]) -> tuple[bool, str, bool]:
    """Whether open_clip finds the weights of a tag's pretrained config ``pcfg`` without the network, the URL
    it would fetch them from otherwise, and whether that is the Hugging Face Hub (as
    :func:`open_clip.pretrained.download_pretrained` picks: the Hub where the config names a repository,
    else its URL)."""
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME
    from open_clip.pretrained import has_hf_hub

    if pcfg.get("file"):
        return True, str(pcfg["file"]), False
    hub = str(pcfg.get("hf_hub") or "")
    if hub and has_hf_hub():
        from huggingface_hub import constants, try_to_load_from_cache

        repo, name = os.path.split(hub)
        name = name or HF_WEIGHTS_NAME
        names = [name, name[:-4] + ".safetensors"] if name.endswith((".bin", ".pth")) else [name]
        if name == HF_WEIGHTS_NAME:
            names.insert(0, HF_SAFE_WEIGHTS_NAME)
        found = any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)
        return found, f"{constants.ENDPOINT}/{repo}", True
    url = str(pcfg.get("url") or "")
    return os.path.isfile(Path("~/.cache/clip").expanduser() / os.path.basename(url)), url, False


def _connect(host: str, port: int, timeout: float) -> None:
    """Open and close a TCP connection to ``host``; raises OSError (a timeout included) if none opens."""
    socket.create_connection((host, port), timeout=timeout).close()


def check_download(model: str, pretrained: str, timeout_s: float | None = None) -> None:
    """Fail in seconds where the weights of a ``--pretrained`` tag would have to be downloaded and cannot be:
    they are not in open_clip's (or Hugging Face's) local cache, and the host they come from (or the proxy
    that ``https_proxy`` names) does not accept a connection within ``timeout_s`` (``DOWNLOAD_TIMEOUT_S``),
    or ``HF_HUB_OFFLINE`` forbids asking. ``none``, a checkpoint path and an unknown tag (which
    :func:`~tvrpipe.features.clip.load_clip` refuses, listing the valid ones) pass. Imports open_clip.

    Raises:
        DownloadError: one line naming the model and tag, the host and how to pass a local checkpoint.
    """
    if pretrained == "none" or os.path.isfile(pretrained) or looks_like_path(pretrained):
        return
    from open_clip.pretrained import get_pretrained_cfg

    pcfg = get_pretrained_cfg(model, pretrained)
    if not pcfg:
        return
    found, url, hub = _cached_download(pcfg)
    if found or not url:  # nothing to fetch from: open_clip says what it makes of such a config
        return
    where = urlparse(url)
    host, port = where.hostname or url, where.port or (80 if where.scheme == "http" else 443)
    why = None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") and hub:
        why = "HF_HUB_OFFLINE is set"
    else:
        proxy = urlparse(os.environ.get("https_proxy") or os.environ.get("HTTPS_PROXY") or "")
        reach = (proxy.hostname, proxy.port or 80) if proxy.hostname else (host, port)
        limit = DOWNLOAD_TIMEOUT_S if timeout_s is None else timeout_s
        try:
            _connect(*reach, limit)
        except OSError as e:
            via = f" through the proxy {reach[0]}:{reach[1]}" if proxy.hostname else ""
            why = f"no connection{via} within {limit:g} s: {' '.join(str(e).split()) or type(e).__name__}"
    if why:
        raise DownloadError(
            f"--pretrained {pretrained}: the weights of {model} {pretrained} are not in this machine's open_clip "
            f"or Hugging Face cache and cannot be downloaded from {host} ({why}); on a machine without network, "
            f"download them elsewhere and pass the file: --pretrained /path/to/file.safetensors (or .pt)"
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
