"""A store's provenance: what it was made from and with, the identity keys that decide whether it is reused
or read by a head, and the command that made (and repairs) it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from tvrpipe.environment import versions
from tvrpipe.features.store.layout import PROGRESS

SCHEMA_VERSION = 2  # 2: markers record each chunk's size and CRC-32, and every chunk is written
# Provenance keys that must match for a store to be reused or read by a head.
IDENTITY_KEYS = (
    "schema_version",
    "model",
    "pretrained",
    "weights_sha256",
    "frames",
    "max_words",
    "embed_dim",
    "frame_sampling",
    "image_size",
    "preprocessing",
    "manifest_sha256",
    "dtype",
)


def manifest_sha256(videos: pd.DataFrame, captions: pd.DataFrame, files: pd.DataFrame | None = None) -> str:
    """A hash of the manifest rows (ids, paths, splits, texts) that a store was built from, and of a
    collection's file fingerprints (``files``: video_id, bytes, mtime_ns), so that a file changed in
    place under the same name changes the store's identity."""
    h = hashlib.sha256()
    for table in (videos, captions) if files is None else (videos, captions, files):
        h.update(pd.util.hash_pandas_object(table.astype(str), index=False).to_numpy().tobytes())
    return h.hexdigest()


def make_provenance(**fields: Any) -> dict[str, Any]:
    """Provenance attrs: the identity keys plus anything else worth recording."""
    from tvrpipe import __version__

    missing = [k for k in IDENTITY_KEYS if k not in fields and k not in ("schema_version", "dtype")]
    if missing:
        raise ValueError(f"provenance lacks {missing}")
    return {"schema_version": SCHEMA_VERSION, "tvrpipe_version": __version__, "dtype": "float16",
            "versions": versions(), **fields}


def store_identity(provenance: Mapping[str, Any]) -> dict[str, Any]:
    """The identity keys of a provenance: what a run records as the store it was trained on."""
    return {k: provenance.get(k) for k in IDENTITY_KEYS}


def written_state(features_dir: str | os.PathLike[str], kind: str = "videos") -> str:
    """A hash of what the shards of ``kind`` hold, as their markers record it (each chunk's size and CRC-32,
    and the shard's failed videos). It changes whenever a shard is written again with other values, which
    the provenance's identity keys do not show: an extract rerun that recovers a failed video, re-extracts
    a damaged shard or overwrites at another precision."""
    h = hashlib.sha256()
    for marker in sorted((Path(features_dir) / PROGRESS / kind).glob("*.json")):
        h.update(marker.name.encode())
        h.update(b"\0")
        try:
            h.update(marker.read_bytes())
        except OSError:  # rewritten by an extract at this moment: a state no cache may be kept under
            h.update(os.urandom(16))
    return h.hexdigest()


def _is_path(pretrained: Any) -> bool:
    from tvrpipe.features.weights import looks_like_path

    return isinstance(pretrained, str) and pretrained != "none" and looks_like_path(pretrained)


def differs(key: str, have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Whether two provenances differ on the identity key ``key``. Two checkpoint paths do not, where both
    record the same ``weights_sha256``: the sha256 names the weights, and a path differs with where it was
    given from (a store made before paths were recorded resolved holds the relative one) or where the
    file has moved."""
    a, b = have.get(key), want.get(key)
    if key == "pretrained" and a != b and _is_path(a) and _is_path(b):
        sha = have.get("weights_sha256")
        return sha is None or sha != want.get("weights_sha256")
    return a != b


def provenance_mismatch(have: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two provenances on the identity keys in ``want``."""
    return [
        f"{k}: store has {have.get(k)!r}, expected {want[k]!r}"
        for k in IDENTITY_KEYS
        if k in want and differs(k, have, want)
    ]


# what stores written by an earlier tvrpipe recorded as their maker, and the command that repairs them
_MAKERS = {"generate_store (tvrpipe.pipeline.genstore)": "tvrpipe synth --features-only"}


def maker_command(made_by: str | None) -> str:
    """The command that made (and so repairs) a store, from its ``made_by`` attribute."""
    made_by = str(made_by or "tvrpipe extract")
    return _MAKERS.get(made_by, made_by)


def run_again(made_by: str) -> str:
    """What a repair message asks for: the maker's command (:func:`maker_command`) run again."""
    return f"`{maker_command(made_by)}` again with the same options and --out"
