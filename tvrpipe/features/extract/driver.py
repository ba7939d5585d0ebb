"""``tvrpipe extract``'s library call, :func:`extract`, and the command lines that make or rebuild a store
(:func:`extract_command`, :func:`rebuild_command`)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.data.manifest import COLLECTION, Manifest, check_max_words, open_manifest
from tvrpipe.features.extract.config import (
    ExtractConfig,
    ExtractionError,
    ExtractSummary,
    check_precision,
    too_many_failures,
)
from tvrpipe.features.extract.executor import Executor, LocalExecutor
from tvrpipe.features.extract.pipeline import Early, Pipeline, decode_early
from tvrpipe.features.extract.plan import Plan, plan_run, write_copied
from tvrpipe.features.outputs import check_store_out
from tvrpipe.features.store import (
    FeatureStore,
    StoreWriter,
    make_provenance,
    manifest_sha256,
    update_interrupted,
)
from tvrpipe.features.weights import (
    cached_facts,
    check_checkpoint,
    confirmed_facts,
    remember_facts,
    resolve_pretrained,
    weights_key,
)


def uses_ray(cfg: ExtractConfig) -> bool:
    """Whether ``cfg`` runs on Ray: an ``--address`` (``local`` too: a private Ray instance on this machine) or
    ``RAY_ADDRESS``; otherwise the :class:`LocalExecutor`."""
    return bool(cfg.address or os.environ.get("RAY_ADDRESS"))


def start_executor(cfg: ExtractConfig) -> Executor:
    """The executor of ``cfg`` (:func:`uses_ray`), its decoders and encoders all starting at once (the encoders
    load the weights while the decoders start); a missing GPU or an unreachable ``--address`` fails first."""
    if uses_ray(cfg):
        from tvrpipe.features.extract.actors import RayExecutor

        return RayExecutor(cfg)
    return LocalExecutor(cfg)


def _complete(out: Path) -> bool:
    """``out`` holds a store marked complete (whatever its settings): a rerun may have nothing to do."""
    from tvrpipe.features.store import StoreError, store_attributes

    try:
        return bool(store_attributes(out).get("complete"))
    except StoreError:
        return False


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


def _reported_facts(executor: Executor, key: str) -> dict[str, Any]:
    """The weights' facts from the encoder that loaded them (cached for a later rerun), or the error it
    met loading them (an unknown tag, a checkpoint of another architecture), raised here."""
    facts = executor.facts()
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
            or ``device="cuda"`` without a GPU (here, or in the Ray cluster of ``address``; all before
            anything is created); weights that cannot be loaded, or an encoder that loaded other weights
            than the store records (before anything is written).
        ManifestError: an invalid manifest (before any decoder or encoder starts).
        LockError: another process is writing ``out_dir``.
        StoreError: ``out_dir`` holds a store made with other settings (pass ``overwrite``).
        ExtractionError: more than ``max_failed_fraction`` of the videos failed; the store is kept,
            incomplete, and the next run retries them.

    Example:
        >>> extract("data/msrvtt/manifest", "data/msrvtt/videos", "features/msrvtt-b32",
        ...         ExtractConfig(model="ViT-B-32", pretrained="openai", device="cuda"))  # doctest: +SKIP
    """
    cfg = config or ExtractConfig()
    t0, started = time.perf_counter(), time.time()
    run = _prepare(manifest_dir, video_root, out_dir, cfg, t0, started)
    try:
        facts = _weights(run)
        check_max_words(run.max_words, facts["context_length"])
        provenance = _provenance(run, facts)
        reason = _write(run, facts, provenance)
    finally:
        if run.executor is not None:
            run.executor.stop()
    run.summary.seconds = time.perf_counter() - t0
    if reason:
        raise ExtractionError(reason, run.summary)
    return run.summary


