"""docs/search.md's table of what each head's score and uncertainty mean, from the heads' own words
(``tvrpipe.search.meanings.markdown_table``): printed, or with ``--write`` put between the file's markers
(a test checks that the file holds what this writes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "search.md"
BEGIN = "<!-- score table: written by `python scripts/score_table.py --write` -->"
END = "<!-- end of the score table -->"


def document(text: str) -> str:
    """``text`` (docs/search.md) with its table replaced by the heads' words now."""
    from tvrpipe.search.meanings import markdown_table

    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    return f"{head}{BEGIN}\n\n{markdown_table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC}")
    args = parser.parse_args(argv)
    if args.write:
        DOC.write_text(document(DOC.read_text()))
        print(f"wrote the score table of {DOC}")
    else:
        from tvrpipe.search.meanings import markdown_table

        sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
