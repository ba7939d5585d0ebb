"""``tvrpipe serve``: a local search server over one feature store.

Everything a search needs is loaded once, when the server starts (:func:`open_server`): the store, the run's head
(or zero-shot CLIP), the CLIP that encodes the queries and the first stage's index; each request then encodes its
query and ranks with them (:func:`~tvrpipe.search.engine.exhaustive` or :func:`~tvrpipe.search.engine.two_stage`,
as ``tvrpipe search`` does). Routes (:func:`make_app`):

- ``GET /``: a page with a query box and a picture field, each with a minimum score field; with ``?q=...`` (or a
  picture POSTed to ``/``), the hits with the thumbnails of ``--html`` (:func:`~tvrpipe.search.html.decode_thumbnails`),
  score and uncertainty with what they mean (the head's words), and a ``<video>`` of the file at the hit's moment
  (``/media/ID#t=start,end``), or ``no file`` where ``/media/ID`` would not serve one.
- ``GET /search?q=...&k=...&min_score=...``: the same hits as JSON (``POST /search`` with a picture: ``image`` form
  field), each with its ``media`` URL (null as the page's ``no file``). ``min_score`` (on ``/`` too) cuts the hits
  scoring below it, as ``tvrpipe search --min-score``; without it, the server's ``--min-score``, if any. The JSON's
  ``note`` says how many were cut. A request's values are named as it sent them (``k=N``, ``min_score=X``), never
  as options of the command line. Without ``k``, the hits of
  ``tvrpipe search`` without ``--top-k``: :data:`DEFAULT_TOP_K`, or every video of a smaller store; a ``k`` out of
  range is refused with its message. A picture with a sentence (``q`` in the address or the form) is refused, as
  ``search --image`` with a sentence is.
- ``GET /media/ID``: the file of the store's video ``ID``, with HTTP Range requests (the player seeks). The id is
  looked up in the store; a path never comes from the request. The file is the store's path under the video root,
  resolved (symlinks followed), and served only if it is a file inside the resolved root
  (:func:`~tvrpipe.search.html.file_inside`, the rule of the page's thumbnails too): anything else is 404.

**Pages of other sites.** A browser on this machine reaches the server for any page it shows, and a page that
points its own name at 127.0.0.1 (DNS rebinding) could read the answers as its own. Such a request carries the
page's name in its ``Host`` header: every route answers only a Host naming the address the server listens on
(for a loopback or wildcard address, also ``localhost``, ``127.0.0.1`` and ``::1``; for a wildcard one, any
address literal, since a rebinding page always sends a name) or a name of ``--allow-host``, and the listening port
or none (:class:`Hosts`); others get 421 (a malformed or missing Host 400). A name may end in the one dot of its
fully qualified form (``localhost.``); an address may not (``127.0.0.1.`` is a name of digits: 421 saying so).
Nothing a client sends becomes a path: a POSTed picture is written to a fixed name in a temporary folder, and its
file name is shown only as text, its control characters replaced (:func:`upload_name`; RFC 5987's ``filename*``
read where it gives no other, :func:`picture_name`). Its body is counted as it streams in: past
:data:`MAX_IMAGE_BYTES` (and room for the form around it) it is refused with 413, before reading where its
Content-Length says so, else at the byte that passes the cap, with or without a Content-Length.

**Listening.** :func:`listen` binds the socket before the store is loaded (a port in use, or a host that cannot
be bound, fails at once with one line) and hands it to uvicorn, so nothing can take the port in between;
``--port 0`` takes a free one, printed at start.

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

import contextlib
import dataclasses
import errno
import html
import ipaddress
import logging
import math
import os
import re
import socket
import tempfile
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from tvrpipe.errors import ConfigError, TvrpipeError
from tvrpipe.search.meanings import SCALE
from tvrpipe.search.results import Hit

# the engine imports torch and Starlette is an extra: `tvrpipe serve --help` reads this module's defaults without them
if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from tvrpipe.heads.base import TextBatch
    from tvrpipe.search.encoded import EncodedVideos
    from tvrpipe.search.engine import Found, Searcher, Shortlister

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_TOP_K = 10  # tvrpipe.search.engine.DEFAULT_TOP_K (a test checks they agree)
MAX_IMAGE_BYTES = 32 * 2**20  # choice: a phone's photo is a few MB; anything larger is refused (413)
FORM_BYTES = 64 * 2**10  # choice: room in a picture's POST for the multipart framing, its name and small fields
NAME_CHARS = 120  # choice: an uploaded picture's name as shown, at most (a name longer than a line is cut)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # answered by a server on a loopback or wildcard address
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


class TooLarge(TvrpipeError):
    """A POSTed picture over :data:`MAX_IMAGE_BYTES` (answered 413), refused as its body streams in."""


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
        encoded: the head's encodings of the videos, read instead of their frames (``--encoded-videos``); None:
            the frames are encoded per request.
    """

    searcher: Searcher
    stage: Shortlister
    files: Mapping[str, str] = field(default_factory=dict)
    signature: tuple = ()
    encoded: EncodedVideos | None = None


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

    def search(self, queries: Sequence[str], k: int | None = None, images: bool = False,
               min_score: float | None = None) -> Found:
        """The ``k`` best videos for each query (sentences, or pictures' paths with ``images``), as ``tvrpipe
        search`` ranks them with the same store, head and first stage, those scoring below ``min_score`` (None:
        the server's :attr:`min_score`) cut. ``k`` None: :data:`DEFAULT_TOP_K`, or every video of a smaller store,
        as ``tvrpipe search`` without ``--top-k``.

        Raises:
            ConfigError: an empty query, ``k`` out of range (refused with ``tvrpipe search --top-k``'s message,
                naming ``k=N``), a ``min_score`` outside the head's scores
                (:func:`~tvrpipe.search.engine.check_min_score`, naming ``min_score=X``; the server's own
                ``--min-score X``), a picture that cannot be read or that the head cannot take.
        """
        from tvrpipe.search.engine import (
            check_min_score,
            cut_below,
            exhaustive,
            hits_asked,
            hits_of,
            two_stage,
        )

        self.refresh()
        cur = self.current  # one opening for the whole request, whatever a concurrent refresh swaps in
        s, stage = cur.searcher, cur.stage
        if min_score is not None:  # the request's, named as a request gives it
            check_min_score(s, min_score, "min_score")
        elif self.min_score is not None:  # the server's own, checked at start (a reopened store may rank otherwise)
            min_score = self.min_score
            check_min_score(s, min_score)
        k = hits_asked(k, len(stage), s.store, self.candidates, "k")  # as tvrpipe search checks --top-k
        with self.lock:  # one search at a time: the head and the CLIP are shared by every request
            texts = s.encode_images(queries) if images else (self.encode or s.encode)(queries)
            try:
                if self.candidates is None or self.candidates >= len(stage):
                    ranked = exhaustive(s.head, texts, s.store, stage.rows, k, s.device, cur.encoded)
                else:
                    ranked = two_stage(s.head, texts, s.store, stage, k, self.candidates, s.device, cur.encoded)
            except Exception as e:
                if self.reopen is None or store_signature(s.store.dir) == cur.signature:
                    raise
                raise StoreBusy(f"{s.store.dir} is being written again (tvrpipe extract) and this search could not "
                                "read it; retry in a moment") from e
        return cut_below(hits_of(queries, ranked, s.store.videos), min_score, len(stage), ranked.candidates, k)

    def media_file(self, video_id: str) -> Path | None:
        """The file of the store's video ``video_id``, resolved, if it is a file inside the resolved video root;
        None otherwise (an unknown id, no video root, a path or symlink leading out of the root, a missing file):
        the rule of the page's thumbnails (:func:`~tvrpipe.search.html.file_inside`).
        """
        from tvrpipe.search.html import file_inside

        rel, root = self.files.get(video_id), self.searcher.video_root
        if rel is None or root is None:
            return None
        return file_inside(root, rel)[0]

    def servable(self) -> Callable[[str], bool]:
        """Whether ``/media/ID`` serves a file, by video id (:meth:`media_file`), each id resolved once: for one
        request's hits, which link a player only where the route would answer it."""
        known: dict[str, bool] = {}

        def has_file(video_id: str) -> bool:
            if video_id not in known:
                known[video_id] = self.media_file(video_id) is not None
            return known[video_id]

        return has_file


