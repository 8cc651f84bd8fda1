"""The conformance kit itself: it passes the reference, catches planted bugs with a reproducer that replays
them, keeps to the declared features, refuses unknown features and wrong signatures, and runs from pytest.

Implementations here are the reference (backend="reference") or the reference with one bug planted, so
these tests cost NumPy time only; the kernels go through the kit in test_ppl_kernels / test_onnx_properties.
"""

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cacheattn
import cacheattn.testing as kit
from cacheattn.testing import ConformanceError

FEW = 15


def reference(op):
    return functools.partial(getattr(cacheattn, op), backend="reference")


# ---------------------------------------------------------------------------------------------- planted bugs

def clears_the_cache(current_key, current_value, start_pos, cache, scale=None, **attrs):
    """Zeroes the whole cache first: every slot the call must not touch changes."""
    cache[...] = 0
    return cacheattn.key_value_cache(current_key, current_value, start_pos, cache, scale, **attrs)


def int8_one_code_off(current_key, current_value, start_pos, cache, scale=None, **attrs):
    """Stores the right codes, then one written int8 code off by one (a rounding slip)."""
    key, value = cacheattn.key_value_cache(current_key, current_value, start_pos, cache, scale, **attrs)
    if attrs["quant_bit"] == 8:
        view = cache[:current_key.shape[0], attrs["layer_idx"]] if attrs["cache_layout"] == 0 else None
        if view is not None:
            view[0, 0, start_pos, 0, 0] = np.int8(view[0, 0, start_pos, 0, 0] ^ 1)
    return key, value


def forgets_the_last_query(Q, K, V, *args, **attrs):
    """Leaves the last query row of Y unwritten (NaN), as a kernel with a short grid would."""
    y, pk, pv, qk = cacheattn.onnx_attention(Q, K, V, *args, **attrs)
    y[..., -1, :] = np.nan
    return y, pk, pv, qk


def qk_without_scale(Q, K, V, *args, **attrs):
    """Returns qk_matmul_output multiplied by 2: wrong only in the fourth output."""
    y, pk, pv, qk = cacheattn.onnx_attention(Q, K, V, *args, **attrs)
    return y, pk, pv, None if qk is None else qk * 2


def biases_the_cache_again(input_query, encoder_output, encoder_sequence_length, step, key_cache, value_cache,
                           *args, weights, **attrs):
    """At steps after the first, attends over cached values plus the value bias again (the cache already holds
    biased values; a key bias again would shift every score alike and cancel in the softmax). For plain caches
    [B, L, H, Dh] only; the cache itself is left alone (a copy is biased)."""
    if step > 1:
        value_cache = value_cache + weights.value_weight.bias.reshape(attrs["head_num"], attrs["size_per_head"])
    return cacheattn.cross_attention(input_query, encoder_output, encoder_sequence_length, step, key_cache,
                                     value_cache, *args, weights=weights, **attrs)


def zeroes_finished_rows(input_query, encoder_output, encoder_sequence_length, step, key_cache, value_cache,
                         finished=None, ia3_tasks=None, context_buf=None, *args, **attrs):
    """Writes zeros into a finished row's context_buf, which FasterTransformer leaves as it was."""
    out = cacheattn.cross_attention(input_query, encoder_output, encoder_sequence_length, step, key_cache,
                                    value_cache, finished, ia3_tasks, context_buf, *args, **attrs)
    if finished is not None and context_buf is not None:
        context_buf[finished] = 0
    return out


def failure(op, impl, examples=30, **options):
    with pytest.raises(ConformanceError) as info:
        kit.check(op, impl, max_examples=examples, seed=0, **options)
    return str(info.value)


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("op", list(kit.OPERATORS))
def test_the_reference_conforms_and_the_report_names_what_ran(op):
    report = kit.check(op, reference(op), max_examples=FEW, seed=3)
    assert report.operator == op and report.examples == FEW
    assert set(report.features) | set(report.not_covered) == set(kit.FEATURES[op])
    assert report.features and f"{op}: {FEW} examples pass" in str(report)


def test_untouched_cache_slots_are_checked_and_labelled():
    message = failure("key_value_cache", clears_the_cache, features={"cache_layout_1"})
    assert message.startswith("key_value_cache does not conform")
    assert "cache (bit-exact)" in message and "[a slot this call must leave untouched]" in message


def test_a_wrong_int8_code_is_caught_at_its_index_as_a_written_slot():
    message = failure("key_value_cache", int8_one_code_off, features={"int8", "cache_layout_0"})
    assert "quant_bit=8" in message and "[a slot this call writes]" in message
    assert "at (0, 0, 0, " in message


