"""Shared fixtures: the real annotation files in ../shared/annotations, a CLI runner."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


def _shared_annotations() -> Path:
    root = Path(os.environ.get("TVRPIPE_SHARED", REPO.parent / "shared")) / "annotations"
    if not (root / "MANIFEST.tsv").is_file():
        raise RuntimeError(
            f"real annotation files not found at {root}: clone the repository beside shared/ "
            "or set TVRPIPE_SHARED to the shared folder"
        )
    return root


@pytest.fixture(scope="session", autouse=True)
def weights_cache(tmp_path_factory) -> Path:
    """A cache of weights facts (tvrpipe.features.weights) of the test session's own, not the user's."""
    path = tmp_path_factory.mktemp("tvrpipe-cache")
    os.environ["TVRPIPE_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def shared_annotations() -> Path:
    """The read-only real annotation files (../shared/annotations)."""
    return _shared_annotations()


@pytest.fixture
def ann_copy(tmp_path: Path, shared_annotations: Path):
    """Copy one dataset's real annotation folder into tmp_path (so tests may add files)."""

    def copy(dataset: str) -> Path:
        dst = tmp_path / "ann" / dataset
        shutil.copytree(shared_annotations / dataset, dst)
        for p in dst.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        dst.chmod(0o755)
        return dst

    return copy


@pytest.fixture
def cli():
    """Invoke the tvrpipe CLI in-process; returns the click Result."""
    from tvrpipe.cli.main import app

    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, [str(a) for a in args])

    return invoke


@pytest.fixture
def interrupt_call(monkeypatch):
    """``interrupt_call(module, "name", n)``: ``module.name`` raises KeyboardInterrupt (a Ctrl-C) on its
    ``n``-th call, the earlier calls run the real function; returns a function that restores it."""

    def patch(module, name: str, n: int):
        real, calls = getattr(module, name), []

        def interrupted(*a, **kw):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*a, **kw)

        monkeypatch.setattr(module, name, interrupted)
        return lambda: monkeypatch.setattr(module, name, real)

    return patch
