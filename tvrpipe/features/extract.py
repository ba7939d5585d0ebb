"""``tvrpipe extract``: manifest + videos -> CLIP features in the Zarr store, with Ray Data.

The flow (DESIGN.md, "Extraction")::

    manifest rows of pending shards
      -> decode actors (CPU, 1 core each): decord, uniform F frames, resize at decode, centre crop;
         each owns a killable decode subprocess with a per-video timeout and a PyAV fallback
      -> encode actors (GPU when --device cuda, fp16 autocast; else CPU): open_clip frame [CLS]
      -> the driver buffers rows per shard and writes each whole shard, then its marker
    texts: shards of captions -> encode actors (tokens, mask, EOS sentence) -> the driver writes

Decode is the bottleneck (DESIGN.md measured ~160 frames/s per core for 720p H.264), so decoding
gets the cores and encoding overlaps with it. Locally ``ray.init(address="local")`` starts a private instance;
``--address``/``RAY_ADDRESS`` runs the same code on a cluster (paths must then be visible to
every node). A bad video is recorded in ``failures.parquet`` with zero features and an all-False
mask; it never stops the run, but a run where more than ``max_failed_fraction`` of the videos
failed exits with an error and leaves the store incomplete (nothing is lost: it stays resumable).

Rerunning the same command resumes: whole shards are skipped, damaged shards (a chunk missing,
truncated or overwritten since it was written) are re-extracted, and the videos recorded as failed
are retried (their shard is rewritten with the rows that succeeded before kept as they were).
Options and the manifest are checked before Ray starts or a model loads, and the store is locked
while written (:mod:`tvrpipe.lock`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.cluster import check_reachable, cluster_cpus, ray_address, ray_init, require_gpus
from tvrpipe.config import above, at_least, check_fields, one_of, within
from tvrpipe.data.manifest import read_manifest
from tvrpipe.errors import ConfigError, NonFiniteError, TvrpipeError
from tvrpipe.features.store import Shard, StoreWriter, make_provenance, manifest_sha256, nonfinite_rows
from tvrpipe.features.workers import DecodeStage, EncodeStage, TextStage
from tvrpipe.lock import check_writable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExtractConfig:
    """Everything that decides what an extraction computes and how it runs.

    Attributes mirror ``tvrpipe extract``'s options; ``frames``/``max_words`` of None take the
    manifest's dataset defaults.
    """

    model: str = "ViT-B-32"
    pretrained: str = "openai"
    frames: int | None = at_least(1, None, option="--frames")
    max_words: int | None = at_least(2, None, option="--max-words")
    batch_size: int = at_least(1, 16, option="--batch-size")  # videos per encoder call (x frames = images per forward)
    device: str = one_of(("cpu", "cuda"), "cpu", option="--device")
    address: str | None = None
    # decode actors; default: one per CPU of the (local) cluster
    decoders: int | None = at_least(1, None, option="--decoders")
    encoders: int = at_least(1, 1, option="--encoders")  # encode actors (one per GPU on a GPU cluster)
    # per-video decode wall clock (an infinity is refused by the maximum below, with its own message)
    timeout_s: float = above(0, 60.0, option="--timeout", infinite=True)
    video_shard: int = at_least(1, 64, option="--video-shard")
    text_shard: int = at_least(1, 256, option="--text-shard")
    seed: int = 0  # for --pretrained none
    overwrite: bool = False
    progress: bool = True
    retry_failed: bool = True  # a rerun retries the videos recorded as failed
    # choice: a wrong --video-root or a broken decoder fails (nearly) every video, while a real
    # download that lost a few files stays well under 10 %; above it the run exits 1
    max_failed_fraction: float = within(0.0, 1.0, 0.1, option="--max-failed-fraction")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid option (every field's declared range, then
        the decoder's longest wait); reads and creates nothing."""
        from tvrpipe.features.decode import check_timeout  # not at import: decode loads decord and av

        check_fields(self, "extract")
        check_timeout(self.timeout_s)


