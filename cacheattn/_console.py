"""Progress bars and tables for the command line, in one place for every subcommand.

Progress goes to stderr and only when stderr is a terminal, so a piped run, a test's captured
output or a docs page that compares printed text never sees it (rich draws the bars).

Tables go to stdout in one of three forms, chosen once per command (`--format`, see `output`):

- ``text`` (the default): every header and every cell whole at the console's width (a terminal's, or
  $COLUMNS, or 80 when piped). A table wider than that is stacked: one text column (the leftmost whose
  leaving is enough, else the widest) heads its rows on a line of its own, once for a run of rows that
  share it; any further column that has to leave follows its row as "header: value"; the rest stay an
  aligned grid; long values wrap at spaces, never inside a word. Headers are short; a legend under the
  table says what each abbreviated one means.
- ``markdown``: a GitHub-flavoured table per table (what bench.md and host.md are written with).
- ``json``: one JSON document for the whole command, printed when it ends: every table with its rows
  as objects of raw values (numbers stay numbers), and every line of text as a note.
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

FORMATS = ("text", "markdown", "json")
PIPED_WIDTH = 80            # a piped run's width unless $COLUMNS says otherwise: the same text on every machine
GAP = "  "                  # between grid columns
INDENT = "    "             # grid rows under their heading (deeper than a wrapped heading's continuation)


@dataclass(frozen=True)
class Column:
    """One column: `header` as shown (keep it short and say what it abbreviates in `means`), `key` in the JSON
    form (default: the header), `show` turns a cell's value into its text (JSON keeps the value itself),
    `right` aligns numbers."""
    header: str
    key: str = ""
    show: Callable[[Any], str] = str
    right: bool = False
    means: str = ""

    @property
    def name(self) -> str:
        return self.key or self.header


@dataclass
class Table:
    title: str | None
    columns: tuple[Column, ...]
    rows: list = field(default_factory=list)      # tuples of values, one per column

    def cells(self) -> list[list[str]]:
        """Every row as the text each column shows."""
        return [[c.show(v) for c, v in zip(self.columns, row)] for row in self.rows]


def make_table(title: str | None, columns: Sequence[str | Column], rows: Iterable[Sequence], *,
               right: Sequence[str] = ()) -> Table:
    """A Table from column specs or plain header names (those named in `right` right-aligned)."""
    cols = tuple(c if isinstance(c, Column) else Column(c, right=c in right) for c in columns)
    rows = [tuple(r) for r in rows]
    for row in rows:
        if len(row) != len(cols):
            raise ValueError(f"a row of {len(row)} cells under {len(cols)} columns: {row!r}")
    return Table(title, cols, rows)


# ---------------------------------------------------------------------------------------------- text


def _wrap(text: str, width: int, continued: str = "  ", first: str = "") -> list[str]:
    """Lines of at most `width` characters, broken only at spaces (a word longer than the width keeps its line);
    the first line starts with `first`, the others with `continued`."""
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=continued, break_long_words=False,
                         break_on_hyphens=False) or [first]


def _stacked_columns(widths: list[int], columns: Sequence[Column], width: int) -> list[int]:
    """Which columns leave the grid so the rest fits `width`: none if it fits; else the leftmost text column
    whose leaving is enough (it then heads its rows, grouping them); else the widest text columns, then numbers,
    until the rest fits."""
    def fits(out):
        kept = [w for i, w in enumerate(widths) if i not in out]
        return sum(kept) + len(GAP) * (len(kept) - 1) + (len(INDENT) if out else 0) <= width

    if fits([]):
        return []
    text = [i for i, c in enumerate(columns) if not c.right]
    alone = next((i for i in text if fits([i])), None)
    if alone is not None:
        return [alone]
    out: list[int] = []
    for i in sorted(range(len(columns)), key=lambda i: (columns[i].right, -widths[i])):
        if fits(out):
            break
        out.append(i)
    return sorted(out)


def render_text(table: Table, width: int = PIPED_WIDTH) -> str:
    """The table as plain text no wider than `width` where its words allow (module docstring)."""
    cells = table.cells()
    columns = table.columns
    widths = [max([len(c.header)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    stacked = _stacked_columns(widths, columns, width)
    grid = [i for i in range(len(columns)) if i not in stacked]
    indent = INDENT if stacked else ""

    def line(values):
        parts = [values[i].rjust(widths[i]) if columns[i].right else values[i].ljust(widths[i]) for i in grid]
        return (indent + GAP.join(parts)).rstrip()

    # The first stacked column heads its rows bare (once for a run of rows that share it); any further stacked
    # column follows the row's grid cells, labelled with its header and indented with them.
    lines = _wrap(table.title, width, "") + [""] if table.title else []
    if stacked:
        lines.append(columns[stacked[0]].header)
    if grid:
        lines.append(line([c.header for c in columns]))
        lines.append(indent + "─" * (sum(widths[i] for i in grid) + len(GAP) * (len(grid) - 1)))
    heading = None
    for values in cells:
        if stacked and not (grid and values[stacked[0]] == heading):
            heading = values[stacked[0]]
            lines += _wrap(heading, width)
        if grid:
            lines.append(line(values))
        for i in stacked[1:]:
            lines += _wrap(f"{columns[i].header}: {values[i]}", width, INDENT + "  ", INDENT)
    legend = [f"{c.header}: {c.means}" for c in columns if c.means]
    if legend:
        lines += [""] + _wrap("; ".join(legend) + ".", width, "")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- markdown


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(table: Table) -> str:
    """The table in GitHub-flavoured markdown: the title as a paragraph, the legend under it."""
    lines = [f"**{_md_cell(table.title)}**", ""] if table.title else []
    lines.append("| " + " | ".join(_md_cell(c.header) for c in table.columns) + " |")
    lines.append("|" + "|".join("---:" if c.right else "---" for c in table.columns) + "|")
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in table.cells()]
    legend = [f"{c.header}: {c.means}" for c in table.columns if c.means]
    if legend:
        lines += ["", _md_cell("; ".join(legend)) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- json


def _plain(value):
    """A cell's value as JSON holds it: numbers stay numbers (NaN and infinities become null), sequences lists."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()                                  # NumPy scalars
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def as_json(table: Table) -> dict:
    """{"title", "columns": [{"key", "header", "means"}], "rows": [{key: value}]}."""
    return {"title": table.title,
            "columns": [{"key": c.name, "header": c.header, "means": c.means} for c in table.columns],
            "rows": [{c.name: _plain(v) for c, v in zip(table.columns, row)} for row in table.rows]}


