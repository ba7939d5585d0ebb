"""Evaluation in training: :func:`evaluate_split`, the one function both trainers validate and test with
(a head's scores on a split's features through the evaluation engine), and :func:`evaluate_run`, which
scores a finished run's selected checkpoint on a store (``tvrpipe evaluate``)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import torch

from tvrpipe.errors import ConfigError
from tvrpipe.features.store import open_store
from tvrpipe.heads.base import Head
from tvrpipe.lock import locked
from tvrpipe.rundir import (
    BEST,
    CHECKPOINTS,
    check_checkpoint_sha,
    check_head_record,
    load_head,
    read_config,
    read_metrics,
    write_metrics,
)
from tvrpipe.training.data import SplitData, store_split_rows
from tvrpipe.training.recorded import trainer_config
from tvrpipe.training.settings import TrainConfig
from tvrpipe.training.stream import StoreSplit

log = logging.getLogger(__name__)


def evaluate_split(head: Head, split: SplitData | StoreSplit, device: str | torch.device, eval_batch: int, block_texts: int,
                   post: tuple[str, ...] = (), querybank: SplitData | StoreSplit | None = None, readouts: bool = True,
                   ranks: bool = False) -> dict:
    """``head``'s scores on ``split`` through the evaluation engine: what both trainers validate and test
    with, and ``evaluate`` scores a finished run with. ``eval_batch`` items per encoder call and
    ``block_texts`` texts per similarity block on ``device``; ``querybank``: the training split's captions,
    for QB-Norm."""
    from tvrpipe.evaluation.engine import EvalInputs, EvalOptions, evaluate_head

    dev = torch.device(device)
    bank = None if querybank is None else (b.to(dev) for b in querybank.text_batches(eval_batch, head.uses_tokens))
    inputs = EvalInputs((b.to(dev) for b in split.text_batches(eval_batch, head.uses_tokens)),
                        (b.to(dev) for b in split.video_batches(eval_batch)), split.text_video,
                        text_ids=split.caption_ids, video_ids=split.video_ids, querybank=bank)
    return evaluate_head(head, inputs, EvalOptions(block_texts=block_texts, device=dev, post=post, readouts=readouts,
                                                   ranks=ranks))


def checkpoint_similarity(checkpoint: str | os.PathLike[str], split: SplitData,
                          device: str = "cpu") -> np.ndarray:
    """The raw float32 ``(n_text, n_video)`` scores of a checkpoint (:func:`load_head`) on every caption
    and video of ``split``, through the evaluation engine: the scores behind a run's metrics there."""
    from tvrpipe.evaluation.engine import encode_all, similarity_matrix

    head = load_head(checkpoint, device)
    video_emb = encode_all(head.encode_videos, split.video_batches(256), device)
    text_emb = encode_all(head.encode_texts, split.text_batches(256, head.uses_tokens), device)
    return similarity_matrix(head, text_emb, video_emb, device=device).numpy()


def evaluate_run(
    run_dir: str | os.PathLike[str],
    split: str = "test",
    post: tuple[str, ...] = (),
    features: str | os.PathLike[str] | None = None,
    train: TrainConfig | None = None,
) -> dict:
    """Evaluate a run's selected checkpoint on ``split``; writes ``eval_<split>.json`` in the run.

    The store must have the provenance the run was trained on (else StoreError); the checkpoint
    must match the sha256 that training recorded in ``metrics.json`` (else RunError).

    Raises:
        RunError: ``config.yaml`` is damaged (a key of the wrong type, a trainer setting out of its range, a method
            or head setting other than the selected checkpoint's), naming the file and the key; the checkpoint
            is missing, damaged or not the one training recorded.
        StoreError: the store is missing, damaged (its tables included) or of another provenance.
        ConfigError: ``split`` is not a split, or has no videos or no captions in the store.
    """
    run = Path(run_dir)
    if split not in ("train", "val", "test"):
        raise ConfigError(f"--split must be train, val or test, got {split!r}")
    config = read_config(run)
    # a finetune run has no trainer section: the defaults give evaluation's block sizes
    tc = train or (trainer_config(run, config) if "train" in config else TrainConfig())
    if tc.device != "cpu" and train is None and not torch.cuda.is_available():
        # trained on a GPU, evaluated here: the scores do not depend on the device (to rounding)
        log.info("%s was trained on %s; evaluating on the CPU (no CUDA here)", run, tc.device)
        tc = dataclasses.replace(tc, device="cpu")
    with locked(run, "--run"):
        trained = read_metrics(run) or {}  # the checkpoint's sha256; a finetune run's export and CLIP provenance
        check_checkpoint_sha(run, trained)
        head = load_head(run / CHECKPOINTS / BEST, tc.device)
        check_head_record(run, config, head.name, dataclasses.asdict(head.config))
        if features is None and config["features"] is None:
            export = trained.get("export")
            how = f" (`{export['extract']}`)" if isinstance(export, dict) and export.get("extract") else ""
            raise ConfigError(f"{run} was trained on live CLIP features (tvrpipe finetune): pass --features, a store "
                              f"extracted with the run's CLIP{how}")
        # a finetune run pins what it learnt with (its CLIP's weights hash) in metrics.json
        expect = {**config["provenance"], **(trained.get("provenance") or {})}
        store = open_store(features or config["features"], expect=expect)
        rows = store_split_rows(store, need_test=split == "test")
        # only the split evaluated (and train's captions for QB-Norm's bank), read batch by batch from the store as
        # evaluation uses them (the same batches a loaded split gives): a split larger than memory is evaluated too
        data = StoreSplit(store, split, getattr(rows, f"{split}_videos"), getattr(rows, f"{split}_texts"))
        if data.n_videos == 0 or data.n_texts == 0:  # nothing to rank: no score would mean anything
            what = "no videos" if data.n_videos == 0 else "no captions"
            raise ConfigError(f"{store.dir}: the {split} split has {what}; evaluate a split that has both (--split)")
        querybank = StoreSplit(store, "train", rows.train_videos, rows.train_texts) if "qbnorm" in post else None
        metrics = {"split": split, "validation": rows.val_source, "features": str(Path(store.dir).resolve()),
                   "device": tc.device, **evaluate_split(head, data, tc.device, tc.eval_batch, tc.block_texts, post=post,
                                     querybank=querybank)}
        write_metrics(run, metrics, f"eval_{split}.json")
    return metrics
