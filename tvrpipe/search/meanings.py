"""What a search's numbers mean, for every registered head: its score and which way ranks first, and its
uncertainty and which way is less certain, in the head's own words (:attr:`~tvrpipe.heads.base.Head.score_meaning`,
:attr:`~tvrpipe.heads.base.Head.uncertainty_meaning`, which ``register_head`` requires).

``tvrpipe search --help`` prints :func:`help_rows`; docs/search.md holds :func:`markdown_table` between its
markers (``python scripts/score_table.py --write`` puts it there, and a test checks that it is current); the
results page's legend reads the ranking head's words for its own config (:meth:`~tvrpipe.heads.base.Head.meaning`).
A new head states its words once, on its class, and all three follow.
"""

from __future__ import annotations

ZERO_SHOT_ROW = "no --run"  # zero-shot CLIP: the meanpool head, untrained
# Which scores compare: said in --help, on the page and in the docs.
SCALE = ("Each head scores on its own scale: compare scores within one head (and one run, whose weights set the "
         "scale); a number from one head means nothing for another. Within a head the scale is the same for every "
         "query, but how high a good match scores differs from query to query.")


def head_meanings() -> list[tuple[str, str, str | None, bool]]:
    """``(name, score, uncertainty, takes a picture)`` of every registered head, by name, then zero-shot CLIP's
    (``no --run``). A head takes a picture (``--image``) where it reads the sentence embedding alone
    (``uses_tokens`` False): the picture's embedding stands in the sentence's place."""
    from tvrpipe.heads.base import head_class, list_heads

    rows = [(name, head_class(name).score_meaning, head_class(name).uncertainty_meaning,
             not head_class(name).uses_tokens) for name in list_heads()]
    meanpool = head_class("meanpool")
    return rows + [(ZERO_SHOT_ROW, f"zero-shot CLIP, the meanpool head untrained: {meanpool.score_meaning}", None,
                    True)]


def help_rows() -> list[tuple[str, str]]:
    """``(head, what its numbers mean)`` for ``--help``'s list."""
    return [(name, f"{score}." + (f" Uncertainty: {unc}." if unc else " No uncertainty.")
             + (" Takes --image." if image else " Not --image (it reads word tokens)."))
            for name, score, unc, image in head_meanings()]


def markdown_table() -> str:
    """docs/search.md's table: one row per head, its score, its uncertainty, and whether it takes ``--image``."""
    lines = ["| head | score (which way ranks first) | uncertainty (which way is less certain) | `--image` |",
             "|---|---|---|---|"]
    for name, score, unc, image in head_meanings():
        label = name if name == ZERO_SHOT_ROW else f"`{name}`"
        lines.append(f"| {label} | {_cell(score)} | {_cell(unc) if unc else 'none'} | "
                     f"{'yes' if image else 'no: reads word tokens'} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
