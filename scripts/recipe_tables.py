"""The recipe tables of docs/reproduce.md, from the shipped recipes: printed, or with ``--write``
put between the file's markers (a test checks that the file holds what this writes)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling doc_tables, also where a test loads it

import doc_tables  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "reproduce.md"
BEGIN = "<!-- recipe tables: written by `python scripts/recipe_tables.py --write` -->"
END = "<!-- end of the recipe tables -->"
ORDER = {"uatvr": "UATVR", "duq": "DUQ", "prota": "ProTA", "tmass": "T-MASS", "xpool": "X-Pool (baseline)",
         "seqtransf": "CLIP4Clip seqTransf (baseline)", "meanpool": "CLIP4Clip meanP (baseline)"}


def _number(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def tables() -> str:
    """Markdown: one table per method, one row per recipe."""
    from tvrpipe.training.recipes import list_recipes, load_recipe

    recipes = [load_recipe(n) for n in list_recipes()]
    methods = list(ORDER) + sorted({r.method for r in recipes} - set(ORDER))
    lines = []
    for method in methods:
        mine = [r for r in recipes if r.method == method]
        if not mine:
            continue
        lines += [f"### {ORDER.get(method, method)}", "",
                  "| recipe | dataset | F / L | batch | epochs | optimiser, lr CLIP / head | published t2v R@1 / R@5 / "
                  "R@10 / MdR / MnR | v2t R@1 | published in |", "|---|---|---|---:|---:|---|---|---:|---|"]
        for r in mine:
            v = r.values()
            lr = f"{v['optimizer']}, {v['clip_lr']:g} / {v['head_lr']:g}" + "".join(
                f", {g} {x:g}" for g, x in v["group_lr"].items())
            if r.published:
                t2v, v2t = r.published.metrics.get("t2v"), r.published.metrics.get("v2t")
                pub = " / ".join(_number(t2v[m]) for m in ("R@1", "R@5", "R@10", "MdR", "MnR")) if t2v else "–"
                row = (pub, _number(v2t["R@1"]) if v2t else "–", r.published.source)
            else:
                row = ("not printed in the four papers", "–", "–")
            lines.append(f"| `{r.name}` | {r.dataset} {r.split_set.value} | {v['frames']} / {v['max_words']} | "
                         f"{v['batch_size']} | {v['epochs']} | {lr} | {' | '.join(row)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def document(text: str) -> str:
    """``text`` (docs/reproduce.md) with its tables replaced by :func:`tables`."""
    return doc_tables.between_markers(text, DOC, BEGIN, END, tables())


def main(argv: list[str] | None = None) -> int:
    return doc_tables.main(argv, __doc__, DOC, "recipe tables", document, tables)


if __name__ == "__main__":
    sys.exit(main())
