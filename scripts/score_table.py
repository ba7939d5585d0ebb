"""docs/search.md's table of what each head's score and uncertainty mean, from the heads' own words
(``tvrpipe.search.meanings.markdown_table``): printed, or with ``--write`` put between the file's markers
(a test checks that the file holds what this writes)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling doc_tables, also where a test loads it

import doc_tables  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "search.md"
BEGIN = "<!-- score table: written by `python scripts/score_table.py --write` -->"
END = "<!-- end of the score table -->"


def _table() -> str:
    from tvrpipe.search.meanings import markdown_table

    return markdown_table()


def document(text: str) -> str:
    """``text`` (docs/search.md) with its table replaced by the heads' words now."""
    return doc_tables.between_markers(text, DOC, BEGIN, END, _table())


def main(argv: list[str] | None = None) -> int:
    return doc_tables.main(argv, __doc__, DOC, "score table", document, _table)


if __name__ == "__main__":
    sys.exit(main())
