"""Hypothesis strategies that draw valid problems for each operator: the attributes and lengths are drawn,
the tensors come from the case's seed (`cacheattn.examples` builds them).

Sizes are awkward on purpose: sequences of length 1, pasts of 0, head_dim 24, page sizes that do not
divide the lengths, GQA groups of 3, unused page-table entries holding -1. Every keyword narrows the space
to what an implementation supports (the checkers pass their `features=` through them).
"""

from __future__ import annotations

from hypothesis import strategies as st

from cacheattn.examples import FTCase, OnnxCase, PPLCase, StaticCase
from cacheattn.ft import HEAD_SIZES


@st.composite
def ppl_cases(draw, *, max_batch=3, max_seqlen=5, max_past=9, quant_bits=(0, 8, 4), dtypes=("float16", "float32"),
              layouts=(0, 1, 2, 3), modes=(0, 1), masks=("none", "2d", "3d"), alibi=(False, True),
              causal=(False, True), groups=(1, 2, 3), decoding=True) -> PPLCase:
    """dynamic_batching cases (MultiHeadCacheAttention and its two halves)."""
    batch = draw(st.integers(1, max_batch))
    decoding_batches = draw(st.integers(0, batch)) if decoding else 0
    seqlens = tuple(1 if b < decoding_batches else draw(st.integers(1, max_seqlen)) for b in range(batch))
    past = tuple(draw(st.integers(0, max_past)) for _ in range(batch))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 16, 24]))
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
    """Static KeyValueCache cases."""
    batch = draw(st.integers(1, 3))
    seqlen = draw(st.integers(1, 4))
    start_pos = draw(st.integers(0, 5))
    head_dim = draw(st.sampled_from([8, 16, 24]))
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
    """ONNX Attention cases (opset 24; opset 25 when a window is drawn)."""
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
    """One cross-attention step. Head sizes: four draws in five from the first two of `head_sizes` (simulator
    kernels are cheap there), else any; lengths anywhere in [1, mem_len], finished rows and IA3 tasks sometimes.
    cross / context_bufs False: never a cross_attentions output / an old context_buf."""
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
