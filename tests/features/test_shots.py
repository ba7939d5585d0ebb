"""``manifest build --videos DIR --shots``: a collection's files cut at their shot boundaries (PySceneDetect), through
the CLI, on generated videos whose hard cuts are at known frames."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError
from tvrpipe.features.collection import Cutting, build_collection, cutting_of
from tvrpipe.worlds.videos import write_mp4

pytest.importorskip("scenedetect")

FPS = 25
# four scenes of distinct colour (hue and brightness both change at each cut), each with a stripe moving inside it
SCENES = [(40, (220, 40, 40)), (55, (20, 20, 110)), (30, (240, 240, 240)), (75, (10, 140, 10))]
CUTS = [40 / FPS, 95 / FPS, 125 / FPS]  # 1.6, 3.8, 5.0 s; the file ends at 200 / 25 = 8.0 s


def _scenes(path: Path, scenes=SCENES) -> Path:
    frames = []
    for length, colour in scenes:
        base = np.zeros((96, 128, 3), np.uint8) + np.array(colour, np.uint8)
        for i in range(length):
            f = base.copy()
            f[:, (2 * i) % 120:(2 * i) % 120 + 8] = 255 - np.array(colour, np.uint8)
            frames.append(f)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_mp4(path, np.stack(frames), FPS)
    return path


@pytest.fixture()
def folder(tmp_path) -> Path:
    _scenes(tmp_path / "v" / "cuts.mp4")
    _scenes(tmp_path / "v" / "one" / "still.mp4", [(75, (30, 90, 200))])  # one scene, 3 s
    return tmp_path / "v"


def _bounds(manifest_dir: Path, path: str) -> list[tuple[float, float]]:
    v = read_manifest(manifest_dir).videos
    v = v[v.path == path].sort_values("start_s")
    return list(zip(v.start_s.tolist(), v.end_s.tolist()))


def test_shots_are_cut_at_the_hard_cuts(folder, tmp_path, cli):
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--shots")
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "collection of 5 moments of 2 videos (shots, threshold 27), no captions" in out
    assert "1 videos are one shot each (1 with no shot boundary found, 0 where detection failed)" in out
    got = _bounds(tmp_path / "m", "cuts.mp4")
    assert len(got) == 4 and got[0][0] == 0.0 and got[-1][1] == 8.0
    starts = [a for a, _ in got[1:]]
    np.testing.assert_allclose(starts, CUTS, atol=2 / FPS)  # within two frames of each hard cut
    assert [b for _, b in got[:-1]] == starts  # shots end to end
    assert _bounds(tmp_path / "m", "one/still.mp4") == [(0.0, 3.0)]
    m = read_manifest(tmp_path / "m")
    assert sorted(m.videos.video_id)[0] == f"cuts.mp4#t=0,{starts[0]:g}"
    assert m.meta["moments"] == {"shots": True, "threshold": 27.0, "window_s": None}
    assert m.meta["one_shot"] == [{"path": "one/still.mp4", "reason": "no shot boundary found: the whole file is one shot"}]


def test_each_shot_samples_only_its_own_scene(folder, tmp_path):
    """The cut times are exact: a shot holds exactly its scene's frames, as extraction reads a moment's frames."""
    from tvrpipe.features.decode import decode_video

    build_collection(folder, tmp_path / "m", progress=False, cutting=Cutting(shots=True))
    for (start, end), (length, colour) in zip(_bounds(tmp_path / "m", "cuts.mp4"), SCENES):
        v = decode_video(folder / "cuts.mp4", 80, 64, start, end)  # more than a shot's frames: all of them
        assert int(v.mask.sum()) == length, (start, end)
        typical = np.median(v.frames[v.mask].reshape(int(v.mask.sum()), -1, 3), axis=1)  # (k, 3): the stripe is thin
        assert np.abs(typical - np.array(colour)).max() < 12, (start, end)


def test_a_cap_cuts_long_shots_into_windows(folder, tmp_path, cli):
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--shots", "--window", "2s",
            "--shot-threshold", "30")
    assert r.exit_code == 0, r.output
    assert "(shots, threshold 30, at most 2s)" in " ".join(r.output.split())
    got = _bounds(tmp_path / "m", "cuts.mp4")
    c1, c2, c3 = (a for a, _ in got[1:4])
    # 0-1.6 and 1.6-3.8 (2.2 s: its 0.2 s tail joins it) stay whole, 3.8-5.0 too; 5.0-8.0 is 2 s + 1 s
    assert got == [(0.0, c1), (c1, c2), (c2, c3), (c3, round(c3 + 2, 3)), (round(c3 + 2, 3), 8.0)]
    assert _bounds(tmp_path / "m", "one/still.mp4") == [(0.0, 2.0), (2.0, 3.0)]  # one shot, capped like any


def test_an_update_detects_only_the_changed_and_added_files(folder, tmp_path, monkeypatch):
    from tvrpipe.features.decode import shots

    build_collection(folder, tmp_path / "m", progress=False, cutting=Cutting(shots=True))
    before = read_manifest(tmp_path / "m").videos
    seen = []
    real = shots.detect_cuts
    monkeypatch.setattr(shots, "detect_cuts", lambda p, t: seen.append(Path(p).name) or real(p, t))

    b = build_collection(folder, tmp_path / "m", progress=False)  # the recorded cutting, nothing changed
    assert seen == [] and (b.probed, b.known) == (0, 2)
    assert read_manifest(tmp_path / "m").videos.equals(before)

    _scenes(folder / "one" / "still.mp4", [(30, (30, 90, 200)), (30, (250, 250, 250))])  # now a cut at 1.2 s
    _scenes(folder / "new.mp4", [(50, (250, 250, 250)), (25, (0, 0, 0))])
    build_collection(folder, tmp_path / "m", progress=False)
    assert sorted(seen) == ["new.mp4", "still.mp4"]
    after = read_manifest(tmp_path / "m")
    assert _bounds(tmp_path / "m", "cuts.mp4") == list(zip(
        before[before.path == "cuts.mp4"].sort_values("start_s").start_s, before[before.path == "cuts.mp4"]
        .sort_values("start_s").end_s))
    (a, b1), (b2, e) = _bounds(tmp_path / "m", "one/still.mp4")
    assert (a, e) == (0.0, 2.4) and b1 == b2 and abs(b1 - 1.2) <= 2 / FPS
    assert len(_bounds(tmp_path / "m", "new.mp4")) == 2 and after.meta["one_shot"] == []

    seen.clear()  # another threshold: every file is cut again
    build_collection(folder, tmp_path / "m", progress=False, cutting=Cutting(shots=True, threshold=40))
    assert sorted(seen) == ["cuts.mp4", "new.mp4", "still.mp4"]


def test_a_failed_detection_is_one_shot_and_said(folder, tmp_path, monkeypatch, cli):
    from tvrpipe.features.decode import DecodeFailure, shots

    def fail(path, threshold):
        raise DecodeFailure("unreadable", Path(path), "shot detection failed: RuntimeError: bad frame")

    monkeypatch.setattr(shots, "detect_cuts", fail)
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--shots")
    assert r.exit_code == 0, r.output
    assert "2 videos are one shot each (0 with no shot boundary found, 2 where detection failed)" in " ".join(
        r.output.split())
    assert _bounds(tmp_path / "m", "cuts.mp4") == [(0.0, 8.0)]
    assert read_manifest(tmp_path / "m").meta["one_shot"][0]["reason"].startswith(
        "shot detection failed (shot detection failed: RuntimeError: bad frame)")


@pytest.mark.parametrize("args, message", [
    (["--shots", "--stride", "5s"], "--stride with --shots: shots are cut where the picture changes"),
    (["--shot-threshold", "30"], "--shot-threshold needs --shots"),
    (["--shots", "--shot-threshold", "0"], "--shot-threshold 0: the detector's threshold is a mean change"),
    (["--shots", "--shot-threshold", "300"], "--shot-threshold 300: the detector's threshold"),
    (["--shots", "--window", "whole"], "--shots with --window whole: whole files are not cut"),
    (["--shots", "--window", "-3"], "--window -3: a window must last a positive number of seconds"),
])
def test_bad_shot_options_are_one_line(folder, tmp_path, cli, args, message):
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", *args)
    assert r.exit_code == 1
    assert message in " ".join(r.output.split())
    assert not (tmp_path / "m").exists()


def test_shots_without_videos_are_refused(tmp_path, cli):
    r = cli("manifest", "build", "--dataset", "custom", "--annotations", tmp_path / "a.csv", "--out", tmp_path / "m",
            "--shots")
    assert r.exit_code == 1
    assert "--shots cuts the files of a collection into moments: give it with --videos" in " ".join(r.output.split())


def test_without_scenedetect_the_error_names_the_extra(folder, tmp_path, cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "scenedetect", None)  # import fails as if not installed
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m", "--shots")
    assert r.exit_code == 1
    out = " ".join(r.output.split())
    assert "--shots needs PySceneDetect and OpenCV, not installed here (scenedetect is missing): pip install " \
           "'tvrpipe[shots]'" in out
    assert len(r.output.strip().splitlines()) <= 3 and not (tmp_path / "m").exists()


def test_cutting_of_shots():
    assert cutting_of(None, None, True) == Cutting(shots=True, threshold=27.0)
    assert cutting_of("1m", None, True, 20.0) == Cutting(60.0, None, True, 20.0)
    assert Cutting.recorded({"moments": Cutting(5.0, shots=True).record()}, "meta.json") == Cutting(5.0, shots=True)
    with pytest.raises(ConfigError, match="--shot-threshold needs --shots"):
        Cutting(10.0, threshold=20.0)


def test_a_collection_of_shots_is_extracted_with_each_shots_frames(folder, tmp_path):
    from tvrpipe.features.clip import TINY_MODEL
    from tvrpipe.features.extract import ExtractConfig, extract
    from tvrpipe.features.store import open_store

    build_collection(folder, tmp_path / "m", progress=False, cutting=Cutting(shots=True))
    cfg = ExtractConfig(model=TINY_MODEL, pretrained="none", frames=4, video_shard=2, batch_size=4, decoders=1,
                        progress=False, timeout_s=30.0)
    s = extract(tmp_path / "m", folder, tmp_path / "s", cfg)
    assert (s.videos_done, s.failed) == (5, 0), s.lines()
    store = open_store(tmp_path / "s")
    v = read_manifest(tmp_path / "m").videos.set_index("video_id")
    ids = list(store.videos.video_id)
    assert ids == sorted(v.index)
    stamps = store.array("videos/timestamps")[:]  # (5, 4): every frame inside its shot
    for i, video_id in enumerate(ids):
        start, end = v.loc[video_id, ["start_s", "end_s"]]
        assert ((stamps[i] >= start - 1e-3) & (stamps[i] < end)).all(), (video_id, stamps[i])
