"""The GPU tooling, checked here without a GPU (so that time on a GPU goes to the GPU): the wheelhouse
resolves from uv.lock and fits, ``pytest -m gpu`` collects every gpu test and skips each with its
reason, and ``make gpu-check``'s script runs through on a CPU machine and writes its results folder."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import wheelhouse  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the gpu suite runs instead of skipping")


def test_the_wheelhouse_resolves_from_the_lock_for_the_gpu_machine_and_fits(capsys):
    wheels = wheelhouse.resolve(list(wheelhouse.PACKAGES), (3, 12), (2, 28), "x86_64")
    assert [w["name"] for w in wheels] == list(wheelhouse.PACKAGES)
    for w in wheels:  # a wheel CPython 3.12 on manylinux x86-64 installs: cp312, abi3 or pure Python
        assert re.search(r"-(cp312-cp312|cp3\d+-abi3|py3-none)-(manylinux\S*x86_64|any)\.whl$", w["file"]), w["file"]
        assert w["size"] > 0 and len(w["sha256"]) == 64
    assert sum(w["size"] for w in wheels) / 1e6 <= wheelhouse.LIMIT_MB
    assert wheelhouse.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "in all, for CPython 3.12 on manylinux_2_28_x86_64" in out and "nothing downloaded" in out
    assert wheelhouse.main(["--dry-run", "--limit-mb", "1"]) == 1  # a set too large is refused


def test_a_package_missing_from_the_lock_is_named():
    with pytest.raises(SystemExit, match="no-such-package is not in uv.lock"):
        wheelhouse.resolve(["no-such-package"], (3, 12), (2, 28), "x86_64")


def test_a_malformed_python_version_is_one_usage_line(capsys):
    with pytest.raises(SystemExit) as e:
        wheelhouse.main(["--python", "3", "--dry-run"])
    assert e.value.code == 2 and "argument --python: '3' is not MAJOR.MINOR, e.g. 3.12" in capsys.readouterr().err


@no_cuda
def test_pytest_m_gpu_collects_every_gpu_test_and_skips_each_with_its_reason():
    collect = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
                              "no:cacheprovider", "tests/gpu"], cwd=REPO, capture_output=True, text=True)
    ids = [ln for ln in collect.stdout.splitlines() if "::" in ln]
    assert len(ids) >= 40, collect.stdout[-2000:]  # every head x every check, encoders, trainers, benchmarks
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/gpu"], cwd=REPO, capture_output=True, text=True)
    assert re.search(rf"\b{len(ids)} skipped\b", run.stdout), run.stdout[-2000:]
    reasons = [ln for ln in run.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert reasons and all("no CUDA device here" in ln and "make gpu-check" in ln for ln in reasons)
    default = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              "tests/gpu"], cwd=REPO, capture_output=True, text=True)
    assert f"{len(ids)} deselected" in default.stdout  # the default run leaves them out


@no_cuda
def test_gpu_check_runs_through_on_a_cpu_machine_and_writes_its_results(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(out),
                        "--wheelhouse", str(tmp_path / "no-wheelhouse")], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    assert "cuda available: False" in summary and "benchmarks: not run (no CUDA device)" in summary
    assert re.search(r"pytest -m gpu: exit 0; \d+ skipped", summary), summary
    facts = json.loads((out / "versions.json").read_text())
    assert facts["packages"]["torch"] == torch.__version__ and facts["cuda_available"] is False
    assert not [m for m, v in facts["packages"].items() if v.startswith("MISSING")]
    assert (out / "pytest.xml").is_file() and "skipped" in (out / "pytest.txt").read_text()
