"""TensorRT-LLM's context phase on rung 6 (kernels_numba/trtllm_context.py: the FlashAttention-2 kernel reading K and
V from the preprocess's scratch as one page) under the simulator: the conformance kit's checks (float64 evaluation,
outputs poisoned, caches bit for bit, every slot the call must not read NaN) on float16 and bfloat16 context calls
whose keys are all new tokens, and where rung 6 cannot serve (a chunked context, cross attention), the fallback and
its reason. One warp a block: the simulator's cost is blocks x threads."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from test_trtllm_kernels import BASE, kernels, launched

import cacheattn
import cacheattn.testing as kit
from kernels_numba import _launch
from kernels_numba.trtllm_context import context_rung

from strategies import build_trt, deep_only, trt_cases

# Context requests without past (every key a new token, in the scratch), GQA 4/2, one layer.
FLASH = replace(BASE, dtype="bfloat16", contexts=((0, 12),), generations=(), beam_width=1, head_size=16,
                capacity=16, window=16, seed=31)
# 70 keys: a full 64-key tile and a partial one; two requests of different lengths share the launch.
LONG = replace(FLASH, contexts=((0, 70), (0, 9)), capacity=72, window=72)
CONTEXT = {
    "float16, causal, 70 + 9 new tokens": replace(LONG, dtype="float16"),
    "bfloat16, causal, 70 + 9 new tokens": LONG,
    "float16, not causal (padding mask), head_size 32": replace(LONG, dtype="float16", mask_type=0, head_size=32,
                                                                 contexts=((0, 70),), seed=32),
    "bfloat16, not causal, head_size 32, softcap": replace(LONG, mask_type=0, head_size=32, softcap=3.0,
                                                           contexts=((0, 70),), seed=33),
    "bfloat16, sliding window 20 (cyclic cache), ALiBi": replace(LONG, window=20, capacity=20, position=4,
                                                                contexts=((0, 40),), seed=34),
    "float16, packed custom mask, T5 bias": replace(LONG, dtype="float16", mask_type=6, position=6, relative="t5",
                                                    packed_mask=True, contexts=((0, 30),), seed=35),
    "float16, INT8 cache (the scratch is not quantized), paged": replace(LONG, dtype="float16", quant=64,
                                                                         paged=True, contexts=((0, 30),), seed=36),
}


def _on_rung_6(case, **launch):
    names = launched(build_trt(case), threads=32, **launch)
    assert "flash_attention_kernel" in names and "mma_attention_kernel" not in names, names


def test_context_on_rung_6():
    """The quick tier's one: 8 bfloat16 tokens of 2 heads sharing one kv head, causal, by default and asked for."""
    case = replace(FLASH, contexts=((0, 8),), num_heads=2, num_kv_heads=1)
    _on_rung_6(case)
    _on_rung_6(case, rung=6)
    kit.check_case("gpt_attention", kernels(32), case)


@deep_only
@pytest.mark.parametrize("name", list(CONTEXT))
def test_context_on_rung_6_deep(name):
    case = CONTEXT[name]
    _on_rung_6(case, rung=6)
    kit.check_case("gpt_attention", kernels(32, rung=6), case)


@deep_only
@settings(max_examples=4, deadline=None)
@given(trt_cases(dtypes=("float16", "bfloat16")).map(
    lambda case: replace(case, head_size=16, rotary_dim=min(case.rotary_dim, 16))))
def test_drawn_calls_conform(case):
    """The kit's drawn calls (every feature) in float16 and bfloat16 at head size 16, rung 6's smallest, by default:
    their context entries on rung 6 where every key is a new token, else where the call's features put them."""
    kit.check_case("gpt_attention", kernels(32), case)


FALLBACKS = {
    # a chunked context reads its earlier keys from the cache: rung 5 for float16, rung 1 for bfloat16
    "chunked float16": (replace(FLASH, dtype="float16", contexts=((3, 9),), capacity=16), "mma_attention_kernel"),
    "chunked bfloat16": (replace(FLASH, contexts=((3, 9),), capacity=16), "attention_kernel"),
    "cross attention": (replace(FLASH, dtype="float16", contexts=((0, 2),), encoder_lengths=(3,), capacity=4,
                                window=4, num_heads=2, num_kv_heads=2), "mma_attention_kernel"),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallbacks(name):
    """Recorded launches (nothing runs): the context launch is the fallback's kernel; rung=6 asked for raises,
    naming rung and why, before any launch."""
    case, kernel = FALLBACKS[name]
    names = launched(build_trt(case), threads=32)
    assert kernel in names and "flash_attention_kernel" not in names, names
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match="^rung: 6.*(chunked|cross)"):
        cacheattn.gpt_attention(**build_trt(case), backend="numba", threads=32, rung=6)
    assert launches == []


def test_rung_6_refuses_float32():
    for backend in ("reference", "numba"):
        with pytest.raises(ValueError, match="^rung: 6"):
            cacheattn.gpt_attention(**build_trt(replace(FLASH, dtype="float32")), backend=backend, rung=6)


def test_context_rung_reasons():
    """Rung 6 where it serves (its bound against rung 5's where both do), else rung 5 or 1, each saying why."""
    common = dict(head_size=64, threads=128, num_splits=None, fused_generation=False)
    assert context_rung(rung=None, rounds_as="bfloat16", **common)[0] == 6
    rung, reason = context_rung(rung=None, rounds_as="float16", flash_wins=lambda: (False, "≥ 2.0 µs (bound)"),
                                **common)
    assert rung == 5 and "not rung 6: its bound" in reason, reason
    rung, reason = context_rung(rung=None, rounds_as="float16", flash_wins=lambda: (True, "bound"), **common)
    assert rung == 6 and "FlashAttention-2" in reason
    rung, reason = context_rung(rung=None, rounds_as="bfloat16", keys_elsewhere="a chunked context", **common)
    assert rung == 1 and "float16 query" in reason and "chunked" in reason, reason
    rung, reason = context_rung(rung=None, rounds_as="float16", **{**common, "head_size": 256})
    assert rung == 5 and "head_dim" in reason, reason
    assert context_rung(rung=6, rounds_as="float16", **common)[0] == 6
    with pytest.raises(ValueError, match="^rung: 6"):
        context_rung(rung=6, rounds_as="float32", **common)


def test_the_score_compiles_in_only_the_features_a_call_uses():
    """A context call's score is specialised (`score_features`): the window only where a key range is longer than
    it, a custom mask (dense or packed), softcap, ALiBi and a relative bias only where set; the deep tier runs the
    calls of each feature on rung 6 against the float64 evaluation."""
    from types import SimpleNamespace

    from kernels_numba.trtllm_common import SCORE_FEATURES, score_features

    plain = SimpleNamespace(window=4096, mask_cols=0, packed_words=0, softcap=0.0, alibi_on=0, relative=0)
    assert score_features(plain, 4096) == frozenset()
    assert score_features(plain, 4097) == {"window"}
    changes = [(dict(mask_cols=70), "mask"), (dict(packed_words=3), "mask"), (dict(softcap=30.0), "softcap"),
               (dict(alibi_on=1), "alibi"), (dict(relative=2), "relative")]
    for change, feature in changes:
        assert score_features(SimpleNamespace(**{**vars(plain), **change}), 10) == {feature}
    assert score_features(SimpleNamespace(window=1, mask_cols=1, packed_words=0, softcap=1.0, alibi_on=1, relative=1),
                          2) == SCORE_FEATURES
