"""tvrpipe: CLIP-based text-video retrieval, from manifests to features to heads.

The public API (docs/design.md, "Stages and data flow"), loaded on first use so that ``import tvrpipe``
stays cheap::

    from tvrpipe import create_head, list_heads, extract, fit, evaluate
"""

from __future__ import annotations

from typing import Any

from tvrpipe.errors import TvrpipeError

__version__ = "0.1.0"

_LAZY = {
    "create_head": ("tvrpipe.heads.base", "create_head"),
    "list_heads": ("tvrpipe.heads.base", "list_heads"),
    "extract": ("tvrpipe.features.extract", "extract"),
    "fit": ("tvrpipe.training.fit", "fit"),
    "evaluate": ("tvrpipe.training.evaluate", "evaluate_run"),
}

__all__ = ["TvrpipeError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'tvrpipe' has no attribute {name!r}")
