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


def test_a_set_without_a_dependency_of_its_packages_is_refused():
    # zarr imports msgspec: a set without it installed on the GPU machine and then failed to import zarr
    with pytest.raises(SystemExit, match=r"zarr \S+ needs msgspec"):
        wheelhouse.resolve([p for p in wheelhouse.PACKAGES if p != "msgspec"], (3, 12), (2, 28), "x86_64")


def test_a_package_missing_from_the_lock_is_named():
    with pytest.raises(SystemExit, match="no-such-package is not in uv.lock"):
        wheelhouse.resolve(["no-such-package"], (3, 12), (2, 28), "x86_64")


def test_a_malformed_python_version_is_one_usage_line(capsys):
    with pytest.raises(SystemExit) as e:
        wheelhouse.main(["--python", "3", "--dry-run"])
    assert e.value.code == 2 and "argument --python: '3' is not MAJOR.MINOR, e.g. 3.12" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-5", "lots"])
def test_a_limit_that_is_not_a_finite_positive_size_is_one_usage_line(value, capsys):
    """--limit-mb nan passed and its check never fired (nan > x is False); every numeric option of the
    script is read by a parser that refuses what the check could not use."""
    with pytest.raises(SystemExit) as e:
        wheelhouse.main(["--dry-run", f"--limit-mb={value}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --limit-mb: '{value}'" in err, err
    assert ("is not a number" if value == "lots" else "a finite number of MB > 0 is needed") in err
    assert wheelhouse.main(["--dry-run", "--limit-mb", "0.5"]) == 1  # a small finite limit still refuses
    assert "exceeds 0.5 MB (--limit-mb)" in capsys.readouterr().err


def test_the_real_script_refuses_a_nan_limit_before_resolving():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "wheelhouse.py"), "--dry-run", "--limit-mb", "nan"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.strip().splitlines()[-1] == ("wheelhouse.py: error: argument --limit-mb: 'nan': a finite number "
                                                 "of MB > 0 is needed")


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "1e-300", "0.5", "1e15", "1e308", "2000001", "soon"])
def test_gpu_check_refuses_a_timeout_it_could_not_use_before_it_runs(value, tmp_path):
    """1e15 passed and crashed subprocess.run with OverflowError after the install; 1e-300 stopped every step."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "o"),
                        f"--timeout={value}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not (tmp_path / "o").exists(), r.stderr
    why = ("'soon' is not a number" if value == "soon"
           else f"'{value}': a number of seconds from 1 to 2,000,000 (23 days) is needed")
    assert r.stderr.strip().splitlines()[-1] == f"gpu_check.py: error: argument --timeout: {why}"


def test_gpu_check_takes_the_timeout_bounds_and_shares_tvrpipes_maximum():
    import gpu_check

    from tvrpipe.features.decode import MAX_TIMEOUT_S

    assert gpu_check.MAX_TIMEOUT_S == MAX_TIMEOUT_S
    assert gpu_check.positive_seconds("1") == 1.0 and gpu_check.positive_seconds("2e6") == 2_000_000.0


@pytest.mark.parametrize("value", ["7", "0", "-64", "8.5", "nan", "many"])
def test_gpu_check_refuses_too_few_extract_videos_before_it_runs(value, tmp_path):
    """bench extract needs 2 x its batch of 4 videos: fewer would fail after the suite and the other benchmarks
    had spent their hour."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "o"),
                        f"--extract-videos={value}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and not (tmp_path / "o").exists(), r.stderr
    why = (f"'{value}' is not a whole number" if value in ("8.5", "nan", "many")
           else f"'{value}': at least 8 videos are needed (2 x bench extract's batch of 4)")
    assert r.stderr.strip().splitlines()[-1] == f"gpu_check.py: error: argument --extract-videos: {why}"


def test_gpu_check_takes_eight_extract_videos_or_more():
    import gpu_check

    assert gpu_check.MIN_EXTRACT_VIDEOS == 8
    assert gpu_check.video_count("8") == 8 and gpu_check.video_count("64") == 64


@pytest.mark.parametrize("argv, videos", [([], "64"), (["--extract-videos", "8"], "8")])
def test_with_cuda_the_extract_benchmark_runs_last_at_720p_and_its_exit_is_in_the_summary(argv, videos, tmp_path,
                                                                                         monkeypatch):
    """main with CUDA said to be there and each step recorded instead of run: pytest, then bench eval, bench
    finetune at batch 32 and 128, then bench extract (fp16, 720p, --extract-videos videos), each with its JSON in
    the results; a failed extract benchmark is named in the summary and fails the check; RAY_ADDRESS never
    reaches a step (extraction would join that cluster)."""
    import gpu_check

    ran = []

    def fake_run(cmd, log, env, timeout):
        ran.append((cmd, log, env))
        log.write_text("1 passed\n")
        return 3 if "extract" in cmd else 0

    monkeypatch.setattr(gpu_check, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    out = tmp_path / "results"
    assert gpu_check.main(["--out", str(out), "--wheelhouse", str(tmp_path / "no-wheelhouse"), *argv]) == 1
    assert [log.name for _, log, _ in ran] == ["pytest.txt", "bench_eval.txt", "bench_finetune_b32.txt",
                                               "bench_finetune_b128.txt", "bench_extract.txt"]
    assert all("RAY_ADDRESS" not in env for _, _, env in ran)
    cmd = ran[-1][0]
    work = REPO / ".gpu-check" / "extract"
    assert cmd == [sys.executable, "-m", "tvrpipe", "bench", "extract", "--out", str(work), "--device", "cuda",
                   "--precision", "fp16", "--videos", videos, "--width", "1280", "--height", "720",
                   "--json", str(out.resolve() / "bench_extract.json")]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [ln for ln in summary if ln.startswith("tvrpipe bench")] == [
        "tvrpipe bench eval --device cuda --size msrvtt1k: exit 0",
        *(f"tvrpipe bench finetune --out {REPO / '.gpu-check' / 'finetune'} --device cuda --precision fp16 "
          f"--batch-size {b}: exit 0" for b in (32, 128)),
        f"tvrpipe bench extract --out {work} --device cuda --precision fp16 --videos {videos} --width 1280 "
        "--height 720: exit 3"]
    assert [name for name, _ in gpu_check.benches(REPO / ".gpu-check", 8)] == [log.stem for _, log, _ in ran[1:]]
    assert "``tvrpipe bench extract --device cuda --precision fp16``" in gpu_check.__doc__


@pytest.mark.slow  # about 20 s: a child pytest collects the whole suite
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


def test_a_download_removes_what_an_interrupted_one_left(tmp_path):
    """Wheels of another version and the partial download of a wheel no longer in the set do not stay."""
    (tmp_path / "old-1.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "gone-2.0-py3-none-any.whl.part").write_bytes(b"half")
    (tmp_path / "README").write_text("kept")
    wheelhouse.download([], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README"]
