"""The onnx node test cases for Attention (onnx >= 1.23.2), on the reference and on the kernels.

Every case runs on the reference. An `_expanded` twin carries the same inputs, attributes and expected
outputs as its twin (the test below checks that), so on the kernels the twin's result stands for both,
and the simulator time goes to distinct cases: every third of them here, all 93 in a long hunt. The kernels
run with 32-thread blocks here: the simulator spends its time on threads, and every strided loop of a
block then wraps more often, not less.
"""

import os

import numpy as np
import pytest

from cacheattn.onnx_conformance import node_cases, run_case

CASES = {case.name: case for case in node_cases()}
DISTINCT = [name for name in CASES if not name.endswith("_expanded")]
# The kernels run every third distinct case here (each costs 1-2 s in the simulator, and the kit's ONNX
# property test already draws the attribute space); CACHEATTN_EXAMPLES >= 3 or `python -m cacheattn
# conformance` runs all 93.
KERNEL_CASES = DISTINCT if int(os.environ.get("CACHEATTN_EXAMPLES", "1")) >= 3 else DISTINCT[::3]


def test_all_node_cases_are_loaded():
    assert len(CASES) == 186 and len(DISTINCT) == 93
    assert {c.opset for c in CASES.values()} == {23, 24, 25}


@pytest.mark.spec("onnx/pattern", "onnx/scale", "onnx/softcap", "onnx/is-causal-top-left", "onnx/causal-with-mask",
                  "onnx/qk-output-modes", "onnx/qk-output-shape", "onnx/softmax-precision", "onnx/self-cross",
                  "onnx/opset23-one-bias", "onnx/bias-sources", "onnx/types", "onnx/y-shape")
@pytest.mark.parametrize("name", list(CASES))
def test_reference_passes_node_case(name):
    ok, detail = run_case(CASES[name], "reference")
    assert ok, detail


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernels_pass_node_case(name):
    ok, detail = run_case(CASES[name], "numba", threads=32)
    assert ok, detail


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("_expanded")])
def test_expanded_twin_has_its_twins_data(name):
    twin, expanded = CASES[name.removesuffix("_expanded")], CASES[name]
    assert (twin.opset, twin.attrs) == (expanded.opset, expanded.attrs)
    for a, b in ((twin.inputs, expanded.inputs), (twin.outputs, expanded.outputs)):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key], equal_nan=True), key
