"""Rung 5's decode kernel: a GQA group's query rows on tensor cores (`mma.sync.m16n8k16`), K and V fed to them
straight from registers (TensorRT-LLM's XQA idea, written for this ladder).

A block serves one sequence's decode token for the query heads of one GQA group (<= 16, padded to the 16 rows of
an A tile); its warps split the keys, each walking its own tiles of 16 keys (a *trip*) with no barrier and no
shared-memory staging: every lane loads the K and V elements its B fragments need from global memory in whole
16-byte (8-, 4-, 2-byte for short rows) loads, unpacks them in registers and feeds the mma. At the end the warps
merge their (m, l, O) through shared memory, as the prefill kernel does (`_attention_mma`). Keys are not split
across blocks: a batch of 64 decodes at 8 kv heads is 512 blocks, which fill the GPU (one long sequence is rung
4's case).

With g = lane >> 2 and q = lane & 3 (PTX's groupID and threadID_in_group), the fragments of `_mma` are fixed:
K's B fragment gives lane (g, q) key column g and reduction indices {2q, 2q + 1, 2q + 8, 2q + 9} of each k16 step,
V's gives keys {2q, 2q + 1, 2q + 8, 2q + 9} of the trip at output column g of each n8 tile. Both reductions and
O's columns may be taken in any order, so the kernel permutes them to make every load instruction read whole
32-byte sectors. A lane's *slice* of a row (a quarter of a key row, an eighth of a value row) is loaded in
16-byte chunks (one 8-, 4- or 2-byte load where the slice is shorter), and the lanes sharing the row interleave
them: chunk c of lane x is chunk x + L c of the row (L = 4 lanes for K, 8 for V), so load c of those lanes reads
L consecutive chunks (`lane_dim`). Within its slice a lane takes its elements in the order it loaded them:

    S = Q Kᵀ (head_dim D, k-step ks = 0 .. D/16 - 1). Lane q's slice of a key row holds D/4 dims; its B
    registers b0 = (k 2q, 2q + 1), b1 = (k 2q + 8, 2q + 9) hold the slice's elements

        format     b0 (low, high)         b1 (low, high)
        float16    4ks, 4ks + 1           4ks + 2, 4ks + 3          (words 2ks, 2ks + 1 of the slice as loaded)
        int8       4ks, 4ks + 1           4ks + 2, 4ks + 3          (int8x4_to_half2 of word ks)
        int4       8w + 2h, 8w + 2h + 4   8w + 2h + 1, 8w + 2h + 5  (ks = 2w + h: int4x8_to_half2 of word w)

    and Q's A fragments (built once, kept in registers) take the same dims, so S is unchanged: `k_dims`.

    O += P V (n8 tile vt = 0 .. D/8 - 1). Column g of tile vt is element vt of lane g's slice of a value row,
    so O's C element (row, column 2q + c) of tile vt is that element of lane 2q + c's slice, whose dim the final
    store un-permutes: `v_dim`. Its B registers pair two keys at one dim, so the two keys'
    loaded words are interleaved first (`_dequant.permute_bytes`, one prmt a register of float16, a half-register
    of int8, a quarter of int4) and then unpacked as K is: the low half is key 2q (2q + 8), the high half the next.

Quantized caches (float16 group scales) are dequantized by magic numbers and one mul.rn.f16x2 a register by the
codes' scale pair, which is the document's q * scale rounded to float16 bit for bit (`_dequant`): a K register's
two values share a key (their groups' scales), a V register's pair takes the two keys' scales of one group. A
chunk's group scales come in one load beside it, interleaved as the chunks are; where that would read half
sectors (two chunks of two groups: int8 at D = 128, groups of 8) each lane loads two chunks' scales of the row
in one 8-byte load, the quad a whole sector, and trades one with its neighbour lane. Q's A fragments (built once)
take K's dims, loaded in 16-byte loads of the query row.

A group of at most 8 heads computes its scores transposed, Sᵀ = K Qᵀ: the trip's 16 keys fill the mma's rows
(A: the K registers a lane loaded, keys grp and grp + 8 at the same reduction indices), the heads its 8 columns
(B: Q's row grp, two registers a k-step), so the scores take D / 16 mma instead of D / 8 and Q needs no zero rows.
Lane (g, q) then holds keys g, g + 8 of heads 2q, 2q + 1; four shuffles hand each head's keys to the lanes of its
row (`trip`), where the softmax continues unchanged. P·V is transposed too, Oᵀ += Vᵀ Pᵀ: the A fragment of
16 of V's dims is the B registers of two n8 tiles, Pᵀ's B fragment is P's A registers p0, p2, so it takes D / 16
mma with no zero rows (no zeroed accumulators a trip); lane (g, q) holds heads 2q, 2q + 1, whose rescale factors
two shuffles a trip bring, and two shuffles a tile turn Oᵀ back into the layout below after the last trip. FP8
(e4m3) codes convert by cvt.rn.f16x2.e4m3x2 where the compile's target has it, by integer instructions on sm_80
(`_dequant.e4m3x4_to_half2_target`).

Softmax runs on the C fragments as in the prefill kernel (a row's maximum over a trip by `quad_max2`), once a
trip, in base 2 (scores times log2(e) / sqrt(D), one ex2.approx an exponential): P, packed to float16, is the A
fragment of P·V. O is rescaled only when some lane's row maximum moved (a branch on the warp's vote, which after
the first trips of a long sequence is rarely taken). Rows 8 .. 15 of a group of at most 8 heads are empty: the
kernel drops their softmax, their O accumulators and Q's registers at compile time. Without a mask or ALiBi (a
compile-time choice) a decode score is q.k / sqrt(D): the one query sees every key, so the operator's score
function is not called.

Keys: the block's key range starts at a multiple of 16, warp w takes trips w, w + warps, ... Every round of trips
but the last holds whole tiles below the last key, so its loads need no bounds: a trip in one page (the page
length a multiple of 16, or an offset cache) is one page-table read, advanced by a walk of the page index (no
division), plus the lane's fixed key offsets. The last round (compiled apart) clamps every key past the end to the
last key, so all loads stay inside the sequence's pages and no value that is not the cache's own reaches P·V
(0 x NaN), and masks them; a trip past the end reloads the last tile, all masked. Every warp runs the same number
of trips (the simulator's mma needs all threads of the block). Pages shorter than a trip, or not a multiple of
16, look every key up. A cache whose keys are not at their positions' slots (a cyclic window past its wrap, sink
tokens, beams: `slot_map`, compile-time) looks up each trip's first key instead of walking the pages: a trip whose
16 keys follow it in one page loads as above, any other looks each key up.

bfloat16 (a compile-time choice): a bfloat16 query and cache are moved as their bits, through the same loads,
permutations and fragments, into `mma.sync ... .bf16` (`_mma.mma_m16n8k16_bf16`); P is packed to bfloat16 for P·V
and the output rounded to bfloat16, both to nearest even (cvt.rn.bf16x2.f32); the new token's scratch is read as
bfloat16 bits (a shift widens one exactly). Softmax, O and split-K partials stay float32. A quantized cache keeps
a bfloat16 query off this kernel: its codes dequantize to float16 pairs, for the float16 mma.

What the host must have decided (`decode_kernel_choice`): one query token a sequence, a float16 or bfloat16 query,
head_dim 32, 64 or 128, a cache of the query's dtype or (float16 query) an int8 / int4 one with float16 scales,
rows whose data and scales allow the vector loads, K and V on one page table.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
from numba import config, cuda

from ._attention_core import SHARED_BYTES
from ._cache import as_offset
from ._dequant import (
    INTERLEAVE_BYTES,
    INTERLEAVE_HALVES,
    e4m3x4_to_half2_target,
    half2_floats,
    int4x8_to_half2,
    int8x4_to_half2,
    load_bits2,
    load_bits4,
    mul_half2,
    mul_half2_by,
    pair_selector,
    permute_bytes,
    scale_half2,
)
from ._mma import (
    MMA_K,
    MMA_M,
    MMA_N,
    bf162_floats,
    mma_m16n8k16,
    mma_m16n8k16_bf16,
    pack_bf162,
    pack_half2,
    quad_max2,
    quad_sum2,
    scratch_shapes,
)
from ._numerics import narrow_bfloat16, widen_bfloat16
from ._vector import load8, load16
from ._warp import WARP_SIZE, lane_values, warp_any

LOG2_E = 1.4426950408889634   # scores are kept in base 2: exp(x) = 2 ** (x log2 e), one ex2 each
KEY_TILE = 16                 # keys a warp takes a trip: two n8 tiles of S, one k16 step of P·V
HEAD_DIMS = (32, 64, 128)     # a lane's K slice is whole 16-byte loads (or one smaller load) at these
QUERY_DTYPES = ("float16", "bfloat16")   # the mma's inputs (bfloat16: an unquantized bfloat16 cache)


if config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def exp2(x):
        """2 ** x in float32 (NumPy's, rounded once; the GPU's ex2.approx.ftz is within 2 ulp of it)."""
        return np.float32(np.exp2(np.float32(x)))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _ex2(typingctx, x):
        """ex2.approx.ftz.f32: one MUFU.EX2 (numba's math.exp adds range reduction around it)."""
        if not isinstance(x, types.Float):
            return None

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.float32)
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            return builder.call(ir.InlineAsm(fnty, "ex2.approx.ftz.f32 $0, $1;", "=f,f"), [value])

        return types.float32(x), codegen

    @cuda.jit(device=True)
    def exp2(x):
        """2 ** x in float32, ex2.approx.ftz.f32 (relative error below 2 ** -22; 2 ** -inf is 0)."""
        return _ex2(x)


