"""python -m cacheattn bench --cpu: the NumPy references against onnx's own ReferenceEvaluator (and
onnxruntime, when installed) on the same ONNX Attention problems, measured in one run.

The references are what the tour, the conformance runs and the checking kit execute thousands of
times, so their speed is felt; onnx's evaluator is the peer that computes the same thing in NumPy.
Each timing is the median of `repeat` calls after a warm-up, the contenders taking turns call by
call, so a busy machine slows all of them alike and the ratios stay meaningful.
"""

from __future__ import annotations

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
    Problem("prefill B2 GQA 8/2 S128 D64 causal", 2, 8, 2, 128, 128, 64, 1),
)


def _onnx_model(problem: Problem):
    from onnx import TensorProto, helper

    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=problem.is_causal)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in "QKV"]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


def _contenders(problem: Problem, feeds: dict) -> dict:
    """{name: zero-argument call} for every peer available here."""
    calls = {"cacheattn": lambda: cacheattn.onnx_attention(feeds["Q"], feeds["K"], feeds["V"],
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


def _interleaved_medians(calls: dict, repeat: int) -> dict:
    """Median milliseconds of each call, the calls taking turns."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call()                                                   # warm-up
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


# Short names for the peers' columns; the legend spells them out.
PEER_SHORT = {"onnx ReferenceEvaluator": "onnx", "onnxruntime": "ort"}


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
        reference_y = calls["cacheattn"]()
        for name, call in calls.items():             # the peers compute the same thing, or the timing is moot
            np.testing.assert_allclose(call(), reference_y, rtol=1e-4, atol=1e-5, err_msg=name)
        rows.append((problem.label, _interleaved_medians(calls, repeat)))
    peers = [name for name in rows[0][1] if name != "cacheattn"]
    columns = [_console.Column("problem"), _console.Column("ours ms", "cacheattn_ms", lambda v: f"{v:.3f}",
                                                           right=True, means="the NumPy reference (cacheattn)")]
    for peer in peers:
        short = PEER_SHORT.get(peer, peer)
        columns += [_console.Column(f"{short} ms", f"{peer} ms", lambda v: f"{v:.3f}", right=True, means=peer),
                    _console.Column(f"{short} x", f"{peer} speed", lambda v: f"{v:.2f}x", right=True,
                                    means=f"{peer} time / ours: above 1, the reference is faster")]
    _console.table(f"ONNX Attention, float32, NumPy reference vs peers (median of {repeat}, taking turns)", columns,
                   [(label, ms["cacheattn"], *(v for p in peers for v in (ms[p], ms[p] / ms["cacheattn"])))
                    for label, ms in rows])
    return 0
