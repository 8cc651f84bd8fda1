"""The onnx node test cases for Attention as the conformance bar: `python -m cacheattn conformance`.

Every `test_attention*` case that onnx's own loader builds (`load_model_tests(kind="node")`;
the `_expanded` twins carry the same data through the function body, so they are run too)
is fed to `cacheattn.onnx_attention` by input name, with the node's attributes, and its
outputs are compared with the stored expected outputs at the case's rtol/atol.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

import cacheattn

# The kernels compute in float32 (bfloat16 inputs are widened to float32 and the output rounded back),
# where onnx's reference computes in the input dtype; a half-precision result can then differ in its
# last place. These are the (rtol, atol) the kernel comparisons use for those dtypes, instead of the
# case's own 1e-3 / 1e-7.
KERNEL_TOLERANCE = {"float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1e-2)}
INPUT_NAMES = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")


@dataclass
class NodeCase:
    name: str
    opset: int
    attrs: dict
    inputs: dict            # ONNX input name -> array, omitted optional inputs absent
    outputs: dict           # ONNX output name -> expected array
    rtol: float
    atol: float


@lru_cache(maxsize=1)
def node_cases() -> tuple:
    """All Attention node cases, expanded twins included, as NodeCase."""
    import onnx
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the loader builds every op's cases; some warn about their data
        tests = [t for t in load_model_tests(kind="node") if t.name.startswith("test_attention")]
    # An `_expanded` graph replaces the node by its function body; its twin's node gives the interface.
    nodes = {t.name: next(n for n in t.model.graph.node if n.op_type == "Attention")
             for t in tests if not t.name.endswith("_expanded")}
    cases = []
    for test in tests:
        graph = test.model.graph
        node = nodes[test.name.removesuffix("_expanded")]
        opset = next(o.version for o in test.model.opset_import if o.domain in ("", "ai.onnx"))
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        for data_in, data_out in test.data_sets:
            graph_inputs = [i.name for i in graph.input]
            by_graph = dict(zip(graph_inputs, data_in))
            inputs = {onnx_name: by_graph[graph_name] for onnx_name, graph_name in zip(INPUT_NAMES, node.input)
                      if graph_name}
            graph_outputs = [o.name for o in graph.output]
            by_out = dict(zip(graph_outputs, data_out))
            out_names = ("Y", "present_key", "present_value", "qk_matmul_output")
            outputs = {onnx_name: by_out[graph_name] for onnx_name, graph_name in zip(out_names, node.output)
                       if graph_name}
            cases.append(NodeCase(test.name, opset, attrs, inputs, outputs, test.rtol, test.atol))
    return tuple(cases)


def run_case(case: NodeCase, backend: str, threads: int = 128) -> tuple[bool, str]:
    """(passed, detail) for one case on one backend (threads: the kernels' block size)."""
    kwargs = {k: v for k, v in case.attrs.items()}
    if "softcap" in kwargs:
        kwargs["softcap"] = float(kwargs["softcap"])
    try:
        got = cacheattn.onnx_attention(**case.inputs, **kwargs, opset=case.opset,
                                       return_qk_matmul_output="qk_matmul_output" in case.outputs, backend=backend,
                                       threads=threads)
    except Exception as exc:  # reported in the table, never hidden
        return False, f"{type(exc).__name__}: {exc}"
    worst = []
    for name, want in case.outputs.items():
        have = np.asarray(getattr(got, name))
        rtol, atol = case.rtol, case.atol
        dtype = np.dtype(want.dtype).name
        if backend == "numba" and dtype in KERNEL_TOLERANCE:
            rtol, atol = KERNEL_TOLERANCE[dtype]
        if have.shape != want.shape:
            return False, f"{name}: shape {have.shape}, expected {want.shape}"
        h, w = have.astype(np.float64), want.astype(np.float64)
        same = (h == w) | (np.isnan(h) & np.isnan(w))                 # equal infinities (masked scores) too
        with np.errstate(invalid="ignore"):
            err = np.where(same, 0.0, np.abs(h - w))
        bad = ~same & ~(err <= atol + rtol * np.abs(w))
        if bad.any():
            return False, f"{name}: {int(bad.sum())} of {bad.size} differ, max |err| {np.nanmax(err):.3g}"
        worst.append(float(err.max(initial=0.0)))
    return True, f"max |err| {max(worst):.2e}"


def conformance(backends=("reference", "numba"), report=print) -> int:
    """Print the table (case, opset, one column per backend) and a total; returns the number of failures."""
    cases = node_cases()
    width = max(len(c.name) for c in cases)
    report(f"{'case':<{width}} opset " + " ".join(f"{b:<24}" for b in backends))
    failures = {b: [] for b in backends}
    for case in cases:
        cells = []
        for backend in backends:
            ok, detail = run_case(case, backend)
            if not ok:
                failures[backend].append((case.name, detail))
            cells.append(f"{'pass' if ok else 'FAIL'} {detail}"[:24].ljust(24))
        report(f"{case.name:<{width}} {case.opset:>5} " + " ".join(cells))
    report("")
    for backend in backends:
        report(f"{backend}: {len(cases) - len(failures[backend])} of {len(cases)} cases pass")
        for name, detail in failures[backend]:
            report(f"  {name}: {detail}")
    return sum(len(f) for f in failures.values())
