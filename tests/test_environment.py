"""The versions recorded with every store and run (tvrpipe.environment)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

import tvrpipe
from tvrpipe import environment
from tvrpipe.environment import resumed_versions, run_versions, versions, versions_text


def test_versions_are_the_installed_ones():
    v = versions()
    assert list(v) == ["tvrpipe", "torch", "cuda", "open_clip", "ray", "zarr", "numpy", "python"]
    assert v["tvrpipe"] == tvrpipe.__version__ and v["torch"] == torch.__version__ and v["cuda"] == torch.version.cuda
    assert v["open_clip"] == importlib.metadata.version("open_clip_torch")
    assert v["ray"] == importlib.metadata.version("ray") and v["numpy"] == importlib.metadata.version("numpy")
    assert v["python"] == platform.python_version()


def test_a_missing_package_is_none_not_an_error(monkeypatch):
    real = importlib.metadata.version

    def without_ray(dist):
        if dist == "ray":
            raise importlib.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(environment.metadata, "version", without_ray)
    assert versions()["ray"] is None
    assert "ray -" in versions_text(versions())


def test_versions_text():
    assert versions_text({"torch": "2.15.0", "tvrpipe": "0.1.0", "cuda": None, "extra": "1"}) == \
        "tvrpipe 0.1.0, torch 2.15.0, cuda -, extra 1"
    assert versions_text(None).startswith("not recorded")


def test_resumed_with_lists_each_other_environment_once(monkeypatch):
    first = versions()
    assert resumed_versions(first, None) is None and run_versions(None) == {"versions": first}
    other = {**first, "torch": "9.9.9"}
    monkeypatch.setattr(environment, "versions", lambda: other)
    assert resumed_versions(first, None) == [other]
    assert resumed_versions(first, [other]) == [other]
    assert run_versions({"versions": first}) == {"versions": first, "resumed_with": [other]}
    # a run from before versions were recorded: its start is unknown, this environment is listed
    assert run_versions({}) == {"versions": None, "resumed_with": [other]}


def _lock() -> dict:
    import tomllib
    from pathlib import Path

    return tomllib.loads((Path(__file__).resolve().parents[1] / "uv.lock").read_text())


def test_the_lock_holds_the_index_torch_never_the_local_cpu_wheel():
    """The machines carry a local torch==2.13.0+cpu wheel that breaks torchvision (docs/design.md,
    "Environment facts"): the lock must hold a regular build from the package index, with hashes, and no
    file or local version."""
    torch_entries = [p for p in _lock()["package"] if p["name"] == "torch"]
    assert torch_entries
    for p in torch_entries:
        assert p["source"] == {"registry": "https://pypi.org/simple"}, p["source"]
        assert "+" not in p["version"] and p["version"] != "2.13.0", p["version"]
        assert p["wheels"] and all(w["url"].startswith("https://") and w["hash"] for w in p["wheels"])


def test_the_lock_covers_every_dependency_of_pyproject():
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    lock = _lock()
    assert lock["requires-python"] == project["requires-python"]
    locked = {p["name"] for p in lock["package"]}
    wanted = project["dependencies"] + project["optional-dependencies"]["dev"]
    names = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in wanted}
    assert names <= locked, names - locked
