"""What a probe of the data root and the manifest builder found, each checked through the real CLI:
`--video-root` is the folder the manifest's videos are checked in (not only extracted from); an option a
command would ignore is refused; an error advises only options of the command that raised it; annotation
files in the encodings benchmarks ship are read, others are one line naming the file, line and byte; a
build removes what a killed build staged; a dry run builds what it needs outside the data root."""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tvrpipe.errors import ConfigError

IDS = [f"video{i}" for i in range(9)]  # 6 in the 9k training list, 3 in the 1k-A test list


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[Path]:
    from tvrpipe.worlds.videos import synthesize

    root = tmp_path_factory.mktemp("probe-videos")
    synthesize(root, 9, seed=0, progress=False)
    return sorted((root / "videos").rglob("*.mp4"))


def msrvtt_annotations(ann: Path) -> Path:
    """CLIP4Clip's three MSR-VTT files, tiny: a 9k list of 6 videos, a 1k-A list of 3, 2 sentences each."""
    ann.mkdir(parents=True, exist_ok=True)
    (ann / "MSRVTT_train.9k.csv").write_text("video_id\n" + "\n".join(IDS[:6]) + "\n")
    (ann / "MSRVTT_JSFUSION_test.csv").write_text("key,vid_key,video_id,sentence\n" + "".join(
        f"ret{i},msr{i},{v},test sentence {i}\n" for i, v in enumerate(IDS[6:])))
    (ann / "MSRVTT_data.json").write_text(json.dumps({"videos": [{"video_id": v} for v in IDS], "sentences": [
        {"video_id": v, "caption": f"caption {k} of {v}", "sen_id": 2 * i + k}
        for i, v in enumerate(IDS) for k in range(2)]}))
    return ann


