"""`python -m cacheattn bench` runs where there is no GPU: it says so and times the reference instead."""

import numpy as np
from test_tables import check_table

from cacheattn import _console
from cacheattn.lab.bench import bench


def test_bench_without_gpu_times_the_reference(capsys):
    assert bench(repeat=4) == 0
    out = " ".join(capsys.readouterr().out.split())          # lines wrapped at 80 columns, words whole
    assert "No GPU" in out and "ms per call" in out


def test_bench_cpu_compares_the_reference_with_onnx(capsys):
    """The CPU bench checks every peer computes the reference's output before it times anything, then gives each
    problem a row per contender: its milliseconds and its time over ours in the same rounds, median [min, max]."""
    from cacheattn.lab.bench_cpu import OURS, PROBLEMS, bench_cpu

    with _console.recording() as tables:
        assert bench_cpu(repeat=2) == 0
    out = " ".join(capsys.readouterr().out.split())          # lines wrapped at 80 columns, words whole
    assert all(p.label in out for p in PROBLEMS) and "median [min, max] of 2 rounds" in out, out
    (table,) = tables
    check_table(table)
    rows = _console.as_json(table)["rows"]
    assert list(dict.fromkeys(r["problem"] for r in rows)) == [p.label for p in PROBLEMS]
    for problem in PROBLEMS:
        mine = [r for r in rows if r["problem"] == problem.label]
        assert [r["contender"] for r in mine][:2] == [OURS, "onnx ReferenceEvaluator"]
        for r in mine:
            assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            low, high = r["time_over_ours"][1:]
            assert 0 < low <= r["time_over_ours"][0] <= high
        assert mine[0]["time_over_ours"] == [1.0, 1.0, 1.0]


def test_bench_cpu_rounds_take_turns():
    """Each round starts with the next contender, so none always runs right after the same other one."""
    from cacheattn.lab.bench_cpu import _rounds

    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times = _rounds(calls, repeat=3)
    assert order == list("abc") + list("abc") + list("bca") + list("cab")       # warm-up, then 3 rounds
    assert all(len(ms) == 3 and min(ms) >= 0 for ms in times.values())


