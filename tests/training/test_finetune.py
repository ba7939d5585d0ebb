"""tvrpipe finetune: live CLIP features, learning from random weights, resume, export, Ray Train."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from tvrpipe.errors import ConfigError
from tvrpipe.heads.base import list_heads
from tvrpipe.training.finetune import FinetuneConfig, finetune
from tvrpipe.training.videodata import TrainPairs, epoch_plan, epoch_steps, frame_offsets

TINY = dict(model="tvrpipe-tiny", pretrained="none", loader_workers=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tvrpipe.worlds.videos import synthesize

    root = tmp_path_factory.mktemp("ftdata")
    synthesize(root, 200, seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def e2e(data, tmp_path_factory):
    """meanpool finetuned end-to-end from random tiny-CLIP weights, then extracted with the export."""
    from tvrpipe.features.extract import ExtractConfig, extract

    out = tmp_path_factory.mktemp("ftrun") / "run"
    cfg = FinetuneConfig(end_to_end=True, epochs=10, epoch_pairs="videos", batch_size=16, clip_lr=1e-3, head_lr=1e-3, **{**TINY, "loader_workers": 2})
    metrics = finetune(data / "manifest", data / "videos", "meanpool", out, cfg, progress=False)
    store = out.parent / "features"
    extract(data / "manifest", data / "videos", store,
            ExtractConfig(model=metrics["export"]["model"], pretrained=str(out / "clip.safetensors"), progress=False))
    return out, metrics, store


def test_learns_from_random_weights(e2e):
    out, metrics, _ = e2e
    rows = pd.read_csv(out / "epochs.csv")
    assert len(rows) == 10
    # selected on validation (R@1, R@5, R@10): the selected epoch has the best validation R@1
    assert rows.loc[metrics["selected_epoch"] - 1, "val_t2v_R@1"] == rows["val_t2v_R@1"].max()
    assert rows["loss"].iloc[-3:].mean() < rows["loss"].iloc[0] - 0.4  # the loss falls
    test = metrics["test"]["t2v"]
    n_videos = metrics["test"]["n_videos"]  # chance: R@k = k / n_videos, MdR about n_videos / 2
    assert test["R@1"] > 2.5 * 100 / n_videos and test["R@5"] > 3 * 500 / n_videos
    assert test["MdR"] <= n_videos / 4
    assert metrics["export"]["file"] == "clip.safetensors" and (out / "clip.safetensors").is_file()


def test_live_features_equal_the_extracted_store(e2e, data):
    """The live CLIP (eval mode) yields exactly what extract stores for the same weights and frames."""
    from tvrpipe.data.manifest import read_manifest
    from tvrpipe.features.clip import load_clip
    from tvrpipe.features.store import open_store
    from tvrpipe.heads.base import create_head
    from tvrpipe.training.live import LiveModel
    from tvrpipe.training.videodata import Collate, DecodedClips, VideoTable

    out, metrics, store_dir = e2e
    store = open_store(store_dir)
    assert store.provenance["weights_sha256"] == metrics["provenance"]["weights_sha256"]
    m = read_manifest(data / "manifest")
    bundle = load_clip(metrics["export"]["model"], str(out / "clip.safetensors"))
    live = LiveModel(bundle, create_head("meanpool", embed_dim=bundle.embed_dim), True, "fp32").eval()
    table = VideoTable(np.array([str(data / "videos" / p) for p in m.videos["path"]], dtype=object),
                       np.full(len(m.videos), np.nan), np.full(len(m.videos), np.nan), m.captions["text"].to_numpy())
    F = store.provenance["frames"]
    ds = DecodedClips(table, F, bundle.image_size, seed=0, timeout_s=60)
    rows = [0, 5, 17, 150]
    batch = Collate(F, bundle.image_size, keep_failed=True)([ds[(r, r, -1)] for r in rows])
    with torch.no_grad():
        texts, videos = live.features(batch.frames, batch.frame_mask, batch.texts, store.provenance["max_words"])
    want_frames = store.array("videos/frames")[:][rows].astype(np.float32)
    assert np.array_equal(store.array("videos/frame_mask")[:][rows], videos.frame_mask.numpy())
    np.testing.assert_allclose(videos.frames.numpy(), want_frames, rtol=2e-3, atol=2e-3)
    assert m.captions["caption_id"].tolist() == store.texts["caption_id"].tolist()
    np.testing.assert_allclose(texts.sentence.numpy(), store.array("texts/sentence")[:][rows].astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(texts.tokens.numpy(), store.array("texts/tokens")[:][rows].astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    assert np.array_equal(texts.token_mask.numpy(), store.array("texts/token_mask")[:][rows])


def test_evaluate_reads_the_finetuned_head_on_the_exported_store(e2e, cli):
    out, metrics, store = e2e
    res = cli("evaluate", "--run", out, "--features", store)
    assert res.exit_code == 0, res.output
    got = json.loads((out / "eval_test.json").read_text())
    for key in ("R@1", "R@5", "R@10", "MnR"):  # the store holds float16: ranks may move on near-ties only
        assert got["t2v"][key] == pytest.approx(metrics["test"]["t2v"][key], abs=2.0)
    res = cli("evaluate", "--run", out)
    assert res.exit_code == 1 and "pass --features" in res.output and "clip.safetensors" in res.output


def test_export_names_its_architecture(e2e):
    from tvrpipe.features.clip import load_clip

    out, metrics, _ = e2e
    with pytest.raises(ConfigError, match="exported by tvrpipe finetune for --model tvrpipe-tiny, not 'ViT-B-32'"):
        load_clip("ViT-B-32", str(out / "clip.safetensors"))
    assert load_clip("tvrpipe-tiny", str(out / "clip.safetensors")).weights_sha256 == \
        metrics["export"]["weights_sha256"]


def test_the_learned_logit_scale_travels_from_finetune_to_train_head(e2e, data, tmp_path, caplog):
    """The head starts from CLIP's scale, the export carries the head's learned scale, extract records it
    and every head trained on that store starts from it; an explicit --set logit_scale_init wins."""
    import math

    import yaml

    from tvrpipe.features.clip import load_clip
    from tvrpipe.features.store import open_store
    from tvrpipe.rundir import load_head
    from tvrpipe.training.fit import TrainConfig, fit

    out, metrics, store = e2e
    random_clip = load_clip("tvrpipe-tiny", "none")
    assert random_clip.logit_scale == pytest.approx(math.log(1 / 0.07), abs=1e-6)  # open_clip's init
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["head"]["logit_scale_init"] == pytest.approx(random_clip.logit_scale)
    from tvrpipe.environment import versions
    assert cfg["versions"] == versions()  # the software the run was trained with
    learned = load_head(out / "checkpoints" / "best.safetensors").logit_scale.item()
    assert abs(learned - random_clip.logit_scale) > 0.01  # the scale trained (lr 1e-3, 10 epochs)
    exported = load_file(str(out / "clip.safetensors"))["logit_scale"]
    assert float(exported) == pytest.approx(min(learned, math.log(100)), abs=1e-6)
    assert open_store(store).provenance["logit_scale"] == pytest.approx(float(exported), abs=1e-6)
    for overrides, want in (({}, float(exported)), ({"logit_scale_init": 0.5}, 0.5)):
        run = tmp_path / f"xpool{len(overrides)}"
        fit(store, "xpool", run, TrainConfig(epochs=0), overrides=overrides, progress=False)
        assert yaml.safe_load((run / "config.yaml").read_text())["head"]["logit_scale_init"] == pytest.approx(want)
        assert load_head(run / "checkpoints" / "best.safetensors").logit_scale.item() == pytest.approx(want)

    # a store extracted before the scale was recorded: the head starts at 1/0.07, and train-head says so
    import logging

    import zarr

    from tvrpipe.features.store import STORE_NAME

    old = tmp_path / "old-store"
    shutil.copytree(store, old)
    del zarr.open_group(str(old / STORE_NAME), mode="a").attrs["logit_scale"]
    with caplog.at_level(logging.WARNING, logger="tvrpipe.training.fit"):
        fit(old, "xpool", tmp_path / "old", TrainConfig(epochs=0), progress=False)
    assert "records no learned CLIP logit scale" in caplog.text and str(old) in caplog.text
    assert load_head(tmp_path / "old" / "checkpoints" / "best.safetensors").logit_scale.item() == \
        pytest.approx(math.log(1 / 0.07))
    # running the same extract again records the scale in the old store (every shard is already done)
    from tvrpipe.features.extract import ExtractConfig, extract

    extract(data / "manifest", data / "videos", old,
            ExtractConfig(model=metrics["export"]["model"], pretrained=str(out / "clip.safetensors"), progress=False))
    assert open_store(old).provenance["logit_scale"] == pytest.approx(float(exported), abs=1e-6)


def test_evaluate_refuses_a_store_of_other_weights(e2e, tmp_path, cli):
    out, metrics, store = e2e
    other = tmp_path / "run"
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("clip*.safetensors", "state.pt", "features"))
    m = json.loads((other / "metrics.json").read_text())
    m["provenance"]["weights_sha256"] = "0" * 64
    (other / "metrics.json").write_text(json.dumps(m))
    res = cli("evaluate", "--run", other, "--features", store)
    assert res.exit_code == 1 and "weights_sha256" in res.output


def _test_captions(data, store):
    """The test split's distinct captions (text, the store row of its video; of captions with the same text,
    the first: search answers a repeated query once)."""
    from tvrpipe.data.manifest import read_manifest
    from tvrpipe.features.store import open_store

    caps = read_manifest(data / "manifest").captions
    caps = caps[caps["split"] == "test"].drop_duplicates("text")
    row = {v: i for i, v in enumerate(open_store(store).videos["video_id"])}
    return caps["text"].tolist(), [row[v] for v in caps["video_id"]], len(row)


def _true_ranks(hits: list[dict], truth: list[int], store, k: int) -> np.ndarray:
    """Each query's rank of its caption's video among its ``k`` hits (k + 1 where it is not among them)."""
    from tvrpipe.features.store import open_store

    ids = open_store(store).videos["video_id"].tolist()
    return np.array([next((h["rank"] for h in hits[q * k:(q + 1) * k] if h["video_id"] == ids[t]), k + 1)
                     for q, t in enumerate(truth)])


@pytest.mark.slow  # 10 s: the finetuned run's searches; test_search_bad_input_is_one_line keeps the path in the default run
def test_search_finds_the_captioned_video_above_chance_through_the_cli(e2e, data, tmp_path, cli):
    """tvrpipe search with the finetune run (queries encoded by its exported CLIP) and with a head trained on the
    exported store (queries encoded by the store's CLIP, two stages): over all 200 videos (many share a caption's
    colour, shape and motion), each test caption's own video ranks far above chance (median rank (n + 1) / 2,
    R@10 10 / n)."""
    from tvrpipe.training.fit import TrainConfig, fit

    out, metrics, store = e2e
    texts, truth, n = _test_captions(data, store)
    (tmp_path / "q.txt").write_text("\n".join(texts) + "\n")
    res = cli("search", "--queries", tmp_path / "q.txt", "--run", out, "--features", store, "--top-k", n,
              "--json", tmp_path / "ft.json", "--csv", tmp_path / "ft.csv")
    assert res.exit_code == 0, res.output
    hits = json.loads((tmp_path / "ft.json").read_text())
    assert len(hits) == n * len(texts) and [h["rank"] for h in hits[:3]] == [1, 2, 3]
    ranks = _true_ranks(hits, truth, store, n)
    assert np.median(ranks) < n / 4 and np.mean(ranks <= 10) > 2 * 10 / n, (np.median(ranks), np.mean(ranks <= 10))
    table = pd.read_csv(tmp_path / "ft.csv", keep_default_na=False)
    assert table["video_id"].tolist() == [h["video_id"] for h in hits]
    np.testing.assert_allclose(table["score"], [h["score"] for h in hits], rtol=1e-6)
    assert "meanpool" in " ".join(res.output.split()) and texts[0][:20] in " ".join(res.output.split())

    run = tmp_path / "xpool"
    fit(store, "xpool", run, TrainConfig(max_epochs=8, batch_size=32, seed=0), progress=False)
    res = cli("search", "--queries", tmp_path / "q.txt", "--run", run, "--top-k", 40, "--candidates", 40,
              "--json", tmp_path / "xp.json")  # the run's own store, by default
    assert res.exit_code == 0, res.output
    ranks = _true_ranks(json.loads((tmp_path / "xp.json").read_text()), truth, store, 40)
    assert np.median(ranks) < n / 4 and np.mean(ranks <= 10) > 2 * 10 / n, (np.median(ranks), np.mean(ranks <= 10))
    # zero-shot: the store's CLIP, mean-pooled, no run
    res = cli("search", texts[0], "--features", store, "--top-k", 3, "--json", tmp_path / "zs.json",
              "--html", tmp_path / "zs.html", "--video-root", data / "videos", "--thumbs", 2)
    assert res.exit_code == 0 and "zero-shot" in res.output
    assert len(json.loads((tmp_path / "zs.json").read_text())) == 3
    page = (tmp_path / "zs.html").read_text()
    assert page.count('src="data:image/jpeg;base64,') == 3 * 2 and "data:image/svg" not in page


def test_search_bad_input_is_one_line(e2e, tmp_path, cli):
    from tvrpipe.worlds.features import GenSpec, generate_store

    out, metrics, store = e2e
    no_export = tmp_path / "run"
    shutil.copytree(out, no_export, ignore=shutil.ignore_patterns("clip.safetensors", "state.pt"))
    other = generate_store(tmp_path / "gen", GenSpec(train_videos=4, test_videos=2, frames=2, max_words=4,
                                                     embed_dim=8, seed=1))
    for args, message in [
        (["a dog", "--run", no_export, "--features", store], "finetuned CLIP end to end but its exported CLIP"),
        (["a dog", "--run", out, "--features", other], "learnt with another CLIP than --features"),
        (["  ", "--features", store], "query 1 is empty"),
        (["a dog", "--features", store, "--top-k", 500], "--top-k 500 is more than the 200 videos"),
        (["a dog", "--run", out], "give --features"),
        ([], "no query"),
    ]:
        res = cli("search", *args)
        assert res.exit_code == 1, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)
        assert len(res.output.strip().splitlines()) <= 3, res.output  # one message (rich may wrap it)


def test_epoch_plan_is_the_same_pairs_for_any_number_of_workers():
    pairs = TrainPairs.build(np.arange(10, 30), np.arange(60), np.repeat(np.arange(10, 30), 3))
    one = epoch_plan(pairs, seed=3, epoch=2, global_batch=8, rank=0, world=1, epoch_pairs="videos")
    two = [epoch_plan(pairs, seed=3, epoch=2, global_batch=8, rank=r, world=2, epoch_pairs="videos") for r in range(2)]
    assert len(one) == 2 and all(len(b) == 8 for b in one)  # 20 videos // 8: the partial batch is dropped
    assert [a + b for a, b in zip(*two)] == one
    videos = [v for b in one for v, _, _ in b]
    assert len(set(videos)) == 16 and all(c // 3 + 10 == v for b in one for v, c, _ in b)  # own captions
    assert epoch_plan(pairs, 3, 3, 8, 0, 1, epoch_pairs="videos") != one  # another epoch, another order
    skipped = epoch_plan(pairs, 3, 2, 8, 0, 1, skip=frozenset({videos[0]}), epoch_pairs="videos")
    assert videos[0] not in {v for b in skipped for v, _, _ in b}
    np.testing.assert_array_equal(frame_offsets(0, 1, 5, 12), frame_offsets(0, 1, 5, 12))
    assert not np.array_equal(frame_offsets(0, 1, 5, 12), frame_offsets(0, 2, 5, 12))


@pytest.mark.parametrize("batch", [7, 8, 16])
def test_the_papers_epoch_pairs_every_caption_once_and_no_video_twice_in_a_batch(batch):
    """--epoch-pairs captions (the default): every (video, caption) pair once an epoch, as the papers'
    loaders list them, and no video twice in a batch; uneven caption counts; workers split it alike."""
    counts = np.random.default_rng(0).integers(1, 6, size=60)  # 60 videos of 1 to 5 captions
    n = int(counts.sum())
    video_of = np.repeat(np.arange(100, 160), counts)
    pairs = TrainPairs.build(np.arange(100, 160), np.arange(n) + 1000, video_of)
    plan = epoch_plan(pairs, seed=1, epoch=0, global_batch=batch, rank=0, world=1)
    assert len(plan) == epoch_steps(pairs, batch) == n // batch and all(len(b) == batch for b in plan)
    seen = [(v, c) for b in plan for v, c, _ in b]
    assert len(set(seen)) == len(seen) == batch * (n // batch)  # each pair at most once, the tail dropped
    assert all(video_of[c - 1000] == v for v, c in seen)  # a caption with its own video
    assert all(len({v for v, _, _ in b}) == batch for b in plan)  # no video twice in a batch
    full = epoch_plan(pairs, seed=1, epoch=0, global_batch=1, rank=0, world=1)
    assert sorted((v, c) for b in full for v, c, _ in b) == sorted(zip(video_of, np.arange(n) + 1000))
    if batch % 2 == 0:
        halves = [epoch_plan(pairs, seed=1, epoch=0, global_batch=batch, rank=r, world=2) for r in range(2)]
        assert [a + b for a, b in zip(*halves)] == plan
    assert epoch_plan(pairs, seed=1, epoch=1, global_batch=batch, rank=0, world=1) != plan
    skipped = epoch_plan(pairs, seed=1, epoch=0, global_batch=batch, rank=0, world=1, skip=frozenset({102}))
    assert 102 not in {v for b in skipped for v, _, _ in b}


def test_options_are_checked_before_anything_runs(data, tmp_path):
    bad = [(dict(batch_size=6, num_workers=4), "divisible by --num-workers"),
           (dict(precision="fp16"), "--precision fp16 needs --use-gpu"),
           (dict(precision="fp64"), "--precision must be one of"),
           (dict(clip_lr=-1.0), "--clip-lr"), (dict(epochs=-1), "--epochs"),
           (dict(epoch_pairs="pairs"), "--epoch-pairs must be one of captions, videos, got 'pairs'"),
           (dict(timeout_s=float("inf")), r"--timeout must be > 0 and at most 2,000,000 seconds")]
    for kw, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            finetune(data / "manifest", data / "videos", "meanpool", tmp_path / "r", FinetuneConfig(**{**TINY, **kw}))
    with pytest.raises(ConfigError, match="--video-root"):
        finetune(data / "manifest", tmp_path / "nope", "meanpool", tmp_path / "r", FinetuneConfig(**TINY))
    with pytest.raises(ConfigError, match="exceeds the 140 training videos"):
        finetune(data / "manifest", data / "videos", "meanpool", tmp_path / "r2",
                 FinetuneConfig(**TINY, batch_size=256), progress=False)
    assert not (tmp_path / "r").exists()


def _small(tmp_path, n=30):
    from tvrpipe.worlds.videos import synthesize

    synthesize(tmp_path / "d", n, seed=1, progress=False)
    return tmp_path / "d"


def test_a_batch_larger_than_the_training_set_writes_nothing(tmp_path, cli):
    d = _small(tmp_path)
    out = tmp_path / "run"
    args = ["finetune", "--end-to-end", "--method", "meanpool", "--manifest", d / "manifest", "--video-root",
            d / "videos", "--out", out, "--model", "tvrpipe-tiny", "--pretrained", "none", "--epochs", "1",
            "--epoch-pairs", "videos", "--loader-workers", "0"]
    r = cli(*args, "--batch-size", "512")
    assert r.exit_code == 1 and "--batch-size 512 exceeds the" in r.output and not out.exists(), r.output
    r = cli(*args, "--batch-size", "4")
    assert r.exit_code == 0, r.output


def test_missing_or_undecodable_videos_stop_the_run_with_nothing_lost(tmp_path, cli):
    """finetune has extract's failed-fraction limit: a wrong --video-root is refused before anything is
    written; training videos that all fail to decode stop the run after the epoch (kept), never a run
    that exits 0 with untrained weights; test videos that all fail stop it before metrics.json, where
    an evaluation batch without one decoded frame used to crash."""
    d = _small(tmp_path)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    args = ["finetune", "--end-to-end", "--method", "meanpool", "--manifest", d / "manifest", "--model", "tvrpipe-tiny",
            "--pretrained", "none", "--epochs", "2", "--batch-size", "4", "--epoch-pairs", "videos",
            "--loader-workers", "0"]
    r = cli(*args, "--video-root", empty, "--out", tmp_path / "a")
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and f"training videos are not files under --video-root {empty} (100.0 % > " \
        "--max-failed-fraction 0.1): missing:" in text and "nothing was written" in text, r.output
    assert not (tmp_path / "a").exists()

    videos = pd.read_parquet(d / "manifest" / "videos.parquet")
    for split, out in (("train", tmp_path / "b"), ("test", tmp_path / "c")):
        root = tmp_path / f"videos-{split}"
        shutil.copytree(d / "videos", root)
        for p in videos.loc[videos.split == split, "path"]:
            (root / p).write_bytes(b"")  # zero bytes: undecodable
        r = cli(*args, "--video-root", root, "--out", out)
        text = " ".join(r.output.split())
        n = int((videos.split == split).sum())
        what = "training" if split == "train" else "test"
        # an epoch of whole batches (4) draws 20 of the 21 training videos; every test video is evaluated
        seen = n - n % 4 if split == "train" else n
        assert r.exit_code == 1 and f"{seen} of {n} {what} videos failed to decode ({100 * seen / n:.1f} % > " \
            "--max-failed-fraction 0.1): empty:" in text, r.output
        assert "--max-failed-fraction" in text and (out / "failures.csv").is_file()
        assert not (out / "metrics.json").exists()
        if split == "train":
            assert "training stopped after epoch 1, which is kept" in text
            assert pd.read_csv(out / "epochs.csv")["epoch"].tolist() == [1]
        else:
            assert "no test metrics were written (the training is kept)" in text
            assert pd.read_csv(out / "epochs.csv")["epoch"].tolist() == [1, 2]


def test_resume_continues_from_the_last_epoch(tmp_path, interrupt_call):
    import tvrpipe.training.finetune.loop as ft
    from tvrpipe import rundir

    d = _small(tmp_path)
    cfg = FinetuneConfig(end_to_end=True, epochs=2, batch_size=4, max_steps=2, clip_lr=1e-3, head_lr=1e-3, **TINY)
    finetune(d / "manifest", d / "videos", "xpool", tmp_path / "full", cfg, progress=False)

    restore = interrupt_call(ft, "evaluate", 2)  # stops in epoch two
    with pytest.raises(KeyboardInterrupt):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut", cfg, progress=False)
    restore()
    assert len(pd.read_csv(tmp_path / "cut" / "epochs.csv")) == 1
    first = load_file(str(tmp_path / "cut" / "checkpoints" / "clip_last.safetensors"))
    finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut", cfg, progress=False)
    rows = pd.read_csv(tmp_path / "cut" / "epochs.csv")
    assert rows["epoch"].tolist() == [1, 2]
    for name in ("clip_last.safetensors", "last.safetensors"):
        a = load_file(str(tmp_path / "cut" / "checkpoints" / name))
        b = load_file(str(tmp_path / "full" / "checkpoints" / name))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    moved = load_file(str(tmp_path / "cut" / "checkpoints" / "clip_last.safetensors"))
    assert any(not torch.equal(first[k], moved[k]) for k in first)  # epoch 2 really trained
    with pytest.raises(ConfigError, match="another configuration"):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut",
                 FinetuneConfig(**{**cfg.__dict__, "clip_lr": 1e-4}), progress=False)

    # cut inside epoch two's commit, its weights staged and its state.pt not yet written: the resume drops
    # them and trains epoch two again from epoch one's (fit's commit test has the other cuts)
    restore = interrupt_call(rundir.Checkpoints, "commit", 2)
    with pytest.raises(KeyboardInterrupt):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut2", cfg, progress=False)
    restore()
    ckpt = tmp_path / "cut2" / "checkpoints"
    assert {".clip_last.safetensors.next", ".last.safetensors.next"} <= {p.name for p in ckpt.glob(".*.next")}
    finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut2", cfg, progress=False)
    assert not list(ckpt.glob(".*.next"))

    # cut after epoch two's state.pt, before its staged files are renamed: the resume moves them into place
    real_commit, real_replace, commits = rundir.Checkpoints.commit, os.replace, []

    def commit(self, state):
        commits.append(1)
        return real_commit(self, state)

    def replace(src, dst):
        if len(commits) == 2 and str(src).endswith(".next"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rundir.Checkpoints, "commit", commit)
        mp.setattr(os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut3", cfg, progress=False)
    ckpt3 = tmp_path / "cut3" / "checkpoints"
    assert torch.load(ckpt3 / "state.pt", weights_only=False)["epoch"] == 1  # epoch two is committed
    assert ".clip_last.safetensors.next" in {p.name for p in ckpt3.glob(".*.next")}
    finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut3", cfg, progress=False)
    assert not list(ckpt3.glob(".*.next")) and len(pd.read_csv(tmp_path / "cut3" / "epochs.csv")) == 2
    for run in ("cut2", "cut3"):
        for name in ("clip_last.safetensors", "last.safetensors", "best.safetensors", "clip_best.safetensors"):
            a, b = (load_file(str(tmp_path / r / "checkpoints" / name)) for r in (run, "full"))
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_a_chunked_run_equals_the_whole_batch_run_and_resumes_with_any_chunk_size(tmp_path, interrupt_call):
    """--chunk-size changes the memory, not the run: the same steps (within float summation order), the
    same run directory on a resume with another chunk size, and a chunked run resumed equals one that was
    not interrupted."""
    import tvrpipe.training.finetune.loop as ft
    from tvrpipe.config import load_yaml

    d = _small(tmp_path)
    cfg = FinetuneConfig(end_to_end=True, epochs=2, batch_size=4, max_steps=2, clip_lr=1e-3, head_lr=1e-3, **TINY)
    chunked = dataclasses.replace(cfg, chunk_size=3)  # a batch of 4 as 3 + 1
    whole = finetune(d / "manifest", d / "videos", "xpool", tmp_path / "whole", cfg, progress=False)
    full = finetune(d / "manifest", d / "videos", "xpool", tmp_path / "full", chunked, progress=False)
    losses = [pd.read_csv(tmp_path / r / "epochs.csv")["loss"].to_numpy() for r in ("whole", "full")]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert full["test"]["t2v"]["R@1"] == pytest.approx(whole["test"]["t2v"]["R@1"])
    config = load_yaml((tmp_path / "full" / "config.yaml").read_bytes(), "config.yaml")
    assert config["execution"]["chunk_size"] == 3 and "chunk_size" not in config["finetune"]

    restore = interrupt_call(ft, "evaluate", 2)  # stops in epoch two
    with pytest.raises(KeyboardInterrupt):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut", chunked, progress=False)
    restore()
    finetune(d / "manifest", d / "videos", "xpool", tmp_path / "cut", chunked, progress=False)
    for name in ("clip_last.safetensors", "last.safetensors", "clip_best.safetensors", "best.safetensors"):
        a, b = (load_file(str(tmp_path / r / "checkpoints" / name)) for r in ("cut", "full"))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)

    restore = interrupt_call(ft, "evaluate", 2)
    with pytest.raises(KeyboardInterrupt):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "other", chunked, progress=False)
    restore()
    finetune(d / "manifest", d / "videos", "xpool", tmp_path / "other", dataclasses.replace(cfg, chunk_size=1),
             progress=False)  # the same run, its second epoch a pair at a time
    config = load_yaml((tmp_path / "other" / "config.yaml").read_bytes(), "config.yaml")
    assert config["execution"]["chunk_size"] == 3  # what the first epoch ran with
    [resumed] = config["resumed_execution"]
    assert resumed["from_epoch"] == 2 and resumed["execution"]["chunk_size"] == 1


def test_a_step_whose_videos_all_fail_to_decode_is_skipped(tmp_path):
    """Every training video unreadable: each step has no pair, and a loss over none is NaN. The
    step is skipped (it stopped the run with 'lower the learning rates'); the failures are kept."""
    from tvrpipe.data.manifest import read_manifest

    d = _small(tmp_path)
    videos = read_manifest(d / "manifest").videos
    train = videos[videos["split"] == "train"]
    for path in train["path"]:
        (d / "videos" / path).write_bytes(b"not a video" * 40)
    # every training video fails: accepted here (the default limit stops such a run, tested above)
    cfg = FinetuneConfig(epochs=1, batch_size=4, max_steps=2, epoch_pairs="videos", max_failed_fraction=1.0, **TINY)
    m = finetune(d / "manifest", d / "videos", "xpool", tmp_path / "run", cfg, progress=False)
    rows = pd.read_csv(tmp_path / "run" / "epochs.csv")
    assert np.isnan(rows["loss"][0]) and rows["failed_videos"][0] == m["failed_videos"] == 8  # 2 steps x 4
    assert set(pd.read_csv(tmp_path / "run" / "failures.csv")["video_id"]) <= set(train["video_id"])
    # the same command resumes the finished run (its results again); another epoch_pairs is another run
    assert finetune(d / "manifest", d / "videos", "xpool", tmp_path / "run", cfg, progress=False)["test"] == m["test"]
    with pytest.raises(ConfigError, match="another configuration"):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "run",
                 dataclasses.replace(cfg, epoch_pairs="captions"), progress=False)


def test_cli_frozen_clip_skips_bad_videos(tmp_path, cli):
    from tvrpipe.data.manifest import read_manifest
    from tvrpipe.features.clip import load_clip

    d = _small(tmp_path, 40)
    m = read_manifest(d / "manifest")
    bad = {split: m.videos[m.videos["split"] == split].iloc[0] for split in ("train", "test")}
    for row in bad.values():
        (d / "videos" / row["path"]).write_bytes(b"not a video at all" * 50)
    out = tmp_path / "run"
    res = cli("finetune", "--method", "xpool", "--manifest", d / "manifest", "--video-root", d / "videos",
              "--out", out, "--model", "tvrpipe-tiny", "--pretrained", "none", "--epochs", "2", "--batch-size", "8",
              "--head-lr", "1e-3", "--loader-workers", "1", "--max-failed-fraction", "0.2")  # 1 of 8 test videos
    assert res.exit_code == 0, res.output
    assert "2 videos failed to decode" in " ".join(res.output.split()) and "t2v" in res.output
    failed = pd.read_csv(out / "failures.csv")
    assert sorted(failed["video_id"]) == sorted(r["video_id"] for r in bad.values())
    assert failed["error"].str.contains("unreadable").all()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["export"] is None and not (out / "clip.safetensors").exists()  # frozen: nothing to export
    frozen = load_file(str(out / "checkpoints" / "clip_best.safetensors"))
    start = load_clip("tvrpipe-tiny", "none").model.state_dict()
    assert all(torch.equal(frozen[k], start[k].cpu()) for k in frozen)  # CLIP did not move
    assert metrics["provenance"]["weights_sha256"] == load_clip("tvrpipe-tiny", "none").weights_sha256
    assert pd.read_csv(out / "epochs.csv")["failed_videos"].tolist() == [1, 1]  # the train video; test comes last


@pytest.mark.slow  # about 40 s: it starts a Ray Train cluster of two workers
def test_ray_train_two_workers_step_equals_one_process_step(tmp_path):
    """One step of 2 Ray Train workers x 4 pairs = one step of one process with 8 pairs."""
    d = _small(tmp_path, 16)
    cfg = FinetuneConfig(end_to_end=True, epochs=1, batch_size=8, max_steps=1, clip_lr=1e-3, head_lr=1e-3,
                         **{**TINY, "cpus_per_worker": 1})
    one = finetune(d / "manifest", d / "videos", "xpool", tmp_path / "one", cfg, progress=False)
    two = finetune(d / "manifest", d / "videos", "xpool", tmp_path / "two",
                   FinetuneConfig(**{**cfg.__dict__, "num_workers": 2}), progress=False)
    # each worker's 4 pairs encoded 3 + 1 at a time: the gradients averaged once, as DDP averages them
    chunked = finetune(d / "manifest", d / "videos", "xpool", tmp_path / "chunked",
                       FinetuneConfig(**{**cfg.__dict__, "num_workers": 2, "chunk_size": 3}), progress=False)
    start = load_file(str(tmp_path / "one" / "checkpoints" / "clip_last.safetensors"))
    from tvrpipe.features.clip import load_clip

    init = load_clip("tvrpipe-tiny", "none").model.state_dict()
    moved = 0
    for name, run in [(n, r) for n in ("clip_last.safetensors", "last.safetensors") for r in ("two", "chunked")]:
        a = load_file(str(tmp_path / "one" / "checkpoints" / name))
        b = load_file(str(tmp_path / run / "checkpoints" / name))
        for k in a:
            x, y = a[k], b[k]
            if k.endswith("attn.in_proj_bias"):
                # the key bias's gradient is exactly 0 (a softmax over keys ignores a shift common to all of
                # them), so in each run it is float noise g ~ 1e-10 of the CPU's summation order, and Adam's
                # first step lr g / (|g| + eps) moves it by anything up to lr: bounded, not compared
                w = x.shape[0] // 3
                assert (x[w:2 * w] - y[w:2 * w]).abs().max() <= 2 * cfg.clip_lr
                x, y = torch.cat([x[:w], x[2 * w:]]), torch.cat([y[:w], y[2 * w:]])
            # Adam's first step is about lr * sign(g), so a batch split in two (other sums, other rounding)
            # moves a weight with a real gradient by the same step up to ~1e-5 (2.4e-6 measured): 0.1 lr
            torch.testing.assert_close(x, y, rtol=0, atol=1e-4)
    for k in start:
        moved += int((start[k] - init[k]).abs().max() > 5e-4)
    assert moved > 10  # the step moved the weights by about lr
    for run, m in (("two", two), ("chunked", chunked)):
        assert pd.read_csv(tmp_path / run / "epochs.csv")["loss"].iloc[0] == pytest.approx(
            pd.read_csv(tmp_path / "one" / "epochs.csv")["loss"].iloc[0], rel=1e-5)
        assert m["test"]["t2v"]["R@1"] == pytest.approx(one["test"]["t2v"]["R@1"])


@pytest.mark.slow  # a Ray Train run per head, ~20 s each on 2 cores; `make test-all` runs it
@pytest.mark.parametrize("method", list_heads())
def test_ray_train_chunked_step_equals_one_process_step_for_every_head(tmp_path, method):
    """One step of 2 Ray Train workers, each encoding its 4 pairs 3 + 1 at a time, = one step of one process
    with the 8 pairs at once: the gathered loss, the gradients averaged once per step."""
    d = _small(tmp_path, 16)
    overrides = {"num_frames": 4} if method == "tmass" else None  # T-MASS reads as many frames as the data has
    cfg = FinetuneConfig(end_to_end=True, epochs=1, batch_size=8, max_steps=1, clip_lr=1e-3, head_lr=1e-3, frames=4,
                         **{**TINY, "cpus_per_worker": 1})
    finetune(d / "manifest", d / "videos", method, tmp_path / "one", cfg, overrides, progress=False)
    finetune(d / "manifest", d / "videos", method, tmp_path / "two",
             FinetuneConfig(**{**cfg.__dict__, "num_workers": 2, "chunk_size": 3}), overrides, progress=False)
    for name in ("clip_last.safetensors", "last.safetensors"):
        a = load_file(str(tmp_path / "one" / "checkpoints" / name))
        b = load_file(str(tmp_path / "two" / "checkpoints" / name))
        diffs = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
        # Adam's first step moves a weight by about lr * sign(g): by at most 2 lr apart for a gradient of float
        # noise (a sign flip; a key bias's is 0 in exact arithmetic), by float order for every other weight
        assert float(diffs.max()) <= 2.2 * cfg.clip_lr, (method, name)
        assert float((diffs > 0.1 * cfg.clip_lr).float().mean()) < 0.01, (method, name)
    losses = [pd.read_csv(tmp_path / r / "epochs.csv")["loss"].iloc[0] for r in ("one", "two")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_bf16_autocast_and_gradient_checkpointing_train(tmp_path):
    d = _small(tmp_path, 16)
    cfg = FinetuneConfig(end_to_end=True, epochs=1, batch_size=4, max_steps=2, clip_lr=1e-3, head_lr=1e-3,
                         precision="bf16", grad_checkpointing=True, **TINY)
    m = finetune(d / "manifest", d / "videos", "tokenwise", tmp_path / "run", cfg, progress=False)
    row = pd.read_csv(tmp_path / "run" / "epochs.csv").iloc[0]
    assert np.isfinite(row["loss"]) and m["export"]["file"] == "clip.safetensors"
    from tvrpipe.features.clip import load_clip

    moved = load_file(str(tmp_path / "run" / "clip.safetensors"))
    init = load_clip("tvrpipe-tiny", "none").model.state_dict()
    assert all(v.dtype == torch.float32 for v in moved.values())  # autocast keeps fp32 master weights
    assert any(not torch.equal(moved[k], init[k]) for k in moved)


def test_group_lr_gives_a_head_group_its_own_learning_rate(tmp_path):
    """--group-lr radius=3e-5 (T-MASS Sec. 4.1): the radius module's AdamW groups train at 3e-5, the rest
    of the head at --head-lr, CLIP at --clip-lr; a group the head lacks fails before anything is written."""
    from tvrpipe.features.clip import TINY_MODEL, load_clip
    from tvrpipe.heads.base import create_head
    from tvrpipe.training.live import LiveModel, param_groups

    bundle = load_clip(TINY_MODEL, "none", seed=0)
    bundle.model.requires_grad_(True)  # end to end, as finetune sets it
    head = create_head("tmass", embed_dim=bundle.embed_dim)
    groups = param_groups(LiveModel(bundle, head, True, "fp32"), 1e-6, 1e-5, 0.2, {"radius": 3e-5})
    by_lr = {}
    for g in groups:
        by_lr.setdefault(g["base_lr"], set()).update(id(p) for p in g["params"])
    assert by_lr[3e-5] == {id(p) for p in head.radius_proj.parameters()}
    assert by_lr[1e-6] == {id(p) for p in bundle.model.parameters()}
    assert by_lr[1e-5] == {id(p) for p in head.parameters()} - by_lr[3e-5]
    d = _small(tmp_path, n=12)
    with pytest.raises(ConfigError, match="--group-lr fusion: xpool has the parameter groups head"):
        finetune(d / "manifest", d / "videos", "xpool", tmp_path / "r", FinetuneConfig(**TINY, group_lr={"fusion": 1e-4}))
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match="--group-lr radius=-1"):
        FinetuneConfig(**TINY, group_lr={"radius": -1.0})


def test_cli_group_lr_is_parsed_and_recorded(tmp_path, cli):
    d = _small(tmp_path, n=12)
    r = cli("finetune", "--method", "tmass", "--manifest", d / "manifest", "--video-root", d / "videos", "--out",
            tmp_path / "run", "--model", "tvrpipe-tiny", "--pretrained", "none", "--epochs", "1", "--batch-size", "4",
            "--epoch-pairs", "videos", "--loader-workers", "0", "--group-lr", "radius=3e-5", "--init-from-clip")
    assert r.exit_code == 0, r.output
    import yaml

    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    recorded = config["finetune"]
    # tmass has no module that starts from CLIP: the run records that nothing was copied
    assert recorded["group_lr"] == {"radius": 3e-5} and recorded["init_from_clip"] is False
    assert config["resolved"]["init_from_clip"] == "nothing: tmass has no module that starts from CLIP"
    assert config["resolved"]["lr_groups"] == {"head": {"lr": 1e-5, "source": "--head-lr"},
                                               "radius": {"lr": 3e-5, "source": "--group-lr"}}
    r = cli("finetune", "--method", "tmass", "--manifest", d / "manifest", "--video-root", d / "videos", "--out",
            tmp_path / "run2", "--group-lr", "radius")
    assert r.exit_code == 1 and "--group-lr expects key=value, got 'radius'" in r.output


def test_init_from_clip_starts_the_temporal_transformer_from_the_live_clip(tmp_path):
    """finetune --init-from-clip: with no epoch trained, the run's seqTransf blocks are the tiny CLIP's
    text blocks (its text tower has 2 heads of width 64: the head is asked for 2 as well)."""
    from safetensors.torch import load_file

    from tvrpipe.features.clip import TINY_MODEL, load_clip

    d = _small(tmp_path, n=12)
    finetune(d / "manifest", d / "videos", "seqtransf", tmp_path / "run",
             FinetuneConfig(**TINY, epochs=0, init_from_clip=True), overrides={"num_heads": 2}, progress=False)
    head = load_file(str(tmp_path / "run" / "checkpoints" / "best.safetensors"))
    clip = load_clip(TINY_MODEL, "none", seed=0).model
    for i in range(2):  # the tiny text tower has 2 blocks; the head's other 2 keep their own init
        assert torch.equal(head[f"blocks.{i}.in_proj.weight"], clip.transformer.resblocks[i].attn.in_proj_weight)
        assert torch.equal(head[f"blocks.{i}.c_fc.bias"], clip.transformer.resblocks[i].mlp.c_fc.bias)
    assert torch.equal(head["frame_position_embeddings.weight"], clip.positional_embedding[:77])
