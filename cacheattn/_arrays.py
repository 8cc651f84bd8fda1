"""Array kinds and backend choice: NumPy in -> reference, GPU arrays in -> kernels, same kind out."""

from __future__ import annotations

import functools
import sys

import numpy as np

BACKENDS = ("auto", "reference", "numba")
_DLPACK_CUDA_DEVICES = (2, 3, 13)   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def kernels():
    """The kernels_numba package, imported on first use: numba reads NUMBA_ENABLE_CUDASIM when it is first
    imported, and `python -m cacheattn` decides on the simulator only after importing this package."""
    import kernels_numba
    return kernels_numba


def to_kind(like, host_array):
    """host_array moved to the array kind of `like` (NumPy stays NumPy; bfloat16 to a GPU: a BFloat16Array)."""
    from kernels_numba._launch import to_kind
    if not isinstance(like, np.ndarray) and host_array.dtype.name == "bfloat16":
        bits = like.bits if isinstance(like, BFloat16Array) else like
        return BFloat16Array(to_kind(bits, host_array.view(np.uint16)))
    return to_kind(like, host_array)


# ------------------------------------------------------------------------------------------- bfloat16 on a GPU
# CuPy has no bfloat16 dtype, so a GPU bfloat16 tensor travels as its bits (a uint16 array) in a small wrapper
# that says what the bits mean: validation reads its dtype (bfloat16) and shape, the kernels read its bits.

class BFloat16Array:
    """A GPU tensor of bfloat16 values held as their bits: a uint16 (or int16) CuPy / CUDA-array-interface array.

    Build one with `cacheattn.bfloat16(bits)`; torch CUDA bfloat16 tensors become one by themselves. `dtype` is
    ml_dtypes' bfloat16, `bits` the uint16 array (no copy), `get()` a NumPy (ml_dtypes) copy. The operators return
    their bfloat16 outputs as this type when the inputs were."""

    def __init__(self, bits):
        dtype = np.dtype(bits.dtype)
        if dtype not in (np.uint16, np.int16):
            raise TypeError(f"bits: expected the bfloat16 bits as a uint16 or int16 GPU array, got dtype {dtype}")
        if not hasattr(bits, "__cuda_array_interface__"):
            raise TypeError(f"bits: expected a GPU array (CuPy or __cuda_array_interface__), got "
                            f"{type(bits).__name__}; a NumPy bfloat16 array is an ml_dtypes.bfloat16 array")
        self.bits = bits.view(np.uint16) if dtype == np.int16 else bits

    @property
    def dtype(self):
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)

    shape = property(lambda self: tuple(self.bits.shape))
    ndim = property(lambda self: self.bits.ndim)
    size = property(lambda self: self.bits.size)
    strides = property(lambda self: self.bits.strides)
    flags = property(lambda self: getattr(self.bits, "flags", None))
    __cuda_array_interface__ = property(lambda self: self.bits.__cuda_array_interface__)

    def reshape(self, *shape):
        return BFloat16Array(self.bits.reshape(*shape))

    def get(self) -> np.ndarray:
        """A NumPy (ml_dtypes.bfloat16) copy on the host."""
        import ml_dtypes
        host = self.bits.get() if hasattr(self.bits, "get") else self.bits.copy_to_host()
        return host.view(ml_dtypes.bfloat16)

    def __repr__(self) -> str:
        return f"BFloat16Array(shape={self.shape}, bits={type(self.bits).__module__}.{type(self.bits).__name__})"


def bfloat16(bits) -> BFloat16Array:
    """A GPU bfloat16 tensor from its bits, for the operators: CuPy has no bfloat16 dtype, so pass a uint16 (or
    int16) CuPy array of bfloat16 bits wrapped by this (no copy). The outputs of the call come back as
    `BFloat16Array` too (`.bits`, `.get()`). torch CUDA bfloat16 tensors need no wrapping; NumPy bfloat16 is
    ml_dtypes.bfloat16.

    Examples
    --------
    >>> import numpy as np, ml_dtypes
    >>> x = np.array([1.0, -2.5, 3.140625], ml_dtypes.bfloat16)
    >>> x.view(np.uint16)            # the bits cacheattn.bfloat16 takes, as a uint16 GPU array
    array([16256, 49184, 16457], dtype=uint16)
    """
    return BFloat16Array(bits)


