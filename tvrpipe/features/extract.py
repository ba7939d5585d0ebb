"""``tvrpipe extract``: manifest + videos -> CLIP features in the Zarr store, with Ray.

The flow (docs/design.md, "Extraction")::

    Ray up; at once: decoder actors (CPU, 1 core each) and encoder actors (GPU with --device cuda,
    fp16 autocast; else CPU), each encoder loading the weights once and reporting their facts
      -> the store opens with those facts in its provenance (the driver loads no model)
      -> each decoder: decord, uniform F frames, resize at decode, centre crop, in a killable decode
         subprocess with a per-video timeout and a PyAV fallback
      -> decoded videos go to an encoder in batches (decoder to encoder through Ray's object store)
      -> caption shards go to the same encoders in between (tokens, mask, EOS sentence)
      -> the driver buffers rows per shard and writes each whole shard, then its marker

Decode is the bottleneck (~160 frames/s per core for 720p H.264: docs/design.md, "Extraction"), so decoding
gets the cores and encoding overlaps with it. The actors are plain Ray actors driven by one loop in
this process, not a Ray Data pipeline: Ray Data started an actor pool per stage plus its own
executor, which cost about 4 s before the first video decoded (docs/performance.md). Locally
``ray.init(address="local")`` starts a private instance; ``--address``/``RAY_ADDRESS`` runs the same
code on a cluster (paths must then be visible to every node). A bad video is recorded in
``failures.parquet`` with zero features and an all-False mask; it never stops the run, but a run
where more than ``max_failed_fraction`` of the videos failed exits with an error and leaves the store
incomplete (nothing is lost: it stays resumable).

Rerunning the same command resumes: whole shards are skipped, damaged shards (a chunk missing,
truncated or overwritten since it was written) are re-extracted, and the videos recorded as failed
are retried (their shard is rewritten with the rows that succeeded before kept as they were). A
rerun with nothing left to do starts neither Ray nor a model (the weights' facts are cached,
:mod:`tvrpipe.features.weights`). Options and the manifest are checked before Ray starts, and the
store is locked while written (:mod:`tvrpipe.lock`).

A collection (a folder of one's own videos, :mod:`tvrpipe.features.collection`) is first compared with
its manifest: a file changed or removed since the manifest was built is an error (rebuild the
manifest), so no feature of another file is kept under its name. Its store is updated in place: the
store of an earlier state of the folder is moved aside (:class:`~tvrpipe.features.store.StoreWriter`
with ``update``) and each video whose file is unchanged (same id, path, size and modification time)
is copied from it, bit for bit, rather than decoded and encoded again; only new and changed files
are encoded.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.cluster import check_reachable, cluster_cpus, ray_address, ray_init, ray_running, require_gpus
from tvrpipe.config import above, at_least, check_fields, one_of, within
from tvrpipe.data.manifest import COLLECTION, check_max_words, open_manifest
from tvrpipe.errors import ConfigError, NonFiniteError, TvrpipeError
from tvrpipe.features.arrays import nonfinite_rows
from tvrpipe.features.failures import over_failure_limit
from tvrpipe.features.outputs import check_store_out
from tvrpipe.features.store import (
    FeatureStore,
    PreviousStore,
    Shard,
    StoreWriter,
    make_provenance,
    manifest_sha256,
    update_interrupted,
)
from tvrpipe.features.weights import (
    cached_facts,
    check_checkpoint,
    check_download,
    confirmed_facts,
    guess_image_size,
    remember_facts,
    resolve_pretrained,
    weights_key,
)
from tvrpipe.features.workers import ClipEncoder, Decoder

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
    # auto: fp16 autocast on cuda, fp32 on cpu; bf16: weights in bf16 on cpu (3.4-3.9x faster with
    # AVX-512 BF16, cosine >= 0.9999 to fp32, docs/performance.md), autocast on cuda
    precision: str = one_of(("auto", "fp32", "bf16", "fp16"), "auto", option="--precision")
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
        if self.precision == "fp16" and self.device == "cpu":
            raise ConfigError("--precision fp16 needs --device cuda; on a CPU use bf16 (fast where the CPU has "
                              "AVX-512 BF16 or AMX) or fp32")

    @property
    def encode_precision(self) -> str:
        """What the encoders compute in: ``precision``, with auto resolved for the device."""
        if self.precision != "auto":
            return self.precision
        return "fp16" if self.device == "cuda" else "fp32"


@dataclass
class ExtractSummary:
    """What an extraction did. ``videos_done + reused + videos_skipped + failed == videos_total``."""

    out: Path
    videos_total: int
    videos_done: int = 0  # extracted (decoded and encoded) in this run (failures not included)
    videos_skipped: int = 0  # extracted by an earlier run into this store (failures not included)
    reused: int = 0  # copied from the store an update of a collection replaced (their files unchanged)
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
    # when each step of the start ended, in seconds from the call: "checks" (options, manifest), "ray" (Ray
    # up, encoders started), "weights" (an encoder has loaded them), "first_batch" (the first videos encoded)
    phases: dict[str, float] = field(default_factory=dict)
    first_videos: int = 0  # how many videos the first encoded batch held

    def lines(self) -> list[str]:
        """A short human-readable summary."""
        rate = self.videos_done / self.seconds if self.seconds else 0.0
        retried = f"; {self.retried} retried, {self.recovered} recovered" if self.retried else ""
        repaired = f"; {self.repaired} damaged shards re-extracted" if self.repaired else ""
        reused = f"{self.reused} reused (unchanged since the last extraction), " if self.reused else ""
        out = [
            f"videos: {self.videos_done} extracted, {reused}{self.videos_skipped} already done, {self.failed} failed "
            f"({self.videos_total} in all{retried}); texts: {self.texts_done} encoded, "
            f"{self.texts_skipped} already done ({self.texts_total} in all){repaired}",
            f"{self.seconds:.1f} s, {rate:.2f} videos/s, {self.frames_done / max(self.seconds, 1e-9):.1f} frames/s",
        ]
        if "ray" in self.phases:
            names = {"checks": "checks", "ray": "Ray up", "weights": "weights loaded",
                     "first_batch": "first videos encoded"}
            out.append("start-up, seconds from the start: " + ", ".join(
                f"{names[k]} {v:.1f}" for k, v in self.phases.items()))
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



def _complete(out: Path) -> bool:
    """``out`` holds a store marked complete (whatever its settings): a rerun may have nothing to do."""
    from tvrpipe.features.store import StoreError, store_attributes

    try:
        return bool(store_attributes(out).get("complete"))
    except StoreError:
        return False


def _check_precision(writer, cfg: ExtractConfig) -> None:
    """A store's rows are all computed in one precision: resuming one made in another is refused (a store
    made before the precision was recorded records none, and takes any)."""
    have = writer.recorded("precision")
    if have is not None and have != cfg.encode_precision:
        raise ConfigError(
            f"--precision {cfg.precision}: the store in {writer.dir} was extracted in {have}, and its rows are "
            f"all computed in one precision; rerun with --precision {have}, or pass --overwrite to extract it "
            f"again in {cfg.encode_precision}"
        )


def _check_device(cfg: ExtractConfig) -> None:
    """Before the store is created or changed: ``--device cuda`` needs a GPU, on this machine or,
    with ``--address`` (or a Ray already joined), in the cluster (Ray would otherwise wait forever
    to place the encoders); an ``--address`` where nothing answers fails here too."""
    address, option = ray_address(cfg.address)
    if address:
        check_reachable(address, option=option)
    if cfg.device != "cuda":
        return
    if not address and not ray_running():
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA GPU that torch can use "
                              "(torch.cuda.is_available() is False); use --device cpu, or --address of a Ray "
                              "cluster with GPUs")
        return
    ray_init(address, data=False)
    require_gpus(1, "--device cuda", "use --device cpu")  # one encoder's GPU



def _progress(enabled: bool):
    from tvrpipe.progress import progress_bar

    return progress_bar(field="rate", elapsed=True, eta=True, enabled=enabled)


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


MANIFEST_PLACEHOLDER = "MANIFEST_DIR"  # where a command must name a manifest folder that no record names
VIDEOS_PLACEHOLDER = "VIDEO_DIR"


def extract_command(settings: Mapping[str, Any], out: str | os.PathLike[str],
                    shards: tuple[int, int] | None = None) -> str:
    """The ``tvrpipe extract`` command line, ready to paste, that computes into ``out`` the features that
    ``settings`` (a store's provenance, or one with another CLIP's ``model``/``pretrained``) describe: its
    ``manifest`` folder and ``video_root`` (:data:`MANIFEST_PLACEHOLDER`/:data:`VIDEOS_PLACEHOLDER` where
    unrecorded), CLIP (``model``, ``pretrained``, ``seed`` of random weights), ``frames``, ``max_words`` and
    the ``precision`` its rows were computed in (which a resumed or updated store must keep), and the
    ``shards`` (videos, captions per shard) where they are not what the defaults give.

    Example:
        >>> extract_command({"manifest": "m", "video_root": "v", "model": "ViT-B-16", "pretrained": "openai",
        ...                  "frames": 12, "max_words": 32, "precision": "bf16"}, "feats")
        'tvrpipe extract --manifest m --video-root v --out feats --model ViT-B-16 --pretrained openai --frames 12 --max-words 32 --precision bf16'
    """
    import shlex

    d = ExtractConfig()
    args: list[Any] = ["tvrpipe", "extract", "--manifest", settings.get("manifest") or MANIFEST_PLACEHOLDER,
                       "--video-root", settings.get("video_root") or VIDEOS_PLACEHOLDER, "--out", out,
                       "--model", settings.get("model") or d.model, "--pretrained", settings.get("pretrained") or d.pretrained]
    seed = int(settings.get("seed") or d.seed)
    if str(settings.get("pretrained")) == "none" and seed != d.seed:
        args += ["--seed", seed]
    for key, option in (("frames", "--frames"), ("max_words", "--max-words")):
        if settings.get(key) is not None:
            args += [option, settings[key]]
    precision = settings.get("precision")
    if precision == "fp16":  # half precision only runs on a GPU
        args += ["--device", "cuda", "--precision", "fp16"]
    elif precision is not None and precision != d.encode_precision:  # fp32: auto on a CPU
        args += ["--precision", precision]
    if shards is not None:
        for chunk, n, default, option in ((shards[0], settings.get("n_videos"), d.video_shard, "--video-shard"),
                                          (shards[1], settings.get("n_texts"), d.text_shard, "--text-shard")):
            if n is not None and chunk != max(1, min(default, int(n))):  # a shard never exceeds the rows
                args += [option, chunk]
    return " ".join(a if a in (MANIFEST_PLACEHOLDER, VIDEOS_PLACEHOLDER) else shlex.quote(a)
                    for a in map(str, args))


def rebuild_command(store: FeatureStore, video_root: str | os.PathLike[str] | None = None,
                    pretrained: str | None = None) -> str:
    """:func:`extract_command` of ``store`` itself, into its own folder: the command that resumes, repairs or
    (for a collection whose files changed) updates it. ``video_root``/``pretrained``: where its videos and
    CLIP checkpoint are now, where they moved since extraction."""
    prov = dict(store.provenance)
    if video_root is not None:
        prov["video_root"] = str(video_root)
    if pretrained is not None:
        prov["pretrained"] = pretrained
    shards = (store.array("videos/frames").chunks[0], store.array("texts/tokens").chunks[0])
    return extract_command(prov, store.dir, shards)


@dataclass
class _Workers:
    """The Ray actors of one extraction: ``--encoders`` CLIP encoders (each loads the weights once, and
    serves both the captions and the videos) and the decoders (one per core unless ``--decoders``)."""

    encoders: list
    decoders: list

    def stop(self) -> None:
        """End them now: their weights (and GPUs) are freed at once, not when Ray shuts down."""
        import ray

        for actor in self.encoders + self.decoders:
            ray.kill(actor)


def _start_workers(cfg: ExtractConfig) -> _Workers:
    """Ray (joined or started) and every actor the run needs, all starting at once (the encoders load the
    weights while the decoders start); a missing GPU or an unreachable ``--address`` fails first."""
    import ray

    _check_device(cfg)
    # a tag's weights that cannot be downloaded fail here in seconds (an encoder's open_clip would retry for
    # minutes, its messages in Ray's worker logs); checked while Ray starts, as it imports torch
    with ThreadPoolExecutor(1) as pool:
        download = pool.submit(check_download, cfg.model, cfg.pretrained)
        ray_init(cfg.address, data=False)
        download.result()
    cpus = cluster_cpus()
    gpu = cfg.device == "cuda"
    # CPU encoders share the cores with the decoders; a GPU encoder needs one core to feed it
    encoder = ray.remote(ClipEncoder).options(**({"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 0}))
    # a decoder whose process dies (out of memory) is restarted and its video tried again
    decoder = ray.remote(Decoder).options(num_cpus=1, max_restarts=2, max_task_retries=2)
    return _Workers(
        [encoder.remote(cfg.model, cfg.pretrained, cfg.device, cfg.seed, 1 if gpu else cpus, cfg.encode_precision)
         for _ in range(cfg.encoders)],
        [decoder.remote(cfg.timeout_s) for _ in range(cfg.decoders if cfg.decoders is not None else cpus)],
    )


@dataclass
class _Early:
    """Decodes sent before the weights' facts are known: ``refs`` maps each to (decoder, row)."""

    image_size: int
    refs: dict[Any, tuple[int, int]]


