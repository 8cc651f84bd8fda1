"""Read-and-run pages: a docs page is Markdown whose ```python blocks run top to bottom in one namespace.

A ```text block right after a python block holds what that block prints. `check` runs a page
and reports every block whose output differs from the page; `update` rewrites the text blocks
with what the run printed. So every output a reader sees was produced by the code beside it.
A shown output must show something: an empty text block, or a block that now prints nothing
where the page shows output, fails the check (code that filters its own source for a line that
has since gone prints nothing, and the page would otherwise point at an empty box).

The comparison is exact for the words and line structure, and numeric for the numbers: the last
digits of a float depend on which BLAS kernels the CPU gets (OpenBLAS picks AVX-512 code on one
machine and AVX2 on another), and NumPy pads printed arrays to the widest element. So a number on
the page matches a printed number within a relative 1e-6 (integers match exactly), and a run of
spaces matches any other run of spaces.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

_BLOCK = re.compile(r"^```(python|text)\n(.*?)^```\n", re.S | re.M)
# A decimal number; [^\W\d_] keeps digits inside names (float16, sm_90, e4m3) from starting a number.
_NUMBER = re.compile(r"(?<![^\W\d_])[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
_SPACES = re.compile(r"[ \t]+")
NUMBER_RTOL = 1e-6


@dataclass
class Block:
    code: str
    code_line: int
    output: str | None        # the page's text block, None when the page shows none
    output_span: tuple | None  # (start, end) of that text block's body in the page
    printed: str = ""


def parse(page: str) -> list[Block]:
    blocks, last_end = [], None
    for m in _BLOCK.finditer(page):
        kind, body = m.group(1), m.group(2)
        if kind == "python":
            blocks.append(Block(body, page.count("\n", 0, m.start()) + 1, None, None))
        elif blocks and blocks[-1].output is None and page[last_end:m.start()].strip() == "":
            blocks[-1].output, blocks[-1].output_span = body, (m.start(2), m.end(2))
        last_end = m.end()
    return blocks


def count_blocks(path: Path) -> int:
    """How many python blocks `run` executes on the page (a progress bar's total)."""
    return len(parse(path.read_text()))


def run(path: Path, on_block=None) -> list[Block]:
    """Execute every python block of the page in order; each block's stdout goes to .printed.
    on_block(label) is called after each block ("page.md:line"), a progress bar's step."""
    blocks = parse(path.read_text())
    namespace = {"__name__": f"docs.{path.stem}"}
    for block in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, f"{path}:{block.code_line}", "exec"), namespace)
        block.printed = out.getvalue()
        if on_block is not None:
            on_block(f"{path.name}:{block.code_line}")
    return blocks


def _split(text: str) -> tuple[list[str], list[str]]:
    """(the text between numbers, spaces collapsed; the numbers as written), trailing whitespace dropped."""
    lines = [_SPACES.sub(" ", line).strip(" ") for line in text.rstrip().splitlines()]
    text = "\n".join(lines)
    return [part.strip(" ") for part in _NUMBER.split(text)], _NUMBER.findall(text)


def _numbers_agree(shown: str, printed: str) -> bool:
    if not any(c in shown + printed for c in ".eE"):       # both integers: counts, indices, line numbers
        return int(shown) == int(printed)
    a, b = float(shown), float(printed)
    return a == b or abs(a - b) <= NUMBER_RTOL * max(abs(a), abs(b))


def same_output(shown: str, printed: str) -> bool:
    """Whether a page's shown output stands for what the code printed (see the module docstring)."""
    (shown_text, shown_numbers), (printed_text, printed_numbers) = _split(shown), _split(printed)
    return (shown_text == printed_text and len(shown_numbers) == len(printed_numbers)
            and all(_numbers_agree(a, b) for a, b in zip(shown_numbers, printed_numbers)))


