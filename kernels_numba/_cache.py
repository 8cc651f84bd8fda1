"""Where key t of sequence b, head h lives, and how it is stored and loaded.

A *cache source* is one `CacheSource` named tuple that every kernel reads the same way:

    CacheSource(data, scales, starts, page, base, s_b, s_t, s_h, sc_base, sc_s_b, sc_s_t, sc_s_h)

(numba-cuda passes a named tuple to a kernel as one argument and the device functions read its fields
by name.) data/scales are flat 1-D views; starts is a (B, pages) int64 table. Token t of
sequence b lives in slot `starts[b, t // page] + t % page` and its head h row
starts at `base + b*s_b + slot*s_t + h*s_h` (scales likewise with the sc_ strides).
That one formula covers
  - the paged cache (cache_mode 1: starts = page table, page = page_size),
  - the offset cache (cache_mode 0: starts = cachestarts[:, None], page = 2^62),
  - the static per-batch cache (starts = 0, s_b = the batch stride),
  - a packed dense tensor like `key` (T, H, Dh) (starts = kvstarts[:B, None]).
Layouts only change the strides; layer_idx and key-vs-value only change `base`.

The integer fields are int32 when every element offset the source can form fits in 32 bits (its data and scales
hold fewer than 2**31 elements, `offset_type`): decided on the host for each source, so the kernels compile a
32-bit variant of the key walk (`slot_rows`) for those caches and keep 64-bit offsets for larger ones.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import cuda

from ._dequant import (
    INT4_PAIR_ELEMENTS,
    INT8_PAIR_ELEMENTS,
    half2_floats,
    int4x8_to_half2,
    int8x4_to_half2,
    load_bits2,
    load_bits4,
    mul_half2,
    pair_selector,
    scale_half2,
)
from ._launch import OFFSET_PAGE, axis_strides, flat
from ._numerics import keep_float32, round_to_float16, rounder
from ._vector import SIMULATED, VECTOR_BYTES, float_from_bits, half_from_bits, load8, load16, store16

QMAX = {8: 127, 4: 7}
OFFSET_LIMIT = 2 ** 31          # element offsets below this fit an int32
MIN_SCALE = 1e-5

# Element (b, token slot, head) of the data starts at base + b*s_b + slot*s_t + h*s_h; its scales likewise.
CacheSource = namedtuple("CacheSource", "data scales starts page base s_b s_t s_h sc_base sc_s_b sc_s_t sc_s_h")

# What a chunk loader offers a kernel that issues a step's loads first: fetch(src, row, sc_row, d0, words_out,
# scales_out) loads a chunk's `words` data words and `scale_words` scale words into uint32 arrays, unpack(words,
# scales, regs, at) makes them the values load_chunk gives.
ChunkPrefetch = namedtuple("ChunkPrefetch", "fetch unpack words scale_words")


def offset_type(*arrays):
    """np.int32 when every element offset into these arrays fits in 32 bits (each holds fewer than 2**31
    elements), else np.int64: the type of a CacheSource's offsets and strides, decided on the host."""
    return np.int32 if all(int(a.size) < OFFSET_LIMIT for a in arrays) else np.int64


def cache_source(data, scales, starts, page, axes: str, layer_idx: int = 0, kv: int = 0, scale_axes: str | None = None):
    """Build the CacheSource for one layer and one of key (kv=0) / value (kv=1) of a tensor with named axes; its
    offsets and strides in `offset_type` (int32 for a cache of fewer than 2**31 elements)."""
    s = axis_strides(data.shape, axes)
    base = layer_idx * s.get("L", 0) + kv * s.get("KV", 0)
    if scales is None:
        scales, sc = data[:1], {}                               # placeholder: never read when unquantized
        sc_base = 0
    else:
        sc = axis_strides(scales.shape, scale_axes or axes)
        sc_base = layer_idx * sc.get("L", 0) + kv * sc.get("KV", 0)
    data, scales = flat(data), flat(scales)
    i = offset_type(data, scales)
    # A page past any 32-bit offset is the offset mode's page that never ends: no token index reaches it either.
    page = min(int(page), OFFSET_LIMIT - 1) if i is np.int32 else page
    return CacheSource(data, scales, starts, i(page), i(base), i(s.get("B", 0)), i(s["T"]), i(s["H"]), i(sc_base),
                       i(sc.get("B", 0)), i(sc.get("T", 0)), i(sc.get("H", 0)))


