"""The hand-off: the tour's serving loop prefills with one operator, cacheattn.convert moves every live request's
cache (every layer) into the other operator's paged cache, and decoding continues there. The greedy tokens are the
tokens of serving with either operator throughout (float caches), and a quantized destination's agreement is
counted."""

import pytest

from cacheattn import serving
from cacheattn.convert import handoff

PPL, TRT = "multi_head_cache_attention", "gpt_attention"
FLOAT = serving.ServeConfig(quant_bit=0)


@pytest.fixture(scope="module")
def model():
    return serving.TinyModel(serving.ModelConfig())


@pytest.fixture(scope="module")
def throughout(model):
    """Tokens of serving with one operator from the first step to the last, float caches."""
    return {op: serving.serve(model, serving.DEFAULT_REQUESTS, FLOAT, operator=op).generated for op in (PPL, TRT)}


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("first, then", [(PPL, TRT), (TRT, PPL)])
def test_a_float_cache_handed_over_mid_generation_gives_the_same_tokens(model, throughout, first, then, step):
    """Step 1: the first two requests have prefilled, the later arrivals prefill on the new engine; step 3: every
    request but the last has decoded a token or two on the first engine."""
    result = serving.serve(model, serving.DEFAULT_REQUESTS, FLOAT, operator=first,
                           handoff=serving.Handoff(step, then, handoff.move))
    assert throughout[PPL] == throughout[TRT]
    assert result.generated == throughout[first]
    assert result.max_error < 1e-4


def test_without_the_moved_cache_the_tokens_change(model, throughout):
    """The control: a hand-off that gives the requests fresh pages but moves nothing changes the tokens, so the
    agreement above is the converted cache's doing."""
    def nothing_moved(old_path, new_path, states, pool):
        for state in states:
            state.pages = [pool.take() for _ in state.pages]
    result = serving.serve(model, serving.DEFAULT_REQUESTS, FLOAT, operator=PPL,
                           handoff=serving.Handoff(1, TRT, nothing_moved))
    assert result.generated != throughout[PPL]


@pytest.mark.parametrize("first, then", [(TRT, PPL), (PPL, TRT)])
def test_an_int8_openppl_cache_on_one_side_agrees(model, throughout, first, then):
    """OpenPPL's int8 group cache (the tour's default) on one side: TensorRT-LLM's float pool -> int8 requantizes
    every cached token by OpenPPL's rule; int8 -> float32 holds the dequantized values exactly. The agreement with
    float serving is counted (all tokens agree on this model)."""
    int8 = serving.ServeConfig()
    result = serving.serve(model, serving.DEFAULT_REQUESTS, int8, operator=first,
                           handoff=serving.Handoff(1, then, handoff.move))
    ppl_int8 = serving.serve(model, serving.DEFAULT_REQUESTS, int8, operator=PPL).generated
    tokens = [t for g in throughout[TRT] for t in g]
    agree = sum(a == b for g, h in zip(result.generated, throughout[TRT]) for a, b in zip(g, h))
    assert agree == len(tokens), f"{agree} of {len(tokens)} tokens agree with float serving"
    assert result.generated == ppl_int8
