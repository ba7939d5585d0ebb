"""``tvrpipe extract``: manifest + videos -> CLIP features in the Zarr store, with Ray Data.

The flow (DESIGN.md, "Extraction")::

    manifest rows of pending shards
      -> decode actors (CPU, 1 core each): decord, uniform F frames, resize at decode, centre crop;
         each owns a killable decode subprocess with a per-video timeout and a PyAV fallback
      -> encode actors (GPU when --device cuda, fp16 autocast; else CPU): open_clip frame [CLS]
      -> the driver buffers rows per shard and writes each whole shard, then its marker
    texts: shards of captions -> encode actors (tokens, mask, EOS sentence) -> the driver writes

Decode is the bottleneck (DESIGN.md measured ~160 frames/s per core for 720p H.264), so decoding
gets the cores and encoding overlaps with it. Locally ``ray.init()`` starts a private instance;
``--address``/``RAY_ADDRESS`` runs the same code on a cluster (paths must then be visible to
every node). A bad video is recorded in ``failures.parquet`` with zero features and an all-False
mask; it never stops the run. Rerunning the same command resumes: complete shards are skipped.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.errors import ConfigError
from tvrpipe.pipeline.manifest import read_manifest
from tvrpipe.pipeline.store import StoreWriter, make_provenance, manifest_sha256

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractConfig:
    """Everything that decides what an extraction computes and how it runs.

    Attributes mirror ``tvrpipe extract``'s options; ``frames``/``max_words`` of None take the
    manifest's dataset defaults.
    """

    model: str = "ViT-B-32"
    pretrained: str = "openai"
    frames: int | None = None
    max_words: int | None = None
    batch_size: int = 16  # videos per encoder call (x frames = images per forward)
    device: str = "cpu"
    address: str | None = None
    decoders: int | None = None  # decode actors; default: one per CPU of the (local) cluster
    encoders: int = 1  # encode actors (one per GPU on a GPU cluster)
    timeout_s: float = 60.0  # per-video decode wall clock
    video_shard: int = 64
    text_shard: int = 256
    seed: int = 0  # for --pretrained none
    overwrite: bool = False
    progress: bool = True


@dataclass
class ExtractSummary:
    """What an extraction did."""

    out: Path
    videos_total: int
    videos_done: int = 0  # extracted in this run (failed ones included)
    videos_skipped: int = 0  # in shards completed by an earlier run
    texts_done: int = 0
    texts_skipped: int = 0
    frames_done: int = 0
    failed: int = 0  # failures in the whole store (this run and earlier ones)
    failure_kinds: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """A short human-readable summary."""
        rate = self.videos_done / self.seconds if self.seconds else 0.0
        out = [
            f"videos: {self.videos_done} extracted, {self.videos_skipped} already done, "
            f"{self.failed} failed (of {self.videos_total}); texts: {self.texts_done} encoded, "
            f"{self.texts_skipped} already done",
            f"{self.seconds:.1f} s, {rate:.2f} videos/s, {self.frames_done / max(self.seconds, 1e-9):.1f} frames/s",
        ]
        if self.failure_kinds:
            kinds = ", ".join(f"{k}: {n}" for k, n in Counter(self.failure_kinds).most_common(5))
            out.append(f"failures by kind: {kinds} (see {self.out / 'failures.parquet'})")
        return out


# ------------------------------------------------------------------------- Ray Data stages


class DecodeStage:
    """Ray Data callable: decodes one batch of video rows into uint8 frames (or a failure)."""

    def __init__(self, frames: int, image_size: int, timeout_s: float) -> None:
        from tvrpipe.pipeline.decode import DecodeWorker

        self.frames, self.image_size = frames, image_size
        self.worker = DecodeWorker(timeout_s=timeout_s)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tvrpipe.pipeline.decode import DecodeFailure

        n, F, S = len(batch["row"]), self.frames, self.image_size
        frames = np.zeros((n, F, S, S, 3), np.uint8)
        mask = np.zeros((n, F), bool)
        stamps = np.full((n, F), np.nan, np.float32)
        errors = np.array([""] * n, dtype=object)
        for i in range(n):
            start, end = batch["start_s"][i], batch["end_s"][i]
            try:
                d = self.worker.decode(
                    str(batch["path"][i]), F, S,
                    None if np.isnan(start) else float(start), None if np.isnan(end) else float(end),
                )
                frames[i], mask[i], stamps[i] = d.frames, d.mask, d.timestamps
            except DecodeFailure as e:
                errors[i] = f"{e.kind}: {e.detail}"
        return {"row": batch["row"], "frames": frames, "mask": mask, "timestamps": stamps, "error": errors}


class EncodeStage:
    """Ray Data callable: encodes the valid frames of a batch of videos with open_clip."""

    def __init__(self, model: str, pretrained: str, device: str, seed: int, threads: int) -> None:
        import torch

        from tvrpipe.pipeline.clip import load_clip

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.bundle = load_clip(model, pretrained, device=device, seed=seed)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tvrpipe.pipeline.clip import encode_frames

        frames, mask = batch["frames"], batch["mask"]  # (B, F, S, S, 3), (B, F)
        B, F = mask.shape
        out = np.zeros((B, F, self.bundle.embed_dim), np.float16)
        if mask.any():
            emb = encode_frames(self.bundle, frames[mask])  # (n_valid, D)
            out[mask] = emb.numpy().astype(np.float16)
        return {"row": batch["row"], "emb": out, "mask": mask, "timestamps": batch["timestamps"],
                "error": batch["error"]}


class TextStage:
    """Ray Data callable: tokenises and encodes one shard of captions per call."""

    def __init__(self, model: str, pretrained: str, device: str, seed: int, max_words: int, threads: int) -> None:
        import torch

        from tvrpipe.pipeline.clip import load_clip

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.bundle = load_clip(model, pretrained, device=device, seed=seed)
        self.max_words = max_words

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from tvrpipe.pipeline.clip import encode_text_tokens, tokenize

        ids, mask = tokenize(self.bundle, [str(t) for t in batch["text"]], self.max_words)
        tokens, sentence = encode_text_tokens(self.bundle, ids)
        return {"row": batch["row"], "tokens": tokens.numpy().astype(np.float16),
                "token_mask": mask.numpy(), "sentence": sentence.numpy().astype(np.float16)}


# ------------------------------------------------------------------------------- helpers


def _ray_init(address: str | None, num_cpus: int | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.verbose_progress = False


def _cluster_cpus() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", os.cpu_count() or 1)))


def _progress(enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        disable=not enabled, transient=False,
    )


def _rows_for(shards, table: pd.DataFrame) -> pd.DataFrame:
    idx = np.concatenate([np.arange(s.start, s.stop) for s in shards]) if shards else np.array([], int)
    return table.iloc[idx].assign(row=idx)


def _video_items(rows: pd.DataFrame, video_root: Path) -> list[dict[str, Any]]:
    return [
        {"row": int(r.row), "path": str(video_root / r.path),
         "start_s": float("nan") if pd.isna(r.start_s) else float(r.start_s),
         "end_s": float("nan") if pd.isna(r.end_s) else float(r.end_s)}
        for r in rows.itertuples()
    ]


class _ShardBuffer:
    """Collects rows that arrive in any order; yields a shard's arrays once all its rows are in."""

    def __init__(self, shards, width: dict[str, tuple[tuple[int, ...], Any]]) -> None:
        self.of_row = {}
        self.pending = {}
        for s in shards:
            for r in range(s.start, s.stop):
                self.of_row[r] = s
        self.width = width
        self.filled: dict[int, int] = Counter()
        self.data: dict[int, dict[str, np.ndarray]] = {}

    def add(self, row: int, values: dict[str, Any]) -> Any:
        s = self.of_row[row]
        if s.index not in self.data:
            n = s.stop - s.start
            self.data[s.index] = {k: np.full((n, *shape), fill, dtype=np.asarray(fill).dtype if dt is None else dt)
                                  for k, (shape, fill, dt) in self.width.items()}
        for k, v in values.items():
            self.data[s.index][k][row - s.start] = v
        self.filled[s.index] += 1
        if self.filled[s.index] == s.stop - s.start:
            return s, self.data.pop(s.index)
        return None


