"""Rung 6's prefill kernel (`kernels_numba/_attention_flash.py`) at the kernel level: float16 and bfloat16 (built
from their bits, as the kernel reads them), a paged cache whose pages are shuffled in the pool, a sequence of 70
keys (a partial 64-key tile), causal and not, against the float64 evaluation of OpenPPL's reference; the outputs
poisoned before the kernel runs. Plus the checks the launchers rely on (`why_not`)."""

import math

import ml_dtypes
import numpy as np
import pytest

from kernels_numba._attention_flash import key_tile, make_flash_attention_kernel, rows_per_block, why_not
from kernels_numba._cache import cache_source
from kernels_numba._numerics import rounder
from kernels_numba.ppl_dynamic_multi_head_attention import PPLScoreArgs, make_ppl_score
from reference.ppl_dynamic_multi_head_attention import dynamic_multi_head_attention

from helpers import assert_close
from strategies import deep_only

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def run_flash(dtype, *, seqlens, kvlens, num_heads, num_kv_heads, head_dim, page, is_causal, warps, seed):
    """(kernel output, float64 reference) for a paged cache of `page` tokens a page."""
    rng = np.random.default_rng(seed)
    real = DTYPES[dtype]
    batch = len(seqlens)
    seqstarts = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64)
    kvstarts = np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int64)
    query = rng.standard_normal((seqstarts[-1], num_heads, head_dim)).astype(real)
    key = rng.standard_normal((kvstarts[-1], num_kv_heads, head_dim)).astype(real)
    value = rng.standard_normal((kvstarts[-1], num_kv_heads, head_dim)).astype(real)

    # The pool: each sequence's pages scattered in reverse order, one spare page of poison between them.
    pages = [math.ceil(n / page) for n in kvlens]
    slots = 2 * sum(pages) * page
    pool = {name: np.full((slots, num_kv_heads, head_dim), np.nan, real) for name in ("k", "v")}
    table = np.zeros((batch, max(pages)), np.int64)
    next_page = 2 * sum(pages) - 1
    for b in range(batch):
        for p in range(pages[b]):
            table[b, p] = next_page * page
            next_page -= 2
            first, last = p * page, min((p + 1) * page, kvlens[b])
            rows = slice(kvstarts[b] + first, kvstarts[b] + last)
            pool["k"][table[b, p]:table[b, p] + last - first] = key[rows]
            pool["v"][table[b, p]:table[b, p] + last - first] = value[rows]
    k_src = cache_source(pool["k"].view(np.uint16), None, table, page, "T H D")
    v_src = cache_source(pool["v"].view(np.uint16), None, table, page, "T H D")

    score, key_range = make_ppl_score(rounder(dtype))
    kernel = make_flash_attention_kernel(score, key_range, head_dim=head_dim, group=num_heads // num_kv_heads,
                                         warps=warps, dtype=dtype)
    args = PPLScoreArgs(np.int64(is_causal), np.int64(0), np.int64(0), np.zeros(1, np.float32),
                        np.zeros(1, np.float32), np.int64(0), np.int64(0), seqstarts, kvstarts, np.int64(0))
    out = np.full(query.shape, np.nan, real)                       # poison: an unwritten element fails
    geometry = (np.int64(0), np.int64(num_heads * head_dim), np.int64(head_dim))
    grid = (math.ceil(max(seqlens) / rows_per_block(32 * warps)), num_heads, batch)
    kernel[grid, 32 * warps](
        (query.view(np.uint16).reshape(-1), seqstarts, *geometry), (out.view(np.uint16).reshape(-1), seqstarts,
                                                                    *geometry),
        np.asarray(seqlens, np.int64), np.asarray(kvlens, np.int64), k_src, v_src, args,
        np.float32(1 / math.sqrt(head_dim)))

    as64 = (lambda x: x.astype(np.float64))
    ref = dynamic_multi_head_attention(as64(query), as64(key), as64(value), seqstarts, kvstarts, 0, max(seqlens),
                                       max(kvlens), num_heads=num_heads, head_dim=head_dim, is_causal=is_causal,
                                       num_kv_heads=num_kv_heads)
    return out, ref


def test_flash_prefill_conforms_quick():
    """The quick tier's representative: bfloat16, causal, one warp, 40 keys (a partial 64-key tile) over three
    pages of 16, two query heads on one kv head."""
    out, ref = run_flash("bfloat16", seqlens=(5,), kvlens=(40,), num_heads=2, num_kv_heads=1, head_dim=16,
                         page=16, is_causal=True, warps=1, seed=3)
    assert_close("attn_output", out.astype(np.float64), ref, DTYPES["bfloat16"])


# 18 queries leave most of a block of two warps empty; not causal, the partial tile's keys past 70 are masked by the
# tile's edge test alone (causal masks them too).
@deep_only
@pytest.mark.parametrize("dtype,is_causal,head_dim", [("float16", True, 16), ("bfloat16", False, 32),
                                                      ("float16", False, 32), ("bfloat16", True, 16)])