@dataclasses.dataclass
class _Run:
    """One extraction's shared state: its checked inputs, the tables it writes, its executor and summary."""

    cfg: ExtractConfig
    manifest: Manifest
    manifest_dir: str | os.PathLike[str]
    root: Path
    frames: int
    max_words: int
    out: Path
    key: str
    videos: pd.DataFrame
    sidecar: pd.DataFrame
    texts: pd.DataFrame
    summary: ExtractSummary
    t0: float
    started: float
    executor: Executor | None = None
    early: Early | None = None

    def reached(self, phase: str) -> None:
        """Records the seconds from the start to the first time ``phase`` is reached."""
        self.summary.phases.setdefault(phase, time.perf_counter() - self.t0)


def _prepare(manifest_dir: str | os.PathLike[str], video_root: str | os.PathLike[str],
             out_dir: str | os.PathLike[str], cfg: ExtractConfig, t0: float, started: float) -> _Run:
    """Check stage: the inputs checked, the store's tables built and the summary begun, before any worker."""
    # Everything that can be checked without the weights is checked before a decoder starts (cfg checked itself)
    manifest, root, F, L = open_manifest(manifest_dir, video_root, out_dir, cfg.frames, cfg.max_words)
    check_store_out(out_dir, {"--manifest": manifest_dir, "--video-root": root})
    if manifest.is_collection:
        from tvrpipe.features.collection import check_unchanged

        check_unchanged(manifest, manifest_dir, root)
    check_checkpoint(cfg.pretrained)
    # recorded as a path that reaches the file from any folder (the sha256 stays the weights' identity)
    cfg = dataclasses.replace(cfg, pretrained=resolve_pretrained(cfg.pretrained))
    out = Path(out_dir)
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
    run = _Run(cfg, manifest, manifest_dir, root, F, L, out, key, videos, sidecar, texts, summary, t0,
               started)
    run.reached("checks")
    return run


def _weights(run: _Run) -> dict[str, Any]:
    """Weights stage: the weights' facts, from the cache or the encoders started (and decoding early) here."""
    cfg, out = run.cfg, run.out
    # a rerun may have nothing to do, an interrupted update nothing but copies: no encoder, no decoder yet
    if not cfg.overwrite and (_complete(out) or run.manifest.is_collection and update_interrupted(out)):
        # cached facts only where the store resumed or replaced records the same: a new store's facts
        # come from that store or from the weights, never from the cache alone
        return confirmed_facts(cached_facts(run.key), _recorded(out)) or _loaded_facts(cfg, run.key)
    # the encoders that do the work report the weights' facts; the driver loads no model
    run.executor = start_executor(cfg)
    run.reached("workers")
    run.early = decode_early(run.executor, cfg, out, run.videos, run.root, run.frames,
                             by_file=run.manifest.is_collection)
    facts = _reported_facts(run.executor, run.key)
    run.reached("weights")
    if run.early and run.early.image_size != facts["image_size"]:  # the architecture file was not the model's
        run.early = None
    return facts


def _provenance(run: _Run, facts: Mapping[str, Any]) -> dict[str, Any]:
    """Provenance stage: what the store records of its inputs, weights and settings."""
    from tvrpipe.features.decode import FRAME_SAMPLING

    cfg, manifest = run.cfg, run.manifest
    return make_provenance(
        dataset=manifest.meta.get("dataset", "unknown"), split_set=manifest.meta.get("split_set"),
        model=cfg.model, pretrained=cfg.pretrained, weights_sha256=facts["weights_sha256"],
        frames=run.frames, max_words=run.max_words, embed_dim=facts["embed_dim"],
        frame_sampling=FRAME_SAMPLING, image_size=facts["image_size"], preprocessing=facts["preprocessing"],
        manifest_sha256=manifest_sha256(manifest.videos, manifest.captions,
                                        manifest.files if manifest.is_collection else None),
        logit_scale=facts["logit_scale"],  # CLIP's learned scale: every head starts from it (train-head)
        precision=cfg.encode_precision,  # what the rows are computed in (not an identity key)
        seed=cfg.seed,  # rebuilds the weights of --pretrained none
        video_root=str(run.root.resolve()),  # where the rows were decoded from (search shows frames from there)
        manifest=str(Path(run.manifest_dir).resolve()),  # what the advice to update or extract it again names
        **({"kind": COLLECTION} if manifest.is_collection else {}),
    )


