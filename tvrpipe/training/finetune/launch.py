"""Where a finetune run executes: in this process, or on ``--num-workers`` Ray Train workers (DDP), with
the GPUs ``--use-gpu`` asks for counted before anything is written, and the driver's progress bar fed
by rank 0's progress file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tvrpipe.errors import RunError
from tvrpipe.training.finetune.config import FinetuneConfig
from tvrpipe.training.finetune.job import FinetuneJob
from tvrpipe.training.finetune.loop import ProgressFile, run_job

NO_GPU = "--use-gpu: no CUDA device is available here; leave it out to train on the CPU"




def gpu_missing(cfg: FinetuneConfig) -> str | None:
    """Why the run cannot have the GPUs ``--use-gpu`` asks for here, checked before anything is written
    (None: it can, or it joins a cluster, whose GPUs :func:`join_ray` counts before the first write)."""
    if not cfg.use_gpu or (cfg.num_workers and (cfg.address or os.environ.get("RAY_ADDRESS"))):
        return None
    need = max(1, cfg.num_workers)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= need:
        return None
    if cfg.num_workers == 0:
        return NO_GPU
    return (f"--use-gpu with --num-workers {cfg.num_workers}: needs {need} GPUs, and this machine has {have}; lower "
            "--num-workers, drop --use-gpu, or join a cluster with GPUs (--address)")


def join_ray(cfg: FinetuneConfig) -> None:
    """Start or join Ray for ``num_workers`` Ray Train workers, and check that the cluster has a GPU for
    each with ``--use-gpu`` (Ray would otherwise wait forever to place them)."""
    from tvrpipe.cluster import ray_init, require_gpus

    ray_init(cfg.address)
    if cfg.use_gpu:
        require_gpus(cfg.num_workers, f"--use-gpu with --num-workers {cfg.num_workers}",
                     "drop --use-gpu or lower --num-workers", per_task=1)


def ray_train(job: FinetuneJob) -> dict:
    """Run :func:`run_job` on ``num_workers`` Ray Train workers (DDP); rank 0 writes the run."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tvrpipe.errors import TvrpipeError

    cfg = job.cfg  # Ray was started or joined (join_ray) before the run directory was written
    cluster_cpus = int(ray.cluster_resources().get("CPU", 1))
    cpus = cfg.cpus_per_worker or max(1, cluster_cpus // cfg.num_workers)
    resources = {"CPU": cpus, **({"GPU": 1} if cfg.use_gpu else {})}
    trainer = TorchTrainer(
        _ray_worker, train_loop_config={"job": job, "threads": cpus},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(storage_path=str(Path(job.out) / "ray"), name="finetune",
                             failure_config=FailureConfig(max_failures=0)),
    )
    try:
        _fit_with_progress(trainer, Path(job.out), job)
    except Exception as e:  # a worker's TvrpipeError keeps its message; anything else is summarised
        cause: BaseException | None = e
        seen = set()
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if isinstance(cause, TvrpipeError):
                raise type(cause)(str(cause)) from None
            inner = [getattr(cause, "__cause__", None), getattr(cause, "cause", None)]
            inner += list(getattr(cause, "worker_failures", {}).values()) if isinstance(
                getattr(cause, "worker_failures", None), dict) else []
            cause = next((c for c in inner if isinstance(c, BaseException)), None)
        raise RunError(f"Ray Train failed: {' '.join(str(e).split())[:400]}; rerun the same command to resume "
                       f"from the last complete epoch") from e
    path = Path(job.out) / "metrics.json"
    return json.loads(path.read_text())


def _fit_with_progress(trainer, out: Path, job: FinetuneJob) -> None:
    """``trainer.fit()``, with a progress bar fed by rank 0's progress file (Ray Train workers' own
    output does not reach this terminal)."""
    import threading

    from tvrpipe.progress import progress_bar

    progress = ProgressFile(out)
    progress.path.unlink(missing_ok=True)
    box: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    bar = progress_bar(field="info", eta=True, enabled=job.progress)
    with bar:
        task = bar.add_task(f"finetune {job.method} ({job.cfg.num_workers} Ray Train workers)", total=None,
                            info="starting the workers")
        while thread.is_alive():
            thread.join(0.5)
            p = progress.read()
            if p:
                bar.update(task, total=p["total"], completed=p["done"], info=p["info"])
    if "error" in box:
        raise box["error"]


def _ray_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    torch.set_num_threads(max(1, int(config["threads"])))
    run_job(config["job"], ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(),
            cpus=int(config["threads"]))