def packed_source(tensor, row_starts):
    """A packed (rows, H, D) tensor such as `key`: sequence b's token t is row row_starts[b] + t."""
    return cache_source(tensor, None, row_starts, OFFSET_PAGE, "T H D")


@cuda.jit(device=True, inline="always")
def token_head_item(starts, num_heads, items_per_head):
    """This thread's (b, i, h, item) in a grid of (x: tokens * heads * items, y: batch b), where batch b has
    starts[b+1] - starts[b] tokens; i is -1 for a thread past them."""
    b = cuda.blockIdx.y
    idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    i = idx // (num_heads * items_per_head)
    if i >= starts[b + 1] - starts[b]:
        i = -1
    return b, i, (idx // items_per_head) % num_heads, idx % items_per_head


@cuda.jit(device=True, inline="always")
def page_rows(src, b, page_index, offset, h):
    """(row, scale_row) of the token at `offset` in page `page_index` of sequence b (`row_offsets` with t split)."""
    slot = src.starts[b, page_index] + offset
    return (src.base + b * src.s_b + slot * src.s_t + h * src.s_h,
            src.sc_base + b * src.sc_s_b + slot * src.sc_s_t + h * src.sc_s_h)


if SIMULATED:
    @cuda.jit(device=True)
    def as_offset(x, like):
        """The integer x in the type of `like` (a CacheSource offset or stride): int32 arithmetic when the host
        narrowed the source's offsets (`offset_type`), which every offset it can form fits."""
        return type(like)(x)

    @cuda.jit(device=True)
    def as_index(x):
        """A non-negative offset (an int32 `as_offset` gave, or an int64) as an int64 index."""
        return np.int64(x)
else:
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def as_offset(typingctx, x, like):
        """The integer x in the type of `like` (a CacheSource offset or stride): int32 arithmetic when the host
        narrowed the source's offsets (`offset_type`), which every offset it can form fits. A truncation in LLVM,
        which then narrows the multiply-adds that formed x to 32 bits."""
        if not (isinstance(x, types.Integer) and isinstance(like, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            return context.cast(builder, args[0], sig.args[0], sig.return_type)

        return like(x, like), codegen

    @intrinsic
    def as_index(typingctx, x):
        """A non-negative offset (an int32 `as_offset` gave, or an int64) as an int64 index: zero-extended, which
        lets the address be one wide multiply-add rather than a sign extension and a 64-bit add."""
        if not isinstance(x, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            if sig.args[0].bitwidth < 64:
                return builder.zext(args[0], context.get_value_type(types.int64))
            return context.cast(builder, args[0], sig.args[0], types.int64)

        return types.int64(x), codegen


@cuda.jit(device=True, inline="always")
def slot_rows(src, b, slot, h):
    """(row, scale_row) of head h of sequence b's token in cache slot `slot`, in the source's offset type: the
    32-bit multiply-adds of `page_rows` when the host narrowed it (`offset_type`), widened once where it is read."""
    return (as_offset(src.base + b * src.s_b + slot * src.s_t + h * src.s_h, src.s_t),
            as_offset(src.sc_base + b * src.sc_s_b + slot * src.sc_s_t + h * src.sc_s_h, src.sc_s_t))


@cuda.jit(device=True, inline="always")
def page_slot(src, b, page_index, offset):
    """The cache slot of the token at `offset` in page `page_index` of sequence b, in the source's offset type. An
    index past the table reads its last page (a lane group whose first key is past the last one, never read)."""
    last = src.starts.shape[1] - 1
    # unsigned indices: no wraparound of a negative index (there is none) in the address arithmetic
    return as_offset(src.starts[np.uint32(b), np.uint32(min(page_index, last))] + offset, src.s_t)


@cuda.jit(device=True, inline="always")
def page_walk(page_index, offset, step, page):
    """(page index, offset) of the token `step` tokens after the one at (page_index, offset): a key loop that
    walks t += step keeps the pair and calls this instead of dividing t by the page size (a 64-bit division by
    a runtime value is a call of ~40 instructions) for every key. Both keep their integer types (32-bit walks
    stay 32-bit: `as_offset`)."""
    offset = as_offset(offset + step, offset)
    while offset >= page:
        offset = as_offset(offset - page, offset)
        page_index = as_offset(page_index + 1, page_index)
    return page_index, offset


def make_cache_access(quant_bit: int, quant_group: int, round_scale, round_value, value_type=np.float32,
                      element=None):
    """Device functions (row_offsets, load) for a cache of the given quantization.

    load returns element d as the document's dequantized tensor holds it: q * scale rounded to the
    scale dtype (round_scale), then to the output dtype T1 (round_value), as a float32 (value_type:
    float64 for an unquantized float64 tensor). element(x): an unquantized element as that float (None:
    value_type(x); `_numerics.widen_bfloat16` for a tensor of bfloat16 bits).
    """
    element = element or value_type

    @cuda.jit(device=True, inline="always")
    # spec: ppl-mhca/offset-mode, ppl-mhca/paged-mode, ppl-mhca/layouts
    def row_offsets(src, b, t, h):
        return page_rows(src, b, t // src.page, t % src.page, h)

    dequantize, _ = make_dequantize(round_scale, round_value)

    @cuda.jit(device=True, inline="always")
    def load(src, row, sc_row, d):
        data, scales = src.data, src.scales
        if quant_bit == 0:
            return round_value(element(data[row + d]))
        if quant_bit == 8:
            q = np.int32(data[row + d])
        else:
            nibble = (np.int32(data[row + d // 2]) >> (4 * (d & 1))) & 0xF   # element 2i: low nibble
            q = nibble - 16 if nibble >= 8 else nibble                        # two's complement
        return dequantize(q, scales[sc_row + d // quant_group])

    return row_offsets, load


def make_dequantize(round_scale, round_value):
    """(dequantize(q, scale), round_product(x)): the document's dequantized element, and the rounding of q * scale
    (exact in float32: an 8-bit q times an 11-bit significand) that it applies."""
    # A value the scale dtype holds is unchanged by rounding it to that dtype again or to float32: skip the second
    # rounding then (float16 scales and output: two instructions a value in the key loop).
    once = round_value is round_scale or round_value is keep_float32

    @cuda.jit(device=True, inline="always")
    def round_product(x):
        """q * scale rounded to the scale dtype, then to the output dtype."""
        return round_scale(x) if once else round_value(round_scale(x))

    @cuda.jit(device=True, inline="always")
    def dequantize(q, scale):
        return round_product(np.float32(q) * np.float32(scale))

    return dequantize, round_product


def chunk_elements(quant_bit: int, cache_dtype, rung: int) -> int:
    """Elements of a row one lane loads at once: a 16-byte chunk (8 float16, 4 float32, 16 int8, 32 int4), but on
    rungs 3 and 4 an 8-byte chunk of int4 (16 values). Their lanes hold a slice of every query and output row in
    registers, 32 + 32 floats a row for a 32-value slice: 16 let 8 lanes share a key and a block take a GQA group
    of 4 rows, not 2, so no two blocks unpack the same keys."""
    if quant_bit == 4:
        return 16 if rung in (3, 4) else 32
    return VECTOR_BYTES // np.dtype(cache_dtype).itemsize


def _address(array) -> int:
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


def vector_loads_ok(src: CacheSource, quant_bit: int, head_dim: int) -> bool:
    """Whether every row of `src` can be read in 16-byte vector loads (decided on the host, once per launch):
    a float16/float32/int8 cache whose data starts 16-byte aligned, with every row offset (base and strides,
    in bytes) a multiple of 16 and a row a whole number of 16-byte chunks (also for rung 3's 8-byte int4 chunks,
    which need less). A quantized cache's scales must start 16-byte aligned too: a chunk's group scales are read
    in one load of up to 16 bytes (`scale_loads`), whose offsets are multiples of its size because the scales are
    contiguous with the group axis last (a row's scale count is a multiple of a chunk's)."""
    itemsize = src.data.dtype.itemsize
    if src.data.dtype.kind not in "fi" or itemsize > 4:
        return False
    if quant_bit and _address(src.scales) % VECTOR_BYTES:
        return False
    row_bytes = head_dim // 2 if quant_bit == 4 else head_dim * itemsize
    offsets = (int(x) * itemsize for x in (src.base, src.s_b, src.s_t, src.s_h))
    return row_bytes % VECTOR_BYTES == 0 and _address(src.data) % VECTOR_BYTES == 0 and \
        all(x % VECTOR_BYTES == 0 for x in offsets)


def scale_loads(quant_group: int, elements: int) -> int:
    """float16 scales a chunk of `elements` values reads in its one scale load: its whole groups (a 4-, 8- or
    16-byte load for 2, 4 or 8 scales), 1 when a group spans the chunk (a 2-byte load), 0 when neither holds
    (a group straddles chunks, or more than 8 of them in one: a 2-byte load per group, as `load` reads them)."""
    if quant_group % elements == 0:
        return 1
    if elements % quant_group == 0 and elements // quant_group <= 8:
        return elements // quant_group
    return 0


def make_chunk_load(quant_bit: int, quant_group: int, round_scale, round_value, elements: int, vector: bool):
    """Device function load_chunk(src, row, sc_row, d0, regs, at, dims): elements d0 .. d0 + elements - 1 of a
    row (those below dims), dequantized as `load` returns them, into regs[at:]. vector: one vector load
    (`_vector.load16`, or `load8` for an 8-byte chunk, `chunk_elements`) unpacked in registers; else one `load`
    per element (rung 2's reads).

    int8 and int4 with float16 scales unpack by magic numbers (`_dequant`): codes to float16 pairs, one
    mul.rn.f16x2 by their pair of group scales (the document's float16 product, bit for bit), then float32 for
    the dot products; the chunk's group scales come in one load (`scale_loads`)."""
    _, load = make_cache_access(quant_bit, quant_group, round_scale, round_value)
    dequantize, round_product = make_dequantize(round_scale, round_value)
    bits = quant_bit or 128 // elements               # float caches: 16-byte chunks of float16 or float32
    words = elements * bits // 32                     # 32-bit words of the chunk: 4, or 2 for 8 bytes of int4
    per_word = 32 // bits                             # elements in each word
    load_words = load8 if words == 2 else load16
    # int4: flipping bit 3 of every nibble (one xor a word) makes each field q + 8, unsigned, so q * scale is one
    # fma of the field with the scale and -8 * scale, exact in float32 as q * scale is: no sign extension a value.
    biased = quant_bit == 4
    # A float16 element widened to float32 is already what float16 or float32 holds: rounding it again is a
    # no-op that would cost two instructions an element (bfloat16 output still rounds).
    exact = quant_bit == 0 and bits == 16 and (round_value is round_to_float16 or round_value is keep_float32)
    # The magic-number path: float16 scales (the product rounds to float16, as mul.rn.f16x2 does) and a chunk
    # whose groups line up with it. A float16 value is what a float16 or float32 output holds: round only bfloat16.
    scales_read = scale_loads(quant_group, elements)
    magic = vector and quant_bit in (8, 4) and round_scale is round_to_float16 and scales_read > 0
    rounded = not (round_value is round_to_float16 or round_value is keep_float32)
    pairs = INT8_PAIR_ELEMENTS if quant_bit == 8 else INT4_PAIR_ELEMENTS
    to_halves = int8x4_to_half2 if quant_bit == 8 else int4x8_to_half2
    pair_words, pair_selectors = _pair_scales(pairs, per_word, words, quant_group, scales_read)
    load_scale_words = _scale_loader(scales_read)

    @cuda.jit(device=True, inline="always")
    def fetch_chunk(src, row, sc_row, d0, words_out, scales_out):
        """The magic path's loads alone: the chunk's words into words_out[:words], its scale words into
        scales_out[:scale_words] (unpack_chunk turns them into values)."""
        loaded = load_words(src.data, row + (d0 // 2 if quant_bit == 4 else d0))
        held = load_scale_words(src.scales, sc_row + d0 // quant_group)
        for j in range(words):
            words_out[j] = loaded[j]
        for j in range(len(held)):
            scales_out[j] = held[j]

    @cuda.jit(device=True, inline="always")
    def unpack_chunk(loaded, held, regs, at):
        """The values of a fetched chunk into regs[at:at + elements]."""
        for j in range(words):
            halves = to_halves(loaded[j])
            for k in range(len(pairs)):
                n = j * len(pairs) + k
                scale = scale_half2(held[pair_words[n, 0]], held[pair_words[n, 1]], pair_selectors[n])
                low, high = half2_floats(mul_half2(halves[k], scale))
                e0, e1 = j * per_word + pairs[k][0], j * per_word + pairs[k][1]
                regs[at + e0] = round_value(low) if rounded else low
                regs[at + e1] = round_value(high) if rounded else high

    @cuda.jit(device=True, inline="always")
    def load_chunk(src, row, sc_row, d0, regs, at, dims):
        if not vector:
            for e in range(elements):
                if d0 + e < dims:
                    regs[at + e] = load(src, row, sc_row, d0 + e)
            return
        data, scales = src.data, src.scales
        loaded = load_words(data, row + (d0 // 2 if quant_bit == 4 else d0))
        if magic:
            unpack_chunk(loaded, load_scale_words(scales, sc_row + d0 // quant_group), regs, at)
            return
        scale = offset = np.float32(0.0)
        for j in range(words):
            word = loaded[j] ^ np.uint32(0x88888888) if biased else loaded[j]
            for k in range(per_word):                 # little-endian: element e is the e-th field from bit 0
                e = j * per_word + k
                field = (word >> (bits * k)) & ((1 << bits) - 1)
                if quant_bit == 0:
                    x = half_from_bits(field) if bits == 16 else float_from_bits(field)
                    regs[at + e] = x if exact else round_value(x)
                    continue
                if e == 0 or (d0 + e) % quant_group == 0:
                    scale = np.float32(scales[sc_row + (d0 + e) // quant_group])
                    offset = np.float32(-8.0) * scale
                if biased:
                    regs[at + e] = round_product(cuda.fma(np.float32(np.int32(field)), scale, offset))
                    continue
                sign = 1 << (bits - 1)
                q = np.int32(field ^ sign) - sign                # two's complement of a bits-wide field
                regs[at + e] = dequantize(q, scale)

    @cuda.jit(device=True, inline="always")
    def fetch_floats(src, row, sc_row, d0, words_out, scales_out):
        """A float chunk's load alone: its words into words_out[:words] (no scales)."""
        loaded = load_words(src.data, row + d0)
        for j in range(words):
            words_out[j] = loaded[j]

    @cuda.jit(device=True, inline="always")
    def unpack_floats(loaded, held, regs, at):
        """The values of a fetched float chunk into regs[at:at + elements], as load_chunk gives them."""
        for j in range(words):
            for k in range(per_word):
                field = (loaded[j] >> (bits * k)) & ((1 << bits) - 1)
                x = half_from_bits(field) if bits == 16 else float_from_bits(field)
                regs[at + j * per_word + k] = x if exact else round_value(x)

    # A kernel may issue every load of a step before it unpacks any (`ChunkPrefetch`).
    if magic:
        load_chunk.prefetch = ChunkPrefetch(fetch_chunk, unpack_chunk, words, max(1, scales_read // 2))
    elif vector and quant_bit == 0:
        load_chunk.prefetch = ChunkPrefetch(fetch_floats, unpack_floats, words, 1)
    return load_chunk


def _pair_scales(pairs, per_word, words: int, quant_group: int, scales_read: int):
    """For every value pair of a chunk (word j's pairs in order), which of the loaded scale words hold its two
    scales ((pairs, 2) int64) and the prmt selector that picks them ((pairs,) int64): compile-time tables."""
    count = max(words * len(pairs), 1)
    word_of, selector = np.zeros((count, 2), np.int64), np.zeros(count, np.int64)
    for j in range(words):
        for k, (a, b) in enumerate(pairs):
            n = j * len(pairs) + k
            ga, gb = ((j * per_word + a) // quant_group, (j * per_word + b) // quant_group) if scales_read > 1 \
                else (0, 0)
            word_of[n] = ga // 2, gb // 2
            selector[n] = pair_selector(ga % 2, gb % 2)
    return word_of, selector


def _scale_loader(scales_read: int):
    """Device function (scales, index) -> the uint32 words holding scales index .. index + scales_read - 1 (float16
    bits, two a word, low half first), in one load: 2 bytes (upper half 0), 4, 8 or 16."""
    if scales_read == 8:
        return load16
    if scales_read == 4:
        return load8

    @cuda.jit(device=True, inline="always")
    def load_scale_words(scales, index):
        return (load_bits4(scales, index),) if scales_read == 2 else (load_bits2(scales, index),)

    return load_scale_words


COPY_SPAN = 8      # cache elements a store thread copies where the cache is not quantized and not vector-aligned


def store_items(quant_bit: int, quant_group: int, head_dim: int, itemsize: int, vector: bool) -> int:
    """Threads of the store kernel per (token, head): one per quantization group, or for a plain copy one per
    16-byte chunk (`vector`) or per COPY_SPAN elements, the last one partial where head_dim is not a multiple."""
    if quant_bit:
        return head_dim // quant_group
    span = VECTOR_BYTES // itemsize if vector else COPY_SPAN
    return -(-head_dim // span)


def make_store_kernel(quant_bit: int, quant_group: int, head_dim: int, input_dtype, round_scale, round_value,
                      vector: bool = False):
    """Kernel: quantize (or copy) current key/value and write them into their cache slots.

    Grid (x: ceil(max_seqlen * H * store_items / threads), y: batch). Quantized: one thread per (token, head,
    group), so a thread owns whole int4 bytes and writes its group's scale alone: no two threads touch one element.
    A plain copy (quant_bit 0, the cache in the input's dtype): one thread per 16-byte chunk of a row in one vector
    load and one vector store (`vector`: the launcher found the rows of both sides 16-byte aligned), else per
    COPY_SPAN elements.
    """
    round_in = rounder(input_dtype)
    row_offsets, _ = make_cache_access(quant_bit, quant_group, round_scale, round_value)
    qmax = QMAX.get(quant_bit, 1)
    min_scale = np.float32(np.dtype(input_dtype).type(MIN_SCALE))   # 1e-5 as the input dtype holds it
    items = store_items(quant_bit, quant_group, head_dim, np.dtype(input_dtype).itemsize, vector)
    span = (VECTOR_BYTES // np.dtype(input_dtype).itemsize if vector else COPY_SPAN) if quant_bit == 0 \
        else quant_group

    @cuda.jit(device=True, inline="always")
    def quantize_one(v, s):
        """clip(round_half_even(v / s), -qmax, qmax), the division in the input dtype."""
        q = round(round_in(np.float32(v) / s))             # round() is half-to-even (cvt.rni)
        return np.int32(min(max(q, -qmax), qmax))

    @cuda.jit(device=True, inline="always")
    def store_item(x, x_off, dst, b, t, h, item):
        data, scales = dst.data, dst.scales
        row, sc_row = row_offsets(dst, b, t, h)
        d0 = item * span
        if quant_bit == 0:
            if vector:
                w0, w1, w2, w3 = load16(x, x_off)
                store16(data, row + d0, w0, w1, w2, w3)
            else:
                for e in range(min(span, head_dim - d0)):
                    data[row + d0 + e] = x[x_off + e]
            return
        absmax = np.float32(0.0)
        for e in range(quant_group):
            absmax = max(absmax, abs(np.float32(x[x_off + e])))
        s = max(round_in(absmax / np.float32(qmax)), min_scale)            # computed in the input dtype
        scales[sc_row + item] = s
        if quant_bit == 8:
            for e in range(quant_group):
                data[row + d0 + e] = quantize_one(x[x_off + e], s)
        else:                                               # int4: quant_group is even, pairs share a byte
            for e in range(0, quant_group, 2):
                byte = (quantize_one(x[x_off + e], s) & 0xF) | ((quantize_one(x[x_off + e + 1], s) & 0xF) << 4)
                data[row + (d0 + e) // 2] = byte - 256 if byte >= 128 else byte

    @cuda.jit
    # spec: ppl-kvc/store, ppl-mhca/quant-bit, ppl-mhca/quant-group
    def store_kernel(cur_key, cur_value, seqstarts, num_heads, start_pos, key_dst, value_dst):
        b, i, h, item = token_head_item(seqstarts, num_heads, items)
        if i < 0:
            return
        x_off = ((seqstarts[b] + i) * num_heads + h) * head_dim + item * span   # current_key (T, H, Dh)
        t = start_pos[b] + i
        store_item(cur_key, x_off, key_dst, b, t, h, item)
        store_item(cur_value, x_off, value_dst, b, t, h, item)

    return store_kernel


def make_gather_kernel(quant_bit: int, quant_group: int, head_dim: int, round_scale, round_value):
    """Kernel: read positions [0, kvlen) back from the cache, dequantized, into packed (rows, H * num_repeat, Dh).

    Grid (x: ceil(max_kvlen * H * Dh / threads), y: batch, z: 0 key / 1 value); one thread per element.
    """
    row_offsets, load = make_cache_access(quant_bit, quant_group, round_scale, round_value)

    @cuda.jit
    # spec: ppl-kvc/extract, ppl-kvc/num-repeat, ppl-kvc/dequant
    def gather_kernel(key_src, value_src, kvstarts, num_heads, num_repeat, key_out, value_out):
        b, t, h, d = token_head_item(kvstarts, num_heads, head_dim)
        if t < 0:
            return
        src, out = (key_src, key_out) if cuda.blockIdx.z == 0 else (value_src, value_out)
        row, sc_row = row_offsets(src, b, t, h)
        x = load(src, row, sc_row, d)
        out_row = ((kvstarts[b] + t) * num_heads + h) * num_repeat
        for r in range(num_repeat):                       # head h repeated num_repeat times in a row
            out[(out_row + r) * head_dim + d] = x

    return gather_kernel