def open_server(features: str | os.PathLike[str], run: str | os.PathLike[str] | None = None, device: str = "cpu",
                pretrained: str | None = None, video_root: str | os.PathLike[str] | None = None,
                first_stage: str = "auto", candidates: int | None = None,
                first_stage_settings: Sequence[str] | Mapping[str, Any] = (), min_score: float | None = None,
                shards: int | None = None, address: str | None = None,
                encode: Callable[[Sequence[str]], TextBatch] | None = None, progress: bool = False,
                encoded_videos: bool = False) -> Server:
    """Load once what every request uses: the store, the head, the query CLIP and the first stage (with
    ``shards``, split over that many Ray actors on the cluster at ``address``, as ``tvrpipe search --shards``).

    ``encode`` replaces the query CLIP (:attr:`Server.encode`): none is then loaded, and a store of no CLIP (a
    generated one) is served. ``progress``: a bar while the first opening builds the first stage's index (a
    reopen while serving shows none). ``encoded_videos``: the head's encodings of the videos are kept beside the
    store (made at start where they are not) and read instead of the frames, as ``tvrpipe search
    --encoded-videos``; a reopened store's are made anew.

    Raises:
        StoreError, RunError, ConfigError: as :func:`~tvrpipe.search.engine.open_searcher`; a store whose
            sentences cannot be encoded (a generated one, a moved checkpoint); a bad first stage or ``candidates``;
            a ``min_score`` outside the head's scores; ``shards`` as :func:`~tvrpipe.search.engine.search` refuses
            them; ``encoded_videos`` as it refuses them.
    """
    from tvrpipe.search.engine import check_min_score
    from tvrpipe.search.shards import check_sharding

    if candidates is not None and candidates < 1:
        raise ConfigError(f"--candidates {candidates}: the head needs at least 1 candidate per query")
    check_sharding(shards, address, candidates)

    def reopen(old: Served | None) -> Served:
        sig = store_signature(features)
        served = open_served(features, run, device, pretrained, video_root, first_stage, first_stage_settings, old,
                             shards, address, candidates, warm_up=encode is None, progress=progress and old is None,
                             encoded_videos=encoded_videos)
        if min_score is not None:
            check_min_score(served.searcher, min_score)
        return dataclasses.replace(served, signature=sig)

    return Server(reopen(None), candidates, min_score, reopen, encode)


