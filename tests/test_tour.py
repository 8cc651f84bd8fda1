"""The README's main job: `python -m cacheattn tour` serves a tiny model and runs every operator on both backends.

The suite runs `--quick` (a one-layer model serving three requests; the first configuration of each operator on
smaller shapes); the full tour, the README's command, runs 24 operator rows."""

from cacheattn.tour import tour

OPERATORS = ("multi_head_cache_attention", "dynamic_multi_head_attention", "key_value_cache", "onnx_attention",
             "gpt_attention", "cross_attention")


def test_tour_passes_every_row(capsys):
    assert tour(quick=True) == 0
    out = capsys.readouterr().out
    # Operator-table rows: operator, then a config (the serving table has the backend second).
    rows = [line for line in out.splitlines() if line.split()[:1] and line.split()[0] in OPERATORS
            and line.split()[1] not in ("reference", "numba")]
    assert len(rows) == 12 and all(" pass " in row for row in rows), out
    assert {row.split()[0] for row in rows} == set(OPERATORS)
    serving = [line.split() for line in out.splitlines() if line.split()[1:2] in (["reference"], ["numba"])
               and line.split()[0] in ("multi_head_cache_attention", "gpt_attention") and len(line.split()) == 10]
    assert {(row[0], row[1]) for row in serving} >= {("multi_head_cache_attention", "reference"),
                                                     ("multi_head_cache_attention", "numba"),
                                                     ("gpt_attention", "reference")}, out
    assert all(row[7] == "yes" and row[8] == "pass" for row in serving), out
    assert f"12 passed, 0 failed; serving loop: {len(serving)} passed, 0 failed" in out


def test_flags_choose_the_backend_and_the_cache_format(capsys):
    """--backend reference --cache int4: only reference rows, and the serving loop on an int4 OpenPPL cache."""
    assert tour(quick=True, backends=("reference",), cache_bits=4) == 0
    out = capsys.readouterr().out
    assert "OpenPPL int4 cache" in out and " numba " not in out, out
    assert "6 passed, 0 failed; serving loop: 2 passed, 0 failed" in out
