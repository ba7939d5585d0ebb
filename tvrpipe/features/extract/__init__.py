"""``tvrpipe extract``: manifest + videos -> CLIP features in the Zarr store, with Ray.

The flow (docs/design.md, "Extraction")::

    Ray up; at once: decoder actors (CPU, 1 core each) and encoder actors (GPU with --device cuda,
    fp16 autocast; else CPU), each encoder loading the weights once and reporting their facts
      -> the store opens with those facts in its provenance (the driver loads no model)
      -> each decoder: decord, uniform F frames, resize at decode, centre crop, in a killable decode
         subprocess with a per-video timeout and a PyAV fallback
      -> decoded videos go to an encoder in batches (decoder to encoder through Ray's object store)
      -> caption shards go to the same encoders in between (tokens, mask, EOS sentence)
      -> the driver buffers rows per shard and writes each whole shard, then its marker

Decode is the bottleneck (~160 frames/s per core for 720p H.264: docs/design.md, "Extraction"), so decoding
gets the cores and encoding overlaps with it. The actors are plain Ray actors driven by one loop in
this process, not a Ray Data pipeline: Ray Data started an actor pool per stage plus its own
executor, which cost about 4 s before the first video decoded (docs/performance.md). Locally
``ray.init(address="local")`` starts a private instance; ``--address``/``RAY_ADDRESS`` runs the same
code on a cluster (paths must then be visible to every node). A bad video is recorded in
``failures.parquet`` with zero features and an all-False mask; it never stops the run, but a run
where more than ``max_failed_fraction`` of the videos failed exits with an error and leaves the store
incomplete (nothing is lost: it stays resumable).

Rerunning the same command resumes: whole shards are skipped, damaged shards (a chunk missing,
truncated or overwritten since it was written) are re-extracted, and the videos recorded as failed
are retried (their shard is rewritten with the rows that succeeded before kept as they were). A
rerun with nothing left to do starts neither Ray nor a model (the weights' facts are cached,
:mod:`tvrpipe.features.weights`). Options and the manifest are checked before Ray starts, and the
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
- :mod:`~tvrpipe.features.extract.actors`: Ray, the decoders and encoders, the decodes sent early;
- :mod:`~tvrpipe.features.extract.pipeline`: the loop that drives the actors and writes whole shards.
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
