"""A generated store relabelled as extracted with the tiny CLIP, for the search tests' CLI and server runs."""

from __future__ import annotations

from pathlib import Path


def as_tiny_clip_store(path: Path, seed: int = 0) -> Path:
    """The generated store at ``path`` relabelled as extracted with the tiny CLIP of random weights ``seed``: its
    queries can be encoded (the weights' sha256 is the store's), without a Ray extraction."""
    import zarr

    from tvrpipe.features.clip import TINY_MODEL, load_clip

    sha = load_clip(TINY_MODEL, "none", device="cpu", seed=seed).weights_sha256
    attrs = zarr.open_group(str(path / "features.zarr"), mode="a").attrs
    attrs.update({"model": TINY_MODEL, "pretrained": "none", "seed": seed, "weights_sha256": sha,
                  "frame_sampling": "uniform", "made_by": "tvrpipe extract"})
    del attrs["generator"]
    return path
