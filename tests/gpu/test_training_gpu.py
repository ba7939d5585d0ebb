"""The trainers and benchmarks on the GPU: ``train-head --device cuda`` against the same run on the CPU,
``finetune --end-to-end --use-gpu`` in fp32, fp16 (GradScaler) and bf16, and ``bench eval`` / ``bench
finetune`` on the device. No Ray: finetune runs in this process (``--num-workers 0``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from tvrpipe.features.clip import TINY_MODEL, load_clip
from tvrpipe.training.finetune import FinetuneConfig, finetune
from tvrpipe.training.fit import TrainConfig, fit
from tvrpipe.worlds.features import GenSpec, generate_store

pytestmark = pytest.mark.gpu


def test_train_head_on_the_gpu_selects_the_cpu_epoch_with_the_cpu_metrics(tmp_path, device, fp32_exact, cli):
    """seqtransf has no dropout and draws no noise, so the two runs differ only by float rounding: the
    same epoch is selected and each metric is the CPU's to within one rank (100 / 48 test captions)."""
    store = generate_store(tmp_path / "s", GenSpec(train_videos=192, val_videos=48, test_videos=48, frames=6,
                                                   max_words=8, embed_dim=32, noise=0.6, seed=0))
    cpu = fit(store, "seqtransf", tmp_path / "cpu", TrainConfig(epochs=4, batch_size=32, lr=1e-3, seed=0),
              progress=False)
    r = cli("train-head", "--features", store, "--method", "seqtransf", "--out", tmp_path / "gpu", "--epochs", "4",
            "--batch-size", "32", "--lr", "1e-3", "--device", str(device))
    assert r.exit_code == 0, r.output
    gpu = json.loads((tmp_path / "gpu" / "metrics.json").read_text())
    assert gpu["selected_epoch"] == cpu["selected_epoch"]
    for split in ("val", "test"):
        for direction in ("t2v", "v2t"):
            for m in ("R@1", "R@5", "R@10"):
                assert abs(gpu[split][direction][m] - cpu[split][direction][m]) <= 100 / 48 + 1e-9, (split, direction, m)
    a, b = (pd.read_csv(tmp_path / run / "epochs.csv")["loss"] for run in ("cpu", "gpu"))
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()  # the training losses, epoch by epoch


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    from tvrpipe.worlds.videos import synthesize

    d = tmp_path_factory.mktemp("videos")
    synthesize(d, 40, seed=1, progress=False)
    return d


def _cfg(device: torch.device, precision: str, **kw) -> FinetuneConfig:
    return FinetuneConfig(**{"model": TINY_MODEL, "pretrained": "none", "epochs": 3, "epoch_pairs": "videos",
                             "batch_size": 8, "clip_lr": 1e-3, "head_lr": 1e-3, "loader_workers": 0,
                             "use_gpu": device.type == "cuda", "precision": precision, **kw})


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_finetune_end_to_end_on_the_gpu_learns_and_resumes(videos, tmp_path, device, precision, interrupt_call):
    import tvrpipe.training.finetune.loop as ft

    if precision == "fp16" and device.type != "cuda":
        pytest.skip("fp16 autocast trains on CUDA only (--precision fp16 needs --use-gpu)")
    cfg = _cfg(device, precision, end_to_end=True)
    full = finetune(videos / "manifest", videos / "videos", "xpool", tmp_path / "full", cfg, progress=False)
    losses = pd.read_csv(tmp_path / "full" / "epochs.csv")["loss"]
    assert losses.notna().all() and losses.iloc[-1] < losses.iloc[0], f"{precision}: the loss did not fall: {list(losses)}"
    assert full["export"] and (tmp_path / "full" / "clip.safetensors").is_file()

    restore = interrupt_call(ft, "evaluate", 2)  # Ctrl-C in epoch two's validation
    with pytest.raises(KeyboardInterrupt):
        finetune(videos / "manifest", videos / "videos", "xpool", tmp_path / "cut", cfg, progress=False)
    restore()
    assert len(pd.read_csv(tmp_path / "cut" / "epochs.csv")) == 1
    resumed = finetune(videos / "manifest", videos / "videos", "xpool", tmp_path / "cut", cfg, progress=False)
    rows = pd.read_csv(tmp_path / "cut" / "epochs.csv")
    assert rows["epoch"].tolist() == [1, 2, 3]
    # the same epochs: GPU kernels may sum in another order from run to run (atomics), so the losses agree
    # to rounding carried through three epochs, not to the bit
    assert (rows["loss"] - losses).abs().max() <= 1e-2 * losses.abs().max(), (list(rows["loss"]), list(losses))
    assert resumed["selected_epoch"] >= 1