def test_an_unwritten_output_row_is_caught():
    message = failure("onnx_attention", forgets_the_last_query, dtypes=["float32"], features=[])
    assert "Y (float32 tolerance" in message and "got nan" in message


def test_only_the_claimed_outputs_are_checked():
    message = failure("onnx_attention", qk_without_scale, features={"qk_matmul_output"})
    assert "qk_matmul_output (" in message and "return_qk_matmul_output=True" in message
    without_qk = [f for f in kit.FEATURES["onnx_attention"] if f != "qk_matmul_output"]
    assert kit.check("onnx_attention", qk_without_scale, max_examples=FEW, seed=0, features=without_qk).examples


def test_the_reproducer_replays_the_failure_and_a_seed_repeats_the_run():
    message = failure("key_value_cache", clears_the_cache)
    assert message == failure("key_value_cache", clears_the_cache)
    code = message.split("reproducer:\n", 1)[1]
    assert "from test_testing_kit import clears_the_cache" in code
    with pytest.raises(ConformanceError) as replay:
        exec(textwrap.dedent(code), {})
    assert str(replay.value) == message


def test_declared_features_bound_the_drawn_problems():
    seen = []

    def recording(*args, **attrs):
        seen.append((attrs["cache_layout"], attrs["cache_mode"], attrs["quant_bit"], attrs["is_alibi"],
                     attrs["num_heads"] == (attrs["num_kv_heads"] or attrs["num_heads"]), args[12] is None))
        return cacheattn.multi_head_cache_attention(*args, **attrs)

    declared = {"cache_layout_2", "cache_mode_1", "causal", "int4"}
    report = kit.check("multi_head_cache_attention", recording, max_examples=FEW, seed=1, features=declared)
    assert {s[:4] for s in seen} <= {(2, 1, 0, False), (2, 1, 4, False)}
    assert all(no_gqa and no_mask for *_, no_gqa, no_mask in seen)
    assert set(report.features) <= declared


@pytest.mark.parametrize("options, message", [
    (dict(features={"causal", "rope"}), "features: unknown for multi_head_cache_attention: rope"),
    (dict(features={"causal", "cache_mode_0"}), "features: multi_head_cache_attention needs at least one of "
                                                "cache_layout_0"),
    (dict(dtypes=["bfloat16"]), "dtypes: expected a non-empty subset of ('float16', 'float32')"),
    (dict(max_examples=0), "max_examples: expected a positive int"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError) as info:
        kit.check_multi_head_cache_attention(reference("multi_head_cache_attention"), **options)
    assert str(info.value).startswith(message)


def renamed(current_key, current_value, start, cache, scale=None, **attrs):
    pass


def no_num_repeat(current_key, current_value, start_pos, cache, scale=None, *, num_layer=1, layer_idx=0,
                  quant_bit=0, quant_group=8, cache_layout=0):
    pass


def needs_a_stream(current_key, current_value, start_pos, cache, scale, stream, **attrs):
    pass


@pytest.mark.parametrize("impl, problem", [
    (renamed, "positional argument 2 is named 'start', expected 'start_pos'"),
    (no_num_repeat, "it does not accept the keyword argument 'num_repeat'"),
    (needs_a_stream, "it requires arguments the document does not have: stream"),
    (lambda current_key, current_value: None, "it takes 2 positional arguments, the document has 5"),
])
def test_a_wrong_signature_is_refused_before_any_call(impl, problem):
    with pytest.raises(TypeError) as info:
        kit.check_key_value_cache(impl)
    text = str(info.value)
    assert text.startswith("impl: expected the signature key_value_cache(current_key, current_value, start_pos, "
                           "cache, scale, *, num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_layout)")
    assert problem in text


def test_unknown_operator_is_refused():
    with pytest.raises(ValueError, match="^op: expected one of multi_head_cache_attention"):
        kit.check("masked_multihead_attention", print)


def test_import_cacheattn_does_not_import_hypothesis():
    code = "import sys, cacheattn; assert 'hypothesis' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "ok\n"


def test_without_hypothesis_the_kit_says_what_to_install():
    code = ("import sys; sys.modules['hypothesis'] = None\n"
            "try:\n    import cacheattn.testing\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("cacheattn.testing needs hypothesis: pip install 'cacheattn[testing]'")


def test_pytest_plugin_runs_the_check_as_one_test(tmp_path):
    (tmp_path / "tiny_impls.py").write_text(textwrap.dedent("""
        import functools
        import cacheattn
        good = functools.partial(cacheattn.gpt_attention, backend="reference")

        def clears(current_key, current_value, start_pos, cache, scale=None, **attrs):
            cache[...] = 0
            return cacheattn.key_value_cache(current_key, current_value, start_pos, cache, scale, **attrs)
    """))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))

    def pytest_run(name, op, *extra):
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--cacheattn-impl=tiny_impls:{name}",
                f"--cacheattn-op={op}", "--cacheattn-examples=10", "--cacheattn-seed=0", *extra]
        return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True)

    # A keyword-only operator passes (every tensor by name), a positional one fails with its reproducer.
    passed = pytest_run("good", "gpt_attention", "--cacheattn-features=paged,int8_kv,rope_gpt_neox")
    assert passed.returncode == 0 and "1 passed" in passed.stdout, passed.stdout + passed.stderr
    failed = pytest_run("clears", "key_value_cache")
    assert failed.returncode == 1 and "ConformanceError: key_value_cache does not conform" in failed.stdout
    assert "from tiny_impls import clears" in failed.stdout



