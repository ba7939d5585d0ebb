"""The feature store: a Zarr v3 group of CLIP features, the contract between extraction and heads.

Layout (docs/design.md, "Feature store"), in ``<features_dir>/``::

    features.zarr/            Zarr v3 group, uncompressed float16 (fp16 embeddings barely compress)
      videos/frames           float16 [n_videos, F, D]   projected frame [CLS] embeddings
      videos/frame_mask       bool    [n_videos, F]      False where a short video was padded
      videos/timestamps       float32 [n_videos, F]      seconds of each sampled frame (NaN: padding)
      texts/tokens            float16 [n_texts, L, D]    ln_final(x) @ text_projection, every token
      texts/token_mask        bool    [n_texts, L]
      texts/sentence          float16 [n_texts, D]       EOS token = open_clip encode_text
      attrs                   provenance (see :func:`make_provenance`) and ``complete``
    videos.parquet            row -> video_id, split, path, start_s, end_s (the clip's bounds; null: the
                              whole file), and for a collection bytes, mtime_ns (the file's fingerprint)
    texts.parquet             row -> caption_id, video_id, video_row, split (no rows for a collection)
    failures.parquet          video_id, stage, error (bad videos: zero features, mask all False)
    _progress/{videos,texts}/NNNNNN.json   completion marker of each shard (atomic rename)
    .tvrpipe.lock             held by the one process writing the store (:mod:`tvrpipe.lock`)
    .previous/                while a collection's store is updated: the store it replaces (below)

Rows follow the manifest's order, so the same ids always land in the same rows. Every row has
F frames (padded + mask), so rows are fixed-size and a writer owns whole shards (row ranges that
are exactly one Zarr chunk): writers never share a chunk. Rerunning an extraction skips completed
shards; a store made with other provenance is refused.

Updating a collection. A collection's folder gains, loses and changes files; its manifest, and so
the store's ``manifest_sha256``, change with it. A writer opened with ``update=True`` on a collection
store whose identity differs only in ``manifest_sha256`` moves that store's files into
``.previous/`` (through a staging folder renamed into place, so an interrupted move is finished by
the next writer) and creates the new store; the extraction copies from ``.previous`` the rows whose
file fingerprint (video_id, path, bytes, mtime_ns) is unchanged and that lie in a whole shard (CRC-32
checked) and did not fail, and encodes the rest. ``.previous`` is deleted once the new store is
complete. If an update is interrupted, the next one keeps ``.previous`` as its source: it resumes
the partial store when it was made from the same manifest, and otherwise deletes it.

Integrity. A shard's marker is written after its chunks and records, for every array of its kind,
the chunk's key, size in bytes and CRC-32 (read back from disk), plus the shard's failures. Every
chunk is written, even one that holds only fill values, so a missing chunk file is always damage.
:func:`open_store` checks that every shard has a marker and every chunk its recorded size (one
``stat`` per chunk: cheap, always); :func:`verify_store` (``tvrpipe features verify``) also
checks every CRC-32 and scans the embeddings for non-finite rows. A writer treats a damaged shard
like one never written, so rerunning the extraction re-extracts exactly the damaged shards.

Modules, by role: :mod:`.layout` (the names on disk, shards, chunk checks against markers),
:mod:`.provenance` (identity keys, the manifest's hash, the maker's command), :mod:`.update` (the store a
collection's update replaces), :mod:`.writer` (:class:`StoreWriter`), :mod:`.reader` (:func:`open_store`,
:class:`FeatureStore`), :mod:`.verify` (:func:`verify_store`), :mod:`.locate` (finding stores). Every name
other modules use is re-exported here: import them from ``tvrpipe.features.store``.
"""

from tvrpipe.features.arrays import nonfinite_rows
from tvrpipe.features.store.layout import (
    ARRAYS,
    EMBEDDINGS,
    KINDS,
    NOT_WRITTEN,
    PREVIOUS,
    PREVIOUS_STAGING,
    PROGRESS,
    SIDECARS,
    STORE_NAME,
    Damage,
    Layout,
    Shard,
    StoreError,
    open_group,
    table_problem,
    update_interrupted,
)
from tvrpipe.features.store.locate import (
    FEATURES_ROOT_ENV,
    check_not_a_store,
    default_features_dir,
    default_store,
    find_stores,
    store_attributes,
)
from tvrpipe.features.store.provenance import (
    IDENTITY_KEYS,
    SCHEMA_VERSION,
    differs,
    make_provenance,
    maker_command,
    manifest_sha256,
    provenance_mismatch,
    run_again,
    store_identity,
    written_state,
)
from tvrpipe.features.store.reader import FeatureStore, open_checked, open_store, read_sidecars, store_group
from tvrpipe.features.store.update import FINGERPRINT, PreviousStore
from tvrpipe.features.store.verify import VerifyReport, verify_store
from tvrpipe.features.store.writer import StoreWriter

__all__ = [
    "ARRAYS", "EMBEDDINGS", "FEATURES_ROOT_ENV", "FINGERPRINT", "IDENTITY_KEYS", "KINDS", "NOT_WRITTEN",
    "PREVIOUS", "PREVIOUS_STAGING", "PROGRESS", "SCHEMA_VERSION", "SIDECARS", "STORE_NAME",
    "Damage", "FeatureStore", "Layout", "PreviousStore", "Shard", "StoreError", "StoreWriter", "VerifyReport",
    "check_not_a_store", "default_features_dir", "default_store", "differs", "find_stores", "make_provenance",
    "maker_command", "manifest_sha256", "nonfinite_rows", "open_checked", "open_group", "open_store",
    "provenance_mismatch", "read_sidecars", "run_again", "store_attributes", "store_group", "store_identity",
    "table_problem", "update_interrupted", "verify_store", "written_state",
]