def test_flash_prefill_conforms(dtype, is_causal, head_dim):
    out, ref = run_flash(dtype, seqlens=(18, 3), kvlens=(70, 40), num_heads=2, num_kv_heads=1, head_dim=head_dim,
                         page=32, is_causal=is_causal, warps=2, seed=sum(map(ord, dtype)) + head_dim + is_causal)
    assert_close("attn_output", out.astype(np.float64), ref, DTYPES[dtype])


@deep_only
def test_flash_prefill_four_warps_share_their_page_lookups():
    """The lab's block of four warps: each warp copies 16 keys a tile, looked up by 16 of its lanes (the other 16
    repeat them) and shuffled to the copying lanes; pages of 8 keys, so every lane's key changes page each tile."""
    out, ref = run_flash("float16", seqlens=(7,), kvlens=(70,), num_heads=2, num_kv_heads=1, head_dim=64, page=8,
                         is_causal=True, warps=4, seed=11)
    assert_close("attn_output", out.astype(np.float64), ref, np.float16)


@deep_only
def test_flash_prefill_rows_across_warps_and_blocks():
    """More rows than a block holds (three blocks of one warp's 16 rows), pages smaller than a thread's copy stride
    (16 rows apart), so a walk crosses several pages."""
    out, ref = run_flash("float16", seqlens=(40,), kvlens=(45,), num_heads=1, num_kv_heads=1, head_dim=16, page=5,
                         is_causal=True, warps=1, seed=7)
    assert_close("attn_output", out.astype(np.float64), ref, np.float16)


def test_why_not_names_the_parameter():
    assert why_not(128, 128) == "" and why_not(64, 128) == "" and why_not(16, 32) == ""
    assert key_tile(128) == 64
    assert why_not(48, 128).startswith("head_dim:") and why_not(256, 128).startswith("head_dim:")
    assert why_not(128, 96).startswith("threads:")
    with pytest.raises(ValueError, match="dtype"):
        make_flash_attention_kernel(None, None, head_dim=16, group=1, warps=1, dtype="float32")


def ppl_case(**kw):
    from strategies import PPLCase
    fields = dict(decoding_batches=0, num_heads=2, num_kv_heads=1, head_dim=16, dtype="float16", quant_bit=0,
                  quant_group=8, scale_dtype="float16", cache_layout=0, cache_mode=1, page_size=16, num_layer=1,
                  layer_idx=0, is_causal=True, is_alibi=False, mask="none", mask_pad=0, seed=5)
    return PPLCase(**{**fields, **kw})


def test_rung_6_serves_openppl_cache_attention(monkeypatch):
    """OpenPPL's multi_head_cache_attention with rung=6 on a paged float16 cache (the current tokens stored, then
    attended): 5 queries after 35 cached tokens, pages of 16, against the conformance kit's float64 evaluation; and
    rung 6's launch, not rung 5's, ran it."""
    import functools

    import cacheattn
    import cacheattn.testing as kit
    from kernels_numba import ppl_dynamic_multi_head_attention as launcher

    ran = []
    flash = launcher._attend_flash
    monkeypatch.setattr(launcher, "_attend_flash", lambda *a, **k: ran.append(1) or flash(*a, **k))
    kit.check_case("multi_head_cache_attention",
                   functools.partial(cacheattn.multi_head_cache_attention, backend="numba", threads=32, rung=6),
                   ppl_case(seqlens=(5,), past=(35,)))
    assert ran


@deep_only
@pytest.mark.parametrize("kw", [dict(seqlens=(18, 3), past=(52, 37), is_alibi=True, page_size=32),
                                dict(seqlens=(20, 2), past=(50, 0), mask="2d", is_causal=False, head_dim=32,
                                     cache_mode=0)])
def test_rung_6_serves_openppl_with_bias(kw):
    """ALiBi, a user mask, the offset cache: every feature of OpenPPL's score compiled into rung 6 by its `score`."""
    import functools

    import cacheattn
    import cacheattn.testing as kit

    kit.check_case("multi_head_cache_attention",
                   functools.partial(cacheattn.multi_head_cache_attention, backend="numba", threads=64, rung=6),
                   ppl_case(**kw))


def test_committed_machine_code_keeps_its_registers():
    """The committed sm_90 SASS of rung 6 at head_dim 128 (docs/kernel-ladder-sass.json): no spills, two blocks an
    SM, and its key loop's trip (a 64-key tile, its 16 copies included) issues about 15 instructions an mma (rung
    5's: about 42)."""
    from cacheattn.lab import sass

    variants = sass.committed()["variants"]
    flash, staged = variants["rung6-float16-prefill"], variants["rung5-float16-prefill"]
    assert flash["kernel"] == "flash_attention_kernel" and flash["spill_bytes"] == 0
    assert flash["occupancy"]["blocks_per_sm"] >= 2
    per_mma = {k: v["key_loop"]["trip"]["total"] / v["key_loop"]["trip"]["HMMA"] for k, v in
               (("flash", flash), ("staged", staged))}
    assert per_mma["flash"] < 16 and per_mma["flash"] * 2.5 < per_mma["staged"], per_mma