# ---------------------------------------------------------------------------------------------- cross_attention

def test_cross_attention_kernels_conform():
    """Our kernels under the simulator, briefly (test_ft_properties runs them on the full kernel budget)."""
    def kernels(*args, **attrs):
        return cacheattn.cross_attention(*args, **attrs, backend="numba", threads=32)
    assert kit.check_cross_attention(kernels, max_examples=2, seed=5).examples == 2


def test_the_bias_added_again_at_a_later_step_is_caught_and_replayed():
    message = failure("cross_attention", biases_the_cache_again, features={"plain_cache", "later_steps"})
    assert message.startswith("cross_attention does not conform") and "context (" in message
    assert "step=2" in message or "step=3" in message
    # The weights print as shapes, so the report stays short; the reproducer rebuilds them from the seed.
    assert "weights=AttentionWeight(query_weight=DenseWeight(kernel=float" in message and "array(" not in message
    code = message.split("reproducer:\n", 1)[1]
    assert "from test_testing_kit import biases_the_cache_again" in code and "FTRequest(base=FTCase(" in code
    with pytest.raises(ConformanceError) as replay:
        exec(textwrap.dedent(code), {})
    assert str(replay.value) == message


def test_a_finished_rows_context_buf_must_stay_as_it_was():
    # A finished row and an old context_buf in one problem: about one draw in seven.
    message = failure("cross_attention", zeroes_finished_rows, examples=100,
                      features={"batch_major_cache", "finished", "context_buf"})
    assert "context_buf (bit-exact)" in message and "[a slot this call must leave untouched]" in message


def test_later_steps_leave_the_cache_rows_past_the_lengths_alone():
    """Step 1 writes every cache row (padding rows get the unbiased projection); later steps write none. Rows past
    the encoder length are never read, so scribbling on them shows in no output: the untouched-bytes check
    catches it."""
    def scribbles_past_the_lengths(*args, **attrs):
        out = cacheattn.cross_attention(*args, **attrs)
        if args[3] > 1:
            for b, n in enumerate(args[2]):
                args[5][b, n:] = 0                      # plain value cache [B, L, H, Dh]
        return out
    message = failure("cross_attention", scribbles_past_the_lengths, features={"plain_cache", "later_steps"})
    assert "value_cache (bit-exact)" in message and "[a slot this call must leave untouched]" in message
    assert "context (" not in message and "hidden_features (" not in message


def test_without_cache_bits_written_cache_rows_are_held_to_the_tolerance():
    """A GPU GEMM sums the step-1 projection in its own order: declared without cache_bits, a cache off by one
    float16 ulp passes (the outputs stay close), with it the same impl fails."""
    def rounds_differently(*args, **attrs):
        out = cacheattn.cross_attention(*args, **attrs)
        if args[3] == 1:
            for cache in args[4:6]:
                cache[...] = np.nextafter(cache, np.inf)
        return out
    everything = set(kit.FEATURES["cross_attention"])
    message = failure("cross_attention", rounds_differently, dtypes=["float16"])
    assert "(bit-exact)" in message
    report = kit.check_cross_attention(rounds_differently, max_examples=FEW, seed=0, dtypes=["float16"],
                                       features=everything - {"cache_bits", "later_steps"})
    assert report.examples == FEW


# ---------------------------------------------------------------------------------------------- gpt_attention

def rope_pairing_swapped(**args):
    """GPT-J's interleaved pairs where GPT-NeoX's halves belong, and the other way round."""
    position = int(args["position_embedding_type"])
    args["position_embedding_type"] = {1: 2, 2: 1}.get(position, position)
    return cacheattn.gpt_attention(**args, backend="reference")