@dataclass
class ExtractSummary:
    """What an extraction did. ``videos_done + videos_skipped + failed == videos_total``."""

    out: Path
    videos_total: int
    videos_done: int = 0  # extracted in this run (failures not included)
    videos_skipped: int = 0  # extracted by an earlier run (failures not included)
    failed: int = 0  # videos that have failed, in this run or an earlier one not retried
    retried: int = 0  # videos that had failed before and were tried again in this run
    recovered: int = 0  # of those, the ones that succeeded this time
    texts_total: int = 0
    texts_done: int = 0
    texts_skipped: int = 0
    frames_done: int = 0
    repaired: int = 0  # damaged shards re-extracted (videos and texts)
    failure_kinds: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """A short human-readable summary."""
        rate = self.videos_done / self.seconds if self.seconds else 0.0
        retried = f"; {self.retried} retried, {self.recovered} recovered" if self.retried else ""
        repaired = f"; {self.repaired} damaged shards re-extracted" if self.repaired else ""
        out = [
            f"videos: {self.videos_done} extracted, {self.videos_skipped} already done, {self.failed} failed "
            f"({self.videos_total} in all{retried}); texts: {self.texts_done} encoded, "
            f"{self.texts_skipped} already done ({self.texts_total} in all){repaired}",
            f"{self.seconds:.1f} s, {rate:.2f} videos/s, {self.frames_done / max(self.seconds, 1e-9):.1f} frames/s",
        ]
        if self.failure_kinds:
            kinds = ", ".join(f"{k}: {n}" for k, n in Counter(self.failure_kinds).most_common(5))
            out.append(f"failures by kind: {kinds} (see {self.out / 'failures.parquet'})")
        return out


class ExtractionError(TvrpipeError):
    """Too many videos failed; the store is kept, incomplete and resumable. ``summary`` says what was done."""

    def __init__(self, message: str, summary: ExtractSummary) -> None:
        super().__init__(message)
        self.summary = summary


_HINTS = {
    "missing": "check --video-root {root}: {example} does not exist",
    "empty": "the files have zero bytes: download them again",
    "unreadable": "neither decord nor PyAV can read them: check them with ffprobe",
    "no_frames": "they hold no decodable frame, or none inside the clip's start/end",
    "timeout": "raise --timeout (now {timeout:g} s) if the videos are long",
    "nonfinite": "the encoder returned NaN or infinity: try --device cpu (fp16 overflow)",
}


@dataclass(frozen=True)
class FailureCount:
    """More than ``--max-failed-fraction`` of some videos failed (:func:`over_failure_limit`).

    Attributes:
        kinds: ``[(kind, count)]``, the errors' kinds (the text before their first ``:``), most
            frequent first, then by name.
        text: how many of how many, the percentage and the limit, then the kinds
            (``3 of 16 videos failed (18.8 % > --max-failed-fraction 0.1): missing: 2, empty: 1``).
        accept: the fraction that would accept these failures, rounded up to a percent.
    """

    kinds: list[tuple[str, int]]
    text: str
    accept: float


def over_failure_limit(errors: list[str], total: int, limit: float, what: str = "videos failed") -> FailureCount | None:
    """``errors`` (one per failed video, ``"kind: detail"``) of ``total`` videos against ``--max-failed-fraction``
    ``limit``: None when at most that fraction failed, else what to say. Shared by extract and finetune."""
    n = len(errors)
    if total == 0 or n / total <= limit:  # "more than this fraction"; n <= frac * total rounds (29 of 100)
        return None
    kinds = sorted(Counter(str(e).split(":", 1)[0] for e in errors).items(), key=lambda kv: (-kv[1], kv[0]))
    accept = math.ceil(round(100 * n / total, 9)) / 100  # rounded up: the advised value lets the run pass
    text = (f"{n} of {total} {what} ({100 * n / total:.1f} % > --max-failed-fraction {limit:g}): "
            f"{', '.join(f'{k}: {c}' for k, c in kinds)}")
    return FailureCount(kinds, text, accept)


def _too_many_failures(failures: pd.DataFrame, videos: pd.DataFrame, root: Path, out: Path,
                       cfg: ExtractConfig) -> str | None:
    over = over_failure_limit(list(failures["error"]), len(videos), cfg.max_failed_fraction)
    if over is None:
        return None
    top = over.kinds[0][0]
    kind = failures["error"].str.split(":", n=1).str[0]
    path = videos.set_index("video_id").loc[failures["video_id"][(kind == top).to_numpy()].iloc[0], "path"]
    hint = _HINTS.get(top, "see the errors").format(root=root, example=root / path, timeout=cfg.timeout_s)
    return (
        f"{over.text}; {hint}. "
        f"The store in {out} is kept but not marked complete: fix the cause and rerun the same command (it "
        f"retries the failed videos and keeps the rest), or accept the failures with --max-failed-fraction "
        f"{over.accept:.2f}; details in {out / 'failures.parquet'}"
    )


# ------------------------------------------------------------------------------- helpers


