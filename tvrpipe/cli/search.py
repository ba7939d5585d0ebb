"""``tvrpipe search``: the videos of a feature store that match sentences, by a trained run or zero-shot CLIP."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

from tvrpipe.cli.app import MAIN_PATH, app, console, finite_float
from tvrpipe.errors import ConfigError
from tvrpipe.search.first_stages import AUTO, first_stage_help


class _SearchCommand(TyperCommand):
    """``search --help`` ends with what each head's score and uncertainty mean, read from the heads when the help
    is shown (importing them imports torch, which no other command's start pays for)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from tvrpipe.search.meanings import SCALE, help_rows

        with formatter.section("What a score means, by head (higher always ranks first)"):
            formatter.write_dl(help_rows())
            formatter.write_paragraph()
            formatter.write_text(SCALE)


@app.command("search", rich_help_panel=MAIN_PATH, cls=_SearchCommand)
def search_cmd(
    queries: Annotated[Optional[list[str]], typer.Argument(
        help="One or more sentences to search for (quote each).", show_default=False)] = None,
    features: Annotated[Optional[Path], typer.Option(
        help="The feature store to search (tvrpipe extract --out); default: a train-head run's own store.")] = None,
    run: Annotated[Optional[Path], typer.Option(
        help="A trained run (train-head, or finetune --end-to-end) whose head ranks the videos; without it, "
             "zero-shot CLIP, mean-pooled.")] = None,
    queries_file: Annotated[Optional[Path], typer.Option(
        "--queries", help="A text file of queries, one per line (blank lines and # comments skipped).")] = None,
    image: Annotated[Optional[list[Path]], typer.Option(
        metavar="PICTURE", help="A picture to search with instead of sentences (repeatable: each picture is a query): its CLIP image "
             "embedding, preprocessed as extraction preprocesses a frame, takes the sentence's place. Zero-shot "
             "(no --run), or a run of a head that reads the sentence alone (below: 'takes --image').",
        show_default=False)] = None,
    top_k: Annotated[Optional[int], typer.Option(
        help="Hits per query (default 10, or every video of a smaller store).", show_default=False)] = None,
    min_score: Annotated[Optional[float], typer.Option(
        parser=finite_float, metavar="X", help="Cut the hits scoring below X, after ranking: a query may show fewer "
        "than --top-k hits, or none, and a note says how many were cut. X is on the ranking head's own scale "
        "(below): a value outside its scores (e.g. above 1 for a cosine) is refused.", show_default=False)] = None,
    per_video: Annotated[Optional[int], typer.Option(
        metavar="N", help="At most N hits of one file per query, its best: for a collection cut into moments "
        "(manifest build --window), the best N moments of each file; the hits kept are the --top-k best under that "
        "limit (within the shortlist, with --candidates).", show_default=False)] = None,
    candidates: Annotated[Optional[int], typer.Option(
        help="K: the shortlist of the first stage (pooled CLIP embeddings) that the run's head re-ranks; "
             "default: the head scores every video (exhaustive).")] = None,
    first_stage: Annotated[str, typer.Option(
        help="What ranks every video for --candidates (its index kept in <features>/search-index/). "
             f"{first_stage_help()}.")] = AUTO,
    first_stage_set: Annotated[Optional[list[str]], typer.Option(
        metavar="KEY=VALUE", help="A first-stage setting, KEY=VALUE (repeatable; e.g. nprobe=64 for faiss-ivfpq, ef_search=128 for "
             "faiss-hnsw; docs/search.md lists them). With --index, its search-time settings only.",
        show_default=False)] = None,
    encoded_videos: Annotated[bool, typer.Option(
        "--encoded-videos", help="Keep the run's head's encoding of every video in <features>/search-encoded/ "
        "(made once, on the first such search: one pass of the head over the store, as an exhaustive search) and "
        "read it instead of encoding the candidates' frames for every search: for a head whose video side is "
        "heavy and the same for every query (prota, uatvr), a re-ranking then costs the sentence's side and the "
        "pair scores only. Its size is the head's encoding (prota: 53 kB a video; docs/search.md).")] = False,
    index: Annotated[Optional[Path], typer.Option(
        help="An index folder written by `tvrpipe export --format faiss` for the first stage; it must be "
             "of this very store.")] = None,
    shards: Annotated[Optional[int], typer.Option(
        metavar="N", help="Split the first stage over N Ray actors (with --address and --candidates): each pools "
        "and indexes its own contiguous part of the store's searchable videos, and their top K are merged here, "
        "where the head re-ranks them (docs/search.md).", show_default=False)] = None,
    address: Annotated[Optional[str], typer.Option(
        metavar="ADDRESS", help="The Ray cluster the --shards run on: auto, HOST:PORT, or local (a Ray started in this process).",
        show_default=False)] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the hits as a JSON list.")] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Also write the hits as CSV.")] = None,
    html: Annotated[Optional[Path], typer.Option(
        help="Also write one self-contained HTML page: each query with a row of thumbnails per hit.")] = None,
    thumbs: Annotated[int, typer.Option(help="--html: thumbnails per hit, at the store's recorded frame times.")] = 4,
    video_root: Annotated[Optional[Path], typer.Option(
        help="Where the collection's videos are now, when they moved since extraction: its files are checked for "
             "changes there and --html decodes thumbnails from there (default: the folder the store was "
             "extracted from).")] = None,
    pretrained: Annotated[Optional[str], typer.Option(
        help="The store's CLIP checkpoint, where its recorded path no longer reaches it (its sha256 is checked).")
    ] = None,
    device: Annotated[str, typer.Option(help="Where the head runs: cpu or cuda.")] = "cpu",
) -> None:
    """Search a feature store's videos with sentences (or pictures, --image); print the top hits of each (rank,
    video, path, clip bounds, score, and the head's uncertainty where it has one)."""
    from tvrpipe.cluster import ray_running, stop_ray
    from tvrpipe.features.outputs import check_output_files
    from tvrpipe.files import atomic_write_text
    from tvrpipe.search.engine import open_searcher, read_queries, search
    from tvrpipe.search.results import HIT_COLUMNS

    texts = list(queries or [])
    if image and (texts or queries_file is not None):
        given = f"{texts[0]!r}" if texts else f"--queries {queries_file}"
        raise ConfigError(f"--image {image[0]} and a text query ({given}) were both given: search with pictures or "
                          "with sentences, in separate searches")
    if queries_file is not None:
        texts += read_queries(queries_file)
    if image:
        texts = [str(p) for p in image]
    if not texts:
        raise ConfigError("no query: give one or more sentences, e.g. tvrpipe search \"a dog catches a frisbee\" "
                          "--features STORE, --queries FILE, or --image PICTURE")
    repeated = len(texts) - len(set(texts))
    texts = list(dict.fromkeys(texts))  # a repeated query (or picture) has the same hits: searched and shown once
    if html is not None and thumbs < 1:
        raise ConfigError(f"--thumbs must be at least 1, got {thumbs}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: choose cpu or cuda")
    outputs = {"--json": json_out, "--csv": csv_out, "--html": html}
    check_output_files(outputs, {"--run": run, "--video-root": video_root})
    for picture in image or ():  # a page written over the picture searched with would lose it
        check_output_files(outputs, {"--image": picture})
    if features is None:
        features = _run_features(run)
    check_output_files(outputs, {"--features": features})
    searcher = open_searcher(features, run, device, pretrained, video_root)
    # the collection's folder too, where the store says it is: a page written there would become one of its files
    check_output_files(outputs, {"--video-root": searcher.video_root})
    ours = not ray_running()  # a Ray the shards start is stopped when the search is done (one it joined is left)
    try:
        found = search(searcher, texts, top_k, candidates, first_stage, index,
                       first_stage_settings=first_stage_set or (), min_score=min_score, images=bool(image),
                       per_video=per_video, shards=shards, address=address, progress=True,
                       encoded_videos=encoded_videos)
    finally:
        if ours:
            stop_ray()
    hits = found.hits
    how = (f"all {found.searchable:,} searchable videos" if found.exhaustive
           else f"the first stage's {found.candidates:,} best of {found.searchable:,} searchable videos"
           + (f" (in {found.shards} Ray shards)" if found.shards else ""))
    by = "the head, from its kept encodings" if found.encoded else "the head"
    console.print(Text.assemble((searcher.label, "bold"), f" over {searcher.store.dir} ({how} scored by {by})"))
    if repeated:
        console.print(f"{repeated} repeated quer{'ies' if repeated > 1 else 'y'} searched once", highlight=False)
    for q in texts:
        _print_hits(q, [h for h in hits if h.query == q], found.note(q))
    # every output made before any is written: a failure leaves none of them behind
    records = [h.record() for h in hits]
    made = []
    if json_out is not None:
        made.append((json_out, json.dumps(records, indent=2) + "\n"))
    if csv_out is not None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(HIT_COLUMNS))
        w.writeheader()
        w.writerows(records)
        made.append((csv_out, buf.getvalue()))
    if html is not None:
        from tvrpipe.search.html import Meaning, render_html

        meaning = Meaning(searcher.head.meaning(), searcher.head.uncertainty_text())
        notes = {q: note for q in texts if (note := found.note(q))}
        made.append((html, render_html(hits, searcher.store, searcher.video_root, f"tvrpipe search: {searcher.label}",
                                       thumbs, meaning=meaning, queries=texts, notes=notes,
                                       heading="Picture" if image else "Query")))
    for path, text in made:
        atomic_write_text(path, text, parents=True)
        console.print(f"wrote {path}", highlight=False)


