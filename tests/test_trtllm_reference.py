"""Properties of the TensorRT-LLM gpt_attention reference (trtllm-gpt-attention.md): the operator against a
float64 evaluation, against itself rearranged (paged = contiguous, packed = padded, a batch = its requests,
chunks = the whole context, steps = one pass), and against explicit computations of each feature."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
from reference import packed_mask, rope
from reference import trtllm_gpt_attention as ref
from reference.softmax import masked_softmax

from helpers import assert_bits_equal, assert_close, assert_same_values
from strategies import REFERENCE, TrtCase, build_trt, float64_trt, trt_cases

FEW = max(REFERENCE // 6, 5)
SOME = max(REFERENCE // 3, 8)

SMALL = TrtCase(contexts=((0, 5),), generations=(), beam_width=1, num_heads=6, num_kv_heads=2, head_size=24,
                dtype="float32", capacity=12, window=12, seed=11)


def run(args):
    """gpt_attention on copies of the in-out tensors: (output, cache after the call)."""
    args = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    output, _ = cacheattn.gpt_attention(**args)
    return output, cache_of(args)


def cache_of(args):
    return args["kv_cache_pool"] if args.get("kv_cache_pool") is not None else args["past_key_value"]


def stored_slot(case: TrtCase, positions):
    bubble = ref.paged_bubble(case.sinks, case.tokens_per_block) if case.paged else 0
    return ref.cyclic_slot(np.asarray(positions), case.window, case.sinks, bubble)


def written(case: TrtCase, args) -> np.ndarray:
    """bool mask over the cache (contiguous or pool): the elements this call stores."""
    cache = cache_of(args)
    mask = np.zeros(cache.shape, bool)
    blocks = mask.reshape(-1, *mask.shape[3:]) if case.paged else None           # (blocks, Hkv, tpb, Dh) view
    for e, (p, n) in enumerate(zip(case.past, case.new)):
        slots = stored_slot(case, np.arange(p, p + n))
        for kv in (0, 1):
            if case.paged:
                table = args["kv_cache_block_offsets"][0, e, kv]
                blocks[table[slots // case.tokens_per_block] + 2 * case.layer_idx, :, slots % case.tokens_per_block] \
                    = True
            else:
                mask[e, kv, :, slots] = True
    return mask


def gather_paged(case: TrtCase, args, pool) -> np.ndarray:
    """The pool's contents as a contiguous cache (E, 2, Hkv, slots, Dh), row e through its block table read
    the KV cache manager's way (offset = block * num_layers * 2 + kv, this layer's slab of that block);
    slot c sits at paged slot c + bubble past the sinks."""
    layers = pool.shape[1]
    contiguous_slots = np.arange(case.capacity)
    paged_slots = np.where(contiguous_slots < case.sinks, contiguous_slots,
                           contiguous_slots + ref.paged_bubble(case.sinks, case.tokens_per_block))
    out = np.empty((case.entries, 2, case.num_kv_heads, case.capacity, case.head_size), pool.dtype)
    for e in range(case.entries):
        for kv in (0, 1):
            offsets = args["kv_cache_block_offsets"][0, e, kv][paged_slots // case.tokens_per_block]
            assert (offsets % (2 * layers) == kv).all()
            out[e, kv] = pool[offsets // (2 * layers), case.layer_idx, kv, :,
                              paged_slots % case.tokens_per_block].transpose(1, 0, 2)
    return out


def as_contiguous(case: TrtCase, args) -> dict:
    """The same call on a contiguous cache holding what the paged one holds."""
    contiguous = dict(args, paged_kv_cache=False, kv_cache_pool=None, kv_cache_block_offsets=None,
                      past_key_value=gather_paged(case, args, args["kv_cache_pool"]))
    return contiguous


# ---- the reference against a float64 evaluation; untouched slots stay bit-identical -----------------------------

@settings(max_examples=REFERENCE)
@given(trt_cases())
def test_reference_matches_float64_evaluation(case):
    args = build_trt(case)
    before = cache_of(args).copy()
    output, cache = run(args)
    want, _ = float64_trt(args)
    # q and k are rounded to the input dtype after the bias and RoPE (the GPU preprocessing writes them back),
    # which the float64 evaluation does not do; with q_scaling 0.5 the scores reach about +-15, and float16's
    # 2^-11 of that moves the probabilities by up to ~1.5%: twice the plain float16 tolerance.
    assert_close("output", output, want, case.dtype, scale=2 if case.dtype == "float16" else 1)
    untouched = ~written(case, args)
    if untouched.any():
        assert_bits_equal("untouched cache", cache[untouched], before[untouched])


# ---- paged = contiguous; packed = padded ---------------------------------------------------------------------------

@pytest.mark.spec("trtllm/paged-blocks")
@settings(max_examples=SOME)
@given(trt_cases(paged=(True,)), st.integers(0, 3))
def test_paged_cache_equals_contiguous(case, sinks):
    if case.window > sinks + 1 and case.capacity >= case.window and sinks:
        case = replace(case, streamingllm=True, sinks=sinks, contexts=tuple((0, n) for _, n in case.contexts))
    paged = build_trt(case)
    contiguous = as_contiguous(case, paged)
    out_paged, pool = run(paged)
    out_contiguous, cache = run(contiguous)
    assert_same_values("output", out_paged, out_contiguous)
    assert_bits_equal("cache", gather_paged(case, paged, pool), cache)


def to_padded(case: TrtCase, args) -> dict:
    starts = np.concatenate([[0], np.cumsum(case.new)])
    width = max(case.new)
    qkv = np.full((case.entries, width, args["qkv"].shape[1]), np.nan, args["qkv"].dtype)   # padding never read
    mask = None if args.get("attention_mask") is None else np.zeros((case.entries, width,
                                                                      args["attention_mask"].shape[1]), bool)
    for e in range(case.entries):
        qkv[e, :case.new[e]] = args["qkv"][starts[e]:starts[e + 1]]
        if mask is not None:
            mask[e, :case.new[e]] = args["attention_mask"][starts[e]:starts[e + 1]]
    return dict(args, qkv=qkv, attention_mask=mask, remove_input_padding=False)


@pytest.mark.spec("trtllm/padded-packed", "trtllm/packed-lengths", "trtllm/padded-qkv-shape", "trtllm/packed-qkv-shape")
@settings(max_examples=SOME)
@given(trt_cases(packed=(True,)))
def test_packed_equals_padded(case):
    packed = build_trt(case)
    out_packed, cache_packed = run(packed)
    out_padded, cache_padded = run(to_padded(case, packed))
    starts = np.concatenate([[0], np.cumsum(case.new)])
    for e in range(case.entries):
        assert_same_values(f"entry {e}", out_padded[e, :case.new[e]], out_packed[starts[e]:starts[e + 1]])
        assert (out_padded[e, case.new[e]:] == 0).all()
    assert_bits_equal("cache", cache_padded, cache_packed)


# ---- in-flight batching: a mixed batch = each request alone --------------------------------------------------------

def request_groups(case: TrtCase):
    """Entries of each request: one per context request, beam_width per generation sequence."""
    groups = [[e] for e in range(len(case.contexts))]
    first = len(case.contexts)
    groups += [list(range(first + g * case.beam_width, first + (g + 1) * case.beam_width))
               for g in range(len(case.generations))]
    return groups


def alone(case: TrtCase, args, entries, gen_index):
    """The call restricted to one request's entries (their cache rows, tokens, indirection row)."""
    starts = np.concatenate([[0], np.cumsum(case.new)])
    rows = np.concatenate([np.arange(starts[e], starts[e + 1]) for e in entries])
    sub = dict(args)
    for name in ("sequence_length", "host_past_key_value_lengths", "context_lengths", "host_request_types"):
        sub[name] = args[name][entries]
    sub["qkv"] = args["qkv"][rows]
    sub["past_key_value"] = args["past_key_value"][entries].copy()
    if gen_index is not None:
        sub["cache_indirection"] = args["cache_indirection"][gen_index:gen_index + 1]
    if args.get("attention_mask") is not None:
        sub["attention_mask"] = args["attention_mask"][rows]
    if args.get("attention_packed_mask") is not None:         # the same mask, packed for these entries alone
        sub["attention_packed_mask"] = packed_mask.pack_attention_mask(
            sub["attention_mask"], np.asarray(case.new)[entries], sub["sequence_length"])
    return sub, rows


