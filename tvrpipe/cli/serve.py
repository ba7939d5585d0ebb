"""``tvrpipe serve``: a local search server over a feature store (a page, a JSON API, the videos)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from tvrpipe.cli.app import MAIN_PATH, app, console, err_console, finite_float
from tvrpipe.errors import ConfigError
from tvrpipe.search.first_stages import AUTO, first_stage_help
from tvrpipe.search.serve import DEFAULT_HOST, DEFAULT_PORT


@app.command("serve", rich_help_panel=MAIN_PATH)
def serve_cmd(
    features: Annotated[Path, typer.Option(help="The feature store to search (tvrpipe extract --out).")],
    run: Annotated[Optional[Path], typer.Option(
        help="A trained run (train-head, or finetune --end-to-end) whose head ranks the videos; without it, "
             "zero-shot CLIP, mean-pooled.")] = None,
    host: Annotated[str, typer.Option(
        help="The address to listen on. The default serves this machine only; any other address lets anyone "
             "who can reach it search the store and read its collection's video files (a warning says so).")
    ] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(help="The port to listen on (0: a free one, printed at start).")
    ] = DEFAULT_PORT,
    allow_host: Annotated[Optional[list[str]], typer.Option(
        metavar="NAME", help="A host name the server also answers to (repeatable), e.g. this machine's name on "
        "the network, or a proxy's. Requests naming any other host are refused (421), so that a web page cannot "
        "read the server through your browser by pointing its own name at this machine; the address it listens "
        "on (and, on a loopback or 0.0.0.0, localhost, 127.0.0.1 and ::1) is always answered.",
        show_default=False)] = None,
    candidates: Annotated[Optional[int], typer.Option(
        help="K: the shortlist of the first stage that the run's head re-ranks; default: the head scores every "
             "video.")] = None,
    min_score: Annotated[Optional[float], typer.Option(
        parser=finite_float, metavar="X", help="Cut the hits scoring below X, as tvrpipe search --min-score (X on the "
        "ranking head's own scale; a value outside its scores is refused); a request's min_score=... replaces it.",
        show_default=False)] = None,
    first_stage: Annotated[str, typer.Option(
        help=f"What ranks every video for --candidates, built once at start. {first_stage_help()}.")] = AUTO,
    first_stage_set: Annotated[Optional[list[str]], typer.Option(
        metavar="KEY=VALUE", help="A first-stage setting (repeatable), as for tvrpipe search.",
        show_default=False)] = None,
    shards: Annotated[Optional[int], typer.Option(
        metavar="N", help="Split the first stage over N Ray actors (with --address and --candidates), as for "
        "tvrpipe search: built once at start; the head re-ranks their merged shortlist in this process.",
        show_default=False)] = None,
    address: Annotated[Optional[str], typer.Option(
        metavar="ADDRESS", help="The Ray cluster the --shards run on: auto, HOST:PORT, or local (a Ray started in this process).",
        show_default=False)] = None,
    encoded_videos: Annotated[bool, typer.Option(
        "--encoded-videos", help="Read the run's head's encodings of the videos, kept beside the store (made at "
        "start where they are not), instead of encoding the candidates' frames for every request, as tvrpipe "
        "search --encoded-videos.")] = False,
    video_root: Annotated[Optional[Path], typer.Option(
        help="Where the collection's videos are now, when they moved since extraction (default: the folder the "
             "store was extracted from). Only the store's videos under it are served, by id.")] = None,
    pretrained: Annotated[Optional[str], typer.Option(
        help="The store's CLIP checkpoint, where its recorded path no longer reaches it (its sha256 is checked).")
    ] = None,
    device: Annotated[str, typer.Option(help="Where the head runs: cpu or cuda.")] = "cpu",
) -> None:
    """Serve a search page over a feature store: the store, the head (or zero-shot CLIP), the query CLIP and the
    first stage are loaded once. GET / is the page (a sentence, or a picture chosen or dropped; hits with
    thumbnails, score, uncertainty and a player at the hit's moment), GET /search?q=...&k=...&min_score=... the
    same hits as JSON, GET /media/ID a video file by its id in the store (Range requests for seeking)."""
    from tvrpipe.search.serve import check_allowed_hosts, exposure_warning, listen, open_server, serve

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: choose cpu or cuda")
    allow = check_allowed_hosts(allow_host or ())
    # the port is bound before anything loads: one in use, or a host that cannot be bound, fails in a second
    with listen(host, port) as listener:
        warning = exposure_warning(host)
        if warning:
            err_console.print(f"warning: {warning}", style="yellow", markup=False, highlight=False)
        server = open_server(features, run, device, pretrained, video_root, first_stage, candidates,
                             first_stage_set or (), min_score, shards, address, progress=True,
                             encoded_videos=encoded_videos)
        where = f" (first stage: {server.stage.describe()}, at {address})" if shards else ""
        if server.current.encoded is not None:
            where += ", re-ranked from the head's kept encodings"
        console.print(f"{server.searcher.label} over {server.searcher.store.dir}: {len(server.stage):,} searchable "
                      f"videos{where}; serving {listener.url} (Ctrl-C stops)", markup=False, highlight=False)
        serve(server, listener, allow)