def copy_videos(clips: list[Path], folder: Path, ids: list[str] = IDS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for v, src in zip(IDS, clips):
        if v in ids:
            shutil.copy(src, folder / f"{v}.mp4")
    return folder


def tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its sha256 (folders: "dir"): what a command must leave unchanged."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def one_line(result) -> str:
    return " ".join(result.output.split())


@pytest.fixture
def fake_extract(monkeypatch):
    """``tvrpipe extract`` up to the library call: the arguments it passes to features.extract.extract."""
    import tvrpipe.features.extract as ex

    calls: list[tuple[Path, Path, Path]] = []

    class Summary:
        def lines(self) -> list[str]:
            return ["(extraction skipped by the test)"]

    def extract(manifest, video_root, out, cfg):
        calls.append((Path(manifest), Path(video_root), Path(out)))
        return Summary()

    monkeypatch.setattr(ex, "extract", extract)
    return calls


TINY = ["--model", "tvrpipe-tiny", "--pretrained", "none"]


# ------------------------------------------------------------------------- --video-root with --dataset


def test_extract_dataset_checks_and_extracts_the_videos_of_video_root(clips, tmp_path, fake_extract, cli):
    """With --dataset and --video-root the manifest is built checking the videos there (the layout's video
    folder need not exist) and extraction reads them there; a manifest checked in another folder is rebuilt."""
    root = tmp_path / "data"
    msrvtt_annotations(root / "msrvtt" / "msrvtt_data")
    mine = copy_videos(clips, tmp_path / "my-videos")
    r = cli("extract", "--dataset", "msrvtt", "--data-root", root, "--video-root", mine, "--out", tmp_path / "f", *TINY)
    assert r.exit_code == 0, r.output
    manifest = root / "msrvtt" / "manifest"
    assert fake_extract == [(manifest, mine, tmp_path / "f")]
    meta = json.loads((manifest / "meta.json").read_text())
    assert meta["video_root"] == str(mine.resolve()) and meta["missing_videos"] == []
    assert not (root / "msrvtt" / "MSRVTT").exists()
    # the layout's folder now holds all but video8: the manifest checked in my-videos is not reused for it
    copy_videos(clips, root / "msrvtt" / "MSRVTT" / "videos" / "all", IDS[:8])
    before = tree(manifest)
    r = cli("extract", "--dataset", "msrvtt", "--data-root", root, "--out", tmp_path / "f", *TINY)
    assert r.exit_code == 1 and "1 of 9 videos not found under" in one_line(r) and "'video8'" in one_line(r)
    assert tree(manifest) == before and len(fake_extract) == 1  # nothing extracted, the manifest kept
    # back to my-videos: reused as it is
    r = cli("extract", "--dataset", "msrvtt", "--data-root", root, "--video-root", mine, "--out", tmp_path / "f", *TINY)
    assert r.exit_code == 0 and tree(manifest) == before and fake_extract[-1][1] == mine


def test_a_missing_video_advises_a_command_that_exists_and_it_works(clips, tmp_path, fake_extract, cli):
    """extract has no --allow-missing: the advice is the `manifest build` command (real options, real paths)
    that drops the missing videos, after which extract --dataset uses that manifest."""
    root = tmp_path / "data"
    msrvtt_annotations(root / "msrvtt" / "msrvtt_data")
    videos = copy_videos(clips, tmp_path / "vids", IDS[:8])
    args = ["extract", "--dataset", "msrvtt", "--data-root", root, "--video-root", videos, "--out", tmp_path / "f", *TINY]
    r = cli(*args)
    text = one_line(r)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"1 of 9 videos not found under {videos}: 'video8'" in text
    assert "--allow-missing to drop" not in text  # extract has no such option
    advised = re.search(r"`(tvrpipe manifest build [^`]+)` builds the manifest without them, and this command then "
                        r"uses it", text)
    assert advised, text
    cmd = shlex.split(advised.group(1))
    assert cmd[cmd.index("--video-root") + 1] == str(videos)
    assert cmd[cmd.index("--out") + 1] == str(root / "msrvtt" / "manifest")
    r = cli(*cmd[1:])
    assert r.exit_code == 0 and "dropped 1 missing videos" in one_line(r), r.output
    r = cli(*args)
    assert r.exit_code == 0, r.output
    assert json.loads((root / "msrvtt" / "manifest" / "meta.json").read_text())["missing_videos"] == ["video8"]
    assert len(fake_extract) == 1


def test_manifest_build_still_advises_its_own_allow_missing(clips, tmp_path, cli):
    ann = msrvtt_annotations(tmp_path / "ann")
    videos = copy_videos(clips, tmp_path / "vids", IDS[:8])
    r = cli("manifest", "build", "--dataset", "msrvtt", "--annotations", ann, "--out", tmp_path / "m",
            "--video-root", videos)
    assert r.exit_code == 1
    assert "'video8'; fix --video-root or pass --allow-missing to drop them" in one_line(r)


@pytest.mark.parametrize("command", [
    ["extract", "--dataset", "msrvtt", *TINY],
    ["extract", *TINY],
])
def test_extract_refuses_data_root_with_manifest(command, tmp_path, fake_extract, cli):
    r = cli(*command, "--manifest", tmp_path / "m", "--video-root", tmp_path, "--data-root", tmp_path / "data")
    assert r.exit_code == 1 and not fake_extract
    assert (f"--data-root {tmp_path / 'data'} finds --dataset's files when no --manifest is given; with --manifest "
            f"{tmp_path / 'm'} it would be ignored: drop one of them") in one_line(r)


def test_manifest_build_refuses_allow_missing_without_video_root(tmp_path, cli):
    ann = msrvtt_annotations(tmp_path / "ann")
    r = cli("manifest", "build", "--dataset", "msrvtt", "--annotations", ann, "--out", tmp_path / "m",
            "--allow-missing")
    assert r.exit_code == 1 and not (tmp_path / "m").exists()
    assert "--allow-missing drops the videos not found under --video-root: give --video-root too" in one_line(r)


def test_video_root_for_the_generated_dataset_is_refused(tmp_path, fake_extract, cli):
    r = cli("extract", "--dataset", "synthetic", "--data-root", tmp_path / "data", "--video-root", tmp_path, *TINY)
    assert r.exit_code == 1 and not (tmp_path / "data").exists() and not fake_extract
    assert f"--video-root {tmp_path}: the synthetic dataset is generated with its videos under the data root" in one_line(r)


# ------------------------------------------------------------------------- finetune --recipe --dry-run


def tiny_recipe(path: Path, dataset: str = "msrvtt", split_set: str = "9k") -> Path:
    """A complete recipe (MSR-VTT 9k unless told) for the tiny test CLIP."""
    settings = {"model": "tvrpipe-tiny", "pretrained": "none", "end_to_end": True, "frames": 4, "max_words": 8,
                "frame_sampling": "uniform", "epoch_pairs": "videos", "batch_size": 4, "epochs": 1,
                "optimizer": "adamw", "clip_lr": 1e-6, "head_lr": 1e-5, "group_lr": {}, "weight_decay": 0.2,
                "warmup_fraction": 0.1, "schedule": "cosine", "grad_clip": 1.0, "precision": "fp32",
                "init_from_clip": False}
    doc = {"paper": "test", "method": "meanpool", "dataset": dataset,
           "split_set": {"value": split_set, "source": "choice: test"},
           "settings": {k: {"value": v, "source": f"choice: test {k}"} for k, v in settings.items()},
           "head": {}, "published": None}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_dry_run_builds_the_manifest_outside_the_data_root_and_checks_it(clips, tmp_path, cli, monkeypatch):
    """`finetune --recipe --dry-run` with no manifest under the data root: it checks what the build checks
    (a missing video fails it), builds in a scratch folder it removes, and leaves the data root
    byte-identical; the real run then builds the manifest there."""
    root = tmp_path / "data"
    msrvtt_annotations(root / "msrvtt" / "msrvtt_data")
    videos = copy_videos(clips, root / "msrvtt" / "MSRVTT" / "videos" / "all", IDS[:8])
    recipe = tiny_recipe(tmp_path / "tiny-msrvtt.yaml")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    args = ["finetune", "--recipe", recipe, "--data-root", root, "--out", tmp_path / "run", "--dry-run"]
    before = tree(root)
    r = cli(*args)
    assert r.exit_code == 1 and "1 of 9 videos not found under" in one_line(r), r.output
    assert tree(root) == before and not list(scratch.glob("tvrpipe-dry-run-*"))
    copy_videos(clips, videos, IDS[8:])
    before = tree(root)
    r = cli(*args)
    assert r.exit_code == 0, r.output
    assert "data: train 5 videos / 10 captions; val 1 videos / 1 captions; test 3 videos / 3 captions" in one_line(r)
    assert tree(root) == before and not list(scratch.glob("tvrpipe-dry-run-*")) and not (tmp_path / "run").exists()
    assert not (root / "msrvtt" / "manifest").exists()
    # the real run builds it under the data root (the training itself is not this test's business)
    import tvrpipe.training.finetune as ft

    seen = []

    def finetune(manifest, video_root, *a, **k):
        seen.append((Path(manifest), Path(video_root)))
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(ft, "finetune", finetune)
    r = cli(*args[:-1])
    assert r.exit_code == 1 and "stopped by the test" in r.output
    assert seen == [(root / "msrvtt" / "manifest", videos)]
    assert json.loads((root / "msrvtt" / "manifest" / "meta.json").read_text())["split_set"] == "9k"


def test_a_dry_run_on_the_generated_dataset_generates_it_outside_the_data_root(tmp_path, cli, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    recipe = tiny_recipe(tmp_path / "tiny-synthetic.yaml", "synthetic", "synthetic")
    r = cli("finetune", "--recipe", recipe, "--data-root", tmp_path / "data", "--out", tmp_path / "run", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "data: train 140 videos" in one_line(r)  # the 200 videos the real run would generate there
    assert not (tmp_path / "data").exists() and not list(scratch.glob("tvrpipe-dry-run-*"))


def test_a_dry_run_checks_the_videos_of_video_root(clips, tmp_path, cli, monkeypatch):
    """finetune --recipe with --video-root: the build checks the videos there (the layout's folder is absent),
    in a dry run too, and the data root is left as it was; with --manifest, --data-root is refused."""
    root = tmp_path / "data"
    msrvtt_annotations(root / "msrvtt" / "msrvtt_data")
    mine = copy_videos(clips, tmp_path / "my-videos")
    recipe = tiny_recipe(tmp_path / "tiny-msrvtt.yaml")
    before = tree(root)
    r = cli("finetune", "--recipe", recipe, "--data-root", root, "--video-root", mine, "--out", tmp_path / "run",
            "--dry-run")
    assert r.exit_code == 0, r.output
    assert tree(root) == before
    r = cli("finetune", "--recipe", recipe, "--data-root", root, "--manifest", tmp_path / "m", "--video-root", mine,
            "--dry-run")
    assert r.exit_code == 1 and f"--manifest {tmp_path / 'm'} it would be ignored: drop one of them" in one_line(r)


# ------------------------------------------------------------------------- encodings of annotation files


def _lsmdc_annotations(ann: Path) -> Path:
    ann.mkdir(parents=True, exist_ok=True)
    for name, split in (("LSMDC16_annos_training.csv", "train"), ("LSMDC16_annos_val.csv", "val"),
                        ("LSMDC16_challenge_1000_publictect.csv", "test")):
        (ann / name).write_text("".join(f"1001_Movie_{split}_00.00.0{i}.000-00.00.0{i + 1}.000\t0\t1\t0\t1\t"
                                        f"SOMEONE walks into the {split} room {i}.\n" for i in range(2)))
    return ann


def _custom_annotations(ann: Path) -> Path:
    ann.mkdir(parents=True, exist_ok=True)
    (ann / "t.csv").write_text("path,caption,split\na.mp4,a red ball,train\nb.mp4,a blue cube,test\n")
    return ann


def _ann(dataset: str, folder: Path) -> Path:
    return {"msrvtt": msrvtt_annotations, "lsmdc": _lsmdc_annotations, "custom": _custom_annotations}[dataset](folder)


def _with_cafe(path: Path) -> str:
    """The file's text with one caption holding "café" (a byte Latin-1 and UTF-8 encode differently)."""
    text = path.read_text()
    for word in ("test sentence 0", "SOMEONE walks into the test room 0", "a red ball", "caption 0 of video0"):
        if word in text:
            return text.replace(word, word.replace(word.split()[0], "café"), 1)
    raise AssertionError(path)


# every reader helper: JSON, a CSV with a header, a list of ids, header-less TSV, a custom table
FILES = [("msrvtt", "MSRVTT_data.json"), ("msrvtt", "MSRVTT_JSFUSION_test.csv"), ("msrvtt", "MSRVTT_train.9k.csv"),
         ("lsmdc", "LSMDC16_challenge_1000_publictect.csv"), ("custom", "t.csv")]


def _build(cli, dataset: str, ann: Path, out: Path):
    return cli("manifest", "build", "--dataset", dataset, "--annotations", ann, "--out", out)


@pytest.mark.parametrize("dataset, name", FILES)
@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16-le-bom", "utf-16-be-bom"])
def test_annotation_files_with_a_byte_order_mark_are_read(dataset, name, encoding, tmp_path, cli):
    """UTF-8 with a BOM (Excel's "CSV UTF-8") and UTF-16 with a BOM (Windows' "Unicode text") give the same
    manifest as the UTF-8 file."""
    ann = _ann(dataset, tmp_path / "ann")
    if name != "MSRVTT_train.9k.csv":  # a list of ids has no caption to hold a non-ASCII letter
        (ann / name).write_text(_with_cafe(ann / name), encoding="utf-8")
    assert _build(cli, dataset, ann, tmp_path / "utf8").exit_code == 0
    text = (ann / name).read_text(encoding="utf-8")
    bom = {"utf-8-sig": b"", "utf-16-le-bom": codecs.BOM_UTF16_LE, "utf-16-be-bom": codecs.BOM_UTF16_BE}[encoding]
    codec = {"utf-8-sig": "utf-8-sig", "utf-16-le-bom": "utf-16-le", "utf-16-be-bom": "utf-16-be"}[encoding]
    (ann / name).write_bytes(bom + text.encode(codec))
    r = _build(cli, dataset, ann, tmp_path / "other")
    assert r.exit_code == 0, r.output
    for table in ("videos.parquet", "captions.parquet"):
        assert (tmp_path / "other" / table).read_bytes() == (tmp_path / "utf8" / table).read_bytes()


@pytest.mark.parametrize("dataset, name", [f for f in FILES if f[1] != "MSRVTT_train.9k.csv"])
def test_latin1_annotation_file_is_one_line_naming_file_line_and_byte(dataset, name, tmp_path, cli):
    ann = _ann(dataset, tmp_path / "ann")
    text = _with_cafe(ann / name)
    data = text.encode("latin-1")
    (ann / name).write_bytes(data)
    offset = data.index(b"\xe9")
    line = data.count(b"\n", 0, offset) + 1
    r = _build(cli, dataset, ann, tmp_path / "m")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    path = ann / name
    assert (f"error: {path} line {line}: not UTF-8 text (byte 0xe9 at byte offset {offset}); convert the file to "
            f"UTF-8, e.g. from Latin-1: `iconv -f latin1 -t utf-8 {path} > {path}.utf8 && mv {path}.utf8 {path}`"
            ) in one_line(r)
    assert len(r.output.strip().splitlines()) <= 3 and not (tmp_path / "m").exists()  # one (wrapped) line
    # the advised conversion makes it readable
    advised = re.search(r"`(iconv [^`]+)`", one_line(r)).group(1)
    if shutil.which("iconv"):
        subprocess.run(advised, shell=True, check=True)
    else:
        path.write_text(data.decode("latin-1"), encoding="utf-8")
    assert _build(cli, dataset, ann, tmp_path / "m").exit_code == 0


@pytest.mark.parametrize("dataset, name", FILES)
def test_utf16_without_a_byte_order_mark_is_named(dataset, name, tmp_path, cli):
    ann = _ann(dataset, tmp_path / "ann")
    path = ann / name
    path.write_bytes(path.read_text().encode("utf-16-le"))
    r = _build(cli, dataset, ann, tmp_path / "m")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert (f"{path} line 1: a NUL byte: not a text file, or UTF-16 without a byte order mark; convert the file "
            f"to UTF-8, e.g. from UTF-16: `iconv -f utf-16le -t utf-8 {path} > {path}.utf8") in one_line(r)


def test_a_parquet_table_with_text_that_is_not_utf8_names_row_and_column(tmp_path, cli):
    import pyarrow as pa
    import pyarrow.parquet as pq

    caption = pa.array([b"a red ball", b"a caf\xe9 table"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"path": ["a.mp4", "b.mp4"], "caption": caption, "split": ["train", "test"]}),
                   tmp_path / "t.parquet")
    r = _build(cli, "custom", tmp_path / "t.parquet", tmp_path / "m")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"{tmp_path / 't.parquet'} row 1: column 'caption' is not UTF-8 text (byte 0xe9 at byte 5 of the value)" \
        in one_line(r)


# ------------------------------------------------------------------------- a build killed before its renames


def test_a_rebuild_removes_what_a_killed_build_staged(tmp_path, cli):
    ann = _custom_annotations(tmp_path / "ann")
    out = tmp_path / "m"
    assert _build(cli, "custom", ann, out).exit_code == 0
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now: what a kill -9 during a build leaves behind
    staged = [out / f".{n}.tmp-{dead.pid}" for n in ("videos.parquet", "captions.parquet", "meta.json")]
    for p in staged:
        p.write_bytes(b"half a file")
    live = out / f".videos.parquet.tmp-{os.getppid()}"  # a build that may still be writing
    others = [out / ".notes.tmp-1", out / f"videos.parquet.tmp-{dead.pid}", out / "README"]
    for p in [live, *others]:
        p.write_text("not the writer's")
    assert _build(cli, "custom", ann, out).exit_code == 0
    assert not any(p.exists() for p in staged)
    assert live.exists() and all(p.exists() for p in others)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["captions.parquet", "meta.json", "videos.parquet", live.name, *(p.name for p in others)])


# ------------------------------------------------------------------------- advice in the options of the command run


def test_manifest_show_of_a_path_outside_the_root_advises_no_option_of_its_own(tmp_path, cli):
    """`manifest show` has no --video-root: the advice says what to do with the paths, and names the commands
    whose --video-root it means."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "m"
    out.mkdir()
    pq.write_table(pa.table({"video_id": ["a"], "path": ["../a.mp4"], "split": ["test"],
                             "start_s": pa.array([None], pa.float64()), "end_s": pa.array([None], pa.float64())}),
                   out / "videos.parquet")
    pq.write_table(pa.table({"caption_id": ["a#0"], "video_id": ["a"], "text": ["a cat"], "split": ["test"]}),
                   out / "captions.parquet")
    r = cli("manifest", "show", out)
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert ("leaves the video root ('../a.mp4'); paths are relative to the video root and stay inside it: write them "
            "relative to one folder that holds every video, and give that folder as the video root (--video-root of "
            "manifest build, extract and finetune)") in one_line(r)