@pytest.mark.spec("trtllm/inflight-order", "trtllm/beam-context", "trtllm/generation-beam-tokens",
                  "trtllm/packed-lengths")
@settings(max_examples=SOME)
@given(trt_cases(paged=(False,), packed=(True,)))
def test_mixed_batch_equals_each_request_alone(case):
    args = build_trt(case)
    output, cache = run(args)
    for r, entries in enumerate(request_groups(case)):
        gen_index = r - len(case.contexts) if r >= len(case.contexts) else None
        sub, rows = alone(case, args, entries, gen_index)
        out_alone, cache_alone = run(sub)
        assert_same_values(f"request {r} output", output[rows], out_alone)
        assert_bits_equal(f"request {r} cache", cache[entries], cache_alone)


# ---- chunked context = whole context; generation steps = one context pass ------------------------------------------

def single_sequence(total, *, window, capacity, dtype="float32", seed=0, **features):
    """A case for one sequence of `total` tokens seen whole (one context request)."""
    return TrtCase(contexts=((0, total),), generations=(), beam_width=1, num_heads=6, num_kv_heads=2, head_size=8,
                   dtype=dtype, capacity=capacity, window=window, seed=seed, **features)


def step_args(whole_args, case: TrtCase, past, new, *, generation, cache):
    """Tokens [past, past + new) of the whole sequence's call, as one request of its own on `cache`."""
    lengths = np.asarray([past + new], np.int32)
    args = dict(whole_args, qkv=whole_args["qkv"][past:past + new], sequence_length=lengths,
                host_past_key_value_lengths=np.asarray([past], np.int32),
                context_lengths=np.asarray([1 if generation else new], np.int32),
                host_request_types=np.asarray([int(generation)], np.int32))
    if case.paged:
        args["kv_cache_pool"] = cache
    else:
        args["past_key_value"] = cache
    if whole_args.get("attention_mask") is not None:
        args["attention_mask"] = whole_args["attention_mask"][past:past + new]
    return args


def features(draw):
    position = draw(st.sampled_from([0, 1, 2, 4, 6]))
    out = dict(position=position, paged=draw(st.booleans()), tokens_per_block=draw(st.sampled_from([1, 2, 4])),
               softcap=draw(st.sampled_from([0.0, 2.5])), qkv_bias=draw(st.booleans()),
               mask_type=draw(st.sampled_from([1, 2])))
    if position in (1, 2):
        out.update(rotary_dim=draw(st.sampled_from([2, 8])), rotary_scale_type=draw(st.sampled_from([0, 1])),
                   rotary_scale=2.0)
    if position == 6:
        out["relative"] = draw(st.sampled_from(["regular", "t5"]))
    return out