def _decode_early(workers: _Workers, cfg: ExtractConfig, out: Path, videos: pd.DataFrame, root: Path,
                  F: int) -> _Early | None:
    """Send the decoders as many videos as the first two batches per encoder hold (two per decoder at
    least) while the encoders load the weights, seconds in which the decoders would wait: only for a new store, where every row is to do, and only when the image size
    can be read from the architecture's file (checked against the encoder's report; if they differ, these
    decodes are dropped)."""
    from tvrpipe.features.store import STORE_NAME

    size = guess_image_size(cfg.model)
    fresh = cfg.overwrite or not (out / STORE_NAME / "zarr.json").is_file()
    if size is None or not fresh or len(videos) == 0:
        return None
    # as many as the first batches hold: the cores a loading encoder leaves idle decode them
    n = min(len(videos), max(2 * len(workers.decoders), 2 * cfg.batch_size * len(workers.encoders)))
    items = _video_items(videos.iloc[:n].assign(row=np.arange(n)), root)
    return _Early(size, {workers.decoders[i % len(workers.decoders)].decode.remote(item, F, size):
                         (i % len(workers.decoders), item["row"]) for i, item in enumerate(items)})


def _reported_facts(encoder, key: str) -> dict[str, Any]:
    """The weights' facts from the encoder that loaded them (cached for a later rerun), or the error it
    met loading them (an unknown tag, a checkpoint of another architecture), raised here."""
    import ray

    from tvrpipe import errors

    facts = ray.get(encoder.facts.remote())
    if "error" in facts:
        name, message = facts["error"]
        raise getattr(errors, name, TvrpipeError)(message)
    remember_facts(key, facts)
    return facts