def check(path: Path, on_block=None) -> list[str]:
    """Differences between what the page shows and what its code prints, one message per block, each naming the
    page, the block's number on it and its first line. An output block must show something: an empty one fails,
    and so does a block that prints nothing where the page shows output."""
    problems = []
    for number, block in enumerate(run(path, on_block), 1):
        where = f"{path}:{block.code_line}: block {number}"
        if block.output is not None and not block.output.strip():
            problems.append(f"{where} has an empty output block: a shown output must show something (it prints "
                            f"{'nothing' if not block.printed.strip() else repr(block.printed)})")
        elif block.output is not None and not block.printed.strip():
            problems.append(f"{where} prints nothing, but the page shows\n{block.output}")
        elif block.output is not None and not same_output(block.output, block.printed):
            problems.append(f"{where} prints\n{block.printed}\nbut the page shows\n{block.output}")
        elif block.output is None and block.printed.strip():
            problems.append(f"{where} prints output the page does not show")
    return problems


def update(path: Path, on_block=None) -> int:
    """Rewrite the page's text blocks (adding missing ones) with what the code prints; returns blocks changed. A
    block that prints nothing keeps its shown output: `check` then names it."""
    page = path.read_text()
    blocks = run(path, on_block)
    changed = 0
    for block in reversed(blocks):       # back to front keeps the earlier spans valid
        printed = block.printed.rstrip() + "\n"
        if block.output_span is not None:
            if block.printed.strip() and not same_output(block.output, printed):
                start, end = block.output_span
                page = page[:start] + printed + page[end:]
                changed += 1
        elif block.printed.strip():
            code_start = page.index(block.code)
            insert_at = page.index("```\n", code_start + len(block.code)) + 4
            page = page[:insert_at] + "\n```text\n" + printed + "```\n" + page[insert_at:]
            changed += 1
    path.write_text(page)
    return changed


def pages(root: Path) -> list[Path]:
    return sorted((root / "docs").glob("*.md"))


# Helpers the rung pages call to show code: a function as a GPU compiles it, and a diff of chosen regions.

def _defs(tree, name, simulated=False):
    """(node, under the simulator's branch) of every top-level or if-nested def/assignment named `name`."""
    import ast

    found = []

    def visit(body, in_simulated):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                found.append((node, in_simulated))
            elif isinstance(node, ast.If):
                is_switch = isinstance(node.test, ast.Name) and node.test.id == "SIMULATED"
                visit(node.body, in_simulated or is_switch)
                visit(node.orelse, in_simulated)
    visit(tree.body, False)
    return found


def definition(module, name: str) -> str:
    """The source of the def `name` in `module` as a GPU compiles it: where the module defines it twice, under
    `if SIMULATED:` (NumPy stand-ins for the simulator) and `else:`, the `else:` one. Dedented, its decorators
    included, headed by a comment naming the file and line."""
    import ast
    import inspect
    import textwrap

    text = inspect.getsource(module)
    found = _defs(ast.parse(text), name)
    if not found:
        raise ValueError(f"name: {module.__name__} defines no function {name!r}")
    node = next((node for node, simulated in found if not simulated), found[0][0])
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    body = textwrap.dedent("\n".join(text.splitlines()[first - 1:node.end_lineno]))
    where = module.__name__.replace(".", "/") + ".py"
    return f"# {where}:{first}\n{body}"


def region(text: str, start: str, end: str) -> list[str]:
    """The lines of `text` from the first holding `start` through the first line after it holding `end`."""
    lines = text.splitlines()
    first = next((k for k, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"start: no line holds {start!r}")
    last = next((k for k in range(first, len(lines)) if end in lines[k]), None)
    if last is None:
        raise ValueError(f"end: no line after {start!r} holds {end!r}")
    return lines[first:last + 1]


def curated_diff(old: str, new: str, *regions) -> str:
    """A diff of chosen regions of two sources, not of the whole files: each region is
    (label, (old start, old end), (new start, new end)), the markers as `region` takes them. Each region's diff is
    headed `@@ label @@` and keeps the lines both sides share as context."""
    import difflib

    shown = []
    for label, (old_start, old_end), (new_start, new_end) in regions:
        a, b = region(old, old_start, old_end), region(new, new_start, new_end)
        lines = difflib.unified_diff(a, b, lineterm="", n=max(len(a), len(b)))
        shown.append(f"@@ {label} @@")
        shown.extend(line for line in lines if not line.startswith(("---", "+++", "@@")))
    return "\n".join(shown)
