"""cacheattn.lab.record: counters calibrated on kernels whose figures follow from the CUDA programming guide by
hand, and sanitizer findings on kernels with one planted defect each (and none on a clean one).

Hand rules used below: a warp is 32 consecutive threads; a global request touches the distinct 32-byte sectors its
lanes' bytes fall in; shared memory has 32 banks of 4-byte words, a request takes as many wavefronts as the most
distinct words one bank serves (8-byte accesses half a warp at a time, 16-byte a quarter); DRAM bytes are 32 x
the distinct sectors of the launch.
"""

import inspect
import os

import numba
import numpy as np
import pytest
from numba import cuda

from cacheattn import lab
from cacheattn.lab.recorder import (
    CONFLICTS_LD,
    CONFLICTS_ST,
    DRAM_READ,
    DRAM_WRITE,
    GLOBAL_LD,
    GLOBAL_ST,
    SECTORS_LD,
    SECTORS_ST,
    WAVEFRONTS_LD,
    WAVEFRONTS_ST,
)
from kernels_numba import _async_copy as ac
from kernels_numba._vector import load16

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the lab counts in numba's CUDA simulator")
RNG = np.random.default_rng(20261128)
LDM_SCRATCH = ac.scratch_shape(1)


def line_of(kernel, text):
    """"test_lab.py:N" of the first line of `kernel`'s source containing `text`."""
    lines, first = inspect.getsourcelines(kernel.py_func)
    return f"test_lab.py:{first + next(i for i, line in enumerate(lines) if text in line)}"


def counted(kernel, grid, block, *args):
    with lab.record() as rec:
        kernel[grid, block](*args)
    return rec


def global_figures(rec):
    m = rec.metrics
    return m[GLOBAL_LD], m[SECTORS_LD], m[GLOBAL_ST], m[SECTORS_ST], m[DRAM_READ], m[DRAM_WRITE]


# ---- global memory ------------------------------------------------------------------------------------------------

@cuda.jit
def strided_copy(src, dst, stride):
    i = cuda.grid(1)
    dst[i] = src[i * stride]


@pytest.mark.parametrize("dtype,stride,sectors", [
    (np.float32, 1, 4),         # 32 lanes x 4 bytes = 128 contiguous bytes = 4 sectors
    (np.float32, 2, 8),         # every other float: the lanes span 256 bytes = 8 sectors, half of each unused
    (np.float16, 1, 2),         # 32 x 2 bytes = 64 bytes = 2 sectors
    (np.float64, 1, 8),         # 32 x 8 bytes = 256 bytes = 8 sectors
])
def test_global_sectors_per_request(dtype, stride, sectors):
    # 2 blocks of 64 threads = 4 warps, one load and one store each: 4 requests of each kind. The stores are
    # always contiguous: 32 x itemsize bytes per warp.
    src = (np.arange(128 * stride) % 7 + 1).astype(dtype)
    dst = np.zeros(128, dtype)
    rec = counted(strided_copy, 2, 64, src, dst, stride)
    assert np.array_equal(dst, src[::stride])
    store_sectors = 32 * np.dtype(dtype).itemsize // 32
    # DRAM: the loads cover 128 * stride elements, every sector of src; the stores all 128 elements of dst.
    assert global_figures(rec) == (4, 4 * sectors, 4, 4 * store_sectors, 128 * stride * np.dtype(dtype).itemsize,
                                   128 * np.dtype(dtype).itemsize)
    assert rec.hazards == []


@cuda.jit
def vector_copy(src, words):
    i = cuda.grid(1)
    w = load16(src, 4 * i)                  # floats 4i .. 4i + 3 in one 16-byte load (the simulator twin)
    for j in range(4):
        words[4 * i + j] = w[j]


def test_16_byte_vector_loads_are_one_access_of_16_bytes():
    # One warp: 32 lanes x 16 bytes = 512 contiguous bytes = 16 sectors in one request. The four uint32 stores
    # are four requests of 32 lanes x 4 bytes spread over 512 bytes: 16 sectors each.
    src = np.arange(128, dtype=np.float32) + 0.5
    words = np.zeros(128, np.uint32)
    rec = counted(vector_copy, 1, 32, src, words)
    assert np.array_equal(words, src.view(np.uint32))
    assert global_figures(rec) == (1, 16, 4, 64, 512, 512)
    assert rec.extra["global_ld_bytes_requested"] == 512           # 100% sector efficiency


