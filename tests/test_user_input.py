"""What users type and what their disks hold, met through the CLI as a user meets it: names, paths and
queries printed literally (never as Rich markup), outputs checked before anything is written and never
inside an input, a closed stdout pipe that ends printing quietly, advice that works, and help that reads
at 80 columns. One collection of oddly named videos, extracted once with the tiny CLIP."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tvrpipe.errors import ConfigError
from tvrpipe.features.clip import TINY_MODEL
from tvrpipe.worlds.videos import synthesize

# [x], [/x] and [bold] in folder and file names: Rich would read each as markup (and [/x] as a closing tag
# with nothing open: a MarkupError)
FOLDER = "vids [old]"
FILES = {"clip [final].mp4": 0, "[bold]loud.mp4": 1, "sub[/x]/AC [live].mp4": 2}
QUERIES = ("clip [final] cut", "AC/DC [/live] concert", "[bold]loud[/bold] music")


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """(root, folder, manifest, store): the three oddly named videos as a collection, and its store."""
    from typer.testing import CliRunner

    from tvrpipe.cli.main import app

    root = tmp_path_factory.mktemp("odd [root]")
    synthesize(root / "synth", 3, seed=5, progress=False)
    folder = root / FOLDER
    for name, k in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / "synth" / "videos" / f"synth_{k:05d}.mp4", folder / name)
    runner = CliRunner()
    r = runner.invoke(app, ["manifest", "build", "--videos", str(folder), "--out", str(root / "man [m]")])
    assert r.exit_code == 0, r.output
    # through the CLI, as a user extracts
    r = runner.invoke(app, ["extract", "--manifest", str(root / "man [m]"), "--video-root", str(folder), "--out",
                            str(root / "store [s]"), "--model", TINY_MODEL, "--pretrained", "none", "--frames", "4",
                            "--video-shard", "2"])
    out = _flat(r.output)
    assert r.exit_code == 0 and "3 extracted, 0 already done, 0 failed" in out, r.output
    return root, folder, root / "man [m]", root / "store [s]"


# ------------------------------------------------------------------------------------------- markup


def test_names_paths_and_queries_print_as_they_are_in_every_command(odd, cli, tmp_path):
    root, folder, manifest, store = odd
    r = cli("manifest", "build", "--videos", folder, "--out", tmp_path / "m [2]")
    assert r.exit_code == 0 and f"-> {tmp_path / 'm [2]'}" in _flat(r.output), r.output
    r = cli("manifest", "show", manifest)
    assert r.exit_code == 0 and str(folder) in _flat(r.output) and str(manifest) in _flat(r.output), r.output
    r = cli("features", "show", store)
    assert r.exit_code == 0 and f"video_root: {folder}" in _flat(r.output) and "store [s]" in r.output, r.output
    r = cli("features", "verify", store)
    assert r.exit_code == 0 and _flat(r.output).startswith(f"{store}: "), r.output

    r = cli("search", *QUERIES, "--features", store, "--json", tmp_path / "h [1].json")
    out = _flat(r.output)
    assert r.exit_code == 0, r.output
    for q in QUERIES:
        assert q in out, (q, r.output)
    for name in FILES:  # in the table, whole (the path column repeats the id for a collection: left out)
        assert out.count(name) == len(QUERIES), (name, r.output)
    assert "│ path" not in r.output and f"over {store}" in out and f"wrote {tmp_path / 'h [1].json'}" in out
    hits = json.loads((tmp_path / "h [1].json").read_text())
    assert {h["query"] for h in hits} == set(QUERIES) and {h["video_id"] for h in hits} == set(FILES)

    r = cli("export", "--features", store, "--format", "npy", "--out", tmp_path / "pooled [p]")
    assert r.exit_code == 0 and f"wrote {tmp_path / 'pooled [p]'}" in _flat(r.output), r.output


def test_a_generated_store_run_and_report_in_odd_folders_print_as_they_are(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short paths: the tables' titles hold them on one line
    store, run, report = Path("gen [g]"), Path("run [/r]"), Path("rep [bold]")
    r = cli("synth", "--features-only", "--out", store, "--set", "train_videos=40", "--set", "test_videos=20")
    assert r.exit_code == 0 and f"--features '{store}' --method" in _flat(r.output), r.output  # quoted: pastes whole
    r = cli("train-head", "--features", store, "--method", "meanpool", "--epochs", 1, "--out", run)
    assert r.exit_code == 0 and f"meanpool: test ({run}/metrics.json)" in _flat(r.output), r.output
    r = cli("evaluate", "--run", run)
    assert r.exit_code == 0 and f"{run}: test ({run}/eval_test.json)" in _flat(r.output), r.output
    r = cli("report", run, "--out", report)
    assert r.exit_code == 0 and f"report: {report}/report.md" in _flat(r.output), r.output


@pytest.mark.parametrize("path", ["vids [old]/nosuch", "my[/]store", "[bold]x[/bold]"])
def test_a_path_in_an_error_is_printed_as_given(cli, tmp_path, path):
    r = cli("search", "a dog", "--features", tmp_path / path)
    assert r.exit_code == 1 and f"error: {tmp_path / path}: no feature store here" in _flat(r.output), r.output
    assert "MarkupError" not in r.output


# ------------------------------------------------------------------------------------------ outputs


def test_extract_refuses_an_out_that_is_its_manifest_or_holds_other_files(odd, cli, tmp_path):
    root, folder, manifest, _ = odd
    copy = tmp_path / "manifest"
    shutil.copytree(manifest, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    args = ("extract", "--manifest", copy, "--video-root", folder, "--model", TINY_MODEL, "--pretrained", "none")
    r = cli(*args, "--out", copy)
    assert r.exit_code == 1 and f"--out {copy} holds --manifest {copy}, an input of this command" in _flat(r.output)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before  # the manifest untouched
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("x")
    r = cli(*args, "--out", other)
    assert r.exit_code == 1 and "holds 1 entry that are not a feature store's (e.g. thesis.tex)" in _flat(r.output)
    r = cli(*args, "--out", copy / "store")
    assert r.exit_code == 1 and f"is inside a manifest ({copy})" in _flat(r.output), r.output
    assert sorted(p.name for p in other.iterdir()) == ["thesis.tex"] and not (copy / "store").exists()


def test_an_out_folder_is_never_a_folder_tvrpipe_made_for_another_purpose(odd, cli, tmp_path):
    root, folder, manifest, store = odd
    run = tmp_path / "run"
    r = cli("synth", "--features-only", "--out", tmp_path / "gen", "--set", "train_videos=40", "--set", "test_videos=20")
    assert r.exit_code == 0, r.output
    r = cli("train-head", "--features", tmp_path / "gen", "--method", "meanpool", "--epochs", 1, "--out", run)
    assert r.exit_code == 0, r.output
    plots = sorted(p.name for p in (run / "plots").iterdir())
    for args, said in ((("manifest", "build", "--videos", folder, "--out", store), f"--out {store} is a feature store"),
                       (("manifest", "build", "--videos", folder, "--out", run / "m"), f"is inside a run ({run})"),
                       (("report", run, "--out", run), f"--out {run} is a run"),
                       (("report", run, "--out", store / "r"), f"is inside a feature store ({store})"),
                       (("train-head", "--features", tmp_path / "gen", "--method", "meanpool", "--out", manifest),
                        f"{manifest} is a manifest")):
        r = cli(*args)
        assert r.exit_code == 1 and said in _flat(r.output), (args, r.output)
    assert sorted(p.name for p in (run / "plots").iterdir()) == plots and not (run / "m").exists()
    assert not (run / "report.md").exists() and not (store / "r").exists()


def test_search_outputs_are_all_checked_before_any_is_written(odd, cli, tmp_path):
    _, _, _, store = odd
    table = (store / "videos.parquet").read_bytes()
    r = cli("search", "a dog", "--features", store, "--json", store / "videos.parquet")
    assert r.exit_code == 1 and f"--json {store / 'videos.parquet'} is inside a feature store" in _flat(r.output)
    assert (store / "videos.parquet").read_bytes() == table
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for bad, why in ((blocker / "x.csv", f"{blocker} is a file, so the folder cannot be created"),
                     (tmp_path, "is a folder; give a file name"),
                     (tmp_path / "ok.json", "name the same file"),
                     # a folder that cannot be made although its parent exists, and which a permission check
                     # (root passes them all) lets through: only making it tells
                     *([(Path("/proc/x/hits.csv"), "--csv /proc/x: cannot write there (/proc/x")]
                       if Path("/proc/self").exists() else [])):
        r = cli("search", "a dog", "--features", store, "--json", tmp_path / "ok.json", "--csv", bad)
        assert r.exit_code == 1 and why in _flat(r.output), r.output
        assert not (tmp_path / "ok.json").exists()  # the good output waits for the bad one: none is written


def test_an_output_that_is_a_device_or_pipe_is_refused_and_a_link_is_written_through(odd, cli, tmp_path):
    """A device or a pipe would be replaced by a regular file by the write's rename (``/dev/null`` for every
    program); a symbolic link keeps pointing at its target, which gets the output."""
    _, _, _, store = odd
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    r = cli("search", "a dog", "--features", store, "--json", tmp_path / "ok.json", "--csv", pipe)
    assert r.exit_code == 1 and f"--csv {pipe} is a pipe, not a file" in _flat(r.output), r.output
    assert not (tmp_path / "ok.json").exists() and stat.S_ISFIFO(os.stat(pipe).st_mode)
    if Path("/dev/full").exists():
        r = cli("search", "a dog", "--features", store, "--csv", "/dev/full")
        assert r.exit_code == 1 and "--csv /dev/full is a device, not a file" in _flat(r.output), r.output
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)
    target, link = tmp_path / "target.csv", tmp_path / "link.csv"
    target.write_text("old")
    link.symlink_to(target)
    r = cli("search", "a dog", "--features", store, "--csv", link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and target.read_text().startswith("query,") and link.read_text() == target.read_text()


def test_a_run_is_never_written_inside_another_runs_folder(cli, tmp_path):
    from tvrpipe.worlds.features import GenSpec, generate_store

    store = generate_store(tmp_path / "s", GenSpec(train_videos=24, test_videos=8, frames=4, max_words=6,
                                                  embed_dim=8))
    r = cli("train-head", "--features", store, "--method", "meanpool", "--epochs", "0", "--out", tmp_path / "r")
    assert r.exit_code == 0, r.output
    r = cli("train-head", "--features", store, "--method", "meanpool", "--epochs", "0", "--out",
            tmp_path / "r" / "checkpoints")
    assert r.exit_code == 1 and f"is inside a run ({tmp_path / 'r'})" in _flat(r.output), r.output
    assert not (tmp_path / "r" / "checkpoints" / "config.yaml").exists()


def test_a_writable_check_makes_the_folder_for_real_and_leaves_nothing(tmp_path):
    from tvrpipe.lock import check_writable

    check_writable(tmp_path / "a" / "b" / "c", "--out")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "d").mkdir()
    check_writable(tmp_path / "d", "--out")
    assert list((tmp_path / "d").iterdir()) == []
    with pytest.raises(ConfigError, match=f"--out {tmp_path / 'f' / 'x'}: .* is a file"):
        (tmp_path / "f").write_text("")
        check_writable(tmp_path / "f" / "x", "--out")


def test_bench_json_creates_nothing_before_the_measurement_writes_it(cli, tmp_path):
    r = cli("bench", "search", "--out", tmp_path / "b", "--videos", 0, "--json", tmp_path / "new" / "sub" / "r.json")
    assert r.exit_code == 1 and "--videos 0" in r.output
    assert not (tmp_path / "new").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, message", [
    (("--width", 0), "--width must be >= 16, got 0"),
    (("--width", 33), "--width must be even, got 33"),
    (("--fps", 0), "--fps must be >= 1, got 0"),
    (("--seconds", 0), "--seconds must be > 0, got 0.0"),
])
def test_bench_extract_options_are_checked_before_anything_is_made(cli, tmp_path, args, message):
    r = cli("bench", "extract", "--out", tmp_path / "b", *args)
    assert r.exit_code == 1 and f"error: {message}" in r.output, r.output
    assert not (tmp_path / "b").exists()


def test_verify_fails_on_a_store_whose_table_does_not_read(odd, cli, tmp_path):
    _, _, _, store = odd
    copy = tmp_path / "s"
    shutil.copytree(store, copy, ignore=shutil.ignore_patterns(".tvrpipe.lock", "search-index"))
    (copy / "videos.parquet").write_bytes(b"not parquet")
    r = cli("features", "verify", copy)
    assert r.exit_code == 1 and f"{copy / 'videos.parquet'} is missing or damaged" in _flat(r.output), r.output
    assert "ok:" not in r.output


def test_a_dataset_whose_videos_are_all_missing_is_not_advised_allow_missing(cli, shared_annotations, tmp_path):
    (tmp_path / "videos").mkdir()
    r = cli("manifest", "build", "--dataset", "msvd", "--annotations", shared_annotations / "msvd", "--video-root",
            tmp_path / "videos", "--out", tmp_path / "m")
    text = _flat(r.output)
    assert r.exit_code == 1 and "1970 of 1970 videos not found" in text, r.output
    assert "the manifest would hold no video" in text and "--allow-missing" not in text
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------------------------ closed pipes


def _closed_stdout(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``tvrpipe ARGS`` whose stdout's reader has gone before it writes a byte (`| head -0`)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "tvrpipe", *args], stdout=w, stderr=subprocess.PIPE, text=True,
                              cwd=cwd, timeout=300)
    finally:
        os.close(w)


def test_a_closed_pipe_ends_printing_quietly_and_files_are_still_written(odd, tmp_path):
    _, _, _, store = odd
    p = _closed_stdout("manifest", "build", "--help", cwd=tmp_path)
    assert (p.returncode, p.stderr) == (0, "")
    p = _closed_stdout("search", "a red circle", "a blue square", "--features", str(store), "--json", "a.json",
                       "--csv", "b.csv", "--html", "c.html", cwd=tmp_path)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    assert len(json.loads((tmp_path / "a.json").read_text())) == 2 * len(FILES)
    assert (tmp_path / "b.csv").read_text().count("\n") == 1 + 2 * len(FILES)
    assert (tmp_path / "c.html").read_text().count("<tr>") == 2 * (len(FILES) + 1)


# ------------------------------------------------------------------------------------------- help


def _commands(group, path=()):
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_every_help_reads_at_80_columns(cli, monkeypatch):
    """No line over 80 characters, every option's names whole, and no `<bool>` for a flag."""
    import typer

    from tvrpipe.cli.main import app

    monkeypatch.setenv("COLUMNS", "80")
    for path, cmd in _commands(typer.main.get_command(app)):
        r = cli(*path, "--help")
        assert r.exit_code == 0, (path, r.output)
        assert max(map(len, r.output.splitlines())) <= 80, (path, r.output)
        for p in cmd.params:
            for opt in (*p.opts, *p.secondary_opts):
                if opt.startswith("-"):
                    assert opt in r.output.split() or f"{opt}," in r.output or f"{opt}/" in r.output, (path, opt)
        assert "<bool>" not in r.output and "…" not in r.output, (path, r.output)
