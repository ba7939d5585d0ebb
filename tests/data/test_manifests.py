"""Manifests built from the real annotation files: standard split counts, formats, bad input.

Files too big to ship (MSRVTT_data.json, the LSMDC training csv, the VATEX JSONs, DiDeMo's
train_data.json) are written here in their documented formats, covering every video the real
split lists name, so the counts asserted are the ones the standard splits give.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tvrpipe.data.datasets import build_manifest, list_datasets, load_spec
from tvrpipe.data.manifest import (
    CAPTION_COLUMNS,
    VIDEO_COLUMNS,
    make_tables,
    read_manifest,
    write_manifest,
)
from tvrpipe.errors import ConfigError, ManifestError


def _counts(m) -> dict[str, tuple[int, int]]:
    return {r.split: (r.videos, r.captions) for r in m.counts().itertuples()}


def _write_msrvtt_json(path: Path, n_videos: int = 10_000, per_video: int = 20) -> None:
    """MSRVTT_data.json in the documented format: 20 sentences per video, global sen_id."""
    videos = [{"video_id": f"video{i}", "split": "train" if i < 6513 else "test"} for i in range(n_videos)]
    sentences = [
        {"video_id": f"video{i}", "caption": f"clip {i} sentence {k}", "sen_id": i * per_video + k}
        for i in range(n_videos)
        for k in range(per_video)
    ]
    path.write_text(json.dumps({"info": {}, "videos": videos, "sentences": sentences}))


@pytest.fixture(scope="module")
def msrvtt_ann(tmp_path_factory, shared_annotations) -> Path:
    d = tmp_path_factory.mktemp("msrvtt")
    for f in (shared_annotations / "msrvtt").glob("*.csv"):
        shutil.copy(f, d / f.name)
    _write_msrvtt_json(d / "MSRVTT_data.json")
    return d


# ------------------------------------------------------------------------- standard counts


@pytest.mark.parametrize(
    "split_set, expected",
    [
        ("9k", {"train": (9000, 180_000), "test": (1000, 1000)}),
        ("7k", {"train": (7010, 140_200), "test": (1000, 1000)}),
        ("full", {"train": (6513, 130_260), "val": (497, 9940), "test": (2990, 59_800)}),
    ],
)
def test_msrvtt_split_sets(msrvtt_ann, tmp_path, split_set, expected):
    m = build_manifest("msrvtt", msrvtt_ann, tmp_path / "m", split_set)
    assert _counts(m) == expected
    assert m.meta["frames"] == 12 and m.meta["max_words"] == 32


def test_msrvtt_1ka_test_uses_the_jsfusion_sentence(msrvtt_ann, tmp_path):
    m = build_manifest("msrvtt", msrvtt_ann, tmp_path / "m", "9k")
    test = m.captions[m.captions.split == "test"].set_index("video_id")
    # MSRVTT_JSFUSION_test.csv row "ret0,msr9770,video9770,a person is connecting something to system"
    assert test.loc["video9770", "text"] == "a person is connecting something to system"
    assert test.loc["video9770", "caption_id"] == "video9770#0"
    train = m.captions[m.captions.video_id == "video0"]
    assert list(train.text) == [f"clip 0 sentence {k}" for k in range(20)]  # sen_id order
    assert m.videos.set_index("video_id").loc["video0", "path"] == "video0.mp4"


def test_manifest_has_exactly_the_design_columns(msrvtt_ann, tmp_path):
    build_manifest("msrvtt", msrvtt_ann, tmp_path / "m", "9k")
    v = pd.read_parquet(tmp_path / "m" / "videos.parquet")
    c = pd.read_parquet(tmp_path / "m" / "captions.parquet")
    assert tuple(v.columns) == VIDEO_COLUMNS
    assert tuple(c.columns) == CAPTION_COLUMNS
    assert v.start_s.isna().all() and v.end_s.isna().all()
    # a caption's split equals its video's split
    assert (c.split.to_numpy() == v.set_index("video_id").split.loc[c.video_id].to_numpy()).all()


def test_msvd_standard_split(shared_annotations, tmp_path):
    m = build_manifest("msvd", shared_annotations / "msvd", tmp_path / "m")
    assert _counts(m) == {"train": (1200, 48_774), "val": (100, 4290), "test": (670, 27_763)}
    assert m.videos.set_index("video_id").loc["-4wsuPCjDBc_5_15", "path"] == "-4wsuPCjDBc_5_15.avi"


def _write_didemo_train(path: Path) -> None:
    # Same list-of-moments format as the shipped val/test files; one video listed twice with
    # different extensions (as in the real files) and moments given out of time order.
    moments = [
        {"video": "v1@N00_1_a.mov", "description": "then he sits.", "times": [[2, 2], [2, 3]], "annotation_id": 7},
        {"video": "v1@N00_1_a.mp4", "description": "a man walks in.", "times": [[0, 0], [0, 1]], "annotation_id": 9},
        {"video": "v2@N00_2_b.avi", "description": "a dog runs.", "times": [[1, 1]], "annotation_id": 3},
    ]
    for m in moments:
        m.update(num_segments=6, dl_link="")
    path.write_text(json.dumps(moments))


def test_didemo_paragraphs_and_extension_insensitive_ids(ann_copy, tmp_path):
    ann = ann_copy("didemo")
    _write_didemo_train(ann / "train_data.json")
    m = build_manifest("didemo", ann, tmp_path / "m")
    assert _counts(m) == {"train": (2, 2), "val": (1065, 1065), "test": (1004, 1004)}
    assert m.meta["frames"] == 64 and m.meta["max_words"] == 64
    tr = m.captions[m.captions.split == "train"].set_index("video_id")
    assert tr.loc["v1@N00_1_a", "text"] == "a man walks in. then he sits."  # time order, one paragraph
    assert m.videos.set_index("video_id").loc["v1@N00_1_a", "path"] == "v1@N00_1_a.mov"


def test_didemo_test_paragraph_from_real_file(shared_annotations, tmp_path):
    ann = tmp_path / "d"
    ann.mkdir()
    shutil.copy(shared_annotations / "didemo" / "test_data.json", ann / "test_data.json")
    shutil.copy(shared_annotations / "didemo" / "val_data.json", ann / "val_data.json")
    _write_didemo_train(ann / "train_data.json")
    m = build_manifest("didemo", ann, tmp_path / "m")
    moments = json.loads((ann / "test_data.json").read_text())
    vid = "26292851@N04_4253489686_265c3c8051"
    mine = [x for x in moments if x["video"].rsplit(".", 1)[0] == vid]
    para = m.captions.set_index("video_id").loc[vid, "text"]
    assert all(" ".join(x["description"].split()) in para for x in mine)
    assert len(para) >= sum(len(x["description"].strip()) for x in mine)


def test_lsmdc_standard_split(ann_copy, tmp_path):
    ann = ann_copy("lsmdc")
    rows = [
        "1001_Movie_A_00.00.01.000-00.00.02.000\t00.00.01.000\t00.00.02.000\t00.00.01.000\t00.00.02.000\tSOMEONE opens a door.",
        "1001_Movie_A_00.00.03.000-00.00.05.000\t00.00.03.000\t00.00.05.000\t00.00.03.000\t00.00.05.000\tHe leaves.",
    ]
    (ann / "LSMDC16_annos_training.csv").write_text("\n".join(rows) + "\n")
    m = build_manifest("lsmdc", ann, tmp_path / "m")
    assert _counts(m) == {"train": (2, 2), "val": (7408, 7408), "test": (1000, 1000)}
    v = m.videos.set_index("video_id")
    assert v.loc["1001_Movie_A_00.00.01.000-00.00.02.000", "path"] == (
        "1001_Movie_A/1001_Movie_A_00.00.01.000-00.00.02.000.avi"
    )
    c = m.captions.set_index("video_id")
    assert c.loc["3086_UGLY_TRUTH_00.23.23.000-00.23.28.886", "text"] == "SOMEONE stands below, hands on her hips."


def test_vatex_hgr_split(ann_copy, tmp_path):
    ann = ann_copy("vatex")

    def ids(name):
        return [x.strip() for x in (ann / name).read_text().split() if x.strip()]

    def write(name, vids):
        items = [{"videoID": v, "enCap": [f"{v} caption {k}" for k in range(10)], "chCap": []} for v in vids]
        (ann / name).write_text(json.dumps(items))

    write("vatex_training_v1.0.json", ids("train_list.txt"))
    write("vatex_validation_v1.0.json", ids("val_list.txt") + ids("test_list.txt"))
    m = build_manifest("vatex", ann, tmp_path / "m")
    assert _counts(m) == {"train": (25_991, 259_910), "val": (1500, 15_000), "test": (1500, 15_000)}


def test_charades_one_description_per_video(shared_annotations, tmp_path):
    m = build_manifest("charades", shared_annotations / "charades", tmp_path / "m")
    assert _counts(m) == {"train": (7985, 7985), "test": (1863, 1863)}
    text = m.captions.set_index("video_id").loc["YSKX3", "text"]
    assert text == "A person looks under a mattress and pats the bed. This person picks up a pillow, and throws it on the bed."


def test_custom_table_csv_and_parquet(tmp_path):
    rows = pd.DataFrame(
        {
            "path": ["a/x.mp4", "a/x.mp4", "b/y.webm", "z.mp4"],
            "caption": ["a cat", "a small cat", "a dog", "a bird"],
            "split": ["train", "train", "test", "val"],
        }
    )
    rows.to_csv(tmp_path / "t.csv", index=False)
    rows.to_parquet(tmp_path / "t.parquet")
    a = build_manifest("custom", tmp_path / "t.csv", tmp_path / "m1")
    b = build_manifest("custom", tmp_path / "t.parquet", tmp_path / "m2")
    assert _counts(a) == _counts(b) == {"train": (1, 2), "val": (1, 1), "test": (1, 1)}
    assert list(a.videos.video_id) == ["a/x", "z", "b/y"]  # train, val, test order
    assert list(a.captions.caption_id[:2]) == ["a/x#0", "a/x#1"]


def test_custom_clip_columns(tmp_path):
    pd.DataFrame(
        {"path": ["m.mp4", "m.mp4"], "video_id": ["m_0", "m_1"], "caption": ["one", "two"],
         "split": ["train", "test"], "start_s": [0.0, 5.0], "end_s": [5.0, 9.5]}
    ).to_csv(tmp_path / "t.csv", index=False)
    m = build_manifest("custom", tmp_path / "t.csv", tmp_path / "m")
    v = m.videos.set_index("video_id")
    assert (v.loc["m_1", "start_s"], v.loc["m_1", "end_s"]) == (5.0, 9.5)


def test_every_spec_loads_and_has_defaults():
    names = list_datasets()
    assert {"msrvtt", "msvd", "didemo", "lsmdc", "vatex", "charades", "custom", "synthetic"} <= set(names)
    for name in names:
        spec = load_spec(name)
        assert spec.frames > 0 and spec.max_words > 0
    assert (load_spec("didemo").frames, load_spec("didemo").max_words) == (64, 64)
    assert (load_spec("msrvtt").frames, load_spec("msrvtt").max_words) == (12, 32)


def test_a_key_given_twice_in_a_spec_is_refused_naming_its_line(tmp_path, monkeypatch, cli):
    """yaml.safe_load keeps the last of two keys silently: msrvtt read with 16 frames where its spec says 12."""
    from tvrpipe.data import datasets

    original = (datasets.specs_dir() / "msrvtt.yaml").read_text()
    assert "\nmax_words: 32 " in original
    text = original.replace("\nmax_words: 32 ", "\nframes: 16\nmax_words: 32 ", 1)
    (tmp_path / "msrvtt.yaml").write_text(text)
    monkeypatch.setattr(datasets, "specs_dir", lambda: tmp_path)
    line = text.splitlines().index("frames: 16") + 1
    want = f"{tmp_path / 'msrvtt.yaml'} line {line}: key 'frames' is given twice; keep one"
    with pytest.raises(ConfigError) as e:
        load_spec("msrvtt")
    assert str(e.value) == want
    result = cli("extract", "--dataset", "msrvtt", "--data-root", tmp_path / "data")
    assert result.exit_code == 1 and " ".join(result.output.split()) == f"error: {want}"


def test_load_yaml_refuses_a_nested_key_given_twice_and_keeps_merge_overrides():
    from tvrpipe.config import load_yaml

    with pytest.raises(ConfigError, match=r"^spec.yaml line 4: key 'reader' is given twice; keep one$"):
        load_yaml("split_sets:\n  9k:\n    - reader: a\n      reader: b\n", "spec.yaml")
    # a key a << merge brings in may be overridden (YAML's own rule), and the same key in two mappings is no repeat
    assert load_yaml("base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  x: 3\ne: {x: 4}\n", "f.yaml") == {
        "base": {"x": 1, "y": 2}, "d": {"x": 3, "y": 2}, "e": {"x": 4}}


# ---------------------------------------------------------------------------- determinism


def test_same_input_same_bytes(shared_annotations, tmp_path):
    build_manifest("msvd", shared_annotations / "msvd", tmp_path / "a")
    build_manifest("msvd", shared_annotations / "msvd", tmp_path / "b")
    for f in ("videos.parquet", "captions.parquet", "meta.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    back = read_manifest(tmp_path / "a")
    assert _counts(back)["test"] == (670, 27_763)


# ------------------------------------------------------------------------------ bad input


def test_unknown_dataset():
    with pytest.raises(ConfigError, match=r"unknown dataset 'nope'; known: charades, custom"):
        build_manifest("nope", ".", "out")


def test_unknown_split_set(msrvtt_ann, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown split set '8k'; choose one of 9k, 7k, full"):
        build_manifest("msrvtt", msrvtt_ann, tmp_path / "m", "8k")


def test_missing_annotation_file_names_it(shared_annotations, tmp_path):
    out = tmp_path / "m"
    with pytest.raises(ManifestError, match=r"annotation file not found: .*MSRVTT_data\.json"):
        build_manifest("msrvtt", shared_annotations / "msrvtt", out, "9k")
    assert not out.exists() or not any(out.iterdir())


def test_malformed_row_names_file_and_line(ann_copy, tmp_path):
    ann = ann_copy("lsmdc")
    (ann / "LSMDC16_annos_training.csv").write_text(
        "c_00.00.01.000-00.00.02.000\t1\t2\t1\t2\tfine\nc_00.00.03.000-00.00.04.000\t3\t4\tmissing columns\n"
    )
    with pytest.raises(ManifestError, match=r"LSMDC16_annos_training\.csv line 2: expected 6 tab-separated columns, got 4"):
        build_manifest("lsmdc", ann, tmp_path / "m")


def test_malformed_json(ann_copy, tmp_path):
    ann = ann_copy("msvd")
    (ann / "captions_msvd.json").write_text('{"a": ["x"],')
    with pytest.raises(ManifestError, match=r"captions_msvd\.json: not valid JSON \(line 1"):
        build_manifest("msvd", ann, tmp_path / "m")


def test_empty_caption_names_row(tmp_path):
    (tmp_path / "t.csv").write_text("path,caption,split\na.mp4,a cat,train\nb.mp4,   ,test\n")
    with pytest.raises(ManifestError, match=r"t\.csv line 3: empty caption"):
        build_manifest("custom", tmp_path / "t.csv", tmp_path / "m")


def test_empty_caption_in_json(ann_copy, tmp_path):
    ann = ann_copy("msvd")
    data = json.loads((ann / "captions_msvd.json").read_text())
    data["-4wsuPCjDBc_5_15"][3] = "  "
    (ann / "captions_msvd.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"empty caption for video '-4wsuPCjDBc_5_15'"):
        build_manifest("msvd", ann, tmp_path / "m")


def test_duplicate_id_in_list(ann_copy, tmp_path):
    ann = ann_copy("msvd")
    lines = (ann / "val_list.txt").read_text().splitlines()
    (ann / "val_list.txt").write_text("\n".join(lines + [lines[0]]) + "\n")
    with pytest.raises(ManifestError, match=rf"val_list\.txt: duplicate video id\(s\) \['{lines[0]}'\]"):
        build_manifest("msvd", ann, tmp_path / "m")


def test_video_in_two_splits_is_a_duplicate(ann_copy, tmp_path):
    ann = ann_copy("msvd")
    first_train = (ann / "train_list.txt").read_text().split()[0]
    with open(ann / "test_list.txt", "a") as f:
        f.write(first_train + "\n")
    with pytest.raises(ManifestError, match=rf"duplicate video_id '{first_train}'"):
        build_manifest("msvd", ann, tmp_path / "m")


def test_list_video_without_captions(ann_copy, tmp_path):
    ann = ann_copy("msvd")
    with open(ann / "test_list.txt", "a") as f:
        f.write("not_a_real_video_1_2\n")
    with pytest.raises(ManifestError, match=r"no captions for 1 video\(s\) listed in test_list\.txt, e\.g\. \['not_a_real_video_1_2'\]"):
        build_manifest("msvd", ann, tmp_path / "m")


def test_failed_build_keeps_the_previous_manifest(ann_copy, tmp_path):
    ann = ann_copy("msvd")
    out = tmp_path / "m"
    build_manifest("msvd", ann, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (ann / "captions_msvd.json").write_text("[")
    with pytest.raises(ManifestError):
        build_manifest("msvd", ann, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_validation_names_rows():
    v, c = make_tables(
        [{"video_id": "a", "path": "a.mp4", "split": "train"}, {"video_id": "b", "path": "b.mp4", "split": "test"}],
        [{"caption_id": "a#0", "video_id": "a", "text": "x", "split": "train"},
         {"caption_id": "b#0", "video_id": "b", "text": "y", "split": "train"}],
    )
    with pytest.raises(ManifestError, match=r"caption 'b#0' is in split 'train' but its video 'b' is in 'test'"):
        write_manifest("unused", v, c)
    c.loc[1, "split"] = "test"
    c.loc[1, "video_id"] = "zz"
    with pytest.raises(ManifestError, match=r"caption\(s\) 'b#0' name unknown video_id 'zz'"):
        write_manifest("unused", v, c)
    c.loc[1, "video_id"] = "b"
    v.loc[1, "path"] = "b\x00.mp4"  # opening it raised ValueError in extract, which stopped the run
    with pytest.raises(ManifestError, match=r"a NUL character in the path of video\(s\) 'b'"):
        write_manifest("unused", v, c)


# ------------------------------------------------------------------------------ video root


def test_video_root_resolves_extensions_and_reports_missing(ann_copy, tmp_path):
    ann = ann_copy("didemo")
    _write_didemo_train(ann / "train_data.json")
    for f in ("val_data.json", "test_data.json"):  # keep only the small train split to check
        (ann / f).write_text("[]")
    root = tmp_path / "videos"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "v1@N00_1_a.mp4").write_bytes(b"x")  # listed as .mov and .mp4
    with pytest.raises(ManifestError, match=r"1 of 2 videos not found under .*videos: 'v2@N00_2_b'; .*--allow-missing"):
        build_manifest("didemo", ann, tmp_path / "m", video_root=root)
    assert not (tmp_path / "m" / "videos.parquet").exists()
    m = build_manifest("didemo", ann, tmp_path / "m", video_root=root, allow_missing=True)
    assert list(m.videos.path) == ["sub/v1@N00_1_a.mp4"]
    assert list(m.captions.video_id) == ["v1@N00_1_a"]
    assert m.meta["missing_videos"] == ["v2@N00_2_b"]
    # DiDeMo's AWS download script saves <JSON name>.mp4, i.e. a doubled extension
    (root / "v2@N00_2_b.m4v.mp4").write_bytes(b"x")
    m = build_manifest("didemo", ann, tmp_path / "m2", video_root=root)
    assert list(m.videos.path) == ["sub/v1@N00_1_a.mp4", "v2@N00_2_b.m4v.mp4"]


@pytest.mark.parametrize("text, said", [
    ("[]", "it holds a list, not a JSON object"),
    ("5", "it holds a number, not a JSON object"),
    ('"msrvtt"', "it holds a string, not a JSON object"),
    ('{"dataset": ', "not valid JSON"),
    ('{"dataset": "x", "frames": "twelve"}', 'frames is "twelve", not a whole number of frames'),
    ('{"dataset": "x", "max_words": -4}', "max_words is -4, not a whole number of tokens"),
    ('{"dataset": "x", "kind": "zzz"}', 'kind is "zzz", not "collection"'),
    ('{"dataset": "x", "video_root": 5}', "video_root is 5, not a folder's path or null"),
    ('{"dataset": "x", "skipped": "abc"}', 'skipped is "abc", not a list'),
])
def test_a_damaged_meta_json_is_an_error_naming_it(tmp_path, text, said):
    v, c = make_tables([{"video_id": "v0", "path": "v0.mp4", "split": "test"}],
                       [{"caption_id": "v0#0", "video_id": "v0", "text": "a dog", "split": "test"}])
    write_manifest(tmp_path / "m", v, c, {"dataset": "x"})
    (tmp_path / "m" / "meta.json").write_text(text)
    with pytest.raises(ManifestError, match=f"{tmp_path / 'm' / 'meta.json'}: {said}"):
        read_manifest(tmp_path / "m")


def test_a_null_or_invisible_caption_text_is_named_as_empty():
    """A caption whose text is missing (null in the table) or shows nothing is named, as a ManifestError, never a
    TypeError from reading the null as text."""
    from tvrpipe.data.manifest import validate

    videos = pd.DataFrame({"video_id": ["a", "b"], "path": ["a.mp4", "b.mp4"], "split": ["train", "train"],
                           "start_s": [None, None], "end_s": [None, None]})
    for text in (None, float("nan"), "\u200b \t"):
        captions = pd.DataFrame({"caption_id": ["a#0", "b#0"], "video_id": ["a", "b"], "text": ["a dog", text],
                                 "split": ["train", "train"]})
        with pytest.raises(ManifestError, match=r"m\.csv: empty text in caption\(s\) .*b#0"):
            validate(videos, captions, "m.csv")
