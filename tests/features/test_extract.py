"""Extraction end to end on generated videos with the tiny model: the store against a sequential
reference, failures recorded, determinism across worker counts, resume after a kill, provenance
refusal, HDF5 export. Ray is started once for the module (start-up is the slow part here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from broken_videos import synth_with_broken_videos

from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError
from tvrpipe.features.clip import TINY_MODEL, encode_frames, encode_text_tokens, load_clip, tokenize
from tvrpipe.features.decode import decode_video
from tvrpipe.features.extract import ExtractConfig, extract
from tvrpipe.features.store import StoreError, open_store

N_VIDEOS = 14


def _free_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Synthetic videos plus a corrupt and a zero-byte video in the manifest."""
    return synth_with_broken_videos(tmp_path_factory.mktemp("data"), N_VIDEOS, seed=5)


def _cfg(**kw) -> ExtractConfig:
    # 2 broken videos of 16 (12.5 %) are over the default 10 % failure limit: allow them here
    base = dict(model=TINY_MODEL, pretrained="none", video_shard=4, text_shard=16, batch_size=3,
                progress=False, timeout_s=30.0, max_failed_fraction=0.2)
    return ExtractConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def store_dir(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("feat")
    summary = extract(data / "manifest", data / "videos", out, _cfg())
    assert (summary.videos_done, summary.videos_skipped, summary.failed) == (N_VIDEOS, 0, 2)
    assert summary.failure_kinds == {"empty": 1, "unreadable": 1}
    assert (summary.videos_per_call, summary.fitted_frames) == (3, 0)  # --batch-size 3; nothing measured on a CPU
    return out


def test_store_equals_sequential_reference(store_dir, data):
    store = open_store(store_dir)
    m = read_manifest(data / "manifest")
    bundle = load_clip(TINY_MODEL, "none")
    F, L, D = store.provenance["frames"], store.provenance["max_words"], store.provenance["embed_dim"]
    frames = store.array("videos/frames")[:]
    mask = store.array("videos/frame_mask")[:]
    stamps = store.array("videos/timestamps")[:]
    assert frames.shape == (N_VIDEOS + 2, F, D) and frames.dtype == np.float16
    # rows follow the manifest's order
    assert list(store.videos.video_id) == list(m.videos.video_id)
    for row, r in enumerate(m.videos.itertuples()):
        if r.video_id in ("zero", "corrupt"):
            assert not mask[row].any() and not frames[row].any()
            continue
        d = decode_video(data / "videos" / r.path, F, store.provenance["image_size"])
        ref = encode_frames(bundle, d.frames[d.mask]).numpy()
        np.testing.assert_array_equal(mask[row], d.mask)
        np.testing.assert_allclose(frames[row][mask[row]].astype(np.float32), ref, rtol=1e-2, atol=2e-3)
        np.testing.assert_allclose(stamps[row][mask[row]], d.timestamps[d.mask], atol=1e-6)
    # texts: same rows as the manifest's captions, tokens and EOS sentence as encode_text
    assert list(store.texts.caption_id) == list(m.captions.caption_id)
    ids, tmask = tokenize(bundle, list(m.captions.text), L)
    tok, sent = encode_text_tokens(bundle, ids)
    np.testing.assert_array_equal(store.array("texts/token_mask")[:], tmask.numpy())
    np.testing.assert_allclose(store.array("texts/sentence")[:].astype(np.float32), sent.numpy(), rtol=1e-2, atol=2e-3)
    np.testing.assert_allclose(store.array("texts/tokens")[:].astype(np.float32), tok.numpy(), rtol=1e-2, atol=2e-3)
    vrow = store.texts.video_row.to_numpy()
    assert (store.videos.video_id.to_numpy()[vrow] == store.texts.video_id.to_numpy()).all()


def test_failures_recorded(store_dir):
    f = open_store(store_dir).failures.set_index("video_id")
    assert sorted(f.index) == ["corrupt", "zero"]
    assert f.loc["zero", "error"].startswith("empty:")
    assert f.loc["corrupt", "error"].startswith("unreadable:")
    assert (f.stage == "decode").all()


def test_provenance_recorded_and_mismatch_refused(store_dir, data, tmp_path):
    prov = open_store(store_dir).provenance
    assert prov["model"] == TINY_MODEL and prov["pretrained"] == "none" and prov["frames"] == 12
    assert prov["max_words"] == 32 and prov["dtype"] == "float16" and len(prov["weights_sha256"]) == 64
    assert prov["frame_sampling"] == "uniform-segment-centre" and prov["complete"] is True
    assert prov["precision"] == "fp32"  # auto on a CPU
    # what rebuilds the weights of --pretrained none, and where the rows were decoded from
    assert prov["seed"] == 0 and prov["video_root"] == str((data / "videos").resolve()) and "kind" not in prov
    assert list(open_store(store_dir).videos.columns) == ["video_id", "split", "path", "start_s", "end_s"]
    with pytest.raises(StoreError, match=r"frames: store has 12, expected 8"):
        open_store(store_dir, expect={"frames": 8})
    with pytest.raises(StoreError, match=r"weights_sha256: store has"):
        open_store(store_dir, expect={"weights_sha256": "0" * 64})
    # extracting into the same folder with another seed (other weights) is refused
    with pytest.raises(StoreError, match=r"other settings \(weights_sha256.*--overwrite"):
        extract(data / "manifest", data / "videos", store_dir, _cfg(seed=1))


def test_rerun_skips_everything_but_retries_failures(store_dir, data):
    before = {a: open_store(store_dir).array(a)[:] for a in ("videos/frames", "videos/frame_mask", "texts/tokens")}
    s = extract(data / "manifest", data / "videos", store_dir, _cfg())
    # the two broken videos are retried (and fail again); counts are disjoint and add up
    assert (s.videos_done, s.videos_skipped, s.failed, s.retried, s.recovered) == (0, N_VIDEOS, 2, 2, 0)
    assert s.texts_done == 0 and s.texts_skipped == s.texts_total and s.repaired == 0
    assert "0 extracted, 14 already done, 2 failed (16 in all; 2 retried, 0 recovered)" in s.lines()[0]
    s = extract(data / "manifest", data / "videos", store_dir, _cfg(retry_failed=False))
    assert (s.videos_done, s.videos_skipped, s.failed, s.retried) == (0, N_VIDEOS, 2, 0)
    for name, values in before.items():
        np.testing.assert_array_equal(open_store(store_dir).array(name)[:], values)


def test_a_rerun_with_nothing_to_do_starts_neither_ray_nor_a_model(store_dir, data, tmp_path, monkeypatch):
    """The weights' facts the run's encoder reported are cached: a rerun of a complete store reads them and
    returns without Ray or torch's model; with the cache gone it loads the weights here, once, still without
    Ray. Other weights (another seed) are still refused."""
    import tvrpipe.features.clip as clip
    from tvrpipe.features.extract import driver

    def forbidden(*a, **kw):
        raise AssertionError("started for a store with nothing to do")

    done = tmp_path / "done"
    shutil.copytree(store_dir, done, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    monkeypatch.setattr(driver, "start_executor", forbidden)
    real_load = clip.load_clip
    monkeypatch.setattr(clip, "load_clip", forbidden)
    s = extract(data / "manifest", data / "videos", done, _cfg(retry_failed=False))
    assert (s.videos_done, s.videos_skipped, s.texts_done, s.failed) == (0, N_VIDEOS, 0, 2)
    assert s.phases == {"checks": s.phases["checks"]}
    monkeypatch.setenv("TVRPIPE_CACHE", str(tmp_path / "empty-cache"))
    loads = []
    monkeypatch.setattr(clip, "load_clip", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    s = extract(data / "manifest", data / "videos", done, _cfg(retry_failed=False))
    assert (s.videos_done, s.texts_done) == (0, 0) and len(loads) == 1
    extract(data / "manifest", data / "videos", done, _cfg(retry_failed=False))
    assert len(loads) == 1  # cached by the first
    with pytest.raises(StoreError, match=r"other settings \(weights_sha256"):
        extract(data / "manifest", data / "videos", done, _cfg(retry_failed=False, seed=7))


def test_what_only_the_weights_can_tell_is_refused_before_the_store_is_created(data, tmp_path):
    """An unknown tag and --max-words beyond the context length are found by the encoder that loads the
    weights (the driver loads none), and raised with their messages before anything is written."""
    out = tmp_path / "f"
    with pytest.raises(ConfigError, match=rf"--pretrained: unknown tag 'no-such-tag' for model '{TINY_MODEL}'"):
        extract(data / "manifest", data / "videos", out, _cfg(pretrained="no-such-tag"))
    with pytest.raises(ConfigError, match=r"--max-words 500 exceeds the model's context length 77"):
        extract(data / "manifest", data / "videos", out, _cfg(max_words=500))
    assert not (out / "features.zarr").exists()


def test_bf16_encoders_agree_with_fp32_and_a_store_keeps_one_precision(store_dir, data, tmp_path):
    """--precision bf16 on a CPU runs the weights in bf16 (same weights, same sha256): every embedding is
    within cosine 0.999 of fp32. A store records its precision, and resuming it in another is refused
    (a complete store with nothing to do is not: nothing would be computed)."""
    from tvrpipe.features.workers import ClipEncoder

    fp32, bf16 = (ClipEncoder(TINY_MODEL, "none", "cpu", 0, 1, p) for p in ("fp32", "bf16"))
    assert bf16.facts()["weights_sha256"] == fp32.facts()["weights_sha256"]
    d = decode_video(next((data / "videos").glob("synth_*.mp4")), 12, 64)
    video = {"row": 0, "frames": d.frames, "mask": d.mask, "timestamps": d.timestamps, "error": ""}
    texts = list(read_manifest(data / "manifest").captions.text[:8])

    def cosines(a, b):
        a, b = a.reshape(-1, a.shape[-1]).astype(np.float64), b.reshape(-1, b.shape[-1]).astype(np.float64)
        keep = np.linalg.norm(a, axis=1) > 0
        a, b = a[keep], b[keep]
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    x, y = fp32.encode_videos(video), bf16.encode_videos(video)
    assert x["emb"].dtype == y["emb"].dtype == np.float16 and cosines(x["emb"], y["emb"]).min() > 0.999
    assert not np.array_equal(x["emb"], y["emb"])  # computed in bf16 indeed
    x, y = fp32.encode_texts(texts, 16), bf16.encode_texts(texts, 16)
    np.testing.assert_array_equal(x["token_mask"], y["token_mask"])
    for key in ("tokens", "sentence"):
        assert cosines(x[key], y[key]).min() > 0.999, key
    with pytest.raises(ConfigError, match="--precision fp16 needs --device cuda; on a CPU use bf16"):
        _cfg(precision="fp16")
    done = tmp_path / "done"
    shutil.copytree(store_dir, done, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
    with pytest.raises(ConfigError, match=r"--precision bf16: the store in .* was extracted in fp32, .*rerun with "
                                          r"--precision fp32, or pass --overwrite to extract it again in bf16"):
        extract(data / "manifest", data / "videos", done, _cfg(precision="bf16"))  # its failed videos: work
    s = extract(data / "manifest", data / "videos", done, _cfg(precision="bf16", retry_failed=False))
    assert (s.videos_done, s.texts_done) == (0, 0)


def test_decodes_sent_before_the_weights_load_are_dropped_when_the_size_was_wrong(store_dir, data, tmp_path,
                                                                                  monkeypatch, same_rows):
    """A new store's first videos are decoded while the encoders load the weights, at the size the
    architecture's file gives; were that not the model's (a wrong guess), they are decoded again at the
    model's size: the store equals one extracted without the head start."""
    from tvrpipe.features.extract import pipeline

    monkeypatch.setattr(pipeline, "guess_image_size", lambda model: 32)  # the tiny model's is 64
    out = tmp_path / "f"
    # calls sized in frames: --encode-frames 71 at F = 12 is 5 videos a call
    s = extract(data / "manifest", data / "videos", out, _cfg(batch_size=None, encode_frames=71))
    assert (s.videos_done, s.failed, s.videos_per_call) == (N_VIDEOS, 2, 5) and 1 <= s.first_videos <= 5
    for name in ("videos/frames", "videos/frame_mask", "videos/timestamps", "texts/sentence"):
        same_rows(open_store(out), open_store(store_dir), name)


@pytest.mark.slow  # ~1 min of Ray start-up on 2 cores; `make test-all` runs it
def test_same_rows_with_other_worker_counts(store_dir, data, tmp_path, same_rows):
    extract(data / "manifest", data / "videos", tmp_path / "b", _cfg(decoders=1, batch_size=5, video_shard=6))
    a, b = open_store(store_dir), open_store(tmp_path / "b")
    for name in ("videos/frames", "videos/frame_mask", "texts/tokens", "texts/sentence"):
        same_rows(a, b, name)
    pd.testing.assert_frame_equal(a.videos, b.videos)


def test_export_hdf5(store_dir, tmp_path, cli):
    r = cli("export", "--features", store_dir, "--format", "hdf5", "--out", tmp_path / "f.h5")
    assert r.exit_code == 0, r.output
    store = open_store(store_dir)
    with h5py.File(tmp_path / "f.h5") as h5:
        for name in ("videos/frames", "videos/frame_mask", "texts/tokens", "texts/token_mask", "texts/sentence"):
            np.testing.assert_array_equal(h5[name][:], store.array(name)[:])
        assert [x.decode() for x in h5["ids/videos/video_id"][:]] == list(store.videos.video_id)
        assert '"tvrpipe-tiny"' == h5.attrs["model"]
    r = cli("export", "--features", store_dir, "--format", "npz", "--out", tmp_path / "f.npz")
    assert r.exit_code == 1 and "--format 'npz' is not supported; use hdf5, npy, parquet" in r.output


def test_export_pooled_embeddings_as_npy_and_parquet(store_dir, tmp_path, cli):
    """One embedding per video with a decoded frame: the meanpool head's, computed here with NumPy from
    the stored frames; ids, splits and paths beside it; the two failed videos left out and counted."""
    import json

    import pyarrow.parquet as pq

    store = open_store(store_dir)
    frames = store.array("videos/frames")[:].astype(np.float64)
    mask = store.array("videos/frame_mask")[:]
    unit = frames / np.maximum(np.linalg.norm(frames, axis=-1, keepdims=True), 1e-12)
    mean = (unit * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1)
    mean = mean[mask.any(1)]
    want = mean / np.linalg.norm(mean, axis=-1, keepdims=True)
    ids = list(store.videos.video_id[mask.any(1)])
    r = cli("export", "--features", store_dir, "--format", "npy", "--out", tmp_path / "pooled")
    assert r.exit_code == 0 and "2 videos without a decoded frame left out" in " ".join(r.output.split()), r.output
    emb = np.load(tmp_path / "pooled" / "embeddings.npy")
    assert emb.dtype == np.float32 and emb.shape == (N_VIDEOS, store.provenance["embed_dim"])
    np.testing.assert_allclose(emb, want, atol=1e-5)
    table = pd.read_csv(tmp_path / "pooled" / "videos.csv")
    assert list(table.video_id) == ids and list(table.row) == list(range(N_VIDEOS))
    assert json.loads((tmp_path / "pooled" / "provenance.json").read_text())["weights_sha256"] == \
        store.provenance["weights_sha256"]
    r = cli("export", "--features", store_dir, "--format", "parquet", "--out", tmp_path / "pooled.parquet")
    assert r.exit_code == 0, r.output
    pt = pq.read_table(tmp_path / "pooled.parquet")
    assert pt.column("video_id").to_pylist() == ids
    np.testing.assert_array_equal(np.array(pt.column("embedding").to_pylist(), np.float32), emb)
    assert json.loads(pt.schema.metadata[b"tvrpipe"])["model"] == TINY_MODEL
    r = cli("export", "--features", store_dir, "--format", "npy", "--out", tmp_path / "pooled")
    assert r.exit_code == 1 and "exists; choose a new folder name" in " ".join(r.output.split())
    from tvrpipe.search.first_stages.faiss_hnsw import faiss_available

    if faiss_available():  # the same embeddings in a FAISS index, which finds each one's own video first
        import faiss

        r = cli("export", "--features", store_dir, "--format", "faiss", "--out", tmp_path / "idx")
        assert r.exit_code == 0 and "2 videos without a decoded frame left out" in " ".join(r.output.split())
        index = faiss.read_index(str(tmp_path / "idx" / "faiss.index"))
        np.testing.assert_array_equal(np.load(tmp_path / "idx" / "pooled.npy"), emb)
        _, top = index.search(emb, 1)
        assert top[:, 0].tolist() == list(range(N_VIDEOS))
        assert list(pd.read_csv(tmp_path / "idx" / "videos.csv").video_id) == ids
    assert not list(tmp_path.glob(".*tmp*"))


def test_features_show(store_dir, cli):
    r = cli("features", "show", store_dir)
    assert r.exit_code == 0
    assert "16 x 12 x 64" in r.output and "weights_sha256" in r.output and "failed videos: 2" in r.output
    import torch

    from tvrpipe import __version__
    assert f"versions: tvrpipe {__version__}, torch {torch.__version__}," in r.output


def test_incomplete_store_is_refused(tmp_path, cli):
    r = cli("features", "show", tmp_path)
    assert r.exit_code == 1 and "no feature store here" in r.output


def test_resume_after_kill(data, tmp_path):
    """Kill a CLI extraction after its first shard lands; the rerun finishes and matches."""
    out = tmp_path / "k"
    cmd = [sys.executable, "-m", "tvrpipe", "extract", "--manifest", str(data / "manifest"),
           "--video-root", str(data / "videos"), "--out", str(out), "--model", TINY_MODEL,
           "--pretrained", "none", "--batch-size", "1", "--decoders", "1", "--video-shard", "1",
           "--max-failed-fraction", "0.2"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    markers = out / "_progress" / "videos"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if markers.is_dir() and any(markers.iterdir()):
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    landed = [json.loads(p.read_text()) for p in markers.glob("*.json")]  # one video a shard
    assert 0 < len(landed) < N_VIDEOS + 2, len(landed)
    # a failed video's shard lands too (under load more than one can land before the kill): the rerun counts it
    # among the failures, not among the videos already done
    done_before = sum(not m["failures"] for m in landed)
    with pytest.raises(StoreError, match="has not finished"):
        open_store(out)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{N_VIDEOS + 2 - done_before - 2} extracted, {done_before} already done, 2 failed" in r.stdout
    store = open_store(out)
    ref = _reference_frames(data)
    np.testing.assert_allclose(store.array("videos/frames")[:].astype(np.float32), ref, rtol=1e-2, atol=2e-3)


def _reference_frames(data: Path) -> np.ndarray:
    m = read_manifest(data / "manifest")
    bundle = load_clip(TINY_MODEL, "none")
    out = np.zeros((len(m.videos), 12, bundle.embed_dim), np.float32)
    for row, r in enumerate(m.videos.itertuples()):
        if r.video_id in ("zero", "corrupt"):
            continue
        d = decode_video(data / "videos" / r.path, 12, bundle.image_size)
        out[row][d.mask] = encode_frames(bundle, d.frames[d.mask]).numpy()
    return out


# ------------------------------------------------------------------ failures, retries, repair


@pytest.mark.slow  # ~1 min of Ray start-up on 2 cores; `make test-all` runs it
def test_wrong_video_root_fails_the_run_then_the_right_one_retries(store_dir, data, tmp_path, cli, same_rows):
    """All videos missing: exit 1 with counts and a hint, store kept incomplete; the rerun with the
    right root retries them (no --overwrite) and gives the same store as a clean run."""
    from tvrpipe.features.extract import ExtractionError

    out, wrong = tmp_path / "f", tmp_path / "empty"
    wrong.mkdir()
    with pytest.raises(ExtractionError) as e:
        extract(data / "manifest", wrong, out, _cfg())
    msg = str(e.value)
    assert msg.startswith(f"{N_VIDEOS + 2} of {N_VIDEOS + 2} videos failed (100.0 % > --max-failed-fraction 0.2)")
    assert f"missing: {N_VIDEOS + 2}" in msg and f"check --video-root {wrong}" in msg and "failures.parquet" in msg
    s = e.value.summary
    assert (s.videos_done, s.videos_skipped, s.failed) == (0, 0, N_VIDEOS + 2)
    with pytest.raises(StoreError, match=f"{N_VIDEOS + 2} of {N_VIDEOS + 2} videos failed"):
        open_store(out)  # not complete: nothing reads it as if it were whole
    r = cli("train-head", "--features", out, "--method", "meanpool", "--out", tmp_path / "run")
    assert r.exit_code == 1 and "videos failed" in r.output
    s = extract(data / "manifest", data / "videos", out, _cfg())
    assert (s.videos_done, s.videos_skipped, s.failed, s.retried, s.recovered) == (N_VIDEOS, 0, 2, N_VIDEOS + 2, N_VIDEOS)
    assert s.texts_done == 0  # texts were done by the failed run and kept
    a, b = open_store(out), open_store(store_dir)
    for name in ("videos/frames", "videos/frame_mask", "videos/timestamps", "texts/sentence"):
        same_rows(a, b, name)
    assert sorted(a.failures.video_id) == ["corrupt", "zero"]


def test_failure_limit_exit_code_and_summary_via_cli(data, tmp_path, cli):
    """The CLI prints the summary, then one error line, and exits 1 (default limit 10 %: 2 of 16 fail)."""
    out = tmp_path / "f"
    r = cli("extract", "--manifest", data / "manifest", "--video-root", data / "videos", "--out", out,
            "--model", TINY_MODEL, "--pretrained", "none", "--video-shard", "8")
    assert r.exit_code == 1, r.output
    text = " ".join(r.output.split())
    assert f"{N_VIDEOS} extracted, 0 already done, 2 failed ({N_VIDEOS + 2} in all)" in text
    assert "error: 2 of 16 videos failed (12.5 % > --max-failed-fraction 0.1): empty: 1, unreadable: 1" in text
    assert "--max-failed-fraction 0.13" in text  # 0.125 rounded up: the advised value lets the run pass
    r = cli("extract", "--manifest", data / "manifest", "--video-root", data / "videos", "--out", out,
            "--model", TINY_MODEL, "--pretrained", "none", "--no-retry-failed", "--max-failed-fraction", "0.13")
    assert r.exit_code == 0, r.output
    assert f"0 extracted, {N_VIDEOS} already done, 2 failed" in " ".join(r.output.split())
    assert open_store(out).provenance["complete"] is True


def test_damaged_shards_are_re_extracted_exactly(store_dir, data, tmp_path, same_rows):
    d = tmp_path / "copy"
    shutil.copytree(store_dir, d)
    (d / ".tvrpipe.lock").unlink(missing_ok=True)
    zarr_dir = d / "features.zarr"
    (zarr_dir / "videos" / "frames" / "c" / "1" / "0" / "0").unlink()
    tok = zarr_dir / "texts" / "tokens" / "c" / "0" / "0" / "0"
    tok.write_bytes(np.random.default_rng(0).bytes(tok.stat().st_size))
    with pytest.raises(StoreError, match="videos/frames chunk c/1/0/0 is missing"):
        open_store(d)
    markers = {p.relative_to(d).as_posix(): p.stat().st_mtime_ns for p in (d / "_progress").rglob("*.json")}
    s = extract(data / "manifest", data / "videos", d, _cfg(retry_failed=False))
    assert s.repaired == 2 and s.videos_done == 4 and s.texts_done == 16, s.lines()
    changed = sorted(k for k, t in markers.items() if (d / k).stat().st_mtime_ns != t)
    assert changed == ["_progress/texts/000000.json", "_progress/videos/000001.json"]
    a, b = open_store(d), open_store(store_dir)
    for name in ("videos/frames", "videos/frame_mask", "texts/tokens", "texts/sentence"):
        same_rows(a, b, name)


def test_invalid_options_are_checked_before_anything(data, tmp_path, monkeypatch):
    """Invalid values never become defaults, and nothing (no decoder, no model, no directory) starts."""
    from tvrpipe.errors import ConfigError, ManifestError
    from tvrpipe.features import clip
    from tvrpipe.features.extract import driver

    def forbidden(*a, **kw):
        raise AssertionError("started before the options were checked")

    monkeypatch.setattr(driver, "start_executor", forbidden)
    monkeypatch.setattr(clip, "load_clip", forbidden)
    out = tmp_path / "f"
    for kw, message in [({"frames": -1}, "--frames must be >= 1, got -1"), ({"frames": 0}, "--frames must be >= 1"),
                        ({"max_words": 0}, "--max-words must be >= 2, got 0"),
                        ({"max_words": 1}, "--max-words must be >= 2, got 1"),
                        ({"decoders": 0}, "--decoders must be >= 1, got 0"),
                        ({"timeout_s": 0.0}, "--timeout must be > 0"),
                        ({"timeout_s": 1e7}, r"--timeout must be > 0 and at most 2,000,000 seconds \(23 days\), "
                                             "got 10000000.0"),  # it overflowed the decoder's wait
                        ({"timeout_s": float("inf")}, "at most 2,000,000 seconds"),
                        ({"max_failed_fraction": 1.5}, "--max-failed-fraction must be between 0 and 1")]:
        with pytest.raises(ConfigError, match=message):
            extract(data / "manifest", data / "videos", out, _cfg(**kw))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "videos.parquet").write_text("not parquet")
    (bad / "captions.parquet").write_text("not parquet")
    with pytest.raises(ManifestError):
        extract(bad, data / "videos", out, _cfg())
    assert not out.exists()


def test_failure_message_example_advice_and_limit(tmp_path):
    """The hint's example is a video of the most common kind; the advised --max-failed-fraction lets
    the run pass; "more than the fraction" is exact (29 of 100 at 0.29 passes; n <= 0.29 * 100 did not)."""
    from tvrpipe.features.extract.config import too_many_failures

    videos = pd.DataFrame({"video_id": [f"v{i}" for i in range(100)], "path": [f"v{i}.mp4" for i in range(100)]})

    def failures(kinds):
        return pd.DataFrame({"video_id": [f"v{i}" for i in range(len(kinds))],
                             "error": [f"{k}: detail" for k in kinds]})

    cfg = ExtractConfig(max_failed_fraction=0.29)
    assert too_many_failures(failures(["missing"] * 29), videos, tmp_path, tmp_path, cfg) is None
    msg = too_many_failures(failures(["timeout"] + ["missing"] * 29), videos, tmp_path, tmp_path, cfg)
    assert msg.startswith("30 of 100 videos failed (30.0 % > --max-failed-fraction 0.29): missing: 29, timeout: 1")
    assert f"check --video-root {tmp_path}: {tmp_path / 'v1.mp4'} does not exist" in msg  # v0 timed out
    for n, total in [(2, 16), (1, 3), (1, 7), (13, 90), (57, 100), (3, 25)]:
        msg = too_many_failures(failures(["empty"] * n), videos.iloc[:total], tmp_path, tmp_path,
                                 ExtractConfig(max_failed_fraction=0.0))
        advice = float(msg.split("--max-failed-fraction ")[-1].split(";")[0])
        assert advice >= n / total and too_many_failures(failures(["empty"] * n), videos.iloc[:total], tmp_path,
                                                          tmp_path, ExtractConfig(max_failed_fraction=advice)) is None


def test_features_of_other_weights_are_refused():
    """Each encoder result carries the sha256 of the weights that encoded it; other weights than the
    store records (a cluster node with another cache) stop the run before anything is written."""
    from tvrpipe.errors import ConfigError
    from tvrpipe.features.extract.config import check_weights
    from tvrpipe.features.workers import ClipEncoder

    encoder = ClipEncoder(TINY_MODEL, "none", "cpu", seed=0, threads=1)
    out = encoder.encode_texts(["a dog", "a cat"], max_words=8)
    sha = encoder.facts()["weights_sha256"]
    assert list(out["weights"]) == [sha, sha]
    prov = {"weights_sha256": sha, "model": TINY_MODEL, "pretrained": "none"}
    check_weights(out, prov, "text")
    other = ClipEncoder(TINY_MODEL, "none", "cpu", seed=1, threads=1)  # another random init
    size = other.facts()["image_size"]
    video = {"row": 0, "frames": np.zeros((2, size, size, 3), np.uint8), "mask": np.ones(2, bool),
             "timestamps": np.zeros(2, np.float32), "error": ""}
    with pytest.raises(ConfigError, match=rf"an image encoder loaded weights with sha256 "
                                          rf"{other.facts()['weights_sha256'][:16]}\.\.\., but the store records "
                                          rf"{sha[:16]}\.\.\. for {TINY_MODEL} / none: every process"):
        check_weights(other.encode_videos(video), prov, "image")


def test_videos_per_encoder_call_from_batch_size_encode_frames_or_the_gpu():
    """--batch-size is videos a call; --encode-frames N is N // F videos (at least one); auto is 16 videos on a
    CPU (--batch-size's old default: CPU stores are computed in the same calls), and on cuda the frames that fit
    the GPU // F, 16 until they are measured. Both sizes at once, or an invalid one, are refused."""
    from tvrpipe.features.extract.config import encode_frames_value

    assert ExtractConfig().videos_per_call(12) == 16 and not ExtractConfig().fits_device
    assert ExtractConfig(batch_size=3).videos_per_call(12, fitted=3072) == 3
    assert not ExtractConfig(batch_size=3, device="cuda").fits_device
    assert [ExtractConfig(encode_frames=n).videos_per_call(12) for n in (1, 12, 71, 3072)] == [1, 1, 5, 256]
    gpu = ExtractConfig(device="cuda")
    assert gpu.fits_device and gpu.videos_per_call(12) == 16  # not measured yet: the early decodes' guess
    assert [gpu.videos_per_call(f, fitted=3072) for f in (12, 64)] == [256, 48]
    assert gpu.videos_per_call(12, fitted=12) == 1
    assert ExtractConfig(encode_frames=96, device="cuda").videos_per_call(12, fitted=3072) == 8  # N wins
    assert [encode_frames_value(s) for s in ("auto", " 512 ")] == ["auto", 512]
    with pytest.raises(ConfigError, match=r"--encode-frames must be auto or a number of frames >= 1, got 'many'"):
        encode_frames_value("many")
    for bad in (0, -4, "512", 2.5, True):
        with pytest.raises(ConfigError, match="--encode-frames must be auto or a number of frames >= 1"):
            ExtractConfig(encode_frames=bad)
    with pytest.raises(ConfigError, match=r"--batch-size 4 \(videos per encoder call\) and --encode-frames 96 "
                                          r"\(frames per call\) both size the encoder's calls: give one"):
        ExtractConfig(batch_size=4, encode_frames=96)
    from tvrpipe.features.extract import ExtractSummary

    fitted = ExtractSummary(Path("f"), 10, videos_per_call=256, fitted_frames=3072).lines()
    assert "encoder calls: up to 256 videos (3072 frames fit the GPU's free memory, --encode-frames auto)" in fitted
    assert not any("encoder calls" in line for line in ExtractSummary(Path("f"), 10, videos_per_call=16).lines())


def test_encode_frames_auto_fits_the_free_gpu_memory_measured_with_a_probe(monkeypatch):
    """--encode-frames auto on cuda, with the device's memory queries replaced (no GPU here): a frame's cost is
    the probe call's peak allocation above what was allocated before, over its frames; the frames per call are
    half the free memory over that, at most 3,072 and at least one video's F."""
    from tvrpipe.features import workers
    from tvrpipe.features.workers import ClipEncoder, fit_frames

    assert fit_frames(8e9, 1e7, 12) == 400  # half of 8 GB at 10 MB a frame
    assert fit_frames(80e9, 1.5e6, 12) == 3072  # capped
    assert fit_frames(1e8, 1e7, 12) == 12  # 5 fit: one video's frames still go in one call
    assert fit_frames(8e9, 1e7, 12, cap=100, share=1.0) == 100 and fit_frames(8e9, 0.0, 64) == 3072

    calls: list = []
    allocated = 3_000_000  # the weights, before the probe
    cost = 2_000_000  # what a frame of the fake probe allocates
    gpu = {"free": 4_000_000_000, "peak": allocated}

    def reset(device=None) -> None:
        calls.append("reset")
        gpu["peak"] = allocated

    def probe(frames: np.ndarray) -> np.ndarray:
        calls.append(("probe", len(frames)))
        assert frames.dtype == np.uint8 and frames.shape[1:] == (64, 64, 3) and not frames.any()
        gpu["peak"] = allocated + len(frames) * cost
        return np.zeros((len(frames), 64), np.float16)

    fake = {"synchronize": lambda device=None: calls.append("sync"), "reset_peak_memory_stats": reset,
            "memory_allocated": lambda device=None: allocated,
            "max_memory_allocated": lambda device=None: gpu["peak"],
            "empty_cache": lambda: calls.append("empty"),
            "mem_get_info": lambda device=None: (gpu["free"], 80_000_000_000)}
    for name, f in fake.items():
        monkeypatch.setattr(torch.cuda, name, f)
    assert workers.device_memory("cuda:0", probe, 64) == (4_000_000_000, 2_000_000.0)
    assert calls == ["sync", "reset", ("probe", workers.PROBE_FRAMES), "sync", "empty"]
    encoder = ClipEncoder(TINY_MODEL, "none", "cpu", seed=0, threads=1)
    monkeypatch.setattr(encoder, "_encode", probe)
    assert encoder.fitted_frames(12) == 1000  # 2 GB of the 4 GB free, at 2 MB a frame
    gpu["free"] = 80_000_000_000
    assert encoder.fitted_frames(12) == 3072
    assert ExtractConfig(device="cuda").videos_per_call(12, fitted=encoder.fitted_frames(12)) == 256
    gpu["free"] = 30_000_000  # a nearly full GPU: 7 frames fit, but a video's 12 go in one call
    assert encoder.fitted_frames(12) == 12


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a Ray cluster without GPUs")
def test_gpu_work_on_a_cluster_without_gpus_fails_naming_the_option(ray_session):
    """extract --device cuda on a cluster, finetune --use-gpu and sweep --gpus-per-run share this
    check; without it Ray waited forever to place the work."""
    from tvrpipe.cluster import require_gpus
    from tvrpipe.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--gpus-per-run 0.5: needs 0.5 GPU, and the Ray cluster has 0; "
                                          r"use --gpus-per-run 0, or run on a cluster whose nodes have GPUs$"):
        require_gpus(0.5, "--gpus-per-run 0.5", "use --gpus-per-run 0")
    with pytest.raises(ConfigError, match=r"^--use-gpu with --num-workers 2: needs 2 GPUs, and the Ray cluster"):
        require_gpus(2, "--use-gpu with --num-workers 2", "drop --use-gpu")
    require_gpus(0, "--gpus-per-run 0", "")  # nothing needed, nothing refused


def test_no_gpu_or_no_cluster_fails_before_the_store_is_created_and_not_when_nothing_is_left(data, store_dir,
                                                                                             tmp_path):
    """--device cuda without a GPU (Ray waited forever to place the encoders) and an --address where
    nothing answers fail before the store exists; on a complete store, where a rerun does nothing,
    neither is needed."""
    from tvrpipe.errors import ConfigError

    out = tmp_path / "f"
    cases = [({"address": f"127.0.0.1:{_free_port()}"}, "--address 127.0.0.1:.*cannot connect")]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "--device cuda: (this machine has no CUDA GPU|needs 1 GPU, and the Ray "
                                          "cluster has 0)"))  # the latter where this process joined a Ray
    for kw, message in cases:
        with pytest.raises(ConfigError, match=message):
            extract(data / "manifest", data / "videos", out, _cfg(**kw))
        assert not (out / "features.zarr").exists()
        done = tmp_path / f"done-{len(kw)}-{next(iter(kw))}"
        shutil.copytree(store_dir, done, ignore=shutil.ignore_patterns(".tvrpipe.lock"))
        s = extract(data / "manifest", data / "videos", done, _cfg(retry_failed=False, **kw))
        assert (s.videos_done, s.texts_done) == (0, 0)


def test_gpus_are_checked_per_node_as_well(monkeypatch):
    """A task is placed on one node: two one-GPU nodes cannot run a 2-GPU sweep run, but can run two
    one-GPU finetune workers."""
    import ray

    from tvrpipe.cluster import require_gpus
    from tvrpipe.errors import ConfigError

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0}},
                                               {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 1.0}},
                                               {"Alive": False, "Resources": {"GPU": 8.0}}])
    require_gpus(2, "--use-gpu with --num-workers 2", "drop --use-gpu", per_task=1)
    with pytest.raises(ConfigError, match=r"^--gpus-per-run 2: a task needs 2 GPUs on one node, and the largest "
                                          r"node has 1; use --gpus-per-run 0, or run on nodes with more GPUs$"):
        require_gpus(2, "--gpus-per-run 2", "use --gpus-per-run 0")
    with pytest.raises(ConfigError, match=r"needs 3 GPUs, and the Ray cluster has 2"):
        require_gpus(3, "--use-gpu with --num-workers 3", "drop --use-gpu", per_task=1)