@pytest.mark.spec("trtllm/chunked-context")
@settings(max_examples=SOME)
@given(st.data())
def test_chunked_context_equals_whole_context(data):
    total = data.draw(st.integers(2, 9))
    window = data.draw(st.sampled_from([total + 2, max(2, total - 2)]))
    case = single_sequence(total, window=window, capacity=total, seed=data.draw(st.integers(0, 2**32 - 1)),
                           **features(data.draw))
    whole = build_trt(case)
    want, _ = run(whole)
    cache, past, got = cache_of(whole).copy(), 0, []
    while past < total:
        chunk = data.draw(st.integers(1, total - past))
        out, cache = run(step_args(whole, case, past, chunk, generation=False, cache=cache))
        got.append(out)
        past += chunk
    assert_close("chunks", np.concatenate(got), want.astype(np.float64), case.dtype)


@pytest.mark.spec("trtllm/cyclic-cache", "trtllm/cyclic-overwrite", "trtllm/generation-mmha")
@settings(max_examples=SOME)
@given(st.data())
def test_generation_after_context_equals_one_context_pass(data):
    """Context of L0 tokens, then one generation step per token, on a cache that is cyclic when the window is
    shorter than the sequence: each step's output = that row of one context pass with the window mask."""
    total = data.draw(st.integers(2, 10))
    window = data.draw(st.sampled_from([total + 1, data.draw(st.integers(2, total))]))
    case = single_sequence(total, window=window, capacity=min(window, total), seed=data.draw(st.integers(0, 2**32 - 1)),
                           **features(data.draw))
    whole = build_trt(case)
    if case.capacity < total:                  # the one-pass evaluation needs room for every token
        roomy = replace(case, capacity=total)
        whole_roomy = dict(build_trt(roomy), qkv=whole["qkv"], qkv_bias=whole.get("qkv_bias"),
                           relative_attention_bias=whole.get("relative_attention_bias"),
                           max_distance=whole.get("max_distance", 0))
        want, _ = run(whole_roomy)
    else:
        want, _ = run(whole)
    prompt = data.draw(st.integers(1, total))
    out, cache = run(step_args(whole, case, 0, prompt, generation=False, cache=cache_of(whole).copy()))
    got = [out]
    for past in range(prompt, total):
        out, cache = run(step_args(dict(whole, context_lengths=np.asarray([prompt], np.int32)), case, past, 1,
                                   generation=True, cache=cache))
        got.append(out)
    assert_close("steps", np.concatenate(got), want.astype(np.float64), case.dtype)


# ---- windows -------------------------------------------------------------------------------------------------------

@pytest.mark.spec("trtllm/window-per-layer", "trtllm/window-repeat")
def test_a_shorter_window_list_repeats_over_the_layers():
    case = replace(SMALL, contexts=((0, 7),), capacity=7, window=3, num_layers=3, layer_idx=2)
    args = build_trt(case)
    per_layer, _ = run(args)
    repeated, _ = run(dict(args, host_max_attention_window_sizes=np.asarray([3], np.int32)))
    other, _ = run(dict(args, host_max_attention_window_sizes=np.asarray([3, 7], np.int32)))   # layer 2 -> 3
    assert_bits_equal("[W] repeated", repeated, per_layer)
    assert_bits_equal("[W, W'] repeated", other, per_layer)


@settings(max_examples=FEW)
@given(trt_cases(windowed=False))
def test_window_at_least_the_length_is_no_window(case):
    args = build_trt(case)
    longest = max(case.lengths)
    windows = np.full_like(args["host_max_attention_window_sizes"], longest)
    out_window, cache_window = run(dict(args, host_max_attention_window_sizes=windows))
    out_none, cache_none = run(args)
    assert_bits_equal("output", out_window, out_none)
    assert_bits_equal("cache", cache_window, cache_none)


@pytest.mark.spec("trtllm/sliding-window-context")
@settings(max_examples=FEW)
@given(st.integers(1, 6), st.sampled_from([1, 2]), st.integers(0, 2**32 - 1))
def test_sliding_window_is_the_explicit_window_mask(window, mask_type, seed):
    """Query i sees keys (i - W, i]: the same as a custom mask saying so, without a window."""
    case = replace(SMALL, contexts=((0, 7),), capacity=7, window=window, mask_type=mask_type, seed=seed)
    args = build_trt(case)
    i, j = np.arange(7)[:, None], np.arange(7)[None, :]
    got, _ = run(args)
    want, _ = run(dict(args, mask_type=6, attention_mask=(j <= i) & (j > i - window),
                       host_max_attention_window_sizes=np.asarray([7], np.int32)))
    assert_bits_equal("window", got, want)


# ---- beam search ---------------------------------------------------------------------------------------------------

@pytest.mark.spec("trtllm/cache-indirection", "trtllm/generation-beam-tokens")
@settings(max_examples=SOME)
@given(trt_cases(beams=(2, 3), paged=(False,), packed=(True,), generation=True, chunked=False), st.booleans())
def test_beams_read_the_rows_the_indirection_names(case, identity):
    """Each beam = a beam-less generation entry over an explicit row: beam 0's row for the prompt, then row
    cache_indirection[bi, w, t] token by token (identity: its own row)."""
    if not case.generations:
        return
    args = build_trt(case)
    if identity:
        args["cache_indirection"] = np.broadcast_to(np.arange(case.beam_width)[None, :, None],
                                                    args["cache_indirection"].shape).astype(np.int32).copy()
    output, cache = run(args)
    C, W = len(case.contexts), case.beam_width
    starts = np.concatenate([[0], np.cumsum(case.new)])
    for bi, (prompt, past) in enumerate(case.generations):
        for w in range(W):
            e = C + bi * W + w
            t = np.arange(past)
            source = np.where(t < prompt, C + bi * W, C + bi * W + args["cache_indirection"][bi, w, t])
            row = args["past_key_value"][e:e + 1].copy()
            row[0][:, :, t] = args["past_key_value"][source, :, :, t].transpose(1, 2, 0, 3)
            single = dict(args, qkv=args["qkv"][starts[e]:starts[e + 1]], past_key_value=row,
                          cache_indirection=np.zeros((1, 1, case.capacity), np.int32),
                          **{name: args[name][e:e + 1] for name in ("sequence_length", "host_past_key_value_lengths",
                                                                     "context_lengths", "host_request_types")})
            if args.get("attention_mask") is not None:
                single["attention_mask"] = args["attention_mask"][starts[e]:starts[e + 1]]
            out, row_after = run(single)
            assert_same_values(f"beam {w} of sequence {bi}", output[starts[e]:starts[e + 1]], out)
            assert_bits_equal(f"beam {w} new token", cache[e][:, :, past], row_after[0][:, :, past])


