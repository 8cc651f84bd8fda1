"""The README's main job: `python -m cacheattn tour` runs every operator on both backends and passes.

The suite runs `--quick` (the same configurations on smaller shapes); the full tour is the README's command."""

from cacheattn.tour import tour


def test_tour_passes_every_row(capsys):
    assert tour(quick=True) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[:1] and line.split()[0] in (
        "multi_head_cache_attention", "dynamic_multi_head_attention", "key_value_cache", "onnx_attention")]
    assert len(rows) == 16 and all(" pass " in row for row in rows), out
    assert {row.split()[0] for row in rows} >= {"multi_head_cache_attention", "onnx_attention"}
    assert "16 passed, 0 failed" in out
