"""``finetune --dry-run``: what a run will do, from its job, without doing it."""

from __future__ import annotations

import dataclasses

from tvrpipe.training.finetune.job import FinetuneJob, steps_per_epoch
from tvrpipe.training.finetune.loop import live_model
from tvrpipe.training.videodata import TrainPairs


def plan_run(job: FinetuneJob, pairs: TrainPairs, bundle, config: dict, gpu_missing: str | None,
             gpu_memory: int | None = None) -> dict:
    """What the run of ``job`` (training ``pairs``) will do: its resolved settings, split counts, steps and images
    per step, and the estimated peak memory of a training step per worker, with its chunks and without
    (:mod:`tvrpipe.training.plan`), measured on the CPU with ``bundle`` (the run's CLIP) and a fresh head; with
    ``gpu_memory`` (bytes per worker), whether it fits and what it needs to (:func:`~tvrpipe.training.plan.advise`)."""
    from tvrpipe.training.plan import advise, measure_step, variants

    cfg = job.cfg
    world = max(1, cfg.num_workers)
    steps = steps_per_epoch(pairs, cfg)
    # fp16 autocast is measured as bf16 on the CPU: the same bytes per activation
    model = live_model(job, "cpu", bundle, "fp32" if cfg.precision == "fp32" else "bf16")
    texts = [str(t) for t in job.table.texts[job.train_texts[:8]]] or ["a video"]
    measured = measure_step(model, texts, job.frames, job.max_words, cfg.batch_size // world, cfg.grad_checkpointing,
                            gathered=cfg.batch_size,
                            settings=variants(cfg.precision, cfg.grad_checkpointing) if gpu_memory
                            else [(cfg.precision, cfg.grad_checkpointing)])  # fp16 measured as bf16, named fp16
    own = measured[(cfg.precision, cfg.grad_checkpointing)]
    memory, whole = own.at(cfg.chunk_size), own.at(None)
    counts = {name: {"videos": int(len(v)), "captions": int(len(c))} for name, (v, c) in (
        ("train", (job.train_videos, job.train_texts)), ("val", job.val), ("test", job.test))}
    return {
        "dry_run": True, "method": job.method, "out": job.out, "config": config, "splits": counts,
        "validation": job.val_source, "steps_per_epoch": steps, "epochs": cfg.epochs, "total_steps": steps * cfg.epochs,
        "workers": world, "pairs_per_step": cfg.batch_size, "images_per_step": cfg.batch_size * job.frames,
        "images_per_step_per_worker": cfg.batch_size // world * job.frames,
        "memory": {**dataclasses.asdict(memory), "total": memory.total, "unchunked_total": whole.total,
                   "measured": {k: [list(x) for x in v] for k, v in own.measured.items()}},
        "fit": None if gpu_memory is None else advise(measured, cfg.precision, cfg.grad_checkpointing, cfg.chunk_size,
                                                       gpu_memory, half="fp16" if cfg.use_gpu else "bf16"),
        "gpu": gpu_missing,  # why the run would stop here for want of GPUs (None: it would not)
    }