# ---- StreamingLLM --------------------------------------------------------------------------------------------------

@pytest.mark.spec("trtllm/sink-tokens", "trtllm/streaming-positions", "trtllm/cyclic-cache")
@settings(max_examples=SOME)
@given(st.integers(4, 9), st.integers(1, 3), st.integers(0, 6), st.booleans(), st.sampled_from([1, 2]),
       st.integers(0, 2**32 - 1))
def test_streamingllm_is_sinks_plus_window_at_cache_positions(window, sinks, extra, paged, position, seed):
    """Context of `window` tokens (dense), then generation steps past the window. Explicitly: each step's query
    sees the sink tokens and the last window - sinks tokens, K rotated at its index in the cache, the new token
    and the query at min(past, window); the cache holds K without RoPE."""
    sinks = min(sinks, window - 2)
    total = window + extra
    case = TrtCase(contexts=((0, total),), generations=(), beam_width=1, num_heads=2, num_kv_heads=1, head_size=8,
                   dtype="float32", capacity=window, window=window, sinks=sinks, streamingllm=True, paged=paged,
                   tokens_per_block=2, position=position, rotary_dim=8, seed=seed)
    whole = build_trt(case)
    x = whole["qkv"].astype(np.float64)
    q_all, k_all, v_all = x[:, :16].reshape(-1, 2, 8), x[:, 16:24].reshape(-1, 1, 8), x[:, 24:].reshape(-1, 1, 8)
    style = rope.GPTJ if position == 1 else rope.GPT_NEOX
    freq = rope.inv_freq(8, 10000.0, np.float64)
    prompt = min(window, total)
    out, cache = run(step_args(whole, case, 0, prompt, generation=False, cache=cache_of(whole).copy()))
    for past in range(prompt, total):
        out, cache = run(step_args(dict(whole, context_lengths=np.asarray([prompt], np.int32)), case, past, 1,
                                   generation=True, cache=cache))
        seen = np.array([t for t in range(past + 1) if t < sinks or t > past - (window - sinks)])
        cache_index = ref.cyclic_slot(seen, window, sinks)
        at = np.where(seen == past, min(past, window), cache_index).astype(np.float64)
        k = rope.rotate(k_all[seen], at, freq, style)
        q = rope.rotate(q_all[past:past + 1], np.array([min(past, window)], np.float64), freq, style)
        scores = np.einsum("ihd,jhd->hij", q, np.repeat(k, 2, axis=1)) / np.sqrt(8)
        want = np.einsum("hij,jhd->ihd", masked_softmax(scores), np.repeat(v_all[seen], 2, axis=1)).reshape(1, 16)
        assert_close(f"step {past}", out, want, "float32")
    stored = gather_paged(case, whole, cache) if paged else cache
    for t in range(max(0, total - (window - sinks)), total):
        assert_bits_equal(f"K of token {t} (no RoPE)", stored[0, 0, :, ref.cyclic_slot(t, window, sinks)],
                          whole["qkv"][t, 16:24].reshape(1, 8))


# ---- RoPE ----------------------------------------------------------------------------------------------------------

@pytest.mark.spec("trtllm/rope")
@settings(max_examples=SOME)
@given(st.sampled_from([2, 4, 8, 24]), st.integers(0, 2**32 - 1))
def test_gptj_and_gpt_neox_are_one_rotation_under_the_interleave(rot_dim, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, 3, 24))
    positions = rng.integers(0, 100, 5).astype(np.float64)
    freq = rope.inv_freq(rot_dim, 10000.0, np.float64)
    # GPT-J's pair (2i, 2i+1) is GPT-NeoX's pair (i, i + rot_dim/2).
    interleave = np.concatenate([np.arange(0, rot_dim, 2), np.arange(1, rot_dim, 2), np.arange(rot_dim, 24)])
    gptj = rope.rotate(x, positions, freq, rope.GPTJ)
    neox = rope.rotate(x[..., interleave], positions, freq, rope.GPT_NEOX)
    np.testing.assert_allclose(gptj[..., interleave], neox, rtol=0, atol=1e-12)
    assert np.array_equal(gptj[..., rot_dim:], x[..., rot_dim:])              # dims past rotary_embedding_dim


@pytest.mark.spec("trtllm/rope")
@settings(max_examples=SOME)
@given(st.sampled_from([rope.GPTJ, rope.GPT_NEOX]), st.integers(0, 50), st.integers(0, 50), st.integers(-20, 20),
       st.integers(0, 2**32 - 1))
def test_rope_preserves_norms_and_qk_depends_on_the_distance(style, m, n, shift, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, 1, 8))
    freq = rope.inv_freq(8, 10000.0, np.float64)

    def at(x, p):
        return rope.rotate(x, np.array([p], np.float64), freq, style)

    np.testing.assert_allclose(np.linalg.norm(at(q, m)), np.linalg.norm(q), rtol=1e-12)
    shifted = max(0, shift + min(m, n)) - min(m, n)              # keep both positions >= 0
    np.testing.assert_allclose((at(q, m) * at(k, n)).sum(), (at(q, m + shifted) * at(k, n + shifted)).sum(),
                               rtol=1e-9, atol=1e-9)