def _check_weights(batch: dict[str, np.ndarray], provenance: dict, tower: str) -> None:
    """Every encoder reports the sha256 of the weights it loaded with each batch: features of other
    weights than the store records (a cluster node whose open_clip cache holds other weights for
    the tag, a checkpoint file replaced during the run) are refused before they are written."""
    want = provenance["weights_sha256"]
    got = sorted(set(map(str, batch["weights"])) - {want})
    if got:
        raise ConfigError(
            f"an {tower} encoder loaded weights with sha256 {got[0][:16]}..., but the store records "
            f"{want[:16]}... for {provenance['model']} / {provenance['pretrained']}: every process (on a cluster, "
            "every node) must load the same weights, the same checkpoint file or the same open_clip cache; "
            "what was written before is kept, and rerunning resumes"
        )



def _already_complete(out: Path, provenance: dict) -> bool:
    """``out`` holds a complete store of this provenance: a rerun has nothing to do."""
    from tvrpipe.features.store import StoreError, provenance_mismatch, store_attributes

    try:
        attrs = store_attributes(out)
    except StoreError:
        return False
    return bool(attrs.get("complete")) and not provenance_mismatch(attrs, provenance)


def _check_device(cfg: ExtractConfig) -> None:
    """Before the store is created or changed: ``--device cuda`` needs a GPU, on this machine or,
    with ``--address`` (or a Ray already joined), in the cluster (Ray would otherwise wait forever
    to place the encoders); an ``--address`` where nothing answers fails here too."""
    import sys

    address, option = ray_address(cfg.address)
    if address:
        check_reachable(address, option=option)
    if cfg.device != "cuda":
        return
    joined = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if not address and not joined:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA GPU that torch can use "
                              "(torch.cuda.is_available() is False); use --device cpu, or --address of a Ray "
                              "cluster with GPUs")
        return
    ray_init(address)
    require_gpus(1, "--device cuda", "use --device cpu")  # one encoder's GPU



def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        disable=not enabled, transient=False,
    )


def _rows_for(jobs: list[tuple[Shard, np.ndarray | None]], table: pd.DataFrame) -> pd.DataFrame:
    """The table's rows that ``jobs`` (shard, rows to do or None for all) need, with a ``row`` column."""
    idx = [np.arange(s.start, s.stop) if rows is None else rows for s, rows in jobs]
    idx = np.concatenate(idx) if idx else np.array([], int)
    return table.iloc[idx].assign(row=idx)


def _video_items(rows: pd.DataFrame, video_root: Path) -> list[dict[str, Any]]:
    return [
        {"row": int(r.row), "path": str(video_root / r.path),
         "start_s": float("nan") if pd.isna(r.start_s) else float(r.start_s),
         "end_s": float("nan") if pd.isna(r.end_s) else float(r.end_s)}
        for r in rows.itertuples()
    ]


class _ShardBuffer:
    """Collects rows that arrive in any order; yields a shard's arrays once all its rows are in.

    A shard being retried (``partial``: shard index -> the number of its rows being redone)
    starts from its stored arrays, read by ``load`` when its first row arrives (so at most the
    shards in flight are in memory), and waits only for its retried rows.
    """

    def __init__(self, shards, width: dict[str, tuple[tuple[int, ...], Any]],
                 partial: dict[int, int] | None = None, load=None) -> None:
        self.of_row = {}
        for s in shards:
            for r in range(s.start, s.stop):
                self.of_row[r] = s
        self.width = width
        self.partial, self.load = partial or {}, load
        self.filled: dict[int, int] = Counter()
        self.data: dict[int, dict[str, np.ndarray]] = {}

    def add(self, row: int, values: dict[str, Any]) -> Any:
        s = self.of_row[row]
        n = s.stop - s.start
        if s.index not in self.data:
            if s.index in self.partial:
                self.data[s.index] = self.load(s)
                self.filled[s.index] = n - self.partial[s.index]
            else:
                self.data[s.index] = {k: np.full((n, *shape), fill, dtype=np.asarray(fill).dtype if dt is None else dt)
                                      for k, (shape, fill, dt) in self.width.items()}
        for k, v in values.items():
            self.data[s.index][k][row - s.start] = v
        self.filled[s.index] += 1
        if self.filled[s.index] == n:
            return s, self.data.pop(s.index)
        return None


# ---------------------------------------------------------------------------------- run


