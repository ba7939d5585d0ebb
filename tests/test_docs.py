"""The repository's own documents are whole: the code cites the design as docs/design.md (a section it
has), and every relative link of the README and docs/ reaches a file of the checkout (and a heading of
it, where the link names one). A clone or a wheel holds nothing outside the repository, so a citation
of a file beside the checkout reads as a dead end to everyone else."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["tvrpipe", "tests", "scripts", "docs", "manifests", "recipes", ".ci", "README.md", "Makefile",
           "pyproject.toml"]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# every path that ends in design.md, in any case: only the repository's own, docs/design.md, may be cited
DESIGN_PATH = re.compile(r"[\w./-]*design\.md", re.IGNORECASE)
# `docs/design.md, "Section"`, `docs/design.md ("Section")`, also across a comment's line break
CITED_SECTION = re.compile(r"docs/design\.md[,\s(#]*\"([^\"]+)\"")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def text_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        for f in ([path] if path.is_file() else sorted(path.rglob("*"))):
            # this file names the wrong citations on purpose, to test the checks
            if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".png", ".pyc") and \
                    f != Path(__file__).resolve():
                files.append(f)
    return files


def read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def design_citations(text: str, in_docs: bool = False) -> tuple[list[str], list[str]]:
    """(citations of a design file other than docs/design.md, the section names cited in docs/design.md).
    Inside docs/ a link names it relative to docs/, as design.md."""
    own = {"docs/design.md", "design.md"} if in_docs else {"docs/design.md"}
    foreign = [p for p in DESIGN_PATH.findall(text) if p not in own]
    sections = [" ".join(s.replace("#", " ").split()) for s in CITED_SECTION.findall(text)]
    return foreign, sections


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading's get -1, -2, ... as on GitHub."""
    found, counts = set(), {}
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        s = slug(heading)
        n = counts.get(s, 0)
        counts[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(path: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return LINK.findall(text) + REFERENCE.findall(text)


def broken_link(source: Path, target: str) -> str | None:
    """Why ``target``, a link in ``source``, does not reach the checkout, or None where it does."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
        return None  # a URL (https:, mailto:): not a file of the checkout
    file, _, anchor = target.partition("#")
    dest = (source.parent / file).resolve() if file else source
    if file.startswith("/") or not dest.is_relative_to(REPO):
        return "points outside the checkout"
    if not dest.exists():
        return "names no file of the checkout"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"names no heading #{anchor} of {dest.relative_to(REPO)}"
    return None


def test_the_code_cites_the_design_as_docs_design_md_and_only_its_sections():
    headings = {" ".join(h.replace("`", "").split()) for h in HEADING.findall((REPO / "docs" / "design.md").read_text())}
    wrong, unknown = [], []
    for f in text_files():
        text = read(f)
        if text is None:
            continue
        foreign, sections = design_citations(text, in_docs=f.parent == REPO / "docs")
        wrong += [f"{f.relative_to(REPO)}: {c}" for c in foreign]
        unknown += [f"{f.relative_to(REPO)}: \"{s}\"" for s in sections if s not in headings]
    assert not wrong, "cite docs/design.md instead of a design file outside the repository:\n" + "\n".join(wrong)
    assert not unknown, "docs/design.md has no such section:\n" + "\n".join(unknown)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_of_the_docs_reaches_the_checkout(doc: Path):
    bad = [f"({t}): {why}" for t in links(doc) if (why := broken_link(doc, t))]
    assert not bad, f"{doc.relative_to(REPO)}:\n" + "\n".join(bad)


def test_the_checks_fail_on_a_foreign_design_a_missing_section_and_a_link_outside(tmp_path):
    """The rules above can fail: what a stray citation or link looks like to them."""
    upper = "DESIGN" ".md"
    foreign, sections = design_citations(f'see {upper}, and ../shared/design.md; docs/design.md, "Heads"\n'
                                         '# (docs/design.md,\n# "Synthetic data\n# and the offline quickstart")')
    assert foreign == [upper, "../shared/design.md"]
    assert sections == ["Heads", "Synthetic data and the offline quickstart"]
    assert design_citations("docs/design.md (the project's own)") == ([], [])
    assert design_citations("[design.md](design.md#heads)", in_docs=True) == ([], [])
    assert design_citations("[design.md](design.md#heads)") == (["design.md", "design.md"], [])
    doc = REPO / "docs" / "design.md"
    assert broken_link(doc, f"../../shared/{upper}") == "points outside the checkout"
    assert broken_link(doc, f"/work/shared/{upper}") == "points outside the checkout"
    assert broken_link(doc, "nothing.md") == "names no file of the checkout"
    assert broken_link(doc, "protocol.md#no-such-heading") == "names no heading #no-such-heading of docs/protocol.md"
    assert broken_link(doc, "protocol.md#what-is-selected-on-what") is None
    assert broken_link(doc, "https://example.org/x.md") is None
    assert links_in("[a](x.md) `[b](y.md)` ![c](img/c.png \"t\")\n```\n[d](z.md)\n```\n[e]: <w.md>\n", tmp_path) == \
        ["x.md", "img/c.png", "w.md"]


def links_in(text: str, tmp_path: Path) -> list[str]:
    f = tmp_path / "doc.md"
    f.write_text(text)
    return links(f)