def open_served(features: str | os.PathLike[str], run: str | os.PathLike[str] | None = None, device: str = "cpu",
                pretrained: str | None = None, video_root: str | os.PathLike[str] | None = None,
                first_stage: str = "auto", first_stage_settings: Sequence[str] | Mapping[str, Any] = (),
                old: Served | None = None, shards: int | None = None, address: str | None = None,
                candidates: int | None = None, warm_up: bool = True, progress: bool = False,
                encoded_videos: bool = False) -> Served:
    """One opening of the store (:class:`Served`); the query CLIP of ``old`` is kept where the store records the
    same one (a reopen after an extract), else loaded and tried on a warm-up query (``warm_up`` False: not loaded,
    for a server given another encoder). With ``shards``, the first stage is new Ray actors (``old``'s end when
    its last request drops them)."""
    from tvrpipe.search.engine import (
        check_encoded,
        check_head_aware,
        first_stage_for,
        kept_encodings,
        open_searcher,
    )
    from tvrpipe.search.shards import sharded_first_stage

    searcher = open_searcher(features, run, device, pretrained, video_root)
    check_head_aware(searcher, first_stage, candidates, shards)  # before the query CLIP loads
    if encoded_videos:
        check_encoded(searcher)
    if warm_up and (old is None or not searcher.share_clip(old.searcher)):
        searcher.encode(["a warm-up query"])  # loads the CLIP now (and refuses a store of no CLIP before serving)
    stage = (first_stage_for(searcher.store, first_stage, first_stage_settings, searcher.head, searcher.run,
                             progress) if shards is None else
             sharded_first_stage(searcher.store, first_stage, first_stage_settings, shards, address, candidates))
    encoded = kept_encodings(searcher, stage, candidates, progress) if encoded_videos else None
    videos = searcher.store.videos
    paths = videos["path"] if "path" in videos.columns else [""] * len(videos)
    files = {str(v): str(p) for v, p in zip(videos["video_id"], paths) if isinstance(p, str) and p}
    return Served(searcher, stage, files, encoded=encoded)