# ---------------------------------------------------------------------------------- run


def extract(
    manifest_dir: str | os.PathLike[str],
    video_root: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: ExtractConfig | None = None,
) -> ExtractSummary:
    """Extract CLIP features for every video and caption of a manifest into a feature store.

    Args:
        manifest_dir: a manifest (``tvrpipe manifest build`` or ``tvrpipe synth``).
        video_root: the folder the manifest's video paths are relative to.
        out_dir: the store's directory; rerunning with the same settings resumes it.
        config: model, sampling and execution options.

    Returns:
        What was done, skipped and failed.

    Example:
        >>> extract("data/msrvtt/manifest", "data/msrvtt/videos", "features/msrvtt-b32",
        ...         ExtractConfig(model="ViT-B-32", pretrained="openai", device="cuda"))  # doctest: +SKIP
    """
    from ray.data import ActorPoolStrategy

    from tvrpipe.pipeline.clip import load_clip, preprocess_description
    from tvrpipe.pipeline.decode import FRAME_SAMPLING

    cfg = config or ExtractConfig()
    t0 = time.perf_counter()
    manifest = read_manifest(manifest_dir)
    root = Path(video_root)
    if not root.is_dir():
        raise ConfigError(f"--video-root {root}: not a directory")
    if cfg.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {cfg.device!r}")
    for opt, value in (("--batch-size", cfg.batch_size), ("--video-shard", cfg.video_shard),
                       ("--text-shard", cfg.text_shard), ("--encoders", cfg.encoders),
                       ("--decoders", cfg.decoders or 1), ("--timeout", cfg.timeout_s)):
        if value <= 0:
            raise ConfigError(f"{opt} must be > 0, got {value}")
    F = cfg.frames or int(manifest.meta.get("frames", 12))
    L = cfg.max_words or int(manifest.meta.get("max_words", 32))

    # The driver loads the model once (on CPU) for provenance: weights hash, D, preprocessing.
    bundle = load_clip(cfg.model, cfg.pretrained, device="cpu", seed=cfg.seed)
    if L > bundle.context_length:
        raise ConfigError(f"--max-words {L} exceeds the model's context length {bundle.context_length}")
    provenance = make_provenance(
        dataset=manifest.meta.get("dataset", "unknown"), split_set=manifest.meta.get("split_set"),
        model=cfg.model, pretrained=cfg.pretrained, weights_sha256=bundle.weights_sha256,
        frames=F, max_words=L, embed_dim=bundle.embed_dim, frame_sampling=FRAME_SAMPLING,
        image_size=bundle.image_size, preprocessing=preprocess_description(bundle),
        manifest_sha256=manifest_sha256(manifest.videos, manifest.captions),
    )
    del bundle
    videos = manifest.videos[["video_id", "split", "path", "start_s", "end_s"]]
    vrow = pd.Series(np.arange(len(videos)), index=videos["video_id"])
    texts = manifest.captions.assign(video_row=vrow.loc[manifest.captions["video_id"]].to_numpy())[
        ["caption_id", "video_id", "video_row", "split", "text"]
    ]
    writer = StoreWriter(out_dir, videos[["video_id", "split", "path"]], texts.drop(columns="text"), provenance,
                         cfg.video_shard, cfg.text_shard, cfg.overwrite)
    summary = ExtractSummary(out=Path(out_dir), videos_total=len(videos))
    v_pending, t_pending = writer.pending("videos"), writer.pending("texts")
    summary.videos_skipped = len(videos) - sum(s.stop - s.start for s in v_pending)
    summary.texts_skipped = len(texts) - sum(s.stop - s.start for s in t_pending)

    if v_pending or t_pending:
        _ray_init(cfg.address)
        cpus = _cluster_cpus()
        gpu = cfg.device == "cuda"
        enc_opts = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 0}
        threads = 1 if gpu else cpus  # CPU encoders share the cores with the decoders
        with _progress(cfg.progress) as bar:
            if t_pending:
                _run_texts(writer, texts, t_pending, cfg, L, enc_opts, threads, bar, summary)
            if v_pending:
                decoders = cfg.decoders or cpus
                _run_videos(writer, videos, v_pending, root, cfg, F, provenance["image_size"], decoders,
                            enc_opts, threads, bar, summary, ActorPoolStrategy)
    failures = writer.finalize()
    summary.failed = len(failures)
    summary.failure_kinds = dict(Counter(e.split(":", 1)[0] for e in failures["error"]))
    summary.seconds = time.perf_counter() - t0
    return summary


