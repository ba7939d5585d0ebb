"""Dataset specs (``manifests/*.yaml``) and the readers that turn annotation files into manifests.

A spec is data: which annotation files make each split of each split set, how captions are
chosen (every caption, one per video, a paragraph per video), and the dataset's default
sampling (frames, max words). A reader knows one annotation *format*; a new dataset whose
files use a known format is one YAML file, and a new format is one ``@register_reader``
function. See docs/datasets.md for the formats and the counts each standard split gives.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from tvrpipe.config import load_yaml
from tvrpipe.data.manifest import (
    MISSING_ADVICE,
    SPLITS,
    Manifest,
    isin_mask,
    make_tables,
    read_text_file,
    resolve_paths,
    visible,
    write_manifest,
)
from tvrpipe.errors import ConfigError, ManifestError
from tvrpipe.files import shipped_folder

log = logging.getLogger(__name__)

Rows = tuple[list[dict[str, Any]], list[dict[str, Any]]]
Reader = Callable[["ReadContext", dict[str, Any]], Rows]
_READERS: dict[str, Reader] = {}


def register_reader(name: str) -> Callable[[Reader], Reader]:
    """Register an annotation-format reader under ``name`` (used by specs' ``reader:`` key)."""

    def deco(fn: Reader) -> Reader:
        if name in _READERS:
            raise ValueError(f"reader {name!r} registered twice")
        _READERS[name] = fn
        return fn

    return deco


# --------------------------------------------------------------------------------------- specs


def specs_dir() -> Path:
    """Directory holding the dataset YAML specs (``manifests/`` at the repository root)."""
    return shipped_folder("_specs", "manifests")


def list_datasets() -> list[str]:
    """Names of the datasets that have a spec."""
    return sorted(p.stem for p in specs_dir().glob("*.yaml"))


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset's YAML spec, parsed.

    Attributes:
        name: dataset name (file stem of the spec).
        frames: default number of frames sampled per video.
        max_words: default maximum number of text tokens.
        path_template: how a video id maps to a path under the video root.
        default_split_set: split set used when none is asked for.
        split_sets: split-set name -> list of reader jobs (dicts with ``reader`` and its args).
        raw: the whole YAML document.
    """

    name: str
    frames: int
    max_words: int
    path_template: str
    default_split_set: str | None
    split_sets: dict[str, list[dict[str, Any]]]
    raw: dict[str, Any]


def load_spec(name: str) -> DatasetSpec:
    """Load ``manifests/<name>.yaml``.

    Raises:
        ConfigError: unknown dataset or malformed spec.
    """
    path = specs_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown dataset {name!r}; known: {', '.join(list_datasets())}")
    try:
        raw = load_yaml(path.read_text(), path)  # a key given twice is refused, not last-wins
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    try:
        split_sets = raw.get("split_sets") or {}
        for set_name, jobs in split_sets.items():
            for job in jobs:
                if job.get("reader") not in _READERS:
                    raise ConfigError(
                        f"{path}: split set {set_name!r} uses unknown reader {job.get('reader')!r}; "
                        f"known: {', '.join(sorted(_READERS))}"
                    )
                if "split" in job and job["split"] not in SPLITS:
                    raise ConfigError(f"{path}: split set {set_name!r} has split {job['split']!r}")
        return DatasetSpec(
            name=name,
            frames=int(raw["frames"]),
            max_words=int(raw["max_words"]),
            path_template=raw.get("path_template", "{video_id}.mp4"),
            default_split_set=raw.get("default_split_set"),
            split_sets=split_sets,
            raw=raw,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: malformed spec ({e!r})") from e


# ------------------------------------------------------------------------------ reader helpers


@dataclass(frozen=True)
class ReadContext:
    """What a reader gets besides its job's arguments."""

    dataset: str
    split_set: str
    annotations: Path  # the dataset's annotation directory
    split: str | None  # the split this job fills, or None when the file carries splits
    path_template: str
    used_files: list[Path]  # readers append every file they read (for provenance)

    def file(self, name: str) -> Path:
        """The annotation file ``name``, which must exist."""
        p = self.annotations / name
        if not p.is_file():
            raise ManifestError(
                f"{self.dataset}: annotation file not found: {p} (split set {self.split_set!r} "
                "needs it; see docs/datasets.md for where to get it)"
            )
        if p not in self.used_files:
            self.used_files.append(p)
        return p

    def video(self, video_id: str, split: str | None = None, **fields: Any) -> dict[str, Any]:
        """A videos-table row; ``path`` comes from the template unless given."""
        path = fields.pop("path", None) or self.path_template.format(video_id=video_id, **fields)
        return {"video_id": video_id, "path": path, "split": split or self.split,
                "start_s": fields.get("start_s"), "end_s": fields.get("end_s")}

    def caption(self, video_id: str, k: int, text: str, split: str | None = None) -> dict[str, Any]:
        """A captions-table row with the id ``<video_id>#<k>``."""
        return {"caption_id": f"{video_id}#{k}", "video_id": video_id, "text": text,
                "split": split or self.split}


def _text(value: Any) -> str:
    return " ".join(str(value).split()) if value is not None else ""


def _read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Non-blank lines of a text file with their 1-based line numbers."""
    for i, line in enumerate(io.StringIO(read_text_file(path), newline=None), 1):
        if line.strip():
            yield i, line.rstrip("\n")


def _read_id_list(path: Path) -> list[str]:
    """Video ids from a one-per-line list (an optional ``video_id`` header is skipped)."""
    ids = []
    for i, line in _read_lines(path):
        item = line.strip()
        if i == 1 and item == "video_id":
            continue
        if "," in item or "\t" in item or " " in item:
            raise ManifestError(f"{path} line {i}: expected one video id, got {item!r}")
        ids.append(item)
    if not ids:
        raise ManifestError(f"{path}: no video ids")
    dup = pd.Series(ids)[pd.Series(ids).duplicated()].tolist()
    if dup:
        raise ManifestError(f"{path}: duplicate video id(s) {dup[:5]}")
    return ids


def _read_dict_csv(path: Path, required: list[str]) -> list[tuple[int, dict[str, str]]]:
    reader = csv.DictReader(io.StringIO(read_text_file(path), newline=""))
    try:
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise ManifestError(f"{path}: missing column(s) {missing} (header: {reader.fieldnames})")
        rows = []
        for row in reader:
            if None in row or any(row.get(c) is None for c in required):
                raise ManifestError(f"{path} line {reader.line_num}: wrong number of fields")
            rows.append((reader.line_num, row))
    except csv.Error as e:
        raise ManifestError(f"{path} line {reader.line_num}: cannot read CSV ({e})") from None
    return rows


def _load_json(path: Path) -> Any:
    try:
        return json.loads(read_text_file(path))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from e


def _select(captions: list[str], mode: str, where: str) -> list[str]:
    if mode == "all":
        return captions
    if mode == "first":
        return captions[:1]
    raise ConfigError(f"{where}: caption_mode {mode!r} is not one of: all, first")


def _need_split(ctx: ReadContext, reader: str) -> str:
    if ctx.split is None:
        raise ConfigError(f"{ctx.dataset}: reader {reader!r} needs a 'split' in split set {ctx.split_set!r}")
    return ctx.split


def _emit(ctx: ReadContext, vid: str, texts: list[str], where: str, **video_fields: Any) -> Rows:
    """Rows for one video with its captions; an empty caption is an error naming ``where``."""
    for t in texts:
        if not t:
            raise ManifestError(f"{where}: empty caption for video {vid!r}")
    return [ctx.video(vid, **video_fields)], [ctx.caption(vid, k, t) for k, t in enumerate(texts)]


def _collect(parts: list[Rows]) -> Rows:
    videos, captions = [], []
    for v, c in parts:
        videos += v
        captions += c
    return videos, captions


# ------------------------------------------------------------------------------------ readers


@register_reader("msrvtt_json")
def read_msrvtt_json(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """Videos from a ``video_id`` CSV list; captions from ``MSRVTT_data.json`` ``sentences``."""
    _need_split(ctx, "msrvtt_json")
    list_path, json_path = ctx.file(args["videos"]), ctx.file(args["captions"])
    ids = _read_id_list(list_path)
    data = _load_json(json_path)
    if not isinstance(data, dict) or not isinstance(data.get("sentences"), list):
        raise ManifestError(f"{json_path}: expected an object with a 'sentences' list")
    wanted = set(ids)
    by_video: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for i, s in enumerate(data["sentences"]):
        if not isinstance(s, dict) or "video_id" not in s or "caption" not in s:
            raise ManifestError(f"{json_path}: sentences[{i}] lacks 'video_id' or 'caption'")
        if s["video_id"] in wanted:
            text = _text(s["caption"])
            if not text:
                raise ManifestError(f"{json_path}: sentences[{i}] has an empty caption")
            by_video[s["video_id"]].append((int(s.get("sen_id", i)), i, text))
    lacking = [v for v in ids if v not in by_video]
    if lacking:
        raise ManifestError(
            f"{json_path}: no sentences for {len(lacking)} video(s) listed in {list_path.name}, "
            f"e.g. {lacking[:5]}"
        )
    mode = args.get("caption_mode", "all")
    return _collect(
        [_emit(ctx, v, _select([t for _, _, t in sorted(by_video[v])], mode, str(json_path)), str(json_path))
         for v in ids]
    )


@register_reader("msrvtt_jsfusion")
def read_msrvtt_jsfusion(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """The 1k-A test list: one (video_id, sentence) pair per row."""
    _need_split(ctx, "msrvtt_jsfusion")
    path = ctx.file(args["file"])
    parts, seen = [], set()
    for line, row in _read_dict_csv(path, ["video_id", "sentence"]):
        vid, text = row["video_id"].strip(), _text(row["sentence"])
        if not vid:
            raise ManifestError(f"{path} line {line}: empty video_id")
        if vid in seen:
            raise ManifestError(f"{path} line {line}: duplicate video_id {vid!r}")
        seen.add(vid)
        parts.append(_emit(ctx, vid, [text], f"{path} line {line}"))
    return _collect(parts)


@register_reader("id_list_captions_json")
def read_id_list_captions_json(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """Videos from a text list; captions from a JSON object ``{video_id: [captions]}`` (MSVD)."""
    _need_split(ctx, "id_list_captions_json")
    list_path, json_path = ctx.file(args["videos"]), ctx.file(args["captions"])
    ids = _read_id_list(list_path)
    data = _load_json(json_path)
    if not isinstance(data, dict):
        raise ManifestError(f"{json_path}: expected an object mapping video ids to caption lists")
    lacking = [v for v in ids if not isinstance(data.get(v), list) or not data[v]]
    if lacking:
        raise ManifestError(
            f"{json_path}: no captions for {len(lacking)} video(s) listed in {list_path.name}, "
            f"e.g. {lacking[:5]}"
        )
    mode = args.get("caption_mode", "all")
    return _collect(
        [_emit(ctx, v, _select([_text(t) for t in data[v]], mode, str(json_path)), f"{json_path} [{v!r}]")
         for v in ids]
    )


@register_reader("vatex_json")
def read_vatex_json(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """Videos from an HGR split list; English captions (``enCap``) from VATEX JSON files."""
    _need_split(ctx, "vatex_json")
    list_path = ctx.file(args["videos"])
    ids = _read_id_list(list_path)
    caps: dict[str, tuple[Path, int, list[str]]] = {}
    for name in args["captions"]:
        json_path = ctx.file(name)
        data = _load_json(json_path)
        if not isinstance(data, list):
            raise ManifestError(f"{json_path}: expected a JSON list of {{videoID, enCap}} objects")
        for i, item in enumerate(data):
            if not isinstance(item, dict) or "videoID" not in item or not isinstance(item.get("enCap"), list):
                raise ManifestError(f"{json_path}: item {i} lacks 'videoID' or an 'enCap' list")
            caps[item["videoID"]] = (json_path, i, [_text(t) for t in item["enCap"]])
    lacking = [v for v in ids if v not in caps]
    if lacking:
        raise ManifestError(
            f"{list_path}: {len(lacking)} video(s) have no captions in {args['captions']}, e.g. {lacking[:5]}"
        )
    mode = args.get("caption_mode", "all")
    return _collect(
        [_emit(ctx, v, _select(caps[v][2], mode, str(caps[v][0])), f"{caps[v][0]} item {caps[v][1]}")
         for v in ids]
    )


def _stem(name: str) -> str:
    """File name without its extension (``a.b.mov`` -> ``a.b``, ``x.`` -> ``x``)."""
    root, _ = os.path.splitext(name)
    return root


@register_reader("didemo_moments")
def read_didemo_moments(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """LocalizingMoments ``*_data.json``: moments grouped per video into one paragraph.

    Videos are keyed by file name without extension (the same video is listed as .mp4, .mov
    and .m4v); descriptions are joined in time order: by the annotators' mean start chunk,
    then mean end chunk, then annotation id (choice: the papers say "in time order" only).
    """
    _need_split(ctx, "didemo_moments")
    path = ctx.file(args["file"])
    data = _load_json(path)
    if not isinstance(data, list):
        raise ManifestError(f"{path}: expected a JSON list of moments")
    moments: dict[str, list[tuple[float, float, int, str]]] = defaultdict(list)
    names: dict[str, str] = {}
    for i, m in enumerate(data):
        if not isinstance(m, dict) or not {"video", "description", "times"} <= m.keys():
            raise ManifestError(f"{path}: moment {i} lacks 'video', 'description' or 'times'")
        text = _text(m["description"])
        if not text:
            raise ManifestError(f"{path}: moment {i} (video {m['video']!r}) has an empty description")
        times = m["times"]
        if not times or not all(isinstance(t, list) and len(t) == 2 for t in times):
            raise ManifestError(f"{path}: moment {i} has malformed 'times' {times!r}")
        vid = _stem(m["video"])
        names[vid] = min(names.get(vid, m["video"]), m["video"])
        start = sum(t[0] for t in times) / len(times)
        end = sum(t[1] for t in times) / len(times)
        moments[vid].append((start, end, int(m.get("annotation_id", i)), text))
    mode = args.get("caption_mode", "paragraph")
    parts = []
    for vid in sorted(moments):
        texts = [t for *_, t in sorted(moments[vid])]
        if mode == "paragraph":
            texts = [" ".join(texts)]
        elif mode != "all":
            raise ConfigError(f"{path}: caption_mode {mode!r} is not one of: paragraph, all")
        parts.append(_emit(ctx, vid, texts, str(path), path=names[vid]))
    return _collect(parts)


@register_reader("lsmdc_tsv")
def read_lsmdc_tsv(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """LSMDC16 annotation CSVs: tab-separated, no header, 6 columns, the sentence last.

    Clips live in per-movie folders: ``<movie>/<clip_id>.avi`` where the movie is the clip id
    without its trailing ``_<start>-<end>`` time stamp.
    """
    _need_split(ctx, "lsmdc_tsv")
    path = ctx.file(args["file"])
    parts, seen = [], set()
    for line, raw in _read_lines(path):
        cols = raw.split("\t")
        if len(cols) != 6:
            raise ManifestError(f"{path} line {line}: expected 6 tab-separated columns, got {len(cols)}")
        vid = cols[0].strip()
        if not vid:
            raise ManifestError(f"{path} line {line}: empty clip id")
        if vid in seen:
            raise ManifestError(f"{path} line {line}: duplicate clip id {vid!r}")
        seen.add(vid)
        parts.append(_emit(ctx, vid, [_text(cols[5])], f"{path} line {line}", movie=vid.rsplit("_", 1)[0]))
    if not parts:
        raise ManifestError(f"{path}: no clips")
    return _collect(parts)


@register_reader("charades_csv")
def read_charades_csv(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """``Charades_v1_{train,test}.csv``: one query per video from its ``descriptions`` field.

    ``descriptions`` holds several annotators' descriptions separated by ``;``; the default
    ``caption_mode: first`` keeps the first one (docs/design.md, "Manifest": one description per video).
    """
    _need_split(ctx, "charades_csv")
    path = ctx.file(args["file"])
    field = args.get("field", "descriptions")
    mode = args.get("caption_mode", "first")
    parts = []
    for line, row in _read_dict_csv(path, ["id", field]):
        vid = row["id"].strip()
        if not vid:
            raise ManifestError(f"{path} line {line}: empty id")
        texts = [_text(t) for t in row[field].split(";") if t.strip()] if field == "descriptions" else [_text(row[field])]
        if not texts:
            raise ManifestError(f"{path} line {line}: empty {field} for video {vid!r}")
        parts.append(_emit(ctx, vid, _select(texts, mode, f"{path} line {line}"), f"{path} line {line}"))
    return _collect(parts)


_TEXT_COLUMNS = ("path", "caption", "split", "video_id")  # text, or missing (null / empty)
_SECONDS_COLUMNS = ("start_s", "end_s")  # numbers of seconds, or missing


def _read_custom_table(path: Path) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """The header and rows of a custom table, each row as ``(where, {column: value})`` with
    ``where`` naming its CSV line or Parquet row; a missing value is None.

    One strict reader, for both formats: a CSV row with more or fewer fields than the header (an
    unquoted delimiter in a caption) and a Parquet column of the wrong type are errors naming the
    line or column, never shifted or coerced (pandas would make an extra first field the index, and
    turn a null caption into the text "nan"). The text is decoded by :func:`read_text_file` (a byte
    order mark, Excel's "CSV UTF-8" or UTF-16 "Unicode text", is read as such, not as part of the first
    column's name); Parquet strings that are not UTF-8 are an error naming the row and column.

    Raises:
        ManifestError: the file cannot be read, or a row or column is malformed.
    """
    if path.suffix.lower() == ".parquet":
        return _read_custom_parquet(path)
    text = read_text_file(path)
    first = next((line for line in text.splitlines() if line.strip()), "")
    try:
        dialect = csv.Sniffer().sniff(first, delimiters=",\t;|")
    except csv.Error:
        raise ManifestError(f"{path}: cannot tell the delimiter from the header {first[:80]!r}; separate the "
                            "columns path, caption, split with commas or tabs") from None
    reader = csv.reader(io.StringIO(text), delimiter=dialect.delimiter, quotechar='"', doublequote=True)
    rows: list[tuple[str, dict[str, Any]]] = []
    header: list[str] | None = None
    try:
        for fields in reader:
            if not any(f.strip() for f in fields):
                continue  # a blank line
            if header is None:
                header = [f.strip() for f in fields]
                dup = sorted({h for h in header if header.count(h) > 1})
                if dup:
                    raise ManifestError(f"{path}: the header names column(s) {dup} twice")
                continue
            where = f"{path} line {reader.line_num}"
            if len(fields) != len(header):
                delim = "tab" if dialect.delimiter == "\t" else repr(dialect.delimiter)
                raise ManifestError(
                    f"{where}: {len(fields)} fields, but the header has {len(header)} ({', '.join(header)}); "
                    f"a field that holds the delimiter ({delim}) must be quoted, e.g. \"a red, round ball\"")
            rows.append((where, {h: (f if f.strip() else None) for h, f in zip(header, fields)}))
    except csv.Error as e:
        raise ManifestError(f"{path} line {reader.line_num}: cannot read CSV ({e})") from None
    return header or [], rows


def _read_custom_parquet(path: Path) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ManifestError(f"{path}: cannot read Parquet ({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    def words(kind: pa.DataType) -> str:
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            return "text"
        if pa.types.is_integer(kind) or pa.types.is_floating(kind):
            return f"numbers ({kind})"
        return f"lists ({kind})" if pa.types.is_list(kind) or pa.types.is_large_list(kind) else f"{kind} values"

    for name, kind in zip(table.column_names, table.schema.types):
        if name in _TEXT_COLUMNS and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                          or pa.types.is_null(kind)):
            raise ManifestError(f"{path}: column {name!r} holds {words(kind)}, not text; write it as strings")
        if name in _SECONDS_COLUMNS and not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
                                             or pa.types.is_null(kind)):
            raise ManifestError(f"{path}: column {name!r} holds {words(kind)}, not numbers of seconds")
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # pyarrow checks a string column's UTF-8 only when it makes Python strings
        for name in table.column_names:
            for i, value in enumerate(table.column(name).cast(pa.binary()).to_pylist()):
                try:
                    if value is not None:
                        value.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ManifestError(
                        f"{path} row {i}: column {name!r} is not UTF-8 text (byte 0x{value[e.start]:02x} at byte "
                        f"{e.start} of the value); write the table again from text decoded with its real "
                        "encoding, e.g. pandas.read_csv(..., encoding='latin1')") from None
        raise
    return table.column_names, [(f"{path} row {i}", r) for i, r in enumerate(rows)]


def _seconds(value: Any, column: str, where: str) -> float | None:
    """A clip bound in seconds; None when missing (empty, null, or NaN in a numeric Parquet column)."""
    if value is None:
        return None
    try:
        x = float(value)
    except ValueError:
        raise ManifestError(f"{where}: {column} {value!r} is not a number of seconds") from None
    if x != x and not isinstance(value, str):
        return None  # NaN: how pandas writes a missing number
    if not math.isfinite(x):
        raise ManifestError(f"{where}: {column} {value!r} is not a finite number of seconds")
    return x


@register_reader("custom_table")
def read_custom_table(ctx: ReadContext, args: dict[str, Any]) -> Rows:
    """A CSV or Parquet table with columns ``path``, ``caption``, ``split``.

    Optional columns: ``video_id`` (default: the path without its extension), ``start_s`` and
    ``end_s``. Several rows with the same video give several captions. ``--annotations`` is the
    table itself, or a directory holding exactly one ``.csv``/``.parquet``. Rows are read strictly
    (:func:`_read_custom_table`).
    """
    path = ctx.annotations
    if path.is_dir():
        tables = sorted(p for p in path.iterdir() if p.suffix.lower() in (".csv", ".parquet"))
        if len(tables) != 1:
            raise ManifestError(f"{path}: expected exactly one .csv or .parquet table, found {len(tables)}")
        path = tables[0]
    elif not path.is_file():
        raise ManifestError(f"custom: annotation table not found: {path}")
    ctx.used_files.append(path)
    columns, records = _read_custom_table(path)
    missing = [c for c in ("path", "caption", "split") if c not in columns]
    if missing:
        raise ManifestError(f"{path}: missing column(s) {missing} (has: {columns})")
    videos: dict[str, dict[str, Any]] = {}
    captions: list[dict[str, Any]] = []
    counts: dict[str, int] = defaultdict(int)
    for at, r in records:
        vpath = (r["path"] or "").strip()
        text, split = _text(r["caption"]), (r["split"] or "").strip()
        if not vpath:
            raise ManifestError(f"{at}: empty path")
        if not visible(text):
            raise ManifestError(f"{at}: empty caption" + (" (only invisible characters)" if text else ""))
        if split not in SPLITS:
            raise ManifestError(f"{at}: split {split!r} is not one of {', '.join(SPLITS)}")
        vid = (r.get("video_id") or "").strip() or Path(vpath).with_suffix("").as_posix()
        clip = {k: _seconds(r.get(k), k, at) for k in _SECONDS_COLUMNS}
        row = ctx.video(vid, split, path=vpath, **clip)
        prev = videos.setdefault(vid, row)
        if prev != row:
            raise ManifestError(f"{at}: video {vid!r} disagrees with its earlier row ({prev} vs {row})")
        captions.append(ctx.caption(vid, counts[vid], text, split))
        counts[vid] += 1
    if not captions:
        raise ManifestError(f"{path}: no rows")
    return list(videos.values()), captions


# ------------------------------------------------------------------------------------- build


def build_manifest(
    dataset: str,
    annotations: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    split_set: str | None = None,
    video_root: str | os.PathLike[str] | None = None,
    allow_missing: bool = False,
    missing_advice: str = MISSING_ADVICE,
) -> Manifest:
    """Build and write a dataset's manifest from its annotation files.

    Args:
        dataset: a name from :func:`list_datasets` (``msrvtt``, ``msvd``, ..., ``custom``).
        annotations: the dataset's annotation directory (for ``custom``: the table itself).
        out_dir: where ``videos.parquet``, ``captions.parquet`` and ``meta.json`` go.
        split_set: e.g. ``9k``, ``7k`` or ``full`` for MSR-VTT; default from the spec.
        video_root: if given, every video must exist under it (paths are resolved
            extension-insensitively); missing ones are reported.
        allow_missing: with ``video_root``, drop missing videos (and their captions) instead
            of failing.
        missing_advice: what the error about missing videos advises, in the options of the command
            that builds (the default names ``tvrpipe manifest build``'s).

    Returns:
        The manifest as written.

    Example:
        >>> build_manifest("msrvtt", "annotations/msrvtt", "data/msrvtt/manifest", "9k")  # doctest: +SKIP
    """
    from tvrpipe.files import file_sha256

    spec = load_spec(dataset)
    if not spec.split_sets:
        raise ConfigError(f"dataset {dataset!r} has no annotation files to build from: {spec.raw.get('note', '')}")
    split_set = split_set or spec.default_split_set or next(iter(spec.split_sets))
    if split_set not in spec.split_sets:
        raise ConfigError(
            f"{dataset}: unknown split set {split_set!r}; choose one of {', '.join(spec.split_sets)}"
        )
    ann = Path(annotations)
    if not ann.exists():
        raise ManifestError(f"{dataset}: --annotations {ann} does not exist")
    used: list[Path] = []
    parts = []
    for job in spec.split_sets[split_set]:
        ctx = ReadContext(dataset, split_set, ann, job.get("split"), spec.path_template, used)
        args = {k: v for k, v in job.items() if k not in ("reader", "split")}
        try:
            parts.append(_READERS[job["reader"]](ctx, args))
        except KeyError as e:
            raise ConfigError(f"{dataset}: split set {split_set!r} job {job} lacks argument {e}") from e
    videos, captions = make_tables(*_collect(parts))
    missing: list[str] = []
    if video_root is not None:
        videos, missing = resolve_paths(videos, video_root, allow_missing, missing_advice)
        captions = captions.loc[isin_mask(captions["video_id"], videos["video_id"])].reset_index(drop=True)
    meta = {
        "dataset": dataset,
        "split_set": split_set,
        "frames": spec.frames,
        "max_words": spec.max_words,
        "annotation_files": {p.name: file_sha256(p) for p in used},
        "missing_videos": missing,
        # the folder the videos were checked in (absolute): the data root rebuilds a manifest checked elsewhere
        "video_root": str(Path(video_root).resolve()) if video_root is not None else None,
        "tvrpipe_version": _version(),
    }
    return write_manifest(out_dir, videos, captions, meta, source=f"{dataset} ({split_set})")


def _version() -> str:
    from tvrpipe import __version__

    return __version__
