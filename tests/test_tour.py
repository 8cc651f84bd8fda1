"""The README's main job: `python -m cacheattn tour` serves a tiny model and runs every operator on both backends.

The suite runs `--quick` (a one-layer model serving three requests; the first configuration of each operator on
smaller shapes); the full tour, the README's command, runs 24 operator rows. The run is read in the JSON form
(`--format json`), and the same run's tables and progress bars are checked for what a reader sees."""

import json
import re
from contextlib import contextmanager

import numpy as np
from test_tables import check_table

from cacheattn import _console, serving
from cacheattn.examples import TOLERANCE
from cacheattn.tour import tour

OPERATORS = ("multi_head_cache_attention", "dynamic_multi_head_attention", "key_value_cache", "onnx_attention",
             "gpt_attention", "cross_attention")


def test_tour_passes_every_row(capsys, monkeypatch):
    bars = []

    @contextmanager
    def counting_progress(total, description):          # every bar: its total and how often it advanced
        bar = {"description": description, "total": total, "steps": 0}
        bars.append(bar)
        yield lambda label="": bar.update(steps=bar["steps"] + 1)

    monkeypatch.setattr(_console, "progress", counting_progress)
    with _console.recording() as tables, _console.output("json"):
        assert tour(quick=True) == 0
    document = json.loads(capsys.readouterr().out)
    serving_rows, operator_rows = (t["rows"] for t in document["tables"])
    assert len(operator_rows) == 12 and all(row["passed"] for row in operator_rows), operator_rows
    assert {row["operator"] for row in operator_rows} == set(OPERATORS)
    assert {(row["operator"], row["backend"]) for row in serving_rows} >= {
        ("multi_head_cache_attention", "reference"), ("multi_head_cache_attention", "numba"),
        ("gpt_attention", "reference")}, serving_rows
    assert all(row["tokens_equal_reference"] and row["passed"] for row in serving_rows), serving_rows
    assert f"12 passed, 0 failed; serving loop: {len(serving_rows)} passed, 0 failed" in document["notes"]
    # The legend names every kind of row the table shows, and the tolerances the checks use.
    legend = " ".join(document["notes"])
    kinds = {re.search(r"\(vs [a-z ]+\)$", row["config"]).group(0) for row in operator_rows if "(vs " in row["config"]}
    assert kinds == {"(vs input)", "(vs reference)"} and all(f'"{kind}"' in legend for kind in kinds)
    assert all(f"{TOLERANCE[np.dtype(d)][0]:g} ({d})" in legend for d in ("float16", "float32"))
    # Every table of the run reads whole at 80 columns (terminal and piped; and at 60 and 120), as markdown and
    # as JSON.
    assert len(tables) == 2
    for table in tables:
        for width in (80, 60, 120):
            check_table(table, width)
    # Each serving bar counts the loop's steps and ends full (it once counted tokens and ended at 8/18).
    steps = serving.steps_to_serve(serving.QUICK_REQUESTS)
    serve_bars = [bar for bar in bars if bar["description"] != "operators"]
    assert len(serve_bars) == len(serving_rows) and all(row["steps"] == steps for row in serving_rows)
    assert all(bar["total"] == bar["steps"] == steps for bar in serve_bars), bars
    operators = next(bar for bar in bars if bar["description"] == "operators")
    assert operators["total"] == operators["steps"] == 6


def test_flags_choose_the_backend_and_the_cache_format(capsys, monkeypatch):
    """--backend reference --cache int4: only reference rows, and the serving loop on an int4 OpenPPL cache (the text
    form, piped: 80 columns)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert tour(quick=True, backends=("reference",), cache_bits=4) == 0
    out = capsys.readouterr().out
    assert "OpenPPL int4 cache" in out and " numba " not in out, out
    assert "6 passed, 0 failed; serving loop: 2 passed, 0 failed" in out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out


def test_steps_to_serve_counts_an_idle_start():
    """Requests that all arrive late: the steps before them are counted (and reported) too."""
    late = tuple(serving.Request(r.prompt, r.max_new_tokens, r.arrival_step + 2) for r in serving.QUICK_REQUESTS)
    model = serving.TinyModel(serving.ModelConfig(num_layers=1))
    seen = []
    result = serving.serve(model, late, on_step=lambda i, what: seen.append((i, what)))
    assert result.steps == serving.steps_to_serve(late) == len(seen) == serving.steps_to_serve(
        serving.QUICK_REQUESTS) + 2
    assert seen[:2] == [(0, "idle"), (1, "idle")] and [i for i, _ in seen] == list(range(result.steps))
