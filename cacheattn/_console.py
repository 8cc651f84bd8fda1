"""Progress bars and tables for the command line (rich), in one place for every subcommand.

Progress goes to stderr and only when stderr is a terminal, so a piped run, a test's captured
output or a docs page that compares printed text never sees it. Tables go to stdout; when
stdout is not a terminal they are drawn without colour at a fixed width, so the text is the
same from one run to the next.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Wide enough for the conformance table's longest case name and two result columns.
PLAIN_WIDTH = 160


def _stdout_console() -> Console:
    # Built per call: the docs runner and pytest swap sys.stdout, and a Console remembers its file.
    if sys.stdout.isatty():
        return Console(file=sys.stdout)
    return Console(file=sys.stdout, width=PLAIN_WIDTH, color_system=None, highlight=False)


@contextmanager
def progress(total: int, description: str) -> Iterator:
    """`with progress(n, "what") as step: ... step(label)` once per item; a bar on stderr when it is a terminal."""
    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield lambda label="": None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[label]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total, label="")
        yield lambda label="": bar.update(task, advance=1, label=label)


@contextmanager
def status(text: str) -> Iterator:
    """A spinner with `text` on stderr (terminal only) while a step with no countable items runs."""
    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield
        return
    with console.status(text):
        yield


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence], *, right: Sequence[str] = ()) -> None:
    """Print rows under column headers; columns named in `right` are right-aligned (numbers)."""
    out = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left")
    for name in columns:
        out.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    for row in rows:
        out.add_row(*(str(cell) for cell in row))
    _stdout_console().print(out)


def say(text: str = "") -> None:
    """A line of text through the same console as the tables (no markup interpretation)."""
    _stdout_console().print(text, markup=False, highlight=False)