def exposure_warning(host: str) -> str | None:
    """What binding ``host`` exposes, for a host other than this machine's loopback; None for loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if host == "localhost" or (address is not None and address.is_loopback):
        return None
    warning = (f"--host {host}: anyone who can reach this address can search the store and read its collection's "
               "video files; bind 127.0.0.1 (the default) to keep them on this machine")
    if address is not None and address.is_unspecified:
        warning += ("; requests naming this machine by an address are answered, by a name (its host name) only "
                    "where --allow-host NAME allows it")
    return warning


# ------------------------------------------------------------------------------------- who may ask, and where

# a DNS name as a Host header carries it: dot-separated labels, lower case (checked after lowering)
_NAME = re.compile(r"(?:[a-z0-9_-]+\.)*[a-z0-9_-]+")


def host_name(value: str) -> str | None:
    """``value`` (a host as a Host header or ``--allow-host`` gives it, without a port) as the server compares it:
    lower case, an IPv6 address without its brackets, an address in its canonical form, a name without the one
    trailing dot of its fully qualified form (``localhost.`` is ``localhost``); None where it is neither a DNS name
    nor an address. An address takes no trailing dot: ``127.0.0.1.`` is a name of digits, not that address
    (:func:`_dotted_address` says so)."""
    v = value.strip().lower()
    if v.startswith("[") and v.endswith("]"):
        try:
            return ipaddress.IPv6Address(v[1:-1]).compressed
        except ValueError:
            return None
    try:
        return ipaddress.ip_address(v).compressed
    except ValueError:
        pass
    if v.endswith(".") and _dotted_address(v) is None:
        v = v[:-1]  # the root's empty label: DNS resolves NAME. and NAME alike, and no attacker owns localhost.
    return v if _NAME.fullmatch(v) else None


def _dotted_address(value: str) -> str | None:
    """The address in a host such as ``127.0.0.1.`` (an IPv4 address and a trailing dot), else None."""
    v = value.strip().lower()
    if not v.endswith("."):
        return None
    try:
        return ipaddress.ip_address(v[:-1]).compressed
    except ValueError:
        return None


def check_allowed_hosts(names: Sequence[str]) -> tuple[str, ...]:
    """The names of ``--allow-host``, as :func:`host_name` compares them.

    Raises:
        ConfigError: a value that is not a host name or an address (a port, a scheme, a path, a wildcard).
    """
    out = []
    for name in names:
        n = host_name(name)
        if n is None:
            raise ConfigError(f"--allow-host {name!r}: give a host name or address as a browser's address bar "
                              "shows it, without scheme, port or path (e.g. mybox.lan, 192.168.1.5 or ::1)")
        out.append(n)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class Hosts:
    """The ``Host`` headers a server answers: a page on another site that points its own name at this machine
    (DNS rebinding) sends that name, and is refused, whatever the route.

    Attributes:
        names: the host names and addresses answered (:func:`host_name`'s form).
        port: the port the server listens on; a Host naming another one is refused (one naming none, as clients
            do for port 80 and a proxy may, is answered).
        any_address: a wildcard bind (0.0.0.0, ::): every address literal is answered too, since a rebinding
            page always sends a name, and the machine's own addresses are more than it can list.
    """

    names: frozenset[str]
    port: int
    any_address: bool = False

    def refusal(self, headers: Sequence[str]) -> tuple[int, str] | None:
        """None where ``headers`` (the request's Host headers) are answered, else the status and why not: 400
        for no Host, several, or one that is not ``NAME[:PORT]``; 421 for a name or port of another server."""
        if len(headers) != 1:
            return 400, f"{'no' if not headers else 'more than one'} Host header: one naming this server is needed"
        value = headers[0]
        shown = value if len(value) <= 100 else value[:99] + "\u2026"
        name, port, raw = _split_host(value)
        if name is None:
            dotted = _dotted_address(raw)
            if dotted is not None:  # a well-formed name, but of digits: not the address, and not this server's
                return 421, (f"the Host header {shown!r} is the address {dotted} followed by a dot: a DNS name of "
                             f"digits, not that address; name this server by the address alone ({dotted})")
            return 400, f"the Host header {shown!r} is not HOST[:PORT]"
        if port is not None and port != self.port:
            return 421, f"the Host header {shown!r} names port {port}, but this server listens on port {self.port}"
        if name in self.names:
            return None
        if self.any_address:
            try:
                ipaddress.ip_address(name)
                return None
            except ValueError:
                pass
        answered = ", ".join(sorted(self.names)) + (" and any address of this machine" if self.any_address else "")
        return 421, (f"the Host header {shown!r} names neither this server ({answered}) nor a name allowed with "
                     "tvrpipe serve --allow-host NAME: a page of another site may not read it through your browser")


def _split_host(value: str) -> tuple[str | None, int | None, str]:
    """A Host header's name (:func:`host_name`'s form), port and host as sent; a None name where it is
    malformed (and an empty host where its port is)."""
    v = value.strip()
    if v.startswith("["):
        end = v.find("]")
        name, rest = (v[:end + 1], v[end + 1:]) if end > 0 else (None, "")
    else:
        name, sep, rest = v.partition(":")
        rest = sep + rest
    port = None
    if rest:
        digits = rest[1:]
        if not (rest[0] == ":" and digits.isascii() and digits.isdigit() and len(digits) <= 5):
            return None, None, ""
        port = int(digits)
    return (None if name is None else host_name(name)), port, name or ""


def allowed_hosts(host: str, port: int, allow: Sequence[str] = (), address: str | None = None) -> Hosts:
    """The Host headers a server bound to ``address`` (``host`` as the user gave it: an address or a name) on
    ``port`` answers: ``host`` and ``address`` themselves; for a loopback address or a wildcard one, also
    ``localhost``, ``127.0.0.1`` and ``::1`` (an attacker controls none of them); for a wildcard one, any address
    literal; and the names of ``allow`` (``--allow-host``).

    Raises:
        ConfigError: a name of ``allow`` that is not a host name or address.

    Example:
        >>> allowed_hosts("127.0.0.1", 8000).refusal(["evil.example:8000"])[0]
        421
    """
    names = {n for n in (host_name(host), host_name(address or host)) if n is not None}
    names.update(check_allowed_hosts(allow))
    try:
        bound = ipaddress.ip_address(host_name(address or host) or "")
    except ValueError:
        bound = None
    anywhere = bound is not None and bound.is_unspecified
    if host == "localhost" or anywhere or (bound is not None and bound.is_loopback):
        names.update(LOOPBACK_NAMES)
    return Hosts(frozenset(names), port, anywhere)


@dataclass
class Listener:
    """A socket bound and listening (:func:`listen`), handed to uvicorn: the port is held from the start, so a
    port in use is refused before the store is loaded and no other process can take it meanwhile.

    Attributes:
        sock: the listening socket.
        host: the ``--host`` it was asked for (an address or a name).
        address: the address bound.
        port: the port bound (the free one the system chose, for ``--port 0``).
    """

    sock: socket.socket = field(repr=False)
    host: str
    address: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host if ':' not in self.host else f'[{self.host}]'}:{self.port}/"

    def hosts(self, allow: Sequence[str] = ()) -> Hosts:
        """The Host headers a server on this socket answers (:func:`allowed_hosts`)."""
        return allowed_hosts(self.host, self.port, allow, self.address)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listen(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> Listener:
    """A socket bound to ``host`` (the first of its addresses that binds) and ``port`` (0: a free one), listening.

    Raises:
        ConfigError: ``port`` outside 0-65535; ``host`` that does not resolve or is not an address of this
            machine; ``port`` in use, or one this user may not bind (each naming the option to change).

    Example:
        >>> with listen("127.0.0.1", 0) as listener:  # doctest: +SKIP
        ...     serve(open_server("features/msrvtt"), listener)
    """
    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port}: a port from 1 to 65535 is needed (or 0: a free one)")
    if not host:
        raise ConfigError("--host: an address to listen on is needed, e.g. 127.0.0.1 (this machine only)")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host}: not an address this machine can listen on ({e}); e.g. 127.0.0.1 (this "
                          "machine only) or 0.0.0.0 (every network)") from None
    first: OSError | None = None
    for family, kind, proto, _, addr in found:
        sock = socket.socket(family, kind, proto)
        try:
            # a port left in TIME_WAIT by a server just stopped binds again; one another socket listens on does not
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(2048)  # uvicorn's backlog; listening now holds the port until uvicorn serves it
        except OSError as e:
            sock.close()
            first = first or e
            continue
        return Listener(sock, host, str(sock.getsockname()[0]), int(sock.getsockname()[1]))
    raise _bind_error(first, host, port)


def _bind_error(e: OSError | None, host: str, port: int) -> ConfigError:
    why = (e.strerror if e is not None else None) or str(e)
    if e is not None and e.errno == errno.EADDRINUSE:
        return ConfigError(f"--port {port}: already in use on {host} (another server listens there); stop it, or "
                           "choose another --port (0: a free one)")
    if e is not None and e.errno == errno.EACCES:
        return ConfigError(f"--port {port}: this user may not listen on it on {host} ({why}); ports below 1024 "
                           "need privileges: choose another --port")
    if e is not None and e.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"--host {host}: not an address of this machine ({why}); e.g. 127.0.0.1 (this machine "
                           "only) or 0.0.0.0 (every network)")
    return ConfigError(f"--host {host} --port {port}: cannot listen there ({why})")


# ------------------------------------------------------------------------------------------------ the app


def media_url(hit: Hit) -> str:
    """``/media/ID`` at the hit's moment: ``#t=start,end`` for a clip (``#t=start`` without an end)."""
    url = "/media/" + quote(hit.video_id, safe="")
    start, end = hit.bounds()
    if start is None and end is None:
        return url
    return f"{url}#t={0.0 if start is None else start:.2f}" + ("" if end is None else f",{end:.2f}")


def _record(hit: Hit, has_file: Callable[[str], bool]) -> dict[str, Any]:
    """A hit as JSON: ``--json``'s fields, and ``media``, the player's URL, where ``/media/ID`` serves a file
    (``has_file``: :meth:`Server.servable`), else null."""
    return {**hit.record(), "media": media_url(hit) if has_file(hit.video_id) else None}


def _min_score(value: str | None) -> float | None:
    """A request's ``min_score``, refused as the request sent it: ``1e999`` is not named ``inf``."""
    if value is None or value == "":
        return None
    try:
        x = float(value)
    except ValueError:
        raise ConfigError(f"min_score={value!r}: a number is needed") from None
    if not math.isfinite(x):
        raise ConfigError(f"min_score={value}: a finite number is needed")
    return x


def _noted(note: str | None, asked: float | None) -> str | None:
    """What ``min_score`` cut, naming it as the request gave it (``asked``; None: the server's ``--min-score``,
    named so)."""
    return note if note is None or asked is None else note.replace("--min-score ", "min_score=")


def _k(value: str | None) -> int | None:
    if value is None or value == "":
        return None  # tvrpipe search's default: DEFAULT_TOP_K, or every video of a smaller store
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"k={value!r}: a whole number of hits is needed") from None


