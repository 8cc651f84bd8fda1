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


def test_gpu_harness_runs_tiny_in_the_simulator(tmp_path):
    """`bench --tiny`: every line of the GPU harness (rotation, ceilings, peers, JSON, markdown) in the simulator."""
    import json

    from cacheattn.bench_gpu import LADDER_PEERS, TINY_CASES, run_harness

    result = run_harness(tiny=True, out_dir=tmp_path, report=lambda *_: None)
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert [r["label"] for r in saved["rows"]] == [c.label for c in TINY_CASES]
    for row in saved["rows"]:
        assert row["ms"] > 0 and row["gb_per_s"] > 0 and row["tflops"] > 0
        assert set(row["peers_ms"]) == {"unfused (KeyValueCache + MultiHeadAttention)", "reference (NumPy)",
                                        *LADDER_PEERS}
    table = (tmp_path / "bench.md").read_text()
    assert "| case | ms |" in table and "TFLOP/s of rungs 2, 5" in table and all(c.label in table for c in TINY_CASES)
