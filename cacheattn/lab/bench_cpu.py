"""python -m cacheattn bench --cpu: the NumPy references against onnx's own ReferenceEvaluator (and
onnxruntime, when installed) on the same ONNX Attention problems, measured in one run.

The references are what the tour, the conformance runs and the checking kit execute thousands of
times, so their speed is felt; onnx's evaluator is the peer that computes the same thing in NumPy, and
onnxruntime the compiled one. Each problem is timed in `repeat` rounds after a warm-up; in a round every
contender is called once, one after the other, starting with a different one each round (so none always
runs right after another one's threads). A busy machine then slows all of them alike, and the ratio of a
peer's time to ours within a round stays meaningful: the table gives its median and spread over the rounds.

On a machine shared with other work, a multi-threaded BLAS (NumPy's, under ours and the evaluator) waits at
every product for its threads to get a core, and its times spread widely; onnxruntime schedules its own threads.
`OPENBLAS_NUM_THREADS=1 python -m cacheattn bench --cpu` times the NumPy contenders on one BLAS thread; the
table's title says which setting was in force.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

import cacheattn


@dataclass(frozen=True)
class Problem:
    label: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_size: int
    is_causal: int


PROBLEMS = (
    Problem("decode B1 H8 T1024 D64", 1, 8, 8, 1, 1024, 64, 0),
    Problem("decode B4 GQA 32/8 T512 D128", 4, 32, 8, 1, 512, 128, 0),
    Problem("prefill B1 H8 S256 D64 causal", 1, 8, 8, 256, 256, 64, 1),
    Problem("prefill B2 H8 S256 D64 causal", 2, 8, 8, 256, 256, 64, 1),
    Problem("prefill B2 GQA 8/2 S128 D64 causal", 2, 8, 2, 128, 128, 64, 1),
    Problem("prefill B1 GQA 16/4 S512 D128 causal", 1, 16, 4, 512, 512, 128, 1),
)

OURS = "cacheattn"


def _onnx_model(problem: Problem):
    from onnx import TensorProto, helper

    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=problem.is_causal)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in "QKV"]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


def _contenders(problem: Problem, feeds: dict) -> dict:
    """{name: zero-argument call} for every peer available here, ours first."""
    calls = {OURS: lambda: cacheattn.onnx_attention(feeds["Q"], feeds["K"], feeds["V"],
                                                    is_causal=problem.is_causal).Y}
    from onnx.reference import ReferenceEvaluator

    evaluator = ReferenceEvaluator(_onnx_model(problem))
    calls["onnx ReferenceEvaluator"] = lambda: evaluator.run(None, feeds)[0]
    try:
        import onnxruntime
    except ImportError:
        return calls
    try:
        session = onnxruntime.InferenceSession(_onnx_model(problem).SerializeToString(),
                                               providers=["CPUExecutionProvider"])
    except Exception as exc:  # an onnxruntime without opset-24 Attention: say so, time the others
        from .. import _console
        _console.say(f"onnxruntime cannot run this model: {type(exc).__name__}")
        return calls
    calls["onnxruntime"] = lambda: session.run(None, feeds)[0]
    return calls


def blas_threads() -> str:
    """The BLAS thread setting NumPy was started with, as the environment gives it, or "default"."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(name):
            return f"{name}={os.environ[name]}"
    return "default"


def _rounds(calls: dict, repeat: int) -> dict:
    """{name: milliseconds of each round}, after one warm-up call each. Round r starts with the r-th contender
    (then the next ones, wrapping around), so that each one follows each of the others equally often."""
    names = list(calls)
    times = {name: [] for name in names}
    for call in calls.values():
        call()                                                   # warm-up
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _spread(values) -> tuple[float, float, float]:
    """(median, min, max)."""
    return float(np.median(values)), float(np.min(values)), float(np.max(values))


def rows_of(label: str, times: dict) -> list[tuple]:
    """One row per contender: (problem, contender, median ms, min ms, max ms, (median, min, max) over the rounds of
    the contender's time / ours in the same round)."""
    ours = np.asarray(times[OURS])
    return [(label, name, *_spread(ms), _spread(np.asarray(ms) / ours)) for name, ms in times.items()]


def bench_cpu(repeat: int = 20) -> int:
    from .. import _console

    try:
        import onnx  # noqa: F401
    except ImportError:
        _console.say("bench --cpu compares with onnx's ReferenceEvaluator: pip install onnx (it is in the test extra)")
        return 1
    rng = np.random.default_rng(0)
    rows = []
    for problem in PROBLEMS:
        shape = (problem.batch, problem.q_heads, problem.q_len, problem.head_size)
        kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_size)
        feeds = {"Q": rng.standard_normal(shape).astype(np.float32),
                 "K": rng.standard_normal(kv_shape).astype(np.float32),
                 "V": rng.standard_normal(kv_shape).astype(np.float32)}
        calls = _contenders(problem, feeds)
        reference_y = calls[OURS]()
        for name, call in calls.items():             # the peers compute the same thing, or the timing is moot
            np.testing.assert_allclose(call(), reference_y, rtol=1e-4, atol=1e-5, err_msg=name)
        rows += rows_of(problem.label, _rounds(calls, repeat))
    ms = lambda v: f"{v:.2f}"
    columns = [_console.Column("problem"),
               _console.Column("contender", means=f"{OURS}: the NumPy reference (ours)"),
               _console.Column("median", "median_ms", ms, right=True, means="milliseconds per call"),
               _console.Column("min", "min_ms", ms, right=True),
               _console.Column("max", "max_ms", ms, right=True),
               _console.Column("time / ours", "time_over_ours", lambda v: f"{v[0]:.2f}x [{v[1]:.2f}, {v[2]:.2f}]",
                               right=True, means="the contender's time over ours in the same round, median "
                                                 "[min, max] over the rounds: above 1, the reference is faster")]
    _console.table(f"ONNX Attention, float32, NumPy reference vs peers; ms per call, median [min, max] of {repeat} "
                   f"rounds taking turns; BLAS threads: {blas_threads()}", columns, rows)
    return 0
