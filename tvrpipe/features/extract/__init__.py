"""``tvrpipe extract``: manifest + videos -> CLIP features in the Zarr store, on this machine or on Ray.

The flow (docs/design.md, "Extraction")::

    an executor starts, at once: decoders (CPU, 1 core each) and encoders (GPU with --device cuda, fp16
    autocast; else CPU), each encoder loading the weights once and reporting their facts
      -> the store opens with those facts in its provenance (the driver loads no model)
      -> each decoder: decord, uniform F frames, resize at decode, centre crop, in a killable decode
         subprocess with a per-video timeout and a PyAV fallback
      -> decoded videos go to an encoder in calls fixed by the plan (a shard's rows, in store order)
      -> caption shards go to the same encoders in between (tokens, mask, EOS sentence)
      -> the driver buffers rows per shard and writes each whole shard, then its marker

Where they run (:mod:`~tvrpipe.features.extract.executor`): without ``--address`` (and ``RAY_ADDRESS``) on this
machine without Ray, decoders as child processes of this one and encoders as threads of it, as the tools
researchers already use run by default; with ``--address`` as Ray actors, on a private instance (``local``) or a
cluster (paths must then be visible to every node). One loop drives both, and both write the same bytes.

Decode is the bottleneck (~160 frames/s per core for 720p H.264: docs/design.md, "Extraction"), so decoding
gets the cores and encoding overlaps with it. A bad video is recorded in ``failures.parquet`` with zero
features and an all-False mask; it never stops the run, but a run where more than ``max_failed_fraction`` of the
videos failed exits with an error and leaves the store incomplete (nothing is lost: it stays resumable).

Rerunning the same command resumes: whole shards are skipped, damaged shards (a chunk missing,
truncated or overwritten since it was written) are re-extracted, and the videos recorded as failed
are retried (their shard is rewritten with the rows that succeeded before kept as they were). A
rerun with nothing left to do starts neither a decoder nor a model (the weights' facts are cached,
:mod:`tvrpipe.features.weights`). Options and the manifest are checked before any worker starts, and the
store is locked while written (:mod:`tvrpipe.lock`).

A collection (a folder of one's own videos, :mod:`tvrpipe.features.collection`) is first compared with
its manifest: a file changed or removed since the manifest was built is an error (rebuild the
manifest), so no feature of another file is kept under its name. Its store is updated in place: the
store of an earlier state of the folder is moved aside (:class:`~tvrpipe.features.store.StoreWriter`
with ``update``) and each video whose file is unchanged (same id, path, size and modification time)
is copied from it, bit for bit, rather than decoded and encoded again; only new and changed files
are encoded.

The package, by role:

- :mod:`~tvrpipe.features.extract.driver`: :func:`extract`, top to bottom, and the command lines that make or
  rebuild a store (:func:`extract_command`, :func:`rebuild_command`);
- :mod:`~tvrpipe.features.extract.config`: the settings (:class:`ExtractConfig`), the summary
  (:class:`ExtractSummary`), :class:`ExtractionError` and the small checks;
- :mod:`~tvrpipe.features.extract.plan`: what is pending besides decoding: rows of pending shards, the rows a
  retried shard keeps, the rows an update copies from the store it replaces;
- :mod:`~tvrpipe.features.extract.executor`: the :class:`~tvrpipe.features.extract.executor.Executor` interface,
  the one for this machine, and the choice between it and Ray's;
- :mod:`~tvrpipe.features.extract.actors`: the executor on Ray (actors, the cluster's device check);
- :mod:`~tvrpipe.features.extract.pipeline`: the loop that drives an executor and writes whole shards, and the
  decodes sent while the weights load.
"""

from __future__ import annotations

from tvrpipe.features.extract.config import (
    ExtractConfig,
    ExtractionError,
    ExtractSummary,
    encode_frames_value,
)
from tvrpipe.features.extract.driver import (
    MANIFEST_PLACEHOLDER,
    VIDEOS_PLACEHOLDER,
    extract,
    extract_command,
    rebuild_command,
)

__all__ = ["MANIFEST_PLACEHOLDER", "VIDEOS_PLACEHOLDER", "ExtractConfig", "ExtractSummary", "ExtractionError",
           "encode_frames_value", "extract", "extract_command", "rebuild_command"]
