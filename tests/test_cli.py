"""The command line: help text, one-line errors with exit code 1, manifest commands."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys

import pandas as pd
import pytest
import typer


def test_help_lists_command_groups(cli):
    r = cli("--help")
    assert r.exit_code == 0
    for group in ("manifest", "synth", "quickstart"):
        assert group in r.output


def test_help_shows_the_main_path_first_then_papers_tools_and_benchmarks(cli):
    r = cli("--help")
    text = " ".join(r.output.split())
    panels = ["Main path: manifest -> extract -> train-head -> evaluate / search / report", "Full papers and grids", "Tools",
              "Benchmarks"]
    assert r.exit_code == 0 and all(p in text for p in panels), r.output
    assert [text.index(p) for p in panels] == sorted(text.index(p) for p in panels)
    order = ["\n  manifest ", "\n  extract ", "\n  train-head ", "\n  evaluate ", "\n  report ", "\n  finetune ",
             "\n  sweep ", "\n  features ", "\n  export ", "\n  heads ", "\n  synth ", "\n  quickstart ",
             "\n  bench "]
    at = [r.output.index(c) for c in order]
    assert at == sorted(at), r.output


@pytest.mark.parametrize("command, config, renamed", [
    ("finetune", "tvrpipe.training.finetune.config:FinetuneConfig", {"timeout": "timeout_s"}),
    ("train-head", "tvrpipe.training.settings:TrainConfig", {}),
    ("sweep", "tvrpipe.training.settings:TrainConfig", {}),
    ("extract", "tvrpipe.features.extract:ExtractConfig", {"timeout": "timeout_s"}),
])
def test_help_shows_the_configs_defaults(cli, monkeypatch, command, config, renamed):
    """Each option of a config field takes its default from the config (declared once, there), and --help
    shows that value: change a config's default and the option and its help follow."""
    import dataclasses
    import importlib

    import typer

    from tvrpipe.cli.main import app

    module, name = config.split(":")
    cls = getattr(importlib.import_module(module), name)
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    params = {p.name: p for p in typer.main.get_command(app).commands[command].params}
    bound = {p: renamed.get(p, p) for p in params if renamed.get(p, p) in defaults}
    assert len(bound) >= 6, sorted(bound)
    monkeypatch.setenv("COLUMNS", "250")
    blocks: dict[str, str] = {}  # each option's rows of the help table, joined
    for line in cli(command, "--help").output.splitlines():
        cells = line.split()
        if cells and line.startswith("  --"):  # an option's first line; its help's further lines are indented more
            option = cells[0]
            blocks[option] = ""
        if cells and blocks:
            blocks[option] += " " + " ".join(cells)
    for param, field in bound.items():
        assert params[param].default == defaults[field], (command, param)
        value = defaults[field]
        if value is None or isinstance(value, bool):
            continue  # None: the help says what stands in; a flag shows its name
        shown = blocks[f"--{param.replace('_', '-')}"]
        assert f"[default: {value}]" in shown, (command, param, shown)


@pytest.mark.parametrize("command, function, renamed", [
    (("bench", "finetune"), "tvrpipe.bench.finetune:bench_finetune", {}),
    (("bench", "extract"), "tvrpipe.bench.extract:bench_extract", {}),
    (("bench", "train-head"), "tvrpipe.bench.heads:bench_train_head", {}),
    (("bench", "eval"), "tvrpipe.bench.heads:bench_eval", {}),
    (("bench", "allocator"), "tvrpipe.bench.heads:bench_allocator", {}),
    (("synth",), "tvrpipe.worlds.videos:synthesize", {}),
])
def test_commands_without_a_config_take_their_defaults_from_the_function_they_call(command, function, renamed):
    import importlib
    import inspect

    import typer

    from tvrpipe.cli.main import app

    module, name = function.split(":")
    signature = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    defaults = {n: p.default for n, p in signature.items() if p.default is not inspect.Parameter.empty
                and n not in ("progress", "methods", "sizes")}
    cmd = typer.main.get_command(app)
    for part in command:
        cmd = cmd.commands[part]
    params = {p.name: p for p in cmd.params}
    shared = {n for n in defaults if renamed.get(n, n) in params}
    assert len(shared) >= 2, (command, sorted(defaults))
    for n in shared:
        assert params[renamed.get(n, n)].default == defaults[n], (command, n)


