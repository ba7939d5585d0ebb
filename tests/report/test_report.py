"""tvrpipe report: tables equal the runs' metrics, seeds aggregate, plots and the gallery are real."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from tvrpipe.errors import ConfigError
from tvrpipe.evaluation.engine import EvalInputs, EvalOptions, evaluate_head
from tvrpipe.evaluation.metrics import (
    bootstrap_recall,
    paired_recall_difference,
    retrieval_metrics,
    t2v_ranks,
)
from tvrpipe.features.store import StoreWriter, make_provenance, manifest_sha256, open_store
from tvrpipe.report import find_runs, gallery_data, group_runs, write_report
from tvrpipe.rundir import load_head
from tvrpipe.training.data import load_splits
from tvrpipe.training.fit import TrainConfig, fit
from tvrpipe.worlds.features import GenSpec, generate_store
from tvrpipe.worlds.videos import synthesize

METRICS = ("R@1", "R@5", "R@10", "MdR", "MnR")
GREEN = np.array([0x1A, 0x9E, 0x3A])  # the gallery's frame around the correct video


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A sweep-like folder on a tiny generated store: xpool with seeds 0 and 1, a probabilistic head
    (tmass: readouts), duq (a head re-ranking), all with DSL; an untrained meanpool without post."""
    root = tmp_path_factory.mktemp("report")
    spec = GenSpec(train_videos=40, test_videos=12, captions_per_train_video=2, frames=4, max_words=6,
                   embed_dim=16, seed=0)
    store = generate_store(root / "store", spec, video_shard=32, text_shard=64)
    base = TrainConfig(epochs=2, batch_size=16)
    for method, seed in (("xpool", 0), ("xpool", 1), ("tmass", 0), ("duq", 0)):
        fit(store, method, root / "runs" / method / f"seed{seed}", dataclasses.replace(base, seed=seed),
            post=("dsl",), progress=False)
    fit(store, "meanpool", root / "runs" / "zero-shot", TrainConfig(epochs=0), progress=False)
    return root / "runs"


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "report"
    assert write_report([runs], out) == out / "report.md"
    return out


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _tables(md: str) -> dict[str, dict[str, list[list[str]]]]:
    """``{## section: {### heading: [cells of each body row]}}`` of a report.md."""
    out: dict[str, dict[str, list[list[str]]]] = {}
    section = heading = None
    for line in md.splitlines():
        if line.startswith("## "):
            section, heading = line[3:], None
            out[section] = {}
        elif line.startswith("### "):
            heading = line[4:]
            out[section][heading] = []
        elif line.startswith("|") and heading and not line.startswith(("| Method", "|---")):
            out[section][heading].append([c.strip().strip("*") for c in line.strip("|").split("|")])
    return out


def _row(table: list[list[str]], label: str) -> list[str]:
    rows = [r for r in table if r[0] == label]
    assert len(rows) == 1, (label, table)
    return rows[0]


def _section(report: Path) -> dict[str, list[list[str]]]:
    tables = _tables((report / "report.md").read_text())
    assert "synthetic-features (split set generated)" in tables, list(tables)
    return tables["synthetic-features (split set generated)"]


def test_single_run_rows_equal_metrics_json(report, runs):
    s = _section(report)
    for label, run in (("tmass", runs / "tmass" / "seed0"), ("duq", runs / "duq" / "seed0"),
                       ("meanpool", runs / "zero-shot")):
        test = _metrics(run)["test"]
        ranks = np.load(run / "test_ranks.npz")
        for direction, name in (("t2v", "Text-to-video"), ("v2t", "Video-to-text")):
            row = _row(s[f"{name}, raw scores"], label)
            assert row[1] == "1"
            lo, hi = bootstrap_recall(ranks[direction], k=1)  # a run of one seed: its interval over the queries
            cells = [f"{test[direction][m]:.1f}" for m in METRICS]
            assert [c.replace("**", "") for c in row[2:]] == [f"{cells[0]} [{lo:.1f}, {hi:.1f}]", *cells[1:]], \
                (label, direction)


