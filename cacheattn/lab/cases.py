"""The bench cases: one attention problem each, shared by the GPU bench, the bound model and the lab's counters.

A case knows its problem (batch, cached and new tokens, heads, head_dim, the cache format), makes the operator's
call (`call`: OpenPPL's `multi_head_cache_attention` for `BenchCase`, TensorRT-LLM's `gpt_attention` generation for
`TrtBenchCase`) at a rung of the kernel ladder, says which rung and split count the operator's default call runs
for the full launch (`default_plan`), and what the operator must do at least: the bytes it must move (K/V once with
their scales, Q read once, O written once, and the new token's K/V stored where the operator stores them) and its
FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..examples import FTCase, OnnxCase, PPLCase, TrtCase, build_ft, build_onnx, build_ppl, build_trt

SMS = 132                      # an H100 SXM's multiprocessors: the full launches' split-K choices are made for it

CACHE_NAMES = {0: "float16", 8: "int8", 4: "int4"}


def causal_flops(case) -> int:
    """Multiply-adds of S = Q K^T and O = P V, times 2: 4 x head_dim per visible (query, key) pair per head; with
    the causal rule query i of a request sees its context + i + 1 keys."""
    pairs = case.new_tokens * case.context + case.new_tokens * (case.new_tokens + 1) // 2
    return 4 * case.head_dim * case.num_heads * case.batch * pairs


@dataclass(frozen=True)
class BenchCase:
    """One OpenPPL MultiHeadCacheAttention call (decode or prefill) over a float16, int8 or int4 cache.

    context: tokens cached per request before the call; new_tokens: query tokens per request (1 in decode), which
    the fused operator stores first, so attention reads context + new_tokens keys. int8 / int4 caches carry one
    float16 scale per `quant_group` elements (docs/semantics.md: int8 per group of quant_group, and int4 with two
    values per byte). cache_mode 1 is paged (page_size tokens a page), 0 offset."""
    label: str
    batch: int
    context: int
    new_tokens: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    quant_bit: int = 0
    cache_mode: int = 1
    page_size: int = 64
    quant_group: int = 8

    operator = "OpenPPL multi_head_cache_attention"
    rungs = (1, 2, 3, 4, 5)
    kv_arrays = "_src.data"    # the attention kernels name the cache K/V `k_src.data` / `v_src.data`

    @property
    def cache(self) -> str:
        """float16, int8 or int4."""
        if self.quant_bit not in CACHE_NAMES:
            raise ValueError(f"quant_bit: expected 0 (float16), 8 (int8) or 4 (int4), got {self.quant_bit!r}")
        return CACHE_NAMES[self.quant_bit]

    @property
    def kvlen(self) -> int:
        return self.context + self.new_tokens

    @property
    def value_bytes(self) -> int:
        """Bytes of the values of one cached K (or V) row of one kv head, without scales."""
        return {"float16": 2 * self.head_dim, "int8": self.head_dim, "int4": self.head_dim // 2}[self.cache]

    @property
    def row_bytes(self) -> int:
        """Bytes of one cached K (or V) row of one kv head: the values, plus their float16 scales when quantized."""
        return self.value_bytes + (2 * (self.head_dim // self.quant_group) if self.quant_bit else 0)

    @property
    def must_move(self) -> dict:
        """The bytes the attention must move at least, by part: K and V (with scales) once, Q read once, the output
        (float16) written once."""
        kv = 2 * self.batch * self.kvlen * self.num_kv_heads * self.row_bytes
        q = self.batch * self.new_tokens * self.num_heads * self.head_dim * 2
        return dict(kv=kv, q=q, o=q)

    @property
    def floor_bytes(self) -> int:
        return sum(self.must_move.values())

    @property
    def flops(self) -> int:
        return causal_flops(self)

    def ppl_case(self) -> PPLCase:
        decode = self.new_tokens == 1
        return PPLCase(seqlens=(self.new_tokens,) * self.batch, past=(self.context,) * self.batch,
                       decoding_batches=self.batch if decode else 0, num_heads=self.num_heads,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype="float16",
                       quant_bit=self.quant_bit, quant_group=self.quant_group, scale_dtype="float16", cache_layout=0,
                       cache_mode=self.cache_mode, page_size=self.page_size, num_layer=1, layer_idx=0,
                       is_causal=True, is_alibi=False, mask="none", mask_pad=0, seed=0)

    def chunk(self, rung: int) -> int:
        """Elements a lane of `rung` loads at once from the cache (`_cache.chunk_elements`)."""
        from kernels_numba._cache import chunk_elements
        return chunk_elements(self.quant_bit, np.int8 if self.quant_bit else np.float16, rung)

    def shape(self):
        """The call as `cacheattn.choose_kernel` sees it."""
        from ..kernel_choice import AttentionShape
        return AttentionShape(batch=self.batch, max_query_len=self.new_tokens, max_kv_len=self.kvlen,
                              num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              query_dtype="float16", quant_bit=self.quant_bit,
                              quant_group=self.quant_group if self.quant_bit else 0,
                              page_size=self.page_size if self.cache_mode == 1 else 0,
                              decode_sequences=self.batch if self.new_tokens == 1 else 0, causal=True)

    def splits(self, rung: int, threads: int = 128) -> int:
        """The split count of rung 4, or of rung 5's decode kernel, for this (full) launch, as the plan picks it
        for an H100's SMs; 1 for the rest."""
        if rung not in (4, 5):
            return 1
        from ..kernel_choice import choose_kernel
        return choose_kernel(self.shape(), rung=rung, threads=threads, sms=SMS).num_splits

    def default_plan(self, threads: int = 128) -> dict:
        """What the operator's default call (rung None) runs for this launch on an H100: `cacheattn.choose_kernel`'s
        choice among the rungs the call offers (rung 6, the FlashAttention-2 prefill, included)."""
        from ..kernel_choice import choose_kernel
        from ..ppl import RUNGS
        chosen = choose_kernel(self.shape(), sms=SMS, rungs=RUNGS)
        return dict(rung=chosen.rung, num_splits=chosen.num_splits, threads=chosen.threads, reason=chosen.reason)

    def call(self, rung: int, threads: int = 128, num_splits: int = 1):
        """One multi_head_cache_attention call of this case at `rung` (rungs 4 and 5 at `num_splits`)."""
        import cacheattn
        ppl = self.ppl_case()
        extra = {"num_splits": num_splits} if rung in (4, 5) else {}
        return cacheattn.multi_head_cache_attention(**build_ppl(ppl), **ppl.attrs(), backend="numba",
                                                    threads=threads, rung=rung, **extra)


