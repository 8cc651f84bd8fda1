"""The serving loop the tour runs: in-flight batching over a paged cache with a free list of pages."""

import numpy as np

from cacheattn import serving


def test_pages_return_to_the_free_list_and_are_reused():
    model = serving.TinyModel(serving.ModelConfig())
    cfg = serving.ServeConfig()
    taken = []
    original_take = serving.PagePool.take

    def recording_take(pool):
        page = original_take(pool)
        taken.append(page)
        return page

    serving.PagePool.take = recording_take
    try:
        result = serving.serve(model, serving.DEFAULT_REQUESTS, cfg)
    finally:
        serving.PagePool.take = original_take
    # The last arrival starts after an earlier request finished: it reuses a page that request gave back.
    assert len(taken) > len(set(taken)), taken
    assert result.peak_pages < len(taken)
    assert [len(g) for g in result.generated] == [r.max_new_tokens for r in serving.DEFAULT_REQUESTS]
    assert result.max_error < 1e-4


def test_a_request_in_a_busy_batch_gets_the_tokens_it_gets_alone():
    """In-flight batching changes who shares a step, not what any request computes."""
    model = serving.TinyModel(serving.ModelConfig())
    together = serving.serve(model, serving.DEFAULT_REQUESTS).generated
    for request, tokens in zip(serving.DEFAULT_REQUESTS, together):
        alone = serving.serve(model, (serving.Request(request.prompt, request.max_new_tokens, 0),)).generated[0]
        assert alone == tokens


def test_the_model_is_not_degenerate():
    """Random weights still give varied greedy tokens, so comparing token streams means something."""
    model = serving.TinyModel(serving.ModelConfig())
    tokens = np.concatenate(serving.serve(model, serving.DEFAULT_REQUESTS).generated)
    assert len(set(tokens.tolist())) >= 4


def test_openppl_and_tensorrt_llm_serve_the_same_tokens():
    """The same model through OpenPPL's int8 paged cache (RoPE by the model) and TensorRT-LLM's float32 pool (RoPE
    by the operator, block offsets as its KV cache manager writes them): both attend within float32 roundings of
    float64, and the greedy tokens agree."""
    model = serving.TinyModel(serving.ModelConfig())
    ppl = serving.serve(model, serving.DEFAULT_REQUESTS, operator="multi_head_cache_attention")
    trt = serving.serve(model, serving.DEFAULT_REQUESTS, operator="gpt_attention")
    assert trt.max_error < 1e-4 and ppl.max_error < 1e-4
    assert trt.generated == ppl.generated
