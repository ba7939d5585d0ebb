"""``tvrpipe serve``: a local search server over one feature store.

Everything a search needs is loaded once, when the server starts (:func:`open_server`): the store, the run's head
(or zero-shot CLIP), the CLIP that encodes the queries and the first stage's index; each request then encodes its
query and ranks with them (:func:`~tvrpipe.search.engine.exhaustive` or :func:`~tvrpipe.search.engine.two_stage`,
as ``tvrpipe search`` does). Routes (:func:`make_app`):

- ``GET /``: a page with a query box and a picture field, each with a minimum score field; with ``?q=...`` (or a
  picture POSTed to ``/``), the hits with the thumbnails of ``--html`` (:func:`~tvrpipe.search.html.decode_thumbnails`),
  score and uncertainty with what they mean (the head's words), and a ``<video>`` of the file at the hit's moment
  (``/media/ID#t=start,end``).
- ``GET /search?q=...&k=...&min_score=...``: the same hits as JSON (``POST /search`` with a picture: ``image`` form
  field). ``min_score`` (on ``/`` too) cuts the hits scoring below it, as ``tvrpipe search --min-score``; without it,
  the server's ``--min-score``, if any. The JSON's ``note`` says how many were cut.
- ``GET /media/ID``: the file of the store's video ``ID``, with HTTP Range requests (the player seeks). The id is
  looked up in the store; a path never comes from the request. The file is the store's path under the video root,
  resolved (symlinks followed), and served only if it is a file inside the resolved root: anything else is 404.

**The query encoder** is the searcher's CLIP (:meth:`~tvrpipe.search.engine.Searcher.encode`) unless
:func:`open_server` is given another (``encode``): ``tvrpipe bench serve`` serves a generated store, which has no
CLIP, with a lookup of its captions' stored embeddings, so that everything else a request does is what
``tvrpipe serve`` does.

**A store updated while serving.** Each search first checks, at most once a second (:meth:`Server.refresh`), a
cheap signature of the store's folder (:func:`store_signature`: ``stat`` of its metadata, tables and shard
markers' folder). When it changed, and the store is complete and no writer holds its lock (an extract still
writing is left alone, and checked again a second later), the store, the head and the first stage are opened
again (the query CLIP is kept where the new store records the same one) on the request that noticed, and
swapped in at once; requests meanwhile, and the ones during an extract, are answered from the old ones. A failed
reopen keeps the old ones and is logged once per signature. While an extract rewrites the store in place, the
old first stage stays whole (its embeddings are a memory map of a file that an index rebuild replaces, never
rewrites), but the head reads the old store's frames from files the extract may be rewriting: a search that
fails then is answered 503 (retry), and one that does not may mix the old and new frames of the videos it
scores, under the old store's ids.

Starlette and uvicorn, not FastAPI: the server has five routes and no request schema, and FastAPI would bring
pydantic (and its compiled core) for validation these routes do in a line each.
"""

from __future__ import annotations

import dataclasses
import html
import ipaddress
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.search.meanings import SCALE
from tvrpipe.search.results import Hit

if TYPE_CHECKING:  # the engine imports torch: `tvrpipe serve --help` reads this module's defaults without it
    from tvrpipe.heads.base import TextBatch
    from tvrpipe.search.engine import Found, Searcher, Shortlister

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_TOP_K = 10  # tvrpipe.search.engine.DEFAULT_TOP_K (a test checks they agree)
MAX_IMAGE_BYTES = 32 * 2**20  # choice: a phone's photo is a few MB; anything larger is refused (413)
THUMBS = 4  # thumbnails per hit, as search --html's default
INSTALL = "the server needs the 'serve' extra: pip install 'tvrpipe[serve]' (Starlette, uvicorn, python-multipart)"

_STYLE = """body { font-family: sans-serif; margin: 1.5em; color: #222; }
form { margin-bottom: 1em; } input[type=text] { width: 30em; } input[type=number] { width: 4em; }
table { border-collapse: collapse; margin-bottom: 2em; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { display: inline-block; margin: 0 4px 0 0; text-align: center; font-size: 75%; color: #666; }
figure img { display: block; }
p.error { color: #a33; } p.why { color: #a33; margin: 2px 0; font-size: 85%; }
dl { font-size: 90%; color: #444; max-width: 60em; }
dt { font-weight: bold; float: left; width: 7em; } dd { margin: 0 0 4px 7em; }"""