def test_test_ranks_are_the_runs_test_scores_and_the_intervals_match_an_independent_bootstrap(report, runs):
    """test_ranks.npz holds the ranks behind metrics.json's test scores, in the split's query order; the
    report's intervals agree with a bootstrap written here (other draws, 20,000 of them) to within the
    resampling noise of 2,000 draws, and each paired difference is the two runs' R@1 difference, marked
    within noise exactly where its interval covers 0."""
    run = runs / "tmass" / "seed0"
    ranks, test = np.load(run / "test_ranks.npz"), _metrics(run)["test"]
    for direction in ("t2v", "v2t"):
        assert retrieval_metrics(ranks[direction]) == test[direction]
        rng = np.random.default_rng(12345)
        hits = ranks[direction] <= 1
        draws = [100.0 * hits[rng.integers(0, len(hits), len(hits))].mean() for _ in range(20000)]
        want = np.percentile(draws, [2.5, 97.5])
        step = 100.0 / len(hits)  # R@1 moves in steps of one query
        np.testing.assert_allclose(bootstrap_recall(ranks[direction]), want, atol=step + 1e-9)
    assert len(ranks["caption_ids"]) == test["t2v"]["n"] and len(ranks["video_ids"]) == test["n_videos"]
    s = _section(report)
    paired = s["Which differences are noise: Text-to-video, raw R@1"]
    rows = {(r[0], r[1]): r for r in paired if r[0] != "a"}
    labels = {"tmass": runs / "tmass" / "seed0", "duq": runs / "duq" / "seed0", "meanpool": runs / "zero-shot"}
    assert {frozenset(k) for k in rows} == {frozenset(p) for p in (("tmass", "duq"), ("tmass", "meanpool"),
                                                                    ("duq", "meanpool"))}
    for (a, b), r in rows.items():
        ra, rb = (np.load(labels[x] / "test_ranks.npz")["t2v"] for x in (a, b))
        d, lo, hi = paired_recall_difference(ra, rb, k=1)
        assert d == pytest.approx(_metrics(labels[a])["test"]["t2v"]["R@1"] - _metrics(labels[b])["test"]["t2v"]["R@1"])
        assert r[2:5] == [f"{d:+.1f}", f"[{lo:+.1f}, {hi:+.1f}]", "within noise" if lo <= 0 <= hi else
                          ("a higher" if lo > 0 else "b higher")]


def test_seeds_form_one_row_with_mean_and_sample_std(report, runs):
    s = _section(report)
    per_seed = [_metrics(runs / "xpool" / f"seed{k}")["test"] for k in (0, 1)]
    for direction, name in (("t2v", "Text-to-video"), ("v2t", "Video-to-text")):
        row = _row(s[f"{name}, raw scores"], "xpool")
        assert row[1] == "2"
        for m, cell in zip(METRICS, row[2:]):
            v = np.array([t[direction][m] for t in per_seed])
            assert cell == f"{v.mean():.1f} ± {v.std(ddof=1):.1f}", (direction, m)
    csv = pd.read_csv(report / "report.csv")
    rec = csv[(csv["row"] == "xpool") & (csv["scores"] == "raw") & (csv["direction"] == "t2v")].iloc[0]
    v = np.array([t["t2v"]["R@1"] for t in per_seed])
    assert rec["seeds"] == 2 and rec["R@1"] == pytest.approx(v.mean())
    assert rec["R@1 std"] == pytest.approx(v.std(ddof=1))
    runs_table = s["Runs"]
    assert sorted(r[1] for r in runs_table if r[0] == "xpool") == ["0", "1"]
    assert _row(runs_table, "tmass")[2] == str(_metrics(runs / "tmass" / "seed0")["selected_epoch"])
    # the software each run was trained with, as its config.yaml records it
    from tvrpipe.environment import versions, versions_text
    assert _row(runs_table, "tmass")[4] == "cpu, in memory"  # how it ran
    assert _row(runs_table, "tmass")[5] == versions_text(versions()).replace("|", "\\|")
    assert rec["versions"] == versions_text(versions()) and rec["ran with"] == "cpu, in memory"


