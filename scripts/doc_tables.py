"""What the scripts that generate a block of a docs/ page share (recipe_tables.py, score_table.py): the block
lies between two marker lines; the script prints it, or with ``--write`` puts it between the markers, and a
test checks that the page holds what the script writes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def between_markers(text: str, doc: Path, begin: str, end: str, body: str) -> str:
    """``text`` (the page ``doc``) with what lies between ``begin`` and ``end`` replaced by ``body``."""
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(f"{doc}: the markers {begin!r} and {end!r} are missing")
    return f"{head}{begin}\n\n{body}\n{end}{tail}"


def main(argv: list[str] | None, description: str, doc: Path, what: str, document: Callable[[str], str],
         make: Callable[[], str]) -> int:
    """Print ``make()``, or with ``--write`` write ``document(page)`` into ``doc``; ``what`` names the block."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", action="store_true", help=f"write the {what} into {doc}")
    args = parser.parse_args(argv)
    if args.write:
        doc.write_text(document(doc.read_text()))
        print(f"wrote the {what} of {doc}")
    else:
        sys.stdout.write(make())
    return 0
