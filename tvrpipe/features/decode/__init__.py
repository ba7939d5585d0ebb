"""Video decoding: F frames per video, resized at decode time, centre-cropped to S x S.

Decode is the extraction bottleneck (docs/design.md, "Extraction"), so the fast path does as little
as it can: a cheap PyAV probe for the frame size, then one decord ``VideoReader`` opened with
``num_threads=1`` and the target size (FFmpeg scales while decoding), ONE sorted ``get_batch``
per video, and a centre crop by slicing. When decord fails, PyAV decodes the file sequentially
before the video is declared failed. :class:`DecodeWorker` runs all of this in a killable child
process with a per-video wall-clock timeout: decord can spin forever in native code on a file
whose frame count lies (dmlc/decord#373, #375), where no Python-level timeout reaches it.

Sampling (``FRAME_SAMPLING``): split the video's ``n`` frames (or the frames inside the clip's
``[start_s, end_s)``) into ``F`` equal segments and take each segment's centre frame,
``floor((i + 0.5) * n / F)``. This is the test-time "uniform" mode of X-Pool and T-MASS (from
Frozen-in-Time), whose integer arithmetic picks the same frame or the one before; CLIP4Clip's
``linspace(0, n - 1, F)`` instead includes the first and last frames. A video with fewer than
``F`` frames gives all its frames, padded with zero frames and ``mask = False``; frames are never
repeated to fill ``F``. Training (``tvrpipe finetune``) passes ``offsets`` to take a random frame of
each segment instead (the "rand" mode of X-Pool and T-MASS), drawn by the caller from its seed.

Choices where the papers and codebases are silent or differ:

- Resize: the short side goes to ``S`` and the long side to ``int(S * long / short)``, as
  torchvision's ``Resize(S)`` (which CLIP's preprocessing uses); then the torchvision centre crop.
  The interpolation is FFmpeg's (swscale) **bilinear**, not CLIP's bicubic: decord 0.6 builds the
  filter ``scale=W:H`` with no flags, and the default flags of that filter in its bundled FFmpeg
  4.1 are ``bilinear`` (swscale's bilinear widens its kernel when downscaling, so it is
  antialiased, like PIL's). The PyAV fallback asks swscale for bilinear too, so both readers
  agree to within about 1 grey level (they differ in FFmpeg version and conversion order).
- Display rotation (phone videos) is applied by both readers, so frames come out upright; the
  probe decodes the first frame to read the rotation (measured: +0.5 ms at 320x240, +5 ms at
  1280x720, under 1 % of a 12-frame decode). Non-square pixels (sample aspect ratio) are
  ignored, as decord, PIL and CLIP pipelines do.
- Timestamps are seconds on the video stream's own timeline (its first frame at about 0, as
  players show it and as decord reports it), not relative to ``start_s``: a clip's frames keep
  their file time. Both readers use presentation timestamps (``pts - stream.start_time``).
- decord silently returns the previous frame for frames it cannot decode (its "fault tolerance"
  cache); tvrpipe opens it with a near-zero tolerance so that this raises instead, and then
  falls back to PyAV. A retry inside decord is not safe: on a file whose frame count lies, decord
  returned frames one or more positions early about one time in fifty, with no error. decord 0.6
  also fails for a few output widths of at most 144 px (a row-padding bug); those go straight to

Modules, by role: :mod:`.sampling` (which frames, their times, resize and crop, padding to F),
:mod:`.probe` (opening a file with PyAV: stream, rate, rotation, size; :func:`probe_video`),
:mod:`.readers` (decord and PyAV; :func:`decode_video`; :func:`decode_moments`, a file's moments from one open
of it, kept open across calls by an :class:`OpenFile`), :mod:`.worker` (:class:`DecodeWorker`, the decoder
process), :mod:`.thumbnails` (:func:`frames_at`), :mod:`.shots` (:func:`detect_cuts`, shot boundaries with
PySceneDetect), :mod:`.failure` (:class:`DecodeFailure` and the checks made before decoding). Every name other
modules use is re-exported here: import them from
``tvrpipe.features.decode``.
"""

from tvrpipe.features.decode.failure import MAX_TIMEOUT_S, DecodeFailure, check_timeout
from tvrpipe.features.decode.probe import probe_duration, probe_video
from tvrpipe.features.decode.readers import RESIZE_INTERPOLATION, OpenFile, decode_moments, decode_video
from tvrpipe.features.decode.sampling import FRAME_SAMPLING, DecodedVideo, resize_dims, sample_indices
from tvrpipe.features.decode.shots import detect_cuts
from tvrpipe.features.decode.thumbnails import frames_at
from tvrpipe.features.decode.worker import DecodeWorker

__all__ = [
    "FRAME_SAMPLING", "MAX_TIMEOUT_S", "RESIZE_INTERPOLATION",
    "DecodeFailure", "DecodeWorker", "DecodedVideo", "OpenFile",
    "check_timeout", "decode_moments", "decode_video", "detect_cuts", "frames_at", "probe_duration", "probe_video",
    "resize_dims", "sample_indices",
]
