"""Extraction on Ray (``--address``): the device check, and :class:`RayExecutor`, whose decoders and encoders are
Ray actors started at once, on this machine (``--address local``) or a cluster's nodes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tvrpipe.cluster import check_reachable, cluster_cpus, ray_address, ray_init, require_gpus
from tvrpipe.features.extract.config import ExtractConfig
from tvrpipe.features.extract.executor import RAY, Executor
from tvrpipe.features.weights import check_download
from tvrpipe.features.workers import ClipEncoder, Decoder


def check_device(cfg: ExtractConfig) -> None:
    """Before the store is created or changed: an ``--address`` where nothing answers fails here, and
    ``--device cuda`` needs a GPU in the cluster (Ray would otherwise wait forever to place the encoders)."""
    address, option = ray_address(cfg.address)
    if address:
        check_reachable(address, option=option)
    if cfg.device != "cuda":
        return
    ray_init(address, data=False)
    require_gpus(1, "--device cuda", "use --device cpu")  # one encoder's GPU


class RayExecutor(Executor):
    """Ray (joined or started) and the actors of one extraction: ``--encoders`` CLIP encoders (each loads the
    weights once, and serves both the captions and the videos; one GPU each with ``--device cuda``) and the
    decoders (one per CPU of the cluster unless ``--decoders``). Handles are Ray refs: a decoded video passes
    from its decoder to an encoder through Ray's object store, never through this process."""

    name = RAY

    def __init__(self, cfg: ExtractConfig) -> None:
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
        self._encoders = [encoder.remote(cfg.model, cfg.pretrained, cfg.device, cfg.seed, 1 if gpu else cpus,
                                         cfg.encode_precision) for _ in range(cfg.encoders)]
        self._decoders = [decoder.remote(cfg.timeout_s)
                          for _ in range(cfg.decoders if cfg.decoders is not None else cpus)]
        self.decoders, self.encoders = len(self._decoders), len(self._encoders)

    def decode(self, k: int, group: list[dict[str, Any]], frames: int, image_size: int) -> list:
        decoder = self._decoders[k]
        if len(group) == 1:
            return [decoder.decode.remote(group[0], frames, image_size)]
        return list(decoder.decode_moments.options(num_returns=len(group)).remote(group, frames, image_size))

    def encode_videos(self, k: int, decoded: list) -> Any:
        return self._encoders[k].encode_videos.remote(*decoded)  # Ray hands the encoder the values

    def encode_texts(self, k: int, texts: list[str], max_words: int) -> Any:
        return self._encoders[k].encode_texts.remote(texts, max_words)

    def wait(self, handles: list) -> list:
        import ray

        ready, _ = ray.wait(handles, num_returns=1)
        return ready

    def result(self, handle: Any) -> Any:
        import ray

        return ray.get(handle)

    def _facts(self) -> dict[str, Any]:
        import ray

        return ray.get(self._encoders[0].facts.remote())

    def fitted_frames(self, frames: int) -> int:
        import ray

        return min(ray.get([encoder.fitted_frames.remote(frames) for encoder in self._encoders]))

    def stop(self) -> None:
        import ray

        for actor in self._encoders + self._decoders:
            ray.kill(actor)
