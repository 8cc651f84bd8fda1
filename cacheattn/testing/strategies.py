"""Hypothesis strategies that draw valid problems for each operator: the attributes and lengths are drawn,
the tensors come from the case's seed (`cacheattn.examples` builds them).

Sizes are awkward on purpose: sequences of length 1, pasts of 0, head_dim 24, page sizes that do not
divide the lengths, GQA groups of 3, unused page-table entries holding -1. Every keyword narrows the space
to what an implementation supports (the checkers pass their `features=` through them).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from cacheattn.examples import FTCase, OnnxCase, PPLCase, StaticCase, TrtCase
from cacheattn.ft import HEAD_SIZES


@st.composite
def ppl_cases(draw, *, max_batch=3, max_seqlen=5, max_past=9, quant_bits=(0, 8, 4), dtypes=("float16", "float32"),
              layouts=(0, 1, 2, 3), modes=(0, 1), masks=("none", "2d", "3d"), alibi=(False, True),
              causal=(False, True), groups=(1, 2, 3), decoding=True) -> PPLCase:
    """Draw `PPLCase`s: dynamic_batching problems (MultiHeadCacheAttention and its two halves).

    Parameters
    ----------
    max_batch : int, default 3
        Sequences per call, 1 to `max_batch`.
    max_seqlen : int, default 5
        Longest current length of a prefill sequence (decode steps have 1).
    max_past : int, default 9
        Longest cached length before the call (0 included).
    quant_bits, dtypes, layouts, modes : tuple
        The `quant_bit`, query dtype, `cache_layout` and `cache_mode` values to draw from.
    masks : tuple of str, default ("none", "2d", "3d")
        `attn_mask` kinds.
    alibi, causal : tuple of bool
        `is_alibi` and `is_causal` values.
    groups : tuple of int, default (1, 2, 3)
        `num_heads // num_kv_heads` (1: no GQA).
    decoding : bool, default True
        Whether some leading sequences are decode steps (`decoding_batches` > 0).

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        Of `PPLCase`; `cacheattn.examples.build_ppl` makes the arguments. Page sizes 1, 3, 4 or 8, head_dim 8, 16
        or 24, one or two layers.

    Examples
    --------
    >>> from hypothesis import given, settings
    >>> from cacheattn.testing.strategies import ppl_cases
    >>> @settings(max_examples=5, database=None)
    ... @given(ppl_cases(quant_bits=(0,), modes=(1,)))
    ... def test(case):
    ...     assert case.quant_bit == 0 and case.cache_mode == 1 and len(case.seqlens) <= 3
    >>> test()
    """
    batch = draw(st.integers(1, max_batch))
    decoding_batches = draw(st.integers(0, batch)) if decoding else 0
    seqlens = tuple(1 if b < decoding_batches else draw(st.integers(1, max_seqlen)) for b in range(batch))
    past = tuple(draw(st.integers(0, max_past)) for _ in range(batch))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 12, 16, 24]))
    quant_bit = draw(st.sampled_from(quant_bits))
    groups_ok = [g for g in (2, 4, 8) if head_dim % g == 0] if quant_bit else [8]
    num_layer = draw(st.integers(1, 2))
    return PPLCase(
        seqlens=seqlens, past=past, decoding_batches=decoding_batches,
        num_heads=num_kv_heads * draw(st.sampled_from(groups)), num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=draw(st.sampled_from(dtypes)), quant_bit=quant_bit, quant_group=draw(st.sampled_from(groups_ok)),
        scale_dtype=draw(st.sampled_from(["float16", "float32"])), cache_layout=draw(st.sampled_from(layouts)),
        cache_mode=draw(st.sampled_from(modes)), page_size=draw(st.sampled_from([1, 3, 4, 8])),
        num_layer=num_layer, layer_idx=draw(st.integers(0, num_layer - 1)), is_causal=draw(st.sampled_from(causal)),
        is_alibi=draw(st.sampled_from(alibi)), mask=draw(st.sampled_from(masks)), mask_pad=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def static_cases(draw, *, quant_bits=(0, 8, 4), dtypes=("float16", "float32"), layouts=(0, 1),
                 repeats=(1, 2, 3)) -> StaticCase:
    """Draw `StaticCase`s: static KeyValueCache problems (B 1 to 3, S 1 to 4, start_pos 0 to 5).

    Parameters
    ----------
    quant_bits, dtypes, layouts : tuple
        The `quant_bit`, dtype and `cache_layout` values to draw from.
    repeats : tuple of int, default (1, 2, 3)
        `num_repeat` values.

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        Of `StaticCase`; `cacheattn.examples.build_static` makes the arguments.
    """
    batch = draw(st.integers(1, 3))
    seqlen = draw(st.integers(1, 4))
    start_pos = draw(st.integers(0, 5))
    head_dim = draw(st.sampled_from([8, 12, 16, 24]))
    quant_bit = draw(st.sampled_from(quant_bits))
    num_layer = draw(st.integers(1, 2))
    return StaticCase(batch=batch, max_batch=batch + draw(st.integers(0, 1)), seqlen=seqlen, start_pos=start_pos,
                      max_seqlen=start_pos + seqlen + draw(st.integers(0, 2)), num_heads=draw(st.integers(1, 3)),
                      head_dim=head_dim, dtype=draw(st.sampled_from(dtypes)), quant_bit=quant_bit,
                      quant_group=draw(st.sampled_from([g for g in (2, 4, 8) if head_dim % g == 0])),
                      num_layer=num_layer, layer_idx=draw(st.integers(0, num_layer - 1)),
                      num_repeat=draw(st.sampled_from(repeats)), cache_layout=draw(st.sampled_from(layouts)),
                      seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def onnx_cases(draw, *, dtypes=("float16", "float32", "float64"), past=True, windows=True, masks=("none", "bool",
               "float"), modes=(0, 1, 2, 3), nonpad=True, causal=(0, 1), groups=(1, 2, 3), three_d=(False, True),
               softcaps=(0.0, 0.0, 1.5, 30.0), scales=(None, None, 0.05, 0.7)) -> OnnxCase:
    """Draw `OnnxCase`s: ONNX Attention problems (opset 24; opset 25 when a window is drawn).

    Parameters
    ----------
    dtypes : tuple of str
        Input dtypes.
    past : bool, default True
        Whether `past_key`/`past_value` may be drawn.
    windows : bool, default True
        Whether opset 25's `left_window_size`/`right_window_size` may be drawn.
    masks : tuple of str
        "none", "bool" and/or "float" `attn_mask`s (any broadcastable rank, last dim possibly short).
    modes : tuple of int
        `qk_matmul_output_mode` values.
    nonpad : bool, default True
        Whether `nonpad_kv_seqlen` may be drawn (only without a past).
    causal : tuple of int
        `is_causal` values.
    groups : tuple of int
        `q_num_heads // kv_num_heads`.
    three_d : tuple of bool
        Whether inputs are 3-D.
    softcaps, scales : tuple
        `softcap` and `scale` values (None: the default scale).

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        Of `OnnxCase`; `cacheattn.examples.build_onnx` makes the inputs.
    """
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    q_len, kv_len = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    past_len = draw(st.integers(1, 4)) if past and draw(st.booleans()) else 0
    total = past_len + kv_len
    q_heads = kv_heads * draw(st.sampled_from(groups))
    lengths = None
    if nonpad and not past_len and draw(st.booleans()):
        lengths = tuple(draw(st.integers(0, kv_len)) for _ in range(batch))
    mask = draw(st.sampled_from(masks))
    shape = ()
    if mask != "none":
        # Right-aligned against (batch, q_heads, q_len, total): each leading axis full or 1, rank 1 to 4,
        # the last dim possibly shorter (padded) but covering the nonpad lengths.
        rank = draw(st.integers(1, 4))
        full = (batch, q_heads, q_len)
        lead = tuple(draw(st.sampled_from([1, n])) for n in full[3 - (rank - 1):]) if rank > 1 else ()
        shortest = max(1, max(lengths) if lengths else 1)
        shape = lead + (draw(st.integers(shortest, total)),)
    windowed = windows and draw(st.booleans())
    return OnnxCase(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, past_len=past_len,
        head_size=draw(st.sampled_from([4, 8, 12])), v_head_size=draw(st.sampled_from([4, 6, 8])),
        three_d=draw(st.sampled_from(three_d)), dtype=draw(st.sampled_from(dtypes)), mask=mask, mask_shape=shape,
        is_causal=int(draw(st.sampled_from(causal))), nonpad=lengths, softcap=draw(st.sampled_from(softcaps)),
        scale=draw(st.sampled_from(scales)),
        left_window_size=draw(st.integers(-1, 3)) if windowed else -1,
        right_window_size=draw(st.integers(-1, 2)) if windowed else -1,
        qk_matmul_output_mode=draw(st.sampled_from(modes)), seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def ft_cases(draw, *, dtypes=("float16", "float32"), layouts=(True, False), steps=(1, 2, 3), head_sizes=HEAD_SIZES,
             max_batch=3, max_mem_len=6, max_heads=3, finished=True, ia3=True, cross=True,
             context_bufs=True):
    """Draw `FTCase`s: one FasterTransformer cross-attention step.

    Head sizes: four draws in five from the first two of `head_sizes` (simulator kernels are cheap there), else
    any; lengths anywhere in `[1, mem_len]`, finished rows and IA3 tasks sometimes.

    Parameters
    ----------
    dtypes : tuple of str
        Input dtypes.
    layouts : tuple of bool
        `is_batch_major_cache` values.
    steps : tuple of int, default (1, 2, 3)
        `step` values.
    head_sizes : tuple of int
        `size_per_head` values, a subset of `cacheattn.ft.HEAD_SIZES`.
    max_batch, max_mem_len, max_heads : int
        Largest B, `mem_max_seq_len` and `head_num`.
    finished, ia3 : bool, default True
        Whether `finished` rows / IA3 tasks may be drawn.
    cross : bool, default True
        False: never a `cross_attentions` output.
    context_bufs : bool, default True
        False: never an old `context_buf`.

    Returns
    -------
    hypothesis.strategies.SearchStrategy
        Of `FTCase`; `cacheattn.examples.build_ft` makes the arguments.
    """
    batch = draw(st.integers(1, max_batch))
    mem_len = draw(st.integers(1, max_mem_len))
    step = draw(st.sampled_from(steps))
    small = draw(st.integers(0, 4)) > 0
    num_tasks = draw(st.integers(1, 3)) if ia3 and draw(st.booleans()) else 0
    tasks = tuple(draw(st.integers(0, num_tasks - 1)) for _ in range(batch)) if num_tasks and draw(st.booleans()) \
        else None
    done = tuple(draw(st.booleans()) for _ in range(batch)) if finished and draw(st.booleans()) else None
    return FTCase(
        lengths=tuple(draw(st.integers(1, mem_len)) for _ in range(batch)), mem_len=mem_len,
        head_num=draw(st.integers(1, max_heads)),
        size_per_head=draw(st.sampled_from(head_sizes[:2] if small else head_sizes)),
        d_model=draw(st.sampled_from([8, 12, 16])), mem_d_model=draw(st.sampled_from([8, 12, 16])),
        dtype=draw(st.sampled_from(dtypes)), is_batch_major_cache=draw(st.sampled_from(layouts)), step=step,
        finished=done, num_tasks=num_tasks, ia3_tasks=tasks,
        max_decoder_seq_len=step + draw(st.integers(0, 2)) if cross and draw(st.booleans()) else 0,
        context_buf=context_bufs and draw(st.booleans()), q_scaling=draw(st.sampled_from([1.0, 1.0, 0.5, 2.0])),
        seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def trt_cases(draw, *, dtypes=("float16", "float32"), paged=(False, True), quant=(0, 64, 128),
              positions=(0, 1, 2, 4, 5, 6), masks=(1, 1, 2, 0, 3, 6), beams=(1, 1, 2), windowed=True, chunked=True,
              generation=True, packed=(True, False), softcap=True, groups=(1, 2, 3), qkv_bias=(False, True),
              rope_scaling=True, relative=("regular", "t5"), fmha_types=(1,), streaming=(False,), cross=(False,),
              fp8_fmha=False, padded_inflight=True, rope_tables=True, logn=True, packed_mask=False) -> TrtCase:
    """A gpt_attention call: a few context requests (some chunked), a few generation sequences (maybe beams),
    awkward sizes (length 1, past 0, tokens_per_block not dividing the lengths, GQA group 3, head size 24).

    streaming / cross: the values these flags may take (one draw picks self attention, StreamingLLM or cross
    attention). A StreamingLLM call has whole contexts, one beam and sink tokens below the window; a
    cross-attention call has encoder K/V (lengths up to the cache capacity), no position embedding, no custom
    mask and no window. fp8_fmha: FP8 context FMHA on some FP8-cache calls. padded_inflight False: padded
    qkv only when every request is in the same phase (the document's in-flight batching needs packed input).
    rope_tables: RoPE calls may carry the host-built rotary_cos_sin (long_rope and yarn, positions 3 and 8, always
    do); logn: self-attention calls may carry logn_scaling; packed_mask: custom masks may come packed too (off by
    default: a test that cuts a call into sub-calls would have to repack it; the kit turns it on)."""
    # One draw picks the kind of call, self attention three times in five when the others are allowed too.
    kinds = ("self",) * 3 * (False in streaming and False in cross) + ("streaming",) * (True in streaming) \
        + ("cross",) * (True in cross)
    kind = draw(st.sampled_from(kinds or ("self",)))
    is_streaming, is_cross = kind == "streaming", kind == "cross"
    beam_width = 1 if is_streaming else draw(st.sampled_from(beams))
    chunked = chunked and not is_streaming
    contexts = tuple((draw(st.integers(0, 4)) if chunked else 0, draw(st.integers(1, 5)))
                     for _ in range(draw(st.integers(0 if generation else 1, 2))))
    generations = ()
    if generation:
        generations = tuple((prompt, prompt + draw(st.integers(0, 3))) for prompt in
                            (draw(st.integers(1, 4)) for _ in range(draw(st.integers(0 if contexts else 1, 2)))))
    lengths = [p + n for p, n in contexts] + [p + 1 for _, p in generations]
    longest = max(lengths)
    capacity = longest + draw(st.integers(0, 2))
    window = capacity + draw(st.integers(0, 2))                   # no window in view
    if windowed and not is_cross and beam_width == 1 and draw(st.booleans()):
        window = draw(st.integers(2, longest + 1))                # a window, the cache cyclic past it
        capacity = max(window, draw(st.integers(window, longest + 1)))
    if is_streaming:
        position = draw(st.sampled_from([p for p in (1, 2, 2, 0) if p in positions]))
    else:
        position = 0 if is_cross else draw(st.sampled_from(positions))
    head_size = draw(st.sampled_from([8, 24]))
    num_kv_heads = draw(st.integers(1, 2))
    rope = position in (1, 2, 3, 8)
    rotary_dim = draw(st.sampled_from([d for d in (2, 6, 8, head_size) if d <= head_size])) if rope else 0
    scale_types = ([0, 1, 2] if rotary_dim > 2 else [0, 1]) if rope_scaling and position in (1, 2) else [0]
    num_layers = draw(st.integers(1, 2))
    quant_mode = draw(st.sampled_from(quant))
    is_packed = draw(st.sampled_from(packed))
    if not padded_inflight and contexts and generations:
        is_packed = True
    encoder = ()
    if is_cross:
        per_sequence = [draw(st.integers(1, capacity)) for _ in range(len(contexts) + len(generations))]
        encoder = tuple(per_sequence[:len(contexts)]) + tuple(n for n in per_sequence[len(contexts):]
                                                              for _ in range(beam_width))
    case = TrtCase(
        contexts=contexts, generations=generations, beam_width=beam_width,
        num_heads=num_kv_heads * draw(st.sampled_from(groups)), num_kv_heads=num_kv_heads, head_size=head_size,
        dtype=draw(st.sampled_from(dtypes)), capacity=capacity, window=window,
        paged=draw(st.sampled_from(paged)), tokens_per_block=draw(st.sampled_from([1, 2, 4])),
        packed=is_packed, quant=quant_mode, position=position,
        rotary_dim=rotary_dim, rotary_scale_type=draw(st.sampled_from(scale_types)),
        rotary_scale=draw(st.sampled_from([1.0, 2.0])),
        mask_type=draw(st.sampled_from([m for m in masks if m != 6] or [1])) if is_cross
        else draw(st.sampled_from(masks)),
        softcap=draw(st.sampled_from([0.0, 0.0, 3.0])) if softcap else 0.0, q_scaling=draw(st.sampled_from([1.0, 0.5])),
        relative=draw(st.sampled_from(relative)), qkv_bias=draw(st.sampled_from(qkv_bias)),
        num_layers=num_layers, layer_idx=draw(st.integers(0, num_layers - 1)), seed=draw(st.integers(0, 2**32 - 1)),
        fp8_context_fmha=fp8_fmha and quant_mode == 128 and draw(st.booleans()), encoder_lengths=encoder,
        context_fmha_type=draw(st.sampled_from(fmha_types)))
    if is_streaming:
        case = replace(case, streamingllm=True, sinks=draw(st.integers(0, min(2, case.window - 1))))
    if rope_tables and position in (1, 2):
        case = replace(case, rope_table=draw(st.booleans()))
    if logn and not is_cross:
        case = replace(case, logn=draw(st.sampled_from([False, False, True])))
    if packed_mask and case.mask_type == 6:
        case = replace(case, packed_mask=draw(st.booleans()))
    return case


def trt_streaming_cases(**kw):
    """StreamingLLM calls: whole contexts (no chunks), sink tokens below the window, RoPE most of the time."""
    return trt_cases(streaming=(True,), **kw)
