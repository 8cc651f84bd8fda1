"""`python -m cacheattn bench` runs where there is no GPU: it says so and times the reference instead."""

from cacheattn.bench import bench


def test_bench_without_gpu_times_the_reference(capsys):
    assert bench(repeat=4) == 0
    out = capsys.readouterr().out
    assert "No GPU" in out and "ms per call" in out


def test_bench_cpu_compares_the_reference_with_onnx(capsys):
    """The CPU bench checks every peer computes the reference's output before it times anything."""
    from cacheattn.bench_cpu import PROBLEMS, bench_cpu

    assert bench_cpu(repeat=1) == 0
    out = capsys.readouterr().out
    assert all(p.label in out for p in PROBLEMS) and "x onnx ReferenceEvaluator" in out, out