def _run_texts(writer, texts, shards, cfg, L, enc_opts, threads, bar, summary) -> None:
    import ray
    from ray.data import ActorPoolStrategy

    rows = _rows_for(shards, texts)
    task = bar.add_task("texts", total=len(rows), rate="")
    ds = ray.data.from_items([{"row": int(r), "text": t} for r, t in zip(rows["row"], rows["text"])])
    ds = ds.map_batches(
        TextStage, fn_constructor_kwargs=dict(model=cfg.model, pretrained=cfg.pretrained, device=cfg.device,
                                              seed=cfg.seed, max_words=L, threads=threads),
        batch_size=cfg.text_shard, compute=ActorPoolStrategy(size=cfg.encoders), **enc_opts,
    )
    D = writer.provenance["embed_dim"]
    buf = _ShardBuffer(shards, {"tokens": ((L, D), 0, np.float16), "token_mask": ((L,), False, bool),
                                "sentence": ((D,), 0, np.float16)})
    t0 = time.perf_counter()
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for i, row in enumerate(batch["row"]):
            done = buf.add(int(row), {k: batch[k][i] for k in ("tokens", "token_mask", "sentence")})
            if done:
                s, d = done
                writer.write_texts(s, d["tokens"], d["token_mask"], d["sentence"])
        summary.texts_done += len(batch["row"])
        bar.update(task, advance=len(batch["row"]),
                   rate=f"{summary.texts_done / (time.perf_counter() - t0):.0f} texts/s")


