"""The data root: `tvrpipe extract --dataset NAME` finds a dataset laid out as docs/datasets.md says,
builds (or reuses) its manifest there and writes its store to the default features folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from tvrpipe.worlds.videos import synthesize

    root = tmp_path_factory.mktemp("layout-videos")
    synthesize(root, 12, seed=0, progress=False)
    return root


def _msrvtt_root(root: Path, synth: Path) -> Path:
    """A data root laid out as docs/datasets.md says for MSR-VTT: CLIP4Clip's msrvtt_data/ (a 9k list of
    6 videos, a 1k-A list of 3) and Frozen-in-Time's MSRVTT/videos/all/ (generated videos under MSR-VTT ids)."""
    ann = root / "msrvtt" / "msrvtt_data"
    videos = root / "msrvtt" / "MSRVTT" / "videos" / "all"
    ann.mkdir(parents=True)
    videos.mkdir(parents=True)
    ids = [f"video{i}" for i in range(9)]
    (ann / "MSRVTT_train.9k.csv").write_text("video_id\n" + "\n".join(ids[:6]) + "\n")
    (ann / "MSRVTT_JSFUSION_test.csv").write_text("key,vid_key,video_id,sentence\n" + "".join(
        f"ret{i},msr{i},{v},test sentence {i}\n" for i, v in enumerate(ids[6:])))
    (ann / "MSRVTT_data.json").write_text(json.dumps({"videos": [{"video_id": v} for v in ids], "sentences": [
        {"video_id": v, "caption": f"caption {k} of {v}", "sen_id": 2 * i + k} for i, v in enumerate(ids) for k in range(2)]}))
    sources = sorted((synth / "videos").rglob("*.mp4"))
    for v, src in zip(ids, sources):
        shutil.copy(src, videos / f"{v}.mp4")
    return root


def test_prepare_dataset_builds_then_reuses_the_manifest(synth, tmp_path):
    from tvrpipe.data.layout import prepare_dataset

    root = _msrvtt_root(tmp_path / "data", synth)
    lay = prepare_dataset("msrvtt", root)
    assert lay.manifest == root / "msrvtt" / "manifest" and lay.videos == root / "msrvtt" / "MSRVTT" / "videos" / "all"
    meta = json.loads((lay.manifest / "meta.json").read_text())
    assert (meta["dataset"], meta["split_set"]) == ("msrvtt", "9k")
    stamp = (lay.manifest / "videos.parquet").stat().st_mtime_ns
    prepare_dataset("msrvtt", root)  # unchanged annotations: reused
    assert (lay.manifest / "videos.parquet").stat().st_mtime_ns == stamp
    train = lay.annotations / "MSRVTT_train.9k.csv"
    train.write_text(train.read_text().replace("video5\n", ""))  # an edited annotation file: rebuilt
    prepare_dataset("msrvtt", root)
    assert len(pd.read_parquet(lay.manifest / "videos.parquet")) == 8


def test_a_generated_dataset_is_made_by_the_generator_it_is_given(tmp_path):
    from tvrpipe.data.layout import prepare_dataset
    from tvrpipe.errors import ConfigError

    root = tmp_path / "data"
    with pytest.raises(ConfigError, match=r"synthetic: the generated dataset is not in .*synthetic yet: make it with "
                                          r"`tvrpipe synth --out .*synthetic`"):
        prepare_dataset("synthetic", root)
    calls = []

    def generate(folder, progress):
        calls.append((folder, progress))
        (folder / "manifest").mkdir(parents=True)
        (folder / "manifest" / "videos.parquet").write_bytes(b"")

    lay = prepare_dataset("synthetic", root, progress=False, generate=generate)
    assert calls == [(root / "synthetic", False)] and lay.manifest == root / "synthetic" / "manifest"
    prepare_dataset("synthetic", root, generate=generate)  # made once: not made again
    assert len(calls) == 1