def test_raw_dsl_and_rerank_tables_apart(report, runs):
    s = _section(report)
    headings = list(s)
    raw = headings.index("Text-to-video, raw scores")
    dsl = headings.index("Text-to-video, after DSL")
    rerank = headings.index("Text-to-video, after the head's re-ranking")
    assert raw < dsl < rerank
    xpool = [_metrics(runs / "xpool" / f"seed{k}")["test"] for k in (0, 1)]
    v = np.array([t["t2v_dsl"]["R@1"] for t in xpool])
    assert _row(s[headings[dsl]], "xpool")[2] == f"{v.mean():.1f} ± {v.std(ddof=1):.1f}"
    duq = _metrics(runs / "duq" / "seed0")["test"]
    assert _row(s[headings[rerank]], "duq")[2:] == [f"{duq['t2v_rerank'][m]:.1f}" for m in METRICS]
    assert [r[0] for r in s[headings[rerank]]] == ["duq"]  # only the head that re-ranks
    # the untrained meanpool ran without --post: it is in the raw table only
    assert "meanpool" in [r[0] for r in s[headings[raw]]]
    assert "meanpool" not in [r[0] for r in s[headings[dsl]]]


def test_readouts_of_probabilistic_heads(report, runs):
    s = _section(report)
    table = s["Uncertainty readouts (test split)"]
    readouts = _metrics(runs / "tmass" / "seed0")["test"]["readouts"]
    name, kinds = next(iter(readouts.items()))
    kind, value = next(iter(kinds.items()))
    assert [r[2] for r in table if r[0] == "tmass" and r[1] == f"{name} ({kind})"] == [f"{value:.4f}"]
    assert not [r for r in table if r[0] in ("xpool", "meanpool")]