def _recorded(out: Path) -> list[dict[str, Any]]:
    """The provenance of the store in ``out`` and of the store an update replaces (``.previous``), those there."""
    from tvrpipe.features.store import PREVIOUS, StoreError, store_attributes

    found = []
    for d in (out, out / PREVIOUS):
        try:
            found.append(store_attributes(d))
        except StoreError:
            pass
    return found


def _loaded_facts(cfg: ExtractConfig, key: str) -> dict[str, Any]:
    """The weights' facts when the cache has none and no encoder is needed: loaded here, once per machine."""
    from tvrpipe.features.clip import load_clip, weights_facts

    facts = weights_facts(load_clip(cfg.model, cfg.pretrained, device="cpu", seed=cfg.seed))
    remember_facts(key, facts)
    return facts


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
            or ``device="cuda"`` without a GPU (all before anything is created); weights that cannot be
            loaded, or an encoder that loaded other weights than the store records (before anything is
            written).
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
    # Everything that can be checked without the weights is checked before Ray starts (cfg checked itself)
    manifest, root, F, L = open_manifest(manifest_dir, video_root, out_dir, cfg.frames, cfg.max_words)
    check_store_out(out_dir, {"--manifest": manifest_dir, "--video-root": root})
    if manifest.is_collection:
        from tvrpipe.features.collection import check_unchanged

        check_unchanged(manifest, manifest_dir, root)
    check_checkpoint(cfg.pretrained)
    # recorded as a path that reaches the file from any folder (the sha256 stays the weights' identity)
    cfg = dataclasses.replace(cfg, pretrained=resolve_pretrained(cfg.pretrained))
    out = Path(out_dir)

    def reached(phase: str) -> None:
        summary.phases.setdefault(phase, time.perf_counter() - t0)

    key = weights_key(cfg.model, cfg.pretrained, cfg.seed)
    videos = manifest.videos[["video_id", "split", "path", "start_s", "end_s"]]
    sidecar = videos  # the store's videos.parquet: a collection's also names each file's fingerprint
    if manifest.is_collection:
        sidecar = videos.merge(manifest.files, on="video_id", how="left", validate="one_to_one")
    vrow = pd.Series(np.arange(len(videos)), index=videos["video_id"])
    texts = manifest.captions.assign(video_row=vrow.loc[manifest.captions["video_id"]].to_numpy())[
        ["caption_id", "video_id", "video_row", "split", "text"]
    ]
    summary = ExtractSummary(out=out, videos_total=len(videos), texts_total=len(texts))
    reached("checks")
    workers: _Workers | None = None
    early: _Early | None = None
    try:
        # a rerun may have nothing to do, an interrupted update nothing but copies: no encoder, no Ray yet
        if not cfg.overwrite and (_complete(out) or manifest.is_collection and update_interrupted(out)):
            # cached facts only where the store resumed or replaced records the same: a new store's facts
            # come from that store or from the weights, never from the cache alone
            facts = confirmed_facts(cached_facts(key), _recorded(out)) or _loaded_facts(cfg, key)
        else:  # the encoders that do the work report the weights' facts; the driver loads no model
            workers = _start_workers(cfg)
            reached("ray")
            early = _decode_early(workers, cfg, out, videos, root, F)
            facts = _reported_facts(workers.encoders[0], key)
            reached("weights")
            if early and early.image_size != facts["image_size"]:  # the architecture file was not the model's
                early = None
        check_max_words(L, facts["context_length"])
        from tvrpipe.features.decode import FRAME_SAMPLING

        provenance = make_provenance(
            dataset=manifest.meta.get("dataset", "unknown"), split_set=manifest.meta.get("split_set"),
            model=cfg.model, pretrained=cfg.pretrained, weights_sha256=facts["weights_sha256"],
            frames=F, max_words=L, embed_dim=facts["embed_dim"], frame_sampling=FRAME_SAMPLING,
            image_size=facts["image_size"], preprocessing=facts["preprocessing"],
            manifest_sha256=manifest_sha256(manifest.videos, manifest.captions,
                                            manifest.files if manifest.is_collection else None),
            logit_scale=facts["logit_scale"],  # CLIP's learned scale: every head starts from it (train-head)
            precision=cfg.encode_precision,  # what the rows are computed in (not an identity key)
            seed=cfg.seed,  # rebuilds the weights of --pretrained none
            video_root=str(root.resolve()),  # where the rows were decoded from (search shows frames from there)
            manifest=str(Path(manifest_dir).resolve()),  # what the advice to update or extract it again names
            **({"kind": COLLECTION} if manifest.is_collection else {}),
        )
        with StoreWriter(out, sidecar, texts.drop(columns="text"), provenance, cfg.video_shard, cfg.text_shard,
                         cfg.overwrite, update=manifest.is_collection) as writer:
            damaged = len(writer.damaged("videos")) + len(writer.damaged("texts"))
            v_pending, t_pending = writer.pending("videos"), writer.pending("texts")
            retry = {s: rows for s, rows in writer.failed_rows().items() if s not in set(v_pending)} \
                if cfg.retry_failed else {}
            # an update: rows whose file is unchanged are copied from the store it replaces
            copies = _copies(writer.previous, sidecar, v_pending)
            summary.reused = sum(int((src >= 0).sum()) for src in copies.values())
            whole = [s for s in v_pending if s.index in copies and (copies[s.index] >= 0).all()]
            if whole:
                _write_copied(writer, whole, copies, cfg.progress)
            jobs = [(s, None if s.index not in copies else s.start + np.flatnonzero(copies[s.index] < 0))
                    for s in v_pending if s not in whole] + list(retry.items())
            summary.repaired = damaged
            summary.retried = sum(len(rows) for rows in retry.values())
            summary.texts_skipped = len(texts) - sum(s.stop - s.start for s in t_pending)
            failed_before = set(writer.failures()["video_id"])
            processed = 0
            if jobs or t_pending:
                _check_precision(writer, cfg)
                if workers is None:  # a complete store whose failed videos are retried
                    workers = _start_workers(cfg)
                    reached("ray")
                with _progress(cfg.progress) as bar:
                    feed = _TextFeed(writer, texts, t_pending, workers.encoders, L, bar, summary)
                    if jobs:
                        def load(shard: Shard) -> dict[str, np.ndarray]:  # a shard of which some rows are kept
                            if shard.index in copies:
                                return _copied_videos(writer.previous, shard, copies[shard.index], F,
                                                      int(provenance["embed_dim"]))
                            return _stored_videos(writer, shard)

                        processed = _run_videos(writer, videos, jobs, root, cfg, F, facts["image_size"], workers,
                                                bar, summary, feed, lambda: reached("first_batch"), early, load)
                    feed.finish()
            failures = writer.failures()
            failed_now = set(failures["video_id"])
            ids = videos["video_id"].to_numpy()
            redone = {str(i) for s, rows in jobs for i in ids[np.arange(s.start, s.stop) if rows is None else rows]}
            retried = {str(i) for rows in retry.values() for i in ids[rows]}
            summary.failed = len(failures)
            summary.videos_done = processed - len(failed_now & redone)
            summary.videos_skipped = summary.videos_total - summary.videos_done - summary.reused - summary.failed
            summary.recovered = len((failed_before & retried) - failed_now)
            summary.failure_kinds = dict(Counter(e.split(":", 1)[0] for e in failures["error"]))
            reason = _too_many_failures(failures, videos, root, out, cfg)
            writer.finalize(incomplete_reason=reason)
    finally:
        if workers is not None:
            workers.stop()
    summary.seconds = time.perf_counter() - t0
    if reason:
        raise ExtractionError(reason, summary)
    return summary


