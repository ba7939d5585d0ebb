"""Where an extraction's decoders and encoders run: the :class:`Executor` interface that
:class:`~tvrpipe.features.extract.pipeline.Pipeline` drives, its implementation for one machine
(:class:`LocalExecutor`); :func:`tvrpipe.features.extract.driver.start_executor` chooses between it and
Ray's.

Without ``--address`` (and without ``RAY_ADDRESS``) an extraction runs here without Ray, as the tools
researchers already use do by default (video2dataset, clip-retrieval, img2dataset): each decoder is a
:class:`~tvrpipe.features.decode.DecodeWorker` child process (per-video timeout, kill, PyAV fallback)
driven by a thread of this process, and each encoder is a thread of this process holding one CLIP (on
``cuda:k`` for the k-th encoder with ``--device cuda``). Ray is never imported. With ``--address`` the
same pipeline drives Ray actors instead (:class:`~tvrpipe.features.extract.actors.RayExecutor`).

Both hand out handles for work in flight: the pipeline sends work, waits for the first handle to finish
and reads its result, and never asks which executor it holds. The calls an encoder gets are decided by
the pipeline alone (:mod:`~tvrpipe.features.extract.pipeline`), so both executors write the same bytes.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from tvrpipe import errors
from tvrpipe.cluster import local_cpus
from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.features.extract.config import ExtractConfig
from tvrpipe.features.weights import check_download
from tvrpipe.features.workers import ClipEncoder, Decoder

log = logging.getLogger(__name__)

# how long a stopped local executor waits for its threads (choice: a decoder's process is killed, so it ends at
# once; an encoder ends after its call in flight, seconds even for thousands of frames on a CPU)
DECODER_STOP_S = 10.0
ENCODER_STOP_S = 120.0

LOCAL = "local"  # the executor names, as the summary and bench extract print them
RAY = "ray"


class Executor(ABC):
    """The decoders and encoders of one extraction, wherever they run.

    ``decoders`` and ``encoders`` are counts; work goes to one of them by index. A handle is whatever
    the implementation returns for work in flight (a Ray ref, a :class:`~concurrent.futures.Future`):
    hashable, and finished once :meth:`wait` returned it.
    """

    name: str
    decoders: int
    encoders: int

    @abstractmethod
    def decode(self, k: int, group: list[dict[str, Any]], frames: int, image_size: int) -> list:
        """Decode one call's items (:func:`~tvrpipe.features.extract.plan.decode_groups`) on decoder ``k``:
        a handle per item, in its order, all finished together; each result is
        :meth:`~tvrpipe.features.workers.Decoder.decode`'s."""

    @abstractmethod
    def encode_videos(self, k: int, decoded: list) -> Any:
        """Encode finished decode handles' videos on encoder ``k`` as one call
        (:meth:`~tvrpipe.features.workers.ClipEncoder.encode_videos`)."""

    @abstractmethod
    def encode_texts(self, k: int, texts: list[str], max_words: int) -> Any:
        """Encode captions on encoder ``k`` (:meth:`~tvrpipe.features.workers.ClipEncoder.encode_texts`)."""

    @abstractmethod
    def wait(self, handles: list) -> list:
        """Block until at least one of ``handles`` has finished; the finished ones."""

    @abstractmethod
    def result(self, handle: Any) -> Any:
        """A finished handle's value (its error raised)."""

    @abstractmethod
    def _facts(self) -> dict[str, Any]:
        """The first encoder's :meth:`~tvrpipe.features.workers.ClipEncoder.facts` (waits for its weights)."""

    @abstractmethod
    def fitted_frames(self, frames: int) -> int:
        """Frames per encoder call that fit every encoder's GPU (``--encode-frames auto`` on cuda): the smallest."""

    @abstractmethod
    def stop(self) -> None:
        """End every decoder and encoder now (their memory and GPUs freed); work in flight is dropped."""

    def facts(self) -> dict[str, Any]:
        """The weights' facts the first encoder reports once it holds them; the error it met loading them (an
        unknown tag, a checkpoint of another architecture, no GPU) raised here, with its own class and text."""
        facts = self._facts()
        if "error" in facts:
            name, message = facts["error"]
            raise getattr(errors, name, TvrpipeError)(message)
        return facts


def check_local_gpus(encoders: int) -> None:
    """``--device cuda`` without ``--address``: each encoder needs a GPU of this machine that torch can use."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA GPU that torch can use "
                          "(torch.cuda.is_available() is False); use --device cpu, or --address of a Ray "
                          "cluster with GPUs")
    have = torch.cuda.device_count()
    if have < encoders:
        raise ConfigError(f"--encoders {encoders} with --device cuda: one GPU each, and this machine has {have}; "
                          f"use --encoders {have}, or --address of a Ray cluster with more GPUs")


class Lane:
    """One daemon thread that runs its calls in the order they came, each answered through a
    :class:`~concurrent.futures.Future`: a decoder's or an encoder's. Not a ``ThreadPoolExecutor``, whose threads
    the interpreter joins at exit, without a limit: a process interrupted while a call runs waited for it, or
    forever where the interruption left a lock held. A stopped lane cancels what waits, ends after the call it
    runs, and is waited for only up to a limit (its thread must end before the interpreter does: torch's threads
    abort a process whose thread that used them is still alive at exit).

    Example:
        >>> lane = Lane("example")
        >>> lane.submit(sum, [1, 2]).result()
        3
        >>> lane.stop()
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args: Any) -> Future:
        future: Future = Future()
        if self._stopped:
            future.cancel()
        else:
            self._calls.put((future, fn, args))
        return future

    def stop(self) -> None:
        """Cancel the calls that wait, and end the thread after the call it runs."""
        self._stopped = True
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        self._calls.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a stopped lane's thread to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised where the caller reads the future
                future.set_exception(e)
            else:
                future.set_result(result)