def upload_name(name: str | None) -> str:
    r"""What the page and the JSON call a POSTed picture: the client's file name as text (never a path), its
    control characters (a NUL, CR, LF, a line separator, a bidirectional override) each shown as U+FFFD, cut to
    :data:`NAME_CHARS`; ``picture`` where it gave none.

    Example:
        >>> upload_name("a\r\nX-Evil: 1.png") == "a\ufffd\ufffdX-Evil: 1.png"
        True
    """
    name = "".join("\ufffd" if _is_control(c) else c for c in name or "") or "picture"
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS - 1] + "\u2026"


# the bidirectional embeddings, overrides and isolates: text after them reads in another order ("gnp.exe")
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _is_control(c: str) -> bool:
    """A character that is no text of a name: it breaks a line, ends a string or reorders what follows."""
    return unicodedata.category(c) in ("Cc", "Zl", "Zp") or c in _BIDI


def picture_name(filename: str | None, disposition: str | None) -> str:
    """A POSTed picture's name (:func:`upload_name`): the form's ``filename``, else RFC 5987's ``filename*``
    (``UTF-8''na%C3%AFve.png``) from its ``Content-Disposition``, which RFC 7578 forbids in forms and
    python-multipart therefore ignores, but some clients send; ``picture`` where neither names it."""
    if not filename and disposition:
        from email.message import Message

        header = Message()
        header["content-disposition"] = disposition
        filename = header.get_filename()  # RFC 2231/5987 decoded, its charset's errors replaced
    return upload_name(filename)


