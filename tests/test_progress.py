"""The long commands (`lab`, `lab --sanitize`, `conformance`, `docs`) show a progress bar on stderr when it is a
terminal, step it once per unit of work, and add nothing when piped: a `--format json` document on stdout stays
clean, and the sanitize tables fit 80 columns."""

import json
import os

import numpy as np
import pytest
from numba import cuda
from test_tables import check_table

from cacheattn import _console, _docs
from cacheattn.__main__ import main

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.fixture
def piped(monkeypatch):
    """stdout and stderr piped, at the default width (pytest captures both; no $COLUMNS, no forced terminal)."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)


def as_terminal(monkeypatch):
    """Make stderr count as a terminal for rich (FORCE_COLOR), as it is when a person runs the command."""
    monkeypatch.setenv("FORCE_COLOR", "1")


def test_a_bar_draws_on_a_terminal_and_nothing_when_piped(piped, monkeypatch, capsys):
    for terminal in (False, True):
        if terminal:
            as_terminal(monkeypatch)
        with _console.progress(3, "counting units") as step:
            for unit in range(3):
                step(f"unit {unit}")
        captured = capsys.readouterr()
        assert captured.out == ""
        assert ("counting units" in captured.err) == terminal, captured.err


def test_docs_steps_once_per_code_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 6\n```\n\nSome words.\n\n```python\nprint(x * 7)\n```\n\n```text\n42\n```\n\n"
                    "```python\ny = x\n```\n")
    steps = []
    assert _docs.count_blocks(page) == 3
    assert _docs.check(page, on_block=steps.append) == []
    assert steps == ["page.md:1", "page.md:7", "page.md:15"]


def test_docs_command_keeps_its_json_clean_with_a_bar_on_stderr(tmp_path, piped, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(6 * 7)\n```\n\n```text\n42\n```\n")
    for terminal in (False, True):
        if terminal:
            as_terminal(monkeypatch)
        assert main(["docs", "--format", "json", str(page)]) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["tables"][0]["rows"] == [{"page": str(page), "result": "ok"}]
        assert ("docs blocks" in captured.err) == terminal


def test_conformance_steps_once_per_case_and_says_how_long_it_takes(piped, monkeypatch, capsys):
    from cacheattn import onnx_conformance

    cases = onnx_conformance.node_cases()[:3]
    monkeypatch.setattr(onnx_conformance, "node_cases", lambda: cases)
    steps = []
    rows = onnx_conformance.results(("reference",), on_case=steps.append)
    assert steps == [case.name for case in cases] and len(rows) == 3
    as_terminal(monkeypatch)
    assert main(["conformance", "--backend", "reference", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert [row["case"] for row in json.loads(captured.out)["tables"][0]["rows"]] == steps
    assert "onnx Attention node cases" in captured.err
    with pytest.raises(SystemExit):
        main(["conformance", "--help"])
    assert "about 7 minutes" in " ".join(capsys.readouterr().out.split())


def _committed_counts(monkeypatch):
    """counters._count answering from the committed run instead of the simulator: (plan, its committed case)."""
    from cacheattn.lab import counters

    plan = counters.plans()[0]                                      # the B = 64 float16 decode
    committed = counters.committed()["cases"][plan.case.label]

    def count(job):
        _, rung, length, _, _ = job
        shown = committed["rungs"][str(rung)]
        return shown["counted"][shown["points"].index(length)]

    monkeypatch.setattr(counters, "_count", count)
    return plan, committed


def test_lab_steps_once_per_counted_launch(monkeypatch):
    from cacheattn.lab import counters

    plan, committed = _committed_counts(monkeypatch)
    steps = []
    result = counters.count_plan(plan, rungs=(2, 3), on_count=steps.append)
    assert len(steps) == counters.launches([plan], (2, 3)) == 4
    assert steps == [f"B64 fp16 rung {rung}, {length} keys" for rung in (2, 3) for length in plan.points]
    for rung in ("2", "3"):                                           # the same figures as counted one by one
        assert result["rungs"][rung]["full"] == committed["rungs"][rung]["full"]


def test_lab_json_stays_clean_with_a_bar_on_stderr(piped, monkeypatch, capsys):
    _committed_counts(monkeypatch)
    command = ["lab", "--case", "decode", "--rung", "3", "--jobs", "1", "--format", "json"]
    for terminal in (False, True):
        if terminal:
            as_terminal(monkeypatch)
        assert main(command) == 0
        captured = capsys.readouterr()
        (table,) = json.loads(captured.out)["tables"]
        assert [c["key"] for c in table["columns"]] == ["metric", "rung_3"]
        assert ("counting launches" in captured.err) == terminal, captured.err
        assert "B64 fp16 rung 3" not in captured.out


# ------------------------------------------------------------------------------------------- lab --sanitize
# Kernels at module level: the simulator swaps the `cuda` a kernel sees among its globals, not in a closure.


@cuda.jit
def copy(src, dst):
    i = cuda.grid(1)
    dst[i] = src[i]


@cuda.jit
def neighbour_sum(src, dst):                      # no barrier between the store and the neighbour's read: a race
    s = cuda.shared.array(32, np.float32)
    t = cuda.threadIdx.x
    s[t] = src[t]
    dst[t] = s[t] + s[(t + 1) % 32]


@cuda.jit
def past_the_end(src, dst):
    i = cuda.grid(1)
    dst[i] = src[i + 32]


@pytest.mark.skipif(not SIMULATOR, reason="the recorder counts in numba's CUDA simulator")
def test_sanitize_tables_fit_80_columns_piped_and_step_once_per_call(piped, monkeypatch, capsys):
    from cacheattn.lab import sanitize

    src = np.random.default_rng(0).standard_normal(32).astype(np.float32)
    long = "a representative call whose label is long enough that the table cannot keep it beside the rest"
    tiny = [sanitize.Call("tiny copy kernel family with a long name, as the operators' families have", long,
                          lambda: copy[1, 32](src, np.zeros(32, np.float32))),
            sanitize.Call("tiny racy kernel", "neighbour sum without a barrier",
                          lambda: neighbour_sum[1, 32](src, np.zeros(32, np.float32))),
            sanitize.Call("tiny failing kernel", "reads past the end of its input",
                          lambda: past_the_end[1, 32](src, np.zeros(32, np.float32)))]
    monkeypatch.setattr(sanitize, "calls", lambda full=False: tiny)

    steps = []
    checked = sanitize.check_calls(tiny, on_call=steps.append)
    assert steps == [f"{call.family}: {call.label}" for call in tiny]
    assert [len(c.hazards) > 0 for c in checked] == [False, True, True] and checked[2].error, checked

    with _console.recording() as tables:
        found = sanitize.sanitize()
    out = capsys.readouterr().out
    findings = sum(len(c.hazards) for c in checked)
    assert found == findings + 1                                    # every finding, and the call that failed
    assert out.splitlines()[-1].startswith(f"{findings} findings, 1 failed calls in 3 calls")
    assert max(len(line) for line in out.splitlines()) <= 80, out
    calls_table, findings_table = tables
    assert [row[1] for row in calls_table.rows] == [call.label for call in tiny]
    shown = " ".join(out.split())
    assert long in shown and "FAILED" in shown and "race: s[" in shown
    assert len(findings_table.rows) == findings + 1
    for table in tables:                  # whole at 80 columns on a terminal too, and as markdown and JSON
        check_table(table)
