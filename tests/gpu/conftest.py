"""The ``gpu`` suite: every test here runs a CUDA path and compares it with the CPU result computed in
the same test. It runs where ``torch.cuda.is_available()`` (``make gpu-check``, or ``pytest -m gpu``)
and is skipped, with the reason, elsewhere. Nothing here starts Ray or downloads anything.

``TVRPIPE_GPU_DEVICE=cpu pytest -m gpu`` runs the suite's own code with the CPU in the GPU's place
(each comparison then holds trivially): a check of the tests themselves, before a GPU is at hand.
``TVRPIPE_GPU_RESULTS=DIR`` makes the tests that measure something (max abs differences, cosines)
append their figures to ``DIR/figures.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
DEVICE = os.environ.get("TVRPIPE_GPU_DEVICE", "cuda")


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker
def pytest_collection_modifyitems(config, items):
    reason = None
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        reason = (f"no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                  "`make gpu-check` on a GPU machine runs the gpu suite")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    return torch.device(DEVICE)


@pytest.fixture
def fp32_exact():
    """fp32 matmuls and convolutions in full fp32 (no TF32 on Ampere and later): the comparisons with the
    CPU hold to reduction order, not to TF32's 10-bit mantissa."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def noise_on_cpu(monkeypatch):
    """torch.randn / torch.rand draw on the CPU's generator and move to the device asked for: CPU and CUDA
    runs of a sampling head then draw the same noise (CUDA's generator is another stream)."""
    real_randn, real_rand = torch.randn, torch.rand

    def on_cpu(real):
        def draw(*size, device=None, **kw):
            x = real(*size, **kw)
            return x if device is None else x.to(device)
        return draw

    monkeypatch.setattr(torch, "randn", on_cpu(real_randn))
    monkeypatch.setattr(torch, "rand", on_cpu(real_rand))


@pytest.fixture
def record():
    """``record(name, **figures)``: a measured figure, appended to $TVRPIPE_GPU_RESULTS/figures.jsonl."""
    def write(name: str, **figures) -> None:
        out = os.environ.get("TVRPIPE_GPU_RESULTS")
        line = json.dumps({"test": name, "device": DEVICE, **figures})
        print(line)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            with open(Path(out) / "figures.jsonl", "a") as f:
                f.write(line + "\n")
    return write
