"""Warp primitives for the kernel ladder (rungs 2 and 3), in one small module.

On a GPU a warp combines lane values with butterfly shuffles (`shfl_xor_sync`): no shared memory, no barrier,
and every lane of a group ends with the same bits (each step combines the same two numbers on both partners).
`xor_reduce` combines over the lanes that differ from this one only in the bits first, 2 first, ..., stop / 2:
(1, 32) is the whole warp (`warp_sum`), (1, w) a group of w consecutive lanes (rung 3: the lanes that share one
key row), (w, 32) the lanes at the same place of every group (rung 3: merging the keys a warp walked at once).
`transpose_sum` sums many values over a group so that each lane ends with a different one (rung 3's logits of
a tile of keys), `lane_values` and `from_lane` (after `publish`) read other lanes' values (`shfl_sync`) and
`warp_any` tells every lane whether any lane's condition holds (`vote.any`: a branch on it is taken by the whole
warp or by none).
numba's CUDA simulator has no shuffles, so there the same device functions go through a per-warp row of
shared memory between two block barriers (`xor_reduce_many`: one pair for several values, as the simulator's
cost is its barriers); their callers therefore call them the same number of times in
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
    def xor_reduce(x, scratch, warp, lane, first, stop, take_max):
        """x summed (or its max, take_max) over the lanes lane ^ k, k a multiple of first below stop (powers of
        2), in each of them (scratch: shared (warps, 32))."""
        if stop <= first:
            return x                            # nothing to combine (first, stop are the same in every thread)
        cuda.syncthreads()                      # the previous call's readers are done with scratch
        scratch[warp, lane] = x
        cuda.syncthreads()
        base = lane & ~(stop - first)           # the lowest lane of this lane's set
        total = scratch[warp, base]
        for k in range(1, stop // first):
            other = scratch[warp, base + k * first]
            total = max(total, other) if take_max else total + other
        return total
else:
    @cuda.jit(device=True, inline="always")
    def xor_reduce(x, scratch, warp, lane, first, stop, take_max):
        """x summed (or its max, take_max) over the lanes lane ^ k, k a multiple of first below stop (powers of
        2), in each of them (scratch unused on a GPU)."""
        offset = first
        while offset < stop:
            other = cuda.shfl_xor_sync(FULL_MASK, x, offset)
            x = max(x, other) if take_max else x + other
            offset *= 2
        return x


if SIMULATED:
    @cuda.jit(device=True)
    def xor_reduce_many(values, count, scratch, warp, lane, first, stop, take_max):
        """values[:count], each combined as `xor_reduce` does, in place; one pair of barriers for all of them
        (scratch: shared (warps, 32, >= count))."""
        if stop <= first:
            return
        cuda.syncthreads()
        for k in range(count):
            scratch[warp, lane, k] = values[k]
        cuda.syncthreads()
        base = lane & ~(stop - first)
        for k in range(count):
            total = scratch[warp, base, k]
            for j in range(1, stop // first):
                other = scratch[warp, base + j * first, k]
                total = max(total, other) if take_max else total + other
            values[k] = total
else:
    @cuda.jit(device=True, inline="always")
    def xor_reduce_many(values, count, scratch, warp, lane, first, stop, take_max):
        """values[:count], each combined as `xor_reduce` does, in place (scratch unused on a GPU)."""
        for k in range(count):
            values[k] = xor_reduce(values[k], scratch, warp, lane, first, stop, take_max)


if SIMULATED:
    @cuda.jit(device=True)
    def transpose_sum(values, per, scratch, warp, lane, lanes):
        """values[:lanes * per] summed over this lane's group of `lanes` consecutive lanes, `per` sums to a lane:
        lane j of the group ends with entries j * per .. j * per + per - 1 summed, in values[:per] (scratch: shared
        (warps, 32, >= lanes * per))."""
        cuda.syncthreads()
        for k in range(lanes * per):
            scratch[warp, lane, k] = values[k]
        cuda.syncthreads()
        base = lane - lane % lanes
        for k in range(per):
            n = (lane % lanes) * per + k
            total = scratch[warp, base, n]
            for x in range(1, lanes):
                total += scratch[warp, base + x, n]
            values[k] = total

    @cuda.jit(device=True)
    def lane_values(out, count, x, scratch, warp, lane, first, stride):
        """out[k] = x of lane first + k * stride of this warp, k < count (scratch: shared (warps, 32, >= 1))."""
        cuda.syncthreads()
        scratch[warp, lane, 0] = x
        cuda.syncthreads()
        for k in range(count):
            out[k] = scratch[warp, first + k * stride, 0]

    @cuda.jit(device=True)
    def publish(x, scratch, warp, lane, k):
        """Offer x to `from_lane` as this lane's value k (scratch: shared (warps, 32, > k)); every later
        from_lane(..., k) of this warp until the next publish reads it."""
        cuda.syncthreads()                       # the previous publish's readers are done
        scratch[warp, lane, k] = x
        cuda.syncthreads()

    @cuda.jit(device=True)
    def from_lane(x, scratch, warp, source, k):
        """Value k that lane `source` of this warp published."""
        return scratch[warp, source, k]

    @cuda.jit(device=True)
    def warp_any(pred, scratch, warp, lane):
        """Whether `pred` holds in any lane of this warp, in every lane (scratch: shared (warps, 32, >= 1))."""
        cuda.syncthreads()
        scratch[warp, lane, 0] = 1 if pred else 0
        cuda.syncthreads()
        for k in range(WARP_SIZE):
            if scratch[warp, k, 0] != 0:
                return True
        return False
else:
    @cuda.jit(device=True, inline="always")
    def transpose_sum(values, per, scratch, warp, lane, lanes):
        """values[:lanes * per] summed over this lane's group of `lanes` consecutive lanes, `per` sums to a lane
        (lane j: entries j * per ..., in values[:per]). A butterfly that halves the values each step: the
        partner whose bit is set keeps the upper half and sends the lower, so lanes * per sums take
        (lanes - 1) * per shuffles, not lanes * per * log2(lanes) as one xor_reduce per value would."""
        half = lanes // 2
        while half >= 1:
            upper = (lane & half) != 0
            for k in range(half * per):
                # select values, not indices: a constant index keeps `values` in registers
                low, high = values[k], values[k + half * per]
                mine, other = (high, low) if upper else (low, high)
                values[k] = mine + cuda.shfl_xor_sync(FULL_MASK, other, half)
            half //= 2

    @cuda.jit(device=True, inline="always")
    def lane_values(out, count, x, scratch, warp, lane, first, stride):
        """out[k] = x of lane first + k * stride of this warp, k < count (scratch unused on a GPU)."""
        for k in range(count):
            out[k] = cuda.shfl_sync(FULL_MASK, x, first + k * stride)

    @cuda.jit(device=True, inline="always")
    def publish(x, scratch, warp, lane, k):
        """Nothing on a GPU: from_lane shuffles x itself."""
        return

    @cuda.jit(device=True, inline="always")
    def from_lane(x, scratch, warp, source, k):
        """x of lane `source` of this warp: one shfl.sync (scratch unused on a GPU)."""
        return cuda.shfl_sync(FULL_MASK, x, source)

    @cuda.jit(device=True, inline="always")
    def warp_any(pred, scratch, warp, lane):
        """Whether `pred` holds in any lane of this warp, in every lane: vote.any (scratch unused on a GPU)."""
        return cuda.any_sync(FULL_MASK, pred)


@cuda.jit(device=True, inline="always")
def warp_sum(x, scratch, warp, lane):
    """The sum of x over the 32 lanes of this warp, in every lane."""
    return xor_reduce(x, scratch, warp, lane, 1, WARP_SIZE, False)
