"""The manifest: two Parquet tables that name a dataset's videos and captions.

Contract (docs/design.md, "Manifest"), in ``<data_dir>/manifest/``:

- ``videos.parquet``: ``video_id`` (str, unique), ``path`` (str, relative to the video root),
  ``split`` (train|val|test), ``start_s``, ``end_s`` (float seconds or null; a clip inside a file).
- ``captions.parquet``: ``caption_id`` (str, unique), ``video_id``, ``text``, ``split``.

``meta.json`` beside them records where the manifest came from and the dataset's sampling
defaults (frames, max words), which ``tvrpipe extract`` uses when not told otherwise.

A *collection* (``meta["kind"] == "collection"``, :mod:`tvrpipe.features.collection`) is a folder of the
user's own videos: no captions, and a third table, ``files.parquet`` (``video_id``, ``bytes``,
``mtime_ns``), the fingerprint of each video file when the manifest was built, by which extract
notices a file changed or removed since.

Every table is validated before anything is written, and files are written under temporary
names and renamed, so a failed build leaves nothing half-written behind. A build killed before its
renames (``kill -9``) leaves its staged files; the next build into the same folder removes them.
Annotation files are read through :func:`read_text_file`, the one place that decodes their text.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import shlex
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from tvrpipe.errors import ConfigError, ManifestError
from tvrpipe.files import atomic_write_all, remove_staged
from tvrpipe.lock import check_writable

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
VIDEO_COLUMNS = ("video_id", "path", "split", "start_s", "end_s")
CAPTION_COLUMNS = ("caption_id", "video_id", "text", "split")
FILE_COLUMNS = ("video_id", "bytes", "mtime_ns")
VIDEOS_FILE = "videos.parquet"
CAPTIONS_FILE = "captions.parquet"
FILES_FILE = "files.parquet"
META_FILE = "meta.json"
COLLECTION = "collection"  # meta["kind"] of a manifest made from a folder of videos without captions

_VIDEO_SCHEMA = pa.schema(
    [
        ("video_id", pa.string()),
        ("path", pa.string()),
        ("split", pa.string()),
        ("start_s", pa.float64()),
        ("end_s", pa.float64()),
    ]
)
_CAPTION_SCHEMA = pa.schema(
    [
        ("caption_id", pa.string()),
        ("video_id", pa.string()),
        ("text", pa.string()),
        ("split", pa.string()),
    ]
)
_FILES_SCHEMA = pa.schema([("video_id", pa.string()), ("bytes", pa.int64()), ("mtime_ns", pa.int64())])
# How many offending ids an error message names before it summarises the rest.
_SHOW = 5


@dataclass(frozen=True)
class Manifest:
    """A dataset's videos and captions, validated.

    Attributes:
        videos: one row per video, columns :data:`VIDEO_COLUMNS`.
        captions: one row per caption, columns :data:`CAPTION_COLUMNS`.
        meta: provenance and defaults (dataset, split set, frames, max_words, ...).
        files: a collection's file fingerprints, columns :data:`FILE_COLUMNS`, in the videos' order
            (None for a dataset).
    """

    videos: pd.DataFrame
    captions: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    files: pd.DataFrame | None = None

    @property
    def is_collection(self) -> bool:
        """Whether this is a folder of videos without captions (``tvrpipe manifest build --videos``)."""
        return self.meta.get("kind") == COLLECTION

    def counts(self) -> pd.DataFrame:
        """Videos and captions per split, in train/val/test order (absent splits omitted)."""
        v = self.videos.groupby("split").size()
        c = self.captions.groupby("split").size()
        rows = [
            {"split": s, "videos": int(v.get(s, 0)), "captions": int(c.get(s, 0))}
            for s in SPLITS
            if s in v.index or s in c.index
        ]
        return pd.DataFrame(rows, columns=["split", "videos", "captions"])


def isin_mask(values: pd.Series, pool: pd.Series) -> np.ndarray:
    """Boolean mask of ``values`` found in ``pool`` (hash lookup; pandas' Arrow-string isin is a Python loop)."""
    return pd.Index(pool.unique()).get_indexer(values) >= 0


# The byte order marks a text file may open with, longest first (UTF-32 LE's begins with UTF-16 LE's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32", "UTF-32"), (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
         (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"), (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
         (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"))


def read_text_file(path: str | os.PathLike[str]) -> str:
    """The text of an annotation file (JSON, CSV, TSV, a list of ids), decoded as benchmarks ship them:
    UTF-8, with or without a byte order mark (Excel's "CSV UTF-8"), or UTF-16 / UTF-32 that opens with
    its byte order mark (Windows' "Unicode" text). Line ends are left as they are.

    Anything else is one line naming the file, the line and the byte, and how to convert it: Latin-1
    or Windows-1252 bytes that are not UTF-8, and NUL bytes (UTF-16 without a byte order mark, or not a
    text file at all), which would otherwise parse into ids and captions that hold NULs.

    Raises:
        ManifestError: the file cannot be read, or is not text in one of those encodings.

    Example:
        >>> read_text_file("data/msvd/annotations/test_list.txt").splitlines()[:1]  # doctest: +SKIP
        ['-4wsuPCjDBc_5_15']
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ManifestError(f"{p}: cannot read it ({e.strerror or e})") from None
    codec, name = "utf-8", "UTF-8"
    for bom, bom_codec, bom_name in _BOMS:
        if data.startswith(bom):
            codec, name = bom_codec, bom_name
            break

    def iconv(source: str) -> str:  # converts the file in place
        f, t = shlex.quote(str(p)), shlex.quote(f"{p}.utf8")
        return f"iconv -f {source} -t utf-8 {f} > {t} && mv {t} {f}"

    try:
        text = data.decode(codec)
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        if name != "UTF-8":
            raise ManifestError(f"{p} line {line}: not valid {name} text ({e.reason} at byte offset {e.start}, "
                                f"after a {name} byte order mark); save the file again as UTF-8") from None
        raise ManifestError(
            f"{p} line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte offset {e.start}); convert the "
            f"file to UTF-8, e.g. from Latin-1: `{iconv('latin1')}` (from Windows-1252: -f cp1252)") from None
    nul = text.find("\x00")
    if nul >= 0:
        line = text.count("\n", 0, nul) + 1
        raise ManifestError(
            f"{p} line {line}: a NUL byte: not a text file, or UTF-16 without a byte order mark; convert the file "
            f"to UTF-8, e.g. from UTF-16: `{iconv('utf-16le')}`")
    return text


def _name_some(items: Iterable[Any]) -> str:
    items = list(items)
    shown = ", ".join(repr(x) for x in items[:_SHOW])
    more = f" and {len(items) - _SHOW} more" if len(items) > _SHOW else ""
    return shown + more


def make_tables(
    videos: Iterable[Mapping[str, Any]], captions: Iterable[Mapping[str, Any]]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Build the two manifest tables from row dicts, filling optional columns with null."""
    v = pd.DataFrame(list(videos), columns=list(VIDEO_COLUMNS))
    c = pd.DataFrame(list(captions), columns=list(CAPTION_COLUMNS))
    for col in ("start_s", "end_s"):
        v[col] = pd.to_numeric(v[col], errors="coerce").astype("float64")
    return v, c


def visible(text: str) -> bool:
    """Whether ``text`` holds a character that shows: not only white space and invisible format
    characters (zero-width spaces and joiners, byte order marks, ...: Unicode category Cf)."""
    return any(not (ch.isspace() or unicodedata.category(ch) == "Cf") for ch in text)


def outside_root(path: str) -> bool:
    """Whether a manifest path would leave the video root: absolute, or climbing out with ``..``. A
    manifest made elsewhere must not make extract open arbitrary files of this machine. A Windows
    absolute path (``C:\\videos\\x.mp4``) is refused everywhere; a name with a drive but no root
    (``a:b.mp4``) only on Windows, where it names another drive: on POSIX it is an ordinary file name."""
    p = PurePosixPath(path.replace("\\", "/"))
    win = PureWindowsPath(path)
    if p.is_absolute() or win.is_absolute() or (win.drive and os.name == "nt"):
        return True
    depth = 0
    for part in p.parts:
        depth += -1 if part == ".." else (0 if part == "." else 1)
        if depth < 0:
            return True
    return False


def validate(videos: pd.DataFrame, captions: pd.DataFrame, source: str = "manifest", *,
             collection: bool = False) -> None:
    """Check the manifest contract; raise :class:`ManifestError` naming the offending rows.

    Args:
        videos: the videos table.
        captions: the captions table.
        source: what the tables were built from, named in error messages.
        collection: a collection (``meta["kind"] == "collection"``): its videos need no caption.
    """
    _check_columns(videos, captions, source)
    if videos.empty:
        raise ManifestError(f"{source}: no videos")
    _check_ids(videos, captions, source)
    _check_paths(videos, source)
    _check_clips(videos, source)
    _check_caption_text(captions, source)
    _check_caption_videos(videos, captions, source, collection)


def _check_columns(videos: pd.DataFrame, captions: pd.DataFrame, source: str) -> None:
    """Validation stage, shape: each table has exactly its columns."""
    for name, table, cols in (
        ("videos", videos, VIDEO_COLUMNS),
        ("captions", captions, CAPTION_COLUMNS),
    ):
        missing = [c for c in cols if c not in table.columns]
        if missing:
            raise ManifestError(f"{source}: {name} table lacks column(s) {missing}")
        extra = [c for c in table.columns if c not in cols]
        if extra:
            raise ManifestError(f"{source}: {name} table has unexpected column(s) {extra}")


def _check_ids(videos: pd.DataFrame, captions: pd.DataFrame, source: str) -> None:
    """Validation stage, rows: every video and caption has an id of its own and a known split."""
    for name, table, key in (("video", videos, "video_id"), ("caption", captions, "caption_id")):
        ids = table[key]
        blank = table.index[ids.isna() | (ids.astype(str).str.strip() == "")]
        if len(blank):
            raise ManifestError(f"{source}: empty {key} in {name} row(s) {_name_some(blank)}")
        dup = ids[ids.duplicated()].unique()
        if len(dup):
            raise ManifestError(f"{source}: duplicate {key} {_name_some(dup)}")
        bad_split = table.loc[~isin_mask(table["split"], pd.Series(SPLITS))]
        if len(bad_split):
            first = bad_split.iloc[0]
            raise ManifestError(
                f"{source}: {name} {first[key]!r} has split {first['split']!r}; "
                f"expected one of {', '.join(SPLITS)}"
            )


def _check_paths(videos: pd.DataFrame, source: str) -> None:
    """Validation stage, paths: every video's path is a name a file can have, inside the video root."""
    no_path = videos.loc[videos["path"].isna() | (videos["path"].astype(str).str.strip() == "")]
    if len(no_path):
        raise ManifestError(f"{source}: empty path for video(s) {_name_some(no_path['video_id'])}")
    nul = videos.loc[videos["path"].astype(str).str.contains("\x00", regex=False)]
    if len(nul):  # no file system has such a name; opening it would raise, not fail the one video
        raise ManifestError(f"{source}: a NUL character in the path of video(s) {_name_some(nul['video_id'])}")
    outside = videos.loc[[outside_root(str(p)) for p in videos["path"]]]
    if len(outside):
        first = outside.iloc[0]
        raise ManifestError(
            f"{source}: the path of video(s) {_name_some(outside['video_id'])} leaves the video root "
            f"({first['path']!r}); paths are relative to the video root and stay inside it: write them relative "
            "to one folder that holds every video, and give that folder as the video root (--video-root of "
            "manifest build, extract and finetune)")


def _check_clips(videos: pd.DataFrame, source: str) -> None:
    """Validation stage, clips: a clip's bounds, where given, satisfy 0 <= start_s < end_s."""
    clipped = videos.dropna(subset=["start_s", "end_s"])
    bad_clip = clipped.loc[~(clipped["start_s"] < clipped["end_s"]) | (clipped["start_s"] < 0)]
    if len(bad_clip):
        raise ManifestError(
            f"{source}: video(s) {_name_some(bad_clip['video_id'])} need 0 <= start_s < end_s"
        )


def _check_caption_text(captions: pd.DataFrame, source: str) -> None:
    """Validation stage, caption text: every caption holds a character that shows."""
    missing = captions["text"].isna()
    # a null stays null under astype(str) in pandas 3: it is named as empty, not read as text
    text = captions["text"].where(~missing, "").astype(str)
    wordless = ~text.str.contains(r"\w", regex=True)  # a caption with a letter or digit shows: only the rest is looked at
    invisible = pd.Series(False, index=captions.index)
    invisible[wordless] = ~text[wordless].map(visible).astype(bool)
    empty = captions.loc[missing | invisible]
    if len(empty):
        raise ManifestError(f"{source}: empty text in caption(s) {_name_some(empty['caption_id'])}")


def _check_caption_videos(videos: pd.DataFrame, captions: pd.DataFrame, source: str, collection: bool) -> None:
    """Validation stage, links: each caption names a video of its split, and each video (but a collection's) has a
    caption."""
    split_of = videos.set_index("video_id")["split"]
    unknown = captions.loc[~isin_mask(captions["video_id"], videos["video_id"])]
    if len(unknown):
        raise ManifestError(
            f"{source}: caption(s) {_name_some(unknown['caption_id'])} name unknown video_id "
            f"{_name_some(unknown['video_id'].unique())}"
        )
    mismatch = captions.loc[captions["split"].to_numpy() != split_of.loc[captions["video_id"]].to_numpy()]
    if len(mismatch):
        first = mismatch.iloc[0]
        raise ManifestError(
            f"{source}: caption {first['caption_id']!r} is in split {first['split']!r} but its "
            f"video {first['video_id']!r} is in {split_of[first['video_id']]!r}"
        )
    uncaptioned = videos.loc[~isin_mask(videos["video_id"], captions["video_id"])]
    if len(uncaptioned) and not collection:
        raise ManifestError(f"{source}: video(s) {_name_some(uncaptioned['video_id'])} have no caption")


def validate_files(files: pd.DataFrame | None, videos: pd.DataFrame, source: str = "manifest") -> None:
    """Check a collection's ``files`` table: one fingerprint (:data:`FILE_COLUMNS`, sizes and times as
    integers) for each video and none other; raise :class:`ManifestError` naming what is wrong."""
    if files is None:
        raise ManifestError(f"{source}: a collection without {FILES_FILE} (the fingerprint of each video file); "
                            "build it again with `tvrpipe manifest build --videos FOLDER --out DIR`")
    if list(files.columns) != list(FILE_COLUMNS):
        raise ManifestError(f"{source}: {FILES_FILE} has columns {list(files.columns)}; expected {list(FILE_COLUMNS)}")
    bad = [c for c in ("bytes", "mtime_ns") if not pd.api.types.is_integer_dtype(files[c])]
    if bad:
        raise ManifestError(f"{source}: {FILES_FILE} column(s) {bad} are not integers")
    dup = files["video_id"][files["video_id"].duplicated()].unique()
    if len(dup):
        raise ManifestError(f"{source}: {FILES_FILE} has duplicate video_id {_name_some(dup)}")
    unknown = files["video_id"][~isin_mask(files["video_id"], videos["video_id"])]
    lacking = videos["video_id"][~isin_mask(videos["video_id"], files["video_id"])]
    if len(unknown) or len(lacking):
        what = (f"names unknown video(s) {_name_some(unknown)}" if len(unknown)
                else f"lacks video(s) {_name_some(lacking)}")
        raise ManifestError(f"{source}: {FILES_FILE} {what}; build it again with `tvrpipe manifest build --videos "
                            "FOLDER --out DIR`")


def write_parquet(table: pd.DataFrame, schema: pa.Schema, path: Path) -> None:
    """Write ``table`` with ``schema`` so that the same rows always give the same bytes."""
    arrow = pa.Table.from_pandas(table, schema=schema, preserve_index=False)
    # No pandas metadata and no timestamps: the same rows give the same bytes.
    arrow = arrow.replace_schema_metadata(None)
    pq.write_table(arrow, path, compression="zstd")


def write_manifest(
    out_dir: str | os.PathLike[str],
    videos: pd.DataFrame,
    captions: pd.DataFrame,
    meta: Mapping[str, Any] | None = None,
    source: str = "manifest",
    files: pd.DataFrame | None = None,
) -> Manifest:
    """Validate the tables and write them atomically into ``out_dir``.

    Rows are sorted by split order and id so that the same input always gives the same bytes.

    Args:
        out_dir: directory to write ``videos.parquet``, ``captions.parquet`` and ``meta.json``.
        videos: the videos table (:data:`VIDEO_COLUMNS`).
        captions: the captions table (:data:`CAPTION_COLUMNS`).
        meta: provenance and defaults, stored in ``meta.json``; ``"kind": "collection"`` makes a
            collection (videos without captions, ``files`` required).
        source: what the tables were built from, named in error messages.
        files: a collection's fingerprints (:data:`FILE_COLUMNS`), written as ``files.parquet``. A
            manifest that is not a collection removes a ``files.parquet`` left in ``out_dir``.

    Returns:
        The manifest as written.

    Example:
        >>> v, c = make_tables([{"video_id": "a", "path": "a.mp4", "split": "test"}],
        ...                    [{"caption_id": "a#0", "video_id": "a", "text": "hi", "split": "test"}])
        >>> write_manifest(tmp_path / "manifest", v, c).counts()  # doctest: +SKIP
    """
    collection = dict(meta or {}).get("kind") == COLLECTION
    validate(videos, captions, source, collection=collection)
    if collection:
        validate_files(files, videos, source)
    elif files is not None:
        raise ValueError("a files table belongs to a collection (meta kind 'collection')")
    order = {s: i for i, s in enumerate(SPLITS)}
    videos = (
        videos.assign(_o=videos["split"].map(order))
        .sort_values(["_o", "video_id"], kind="stable")
        .drop(columns="_o")
        .reset_index(drop=True)
    )
    # Captions keep their source order within a video (paraphrase order, sentence ids).
    vrank = pd.Series(range(len(videos)), index=videos["video_id"])
    captions = (
        captions.assign(_o=captions["video_id"].map(vrank))
        .sort_values("_o", kind="stable")
        .drop(columns="_o")
        .reset_index(drop=True)
    )
    if files is not None:  # in the videos' order
        files = files.set_index("video_id").loc[videos["video_id"]].reset_index()[list(FILE_COLUMNS)]
    meta = dict(meta or {})
    meta["counts"] = {
        r.split: {"videos": r.videos, "captions": r.captions}
        for r in Manifest(videos, captions).counts().itertuples()
    }
    writes = [(VIDEOS_FILE, lambda p: write_parquet(videos, _VIDEO_SCHEMA, p)),
              (CAPTIONS_FILE, lambda p: write_parquet(captions, _CAPTION_SCHEMA, p))]
    if files is not None:
        writes.append((FILES_FILE, lambda p: write_parquet(files, _FILES_SCHEMA, p)))
    writes.append((META_FILE, lambda p: p.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # what a build killed before its renames staged here (only the manifest's own names: the folder may be
    # the user's)
    remove_staged(out, (VIDEOS_FILE, CAPTIONS_FILE, FILES_FILE, META_FILE))
    atomic_write_all(out, writes)
    if files is None:  # a collection's fingerprints would describe files this manifest does not list
        (out / FILES_FILE).unlink(missing_ok=True)
    log.info("wrote manifest to %s", out)
    return Manifest(videos, captions, meta, files)


def json_type(value: Any) -> str:
    """What a JSON value is, for messages: ``an object``, ``a list``, ``a number``..."""
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null"}.get(
        type(value), "a number")


def read_meta(path: Path, lenient: tuple[str, ...] = ()) -> dict[str, Any]:
    """A manifest's ``meta.json`` (at ``path``), which must be a JSON object whose keys tvrpipe reads hold values of
    their kind (``lenient``: keys the caller checks itself, e.g. a rebuild's notes that it can probe again).

    Raises:
        ManifestError: it cannot be read, is not text, not valid JSON, or not an object (naming it).
    """
    text = read_text_file(path)
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ManifestError(f"{path}: it holds {json_type(meta)}, not a JSON object")
    for key, (ok, wanted) in _META_KEYS.items():
        if key in meta and key not in lenient and not ok(meta[key]):
            shown = json.dumps(meta[key], default=str)
            raise ManifestError(f"{path}: {key} is {shown if len(shown) <= 80 else shown[:77] + '...'}, not "
                                f"{wanted}; build the manifest again (tvrpipe manifest build), or restore the file")
    return meta


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# what tvrpipe reads of a manifest's meta.json, by key: a damaged value is an error naming it, never shown or used as
# it stands ("twelve frames") nor read as another kind of manifest
_META_KEYS: dict[str, tuple[Any, str]] = {
    "kind": (lambda v: v == COLLECTION, f'"{COLLECTION}" (or no kind: a benchmark\'s manifest)'),
    "frames": (lambda v: v is None or _count(v), "a whole number of frames, at least 1"),
    "max_words": (lambda v: v is None or _count(v), "a whole number of tokens, at least 1"),
    "dataset": (lambda v: isinstance(v, str), "a name"),
    "split_set": (lambda v: v is None or isinstance(v, str), "a name or null"),
    "video_root": (lambda v: v is None or isinstance(v, str), "a folder's path or null"),
    "skipped": (lambda v: isinstance(v, list), "a list"),
    "one_shot": (lambda v: isinstance(v, list), "a list"),
    "missing_videos": (lambda v: isinstance(v, list), "a list"),
}


def read_manifest(manifest_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate a manifest written by :func:`write_manifest`.

    Raises:
        ManifestError: the directory lacks the tables or they break the contract.
    """
    d = Path(manifest_dir)
    vp, cp = d / VIDEOS_FILE, d / CAPTIONS_FILE
    if not vp.is_file() or not cp.is_file():
        raise ManifestError(
            f"{d}: no manifest here (expected {VIDEOS_FILE} and {CAPTIONS_FILE}); "
            "build one with `tvrpipe manifest build` or `tvrpipe synth`"
        )
    try:
        videos = pq.read_table(vp).to_pandas()
        captions = pq.read_table(cp).to_pandas()
    except (pa.ArrowException, OSError) as e:
        raise ManifestError(f"{d}: cannot read manifest tables: {e}") from e
    meta = read_meta(d / META_FILE) if (d / META_FILE).is_file() else {}
    collection = meta.get("kind") == COLLECTION
    validate(videos, captions, str(d), collection=collection)
    files = None
    if collection:
        fp = d / FILES_FILE
        if fp.is_file():
            try:
                files = pq.read_table(fp).to_pandas()
            except (pa.ArrowException, OSError) as e:
                raise ManifestError(f"{d}: cannot read {FILES_FILE}: {e}") from e
        validate_files(files, videos, str(d))
    return Manifest(videos, captions, meta, files)


VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".flv", ".mpg", ".mpeg", ".3gp",
                              ".wmv"})


def index_video_files(video_root: str | os.PathLike[str]) -> dict[str, str]:
    """Map each file stem under ``video_root`` (recursively) to its relative path.

    Extensions are ignored, so ``x.mp4`` and ``x.mov`` both answer to ``x``; a doubled video
    extension too (``x.m4v.mp4``, as DiDeMo's AWS download script saves ``x.m4v``), which also
    answers to ``x.m4v``. Where a stem has several files the lexicographically first relative
    path wins (deterministic).
    """
    root = Path(video_root)
    found: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.name.startswith("."):
            stem, rel = (p.stem if p.suffix else p.name), p.relative_to(root).as_posix()
            found.setdefault(stem, rel)
            inner = Path(stem)
            if inner.suffix.lower() in VIDEO_EXTENSIONS:
                found.setdefault(inner.stem, rel)
    return found


MISSING_ADVICE = "fix --video-root or pass --allow-missing to drop them"  # `tvrpipe manifest build`'s options


def _emptied_splits(videos: pd.DataFrame, missing: list[str]) -> list[str]:
    """The splits (or "the manifest", without splits) that would hold no video once ``missing`` are dropped."""
    kept = ~isin_mask(videos["video_id"], pd.Series(missing, dtype=object))
    if not kept.any():
        return ["the manifest"]
    if "split" not in videos.columns:
        return []
    return [f"the {s} split" for s in dict.fromkeys(videos["split"]) if not kept[(videos["split"] == s).to_numpy()].any()]


def resolve_paths(
    videos: pd.DataFrame, video_root: str | os.PathLike[str], allow_missing: bool = False,
    advice: str = MISSING_ADVICE,
) -> tuple[pd.DataFrame, list[str]]:
    """Point each video's ``path`` at an existing file under ``video_root``.

    A path that exists is kept; otherwise the file is looked up by the path's stem
    (extension-insensitive, in any subfolder), so DiDeMo's ``.mov``/``.mp4``/``.m4v`` variants
    and LSMDC's per-movie folders resolve without a dataset-specific rule.

    Args:
        videos: the videos table.
        video_root: the folder the paths are relative to.
        allow_missing: drop missing videos instead of failing.
        advice: what the error about missing videos tells the user to do, in the options of the command
            they ran (the default names ``tvrpipe manifest build``'s).

    Returns:
        The table with resolved paths (missing videos dropped when ``allow_missing``) and the
        ids of the missing videos.

    Raises:
        ManifestError: videos are missing and ``allow_missing`` is false.
    """
    root = Path(video_root)
    if not root.is_dir():
        raise ManifestError(f"--video-root {root}: not a directory")
    index: dict[str, str] | None = None
    paths, missing = [], []
    for vid, path in zip(videos["video_id"], videos["path"]):
        if (root / path).is_file():
            paths.append(path)
            continue
        if index is None:
            index = index_video_files(root)
        stem = Path(path).stem if Path(path).suffix else Path(path).name
        hit = index.get(stem) or index.get(vid)
        paths.append(hit)
        if hit is None:
            missing.append(vid)
    out = videos.assign(path=paths)
    if missing and not allow_missing:
        emptied = _emptied_splits(out, missing)
        if emptied:  # dropping the missing videos would leave nothing to build from: advise only what can work
            advice = (f"with them dropped, {' and '.join(emptied)} would hold no video, so check that --video-root "
                      f"is the folder that holds this dataset's video files (looked for by name, e.g. "
                      f"{out['video_id'].iloc[0]} as {Path(str(videos['path'].iloc[0])).name}, in any subfolder)")
        raise ManifestError(
            f"{len(missing)} of {len(videos)} videos not found under {root}: "
            f"{_name_some(missing)}; {advice}"
        )
    if missing:
        log.warning("dropping %d videos not found under %s: %s", len(missing), root, _name_some(missing))
        out = out.loc[~isin_mask(out["video_id"], pd.Series(missing, dtype=object))].reset_index(drop=True)
    return out, missing


def open_manifest(manifest_dir, video_root, out_dir, frames: int | None, max_words: int | None):
    """What ``extract`` and ``finetune`` start from, checked before anything is written, Ray starts or
    weights load: the manifest, the video root, a writable ``out_dir``, and F and L (the manifest's
    defaults unless given).

    Returns:
        ``(manifest, video_root, F, L)``.
    """
    manifest = read_manifest(manifest_dir)
    root = Path(video_root)
    if not root.is_dir():
        raise ConfigError(f"--video-root {root}: not a directory")
    check_writable(out_dir, "--out")
    F = frames if frames is not None else int(manifest.meta.get("frames", 12))
    L = max_words if max_words is not None else int(manifest.meta.get("max_words", 32))
    return manifest, root, F, L


def check_max_words(L: int, context_length: int) -> None:
    """Refuse ``--max-words`` (L) beyond the text tower's context length."""
    if L > context_length:
        raise ConfigError(f"--max-words {L} exceeds the model's context length {context_length}")