def _run_features(run: Path | None) -> Path:
    """A train-head run's own store, for ``search`` without ``--features``."""
    from tvrpipe.rundir import read_config

    if run is not None:
        stored = read_config(run).get("features")
        if stored:
            return Path(stored)
        raise ConfigError(f"--run {run} trained on live CLIP features (tvrpipe finetune): give --features, a store "
                          "extracted with the run's exported CLIP")
    raise ConfigError("give --features: the feature store to search (tvrpipe extract --out)")


def _print_hits(query: str, hits, note: str | None = None) -> None:
    """One query's hits as a table, and ``note`` (what --min-score cut) below it; names wrap instead of being cut,
    and the path column is left out where it repeats the video id (a collection's ids are its files' paths)."""
    if not hits:
        console.print(Text.assemble(query, (f": {note}" if note else ": no hit", "italic")))
        return
    table = Table(title=Text(query), title_justify="left")
    unc = any(h.uncertainty is not None for h in hits)
    clips = any(h.clip() != "whole file" for h in hits)
    paths = any(h.path != h.video_id for h in hits)
    columns = ("rank", "video", *(["path"] if paths else []), *(["clip (s)"] if clips else []), "score",
               *(["uncertainty"] if unc else []))
    for col in columns:
        numeric = col in ("rank", "score", "uncertainty")
        table.add_column(col, justify="right" if numeric else "left", overflow="fold", no_wrap=numeric)
    for h in hits:
        path = [h.path] if paths else []
        clip = [h.clip()] if clips else []
        u = [f"{h.uncertainty:.4g}" if h.uncertainty is not None else ""] if unc else []
        table.add_row(str(h.rank), h.video_id, *path, *clip, f"{h.score:.4f}", *u)
    console.print(table)
    if note:
        console.print(note, style="italic")