def test_a_command_passes_only_the_options_given(tmp_path, monkeypatch, cli):
    """train-head hands fit a TrainConfig built from what was typed alone: the rest are the config's own."""
    import tvrpipe.training.fit as fit_module
    from tvrpipe.training.settings import TrainConfig

    seen = []

    def fit(features, method, out, cfg, *a, **k):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(fit_module, "fit", fit)
    cli("train-head", "--method", "xpool", "--out", tmp_path / "run", "--features", tmp_path, "--patience", "3")
    assert seen == [TrainConfig(patience=3)]


def test_version(cli):
    from tvrpipe import __version__

    r = cli("--version")
    assert r.exit_code == 0 and r.output.strip() == f"tvrpipe {__version__}"


def test_manifest_build_and_show(cli, shared_annotations, tmp_path):
    out = tmp_path / "m"
    r = cli("manifest", "build", "--dataset", "msvd", "--annotations", shared_annotations / "msvd", "--out", out)
    assert r.exit_code == 0, r.output
    assert "27,763" in r.output and "1,200" in r.output
    assert (out / "videos.parquet").is_file() and (out / "captions.parquet").is_file()
    r = cli("manifest", "show", out)
    assert r.exit_code == 0
    assert "670" in r.output and "27,763" in r.output and "12 frames, 32 words" in r.output


def test_manifest_build_videos_and_show(cli, tmp_path):
    """A folder of videos without annotations: a collection, its skipped files counted in a yellow line,
    and `manifest show` says what it is."""
    from tvrpipe.worlds.videos import synthesize

    synthesize(tmp_path / "s", 2, seed=0, progress=False)
    folder = tmp_path / "mine"
    (folder / "trip").mkdir(parents=True)
    for i, p in enumerate(sorted((tmp_path / "s" / "videos").glob("*.mp4"))):
        shutil.copyfile(p, folder / ("trip" if i else ".") / f"clip{i}.mp4")
    (folder / "readme.txt").write_text("x")
    out = tmp_path / "m"
    r = cli("manifest", "build", "--videos", folder, "--out", out)
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert f"collection of 2 videos, no captions -> {out} (2 files probed" in text
    assert "skipped 1 files (0 video files that do not decode, 1 not videos" in text
    assert (out / "files.parquet").is_file()
    r = cli("manifest", "show", out)
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and f"collection, no captions: 2 videos from {folder.resolve()}" in text
    assert "1 files skipped" in text and "12 frames, 32 words" in text


def test_manifest_build_takes_annotations_or_a_folder_of_videos(cli, tmp_path):
    r = cli("manifest", "build", "--videos", tmp_path, "--dataset", "msvd", "--annotations", tmp_path,
            "--out", tmp_path / "m")
    assert r.exit_code == 1
    assert "--videos builds a collection from a folder, without annotations; --dataset, --annotations belong" in \
        " ".join(r.output.split())
    r = cli("manifest", "build", "--dataset", "msvd", "--out", tmp_path / "m")
    assert r.exit_code == 1 and "give --dataset and --annotations" in r.output and "--videos FOLDER" in r.output
    r = cli("manifest", "build", "--videos", tmp_path, "--out", tmp_path / "m")
    assert r.exit_code == 1 and "no video file (" in r.output
    assert not (tmp_path / "m").exists()


def test_manifest_datasets_lists_specs(cli):
    r = cli("manifest", "datasets")
    assert r.exit_code == 0
    for name in ("msrvtt", "msvd", "didemo", "lsmdc", "vatex", "charades", "custom"):
        assert name in r.output


