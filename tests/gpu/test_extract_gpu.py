"""``tvrpipe extract`` on the GPU without Ray (the local executor: decoders are child processes, the encoder a
thread of this process), ViT-B-32 with random weights from a checkpoint file (no download):

- the encoder alone at ``--encode-frames auto``: the frames per call that fit the GPU
  (:meth:`~tvrpipe.features.workers.ClipEncoder.fitted_frames`) and the frames per second it encodes at that
  size in fp16. The goal (>= 25,000 frames/s on an H100/H200) is recorded beside the figure, not asserted: a
  test never asserts a time;
- a whole store extracted on the GPU (precision auto: fp16) against the same videos extracted on the CPU in
  fp32: the same masks, and every valid frame and every sentence at a cosine >= 0.999 to its fp32 counterpart
  (fp16's relative rounding is 4.9e-4 per op, the store's float16 adds as much once; a wrong normalisation,
  resize, frame order or mask drops the cosine far lower).

Nothing here imports Ray: both runs must report the local executor.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tvrpipe.features.clip import encode_frames, load_clip

pytestmark = pytest.mark.gpu

MODEL = "ViT-B-32"
FRAMES = 12  # extract's default frames per video (MSR-VTT's, the manifests' default)
TARGET_FRAMES_PER_S = 25_000  # the goal on an H100/H200, reported with the figure
MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """ViT-B-32's seeded random weights as a checkpoint file, written once, as users pass a pretrained file."""
    from tvrpipe.training.finetune.export import save_clip

    path = tmp_path_factory.mktemp("weights") / f"{MODEL}-random.safetensors"
    save_clip(load_clip(MODEL, "none", seed=0).model, path, {"model": MODEL, "source": "tests/gpu: random, seed 0"})
    return path


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def frames_per_second(call, frames: int, device: torch.device, min_calls: int = 3, min_s: float = 2.0) -> float:
    """Frames per second of ``call()`` (``frames`` frames each), after one untimed warm-up call at the same shape
    (the allocator, cuDNN's and cuBLAS's choices): at least ``min_calls`` calls and ``min_s`` seconds."""
    call()
    synchronize(device)
    calls, t = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t < min_s:
        call()
        calls += 1
    synchronize(device)
    return calls * frames / (time.perf_counter() - t)


def encoder_at_auto(device: torch.device, weights: Path) -> tuple[dict, np.ndarray]:
    """extract's encoder on ``device``, its calls sized and its precision picked as ``--encode-frames auto`` and
    ``--precision auto`` do: its figures, and two videos' embeddings ``(2, F, D)``. The encoder is gone (its GPU
    memory free to be released) once this returns."""
    from tvrpipe.features.extract import ExtractConfig
    from tvrpipe.features.workers import ClipEncoder

    cfg = ExtractConfig(model=MODEL, pretrained=str(weights), device=device.type)
    precision = cfg.encode_precision
    encoder = ClipEncoder(MODEL, str(weights), device.type, 0, os.cpu_count() or 1, precision)
    assert encoder.error is None, encoder.error
    fitted = encoder.fitted_frames(FRAMES) if cfg.fits_device else None
    per_call = cfg.videos_per_call(FRAMES, fitted)
    n, S = per_call * FRAMES, encoder.bundle.image_size
    frames = np.random.default_rng(0).integers(0, 256, (n, S, S, 3), np.uint8)  # (n, 224, 224, 3)
    videos = [{"row": i, "frames": frames[FRAMES * i:FRAMES * (i + 1)], "mask": np.ones(FRAMES, bool),
               "timestamps": np.zeros(FRAMES, np.float32), "error": ""} for i in range(per_call)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rate = frames_per_second(lambda: encoder.encode_videos(*videos), n, device)
    alone = frames_per_second(lambda: encode_frames(encoder.bundle, frames, autocast=precision != "fp32"), n, device)
    r = {"image_size": S, "fitted_frames": fitted or 0, "videos_per_call": per_call, "frames_per_call": n,
         "precision": precision, f"encoder_auto_{precision}_frames_per_s": rate,
         "encode_frames_alone_frames_per_s": alone, "oom_splits": encoder.oom_splits,
         "target_frames_per_s": TARGET_FRAMES_PER_S, "meets_target": rate >= TARGET_FRAMES_PER_S}
    if device.type == "cuda":
        r.update(gpu=torch.cuda.get_device_name(device), peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                 total_gib=torch.cuda.get_device_properties(device).total_memory / 2**30)
    return r, encoder.encode_videos(*videos[:2])["emb"]


def test_the_encoder_alone_at_encode_frames_auto(device, weights, record):
    """Sized as ``--encode-frames auto`` sizes a call (on a GPU: the frames that fit its free memory; on a CPU:
    the default videos per call), in the precision auto picks (fp16 on a GPU), timed through
    ``encode_videos`` (what extract's encoder thread calls: the frames stacked, copied to the GPU, encoded and
    returned) and through ``encode_frames`` on one contiguous array (the model alone)."""
    r, emb = encoder_at_auto(device, weights)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the encoder's memory, for the extraction after this test
    record(f"extract encoder {MODEL} --encode-frames auto {r['precision']} on {device.type}", **r)
    assert r["image_size"] == 224 and r["frames_per_call"] >= FRAMES and r["videos_per_call"] >= 1, r
    assert (r["fitted_frames"] >= FRAMES) == (device.type == "cuda"), r  # measured on a GPU only
    assert emb.shape == (2, FRAMES, 512) and np.isfinite(emb.astype(np.float32)).all()
    for k in (f"encoder_auto_{r['precision']}_frames_per_s", "encode_frames_alone_frames_per_s"):
        assert math.isfinite(r[k]) and r[k] > 0, r


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row cosines of two (n, D) arrays, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)


