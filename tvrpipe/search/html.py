"""``tvrpipe search --html FILE``: one self-contained page of the hits, a row of thumbnails per hit.

The thumbnails are frames the store recorded for the video (``videos/timestamps`` where
``videos/frame_mask`` is set): up to ``thumbs`` of them, spread over the video as extraction
spreads its frames (:func:`tvrpipe.features.decode.sample_indices`), decoded again from the video
file with PyAV, scaled to :data:`THUMB_HEIGHT` px high and embedded as JPEG ``data:`` URIs. The page
loads nothing else (no CSS, script, font or image from anywhere, and its Content-Security-Policy
forbids it), so it can be mailed or opened offline. A video that cannot be shown (no video root
given, file missing, undecodable, no frame recorded, a path or symlink leading out of the video
root, which is never opened: :func:`file_inside`) gets an inline SVG placeholder naming the
reason, also written beside it as text; one bad video never fails the page.

The page's one inline script counts, on ``load``, the images that rendered, and writes
``rendered/total`` into ``<body data-thumbs>`` and the summary line: a reader sees at once that
every thumbnail shows, and the browser test reads the same count.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tvrpipe.errors import ConfigError
from tvrpipe.features.decode import DecodeFailure, frames_at, sample_indices
from tvrpipe.features.store import FeatureStore
from tvrpipe.files import atomic_write_text
from tvrpipe.search.meanings import SCALE
from tvrpipe.search.results import Hit

log = logging.getLogger(__name__)

THUMB_HEIGHT = 96  # px; choice: four thumbnails of a 16:9 video fit beside the text on a laptop screen
JPEG_QUALITY = 80  # choice: small files with no visible artefacts at thumbnail size
_PLACEHOLDER_WIDTH = 128  # px, a 4:3 box at THUMB_HEIGHT

# DecodeFailure.kind -> what the page says
_REASONS = {"missing": "file missing", "empty": "file is empty", "unreadable": "cannot decode the file",
            "no_frames": "no frame decodes", "timeout": "decoding timed out"}

# Counts the images that rendered once everything has loaded (see the module docstring).
_SCRIPT = """addEventListener("load", function () {
  var imgs = document.images, ok = 0;
  for (var i = 0; i < imgs.length; i++) { if (imgs[i].complete && imgs[i].naturalWidth > 0) { ok++; } }
  document.body.dataset.thumbs = ok + "/" + imgs.length;
  document.getElementById("rendered").textContent = ok + " of " + imgs.length + " rendered";
});"""

_STYLE = """body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 2em; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.path { font-family: monospace; font-size: 90%; word-break: break-all; max-width: 24em; }
figure { display: inline-block; margin: 0 4px 0 0; text-align: center; font-size: 75%; color: #666; }
figure img { display: block; }
p.why { color: #a33; margin: 2px 0; font-size: 85%; }
p.note { font-style: italic; color: #555; }
dl { font-size: 90%; color: #444; max-width: 60em; }
dt { font-weight: bold; float: left; width: 7em; }
dd { margin: 0 0 4px 7em; }"""


@dataclass(frozen=True)
class Meaning:
    """What a page's numbers mean, in the ranking head's words for its config (``Head.meaning()``,
    ``Head.uncertainty_text()``)."""

    score: str = "the head's similarity of the query and the video (higher ranks first)"
    uncertainty: str | None = None


@dataclass(frozen=True)
class Thumbs:
    """What one video shows: its images (data URIs with their captions), or why there are none."""

    images: tuple[tuple[str, str, float | None], ...]  # (data URI, caption, the frame's time in seconds)
    why: str | None = None  # None: real frames


def write_html(
    out: str | os.PathLike[str],
    hits: Sequence[Hit],
    store: FeatureStore,
    video_root: str | os.PathLike[str] | None,
    title: str = "tvrpipe search",
    thumbs: int = 4,
    progress: bool = False,
    meaning: Meaning | None = None,
    queries: Sequence[str] | None = None,
    notes: Mapping[str, str] | None = None,
    heading: str = "Query",
) -> Path:
    """Write the hits as one self-contained HTML page, a row of thumbnails per hit.

    Hits are grouped by query (in the order the queries first appear), ranks ascending. Each
    distinct video is decoded once, however many queries it answers.

    Args:
        out: The page's file; its folder is created if missing; written atomically.
        hits: What the search returned.
        store: The store the hits index (``Hit.row``): it gives each video's recorded frame times.
        video_root: The folder the hits' paths are relative to; None shows placeholders only.
        title: The page's title and heading.
        thumbs: Thumbnails per hit, at most (fewer when the store recorded fewer frames).
        progress: Show a progress bar while decoding.
        meaning: What the scores and uncertainties mean, for the page's legend (the head's words).
        queries: Every query searched, in order: one left without hits (``--min-score`` cut them all) still gets
            its section (default: the queries of ``hits``).
        notes: A line to show under a query's hits (what ``--min-score`` cut), by query.
        heading: What each query's section is headed with (``Picture`` for ``--image``'s paths).

    Returns:
        The page's path.

    Raises:
        ConfigError: ``thumbs`` < 1.
        WriteError: The page cannot be written (one line naming it).

    Example:
        >>> write_html("hits.html", hits, open_store("features/msrvtt"), "data/videos")  # doctest: +SKIP
        PosixPath('hits.html')
    """
    out = Path(out)
    page = render_html(hits, store, video_root, title, thumbs, progress, meaning, queries, notes, heading)
    atomic_write_text(out, page, parents=True)
    log.info("wrote %s (%d hits)", out, len(hits))
    return out


def render_html(hits: Sequence[Hit], store: FeatureStore, video_root: str | os.PathLike[str] | None,
                title: str = "tvrpipe search", thumbs: int = 4, progress: bool = False,
                meaning: Meaning | None = None, queries: Sequence[str] | None = None,
                notes: Mapping[str, str] | None = None, heading: str = "Query") -> str:
    """The page :func:`write_html` writes, as text (the thumbnails decoded); nothing is written.

    Raises:
        ConfigError: ``thumbs`` < 1.
    """
    if thumbs < 1:
        raise ConfigError(f"--thumbs must be at least 1, got {thumbs}")
    root = None if video_root is None else Path(video_root)
    shown = decode_thumbnails(hits, store, root, thumbs, progress)
    # ASCII with character references: the page reads the same whatever encoding opens it
    page = _page(hits, shown, title, root, meaning or Meaning(), queries, notes or {}, heading)
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")


def decode_thumbnails(
    hits: Sequence[Hit], store: FeatureStore, video_root: Path | None, thumbs: int, progress: bool
) -> dict[tuple[int, str], Thumbs]:
    """The thumbnails of every distinct (row, path) among the hits, each video decoded once."""
    from tvrpipe.progress import progress_bar

    keys = list(dict.fromkeys((h.row, h.path) for h in hits))
    rows = sorted({row for row, _ in keys})
    times, mask = {}, {}
    if rows:  # one orthogonal read per array, not one per hit
        index = (np.asarray(rows), slice(None))
        stamps = store.array("videos/timestamps").get_orthogonal_selection(index)  # (n_rows, F)
        valid = store.array("videos/frame_mask").get_orthogonal_selection(index)  # (n_rows, F)
        for i, row in enumerate(rows):
            times[row], mask[row] = stamps[i], valid[i]
    shown = {}
    with progress_bar(elapsed=True, enabled=progress) as bar:
        task = bar.add_task("thumbnails", total=len(keys))
        for row, path in keys:
            t = times[row][mask[row] & np.isfinite(times[row])].astype(np.float64)
            t = t[sample_indices(len(t), thumbs)] if len(t) else t
            shown[row, path] = _thumbnails(video_root, path, t)
            bar.advance(task)
    return shown


def _thumbnails(video_root: Path | None, path: str, times: np.ndarray) -> Thumbs:
    """One video's thumbnails at ``times``, or a placeholder saying why there are none."""
    if not path:
        return _placeholder("no file recorded in the store")
    if video_root is None:
        return _placeholder("no video root given")
    if len(times) == 0:
        return _placeholder("no frame recorded in the store")
    # the store's path is data, as a request is: a file outside the collection's folder is never opened
    file, why = file_inside(video_root, path)
    if file is None:
        return _placeholder(str(why))
    try:
        frames = frames_at(file, times, THUMB_HEIGHT)
    except DecodeFailure as failure:
        log.warning("%s", failure)
        return _placeholder(_REASONS.get(failure.kind, failure.kind))
    except Exception as exc:  # one bad video never fails the page
        log.warning("%s: cannot make thumbnails: %s: %s", file, type(exc).__name__, exc)
        return _placeholder("cannot decode the file")
    return Thumbs(tuple((_jpeg_uri(f), f"{s:.2f} s", float(s)) for f, s in zip(frames, times)))


def file_inside(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> tuple[Path | None, str | None]:
    """The file ``path`` (relative to ``root``) names, resolved with its symlinks, if it is a regular file inside
    the resolved ``root``; else None and why not. Nothing is opened: ``path`` comes from a store or a request, and
    a ``..``, an absolute path or a symlink leading out of the root must not reach a file there.

    Returns:
        ``(file, None)``, or ``(None, why)``: ``video root missing``, ``file missing``, ``outside the video root``,
        ``not a file`` or why the path cannot be resolved (a symlink loop).

    Example:
        >>> file_inside("data/videos", "../secret.mp4")  # doctest: +SKIP
        (None, 'outside the video root')
    """
    try:
        base = Path(root).resolve(strict=True)
    except (OSError, RuntimeError):
        return None, "video root missing"
    try:
        file = (base / path).resolve(strict=True)
    except FileNotFoundError:
        return None, "file missing"
    except (OSError, RuntimeError) as e:  # a symlink loop (RuntimeError before Python 3.13), a name too long
        return None, f"cannot resolve the path ({getattr(e, 'strerror', None) or e})"
    if not file.is_relative_to(base):
        return None, "outside the video root"
    if not file.is_file():
        return None, "not a file"
    return file, None


def _jpeg_uri(frame: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _placeholder(why: str) -> Thumbs:
    """A grey box naming ``why``: an image that renders like the thumbnails it stands in for."""
    w, h = _PLACEHOLDER_WIDTH, THUMB_HEIGHT
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}">'
           f'<rect width="{w}" height="{h}" fill="#e4e4e4" stroke="#aaa"/>'
           f'<text x="{w // 2}" y="{h // 2}" font-family="sans-serif" font-size="11" fill="#555" '
           f'text-anchor="middle" dominant-baseline="middle">{html.escape(why)}</text></svg>')
    uri = "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return Thumbs(((uri, "", None),), why)


def csp_hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode("utf-8")).digest()).decode("ascii") + "'"