def test_rope_scalings_are_their_frequencies():
    """Linear scaling = frequencies / scale; dynamic NTK = the raised base past max_positions, none before;
    a given rotary_inv_freq is used as it is."""
    base = build_trt(replace(SMALL, position=2, rotary_dim=8))
    freq = rope.inv_freq(8, 10000.0)
    linear, _ = run(dict(base, rotary_embedding_scale_type=1, rotary_embedding_scale=4.0))
    given_freq, _ = run(dict(base, rotary_inv_freq=freq / np.float32(4)))
    assert_close("linear", linear, given_freq.astype(np.float64), "float32")
    short, _ = run(dict(base, rotary_embedding_scale_type=2, rotary_embedding_scale=3.0,
                        rotary_embedding_max_positions=5))
    plain, _ = run(base)
    assert_bits_equal("dynamic within max_positions", short, plain)
    long_, _ = run(dict(base, rotary_embedding_scale_type=2, rotary_embedding_scale=3.0,
                        rotary_embedding_max_positions=4))
    ntk = rope.inv_freq(8, rope.dynamic_ntk_base(10000.0, 8, 3.0, 5, 4))
    want, _ = run(dict(base, rotary_inv_freq=ntk))
    assert_bits_equal("dynamic past max_positions", long_, want)
    assert rope.dynamic_ntk_base(10000.0, 8, 3.0, 5, 4) == pytest.approx(10000.0 * (3 * 5 / 4 - 2) ** (8 / 6))


def test_llama3_frequencies_keep_high_and_slow_low_frequencies():
    freq = rope.inv_freq(128, 500000.0, np.float64)
    llama3 = rope.llama3_inv_freq(128, 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192)
    wavelen = 2 * np.pi / freq
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    np.testing.assert_allclose(llama3[high], freq[high].astype(np.float32))
    np.testing.assert_allclose(llama3[low], (freq[low] / 8).astype(np.float32))
    medium = ~high & ~low
    assert medium.any() and ((llama3[medium] < freq[medium]) & (llama3[medium] > freq[medium] / 8)).all()


# ---- ALiBi, relative attention bias, T5 buckets --------------------------------------------------------------------

@pytest.mark.spec("trtllm/alibi", "trtllm/rab", "trtllm/rab-modes")
@settings(max_examples=FEW)
@given(trt_cases(positions=(4, 5), dtypes=("float32",), quant=(0,)))
def test_alibi_is_the_explicit_bias_slope_times_distance(case):
    args = build_trt(case)
    longest = max(case.lengths)
    i, j = np.arange(longest)[:, None], np.arange(longest)[None, :]
    table = (args["alibi_slopes"][:, None, None].astype(np.float64) * (j - i)).astype(np.float32)   # (H, L, L)
    explicit = dict(args, alibi_slopes=None, position_embedding_type=6, relative_attention_bias=table, max_distance=0)
    got, _ = run(args)
    want, _ = run(explicit)
    assert_close("alibi", got, want.astype(np.float64), "float32")


@pytest.mark.spec("trtllm/rab-implicit")
def test_t5_buckets_on_hand_checked_values():
    # num_buckets 32, max_distance 128 (T5's defaults); decoder (causal) side: rp = max(i - j, 0).
    rp = np.array([0, 1, 15, 16, 32, 64, 127, 128, 500])
    # 16 + int(log(rp / 16) / log(8) * 16): rp 32 -> 16 + int(5.33) = 21, 64 -> 26, 127 -> 31, 128 -> min(32, 31).
    assert ref.t5_bucket(-rp, 32, 128, False).tolist() == [0, 1, 15, 16, 21, 26, 31, 31, 31]
    assert ref.t5_bucket(rp, 32, 128, False).tolist() == [0] * 9           # keys ahead: bucket 0
    # Bidirectional: 16 buckets a side, max_exact 8; keys ahead add 16.
    assert ref.t5_bucket(np.array([3, -3, 16, -16, 0]), 32, 128, True).tolist() == [19, 3, 26, 10, 0]


@pytest.mark.spec("trtllm/rab-implicit", "trtllm/rab-modes")
def test_relative_bias_t5_mode_uses_the_bucket_table():
    args = build_trt(replace(SMALL, position=6, relative="t5"))
    table = args["relative_attention_bias"]                     # (H, 8), max_distance 12
    i, j = np.arange(5)[:, None], np.arange(5)[None, :]
    regular = table[:, ref.t5_bucket(j - i, 8, 12, False)]      # (H, 5, 5)
    got, _ = run(args)
    want, _ = run(dict(args, relative_attention_bias=regular, max_distance=0))
    assert_bits_equal("t5 = its table expanded", got, want)


# ---- an explicit float64 attention for the basic features ----------------------------------------------------------

@pytest.mark.spec("trtllm/mha-mqa-gqa", "trtllm/qkv-packing", "trtllm/norm-factor", "trtllm/contiguous-shape")
@settings(max_examples=SOME)
@given(st.sampled_from([0.0, 1.5]), st.sampled_from([1.0, 0.7]), st.booleans(), st.sampled_from([0, 1, 3]),
       st.integers(0, 2**32 - 1))
def test_one_context_request_explicitly(softcap, q_scaling, bias, mask_type, seed):
    """QKV split with GQA group 3, qkv_bias, norm_factor = 1/(q_scaling sqrt(Dh)) on QK^T only, softcap, causal
    (bottom-right) or not, written out in float64."""
    case = replace(SMALL, dtype="float64", softcap=softcap, q_scaling=q_scaling, qkv_bias=bias, mask_type=mask_type,
                   seed=seed)
    args = build_trt(case)
    x = args["qkv"] + (args["qkv_bias"] if bias else 0)
    q, k, v = x[:, :144].reshape(5, 6, 24), x[:, 144:192].reshape(5, 2, 24), x[:, 192:].reshape(5, 2, 24)
    k, v = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, k) / (q_scaling * np.sqrt(24))
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    if mask_type == 1:
        scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    want = np.einsum("hij,jhd->ihd", masked_softmax(scores), v).reshape(5, 144)
    got, cache = run(args)
    assert_close("output", got, want, "float64")
    assert_bits_equal("K stored", cache[0, 0, :, :5], x[:, 144:192].reshape(5, 2, 24).transpose(1, 0, 2))


