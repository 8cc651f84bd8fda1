"""Host-side helpers shared by the launchers: output allocation of the caller's array kind,
the caller's stream, flat views and element strides.

Kernels receive every strided tensor as a flat 1-D array plus element strides, so one
kernel body serves every cache layout: the layout lives in the strides, not the code.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from numba import cuda

# The offset-mode cache is the paged one with pages this long: t // OFFSET_PAGE == 0 for any real t.
OFFSET_PAGE = 1 << 62


_poison = None          # fill value for new outputs, set by poisoned_outputs()
_recorder = None        # list that launch() appends to instead of launching, set by recorded_launches()
_guards = None          # (guard bytes, list of guarded allocations), set by guarded_outputs()


@contextmanager
def poisoned_outputs(value=np.nan):
    """New output buffers start as `value` (NaN) instead of whatever memory held: a kernel that skips an
    element leaves a visible NaN behind. Tests run with this on."""
    global _poison
    previous, _poison = _poison, value
    try:
        yield
    finally:
        _poison = previous


@contextmanager
def recorded_launches():
    """Collect (kernel, args) of every launch instead of running it; the PTX check compiles them."""
    global _recorder
    previous, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = previous


def guard_byte(dtype) -> int:
    """The byte a guard band is filled with: all ones (a NaN) for floats, so a kernel that reads a guard
    computes NaN; 0xA5 for integers and bools, a value no index or code of the tests lands on whole."""
    return 0xFF if np.dtype(dtype).kind in "fc" else 0xA5


def guarded(xp, size: int, dtype, guard_bytes: int):
    """(allocation, view): a 1-D xp array of `size` elements in the middle of an allocation with guard_bytes
    filled with guard_byte(dtype) before and after it. The view starts guard_bytes in, so a guard band of a
    multiple of 256 bytes keeps the allocator's alignment."""
    dtype = np.dtype(dtype)
    pad = -(-guard_bytes // dtype.itemsize)
    allocation = xp.empty(size + 2 * pad, dtype)
    allocation.view(np.uint8)[...] = guard_byte(dtype)
    return allocation, allocation[pad:pad + size]


def guards_intact(allocation, view) -> bool:
    """Are the bytes of `allocation` outside `view` (made by `guarded`) all still the guard byte?"""
    pad = (allocation.size - view.size) // 2
    raw = allocation.view(np.uint8)
    edge = pad * allocation.dtype.itemsize
    untouched = raw[:edge] == guard_byte(allocation.dtype), raw[raw.size - edge:] == guard_byte(allocation.dtype)
    return bool(untouched[0].all()) and bool(untouched[1].all())


@contextmanager
def guarded_outputs(guard_bytes: int = 4096):
    """Every buffer a launcher allocates (outputs and scratch) is a view into the middle of a larger allocation
    whose guard bands hold guard_byte; yields the list of (allocation, view) for checking with guards_intact
    after the call. NumPy (simulator) and CuPy buffers only."""
    global _guards
    previous, _guards = _guards, (guard_bytes, [])
    try:
        yield _guards[1]
    finally:
        _guards = previous


def launch(kernel, grid, threads, stream, *args):
    """kernel[grid, threads, stream](*args), or record it (see recorded_launches)."""
    if _recorder is not None:
        _recorder.append((kernel, args))
        return
    kernel[grid, threads, stream](*args)


def is_host(array) -> bool:
    return isinstance(array, np.ndarray)


BFLOAT16_NAN_BITS = 0x7FC0     # a bfloat16 NaN: the poison of a new tensor of bfloat16 bits


def empty_like_kind(like, shape, dtype):
    """An uninitialised array of `like`'s kind: NumPy for NumPy (simulator), else CuPy or a numba device array.
    dtype "bfloat16": a tensor of bfloat16 bits (uint16), poisoned with a bfloat16 NaN."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        out = empty_like_kind(like, shape, np.uint16) if _poison is None else _unpoisoned(like, shape, np.uint16)
        if _poison is not None:
            out[...] = BFLOAT16_NAN_BITS
        return out
    if _guards is not None:
        out = _guarded_output(like, shape, dtype)
    elif _recorder is not None and _poison is None and is_host(like):
        # zeros (below) without touching the pages: a recorded decode's outputs can be tens of MB, and filling
        # them would be most of what a host-time measurement of the call sees
        return np.zeros(shape, dtype)
    elif is_host(like):
        out = np.empty(shape, dtype)
    else:
        try:
            import cupy
            out = cupy.empty(shape, dtype)
        except ImportError:
            out = cuda.device_array(shape, dtype)
    if _poison is not None:
        out[...] = _poison
    elif _recorder is not None:
        # Recorded launches never run, so nothing writes this buffer; a launcher that post-processes its output on
        # the host (bfloat16's rounding) would read leftover memory, NaN bit patterns included. Zeros are defined.
        out[...] = 0
    return out


def _unpoisoned(like, shape, dtype):
    global _poison
    previous, _poison = _poison, None
    try:
        return empty_like_kind(like, shape, dtype)
    finally:
        _poison = previous


def bfloat16_bits(x):
    """The bits (uint16, no copy) of a bfloat16 tensor: an ml_dtypes NumPy array's view, or the `bits` a GPU
    tensor carries (`cacheattn.bfloat16`; CuPy has no bfloat16 dtype)."""
    if isinstance(x, np.ndarray):
        return x.view(np.uint16)
    return x.bits


def bfloat16_like(like, bits):
    """bfloat16 bits (uint16) as a bfloat16 tensor of `like`'s kind: NumPy's ml_dtypes view, or `like`'s own
    wrapper type around a GPU array of bits."""
    if isinstance(bits, np.ndarray):
        import ml_dtypes
        return bits.view(ml_dtypes.bfloat16)
    return type(like)(bits)


def _guarded_output(like, shape, dtype):
    """empty_like_kind under guarded_outputs: the view into a guarded allocation, which is recorded."""
    if is_host(like):
        xp = np
    else:
        import cupy as xp
    allocation, view = guarded(xp, int(np.prod(shape, dtype=np.int64)), dtype, _guards[0])
    _guards[1].append((allocation, view))
    return view.reshape(shape)


def to_kind(like, host_array):
    """host_array copied to `like`'s kind (small index arrays the launcher derives)."""
    if is_host(like):
        return np.ascontiguousarray(host_array)
    try:
        import cupy
    except ImportError:
        return cuda.to_device(np.ascontiguousarray(host_array))
    return cupy.asarray(host_array)


def caller_stream(*arrays):
    """The caller's current CuPy stream when its arrays are CuPy's; the default stream otherwise."""
    if any(type(a).__module__.startswith("cupy") for a in arrays):
        import cupy
        return cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    return 0


def flat(array):
    """1-D view of a C-contiguous array (validated before launch)."""
    return array.reshape(-1)


def element_strides(shape) -> list[int]:
    """C-order element strides of a contiguous array, aligned with `shape`."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= int(extent)
    return list(reversed(strides))


def axis_strides(shape, axes: str) -> dict:
    """{axis name: element stride} for a tensor whose axes are named by `axes` (e.g. "L KV H T D")."""
    return dict(zip(axes.split(), element_strides(shape)))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
