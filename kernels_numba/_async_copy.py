"""Asynchronous global -> shared copies and warp-wide matrix loads from shared memory: the building blocks of a
prefill that stages K and V tiles in shared memory (FlashAttention-2's loop) and of a decode that hides the
latency of its next page behind the current one.

numba-cuda has neither, so on a GPU these are `@intrinsic`s emitting inline PTX through llvmlite's `ir.InlineAsm`
(as `_mma.py` and `_dequant.py` do):

    cp_async16(dst, dst_index, src, src_index)
        cp.async.cg.shared.global [dst], [src], 16 (sm_80+): the 16 bytes from element src_index of the global
        1-D array src to element dst_index of the shared 1-D array dst, bypassing L1. Indices count elements; both
        addresses must be 16-byte aligned. PTX ISA, "Data Movement and Conversion Instructions: cp.async".
    shared_base(array) -> uint32
        the 32-bit shared-window address of a shared array's first element (cvta.to.shared), once a kernel.
    cp_async16_at(dst, base, dst_index, src, src_index, full)
        cp_async16 with the shared address formed in 32 bits, base + dst_index * itemsize (base from
        shared_base(dst)), and the global one as one wide multiply-add of src_index (32 or 64 bits) onto src's
        data pointer: a constant dst_index folds into the instruction's immediate, so a copy costs its source
        offset's multiply-add and itself, where cp_async16's 64-bit generic pointers cost about 10 more. When
        `full` is false the copy reads nothing and writes 16 zero bytes (the instruction's src-size operand 0,
        which zero-fills the rest): a tile's rows past the last key without a branch around the copy.
    cp_async_commit()        cp.async.commit_group: this thread's copies since its last commit become one group.
    cp_async_wait(n)         cp.async.wait_group n: wait until at most the n most recent of this thread's
                             committed groups are still pending; n must be a compile-time constant.
    cp_async_wait_all()      cp.async.wait_all: commit, then wait for every group.
                             PTX ISA, "cp.async.commit_group" and "cp.async.wait_group / cp.async.wait_all".
    async_target(array)      a shared array as a copy's destination: the array itself on a GPU, a checked view in
                             the simulator (below). Declare the array with `alignment=SHARED_ALIGNMENT`.
    ldmatrix_x4(shared, row, scratch, warp, lane) -> (r0, r1, r2, r3)
        ldmatrix.sync.aligned.m8n8.x4.shared.b16 (sm_75+): four 8x8 matrices of 16-bit elements; lane l gives
        the element index of one 16-byte row (lanes 8j .. 8j + 7: rows 0..7 of matrix j) and receives register
        j of each matrix. PTX ISA, "Warp-level matrix load instruction: ldmatrix".
    ldmatrix_x4_trans(...)   the same with .trans: each matrix transposed on the way.
    ldmatrix_x4_at(shared, row, offset, scratch, warp, lane), ldmatrix_x4_trans_at(...)
                             the same from row + offset (elements), the offset added to the 32-bit shared address
                             inside the instruction's PTX: loads at distances that are constants once the compiler
                             unrolls the loop around them (ptxas folds each into the instruction's immediate) keep
                             the few lane-dependent rows' addresses only, not one 64-bit address per load (the
                             compiler hoists every distinct address out of the loop, into a register pair each).

ldmatrix's fragment, from the ISA's table: with groupID = lane >> 2 and threadID_in_group = lane % 4, register j
holds elements (groupID, 2 * threadID_in_group) and (groupID, 2 * threadID_in_group + 1) of matrix j, low half
first; with .trans, elements (2 * threadID_in_group, groupID) and (2 * threadID_in_group + 1, groupID). So
(`a_rows`, `b_rows`):

    A of mma_m16n8k16 (`_mma.a_position`) from a 16x16 row-major tile: lane l points at row l % 16, column
        8 * (l // 16); ldmatrix_x4 returns a0..a3 in order.
    B of mma_m16n8k16 (`_mma.b_position`) from a row-major 16 x 16 tile (k rows, n columns): lane l points at
        row l % 16, column 8 * (l // 16); ldmatrix_x4_trans returns b0, b1 of columns 0..7 and b0, b1 of
        columns 8..15 (two n-tiles of the mma).

In a kernel (as tests/test_async_copy.py's double-buffered copy does), with the constants as module globals,
which numba reads as compile-time constants (a module attribute or an expression such as STAGES - 1 it types as
a run-time integer, which `alignment=` and cp_async_wait refuse):

    ALIGN, SCRATCH, WAIT = SHARED_ALIGNMENT, scratch_shape(WARPS), STAGES - 1
    tile = async_target(cuda.shared.array(STAGES * TILE, np.float16, alignment=ALIGN))
    cp_async16(tile, stage * TILE + 8 * t, keys, first + 8 * t)       # issue the next stage's rows
    cp_async_commit()
    cp_async_wait(WAIT)                                                # the oldest stage has landed ...
    cuda.syncthreads()                                                 # ... for every thread's copies

The simulator cannot run PTX. Its twins:

- cp_async16 copies at once. A copy may complete at any moment between its issue and the wait that covers it;
  at issue is one of those moments, so a kernel whose result changes under the eager copy is wrong on a GPU too,
  and a kernel that touches a copy's bytes only after the wait that covers it (and, in other threads, after a
  barrier that follows that wait) computes the same under every schedule, the GPU's included. What the eager copy
  would hide is a read too early, so the twin tracks each thread's pending copies by the same group accounting
  as the hardware (commit, wait_group n, wait_all) and raises `PendingCopyError`, naming the array and index,
  when a kernel reads or writes bytes of a shared array whose copy no wait has completed yet, whichever thread
  touches them. It checks element accesses through `async_target`'s view (and its slices and dtype views) and
  ldmatrix's reads; reads through another alias of the memory it cannot see, nor whether a barrier separates
  another thread's wait from a read (the simulator's threads interleave freely between barriers, so a missing
  barrier shows as this error on some runs only). It also checks each copy's alignment and bounds (the addresses as
  the simulator holds them: a launcher must still check a kernel argument's own alignment on the host, as
  `_cache.vector_loads_ok` does).
- ldmatrix_x4 is warp-collective like `_mma.mma_m16n8k16`'s twin: every lane writes its row's index to a
  per-warp row of the shared `scratch` (`scratch_shape`), the block meets at a barrier, each lane gathers its
  registers from the rows of the whole warp, and the block meets again before the scratch is reused. So, as
  there, every thread of the block calls it the same number of times.
"""