def test_every_form_of_address_is_checked_before_ray_waits(monkeypatch):
    """HOST:PORT, ray://HOST:PORT and auto (Ray resolves auto to the last cluster started on this machine,
    whose address outlives it, and then retried forever): a stopped cluster is one line naming the option."""
    import socket

    import ray._private.services as services

    from tvrpipe.cluster import check_reachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ConfigError, match=rf"--address {re.escape(address)}: cannot connect to the Ray cluster"):
            check_reachable(address, timeout=2)
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda addr, temp_dir=None: f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS auto \(auto: the last cluster started on this machine, at "
                                          rf"127\.0\.0\.1:{port}\): cannot connect .*that cluster has stopped"):
        check_reachable("auto", timeout=2, option="RAY_ADDRESS")
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", lambda addr, temp_dir=None: None)
    with pytest.raises(ConfigError, match=r"--address auto: no Ray cluster was started on this machine"):
        check_reachable("auto")


def test_train_head_starts_a_temporal_transformer_from_the_stores_clip(store_dir, tmp_path, cli):
    """--init-from-clip loads the CLIP the store was extracted with (its provenance names it) and starts
    seqtransf's temporal transformer from its text transformer, as CLIP4Clip does; config.yaml records what was
    copied. A head with nothing to copy records that it kept its own initialisation."""
    import yaml

    from tvrpipe.heads.base import create_head
    from tvrpipe.rundir import load_head

    r = cli("train-head", "--features", store_dir, "--method", "seqtransf", "--epochs", 0, "--set", "num_heads=2",
            "--init-from-clip", "--out", tmp_path / "s")
    assert r.exit_code == 0, r.output
    cfg = yaml.safe_load((tmp_path / "s" / "config.yaml").read_text())
    assert cfg["train"]["init_from_clip"] is True and cfg["resolved"]["init_from_clip"][:2] == ["block 0", "block 1"]
    head = load_head(tmp_path / "s" / "checkpoints" / "best.safetensors")
    prov = open_store(store_dir).provenance
    torch.manual_seed(123)  # another draw: only what CLIP gave can agree
    ref = create_head("seqtransf", embed_dim=int(prov["embed_dim"]), num_heads=2)
    assert ref.init_from_clip(load_clip(TINY_MODEL, "none", seed=int(prov.get("seed", 0))).model)
    for k in (0, 1):  # the tiny CLIP's two text layers; the head's further blocks keep their own initialisation
        for (name, a), (_, b) in zip(head.blocks[k].named_parameters(), ref.blocks[k].named_parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"block {k} {name}")
    assert not torch.equal(head.blocks[2].in_proj.weight, ref.blocks[2].in_proj.weight)

    r = cli("train-head", "--features", store_dir, "--method", "xpool", "--epochs", 0, "--init-from-clip", "--out",
            tmp_path / "x")
    assert r.exit_code == 0, r.output
    cfg = yaml.safe_load((tmp_path / "x" / "config.yaml").read_text())
    assert cfg["train"]["init_from_clip"] is False and cfg["resolved"]["init_from_clip"].startswith("nothing: ")


def test_init_from_clip_on_a_generated_store_is_one_line(tmp_path, cli):
    r = cli("synth", "--features-only", "--out", tmp_path / "g", "--set", "train_videos=40", "--set", "test_videos=20")
    assert r.exit_code == 0, r.output
    r = cli("train-head", "--features", tmp_path / "g", "--method", "seqtransf", "--init-from-clip", "--out",
            tmp_path / "r")
    assert r.exit_code == 1 and ("was generated by `tvrpipe synth --features-only`, so no CLIP made its features"
                                 in " ".join(r.output.split())), r.output
    assert not (tmp_path / "r").exists()