def test_a_missing_layout_is_one_line_naming_the_folder_and_what_to_pass(tmp_path, monkeypatch, cli):
    monkeypatch.chdir(tmp_path)
    result = cli("extract", "--dataset", "msrvtt", "--model", "tvrpipe-tiny", "--pretrained", "none")
    text = " ".join(result.output.split())
    assert result.exit_code == 1
    assert "annotation folder data/msrvtt/msrvtt_data not found" in text and "--data-root" in text
    (tmp_path / "elsewhere" / "msrvtt" / "msrvtt_data").mkdir(parents=True)
    monkeypatch.setenv("TVRPIPE_DATA", str(tmp_path / "elsewhere"))
    result = cli("extract", "--dataset", "msrvtt")
    assert result.exit_code == 1 and "video folder" in result.output and "MSRVTT/videos/all" in result.output
    result = cli("extract", "--dataset", "custom")
    assert result.exit_code == 1 and "no fixed layout" in result.output
    assert not (tmp_path / "features").exists()


def test_a_missing_layout_says_which_data_root_it_looked_under(tmp_path, monkeypatch, cli):
    """An explicit --data-root is named as such, with no advice to pass what was passed; without one the
    message says whether $TVRPIPE_DATA or the default gave the root, and points at both."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TVRPIPE_DATA", str(tmp_path / "env"))  # an explicit --data-root wins over it
    given = ("error: msrvtt: annotation folder /nonexistent/x/msrvtt/msrvtt_data not found (the msrvtt layout under "
             "--data-root /nonexistent/x, docs/datasets.md: put the files there, or point --data-root at the folder "
             "that holds msrvtt/)")
    for command in (("extract", "--dataset", "msrvtt"), ("finetune", "--recipe", "tmass-msrvtt", "--dry-run")):
        result = cli(*command, "--data-root", "/nonexistent/x")
        assert result.exit_code == 1 and " ".join(result.output.split()).endswith(given), result.output
    advice = "docs/datasets.md: put the files there, or point --data-root or $TVRPIPE_DATA at the folder that holds msrvtt/)"
    result = cli("extract", "--dataset", "msrvtt")
    assert result.exit_code == 1 and " ".join(result.output.split()) == (
        f"error: msrvtt: annotation folder {tmp_path}/env/msrvtt/msrvtt_data not found (the msrvtt layout under "
        f"$TVRPIPE_DATA={tmp_path}/env, {advice}")
    monkeypatch.delenv("TVRPIPE_DATA")
    result = cli("extract", "--dataset", "msrvtt")
    assert result.exit_code == 1 and " ".join(result.output.split()) == (
        f"error: msrvtt: annotation folder data/msrvtt/msrvtt_data not found (the msrvtt layout under the default "
        f"data root data/, {advice}")
    assert not (tmp_path / "features").exists() and not (tmp_path / "data").exists()


def test_extract_with_only_the_dataset_finds_everything_under_the_data_root(synth, tmp_path, monkeypatch, cli):
    """`tvrpipe extract --dataset msrvtt` (the tiny random CLIP in place of ViT-B-32: no weights here) in a
    folder holding data/ as documented: the manifest is built there, the store lands in features/, and
    train-head finds it with no --features."""
    _msrvtt_root(tmp_path / "data", synth)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TVRPIPE_DATA", raising=False)
    monkeypatch.delenv("TVRPIPE_FEATURES", raising=False)
    result = cli("extract", "--dataset", "msrvtt", "--model", "tvrpipe-tiny", "--pretrained", "none",
                 "--decoders", "1")
    assert result.exit_code == 0, result.output
    store = Path("features") / "msrvtt-tvrpipe-tiny-none"
    assert (tmp_path / store / "features.zarr").is_dir()
    from tvrpipe.features.store import default_store, open_store

    assert default_store().resolve() == (tmp_path / store).resolve()
    assert len(open_store(tmp_path / store).videos) == 9

