"""No kernel writes outside its arrays: every array a call sees lives inside a larger allocation with guard bands.

Each input and in-place tensor (caches, scales, page tables) is copied into the middle of an allocation whose
guard bands before and after hold a sentinel byte (NaN bits for floats, so a read past an edge poisons the
result), and every buffer the launchers allocate (outputs and scratch) is made the same way
(`_launch.guarded_outputs`). After the call every guard band must be bit-identical, and the results must still
pass the same checks as the kernel tests (the conformance kit for the OpenPPL, ONNX and FasterTransformer
operators; float64 and the reference's cache for gpt_attention).

On a GPU (CACHEATTN_TEST_GPU=1) the allocations are CuPy's and the guard bands 4 KiB, where a stray write
lands in memory the sanitizer's memcheck cannot see (the CuPy pool hands out pieces of larger blocks). In the
simulator the guarded NumPy views check the launchers' addressing (views with an offset, flat views, copies
back into the caller's tensors) on one example per operator.
"""

import functools
import os

import numpy as np
import pytest

import cacheattn
import cacheattn.testing as kit
from kernels_numba import _launch

from strategies import KERNEL

GPU = os.environ.get("CACHEATTN_TEST_GPU") == "1"          # as conftest decides; the budgets below need it early
GUARD_BYTES = 4096 if GPU else 256
EXAMPLES = KERNEL if GPU else max(1, KERNEL // 6)       # the simulator: under 15 s for all seven operators
# gpt_attention's data tensors (cacheattn.trtllm's `data`): on a GPU these go over as CuPy, the index tensors stay
# NumPy as TensorRT-LLM's host tensors do (guarded all the same).
TRT_DATA = ("qkv", "past_key_value", "kv_cache_pool", "attention_mask", "cross_kv", "qkv_bias", "alibi_slopes",
            "relative_attention_bias")


class Guarded:
    """The arrays of one call, each copied into a guarded allocation; `check` asserts every guard band intact."""

    def __init__(self, device):
        self.device = device
        self.placed = []            # (name, caller's array, allocation, view)

    def place(self, name, x, on_device=True):
        """x (NumPy, or a tuple of them such as FasterTransformer's weights) as guarded views of the same values."""
        if isinstance(x, tuple):
            items = [self.place(f"{name}[{i}]", item, on_device) for i, item in enumerate(x)]
            return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
        if not isinstance(x, np.ndarray):
            return x
        xp = self.device.xp if self.device.gpu and on_device else np
        allocation, view = _launch.guarded(xp, x.size, x.dtype, GUARD_BYTES)
        view = view.reshape(x.shape)
        view[...] = xp.asarray(x)
        self.placed.append((name, x, allocation, view))
        return view

    def check(self, allocated):
        bad = [name for name, _, allocation, view in self.placed if not _launch.guards_intact(allocation, view)]
        bad += [f"launcher buffer {i} {view.shape}" for i, (allocation, view) in enumerate(allocated)
                if not _launch.guards_intact(allocation, view)]
        assert not bad, f"guard bands written: {', '.join(bad)}"

    def write_back(self):
        """The call's in-place updates (caches, scales) into the caller's arrays, for the checks that follow."""
        for _, x, _, view in self.placed:
            x[...] = self.device.get(view)


def guarded_kernels(device, function, **launch):
    """function on the kernels, called as the kit calls an implementation, every array guarded (see Guarded)."""
    @functools.wraps(function)
    def call(*args, **attrs):
        guarded = Guarded(device)
        args = [guarded.place(f"argument {i}", a) for i, a in enumerate(args)]
        attrs = {name: guarded.place(name, a) for name, a in attrs.items()}
        with _launch.guarded_outputs(GUARD_BYTES) as allocated:
            out = function(*args, **attrs, backend="numba", **launch)
            guarded.check(allocated)
        guarded.write_back()
        return tuple(device.get(o) for o in out) if isinstance(out, tuple) else device.get(out)
    return call


@pytest.mark.parametrize("op", ["multi_head_cache_attention", "dynamic_multi_head_attention", "dynamic_key_value_cache",
                                "key_value_cache", "onnx_attention", "cross_attention"])
def test_kernels_stay_inside_their_buffers(device, op):
    """Guards intact and the kit's checks pass; 32 threads (fewer than the elements: strided loops wrap)."""
    # bfloat16 ONNX runs on the kernels from NumPy only; the step-1 GEMM of cross_attention sums in cuBLAS's order
    # on a GPU, so its cache bits are checked in the simulator only (as in test_ft_properties).
    dtypes = ("float16", "float32") if device.gpu and op == "onnx_attention" else None
    features = [f for f in kit.FEATURES[op] if not (device.gpu and f == "cache_bits")]
    report = kit.check(op, guarded_kernels(device, getattr(cacheattn, op), threads=32), max_examples=EXAMPLES,
                       dtypes=dtypes, features=features)
    assert report.examples >= 1


def guarded_gpt_attention(device):
    """gpt_attention on the kernels as the kit calls it (every tensor by keyword), each array guarded; the index
    tensors stay NumPy, as TensorRT-LLM's host tensors do, but guarded all the same."""
    def call(**args):
        guarded = Guarded(device)
        placed = {name: guarded.place(name, a, on_device=name in TRT_DATA) for name, a in args.items()}
        with _launch.guarded_outputs(GUARD_BYTES) as allocated:
            output, present = cacheattn.gpt_attention(**placed, backend="numba", threads=32)
            guarded.check(allocated)
        guarded.write_back()
        return device.get(output), None if present is None else device.get(present)
    return call


def test_gpt_attention_stays_inside_its_buffers(device):
    """Guards intact and the kit's checks pass (a simulator call costs 2-4 s: half the budget)."""
    report = kit.check("gpt_attention", guarded_gpt_attention(device), max_examples=max(1, EXAMPLES // 2),
                       dtypes=("float16",))
    assert report.examples >= 1


def test_a_write_past_the_end_is_caught(device):
    """The check itself: a buffer written one element past its view fails it, on either side."""
    for side in (-1, 1):
        guarded = Guarded(device)
        view = guarded.place("cache", np.arange(6, dtype=np.float16).reshape(2, 3))
        allocation = guarded.placed[0][2]
        pad = (allocation.size - view.size) // 2
        allocation[pad - 1 if side < 0 else pad + view.size] = 0
        with pytest.raises(AssertionError, match="guard bands written: cache"):
            guarded.check([])
