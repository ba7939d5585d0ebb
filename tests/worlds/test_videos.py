"""tvrpipe.worlds.videos: real mp4 files whose pixels and captions agree with the attributes."""

from __future__ import annotations

import re
from pathlib import Path

import decord
import numpy as np
import pandas as pd
import pytest

from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError, VideoError
from tvrpipe.worlds import videos as synth
from tvrpipe.worlds.videos import COLOURS, MOTION_WORDS, SHAPE_WORDS, plan_videos, synthesize

N = 24
FPS = 8
SIZE = 64
FRAMES_PER_SCENE = 16  # 2 s x 8 fps
TABLES = ("manifest/videos.parquet", "manifest/captions.parquet", "manifest/meta.json", "attributes.parquet")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three datasets: seed 0 twice (into different folders) and seed 1."""
    root = tmp_path_factory.mktemp("synth")
    out = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        synthesize(root / name, N, seed=seed, progress=False)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def attrs(runs) -> pd.DataFrame:
    return pd.read_parquet(runs["a"] / "attributes.parquet")


@pytest.fixture(scope="module")
def manifest(runs):
    return read_manifest(runs["a"] / "manifest")


def decode(path: Path) -> np.ndarray:
    vr = decord.VideoReader(str(path), num_threads=1)
    return vr.get_batch(list(range(len(vr)))).asnumpy()


def mentions(text: str, phrase: str) -> bool:
    # Word boundaries: "cross" must not match "across".
    return re.search(rf"\b{re.escape(phrase)}\b", text) is not None


def says_shape(text: str, shape: str) -> bool:
    return any(mentions(text, w) for w in SHAPE_WORDS[shape])


def says_motion(text: str, direction: str) -> bool:
    return any(mentions(text, w) for pair in MOTION_WORDS[direction] for w in pair)


def captions_of(manifest, video_id: str) -> list[str]:
    return manifest.captions.loc[manifest.captions["video_id"] == video_id, "text"].tolist()


# --- tables ----------------------------------------------------------------------------------


def test_counts_ids_paths_and_meta(runs, manifest, attrs):
    v, c = manifest.videos, manifest.captions
    assert sorted(v["video_id"]) == [f"synth_{i:05d}" for i in range(N)]
    assert len(c) == 3 * N
    assert (c.groupby("video_id").size() == 3).all()
    assert (v["path"] == v["video_id"] + ".mp4").all()
    assert all((runs["a"] / "videos" / p).is_file() for p in v["path"])
    assert sorted(p.name for p in (runs["a"] / "videos").iterdir()) == sorted(v["path"])
    assert v["start_s"].isna().all() and v["end_s"].isna().all()
    assert (c["caption_id"] == c["video_id"] + "#" + c.groupby("video_id").cumcount().astype(str)).all()

    meta = manifest.meta
    assert meta["dataset"] == "synthetic" and meta["split_set"] == "synthetic"
    assert meta["frames"] == 12 and meta["max_words"] == 32
    assert (runs["a"] / "manifest" / meta["video_root"]).resolve() == (runs["a"] / "videos").resolve()
    assert meta["synth"]["seed"] == 0 and meta["synth"]["n_videos"] == N
    assert meta["synth"]["split_fractions"] == [0.7, 0.1, 0.2]
    assert meta["tvrpipe_version"]
    # 30 % distractors and 30 % multi-scene videos of 24: round(7.2) each, the rest single.
    kinds = attrs.drop_duplicates("video_id")["kind"].value_counts().to_dict()
    assert kinds == {"distractor": 7, "multi_scene": 7, "single": 10}
    assert meta["synth"]["kinds"] == {"single": 10, "multi_scene": 7, "distractor": 7}
    assert set(attrs["video_id"]) == set(v["video_id"])


def test_captions_are_distinct_short_sentences(manifest):
    for _, texts in manifest.captions.groupby("video_id")["text"]:
        assert len(set(texts)) == len(texts) == 3
        for t in texts:
            assert t.strip() and len(t.split()) <= 32


def test_attribute_frames_tile_each_video(attrs):
    for _, rows in attrs.groupby("video_id"):
        rows = rows.sort_values("scene")
        assert rows["scene"].tolist() == list(range(len(rows)))
        assert rows["start_frame"].tolist() == [FRAMES_PER_SCENE * k for k in range(len(rows))]
        assert (rows["end_frame"] - rows["start_frame"] == FRAMES_PER_SCENE).all()
        assert rows["described"].sum() == 1


# --- videos ----------------------------------------------------------------------------------


def test_palette_colours_look_like_their_names():
    # Written from the colour words, not from the module: which channels dominate.
    looks = {
        "red": lambda r, g, b: r > g + 100 and r > b + 100,
        "green": lambda r, g, b: g > r + 100 and g > b + 100,
        "blue": lambda r, g, b: b > r + 100 and b > g + 100,
        "yellow": lambda r, g, b: min(r, g) > b + 100,
        "purple": lambda r, g, b: min(r, b) > g + 80 and b >= r,
        "white": lambda r, g, b: min(r, g, b) > 200,
    }
    assert set(COLOURS) == set(looks)
    for name, rgb in COLOURS.items():
        assert looks[name](*rgb), name
    names = list(COLOURS)
    gaps = [np.linalg.norm(np.subtract(COLOURS[a], COLOURS[b])) for i, a in enumerate(names) for b in names[i + 1 :]]
    assert min(gaps) > 100  # far apart enough to survive lossy coding


def test_every_video_decodes_with_expected_frames_and_size(runs, manifest, attrs):
    n_scenes = attrs.groupby("video_id").size()
    for vid, path in zip(manifest.videos["video_id"], manifest.videos["path"]):
        vr = decord.VideoReader(str(runs["a"] / "videos" / path), num_threads=1)
        assert len(vr) == n_scenes[vid] * FRAMES_PER_SCENE == synth.video_frame_count(n_scenes[vid], 2.0, FPS)
        assert vr[0].shape == (SIZE, SIZE, 3)
        assert vr.get_avg_fps() == pytest.approx(FPS)


def _foreground(frame: np.ndarray) -> np.ndarray:
    """Pixels far from the (grey, mostly uniform) background."""
    bg = np.median(frame.reshape(-1, 3), axis=0)
    return np.abs(frame.astype(int) - bg).sum(axis=2) > 90


def test_frames_show_the_named_colour_moving_the_named_way(runs, attrs):
    palette = {k: np.array(v, float) for k, v in COLOURS.items()}
    for r in attrs.itertuples():
        frames = decode(runs["a"] / "videos" / f"{r.video_id}.mp4")
        first, last = frames[r.start_frame], frames[r.end_frame - 1]
        centres = []
        for frame in (first, last):
            fg = _foreground(frame)
            assert fg.sum() > 30, f"{r.video_id} scene {r.scene}: no object visible"
            colour = np.median(frame[fg], axis=0)
            nearest = min(palette, key=lambda k: np.linalg.norm(palette[k] - colour))
            assert nearest == r.colour, (r.video_id, r.scene, colour)
            # yuv420p halves the chroma resolution: small pointed shapes lose some saturation.
            assert np.abs(colour - palette[r.colour]).max() < 60, (r.video_id, r.scene, colour)
            ys, xs = np.nonzero(fg)
            centres.append(np.array([xs.mean(), ys.mean()]))
        dx, dy = centres[1] - centres[0]
        along, across = {"left": (-dx, dy), "right": (dx, dy), "up": (-dy, dx), "down": (dy, dx)}[r.direction]
        assert along > 0.3 * SIZE and abs(across) < 3, (r.video_id, r.scene, r.direction, dx, dy)


def test_scenes_change_at_the_scene_boundary(runs, attrs):
    multi = attrs[attrs["kind"] == "multi_scene"]
    assert len(multi)
    for vid, rows in multi.groupby("video_id"):
        frames = decode(runs["a"] / "videos" / f"{vid}.mp4")
        for r in rows.itertuples():
            fg = frames[r.start_frame : r.end_frame]
            colours = [np.median(f[_foreground(f)], axis=0) for f in fg]
            target = np.array(COLOURS[r.colour], float)
            assert all(np.abs(c - target).max() < 60 for c in colours), (vid, r.scene)


# --- difficulty knobs ------------------------------------------------------------------------


def test_multi_scene_captions_describe_exactly_one_scene(manifest, attrs):
    multi = attrs[attrs["kind"] == "multi_scene"]
    assert multi["video_id"].nunique() == 7
    for vid, rows in multi.groupby("video_id"):
        assert len(rows) in (2, 3)
        # Scenes differ pairwise in every attribute, so a caption pins down its scene.
        for col in ("shape", "colour", "direction"):
            assert rows[col].nunique() == len(rows)
        assert rows["described"].sum() == 1
        told = rows[rows["described"]].iloc[0]
        others = rows[~rows["described"]]
        for text in captions_of(manifest, vid):
            assert mentions(text, told["colour"]) and says_shape(text, told["shape"])
            assert says_motion(text, told["direction"])
            assert not any(mentions(text, c) for c in others["colour"])
            assert not any(says_shape(text, s) for s in others["shape"])


def test_distractor_differs_from_its_source_in_exactly_one_attribute(manifest, attrs):
    distractors = attrs[attrs["kind"] == "distractor"]
    assert distractors["video_id"].nunique() == 7
    by_video = {vid: rows.sort_values("scene").reset_index(drop=True) for vid, rows in attrs.groupby("video_id")}
    for vid, rows in distractors.groupby("video_id"):
        rows = by_video[vid]
        source = by_video[rows["group"].iloc[0]]
        assert source["kind"].iloc[0] != "distractor" and source["group"].iloc[0] == source["video_id"].iloc[0]
        assert len(source) == len(rows)
        assert (source["described"] == rows["described"]).all()
        diffs = [
            (k, col)
            for k in range(len(rows))
            for col in ("shape", "colour", "direction")
            if rows.loc[k, col] != source.loc[k, col]
        ]
        assert len(diffs) == 1, (vid, diffs)
        k, col = diffs[0]
        assert rows.loc[k, "described"], "the change must be in the captioned scene"
        own, theirs = rows.loc[k, col], source.loc[k, col]
        says = {"colour": mentions, "shape": says_shape, "direction": says_motion}[col]
        for text in captions_of(manifest, vid):
            assert mentions(text, rows.loc[k, "colour"]) and says_shape(text, rows.loc[k, "shape"])
            assert says(text, own) and not says(text, theirs), (text, col, own, theirs)


def test_distractor_is_a_pixel_near_duplicate_of_its_source(runs, attrs):
    d = attrs[(attrs["kind"] == "distractor") & (attrs["scene"] == 0)].iloc[0]
    a = decode(runs["a"] / "videos" / f"{d.video_id}.mp4").astype(int)
    b = decode(runs["a"] / "videos" / f"{d.group}.mp4").astype(int)
    assert a.shape == b.shape
    # Same background texture: outside both objects the frames agree up to coding noise.
    both_bg = ~(_foreground(a[0].astype(np.uint8)) | _foreground(b[0].astype(np.uint8)))
    assert np.abs(a[0] - b[0])[both_bg].mean() < 3


def test_groups_stay_in_one_split(manifest, attrs):
    split = manifest.videos.set_index("video_id")["split"]
    groups = attrs.drop_duplicates("video_id").assign(split=lambda t: t["video_id"].map(split))
    assert (groups.groupby("group")["split"].nunique() == 1).all()
    # Captions follow their video.
    assert (manifest.captions["split"] == manifest.captions["video_id"].map(split)).all()


def test_split_sizes_follow_the_fractions_and_groups_stay_whole():
    plans = plan_videos(400, 3, SIZE, 2, 0.3, 0.5, (0.6, 0.2, 0.2))
    counts = pd.Series([p.split for p in plans]).value_counts()
    assert abs(counts["train"] - 240) <= 12 and abs(counts["val"] - 80) <= 12
    groups = pd.DataFrame({"group": [p.group for p in plans], "split": [p.split for p in plans]})
    assert (groups.groupby("group")["split"].nunique() == 1).all()
    assert sum(p.kind == "distractor" for p in plans) == 200
    only_train = plan_videos(30, 0, SIZE, 1, 0.3, 0.3, (1.0, 0.0, 0.0))
    assert {p.split for p in only_train} == {"train"}


def test_distractors_capped_when_every_video_asks_to_be_one():
    plans = plan_videos(14, 0, SIZE, 1, 0.0, 1.0, (0.7, 0.1, 0.2))
    kinds = pd.Series([p.kind for p in plans]).value_counts()
    assert kinds["distractor"] == 12 and kinds["single"] == 2  # 12 one-attribute variants each
    for g in {p.group for p in plans}:
        drawn = [(p.scenes[0].shape, p.scenes[0].colour, p.scenes[0].direction) for p in plans if p.group == g]
        assert len(set(drawn)) == len(drawn)


# --- determinism -----------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_and_frames(runs):
    for name in TABLES:
        assert (runs["a"] / name).read_bytes() == (runs["b"] / name).read_bytes(), name
    for p in sorted((runs["a"] / "videos").glob("*.mp4")):
        assert np.array_equal(decode(p), decode(runs["b"] / "videos" / p.name)), p.name
        assert p.read_bytes() == (runs["b"] / "videos" / p.name).read_bytes(), p.name


def test_different_seed_gives_different_data(runs):
    ca = read_manifest(runs["a"] / "manifest").captions
    cc = read_manifest(runs["c"] / "manifest").captions
    assert ca["text"].tolist() != cc["text"].tolist()
    assert not np.array_equal(decode(runs["a"] / "videos" / "synth_00000.mp4"),
                              decode(runs["c"] / "videos" / "synth_00000.mp4"))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_datasets(tmp_path, n):
    m = synthesize(tmp_path, n, seed=5, progress=False)
    assert len(m.videos) == n and len(m.captions) == 3 * n
    assert read_manifest(tmp_path / "manifest").videos["video_id"].tolist() == m.videos["video_id"].tolist()


def test_options_change_frames_size_and_caption_count(tmp_path):
    m = synthesize(tmp_path, 3, seed=0, size=32, fps=4, scene_seconds=1.5, captions_per_video=5,
                   multi_scene_fraction=1.0, distractor_fraction=0.0, progress=False)
    assert len(m.captions) == 15
    attrs = pd.read_parquet(tmp_path / "attributes.parquet")
    for vid in m.videos["video_id"]:
        frames = decode(tmp_path / "videos" / f"{vid}.mp4")
        assert frames.shape == ((attrs["video_id"] == vid).sum() * 6, 32, 32, 3)


def test_smallest_readable_size(tmp_path):
    m = synthesize(tmp_path, 1, seed=0, size=18, progress=False)
    assert decode(tmp_path / "videos" / m.videos["path"][0]).shape == (16, 18, 18, 3)


def test_a_size_decord_misreads_fails_before_any_manifest(tmp_path, monkeypatch):
    # Without the up-front check, reading the first video back catches it.
    monkeypatch.setattr(synth, "DECORD_BAD_SIZES", frozenset())
    with pytest.raises(VideoError, match="--size"):
        synthesize(tmp_path, 2, seed=0, size=48, progress=False)
    assert not (tmp_path / "manifest").exists()


# --- arguments and failures ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"n_videos": 0}, "--videos"),
        ({"seed": -1}, "--seed"),
        ({"size": 15}, "--size"),
        ({"size": 8}, "--size"),
        ({"size": 63}, "--size"),
        ({"size": 48}, "--size"),  # decord misreads it
        ({"fps": 0}, "--fps"),
        ({"scene_seconds": 0.0}, "--scene-seconds"),
        ({"scene_seconds": 1.3}, "--scene-seconds"),  # 10.4 frames
        ({"captions_per_video": 0}, "--captions-per-video"),
        ({"captions_per_video": 10_000}, "--captions-per-video"),
        ({"multi_scene_fraction": 1.5}, "--multi-scene-fraction"),
        ({"distractor_fraction": -0.1}, "--distractor-fraction"),
        ({"distractor_fraction": float("nan")}, "--distractor-fraction"),
        ({"split_fractions": (0.5, 0.5, 0.5)}, "--split-fractions"),
        ({"split_fractions": (1.2, -0.2, 0.0)}, "--split-fractions"),
        ({"split_fractions": (0.5, 0.5)}, "--split-fractions"),
    ],
)
def test_bad_arguments_raise_config_error_naming_the_option(tmp_path, kwargs, option):
    args = {"n_videos": 4, **kwargs}
    with pytest.raises(ConfigError, match=re.escape(option)) as e:
        synthesize(tmp_path / "out", args.pop("n_videos"), progress=False, **args)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_failure_leaves_no_manifest(tmp_path, monkeypatch):
    synthesize(tmp_path, 4, seed=0, progress=False)
    assert (tmp_path / "manifest" / "videos.parquet").is_file()
    calls = []

    def broken(path, frames, fps):
        calls.append(path)
        if len(calls) == 3:
            raise VideoError(f"cannot write {path}: disk full")
        real(path, frames, fps)

    real = synth.write_mp4
    monkeypatch.setattr(synth, "write_mp4", broken)
    with pytest.raises(VideoError):
        synthesize(tmp_path, 6, seed=1, progress=False)
    assert not any((tmp_path / "manifest").iterdir())
    assert not list(tmp_path.rglob(".*tmp*"))


def test_rerun_replaces_an_earlier_synthetic_dataset(tmp_path):
    synthesize(tmp_path, 6, seed=0, progress=False)
    m = synthesize(tmp_path, 3, seed=0, progress=False)
    assert sorted(p.stem for p in (tmp_path / "videos").glob("*.mp4")) == sorted(m.videos["video_id"])
    assert len(pd.read_parquet(tmp_path / "attributes.parquet").drop_duplicates("video_id")) == 3


def test_refuses_to_overwrite_another_datasets_manifest(tmp_path):
    (tmp_path / "manifest").mkdir()
    (tmp_path / "manifest" / "meta.json").write_text('{"dataset": "msrvtt"}')
    (tmp_path / "manifest" / "videos.parquet").write_bytes(b"x")
    with pytest.raises(ConfigError, match="--out"):
        synthesize(tmp_path, 2, progress=False)
    assert (tmp_path / "manifest" / "videos.parquet").read_bytes() == b"x"


def test_caption_templates_give_a_style_and_default_to_all():
    markers = ("on a grey background", "we see", "a video of", "in this clip", "across a dark background")
    # each descriptive template has a phrase of its own, and no short one has any
    assert [sum(m in synth.TEMPLATES[i] for m in markers) for i in synth.DESCRIPTIVE_TEMPLATES] == [1] * 5
    assert not any(m in synth.TEMPLATES[i] for m in markers for i in synth.SHORT_TEMPLATES)
    assert sorted(synth.SHORT_TEMPLATES + synth.DESCRIPTIVE_TEMPLATES) == list(range(len(synth.TEMPLATES)))
    args = (60, 2, SIZE, 4, 0.3, 0.3, (0.7, 0.1, 0.2))
    short = [c for p in plan_videos(*args, synth.SHORT_TEMPLATES) for c in p.captions]
    descriptive = [c for p in plan_videos(*args, synth.DESCRIPTIVE_TEMPLATES) for c in p.captions]
    assert not any(m in c for c in short for m in markers)
    assert all(any(m in c for m in markers) for c in descriptive)
    # the same videos either way (only the captions' wording differs), and no subset is the old default
    assert [p.scenes for p in plan_videos(*args, synth.SHORT_TEMPLATES)] == [p.scenes for p in plan_videos(*args)]
    assert synth.ALL_TEMPLATES == tuple(range(len(synth.TEMPLATES)))
    assert plan_videos(*args) == plan_videos(*args, synth.ALL_TEMPLATES)


def test_caption_templates_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"caption_templates must be distinct indices of the 8 caption templates "
                                          r"\(0 to 7\), got \[1, 1\]"):
        synthesize(tmp_path / "s", 4, caption_templates=[1, 1], progress=False)
    with pytest.raises(ConfigError, match=r"got \[8\]"):
        synthesize(tmp_path / "s", 4, caption_templates=[8], progress=False)
    # 3 templates x 3 shape words x 5 motion phrases: 45 distinct captions a scene
    with pytest.raises(ConfigError, match="--captions-per-video must be between 1 and 45, got 46"):
        synthesize(tmp_path / "s", 4, captions_per_video=46, caption_templates=synth.SHORT_TEMPLATES, progress=False)
    assert not (tmp_path / "s").exists()
    # numpy indices are indices too, and meta.json records plain integers
    m = synthesize(tmp_path / "s", 4, caption_templates=np.array(synth.SHORT_TEMPLATES), progress=False)
    assert m.meta["synth"]["caption_templates"] == [0, 1, 3]