@cuda.jit
def broadcast(src, dst):
    i = cuda.grid(1)
    dst[i] = src[0]


def test_one_address_for_every_lane_is_one_sector():
    # Every lane reads element 0: one sector per request (2 warps, 2 requests), and 4 bytes asked per request.
    src = np.array([3.0, 4.0], np.float32)
    dst = np.zeros(64, np.float32)
    rec = counted(broadcast, 1, 64, src, dst)
    assert global_figures(rec)[:2] == (2, 2)
    assert rec.extra["global_ld_bytes_requested"] == 2 * 4
    assert rec.metrics[DRAM_READ] == 32


@cuda.jit
def both_blocks_read(src, dst):
    t = cuda.threadIdx.x
    dst[cuda.blockIdx.x * 32 + t] = src[t]


def test_two_blocks_reading_one_array_fetch_it_from_dram_once():
    # Two blocks read the same 128 bytes: 2 requests of 4 sectors, but the launch's distinct sectors are 4, so
    # 128 bytes from DRAM; each block writes its own 128 bytes: 256.
    src = np.arange(32, dtype=np.float32)
    dst = np.zeros(64, np.float32)
    rec = counted(both_blocks_read, 2, 32, src, dst)
    assert global_figures(rec) == (2, 8, 2, 8, 128, 256)
    # Two launches: DRAM bytes are per launch, summed (the second launch reads src from DRAM again).
    with lab.record() as rec:
        both_blocks_read[2, 32](src, dst)
        both_blocks_read[2, 32](src, dst)
    assert rec.metrics[DRAM_READ] == 256 and rec.extra["launches"] == 2 and len(rec.launches) == 2


def test_2d_grid_and_block_warps_come_from_the_linear_thread_id():
    # Block (16, 4): the linear id x + 16 y puts rows y = 0, 1 in warp 0 and 2, 3 in warp 1. Each thread reads
    # element 16 y + x: a warp reads 32 consecutive floats, 4 sectors.
    @cuda.jit
    def by_rows(src, dst):
        x, y = cuda.threadIdx.x, cuda.threadIdx.y
        dst[16 * y + x] = src[16 * y + x]

    src = np.arange(64, dtype=np.float32)
    dst = np.zeros(64, np.float32)
    rec = counted(by_rows, 1, (16, 4), src, dst)
    assert global_figures(rec) == (2, 8, 2, 8, 256, 256)


# ---- shared memory ------------------------------------------------------------------------------------------------