def is_device_array(x) -> bool:
    if hasattr(x, "__cuda_array_interface__"):
        return True
    if hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray):
        return x.__dlpack_device__()[0] in _DLPACK_CUDA_DEVICES
    return False


def as_kernel_array(x):
    """Something numba can launch on: NumPy and CUDA-array-interface objects as they are, DLPack via CuPy."""
    if x is None or isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__"):
        return x
    import cupy
    return cupy.from_dlpack(x)


def compute_capability():
    """(major, minor) of the current GPU, or None under the simulator (it emulates every instruction)."""
    from numba import config, cuda
    if config.ENABLE_CUDASIM:
        return None
    return tuple(cuda.get_current_device().compute_capability)


def resolve_backend(backend: str, data: dict) -> str:
    """'reference' or 'numba' for these data arrays ({document name: array or None})."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    present = {name: a for name, a in data.items() if a is not None}
    on_device = {name for name, a in present.items() if is_device_array(a)}
    if on_device and len(on_device) != len(present):
        host = sorted(set(present) - on_device)
        raise TypeError(f"{', '.join(host)}: expected GPU arrays like {', '.join(sorted(on_device))}, "
                        "got NumPy arrays; pass every data array on the same side")
    for name, a in present.items():
        if not on_device and not isinstance(a, np.ndarray):
            raise TypeError(f"{name}: expected a NumPy or GPU array, got {type(a).__name__}")
    if backend == "auto":
        return "numba" if on_device else "reference"
    if backend == "numba" and not on_device:
        from numba import cuda
        if not cuda.is_available():
            raise RuntimeError("backend='numba' with NumPy arrays needs a CUDA GPU or the simulator "
                               "(NUMBA_ENABLE_CUDASIM=1 before numba is imported)")
    return backend


def to_host(x):
    """A NumPy copy (or the array itself) of a NumPy, CuPy or CUDA-array-interface array, or of a Python
    scalar or list; None stays None."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if not is_device_array(x):
        return np.asarray(x)
    if isinstance(x, BFloat16Array) or hasattr(x, "get"):
        return x.get()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    from numba import cuda
    return cuda.as_cuda_array(x).copy_to_host()