TRT_QUANT = {"float16": 0, "int8": 64, "fp8": 128}     # kv_cache_quant_mode of each cache format


@dataclass(frozen=True)
class TrtBenchCase:
    """One TensorRT-LLM `gpt_attention` generation step: `batch` sequences of one new token each over `context`
    cached tokens, a paged float16, INT8 or FP8 (e4m3) cache of `tokens_per_block` tokens a block (one float32
    scale for the whole cache), no position embedding (RoPE adds arithmetic on Q and the new K, no bytes).

    The preprocess stores every new token's K and V into the cache, then attention reads `context + 1` keys. Rungs
    1, 3, 4 and 5 (its decode kernel) serve it; the default call takes rung 5's decode kernel, or rung 4 when
    multi-block mode splits (few blocks)."""
    label: str
    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_cache: str = "float16"
    tokens_per_block: int = 64

    operator = "TensorRT-LLM gpt_attention"
    rungs = (1, 3, 4, 5)
    # the cache sources' field: `k_src.cache` / `v_src.cache` (the pool); rung 5's decode sources name it `data`
    kv_arrays = ("_src.cache", "_src.data")
    new_tokens = 1
    quant_bit = 0              # no per-group scales: the INT8 / FP8 cache has one per-tensor scale
    cache_mode = 1
    threads_default = 128

    @property
    def cache(self) -> str:
        if self.kv_cache not in TRT_QUANT:
            raise ValueError(f"kv_cache: expected one of {tuple(TRT_QUANT)}, got {self.kv_cache!r}")
        return self.kv_cache

    @property
    def page_size(self) -> int:
        return self.tokens_per_block

    @property
    def kvlen(self) -> int:
        return self.context + 1

    @property
    def value_bytes(self) -> int:
        return self.head_dim * (2 if self.cache == "float16" else 1)

    @property
    def row_bytes(self) -> int:
        return self.value_bytes

    @property
    def must_move(self) -> dict:
        """The bytes the step must move at least: the cached K and V once, the new token's K/V read from qkv
        (float16) and stored into the cache once, Q read once, the output (float16) written once."""
        heads_kv = self.batch * self.num_kv_heads
        q = self.batch * self.num_heads * self.head_dim * 2
        return dict(kv=2 * heads_kv * self.context * self.row_bytes, new_kv=2 * heads_kv * self.head_dim * 2,
                    store=2 * heads_kv * self.row_bytes, q=q, o=q)

    @property
    def floor_bytes(self) -> int:
        return sum(self.must_move.values())

    @property
    def flops(self) -> int:
        """2 x the multiply-adds of S = q K^T and o = P V: 4 x head_dim per (query, key) pair per head."""
        return 4 * self.head_dim * self.num_heads * self.batch * self.kvlen

    def chunk(self, rung: int) -> int:
        """Elements a lane of rungs 3/4 loads at once (16 bytes); rung 1 stages tiles through shared memory."""
        from kernels_numba.trtllm_common import chunk_elements
        return chunk_elements(np.dtype(np.float16 if self.cache == "float16" else np.int8).itemsize)

    def trt_case(self) -> TrtCase:
        return TrtCase(contexts=(), generations=((self.context, self.context),) * self.batch, beam_width=1,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                       dtype="float16", capacity=self.kvlen, window=self.kvlen, paged=True,
                       tokens_per_block=self.tokens_per_block, quant=TRT_QUANT[self.cache])

    def _blocks(self, rung: int, threads: int) -> tuple[int, int]:
        """(blocks of the unsplit grid, keys a block takes per step) of the generation kernel at `rung`."""
        if rung == 1:
            from kernels_numba._attention_core import plan_tiles
            heads_per_block, q_tile, key_tile = plan_tiles(self.num_heads, self.num_kv_heads, 1, self.head_dim,
                                                           self.head_dim, 4)
            return math.ceil(1 / q_tile) * (self.num_heads // heads_per_block) * self.batch, key_tile
        if rung == 5:                                   # the decode kernel: a GQA group a block, 16 keys a warp
            from kernels_numba._attention_gqa_mma import decode_grid
            return decode_grid(self.num_heads, self.num_kv_heads, self.batch, threads)
        from kernels_numba.trtllm_generation import block_plan, key_step
        heads_per_block, _ = block_plan(self.num_heads, self.num_kv_heads, self.head_dim, self.chunk(rung), threads)
        return (self.num_heads // heads_per_block) * self.batch, key_step(self.head_dim, self.chunk(rung), threads)

    def splits(self, rung: int, threads: int = 128) -> int:
        """The split count multi-block mode picks for this (full) launch on an H100 at `rung` (rung 3: 1)."""
        if rung == 3:
            return 1
        from kernels_numba._split_k import choose_splits
        blocks, step = self._blocks(rung, threads)
        return choose_splits(blocks, self.kvlen, step, SMS)

    def default_plan(self, threads: int = 128) -> dict:
        """What `gpt_attention`'s default call (rung None, multi_block_mode) runs for this launch on an H100: rung 5's
        decode kernel (a float16 query at its head sizes, one beam: the bench cases are such), its keys split where
        multi-block mode splits."""
        blocks, _ = self._blocks(5, threads)
        splits = self.splits(5, threads)
        kernel = "rung 5's decode kernel (the GQA group on tensor cores, K/V loaded into the mma's registers)"
        if splits == 1:
            reason = f"{blocks} blocks fill {SMS} SMs: multi-block mode does not split; {kernel}"
        else:
            reason = f"{blocks} blocks for {SMS} SMs: multi-block mode splits the keys {splits} ways; {kernel}"
        return dict(rung=5, num_splits=splits, threads=threads, reason=reason)

    def call(self, rung: int, threads: int = 128, num_splits: int = 1):
        """One gpt_attention generation step of this case at `rung` (rungs 1 and 4 at `num_splits`: the full
        launch's, never what multi-block mode would pick for a cut-down grid)."""
        import cacheattn
        extra = {} if rung == 3 else {"num_splits": num_splits}
        return cacheattn.gpt_attention(**build_trt(self.trt_case()), backend="numba", threads=threads, rung=rung,
                                       **extra)


@dataclass(frozen=True)
class TrtContextBenchCase:
    """One TensorRT-LLM `gpt_attention` context step: `batch` prompts of `new_tokens` tokens each and nothing cached
    before them, a paged float16 cache of `tokens_per_block` tokens a block, no position embedding. The preprocess
    stores the prompt's K and V into the cache; the fused context kernel reads them from the float16 scratch the
    preprocess also writes (as TensorRT-LLM's context FMHA reads the packed QKV), under the causal mask.

    Rungs 1 and 5 serve it (rung 5, `mma.sync`, is the default for a float16 query); what it must move at least:
    the packed QKV read once, the new K and V stored into the cache once, the output written once."""
    label: str
    batch: int
    new_tokens: int
    context: int = 0
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 64

    operator = "TensorRT-LLM gpt_attention"
    rungs = (1, 5, 6)
    kv_arrays = ("_src.scratch", "_src.cache")   # the prompt's K/V in the scratch, a chunked context's in the pool
    cache = "float16"
    quant_bit = 0
    cache_mode = 1

    @property
    def page_size(self) -> int:
        return self.tokens_per_block

    @property
    def kvlen(self) -> int:
        return self.context + self.new_tokens

    @property
    def value_bytes(self) -> int:
        return 2 * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.value_bytes

    @property
    def must_move(self) -> dict:
        tokens = self.batch * self.new_tokens
        heads = self.num_heads + 2 * self.num_kv_heads
        return dict(qkv=tokens * heads * self.head_dim * 2, store=2 * tokens * self.num_kv_heads * self.row_bytes,
                    kv=2 * self.batch * self.context * self.num_kv_heads * self.row_bytes,
                    o=tokens * self.num_heads * self.head_dim * 2)

    @property
    def floor_bytes(self) -> int:
        return sum(self.must_move.values())

    @property
    def flops(self) -> int:
        return causal_flops(self)

    def trt_case(self) -> TrtCase:
        return TrtCase(contexts=((self.context, self.new_tokens),) * self.batch, generations=(), beam_width=1,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                       dtype="float16", capacity=self.kvlen, window=self.kvlen, paged=True,
                       tokens_per_block=self.tokens_per_block)

    def splits(self, rung: int, threads: int = 128) -> int:
        return 1

    def default_plan(self, threads: int = 128) -> dict:
        """What `gpt_attention`'s default call runs for this context step: the operator's own decision
        (`trtllm_context.context_rung`), rung 6 against rung 5 weighed by the bound model as the call weighs them
        (`cacheattn.trtllm.context_on_rung_6`)."""
        from kernels_numba.trtllm_context import context_rung

        from ..trtllm import context_on_rung_6

        def flash_wins():
            return context_on_rung_6(batch=self.batch, max_query_len=max(self.new_tokens, 2), max_kv_len=self.kvlen,
                                     num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                     head_dim=self.head_dim, query_dtype="float16", threads=threads, sms=SMS)
        rung, reason = context_rung(rung=None, rounds_as="float16", head_size=self.head_dim, threads=threads,
                                    fused_generation=False, num_splits=None, flash_wins=flash_wins)
        return dict(rung=rung, num_splits=1, threads=threads, reason=reason)

    def call(self, rung: int, threads: int = 128, num_splits: int = 1):
        """One gpt_attention context step of this case at `rung` (rung 1 unsplit: multi-block mode would split a
        cut-down grid that the full launch fills)."""
        import cacheattn
        extra = {"num_splits": num_splits} if rung == 1 else {}
        return cacheattn.gpt_attention(**build_trt(self.trt_case()), backend="numba", threads=threads, rung=rung,
                                       **extra)


DECODE = BenchCase("decode B64 ctx4096 paged fp16", 64, 4096, 1)
DECODE_INT8 = BenchCase("decode B64 ctx4096 paged int8", 64, 4096, 1, quant_bit=8)
DECODE_INT4 = BenchCase("decode B64 ctx4096 paged int4", 64, 4096, 1, quant_bit=4)
LONG_DECODE = BenchCase("decode B1 ctx32768 paged fp16", 1, 32768, 1)
PREFILL = BenchCase("prefill B1 4096 tokens fp16", 1, 0, 4096)

# What `python -m cacheattn bench` times on a GPU (the offset cache beside the paged one)...
GPU_CASES = (DECODE, DECODE_INT8, BenchCase("decode B64 ctx4096 offset fp16", 64, 4096, 1, cache_mode=0),
             LONG_DECODE, PREFILL)
def _takes_rung(operator) -> bool:
    """Whether an operator's call offers the ladder's `rung=` (those that do not run rung 1's tiles)."""
    import inspect
    return "rung" in inspect.signature(operator).parameters


class PlannedCase:
    """A decode step of one float16 query token a sequence over `self.kvlen` float16 keys (`batch`, `num_heads`,
    `num_kv_heads`, `head_dim` fields), by an operator that offers the rungs in `self.rungs` and whose default is
    `cacheattn.choose_kernel`'s choice for `self.shape()`: the split counts and the default the lab counts come from the
    plan itself. `must_move` is the operator's own."""
    new_tokens = 1
    quant_bit = 0
    quant_group = 0
    cache = "float16"
    cache_mode = 0
    page_size = 0

    @property
    def value_bytes(self) -> int:
        return 2 * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.value_bytes

    @property
    def floor_bytes(self) -> int:
        return sum(self.must_move.values())

    @property
    def flops(self) -> int:
        return 4 * self.head_dim * self.num_heads * self.batch * self.kvlen

    def chunk(self, rung: int) -> int:
        from kernels_numba._cache import chunk_elements
        return chunk_elements(0, np.float16, rung)

    def shape(self):
        from ..kernel_choice import AttentionShape
        return AttentionShape(batch=self.batch, max_query_len=1, max_kv_len=self.kvlen, num_heads=self.num_heads,
                              num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, query_dtype="float16",
                              decode_sequences=self.batch)

    def rung_keywords(self, rung: int, num_splits: int) -> dict:
        """The call's `rung=` (and rung 4's `num_splits=`) where the operator offers them; none where it does not."""
        if 3 not in self.rungs:
            return {}
        return dict(rung=rung, **({"num_splits": num_splits} if rung == 4 else {}))

    def splits(self, rung: int, threads: int = 128) -> int:
        if rung != 4 or 4 not in self.rungs:
            return 1
        from ..kernel_choice import choose_kernel
        return choose_kernel(self.shape(), rung=4, threads=threads, sms=SMS, **self.plan_options).num_splits

    def default_plan(self, threads: int = 128) -> dict:
        if 3 not in self.rungs:
            return dict(rung=1, num_splits=1, threads=threads, reason="the call offers rung 1's tiles only")
        from ..kernel_choice import choose_kernel
        chosen = choose_kernel(self.shape(), sms=SMS, **self.plan_options)
        return dict(rung=chosen.rung, num_splits=chosen.num_splits, threads=chosen.threads, reason=chosen.reason)


@dataclass(frozen=True)
class OnnxBenchCase(PlannedCase):
    """One ONNX `Attention` decode step with past (4-D float16 tensors): `batch` sequences of one query token over
    `context` past tokens. The operator returns present_key / present_value, past and the new token concatenated:
    it must read the past once and write all of present once.

    Counted at the rungs its call offers: rung 1 where it has no `rung=`; rungs 1, 3 and 4 once it has (then its
    default is `cacheattn.choose_kernel`'s choice)."""
    label: str
    batch: int
    context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    operator = "ONNX Attention"

    @property
    def plan_options(self) -> dict:
        from ..onnx import PLAN_OPTIONS
        return PLAN_OPTIONS
    # What the attention kernel reads K/V from: present (rung 1, after the copy kernels), or past and the new token
    # (rungs 3 and 4, which write present as they read them).
    kv_arrays = ("_src.data", "_src.past", "_src.new")

    @property
    def rungs(self) -> tuple:
        import cacheattn
        return (1, 3, 4) if _takes_rung(cacheattn.onnx_attention) else (1,)

    @property
    def kvlen(self) -> int:
        return self.context + 1

    @property
    def must_move(self) -> dict:
        """Past K and V read once, the new token's K and V read once, present (past and new) written once, Q read
        once, Y written once (float16)."""
        heads_kv = self.batch * self.num_kv_heads
        q = self.batch * self.num_heads * self.head_dim * 2
        return dict(kv=2 * heads_kv * self.context * self.row_bytes, new_kv=2 * heads_kv * self.row_bytes,
                    present=2 * heads_kv * self.kvlen * self.row_bytes, q=q, o=q)

    def onnx_case(self) -> OnnxCase:
        return OnnxCase(batch=self.batch, q_heads=self.num_heads, kv_heads=self.num_kv_heads, q_len=1, kv_len=1,
                        past_len=self.context, head_size=self.head_dim, v_head_size=self.head_dim, three_d=False,
                        dtype="float16", mask="none", mask_shape=(), is_causal=0, nonpad=None, softcap=0.0,
                        scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0, seed=0)

    def call(self, rung: int, threads: int = 128, num_splits: int = 1):
        import cacheattn
        case = self.onnx_case()
        attrs = {k: v for k, v in case.attrs().items() if k != "opset"}
        return cacheattn.onnx_attention(**build_onnx(case), **attrs, opset=case.opset, backend="numba",
                                        threads=threads, **self.rung_keywords(rung, num_splits))


@dataclass(frozen=True)
class FTBenchCase(PlannedCase):
    """One FasterTransformer cross-attention decoder step past the first (`cacheattn.cross_attention`, step 2):
    `batch` rows of one query token over `encoder_length` encoder positions, whose K and V the first step projected
    into the batch-major float16 caches; multi-head (as many kv heads as heads). The step's projections (Q before,
    the output after) are the array module's matrix products, not attention kernels: the floor and the counts are
    the attention's (K and V once, q read once, the context written once).

    Counted at the rungs its call offers (rung 1 where it has no `rung=`)."""
    label: str
    batch: int
    encoder_length: int
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 64

    operator = "FasterTransformer cross_attention"

    @property
    def plan_options(self) -> dict:
        from ..ft import PLAN_OPTIONS
        return PLAN_OPTIONS
    kv_arrays = ("k_src[0]", "v_src[0]")       # the attention kernel's cache sources, (data, ...) each

    def __post_init__(self):
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"num_kv_heads: cross attention is multi-head, expected {self.num_heads}, "
                             f"got {self.num_kv_heads}")

    def with_keys(self, keys: int) -> FTBenchCase:
        """This case over `keys` encoder positions (a counted point)."""
        from dataclasses import replace
        return replace(self, encoder_length=keys, label=f"{self.label} kv{keys}")

    @property
    def rungs(self) -> tuple:
        import cacheattn
        return (1, 3, 4) if _takes_rung(cacheattn.cross_attention) else (1,)

    @property
    def kvlen(self) -> int:
        return self.encoder_length

    @property
    def context(self) -> int:
        """Keys before the last one (the counters' decode convention: the query sees context + 1 keys)."""
        return self.encoder_length - 1

    @property
    def must_move(self) -> dict:
        q = self.batch * self.num_heads * self.head_dim * 2
        return dict(kv=2 * self.batch * self.num_heads * self.encoder_length * self.row_bytes, q=q, o=q)

    def ft_case(self) -> FTCase:
        hidden = self.num_heads * self.head_dim
        return FTCase(lengths=(self.encoder_length,) * self.batch, mem_len=self.encoder_length,
                      head_num=self.num_heads, size_per_head=self.head_dim, d_model=hidden, mem_d_model=hidden,
                      dtype="float16", is_batch_major_cache=True, step=2, finished=None, num_tasks=0,
                      ia3_tasks=None, max_decoder_seq_len=0, context_buf=False, q_scaling=1.0, seed=0)

    def call(self, rung: int, threads: int = 128, num_splits: int = 1):
        import cacheattn
        case = self.ft_case()
        return cacheattn.cross_attention(**build_ft(case), **case.attrs(), backend="numba", threads=threads,
                                         **self.rung_keywords(rung, num_splits))


TRT_DECODE = TrtBenchCase("trtllm generation B64 ctx4096 paged fp16", 64, 4096)
TRT_DECODE_INT8 = TrtBenchCase("trtllm generation B64 ctx4096 paged int8", 64, 4096, kv_cache="int8")
TRT_DECODE_FP8 = TrtBenchCase("trtllm generation B64 ctx4096 paged fp8", 64, 4096, kv_cache="fp8")
TRT_CONTEXT = TrtContextBenchCase("trtllm context B1 4096 tokens fp16", 1, 4096)
# ... and what the lab counts and bounds: the five bench cases of OpenPPL's operator (its headline decode with each
# cache format, B = 1 at 32k, prefill), then the other operators' at the headline shape (TensorRT-LLM's generation
# step with each of its cache formats and its context step of 4096 tokens, ONNX's decode with past,
# FasterTransformer's cross-attention step).
LAB_CASES = (DECODE, DECODE_INT8, DECODE_INT4, LONG_DECODE, PREFILL)
ONNX_DECODE = OnnxBenchCase("onnx decode B64 past4096 fp16", 64, 4096)
FT_CROSS = FTBenchCase("ft cross-attention B64 enc1024 fp16", 64, 1024)
OPERATOR_CASES = (TRT_DECODE, TRT_DECODE_INT8, TRT_DECODE_FP8, TRT_CONTEXT, ONNX_DECODE, FT_CROSS)
ALL_LAB_CASES = LAB_CASES + OPERATOR_CASES
TINY_CASES = (
    BenchCase("tiny decode B2 ctx12 paged int8", 2, 12, 1, num_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
              quant_bit=8),
    BenchCase("tiny prefill B1 5 tokens fp16", 1, 0, 5, num_heads=2, num_kv_heads=1, head_dim=8, page_size=4),
)