def test_unknown_dataset_is_one_line_exit_1(cli, tmp_path):
    r = cli("manifest", "build", "--dataset", "nope", "--annotations", tmp_path, "--out", tmp_path / "m")
    assert r.exit_code == 1
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown dataset 'nope'")
    assert "Traceback" not in r.output


def test_custom_empty_caption_via_cli(cli, tmp_path):
    pd.DataFrame({"path": ["a.mp4", "b.mp4"], "caption": ["x", ""], "split": ["train", "test"]}).to_csv(
        tmp_path / "t.csv", index=False
    )
    r = cli("manifest", "build", "--dataset", "custom", "--annotations", tmp_path / "t.csv", "--out", tmp_path / "m")
    assert r.exit_code == 1
    assert "t.csv line 3: empty caption" in r.output
    assert not (tmp_path / "m" / "videos.parquet").exists()


def test_show_on_a_folder_without_manifest(cli, tmp_path):
    r = cli("manifest", "show", tmp_path)
    assert r.exit_code == 1
    assert "no manifest here" in r.output and "tvrpipe manifest build" in r.output


def test_wrong_option_is_a_usage_error(cli):
    r = cli("manifest", "build", "--datset", "msvd")
    assert r.exit_code == 2
    assert "No such option" in r.output


def test_console_script_runs_as_a_process(tmp_path):
    # The installed entry point, not just the in-process app: errors exit 1 without a traceback.
    r = subprocess.run(
        [sys.executable, "-m", "tvrpipe", "manifest", "show", str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 1
    assert "error:" in r.stderr and "Traceback" not in r.stderr


def test_synth_via_cli(cli, tmp_path):
    r = cli("synth", "--out", tmp_path / "s", "--videos", "12", "--seed", "3")
    assert r.exit_code == 0, r.output
    assert len(list((tmp_path / "s" / "videos").glob("*.mp4"))) == 12
    r = cli("manifest", "show", tmp_path / "s" / "manifest")
    assert r.exit_code == 0 and "synthetic" in r.output


def test_synth_bad_option_names_it(cli, tmp_path):
    r = cli("synth", "--out", tmp_path / "s", "--videos", "0")
    assert r.exit_code == 1
    assert "--videos must be >= 1" in r.output
    r = cli("synth", "--out", tmp_path / "s", "--videos", "4", "--distractor-fraction", "1.5")
    assert r.exit_code == 1 and "--distractor-fraction" in r.output


def test_quickstart_end_to_end(tmp_path):
    """The README's main command, as a user runs it (a process of its own, Ray included), --fast."""
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import list_heads
    from tvrpipe.worlds.videos import DESCRIPTIVE_TEMPLATES, SHORT_TEMPLATES

    r = subprocess.run([sys.executable, "-m", "tvrpipe", "quickstart", "--out", str(tmp_path / "q"), "--fast",
                        "--videos", "40"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    store = open_store(tmp_path / "q" / "features")
    assert store.array("videos/frames").shape[0] == 40 and store.array("videos/frame_mask")[:].all()
    # the store was extracted with the finetuned CLIP, and every head was trained on it
    export = json.loads((tmp_path / "q" / "finetune" / "metrics.json").read_text())["export"]
    assert store.provenance["weights_sha256"] == export["weights_sha256"]
    results = pd.read_csv(tmp_path / "q" / "results.csv")
    assert sorted(results[results["post"] == "raw"]["method"]) == sorted(["zero-shot", *list_heads()])
    assert set(results["post"]) == {"raw", "dsl"} and results["t2v R@1"].between(0, 100).all()
    # ProTA's scores are negative distances: no DSL row (DSL would invert its ranking), and the table says so
    dsl_rows = sorted(results[results["post"] == "dsl"]["method"])
    assert dsl_rows == sorted(["zero-shot", *set(list_heads()) - {"prota"}])
    assert "no DSL for prota" in " ".join(r.stdout.split())
    # CLIP's own training videos are single-scene; the benchmark has multi-scene videos
    pretrain = pd.read_parquet(tmp_path / "q" / "pretrain" / "attributes.parquet")
    assert (pretrain.groupby("video_id")["scene"].nunique() == 1).all()
    # ... captioned in the short style, the benchmark in the descriptive one: a shift a head can learn
    styles = {d: json.loads((tmp_path / "q" / d / "manifest" / "meta.json").read_text())["synth"]["caption_templates"]
              for d in ("pretrain", "data")}
    assert styles == {"pretrain": list(SHORT_TEMPLATES), "data": list(DESCRIPTIVE_TEMPLATES)}
    for title in ("text-to-video, raw scores", "video-to-text, raw scores", "text-to-video, after DSL"):
        assert title in " ".join(r.stdout.split())
    assert "results.csv" in r.stdout
    # R@1 by difficulty: recomputed from each run's checkpoint, its "all" is the run's test R@1
    difficulty = pd.read_csv(tmp_path / "q" / "difficulty.csv")
    raw = results[results["post"] == "raw"].set_index("method")["t2v R@1"]
    overall = difficulty[difficulty["difficulty"] == "all"].set_index("method")["t2v R@1"]
    assert overall.round(6).to_dict() == raw.round(6).to_dict()
    counts = difficulty.groupby("difficulty")["captions"].first()
    assert counts["all"] == (store.texts["split"] == "test").sum()
    # each caption is plain, multi-scene or near-duplicate (the last two may overlap), never plain and another
    assert counts["plain"] + counts["multi_scene"] + counts["near_duplicate"] >= counts["all"]
    assert counts["plain"] + max(counts["multi_scene"], counts["near_duplicate"]) <= counts["all"]
    assert "text-to-video R@1 by difficulty" in " ".join(r.stdout.split())
    # the report over every run: its raw t2v table holds the results' numbers, and its plots exist
    report = (tmp_path / "q" / "report" / "report.md").read_text()
    assert f"report: {tmp_path / 'q' / 'report' / 'report.md'}" in " ".join(r.stdout.split())
    zero = results[(results["post"] == "raw") & (results["method"] == "zero-shot")].iloc[0]
    assert f"{zero['t2v R@1']:.1f}" in report and "Text-to-video" in report
    for png in ("curves.png", "r1.png", "uncertainty.png", "gallery.png"):
        assert (tmp_path / "q" / "report" / png).stat().st_size > 10_000, png
    # it ends with a search: the best trained head's top 5 for one test caption, and where its video ranks
    found = json.loads((tmp_path / "q" / "search.json").read_text())
    best = results[(results["post"] == "raw") & (results["method"] != "zero-shot")].sort_values(
        ["t2v R@1", "t2v R@5", "t2v R@10"], ascending=False).iloc[0]
    assert found["method"] == best["method"] and len(found["hits"]) == 5 and found["videos"] == 40
    assert [h["rank"] for h in found["hits"]] == [1, 2, 3, 4, 5]
    assert found["found_at"] == next((h["rank"] for h in found["hits"] if h["video_id"] == found["true_video"]), None)
    assert found["query"] in " ".join(r.stdout.split()) and "the caption's video" in r.stdout
    # quiet by default: our progress bars and summaries only, no Ray or open_clip lines
    noise = [line for line in (r.stdout + r.stderr).replace("\r", "\n").splitlines()
             if any(k in line for k in ("INFO", "core_worker", "Token authentication", "WARNING",
                                        "No pretrained weights", "streaming_executor", "Progress bars disabled"))]
    assert not noise, noise


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the whole default quickstart: about 1.5 min alone, several times that on a busy machine
def test_default_quickstart_heads_beat_zero_shot_at_mean_rank(tmp_path):
    """The default quickstart (seed 0): each head with trained parameters ranks the caption's video higher on
    average than zero-shot CLIP does (measured 5.8 to 8.8 against 12.0, docs/quickstart.md)."""
    from tvrpipe.heads.base import list_heads
    from tvrpipe.quickstart import run_quickstart

    run_quickstart(tmp_path / "q", progress=False)
    raw = pd.read_csv(tmp_path / "q" / "results.csv").query("post == 'raw'").set_index("method")["t2v MnR"]
    trained = sorted(set(list_heads()) - {"meanpool", "tokenwise"})
    assert len(trained) == 6 and {m: raw[m] for m in trained if raw[m] >= raw["zero-shot"]} == {}, raw.to_dict()


def test_extract_bad_input_is_one_line(cli, tmp_path):
    cli("synth", "--out", tmp_path / "s", "--videos", "3")
    m, root = tmp_path / "s" / "manifest", tmp_path / "s" / "videos"
    cases = [
        (["--manifest", tmp_path / "nope", "--video-root", root], "no manifest here"),
        (["--manifest", m, "--video-root", tmp_path / "nope"], "--video-root"),
        (["--manifest", m, "--video-root", root, "--device", "tpu"], "--device must be one of cpu, cuda, got 'tpu'"),
        (["--manifest", m, "--video-root", root, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--manifest", m, "--video-root", root, "--encode-frames", "0"],
         "--encode-frames must be auto or a number of frames >= 1, got 0"),
        (["--manifest", m, "--video-root", root, "--encode-frames", "lots"], "got 'lots'"),
        (["--manifest", m, "--video-root", root, "--batch-size", "4", "--encode-frames", "96"],
         "both size the encoder's calls: give one"),
        (["--manifest", m, "--video-root", root, "--frames", "-1"], "--frames must be >= 1, got -1"),
        (["--manifest", m, "--video-root", root, "--frames", "0"], "--frames must be >= 1, got 0"),
        (["--manifest", m, "--video-root", root, "--max-words", "0"], "--max-words must be >= 2, got 0"),
        (["--manifest", m, "--video-root", root, "--decoders", "0"], "--decoders must be >= 1, got 0"),
        (["--manifest", m, "--video-root", root, "--max-failed-fraction", "-0.1"], "--max-failed-fraction must"),
        (["--manifest", m, "--video-root", root, "--dataset", "msrvtt"], "--dataset 'msrvtt' but the manifest"),
        (["--manifest", m, "--video-root", root, "--model", "ViT-Q-99"], "ViT-Q-99"),
        (["--manifest", m, "--video-root", root, "--model", "tvrpipe-tiny", "--pretrained", "/no/such.pt"],
         "checkpoint not found"),
    ]
    for args, message in cases:
        r = cli("extract", *args, "--out", tmp_path / "f")
        assert r.exit_code == 1, (args, r.output)
        assert message in r.output, (args, r.output)
        assert "Traceback" not in r.output
    assert not (tmp_path / "f").exists()  # nothing was started, nothing written


def test_help_lists_extraction_commands(cli):
    r = cli("--help")
    for name in ("extract", "export", "features", "bench"):
        assert name in r.output
    r = cli("extract", "--help")
    assert r.exit_code == 0 and "--pretrained" in r.output and "--address" in r.output


def test_nan_and_infinities_are_refused_wherever_a_finite_number_is_meant(cli, tmp_path):
    """NaN passes every range check (nan > 0 and nan < 0 are both False) and then turns a loss term off
    or a run into NaNs: refused in every float option, every --set, every head config, naming it."""
    nowhere = tmp_path / "none"
    for args in (["train-head", "--features", nowhere, "--method", "xpool", "--out", tmp_path / "r", "--lr", "nan"],
                 ["finetune", "--method", "xpool", "--manifest", nowhere, "--video-root", nowhere, "--out",
                  tmp_path / "f", "--head-lr", "inf"],
                 ["extract", "--manifest", nowhere, "--video-root", nowhere, "--out", tmp_path / "s",
                  "--max-failed-fraction", "nan"],
                 ["sweep", "--features", nowhere, "--methods", "xpool", "--out", tmp_path / "w", "--cpus-per-run", "-inf"]):
        r = cli(*args)
        text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.output).split())  # the usage error's box, unwrapped
        assert r.exit_code == 2 and f"Invalid value for '{args[-2]}': '{args[-1]}': a finite number is needed " \
            "(not NaN or an infinity)" in text, (args, r.output)
        assert not (tmp_path / "r").exists() and not (tmp_path / "f").exists()
    for method, item in (("tmass", "alpha=nan"), ("duq", "uncertainty_weight=NaN"), ("prota", "margin_weight=nan"),
                         ("xpool", "logit_scale_init=nan"), ("prota", "kl_weight=inf")):
        r = cli("train-head", "--features", nowhere, "--method", method, "--out", tmp_path / "r", "--set", item)
        assert r.exit_code == 1, r.output
        assert f"error: --set {item}: it must be a finite number (not NaN or an infinity)" in " ".join(r.output.split())
        assert not (tmp_path / "r").exists()
    r = cli("train-head", "--features", nowhere, "--method", "prota", "--out", tmp_path / "r", "--set", "lam=nan")
    assert r.exit_code == 1 and "error: --set lam=nan: NaN is not a value" in " ".join(r.output.split())
    r = cli("sweep", "--features", nowhere, "--methods", "tmass", "--out", tmp_path / "w", "--set", "train.lr=1e-3,nan")
    assert r.exit_code == 1 and "--set train.lr=nan: it must be a finite number" in " ".join(r.output.split()), r.output


def _build_custom(cli, table, out):
    r = cli("manifest", "build", "--dataset", "custom", "--annotations", table, "--out", out)
    return r, " ".join(r.output.split())


def test_custom_csv_is_read_strictly(cli, tmp_path):
    """A row with a field more than the header (an unquoted comma in a caption) is an error naming the
    line, never columns shifted by one; a UTF-8 BOM is read as such; invisible-only captions are empty."""
    bad = tmp_path / "bad.csv"
    bad.write_text("path,caption,split\na.mp4,a cat,train\nb.mp4,a red, round ball,test\n")
    r, text = _build_custom(cli, bad, tmp_path / "m")
    assert r.exit_code == 1 and f"{bad} line 3: 4 fields, but the header has 3 (path, caption, split); a field " \
        "that holds the delimiter (',') must be quoted" in text, r.output
    assert not (tmp_path / "m").exists()
    bom = tmp_path / "bom.csv"
    bom.write_bytes('path,caption,split\na.mp4,a cat,train\nb.mp4,"a red, round ball",test\n'.encode("utf-8-sig"))
    r, _ = _build_custom(cli, bom, tmp_path / "m")
    assert r.exit_code == 0, r.output
    captions = pd.read_parquet(tmp_path / "m" / "captions.parquet")
    assert list(captions.text) == ["a cat", "a red, round ball"]
    ghost = tmp_path / "ghost.csv"
    ghost.write_text("path,caption,split\na.mp4,a cat,train\nb.mp4,\u200b \u200d\ufeff,test\n")
    r, text = _build_custom(cli, ghost, tmp_path / "g")
    assert r.exit_code == 1 and f"{ghost} line 3: empty caption (only invisible characters)" in text, r.output
    clip = tmp_path / "clip.csv"
    clip.write_text("path,caption,split,start_s,end_s\na.mp4,a cat,train,0,abc\nb.mp4,a dog,test,,\n")
    r, text = _build_custom(cli, clip, tmp_path / "c")
    assert r.exit_code == 1 and f"{clip} line 2: end_s 'abc' is not a number of seconds" in text, r.output


def test_custom_parquet_values_of_the_wrong_kind_are_refused_not_coerced(cli, tmp_path):
    base = {"path": ["a.mp4", "b.mp4"], "caption": ["a cat", "a dog"], "split": ["train", "test"]}
    for change, message in (({"caption": ["a cat", None]}, "row 1: empty caption"),
                            ({"caption": [1.5, 2.5]}, "column 'caption' holds numbers (double), not text"),
                            ({"caption": [["a", "b"], ["c"]]}, "column 'caption' holds lists (list<"),
                            ({"start_s": ["0", "x"], "end_s": [1.0, 2.0]}, "column 'start_s' holds text, not numbers of seconds")):
        table = tmp_path / "t.parquet"
        pd.DataFrame({**base, **change}).to_parquet(table)
        r, text = _build_custom(cli, table, tmp_path / "m")
        assert r.exit_code == 1 and message in text, (change, r.output)
        assert not (tmp_path / "m").exists()
    pd.DataFrame({**base, "video_id": ["first", None], "start_s": [0.0, float("nan")],
                  "end_s": [2.0, float("nan")]}).to_parquet(tmp_path / "t.parquet")
    r, _ = _build_custom(cli, tmp_path / "t.parquet", tmp_path / "m")
    assert r.exit_code == 0, r.output
    videos = pd.read_parquet(tmp_path / "m" / "videos.parquet").set_index("video_id")
    assert list(videos.index) == ["first", "b"]  # a null id is the documented default, the path's stem
    assert videos.loc["first", "end_s"] == 2.0 and pd.isna(videos.loc["b", "start_s"])


def test_manifest_paths_stay_inside_the_video_root(cli, tmp_path):
    for path in ("../../etc/passwd", "/etc/passwd", "a/../../x.mp4"):
        table = tmp_path / "t.csv"
        pd.DataFrame({"path": ["ok/a.mp4", path], "caption": ["a cat", "a dog"],
                      "split": ["train", "test"]}).to_csv(table, index=False)
        r, text = _build_custom(cli, table, tmp_path / "m")
        assert r.exit_code == 1 and f"leaves the video root ({path!r})" in text, (path, r.output)
    pd.DataFrame({"path": ["ok/a.mp4", "ok/../b.mp4"], "caption": ["a cat", "a dog"],
                  "split": ["train", "test"]}).to_csv(table, index=False)
    assert _build_custom(cli, table, tmp_path / "m")[0].exit_code == 0


def test_export_into_its_own_store_is_refused_and_repair_hints_name_a_command(cli, tmp_path):
    from tvrpipe.features.store import open_store
    from tvrpipe.worlds.features import GenSpec, generate_store

    store = generate_store(tmp_path / "s", GenSpec(train_videos=8, test_videos=4, frames=4, max_words=6,
                                                   embed_dim=8, seed=0))
    before = (store / "videos.parquet").read_bytes()
    for inside in (store / "videos.parquet", store / "features.zarr" / "x.h5", store / "sub" / "f.h5"):
        r = cli("export", "--features", store, "--out", inside)
        text = " ".join(r.output.split())
        assert r.exit_code == 1 and f"--out {inside} is inside the feature store {store}" in text, r.output
    assert (store / "videos.parquet").read_bytes() == before and not (store / "sub").exists()
    open_store(store)  # still whole
    (store / "features.zarr" / "videos" / "frames" / "c" / "0" / "0" / "0").unlink()
    r = cli("features", "show", store)
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "repair it by running `tvrpipe synth --features-only` again" in text, r.output


# SIGTERM takes the same path as SIGINT with its own exit code: the slower half of the pair runs in `make test-all`
@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted"),
                                             pytest.param(signal.SIGTERM, 143, "terminated", marks=pytest.mark.slow)])
def test_a_signal_says_so_and_the_same_command_resumes(tmp_path, sig, code, word):
    """Ctrl-C or SIGTERM (a scheduler's preemption): one line saying what to do, the conventional exit code,
    and the same command resumes from the last finished epoch."""
    import time

    from tvrpipe.worlds.features import GenSpec, generate_store

    store = generate_store(tmp_path / "s", GenSpec(train_videos=64, test_videos=8, frames=4, max_words=6,
                                                   embed_dim=16, seed=0))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tvrpipe", "train-head", "--features", str(store), "--method", "meanpool",
           "--out", str(run), "--epochs", "60", "--batch-size", "8"]
    # SIGINT as a terminal delivers it: a suite started in the background by a non-interactive shell has
    # SIGINT ignored, and its children inherit that (Ctrl-C could not reach them either)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (run / "epochs.csv").is_file() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, (p.returncode, err)
    assert f"{word}" in err and "what was finished is kept; rerun the same command to resume" in " ".join(err.split())
    assert "Traceback" not in err
    done = len(pd.read_csv(run / "epochs.csv"))
    assert 1 <= done < 60
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(pd.read_csv(run / "epochs.csv")) == 60


