"""`python -m cacheattn bench` runs where there is no GPU: it says so and times the reference instead."""

from cacheattn.bench import bench


def test_bench_without_gpu_times_the_reference(capsys):
    assert bench(repeat=4) == 0
    out = capsys.readouterr().out
    assert "No GPU" in out and "ms per call" in out