def test_a_store_extracted_on_the_gpu_matches_one_extracted_on_the_cpu_in_fp32(device, weights, tmp_path, record):
    from tvrpipe.features.extract import ExtractConfig, extract
    from tvrpipe.features.store import open_store
    from tvrpipe.worlds.videos import synthesize

    data = tmp_path / "data"
    synthesize(data, 6, seed=0, progress=False)
    configs = {"gpu": ExtractConfig(model=MODEL, pretrained=str(weights), device=device.type, progress=False),
               "cpu": ExtractConfig(model=MODEL, pretrained=str(weights), device="cpu", precision="fp32",
                                    progress=False)}
    runs = {name: extract(data / "manifest", data / "videos", tmp_path / name, cfg) for name, cfg in configs.items()}
    for summary in runs.values():
        assert (summary.videos_done, summary.failed) == (6, 0), summary
        assert summary.executor == "local", summary  # no Ray: the local executor ran
    gpu, cpu = open_store(tmp_path / "gpu"), open_store(tmp_path / "cpu")
    assert gpu.provenance["weights_sha256"] == cpu.provenance["weights_sha256"]
    assert list(gpu.videos.video_id) == list(cpu.videos.video_id) and list(gpu.texts.caption_id) == \
        list(cpu.texts.caption_id)
    mask = gpu.array("videos/frame_mask")[:]
    np.testing.assert_array_equal(mask, cpu.array("videos/frame_mask")[:])
    assert mask.any(axis=1).all()  # every video has frames
    tmask = gpu.array("texts/token_mask")[:].astype(bool)
    np.testing.assert_array_equal(tmask, cpu.array("texts/token_mask")[:].astype(bool))
    frames = cosines(gpu.array("videos/frames")[:][mask], cpu.array("videos/frames")[:][mask])
    sentences = cosines(gpu.array("texts/sentence")[:], cpu.array("texts/sentence")[:])
    tokens = cosines(gpu.array("texts/tokens")[:][tmask], cpu.array("texts/tokens")[:][tmask])
    r = {"videos": int(mask.shape[0]), "frames": int(mask.sum()), "sentences": int(len(sentences)),
         "precision": configs["gpu"].encode_precision,
         "fitted_frames": runs["gpu"].fitted_frames, "videos_per_call": runs["gpu"].videos_per_call,
         "frames_cosine_min": float(frames.min()), "sentence_cosine_min": float(sentences.min()),
         "tokens_cosine_min": float(tokens.min())}
    record(f"extract store {MODEL} (random weights) on {device.type} vs cpu fp32", **r)
    assert len(frames) == mask.sum() > 0 and len(sentences) > 0
    assert r["frames_cosine_min"] >= MIN_COSINE and r["sentence_cosine_min"] >= MIN_COSINE, r

