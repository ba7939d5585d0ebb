"""``tvrpipe export``: copy a complete feature store into one HDF5 file for sharing.

The HDF5 file holds the same arrays under the same names (``videos/frames``, ...), the id
tables as string datasets (``ids/video_id``, ``ids/caption_id``, ...) and the provenance as
root attributes. Arrays are copied one Zarr chunk at a time, so memory stays bounded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from tvrpipe.errors import ConfigError, writing
from tvrpipe.features.store import ARRAYS as STORE_ARRAYS
from tvrpipe.features.store import open_store
from tvrpipe.lock import check_writable, nearest_existing

ARRAYS = tuple(f"{kind}/{name}" for kind, names in STORE_ARRAYS.items() for name in names)


def export_hdf5(features_dir: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> Path:
    """Write the store's arrays, ids and provenance into ``out_file`` (written atomically).

    The store is checked as it is opened (:func:`~tvrpipe.features.store.open_store`); a damaged
    store is refused before anything is written.

    Example:
        >>> export_hdf5("features/msrvtt-b32", "msrvtt-b32.h5")  # doctest: +SKIP
    """
    store = open_store(features_dir)
    out = Path(out_file)
    if out.resolve().is_relative_to(store.dir.resolve()):
        raise ConfigError(f"--out {out} is inside the feature store {store.dir}: the export would overwrite or add "
                          "to the store's own files; write it outside the store's directory")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as features.h5")
    check_writable(out.parent, "--out")
    # h5py crashes the process (not an exception) when the disk fills as it closes a file: check the room first
    need = sum(store.array(name).nbytes for name in ARRAYS) * 1.02 + (16 << 20)  # + ids, attributes, headers
    ancestor = nearest_existing(out.parent)
    free = shutil.disk_usage(ancestor).free
    if free < need:
        raise ConfigError(f"--out {out}: the export needs about {need / 1e9:.2f} GB and {ancestor} has "
                          f"{free / 1e9:.2f} GB free; make room or write it elsewhere")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        h5 = h5py.File(tmp, "w")
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e}); choose a writable path") from None
    try:
        with writing(out), h5:
            for name in ARRAYS:
                src = store.array(name)
                dst = h5.create_dataset(name, shape=src.shape, dtype=src.dtype, chunks=src.chunks)
                step = src.chunks[0]
                for a in range(0, src.shape[0], step):
                    dst[a : a + step] = src[a : a + step]
            strings = h5py.string_dtype()
            for table, cols in ((store.videos, ("video_id", "split", "path")),
                                (store.texts, ("caption_id", "video_id", "split"))):
                prefix = "ids/videos" if "path" in cols else "ids/texts"
                for col in cols:
                    h5.create_dataset(f"{prefix}/{col}", data=table[col].astype(str).to_numpy(dtype=object),
                                      dtype=strings)
            h5.create_dataset("ids/texts/video_row", data=store.texts["video_row"].to_numpy(np.int64))
            for k, v in store.provenance.items():
                h5.attrs[k] = json.dumps(v)
            h5.flush()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