class StoreBusy(TvrpipeError):
    """A search failed while an extract was rewriting the store under the server (answered 503: retry)."""


def store_signature(features_dir: str | os.PathLike[str]) -> tuple:
    """What changes when ``tvrpipe extract`` writes the store in ``features_dir``, read with a few ``stat``
    calls: its Zarr metadata (rewritten whenever its attributes are, ``complete`` included), its tables and the
    folder of its video shards' markers (a shard written again replaces its marker). A missing file counts
    as its own state."""
    from tvrpipe.features.store import PROGRESS, STORE_NAME

    d = Path(features_dir)
    out = []
    for path in (d / STORE_NAME / "zarr.json", d / "videos.parquet", d / "texts.parquet", d / PROGRESS / "videos"):
        try:
            st = path.stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


def ready_to_reopen(features_dir: str | os.PathLike[str]) -> bool:
    """Whether the store can be opened again now: no writer holds its lock and its attributes say it is
    complete (a store still being written, or left incomplete, is not)."""
    from tvrpipe.features.store import store_attributes
    from tvrpipe.lock import lock_holder

    if lock_holder(features_dir) is not None:
        return False
    try:
        return bool(store_attributes(features_dir).get("complete"))
    except TvrpipeError:
        return False


@dataclass(frozen=True)
class Served:
    """One opening of the store: what a request ranks with, swapped whole when the store changes.

    Attributes:
        searcher: the store, the head and the query encoder (:func:`~tvrpipe.search.engine.open_searcher`).
        stage: the first stage, built (or read from ``STORE/search-index/``) once; or split over Ray actors
            (:class:`~tvrpipe.search.shards.ShardedFirstStage`, ``--shards``).
        files: each video id's file, relative to ``searcher.video_root`` (videos without a file left out).
        signature: the store's :func:`store_signature` when it was opened.
    """

    searcher: Searcher
    stage: Shortlister
    files: Mapping[str, str] = field(default_factory=dict)
    signature: tuple = ()


