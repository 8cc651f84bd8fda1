"""reference.blas: the matrix product every reference uses, whatever the operands' layout."""

import contextlib

import numpy as np
import pytest

from reference import blas
from reference.blas import blas_ready, matmul

from helpers import assert_close

RNG = np.random.default_rng(7)
BASE = RNG.standard_normal((3, 10, 12)).astype(np.float32)                # stacks of 10 x 12 matrices

LAYOUTS = {                                                                 # name: (operand, read in place?)
    "C-contiguous": (BASE[..., :8], True),                                  # rows of 8, leading dimension 12
    "transposed view": (BASE.swapaxes(-1, -2), True),
    "heads of a (tokens, heads, dim) array": (BASE.reshape(10, 3, 3, 4)[:, 0].transpose(1, 0, 2), True),
    "step slice": (BASE[..., ::2], False),
    "broadcast row (stride 0)": (np.broadcast_to(BASE[:, :1], (3, 10, 12)), False),
    "new axis of one row": (BASE[:, 0][:, None, :], False),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_blas_ready_copies_only_what_blas_cannot_read(name):
    x, in_place = LAYOUTS[name]
    ready = blas_ready(x)
    assert (ready is x) == in_place, name
    np.testing.assert_array_equal(ready, x)
    if not in_place:
        assert ready.flags.c_contiguous and ready.strides[-2] == ready.shape[-1] * ready.itemsize


@pytest.mark.parametrize("name", LAYOUTS)
def test_matmul_equals_a_float64_product_for_every_layout(name):
    x, _ = LAYOUTS[name]
    rows, cols = x.shape[-2:]
    right = RNG.standard_normal((x.shape[0], cols, 5)).astype(np.float32)
    left = RNG.standard_normal((x.shape[0], 4, rows)).astype(np.float32)
    x64 = x.astype(np.float64)
    assert_close(f"{name} @ right", matmul(x, right), x64 @ right.astype(np.float64), "float32")
    assert_close(f"left @ {name}", matmul(left, x), left.astype(np.float64) @ x64, "float32")


def test_mid_sized_products_run_on_one_blas_thread(monkeypatch):
    """A product between the thresholds runs under a one-thread limit; a tiny or a large one is left alone."""
    calls = []

    class Controller:
        def limit(self, limits, user_api):
            calls.append((limits, user_api))
            return contextlib.nullcontext()

    monkeypatch.setattr(blas, "_blas_threads", lambda: Controller())
    rng = np.random.default_rng(3)
    for rows, inner, cols, limited in [(1, 64, 64, False), (256, 64, 256, True), (512, 128, 512, False)]:
        a, b = rng.standard_normal((2, rows, inner)), rng.standard_normal((2, inner, cols))
        before = len(calls)
        np.testing.assert_allclose(blas.matmul(a, b), a @ b, rtol=1e-12, atol=1e-12)
        assert (len(calls) - before == 1) == limited, (rows, inner, cols)
    assert set(calls) == {(1, "blas")}
