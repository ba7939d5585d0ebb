"""What an extraction is asked (:class:`ExtractConfig`), what it did (:class:`ExtractSummary`), the error of a
run where too many videos failed (:class:`ExtractionError`), and the small checks of encoder results and of a
resumed store's precision."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from tvrpipe.config import above, at_least, check_fields, one_of, within
from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.features.failures import over_failure_limit

# videos per encoder call where neither --batch-size nor --encode-frames N says (on a CPU, and on a GPU until its
# memory is measured): --batch-size's default before --encode-frames (fp32 CPU throughput is flat from 12 to 192
# images, docs/performance.md), so CPU stores are computed in the same calls as before
DEFAULT_VIDEOS_PER_CALL = 16

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
    # videos per encoder call (x frames = images per forward); None: sized by encode_frames
    batch_size: int | None = at_least(1, None, option="--batch-size")
    # frames per encoder call (videos per call: N // F, at least one), or auto: on cuda what fits the GPU's free
    # memory (measured by each encoder, at most 3,072; workers.fit_frames), on cpu DEFAULT_VIDEOS_PER_CALL videos
    encode_frames: int | str = "auto"
    device: str = one_of(("cpu", "cuda"), "cpu", option="--device")
    # auto: fp16 autocast on cuda, fp32 on cpu; bf16: weights in bf16 on cpu (3.4-3.9x faster with
    # AVX-512 BF16, cosine >= 0.9999 to fp32, docs/performance.md), autocast on cuda
    precision: str = one_of(("auto", "fp32", "bf16", "fp16"), "auto", option="--precision")
    # a Ray cluster ("auto", host:port; "local": a private Ray instance here); None: RAY_ADDRESS, else no Ray
    address: str | None = None
    # decoders; default: one per CPU (of this machine, or of the Ray cluster)
    decoders: int | None = at_least(1, None, option="--decoders")
    encoders: int = at_least(1, 1, option="--encoders")  # encoders (one GPU each with --device cuda)
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
        auto = self.encode_frames == "auto"
        if not auto and (isinstance(self.encode_frames, bool) or not isinstance(self.encode_frames, int)
                         or self.encode_frames < 1):
            raise ConfigError(f"--encode-frames must be auto or a number of frames >= 1, got {self.encode_frames!r}")
        if not auto and self.batch_size is not None:
            raise ConfigError(f"--batch-size {self.batch_size} (videos per encoder call) and --encode-frames "
                              f"{self.encode_frames} (frames per call) both size the encoder's calls: give one")
        if self.precision == "fp16" and self.device == "cpu":
            raise ConfigError("--precision fp16 needs --device cuda; on a CPU use bf16 (fast where the CPU has "
                              "AVX-512 BF16 or AMX) or fp32")

    @property
    def fits_device(self) -> bool:
        """Whether the encoder calls are sized by the GPU's free memory (``--encode-frames auto`` on cuda, no
        ``--batch-size``): the encoders measure it once they hold the weights."""
        return self.batch_size is None and self.encode_frames == "auto" and self.device == "cuda"

    def videos_per_call(self, frames: int, fitted: int | None = None) -> int:
        """Decoded videos of ``frames`` frames each per encoder call: ``batch_size``, else ``encode_frames`` //
        ``frames`` (at least one), else, with :attr:`fits_device`, ``fitted`` (the frames that fit the GPU) //
        ``frames``, else :data:`DEFAULT_VIDEOS_PER_CALL` (a CPU, or a GPU whose memory is not measured yet).

        Example:
            >>> ExtractConfig(encode_frames=512).videos_per_call(12)
            42
        """
        if self.batch_size is not None:
            return self.batch_size
        if self.encode_frames != "auto":
            return max(1, self.encode_frames // frames)
        if self.fits_device and fitted is not None:
            return max(1, fitted // frames)
        return DEFAULT_VIDEOS_PER_CALL

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
    # when each step of the start ended, in seconds from the call: "checks" (options, manifest), "workers" (the
    # decoders and encoders started: with Ray, once Ray is up), "weights" (an encoder has loaded them),
    # "first_decode" (the first video's frames decoded), "first_batch" (the first videos encoded)
    phases: dict[str, float] = field(default_factory=dict)
    executor: str = ""  # where the decoders and encoders ran: "local" (this machine, no Ray) or "ray"; "": none ran
    encoders: int = 0  # the encoders that ran
    encode_seconds: float = 0.0  # the encoders' time inside their calls, summed over encoders
    first_videos: int = 0  # how many videos the first encoded batch held
    videos_per_call: int = 0  # decoded videos per encoder call (0: no video encoded)
    fitted_frames: int = 0  # --encode-frames auto on cuda: the frames per call that fit the GPU (0: not measured)

    @property
    def encoder_busy(self) -> float:
        """The share of the time from the weights' load to the end that the encoders spent encoding (NaN where no
        encoder ran): near 1, the encoder is the bottleneck; well below, the decoders are."""
        span = self.encoders * (self.seconds - self.phases.get("weights", 0.0))
        return self.encode_seconds / span if self.encoders and span > 0 else float("nan")

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
        if "workers" in self.phases:
            names = {"checks": "checks", "workers": "Ray up, workers started" if self.executor == "ray" else
                     "workers started", "weights": "weights loaded", "first_decode": "first video decoded",
                     "first_batch": "first videos encoded"}
            where = {"ray": "Ray", "local": "this machine, without Ray"}.get(self.executor, self.executor)
            out.append(f"start-up ({where}), seconds from the start: " + ", ".join(
                f"{names[k]} {v:.1f}" for k, v in sorted(self.phases.items(), key=lambda kv: kv[1])))
        if self.encoders and self.encode_seconds:
            out.append(f"encoders busy {self.encoder_busy:.0%} of the time after the weights loaded "
                       f"({self.encode_seconds:.1f} s encoding in {self.encoders} encoder{'s' if self.encoders > 1 else ''})")
        if self.fitted_frames:
            out.append(f"encoder calls: up to {self.videos_per_call} videos ({self.fitted_frames} frames fit the "
                       "GPU's free memory, --encode-frames auto)")
        if self.failure_kinds:
            kinds = ", ".join(f"{k}: {n}" for k, n in Counter(self.failure_kinds).most_common(5))
            out.append(f"failures by kind: {kinds} (see {self.out / 'failures.parquet'})")
        return out


def encode_frames_value(text: str) -> int | str:
    """``--encode-frames``' text as :class:`ExtractConfig` takes it: ``auto``, or a number of frames (checked
    there)."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--encode-frames must be auto or a number of frames >= 1, got {text!r}") from None


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


def too_many_failures(failures: pd.DataFrame, videos: pd.DataFrame, root: Path, out: Path,
                      cfg: ExtractConfig) -> str | None:
    """The error message of a run where more than ``cfg.max_failed_fraction`` of the videos failed (with a hint
    for the most common kind and the fraction that would accept them), or None."""
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


def check_weights(batch: dict[str, np.ndarray], provenance: dict, tower: str) -> None:
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


def check_precision(writer, cfg: ExtractConfig) -> None:
    """A store's rows are all computed in one precision: resuming one made in another is refused (a store
    made before the precision was recorded records none, and takes any)."""
    have = writer.recorded("precision")
    if have is not None and have != cfg.encode_precision:
        raise ConfigError(
            f"--precision {cfg.precision}: the store in {writer.dir} was extracted in {have}, and its rows are "
            f"all computed in one precision; rerun with --precision {have}, or pass --overwrite to extract it "
            f"again in {cfg.encode_precision}"
        )