def repeat_kv_heads(case: TrtCase, args, group: int) -> dict:
    """The same call as MHA: every K/V head repeated `group` times in qkv, qkv_bias, cross_kv and the cache."""
    H, Hkv, Dh = case.num_heads, case.num_kv_heads, case.head_size

    def heads(x, axis):
        return None if x is None else np.repeat(x, group, axis=axis)

    def packed(x, parts):                                    # [Q? | K | V] along the last axis -> K, V repeated
        q = x[..., :(H * Dh if parts == 3 else 0)]
        kv = x[..., q.shape[-1]:].reshape(*x.shape[:-1], 2, Hkv, Dh)
        return np.concatenate([q, heads(kv, -2).reshape(*x.shape[:-1], 2 * H * Dh)], axis=-1)

    mha = dict(args, num_kv_heads=H, qkv=packed(args["qkv"], 3))
    if args.get("qkv_bias") is not None:
        mha["qkv_bias"] = packed(args["qkv_bias"], 3)
    if args.get("cross_kv") is not None:
        mha["cross_kv"] = packed(args["cross_kv"], 2)
    if args.get("kv_cache_pool") is not None:
        mha["kv_cache_pool"] = heads(args["kv_cache_pool"], 3)            # (blocks, layers, 2, Hkv, tpb, Dh)
    else:
        mha["past_key_value"] = heads(args["past_key_value"], 2)          # (rows, 2, Hkv, slots, Dh)
    return mha


@pytest.mark.spec("trtllm/mha-mqa-gqa")
@settings(max_examples=SOME)
@given(trt_cases(groups=(2, 3), streaming=(False, True), cross=(False, True), fp8_fmha=True))
def test_gqa_equals_mha_with_repeated_kv_heads(case):
    """Query head h reads kv head h // (H / Hkv): GQA computes what MHA computes on K/V heads repeated over each
    group, and stores the same tokens (the MHA cache holds each kv head `group` times)."""
    group = case.num_heads // case.num_kv_heads
    args = build_trt(case)
    gqa_out, gqa_cache = run(args)
    mha_out, mha_cache = run(repeat_kv_heads(case, args, group))
    assert_same_values("output", gqa_out, mha_out)
    assert_bits_equal("cache", np.repeat(gqa_cache, group, axis=3 if case.paged else 2), mha_cache)


# ---- INT8 / FP8 caches ---------------------------------------------------------------------------------------------

@pytest.mark.spec("trtllm/int8-fp8-cache", "trtllm/quant-inverse-scale", "trtllm/dequant")
@settings(max_examples=SOME)
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.01, 0.05, 0.3]))
def test_quantization_round_trip_within_half_a_step(seed, s):
    x = np.random.default_rng(seed).standard_normal(500).astype(np.float32) * 2
    int8 = ref.dequantize_kv(ref.quantize_kv(x, 1 / s, ref.INT8_KV_CACHE), s)
    inside = (x / s >= ref.INT8_MIN) & (x / s <= ref.INT8_MAX)
    assert (np.abs(int8 - x)[inside] <= s / 2 * (1 + 1e-5)).all()
    saturated = np.where(x > 0, ref.INT8_MAX, ref.INT8_MIN).astype(np.float32) * np.float32(s)
    assert np.array_equal(int8[~inside], saturated[~inside])
    fp8 = ref.dequantize_kv(ref.quantize_kv(x, 1 / s, ref.FP8_KV_CACHE), s)
    inside = np.abs(x / s) <= ref.FP8_MAX
    # e4m3: 3 mantissa bits, a half step is 2^-4 of the value; subnormals (below 2^-6) step by 2^-9.
    half_step = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10)
    assert (np.abs(fp8 - x)[inside] <= half_step[inside] * (1 + 1e-5)).all()
    assert (np.abs(fp8[~inside]) == np.float32(ref.FP8_MAX * s)).all()


@pytest.mark.spec("trtllm/int8-fp8-cache", "trtllm/quant-inverse-scale", "trtllm/generation-mmha")
@pytest.mark.parametrize("quant", [64, 128])
def test_quantized_cache_stores_the_rounded_keys(quant):
    """The cache holds sat(round_half_even(k / s)) of the new (rotated) keys; reading it back gives q * s."""
    case = replace(SMALL, quant=quant, position=2, rotary_dim=8)
    args = build_trt(case)
    _, cache = run(args)
    _, exact = float64_trt(replace_quant(args))
    k = exact[0, :, :, :5]                                        # float64 evaluation with a float64 cache
    assert_bits_equal("codes", cache[0, :, :, :5], ref.quantize_kv(k, args["kv_orig_quant_scale"][0], quant))


def replace_quant(args):
    """The same call on a float cache (no quantization): its stored values are the exact new K/V."""
    return dict(args, kv_cache_quant_mode=0, kv_orig_quant_scale=None, kv_quant_orig_scale=None,
                past_key_value=np.zeros(args["past_key_value"].shape, np.float64), use_fp8_context_fmha=False)