def _number(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "&ndash;"
    return "nan" if math.isnan(x) else f"{x:.{digits}f}"


def _clip(hit: Hit) -> str:
    return hit.clip(2, " &ndash; ", " s")


def video_link(video_root: Path | None, hit: Hit, at: float | None = None) -> str | None:
    """The video file's ``file:`` URL, opening at ``at`` seconds or at the hit's clip (a media fragment,
    ``#t=start,end``, which browsers honour when they play the file); None without a file to point at."""
    if video_root is None or not hit.path:
        return None
    url = (video_root / hit.path).absolute().as_uri()
    if at is not None:
        return f"{url}#t={at:.2f}"
    start, end = hit.bounds()
    if start is None and end is None:
        return url
    return f"{url}#t={0.0 if start is None else start:.2f}" + ("" if end is None else f",{end:.2f}")


def _row(hit: Hit, shown: Thumbs, with_uncertainty: bool, video_root: Path | None) -> str:
    e = html.escape
    figures = "".join(
        f'<figure><a href="{e(video_link(video_root, hit, at) or "")}" title="open the video at {e(caption)}">'
        f'<img src="{uri}" alt="{e(hit.video_id)} at {e(caption)}" title="{e(caption)}"></a>'
        f"<figcaption>{e(caption)}</figcaption></figure>" if caption else
        f'<figure><img src="{uri}" alt="{e(shown.why or "")}"></figure>'
        for uri, caption, at in shown.images
    )
    why = f'<p class="why">no thumbnails: {e(shown.why)}</p>' if shown.why else ""
    link = video_link(video_root, hit)
    clip = _clip(hit) + (f'<br><a href="{e(link)}">open</a>' if link else "")
    cells = [
        f'<td class="num">{hit.rank}</td>', f"<td>{e(hit.video_id)}</td>", f'<td class="path">{e(hit.path)}</td>',
        f"<td>{clip}</td>", f'<td class="num">{_number(hit.score)}</td>',
    ]
    if with_uncertainty:
        cells.append(f'<td class="num">{_number(hit.uncertainty)}</td>')
    cells.append(f"<td>{figures}{why}</td>")
    return "<tr>" + "".join(cells) + "</tr>"


def _page(hits: Sequence[Hit], shown: dict[tuple[int, str], Thumbs], title: str, video_root: Path | None,
          meaning: Meaning, queries: Sequence[str] | None, notes: Mapping[str, str], heading: str) -> str:
    e = html.escape
    by_query: dict[str, list[Hit]] = {q: [] for q in queries or ()}
    for h in hits:
        by_query.setdefault(h.query, []).append(h)
    n_images = sum(len(shown[h.row, h.path].images) for h in hits)
    n_missing = len({k for k in shown if shown[k].why})
    sections = []
    for query, qhits in by_query.items():
        words = notes.get(query) or ("" if qhits else "no hit")
        note = f'<p class="note">{e(words)}</p>\n' if words else ""
        if not qhits:
            sections.append(f"<section>\n<h2>{e(heading)}: &ldquo;{e(query)}&rdquo;</h2>\n{note}</section>")
            continue
        with_u = any(h.uncertainty is not None for h in qhits)
        head = ["rank", "video", "path", "clip", "score"] + (["uncertainty"] if with_u else []) + ["frames"]
        rows = "\n".join(_row(h, shown[h.row, h.path], with_u, video_root)
                          for h in sorted(qhits, key=lambda h: h.rank))
        sections.append(
            f'<section>\n<h2>{e(heading)}: &ldquo;{e(query)}&rdquo;</h2>\n<table>\n<thead><tr>'
            + "".join(f"<th>{c}</th>" for c in head) + f"</tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>\n{note}"
            "</section>"
        )
    without = f"; {n_missing} video{'s' if n_missing != 1 else ''} without thumbnails" if n_missing else ""
    summary = (f'{len(by_query)} quer{"ies" if len(by_query) != 1 else "y"}, {len(hits)} hits, {n_images} '
               f'images (<span id="rendered">not counted: scripts are off</span>){without}')
    # Only inline data: images, this style and this script: nothing is ever fetched.
    csp = f"default-src 'none'; img-src data:; style-src {csp_hash(_STYLE)}; script-src {csp_hash(_SCRIPT)}"
    body = "\n".join(sections) if sections else "<p>No hits.</p>"
    legend = [("score", f"{meaning.score}. {SCALE}")]
    if any(h.uncertainty is not None for h in hits):
        legend.append(("uncertainty", meaning.uncertainty or "the head's uncertainty about the pair"))
    legend.append(("clip", "the moment of the file the hit is (whole file, or its bounds in seconds); "
                           "<q>open</q> and each thumbnail open the video file at that moment"
                   if video_root is not None else "the moment of the file the hit is (whole file, or its bounds in "
                                                  "seconds); without the video folder there is no file to open"))
    legend_html = "<dl>" + "".join(f"<dt>{e(k)}</dt><dd>{e(v) if k != 'clip' else v}</dd>" for k, v in legend) + "</dl>"
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>{e(title)}</h1>
<p>{summary}</p>
{legend_html}
{body}
<script>{_SCRIPT}</script>
</body>
</html>
"""