def _status(e: TvrpipeError) -> int:
    return 413 if isinstance(e, TooLarge) else 503 if isinstance(e, StoreBusy) else 400


def _too_large() -> TooLarge:
    cap = MAX_IMAGE_BYTES
    size = f"{cap / 2**20:g} MiB" if cap >= 2**20 else f"{cap:,} bytes"
    return TooLarge(f"the picture is over {size}, the most this server takes: send a smaller one")


def _capped(receive: Callable[[], Any], cap: int) -> Callable[[], Any]:
    """``receive`` (ASGI) raising :class:`TooLarge` once the request's body passes ``cap`` bytes: a body is
    refused while it streams in, with or without a Content-Length, before it is written anywhere whole."""
    seen = 0

    async def counted() -> Any:
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise _too_large()
        return message

    return counted


_BOTH = ("a picture and a sentence (q) were both given: search with a picture or with a sentence, in separate "
         "requests")


def _picture_form_parser() -> type:
    """Starlette's multipart parser, also taking a part that names its file only by RFC 5987's ``filename*=`` as
    the file it is: python-multipart ignores that parameter (RFC 7578 forbids it in forms), so Starlette would
    read the picture as a text field, and refuse it as no picture (or as a field over its size)."""
    from python_multipart.multipart import parse_options_header
    from starlette.formparsers import MultiPartParser

    extended = re.compile(rb";\s*filename\*\s*=", re.IGNORECASE)

    class PictureFormParser(MultiPartParser):
        def on_headers_finished(self) -> None:
            part = self._current_part
            disposition = part.content_disposition or b""
            if extended.search(disposition) and b"filename" not in parse_options_header(disposition)[1]:
                # an empty plain name makes it a file; picture_name reads the extended one from its headers
                part.content_disposition = disposition + b'; filename=""'
            super().on_headers_finished()

    return PictureFormParser


def _unreadable_form(e: Exception) -> ConfigError:
    """Why a multipart body cannot be read, in the words of what the client can change: Starlette says "Invalid
    multipart data" for every error of python-multipart, whose own message (its cause) says which."""
    from python_multipart.multipart import DEFAULT_MAX_HEADER_COUNT, DEFAULT_MAX_HEADER_SIZE

    cause = str(e.__cause__ or "")
    if "header size" in cause:
        return ConfigError(f"the form cannot be read: a header of one of its parts is over "
                           f"{DEFAULT_MAX_HEADER_SIZE:,} bytes (a file name that long?); send the picture under a "
                           "shorter name")
    if "header count" in cause:
        return ConfigError(f"the form cannot be read: one of its parts has more than {DEFAULT_MAX_HEADER_COUNT} "
                           "headers")
    said = getattr(e, "message", str(e))
    return ConfigError(f"the form cannot be read: {said}" + (f" ({cause})" if cause and cause not in said else ""))


def make_app(server: Server, hosts: Hosts | None = None) -> Any:
    """The Starlette app serving ``server``'s searches, pages and media files, to requests whose Host ``hosts``
    answers (None: those of a server on the default address, :func:`allowed_hosts` of 127.0.0.1:8000).

    Raises:
        ConfigError: Starlette is not installed (naming the extra).
    """
    try:  # the 'serve' extra: Starlette, and python-multipart, whose parser the picture forms extend
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        form_parser = _picture_form_parser()
    except ImportError:
        raise ConfigError(INSTALL) from None

    hosts = allowed_hosts(DEFAULT_HOST, DEFAULT_PORT) if hosts is None else hosts
    searches = _Searches(server, form_parser)
    return Starlette(routes=[_page_route(searches), _search_route(searches), _media_route(server)],
                     middleware=[Middleware(_host_check(hosts))])