@dataclass
class Server:
    """What a search server holds for its lifetime.

    Attributes:
        current: the store, head and first stage answered from (:class:`Served`), replaced when the store changes.
        candidates: K, the shortlist the head re-ranks; None: the head scores every video.
        min_score: the cut of a request that gives none (``--min-score``); None: no cut.
        reopen: opens the store again (:meth:`refresh`); None: the server keeps ``current``.
        encode: encodes sentence queries (a :class:`~tvrpipe.heads.base.TextBatch` as
            :meth:`~tvrpipe.search.engine.Searcher.encode` returns, raising ConfigError for a query it cannot
            encode); None: the searcher's CLIP.
        check_seconds: the least time between two checks of the store's signature.
    """

    current: Served
    candidates: int | None = None
    min_score: float | None = None
    reopen: Callable[[Served], Served] | None = field(default=None, repr=False)
    encode: Callable[[Sequence[str]], TextBatch] | None = field(default=None, repr=False)
    check_seconds: float = 1.0  # choice: a few stat calls a second at most, under any request rate
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reloading: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _checked: float = field(default=-math.inf, repr=False)
    _failed: tuple | None = field(default=None, repr=False)

    @property
    def searcher(self) -> Searcher:
        return self.current.searcher

    @property
    def stage(self) -> Shortlister:
        return self.current.stage

    @property
    def files(self) -> Mapping[str, str]:
        return self.current.files

    def refresh(self) -> bool:
        """Open the store again and swap it in, where its signature changed since it was opened and it is
        complete and not being written; at most one check per :attr:`check_seconds`, one reopen at a time (other
        requests meanwhile keep the old one). A reopen that fails keeps the old one, logged once per signature.

        Returns:
            Whether a new opening was swapped in.
        """
        now = time.monotonic()
        if self.reopen is None or now - self._checked < self.check_seconds:
            return False
        self._checked = now
        old = self.current
        d = old.searcher.store.dir
        sig = store_signature(d)
        if sig == old.signature or sig == self._failed or not ready_to_reopen(d):
            return False
        if not self._reloading.acquire(blocking=False):
            return False
        try:
            new = self.reopen(old)
            if store_signature(d) != sig:  # written again while it was opened: the next check reopens it
                return False
            self.current = dataclasses.replace(new, signature=sig)
            log.info("%s changed: now serving it as written (%s searchable videos)", d, f"{len(new.stage):,}")
            return True
        except Exception as e:  # noqa: BLE001 - whatever the new store does, the old one keeps serving
            self._failed = sig
            log.warning("%s changed, but opening it again failed (still serving the store as it was): %s", d, e)
            return False
        finally:
            self._reloading.release()

    def search(self, queries: Sequence[str], k: int = DEFAULT_TOP_K, images: bool = False,
               min_score: float | None = None) -> Found:
        """The ``k`` best videos for each query (sentences, or pictures' paths with ``images``), as ``tvrpipe
        search`` ranks them with the same store, head and first stage, those scoring below ``min_score`` (None:
        the server's :attr:`min_score`) cut.

        Raises:
            ConfigError: an empty query, ``k`` out of range, a ``min_score`` outside the head's scores
                (:func:`~tvrpipe.search.engine.check_min_score`), a picture that cannot be read or that the head
                cannot take.
        """
        from tvrpipe.search.engine import (
            check_min_score,
            check_top_k,
            cut_below,
            exhaustive,
            hits_of,
            two_stage,
        )

        self.refresh()
        cur = self.current  # one opening for the whole request, whatever a concurrent refresh swaps in
        s, stage = cur.searcher, cur.stage
        min_score = self.min_score if min_score is None else min_score
        if min_score is not None:
            check_min_score(s, min_score)
        check_top_k(k, len(stage), s.store)
        with self.lock:  # one search at a time: the head and the CLIP are shared by every request
            texts = s.encode_images(queries) if images else (self.encode or s.encode)(queries)
            try:
                if self.candidates is None or self.candidates >= len(stage):
                    ranked = exhaustive(s.head, texts, s.store, stage.rows, k, s.device)
                else:
                    ranked = two_stage(s.head, texts, s.store, stage, k, max(self.candidates, k), s.device)
            except Exception as e:
                if self.reopen is None or store_signature(s.store.dir) == cur.signature:
                    raise
                raise StoreBusy(f"{s.store.dir} is being written again (tvrpipe extract) and this search could not "
                                "read it; retry in a moment") from e
        return cut_below(hits_of(queries, ranked, s.store.videos), min_score, len(stage), ranked.candidates, k)

    def media_file(self, video_id: str) -> Path | None:
        """The file of the store's video ``video_id``, resolved, if it is a file inside the resolved video root;
        None otherwise (an unknown id, no video root, a path or symlink leading out of the root, a missing file).
        """
        rel, root = self.files.get(video_id), self.searcher.video_root
        if rel is None or root is None:
            return None
        try:
            root = root.resolve(strict=True)
            path = (root / rel).resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        if not path.is_relative_to(root) or not path.is_file():
            return None
        return path


def open_server(features: str | os.PathLike[str], run: str | os.PathLike[str] | None = None, device: str = "cpu",
                pretrained: str | None = None, video_root: str | os.PathLike[str] | None = None,
                first_stage: str = "auto", candidates: int | None = None,
                first_stage_settings: Sequence[str] | Mapping[str, Any] = (), min_score: float | None = None,
                shards: int | None = None, address: str | None = None,
                encode: Callable[[Sequence[str]], TextBatch] | None = None) -> Server:
    """Load once what every request uses: the store, the head, the query CLIP and the first stage (with
    ``shards``, split over that many Ray actors on the cluster at ``address``, as ``tvrpipe search --shards``).

    ``encode`` replaces the query CLIP (:attr:`Server.encode`): none is then loaded, and a store of no CLIP (a
    generated one) is served.

    Raises:
        StoreError, RunError, ConfigError: as :func:`~tvrpipe.search.engine.open_searcher`; a store whose
            sentences cannot be encoded (a generated one, a moved checkpoint); a bad first stage or ``candidates``;
            a ``min_score`` outside the head's scores; ``shards`` as :func:`~tvrpipe.search.engine.search` refuses
            them.
    """
    from tvrpipe.search.engine import check_min_score
    from tvrpipe.search.shards import check_sharding

    if candidates is not None and candidates < 1:
        raise ConfigError(f"--candidates {candidates}: the head needs at least 1 candidate per query")
    check_sharding(shards, address, candidates)

    def reopen(old: Served | None) -> Served:
        sig = store_signature(features)
        served = open_served(features, run, device, pretrained, video_root, first_stage, first_stage_settings, old,
                             shards, address, candidates, warm_up=encode is None)
        if min_score is not None:
            check_min_score(served.searcher, min_score)
        return dataclasses.replace(served, signature=sig)

    return Server(reopen(None), candidates, min_score, reopen, encode)