class _TextFeed:
    """Caption shards sent to the encoders and written as their features come back, while the videos
    decode. At most two shards per encoder are in flight: finished ones wait in Ray's object store
    until written, and a video batch queues behind no more than two shards."""

    def __init__(self, writer, texts: pd.DataFrame, shards: list[Shard], encoders: list, max_words: int, bar,
                 summary: ExtractSummary) -> None:
        self.writer, self.encoders, self.max_words, self.bar, self.summary = writer, encoders, max_words, bar, summary
        self.text = texts["text"].astype(str).to_numpy()
        self.caption_ids = texts["caption_id"].to_numpy()
        self.todo = list(reversed(shards))  # popped from the end: in order
        self.flight: dict[Any, Shard] = {}
        self.turn = 0
        self.task = bar.add_task("texts", total=sum(s.stop - s.start for s in shards), rate="") if shards else None
        self.t0 = time.perf_counter()

    def send(self) -> None:
        """Send shards to the encoders, in turn, up to the limit."""
        while self.todo and len(self.flight) < 2 * len(self.encoders):
            s = self.todo.pop()
            encoder = self.encoders[self.turn % len(self.encoders)]
            self.turn += 1
            self.flight[encoder.encode_texts.remote(self.text[s.start:s.stop].tolist(), self.max_words)] = s

    def take(self, ref) -> None:
        """Write the shard whose features ``ref`` (one of :attr:`flight`, finished) holds."""
        import ray

        self._write(self.flight.pop(ref), ray.get(ref))

    def finish(self) -> None:
        """Send and write every shard left."""
        import ray

        self.send()
        while self.flight:
            ready, _ = ray.wait(list(self.flight), num_returns=1)
            self.take(ready[0])
            self.send()

    def _write(self, s: Shard, d: dict[str, np.ndarray]) -> None:
        _check_weights(d, self.writer.provenance, "text")
        bad = np.flatnonzero(nonfinite_rows(d["tokens"]) | nonfinite_rows(d["sentence"]))
        if len(bad):  # never stored as if it were a feature; the shard stays pending
            caps = self.caption_ids[s.start + bad]
            raise NonFiniteError(
                f"the text encoder returned NaN or infinity for captions {', '.join(map(str, caps[:5]))}"
                f" ({len(bad)} in {s}); with --device cuda try --device cpu (fp16 overflow)"
            )
        self.writer.write_texts(s, d["tokens"], d["token_mask"], d["sentence"])
        self.summary.texts_done += s.stop - s.start
        self.bar.update(self.task, advance=s.stop - s.start,
                        rate=f"{self.summary.texts_done / (time.perf_counter() - self.t0):.0f} texts/s")


