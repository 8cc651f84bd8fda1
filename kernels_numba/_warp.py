"""Warp primitives for the kernel ladder's second rung, in one small module.

On a GPU a warp sums 32 lane values with five butterfly shuffles (`shfl_xor_sync`): no shared memory, no
barrier, and every lane ends with the same bits (each step adds the same two numbers on both partners).
numba's CUDA simulator has no shuffles, so there the same device function goes through a per-warp row of
shared memory between two block barriers; its callers therefore call it the same number of times in
every thread of the block (a barrier must be reached by all). The sum's order differs between the two
paths (a tree on the GPU, left to right in the simulator), which is within every tolerance the tests use.
"""

from __future__ import annotations

from numba import config, cuda

WARP_SIZE = 32
FULL_MASK = 0xFFFFFFFF
SIMULATED = bool(config.ENABLE_CUDASIM)

if SIMULATED:
    @cuda.jit(device=True)
    def warp_sum(x, scratch, warp, lane):
        """The sum of x over the 32 lanes of this warp, in every lane (scratch: shared (warps, 32))."""
        cuda.syncthreads()                      # the previous call's readers are done with scratch
        scratch[warp, lane] = x
        cuda.syncthreads()
        total = scratch[warp, 0]
        for other in range(1, WARP_SIZE):
            total += scratch[warp, other]
        return total
else:
    @cuda.jit(device=True, inline="always")
    def warp_sum(x, scratch, warp, lane):
        """The sum of x over the 32 lanes of this warp, in every lane (scratch unused on a GPU)."""
        offset = WARP_SIZE // 2
        while offset > 0:
            x += cuda.shfl_xor_sync(FULL_MASK, x, offset)
            offset //= 2
        return x