def _host_check(hosts: Hosts) -> type:
    """The middleware answering only the Host headers ``hosts`` allows, on every route."""
    from starlette.datastructures import Headers
    from starlette.responses import PlainTextResponse

    class HostCheck:
        """Every route answers only the Host headers ``hosts`` allows: a page that rebinds its own name to this
        machine reaches the server through the user's browser, with that name in its Host header."""

        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                refused = hosts.refusal(Headers(scope=scope).getlist("host"))
                if refused is not None:
                    # the Host is echoed: as text that no browser reads as a page
                    await PlainTextResponse(refused[1], status_code=refused[0],
                                            headers={"X-Content-Type-Options": "nosniff"})(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    return HostCheck


@dataclass(frozen=True)
class _Searches:
    """What the page's and the JSON's routes share: the server, and reading and searching a query or picture."""

    server: Server
    form_parser: type

    async def read_picture(self, request: Request, missing: str) -> tuple[str, bytes, str | None]:
        """The POSTed picture's name (:func:`upload_name`) and bytes, and the form's ``min_score``. Starlette caps
        a form's fields but not its files, so the body is counted here, refused past the cap before it is read
        (Content-Length) or as it streams in (chunked)."""
        from python_multipart.multipart import parse_options_header
        from starlette.exceptions import HTTPException
        from starlette.formparsers import MultiPartException
        from starlette.requests import Request

        cap = MAX_IMAGE_BYTES + FORM_BYTES
        length = request.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > cap:
            raise _too_large()
        capped = Request(request.scope, _capped(request.receive, cap))
        limits: dict[str, Any] = {"max_files": 1, "max_fields": 8, "max_part_size": FORM_BYTES}
        if parse_options_header(request.headers.get("content-type"))[0] == b"multipart/form-data":
            try:
                async with contextlib.aclosing(capped.stream()) as stream:
                    form = await self.form_parser(capped.headers, stream, **limits).parse()
            except MultiPartException as e:
                raise _unreadable_form(e) from None
        else:  # a urlencoded form, or none: no file in it, so "no picture"
            try:
                form = await capped.form(**limits)
            except HTTPException as e:  # a body Starlette cannot parse as a form (too many fields)
                raise ConfigError(f"the form cannot be read: {e.detail}") from None
        try:
            upload = form.get("image")
            if upload is None or isinstance(upload, str):
                raise ConfigError(missing)
            if "q" in request.query_params or "q" in form:
                raise ConfigError(_BOTH)
            data = await upload.read(MAX_IMAGE_BYTES + 1)
            if len(data) > MAX_IMAGE_BYTES:
                raise _too_large()
            score = form.get("min_score")
            name = picture_name(upload.filename, upload.headers.get("content-disposition"))
            return name, data, score if isinstance(score, str) and score else None
        finally:
            await form.close()

    def search_picture(self, name: str, data: bytes, k: int | None,
                       min_score: float | None) -> tuple[list[Hit], str | None]:
        """The hits of a POSTed picture, and the note of what ``min_score`` cut, in the words of its name."""
        with tempfile.TemporaryDirectory(prefix="tvrpipe-serve-") as d:
            # a fixed name: the client's never becomes a path (Pillow reads the format from the bytes)
            path = os.path.join(d, "picture")
            Path(path).write_bytes(data)
            try:
                found = self.server.search([path], k, images=True, min_score=min_score)
            except ConfigError as e:  # the upload's name, not the temporary file's
                raise ConfigError(str(e).replace(f"--image {path}", f"the picture {name!r}")
                                  .replace(path, repr(name))) from None
        return [dataclasses.replace(h, query=name) for h in found.hits], _noted(found.note(path), min_score)

    def search_text(self, q: str, k: int | None, min_score: float | None) -> tuple[list[Hit], str | None]:
        """The hits of a sentence, and the note of what ``min_score`` cut."""
        found = self.server.search([q], k, min_score=min_score)
        return found.hits, _noted(found.note(q), min_score)


_NO_PICTURE_PAGE = "no picture: choose or drop a picture file"
_NO_PICTURE_JSON = "no picture: POST one as the form field 'image' (a sentence: GET /search?q=...)"


def _page_route(searches: _Searches) -> Route:
    """``/``: the page, with the hits of the address's query or of a POSTed picture."""
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    async def page(request: Request) -> Response:
        q = request.query_params.get("q", "")
        k_text = request.query_params.get("k")
        score_text = request.query_params.get("min_score", "")
        hits, note, error, status, query, heading = None, None, None, 200, q, "Query"
        try:
            k = _k(k_text)
            min_score = _min_score(score_text)
            if request.method == "POST":
                name, data, form_score = await searches.read_picture(request, _NO_PICTURE_PAGE)
                if form_score is not None:  # the picture form's field, over the address's
                    score_text, min_score = form_score, _min_score(form_score)
                query, heading = name, "Picture"
                hits, note = await _threaded(searches.search_picture, name, data, k, min_score)
            elif q.strip():
                hits, note = await _threaded(searches.search_text, q, k, min_score)
        except (ConfigError, StoreBusy, TooLarge) as e:
            error, status = str(e), _status(e)
        body = await _threaded(render_page, searches.server, query if heading == "Query" else "", k_text or "",
                               hits, error, heading, query, note, score_text)
        return HTMLResponse(body, status_code=status)

    return Route("/", page, methods=["GET", "POST"])


def _search_route(searches: _Searches) -> Route:
    """``/search``: the hits of a sentence (GET) or a picture (POST) as JSON."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    server = searches.server

    async def search_json(request: Request) -> Response:
        try:
            k = _k(request.query_params.get("k"))
            min_score = _min_score(request.query_params.get("min_score"))
            if request.method == "POST":
                name, data, form_score = await searches.read_picture(request, _NO_PICTURE_JSON)
                if form_score is not None:
                    min_score = _min_score(form_score)
                hits, note = await _threaded(searches.search_picture, name, data, k, min_score)
            else:
                hits, note = await _threaded(searches.search_text, request.query_params.get("q", ""), k,
                                             min_score)
        except (ConfigError, StoreBusy, TooLarge) as e:
            return JSONResponse({"error": str(e)}, status_code=_status(e))
        head, has_file = server.searcher.head, server.servable()  # one resolution per video of this answer
        return JSONResponse({"ranked_by": server.searcher.label, "score": head.meaning(),
                             "uncertainty": head.uncertainty_text(), "note": note,
                             "shards": getattr(server.stage, "shards", None),
                             "hits": [_record(h, has_file) for h in hits]})

    return Route("/search", search_json, methods=["GET", "POST"])


def _media_route(server: Server) -> Route:
    """``/media/ID``: the file of the store's video ID, looked up by id (:meth:`Server.media_file`), else 404."""
    from starlette.responses import FileResponse, PlainTextResponse
    from starlette.routing import Route

    async def media(request: Request) -> Response:
        path = server.media_file(request.path_params["video_id"])
        if path is None:
            return PlainTextResponse("no such video", status_code=404)
        return FileResponse(path)  # Range requests answered with 206 and the bytes asked for

    return Route("/media/{video_id:path}", media, methods=["GET", "HEAD"])


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
             f'autofocus> hits <input type="number" name="k" min="1" '
             f'value="{e(k or str(min(DEFAULT_TOP_K, len(server.stage))))}" '
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
        has_file = server.servable()
        rows = "\n".join(_row(h, shown[h.row, h.path], with_u, has_file(h.video_id)) for h in hits)
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


def _row(hit: Hit, shown: Any, with_u: bool, has_file: bool) -> str:
    e = html.escape
    figures = "".join(f'<figure><img src="{uri}" alt="{e(hit.video_id)} at {e(cap)}"><figcaption>{e(cap)}'
                      "</figcaption></figure>" if cap else f'<figure><img src="{uri}" alt="{e(shown.why or "")}">'
                      "</figure>" for uri, cap, _ in shown.images)
    if shown.why:
        figures += f'<p class="why">no thumbnails: {e(shown.why)}</p>'
    start, _ = hit.bounds()
    video = (f'<video controls preload="metadata" width="240" src="{e(media_url(hit))}" '
             f'data-start="{0.0 if start is None else start:.2f}"></video>'
             if has_file else "no file")  # a player only where /media/ID serves its file
    cells = [f'<td class="num">{hit.rank}</td>', f"<td>{e(hit.video_id)}</td>", f"<td>{e(hit.clip(2))}</td>",
             f'<td class="num">{_number(hit.score)}</td>']
    if with_u:
        cells.append(f'<td class="num">{_number(hit.uncertainty)}</td>')
    cells += [f"<td>{figures}</td>", f"<td>{video}</td>"]
    return '<tr class="hit">' + "".join(cells) + "</tr>"


def page_url(q: str, k: int | None = None) -> str:
    """The page's address for a query (for links and tests)."""
    return "/?" + urlencode({"q": q, **({"k": k} if k is not None else {})})


def serve(server: Server, listener: Listener, allow: Sequence[str] = ()) -> None:
    """Serve on ``listener``'s socket until interrupted (uvicorn; one process, searches one at a time), to
    requests naming its address or a name of ``allow`` (:meth:`Listener.hosts`).

    Raises:
        ConfigError: uvicorn is not installed; a name of ``allow`` that is not a host name or address.
    """
    try:
        import uvicorn
    except ImportError:
        raise ConfigError(INSTALL) from None
    app = make_app(server, listener.hosts(allow))
    config = uvicorn.Config(app, host=listener.address, port=listener.port, log_level="info")
    uvicorn.Server(config).run(sockets=[listener.sock])
