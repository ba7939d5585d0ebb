"""The work of extraction's decoders and encoders, wherever they run: threads of ``tvrpipe extract``'s own
process, or Ray actors (:mod:`tvrpipe.features.extract.executor` drives them).

Imported by every decode and encode worker, so this module imports nothing heavy at load time:
decord, PyAV, torch and open_clip load inside the workers that use them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.features.arrays import nonfinite_rows

log = logging.getLogger(__name__)

# --encode-frames auto on a GPU (fit_frames): at most this many frames per encoder call (choice: beyond a few
# thousand images one forward keeps a GPU busy, and a larger call only holds more decoded frames in Ray's object
# store, two calls in flight and two waiting per encoder), in at most this share of the GPU's free memory (the
# rest: the caption calls in between, the allocator's fragmentation, and a per-frame cost that grows faster than
# the probe's at another batch shape)
ENCODE_FRAMES_CAP = 3072
ENCODE_MEMORY_SHARE = 0.5
PROBE_FRAMES = 32  # frames of the probe call that measures a frame's cost (device_memory)


def fit_frames(free_bytes: float, frame_bytes: float, frames: int, cap: int = ENCODE_FRAMES_CAP,
               share: float = ENCODE_MEMORY_SHARE) -> int:
    """Frames per encoder call for ``--encode-frames auto`` on a GPU: as many as ``share`` of ``free_bytes`` holds
    at ``frame_bytes`` each, at most ``cap``, and at least one video's ``frames`` (a video is never split).

    Example:
        >>> fit_frames(8e9, 1e7, 12)  # 8 GB free, 10 MB a frame: half of it holds 400 frames
        400
    """
    fitted = int(share * free_bytes // max(frame_bytes, 1.0))
    return max(frames, min(cap, fitted))


def device_memory(device: Any, encode: Any, image_size: int, probe: int = PROBE_FRAMES) -> tuple[int, float]:
    """(free bytes on the CUDA ``device``, bytes one frame takes in an ``encode`` call there): ``encode`` runs once
    on ``probe`` black frames, and a frame costs the probe's peak allocation above what was allocated before,
    divided by ``probe`` (the call's fixed cost included: an overestimate, on the safe side). The free memory is
    read afterwards, with torch's cached blocks released."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    encode(np.zeros((probe, image_size, image_size, 3), np.uint8))
    torch.cuda.synchronize(device)
    frame_bytes = (torch.cuda.max_memory_allocated(device) - before) / probe
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return int(free), float(frame_bytes)


class Decoder:
    """Decodes videos, one per call, in a killable child process (:class:`~tvrpipe.features.decode.DecodeWorker`:
    a per-video wall-clock timeout and a PyAV fallback). ``tvrpipe extract`` starts one per core (a thread of
    its own process, or a Ray actor with ``--address``) at the same time as the encoders, so both are ready
    together.

    Args:
        timeout_s: the longest one decode may take, in seconds.
    """

    def __init__(self, timeout_s: float) -> None:
        from tvrpipe.features.decode import DecodeWorker

        self.worker = DecodeWorker(timeout_s=timeout_s)

    def start(self) -> None:
        """Start the decoder process now, while the encoders load the weights (else it starts with the first
        video)."""
        self.worker.start()

    def stop(self) -> None:
        """Kill the decoder process; a decode in flight ends at once (:meth:`DecodeWorker.stop`)."""
        self.worker.stop()

    def decode(self, item: dict[str, Any], frames: int, image_size: int) -> dict[str, Any]:
        """``item`` (row, path, start_s, end_s; NaN for no bound) -> its F frames ``(F, S, S, 3)`` uint8,
        mask, timestamps and ``error`` ("" or ``"kind: detail"``; a failed video has an all-False mask)."""
        from tvrpipe.features.decode import DecodeFailure

        try:
            d = self.worker.decode(item["path"], frames, image_size, *_bounds(item))
        except DecodeFailure as e:
            d = e
        return _decoded(item, frames, image_size, d)

    def decode_moments(self, items: list[dict[str, Any]], frames: int, image_size: int) -> tuple[dict[str, Any], ...]:
        """Moments of one file (items of one path, with bounds) from one open of it
        (:meth:`~tvrpipe.features.decode.DecodeWorker.decode_moments`): one result per item, as :meth:`decode`
        gives; called with ``num_returns=len(items)``, so that each is its own object for the encoders."""
        decoded = self.worker.decode_moments(items[0]["path"], frames, image_size, [_bounds(i) for i in items])
        return tuple(_decoded(item, frames, image_size, d) for item, d in zip(items, decoded))


def _bounds(item: dict[str, Any]) -> tuple[float | None, float | None]:
    """An item's clip bounds as the decoder takes them (None for NaN: no bound)."""
    return tuple(None if np.isnan(item[k]) else float(item[k]) for k in ("start_s", "end_s"))


def _decoded(item: dict[str, Any], frames: int, image_size: int, d: Any) -> dict[str, Any]:
    """:meth:`Decoder.decode`'s result for ``item`` from ``d``, a decoded video or the ``DecodeFailure`` it met
    (black frames, an all-False mask and the error), stamped with when it was ready (the driver's start-up
    figures)."""
    from tvrpipe.features.decode import DecodeFailure

    F, S = frames, image_size
    out = {"row": item["row"], "frames": np.zeros((F, S, S, 3), np.uint8), "mask": np.zeros(F, bool),
           "timestamps": np.full(F, np.nan, np.float32), "error": ""}
    if isinstance(d, DecodeFailure):
        out["error"] = f"{d.kind}: {d.detail}"
    else:
        out.update(frames=d.frames, mask=d.mask, timestamps=d.timestamps)
    out["decoded_at"] = time.time()
    return out


class ClipEncoder:
    """One CLIP, loaded once, that encodes both caption shards and batches of decoded frames.

    ``tvrpipe extract`` starts ``--encoders`` of them (threads of its own process, or Ray actors with
    ``--address``; each on a GPU with ``--device cuda``), and both stages send their work to the same ones:
    the weights load once per encoder, and captions are encoded while the first videos decode. :meth:`facts`
    reports what the store's provenance takes from the weights, so the driver never loads them itself.

    Args:
        model, pretrained, seed: the weights, as :func:`~tvrpipe.features.clip.load_clip` takes them.
        device: ``"cpu"`` or ``"cuda"``.
        threads: torch's CPU threads (a CPU encoder shares the cores with the decoders).
        precision: ``"fp32"``; ``"fp16"`` (autocast, cuda); ``"bf16"`` (autocast on cuda, the weights
            themselves on a CPU).
    """

    def __init__(self, model: str, pretrained: str, device: str, seed: int, threads: int,
                 precision: str = "fp32") -> None:
        import torch

        from tvrpipe.features.clip import load_clip

        if device == "cpu":
            torch.set_num_threads(max(1, threads))
        self.bundle, self.error, self.precision = None, None, precision
        self.max_frames: int | None = None  # after a GPU out-of-memory error: the frames a call is split into
        self.oom_splits = 0  # calls split after an out-of-memory error
        try:
            self.bundle = load_clip(model, pretrained, device=device, seed=seed)
        except TvrpipeError as e:  # an unknown tag or a bad checkpoint: the driver raises it with its own text
            self.error = (type(e).__name__, str(e))
            return
        if precision == "bf16" and device == "cpu":
            # the weights themselves in bf16 (their sha256 was taken in fp32): 3.4-3.9x faster than fp32 on
            # a CPU with AVX-512 BF16, where autocast's per-call casts gave 1.25x at 48 frames
            self.bundle.model.to(torch.bfloat16)

    def _precision(self):
        """The autocast context of :attr:`precision` (fp16/bf16 on a GPU; nothing for fp32, or for bf16 on
        a CPU, whose weights are bf16 already)."""
        import contextlib

        import torch

        if self.bundle.device.type == "cuda" and self.precision in ("fp16", "bf16"):
            dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
            return torch.autocast("cuda", dtype=dtype)
        return contextlib.nullcontext()

    def facts(self) -> dict[str, Any]:
        """:func:`~tvrpipe.features.clip.weights_facts`, or ``{"error": (class name, message)}`` when the
        weights could not be loaded."""
        from tvrpipe.features.clip import weights_facts

        if self.error:
            return {"error": self.error}
        return weights_facts(self.bundle)

    def encode_texts(self, texts: list[str], max_words: int) -> dict[str, np.ndarray]:
        """Word tokens ``(n, L, D)``, token mask and EOS sentence ``(n, D)`` of ``texts``, float16."""
        from tvrpipe.features.clip import encode_text_tokens, tokenize

        t0 = time.perf_counter()
        ids, mask = tokenize(self.bundle, [str(t) for t in texts], max_words)
        with self._precision():
            tokens, sentence = encode_text_tokens(self.bundle, ids, autocast=False)
        return {"tokens": tokens.numpy().astype(np.float16), "token_mask": mask.numpy(),
                "sentence": sentence.numpy().astype(np.float16),
                "weights": np.full(len(texts), self.bundle.weights_sha256, dtype=object),
                "encode_s": time.perf_counter() - t0}

    def fitted_frames(self, frames: int, cap: int = ENCODE_FRAMES_CAP) -> int:
        """Frames per :meth:`encode_videos` call that fit this encoder's GPU (``--encode-frames auto``):
        :func:`fit_frames` of its free memory and a frame's cost, measured by :func:`device_memory`."""
        free, frame_bytes = device_memory(self.bundle.device, self._encode, self.bundle.image_size)
        return fit_frames(free, frame_bytes, frames, cap)

    def _encode(self, frames: np.ndarray) -> np.ndarray:
        """Projected [CLS] embeddings ``(n, D)`` float16 of uint8 frames ``(n, S, S, 3)``, in :attr:`precision`.

        A call the GPU has no memory for (other processes on it, a fragmented allocator, a frame cost above
        the probe's) is split in two halves, each encoded apart, and later calls are split to the size that
        fitted (:attr:`max_frames`): the run goes on, a warning says so, and only a single frame that does
        not fit is an error."""
        import torch

        from tvrpipe.features.clip import encode_frames

        if self.max_frames is not None and len(frames) > self.max_frames:
            return np.concatenate([self._encode(frames[i : i + self.max_frames])
                                   for i in range(0, len(frames), self.max_frames)])
        try:
            with self._precision():
                return encode_frames(self.bundle, frames, autocast=False).numpy().astype(np.float16)
        except torch.cuda.OutOfMemoryError:
            if self.bundle.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(frames) < 2:
                raise ConfigError(f"the GPU ({self.bundle.device}) has no memory left for one frame of "
                                 f"{self.bundle.image_size} px: free it (other processes on it: nvidia-smi), or use "
                                 "--device cpu") from None
            half = (len(frames) + 1) // 2
            self.max_frames, self.oom_splits = half, self.oom_splits + 1
            log.warning("the GPU ran out of memory encoding %d frames: encoding in calls of at most %d from now on "
                        "(set --encode-frames %d to start there)", len(frames), half, half)
            return np.concatenate([self._encode(frames[:half]), self._encode(frames[half:])])

    def encode_videos(self, *videos: dict[str, Any]) -> dict[str, np.ndarray]:
        """The valid frames of decoded videos (:meth:`Decoder.decode`'s results) encoded in one batch:
        ``emb`` ``(B, F, D)`` float16 with the rows, masks, timestamps and errors stacked; a video
        whose features are not finite becomes a failure."""
        t0 = time.perf_counter()
        mask = np.stack([v["mask"] for v in videos])  # (B, F)
        B, F = mask.shape
        out = np.zeros((B, F, self.bundle.embed_dim), np.float16)
        error = np.array([v["error"] for v in videos], dtype=object)
        if mask.any():
            out[mask] = self._encode(np.concatenate([v["frames"][v["mask"]] for v in videos]))  # (n_valid, S, S, 3)
            bad = nonfinite_rows(out)  # e.g. fp16 overflow: never stored as if it were a feature
            if bad.any():
                out[bad] = 0
                mask[bad] = False
                error[bad] = "nonfinite: the encoder returned NaN or infinity for this video's frames"
        return {"row": np.array([v["row"] for v in videos]), "emb": out, "mask": mask,
                "timestamps": np.stack([v["timestamps"] for v in videos]), "error": error,
                "decoded_at": np.array([v.get("decoded_at", np.nan) for v in videos], np.float64),
                "weights": np.full(B, self.bundle.weights_sha256, dtype=object),
                "encode_s": time.perf_counter() - t0}  # the encoder's busy time, for the summary
