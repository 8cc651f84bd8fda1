"""`python -m cacheattn bench --cpu`'s second table: every operator's reference at serving shapes (tiny here)."""

from test_tables import check_table

from cacheattn import _console
from cacheattn.lab.bench_reference import TINY, bench_reference, cases


def test_bench_reference_times_every_operator(capsys):
    labels = list(cases(TINY))
    assert {label.split()[0] for label in labels} == {"PPL", "ONNX", "TRT-LLM", "FT"}
    with _console.recording() as tables:
        times = bench_reference(repeat=2, shapes=TINY, clock="cpu")
    out = capsys.readouterr().out
    assert list(times) == labels and all(len(ms) == 2 and min(ms) >= 0 for ms in times.values())
    assert all(label in out for label in labels) and "median [min, max] of 2" in out
    (table,) = tables
    assert [row[0] for row in table.rows] == labels
    check_table(table)
    only = bench_reference(repeat=1, shapes=TINY, only="ONNX")
    assert list(only) == [label for label in labels if "ONNX" in label]
