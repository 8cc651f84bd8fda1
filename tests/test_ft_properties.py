"""FasterTransformer cross attention: the reference held to what DecoderCrossAttentionLayer implies, the kernels to
the reference.

Reference properties run many cheap examples; the kernel test runs under the simulator (NaN-poisoned outputs,
caches compared bit for bit) on small batches, few heads and mostly head sizes 32/48.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
import cacheattn.testing as kit
from cacheattn import AttentionWeight, DenseWeight
from reference.ft_cross_attention import logical_caches

from helpers import assert_bits_equal, assert_close, assert_same_values
from strategies import HEAD_SIZES, KERNEL, REFERENCE, FTCase, build_ft, copy_inputs, float64_ft, ft_cases, with_

OUTPUTS = ("key_cache", "value_cache", "context_buf", "cross_attentions")


def run(inputs, case, **backend):
    """One call on copies of the inputs: (outputs, the in-out tensors after the call)."""
    x = copy_inputs(inputs)
    out = cacheattn.cross_attention(**x, **case.attrs(), **backend)
    return out, x


def assert_same_outputs(a, b, rows=slice(None)):
    assert_same_values("hidden_features", a.hidden_features[rows], b.hidden_features[rows])
    assert_same_values("context", a.context[rows], b.context[rows])


def logical(x, case):
    return logical_caches(x["key_cache"], x["value_cache"], case.is_batch_major_cache)


def unfinished(case):
    return np.ones(case.batch, bool) if case.finished is None else ~np.asarray(case.finished)


@pytest.mark.spec("ft/kv-once", "ft/store-first-step", "ft/read-from-cache", "ft/step", "ft/caches")
@settings(max_examples=REFERENCE // 2)
@given(ft_cases(steps=(1,)), st.integers(2, 4))
def test_steps_after_the_first_equal_recomputing_biased_kv(case, steps):
    """Step s reads the cache step 1 biased; a step-1 call (which recomputes and biases K/V from the encoder
    output) on a fresh cache gives the same bits. The caches do not change after step 1."""
    case = with_(case, max_decoder_seq_len=steps)
    inputs = build_ft(case)
    _, state = run(inputs, case)
    for step in range(2, steps + 1):
        later, after = run(dict(state, step=step), with_(case, step=step))
        for name in ("key_cache", "value_cache"):
            assert_bits_equal(f"{name} at step {step}", after[name], state[name])
        fresh, recomputed = run(dict(inputs, cross_attentions=state["cross_attentions"],
                                     context_buf=state["context_buf"]), case)
        assert_same_outputs(later, fresh)
        for b in np.flatnonzero(unfinished(case)):
            n = case.lengths[b]
            assert_bits_equal("cross_attentions", after["cross_attentions"][b, :, step - 1, :n],
                              recomputed["cross_attentions"][b, :, 0, :n])


@pytest.mark.spec("ft/caches")
@settings(max_examples=REFERENCE)
@given(ft_cases())
def test_the_two_cache_layouts_agree(case):
    """Batch-major and plain caches give the same outputs and hold the same numbers, transposed."""
    major, plain = with_(case, is_batch_major_cache=True), with_(case, is_batch_major_cache=False)
    inputs = build_ft(major)
    k, v = logical(inputs, major)
    flat_k, flat_v = k.transpose(0, 2, 1, 3).copy(), v.transpose(0, 2, 1, 3).copy()        # [B, L, H, Dh]
    a, after_a = run(inputs, major)
    b, after_b = run(dict(inputs, key_cache=flat_k, value_cache=flat_v), plain)
    assert_same_outputs(a, b)
    for got, want in zip(logical(after_a, major), logical(after_b, plain)):
        assert_bits_equal("cache (logical [B, H, L, Dh])", got, want)
    if case.max_decoder_seq_len:
        assert_same_values("cross_attentions", after_a["cross_attentions"], after_b["cross_attentions"])


def zero_biases(weights):
    return AttentionWeight(*(DenseWeight(w.kernel, np.zeros_like(w.bias)) for w in weights[:4]))


@pytest.mark.spec("ft/finished")
@settings(max_examples=REFERENCE)
@given(ft_cases(steps=(1, 2)).filter(lambda c: c.finished is not None and any(c.finished)))
def test_a_finished_row_is_left_alone(case):
    """Its context row and probabilities keep what they held; at step 1 its cache holds the unbiased projection."""
    inputs = build_ft(with_(case, context_buf=True))
    out, after = run(inputs, with_(case, context_buf=True))
    done = np.asarray(case.finished)
    assert_bits_equal("context_buf (finished rows)", after["context_buf"][done], inputs["context_buf"][done])
    if case.max_decoder_seq_len:
        assert_bits_equal("cross_attentions (finished rows)", after["cross_attentions"][done],
                          inputs["cross_attentions"][done])
    # Without a context_buf, a finished row of the new buffer is zeros.
    fresh, _ = run(dict(inputs, context_buf=None), with_(case, context_buf=False))
    assert not fresh.context[done].any()
    if case.step == 1:
        # Zero biases and no IA3: every row's cache is the unbiased projection FasterTransformer's GEMM wrote.
        _, unbiased = run(dict(inputs, weights=zero_biases(inputs["weights"]), ia3_tasks=None), case)
        for got, want in zip(logical(after, case), logical(unbiased, case)):
            assert_bits_equal("cache (finished rows)", got[done], want[done])


def mask_padding_and_attend(inputs, case, state):
    """A float64 evaluation over ALL mem_max_seq_len positions of the biased cache, with an explicit -inf mask
    at positions >= encoder_sequence_length (FasterTransformer never visits them; a mask must agree)."""
    w = inputs["weights"]
    q = (inputs["input_query"].astype(np.float64) @ w.query_weight.kernel.astype(np.float64)
         + w.query_weight.bias).reshape(case.batch, case.head_num, 1, case.size_per_head)
    k, v = (c.astype(np.float64) for c in logical(state, case))                           # [B, H, L, Dh]
    scores = q @ k.transpose(0, 1, 3, 2) / (np.sqrt(case.size_per_head) * case.q_scaling)   # [B, H, 1, L]
    padding = np.arange(case.mem_len)[None, :] >= np.asarray(case.lengths)[:, None]        # [B, L]
    scores = np.where(padding[:, None, None, :], -np.inf, scores)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = e / (e.sum(axis=-1, keepdims=True) + 1e-6)
    return (probs @ v).reshape(case.batch, -1), probs[:, :, 0]


@pytest.mark.spec("ft/encoder-lengths", "ft/input-query", "ft/read-from-cache")
@settings(max_examples=REFERENCE)
@given(ft_cases(finished=False), st.integers(0, 2**32 - 1))
def test_lengths_equal_an_explicit_mask_over_padded_encoder_states(case, seed):
    inputs = build_ft(case)
    out, state = run(inputs, case)
    # Padded encoder states (positions >= length) change nothing: they are never biased or read.
    noisy = inputs["encoder_output"].copy()
    padding = np.arange(case.mem_len)[None, :] >= np.asarray(case.lengths)[:, None]
    noisy[padding] = np.random.default_rng(seed).standard_normal(noisy[padding].shape) * 100
    padded, _ = run(dict(inputs, encoder_output=noisy), case)
    assert_same_outputs(out, padded)
    # And the result is attention with a -inf mask over those positions.
    context, probs = mask_padding_and_attend(inputs, case, state)
    assert_close("context", out.context, context, case.dtype, scale=2.0)
    if case.max_decoder_seq_len:
        got = state["cross_attentions"][:, :, case.step - 1]
        assert_close("cross_attentions", np.where(padding[:, None, :], 0, got), probs, case.dtype, scale=2.0)


@settings(max_examples=REFERENCE)
@given(ft_cases(steps=(1,)).filter(lambda c: c.num_tasks > 0 and c.ia3_tasks is not None))
def test_ia3_with_all_ones_weights_is_no_ia3(case):
    inputs = build_ft(case)
    w = inputs["weights"]
    ones = DenseWeight(np.ones_like(w.ia3_key_weight.kernel))
    a, after_a = run(dict(inputs, weights=w._replace(ia3_key_weight=ones, ia3_value_weight=ones)), case)
    b, after_b = run(dict(inputs, ia3_tasks=None, weights=AttentionWeight(*w[:4])), case)
    assert_same_outputs(a, b)
    for name in OUTPUTS:
        if after_a[name] is not None:
            assert_bits_equal(name, after_a[name], after_b[name])


@settings(max_examples=REFERENCE)
@given(ft_cases(dtypes=("float32",)).filter(lambda c: c.max_decoder_seq_len > 0))
def test_probabilities_sum_to_one_and_reproduce_the_context(case):
    inputs = build_ft(case)
    out, state = run(inputs, case)
    probs = state["cross_attentions"][:, :, case.step - 1].astype(np.float64)              # [B, H, L]
    _, v = logical(state, case)
    for b in np.flatnonzero(unfinished(case)):
        n = case.lengths[b]
        assert np.allclose(probs[b, :, :n].sum(axis=-1), 1.0, atol=1e-5, rtol=0)
        if n < case.mem_len:
            assert_bits_equal("cross_attentions past the length", state["cross_attentions"][b, :, case.step - 1, n:],
                              inputs["cross_attentions"][b, :, case.step - 1, n:])
        context = np.einsum("ht,htd->hd", probs[b, :, :n], v[b, :, :n].astype(np.float64)).reshape(-1)
        assert_close("context", out.context[b], context, np.float32, scale=4.0)


@settings(max_examples=REFERENCE)
@given(ft_cases(dtypes=("float16", "float32")))
def test_reference_matches_float64_evaluation(case):
    inputs = build_ft(case)
    out, state = run(inputs, case)
    hidden, context, key_cache, value_cache, cross = float64_ft(copy_inputs(inputs), case)
    assert_close("context", out.context, context, case.dtype, scale=2.0)
    assert_close("hidden_features", out.hidden_features, hidden, case.dtype, scale=4.0)
    assert_close("key_cache", state["key_cache"], key_cache, case.dtype)
    assert_close("value_cache", state["value_cache"], value_cache, case.dtype)
    if case.max_decoder_seq_len:
        assert_close("cross_attentions", state["cross_attentions"], cross, case.dtype, scale=2.0)


@pytest.mark.spec("ft/kv-from-encoder", "ft/store-first-step", "ft/output-linear", "ft/hidden-features")
@settings(max_examples=REFERENCE // 2)
@given(ft_cases(steps=(1,), finished=False, ia3=False))
def test_first_step_caches_the_projected_encoder_output_and_projects_the_context(case):
    """The article's formulas in float64, apart from the reference: after step 1 the caches hold
    encoder_output . Wk / Wv plus the bias at every position a row reads, and hidden_features, the size of
    input_query, is context . Wo."""
    inputs = build_ft(case)
    out, state = run(inputs, case)
    w = inputs["weights"]
    memory = inputs["encoder_output"].astype(np.float64)                                 # [B, L, mem_d_model]
    for name, dense, got in zip(("key_cache", "value_cache"), (w.key_weight, w.value_weight), logical(state, case)):
        want = (memory @ dense.kernel.astype(np.float64) + dense.bias).reshape(
            case.batch, case.mem_len, case.head_num, case.size_per_head).transpose(0, 2, 1, 3)   # [B, H, L, Dh]
        for b, n in enumerate(case.lengths):
            assert_close(f"{name} row {b}", got[b, :, :n], want[b, :, :n], case.dtype, scale=2.0)
    assert out.hidden_features.shape == inputs["input_query"].shape
    wo = w.attention_output_weight.kernel.astype(np.float64)
    assert_close("hidden_features", out.hidden_features, out.context.astype(np.float64) @ wo, case.dtype)


@pytest.mark.spec("ft/q-every-step", "ft/read-from-cache", "ft/kv-once", "ft/step")
@settings(max_examples=REFERENCE // 2)
@given(ft_cases(steps=(1,)), st.integers(0, 2**32 - 1))
def test_a_later_step_projects_its_new_query_and_ignores_the_encoder_output(case, seed):
    """Step 2 with a new input_query and a different encoder_output gives the bits of step 1 with that query
    over the original encoder output: Q comes from this step's input, K/V from the cache alone."""
    case = with_(case, max_decoder_seq_len=2)
    inputs = build_ft(case)
    _, state = run(inputs, case)
    rng = np.random.default_rng(seed)
    query = rng.standard_normal(inputs["input_query"].shape).astype(case.dtype)
    other = (rng.standard_normal(inputs["encoder_output"].shape) * 100).astype(case.dtype)
    later, after = run(dict(state, step=2, input_query=query, encoder_output=other), with_(case, step=2))
    first, _ = run(dict(inputs, input_query=query), case)
    assert_same_outputs(later, first)
    for name in ("key_cache", "value_cache"):
        assert_bits_equal(f"{name} at step 2", after[name], state[name])