@pytest.mark.parametrize("where, error", [
    ("save_file", Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                            '"No space left on device" })')),  # safetensors' SafetensorError on a full disk
    ("torch_save", RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                                "file data/0: file write failed")),  # torch.save's on a full disk
])
def test_a_full_disk_is_one_line_naming_the_file(cli, tmp_path, monkeypatch, where, error):
    """Whatever a library raises when the disk fills becomes one line naming the file, never a traceback."""
    import safetensors.torch
    import torch

    from tvrpipe.worlds.features import GenSpec, generate_store

    store = generate_store(tmp_path / "s", GenSpec(train_videos=16, test_videos=4, frames=4, max_words=6,
                                                   embed_dim=8, seed=0))

    def full(*a, **k):
        raise error

    if where == "save_file":
        monkeypatch.setattr(safetensors.torch, "save_file", full)
        name = "best.safetensors"  # the first weights written: the untrained head's, which selection compares
    else:
        monkeypatch.setattr(torch, "save", full)
        name = "state.pt"
    r = cli("train-head", "--features", store, "--method", "meanpool", "--out", tmp_path / "run", "--epochs", "1")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    # the file named is the one being written (a checkpoint is staged as .NAME.next, then committed)
    assert re.search(rf"{re.escape(str(tmp_path / 'run' / 'checkpoints'))}/\.?{re.escape(name)}(\.next)?: cannot write "
                     r"it \(no space left on the device\); make room on the disk", text), r.output