from __future__ import annotations

import linecache
import re
import threading

import numpy as np
from numba import config, cuda

from ._warp import WARP_SIZE

SIMULATED = bool(config.ENABLE_CUDASIM)
COPY_BYTES = 16                  # cp.async.cg copies 16 bytes; an ldmatrix row is 16 bytes (8 x 16 bits)
# `cuda.shared.array(..., alignment=SHARED_ALIGNMENT)`: 16 bytes on a GPU (a shared array is otherwise aligned to
# its element only); the simulator refuses an alignment, and numpy's allocations are 16-byte aligned anyway.
SHARED_ALIGNMENT = None if SIMULATED else COPY_BYTES


def scratch_shape(warps: int):
    """Shape of the int32 shared scratch ldmatrix's simulator twin needs (one row index a lane); a GPU needs none,
    so it gets one element."""
    return (warps, WARP_SIZE) if SIMULATED else (1, 1)


def a_rows(lane: int, row_stride: int) -> int:
    """The element index (from the tile's first element) of the row lane `lane` points ldmatrix_x4 at, for the A
    fragment of a 16x16 row-major 16-bit tile whose rows are `row_stride` elements apart."""
    return (lane % 16) * row_stride + 8 * (lane // 16)


def b_rows(lane: int, row_stride: int) -> int:
    """The same for ldmatrix_x4_trans and the B fragments of a row-major 16 (k) x 16 (n) tile: the same rows."""
    return a_rows(lane, row_stride)


if SIMULATED:
    class PendingCopyError(RuntimeError):
        """A shared array's bytes were touched while a cp.async copy into them was still pending."""

    class _Copy:
        """One pending copy: the thread that issued it and its group (None until committed)."""
        __slots__ = ("thread", "group", "root", "chunk")

        def __init__(self, thread, root, chunk):
            self.thread, self.group, self.root, self.chunk = thread, None, root, chunk

        def describe(self) -> str:
            group = "not yet committed" if self.group is None else f"in its commit group {self.group}"
            return (f"copied by thread {tuple(self.thread.threadIdx)} of block {tuple(self.thread.blockIdx)}, "
                    f"{group}")

    _LOCK = threading.Lock()
    _PENDING = {}                   # id(root array) -> (root, {16-byte chunk of the root: _Copy})

    class _Target(np.ndarray):
        """A view of a shared array whose element reads and writes are checked against the pending copies."""

        def __getitem__(self, key):
            out = super().__getitem__(key)
            if isinstance(out, np.ndarray) and out.ndim and np.may_share_memory(out, self):
                return out                                   # a view (a stage of a tile): nothing read yet
            _check_access(self, key, "read")
            return out

        def __setitem__(self, key, value):
            _check_access(self, key, "written")
            super().__setitem__(key, value)

    def _root(array):
        while isinstance(array.base, np.ndarray):
            array = array.base
        return array

    def _address(array) -> int:
        return array.__array_interface__["data"][0]

    def _ndarray(array, function: str, parameter: str):
        """The NumPy array behind a simulator kernel argument (FakeCUDAArray wrappers) or a shared array."""
        for _ in range(4):
            if isinstance(array, np.ndarray):
                return array
            inner = array.__dict__.get("_item") if hasattr(array, "__dict__") else None
            array = inner if inner is not None else getattr(array, "_ary", array)
        raise TypeError(f"{function}: {parameter} must be an array, got {type(array).__name__}")

    def _table(root):
        """{16-byte chunk: pending _Copy} of the root shared array, for the block running now: a copy an earlier
        block (the simulator runs them one after another in the same shared arrays) left pending is forgotten."""
        entry = _PENDING.get(id(root))
        if entry is None or entry[0] is not root:
            return None
        block = getattr(threading.current_thread(), "_manager", None)
        stale = [chunk for chunk, copy in entry[1].items() if getattr(copy.thread, "_manager", None) is not block]
        for chunk in stale:
            del entry[1][chunk]
        return entry[1]

    def _forget_finished():
        """Drop the tables whose copies all belong to threads that have ended (so no array outlives its launch)."""
        for key, (_, table) in list(_PENDING.items()):
            if not any(copy.thread.is_alive() for copy in table.values()):
                del _PENDING[key]

    def _name(root) -> str:
        """'tile' for `tile = cuda.shared.array(...)` (from the allocation's source line), else a description."""
        from numba.cuda.simulator.kernel import _get_kernel_context

        try:
            allocations = _get_kernel_context().shared._allocations
        except Exception:                    # outside a launch, or a simulator without this bookkeeping
            allocations = {}
        for (filename, line), array in allocations.items():
            if array is root:
                found = re.match(r"\s*(\w+)\s*=", linecache.getline(filename, line))
                return f"shared array '{found.group(1) if found else '?'}' ({filename.rsplit('/', 1)[-1]}:{line})"
        return f"shared array of shape {root.shape} and dtype {root.dtype}"

    def _check_access(view, key, verb):
        root = _root(view)
        with _LOCK:
            table = _table(root)
            if not table:
                return
            # byte offset (from the root's start) of every element of the view, then of the ones `key` picks
            offsets = np.full(view.shape, _address(view) - _address(root), np.int64)
            for axis, (size, stride) in enumerate(zip(view.shape, view.strides)):
                offsets += (np.arange(size) * stride).reshape((-1,) + (1,) * (view.ndim - axis - 1))
            picked = np.asarray(offsets[key]).reshape(-1)
            for first in picked:
                for chunk in {int(first) // COPY_BYTES, (int(first) + view.itemsize - 1) // COPY_BYTES}:
                    copy = table.get(chunk)
                    if copy is not None:
                        raise PendingCopyError(
                            f"{_name(root)}: element {key!r} of a {view.dtype} view is {verb} while a cp.async copy "
                            f"into its bytes {COPY_BYTES * chunk}..{COPY_BYTES * chunk + COPY_BYTES - 1} is still "
                            f"pending ({copy.describe()}): cp_async_wait for that group, then cuda.syncthreads() "
                            "when another thread issued it, before touching them")

    def _chunk_bytes(array, index, function, array_name, index_name):
        """The byte offset in its root of the 16 bytes from array[index] (1-D), checked: integer index, in bounds,
        an element size that divides 16, 16-byte aligned."""
        if array.ndim != 1:
            raise TypeError(f"{function}: {array_name} must be a 1-D array (index it by element), got {array.ndim}-D")
        if COPY_BYTES % array.itemsize:
            raise TypeError(f"{function}: {array_name}'s elements ({array.dtype}) must divide 16 bytes")
        if array.strides[0] != array.itemsize:
            raise ValueError(f"{function}: {array_name} must be contiguous")
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"{function}: {index_name} must be an integer, got {type(index).__name__}")
        index, count = int(index), COPY_BYTES // array.itemsize
        if index < 0 or index + count > array.shape[0]:
            raise ValueError(f"{function}: {index_name} {index} .. {index + count - 1} (16 bytes) is outside "
                             f"{array_name}, which has {array.shape[0]} elements")
        offset = index * array.strides[0]
        if (_address(array) + offset) % COPY_BYTES:
            raise ValueError(f"{function}: {array_name}[{index_name}={index}] is not 16-byte aligned (address "
                             f"{(_address(array) + offset) % COPY_BYTES} past a multiple of 16): pick an index that "
                             f"is a multiple of {count} in an aligned array")
        return _address(array) + offset - _address(_root(array))

    def _thread_state(thread):
        state = getattr(thread, "_cp_async", None)
        if state is None:
            state = thread._cp_async = dict(open=[], groups=[], committed=0)
        return state

    @cuda.jit(device=True)
    def async_target(array):
        """`array` (a shared array) as cp_async16's destination: here a view that checks its element reads and
        writes against the copies still pending."""
        return array.view(_Target)

    @cuda.jit(device=True)
    def cp_async16(dst, dst_index, src, src_index):
        """Copy the 16 bytes at src[src_index] (global) to dst[dst_index] (shared, from async_target); here at
        once, recorded as pending until a cp_async_wait covers it."""
        _copy16(dst, dst_index, src, src_index, True, "cp_async16")

    def _copy16(dst, dst_index, src, src_index, full, function):
        """cp_async16's twin; `full` false: 16 zero bytes, src neither read nor checked (the GPU reads none)."""
        if not isinstance(dst, _Target):
            raise TypeError("cp_async16: dst must be a shared array passed through async_target(...), so that the "
                            "simulator can check that no one reads it before the copy is waited for")
        source = _ndarray(src, function, "src")
        if full:
            _chunk_bytes(source, src_index, function, "src", "src_index")
        offset = _chunk_bytes(dst, dst_index, function, "dst", "dst_index")
        root = _root(dst)
        thread = threading.current_thread()
        with _LOCK:
            table = _table(root)
            if table is None:
                _forget_finished()
                table = {}
                _PENDING[id(root)] = (root, table)
            chunk = offset // COPY_BYTES
            if chunk in table:
                raise PendingCopyError(f"{_name(root)}: cp_async16 into bytes {offset}..{offset + 15} while an "
                                       f"earlier copy into them is still pending ({table[chunk].describe()})")
            copy = table[chunk] = _Copy(thread, root, chunk)
        data = (np.asarray(source[src_index:src_index + COPY_BYTES // source.itemsize]).view(np.uint8) if full
                else np.uint8(0))
        np.asarray(dst)[dst_index:dst_index + COPY_BYTES // dst.itemsize].view(np.uint8)[:] = data
        _thread_state(thread)["open"].append(copy)

    @cuda.jit(device=True)
    def shared_base(array):
        """The shared address of array[0]: here 0 (cp_async16_at's twin addresses its array by index)."""
        return np.uint32(0)

    @cuda.jit(device=True)
    def cp_async16_at(dst, base, dst_index, src, src_index, full):
        """cp_async16 at dst[dst_index], or 16 zero bytes when not `full` (base, the GPU's shared address of dst, is
        unused here)."""
        _copy16(dst, dst_index, src, src_index, bool(full), "cp_async16_at")

    @cuda.jit(device=True)
    def cp_async_commit():
        """This thread's copies since its last commit become one group."""
        state = _thread_state(threading.current_thread())
        for copy in state["open"]:
            copy.group = state["committed"]
        state["groups"].append(state["open"])
        state["open"] = []
        state["committed"] += 1

    @cuda.jit(device=True)
    def cp_async_wait(n):
        """Wait until at most the n most recent of this thread's committed groups are pending."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"cp_async_wait: n must be a non-negative integer constant, got {n!r}")
        state = _thread_state(threading.current_thread())
        with _LOCK:
            while len(state["groups"]) > n:
                for copy in state["groups"].pop(0):
                    entry = _PENDING.get(id(copy.root))
                    if entry is not None and entry[0] is copy.root and entry[1].get(copy.chunk) is copy:
                        del entry[1][copy.chunk]

    @cuda.jit(device=True)
    def cp_async_wait_all():
        """Commit, then wait for every group of this thread."""
        cp_async_commit()
        cp_async_wait(0)

    def _row(shared, index, function):
        """The 8 16-bit elements of the 16-byte row at shared[index] (checked like a copy, and against pending
        copies)."""
        array = _ndarray(shared, function, "shared")
        offset = _chunk_bytes(array, index, function, "shared", "row")
        root = _root(array)
        with _LOCK:
            table = _table(root)
            copy = table.get(offset // COPY_BYTES) if table else None
        if copy is not None:
            raise PendingCopyError(f"{_name(root)}: {function} reads row {int(index)} (bytes {offset}..{offset + 15}) "
                                   f"while a cp.async copy into it is still pending ({copy.describe()}): "
                                   "cp_async_wait, then cuda.syncthreads(), before the ldmatrix")
        return np.asarray(array)[index:index + COPY_BYTES // array.itemsize].view(np.uint16)

    def _ldmatrix(shared, row, scratch, warp, lane, transpose, function):
        cuda.syncthreads()                          # the previous call's readers are done with scratch
        scratch[warp, lane] = row
        cuda.syncthreads()
        group, thread = lane >> 2, lane % 4
        out = []
        for j in range(4):
            if transpose:                           # column `group` of matrix j, rows 2 * thread and the next
                # a loop, not a list comprehension: the lab's recorder knows this function's frames as a twin's
                # (register rows, not memory), and a comprehension runs in a frame of its own
                pair = [0, 0]
                for k in range(2):
                    pair[k] = _row(shared, scratch[warp, 8 * j + 2 * thread + k], function)[group]
            else:                                   # row `group` of matrix j, columns 2 * thread and the next
                pair = _row(shared, scratch[warp, 8 * j + group], function)[2 * thread:2 * thread + 2]
            out.append(np.uint32(int(pair[0]) | int(pair[1]) << 16))
        cuda.syncthreads()
        return out[0], out[1], out[2], out[3]

    @cuda.jit(device=True)
    def ldmatrix_x4(shared, row, scratch, warp, lane):
        """Four 8x8 16-bit matrices from the rows the warp's lanes point at (see the module docstring); returns
        this lane's four registers."""
        return _ldmatrix(shared, row, scratch, warp, lane, False, "ldmatrix_x4")

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(shared, row, scratch, warp, lane):
        """ldmatrix_x4 with each matrix transposed (.trans)."""
        return _ldmatrix(shared, row, scratch, warp, lane, True, "ldmatrix_x4_trans")

    @cuda.jit(device=True)
    def ldmatrix_x4_at(shared, row, offset, scratch, warp, lane):
        """ldmatrix_x4 from row + offset."""
        return _ldmatrix(shared, row + offset, scratch, warp, lane, False, "ldmatrix_x4_at")

    @cuda.jit(device=True)
    def ldmatrix_x4_trans_at(shared, row, offset, scratch, warp, lane):
        """ldmatrix_x4_trans from row + offset."""
        return _ldmatrix(shared, row + offset, scratch, warp, lane, True, "ldmatrix_x4_trans_at")
else:
    from types import SimpleNamespace

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import _intrinsic, intrinsic  # _intrinsic: `intrinsic` with options (prefer_literal)

    from ._vector import element_pointer

    _WORD = ir.IntType(32)
    # The generic address of a shared element -> the 32-bit shared-window address cp.async and ldmatrix take
    # (what CUDA C++'s __cvta_generic_to_shared does); operand {0} is the 64-bit generic pointer.
    _SHARED = "cvta.to.shared.u64 a, {0}; cvt.u32.u64 s, a;"

    def _is_vector(array, index):
        return isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)

    def _void(context, builder, text, constraints, operands):
        # side_effect and the memory clobber: the optimizer must neither drop these nor move loads and stores of
        # shared memory across them.
        fnty = ir.FunctionType(ir.VoidType(), [v.type for v in operands])
        builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), operands)
        return context.get_dummy_value()

    @intrinsic
    def async_target(typingctx, array):
        """The shared array itself (the simulator's twin returns a checked view)."""
        if not isinstance(array, types.Array):
            return None

        def codegen(context, builder, sig, args):
            return args[0]

        return array(array), codegen

    @intrinsic
    def cp_async16(typingctx, dst, dst_index, src, src_index):
        """cp.async.cg.shared.global [dst + dst_index], [src + src_index], 16."""
        if not (_is_vector(dst, dst_index) and _is_vector(src, src_index)):
            return None

        def codegen(context, builder, sig, args):
            shared = element_pointer(context, builder, sig, args)
            glob = element_pointer(context, builder, SimpleNamespace(args=sig.args[2:]), args[2:])
            text = ("{ .reg .u64 a, g; .reg .u32 s; " + _SHARED.format("$0")
                    + " cvta.to.global.u64 g, $1; cp.async.cg.shared.global [s], [g], 16; }")
            return _void(context, builder, text, "l,l,~{memory}", [shared, glob])

        return types.void(dst, dst_index, src, src_index), codegen

    @intrinsic
    def shared_base(typingctx, array):
        """cvta.to.shared of array[0]'s generic address, as 32 bits. Pure (no side effect): the compiler keeps one."""
        if not isinstance(array, types.Array):
            return None

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            fnty = ir.FunctionType(_WORD, [data.type])
            text = "{ .reg .u64 a; cvta.to.shared.u64 a, $1; cvt.u32.u64 $0, a; }"
            return builder.call(ir.InlineAsm(fnty, text, "=r,l"), [data])

        return types.uint32(array), codegen

    @intrinsic
    def cp_async16_at(typingctx, dst, base, dst_index, src, src_index, full):
        """cp.async.cg.shared.global [base + dst_index * size], [src + src_index * size], 16, full ? 16 : 0."""
        if not (_is_vector(dst, dst_index) and _is_vector(src, src_index) and isinstance(base, types.Integer)
                and isinstance(full, types.Boolean)):
            return None
        wide = src_index.bitwidth > 32
        # a 32-bit index (a non-negative int32 or a uint32) widens inside the multiply-add: one IMAD.WIDE.U32
        mad = "mad.lo.u64 g, $2, {size}, $1;" if wide else "mad.wide.u32 g, $2, {size}, $1;"
        text = ("{ .reg .u64 g; " + mad.format(size=src.dtype.bitwidth // 8)
                + " cvta.to.global.u64 g, g; cp.async.cg.shared.global [$0], [g], 16, $3; }")

        def codegen(context, builder, sig, args):
            word = lambda k: context.cast(builder, args[k], sig.args[k], types.uint32)   # noqa: E731
            size = ir.Constant(_WORD, dst.dtype.bitwidth // 8)
            shared = builder.add(word(1), builder.mul(word(2), size))              # 32 bits: no carry to form
            data = context.make_array(sig.args[3])(context, builder, value=args[3]).data
            index = args[4] if wide else word(4)
            flag = context.cast(builder, args[5], sig.args[5], types.boolean)
            source_bytes = builder.select(flag, ir.Constant(_WORD, 16), ir.Constant(_WORD, 0))
            return _void(context, builder, text, "r,l," + ("l" if wide else "r") + ",r,~{memory}",
                         [shared, data, index, source_bytes])

        return types.void(dst, base, dst_index, src, src_index, full), codegen

    @intrinsic
    def cp_async_commit(typingctx):
        """cp.async.commit_group."""
        def codegen(context, builder, sig, args):
            return _void(context, builder, "cp.async.commit_group;", "~{memory}", [])

        return types.void(), codegen

    # prefer_literal: a constant argument arrives as its literal first, so a runtime one can be refused by name.
    @_intrinsic(target="cuda", prefer_literal=True)
    def cp_async_wait(typingctx, n):
        """cp.async.wait_group n (n a compile-time constant)."""
        if not isinstance(n, types.IntegerLiteral) or n.literal_value < 0:
            raise TypeError(f"cp_async_wait(n): n must be a non-negative compile-time integer constant (the "
                            f"instruction encodes it), got {n}: pass a literal or a global (an expression such as "
                            "STAGES - 1 is computed at run time; name it as a global first)")
        count = n.literal_value

        def codegen(context, builder, sig, args):
            return _void(context, builder, f"cp.async.wait_group {count};", "~{memory}", [])

        return types.void(n), codegen

    @intrinsic
    def cp_async_wait_all(typingctx):
        """cp.async.wait_all."""
        def codegen(context, builder, sig, args):
            return _void(context, builder, "cp.async.wait_all;", "~{memory}", [])

        return types.void(), codegen

    def _ldmatrix(transpose: bool):
        text = ("{ .reg .u64 a; .reg .u32 s; " + _SHARED.format("$4") + " ldmatrix.sync.aligned.m8n8.x4"
                + (".trans" if transpose else "") + ".shared.b16 {$0, $1, $2, $3}, [s]; }")

        def load(typingctx, shared, row):
            if not _is_vector(shared, row):
                return None

            def codegen(context, builder, sig, args):
                pointer = element_pointer(context, builder, sig, args)
                fnty = ir.FunctionType(ir.LiteralStructType([_WORD] * 4), [pointer.type])
                # side_effect: warp-collective, like the mma; the clobber orders it after the shared stores
                out = builder.call(ir.InlineAsm(fnty, text, "=r,=r,=r,=r,l,~{memory}", side_effect=True), [pointer])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, k) for k in range(4)])

            return types.UniTuple(types.uint32, 4)(shared, row), codegen

        load.__name__ = load.__qualname__ = "_ldmatrix_trans" if transpose else "_ldmatrix"
        return intrinsic(load)

    _ldmatrix_x4, _ldmatrix_x4_trans = _ldmatrix(False), _ldmatrix(True)

    def _ldmatrix_at(transpose: bool):
        """ldmatrix from the shared address of shared[row] plus offset elements (`ldmatrix_x4_at`)."""
        def load(typingctx, shared, row, offset):
            if not (_is_vector(shared, row) and isinstance(offset, types.Integer)):
                return None
            shift = (shared.dtype.bitwidth // 8).bit_length() - 1           # elements -> bytes
            text = ("{ .reg .u64 a; .reg .u32 s, o; " + _SHARED.format("$4") + f" shl.b32 o, $5, {shift}; "
                    "add.u32 s, s, o; ldmatrix.sync.aligned.m8n8.x4" + (".trans" if transpose else "")
                    + ".shared.b16 {$0, $1, $2, $3}, [s]; }")

            def codegen(context, builder, sig, args):
                pointer = element_pointer(context, builder, sig, args)
                distance = context.cast(builder, args[2], sig.args[2], types.int32)
                fnty = ir.FunctionType(ir.LiteralStructType([_WORD] * 4), [pointer.type, _WORD])
                out = builder.call(ir.InlineAsm(fnty, text, "=r,=r,=r,=r,l,r,~{memory}", side_effect=True),
                                   [pointer, distance])
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, k) for k in range(4)])

            return types.UniTuple(types.uint32, 4)(shared, row, offset), codegen

        load.__name__ = load.__qualname__ = "_ldmatrix_trans_at" if transpose else "_ldmatrix_at"
        return intrinsic(load)

    _ldmatrix_x4_at, _ldmatrix_x4_trans_at = _ldmatrix_at(False), _ldmatrix_at(True)

    @cuda.jit(device=True)
    def ldmatrix_x4_at(shared, row, offset, scratch, warp, lane):
        """ldmatrix_x4 from row + offset, offset a compile-time constant in the instruction (scratch, warp and lane
        unused here)."""
        return _ldmatrix_x4_at(shared, row, offset)

    @cuda.jit(device=True)
    def ldmatrix_x4_trans_at(shared, row, offset, scratch, warp, lane):
        """ldmatrix_x4_at with each matrix transposed (.trans)."""
        return _ldmatrix_x4_trans_at(shared, row, offset)

    @cuda.jit(device=True)
    def ldmatrix_x4(shared, row, scratch, warp, lane):
        """Four 8x8 16-bit matrices from the rows the warp's lanes point at; this lane's four registers (scratch,
        warp and lane unused here)."""
        return _ldmatrix_x4(shared, row)

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(shared, row, scratch, warp, lane):
        """ldmatrix_x4 with each matrix transposed (.trans)."""
        return _ldmatrix_x4_trans(shared, row)