@pytest.mark.spec("ft/head-size-dispatch")
@pytest.mark.parametrize("size_per_head", HEAD_SIZES)
def test_every_head_size_matches_float64_evaluation(size_per_head):
    """Each of FasterTransformer's head sizes, both layouts, against the float64 evaluation (the kernel test
    draws mostly 32/48; the PTX check compiles 32 and 256)."""
    for major in (True, False):
        case = FTCase(lengths=(2, 3), mem_len=3, head_num=2, size_per_head=size_per_head, d_model=8, mem_d_model=8,
                      dtype="float16", is_batch_major_cache=major, step=1, finished=None, num_tasks=0, ia3_tasks=None,
                      max_decoder_seq_len=1, context_buf=False, q_scaling=1.0, seed=size_per_head)
        inputs = build_ft(case)
        out, _ = run(inputs, case)
        assert_close("context", out.context, float64_ft(copy_inputs(inputs), case)[1], case.dtype, scale=2.0)


def on_device(device, threads):
    """cross_attention on the kernels, called as the kit calls an implementation (NumPy in, weights an
    AttentionWeight). On a GPU the arrays (weights too) go over as CuPy and the in-place ones come back into
    the caller's arrays."""
    def kernels(*args, weights, **attrs):
        moved = [device.put(a) for a in args]
        moved_weights = AttentionWeight(*(None if w is None else DenseWeight(device.put(w.kernel), device.put(w.bias))
                                          for w in weights))
        out = cacheattn.cross_attention(*moved, weights=moved_weights, **attrs, backend="numba", threads=threads)
        for host, there in zip(args, moved):
            if there is not host:
                host[...] = device.get(there)
        return tuple(device.get(o) for o in out)
    return kernels