def _write(run: _Run, facts: Mapping[str, Any], provenance: dict[str, Any]) -> str | None:
    """Write stage: plans, computes and records the store's rows; the reason it stays incomplete, if any."""
    cfg = run.cfg
    with StoreWriter(run.out, run.sidecar, run.texts.drop(columns="text"), provenance, cfg.video_shard,
                     cfg.text_shard, cfg.overwrite, update=run.manifest.is_collection) as writer:
        plan = _plan(run, writer)
        failed_before = set(writer.failures()["video_id"])
        processed = _encode(run, writer, plan, facts) if plan.jobs or plan.texts else 0
        reason = _record(run, writer, plan, failed_before, processed)
        writer.finalize(incomplete_reason=reason)
    return reason


def _plan(run: _Run, writer: StoreWriter) -> Plan:
    """Plan stage: what the store already holds, copies or must compute; rows copied from a replaced store."""
    plan = plan_run(writer, run.sidecar, run.cfg.retry_failed)
    run.summary.reused = plan.reused
    if plan.copied:
        write_copied(writer, plan.copied, plan.copies, run.cfg.progress)
    run.summary.repaired = plan.damaged
    run.summary.retried = plan.retried
    run.summary.texts_skipped = len(run.texts) - sum(s.stop - s.start for s in plan.texts)
    return plan


def _encode(run: _Run, writer: StoreWriter, plan: Plan, facts: Mapping[str, Any]) -> int:
    """Run stage: the pipeline decodes and encodes what the plan left to do; the videos it processed."""
    cfg, summary, F = run.cfg, run.summary, run.frames
    check_precision(writer, cfg)
    if run.executor is None:  # a complete store whose failed videos are retried
        run.executor = start_executor(cfg)
        run.reached("workers")
    summary.executor, summary.encoders = run.executor.name, run.executor.encoders
    if plan.jobs and cfg.fits_device:  # the encoders measure what fits their GPUs
        summary.fitted_frames = run.executor.fitted_frames(F)
    per_call = cfg.videos_per_call(F, summary.fitted_frames or None)
    summary.videos_per_call = per_call if plan.jobs else 0
    pipeline = Pipeline(writer, run.executor, summary, run.videos, run.texts, run.root, frames=F,
                        max_words=run.max_words, image_size=facts["image_size"], videos_per_call=per_call,
                        first=lambda: run.reached("first_batch"), by_file=run.manifest.is_collection,
                        started=run.started)
    return pipeline.run(plan, run.early, cfg.progress)


def _record(run: _Run, writer: StoreWriter, plan: Plan, failed_before: set[str],
            processed: int) -> str | None:
    """Record stage: the summary's done, skipped, failed and recovered counts, and the failure check."""
    summary = run.summary
    failures = writer.failures()
    failed_now = set(failures["video_id"])
    ids = run.videos["video_id"].to_numpy()
    redone = {str(i) for s, rows in plan.jobs
              for i in ids[np.arange(s.start, s.stop) if rows is None else rows]}
    retried = {str(i) for rows in plan.retry.values() for i in ids[rows]}
    summary.failed = len(failures)
    summary.videos_done = processed - len(failed_now & redone)
    summary.videos_skipped = summary.videos_total - summary.videos_done - summary.reused - summary.failed
    summary.recovered = len((failed_before & retried) - failed_now)
    summary.failure_kinds = dict(Counter(e.split(":", 1)[0] for e in failures["error"]))
    return too_many_failures(failures, run.videos, run.root, run.out, run.cfg)