def _run_videos(writer, videos, shards, root, cfg, F, image_size, decoders, enc_opts, threads, bar, summary,
                ActorPoolStrategy) -> None:
    import ray

    rows = _rows_for(shards, videos)
    task = bar.add_task("videos", total=len(rows), rate="")
    ds = ray.data.from_items(_video_items(rows, root))
    ds = ds.map_batches(
        DecodeStage, fn_constructor_kwargs=dict(frames=F, image_size=image_size, timeout_s=cfg.timeout_s),
        batch_size=1, compute=ActorPoolStrategy(size=decoders), num_cpus=1,
    )
    ds = ds.map_batches(
        EncodeStage, fn_constructor_kwargs=dict(model=cfg.model, pretrained=cfg.pretrained, device=cfg.device,
                                                seed=cfg.seed, threads=threads),
        batch_size=cfg.batch_size, compute=ActorPoolStrategy(size=cfg.encoders), **enc_opts,
    )
    D = writer.provenance["embed_dim"]
    buf = _ShardBuffer(shards, {"emb": ((F, D), 0, np.float16), "mask": ((F,), False, bool),
                                "timestamps": ((F,), np.nan, np.float32)})
    failures: dict[int, list[dict[str, str]]] = {}
    ids = videos["video_id"].to_numpy()
    t0 = time.perf_counter()
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for i, row in enumerate(batch["row"]):
            row = int(row)
            err = str(batch["error"][i])
            shard = buf.of_row[row]
            if err:
                failures.setdefault(shard.index, []).append(
                    {"video_id": str(ids[row]), "stage": "decode", "error": err})
            done = buf.add(row, {"emb": batch["emb"][i], "mask": batch["mask"][i],
                                 "timestamps": batch["timestamps"][i]})
            if done:
                s, d = done
                writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], failures.pop(s.index, []))
        summary.videos_done += len(batch["row"])
        summary.frames_done += int(batch["mask"].sum())
        dt = time.perf_counter() - t0
        bar.update(task, advance=len(batch["row"]),
                   rate=f"{summary.videos_done / dt:.1f} videos/s, {summary.frames_done / dt:.0f} frames/s")
