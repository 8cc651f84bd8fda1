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


def launch(kernel, grid, threads, stream, *args):
    """kernel[grid, threads, stream](*args), or record it (see recorded_launches)."""
    if _recorder is not None:
        _recorder.append((kernel, args))
        return
    kernel[grid, threads, stream](*args)


def is_host(array) -> bool:
    return isinstance(array, np.ndarray)


def empty_like_kind(like, shape, dtype):
    """An uninitialised array of `like`'s kind: NumPy for NumPy (simulator), else CuPy or a numba device array."""
    if is_host(like):
        out = np.empty(shape, dtype)
    else:
        try:
            import cupy
            out = cupy.empty(shape, dtype)
        except ImportError:
            out = cuda.device_array(shape, dtype)
    if _poison is not None:
        out[...] = _poison
    return out


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
