"""Every table the command line prints reads whole at 80 columns, on a terminal and piped, and comes as markdown and
JSON for machines (cacheattn/_console.py). `check_table` is what the subcommands' own tests (the tour, the benches)
run on the tables they print, so each real table is checked on the run its test already makes."""

import io
import json
import math
import re

import pytest
from markdown_it import MarkdownIt
from rich.console import Console

from cacheattn import _console
from cacheattn._console import Column, make_table, render_markdown, render_text
from cacheattn.lab.bench_host import HOST_READS

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _flat(text: str) -> str:
    """Whitespace collapsed: a value wrapped at a space still reads whole; one cut inside a word does not."""
    return " ".join(text.split())


def _printed(table, *, terminal: bool, width: int = 80) -> str:
    """The text form as the command prints it: through a rich Console of `width`, a terminal or not (piped)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=terminal, color_system="standard" if terminal else None)
    _console.print_table(table, console)
    return ANSI.sub("", buffer.getvalue())


def _markdown_cells(text: str) -> list[list[str]]:
    """The rows of the one table in `text` as a markdown parser (GFM tables) reads them, header row first."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    rows, row = [], None
    for token in tokens:
        if token.type == "tr_open":
            row = []
        elif token.type == "inline" and row is not None:
            row.append(token.content)
        elif token.type == "tr_close":
            rows.append(row)
            row = None
    return rows


def check_table(table, width: int = 80) -> None:
    """The text form at `width` (terminal and piped) holds every header and cell whole, no line wider than
    `width` unless one word is, and no ellipsis; the markdown form parses to the same cells; the JSON form parses
    and holds every row's raw values under the column keys."""
    headers = [c.header for c in table.columns]
    cells = table.cells()
    for terminal in (True, False):
        text = _printed(table, terminal=terminal, width=width)
        assert "…" not in text, text
        for line in text.splitlines():
            assert len(line) <= width or " " not in line.strip(), (line, text)
        flat = _flat(text)
        for value in headers + [v for row in cells for v in row]:
            assert _flat(value) in flat, (value, text)
    parsed = _markdown_cells(render_markdown(table))
    assert parsed[0] == headers and parsed[1:] == cells, render_markdown(table)
    document = json.loads(json.dumps(_console.as_json(table), allow_nan=False))
    keys = [c.name for c in table.columns]
    assert [col["key"] for col in document["columns"]] == keys and len(set(keys)) == len(keys)
    assert len(document["rows"]) == len(table.rows)
    for got, row in zip(document["rows"], table.rows):
        assert list(got) == keys
        for key, value in zip(keys, row):
            assert got[key] == _as_json_holds(value), (key, got[key], value)