class LocalExecutor(Executor):
    """Decoders and encoders on this machine, without Ray.

    Decoder ``k`` is a single thread of this process that sends its calls, one at a time, to its own
    :class:`~tvrpipe.features.workers.Decoder`'s child process (a crash or a hang there is killed and the
    video recorded, as under Ray); encoder ``k`` is a single thread that loads one CLIP, then runs its
    calls in the order they were sent. Torch runs its own threads inside each call, on every core of a
    CPU (the decoders' processes share them, as Ray's CPU encoders do).
    """

    name = LOCAL

    def __init__(self, cfg: ExtractConfig) -> None:
        cpus = local_cpus()
        gpu = cfg.device == "cuda"
        if not gpu and "torch" not in sys.modules:
            # a CPU encoder's OpenMP threads share the cores with the decoder processes: spinning between parallel
            # regions (OpenMP's default) takes the decoders' time slices, sleeping gives them back (16 x 720p on 2
            # cores: 15.1 s against 16.0 s, docs/performance.md). Read once, when torch starts OpenMP: in a process
            # that imported torch before (the quickstart), its setting stays.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.decoders = cfg.decoders if cfg.decoders is not None else cpus
        self.encoders = cfg.encoders
        self._decoders = [Decoder(cfg.timeout_s) for _ in range(self.decoders)]
        self._decode_lanes = [Lane(f"tvrpipe-decoder-{k}") for k in range(self.decoders)]
        self._encode_lanes = [Lane(f"tvrpipe-encoder-{k}") for k in range(self.encoders)]
        for decoder, thread in zip(self._decoders, self._decode_lanes):
            thread.submit(decoder.start)  # the child processes start while the weights load
        self._clip = [thread.submit(_local_encoder, cfg, f"cuda:{k}" if gpu else "cpu", 1 if gpu else cpus)
                      for k, thread in enumerate(self._encode_lanes)]

    def decode(self, k: int, group: list[dict[str, Any]], frames: int, image_size: int) -> list[Future]:
        decoder = self._decoders[k]
        if len(group) == 1:
            return [self._decode_lanes[k].submit(decoder.decode, group[0], frames, image_size)]
        parts = [Future() for _ in group]  # one handle per moment, as Ray's num_returns gives

        def moments() -> None:
            try:
                outs = decoder.decode_moments(group, frames, image_size)
            except BaseException as e:  # noqa: BLE001 - the pipeline raises it where it reads a result
                for part in parts:
                    part.set_exception(e)
            else:
                for part, out in zip(parts, outs):
                    part.set_result(out)

        for part in parts:
            part.set_running_or_notify_cancel()
        self._decode_lanes[k].submit(moments)
        return parts

    def encode_videos(self, k: int, decoded: list[Future]) -> Future:
        clip = self._clip[k]
        videos = [d.result() for d in decoded]  # finished: the pipeline sends only decoded videos
        return self._encode_lanes[k].submit(lambda: clip.result().encode_videos(*videos))

    def encode_texts(self, k: int, texts: list[str], max_words: int) -> Future:
        clip = self._clip[k]
        return self._encode_lanes[k].submit(lambda: clip.result().encode_texts(texts, max_words))

    def wait(self, handles: list[Future]) -> list[Future]:
        done, _ = wait(handles, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle: Future) -> Any:
        return handle.result()

    def _facts(self) -> dict[str, Any]:
        return self._clip[0].result().facts()

    def fitted_frames(self, frames: int) -> int:
        calls = [thread.submit(lambda clip=clip: clip.result().fitted_frames(frames))
                 for clip, thread in zip(self._clip, self._encode_lanes)]
        return min(call.result() for call in calls)

    def stop(self) -> None:
        for decoder in self._decoders:
            decoder.stop()  # a decode in flight ends at once: its thread finds the child gone
        for lane in self._decode_lanes + self._encode_lanes:
            lane.stop()
        # a decode in flight ends at once (its process is gone); an encoder finishes its call (seconds at most)
        for lanes, limit in ((self._decode_lanes, DECODER_STOP_S), (self._encode_lanes, ENCODER_STOP_S)):
            for lane in lanes:
                if not lane.join(limit):
                    log.warning("a %s thread did not end within %g s of the stop; exiting without it",
                                "decoder" if lanes is self._decode_lanes else "encoder", limit)
        for clip in self._clip:
            clip.cancel()
        self._clip = [_dropped() for _ in self._clip]  # the weights (and the GPU's memory) go with the threads


def _dropped() -> Future:
    f: Future = Future()
    f.set_exception(ConfigError("the extraction's encoders were stopped"))
    return f


def _local_encoder(cfg: ExtractConfig, device: str, threads: int) -> ClipEncoder:
    """An encoder thread's first call: one CLIP on ``device``. A missing GPU, or a tag's weights that cannot be
    downloaded (found in seconds: open_clip would retry for minutes), is raised where :meth:`facts` reads it,
    before the store is created; both are checked here, in the encoder's thread, so that the decoders start
    without waiting for the imports they need (torch, open_clip)."""
    if cfg.device == "cuda":
        check_local_gpus(cfg.encoders)
    check_download(cfg.model, cfg.pretrained)
    return ClipEncoder(cfg.model, cfg.pretrained, device, cfg.seed, threads, cfg.encode_precision)
