"""Download the wheels an offline GPU machine needs beyond its own torch, for `make gpu-check` there.

Run on a connected machine (``make wheelhouse``); copy the repository, with the ``wheelhouse/`` folder
it writes, to the GPU machine. The versions are uv.lock's (what CI tested), resolved for the target's
Python and platform (default CPython 3.12, manylinux x86-64, glibc 2.28), each file checked against the
lock's sha256. ``--dry-run`` resolves and sums the sizes from the lock alone, downloading nothing.

The set: what tvrpipe needs that a PyTorch GPU image (torch, torchvision, numpy, pandas, pyarrow,
safetensors, typer, rich, PyYAML, matplotlib, timm, huggingface_hub, regex, tqdm) does not usually have.
``make gpu-check`` names any module still missing there; ``--also NAME`` adds its package.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tomllib
import urllib.request
from pathlib import Path

from packaging.markers import Marker
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("open-clip-torch", "decord", "av", "zarr", "numcodecs", "donfig", "google-crc32c", "msgspec", "ftfy", "wcwidth")
# what a PyTorch GPU image is taken to have already (the docstring's list, with what those need)
IMAGE = ("torch", "torchvision", "numpy", "pandas", "pyarrow", "safetensors", "typer", "rich", "pyyaml", "matplotlib",
         "timm", "huggingface-hub", "regex", "tqdm", "pytest", "packaging", "typing-extensions")
LIMIT_MB = 60.0  # what can be carried to such a machine beside the repository


def target_tags(python: tuple[int, int], glibc: tuple[int, int], arch: str) -> list:
    """The wheel tags a CPython ``python`` on manylinux ``glibc`` / ``arch`` installs, best first."""
    platforms = [f"manylinux_{glibc[0]}_{m}_{arch}" for m in range(glibc[1], 4, -1)]
    legacy = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
    platforms += [f"{legacy[v]}_{arch}" for v in legacy if v <= glibc] + [f"linux_{arch}"]
    return [*cpython_tags(python, platforms=platforms), *compatible_tags(python, f"cp{python[0]}{python[1]}",
                                                                         platforms)]


def environment(python: tuple[int, int], arch: str) -> dict[str, str]:
    """The PEP 508 marker environment of the target."""
    version = f"{python[0]}.{python[1]}"
    return {"python_version": version, "python_full_version": f"{version}.0", "sys_platform": "linux",
            "platform_system": "Linux", "os_name": "posix", "platform_machine": arch,
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": f"{version}.0"}


def resolve(packages: list[str], python: tuple[int, int], glibc: tuple[int, int], arch: str,
            lock: Path = REPO / "uv.lock") -> list[dict]:
    """For each package: the lock's version for the target and its best wheel (``name``, ``version``,
    ``file``, ``url``, ``sha256``, ``size``).

    Raises:
        SystemExit: a package is not in the lock, or has no wheel for the target.
    """
    entries = tomllib.loads(lock.read_text())["package"]
    env, tags = environment(python, arch), target_tags(python, glibc, arch)
    rank = {t: i for i, t in enumerate(tags)}
    chosen = []
    for name in packages:
        name = canonicalize_name(name)
        candidates = [p for p in entries if canonicalize_name(p["name"]) == name and
                      (not p.get("resolution-markers") or any(Marker(m).evaluate(env)
                                                               for m in p["resolution-markers"]))]
        if not candidates:
            raise SystemExit(f"wheelhouse: {name} is not in uv.lock for Python {python[0]}.{python[1]}; "
                             "add it to pyproject.toml and run `make lock`")
        pkg = candidates[0]
        missing = [d["name"] for d in pkg.get("dependencies", [])
                   if canonicalize_name(d["name"]) not in {canonicalize_name(n) for n in (*packages, *IMAGE)}
                   and (not d.get("marker") or Marker(d["marker"]).evaluate(env))]
        if missing:  # it would install, then fail to import on the GPU machine
            raise SystemExit(f"wheelhouse: {name} {pkg['version']} needs {', '.join(missing)}, which is neither in "
                             "the set nor in what a PyTorch image has; add it with --also NAME")
        best = None
        for w in pkg.get("wheels", []):
            file = w["url"].rsplit("/", 1)[1]
            score = min((rank[t] for t in parse_wheel_filename(file)[3] if t in rank), default=None)
            if score is not None and (best is None or score < best[0]):
                best = (score, file, w)
        if best is None:
            raise SystemExit(f"wheelhouse: {name} {pkg['version']} has no wheel for CPython "
                             f"{python[0]}.{python[1]} on manylinux_{glibc[0]}_{glibc[1]}_{arch} in uv.lock")
        _, file, w = best
        chosen.append({"name": name, "version": pkg["version"], "file": file, "url": w["url"],
                       "sha256": w["hash"].split(":", 1)[1], "size": int(w["size"])})
    return chosen


def download(wheels: list[dict], out: Path) -> None:
    """Fetch each wheel into ``out`` (kept when already there with the right sha256)."""
    out.mkdir(parents=True, exist_ok=True)
    for w in wheels:
        path = out / w["file"]
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == w["sha256"]:
            continue
        tmp = path.with_name(path.name + ".part")
        with urllib.request.urlopen(w["url"], timeout=120) as r, open(tmp, "wb") as f:
            while block := r.read(1 << 20):
                f.write(block)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != w["sha256"]:
            tmp.unlink()
            raise SystemExit(f"wheelhouse: {w['file']} does not match the sha256 in uv.lock; not kept")
        tmp.replace(path)
    for stale in set(out.glob("*.whl")) - {out / w["file"] for w in wheels}:
        stale.unlink()  # a wheel of another version: gpu-check installs every file here
    for part in out.glob("*.whl.part"):
        part.unlink()  # what an interrupted download of a wheel no longer in the set left behind


def major_minor(text: str) -> tuple[int, int]:
    """``"3.12"`` -> ``(3, 12)``, for argparse (which turns the ValueError into one usage line)."""
    parts = text.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not MAJOR.MINOR, e.g. 3.12")
    return int(parts[0]), int(parts[1])


def positive_mb(text: str) -> float:
    """A size in MB > 0 and finite, for argparse (which names the option in its usage line): ``nan``
    passes every comparison as False, so the size check would never fire, and ``inf`` or ``0`` is no limit."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or x <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number of MB > 0 is needed")
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "wheelhouse", help="where the wheels go (default: wheelhouse/)")
    ap.add_argument("--python", type=major_minor, default=(3, 12),
                    help="the GPU machine's Python, MAJOR.MINOR (default 3.12)")
    ap.add_argument("--glibc", type=major_minor, default=(2, 28),
                    help="its glibc, MAJOR.MINOR (default 2.28: manylinux_2_28)")
    ap.add_argument("--arch", default="x86_64", help="its machine (default x86_64)")
    ap.add_argument("--also", action="append", default=[], help="another package of uv.lock (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="resolve and size from uv.lock; download nothing")
    ap.add_argument("--limit-mb", type=positive_mb, default=LIMIT_MB, help=f"refuse a larger set (default {LIMIT_MB:.0f})")
    a = ap.parse_args(argv)
    python, glibc = a.python, a.glibc
    wheels = resolve([*PACKAGES, *a.also], python, glibc, a.arch)
    total = sum(w["size"] for w in wheels) / 1e6
    for w in wheels:
        print(f"{w['size'] / 1e6:7.1f} MB  {w['file']}")
    print(f"{total:7.1f} MB  in all, for CPython {python[0]}.{python[1]} on manylinux_{glibc[0]}_{glibc[1]}_{a.arch} "
          f"(limit {a.limit_mb:g} MB){'; dry run: nothing downloaded' if a.dry_run else ''}")
    if total > a.limit_mb:
        print(f"wheelhouse: {total:.1f} MB exceeds {a.limit_mb:g} MB (--limit-mb)", file=sys.stderr)
        return 1
    if not a.dry_run:
        download(wheels, a.out)
        print(f"wrote {len(wheels)} wheels to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