def test_a_frozen_clip_stays_frozen_under_the_gradient_scaler(videos, tmp_path, device):
    precision = "fp16" if device.type == "cuda" else "bf16"  # fp16 (GradScaler) is CUDA's
    finetune(videos / "manifest", videos / "videos", "xpool", tmp_path / "run",
             _cfg(device, precision, end_to_end=False, epochs=2), progress=False)
    before = load_clip(TINY_MODEL, "none", "cpu", seed=0).model.state_dict()
    after = load_file(str(tmp_path / "run" / "checkpoints" / "clip_best.safetensors"))
    moved = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert not moved, f"frozen CLIP weights changed under {precision}: {moved[:5]}"
    head = load_file(str(tmp_path / "run" / "checkpoints" / "best.safetensors"))
    assert head  # the head trained beside it (its checkpoint is written)


def test_bench_eval_and_bench_finetune_on_the_device_write_their_json(tmp_path, device, cli):
    r = cli("bench", "eval", "--device", str(device), "--method", "xpool", "--method", "tokenwise",
            "--size", "msrvtt1k", "--json", tmp_path / "eval.json")
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "eval.json").read_text())
    assert {x["method"] for x in rows} == {"xpool", "tokenwise"} and all(x["device"] == str(device) for x in rows)
    assert all(x["seconds"] > 0 for x in rows)
    precision = "fp16" if device.type == "cuda" else "bf16"
    r = cli("bench", "finetune", "--out", tmp_path / "ft", "--model", TINY_MODEL, "--device", str(device),
            "--precision", precision, "--batch-size", "4", "--steps", "3", "--frames", "4",
            "--width", "96", "--height", "72", "--seconds", "2", "--json", tmp_path / "ft.json")
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "ft.json").read_text())
    assert res["device"] == str(device) and res["precision"] == precision and res["clips_per_s"] > 0


def test_the_trainer_configs_take_the_device(device):
    assert TrainConfig(device=str(device)).device == str(device)
    assert replace(_cfg(device, "fp32"), end_to_end=True).use_gpu == (device.type == "cuda")


@pytest.mark.parametrize("precision, checkpointing", [("fp16", False), ("fp32", True)])
def test_dry_run_memory_estimate_against_the_measured_peak(videos, tmp_path, device, record, precision, checkpointing):
    """`finetune --recipe xpool-msrvtt --dry-run` estimates a step's peak memory from CPU steps; a short real
    run of the same recipe (ViT-B/32 random weights, batch 16 x 12 frames) measures it with CUDA's allocator.
    The estimate leaves out workspaces and fragmentation, so it may be lower, but not by half, nor above 1.5x."""
    from tvrpipe.training.recipes import finetune_config, load_recipe

    if device.type != "cuda":
        pytest.skip("the peak is measured by CUDA's allocator")
    cfg, _ = finetune_config(load_recipe("xpool-msrvtt"), {
        "pretrained": "none", "epochs": 1, "batch_size": 16, "epoch_pairs": "videos", "precision": precision,
        "grad_checkpointing": checkpointing, "use_gpu": True, "loader_workers": 0, "max_steps": 2})
    plan = finetune(videos / "manifest", videos / "videos", "xpool", tmp_path / "r", cfg, dry_run=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    finetune(videos / "manifest", videos / "videos", "xpool", tmp_path / "r", cfg, progress=False)
    peak = torch.cuda.max_memory_allocated(device)
    estimate = plan["memory"]["total"]
    record("dry_run_memory_estimate", precision=precision, grad_checkpointing=checkpointing,
           estimate_gib=estimate / 2**30, peak_gib=peak / 2**30, ratio_peak_to_estimate=peak / estimate,
           parts_gib={k: plan["memory"][k] / 2**30 for k in ("weights", "gradients", "optimizer", "inputs",
                                                              "activations")})
    assert 0.67 <= peak / estimate <= 2.0