@pytest.mark.spec("trtllm/fp8-context-fmha")
@settings(max_examples=FEW)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 3]))
def test_fp8_context_fmha_rounds_q_k_v_and_p_to_e4m3(seed, mask_type):
    case = replace(SMALL, quant=128, fp8_context_fmha=True, mask_type=mask_type, seed=seed)
    args = build_trt(case)
    s = float(args["kv_quant_orig_scale"][0])
    e4m3 = ref.fp8_e4m3()

    def round8(a):
        return np.clip(a.astype(np.float32) / np.float32(s), -448, 448).astype(e4m3).astype(np.float64)

    x = args["qkv"]
    q, k, v = round8(x[:, :144].reshape(5, 6, 24)), round8(x[:, 144:192].reshape(5, 2, 24)), round8(
        x[:, 192:].reshape(5, 2, 24))
    scores = np.einsum("ihd,jhd->hij", q, np.repeat(k, 3, axis=1)) * s * s / np.sqrt(24)
    if mask_type == 1:
        scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p8 = p.astype(np.float32).astype(e4m3).astype(np.float64)
    want = np.einsum("hij,jhd->ihd", p8, np.repeat(v, 3, axis=1)) * s / p.sum(axis=-1).transpose(1, 0)[..., None]
    got, _ = run(args)
    assert_close("fp8 fmha", got, want.reshape(5, 144), "float32", scale=5)
    plain, _ = run(dict(args, use_fp8_context_fmha=False))
    assert not np.array_equal(got, plain)                         # the roundings are there


# ---- cross attention -----------------------------------------------------------------------------------------------

@pytest.mark.spec("trtllm/cross-attention")
@settings(max_examples=FEW)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.integers(0, 2**32 - 1))
def test_cross_attention_is_attention_over_the_encoder_states(encoder_lengths, seed):
    """Context: the encoder K/V (cross_kv) go to the cache and the queries attend over exactly L_e of them;
    generation: the same over the cache, nothing written."""
    E = len(encoder_lengths)
    case = TrtCase(contexts=tuple((0, 2) for _ in range(E)), generations=(), beam_width=1, num_heads=4,
                   num_kv_heads=2, head_size=8, dtype="float64", capacity=8, window=8, mask_type=0, seed=seed)
    args = build_trt(case)
    rng = np.random.default_rng(seed)
    enc = np.asarray(encoder_lengths, np.int32)
    cross_kv = rng.standard_normal((int(enc.sum()), 32))
    args.update(do_cross_attention=True, cross_kv=cross_kv, encoder_input_lengths=enc)
    got, cache = run(args)
    # The padded encoder states (E, 5, ...) with a padding mask give the same rows.
    starts = np.concatenate([[0], np.cumsum(enc)])
    for e in range(E):
        kv = np.zeros((5, 32))
        kv[:enc[e]] = cross_kv[starts[e]:starts[e + 1]]
        keys, values = np.repeat(kv[:, :16].reshape(5, 2, 8), 2, axis=1), np.repeat(kv[:, 16:].reshape(5, 2, 8), 2, 1)
        q = args["qkv"][2 * e:2 * e + 2, :32].reshape(2, 4, 8)
        scores = np.einsum("ihd,jhd->hij", q, keys) / np.sqrt(8)
        scores[..., enc[e]:] = -np.inf
        want = np.einsum("hij,jhd->ihd", masked_softmax(scores), values).reshape(2, 32)
        assert_close(f"context {e}", got[2 * e:2 * e + 2], want, "float64")
        assert_bits_equal(f"encoder K cached {e}", cache[e, 0, :, :enc[e]],
                          kv[:enc[e], :16].reshape(-1, 2, 8).transpose(1, 0, 2))
    # TensorRT-LLM's packed [1, num_tokens, .] form, and the padded mode with cross_kv (E, max length, .).
    assert_same_values("[1, num_tokens, .]", run(dict(args, cross_kv=cross_kv[None]))[0], got)
    padded_kv = np.zeros((E, 5, 32))
    for e in range(E):
        padded_kv[e, :enc[e]] = cross_kv[starts[e]:starts[e + 1]]
    padded, _ = run(dict(to_padded(case, args), cross_kv=padded_kv))
    assert_same_values("padded", padded.reshape(-1, 32), got)
    # A generation step reads the encoder states back from the cache and writes nothing.
    gen = dict(args, qkv=rng.standard_normal((E, 64)), sequence_length=np.full(E, 3, np.int32),
               host_past_key_value_lengths=np.full(E, 2, np.int32), host_request_types=np.ones(E, np.int32),
               cross_kv=None, past_key_value=cache.copy(), cache_indirection=np.zeros((E, 1, 8), np.int32))
    out, after = run(gen)
    assert_bits_equal("cache after generation", after, cache)
    for e in range(E):
        kv = cross_kv[starts[e]:starts[e + 1]]
        keys, values = np.repeat(kv[:, :16].reshape(-1, 2, 8), 2, 1), np.repeat(kv[:, 16:].reshape(-1, 2, 8), 2, 1)
        scores = np.einsum("ihd,jhd->hij", gen["qkv"][e:e + 1, :32].reshape(1, 4, 8), keys) / np.sqrt(8)
        want = np.einsum("hij,jhd->ihd", masked_softmax(scores), values).reshape(1, 32)
        assert_close(f"generation {e}", out[e:e + 1], want, "float64")


# ---- custom mask, multi-block combine ------------------------------------------------------------------------------

def test_custom_mask_hides_exactly_its_false_keys():
    args = build_trt(replace(SMALL, mask_type=6, dtype="float64"))
    mask = args["attention_mask"]
    got, _ = run(args)
    # The same keys hidden through an explicit -inf relative bias.
    table = np.where(mask[None, :, :5], 0.0, -np.inf).repeat(6, axis=0)      # (H, L, L)
    want, _ = run(dict(args, mask_type=0, attention_mask=None, position_embedding_type=6,
                       relative_attention_bias=table))
    assert_bits_equal("custom", got, want)
    causal, _ = run(dict(args, mask_type=1, attention_mask=None))
    assert not np.array_equal(got, causal)


