"""Rung 5's staged K/V at head_dim 128: the order in which a lane stores its chunk's words (`store_masks`) spreads a
warp's stores over 32 banks in few rounds of selects, and the kernel with that order matches the document for every
cache format, with one row tile per warp (a 16-row prefill) and with the keys split across four warps."""

import functools

import pytest

import cacheattn
import cacheattn.testing as kit
from kernels_numba._attention_mma import stage_shape, store_masks

from strategies import KERNEL, PPLCase

HEAD_DIM = 128
CHUNKS = {0: 8, 8: 16, 4: 32}           # rung 5's chunk of each cache format (`_cache.chunk_elements`): 16 bytes


def stage_geometry(chunk: int):
    """(K row, V row, chunks a row) of the stage in words, as the kernel pads it (module docstring, step 2)."""
    _, words = stage_shape(HEAD_DIM, HEAD_DIM, 4, 1)
    return words + 4, 2 * words + 8, -(-2 * words // chunk)


@pytest.mark.parametrize("quant_bit", CHUNKS)
def test_store_order_spreads_a_warp_over_32_banks(quant_bit):
    """The j-th store of lane l (first staged chunk: row l // chunks, chunk l % chunks) writes word j ^ masks[l] of
    its chunk; at every j the warp's 32 stores fall in 32 different banks, for K (chunk / 2 words a chunk) and V
    (chunk words, two keys a row), in 2 rounds of selects for K and 3 for V."""
    chunk = CHUNKS[quant_bit]
    k_row, v_row, chunks = stage_geometry(chunk)
    for row_words, chunk_words, rounds_at_most in ((k_row, chunk // 2, 2), (v_row, chunk, 3)):
        masks, rounds = store_masks(row_words, chunk_words, chunks)
        assert rounds <= rounds_at_most
        assert masks.min() >= 0 and masks.max() < 1 << rounds
        for j in range(chunk_words):
            banks = {(lane // chunks * row_words + lane % chunks * chunk_words + (j ^ int(masks[lane]))) % 32
                     for lane in range(32)}
            assert len(banks) == 32, (row_words, chunk_words, j, sorted(banks))


# A 16-row prefill (one row tile per warp: each thread stages at most one chunk of K and of V a step) and a short
# one (one row tile, keys split four ways: 64 keys staged a step, several chunks a thread, the warps' merge); pasts
# that end mid-tile and mid-page.
SHAPES = {"16 rows": dict(seqlens=(16, 5), past=(5, 20)), "keys split": dict(seqlens=(2, 3), past=(30, 13))}


# One of the six runs in the suite (int4's stage has the most words a chunk); CACHEATTN_EXAMPLES >= 2 runs them all.
IN_THE_SUITE = {(4, "keys split")}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("quant_bit,seed", [(0, 11), (8, 12), (4, 13)])
def test_rung_5_at_head_dim_128_conforms(quant_bit, seed, shape):
    if KERNEL < 12 and (quant_bit, shape) not in IN_THE_SUITE:
        pytest.skip("the other formats and shapes: CACHEATTN_EXAMPLES=2 or more")
    case = PPLCase(**SHAPES[shape], decoding_batches=0, num_heads=4, num_kv_heads=1, head_dim=HEAD_DIM,
                   dtype="float16", quant_bit=quant_bit, quant_group=8, scale_dtype="float16", cache_layout=0,
                   cache_mode=1, page_size=16, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False,
                   mask="none", mask_pad=0, seed=seed)
    kit.check_case("multi_head_cache_attention",
                   functools.partial(cacheattn.multi_head_cache_attention, backend="numba", threads=128, rung=5),
                   case)
