"""Which rung of the kernel ladder runs an attention call: the plan, made on the host from what the call is.

An operator describes its call in neutral terms (`AttentionShape`: sequences, the longest query and key ranges,
heads, head_dim, the query and cache formats) and `choose_kernel` returns a `KernelPlan`: the rung, rung 4's split
count, the block size and a one-line reason. Like FlashInfer's `plan()` and TensorRT-LLM's dispatch heuristics it looks
at shapes only, never at the data, so a server can make it once per batch step; it is cached per shape.

The choice, among the rungs of docs/kernel-ladder.md that can serve the call, by the whole bound model
(`cacheattn.bounds.ceilings`, an H100 SXM with the device's SM count): every candidate's DRAM bytes (a split's
float32 partials included), its arithmetic (float32 FMA on the CUDA cores, mma.sync and the shared wavefronts that
feed it on the tensor cores), its launches (a split adds the combine's), and, where the committed sm_90 SASS has
its kernel at the call's head_dim and block size (`SASS_WORK`), what its warps issue (every trip of the key loop's
shortest path, the masked tail included, and what a warp runs once), its exp2 and LSU work, and the chain of
dependent round trips each trip waits on against the warps an SM holds. A candidate wins on a lower bound (rung 5
on a tie with rung 3); a split, on a lower bound or lower terms after it:

- **rung 3, or rung 4 when splitting pays.** Lane groups with vector loads. When the grid has fewer blocks than
  the GPU has SMs, rung 4 splits every block's keys so each SM gets about two (`kernels_numba._split_k.
  choose_splits`, TensorRT-LLM's multi-block mode), but only where the split's bound, partials and combine launch
  included, is lower than the unsplit one's;
- **rung 5's decode kernel for a decode batch** (the GQA group on tensor cores fed from registers), split the same
  way, where its bound is lower than rung 3/4's: the same bytes with a fraction of the instructions and a shorter
  chain of waits;
- **rung 5 when the tensor cores are faster**: a prefill with a float16 query. A candidate whose SASS terms are
  not known (a kernel not compiled at this shape) wins only on a strictly lower bound of the terms known for both;
- **rung 6 over rung 5 for a prefill**, where the operator offers it (OpenPPL, ONNX: `rungs` with 6): the
  FlashAttention-2 kernel (`kernels_numba._attention_flash`: 64 query rows a block, K/V tiles by cp.async and
  ldmatrix) on a float16 or bfloat16 query and cache at head_dim 16 to 128, when its bound is no worse than rung
  5's (a bfloat16 prefill has no rung 5: rung 6 against the CUDA cores);
- **rung 1 as the fallback** where neither can run: block sizes that are not whole warps, or a head_dim whose rows
  do not fit those kernels' shared memory at the block size asked for. Rung 2 is never chosen: rung 3 serves every
  call rung 2 can, with fewer instructions a key.

Each candidate is asked once for a call (and block size) what it makes of it: its kernel module's `fit`
(`kernels_numba._fit.RungFit`: the grid, the block's rows, the keys a block takes a step, its shared memory, and
whether it fits or the launcher's refusal), computed by the planning functions its launcher calls; the comparison
builds each answer's bound model from it, and a rung asked for is refused with its answer's message. A fit reads
only the call's sequences, longest query, heads, head_dim, dtypes and quantization (`kernels_numba._fit.CALL_FACTS`,
all it is handed), so its answer is kept for them: a server's next decode step, a key longer, asks no kernel again.
Rung 1 is asked only where no faster rung serves the call.

Figures in the reasons are lower bounds derived from shapes (never timings), printed as bounds ("≥ 43.7 µs
(bound: DRAM; then ...)"); with ragged batches they are taken at the longest lengths.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from functools import cache, lru_cache, partial

import numpy as np

from ._validate import check_int

LADDER = (1, 2, 3, 4, 5)       # every rung of the kernel ladder (docs/kernel-ladder.md)
# Rung 6, the FlashAttention-2 prefill (kernels_numba/_attention_flash.py): offered by the operators that launch it
# (OpenPPL's), in their `rungs`.
FLASH_RUNG = 6
ALL_RUNGS = LADDER + (FLASH_RUNG,)
DEFAULT_THREADS = 128          # the block size every rung was counted at (docs/kernel-ladder.md)
MMA_FLOPS = 16 * 8 * 16 * 2    # one mma.m16n8k16
MMA_ROWS = 16                  # query rows of one mma tile; rung 5 pads a block's rows to it
# Shared-memory wavefronts per mma of rung 5 (kernels_numba/_attention_mma.py: K and V fragments and staging,
# 2.5 a mma; an int4 cache keeps Q's fragments in shared memory too, 3.5). The lab counts them: 2.5 in prefill.
MMA_WAVEFRONTS = {4: 3.5}
MMA_WAVEFRONTS_DEFAULT = 2.5


@dataclass(frozen=True)
class AttentionShape:
    """What one attention call is, in terms no operator owns.

    Attributes
    ----------
    batch : int
        Sequences (requests) in the call.
    max_query_len : int
        Query tokens of the longest sequence this call (1: decode only). The kernels' grid is sized by it.
    max_kv_len : int
        Keys the longest sequence attends to (its cached tokens plus its new ones).
    num_heads : int
        Query heads.
    num_kv_heads : int
        Key/value heads, dividing `num_heads` (grouped-query attention); `num_heads` for multi-head attention.
    head_dim : int
        Elements of one head's query, key and value.
    query_dtype : dtype-like
        float16, bfloat16 (the kernels read its bits and compute in float32; rung 5 takes float16) or float32.
    cache_dtype : dtype-like or None
        How keys and values are stored: float16, bfloat16, float32, or int8 for quantized caches (int4 packs two
        values in a byte); None means `query_dtype`.
    quant_bit : int
        0 (not quantized), 8 or 4.
    quant_group : int
        Elements per float16 scale of a quantized cache (counted in the bytes to move); 0 when not quantized.
    page_size : int
        Tokens a page of a paged cache; 0 for one contiguous range per sequence. Every rung walks pages the same
        way, so no choice depends on it today.
    decode_sequences : int
        Of `batch`, the sequences with one query token (decode steps); the rest are prefill. Only the FLOP
        estimate uses it.
    causal : bool
        Whether prefill query rows see only the keys up to their own position (bottom-right aligned); halves a
        prefill's FLOPs.
    keys_apart : bool
        Whether the keys are given apart from the queries (cross attention; ONNX's K, OpenPPL's dynamic attention),
        so that a sequence may have more query tokens than keys. False: the keys are the cached tokens plus the new
        ones, and `max_query_len` cannot exceed `max_kv_len`.

    Raises
    ------
    ValueError / TypeError
        A field out of its range, named: a negative count, a head count or head_dim below 1, `num_kv_heads` not
        dividing `num_heads`, more query tokens than keys (`max_query_len`) without `keys_apart`, decode sequences
        without a query token, a dtype outside those listed, a `quant_group` that does not divide
        `head_dim` in a quantized cache.
    """
    batch: int
    max_query_len: int
    max_kv_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_dtype: object = "float16"
    cache_dtype: object = None
    quant_bit: int = 0
    quant_group: int = 0
    page_size: int = 0
    decode_sequences: int = 0
    causal: bool = False
    keys_apart: bool = False

    # The dtypes the kernels take: a float16, bfloat16 or float32 query (bfloat16 as its bits, 2 bytes an element,
    # computed in float32; float64 on rung 1 without a plan), a cache of the query's float dtype or of int8 codes.
    QUERY_DTYPES = ("float16", "bfloat16", "float32")
    CACHE_DTYPES = ("float16", "bfloat16", "float32", "int8")

    def __post_init__(self):
        # Zero batch, query or key lengths describe an empty step, which the operators may plan.
        for name, low in (("batch", 0), ("max_query_len", 0), ("max_kv_len", 0), ("num_heads", 1),
                          ("num_kv_heads", 1), ("head_dim", 1), ("page_size", 0), ("quant_group", 0)):
            check_int(name, getattr(self, name), low=low)
        check_int("decode_sequences", self.decode_sequences, low=0, high=self.batch)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads ({self.num_heads}), "
                             f"got {self.num_kv_heads}")
        if not self.keys_apart and self.max_query_len > self.max_kv_len:
            raise ValueError(f"max_query_len: expected <= max_kv_len ({self.max_kv_len}: a sequence's keys are its "
                             f"cached tokens plus its new ones), got {self.max_query_len}; swapped? Pass "
                             f"keys_apart=True where the keys are given apart from the queries (cross attention)")
        if self.decode_sequences and self.max_query_len < 1:
            raise ValueError(f"max_query_len: expected >= 1 with decode_sequences {self.decode_sequences} (a decode "
                             f"step has one query token), got 0")
        if isinstance(self.quant_bit, bool) or self.quant_bit not in (0, 4, 8):
            raise ValueError(f"quant_bit: expected one of (0, 4, 8), got {self.quant_bit!r}")
        if self.quant_bit:
            if self.quant_group < 1 or self.head_dim % self.quant_group:
                raise ValueError(f"quant_group: expected a divisor of head_dim ({self.head_dim}) for quant_bit "
                                 f"{self.quant_bit} (a float16 scale per group), got {self.quant_group}")
            if self.quant_bit == 4 and self.quant_group % 2:
                raise ValueError(f"quant_group: expected an even group for quant_bit 4 (two values per byte), got "
                                 f"{self.quant_group}")
        # Dtypes as NumPy dtypes, so equal shapes hash equal (the plan is cached per shape).
        query = _dtype_field("query_dtype", self.query_dtype, self.QUERY_DTYPES)
        object.__setattr__(self, "query_dtype", query)
        if self.quant_bit:
            cache = np.dtype(np.int8)        # int4 codes pack two in a byte: the cache holds int8 either way
        elif self.cache_dtype is None:
            cache = query
        else:
            cache = _dtype_field("cache_dtype", self.cache_dtype, self.CACHE_DTYPES)
        object.__setattr__(self, "cache_dtype", cache)
        object.__setattr__(self, "causal", bool(self.causal))
        object.__setattr__(self, "keys_apart", bool(self.keys_apart))

    @property
    def row_bytes(self) -> int:
        """Bytes of one cached K (or V) row of one kv head: the values, plus float16 scales when quantized."""
        if not self.quant_bit:
            return self.head_dim * self.cache_dtype.itemsize
        groups = self.head_dim // self.quant_group if self.quant_group else 0
        return self.head_dim * self.quant_bit // 8 + 2 * groups

    @property
    def bytes_to_move(self) -> int:
        """K and V once (with their scales), Q read once and the output written once: what any kernel moves."""
        kv = 2 * self.batch * self.max_kv_len * self.num_kv_heads * self.row_bytes
        rows = self.decode_sequences + (self.batch - self.decode_sequences) * self.max_query_len
        return kv + 2 * rows * self.num_heads * self.head_dim * self.query_dtype.itemsize

    @property
    def flops(self) -> int:
        """2 x multiply-adds of S = Q K^T and P V over the visible (query, key) pairs, at the longest lengths."""
        q, kv = self.max_query_len, self.max_kv_len
        prefill_pairs = q * (kv - q) + q * (q + 1) // 2 if self.causal and q <= kv else q * kv
        pairs = self.decode_sequences * kv + (self.batch - self.decode_sequences) * prefill_pairs
        return 4 * self.head_dim * self.num_heads * pairs


def _dtype_field(name: str, value, accepted: tuple) -> np.dtype:
    """An AttentionShape dtype field as a NumPy dtype, one of `accepted` (TypeError naming the field)."""
    if isinstance(value, str) and value == "bfloat16":
        import ml_dtypes
        value = ml_dtypes.bfloat16          # NumPy knows the name only once ml_dtypes is imported
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in accepted:
        got = dtype.name if dtype is not None else repr(value)
        raise TypeError(f"{name}: expected one of {accepted} (a name or NumPy dtype), got {got}")
    return dtype


@dataclass(frozen=True)
class KernelPlan:
    """How the kernels run one call.

    Attributes
    ----------
    rung : int
        The kernel of the ladder (docs/kernel-ladder.md): 1 shared-memory tiles, 2 a warp per key, 3 lane
        groups with vector loads, 4 rung 3 with split-K, 5 tensor cores.
    num_splits : int
        Blocks each block's keys are split over (rung 4; 1 otherwise).
    threads : int
        The block size.
    reason : str
        Why, in one line: the bound that decided, or why a faster rung cannot serve the call.
    """
    rung: int
    num_splits: int
    threads: int
    reason: str


def choose_kernel(shape: AttentionShape, *, rung: int | None = None, num_splits: int | None = None,
                  threads: int | None = None, sms: int | None = None, rungs: tuple = LADDER,
                  register_decode: bool = True) -> KernelPlan:
    """The kernel plan for a call of this shape.

    Parameters
    ----------
    shape : AttentionShape
        What the call is.
    rung : int or None, default None
        None: the plan's choice. 1 to 5: that rung (the ladder's teaching override); ValueError naming
        `head_dim` or `threads` when it cannot serve the call, as the kernels would raise.
    num_splits : int or None, default None
        Rung 4's split count, or that of rung 5's decode kernel with `rung` 5; given without `rung`, it asks for
        rung 4.
    threads : int or None, default None
        The block size; None lets the plan pick (128, or fewer warps where a rung's shared-memory buffers need
        them).
    sms : int or None, default None
        The GPU's multiprocessors; None reads the current device (132, an H100 SXM, without one).
    rungs : tuple of int, default (1, 2, 3, 4, 5)
        The rungs the operator's kernels offer: the plan chooses among them (FasterTransformer's cross attention
        offers (1, 3, 4), so rung 5 is never its choice), and a `rung` outside them is refused.
    register_decode : bool, default True
        Whether the operator's rung 5 decodes on the register-fed kernel (`kernels_numba._attention_gqa_mma`,
        OpenPPL's launcher): then a decode batch that rung 3 or 4 would serve runs it instead, the same bytes in a
        fraction of the instructions, its keys split across blocks as rung 4's where the grid leaves SMs idle.
        ONNX's rung 5 stages its keys through shared memory: False.

    Returns
    -------
    KernelPlan

    Raises
    ------
    ValueError
        A `rung` asked for that cannot serve the call or that `rungs` lacks (named by `threads`, `rung` or
        `head_dim`), a `num_splits`
        outside 1 to 64, or a call that no rung can hold (`head_dim` too wide for every kernel's shared memory at
        the block sizes tried).

    Examples
    --------
    Decode of 64 requests at 4096 cached tokens fills an H100 on rung 3's grid, which rung 5's decode kernel runs
    (rung 3 where the operator's rung 5 has no such kernel); one request at 32768 splits its keys over 33 blocks a
    GQA group (rung 4 where the operator's rung 5 has no decode kernel):

    >>> from cacheattn import AttentionShape, choose_kernel
    >>> heads = dict(num_heads=32, num_kv_heads=8, head_dim=128, query_dtype="float16")
    >>> decode = AttentionShape(batch=64, max_query_len=1, max_kv_len=4097, decode_sequences=64, **heads)
    >>> choose_kernel(decode, sms=132).rung, choose_kernel(decode, sms=132, register_decode=False).rung
    (5, 3)
    >>> one = AttentionShape(batch=1, max_query_len=1, max_kv_len=32769, decode_sequences=1, **heads)
    >>> long = choose_kernel(one, sms=132)
    >>> long.rung, long.num_splits, long.threads
    (5, 33, 128)
    >>> long.reason[:long.reason.index(")") + 1]
    '8 blocks for 132 SMs: 33 splits make 264; memory-bound, ≥ 43.7 µs (bound: DRAM; then latency ≥ 9.5, waves ≥ 9.5)'
    """
    if sms is None:
        from kernels_numba._split_k import sm_count
        sms = sm_count()
    rungs = tuple(sorted(set(rungs)))
    if not rungs or not set(rungs) <= set(ALL_RUNGS) or 1 not in rungs:
        raise ValueError(f"rungs: expected rungs of the ladder {ALL_RUNGS} including rung 1 (every call's fallback), "
                         f"got {rungs}")
    if rung is not None and rung not in rungs:
        raise ValueError(f"rung: this operator's kernels offer rungs {rungs}, got {rung!r}")
    if rung is None and num_splits is not None and 4 not in rungs:
        raise ValueError(f"num_splits: asks for rung 4's split-K, which this operator's kernels do not offer "
                         f"(rungs {rungs})")
    return _plan(shape, rung, num_splits, threads, sms, rungs, register_decode)


@lru_cache(maxsize=512)
def _plan(shape, rung, num_splits, threads, sms, rungs=LADDER, register_decode=True):
    if rung is None and num_splits is not None:
        return _forced(shape, 4, num_splits, threads or DEFAULT_THREADS, sms, f"num_splits={num_splits} given")
    if rung is not None:
        return _forced(shape, rung, num_splits, threads or DEFAULT_THREADS, sms, f"rung={rung} asked for",
                       register_decode)
    answers = _answers(shape, threads, rungs, register_decode)
    cores, why_not_cores = (_cuda_core_rung(shape, answers[VECTOR], threads, sms, split=4 in rungs) if 3 in rungs
                            else (None, "rung 3 not offered"))
    decode = answers.get(DECODE, (None, ""))[0]
    if cores is not None and decode is not None:
        # A decode batch: rung 5 runs its register-fed kernel, against rung 3/4 by the whole model.
        (chosen, b), (fast, b5) = cores, _register_decode(shape, decode, sms)
        if _no_worse(b5, b):
            return replace(fast, reason=f"{fast.reason}; rung {chosen.rung}: {_bound_text(b)}")
        return replace(chosen, reason=f"{chosen.reason}; rung 5's decode kernel: {_bound_text(b5)}")
    tensor, why_not_tensor = (_tensor_core_rung(shape, answers[STAGED], threads, sms) if 5 in rungs
                              else (None, "rung 5 not offered"))
    flash = _flash_rung(shape, answers[FLASH][0], sms) if answers.get(FLASH, (None, ""))[0] is not None else None
    if flash is not None and (tensor is None or _no_worse(flash[1], tensor[1])):
        against = f"; rung 5: {_bound_text(tensor[1])}" if tensor is not None else ""
        tensor = (replace(flash[0], reason=flash[0].reason + against), flash[1])
    # Rung 5's staged kernel takes a prefill tie; a decode (its machine code read from the prefill's) only on a
    # strictly lower bound.
    if tensor is not None and (cores is None or (_no_worse(tensor[1], cores[1]) if shape.max_query_len > 1
                                                 else tensor[1].bound_us < cores[1].bound_us)):
        chosen = tensor[0]
        against = f"; CUDA cores: {_bound_text(cores[1])}" if cores is not None else ""
        return replace(chosen, reason=chosen.reason + against)
    if cores is not None:
        chosen, b = cores
        if b.limiter != "DRAM" and why_not_tensor:
            chosen = replace(chosen, reason=f"{chosen.reason}; no tensor cores: {why_not_tensor}")
        return chosen
    # Rung 1 plans its tiles for any block size (the one asked for, or 128), asked only now that no faster rung
    # serves; a head_dim it cannot hold raises here, as it always has.
    tiles = _ask(shape, TILES, threads or DEFAULT_THREADS)
    if not tiles.fits:
        raise ValueError(tiles.why_not)
    return KernelPlan(1, 1, threads or DEFAULT_THREADS, f"fallback to shared-memory tiles: {why_not_cores}")


def _forced(shape, rung, num_splits, threads, sms, why, register_decode=True):
    """The rung asked for, checked as its launcher will check it (its kernel's answer: whole warps, rung 5's float16
    query, a head_dim that fits), with rung 4's split count (and that of rung 5's decode kernel, which splits as
    rung 4 does)."""
    from kernels_numba._split_k import MAX_SPLITS

    check_int("rung", rung, low=1, high=FLASH_RUNG)
    if num_splits is not None:
        check_int("num_splits", num_splits, low=1, high=MAX_SPLITS)
    fit = _ask(shape, FORCED[rung], threads)
    if not fit.fits:
        raise ValueError(fit.why_not)
    if rung == 5 and register_decode and shape.decode_sequences == shape.batch:
        decode = _ask(shape, DECODE, threads)
        if decode.fits:
            splits = num_splits or _splits(shape, decode.blocks, decode.keys_per_step, sms)
            return KernelPlan(5, splits, threads, why if splits == 1 else f"{why}: the decode kernel, {splits} splits")
    if num_splits is not None and num_splits > 1 and rung != 4:
        raise ValueError(f"num_splits: rung {rung} does not split this call's keys (rung 4 does, and rung 5's decode "
                         f"kernel on a float16 decode batch), got num_splits={num_splits}")
    if rung != 4:
        return KernelPlan(rung, 1, threads, why)
    splits = num_splits or _splits(shape, fit.blocks, fit.keys_per_step, sms)
    return KernelPlan(4, splits, threads, f"{why}: {splits} splits of {fit.blocks} blocks")


# The kernels the plan asks about, (rung, variant) as their `kernels_numba._fit.RungFit` names them. Rung 4 is rung
# 3's kernel writing split-K partials: the plan splits rung 3's answer, and asks (4, "vector") only for a rung 4
# asked for (its refusals name rung 4). Rung 2 is never chosen (rung 3 serves its calls), only asked for.
TILES, WARP, VECTOR, SPLIT, STAGED, DECODE, FLASH = (1, "tiles"), (2, "warp"), (3, "vector"), (4, "vector"), \
    (5, "staged"), (5, "decode"), (6, "flash")
FORCED = {1: TILES, 2: WARP, 3: VECTOR, 4: SPLIT, 5: STAGED, 6: FLASH}
# what the plan compares, in the order it asks; rung 1 only when none serves
CANDIDATES = (VECTOR, DECODE, STAGED, FLASH)


@cache
def rung_fits() -> dict:
    """{(rung, variant): fit(shape, threads) -> RungFit}: each kernel's own answer, next to its launcher
    (`kernels_numba._fit`)."""
    from kernels_numba import (
        _attention_core,
        _attention_flash,
        _attention_gqa_mma,
        _attention_mma,
        _attention_vector,
        _attention_warp,
    )

    return {TILES: _attention_core.fit, WARP: _attention_warp.fit, VECTOR: _attention_vector.fit,
            SPLIT: partial(_attention_vector.fit, rung=4), STAGED: _attention_mma.fit, DECODE: _attention_gqa_mma.fit,
            FLASH: _attention_flash.fit}


@cache
def _call_facts() -> tuple:
    """(the facts of a shape a fit reads, as a tuple; the named tuple a fit is handed): `kernels_numba._fit`'s."""
    from kernels_numba._fit import CALL_FACTS, CallFacts

    return operator.attrgetter(*CALL_FACTS), CallFacts


def _ask(shape, kernel, threads):
    return _answer(rung_fits()[kernel], threads, _call_facts()[0](shape))


@lru_cache(maxsize=1024)
def _answer(fit, threads, facts):
    """A kernel's answer at a block size, asked once for each set of the facts a fit reads: a server's decode steps,
    a key longer each, ask no kernel again, and a new batch size asks each once."""
    return fit(_call_facts()[1](*facts), threads)


def _answers(shape, threads, rungs, register_decode) -> dict:
    """Each offered candidate's answer, asked once a block size: {kernel: (its RungFit at the first block size of
    `_block_sizes` it fits, or None; the first refusal's text)}. Rung 1, the fallback, is not asked here. Rung 5's
    decode kernel is asked for a decode batch where the operator's rung 5 has it, at the block size rung 3 takes
    (the call it would take over); where it serves, it is rung 5's candidate, and the staged kernel is not asked."""
    answers = {}
    for kernel in CANDIDATES:
        if kernel[0] not in rungs or kernel == DECODE and not (register_decode and
                                                               shape.decode_sequences == shape.batch):
            continue
        if kernel in (STAGED, FLASH) and answers.get(DECODE, (None, ""))[0] is not None:
            continue
        if kernel == FLASH and shape.max_query_len <= 1:
            continue                               # a prefill kernel: 16 rows a warp for one query position
        if kernel == DECODE:
            cores = answers.get(VECTOR, (None, ""))[0]
            if cores is None:
                continue
            sizes = (cores.threads,)
        else:
            sizes = _block_sizes(threads)
        fit, first = None, ""
        for t in sizes:
            asked = _ask(shape, kernel, t)
            if asked.fits:
                fit = asked
                break
            first = first or asked.why_not
        answers[kernel] = (fit, first)
    return answers


def _splits(shape, blocks, step, sms):
    from kernels_numba._split_k import choose_splits
    return choose_splits(blocks, shape.max_kv_len, step, sms)


# What one warp of a rung's kernel issues and waits on, read from the committed sm_90 SASS at head_dim 128 and 128
# threads (docs/kernel-ladder-sass.json, which tests/test_kernel_choice.py holds these to): (rung, phase, quant_bit)
# -> (instructions of a key-loop trip on its shortest path, instructions a warp runs once, MUFU.EX2 a trip,
# LDS/STS/SHFL a trip, HBM round trips a trip waits on in series, short ones, blocks an SM holds). Rung 4 is rung 3
# writing partials; rung 5's decode is its register-fed kernel; rung 6 is the FlashAttention-2 prefill, whose trip
# is a 64-key tile of its 4 warps, its 16 cp.async copies and a lane's one page-table read included.
SASS_WORK = {
    (3, "decode", 0): (517, 1246, 2, 29, 1, 5, 4), (3, "decode", 8): (868, 1969, 2, 21, 2, 2, 2),
    (3, "decode", 4): (863, 1968, 2, 21, 0, 6, 2), (4, "decode", 0): (526, 1318, 2, 29, 1, 5, 3),
    (4, "decode", 8): (868, 2080, 2, 21, 1, 5, 2), (4, "decode", 4): (863, 2081, 2, 21, 0, 6, 2),
    (5, "decode", 0): (233, 1539, 5, 8, 2, 1, 3), (5, "decode", 8): (452, 1812, 5, 10, 2, 1, 3),
    (5, "decode", 4): (419, 1747, 5, 8, 1, 2, 4), (3, "prefill", 0): (725, 1793, 2, 41, 1, 5, 2),
    (4, "prefill", 0): (729, 1928, 2, 41, 1, 5, 2),
    (5, "prefill", 0): (1730, 3623, 10, 84, 4, 28, 2), (5, "prefill", 8): (1961, 3598, 10, 92, 3, 27, 2),
    (5, "prefill", 4): (2607, 2182, 10, 148, 3, 27, 2), (6, "prefill", 0): (1271, 2661, 34, 23, 2, 1, 2),
}
SASS_SHAPE = (128, 128)        # (head_dim, threads) the table was read at


def _keys_a_block_sees(shape) -> float:
    """Keys one block of a sequence walks, on average over its query tiles: the visible (query, key) pairs of the
    longest sequence over its query rows (decode: every key)."""
    q, kv = max(shape.max_query_len, 1), shape.max_kv_len
    pairs = q * (kv - q) + q * (q + 1) // 2 if shape.causal and q <= kv else q * kv
    return pairs / q


def _call_bounds(shape, sms, rung, threads, blocks, splits=1, step=None, kernel_phase=None, **work):
    """The whole bound model (`cacheattn.bounds.ceilings`) for one candidate: the call's bytes (and, split, its
    float32 partials written and read back by the combine), `work` (fma_flops, or mma and shared wavefronts), its
    launches (the combine's too), and where the committed SASS has the kernel at this shape, what its warps issue
    and the latency chain of their trips, on an H100 SXM with `sms` multiprocessors over `blocks` x `splits`
    blocks. `step`: the keys a block takes a step (a warp a trip each); `kernel_phase`: the phase whose kernel runs
    the call, where it is not the call's own (rung 5's staged kernel on a decode is its prefill kernel)."""
    from cacheattn import bounds as model

    phase = "decode" if shape.max_query_len <= 1 else "prefill"
    partials = 0
    if splits > 1:           # each split's output row, max and sum in float32, written and read back
        rows = shape.batch * max(shape.max_query_len, 1) * shape.num_heads
        partials = 2 * splits * rows * (shape.head_dim * 4 + 8)
    fields = dict(dram_bytes=shape.bytes_to_move + partials, launches=2 if splits > 1 else 1,
                  blocks=blocks * splits, warps_per_block=threads // 32, **work)
    table = SASS_WORK.get((rung, kernel_phase or phase, shape.quant_bit)) if rung is not None else None
    if table is not None and step and shape.cache_dtype.itemsize <= 2:
        trip, once, ex2, lsu, hbm, near, resident = table
        warps = threads // 32
        keys = _keys_a_block_sees(shape) / splits
        steps = keys / step if phase == "prefill" else math.ceil(keys / step)
        trips = blocks * splits * warps * steps
        fields.update(warp_trips=trips, chain_hbm=hbm if phase == "decode" else 0,
                      chain_l2=0 if phase == "decode" else hbm, chain_near=near)
        if (shape.head_dim, threads) == SASS_SHAPE:
            fields.update(warp_instructions=trips * trip + blocks * splits * warps * once, ex2=trips * ex2,
                          lsu_instructions=trips * lsu, blocks_per_sm=resident)
        else:
            # At another head_dim or block size the trip's instructions differ, but not the order its loads wait
            # in: the chain stands, over as many blocks an SM as its warps allow (a lower bound on the wait).
            fields.update(blocks_per_sm=max(1, 64 // warps))
    return model.ceilings(model.Work(**fields), _machine(model.H100_SXM, sms))


@lru_cache(maxsize=16)
def _machine(machine, sms):
    """The H100 model with the device's SM count (cached: the plan runs on the host for every new shape)."""
    return replace(machine, sms=sms)


def _bound_text(b) -> str:
    """'≥ X µs (bound: limited by R; then S ≥ y, T ≥ z)'."""
    then = ", ".join(f"{name} ≥ {b.resources[name].value:,.1f}" for name in b.ranked[1:3])
    return f"≥ {b.bound_us:,.1f} µs (bound: {b.limiter}; then {then})" if then else f"≥ {b.bound_us:,.1f} µs " \
        f"(bound: {b.limiter})"


def _kind(b) -> str:
    return {"DRAM": "memory", "L2": "memory", "L1": "memory", "latency": "latency", "waves": "latency",
            "launch": "launch"}.get(b.limiter, "compute")


_SASS_TERMS = {"issue", "MUFU", "LSU", "latency", "waves"}


def _better(a, b) -> bool:
    """Whether bounds `a` beat `b`: a lower bound, or the same bound and lower terms after it. A term read from
    machine code that one candidate lacks (no SASS of its kernel at this shape) is left out of both, so a kernel
    is never preferred for what the model does not know of it."""
    unknown = (_SASS_TERMS & (set(a.resources) | set(b.resources))) - (set(a.resources) & set(b.resources))

    def terms(x):
        return sorted((fig.value for name, fig in x.resources.items() if name not in unknown), reverse=True)
    # Where a term is unknown for one, only a strictly lower bound on the known terms decides.
    return terms(a)[0] < terms(b)[0] if unknown else terms(a) < terms(b)


def _no_worse(a, b) -> bool:
    """Whether the faster rung's bounds `a` are at most `b`'s: rung 5 takes a tie with rung 3 (two calls held by the
    same term, as tiny calls are by their launch), unless a term is unknown for one of them (`_better` then)."""
    if (_SASS_TERMS & (set(a.resources) | set(b.resources))) - (set(a.resources) & set(b.resources)):
        return _better(a, b)
    return a.bound_us <= b.bound_us


def _block_sizes(threads):
    """The block sizes to try: the one asked for, else 128 and then fewer warps (smaller shared-memory buffers)."""
    return (threads,) if threads is not None else (DEFAULT_THREADS, 64, 32)


def _fewer(shape, t, threads):
    return f" at {t} threads (head_dim {shape.head_dim} does not fit {DEFAULT_THREADS})" if t != (
        threads or DEFAULT_THREADS) else ""


def _cuda_core_rung(shape, answer, threads, sms, split=True):
    """((plan, bounds), None) for rung 3, or 4 when splitting rung 3's keys over more blocks lowers the whole
    model's bound (and `split` offers it); (None, why not). `answer`: rung 3's (RungFit or None, first refusal)."""
    if threads is not None and threads % 32:
        return None, f"rungs 2-5 need whole warps, threads is {threads}"
    fit, why = answer
    if fit is None:
        return None, f"rung 3: {why}"
    t, blocks, step = fit.threads, fit.blocks, fit.keys_per_step
    unsplit = _call_bounds(shape, sms, 3, t, blocks, step=step, fma_flops=shape.flops)
    splits = _splits(shape, blocks, step, sms) if split else 1
    b = unsplit
    if splits > 1:
        parted = _call_bounds(shape, sms, 4, t, blocks, splits, step=step, fma_flops=shape.flops)
        if _better(parted, unsplit):
            b = parted
        else:
            splits = -splits                       # offered, but the partials and the combine cost more
    figures = f"{_kind(b)}-bound, {_bound_text(b)}"
    if splits > 1:
        reason = f"{blocks} blocks for {sms} SMs: {splits} splits make {blocks * splits}"
    elif splits < -1:
        reason = (f"{blocks} blocks for {sms} SMs, unsplit: {-splits} splits' partials and combine launch "
                  f"cost more than they buy")
        splits = 1
    else:
        reason = (f"{blocks} blocks fill {sms} SMs" if blocks >= sms else f"{blocks} blocks, too few keys to split"
                  if split else f"{blocks} blocks, unsplit: rung 4 (split-K) not offered")
    return (KernelPlan(4 if splits > 1 else 3, splits, t, f"{reason}{_fewer(shape, t, threads)}; {figures}"),
            b), None


def _register_decode(shape, fit, sms):
    """(plan, bounds) of rung 5's register-fed decode kernel, from its answer `fit`, split as rung 4 where that
    lowers its bound."""
    threads, blocks, step = fit.threads, fit.blocks, fit.keys_per_step
    mma = shape.flops / MMA_FLOPS * MMA_ROWS / max(1, shape.num_heads // shape.num_kv_heads)
    b = _call_bounds(shape, sms, 5, threads, blocks, step=step, mma=mma)
    splits = _splits(shape, blocks, step, sms)
    reason = f"{blocks} blocks fill {sms} SMs" if blocks >= sms else f"{blocks} blocks for {sms} SMs, unsplit"
    if splits > 1:
        parted = _call_bounds(shape, sms, 5, threads, blocks, splits, step=step, mma=mma)
        if _better(parted, b):
            b, reason = parted, f"{blocks} blocks for {sms} SMs: {splits} splits make {blocks * splits}"
        else:
            reason += f": {splits} splits' partials and combine launch cost more than they buy"
            splits = 1
    return KernelPlan(5, splits, threads, f"{reason}; {_kind(b)}-bound, {_bound_text(b)}; rung 5's decode kernel: "
                                          f"the GQA group on tensor cores fed from registers"), b


def _tensor_core_rung(shape, answer, threads, sms):
    """((plan, bounds), None) for rung 5, or (None, why not). `answer`: rung 5's staged kernel's (RungFit at the
    first block size that fits, fewer warps where its tiles do not fit the shared memory at 128 threads, or None;
    first refusal)."""
    if shape.query_dtype != np.float16:
        return None, f"rung 5 takes a float16 query, got {shape.query_dtype.name}"
    if threads is not None and threads % 32:
        return None, f"rung 5 needs whole warps, threads is {threads}"
    fit, why = answer
    if fit is None:
        return None, f"rung 5: {why}"
    rows, t, blocks = max(shape.max_query_len, 1), fit.threads, fit.blocks
    # An mma tile computes 16 rows whatever it holds: decode fills heads_per_block of them.
    mma = shape.flops / MMA_FLOPS * MMA_ROWS / (fit.heads_per_block * min(fit.positions // fit.row_tiles, rows))
    # The staged kernel's SASS is the prefill kernel's, a decode through it included (the same key loop).
    b = _call_bounds(shape, sms, 5, t, blocks, step=fit.keys_per_step, kernel_phase="prefill",
                     mma=mma, shared_wavefronts=mma * MMA_WAVEFRONTS.get(shape.quant_bit, MMA_WAVEFRONTS_DEFAULT))
    return (KernelPlan(5, 1, t, f"tensor cores{_fewer(shape, t, threads)} on {blocks} blocks: {_kind(b)}-bound, "
                                f"{_bound_text(b)}"), b), None


def _flash_rung(shape, fit, sms):
    """(plan, bounds) of rung 6, the FlashAttention-2 prefill, from its answer `fit`: 16 query positions of one head
    a warp, so an mma tile is full from 16 positions on; its shared-memory wavefronts a mma from its tile plan
    (`_attention_flash.shared_wavefronts`)."""
    from kernels_numba._attention_flash import shared_wavefronts

    rows, t, blocks = max(shape.max_query_len, 1), fit.threads, fit.blocks
    mma = shape.flops / MMA_FLOPS * MMA_ROWS / min(MMA_ROWS, rows)
    b = _call_bounds(shape, sms, FLASH_RUNG, t, blocks, step=fit.keys_per_step, mma=mma,
                     shared_wavefronts=mma * shared_wavefronts(shape.head_dim, t // 32))
    return KernelPlan(FLASH_RUNG, 1, t, f"FlashAttention-2 prefill on {blocks} blocks: {_kind(b)}-bound, "
                                        f"{_bound_text(b)}"), b