@pytest.mark.spec("trtllm/multi-block")
@settings(max_examples=REFERENCE)
@given(st.integers(1, 12), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_multi_block_combine_equals_one_pass_for_every_split_count(keys, queries, seed):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((2, queries, keys)) * 3
    scores[rng.random(scores.shape) < 0.3] = -np.inf                          # hidden keys; some tiles all hidden
    values = rng.standard_normal((keys, 2, 5))
    want = np.einsum("hik,khd->hid", masked_softmax(scores), values)
    for splits in range(1, keys + 2):
        got = ref.combine_partials(*ref.split_attention(scores, values, splits))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{splits} splits")


# ---- traceability: facts no test above checks on its own -------------------------------------------------------------

@pytest.mark.spec("trtllm/context-fmha-fp32-acc")
@pytest.mark.parametrize("context_fmha_type", [1, 2])
def test_float16_scores_accumulate_in_float32(context_fmha_type):
    """Positive float16 Q and K whose dot products (about 24 * 60^2) pass float16's largest value 65504: a float16
    accumulation would give inf (then NaN); the float32 one matches the float64 evaluation."""
    args = build_trt(replace(SMALL, dtype="float16"))
    rng = np.random.default_rng(context_fmha_type)
    x = rng.standard_normal((5, 240))                                       # (tokens, (6 + 2 + 2) * 24)
    x[:, :192] = 60 + 5 * x[:, :192]                                        # Q and K around 60
    qkv = x.astype(np.float16)
    got, _ = run(dict(args, qkv=qkv, context_fmha_type=context_fmha_type))
    x = qkv.astype(np.float64)
    q, k, v = x[:, :144].reshape(5, 6, 24), x[:, 144:192].reshape(5, 2, 24), x[:, 192:].reshape(5, 2, 24)
    scores = np.einsum("ihd,jhd->hij", q, np.repeat(k, 3, axis=1))          # (H, 5, 5)
    assert scores.max() > np.finfo(np.float16).max
    scores = np.where(np.tril(np.ones((5, 5), bool)), scores / np.sqrt(24), -np.inf)
    want = np.einsum("hij,jhd->ihd", masked_softmax(scores), np.repeat(v, 3, axis=1)).reshape(5, 144)
    assert_close("output", got, want, "float16")


@pytest.mark.spec("trtllm/cache-per-layer")
@settings(max_examples=FEW)
@given(st.integers(0, 2**32 - 1))
def test_each_layer_has_its_own_cache_in_the_pool(seed):
    """The same calls as layer 0 and as layer 1 of one pool: each writes only its own layer's slab, the slabs end
    up holding the same tokens, and a later chunk reads its own layer's keys (the other slab holds random codes)."""
    case = single_sequence(7, window=12, capacity=12, paged=True, tokens_per_block=2, num_layers=2, seed=seed)
    whole = build_trt(case)
    pool = cache_of(whole)
    first = step_args(whole, case, 0, 5, generation=False, cache=pool)
    _, pool_0 = run(first)
    _, pool_1 = run(dict(first, layer_idx=1))
    assert_bits_equal("layer 1 after a layer-0 call", pool_0[:, 1], pool[:, 1])
    assert_bits_equal("layer 0 after a layer-1 call", pool_1[:, 0], pool[:, 0])
    stored = written(replace(case, contexts=((0, 5),)), first)[:, 0]      # the slots of tokens 0..4 in a slab
    assert_bits_equal("the two layers' stored tokens", pool_1[:, 1][stored], pool_0[:, 0][stored])
    assert not np.array_equal(pool_0[:, 0], pool[:, 0])
    chunk_0, _ = run(step_args(whole, case, 5, 2, generation=False, cache=pool_0))
    chunk_1, _ = run(dict(step_args(whole, case, 5, 2, generation=False, cache=pool_1), layer_idx=1))
    assert_bits_equal("a chunk over either layer", chunk_1, chunk_0)
    wrong, _ = run(dict(step_args(whole, case, 5, 2, generation=False, cache=pool_0), layer_idx=1))
    assert not np.array_equal(wrong, chunk_0)                  # layer 1 of pool_0 was never written


@pytest.mark.spec("trtllm/streaming-context-dense", "trtllm/cyclic-overwrite")
@settings(max_examples=FEW)
@given(st.integers(4, 6), st.integers(1, 2), st.integers(1, 4), st.sampled_from([0, 2]), st.integers(0, 2**32 - 1))
def test_streamingllm_context_is_dense_and_keeps_sinks_plus_the_last_tokens(window, sinks, extra, position, seed):
    """A StreamingLLM context longer than the window gives the bits of a plain causal call on a cache with room for
    every token; its cyclic cache keeps the sink tokens and the last window - sinks tokens (K without RoPE)."""
    total = window + extra
    rope_args = dict(position=position, rotary_dim=8 if position else 0)
    case = single_sequence(total, window=window, capacity=window, sinks=sinks, streamingllm=True, seed=seed,
                           **rope_args)
    args = build_trt(case)
    roomy = dict(build_trt(single_sequence(total, window=total, capacity=total, seed=seed, **rope_args)),
                 qkv=args["qkv"])
    got, cache = run(args)
    want, _ = run(roomy)
    assert_bits_equal("dense context", got, want)
    kept = [t for t in range(total) if t < sinks or t >= total - (window - sinks)]
    assert len(kept) == window
    for t in kept:
        assert_bits_equal(f"K of token {t}", cache[0, 0, :, ref.cyclic_slot(t, window, sinks)],
                          args["qkv"][t, 48:64].reshape(2, 8))