def index_array(name: str, x) -> np.ndarray:
    """Host int64 copy of an index input (seqstarts, kvstarts, cachestarts, start_pos)."""
    host = np.asarray(to_host(x))
    if not np.issubdtype(host.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer tensor (int64), got dtype {host.dtype}")
    return host.astype(np.int64)


def kernel_index(like, given, host: np.ndarray):
    """The index tensor the kernels read: the caller's own device array when it already is C-contiguous int64
    (validation has read exactly these values, so no upload is needed), else the validated host copy `host`
    moved to `like`'s kind."""
    if not isinstance(like, np.ndarray) and is_device_array(given) and np.dtype(given.dtype) == np.int64:
        flags = getattr(given, "flags", None)
        if flags is None or flags["C_CONTIGUOUS"]:
            return as_kernel_array(given)
    return to_kind(like, host)


def copy_into(dst, host_src) -> None:
    """Write a host result back into a caller's in-out tensor of any kind (cache, scale)."""
    if isinstance(dst, np.ndarray):
        dst[...] = host_src
    elif isinstance(dst, BFloat16Array):
        copy_into(dst.bits, np.ascontiguousarray(host_src).view(np.uint16))
    elif hasattr(dst, "copy_to_device"):
        dst.copy_to_device(host_src)
    else:
        import cupy
        cupy.asarray(dst)[...] = cupy.asarray(host_src)


def run_reference(data: dict, inout_names: tuple, call):
    """Run `call(host_data)` on host copies of `data` (the reference is NumPy). GPU in-out tensors get
    the new contents back, and array results return as the kind of the first data array."""
    on_host = all(x is None or isinstance(x, np.ndarray) for x in data.values())
    host = data if on_host else {name: to_host(x) for name, x in data.items()}
    result = call(host)
    if on_host:
        return result
    for name in inout_names:
        if data[name] is not None:
            copy_into(data[name], host[name])
    like = next(x for x in data.values() if x is not None)
    if isinstance(result, tuple):
        return tuple(None if r is None else to_kind(like, r) for r in result)
    return to_kind(like, result)


# ---------------------------------------------------------------------------------------------- torch tensors
# torch is optional: these helpers only act on objects whose type comes from the torch package, and import
# torch only when they meet one. CPU tensors become NumPy views (the reference writes in-out caches in place
# through them), CUDA tensors become CuPy arrays through DLPack (no copy; the kernels write in place), and
# every array result goes back to torch on the device the inputs were on.

def is_torch(x) -> bool:
    torch = sys.modules.get("torch")       # a caller holding a tensor has imported torch already
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_to_native(x):
    """A torch tensor as the array the rest of cacheattn speaks: NumPy on the CPU, CuPy on a GPU; no copy."""
    x = x.detach()
    import torch
    if x.device.type == "cuda":
        import cupy
        if x.dtype == torch.bfloat16:      # CuPy has no bfloat16: its bits, as an int16 tensor (same storage)
            return BFloat16Array(cupy.from_dlpack(x.view(torch.int16)))
        return cupy.from_dlpack(x)
    if x.dtype == torch.bfloat16:          # NumPy has no bfloat16: reinterpret the bits as ml_dtypes' type
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _torch_leaves(x) -> list:
    """The torch tensors in x, looking inside tuples (FasterTransformer's AttentionWeight holds DenseWeights)."""
    if is_torch(x):
        return [x]
    if isinstance(x, tuple):
        return [t for item in x for t in _torch_leaves(item)]
    return []


def map_leaves(function, x):
    """x with function applied to everything in it that is not a tuple: tuples and named tuples (an operator's
    outputs, FasterTransformer's AttentionWeight of DenseWeights) are rebuilt around the results."""
    if isinstance(x, tuple):
        items = [map_leaves(function, item) for item in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    return function(x)


def _to_native(x):
    """x with every torch tensor in it, nested tuples included, swapped for its NumPy / CuPy view."""
    return map_leaves(lambda a: _torch_to_native(a) if is_torch(a) else a, x)


def _native_to_torch(x, device):
    import torch
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)
    if isinstance(x, BFloat16Array):
        return torch.from_dlpack(x.bits.view(np.int16)).view(torch.bfloat16)
    if is_device_array(x):
        return torch.from_dlpack(x)
    return x


def _results_to_torch(result, device):
    return map_leaves(lambda r: _native_to_torch(r, device), result)     # None stays None


def accepts_torch(operator):
    """Decorator for a public operator: torch tensors in, torch tensors out, through the NumPy / CuPy paths.

    Every operator of cacheattn carries it, so torch support is this one mechanism: arguments that are
    torch tensors are swapped for zero-copy NumPy (CPU) or CuPy (CUDA, via DLPack, run on torch's current
    stream) arrays before validation, and the array results come back as torch tensors on that device.
    """
    @functools.wraps(operator)
    def call(*args, **kwargs):
        tensors = _torch_leaves((*args, *kwargs.values()))
        if not tensors:
            return operator(*args, **kwargs)
        device = tensors[0].device
        args = tuple(_to_native(a) for a in args)
        kwargs = {k: _to_native(v) for k, v in kwargs.items()}
        if device.type == "cuda":
            import cupy
            import torch
            with cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
                return _results_to_torch(operator(*args, **kwargs), device)
        return _results_to_torch(operator(*args, **kwargs), device)

    return call
