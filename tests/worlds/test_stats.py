"""World statistics (`tvrpipe synth --describe`): measured against a plain reference, and the calibrated
worlds against real CLIP's documented targets."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from tvrpipe.features.store import open_store
from tvrpipe.worlds.features import (
    CALIBRATED,
    LATENT_TEXTS,
    LATENT_VIDEOS,
    ONE_SCENE,
    GenSpec,
    generate_store,
)
from tvrpipe.worlds.stats import TARGET, TARGETS, measure, table

pytestmark = pytest.mark.numerics


def _reference(store, split="test"):
    """The statistics by plain loops over pairs (no shared code with measure)."""
    v = store.videos
    rows = np.flatnonzero((v["split"] == split).to_numpy())
    t = store.texts
    cap = [int(np.flatnonzero(t["video_row"].to_numpy() == r)[0]) for r in rows]
    F = store.array("videos/frames")[:]
    M = store.array("videos/frame_mask")[:]
    S = store.array("texts/sentence")[:]
    W = store.array("texts/tokens")[:]
    WM = store.array("texts/token_mask")[:]

    def unit(x):
        x = np.asarray(x, np.float64)
        return x / np.linalg.norm(x)

    frames = [[unit(F[r, j]) for j in range(F.shape[1]) if M[r, j]] for r in rows]
    sents = [unit(S[c]) for c in cap]
    words = [[unit(W[c, j]) for j in np.flatnonzero(WM[c])[1:]] for c in cap]  # SOT left out
    n = len(rows)

    def r1(score):
        hits = 0
        for q in range(n):
            s = [score(q, g) for g in range(n)]
            hits += all(s[g] < s[q] for g in range(n) if g != q)  # a tie counts against
        return 100.0 * hits / n

    means = [unit(np.mean(fr, axis=0)) for fr in frames]  # of the normalised frames, as meanpool

    def tokenwise(q, g):
        c = np.array([[w @ f for f in frames[g]] for w in words[q]])
        return (c.max(1).mean() + c.max(0).mean()) / 2

    same = [a @ b for fr in frames for a, b in itertools.permutations(fr, 2)]
    other = [a @ b for i, j in itertools.permutations(range(n), 2) for a in frames[i] for b in frames[j]]
    return {
        "meanpool_r1": r1(lambda q, g: sents[q] @ means[g]),
        "frame_r1": r1(lambda q, g: sents[q] @ frames[g][len(frames[g]) // 2]),
        "tokenwise_r1": r1(tokenwise),
        "frame_cos_same": np.mean(same),
        "frame_cos_other": np.mean(other),
        "text_cos_other": np.mean([sents[i] @ sents[j] for i, j in itertools.permutations(range(n), 2)]),
        "text_frame_cos_matched": np.mean([np.mean([sents[i] @ f for f in frames[i]]) for i in range(n)]),
        "text_frame_cos_other": np.mean([np.mean([sents[i] @ f for j in range(n) if j != i for f in frames[j]])
                                         for i in range(n)]),
    }


def test_measure_matches_a_plain_reference(tmp_path):
    spec = GenSpec(train_videos=5, test_videos=14, captions_per_test_video=2, frames=5, min_frames=3, max_words=10,
                   embed_dim=24, intrinsic_dim=12, concepts=30, seed=5, **{**CALIBRATED, "noise": 0.6})
    store = open_store(generate_store(tmp_path / "s", spec))
    got, ref = measure(store), _reference(store)
    assert got["gallery"] == 14 and got["split"] == "test"
    for name, want in ref.items():
        # float32 features, float64 sums in a different order: cosines agree to float32 rounding
        assert got[name] == pytest.approx(want, abs=1e-5), name


def test_measure_samples_a_gallery_of_at_most_1000_videos(tmp_path):
    spec = GenSpec(train_videos=0, test_videos=30, frames=3, max_words=8, embed_dim=16, seed=1)
    store = open_store(generate_store(tmp_path / "s", spec))
    small = measure(store, gallery=10)
    assert small["gallery"] == 10
    assert measure(store, gallery=10, seed=0) == small
    assert measure(store, gallery=10, seed=1) != small
    rows = table(small)
    assert [r[0] for r in rows] == [t.label for t in TARGETS]
    assert rows[0][3] == "n/a (10 videos)"  # R@1 of a 10-video gallery is not comparable to 1k-A's


@pytest.mark.parametrize("world, off_target", [(CALIBRATED, ()), (ONE_SCENE, ("frame_cos_same",))])
def test_calibrated_worlds_show_real_clip_statistics(tmp_path, world, off_target):
    # D = 512 and a 1,000-video gallery: ViT-B/32 on MSR-VTT 1k-A, the targets' setting
    spec = GenSpec(train_videos=0, test_videos=1000, embed_dim=512, seed=11, **world)
    got = measure(open_store(generate_store(tmp_path / "s", spec)))
    for t in TARGETS:
        if t.name in off_target:
            continue
        assert abs(got[t.name] - t.value) <= t.tolerance, (t.name, got[t.name], t.value)
    # the orders real CLIP shows: mean pooling above one frame above chance, token-wise below mean pooling
    assert got["meanpool_r1"] > got["frame_r1"] > 10 * 100 / 1000
    assert got["tokenwise_r1"] < got["meanpool_r1"]
    if off_target:  # one scene per video: its frames are closer than real CLIP's (docs/synthetic.md)
        assert got["frame_cos_same"] > TARGET["frame_cos_same"].value + TARGET["frame_cos_same"].tolerance


def test_mixed_worlds_have_one_and_multi_scene_videos_and_partial_captions(tmp_path):
    spec = GenSpec(train_videos=0, test_videos=400, captions_per_test_video=4, frames=6, max_words=16, embed_dim=16,
                   concepts=64, seed=2, scenes=3, multi_scene=0.3, caption_describes="mixed", partial_captions=0.5)
    out = generate_store(tmp_path / "s", spec)
    lv = pd.read_parquet(out / LATENT_VIDEOS)
    lt = pd.read_parquet(out / LATENT_TEXTS)
    multi = (lv["scenes"] == 3).to_numpy()
    assert set(lv["scenes"]) == {1, 3}
    assert abs(multi.mean() - 0.3) < 0.07  # binomial, 400 videos: sd 0.023
    assert (lv["concepts"].map(len) == np.where(multi, 9, 3)).all()
    of_multi = multi[lt["video_row"].to_numpy()]
    assert (lt["scene"][~of_multi] == -1).all()  # a one-scene video's captions describe it whole
    partial = (lt["scene"][of_multi] >= 0).mean()
    assert abs(partial - 0.5) < 0.07
    assert (lt["concepts"].map(len) == np.where(lt["scene"] >= 0, 3, np.where(of_multi, 9, 3))).all()
    # a one-scene video's frames all show its one scene: they are closer than a multi-scene video's
    s = open_store(out)
    f = s.array("videos/frames")[:].astype(np.float64)
    f /= np.linalg.norm(f, axis=-1, keepdims=True)
    first_last = (f[:, 0] * f[:, -1]).sum(1)
    assert first_last[~multi].mean() > first_last[multi].mean() + 0.02


def test_structure_rows_show_a_stores_rates_beside_the_calibrated_worlds():
    from tvrpipe.worlds.stats import STRUCTURE, structure_rows

    spec = GenSpec(caption_shift=12.5, shared_sources=0.25, near_duplicates=0.1, scenes=1).to_dict()
    rows = {r[0]: r for r in structure_rows(spec, {**CALIBRATED, "caption_shift": 30.0})}
    assert len(rows) == len(STRUCTURE)
    share = next(r for k, r in rows.items() if k.startswith("learnable share"))
    assert share[1:4] == ("12.5", "30", "+7.6 R@1 over zero-shot for a trained head on frozen CLIP")
    shared = next(r for k, r in rows.items() if k.startswith("val/test videos"))
    assert shared[1] == "25%" and shared[3].startswith("37.2 %") and "MDMMT" in shared[4]
    scenes = next(r for k, r in rows.items() if k.startswith("videos of several scenes"))
    assert scenes[1:3] == ("0%", "30%")  # one scene a video: none has several, whatever multi_scene says
    repeated = next(r for k, r in rows.items() if k.startswith("captions that repeat"))
    assert repeated[1:3] == ("none", "none") and "not modelled" in repeated[4]


def test_r1_counts_a_tie_against():
    from tvrpipe.worlds.stats import _r1

    assert _r1(np.array([[0.5, 0.5, 0.1], [0.0, 0.9, 0.2], [0.3, 0.3, 0.4]])) == pytest.approx(200 / 3)


def test_describe_prints_the_table_and_writes_nothing(cli, tmp_path):
    out = tmp_path / "s"
    generate_store(out, GenSpec(train_videos=0, test_videos=12, frames=3, max_words=8, embed_dim=16, seed=1,
                                caption_shift=12.5, shared_sources=0.25))
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = cli("synth", "--out", out, "--describe")
    assert r.exit_code == 0, r.output
    assert "R@1, mean pooling [1]" in r.output and "12 videos" in r.output
    assert "Mind the Gap" in r.output and "n/a (12 videos)" in r.output
    assert "[1] published: Portillo-Quintero" in r.output and "[2] chosen: not published" in r.output
    # the generator's structure, beside the calibrated world's and MSR-VTT's published rates, with sources
    assert "the world's structure" in r.output and "37.2 %" in r.output
    assert "MV-Adapter" in r.output and "MDMMT (arXiv 2103.10699) Tab. 11" in r.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    for args, message in ((["--describe", "--videos", "3"], "--videos makes data; --describe alone only reads"),
                          (["--split", "val"], "--split applies with --describe"),
                          (["--describe", "--split", "train"], "split 'train' has 0 videos")):
        r = cli("synth", "--out", out, *args)
        assert r.exit_code == 1 and message in " ".join(r.output.split()), r.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