def open_served(features: str | os.PathLike[str], run: str | os.PathLike[str] | None = None, device: str = "cpu",
                pretrained: str | None = None, video_root: str | os.PathLike[str] | None = None,
                first_stage: str = "auto", first_stage_settings: Sequence[str] | Mapping[str, Any] = (),
                old: Served | None = None, shards: int | None = None, address: str | None = None,
                candidates: int | None = None, warm_up: bool = True) -> Served:
    """One opening of the store (:class:`Served`); the query CLIP of ``old`` is kept where the store records the
    same one (a reopen after an extract), else loaded and tried on a warm-up query (``warm_up`` False: not loaded,
    for a server given another encoder). With ``shards``, the first stage is new Ray actors (``old``'s end when
    its last request drops them)."""
    from tvrpipe.search.engine import open_searcher
    from tvrpipe.search.index import first_stage as make_stage
    from tvrpipe.search.shards import sharded_first_stage

    searcher = open_searcher(features, run, device, pretrained, video_root)
    if warm_up and (old is None or not searcher.share_clip(old.searcher)):
        searcher.encode(["a warm-up query"])  # loads the CLIP now (and refuses a store of no CLIP before serving)
    stage = (make_stage(searcher.store, first_stage, settings=first_stage_settings) if shards is None else
             sharded_first_stage(searcher.store, first_stage, first_stage_settings, shards, address, candidates))
    videos = searcher.store.videos
    paths = videos["path"] if "path" in videos.columns else [""] * len(videos)
    files = {str(v): str(p) for v, p in zip(videos["video_id"], paths) if isinstance(p, str) and p}
    return Served(searcher, stage, files)


def exposure_warning(host: str) -> str | None:
    """What binding ``host`` exposes, for a host other than this machine's loopback; None for loopback."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"--host {host}: anyone who can reach this address can search the store and read its collection's "
            "video files; bind 127.0.0.1 (the default) to keep them on this machine")


# ------------------------------------------------------------------------------------------------ the app


def media_url(hit: Hit) -> str:
    """``/media/ID`` at the hit's moment: ``#t=start,end`` for a clip (``#t=start`` without an end)."""
    url = "/media/" + quote(hit.video_id, safe="")
    start, end = hit.bounds()
    if start is None and end is None:
        return url
    return f"{url}#t={0.0 if start is None else start:.2f}" + ("" if end is None else f",{end:.2f}")


def _record(hit: Hit, server: Server) -> dict[str, Any]:
    return {**hit.record(), "media": media_url(hit) if hit.video_id in server.files else None}


def _min_score(value: str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"min_score={value!r}: a number is needed") from None


def _k(value: str | None) -> int:
    if value is None or value == "":
        return DEFAULT_TOP_K
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"k={value!r}: a whole number of hits is needed") from None