def _image(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.mark.parametrize("name", ["curves.png", "r1.png", "uncertainty.png"])
def test_plots_are_real_images(report, name):
    img = _image(report / name)
    assert img.shape[0] >= 300 and img.shape[1] >= 400, img.shape
    assert img.reshape(-1, 3).std(0).max() > 10  # not a blank canvas
    assert f"![{name}]({name})" in (report / "report.md").read_text()


def test_variants_copies_incomplete_and_plots_without_readouts(runs, tmp_path):
    """A num_heads=2 row (its metrics edited for a known seed spread), a copy, an unfinished run."""
    src = runs / "xpool" / "seed0"
    for k, r1 in ((0, 10.0), (1, 13.0)):  # num_heads=2, seeds 0 and 1, with known test R@1
        dst = tmp_path / "runs" / f"heads2-{k}"
        fit(runs.parent / "store", "xpool", dst, TrainConfig(epochs=2, batch_size=16, seed=k), {"num_heads": 2},
            progress=False)
        m = _metrics(dst)
        m["test"]["t2v"]["R@1"] = r1
        (dst / "metrics.json").write_text(json.dumps(m))
    shutil.copytree(src, tmp_path / "runs" / "default")
    shutil.copytree(src, tmp_path / "runs" / "unfinished")
    (tmp_path / "runs" / "unfinished" / "metrics.json").unlink()
    (tmp_path / "runs" / "notes").mkdir()  # not a run: ignored

    found, skipped = find_runs([tmp_path / "runs"])
    assert len(found) == 3
    assert [s.dir.name for s in skipped] == ["unfinished"] and "no metrics.json" in skipped[0].reason
    [section] = group_runs(found)
    assert [(r.label, len(r.runs)) for r in section.rows] == [("xpool (num_heads=1)", 1), ("xpool (num_heads=2)", 2)]

    out = write_report([tmp_path / "runs"], tmp_path / "rep")
    md = out.read_text()
    row = _row(_tables(md)["synthetic-features (split set generated)"]["Text-to-video, raw scores"],
               "xpool (num_heads=2)")
    assert row[1:3] == ["2", f"11.5 ± {np.std([10.0, 13.0], ddof=1):.1f}"]  # sample std: 2.1, not 1.5
    assert re.search(r"## Skipped\n\n- `[^`]*unfinished`: unfinished: no metrics.json", md)
    assert not (tmp_path / "rep" / "uncertainty.png").exists()  # xpool logs no readouts
    assert "uncertainty: no run logs uncertainty readouts" in md


def test_execution_settings_never_split_a_row_and_show_in_the_runs_table(runs, tmp_path):
    """Runs that differ only in how they ran (memory budget and the data mode it chose, device, prefetch, evaluation
    batches; finetune's workers and GPU) are one row, and one configuration change still splits them."""
    def copy(src: Path, name: str, edit) -> None:
        dst = tmp_path / "runs" / name
        shutil.copytree(src, dst)
        cfg = yaml.safe_load((dst / "config.yaml").read_text())
        edit(cfg)
        (dst / "config.yaml").write_text(yaml.safe_dump(cfg))

    def streamed(cfg):
        cfg["train"]["memory_budget"] = 2_000_000
        cfg["data"] = {**cfg["data"], "mode": "streamed", "budget": "0.00 GB (--memory-budget)"}

    def elsewhere(cfg):
        cfg["train"].update(prefetch=False, eval_batch=7, block_texts=5)

    def other_lr(cfg):
        cfg["train"]["weight_decay"] = 0.5

    copy(runs / "xpool" / "seed0", "in-memory", lambda cfg: None)
    copy(runs / "xpool" / "seed0", "streamed", streamed)
    copy(runs / "xpool" / "seed1", "no-prefetch", elsewhere)
    copy(runs / "xpool" / "seed1", "decayed", other_lr)
    [section] = group_runs(find_runs([tmp_path / "runs"])[0])
    assert [(r.label, len(r.runs)) for r in section.rows] == [("xpool (weight_decay=0.2)", 3),
                                                               ("xpool (weight_decay=0.5)", 1)]
    md = write_report([tmp_path / "runs"], tmp_path / "rep").read_text()
    runs_table = [line for line in md.splitlines() if line.startswith("| xpool (weight_decay=0.2) |")
                  and "config" not in line and "ran with" not in line]
    ran_with = sorted(line.split("|")[5].strip() for line in runs_table if "/runs/" in line or "runs/" in line)
    assert ran_with == ["cpu, in memory", "cpu, in memory, no prefetch", "cpu, streamed, memory_budget=2.0 MB"], md
    ft = {"end_to_end": True, "model": "ViT-B-32", "epochs": 5, "seed": 0}
    for name, execution in (("ft-1", {"num_workers": 0, "use_gpu": False}),
                            ("ft-2", {"num_workers": 2, "use_gpu": True, "eval_batch": 8})):
        copy(runs / "xpool" / "seed0", name, lambda cfg, e=execution: (
            cfg.pop("train"), cfg.update(finetune=dict(ft), execution=e, features=None)))
    rows = group_runs(find_runs([tmp_path / "runs"])[0])[0].rows
    assert [(r.label, len(r.runs)) for r in rows if "finetune" in r.label] == [("xpool (finetune end-to-end)", 2)]


def test_finetune_run_shares_the_dataset_and_is_named_by_mode(runs, tmp_path):
    """A finetune run (no store; its manifest names the dataset) sits beside train-head runs of the same
    manifest, in the same section, as a row of its own."""
    (tmp_path / "manifest").mkdir()
    (tmp_path / "manifest" / "meta.json").write_text(json.dumps({"dataset": "synthetic-features",
                                                                   "split_set": "generated"}))
    dst = tmp_path / "runs" / "xpool-e2e"
    shutil.copytree(runs / "xpool" / "seed0", dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["finetune"] = {"end_to_end": True, "model": "ViT-B-32", "epochs": 5, "seed": 0}
    del cfg["train"]
    cfg.update(features=None, manifest=str(tmp_path / "manifest"), video_root=str(tmp_path / "videos"))
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    found, _ = find_runs([tmp_path / "runs", runs / "xpool"])
    [section] = group_runs(found)
    assert section.title == "synthetic-features (split set generated)"
    assert [(r.label, len(r.runs)) for r in section.rows] == [("xpool (finetune end-to-end)", 1),
                                                               ("xpool (train-head)", 2)]


def test_damaged_runs_other_default_lrs_and_replaced_stores(runs, tmp_path):
    """Runs trained at two default lrs are two rows; a run whose raw metrics lost a number, or whose
    epochs.csv is gone, is skipped with the reason (it was counted, then dropped from the raw tables
    alone); a run whose store was replaced at its path does not take the new store's dataset; a
    finetune run alone in its section still says it is one."""
    from tvrpipe.report.runs import _dataset_of

    src = runs / "xpool"
    for name, seed in (("a", "seed0"), ("b", "seed1"), ("lost-r1", "seed0"), ("no-log", "seed0")):
        shutil.copytree(src / seed, tmp_path / "runs" / name)
    cfg = yaml.safe_load((tmp_path / "runs" / "b" / "config.yaml").read_text())
    assert cfg["train"]["lr"] is None and cfg["resolved"]["lr"] == 1e-3
    cfg["resolved"]["lr"] = 1e-2  # trained without --lr when xpool's default_lr was 1e-2
    cfg["resolved"]["lr_groups"]["head"]["lr"] = 1e-2  # the rate its one group trained at
    (tmp_path / "runs" / "b" / "config.yaml").write_text(yaml.safe_dump(cfg))
    m = _metrics(tmp_path / "runs" / "lost-r1")
    del m["test"]["t2v"]["R@1"]
    (tmp_path / "runs" / "lost-r1" / "metrics.json").write_text(json.dumps(m))
    (tmp_path / "runs" / "no-log" / "epochs.csv").unlink()
    found, skipped = find_runs([tmp_path / "runs"])
    reasons = {s.dir.name: s.reason for s in skipped}
    assert reasons["lost-r1"].endswith("metrics.json is damaged: no test t2v R@1")
    assert "epochs.csv is missing" in reasons["no-log"] and "says 2 epochs ran" in reasons["no-log"]
    [section] = group_runs(found)
    assert [(r.label, len(r.runs)) for r in section.rows] == [("xpool (lr=0.001)", 1), ("xpool (lr=0.01)", 1)]

    cfg = yaml.safe_load((src / "seed0" / "config.yaml").read_text())
    assert _dataset_of(cfg) == ("synthetic-features", "generated")
    cfg["provenance"]["manifest_sha256"] = "0" * 64  # trained on a store since replaced at that path
    assert _dataset_of(cfg) == ("?", None)
    from tvrpipe.data.manifest import make_tables, write_manifest
    from tvrpipe.features.store import manifest_sha256

    v, c = make_tables([{"video_id": "a", "path": "a.mp4", "split": "test"}],
                       [{"caption_id": "a#0", "video_id": "a", "text": "x", "split": "test"}])
    write_manifest(tmp_path / "manifest", v, c, {"dataset": "msvd", "split_set": "standard"})
    finetuned = {"manifest": str(tmp_path / "manifest"), "provenance": {"manifest_sha256": manifest_sha256(v, c)}}
    assert _dataset_of(finetuned) == ("msvd", "standard")  # a finetune run: the manifest names it
    finetuned["provenance"]["manifest_sha256"] = "0" * 64  # the manifest was rewritten since
    assert _dataset_of(finetuned) == ("?", None)

    dst = tmp_path / "alone" / "e2e"
    shutil.copytree(src / "seed0", dst)
    cfg = yaml.safe_load((dst / "config.yaml").read_text())
    cfg["finetune"] = {"end_to_end": True, "model": "ViT-B-32", "epochs": 5, "seed": 0}
    del cfg["train"]
    cfg.update(features=None, manifest=str(tmp_path / "nowhere"), video_root=str(tmp_path / "videos"))
    (dst / "config.yaml").write_text(yaml.safe_dump(cfg))
    [section] = group_runs(find_runs([tmp_path / "alone"])[0])
    assert [r.label for r in section.rows] == ["xpool (finetune end-to-end)"]


def test_paths_without_runs_are_errors(tmp_path, runs):
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"empty: no runs here"):
        write_report([runs, tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(ConfigError, match=r"missing: no such run directory"):
        find_runs([tmp_path / "missing"])
    only = tmp_path / "only-unfinished"
    shutil.copytree(runs / "tmass" / "seed0", only)
    (only / "metrics.json").unlink()
    with pytest.raises(ConfigError, match=r"no finished runs under .*no metrics.json"):
        write_report([only], tmp_path / "out")
    assert not (tmp_path / "out" / "report.md").exists()


def test_cli_end_to_end(cli, runs, tmp_path):
    res = cli("report", runs / "xpool", runs / "zero-shot", "--out", tmp_path / "rep")
    assert res.exit_code == 0, res.output
    assert "report.md" in res.output and (tmp_path / "rep" / "report.csv").is_file()
    csv = pd.read_csv(tmp_path / "rep" / "report.csv")
    assert sorted(set(csv["row"])) == ["meanpool", "xpool"]
    bad = cli("report", tmp_path / "nowhere")
    assert bad.exit_code == 1 and "nowhere: no such run directory" in bad.output
    assert "Traceback" not in bad.output
    helptext = cli("report", "--help").output
    for option in ("--out", "--video-root", "--manifest", "--gallery-run", "--queries", "--seed"):
        assert option in helptext


# ------------------------------------------------------------------------------------ the gallery

F, L, D = 4, 6, 16


def _store_for(manifest, out: Path) -> Path:
    """A feature store over the synthetic videos' manifest: each caption's sentence embedding is its
    video's latent plus noise, so a trained-for-nothing meanpool retrieves it near the top."""
    rng = np.random.default_rng(0)
    videos = manifest.videos[["video_id", "split", "path"]]
    row = {v: i for i, v in enumerate(videos["video_id"])}
    texts = manifest.captions.assign(video_row=manifest.captions["video_id"].map(row))
    texts = texts[["caption_id", "video_id", "video_row", "split"]]
    latent = rng.normal(size=(len(videos), D))
    prov = make_provenance(dataset="synthetic", split_set="synthetic", model="test-features", pretrained="none",
                           weights_sha256="0" * 64, frames=F, max_words=L, embed_dim=D, frame_sampling="test",
                           image_size=0, preprocessing="test",
                           manifest_sha256=manifest_sha256(manifest.videos, manifest.captions))
    with StoreWriter(out, videos, texts, prov, video_shard=64, text_shard=256) as w:
        for s in w.pending("videos"):
            n = s.stop - s.start
            frames = latent[s.start:s.stop, None, :] + 0.3 * rng.normal(size=(n, F, D))
            w.write_videos(s, frames, np.ones((n, F), bool), np.zeros((n, F)), [])
        for s in w.pending("texts"):
            n = s.stop - s.start
            sentence = latent[texts["video_row"].to_numpy()[s.start:s.stop]] + 0.6 * rng.normal(size=(n, D))
            w.write_texts(s, rng.normal(size=(n, L, D)), np.ones((n, L), bool), sentence)
        w.finalize()
    return out


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gallery")
    manifest = synthesize(root / "data", 20, seed=3, split_fractions=(0.5, 0.1, 0.4), progress=False)
    store = _store_for(manifest, root / "features")
    fit(store, "meanpool", root / "runs" / "meanpool", TrainConfig(epochs=0), progress=False)
    return root, manifest


def test_gallery_top5_is_the_ranking_of_the_similarity_matrix(video_run):
    root, manifest = video_run
    run = root / "runs" / "meanpool"
    g = gallery_data(run, manifest=root / "data" / "manifest", queries=4, seed=0)
    assert g.video_root == (root / "data" / "videos").resolve()  # found from the manifest's meta.json
    # independently: the whole test split through the evaluation engine, ranked here
    test = load_splits(open_store(root / "features")).test
    head = load_head(run / "checkpoints" / "best.safetensors")
    sim = evaluate_head(head, EvalInputs(test.text_batches(64), test.video_batches(64), test.text_video),
                        EvalOptions(return_sim=True))["sim"].numpy()
    ranks = t2v_ranks(sim, test.text_video)
    texts = dict(zip(manifest.captions["caption_id"], manifest.captions["text"]))
    assert len(g.queries) == 4 and len({q.caption_id for q in g.queries}) == 4
    for q in g.queries:
        i = list(test.caption_ids).index(q.caption_id)
        order = np.argsort(-sim[i], kind="stable")[:5]
        assert [v for v, _ in q.top] == [test.video_ids[j] for j in order]
        assert [s for _, s in q.top] == pytest.approx(sim[i, order], abs=1e-5)
        assert q.rank == ranks[i] and q.video_id == test.video_ids[test.text_video[i]]
        assert q.score == pytest.approx(sim[i, test.text_video[i]], abs=1e-5)
        assert q.text == texts[q.caption_id]
    again = gallery_data(run, manifest=root / "data" / "manifest", queries=4, seed=0)
    assert [q.caption_id for q in again.queries] == [q.caption_id for q in g.queries]
    other = gallery_data(run, manifest=root / "data" / "manifest", queries=4, seed=1)
    assert [q.caption_id for q in other.queries] != [q.caption_id for q in g.queries]
    fewer = gallery_data(run, manifest=root / "data" / "manifest", queries=2, seed=0)
    assert {q.caption_id for q in fewer.queries} < {q.caption_id for q in g.queries}


def test_gallery_png_marks_the_correct_video(video_run, tmp_path):
    root, _ = video_run
    md = write_report([root / "runs"], tmp_path / "rep", manifest=root / "data" / "manifest", gallery_queries=3)
    img = _image(tmp_path / "rep" / "gallery.png")
    assert img.shape[0] >= 3 * 200 and img.shape[1] >= 800, img.shape
    g = gallery_data(root / "runs" / "meanpool", manifest=root / "data" / "manifest", queries=3, seed=0)
    assert any(q.rank <= 5 for q in g.queries)  # so a green frame must be drawn
    green = (np.abs(img.astype(int) - GREEN).sum(-1) < 30).sum()
    assert green > 500, green
    assert "![gallery.png](gallery.png)" in md.read_text()


def test_gallery_skipped_when_videos_are_unreachable(video_run, tmp_path):
    root, _ = video_run
    (tmp_path / "elsewhere").mkdir()
    md = write_report([root / "runs"], tmp_path / "rep", video_root=tmp_path / "elsewhere").read_text()
    assert not (tmp_path / "rep" / "gallery.png").exists()
    assert f"gallery: videos not reachable under {tmp_path / 'elsewhere'}" in md
    md = write_report([root / "runs"], tmp_path / "rep2").read_text()  # no manifest, no --video-root
    assert "gallery: no video root: pass --video-root" in md


def test_a_copied_run_directory_is_not_a_second_seed(runs, tmp_path, cli):
    """The same configuration, seed and store is one run wherever its directory is: a copy is listed as
    skipped, and the row keeps the seeds it really has."""
    shutil.copytree(runs / "xpool" / "seed0", tmp_path / "copy" / "seed0-again")
    found, skipped = find_runs([runs, tmp_path / "copy"])
    assert sorted(r.seed for r in found if r.method == "xpool") == [0, 1]
    [dup] = skipped
    assert dup.dir == tmp_path / "copy" / "seed0-again" and "the same run as" in dup.reason
    r = cli("report", runs, tmp_path / "copy", "--out", tmp_path / "rep")
    assert r.exit_code == 0, r.output
    s = _tables((tmp_path / "rep" / "report.md").read_text())["synthetic-features (split set generated)"]
    assert _row(s["Text-to-video, raw scores"], "xpool")[1] == "2"


def _copy(src: Path, dst: Path, edit=None, r1: float | None = None) -> Path:
    """A copy of a run, its config.yaml edited by ``edit`` and its test t2v R@1 set to ``r1``."""
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = yaml.safe_load((dst / "config.yaml").read_text())
        edit(cfg)
        (dst / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if r1 is not None:
        m = _metrics(dst)
        m["test"]["t2v"]["R@1"] = r1
        (dst / "metrics.json").write_text(json.dumps(m))
    return dst


def test_a_damaged_config_yaml_is_skipped_naming_the_file_and_key(runs, tmp_path, cli):
    """A run whose config.yaml holds a value of the wrong type, a method or head setting its checkpoint was not
    trained with, or a trainer setting out of its range is listed under Skipped with the reason, never a
    traceback nor a row filed under the edited settings."""
    damaged = {
        "head-text": (lambda c: c.update(head="x"), "head is 'x', not a mapping"),
        "train-text": (lambda c: c.update(train="x"), "train is 'x', not a mapping"),
        "seed-text": (lambda c: c["train"].update(seed="zero"), "train.seed is 'zero', not an integer"),
        "features-number": (lambda c: c.update(features=5), "features is 5, not text or null"),
        "resolved-lr-text": (lambda c: c["resolved"].update(lr="fast"), "resolved.lr is 'fast', not a number or null"),
        "other-method": (lambda c: c.update(method="nope"), "method is 'nope' but the selected checkpoint"),
        "other-head": (lambda c: c["head"].update(num_heads=3), "head.num_heads is 3 but the selected checkpoint"),
        "epochs": (lambda c: c["train"].update(epochs=-3), "train.epochs must be >= 0, got -3"),
    }
    for name, (edit, _) in damaged.items():
        _copy(runs / "xpool" / "seed0", tmp_path / "runs" / name, edit)
    found, skipped = find_runs([runs / "xpool", tmp_path / "runs"])
    assert sorted(r.dir.name for r in found) == ["seed0", "seed1"]
    reasons = {s.dir.name: s.reason for s in skipped}
    for name, (_, message) in damaged.items():
        assert reasons[name].startswith(f"{tmp_path / 'runs' / name / 'config.yaml'}: {message}"), reasons[name]
    r = cli("report", runs / "xpool", tmp_path / "runs", "--out", tmp_path / "rep")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert f"- `{tmp_path / 'runs' / 'head-text'}`: {tmp_path / 'runs' / 'head-text' / 'config.yaml'}: head is 'x'" in md
    assert [row[0] for row in _tables(md)["synthetic-features (split set generated)"]["Text-to-video, raw scores"]] \
        == ["xpool"]


def test_runs_of_one_seed_that_ran_otherwise_are_one_seed(runs, tmp_path):
    """Three runs of seed 0 that differ only in how they ran are repeats of one experiment: the row counts one
    seed, its cell is their mean with no ±, its raw R@1 has the bootstrap interval of its first run by directory
    name, and that run stands for the row in the paired tests."""
    src = runs / "xpool" / "seed0"
    _copy(src, tmp_path / "runs" / "a", r1=10.0)
    _copy(src, tmp_path / "runs" / "b", lambda c: c["train"].update(prefetch=False), r1=13.0)
    _copy(src, tmp_path / "runs" / "c", lambda c: c["train"].update(eval_batch=7), r1=16.0)
    ranks = dict(np.load(src / "test_ranks.npz"))
    ranks["t2v"] = np.where(ranks["t2v"] == 1, 2, ranks["t2v"])  # the first run's own ranks: no query at rank 1
    np.savez(tmp_path / "runs" / "a" / "test_ranks.npz", **ranks)
    other = _copy(runs / "tmass" / "seed0", tmp_path / "runs" / "tmass")
    [section] = group_runs(find_runs([tmp_path / "runs"])[0])
    row = next(r for r in section.rows if r.method == "xpool")
    assert len(row.runs) == 3 and row.seeds == [0] and row.values("raw", "t2v", "R@1") == [13.0]
    assert row.ranked_run("t2v").dir.name == "a"

    md = write_report([tmp_path / "runs"], tmp_path / "rep").read_text()
    s = _tables(md)["synthetic-features (split set generated)"]
    lo, hi = bootstrap_recall(ranks["t2v"], k=1)
    assert (lo, hi) == (0.0, 0.0)
    assert [c.replace("**", "") for c in _row(s["Text-to-video, raw scores"], "xpool")[1:3]] == \
        ["1 (3 runs)", f"13.0 [{lo:.1f}, {hi:.1f}]"]
    v2t = _metrics(src)["test"]["v2t"]["R@1"]
    assert _row(s["Video-to-text, raw scores"], "xpool")[2].replace("**", "").startswith(f"{v2t:.1f} [")  # no ±
    [pair] = [r for r in s["Which differences are noise: Text-to-video, raw R@1"] if r[0] != "a"]
    d, lo, hi = paired_recall_difference(np.load(other / "test_ranks.npz")["t2v"], ranks["t2v"], k=1)
    assert pair[:4] == ["tmass", "xpool", f"{d:+.1f}", f"[{lo:+.1f}, {hi:+.1f}]"]
    csv = pd.read_csv(tmp_path / "rep" / "report.csv")
    rec = csv[(csv["row"] == "xpool") & (csv["scores"] == "raw") & (csv["direction"] == "t2v")].iloc[0]
    assert rec["seeds"] == 1 and rec["R@1"] == pytest.approx(13.0) and np.isnan(rec["R@1 std"])
    assert (rec["R@1 95% low"], rec["R@1 95% high"]) == (0.0, 0.0)


def test_the_memory_budget_is_shown_as_a_size():
    from tvrpipe.report.tables import execution_text

    config = {"train": {"device": "cpu", "memory_budget": 2_147_483_648_000_000}, "data": {"mode": "streamed"}}
    assert execution_text(config) == "cpu, streamed, memory_budget=2,147.48 TB"
    config["train"]["memory_budget"] = 2_150_000_000
    assert execution_text(config) == "cpu, streamed, memory_budget=2.15 GB"
