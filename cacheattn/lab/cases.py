"""The bench cases: one OpenPPL paged GQA attention problem each, shared by the GPU bench, the bound model and the
lab's counters.

A case knows its problem (batch, cached and new tokens, heads, head_dim, the cache format), builds its
`multi_head_cache_attention` inputs (`ppl_case`), and says what the operator must do at least: the bytes it must
move (K/V once with their scales, Q read once, O written once) and its FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..examples import PPLCase

CACHE_NAMES = {0: "float16", 8: "int8", 4: "int4"}


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
        """Multiply-adds of S = Q K^T and O = P V, times 2: 4 x head_dim per visible (query, key) pair per head; with
        the causal rule query i of a request sees context + i + 1 keys."""
        pairs = self.new_tokens * self.context + self.new_tokens * (self.new_tokens + 1) // 2
        return 4 * self.head_dim * self.num_heads * self.batch * pairs

    def ppl_case(self) -> PPLCase:
        decode = self.new_tokens == 1
        return PPLCase(seqlens=(self.new_tokens,) * self.batch, past=(self.context,) * self.batch,
                       decoding_batches=self.batch if decode else 0, num_heads=self.num_heads,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype="float16",
                       quant_bit=self.quant_bit, quant_group=self.quant_group, scale_dtype="float16", cache_layout=0,
                       cache_mode=self.cache_mode, page_size=self.page_size, num_layer=1, layer_idx=0,
                       is_causal=True, is_alibi=False, mask="none", mask_pad=0, seed=0)


DECODE = BenchCase("decode B64 ctx4096 paged fp16", 64, 4096, 1)
DECODE_INT8 = BenchCase("decode B64 ctx4096 paged int8", 64, 4096, 1, quant_bit=8)
DECODE_INT4 = BenchCase("decode B64 ctx4096 paged int4", 64, 4096, 1, quant_bit=4)
LONG_DECODE = BenchCase("decode B1 ctx32768 paged fp16", 1, 32768, 1)
PREFILL = BenchCase("prefill B1 4096 tokens fp16", 1, 0, 4096)

# What `python -m cacheattn bench` times on a GPU (the offset cache beside the paged one)...
GPU_CASES = (DECODE, DECODE_INT8, BenchCase("decode B64 ctx4096 offset fp16", 64, 4096, 1, cache_mode=0),
             LONG_DECODE, PREFILL)
# ... and what the lab counts and bounds: the headline decode with each cache format, B = 1 at 32k, prefill.
LAB_CASES = (DECODE, DECODE_INT8, DECODE_INT4, LONG_DECODE, PREFILL)
TINY_CASES = (
    BenchCase("tiny decode B2 ctx12 paged int8", 2, 12, 1, num_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
              quant_bit=8),
    BenchCase("tiny prefill B1 5 tokens fp16", 1, 0, 5, num_heads=2, num_kv_heads=1, head_dim=8, page_size=4),
)
