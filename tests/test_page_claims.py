"""What the pages claim can be followed and read for what it is.

- Every link and image in the README, the changelog and the docs pages resolves: a file of the repository, a
  picture the site draws (`cacheattn.figures`), and for a page, the heading its anchor names.
- A speed figure (µs, ms, TFLOP/s, GB/s, TB/s, "% of HBM", "faster") stands in a sentence that says what kind of
  figure it is: a bound ("≥", "≤", "bound", "at most"), counted or derived, an estimate, timed or measured, a
  published figure, a peak or a spec. The lab derives bounds from counts; nothing here was timed on a GPU, and a
  bound printed as a bare speed reads as one.
"""

import re
import unicodedata
from pathlib import Path

import pytest

from cacheattn import figures

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SPEED = re.compile(r"\d[\d,.]*\s*(?:µs|ms|TFLOP/s|GFLOP/s|GB/s|TB/s)(?![\w/])|\d[\d.]*\s*%\s+of\s+(?:HBM|peak)"
                   r"|\bfaster\b|\bslower\b", re.I)
KIND = re.compile(r"bound|≥|≤|>=|<=|\bcounted\b|\bderived\b|estimate|\btimed\b|\bmeasured\b|\bpublished\b|at most|"
                  r"at least|\bpeak\b|\bspec\b|datasheet|\bfloor\b|cannot (?:run|beat|go)|no faster|\blimit|"
                  r"\brate\b|microbenchmark|host time|wall|predict", re.I)


def prose_lines(path: Path):
    """(line number, text) of the page outside fenced code and output blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (Python-Markdown's toc slugify)."""
    text = re.sub(r"<[^>]+>|[`*]", "", heading)
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    found = set()
    for _, line in prose_lines(path):
        if line.startswith("#"):
            found.add(slug(line.lstrip("#").strip()))
        found.update(m.group(1) for m in re.finditer(r"\{#([\w-]+)\}|id=\"([\w-]+)\"", line) if m.group(1))
    return found


def broken_links(pages) -> list[str]:
    drawn = set(figures.figures())
    broken = []
    for page in pages:
        for number, line in prose_lines(page):
            for match in LINK.finditer(line):
                target = match.group(1)
                if re.match(r"[a-z]+:", target):          # a web address: not ours to check offline
                    continue
                path, _, anchor = target.partition("#")
                if path.startswith("figures/") and Path(path).name in drawn:
                    continue
                file = page.parent / path if path else page
                if not file.exists():
                    broken.append(f"{page.name}:{number}: {target}: no such file")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                    broken.append(f"{page.name}:{number}: {target}: no heading with that anchor")
    return broken


def paragraphs(path: Path):
    """(first line number, text) of each prose paragraph, its lines joined (a sentence may wrap), and each table
    row on its own."""
    start, lines = 0, []
    for number, line in prose_lines(path):
        if not line.strip() or line.lstrip().startswith(("|", "#")):
            if lines:
                yield start, " ".join(lines)
            start, lines = 0, []
            if line.strip():
                yield number, line
            continue
        start = start or number
        lines.append(line.strip())
    if lines:
        yield start, " ".join(lines)


def unlabelled_speeds(pages) -> list[str]:
    found = []
    for page in pages:
        for number, text in paragraphs(page):
            # A sentence, or a table cell: the unit a label must share.
            for part in re.split(r"(?<=[.;])\s+(?=[A-Z(*])|\|", text):
                if SPEED.search(part) and not KIND.search(part):
                    found.append(f"{page.name}:{number}: {part.strip()[:200]}")
    return found


def test_every_link_and_image_resolves():
    assert broken_links(PAGES) == []


def test_every_speed_figure_says_what_kind_it_is():
    assert unlabelled_speeds(PAGES) == []


@pytest.mark.parametrize("text, bad", [
    ("The kernel runs at 414 TFLOP/s on the prefill.", True),
    ("Its bound is ≥ 1.2 ms, ≤ 110 TFLOP/s (bound).", False),
    ("The int8 cache makes decode 1.6 times faster.", True),
    ("FlashAttention-2's published 350 TFLOP/s.", False),
    ("| rung 5 | 332.3 µs |", True),
])
def test_the_speed_check_tells_a_bare_speed_from_a_labelled_one(tmp_path, text, bad):
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{text}\n\n```text\n9 µs in an output block is the code's to label\n```\n")
    assert bool(unlabelled_speeds([page])) == bad


def test_the_link_check_finds_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [no anchor](other.md#nowhere) "
                    "![drawn](figures/page-table.svg) [web](https://example.com)\n")
    assert [b.split(": ", 1)[1] for b in broken_links([page])] == [
        "missing.md: no such file", "other.md#nowhere: no heading with that anchor"]
