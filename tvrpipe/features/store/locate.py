"""Finding stores: the stores under a folder, the one a command without ``--features`` reads, the default
folder of a new one, a store's attributes read unchecked, and the refusal of a store as a run's ``--out``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tvrpipe.errors import ConfigError
from tvrpipe.features.store.layout import STORE_NAME
from tvrpipe.features.store.reader import store_group

FEATURES_ROOT_ENV = "TVRPIPE_FEATURES"  # where `train-head` without --features looks for stores


def check_not_a_store(out: str | os.PathLike[str], what: str) -> None:
    """Raise :class:`ConfigError` when ``out`` (an ``--out`` for ``what``: "a run", "a sweep") is a feature
    store, whose folder a run or a sweep would otherwise write into."""
    if (Path(out) / STORE_NAME).exists():
        example = "runs/sweep" if what == "a sweep" else "runs/NAME"
        raise ConfigError(f"--out {out} is a feature store; {what} goes into a folder of its own (e.g. {example})")


def find_stores(root: str | os.PathLike[str], depth: int = 3) -> list[Path]:
    """The feature store directories under ``root`` (it included), at most ``depth`` folders down,
    sorted; a store's own folders are not searched.

    Symbolic links to folders are followed (``features/msrvtt -> /scratch/stores/msrvtt`` is found), a
    link back to a folder above it is not walked again, and a store reached by several names is listed
    once: by its real path where that is under ``root``, else by its first name in sorted order.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    names: dict[str, list[Path]] = {}  # real path of a store -> the names it was reached by

    def walk(here: Path, level: int, above: frozenset[str]) -> None:
        real = os.path.realpath(here)
        if real in above:  # a link back to a folder on this path: a cycle
            return
        if (here / STORE_NAME).is_dir():
            names.setdefault(real, []).append(here)
            return
        if level >= depth:
            return
        try:
            children = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:  # unreadable, or a link that broke meanwhile
            return
        for child in children:
            try:
                if child.is_dir():  # follows links; a dangling one is no folder
                    walk(Path(child.path), level + 1, above | {real})
            except OSError:
                continue

    walk(root, 0, frozenset())
    real_root = Path(os.path.realpath(root))
    found = []
    for real, reached in names.items():
        direct = [p for p in reached if Path(real) == real_root / p.relative_to(root)]
        found.append((direct or sorted(reached))[0])
    return sorted(found)


def default_features_dir(dataset: str, model: str, pretrained: str,
                         root: str | os.PathLike[str] | None = None) -> Path:
    """``<features root>/<dataset>-<model>-<pretrained>`` (a checkpoint file by its stem), where the
    features root is ``root``, else ``$TVRPIPE_FEATURES``, else ``features`` (where ``train-head`` looks)."""
    tag = Path(pretrained).stem if os.sep in pretrained or Path(pretrained).suffix else pretrained
    base = Path(root if root is not None else os.environ.get(FEATURES_ROOT_ENV, "features"))
    return base / f"{dataset}-{model}-{tag}"


def default_store(root: str | os.PathLike[str] | None = None) -> Path:
    """The one feature store under ``root`` (default ``$TVRPIPE_FEATURES``, else ``features/``), for a
    command run without ``--features``.

    Raises:
        ConfigError: no store there, or several (each listed).
    """
    root = Path(root if root is not None else os.environ.get(FEATURES_ROOT_ENV, "features"))
    stores = find_stores(root)
    if len(stores) == 1:
        return stores[0]
    if not stores:
        raise ConfigError(f"no feature store under {root}/: pass --features DIR (a store of `tvrpipe extract`), "
                          f"or set {FEATURES_ROOT_ENV} to the folder that holds yours")
    listed = ", ".join(str(s) for s in stores[:10]) + (f" (+{len(stores) - 10} more)" if len(stores) > 10 else "")
    raise ConfigError(f"{len(stores)} feature stores under {root}/: pass --features with one of {listed}")


def store_attributes(features_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The store's attributes (provenance, ``complete``, counts), read without checking the store:
    for describing a store, e.g. in a report, whatever its state.

    Raises:
        StoreError: no store in ``features_dir``, or its metadata cannot be read.
    """
    return dict(store_group(Path(features_dir)).attrs)