def _as_json_holds(value):
    """What JSON can hold of a value: NumPy scalars as Python numbers, NaN as null, sequences as lists."""
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (tuple, list)):
        return [_as_json_holds(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json_holds(v) for k, v in value.items()}
    return value


LONG = ("step 1 (fill + bias), B3, 4 heads x 64, batch-major K, IA3, 1 finished, fp16, and then some more words "
        "so the cell is wider than any terminal")
SAMPLE = make_table(
    "A title long enough that it has to wrap at eighty columns, which it does at a space and nowhere else at all",
    (Column("operator"), Column("config"), Column("backend"),
     Column("max |err|", "max_error", lambda e: f"{e:.2e}", right=True, means="against float64"),
     Column("result", "passed", lambda ok: "pass" if ok else "FAIL"),
     Column("s", "seconds", lambda s: f"{s:.2f}", right=True, means="seconds"),
     Column("peers", "peers", lambda p: ", ".join(f"{k} {v:.3f}" for k, v in p.items()))),
    [("dynamic_multi_head_attention", LONG, "reference", 1.25e-3, True, 0.5, {"plain | CuPy": 1.0, "rung 2": 2.5}),
     ("dynamic_multi_head_attention", LONG, "numba", float("nan"), False, 31.25, {}),
     ("gpt_attention", "short", "numba", 2.0, True, 1234.5, {"torch SDPA (enable_gqa)": 0.125})])


@pytest.mark.parametrize("width", [80, 60, 200])
def test_a_table_wider_than_the_console_stacks_its_widest_columns_and_keeps_every_cell(width):
    check_table(SAMPLE, width)


def test_stacked_rows_share_their_heading_and_the_grid_stays_aligned():
    text = render_text(SAMPLE, 80)
    assert text.count("step 1 (fill + bias)") == 1          # two rows under one heading
    grid = [line for line in text.splitlines() if "dynamic_multi_head_attention" in line or "gpt_attention" in line]
    assert len(grid) == 3 and len({line.index("numba") if "numba" in line else line.index("reference")
                                   for line in grid}) == 1
    wide = render_text(SAMPLE, 400)                           # room for everything: one line per row
    assert sum(LONG in line for line in wide.splitlines()) == 2


def test_the_leftmost_column_that_is_enough_heads_the_rows():
    """When taking one text column out is enough, the leftmost such column goes (it groups the rows), not the
    widest: here the case heads each case's peers."""
    peers = make_table(None, ("case", "peer", "ms"), [
        (case, peer, f"{ms:.3f}") for case in ("tiny decode B2 ctx12 paged int8", "tiny prefill B1 5 tokens fp16")
        for peer, ms in (("unfused (KeyValueCache + MultiHeadAttention)", 1.5), ("rung 2 (warp per key)", 2.0))],
        right=("ms",))
    lines = render_text(peers, 80).splitlines()
    assert lines[0] == "case" and lines[3] == "tiny decode B2 ctx12 paged int8"
    assert lines[4].split() == ["unfused", "(KeyValueCache", "+", "MultiHeadAttention)", "1.500"]
    check_table(peers)


def test_markdown_escapes_pipes_and_json_keeps_numbers():
    md = render_markdown(SAMPLE)
    assert "max \\|err\\|" in md and "plain \\| CuPy 1.000" in md
    rows = _console.as_json(SAMPLE)["rows"]
    assert rows[0]["max_error"] == 1.25e-3 and rows[1]["max_error"] is None and rows[2]["passed"] is True
    assert rows[0]["peers"] == {"plain | CuPy": 1.0, "rung 2": 2.5}


def test_json_format_prints_one_document_with_tables_and_notes(capsys):
    with _console.output("json"):
        _console.say("a note")
        _console.table("t", ("a", "b"), [(1, "x"), (2, "y")], right=("a",))
    document = json.loads(capsys.readouterr().out)
    assert document == {"tables": [{"title": "t", "columns": [{"key": "a", "header": "a", "means": ""},
                                                               {"key": "b", "header": "b", "means": ""}],
                                    "rows": [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]}], "notes": ["a note"]}
    with pytest.raises(ValueError, match="--format"):
        with _console.output("html"):
            pass


def test_piped_width_is_80_unless_columns_says_otherwise(monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    _console.table(None, ("case",), [("x " * 60,)])
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 80
    monkeypatch.setenv("COLUMNS", "200")
    assert _console.width() == 200


def test_conformance_table_reads_whole():
    """The conformance table of a few real node cases (the reference), the longest case name among them."""
    from cacheattn.onnx_conformance import conformance_table, node_cases, run_case

    cases = node_cases()
    chosen = [cases[0], max(cases, key=lambda c: len(c.name))]
    rows = [(case, {"reference": run_case(case, "reference"), "numba": (False, "ValueError: shown whole")})
            for case in chosen]
    table = conformance_table(rows, ("reference", "numba"))
    check_table(table)
    assert [r["reference"]["passed"] for r in _console.as_json(table)["rows"]] == [True, True]


def test_version_and_no_files_without_out(tmp_path, monkeypatch, capsys):
    """`--version` prints the package's version; `bench --host` (tiny sizes) writes nothing into the current folder
    unless --out names one, and then its two files; gpu-session asks for --out before it runs anything."""
    from importlib.metadata import version

    from cacheattn.__main__ import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"cacheattn {version('cacheattn')}"
    host = ["bench", "--host", "--repeat", "1", "--batch", "2"]
    assert main([*host, "--format", "json"]) == 0
    assert list(tmp_path.iterdir()) == []
    document = json.loads(capsys.readouterr().out)
    # the calls, where host code reads device data, and one call / plan / run per operator that has a plan
    assert [len(t["rows"]) for t in document["tables"]] == [3, len(HOST_READS), 3, 3]
    assert any("simulator" in note for note in document["notes"])
    assert main([*host, "--format", "markdown", "--out", "here"]) == 0
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["host.json", "host.md"]
    printed = capsys.readouterr().out
    assert len(_markdown_cells(printed)) == 2 + 3 + len(HOST_READS) + 2 * (1 + 3)   # every header row and row
    with pytest.raises(SystemExit) as done:
        main(["gpu-session"])
    assert done.value.code == 2 and "--out DIR is needed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"]


def test_docs_command_prints_a_table_of_pages(tmp_path, monkeypatch, capsys):
    from cacheattn.__main__ import main

    page = tmp_path / "page.md"
    page.write_text("```python\nprint(6 * 7)\n```\n\n```text\n42\n```\n")
    assert main(["docs", "--format", "json", str(page)]) == 0
    rows = json.loads(capsys.readouterr().out)["tables"][0]["rows"]
    assert rows == [{"page": str(page), "result": "ok"}]
    page.write_text("```python\nprint(6 * 7)\n```\n\n```text\n41\n```\n")
    assert main(["docs", str(page)]) == 1
    out = capsys.readouterr().out
    assert "1 blocks differ" in out and "but the page shows\n41" in out


def test_gpu_session_summary_prints_its_steps_and_the_tables_it_brought_back(tmp_path, capsys):
    """The session's closing tables: one row per step, then host.json's tables (bench.json's the same way)."""
    from cacheattn.lab.bench_host import host_overhead
    from cacheattn.lab.gpu_session import show_summary

    host_overhead(repeat=1, batch=2, context=8, out_dir=tmp_path, show=False)
    steps = {"gpu-tests": {"status": "passed", "seconds": 12.5, "rc": 0,
                           "findings": {"summary": "41 passed, 2 skipped in 11.9s", "passed": 41, "skipped": 2}},
             "memcheck": {"status": "failed", "seconds": 80.0, "rc": 1,
                          "findings": {"errors": 3, "pytest": {"summary": "1 failed, 9 passed in 70s"}}},
             "kernel-tests": {"status": "skipped", "why": "budget spent: run it with --steps next time"}}
    with _console.recording() as tables:
        show_summary({"steps": steps, "environment": {}, "budget_s": 570}, tmp_path)
    assert [len(t.rows) for t in tables] == [3, 3, len(HOST_READS)]
    for table in tables:
        check_table(table)
    rows = _console.as_json(tables[0])["rows"]
    assert rows[1] == {"step": "memcheck", "status": "failed", "seconds": 80.0,
                       "detail": "sanitizer errors 3; 1 failed, 9 passed in 70s"}
    assert rows[2]["detail"] == "budget spent: run it with --steps next time" and rows[2]["seconds"] is None
    assert "summary.md" in capsys.readouterr().out


def test_gpu_session_dry_run_as_json_lists_every_step(capsys):
    from cacheattn.__main__ import main
    from cacheattn.lab.gpu_session import default_steps

    assert main(["gpu-session", "--dry-run", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["tables"][0]["rows"]
    assert [(r["step"], r["limit_s"], r["command"]) for r in rows] == [
        (s.name, s.timeout_s, list(s.command)) for s in default_steps()]
