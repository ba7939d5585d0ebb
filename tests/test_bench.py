"""``tvrpipe bench extract`` runs end to end (tiny model and videos) and reports sane numbers."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_extract_cli(tmp_path):
    out = tmp_path / "b"
    r = subprocess.run(
        [sys.executable, "-m", "tvrpipe", "bench", "extract", "--out", str(out), "--videos", "4",
         "--width", "96", "--height", "64", "--seconds", "1", "--fps", "12", "--model", "tvrpipe-tiny",
         "--batch-size", "1", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "r.json").read_text())
    for key in ("decode", "encode", "bound", "naive"):
        assert res[key] > 0, key
    # 4 tiny videos are too little work for a marginal rate to rise above Ray's noise: the bench
    # reports either a positive rate or NaN (said so in its output), never a negative one.
    assert res["pipeline"] > 0 or (res["pipeline"] != res["pipeline"] and "too little work" in r.stdout)
    # the shared-CPU bound is below both stages and equals its formula
    assert res["bound"] < min(res["decode"], res["encode"])
    assert abs(1 / res["bound"] - (1 / res["decode"] + 1 / res["encode"])) < 1e-9
    if res["pipeline"] > 0:
        assert abs(res["vs_bound"] - res["pipeline"] / res["bound"]) < 1e-9
    assert "pipeline / bound" in r.stdout and "pipeline / naive" in r.stdout
    assert len(list((out / "videos").glob("bench_*.mp4"))) == 4
    assert not (out / "features").exists()  # measurement stores are removed


def test_bench_rejects_too_few_videos(cli, tmp_path):
    r = cli("bench", "extract", "--out", tmp_path, "--videos", "3", "--batch-size", "4")
    assert r.exit_code == 1 and "--videos must be at least 2 x --batch-size (8), got 3" in r.output
