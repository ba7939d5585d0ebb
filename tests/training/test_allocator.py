"""glibc's malloc tuned for training: a step-sized block is reused, not faulted in again each step.

Each check runs in a fresh interpreter, since the tuning is process-wide and sticky. The measure is
the kernel's count of minor page faults while a (128, 128, 512) float32 tensor (32 MiB, X-Pool's
pooled videos at B = 128, D = 512) is allocated, filled and freed, the median over 7 blocks:
8,192 pages a block when every allocation is a fresh mapping, none when the heap hands the same
block back.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the tuning applies to glibc only")

PAGES = 128 * 128 * 512 * 4 // 4096  # 8,192 pages of 4 KiB in one 32 MiB block

MEASURE = """
import json, resource, sys, torch
def faults_per_block(n=7):  # the median over n blocks: the heap may grow once, to make room
    counts = []
    for _ in range(n):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(128, 128, 512)
        del x
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sorted(counts)[n // 2]
"""


def _run(body: str, env: dict[str, str] | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", MEASURE + body], env={**clean, **(env or {})},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fit_tunes_the_allocator_so_a_step_block_is_not_faulted_in_again(tmp_path):
    """Before fit, every 32 MiB block is a fresh mapping (8,192 faults); once fit has run, the heap
    reuses it. fit on a tiny generated store is the path every head trains through."""
    res = _run(f"""
from tvrpipe.worlds.features import GenSpec, generate_store
from tvrpipe.training import allocator
from tvrpipe.training.fit import TrainConfig, fit
before = faults_per_block()
store = generate_store({str(tmp_path / 'store')!r}, GenSpec(train_videos=16, test_videos=8, embed_dim=8, seed=0))
fit(store, "xpool", {str(tmp_path / 'run')!r}, TrainConfig(epochs=1, batch_size=8), progress=False)
print(json.dumps({{"before": before, "after": faults_per_block(), "state": allocator.tune_allocator()}}))
""")
    assert res["before"] >= 0.9 * PAGES, res  # glibc's default: mmap and munmap around every block
    if "up to 32 MiB" in res["state"]:
        pytest.skip("this glibc caps the mmap threshold at 32 MiB, so a 32 MiB block stays mapped")
    assert res["after"] < 0.01 * PAGES, res
    assert res["state"] == "glibc: blocks up to 256 MiB from the heap, 1024 MiB of it kept"


def test_a_users_malloc_variables_win_and_the_first_call_decides():
    """With MALLOC_MMAP_THRESHOLD_ set (here to glibc's own 128 KiB), nothing is changed: blocks are
    still mapped afresh; a second call returns the first call's answer."""
    res = _run("""
from tvrpipe.training.allocator import tune_allocator
first = tune_allocator()
print(json.dumps({"first": first, "second": tune_allocator(), "faults": faults_per_block()}))
""", env={"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert res["first"] == res["second"] == "left as set by MALLOC_MMAP_THRESHOLD_"
    assert res["faults"] >= 0.9 * PAGES, res


def test_other_platforms_and_a_refusing_glibc_are_left_alone(monkeypatch):
    """Elsewhere than glibc nothing is called; a glibc that refuses a 256 MiB mmap threshold gets 32
    MiB (its cap); a threshold refused outright is reported by name (the fakes stand in for the C
    library, so this process's malloc is not touched)."""
    from tvrpipe.training import allocator

    for var in allocator.USER_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(allocator.platform, "system", lambda: "Darwin")
    assert allocator._tune() == "left as is (not glibc)"
    monkeypatch.setattr(allocator.platform, "system", lambda: "Linux")
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("glibc", "2.36"))
    calls = []

    class FakeLibc:
        def __init__(self, name):
            self.mallopt = FakeMallopt()

    class FakeMallopt:
        argtypes = restype = None

        def __call__(self, param, value):
            calls.append((param, value))
            return int(value in accept.get(param, ()))

    accept = {-3: (32 << 20,)}  # a glibc that caps the mmap threshold at 32 MiB, and refuses the trim threshold
    monkeypatch.setattr(allocator.ctypes, "CDLL", FakeLibc)
    assert allocator._tune() == "glibc refused the trim threshold (left at its default)"
    assert calls == [(-3, 256 << 20), (-3, 32 << 20), (-1, 1 << 30)]
    accept[-1] = (1 << 30,)
    assert allocator._tune() == "glibc: blocks up to 32 MiB from the heap, 1024 MiB of it kept"
    accept[-3] = ()
    assert allocator._tune() == "glibc refused the mmap threshold (left at its default)"