# ---------------------------------------------------------------------------------------------- printing

_format = "text"
_collected: dict | None = None          # the JSON document being gathered (json format only)
_recorders: list[list] = []


@contextmanager
def output(fmt: str = "text") -> Iterator:
    """Print every table and line inside in `fmt` (one of FORMATS); json prints one document at the end."""
    global _format, _collected
    if fmt not in FORMATS:
        raise ValueError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    before = _format, _collected
    _format, _collected = fmt, ({"tables": [], "notes": []} if fmt == "json" else None)
    try:
        yield
    finally:
        document = _collected
        _format, _collected = before
        if document is not None:
            sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")


def current_format() -> str:
    """The form tables print in now (one of FORMATS)."""
    return _format


@contextmanager
def recording() -> Iterator[list]:
    """Collect every Table printed inside (whatever the format) into the yielded list: tests check them."""
    tables: list = []
    _recorders.append(tables)
    try:
        yield tables
    finally:
        _recorders.remove(tables)


def width() -> int:
    """Where tables must fit: the terminal's width, else $COLUMNS, else PIPED_WIDTH."""
    if sys.stdout.isatty():
        return Console(file=sys.stdout).width
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else PIPED_WIDTH


def _stdout_console() -> Console:
    # Built per call: the docs runner and pytest swap sys.stdout, and a Console remembers its file.
    if sys.stdout.isatty():
        return Console(file=sys.stdout, highlight=False)
    return Console(file=sys.stdout, width=width(), color_system=None, highlight=False)


def print_table(table: Table, console: Console | None = None) -> None:
    """Print a Table in the current format (text: on `console`, default stdout's, at its width)."""
    for tables in _recorders:
        tables.append(table)
    if _collected is not None:
        _collected["tables"].append(as_json(table))
        return
    if _format == "markdown":
        (console.file if console else sys.stdout).write(render_markdown(table) + "\n")
        return
    console = console or _stdout_console()
    text = Text(render_text(table, console.width))
    if console.is_terminal:                               # colour only on a terminal: verdicts stand out
        text.highlight_regex(r"\bFAIL\b", "bold red")
    console.print(text, soft_wrap=True)


def table(title: str | None, columns: Sequence[str | Column], rows: Iterable[Sequence], *,
          right: Sequence[str] = ()) -> Table:
    """Print rows under column headers in the current format; returns the Table (see `make_table`)."""
    built = make_table(title, columns, rows, right=right)
    print_table(built)
    return built


def say(text: str = "", *, wrap: bool = True) -> None:
    """A line of text beside the tables (in the json form, a note), wrapped at spaces to the width unless told
    not to (text whose lines must stay as they are, such as a diff)."""
    if _collected is not None:
        if text:
            _collected["notes"].append(text)
        return
    if _format == "markdown":
        if text.strip():
            sys.stdout.write(text.strip("\n") + "\n\n")     # a paragraph of its own
        return
    console = _stdout_console()
    if not wrap:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
        return
    at = console.width
    for part in text.split("\n"):                        # each line wrapped at spaces, its indent kept
        lead = part[:len(part) - len(part.lstrip())]
        wrapped = textwrap.wrap(part, at, subsequent_indent=lead + "  ", break_long_words=False,
                                break_on_hyphens=False) or [""]
        console.print("\n".join(wrapped), markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress(total: int, description: str) -> Iterator:
    """`with progress(n, "what") as step: ... step(label)` once per item; a bar on stderr when it is a terminal."""
    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield lambda label="": None
        return
    bar_width = 20
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=bar_width), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[label]}"))
    # The label (what just finished) gets what the other columns leave, cut short with an ellipsis, so the counts
    # and the time stay whole on a narrow terminal (the 5: a space between columns and one spare).
    room = console.width - len(description) - bar_width - (2 * len(str(total)) + 1) - len("0:00:00") - 5

    def cut(label: str) -> str:
        return label if len(label) <= room else label[:max(0, room - 1)] + "…"

    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total, label="")
        yield lambda label="": bar.update(task, advance=1, label=cut(label))


@contextmanager
def status(text: str) -> Iterator:
    """A spinner with `text` on stderr (terminal only) while a step with no countable items runs."""
    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield
        return
    with console.status(text):
        yield
