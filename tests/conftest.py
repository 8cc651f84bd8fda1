"""Test set-up: kernels run under the CUDA simulator unless CACHEATTN_TEST_GPU=1 says a real GPU is here.

The simulator must be chosen before numba is imported, so it is set here, first.
"""

import os

GPU = os.environ.get("CACHEATTN_TEST_GPU") == "1"
if not GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
elif os.environ.get("CACHEATTN_CUPY_POOL") == "0":
    # Under compute-sanitizer (python -m cacheattn gpu-session): every array its own cudaMalloc, so memcheck
    # sees each one's bounds; the pool would hand out pieces of larger blocks.
    import cupy

    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from kernels_numba import _launch  # noqa: E402

# Simulator launches take seconds: no deadline, and fewer examples for kernel tests (see strategies.KERNEL).
settings.register_profile("default", deadline=None, print_blob=True)
settings.load_profile("default")


@pytest.fixture(autouse=True)
def poisoned_kernel_outputs():
    """Every output buffer a launcher allocates starts as NaN, so an element a kernel never writes shows."""
    with _launch.poisoned_outputs(np.nan):
        yield


class Device:
    """Where kernel tests put their arrays: NumPy under the simulator, CuPy on a real GPU."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        if gpu:
            import cupy
            self.xp = cupy

    def put(self, x):
        if x is None or not self.gpu or not isinstance(x, np.ndarray):
            return x
        return self.xp.asarray(x)

    def get(self, x):
        return x.get() if self.gpu and hasattr(x, "get") else x


@pytest.fixture(scope="session")
def device():
    return Device(GPU)


# Files whose tests take 10-70 s each (PTX compiles in fresh processes, whole lab and tour runs). They are started
# first, so that with `-n 2 --dist worksteal` the short tests fill in around them instead of one worker finishing
# a long test alone at the end.
LONG_FIRST = ("test_ptx.py", "test_lab_commands.py", "test_tour.py", "test_docs.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a real GPU with CuPy: run with CACHEATTN_TEST_GPU=1")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip_gpu)
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)
