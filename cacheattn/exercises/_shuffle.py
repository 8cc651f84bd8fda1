"""`cuda.shfl_xor_sync` for kernels run in numba's CUDA simulator, which has no warp shuffles.

On a GPU, `cuda.shfl_xor_sync(mask, value, lane_mask)` hands each lane named in `mask` the value of lane
`lane ^ lane_mask` of its warp, in registers: no shared memory, no barrier. `installed()` gives the simulator's
`cuda` module the same function while an exercise's kernel runs: the lanes of a warp meet at each call (each
lane's k-th call meets the others' k-th) and each takes its partner's value. A shuffle that a lane of the mask
never reaches (a shuffle inside a branch; undefined on a GPU) raises as soon as that lane ends, or after `WAIT_S`
(a lane waiting at a barrier instead). Each warp-wide call counts once in the recording's
`extra["warp_shuffles"]` when `cacheattn.lab.record()` runs.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

WAIT_S = 10.0           # how long the lanes of a warp wait for the rest at a shuffle
_LOCK = threading.Lock()


class _Round:
    """One warp-wide call: the values the lanes brought, and the moment the last lane of the mask arrived."""
    __slots__ = ("values", "ready")

    def __init__(self):
        self.values, self.ready = {}, threading.Event()


def shfl_xor_sync(fake_cuda, mask, value, lane_mask):
    """The simulator's cuda.shfl_xor_sync (see the module docstring)."""
    thread = threading.current_thread()
    block = fake_cuda.blockDim
    threads = block.x * block.y * block.z
    tid = thread.thread_id
    warp, lane = tid >> 5, tid & 31
    present = min(32, threads - 32 * warp)
    members = [i for i in range(present) if int(mask) >> i & 1]
    partner = lane ^ int(lane_mask)
    if lane not in members:
        raise RuntimeError(f"cuda.shfl_xor_sync: lane {lane} is not in mask {int(mask):#x}")
    if partner not in members:
        raise RuntimeError(f"cuda.shfl_xor_sync: lane {lane}'s partner {partner} (lane ^ {int(lane_mask)}) is not "
                           f"in mask {int(mask):#x} or not in the block")
    calls = thread.__dict__.setdefault("exercise_shuffles", {})
    k = calls[warp] = calls.get(warp, 0) + 1
    with _LOCK:
        rounds = fake_cuda.__dict__.setdefault("_exercise_rounds", {})
        key = (tuple(thread.blockIdx), warp, k)
        now = rounds.get(key)
        if now is None:
            now = rounds[key] = _Round()
        now.values[lane] = value
        if len(now.values) == len(members):
            now.ready.set()
            from ..lab import recorder
            if recorder._RECORDING is not None:
                extra = recorder._RECORDING.extra
                extra["warp_shuffles"] = extra.get("warp_shuffles", 0) + 1
    deadline = time.monotonic() + WAIT_S
    ended = thread._manager.__dict__.setdefault("exercise_ended", {}).setdefault(tuple(thread.blockIdx), set())
    while not now.ready.wait(0.002):
        if thread.abort:                              # another thread of the block failed
            raise RuntimeError("abort flag set at a shuffle")
        missing = sorted(set(members) - set(now.values))
        gone = [i for i in missing if 32 * warp + i in ended]
        if gone or time.monotonic() > deadline:
            raise RuntimeError(f"cuda.shfl_xor_sync: lanes {gone or missing} of warp {warp} "
                               f"{'ended without reaching' if gone else 'never reached'} this shuffle (is it inside a "
                               "branch that not every lane takes?)")
    return now.values[partner]


def _run_thread(original):
    def run(self):
        try:
            original(self)
        finally:                                      # a lane that ends can no longer join a shuffle
            with _LOCK:
                ended = self._manager.__dict__.setdefault("exercise_ended", {})
                ended.setdefault(tuple(self.blockIdx), set()).add(self.thread_id)
    return run


@contextmanager
def installed():
    """The simulator's `cuda` module with `shfl_xor_sync` inside the block (nothing changes where it has one)."""
    from numba.cuda.simulator import kernel, kernelapi
    module = kernelapi.FakeCUDAModule
    if hasattr(module, "shfl_xor_sync"):
        yield
        return
    run = kernel.BlockThread.run
    module.shfl_xor_sync = shfl_xor_sync
    kernel.BlockThread.run = _run_thread(run)
    try:
        yield
    finally:
        del module.shfl_xor_sync
        kernel.BlockThread.run = run
