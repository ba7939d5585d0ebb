"""``tvrpipe bench finetune``: end-to-end finetuning throughput, data-loading share and peak memory.

One ``tvrpipe finetune --end-to-end`` epoch of ``steps`` steps on generated H.264 videos (by
default MSR-VTT-like: 320x240, 15 s at 30 fps) with random weights of the chosen model, measured
in the same run:

- **clips/s**: training pairs per second in steady state (the first step, which waits for the
  DataLoader workers to start, is left out; ``clips/s over the epoch`` keeps it);
- **data share**: the share of step time the loop waited for decoded batches (0 % means decoding
  keeps up with the model; near 100 % means the run is decode-bound: add loader workers or CPUs);
- **peak memory**: the training process's peak resident set (decoding runs in other processes),
  and on a GPU the peak of ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tvrpipe.bench.extract import BenchVideos, make_bench_videos
from tvrpipe.bench.room import check_room, clip_batch_needs, model_image_size, videos_needs
from tvrpipe.errors import ConfigError
from tvrpipe.rundir import read_epochs

MSRVTT_LIKE = BenchVideos(count=0, width=320, height=240, seconds=15.0, fps=30, gop=250)


@dataclass
class FinetuneBench:
    """One benchmark run's measurements."""

    model: str
    method: str
    device: str
    precision: str
    grad_checkpointing: bool
    batch_size: int
    frames: int
    steps: int
    cpus: int
    loader_workers: int | None
    chunk_size: int | None = None  # pairs CLIP encodes at a time (None: the batch)
    videos: dict = field(default_factory=dict)
    clips_per_s: float = 0.0  # steady state
    data_share: float = 0.0  # steady state
    clips_per_s_epoch: float = 0.0
    data_share_epoch: float = 0.0
    peak_rss_gb: float = 0.0
    peak_gpu_gb: float | None = None

    def lines(self) -> list[str]:
        v = self.videos
        gpu = f", GPU peak {self.peak_gpu_gb:.2f} GB" if self.peak_gpu_gb is not None else ""
        return [
            f"{self.model} (random weights) + {self.method}, end to end, {self.device} {self.precision}"
            f"{', gradient checkpointing' if self.grad_checkpointing else ''}"
            f"{f', chunks of {self.chunk_size}' if self.chunk_size else ''}; batch {self.batch_size} x "
            f"{self.frames} frames, {self.steps} steps; videos {v['width']}x{v['height']}, {v['seconds']:g} s at "
            f"{v['fps']} fps; {self.cpus} CPUs, loader workers {self.loader_workers if self.loader_workers is not None else 'default'}",
            f"steady state: {self.clips_per_s:.2f} clips/s ({self.clips_per_s * self.frames:.1f} frames/s), "
            f"data share {100 * self.data_share:.1f} %",
            f"over the epoch (first step included): {self.clips_per_s_epoch:.2f} clips/s, data share "
            f"{100 * self.data_share_epoch:.1f} %",
            f"peak resident memory of the training process {self.peak_rss_gb:.2f} GB{gpu}",
        ]


def _manifest(out: Path, spec: BenchVideos, train: int) -> Path:
    """The bench videos as a manifest with ``train`` training videos and 2 validation and 2 test ones."""
    from tvrpipe.data.manifest import make_tables, write_manifest

    make_bench_videos(out, spec)
    split = ["train"] * train + ["val", "val", "test", "test"]
    ids = [f"bench_{k:04d}" for k in range(spec.count)]
    v, c = make_tables(
        [{"video_id": i, "path": f"{i}.mp4", "split": s} for i, s in zip(ids, split)],
        [{"caption_id": f"{i}#0", "video_id": i, "text": f"a coloured block number {k} moves right", "split": s}
         for k, (i, s) in enumerate(zip(ids, split))],
    )
    write_manifest(out / "finetune_manifest", v, c, {"dataset": "bench", "split_set": "bench", "frames": 12,
                                                     "max_words": 32})
    return out / "finetune_manifest"


def bench_finetune(
    out: str | os.PathLike[str],
    model: str = "ViT-B-32",
    method: str = "xpool",
    device: str = "cpu",
    precision: str = "fp32",
    batch_size: int = 8,
    frames: int = 12,
    steps: int = 4,
    videos: BenchVideos = MSRVTT_LIKE,
    grad_checkpointing: bool = False,
    loader_workers: int | None = None,
    chunk_size: int | None = None,
) -> FinetuneBench:
    """Run one finetuning epoch of ``steps`` steps and report its throughput and memory.

    Example:
        >>> bench_finetune("bench/finetune", "ViT-B-32", device="cuda", precision="fp16",
        ...                batch_size=32)  # doctest: +SKIP
    """
    import torch

    from tvrpipe.training.finetune import FinetuneConfig, finetune
    from tvrpipe.training.fit import check_device

    # in this command's options, before videos are rendered (FinetuneConfig's own messages name finetune's)
    cuda = device.startswith("cuda")
    if precision == "fp16" and not cuda:
        raise ConfigError("--precision fp16 needs --device cuda (CPU autocast supports bf16: --precision bf16)")
    check_device(device)
    out = Path(out)
    train = batch_size * steps
    spec = BenchVideos(**{**asdict(videos), "count": train + 4})
    cpus = os.cpu_count() or 1
    if loader_workers is not None and loader_workers > 4 * cpus:  # each is a process decoding whole videos
        raise ConfigError(f"--loader-workers {loader_workers}: at most 4 x this machine's {cpus} CPUs "
                          f"({4 * cpus}); the default is the CPUs, at most 8")
    check_room("bench finetune", out, videos_needs(spec.count, spec.width, spec.height, spec.seconds, spec.fps,
                                                   loader_workers if loader_workers is not None else min(cpus, 8))
               + clip_batch_needs(batch_size, frames, model_image_size(model)),
               "--steps, --batch-size, --frames or the videos' size")
    manifest = _manifest(out, spec, train)
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)  # a bench measures a fresh run, never a resumed one
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cfg = FinetuneConfig(end_to_end=True, model=model, pretrained="none", epochs=1, batch_size=batch_size,
                         frames=frames, max_steps=steps, use_gpu=cuda, precision=precision,
                         grad_checkpointing=grad_checkpointing, chunk_size=chunk_size, loader_workers=loader_workers,
                         eval_batch=4)
    finetune(manifest, out / "videos", method, run, cfg, progress=True)
    row = read_epochs(run).iloc[-1]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return FinetuneBench(
        model=model, method=method, device=device, precision=precision, grad_checkpointing=grad_checkpointing,
        batch_size=batch_size, frames=frames, steps=steps, cpus=cpus, loader_workers=loader_workers,
        chunk_size=chunk_size, videos=asdict(spec), clips_per_s=float(row["clips_per_s_steady"]), data_share=float(row["data_share_steady"]),
        clips_per_s_epoch=float(row["clips_per_s"]), data_share_epoch=float(row["data_share"]),
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        peak_gpu_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
    )
