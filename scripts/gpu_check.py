"""`make gpu-check`: the gpu test suite and the GPU benchmarks on a machine with torch and no network.

From the repository root, with ``wheelhouse/`` beside it (``make wheelhouse`` on a connected machine):

1. installs the wheelhouse with ``pip --no-index`` into ``.gpu-check/site`` (a target folder: the
   machine's own torch is left alone); without a wheelhouse it uses what this Python has;
2. checks that every module the suite imports is there, naming the missing ones;
3. runs ``pytest -m gpu`` (skipped, with the reason, where CUDA is not available);
4. where CUDA is available, runs the GPU benchmarks, in this order (:func:`benches`):
   ``tvrpipe bench eval --device cuda`` (every head at the 1k x 1k size),
   ``tvrpipe bench finetune --device cuda --precision fp16`` (ViT-B-32 at batch 32 and 128), and
   ``tvrpipe bench extract --device cuda --precision fp16`` (``--extract-videos`` generated 720p videos, 64 by
   default: extraction, without Ray, against its bound, a naive loop and the open_clip + PyAV loop);
5. writes everything into one folder to copy back (default ``gpu-check-results/``): summary.txt, the
   pytest output and JUnit XML, the benchmarks' JSON, the figures the tests measured (figures.jsonl),
   ``nvidia-smi``'s line and the versions.

Exit status: 1 when a test failed, a benchmark failed or a module is missing, else 0. Nothing here starts Ray
(``RAY_ADDRESS`` is left out of the steps' environment, so extraction runs without it) or downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what the gpu suite and the benchmarks import (Ray is not among them)
MODULES = ("torch", "torchvision", "numpy", "pandas", "pyarrow", "yaml", "safetensors", "typer", "rich",
           "matplotlib", "pytest", "packaging", "open_clip", "decord", "av", "zarr", "numcodecs")
# --timeout's maximum, tvrpipe's own decode --timeout's (tvrpipe.features.decode.MAX_TIMEOUT_S, which this script
# does not import: it runs before the wheelhouse is installed)
MAX_TIMEOUT_S = 2_000_000
# --extract-videos' minimum: bench extract needs at least 2 x its --batch-size (4) videos, to time a marginal rate
# after the first batch
MIN_EXTRACT_VIDEOS = 8


def run(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> int:
    """``cmd`` with its output in ``log`` (and echoed); its exit status (124 when it ran past ``timeout``)."""
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=timeout)
            out, code = p.stdout, p.returncode
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            out, code = f"{partial}\n(stopped after {timeout:.0f} s)\n", 124
        f.write(out)
    print(out[-4000:], flush=True)
    return code


def install(wheelhouse: Path, site: Path) -> tuple[str, bool]:
    """The wheelhouse installed into ``site`` (no index, no dependency resolution: the set is complete):
    what was done, and whether it worked."""
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        return f"no wheelhouse at {wheelhouse}: using this Python's own packages", True
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site),
           *map(str, wheels)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        why = " ".join((p.stderr or p.stdout).split())[:400]
        return (f"FAILED to install {wheelhouse} ({why}); make it for this Python with `python scripts/wheelhouse.py "
                f"--python {sys.version_info[0]}.{sys.version_info[1]}` on a connected machine"), False
    return f"installed {len(wheels)} wheels from {wheelhouse} into {site}", True


def versions(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Each module's version as the suite will import it (in a child with the suite's PYTHONPATH), and the
    modules missing."""
    code = ("import importlib, json, sys\nout = {}\nfor m in sys.argv[1:]:\n"
            "    try:\n        out[m] = str(getattr(importlib.import_module(m), '__version__', 'present'))\n"
            "    except Exception as e:\n        out[m] = 'MISSING: ' + type(e).__name__ + ': ' + str(e)[:200]\n"
            "print(json.dumps(out))")
    p = subprocess.run([sys.executable, "-c", code, *MODULES], cwd=REPO, env=env, capture_output=True, text=True)
    found = json.loads(p.stdout.strip().splitlines()[-1])
    return found, [m for m, v in found.items() if v.startswith("MISSING")]


def gpu_line() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi: not found"
    p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    return p.stdout.strip() or p.stderr.strip()