def open_inputs(manifest_dir, video_root, out_dir, frames: int | None, max_words: int | None, model: str,
                pretrained: str, seed: int):
    """What ``extract`` and ``finetune`` start from, checked before anything is written or Ray starts:
    the manifest, the video root, a writable ``out_dir``, F and L (the manifest's defaults unless
    given) and the model loaded on the CPU (its weights found, L within its context).

    Returns:
        ``(manifest, video_root, F, L, bundle)``.
    """
    from tvrpipe.features.clip import load_clip

    manifest = read_manifest(manifest_dir)
    root = Path(video_root)
    if not root.is_dir():
        raise ConfigError(f"--video-root {root}: not a directory")
    check_writable(out_dir, "--out")
    F = frames if frames is not None else int(manifest.meta.get("frames", 12))
    L = max_words if max_words is not None else int(manifest.meta.get("max_words", 32))
    bundle = load_clip(model, pretrained, device="cpu", seed=seed)
    if L > bundle.context_length:
        raise ConfigError(f"--max-words {L} exceeds the model's context length {bundle.context_length}")
    return manifest, root, F, L, bundle


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
        What was done, skipped and failed (disjoint counts).

    Raises:
        ConfigError: an invalid option, video root or output directory, an unreachable ``address``,
            or ``device="cuda"`` without a GPU (all before anything is created); an encoder that
            loaded other weights than the store records (before their features are written).
        ManifestError: an invalid manifest (before Ray starts).
        LockError: another process is writing ``out_dir``.
        StoreError: ``out_dir`` holds a store made with other settings (pass ``overwrite``).
        ExtractionError: more than ``max_failed_fraction`` of the videos failed; the store is kept,
            incomplete, and the next run retries them.

    Example:
        >>> extract("data/msrvtt/manifest", "data/msrvtt/videos", "features/msrvtt-b32",
        ...         ExtractConfig(model="ViT-B-32", pretrained="openai", device="cuda"))  # doctest: +SKIP
    """
    cfg = config or ExtractConfig()
    t0 = time.perf_counter()
    # Everything that can be checked cheaply is checked before Ray starts or a model loads (cfg checked itself).
    # The driver loads the model once (on CPU) for provenance: weights hash, D, preprocessing.
    manifest, root, F, L, bundle = open_inputs(manifest_dir, video_root, out_dir, cfg.frames, cfg.max_words,
                                               cfg.model, cfg.pretrained, cfg.seed)
    out = Path(out_dir)

    from tvrpipe.features.clip import preprocess_description
    from tvrpipe.features.decode import FRAME_SAMPLING

    provenance = make_provenance(
        dataset=manifest.meta.get("dataset", "unknown"), split_set=manifest.meta.get("split_set"),
        model=cfg.model, pretrained=cfg.pretrained, weights_sha256=bundle.weights_sha256,
        frames=F, max_words=L, embed_dim=bundle.embed_dim, frame_sampling=FRAME_SAMPLING,
        image_size=bundle.image_size, preprocessing=preprocess_description(bundle),
        manifest_sha256=manifest_sha256(manifest.videos, manifest.captions),
        logit_scale=bundle.logit_scale,  # CLIP's learned scale: every head starts from it (train-head)
    )
    del bundle
    checked = cfg.overwrite or not _already_complete(out, provenance)  # a complete store may need no device
    if checked:
        _check_device(cfg)
    videos = manifest.videos[["video_id", "split", "path", "start_s", "end_s"]]
    vrow = pd.Series(np.arange(len(videos)), index=videos["video_id"])
    texts = manifest.captions.assign(video_row=vrow.loc[manifest.captions["video_id"]].to_numpy())[
        ["caption_id", "video_id", "video_row", "split", "text"]
    ]
    summary = ExtractSummary(out=out, videos_total=len(videos), texts_total=len(texts))
    with StoreWriter(out, videos[["video_id", "split", "path"]], texts.drop(columns="text"), provenance,
                     cfg.video_shard, cfg.text_shard, cfg.overwrite) as writer:
        damaged = len(writer.damaged("videos")) + len(writer.damaged("texts"))
        v_pending, t_pending = writer.pending("videos"), writer.pending("texts")
        retry = {s: rows for s, rows in writer.failed_rows().items() if s not in set(v_pending)} \
            if cfg.retry_failed else {}
        jobs = [(s, None) for s in v_pending] + list(retry.items())
        summary.repaired = damaged
        summary.retried = sum(len(rows) for rows in retry.values())
        summary.texts_skipped = len(texts) - sum(s.stop - s.start for s in t_pending)
        failed_before = set(writer.failures()["video_id"])
        processed = 0
        if jobs or t_pending:
            if not checked:  # a complete store whose failed videos are retried
                _check_device(cfg)
            ray_init(cfg.address)
            cpus = cluster_cpus()
            gpu = cfg.device == "cuda"
            enc_opts = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 0}
            threads = 1 if gpu else cpus  # CPU encoders share the cores with the decoders
            with _progress(cfg.progress) as bar:
                if t_pending:
                    _run_texts(writer, texts, t_pending, cfg, L, enc_opts, threads, bar, summary)
                if jobs:
                    decoders = cfg.decoders if cfg.decoders is not None else cpus
                    processed = _run_videos(writer, videos, jobs, root, cfg, F, provenance["image_size"],
                                            decoders, enc_opts, threads, bar, summary)
        failures = writer.failures()
        failed_now = set(failures["video_id"])
        ids = videos["video_id"].to_numpy()
        redone = {str(i) for s, rows in jobs for i in ids[np.arange(s.start, s.stop) if rows is None else rows]}
        retried = {str(i) for rows in retry.values() for i in ids[rows]}
        summary.failed = len(failures)
        summary.videos_done = processed - len(failed_now & redone)
        summary.videos_skipped = summary.videos_total - summary.videos_done - summary.failed
        summary.recovered = len((failed_before & retried) - failed_now)
        summary.failure_kinds = dict(Counter(e.split(":", 1)[0] for e in failures["error"]))
        reason = _too_many_failures(failures, videos, root, out, cfg)
        writer.finalize(incomplete_reason=reason)
    summary.seconds = time.perf_counter() - t0
    if reason:
        raise ExtractionError(reason, summary)
    return summary


def _run_texts(writer, texts, shards, cfg, L, enc_opts, threads, bar, summary) -> None:
    import ray
    from ray.data import ActorPoolStrategy

    rows = _rows_for([(s, None) for s in shards], texts)
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
        _check_weights(batch, writer.provenance, "text")
        for i, row in enumerate(batch["row"]):
            full = buf.add(int(row), {k: batch[k][i] for k in ("tokens", "token_mask", "sentence")})
            if full:
                s, d = full
                bad = np.flatnonzero(nonfinite_rows(d["tokens"]) | nonfinite_rows(d["sentence"]))
                if len(bad):  # never stored as if it were a feature; the shard stays pending
                    caps = texts["caption_id"].to_numpy()[s.start + bad]
                    raise NonFiniteError(
                        f"the text encoder returned NaN or infinity for captions {', '.join(map(str, caps[:5]))}"
                        f" ({len(bad)} in {s}); with --device cuda try --device cpu (fp16 overflow)"
                    )
                writer.write_texts(s, d["tokens"], d["token_mask"], d["sentence"])
        summary.texts_done += len(batch["row"])
        bar.update(task, advance=len(batch["row"]),
                   rate=f"{summary.texts_done / (time.perf_counter() - t0):.0f} texts/s")


def _run_videos(writer, videos, jobs, root, cfg, F, image_size, decoders, enc_opts, threads, bar,
                summary) -> int:
    """Decode and encode the rows of ``jobs`` and write their shards; returns the videos processed."""
    import ray
    from ray.data import ActorPoolStrategy

    shards = [s for s, _ in jobs]
    rows = _rows_for(jobs, videos)
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

    def stored(shard):  # a retried shard keeps its other rows as stored
        old = writer.read_videos(shard)
        return {"emb": old["frames"], "mask": old["frame_mask"], "timestamps": old["timestamps"]}

    buf = _ShardBuffer(shards, {"emb": ((F, D), 0, np.float16), "mask": ((F,), False, bool),
                                "timestamps": ((F,), np.nan, np.float32)},
                       partial={s.index: len(rows) for s, rows in jobs if rows is not None}, load=stored)
    failures: dict[int, list[dict[str, str]]] = {}
    ids = videos["video_id"].to_numpy()
    t0 = time.perf_counter()
    done = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        _check_weights(batch, writer.provenance, "image")
        for i, row in enumerate(batch["row"]):
            row = int(row)
            err = str(batch["error"][i])
            shard = buf.of_row[row]
            if err:
                stage = "encode" if err.startswith("nonfinite") else "decode"
                failures.setdefault(shard.index, []).append({"video_id": str(ids[row]), "stage": stage, "error": err})
            full = buf.add(row, {"emb": batch["emb"][i], "mask": batch["mask"][i], "timestamps": batch["timestamps"][i]})
            if full:
                s, d = full
                writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], failures.pop(s.index, []))
        done += len(batch["row"])
        summary.frames_done += int(batch["mask"].sum())
        dt = time.perf_counter() - t0
        bar.update(task, advance=len(batch["row"]),
                   rate=f"{done / dt:.1f} videos/s, {summary.frames_done / dt:.0f} frames/s")
    return done