def nudges_written(part):
    """The reference, then every element of `part` ("rotated keys" or "values") the call wrote one float ulp up."""
    def impl(**args):
        cache = args["past_key_value"]
        before = cache.copy()
        result = cacheattn.gpt_attention(**args, backend="reference")
        changed = (cache.view(np.uint8) != before.view(np.uint8)).reshape(*cache.shape, -1).any(axis=-1)
        part_of = np.zeros(cache.shape, bool)
        if part == "values":
            part_of[:, 1] = True
        else:
            part_of[:, 0, ..., :args["rotary_embedding_dim"]] = True
        cache[changed & part_of] = np.nextafter(cache[changed & part_of], np.inf)
        return result
    impl.__qualname__ = impl.__name__ = f"nudges_{part.replace(' ', '_')}"
    return impl


def returns_the_old_cache(**args):
    """present_key_value: a copy of past_key_value taken before the update."""
    old = args["past_key_value"].copy()
    output, _ = cacheattn.gpt_attention(**args, backend="reference")
    return output, old


def test_a_swapped_rope_pairing_is_caught_in_the_cache_and_replayed():
    """gpt_attention is keyword-only: the kit passes every tensor by name and checks the cache passed so."""
    message = failure("gpt_attention", rope_pairing_swapped, examples=60,
                      features={"contiguous", "rope_gptj", "rope_gpt_neox"})
    assert message.startswith("gpt_attention does not conform") and "past_key_value (bit-exact; a RoPE'd key" in message
    assert "[a slot this call writes]" in message and "inputs: qkv float" in message
    code = message.split("reproducer:\n", 1)[1]
    assert "impl = rope_pairing_swapped" in code and "case = TrtCase(" in code and "impl(*args, **attrs)" in code
    with pytest.raises(ConformanceError) as replay:
        exec(textwrap.dedent(code), {})
    assert str(replay.value) == message


ROPE_CASE = kit.TrtCase(contexts=((2, 3),), generations=((2, 3),), beam_width=1, num_heads=2, num_kv_heads=1,
                        head_size=8, dtype="float32", capacity=5, window=5, position=2, rotary_dim=8, seed=1)


def one_failure(impl, case):
    with pytest.raises(ConformanceError) as info:
        kit.check_case("gpt_attention", impl, case)
    return str(info.value)


def test_rope_keys_may_round_differently_the_rest_of_the_cache_may_not():
    """A RoPE'd key one float32 ulp off is within the kit's rule (cos/sin are not fixed to the bit); a cached value
    one ulp off is not."""
    claims = dict(features={"contiguous", "generation", "rope_gptj", "rope_gpt_neox"}, dtypes=["float32"])
    report = kit.check_gpt_attention(nudges_written("rotated keys"), max_examples=FEW, seed=0, **claims)
    assert {"rope_gptj", "rope_gpt_neox"} <= set(report.features)
    message = one_failure(nudges_written("values"), ROPE_CASE)
    assert "past_key_value (bit-exact" in message and "[a slot this call writes]" in message


def test_present_key_value_must_be_the_updated_cache():
    message = one_failure(returns_the_old_cache, ROPE_CASE)
    assert "present_key_value (bit-exact; the past_key_value it updated)" in message


def test_padding_rows_of_a_padded_output_are_not_compared():
    def scribbles_on_padding(**args):
        output, present = cacheattn.gpt_attention(**args, backend="reference")
        if not args["remove_input_padding"]:
            for e, n in enumerate(args["sequence_length"] - args["host_past_key_value_lengths"]):
                output[e, n:] = np.nan
        return output, present
    report = kit.check_gpt_attention(scribbles_on_padding, max_examples=FEW, seed=0, features={"paged", "padded"})
    assert "padded" in report.features


def test_a_feature_that_needs_another_is_refused_alone():
    with pytest.raises(ValueError, match="^features: fp8_context_fmha needs fp8_kv declared too"):
        kit.check_gpt_attention(reference("gpt_attention"), features={"paged", "fp8_context_fmha"})


def test_a_keyword_only_signature_missing_an_argument_is_refused():
    def the_rest_by_keyword(*, qkv, past_key_value, sequence_length, **rest):
        pass

    def positional_or_keyword(qkv, past_key_value, *rest, **attrs):
        pass

    with pytest.raises(TypeError) as info:
        kit.check_gpt_attention(lambda *, qkv: None)
    assert str(info.value).startswith("impl: expected the signature gpt_attention(*, qkv, past_key_value, ")
    assert "it does not accept the keyword argument 'past_key_value'" in str(info.value)
    for accepted in (the_rest_by_keyword, positional_or_keyword):     # every documented name by keyword
        kit._core.check_signature(kit.OPERATORS["gpt_attention"], accepted)
