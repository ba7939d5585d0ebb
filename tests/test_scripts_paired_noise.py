"""scripts/paired_noise.py (the validation noise figures of docs/training.md), against independent references:
the finite-population correction against simulated sampling of a known Bernoulli population, a draw's R@1
against a plain loop over its queries and against worlds.stats' zero-shot scorers, and the whole command on a
tiny pool."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tvrpipe.features.store import open_store
from tvrpipe.worlds.features import CALIBRATED, GenSpec, generate_store
from tvrpipe.worlds.stats import measure as world_measure

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import paired_noise  # noqa: E402


@pytest.mark.parametrize("n", [5, 20, 40])
def test_the_correction_turns_the_sd_of_a_pool_sample_into_that_of_an_infinite_population(n):
    # A pool of N = 50 videos, 20 of them hits: n drawn without replacement from it, the sd of their hit rate
    # times the factor is the sd of n drawn from the world the pool was drawn from, sqrt(p (1 - p) / n).
    N, hits = 50, 20
    pool = np.zeros(N)
    pool[:hits] = 1
    rng = np.random.default_rng(0)
    rates = np.array([pool[rng.permutation(N)[:n]].mean() for _ in range(20000)])
    p = hits / N
    infinite = np.sqrt(p * (1 - p) / n)
    corrected = paired_noise.finite_population_factor(N, n) * rates.std(ddof=1)
    assert corrected == pytest.approx(infinite, rel=0.02)  # the sd of 20,000 draws is known to 0.5 %
    assert rates.std(ddof=1) < 0.98 * infinite  # uncorrected it is low, more so as n nears N
    with pytest.raises(ValueError, match="1 <= n < N"):
        paired_noise.finite_population_factor(N, N)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    # videos of 4 to 7 frames, so that the middle frame is the middle *valid* one
    spec = GenSpec(train_videos=3, val_videos=0, test_videos=48, embed_dim=32, frames=7, min_frames=4, seed=3,
                   **CALIBRATED)
    return open_store(generate_store(tmp_path_factory.mktemp("pn") / "world", spec))


def _plain_r1(store, rows, scorer):
    """R@1 of the draw by a loop over its queries: float64, the first caption, ties against."""
    vrows = np.flatnonzero((store.videos["split"] == "test").to_numpy())[rows]
    t = store.texts
    frames = store.array("videos/frames")[:].astype(np.float64)
    fmask = store.array("videos/frame_mask")[:].astype(bool)
    sentences = store.array("texts/sentence")[:].astype(np.float64)

    def unit(x):
        return x / np.linalg.norm(x)

    def video(v):
        valid = [unit(f) for f, ok in zip(frames[v], fmask[v]) if ok]
        return unit(np.mean(valid, axis=0)) if scorer == "mean" else valid[len(valid) // 2]

    gallery = [video(v) for v in vrows]
    hits = 0
    for i, v in enumerate(vrows):
        s = unit(sentences[int(np.flatnonzero(t["video_row"].to_numpy() == v)[0])])
        scores = [float(s @ g) for g in gallery]
        hits += sum(scores[j] >= scores[i] for j in range(len(vrows)) if j != i) == 0
    return 100.0 * hits / len(vrows)


def test_a_draws_r1_is_a_plain_loops_and_worlds_stats(tiny_store):
    sent, mean, middle = paired_noise.pool_features(tiny_store)
    assert sent.shape == mean.shape == middle.shape == (48, 32)
    for seed, n in [(0, 12), (1, 30), (2, 48 - 1)]:
        # worlds.stats.measure's draw of n test videos, scored by the script and by worlds.stats
        rows = np.sort(np.random.default_rng(seed).choice(48, n, replace=False))
        got_mean, got_mid = paired_noise.draw_r1(sent, mean, rows), paired_noise.draw_r1(sent, middle, rows)
        assert got_mean == pytest.approx(_plain_r1(tiny_store, rows, "mean"))
        assert got_mid == pytest.approx(_plain_r1(tiny_store, rows, "middle"))
        ws = world_measure(tiny_store, gallery=n, seed=seed)
        assert (got_mean, got_mid) == pytest.approx((ws["meanpool_r1"], ws["frame_r1"]))


def test_a_tie_counts_against():
    sent = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    videos = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # query 0 ties between both videos; query 1 misses
    assert paired_noise.draw_r1(sent, videos, np.array([0, 1])) == 0.0
    assert paired_noise.draw_r1(sent, videos, np.array([0])) == 100.0  # alone in its gallery, it hits


def test_measure_reports_the_corrected_sd_of_its_draws_with_an_interval_around_it(tiny_store):
    sent, mean, middle = paired_noise.pool_features(tiny_store)
    rows = paired_noise.measure(sent, mean, middle, [10, 24], draws=30, seed=5, n_boot=400)
    for r in rows:
        c = np.sqrt(47 / (48 - r["n"]))
        assert r["factor"] == pytest.approx(c)
        assert r["sd_diff"] == pytest.approx(c * np.std(r["meanpool"] - r["middle"], ddof=1))
        assert r["sd_meanpool"] == pytest.approx(c * np.std(r["meanpool"], ddof=1))
        assert r["sd_diff_ci"][0] < r["sd_diff"] < r["sd_diff_ci"][1]
        assert r["sd_meanpool_ci"][0] < r["sd_meanpool"] < r["sd_meanpool_ci"][1]
    # the draws are the seeded ones: a second run gives the same figures
    again = paired_noise.measure(sent, mean, middle, [10, 24], draws=30, seed=5, n_boot=400)
    assert [r["sd_diff"] for r in again] == [r["sd_diff"] for r in rows]


def test_the_command_runs_on_a_tiny_pool_and_keeps_its_store_under_out(tmp_path, capsys):
    assert paired_noise.main(["--pool", "40", "--draws", "5", "--sizes", "10,20", "--out", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "pool N = 40 test videos, 5 draws per size" in out and "generated in" in out and "sqrt((N-1)/(N-n))" in out
    assert [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| 1") or
            line.startswith("| 2")] == ["10", "20"]
    assert f"'noise': {CALIBRATED['noise']}" in out  # the world is CALIBRATED as it is when the script runs
    assert open_store(tmp_path / "w").videos["split"].eq("test").sum() == 40
    assert paired_noise.main(["--pool", "40", "--draws", "5", "--sizes", "10", "--out", str(tmp_path / "w")]) == 0
    assert "found there, checked and completed" in capsys.readouterr().out  # a rerun says it reused the store
    with pytest.raises(SystemExit):
        paired_noise.main(["--pool", "40", "--sizes", "40"])  # a draw must leave videos out of the pool