def test_gpu_harness_runs_tiny_in_the_simulator(tmp_path, monkeypatch, capsys):
    """`bench --tiny --out DIR`: every line of the GPU harness (rotation, ceilings, peers, JSON, markdown) in the
    simulator, from the command line; nothing lands outside DIR, and its printed tables read whole."""
    import json

    from cacheattn.__main__ import main
    from cacheattn.lab.bench_gpu import LADDER_PEERS, TINY_CASES, markdown_table

    monkeypatch.chdir(tmp_path)
    with _console.recording() as tables:
        assert main(["bench", "--tiny", "--out", "out"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["label"] for r in saved["rows"]] == [c.label for c in TINY_CASES]
    for row in saved["rows"]:
        assert row["ms"] > 0 and row["gb_per_s"] > 0 and row["tflops"] > 0
        assert set(row["peers_ms"]) == {"unfused (KeyValueCache + MultiHeadAttention)", "reference (NumPy)",
                                        *LADDER_PEERS}
    table = (tmp_path / "out" / "bench.md").read_text()
    assert table == markdown_table(saved) and "| case | ms | host ms |" in table and "| case | peer | ms |" in table
    assert all(c.label in table for c in TINY_CASES) and all(name in table for name in LADDER_PEERS)
    assert len(tables) == 2 and len(tables[1].rows) == sum(len(r["peers_ms"]) for r in saved["rows"])
    for t in tables:
        check_table(t)
    assert "numba CUDA simulator" in capsys.readouterr().out
    check_bench_plot(saved)


def check_bench_plot(result):
    """The docs' plot of a run (cacheattn.figures.bench_plot): a bar for our kernel and every timed rung or peer of
    each case, at its share of the nearer ceiling; a peer recorded as not measured (NaN) gets no bar."""
    import math
    import xml.etree.ElementTree as ET

    from cacheattn.figures import bench_plot

    result["rows"][0]["peers_ms"]["FlashInfer"] = math.nan
    svg = bench_plot(result)
    assert ET.fromstring(svg).tag.endswith("svg")
    for row in result["rows"]:
        share = max(row["gb_per_s"] / result["copy_bandwidth_gb_per_s"], row["tflops"] / result["fp16_matmul_tflops"])
        assert row["label"] in svg and f"{100 * share:.1f}%  {row['ms']:.3f} ms" in svg
    timed = sum(1 + sum(ms == ms for ms in row["peers_ms"].values()) for row in result["rows"])
    assert svg.count("<rect") == timed + 1 and "FlashInfer" not in svg     # + the 100% line


def test_bench_host_counts_launches_parameters_and_device_reads(tmp_path):
    """`bench --host` on small decode calls: every operator launches, numba's flattened parameters are counted, and
    the device index tensors are read back exactly once each (gpt_attention used to read two of them twice)."""
    import json

    from cacheattn.lab.bench_host import host_cases, host_overhead, kernel_parameters

    assert kernel_parameters((np.zeros((2, 3)), np.int64(1), 2.0)) == 5 + 2 * 2 + 1 + 1
    with _console.recording() as tables:
        rows = host_overhead(repeat=2, batch=2, context=8, out_dir=tmp_path)
    assert [r["label"] for r in rows] == [c.label for c in host_cases(2, 8)]
    for row, case in zip(rows, host_cases(2, 8)):
        assert row["launches"] == len(row["kernels"]) >= 1 and row["parameters"] > 40 * row["launches"]
        assert row["device_reads"] == len(case.device_index)
        assert 0 < row["validation_us"] and 0 < row["host_us"]
    saved = json.loads((tmp_path / "host.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and "CPU figures" in (tmp_path / "host.md").read_text()
    # gpt_attention and multi_head_cache_attention planned once and run per layer: the plan reads the device
    # index tensors, run none, and launches what the one call launches.
    planned = [c for c in host_cases(2, 8) if c.operator in ("gpt_attention", "multi_head_cache_attention")]
    assert [p["label"] for p in saved["per_layer"]] == [c.label for c in planned]
    for per_layer, case in zip(saved["per_layer"], planned):
        assert per_layer["plan_reads"] == len(case.device_index) and per_layer["run_reads"] == 0
        assert per_layer["run_launches"] == next(r["launches"] for r in rows if r["label"] == case.label)
        assert all(0 < us[1] <= us[0] <= us[2] for us in (per_layer["one_call_us"], per_layer["plan_us"],
                                                          per_layer["run_us"]))
    assert len(tables) == 2 + len(planned)
    for table in tables:
        check_table(table)


def test_flashinfer_peer_is_skipped_with_a_note_when_not_installed(monkeypatch):
    """Without FlashInfer the decode rows record it as not measured and the table says so; prefill has no entry."""
    import sys

    from cacheattn.lab.bench_gpu import GPU_CASES, flashinfer_peer, markdown_table

    monkeypatch.setitem(sys.modules, "flashinfer", None)          # import fails as if not installed
    decode, prefill = GPU_CASES[0], GPU_CASES[-1]
    assert decode.new_tokens == 1 and prefill.new_tokens > 1
    peer = flashinfer_peer(None, decode, repeat=1)
    assert list(peer) == ["FlashInfer (not installed)"] and np.isnan(peer["FlashInfer (not installed)"])
    assert flashinfer_peer(None, prefill, repeat=1) == {}
    row = dict(label="decode", ms=1.0, host_ms=0.1, gb_per_s=1.0, bandwidth_share=0.5, tflops=1.0,
               peers_ms={"plain CuPy": 2.0, **peer})
    table = markdown_table({"device": {"device": "test"}, "copy_bandwidth_gb_per_s": 2.0, "fp16_matmul_tflops": 1.0,
                            "repeat": 1, "rows": [row]})
    assert "| decode | plain CuPy | 2.000 | 2.00x | 0.50 |" in table
    assert "| decode | FlashInfer (not installed) | - | - | - |" in table
    assert table.rstrip().endswith("Not measured: FlashInfer (not installed).")