def make_app(server: Server) -> Any:
    """The Starlette app serving ``server``'s searches, pages and media files.

    Raises:
        ConfigError: Starlette is not installed (naming the extra).
    """
    try:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
        from starlette.routing import Route
    except ImportError:
        raise ConfigError(INSTALL) from None

    async def read_picture(request: Request) -> tuple[str, bytes] | None:
        form = await request.form(max_files=1, max_fields=8, max_part_size=MAX_IMAGE_BYTES)
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            return None
        data = await upload.read(MAX_IMAGE_BYTES + 1)
        if len(data) > MAX_IMAGE_BYTES:
            raise ConfigError(f"the picture is over {MAX_IMAGE_BYTES // 2**20} MiB")
        return (upload.filename or "picture"), data

    def search_picture(name: str, data: bytes, k: int, min_score: float | None) -> tuple[list[Hit], str | None]:
        with tempfile.TemporaryDirectory(prefix="tvrpipe-serve-") as d:
            path = Path(d) / (Path(name).name or "picture")
            path.write_bytes(data)
            found = server.search([str(path)], k, images=True, min_score=min_score)
        # the upload's name, not the temporary path
        return [dataclasses.replace(h, query=name) for h in found.hits], found.note(str(path))

    def search_text(q: str, k: int, min_score: float | None) -> tuple[list[Hit], str | None]:
        found = server.search([q], k, min_score=min_score)
        return found.hits, found.note(q)

    async def page(request: Request) -> Response:
        q = request.query_params.get("q", "")
        k_text = request.query_params.get("k")
        score_text = request.query_params.get("min_score", "")
        hits, note, error, busy, query, heading = None, None, None, False, q, "Query"
        try:
            k = _k(k_text)
            min_score = _min_score(score_text)
            if request.method == "POST":
                got = await read_picture(request)
                if got is None:
                    raise ConfigError("no picture: choose or drop a picture file")
                form_score = (await request.form()).get("min_score")  # the form is parsed once, then kept
                if isinstance(form_score, str) and form_score:  # the picture form's field, over the address's
                    score_text, min_score = form_score, _min_score(form_score)
                query, heading = got[0], "Picture"
                hits, note = await _threaded(search_picture, got[0], got[1], k, min_score)
            elif q.strip():
                hits, note = await _threaded(search_text, q, k, min_score)
        except (ConfigError, StoreBusy) as e:
            error, busy = str(e), isinstance(e, StoreBusy)
        body = await _threaded(render_page, server, query if heading == "Query" else "", k_text or "", hits,
                               error, heading, query, note, score_text)
        return HTMLResponse(body, status_code=(503 if busy else 400) if error else 200)

    async def search_json(request: Request) -> Response:
        try:
            k = _k(request.query_params.get("k"))
            min_score = _min_score(request.query_params.get("min_score"))
            if request.method == "POST":
                got = await read_picture(request)
                if got is None:
                    raise ConfigError("no picture: POST one as the form field 'image'")
                hits, note = await _threaded(search_picture, got[0], got[1], k, min_score)
            else:
                hits, note = await _threaded(search_text, request.query_params.get("q", ""), k, min_score)
        except ConfigError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        except StoreBusy as e:
            return JSONResponse({"error": str(e)}, status_code=503)
        head = server.searcher.head
        return JSONResponse({"ranked_by": server.searcher.label, "score": head.meaning(),
                             "uncertainty": head.uncertainty_text(), "note": note,
                             "shards": getattr(server.stage, "shards", None),
                             "hits": [_record(h, server) for h in hits]})

    async def media(request: Request) -> Response:
        path = server.media_file(request.path_params["video_id"])
        if path is None:
            return PlainTextResponse("no such video", status_code=404)
        return FileResponse(path)  # Range requests answered with 206 and the bytes asked for

    return Starlette(routes=[
        Route("/", page, methods=["GET", "POST"]),
        Route("/search", search_json, methods=["GET", "POST"]),
        Route("/media/{video_id:path}", media, methods=["GET", "HEAD"]),
    ])