def _run_videos(writer, videos, jobs, root, cfg, F, image_size, workers: _Workers, bar, summary, feed: _TextFeed,
                first, early: _Early | None = None, load=None) -> int:
    """Decode and encode the rows of ``jobs`` and write their shards, the captions' shards in between;
    returns the videos processed.

    Every decoder has two videos in flight (one decoding, the next waiting). A decoded video stays in
    Ray's object store until ``--batch-size`` of them go to an encoder as one call (the frames pass
    from decoder to encoder, never through this process); each encoder has up to two batches in
    flight, so it never waits for the hand-over. An encoder with nothing to do gets what is decoded
    without waiting for a whole batch (the first videos are encoded while the next decode). Decoded
    videos waiting for an encoder are capped at two batches per encoder: the frames are the memory.
    ``early``: decodes already sent (:func:`_decode_early`); those of rows in ``jobs`` are kept. ``load``:
    the arrays a shard of which only some rows are in ``jobs`` starts from (default: its stored rows).
    """
    import ray

    B = cfg.batch_size
    items = deque(_video_items(_rows_for(jobs, videos), root))
    task = bar.add_task("videos", total=len(items), rate="")
    decoders, encoders = workers.decoders, workers.encoders
    decoding: dict[Any, int] = {}  # ref -> its decoder
    encoding: dict[Any, int] = {}  # ref -> its encoder
    decoded: list = []  # refs of decoded videos, in the order they finished
    if early is not None:
        todo = {item["row"] for item in items}
        decoding = {ref: k for ref, (k, row) in early.refs.items() if row in todo}
        sent = {row for k, row in early.refs.values() if row in todo}
        items = deque(item for item in items if item["row"] not in sent)

    buf = _ShardBuffer([s for s, _ in jobs],
                       {"emb": ((F, writer.provenance["embed_dim"]), 0, np.float16), "mask": ((F,), False, bool),
                        "timestamps": ((F,), np.nan, np.float32)},
                       partial={s.index: len(rows) for s, rows in jobs if rows is not None},
                       load=load or (lambda shard: _stored_videos(writer, shard)))
    failures: dict[int, list[dict[str, str]]] = {}
    ids = videos["video_id"].to_numpy()
    t0 = time.perf_counter()
    done = 0
    while items or decoding or decoded or encoding:
        while items and len(decoding) < 2 * len(decoders) and len(decoded) < 2 * B * len(encoders):
            k = _least_busy(decoding, len(decoders))
            decoding[decoders[k].decode.remote(items.popleft(), F, image_size)] = k
        last = not items and not decoding  # nothing more will be decoded: a short batch goes too
        while decoded and len(encoding) < 2 * len(encoders) and (
                len(decoded) >= B or last or len(set(encoding.values())) < len(encoders)):  # or one is idle
            k = _least_busy(encoding, len(encoders))
            encoding[encoders[k].encode_videos.remote(*decoded[:B])] = k
            del decoded[:B]
        feed.send()
        ready, _ = ray.wait([*decoding, *encoding, *feed.flight], num_returns=1)
        for ref in ready:
            if ref in decoding:
                del decoding[ref]
                decoded.append(ref)
            elif ref in feed.flight:
                feed.take(ref)
            else:
                del encoding[ref]
                batch = ray.get(ref)
                if not summary.first_videos:
                    first()
                    summary.first_videos = len(batch["row"])
                _check_weights(batch, writer.provenance, "image")
                for i, row in enumerate(batch["row"]):
                    row = int(row)
                    err = str(batch["error"][i])
                    shard = buf.of_row[row]
                    if err:
                        stage = "encode" if err.startswith("nonfinite") else "decode"
                        failures.setdefault(shard.index, []).append(
                            {"video_id": str(ids[row]), "stage": stage, "error": err})
                    full = buf.add(row, {"emb": batch["emb"][i], "mask": batch["mask"][i],
                                         "timestamps": batch["timestamps"][i]})
                    if full:
                        s, d = full
                        writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], failures.pop(s.index, []))
                done += len(batch["row"])
                summary.frames_done += int(batch["mask"].sum())
                dt = time.perf_counter() - t0
                bar.update(task, advance=len(batch["row"]),
                           rate=f"{done / dt:.1f} videos/s, {summary.frames_done / dt:.0f} frames/s")
    return done