def test_export_checks_the_room_it_needs_before_writing(cli, tmp_path, monkeypatch):
    import shutil as sh
    from collections import namedtuple

    from tvrpipe.worlds.features import GenSpec, generate_store

    store = generate_store(tmp_path / "s", GenSpec(train_videos=16, test_videos=4, frames=4, max_words=6,
                                                   embed_dim=8, seed=0))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 1 << 20))
    r = cli("export", "--features", store, "--out", tmp_path / "f.h5")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and f"--out {tmp_path / 'f.h5'}: the export needs about 0.02 GB and" in text, r.output
    assert "0.00 GB free" in text and not list(tmp_path.glob("*f.h5*"))


def test_given_fields_passes_the_options_given_that_name_a_config_field():
    import dataclasses

    from typer.testing import CliRunner

    from tvrpipe.cli.app import given_fields

    @dataclasses.dataclass
    class Cfg:
        lr: float = 1e-3
        timeout_s: float = 5.0
        group_lr: dict = dataclasses.field(default_factory=dict)

    got = {}
    app = typer.Typer()

    @app.command()
    def cmd(ctx: typer.Context, lr: float = 1e-3, timeout: float = 5.0, group_lr: list[str] = [],  # noqa: B006
            out: str = "o") -> None:
        got.update(given_fields(ctx, Cfg, {"timeout": "timeout_s"},
                                {"group_lr": lambda v: dict(x.split("=") for x in v)}))

    runner = CliRunner()
    assert runner.invoke(app, ["--out", "x"]).exit_code == 0 and got == {}  # defaults and non-fields stay out
    assert runner.invoke(app, ["--lr", "0.5", "--timeout", "9", "--group-lr", "head=1"]).exit_code == 0
    assert got == {"lr": 0.5, "timeout_s": 9.0, "group_lr": {"head": "1"}}