def make_shared_walk(width, dtype, pattern):
    """A kernel that fills a (32, width) shared array in flat order (request k: elements 32 k .. 32 k + 31, 32
    consecutive words, one wavefront; `width` requests), waits at a barrier, then reads once with `pattern`."""
    @cuda.jit
    def walk(out):
        tile = cuda.shared.array((32, width), dtype)
        t = cuda.threadIdx.x
        for e in range(t, 32 * width, 32):      # the same trip count in every lane
            tile[e // width, e % width] = e
        cuda.syncthreads()
        if pattern == 0:
            out[t] = tile[t, 0]                 # column walk
        elif pattern == 1:
            out[t] = tile[0, 0]                 # every lane the same word
        else:
            out[t] = tile[0, 2 * t]             # stride 2
    return walk


@pytest.mark.parametrize("width,pattern,wavefronts", [
    (32, 0, 32),    # rows of 32 floats = 128 bytes: lane t's word 32 t is in bank 0 for every lane -> 32
    (33, 0, 1),     # rows padded to 33: word 33 t is in bank t % 32, all different -> 1
    (32, 1, 1),     # one word for all lanes: served once -> 1
    (64, 2, 2),     # stride 2: words 2 t; lanes t and t + 16 share bank 2 t % 32 with different words -> 2
])
def test_shared_wavefronts_and_bank_conflicts(width, pattern, wavefronts):
    out = np.zeros(32, np.float32)
    rec = counted(make_shared_walk(width, np.float32, pattern), 1, 32, out)
    want = {0: np.arange(32) * width, 1: np.zeros(32), 2: 2 * np.arange(32)}[pattern]
    assert np.array_equal(out, want)
    m = rec.metrics
    assert (m[WAVEFRONTS_LD], m[CONFLICTS_LD]) == (wavefronts, wavefronts - 1)
    assert (m[WAVEFRONTS_ST], m[CONFLICTS_ST], rec.extra["shared_st_requests"]) == (width, 0, width)
    assert rec.hazards == []


@pytest.mark.parametrize("step,wavefronts", [
    (1, 2),     # lane t reads float64 t: each half-warp reads 128 contiguous bytes, one word per bank: 1 + 1
    (2, 4),     # float64 2 t: in a half-warp, lanes t and t + 8 land on the same banks: 2 + 2, 2 conflicts
])
def test_shared_8_byte_accesses_are_served_a_half_warp_at_a_time(step, wavefronts):
    @cuda.jit
    def wide(out):
        values = cuda.shared.array(64, np.float64)
        t = cuda.threadIdx.x
        values[t] = t
        values[t + 32] = t
        cuda.syncthreads()
        out[t] = values[step * t]

    out = np.zeros(32, np.float64)
    rec = counted(wide, 1, 32, out)
    m = rec.metrics
    assert (m[WAVEFRONTS_LD], m[CONFLICTS_LD]) == (wavefronts, wavefronts - 2)
    assert (m[WAVEFRONTS_ST], m[CONFLICTS_ST]) == (4, 0)      # two requests of consecutive float64: 2 each
    assert rec.hazards == []


def test_registers_and_local_arrays_are_not_memory():
    @cuda.jit
    def local(src, dst):
        t = cuda.threadIdx.x
        scratch = cuda.local.array(4, np.float32)
        for j in range(4):
            scratch[j] = src[t] * j
        dst[t] = scratch[3]

    src = np.arange(32, dtype=np.float32)
    dst = np.zeros(32, np.float32)
    rec = counted(local, 1, 32, src, dst)
    # The four reads of src[t] are four requests (one site, executed four times per lane).
    assert global_figures(rec) == (4, 16, 1, 4, 128, 128)
    assert rec.metrics[WAVEFRONTS_LD] == rec.metrics[WAVEFRONTS_ST] == 0


# ---- sanitizers ---------------------------------------------------------------------------------------------------

@cuda.jit
def neighbour_sum(src, dst, synchronise):
    s = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    s[t] = src[t]
    if synchronise:
        cuda.syncthreads()
    dst[t] = s[t] + s[(t + 1) % 64]


def test_clean_kernel_gives_no_finding():
    src = np.arange(64, dtype=np.float32) + 1
    dst = np.zeros(64, np.float32)
    rec = counted(neighbour_sum, 1, 64, src, dst, True)
    assert np.array_equal(dst, src + np.roll(src, -1))
    assert rec.hazards == [] and "0 finding(s)" in rec.report()


def test_race_without_the_barrier_names_both_lines():
    # Without the barrier, thread t reads s[t + 1], which thread t + 1 writes in the same barrier interval.
    src = np.arange(64, dtype=np.float32) + 1
    rec = counted(neighbour_sum, 1, 64, src, np.zeros(64, np.float32), False)
    races = [h for h in rec.hazards if h.kind == "race"]
    assert len(races) == 1
    race = races[0]
    assert race.array == "s"
    assert sorted(race.lines) == sorted([line_of(neighbour_sum, "s[t] = src[t]"), line_of(neighbour_sum, "dst[t] =")])
    # All 64 readers of a neighbour's word conflict with its writer; the word a thread reads itself does not.
    assert race.count == 64
    (_, first), (_, second) = race.threads
    assert first != second
    # The simulator interleaves threads freely: whichever came first, the same pair of sites; some reads may also
    # have come before any write (uninitialized), never anything else.
    assert {h.kind for h in rec.hazards} <= {"race", "uninitialized"}


def test_write_write_race():
    @cuda.jit
    def last_writer_wins(dst):
        flag = cuda.shared.array(1, np.int32)
        flag[0] = cuda.threadIdx.x
        cuda.syncthreads()
        dst[cuda.threadIdx.x] = flag[0]

    rec = counted(last_writer_wins, 1, 32, np.zeros(32, np.int32))
    assert [(h.kind, h.array, h.count) for h in rec.hazards] == [("race", "flag", 31)]


@cuda.jit
def half_initialised(dst):
    s = cuda.shared.array(64, np.float32)
    t = cuda.threadIdx.x
    if cuda.blockIdx.x == 0 and t < 32:
        s[t] = t
    if t < 32:
        s[t + 32] = t
    cuda.syncthreads()
    dst[cuda.blockIdx.x * 64 + t] = s[t]


def test_uninitialized_shared_read_is_per_block():
    # Block 0's threads 0..31 write words t and t + 32; block 1's only t + 32, so its threads 0..31 read words
    # no thread of block 1 wrote. The simulator hands both blocks the same array (already holding block 0's
    # values); a GPU would not.
    rec = counted(half_initialised, 2, 64, np.zeros(128, np.float32))
    assert len(rec.hazards) == 1
    finding = rec.hazards[0]
    assert (finding.kind, finding.array, finding.count) == ("uninitialized", "s", 32)
    assert finding.threads[0][0] == (1, 0, 0)                       # in block 1
    assert finding.lines == (line_of(half_initialised, "dst["),)


@cuda.jit
def shifted_copy(src, dst, shift):
    i = cuda.grid(1)
    dst[i] = src[i + shift]


def test_negative_index_is_out_of_bounds():
    # src[-1] is the last element for NumPy (the simulator runs on), before the array on a GPU.
    src = np.arange(32, dtype=np.float32)
    rec = counted(shifted_copy, 1, 32, src, np.zeros(32, np.float32), -1)
    assert [(h.kind, h.array, h.index, h.count) for h in rec.hazards] == [("out_of_bounds", "src", -1, 1)]
    assert rec.hazards[0].threads == (((0, 0, 0), (0, 0, 0)),)


def test_index_past_the_end_is_recorded_before_the_launch_fails():
    src = np.arange(32, dtype=np.float32)
    with pytest.raises(IndexError):
        with lab.record() as rec:
            shifted_copy[1, 32](src, np.zeros(32, np.float32), 1)
    assert [(h.kind, h.array, h.index) for h in rec.hazards] == [("out_of_bounds", "src", 32)]
    assert "out_of_bounds" in rec.report()


def test_negative_shared_index_and_a_vector_load_past_the_end():
    @cuda.jit
    def before_the_start(dst):
        s = cuda.shared.array(32, np.float32)
        t = cuda.threadIdx.x
        s[t] = t
        cuda.syncthreads()
        dst[t] = s[t - 1]                       # thread 0 reads s[-1]

    rec = counted(before_the_start, 1, 32, np.zeros(32, np.float32))
    assert [(h.kind, h.array, h.index, h.count) for h in rec.hazards] == [("out_of_bounds", "s", -1, 1)]

    @cuda.jit
    def overrun(src, dst):
        words = load16(src, 30)                 # 16 bytes from float 30 of 32: floats 30 .. 33
        dst[0] = words[0]

    with pytest.raises(IndexError):             # NumPy clips the slice to 2 floats; the twin then lacks words 2, 3
        with lab.record() as rec:
            overrun[1, 1](np.zeros(32, np.float32), np.zeros(1, np.uint32))
    assert [(h.kind, h.array) for h in rec.hazards] == [("out_of_bounds", "src")]


def test_barriers_of_the_simulators_warp_twins_are_not_barriers():
    # kernels_numba._warp.xor_reduce is a shuffle on a GPU: no shared memory, no barrier. Its simulator twin holds
    # two block barriers; they must not hide a race between the kernel's own accesses around it.
    from kernels_numba._warp import warp_sum

    @cuda.jit
    def racy_around_a_shuffle(dst):
        scratch = cuda.shared.array((1, 32), np.float32)
        s = cuda.shared.array(32, np.float32)
        t = cuda.threadIdx.x
        s[t] = t
        total = warp_sum(np.float32(1.0), scratch, 0, t)
        dst[t] = s[(t + 1) % 32] + total

    rec = counted(racy_around_a_shuffle, 1, 32, np.zeros(32, np.float32))
    assert [(h.kind, h.array) for h in rec.hazards] == [("race", "s")]
    assert rec.metrics[WAVEFRONTS_LD] == 1 and rec.metrics[WAVEFRONTS_ST] == 1     # the scratch is not counted


def test_record_needs_the_simulator(monkeypatch):
    from numba import config
    monkeypatch.setattr(config, "ENABLE_CUDASIM", 0)
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM=1"):
        with lab.record():
            pass


def test_atomics_do_not_race_and_count_as_read_and_write():
    # 64 threads add 1 to one shared counter and to one global word: atomics do not race with one another, and
    # are no plain load/store requests; the global word's sector is read and written once.
    @cuda.jit
    def count(total):
        counter = cuda.shared.array(1, np.int32)
        if cuda.threadIdx.x == 0:
            counter[0] = 0
        cuda.syncthreads()
        cuda.atomic.add(counter, 0, 1)
        cuda.atomic.add(total, 0, 1)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            total[1] = counter[0]

    total = np.zeros(2, np.int32)
    rec = counted(count, 1, 64, total)
    assert list(total) == [64, 64]
    assert rec.hazards == []
    # Thread 0's store of total[1] is the one plain global request; the counter's store and load the shared ones.
    assert global_figures(rec) == (0, 0, 1, 1, 32, 32)
    assert rec.extra["shared_st_requests"] == rec.extra["shared_ld_requests"] == 1


def test_dynamic_shared_memory():
    # Dynamic shared memory (a size-0 array, the launch's fourth configuration value): lane t writes float t and
    # reads float 2 t of the same 256 bytes: stride 2, 2 wavefronts.
    @cuda.jit
    def dynamic(out):
        s = cuda.shared.array(0, numba.float32)
        t = cuda.threadIdx.x
        s[t] = t
        s[t + 32] = t + 32
        cuda.syncthreads()
        out[t] = s[2 * t]

    out = np.zeros(32, np.float32)
    with lab.record() as rec:
        dynamic[1, 32, 0, 256](out)
    assert np.array_equal(out, 2 * np.arange(32))
    m = rec.metrics
    assert (m[WAVEFRONTS_LD], m[CONFLICTS_LD], m[WAVEFRONTS_ST]) == (2, 1, 2)
    assert rec.hazards == []


def test_lines_say_where_the_conflicts_are():
    # The column walk's 31 conflicts belong to its load line; the row stores before it have none.
    out = np.zeros(32, np.float32)
    rec = counted(make_shared_walk(32, np.float32, 0), 1, 32, out)
    conflicted = {line: f for line, f in rec.lines.items() if f["shared_ld_conflicts"]}
    assert len(conflicted) == 1
    (line, figures), = conflicted.items()
    assert (figures["shared_ld_requests"], figures["shared_ld_wavefronts"], figures["shared_ld_conflicts"]) == \
        (1, 32, 31)
    assert sum(f["shared_st_wavefronts"] for f in rec.lines.values()) == rec.metrics[WAVEFRONTS_ST] == 32
    assert sum(f["global_st_sectors"] for f in rec.lines.values()) == rec.metrics[SECTORS_ST] == 4


def test_hmma_counts_one_per_warp_per_mma():
    # Two warps, three mma.sync each: 6 warp-level HMMA, whatever the 64 threads do with the results.
    from kernels_numba._mma import mma_m16n8k16, scratch_shapes

    regs_shape, _ = scratch_shapes(2)

    @cuda.jit
    def three_mmas(out):
        scratch = cuda.shared.array(regs_shape, np.uint32)
        t = cuda.threadIdx.x
        d = np.float32(0.0)
        for _ in range(3):
            d0, d1, d2, d3 = mma_m16n8k16(np.uint32(0x3C003C00), np.uint32(0), np.uint32(0), np.uint32(0),
                                          np.uint32(0x3C003C00), np.uint32(0), d, d, d, d, scratch, t // 32, t % 32)
            d = d0
        out[t] = d

    out = np.full(64, np.nan, np.float32)
    rec = counted(three_mmas, 1, 64, out)
    assert rec.extra[lab.recorder.HMMA] == 6
    assert not np.isnan(out).any()


# ---- cp.async and ldmatrix (kernels_numba._async_copy's twins) ---------------------------------------------------
# Rows of 8 chunks of 16 bytes (64 halves, 128 bytes): unswizzled, chunk c of every row lies in the same 4 banks.

@cuda.jit
def staged_ldmatrix(values, out, swizzle, transpose):
    """One warp: 8 rows x 8 chunks of `values` into shared memory by cp.async (chunk c of row r stored at chunk
    c ^ r when `swizzle`), then one ldmatrix_x4 of chunks 0..3 of the 8 rows (matrix j: chunk j)."""
    lane = cuda.threadIdx.x
    tile = ac.async_target(cuda.shared.array(512, np.uint16, alignment=ac.SHARED_ALIGNMENT))
    scratch = cuda.shared.array(LDM_SCRATCH, np.int32)
    for n in range(2):
        row, chunk = (lane + 32 * n) // 8, (lane + 32 * n) % 8
        ac.cp_async16(tile, 64 * row + 8 * (chunk ^ row if swizzle else chunk), values, 64 * row + 8 * chunk)
    ac.cp_async_commit()
    ac.cp_async_wait(0)
    cuda.syncthreads()
    r, j = lane % 8, lane // 8
    at = 64 * r + 8 * (j ^ r if swizzle else j)
    if transpose:
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = ac.ldmatrix_x4_trans(tile, at, scratch, 0, lane)
    else:
        out[lane, 0], out[lane, 1], out[lane, 2], out[lane, 3] = ac.ldmatrix_x4(tile, at, scratch, 0, lane)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("swizzle,wavefronts", [
    (True, 4),      # chunk j ^ r of row r: the 8 rows of each matrix in 8 different bank groups, 1 wavefront each
    (False, 32),    # chunk j of rows 128 bytes apart: 8 rows in one bank group, 8 wavefronts a matrix, 7 conflicts
])
def test_ldmatrix_counts_a_wavefront_a_matrix_when_its_rows_miss_each_other(swizzle, wavefronts, transpose):
    values = RNG.integers(0, 2**16, 512).astype(np.uint16)
    out = np.zeros((32, 4), np.uint32)
    rec = counted(staged_ldmatrix, 1, 32, values, out, swizzle, transpose)
    # lane 4i + q, register j: elements (i, 2q), (i, 2q + 1) of matrix j (.trans: of its transpose)
    matrices = values.reshape(8, 8, 8).transpose(1, 0, 2).astype(np.uint32)      # [chunk j, row, element]
    if transpose:
        matrices = matrices.transpose(0, 2, 1)
    lane = np.arange(32)
    want = np.stack([matrices[j, lane // 4, 2 * (lane % 4)] | matrices[j, lane // 4, 2 * (lane % 4) + 1] << 16
                     for j in range(4)], axis=1)
    assert np.array_equal(out, want)
    m = rec.metrics
    assert (m[WAVEFRONTS_LD], m[CONFLICTS_LD], rec.extra["shared_ld_requests"]) == (wavefronts, wavefronts - 4, 1)
    # the copies' stores: 2 requests, each quarter-warp one whole row (a permutation of its chunks): 4 + 4
    assert (m[WAVEFRONTS_ST], m[CONFLICTS_ST], rec.extra["shared_st_requests"]) == (8, 0, 2)
    assert rec.async_copies == {"cp_async_requests": 2, "ldmatrix_requests": 1}
    assert rec.hazards == []


def make_copy_or_load(stride, copy):
    """One warp reads 16 bytes a lane from chunk stride x lane of `src`, by cp.async into a 128-byte-stride shared
    layout (copy) or by a 16-byte load (the load16 twin, LDG.128)."""
    @cuda.jit
    def kernel(src, out):
        lane = cuda.threadIdx.x
        tile = ac.async_target(cuda.shared.array(32 * 64, np.uint16, alignment=ac.SHARED_ALIGNMENT))
        if copy:
            ac.cp_async16(tile, 64 * lane, src, 8 * stride * lane)
            ac.cp_async_wait_all()
            out[lane] = np.uint32(tile[64 * lane]) | np.uint32(tile[64 * lane + 1]) << np.uint32(16)
        else:
            w0, w1, w2, w3 = load16(src, 8 * stride * lane)
            out[lane] = w0
    return kernel


@pytest.mark.parametrize("stride,sectors", [(1, 16), (2, 32)])   # 512 contiguous bytes; every other 16 bytes
def test_cp_async_reads_the_sectors_of_a_16_byte_load_and_stores_as_sts128(stride, sectors):
    src = RNG.integers(0, 2**16, 8 * stride * 32).astype(np.uint16)
    outs, figures = [], []
    for copy in (True, False):
        out = np.zeros(32, np.uint32)
        rec = counted(make_copy_or_load(stride, copy), 1, 32, src, out)
        outs.append(out)
        figures.append((rec.metrics[GLOBAL_LD], rec.metrics[SECTORS_LD], rec.metrics[DRAM_READ],
                        rec.extra["global_ld_bytes_requested"]))
        assert rec.hazards == []
        if copy:
            # lanes 128 bytes apart: a quarter-warp's 8 chunks in one bank group, 8 wavefronts each (as STS.128)
            assert (rec.metrics[WAVEFRONTS_ST], rec.metrics[CONFLICTS_ST]) == (32, 28)
            assert rec.async_copies["cp_async_requests"] == 1
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[0], src.view(np.uint32)[::4 * stride])
    assert figures[0] == figures[1] == (1, sectors, 32 * sectors, 512)