async def _threaded(fn: Any, *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def render_page(server: Server, q: str, k: str, hits: list[Hit] | None, error: str | None, heading: str = "Query",
                query: str = "", note: str | None = None, min_score: str = "") -> str:
    """The search page: the query box, the minimum score field (``min_score``: as the request gave it) and the
    picture field, and the hits where there are some (``note``: what the minimum score cut)."""
    from tvrpipe.search.html import csp_hash, decode_thumbnails

    e = html.escape
    s = server.searcher
    # one field in each form: the picture's form posts its own, as the query's form sends its own in the address
    score = (f' min score <input type="number" name="min_score" step="any" value="{e(min_score)}" '
             f'placeholder="{"none" if server.min_score is None else f"{server.min_score:g}"}" '
             'title="cut the hits scoring below it, on the ranking head\'s own scale (a value outside its scores is '
             'refused)">')
    parts = [f"<p>{e(s.label)} over {e(str(s.store.dir))}: {len(server.stage):,} searchable videos.</p>",
             f'<form method="get" action="/"><input type="text" name="q" value="{e(q)}" placeholder="a sentence" '
             f'autofocus> hits <input type="number" name="k" min="1" value="{e(k or str(DEFAULT_TOP_K))}" '
             'style="width:4em">' + score + ' <button type="submit">Search</button></form>',
             '<form method="post" action="/" enctype="multipart/form-data">or a picture (choose or drop it here): '
             '<input type="file" name="image" accept="image/*">' + score + ' <button type="submit">Search with the '
             "picture</button></form>"]
    if error:
        parts.append(f'<p class="error">error: {e(error)}</p>')
    legend = [("score", f"{s.head.meaning()}. {SCALE}")]
    if hits:
        if any(h.uncertainty is not None for h in hits):
            legend.append(("uncertainty", s.head.uncertainty_text() or "the head's uncertainty about the pair"))
        legend.append(("video", "the file at the hit's moment (whole file, or its clip in seconds): the player "
                                "starts at the moment's start"))
        parts.append("<dl>" + "".join(f"<dt>{e(a)}</dt><dd>{e(b)}</dd>" for a, b in legend) + "</dl>")
        shown = decode_thumbnails(hits, s.store, s.video_root, THUMBS, False)
        with_u = any(h.uncertainty is not None for h in hits)
        head = ["rank", "video", "clip", "score"] + (["uncertainty"] if with_u else []) + ["frames", "video"]
        rows = "\n".join(_row(h, shown[h.row, h.path], with_u, server) for h in hits)
        parts.append(f"<h2>{e(heading)}: &ldquo;{e(query)}&rdquo;</h2><table><thead><tr>"
                     + "".join(f"<th>{c}</th>" for c in head) + f'</tr></thead><tbody id="hits">\n{rows}\n'
                     "</tbody></table>")
    elif hits is not None:
        parts.append("<p>No hit.</p>")
    if note:
        parts.append(f'<p class="note">{e(note)}</p>')
    csp = (f"default-src 'none'; img-src data:; media-src 'self'; style-src {csp_hash(_STYLE)}; "
           "form-action 'self'")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<title>tvrpipe serve: {e(s.label)}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>tvrpipe serve</h1>
{chr(10).join(parts)}
</body>
</html>
"""


def _number(x: float | None) -> str:
    return "&ndash;" if x is None else ("nan" if math.isnan(x) else f"{x:.4f}")


def _row(hit: Hit, shown: Any, with_u: bool, server: Server) -> str:
    e = html.escape
    figures = "".join(f'<figure><img src="{uri}" alt="{e(hit.video_id)} at {e(cap)}"><figcaption>{e(cap)}'
                      "</figcaption></figure>" if cap else f'<figure><img src="{uri}" alt="{e(shown.why or "")}">'
                      "</figure>" for uri, cap, _ in shown.images)
    if shown.why:
        figures += f'<p class="why">no thumbnails: {e(shown.why)}</p>'
    start, _ = hit.bounds()
    video = (f'<video controls preload="metadata" width="240" src="{e(media_url(hit))}" '
             f'data-start="{0.0 if start is None else start:.2f}"></video>'
             if hit.video_id in server.files and server.searcher.video_root is not None else "no file")
    cells = [f'<td class="num">{hit.rank}</td>', f"<td>{e(hit.video_id)}</td>", f"<td>{e(hit.clip(2))}</td>",
             f'<td class="num">{_number(hit.score)}</td>']
    if with_u:
        cells.append(f'<td class="num">{_number(hit.uncertainty)}</td>')
    cells += [f"<td>{figures}</td>", f"<td>{video}</td>"]
    return '<tr class="hit">' + "".join(cells) + "</tr>"


def page_url(q: str, k: int | None = None) -> str:
    """The page's address for a query (for links and tests)."""
    return "/?" + urlencode({"q": q, **({"k": k} if k is not None else {})})


def serve(server: Server, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> None:
    """Serve until interrupted (uvicorn; one process, searches one at a time).

    Raises:
        ConfigError: uvicorn is not installed.
    """
    try:
        import uvicorn
    except ImportError:
        raise ConfigError(INSTALL) from None
    uvicorn.run(make_app(server), host=host, port=port, log_level="info")