def positive_seconds(text: str) -> float:
    """A time limit in seconds from 1 to MAX_TIMEOUT_S, for argparse (which names the option in its usage line):
    ``nan`` would pass every comparison as False and run each step without a limit, a limit near 0 stops
    every step at once, and one past what the clock can wait for (``1e15``) crashes subprocess.run."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 1 <= x <= MAX_TIMEOUT_S:  # nan and the infinities fail this too
        raise argparse.ArgumentTypeError(f"{text!r}: a number of seconds from 1 to {MAX_TIMEOUT_S:,} (23 days) "
                                         "is needed")
    return x


def video_count(text: str) -> int:
    """``--extract-videos``, for argparse: a whole number of videos, at least :data:`MIN_EXTRACT_VIDEOS`
    (refused before anything runs, not after the suite has spent its hour)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < MIN_EXTRACT_VIDEOS:
        raise argparse.ArgumentTypeError(f"{text!r}: at least {MIN_EXTRACT_VIDEOS} videos are needed (2 x bench "
                                         "extract's batch of 4)")
    return n


def benches(work: Path, extract_videos: int) -> list[tuple[str, list[str]]]:
    """The GPU benchmarks, in the order they run: each one's name (its ``NAME.json`` and ``NAME.txt`` in the
    results) and its ``tvrpipe`` arguments. ``work`` holds what they generate (the finetune and extract
    benchmarks' videos and weights)."""
    steps = [("bench_eval", ["bench", "eval", "--device", "cuda", "--size", "msrvtt1k"])]
    steps += [(f"bench_finetune_b{b}", ["bench", "finetune", "--out", str(work / "finetune"), "--device", "cuda",
                                        "--precision", "fp16", "--batch-size", str(b)]) for b in (32, 128)]
    steps.append(("bench_extract", ["bench", "extract", "--out", str(work / "extract"), "--device", "cuda",
                                    "--precision", "fp16", "--videos", str(extract_videos), "--width", "1280",
                                    "--height", "720"]))
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "gpu-check-results", help="the results folder")
    ap.add_argument("--wheelhouse", type=Path, default=REPO / "wheelhouse")
    ap.add_argument("--timeout", type=positive_seconds, default=3600.0, help="seconds for each step at most")
    ap.add_argument("--extract-videos", type=video_count, default=64,
                    help=f"generated 720p videos of the extract benchmark (at least {MIN_EXTRACT_VIDEOS})")
    a = ap.parse_args(argv)
    out = a.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start = time.time()
    site = REPO / ".gpu-check" / "site"
    how, installed = install(a.wheelhouse, site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site) if site.is_dir() else "", str(REPO),
                                                                   os.environ.get("PYTHONPATH", "")) if p),
           "TVRPIPE_GPU_RESULTS": str(out), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("RAY_ADDRESS", None)  # extract and finetune would join that cluster instead of running here
    found, missing = versions(env)
    import torch  # the machine's own

    cuda = torch.cuda.is_available()
    facts = {"python": platform.python_version(), "platform": platform.platform(), "gpu": gpu_line(),
             "cuda_available": cuda, "torch_cuda": torch.version.cuda, "packages": found, "install": how}
    (out / "versions.json").write_text(json.dumps(facts, indent=2))
    lines = [f"gpu-check {time.strftime('%Y-%m-%d %H:%M:%S')}", f"GPU: {facts['gpu']}",
             f"python {facts['python']}, torch {found.get('torch')} (CUDA {torch.version.cuda}), cuda available: {cuda}",
             how]
    status = 0
    if not installed:
        status = 1
    elif missing:
        lines.append(f"MISSING modules: {', '.join(missing)}: add their packages to the wheelhouse "
                     "(`python scripts/wheelhouse.py --also NAME` on a connected machine)")
        status = 1
    else:
        code = run([sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rA",
                    f"--junitxml={out / 'pytest.xml'}", "tests/gpu"], out / "pytest.txt", env, a.timeout)
        tail = [ln for ln in (out / "pytest.txt").read_text().splitlines() if ln.strip()][-1:]
        lines.append(f"pytest -m gpu: exit {code}; {tail[0] if tail else ''}")
        status = 1 if code not in (0, 5) else 0  # 5: nothing collected
        if cuda:
            for name, args in benches(REPO / ".gpu-check", a.extract_videos):
                code = run([sys.executable, "-m", "tvrpipe", *args, "--json", str(out / f"{name}.json")],
                           out / f"{name}.txt", env, a.timeout)
                lines.append(f"tvrpipe {' '.join(args)}: exit {code}")
                status = status or int(code != 0)
        else:
            lines.append("benchmarks: not run (no CUDA device)")
    lines.append(f"{time.time() - start:.0f} s; results in {out}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
