"""Ray and the actors of one extraction: the device check, the decoders and encoders started at once, and the
decodes sent while the encoders load the weights."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tvrpipe.cluster import check_reachable, cluster_cpus, ray_address, ray_init, ray_running, require_gpus
from tvrpipe.errors import ConfigError
from tvrpipe.features.extract.config import ExtractConfig
from tvrpipe.features.extract.plan import decode_groups, send_decode, video_items
from tvrpipe.features.weights import check_download, guess_image_size
from tvrpipe.features.workers import ClipEncoder, Decoder


def check_device(cfg: ExtractConfig) -> None:
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


@dataclass
class Workers:
    """The Ray actors of one extraction: ``--encoders`` CLIP encoders (each loads the weights once, and
    serves both the captions and the videos) and the decoders (one per core unless ``--decoders``)."""

    encoders: list
    decoders: list

    def stop(self) -> None:
        """End them now: their weights (and GPUs) are freed at once, not when Ray shuts down."""
        import ray

        for actor in self.encoders + self.decoders:
            ray.kill(actor)


def start_workers(cfg: ExtractConfig) -> Workers:
    """Ray (joined or started) and every actor the run needs, all starting at once (the encoders load the
    weights while the decoders start); a missing GPU or an unreachable ``--address`` fails first."""
    import ray

    check_device(cfg)
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
    return Workers(
        [encoder.remote(cfg.model, cfg.pretrained, cfg.device, cfg.seed, 1 if gpu else cpus, cfg.encode_precision)
         for _ in range(cfg.encoders)],
        [decoder.remote(cfg.timeout_s) for _ in range(cfg.decoders if cfg.decoders is not None else cpus)],
    )


def fitted_frames(workers: Workers, frames: int) -> int:
    """The frames per encoder call that fit the GPU of every encoder (``--encode-frames auto`` on cuda): the
    smallest, as any encoder may take any call. Each measures its own once it holds the weights."""
    import ray

    return min(ray.get([encoder.fitted_frames.remote(frames) for encoder in workers.encoders]))


@dataclass
class Early:
    """Decodes sent before the weights' facts are known: ``refs`` maps each call's first ref to (decoder, its
    rows, the refs of its videos)."""

    image_size: int
    refs: dict[Any, tuple[int, tuple[int, ...], list]]


def decode_early(workers: Workers, cfg: ExtractConfig, out: Path, videos: pd.DataFrame, root: Path,
                 F: int, by_file: bool = False) -> Early | None:
    """Send the decoders as many videos as the first two batches per encoder hold (two per decoder at
    least) while the encoders load the weights, seconds in which the decoders would wait: only for a new
    store, where every row is to do, and only when the image size can be read from the architecture's file
    (checked against the encoder's report; if they differ, these decodes are dropped)."""
    from tvrpipe.features.store import STORE_NAME

    size = guess_image_size(cfg.model)
    fresh = cfg.overwrite or not (out / STORE_NAME / "zarr.json").is_file()
    if size is None or not fresh or len(videos) == 0:
        return None
    # as many as the first batches hold: the cores a loading encoder leaves idle decode them
    n = min(len(videos), max(2 * len(workers.decoders), 2 * cfg.videos_per_call(F) * len(workers.encoders)))
    groups = decode_groups(video_items(videos.iloc[:n].assign(row=np.arange(n)), root), by_file)
    refs = {}
    for i, group in enumerate(groups):  # by_file: a file's moments as one call, as the pipeline sends them
        k = i % len(workers.decoders)
        sent = send_decode(workers.decoders[k], group, F, size)
        refs[sent[0]] = (k, tuple(item["row"] for item in group), sent)
    return Early(size, refs)