def _least_busy(calls: dict[Any, int], actors: int) -> int:
    """The actor (an index below ``actors``) with the fewest of ``calls`` (ref -> actor) in flight."""
    load = Counter(calls.values())
    return min(range(actors), key=load.__getitem__)


def _stored_videos(writer, shard: Shard) -> dict[str, np.ndarray]:
    """A retried shard's rows as stored: the rows not retried keep them."""
    old = writer.read_videos(shard)
    return {"emb": old["frames"], "mask": old["frame_mask"], "timestamps": old["timestamps"]}


def _copies(previous: PreviousStore | None, sidecar: pd.DataFrame, pending: list[Shard]) -> dict[int, np.ndarray]:
    """For each pending video shard with a row to copy from the store an update replaces: each of its rows'
    row there (-1: to encode)."""
    if previous is None or not pending:
        return {}
    src = previous.match(sidecar)
    out = {}
    for s in pending:
        rows = src[s.start : s.stop]
        if (rows >= 0).any():
            out[s.index] = rows
    return out


def _copied_videos(previous: PreviousStore, shard: Shard, src: np.ndarray, F: int, D: int) -> dict[str, np.ndarray]:
    """A shard's rows as copied from the store an update replaces (``src``: each row's row there); the rows
    to encode (-1) hold the padding's values until their features arrive."""
    n = shard.stop - shard.start
    out = {"emb": np.zeros((n, F, D), np.float16), "mask": np.zeros((n, F), bool),
           "timestamps": np.full((n, F), np.nan, np.float32)}
    have = np.flatnonzero(src >= 0)
    if len(have):
        d = previous.read(src[have])
        out["emb"][have], out["mask"][have], out["timestamps"][have] = d["frames"], d["frame_mask"], d["timestamps"]
    return out


def _write_copied(writer, shards: list[Shard], copies: dict[int, np.ndarray], progress: bool) -> None:
    """Write the shards whose every row is copied from the store an update replaces (no video decoded)."""
    F, D = int(writer.provenance["frames"]), int(writer.provenance["embed_dim"])
    with _progress(progress) as bar:
        task = bar.add_task("videos reused", total=sum(s.stop - s.start for s in shards), rate="")
        for s in shards:
            d = _copied_videos(writer.previous, s, copies[s.index], F, D)
            writer.write_videos(s, d["emb"], d["mask"], d["timestamps"], [])
            bar.update(task, advance=s.stop - s.start)
