"""Two OpenPPL sentences that state a default rather than a computation, each checked directly."""

import numpy as np
import pytest

import cacheattn
from cacheattn.examples import PPLCase, StaticCase, build_ppl, build_static, copy_inputs

from helpers import assert_bits_equal

MHA = PPLCase(seqlens=(2, 1), past=(3, 5), decoding_batches=0, num_heads=3, num_kv_heads=3, head_dim=8,
              dtype="float32", quant_bit=0, quant_group=8, scale_dtype="float32", cache_layout=3, cache_mode=1,
              page_size=2, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False, mask="none", mask_pad=0, seed=11)


@pytest.mark.spec("ppl-mhca/kv-heads-default")
def test_num_kv_heads_zero_means_num_heads():
    inputs = build_ppl(MHA)
    default = cacheattn.multi_head_cache_attention(**copy_inputs(inputs), **{**MHA.attrs(), "num_kv_heads": 0})
    explicit = cacheattn.multi_head_cache_attention(**copy_inputs(inputs), **MHA.attrs())
    assert_bits_equal("attn_output", default, explicit)
    assert np.isfinite(default).all()


@pytest.mark.spec("ppl-kvc/quant-skip")
def test_quant_bit_zero_stores_and_returns_values_unchanged_without_scale():
    case = StaticCase(batch=2, max_batch=2, seqlen=3, start_pos=1, max_seqlen=6, num_heads=2, head_dim=4,
                      dtype="float16", quant_bit=0, quant_group=8, num_layer=2, layer_idx=1, num_repeat=1,
                      cache_layout=0, seed=2)
    inputs = build_static(case)
    assert inputs["scale"] is None                                  # no scale tensor at all
    x = copy_inputs(inputs)
    key, value = cacheattn.key_value_cache(**x, num_layer=2, layer_idx=1, quant_bit=0)
    # The current tokens come back bit for bit (no quantization round trip) and sit in the cache as given.
    assert_bits_equal("key[:, start_pos:]", key[:, 1:], inputs["current_key"])
    assert_bits_equal("value[:, start_pos:]", value[:, 1:], inputs["current_value"])
    assert_bits_equal("cached key", x["cache"][:2, 1, 0, 1:4], inputs["current_key"])
    assert_bits_equal("cached past", key[:, :1], inputs["cache"][:2, 1, 0, :1])
