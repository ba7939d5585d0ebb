"""The software a store or a run was made with: recorded next to tvrpipe's version in every feature
store's provenance and every run's ``config.yaml``, printed by ``tvrpipe features show`` and the report,
so that a number can be traced to its environment (docs/design.md, "Data contracts").

Example:
    >>> from tvrpipe.environment import versions, versions_text
    >>> v = versions()
    >>> sorted(v)
    ['cuda', 'numpy', 'open_clip', 'python', 'ray', 'torch', 'tvrpipe', 'zarr']
"""

from __future__ import annotations

import ast
import importlib.util
import platform
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

# name recorded -> the distribution it is read from (read from package metadata: no import of ray)
DISTRIBUTIONS = {"open_clip": "open_clip_torch", "ray": "ray", "zarr": "zarr", "numpy": "numpy"}
# the entries of a run's config and a store's attrs that record the environment, not the run's settings
ENVIRONMENT_KEYS = ("versions", "resumed_with")
ORDER = ("tvrpipe", "torch", "cuda", "open_clip", "ray", "zarr", "numpy", "python")


def versions() -> dict[str, str | None]:
    """The versions of tvrpipe, torch (with its build tag, e.g. ``2.15.0+cu132``), the CUDA torch was
    built for (None for a CPU build), open_clip, ray, zarr, numpy and Python; None for a package that
    is not installed (a GPU node without Ray). Reads no module it would have to import (torch's
    import alone takes a second)."""
    from tvrpipe import __version__

    torch_version, cuda = torch_versions()
    out: dict[str, str | None] = {"tvrpipe": __version__, "torch": torch_version, "cuda": cuda}
    for name, dist in DISTRIBUTIONS.items():
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return {k: out[k] for k in ORDER}


def torch_versions() -> tuple[str | None, str | None]:
    """``(torch.__version__, torch.version.cuda)`` as strings (None where absent), read from the
    ``torch/version.py`` that the build generated when torch is not imported yet: the distribution's
    metadata may lack the local build tag (``+cu132``) that ``torch.__version__`` carries."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "version"):
        # str(): torch.__version__ is a TorchVersion, which YAML cannot write
        return str(torch.__version__), None if torch.version.cuda is None else str(torch.version.cuda)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    found: dict[str, Any] = {}
    source = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    for node in ast.parse(source.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id in ("__version__", "cuda") and node.value is not None:
            found[target.id] = ast.literal_eval(node.value)
    cuda = found.get("cuda")
    return found.get("__version__"), None if cuda is None else str(cuda)


def versions_text(recorded: Mapping[str, Any] | None) -> str:
    """One line for a recorded :func:`versions` dict: ``tvrpipe 0.1.0, torch 2.15.0+cu132, ...``;
    "not recorded" for a store or run made before tvrpipe recorded them."""
    if not recorded:
        return "not recorded (made by a tvrpipe before versions were recorded)"
    keys = [k for k in ORDER if k in recorded] + sorted(k for k in recorded if k not in ORDER)
    return ", ".join(f"{k} {recorded[k] if recorded[k] is not None else '-'}" for k in keys)


def resumed_versions(recorded: Mapping[str, Any] | None, history: list | None) -> list[dict] | None:
    """The ``resumed_with`` list of a store or run that this process continues: ``history`` with this
    environment's versions appended when they differ from ``recorded`` (the versions it was started
    with; None for one made before they were recorded) and from every entry already listed; None
    while no environment other than the first has touched it."""
    now = versions()
    listed = [dict(v) for v in history or []]
    if now != dict(recorded or {}) and now not in listed:
        listed.append(now)
    return listed or None


def run_versions(previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``versions`` entry of a run's config (and ``resumed_with`` when a run is continued in another
    environment), given the config already in the run directory (None for a new run)."""
    if previous is None:
        return {"versions": versions()}
    out: dict[str, Any] = {"versions": previous.get("versions")}
    resumed = resumed_versions(previous.get("versions"), previous.get("resumed_with"))
    if resumed:
        out["resumed_with"] = resumed
    return out