def chunk_dims(slice_dims: int, quant_bit: int) -> int:
    """Dims of one load of a lane's slice of `slice_dims` dims: a 16-byte chunk (8 float16, 16 int8, 32 int4
    values), or the whole slice where it is shorter (one 8-, 4- or 2-byte load)."""
    return min(slice_dims, 128 // (quant_bit or 16))


def lane_dim(slice_dims: int, quant_bit: int, lanes: int, lane: int, dim: int) -> int:
    """The head dim of element `dim` (0 .. slice_dims - 1) of lane `lane`'s slice, the `lanes` lanes of a row
    interleaving their chunks: load c of the lanes reads chunks lanes * c .. lanes * c + lanes - 1 of the row, one
    contiguous run of whole sectors."""
    chunk = chunk_dims(slice_dims, quant_bit)
    return chunk * (lane + lanes * (dim // chunk)) + dim % chunk


def k_slice_dims(quant_bit: int, ks: int) -> tuple:
    """The elements of a lane's K slice in its B fragment at k-step ks, (b0 low, b0 high, b1 low, b1 high): the
    module's table."""
    if quant_bit == 4:
        w, h = divmod(ks, 2)
        e = 8 * w + 2 * h
        return e, e + 4, e + 1, e + 5
    e = 4 * ks
    return e, e + 1, e + 2, e + 3


def k_dims(quant_bit: int, head_dim: int, quad: int, ks: int) -> tuple:
    """The head dims of lane quad's K B fragment at k-step ks, (b0 low, b0 high, b1 low, b1 high): the
    reduction indices 2q, 2q + 1, 2q + 8, 2q + 9 of the step, permuted (`k_slice_dims`, then `lane_dim`); Q's A
    fragment columns take the same dims."""
    return tuple(lane_dim(head_dim // 4, quant_bit, 4, quad, d) for d in k_slice_dims(quant_bit, ks))


def v_dim(quant_bit: int, head_dim: int, column: int, tile: int) -> int:
    """The head dim of column `column` (0..7) of O's n8 tile `tile`: lane g's V B fragment is column g, its
    element `tile` of its slice (`lane_dim`)."""
    return lane_dim(head_dim // 8, quant_bit, 8, column, tile)


@cache         # the plan asks it for every new batch size (`fit`); the answer depends on these ints alone
def heads_per_block(num_heads: int, num_kv_heads: int) -> int:
    """Query heads of a block: the largest divisor of the GQA group that fits the 16 rows of an A tile."""
    group = num_heads // num_kv_heads
    return max(d for d in range(1, min(group, MMA_M) + 1) if group % d == 0)


def decode_grid(num_heads: int, num_kv_heads: int, sequences: int, threads: int) -> tuple:
    """(blocks, keys a block takes a step) of the kernel over `sequences` decode sequences: a block a GQA group's
    `heads_per_block` heads, each warp a trip of 16 keys a step (what a split count is chosen from)."""
    return (num_heads // heads_per_block(num_heads, num_kv_heads)) * sequences, KEY_TILE * (threads // WARP_SIZE)


def _rows(heads: int) -> int:
    """C-fragment rows a lane keeps: grp only (1) when the block's heads fit rows 0..7, else grp and grp + 8."""
    return 1 if heads <= 8 else 2


def merge_shape(head_dim: int, warps: int, heads: int) -> tuple:
    """Shared float32 array of the warps' merge: per warp past the first, per value (each row's m, l and O
    fragments) one word per lane, lane last (a warp's 32 words of a value fall in 32 banks)."""
    return max(1, warps - 1), _rows(heads) * (2 + 2 * (head_dim // MMA_N)), WARP_SIZE


@cache         # the plan asks it for every new batch size (`fit`); the answer depends on these ints alone
def shared_bytes(head_dim: int, warps: int, heads: int) -> int:
    """Shared memory of a block: the merge slots and the simulator's scratch (4-byte words)."""
    return 4 * sum(math.prod(s) for s in (merge_shape(head_dim, warps, heads), *scratch_shapes(warps)))


def _dtype_name(dtype) -> str:
    """A dtype's name; "bfloat16" as given (the kernels' key for bfloat16 bits, which NumPy may not know)."""
    return dtype if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype).name


def decode_shape_problem(*, query_dtype, max_seqlen: int, head_dim: int, num_heads: int, num_kv_heads: int,
                         quant_bit: int, cache_dtype, threads: int) -> str | None:
    """Why a call of these shapes cannot run on this kernel, or None: what `cacheattn.choose_kernel` can know before any
    array exists (`decode_kernel_choice` adds the arrays' own conditions)."""
    query, cache = _dtype_name(query_dtype), _dtype_name(cache_dtype)
    if max_seqlen != 1:
        return f"not a decode batch (max_seqlen {max_seqlen})"
    if query not in QUERY_DTYPES:
        return f"query {query}, not float16 or bfloat16"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if quant_bit and query == "bfloat16":
        return (f"a quantized cache (quant_bit {quant_bit}) with a bfloat16 query (the codes dequantize to float16 "
                f"pairs, for the float16 mma)")
    if cache != ("int8" if quant_bit else query):
        return f"a {cache} cache of quant_bit {quant_bit} for a {query} query"
    if shared_bytes(head_dim, threads // WARP_SIZE, heads_per_block(num_heads, num_kv_heads)) > SHARED_BYTES:
        return f"the merge of {threads // WARP_SIZE} warps needs more than {SHARED_BYTES} bytes of shared memory"
    return None


def _arrays_problem(quant_bit, quant_group, head_dim, scale_dtype, value_dtype, vector, key_src, value_src):
    """Why the call's arrays keep it off this kernel (dtypes, alignment, page tables), or None."""
    if quant_bit and np.dtype(scale_dtype) != np.float16:
        return f"{np.dtype(scale_dtype).name} scales (the f16x2 dequantization takes float16 scales)"
    if np.dtype(value_dtype) not in (np.float16, np.float32):
        return f"a {np.dtype(value_dtype).name} value dtype (the dequantized values are rounded to it)"
    if not vector:
        return "cache rows, scales or the query not aligned for 16-byte loads"
    if quant_bit and not all(int(x) % max(1, head_dim // 4 // quant_group) == 0 for src in (key_src, value_src)
                             for x in (src.sc_base, src.sc_s_b, src.sc_s_t, src.sc_s_h)):
        return "scale rows not aligned for a lane's scale loads"
    if key_src.starts is not value_src.starts or int(key_src.page) != int(value_src.page):
        return "K and V on different page tables"
    return None


def decode_kernel_choice(*, query_dtype, max_seqlen: int, head_dim: int, num_heads: int, num_kv_heads: int,
                         quant_bit: int, quant_group: int, scale_dtype, value_dtype, threads: int, vector: bool,
                         key_src, value_src) -> tuple:
    """(serves, reason): whether rung 5 runs this call on the register-fed decode kernel rather than the staged
    one (`_attention_mma`), and why, in one line. Decided on the host from the call's facts."""
    why = decode_shape_problem(query_dtype=query_dtype, max_seqlen=max_seqlen, head_dim=head_dim,
                               num_heads=num_heads, num_kv_heads=num_kv_heads, quant_bit=quant_bit,
                               cache_dtype=key_src.data.dtype, threads=threads) \
        or _arrays_problem(quant_bit, quant_group, head_dim, scale_dtype, value_dtype, vector, key_src, value_src)
    if why is None:
        return True, "decode: a GQA group on tensor cores, K/V loaded into the mma's registers"
    return False, f"staged rung 5: {why}"


def _word_loader(nbytes: int, itemsize: int, lanes: int = 1):
    """Device function (data, index, out, at): a lane's `nbytes` bytes from element `index` of the 1-D array `data`
    into out[at:] as uint32 words (one word, zero-extended, below 4 bytes), in 16-byte loads where they fit; the
    `lanes` lanes sharing the row interleave their 16-byte chunks (the lane's chunk c is 16 * lanes * c bytes on)."""
    if nbytes >= 16:
        loads, step = nbytes // 16, 16 * lanes // itemsize

        @cuda.jit(device=True, inline="always")
        def load_words(data, index, out, at):
            for c in range(loads):
                w = load16(data, index + c * step)
                for j in range(4):
                    out[at + 4 * c + j] = w[j]
    elif nbytes == 8:
        @cuda.jit(device=True, inline="always")
        def load_words(data, index, out, at):
            w = load8(data, index)
            out[at] = w[0]
            out[at + 1] = w[1]
    else:
        load_one = load_bits4 if nbytes == 4 else load_bits2

        @cuda.jit(device=True, inline="always")
        def load_words(data, index, out, at):
            out[at] = load_one(data, index)
    return load_words


def _scale_table(pairs, quant_group: int, chunk: int, chunk_words: int) -> np.ndarray:
    """For each value pair of `pairs` ((n, 2) dims relative to the lane's slice, loaded in chunks of `chunk` dims),
    the loaded scale words of its two groups and the prmt selector that picks their halves (`pair_selector`):
    (n, 3) int64, a compile-time table. Chunk c's group scales are words c * chunk_words.. of the lane's."""
    out = np.zeros((len(pairs), 3), np.int64)
    for n, dims in enumerate(pairs):
        at = [(d // chunk, d % chunk // quant_group if quant_group <= chunk else 0) for d in dims]
        words = [c * chunk_words + g // 2 for c, g in at]
        out[n] = words[0], words[1], pair_selector(at[0][1] % 2, at[1][1] % 2)
    return out


def _scale_loader(slice_dims: int, quant_bit: int, quant_group: int, lanes: int):
    """(device function (scales, index, out, at), words it writes): a lane's group scales of one row, chunk by
    chunk (`lane_dim`): chunk c's whole groups in one load (one scale where a group spans the chunk), `lanes *
    chunk / quant_group` scales after chunk c - 1's; index: the lane's first chunk's first scale."""
    chunk = chunk_dims(slice_dims, quant_bit)
    loads, per_chunk = slice_dims // chunk, max(1, chunk // quant_group)
    words, stride = max(1, per_chunk // 2), lanes * chunk // quant_group
    load_chunk = _word_loader(2 * per_chunk, 2)

    @cuda.jit(device=True, inline="always")
    def load_scales(scales, index, out, at):
        for c in range(loads):
            load_chunk(scales, index + c * stride, out, at + c * words)
    return load_scales, loads * words


def make_gqa_decode_attention_kernel(score, key_range, *, quant_bit: int, quant_group: int, head_dim: int,
                                     heads_per_block: int, group: int, warps: int, whole_trips: bool,
                                     biased: bool = True, per_tensor: bool = False, e4m3: bool = False,
                                     shared_pages: bool = True, page_unit: int = 1, new_token: bool = False,
                                     num_kv_heads: int = 0, partials: bool = False, bf16: bool = False,
                                     slot_map=None):
    """Build the kernel. Launch grid (1, num_heads / heads_per_block, B), 32 * warps threads; arguments as
    `_attention_mma.make_mma_attention_kernel`'s kernel (float16 query, or bfloat16 bits with `bf16`; one
    position a sequence), the sources `_cache.CacheSource`s (data, scales, starts, page and the strides).
    score / key_range: the operator's (`make_ppl_score`); whole_trips: the page length is a multiple of 16 (every
    trip in one page); biased: the call has a mask or ALiBi (else a score is q.k / sqrt(D) and `score` is not
    called).

    TensorRT-LLM's generation adds (`trtllm_generation`): per_tensor, an 8-bit cache with one scale for the whole
    tensor and no group scales: the codes (int8, or e4m3 read as value / 256 with `e4m3`) go into the mma as they
    are, the launcher folds the scale into sm_scale, and the output is multiplied by the sources' `fold`;
    shared_pages False, V's pages from v_src.starts (K and V blocks have offsets of their own); page_unit, the
    slots a step of starts counts (a block index times the slots of a block); new_token, the sequence's last key
    read from the sources' `scratch` (row (q_starts[b] * num_kv_heads + kv head) * D, the query's dtype) rather than
    the cache: the warps walk the cached keys before it, and warp 0 adds it after the merge in float32.
    slot_map (compile-time: None for key t at slot t of row b): a device function (score_args, k_src, b, t) ->
    (row, slot, run) for caches whose keys are not in key order (sinks and a wrapped cyclic window, beams): the
    kernel walks key indices t of `key_range` (and `score` takes them) and reads key t from slot `slot` of cache
    row `row` (pages starts[row, slot // page]), keys t + 1 .. t + run - 1 from the slots after it in that row.
    A trip whose 16 keys follow each other in one page takes the whole-trip loads; any other (a wrap, the sinks'
    end, a page boundary, the last round) looks each key up.

    partials (split-K, `_split_k`): out_geom is `_attention_core.make_attention_kernel`'s partial geometry and
    grid z = B * num_splits; block z walks split z % num_splits of sequence z // num_splits's trips (whole 16-key
    trips from the first visible key's, so no two splits load one) and writes each row's unnormalised O, its max
    (natural log units) and sum; the last split adds the new token. `_split_k.combine_kernel` finishes.

    bf16: a bfloat16 query and cache, both passed as their bits (uint16), the output too: the same fragments
    (the kernel moves bits) into `mma ... .bf16`, P packed to bfloat16 (round to nearest even) for P·V, the output
    rounded to bfloat16 the same way, the new token's K/V scratch read as bfloat16 bits; float32 accumulation and
    split-K partials as with float16. Unquantized caches only: the dequantization makes float16 pairs."""
    D, HPB, WARPS = head_dim, heads_per_block, warps
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim: {D} is not one the tensor-core decode kernel takes ({HEAD_DIMS})")
    K_STEPS, V_TILES = D // MMA_K, D // MMA_N
    OT_TILES = V_TILES // 2                          # m16 tiles of Oᵀ (transposed trips): two n8 tiles each
    R = _rows(HPB)                                   # C rows a lane keeps: grp (and grp + 8)
    TRANSPOSED = R == 1                              # scores as Sᵀ = K Qᵀ: the heads fit the mma's 8 columns
    BITS = quant_bit or 16
    SCALED = bool(quant_bit) and not per_tensor      # group scales loaded beside the codes and multiplied in
    if (per_tensor or e4m3) and quant_bit != 8:
        raise ValueError(f"quant_bit: a per-tensor or e4m3 cache holds 8-bit codes, got {quant_bit}")
    if bf16 and quant_bit:
        raise ValueError(f"quant_bit: a bfloat16 query takes an unquantized (bfloat16) cache, got {quant_bit}")
    # bfloat16: the same bits in the same registers, its own mma and roundings (a bfloat16 widens by a shift)
    mma = mma_m16n8k16_bf16 if bf16 else mma_m16n8k16
    pack = pack_bf162 if bf16 else pack_half2
    pair_floats = bf162_floats if bf16 else half2_floats
    BF16 = bf16
    to_half2 = e4m3x4_to_half2_target if e4m3 else int8x4_to_half2   # cvt where the target has it
    ITEM = 2 if quant_bit == 0 else 1                # bytes of a data element (int4: a byte holds two codes)
    K_DIMS, V_DIMS = D // 4, D // 8                  # dims of a row a lane loads: K (per quad), V (per grp)
    K_BYTES, V_BYTES = K_DIMS * BITS // 8, V_DIMS * BITS // 8
    K_WORDS, V_WORDS = max(1, K_BYTES // 4), max(1, V_BYTES // 4)
    # A lane's slice is loaded in chunks (`chunk_dims`), the lanes of a row interleaving them (`lane_dim`): a
    # load instruction reads whole sectors of every row it touches.
    K_CHUNK, V_CHUNK = chunk_dims(K_DIMS, quant_bit), chunk_dims(V_DIMS, quant_bit)
    K_CHUNK_BYTES, V_CHUNK_BYTES = K_CHUNK * BITS // 8, V_CHUNK * BITS // 8
    V_UNITS = V_BYTES // 2                           # 2-byte pieces of a V slice: one prmt each
    load_k, load_v = _word_loader(K_BYTES, ITEM, 4), _word_loader(V_BYTES, ITEM, 8)
    load_k_scales, KS_WORDS = _scale_loader(K_DIMS, quant_bit, quant_group, 4)
    # Two chunks of two group scales each (int8 at head_dim 128, groups of 8): the quad's interleaved scale loads
    # would read half of the row's 32 bytes each. Instead lane q reads 8 bytes, chunks 2 pi(q) and 2 pi(q) + 1 of
    # the row with pi = (0, 2, 1, 3), a whole sector a quad, keeps the one it needs and trades the other with
    # its neighbour (lane q ^ 1 holds the other one it needs): one shuffle a key.
    K_SCALE_SWAP = SCALED and K_DIMS // K_CHUNK == 2 and K_CHUNK // quant_group == 2
    if K_SCALE_SWAP:
        load_k_scales = _word_loader(8, 2)
    load_v_scales, VS_WORDS = _scale_loader(V_DIMS, quant_bit, quant_group, 8)
    KW_SIZE, KSC_SIZE, VW_SIZE, VSC_SIZE = 2 * K_WORDS, 2 * KS_WORDS, 4 * V_WORDS, 4 * VS_WORDS   # local arrays
    # K: the slice dims of each k-step's two registers (the module's table before `lane_dim`), and where their
    # scales are in the lane's scale words.
    K_REL = np.array([k_slice_dims(quant_bit, ks) for ks in range(K_STEPS)], np.int64)
    K_SC = _scale_table(K_REL.reshape(-1, 2), quant_group, K_CHUNK, KS_WORDS // (K_DIMS // K_CHUNK)).reshape(
        K_STEPS, 2, 3)
    # where a register's two values take one scale (the same half of the same word), that half (else -1)
    K_SC_ONE = np.array([[(K_SC[ks, j, 2] & 0xF) // 2 if K_SC[ks, j, 0] == K_SC[ks, j, 1] and
                          K_SC[ks, j, 2] in (pair_selector(0, 0), pair_selector(1, 1)) else -1 for j in range(2)]
                         for ks in range(K_STEPS)], np.int64)
    V_SC = _scale_table([(vt, vt) for vt in range(V_TILES)], quant_group, V_CHUNK, VS_WORDS // (V_DIMS // V_CHUNK))
    V_SELECT = INTERLEAVE_BYTES if quant_bit == 8 else INTERLEAVE_HALVES
    # Q's A fragments take K's dims: the lane's float16 chunks of the query row at K's chunks, each chunk's bytes
    # in whole 16-byte loads (Q's selectors pick each register's two halves from the loaded words).
    Q_LOADS, Q_WORDS = K_DIMS // 8, K_DIMS // 2     # 16-byte loads (8 float16) and words of a lane's Q slice
    Q_SELECT = tuple(pair_selector(int(K_REL[ks, 2 * j]) % 2, int(K_REL[ks, 2 * j + 1]) % 2)
                     for ks in range(K_STEPS) for j in range(2))      # Python ints: prmt's selector
    MMA_SCRATCH, QUAD_SCRATCH = scratch_shapes(WARPS)
    MERGE = merge_shape(D, WARPS, HPB)
    O_VALUES = 2 * V_TILES                          # a row's O fragments a lane holds
    WHOLE, BIASED, SHARED, UNIT, NEW = whole_trips, biased, shared_pages, page_unit, new_token
    SLOT_MAP = slot_map is not None
    place = slot_map
    if not SLOT_MAP:
        @cuda.jit(device=True, inline="always")
        def place(args, src, b, t):
            """Key t at slot t of row b (never called: the walk's own addressing serves)."""
            return np.int64(b), np.int64(t), np.int64(KEY_TILE)
    KV_HEADS, PER_TENSOR, PARTIALS = num_kv_heads, per_tensor, partials
    LN_2 = np.float32(math.log(2.0))                 # base-2 row maxima to the combine's natural-log units
    # The new token's K dims of each lane: the quad's lanes hold a quarter of Q's row each (k_dims).
    K_DIM_TABLE = np.array([[k_dims(quant_bit, D, quad, ks) for ks in range(K_STEPS)] for quad in range(4)],
                           np.int64)

    f32, u32 = np.float32, np.uint32
    NEG_INF = f32(-math.inf)
    ZERO = u32(0)

    @cuda.jit(device=True, inline="always")
    def key_fragments(kw, ksc, kb):
        """K's B registers kb[n, ks, j] of the two keys (n = 0: key grp, 1: grp + 8) from their loaded words."""
        for n in range(2):
            if quant_bit == 0:
                for ks in range(K_STEPS):
                    kb[n, ks, 0] = kw[n * K_WORDS + 2 * ks]
                    kb[n, ks, 1] = kw[n * K_WORDS + 2 * ks + 1]
                continue
            for w in range(K_WORDS):
                if quant_bit == 8:
                    halves = to_half2(kw[n * K_WORDS + w])
                else:
                    halves = int4x8_to_half2(kw[n * K_WORDS + w])
                for k in range(len(halves)):
                    ks, j = (w, k) if quant_bit == 8 else (2 * w + k // 2, k % 2)
                    if not SCALED:
                        kb[n, ks, j] = halves[k]
                        continue
                    if K_SC_ONE[ks, j] >= 0:         # both values in one group (int4): its scale read in place
                        kb[n, ks, j] = mul_half2_by(halves[k], ksc[n * KS_WORDS + K_SC[ks, j, 0]], K_SC_ONE[ks, j])
                        continue
                    scale = scale_half2(ksc[n * KS_WORDS + K_SC[ks, j, 0]], ksc[n * KS_WORDS + K_SC[ks, j, 1]],
                                        K_SC[ks, j, 2])
                    kb[n, ks, j] = mul_half2(halves[k], scale)

    @cuda.jit(device=True, inline="always")
    def value_fragments(vw, vsc, vb):
        """V's B registers vb[p, vt] of the key pairs (p = 0: keys 2q, 2q + 1; 1: 2q + 8, 2q + 9) from the four
        keys' loaded words (key n = 2p + u at vw[n * V_WORDS:]): each 2-byte piece of the two keys interleaved,
        then unpacked and scaled."""
        for p in range(2):
            a, b = 2 * p * V_WORDS, (2 * p + 1) * V_WORDS
            for u in range(V_UNITS):
                mixed = permute_bytes(vw[a + u // 2], vw[b + u // 2], V_SELECT[u % 2])
                if quant_bit == 0:
                    vb[p, u] = mixed
                    continue
                if quant_bit == 8:
                    halves = to_half2(mixed)
                else:
                    halves = int4x8_to_half2(mixed)
                for k in range(len(halves)):
                    vt = len(halves) * u + k
                    if not SCALED:
                        vb[p, vt] = halves[k]
                        continue
                    word = V_SC[vt, 0]            # both keys' scales of the group: (word, half) alike
                    scale = scale_half2(vsc[2 * p * VS_WORDS + word], vsc[(2 * p + 1) * VS_WORDS + word],
                                        V_SC[vt, 2])
                    vb[p, vt] = mul_half2(halves[k], scale)

    @cuda.jit(device=True, inline="always")
    def trip(t0, tail, rows, srcs, kvs, walk, acc, regs, scratch, score_args, sm_scale, warp, lane):
        """One warp's trip over keys t0 .. t0 + 15: loads, S = Q Kᵀ, softmax, O += P V. `tail` (compile-time):
        the trip may hold keys from hi on, or lie past them (the last round of trips), so loads are clamped to
        key hi - 1 and scores masked; the other trips hold only keys below hi.
        rows: (b, h0, lo, hi, seqlen, kvlen); srcs: (k_src, v_src); kvs: this lane's element / scale indices of
        slot 0 (K data, K scales, V data, V scales), then the same plus its first key's rows (K: grp, V: 2q);
        walk: int64 (page index, offset, key it is at); acc: (row_max, row_sum, o, qa);
        regs: (s, tile_max, kw, ksc, vw, vsc, kb, vb, swap, moved)."""
        b, h0, lo, hi, seqlen, kvlen = rows
        k_src, v_src = srcs
        k_row, k_sc, v_row, v_sc, k_lane, k_sc_lane, v_lane, v_sc_lane = kvs
        row_max, row_sum, o, qa = acc
        s, tile_max, kw, ksc, vw, vsc, kb, vb, swap, moved = regs
        mma_scratch, quad_scratch = scratch
        grp, quad = lane // 4, lane % 4
        sm_log2 = sm_scale * f32(LOG2_E)            # scores and row maxima in base 2
        tc = min(t0, hi - 1 - (hi - 1) % KEY_TILE) if tail else t0      # the trip whose keys are loaded
        kmax = hi - 1 - tc                                              # keys past it load key hi - 1
        starts, page = k_src.starts, k_src.page
        slot0, v_slot0 = as_offset(0, k_src.s_t), as_offset(0, v_src.s_t)
        row_shift = (np.int64(0), np.int64(0), np.int64(0), np.int64(0))     # a mapped trip's row, past b's
        whole = WHOLE and not tail
        if SLOT_MAP:
            # One lookup of the trip's first key: its 16 keys in consecutive slots of one page take the whole-trip
            # loads (one division a trip), the others a lookup a key below.
            whole = False
            if WHOLE and not tail:
                row0, s0, run = place(score_args, k_src, b, tc)
                at_page = s0 % page
                if run >= KEY_TILE and at_page + KEY_TILE <= page:
                    whole = True
                    slot0 = as_offset(starts[row0, s0 // page] * UNIT + at_page, k_src.s_t)
                    v_slot0 = slot0 if SHARED else as_offset(v_src.starts[row0, s0 // page] * UNIT + at_page,
                                                             v_src.s_t)
                    row_shift = ((row0 - b) * k_src.s_b, (row0 - b) * k_src.sc_s_b, (row0 - b) * v_src.s_b,
                                 (row0 - b) * v_src.sc_s_b)
        elif WHOLE:
            walk[1] += tc - walk[2]
            walk[2] = tc
            while walk[1] >= page:
                walk[1] -= page
                walk[0] += 1
            # in the sources' offset type: where the host found every offset fits 32 bits, a row is one wide
            # multiply-add of the slot (rather than a 64-bit multiply)
            # (unsigned indices: no wraparound for a negative one)
            page_b, page_i = np.uint32(b), np.uint32(walk[0])
            slot0 = as_offset(starts[page_b, page_i] * UNIT + walk[1], k_src.s_t)
            v_slot0 = slot0 if SHARED else as_offset(v_src.starts[page_b, page_i] * UNIT + walk[1], v_src.s_t)
        # 1. the trip's loads: K of keys grp, grp + 8; V of keys 2q, 2q + 1, 2q + 8, 2q + 9 (with scales). A whole
        #    trip in one page adds 0 or 8 rows (K), 0, 1, 8 or 9 rows (V) to the lane's first key's row.
        lane_rows = (as_offset(k_lane + slot0 * k_src.s_t + row_shift[0], k_src.s_t),
                     as_offset(k_sc_lane + slot0 * k_src.sc_s_t + row_shift[1], k_src.s_t),
                     as_offset(v_lane + v_slot0 * v_src.s_t + row_shift[2], v_src.s_t),
                     as_offset(v_sc_lane + v_slot0 * v_src.sc_s_t + row_shift[3], v_src.s_t))
        for n in range(6):
            src = k_src if n < 2 else v_src
            if whole:
                extra = 8 * n if n < 2 else (n - 2) % 2 + 8 * ((n - 2) // 2)
                at = as_offset(lane_rows[0 if n < 2 else 2] + extra * src.s_t, src.s_t)
                sc_at = as_offset(lane_rows[1 if n < 2 else 3] + extra * src.sc_s_t, src.s_t)
            else:
                k = np.int64(grp + 8 * n if n < 2 else 2 * quad + (n - 2) % 2 + 8 * ((n - 2) // 2))
                if tail:
                    k = min(k, kmax)
                shift, sc_shift = np.int64(0), np.int64(0)
                if SLOT_MAP:                    # key tc + k at its slot of its row
                    row, t, _ = place(score_args, k_src, b, tc + k)
                    slot = (starts if n < 2 or SHARED else v_src.starts)[row, t // page] * UNIT + t % page
                    shift, sc_shift = (row - b) * src.s_b, (row - b) * src.sc_s_b
                elif WHOLE:
                    slot = (slot0 if n < 2 else v_slot0) + k
                else:
                    t = tc + k
                    slot = (starts if n < 2 or SHARED else v_src.starts)[b, t // page] * UNIT + t % page
                at = (k_row if n < 2 else v_row) + slot * src.s_t + shift
                sc_at = (k_sc if n < 2 else v_sc) + slot * src.sc_s_t + sc_shift
            if n < 2:
                load_k(k_src.data, at, kw, n * K_WORDS)
                if SCALED:
                    load_k_scales(k_src.scales, sc_at, ksc, n * KS_WORDS)
                if K_SCALE_SWAP:                # even lanes hold chunk 0's word, odd ones chunk 1's
                    even = quad % 2 == 0
                    w0, w1 = ksc[2 * n], ksc[2 * n + 1]
                    # shfl takes 32-bit signed ints: the word's bits travel as an int32
                    lane_values(swap, 1, np.int32(w1 if even else w0), mma_scratch, warp, lane, lane ^ 1, 0)
                    got = u32(swap[0])
                    ksc[2 * n] = w0 if even else got
                    ksc[2 * n + 1] = got if even else w1
            else:
                load_v(v_src.data, at, vw, (n - 2) * V_WORDS)
                if SCALED:
                    load_v_scales(v_src.scales, sc_at, vsc, (n - 2) * VS_WORDS)
        # 2. the scores: s[nt, 2 r + c] = S[head grp + 8 r, key t0 + 8 nt + 2 quad + c]
        key_fragments(kw, ksc, kb)
        if TRANSPOSED:
            # Sᵀ = K Qᵀ, D / 16 mma: the trip's 16 keys fill the A rows (the lane's keys grp, grp + 8, the K
            # registers it loaded), the group's heads the 8 columns (B: Q's row grp, the registers of A fragments).
            c0 = c1 = c2 = c3 = f32(0.0)
            for ks in range(K_STEPS):
                c0, c1, c2, c3 = mma(kb[0, ks, 0], kb[1, ks, 0], kb[0, ks, 1], kb[1, ks, 1], qa[ks, 0], qa[ks, 2],
                                     c0, c1, c2, c3, mma_scratch, warp, lane)
            # Lane (g, q) holds Sᵀ of keys g, g + 8 (c0, c1; c2, c3) at heads 2q, 2q + 1; head h's keys 2q + j,
            # 2q + j + 8 are at lane 4 (2q + j) + h / 2, column h % 2. Two rounds of two shuffles: in round i, lane
            # (g, q) reads lane 4 (2q + j) + g / 2 with j = i ^ (g % 2), which sends its column i ^ (its g % 2),
            # the very column g % 2 the reader needs (each sender has readers of both columns, one a round).
            odd = np.int32(lane >> 2) & np.int32(1)     # 32 bits: one compare a select, not two
            for i in range(2):
                j = np.int32(i) ^ odd
                src = 4 * (2 * quad + j) + grp // 2
                lane_values(moved, 1, c1 if j == 1 else c0, quad_scratch, warp, lane, src, 0)
                key_lo = moved[0]
                lane_values(moved, 1, c3 if j == 1 else c2, quad_scratch, warp, lane, src, 0)
                key_hi = moved[0]
                if j == 0:
                    s[0, 0], s[1, 0] = key_lo, key_hi
                else:
                    s[0, 1], s[1, 1] = key_lo, key_hi
        else:
            # S = Q Kᵀ: two n8 tiles (keys t0 + grp.., t0 + 8 + grp..), D / 16 mma each; rows 8.. hold heads 8..
            for nt in range(2):
                for e in range(4):
                    s[nt, e] = 0.0
            for ks in range(K_STEPS):
                for nt in range(2):
                    s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3] = mma(
                        qa[ks, 0], qa[ks, 1], qa[ks, 2], qa[ks, 3], kb[nt, ks, 0], kb[nt, ks, 1],
                        s[nt, 0], s[nt, 1], s[nt, 2], s[nt, 3], mma_scratch, warp, lane)
        # 3. scores and the online softmax; element e of a C tile: row grp + 8 * (e // 2), key 2q + e % 2. Without
        #    a mask or ALiBi a decode score is q.k / sqrt(D) (causality hides no key of the one query), and a row
        #    past the group's heads needs no mask: its scores never meet a real row's (a row's max is its quad's).
        # keys of the trip below lo, and from hi, in 32 bits (t0 >= lo - lo % 16: lo - t0 < 16 in every trip)
        low = max(np.int32(lo - t0), np.int32(0))
        high = np.int32(max(min(hi - t0, KEY_TILE), 0))
        for r in range(2):
            tile_max[r] = NEG_INF
        for r in range(R):
            h = h0 + grp + 8 * r
            for nt in range(2):
                for c in range(2):
                    kt = np.int32(8 * nt + 2 * quad + c)
                    x = NEG_INF
                    if BIASED:
                        if grp + 8 * r < HPB and low <= kt < high:
                            x = score(score_args, s[nt, 2 * r + c] * sm_scale, b, h, 0, t0 + kt, seqlen,
                                      kvlen) * f32(LOG2_E)
                    elif low <= kt and (kt < high or not tail):
                        x = s[nt, 2 * r + c]            # q.k: scaled in the exponent's fma below
                    s[nt, 2 * r + c] = x
                    tile_max[r] = max(tile_max[r], x)
        top0, top1 = quad_max2(tile_max[0], tile_max[1], quad_scratch, warp, lane)
        if not BIASED:
            # the scale is positive and rounding monotonic: the rounded scaled max is the max of the rounded scaled
            # scores, one multiply a row rather than one a score
            top0, top1 = top0 * sm_log2, top1 * sm_log2
        tile_max[0], tile_max[1] = top0, top1
        rescale = False
        for r in range(R):
            new_max = max(row_max[r], tile_max[r])
            # all hidden so far: subtract 0, so p = 2 ** -inf = 0 and alpha = 0 (the row's sum and O are 0 still)
            # with no branch and no NaN of -inf - -inf
            top = new_max if new_max != NEG_INF else f32(0.0)
            alpha = exp2(row_max[r] - top)
            rescale = rescale or new_max != row_max[r]
            for nt in range(2):
                for c in range(2):
                    if BIASED:
                        s[nt, 2 * r + c] = exp2(s[nt, 2 * r + c] - top)
                    else:                               # q.k log2(e) / sqrt(D) - max, rounded once
                        s[nt, 2 * r + c] = exp2(cuda.fma(s[nt, 2 * r + c], sm_log2, -top))
            part = (s[0, 2 * r] + s[0, 2 * r + 1]) + (s[1, 2 * r] + s[1, 2 * r + 1])
            row_sum[r] = row_sum[r] * alpha + part
            row_max[r] = new_max
            tile_max[r] = alpha
        # O's rescale only when some row's max moved: after the first trips of a long sequence it rarely does, and
        # a branch on the warp's vote skips the 2 D / 8 multiplies of every lane together (where it is taken, the
        # lanes whose max stayed multiply by 1, exactly, or a row with no key yet its zeros by 0)
        alpha_even = alpha_odd = f32(1.0)
        if TRANSPOSED:
            # Oᵀ's columns are heads 2q, 2q + 1: their factors from quad 0 of those rows' lanes (outside the
            # branch: two shuffles a trip rather than a branch that a shuffle keeps on every trip's path)
            lane_values(moved, 1, tile_max[0], quad_scratch, warp, lane, 8 * quad, 0)
            alpha_even = moved[0]
            lane_values(moved, 1, tile_max[0], quad_scratch, warp, lane, 8 * quad + 4, 0)
            alpha_odd = moved[0]
        if warp_any(rescale, quad_scratch, warp, lane):
            if TRANSPOSED:
                for m in range(OT_TILES):
                    for e in range(2):
                        o[m, 2 * e] *= alpha_even
                        o[m, 2 * e + 1] *= alpha_odd
            else:
                for r in range(R):
                    for vt in range(V_TILES):
                        o[vt, 2 * r] *= tile_max[r]
                        o[vt, 2 * r + 1] *= tile_max[r]
        # 4. P as the A fragment of P·V (rows grp + 8 zero unless the block has them)
        p0, p2 = pack(s[0, 0], s[0, 1]), pack(s[1, 0], s[1, 1])
        p1, p3 = ZERO, ZERO
        if R == 2:
            p1, p3 = pack(s[0, 2], s[0, 3]), pack(s[1, 2], s[1, 3])
        # 5. O += P V: D / 8 n8 tiles, V's B registers from the interleaved key pairs
        value_fragments(vw, vsc, vb)
        if TRANSPOSED:
            # Oᵀ += Vᵀ Pᵀ, D / 16 mma and no zero rows: A tile m's rows g, g + 8 are elements 2m, 2m + 1 of lane
            # g's V slice, whose key pairs are the B registers of n8 tiles 2m, 2m + 1; Pᵀ's B registers are P's A
            # registers p0, p2 (head g's keys 2q.., 2q + 8..). Lane (g, q) holds heads 2q, 2q + 1 (`o_from_ot`).
            for m in range(OT_TILES):
                o[m, 0], o[m, 1], o[m, 2], o[m, 3] = mma(
                    vb[0, 2 * m], vb[0, 2 * m + 1], vb[1, 2 * m], vb[1, 2 * m + 1], p0, p2,
                    o[m, 0], o[m, 1], o[m, 2], o[m, 3], mma_scratch, warp, lane)
            return
        for vt in range(V_TILES):
            c2, c3 = (o[vt, 2], o[vt, 3]) if R == 2 else (f32(0.0), f32(0.0))
            d0, d1, d2, d3 = mma(p0, p1, p2, p3, vb[0, vt], vb[1, vt], o[vt, 0], o[vt, 1], c2, c3, mma_scratch,
                                 warp, lane)
            o[vt, 0], o[vt, 1] = d0, d1
            if R == 2:
                o[vt, 2], o[vt, 3] = d2, d3

    @cuda.jit(device=True, inline="always")
    def o_from_ot(o, ot, moved, quad_scratch, warp, lane):
        """The transposed trips' Oᵀ (ot[m, e]: head 2q + e % 2 at element 2m + e // 2 of lane g's V slice) as the C
        fragments of O = P V (o[vt, c]: head g at element vt of lane 2q + c's slice), two shuffles a tile: in round
        i, lane (g, q) reads c = i ^ (g % 2) from lane 4 (2q + c) + g / 2, which sends its head i ^ (its g % 2),
        the very parity the reader's row needs (each sender has readers of both parities, one a round)."""
        grp, quad = lane // 4, lane % 4
        odd = grp % 2 == 1
        # every index a constant (values selected, not elements): the arrays stay in registers
        for m in range(OT_TILES):
            for h in range(2):
                even_head, odd_head = ot[m, 2 * h], ot[m, 2 * h + 1]
                # round 0 sends head parity (its g % 2) and fills the reader's column g % 2; round 1 the others
                lane_values(moved, 1, odd_head if odd else even_head, quad_scratch, warp, lane,
                            4 * (2 * quad + (1 if odd else 0)) + grp // 2, 0)
                first = moved[0]
                lane_values(moved, 1, even_head if odd else odd_head, quad_scratch, warp, lane,
                            4 * (2 * quad + (0 if odd else 1)) + grp // 2, 0)
                second = moved[0]
                o[2 * m + h, 0] = second if odd else first
                o[2 * m + h, 1] = first if odd else second

    @cuda.jit(device=True, inline="always")
    def o_dim(quad, c, vt):
        """The head dim of O's C element (any row, column 2 quad + c) of n8 tile vt: `v_dim`, un-permuted."""
        return V_CHUNK * (2 * quad + c + 8 * (vt // V_CHUNK)) + vt % V_CHUNK

    @cuda.jit(device=True, inline="always")
    def write_partials(out_geom, b, split, h0, acc, total0, total1, v_src, lane):
        """Warp 0's rows as split `split`'s partials: unnormalised O (times the per-tensor scale), and once a row
        its max in natural-log units and its sum (-inf and 0 for a split that saw no key)."""
        out, o_starts, o_sb, o_si, o_sh, _, split_stride, split_rows, num_heads, m_out, l_out = out_geom
        row_max, row_sum, o, qa = acc
        grp, quad = lane // 4, lane % 4
        for r in range(R):
            if grp + 8 * r < HPB:
                h = h0 + grp + 8 * r
                at = split * split_stride + b * o_sb + o_starts[b] * o_si + h * o_sh
                for vt in range(V_TILES):
                    for c in range(2):
                        x = o[vt, 2 * r + c]
                        out[at + o_dim(quad, c, vt)] = x * v_src.fold if PER_TENSOR else x
                if quad == 0:
                    row = split * split_rows + o_starts[b] * num_heads + h
                    m_out[row] = row_max[r] * LN_2 if row_max[r] != NEG_INF else NEG_INF
                    l_out[row] = total0 if r == 0 else total1

    @cuda.jit(device=True, inline="always")
    def scratch_value(scratch, at):
        """Element `at` of a K/V scratch as float32 (bfloat16: its bits widened, exactly)."""
        if BF16:
            return widen_bfloat16(scratch[at])
        return f32(scratch[at])

    @cuda.jit(device=True, inline="always")
    def store(out, at, x):
        """out[at] = x rounded to the output's dtype: float16 by the store's conversion, bfloat16 to its bits
        (round to nearest even)."""
        if BF16:
            out[at] = narrow_bfloat16(x)
        else:
            out[at] = x

    @cuda.jit(device=True, inline="always")
    def new_token(b, h0, g_kv, t, seqlen, kvlen, q_starts, k_src, v_src, acc, quad_scratch, score_args, sm_scale,
                  warp, lane):
        """Key t, the sequence's new token, from the scratch into warp 0's merged state, in float32: each lane's
        quarter of q.k (Q's registers hold its dims), summed over the quad; one online-softmax step; O's columns
        from V's row. With a per-tensor scale the cached keys are in code units: the logit scale and V are
        divided by the sources' fold."""
        row_max, row_sum, o, qa = acc
        grp, quad = lane // 4, lane % 4
        at = (q_starts[b] * KV_HEADS + g_kv) * D
        dots = cuda.local.array(2, f32)
        for r in range(2):
            dots[r] = 0.0
        for r in range(R):
            for ks in range(K_STEPS):
                for j in range(2):
                    q_low, q_high = pair_floats(qa[ks, r + 2 * j])
                    dots[r] += q_low * scratch_value(k_src.scratch, at + K_DIM_TABLE[quad, ks, 2 * j]) + \
                        q_high * scratch_value(k_src.scratch, at + K_DIM_TABLE[quad, ks, 2 * j + 1])
        dot0, dot1 = quad_sum2(dots[0], dots[1], quad_scratch, warp, lane)
        if warp != 0:
            return
        logit_scale = sm_scale / k_src.fold if PER_TENSOR else sm_scale
        value_scale = f32(1.0) / v_src.fold if PER_TENSOR else f32(1.0)
        for r in range(R):
            x = NEG_INF
            if grp + 8 * r < HPB:
                logit = (dot0 if r == 0 else dot1) * logit_scale
                if BIASED:
                    x = score(score_args, logit, b, h0 + grp + 8 * r, 0, t, seqlen, kvlen) * f32(LOG2_E)
                else:
                    x = logit * f32(LOG2_E)
            new_max = max(row_max[r], x)
            if new_max == NEG_INF:
                continue
            alpha, p = exp2(row_max[r] - new_max), exp2(x - new_max)
            row_sum[r] = row_sum[r] * alpha + (p if quad == 0 else f32(0.0))   # a row's sum: once in its quad
            row_max[r] = new_max
            for vt in range(V_TILES):
                for c in range(2):
                    o[vt, 2 * r + c] = o[vt, 2 * r + c] * alpha + \
                        p * scratch_value(v_src.scratch, at + o_dim(quad, c, vt)) * value_scale

    @cuda.jit
    def gqa_decode_attention_kernel(q_geom, out_geom, seqlens, kvlens, k_src, v_src, score_args, sm_scale):
        b, split, num_splits = cuda.blockIdx.z, 0, 1
        if PARTIALS:
            num_splits = out_geom[5]
            b, split = b // num_splits, b % num_splits
        seqlen, kvlen = seqlens[b], kvlens[b]
        if seqlen < 1:
            return                                   # block-uniform exit: no thread waits at a barrier
        h0 = cuda.blockIdx.y * HPB
        g_kv = h0 // group
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_SIZE, tid % WARP_SIZE
        grp, quad = lane // 4, lane % 4

        mma_scratch = cuda.shared.array(MMA_SCRATCH, np.uint32)     # simulator paths only
        quad_scratch = cuda.shared.array(QUAD_SCRATCH, f32)
        merge = cuda.shared.array(MERGE, f32)

        # Q's A fragments in the permuted dims (k_dims); rows grp + 8 only when the block has more than 8 heads.
        q, q_starts, q_sb, q_si, q_sh = q_geom
        qa = cuda.local.array((K_STEPS, 4), np.uint32)
        qw = cuda.local.array(Q_WORDS, np.uint32)
        for ks in range(K_STEPS):
            for k in range(4):
                qa[ks, k] = ZERO
        for r in range(R):
            if grp + 8 * r < HPB:
                at = b * q_sb + q_starts[b] * q_si + (h0 + grp + 8 * r) * q_sh + K_CHUNK * quad
                for u in range(Q_LOADS):        # load u: chunk u // per of K's, its 8 dims 8 * (u % per)..
                    c, part = divmod(u, K_CHUNK // 8)
                    w = load16(q, at + 4 * K_CHUNK * c + 8 * part)
                    for j in range(4):
                        qw[4 * u + j] = w[j]
                for ks in range(K_STEPS):
                    for j in range(2):
                        lo, hi = K_REL[ks, 2 * j], K_REL[ks, 2 * j + 1]
                        qa[ks, r + 2 * j] = permute_bytes(qw[lo // 2], qw[hi // 2], Q_SELECT[2 * ks + j])

        row_max = cuda.local.array(2, f32)
        row_sum = cuda.local.array(2, f32)           # this lane's columns only, until the end
        o = cuda.local.array((V_TILES, 4), f32)      # O's C fragments (elements 2, 3: rows grp + 8)
        for r in range(2):
            row_max[r] = NEG_INF
            row_sum[r] = 0.0
        for vt in range(V_TILES):
            for e in range(4):
                o[vt, e] = 0.0
        regs = (cuda.local.array((2, 4), f32), cuda.local.array(2, f32), cuda.local.array(KW_SIZE, np.uint32),
                cuda.local.array(KSC_SIZE, np.uint32), cuda.local.array(VW_SIZE, np.uint32),
                cuda.local.array(VSC_SIZE, np.uint32), cuda.local.array((2, K_STEPS, 2), np.uint32),
                cuda.local.array((2, V_TILES), np.uint32), cuda.local.array(1, np.int32), cuda.local.array(1, f32))
        acc = (row_max, row_sum, o, qa)

        lo, hi = key_range(score_args, b, 0, 0, seqlen, kvlen)
        last_key = hi - 1
        if NEW:
            hi -= 1                                  # the warps walk the cached keys; the new one comes after
        if PARTIALS:                                 # this split's whole trips of the visible keys
            start = lo - lo % KEY_TILE
            per_split = -(-max(hi - start, 0) // (KEY_TILE * num_splits)) * KEY_TILE
            lo, hi = max(lo, start + split * per_split), min(hi, start + (split + 1) * per_split)
        first = lo - lo % KEY_TILE
        tiles = -(-(hi - first) // KEY_TILE) if hi > lo else 0
        rounds = -(-tiles // WARPS)                  # the same count in every warp: the simulator's barriers
        # This lane's first chunks in slot 0 of the sequence's cache: K dims K_CHUNK * quad.., V dims V_CHUNK * grp..
        kvs = (k_src.base + b * k_src.s_b + g_kv * k_src.s_h + K_CHUNK_BYTES * quad // ITEM,
               k_src.sc_base + b * k_src.sc_s_b + g_kv * k_src.sc_s_h +
               ((4 * (quad // 2) + 8 * (quad % 2)) if K_SCALE_SWAP else K_CHUNK * quad // quant_group),
               v_src.base + b * v_src.s_b + g_kv * v_src.s_h + V_CHUNK_BYTES * grp // ITEM,
               v_src.sc_base + b * v_src.sc_s_b + g_kv * v_src.sc_s_h + V_CHUNK * grp // quant_group)
        kvs = kvs + (kvs[0] + grp * k_src.s_t, kvs[1] + grp * k_src.sc_s_t, kvs[2] + 2 * quad * v_src.s_t,
                     kvs[3] + 2 * quad * v_src.sc_s_t)
        walk = cuda.local.array(3, np.int32)         # the page walk: page index, offset, the key they locate (32 bits)
        walk[0], walk[1], walk[2] = first // k_src.page, first % k_src.page, first
        rows = (b, h0, lo, hi, seqlen, kvlen)
        srcs, scratch = (k_src, v_src), (mma_scratch, quad_scratch)
        # Every round but the last holds whole tiles of keys below hi (tile indices below (rounds - 1) * warps).
        for step in range(rounds - 1):
            trip(first + (step * WARPS + warp) * KEY_TILE, False, rows, srcs, kvs, walk, acc, regs, scratch,
                 score_args, sm_scale, warp, lane)
        if rounds > 0:
            trip(first + ((rounds - 1) * WARPS + warp) * KEY_TILE, True, rows, srcs, kvs, walk, acc, regs, scratch,
                 score_args, sm_scale, warp, lane)

        if TRANSPOSED:                               # Oᵀ back to the layout the merge and the stores read
            ot = cuda.local.array((OT_TILES, 4), f32)
            for m in range(OT_TILES):
                for e in range(4):
                    ot[m, e] = o[m, e]
            o_from_ot(o, ot, regs[9], quad_scratch, warp, lane)

        # 6. the warps' merge: warps 1.. hand their state to warp 0, which folds them in (multi-block rule)
        if WARPS > 1:
            if warp > 0:
                for r in range(R):
                    at = r * (2 + O_VALUES)
                    merge[warp - 1, at, lane] = row_max[r]
                    merge[warp - 1, at + 1, lane] = row_sum[r]
                    for vt in range(V_TILES):
                        for c in range(2):
                            merge[warp - 1, at + 2 + 2 * vt + c, lane] = o[vt, 2 * r + c]
            cuda.syncthreads()
            if warp == 0:
                for w in range(WARPS - 1):
                    for r in range(R):
                        at = r * (2 + O_VALUES)
                        other = merge[w, at, lane]
                        top = max(row_max[r], other)
                        if top != NEG_INF:
                            mine, theirs = exp2(row_max[r] - top), exp2(other - top)
                            row_sum[r] = row_sum[r] * mine + merge[w, at + 1, lane] * theirs
                            for vt in range(V_TILES):
                                for c in range(2):
                                    o[vt, 2 * r + c] = o[vt, 2 * r + c] * mine + merge[w, at + 2 + 2 * vt + c,
                                                                                       lane] * theirs
                            row_max[r] = top

        if NEW and split == num_splits - 1:
            new_token(b, h0, g_kv, last_key, seqlen, kvlen, q_starts, k_src, v_src, acc, quad_scratch, score_args,
                      sm_scale, warp, lane)

        total0, total1 = quad_sum2(row_sum[0], row_sum[1], quad_scratch, warp, lane)
        if PARTIALS:
            if warp == 0:
                write_partials(out_geom, b, split, h0, acc, total0, total1, v_src, lane)
            return
        if warp == 0:
            out, o_starts, o_sb, o_si, o_sh = out_geom
            for r in range(R):
                total = total0 if r == 0 else total1
                if grp + 8 * r < HPB:
                    at = b * o_sb + o_starts[b] * o_si + (h0 + grp + 8 * r) * o_sh
                    for vt in range(V_TILES):
                        for c in range(2):
                            x = o[vt, 2 * r + c] / total if total > 0.0 else f32(0.0)
                            store(out, at + o_dim(quad, c, vt), x * v_src.fold if PER_TENSOR else x)

    return gqa_decode_attention_kernel


def fit(shape, threads: int):
    """Rung 5's answer for a decode call on this kernel (`_fit.RungFit`, variant "decode"): `decode_grid`'s blocks
    and keys a step, a GQA group's `heads_per_block` heads a block, the merge's shared memory; fits=False with
    why its launcher stages rung 5 instead (`decode_shape_problem`: what can be known before any array exists),
    or the refusal of a block size that is not whole warps."""
    from ._fit import RungFit, whole_warps

    refused = whole_warps(5, "decode", threads)
    if refused:
        return refused
    blocks, step = decode_grid(shape.num_heads, shape.num_kv_heads, shape.batch, threads)
    heads = heads_per_block(shape.num_heads, shape.num_kv_heads)
    why = decode_shape_problem(query_dtype=shape.query_dtype, max_seqlen=shape.max_query_len,
                               head_dim=shape.head_dim, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                               quant_bit=shape.quant_bit, cache_dtype=shape.cache_dtype, threads=threads)
    return RungFit(5, "decode", threads, why is None, why or "", blocks=blocks, heads_per_block=heads, positions=1,
                   keys_per_step=step, shared_bytes=shared_bytes(shape.head_dim, threads // WARP_SIZE, heads))
