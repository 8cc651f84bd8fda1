"""The onnx node test cases for Attention as the conformance bar: `python -m cacheattn conformance`.

Every `test_attention*` case that onnx's own loader builds (`load_model_tests(kind="node")`; the
same cases are built here from onnx's Attention case module alone, which is faster; the `_expanded`
twins carry the same data through the function body, so they are run too)
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

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # building cases runs onnx's reference; some warn about their data
        tests = _attention_node_tests()
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


def _attention_node_tests() -> list:
    """The Attention node tests. `load_model_tests(kind="node")` builds every operator's cases (about 15 s);
    importing only onnx's Attention case module builds its cases alone (its exports run on import and
    register with the node package's list). Falls back to the full loader if that layout ever changes."""
    import importlib

    try:
        importlib.import_module("onnx.backend.test.case.node.attention")
        from onnx.backend.test.case.node import _NodeTestCases
        tests = [t for t in _NodeTestCases if t.name.startswith("test_attention")]
    except (ImportError, AttributeError):
        tests = []
    if not tests:
        from onnx.backend.test.loader import load_model_tests
        tests = [t for t in load_model_tests(kind="node") if t.name.startswith("test_attention")]
    return tests


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


def results(backends=("reference", "numba"), on_case=lambda label: None) -> list[tuple]:
    """[(case, {backend: (passed, detail)})] for every node case; on_case(label) after each case (progress)."""
    rows = []
    for case in node_cases():
        rows.append((case, {backend: run_case(case, backend) for backend in backends}))
        on_case(case.name)
    return rows


def summary(rows, backends) -> list[str]:
    """One line per backend ("reference: 186 of 186 cases pass"), then each failure with its detail."""
    lines = []
    for backend in backends:
        failed = [(case.name, cells[backend][1]) for case, cells in rows if not cells[backend][0]]
        lines.append(f"{backend}: {len(rows) - len(failed)} of {len(rows)} cases pass")
        lines.extend(f"  {name}: {detail}" for name, detail in failed)
    return lines


def _result(cell: dict) -> str:
    """A backend's cell: "pass" and the largest error, or "FAIL" and why."""
    if cell["passed"]:
        return "pass " + cell["detail"].removeprefix("max |err| ")
    return "FAIL " + cell["detail"]


def conformance_table(rows, backends):
    """The rows of `results` as a table: case, opset, and each backend's verdict with its largest |err|."""
    from . import _console

    columns = (_console.Column("case"), _console.Column("opset", right=True),
               *(_console.Column(b, show=_result, means="the same" if n else "pass and the largest |err| of any "
                                 "output against the case's expected one, or FAIL and why")
                 for n, b in enumerate(backends)))
    return _console.make_table(None, columns, [
        (case.name, case.opset, *({"passed": cells[b][0], "detail": cells[b][1]} for b in backends))
        for case, cells in rows])


def conformance(backends=("reference", "numba")) -> int:
    """Run every case with a progress bar (on a terminal), print the table and a total; returns the failures."""
    from . import _console

    with _console.status("loading the onnx node test cases (onnx builds every operator's cases)"):
        count = len(node_cases())
    with _console.progress(count, "onnx Attention node cases") as step:
        rows = results(backends, on_case=step)
    _console.print_table(conformance_table(rows, backends))
    for line in summary(rows, backends):
        _console.say(line)
    return sum(not cells[b][0] for _, cells in rows for b in backends)