@pytest.mark.parametrize("threads", [32, 64])
def test_kernels_match_the_reference(device, threads):
    """The conformance kit on the kernels (the KERNEL budget split between the two block sizes): hidden_features
    and context close to a float64 evaluation, caches bit-identical to the reference's (on a GPU, where the step-1
    GEMM sums in cuBLAS's order, close to float64), probabilities close, finished rows' context_buf, unwritten
    cross_attentions entries and cache rows past the lengths untouched; outputs start as NaN (conftest)."""
    features = [f for f in kit.FEATURES["cross_attention"] if not (device.gpu and f == "cache_bits")]
    report = kit.check_cross_attention(on_device(device, threads), max_examples=max(1, KERNEL // 2),
                                       features=features)
    assert report.examples >= 1


@pytest.mark.spec("ft/head-size-dispatch")
@pytest.mark.parametrize("size_per_head", HEAD_SIZES)
def test_kernels_for_every_head_size(device, size_per_head):
    """One small launch per head size (each compiles its own kernel); dtype and layout alternate over the list,
    step 1 with IA3 so every kernel runs."""
    n = HEAD_SIZES.index(size_per_head)
    case = FTCase(lengths=(2,), mem_len=3, head_num=1, size_per_head=size_per_head, d_model=8, mem_d_model=8,
                  dtype=("float16", "float32")[n % 2], is_batch_major_cache=n % 4 < 2, step=1, finished=None,
                  num_tasks=2, ia3_tasks=(1,), max_decoder_seq_len=1, context_buf=False, q_scaling=0.5, seed=n)
    inputs = build_ft(case)
    _, ref_state = run(inputs, case)
    wide = float64_ft(copy_inputs(inputs), case)
    x = {k: device.put(v) for k, v in copy_inputs(inputs).items()}
    x["weights"] = AttentionWeight(*(None if w is None else DenseWeight(device.put(w.kernel), device.put(w.bias))
                                     for w in inputs["weights"]))
    got = cacheattn.cross_attention(**x, **case.attrs(), backend="numba", threads=64)
    assert_close("context", device.get(got.context), wide[1], case.dtype, scale=2.0)
    assert_close("hidden_features", device.get(got.hidden_features), wide[0], case.dtype, scale=4.0)
    if not device.gpu:                          # on a GPU the step-1 GEMM sums in cuBLAS's order
        assert_bits_equal("key_cache", device.get(x["key_cache"]), ref_state["key_cache"])
        assert_bits_equal("value_cache", device.get(x["value_cache"]), ref_state["value_cache"])
    assert_close("cross_attentions", device.get(x["cross_attentions"]), ref_state["cross_attentions"], case.dtype)


@pytest.mark.gpu
def test_cupy_in_cupy_out_on_the_callers_stream():
    """Real GPU only: CuPy arrays in (weights too) -> kernels on the caller's stream -> CuPy out, caches in place."""
    import cupy

    case = FTCase(lengths=(3, 5), mem_len=5, head_num=2, size_per_head=64, d_model=16, mem_d_model=12,
                  dtype="float16", is_batch_major_cache=True, step=1, finished=(False, True), num_tasks=2,
                  ia3_tasks=(1, 0), max_decoder_seq_len=2, context_buf=True, q_scaling=1.0, seed=11)
    inputs = build_ft(case)
    wide = float64_ft(copy_inputs(inputs), case)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in copy_inputs(inputs).items()}
        x["weights"] = AttentionWeight(*(None if w is None else DenseWeight(cupy.asarray(w.kernel), w.bias if
                                         w.bias is None else cupy.asarray(w.bias)) for w in inputs["weights"]))
        out = cacheattn.cross_attention(**x, **case.attrs())
        stream.synchronize()
    assert isinstance(out.hidden_features, cupy.ndarray) and out.context is x["context_buf"]
    assert_close("context", out.context.get(), wide[1], case.dtype, scale=2.0)
    assert_close("key_cache", x["key_cache"].get(), wide[2], case.dtype)
