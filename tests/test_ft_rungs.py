"""FasterTransformer cross attention on the kernel ladder's rungs 3 and 4: step 1 (which writes the caches) and a later
step (which only reads them), forced and by the plan's default, against a float64 evaluation; the launch keywords'
validation; the fallback to rung 1 where 16-byte loads cannot serve a call."""

import numpy as np
import pytest

import cacheattn
from kernels_numba import _launch

from helpers import assert_bits_equal, assert_close
from strategies import FTCase, build_ft, copy_inputs, float64_ft, with_

# Lengths that differ per entry and are not multiples of a block's key step (4 keys at one warp: float16 at head size
# 48, 6 chunks on 8 lanes; float32 at 32), a finished entry between them; float16 on the split key cache, float32
# plain. One head keeps the simulator's blocks few; rung 4's two splits still walk several steps each.
CASES = {dtype: FTCase(lengths=(17, 6, 11), mem_len=19, head_num=1, size_per_head=size, d_model=16, mem_d_model=12,
                       dtype=dtype, is_batch_major_cache=major, step=1, finished=(False, True, False), num_tasks=0,
                       ia3_tasks=None, max_decoder_seq_len=2, context_buf=True, q_scaling=0.75, seed=seed)
         for dtype, size, major, seed in (("float16", 48, True, 5), ("float32", 32, False, 6))}
# The default: 2 blocks for 132 SMs, but 19 keys do not pay for a split's combine launch: rung 3, unsplit.
LAUNCHES = {"default": ({}, ("vector_attention_kernel",)),
            "rung 3": ({"rung": 3}, ("vector_attention_kernel",)),
            "rung 4": ({"rung": 4, "num_splits": 2}, ("vector_attention_kernel", "combine_kernel"))}


def attend(x, case, **launch):
    """One kernel call on x (written in place), running rows of context_buf poisoned first: (outputs, the names
    of the kernels it launches after the query bias, in order, as a recorded call lists them)."""
    with _launch.recorded_launches() as launched:            # records instead of launching: x stays as it is
        cacheattn.cross_attention(**x, **case.attrs(), backend="numba", threads=32, **launch)
    names = [kernel.py_func.__name__ for kernel, _ in launched]
    x["context_buf"][~np.asarray(case.finished)] = np.nan
    out = cacheattn.cross_attention(**x, **case.attrs(), backend="numba", threads=32, **launch)
    return out, tuple(names[names.index("query_bias_kernel") + 1:])


def check_step(x, before, case, out):
    """context and hidden_features close to the float64 evaluation of the same inputs; the finished entry's
    context row as it was."""
    hidden, context, *_ = float64_ft(copy_inputs(before), case)
    running = ~np.asarray(case.finished)
    assert_close("context", out.context[running], context[running], case.dtype, scale=2.0)
    assert_close("hidden_features", out.hidden_features[running], hidden[running], case.dtype, scale=4.0)
    assert_bits_equal("context_buf (finished)", x["context_buf"][~running], before["context_buf"][~running])


@pytest.mark.parametrize("dtype", CASES)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_steps_on_rungs_3_and_4(dtype, launch):
    case = CASES[dtype]
    keywords, kernels = LAUNCHES[launch]
    inputs = build_ft(case)
    # Step 1: the caches as the reference writes them, bit for bit; the attention on the rung asked for.
    x = copy_inputs(inputs)
    before = copy_inputs(x)
    out, launched = attend(x, case, **keywords)
    assert launched == kernels + ("probs_kernel",)
    reference_state = copy_inputs(inputs)
    cacheattn.cross_attention(**reference_state, **case.attrs(), backend="reference")
    for name in ("key_cache", "value_cache"):
        assert_bits_equal(name, x[name], reference_state[name])
    check_step(x, before, case, out)
    # Step 2: a new query over the cache alone (the encoder output is noise now), caches unchanged.
    later = with_(case, step=2)
    rng = np.random.default_rng(case.seed)
    y = dict(copy_inputs(x), step=2, input_query=rng.standard_normal(x["input_query"].shape).astype(dtype),
             encoder_output=(rng.standard_normal(x["encoder_output"].shape) * 100).astype(dtype))
    before = copy_inputs(y)
    out, launched = attend(y, later, **keywords)
    assert launched == kernels + ("probs_kernel",)
    for name in ("key_cache", "value_cache"):
        assert_bits_equal(f"{name} at step 2", y[name], x[name])
    check_step(y, before, later, out)


def test_an_unaligned_cache_falls_back_to_rung_1():
    """A value cache one element past a 16-byte boundary: the plan says why, and the call runs on rung 1."""
    case = with_(CASES["float16"], max_decoder_seq_len=0)
    x = build_ft(case)
    shifted = np.empty(x["value_cache"].size + 1, x["value_cache"].dtype)[1:].reshape(x["value_cache"].shape)
    shifted[...] = x["value_cache"]
    x["value_cache"] = shifted
    chosen = cacheattn.ft.kernel_plan(x["encoder_sequence_length"], x["key_cache"], shifted, x["finished"],
                                      head_num=case.head_num, size_per_head=case.size_per_head, rung=3, threads=32)
    assert (chosen.rung, chosen.reason) == (1, "fallback to shared-memory tiles: value_cache does not start on a "
                                               "16-byte boundary")
    before = copy_inputs(x)
    out, launched = attend(x, case, rung=3)
    assert launched == ("attention_kernel",)
    check_step(x, before, case, out)


@pytest.mark.parametrize("launch, name", [
    (dict(rung=2), "rung"), (dict(rung=5), "rung"), (dict(rung=True), "rung"),
    (dict(rung=3, num_splits=2), "num_splits"), (dict(rung=1, num_splits=2), "num_splits"),
    (dict(num_splits=0), "num_splits"), (dict(num_splits=65), "num_splits"),
    (dict(rung=3, threads=48), "threads"), (dict(rung=4, threads=16), "threads"), (dict(threads=0), "threads"),
    (dict(threads=2048), "threads")])
def test_bad_launch_keywords_are_refused_on_either_backend(launch, name):
    case = CASES["float32"]
    x = build_ft(case)
    before = copy_inputs(x)
    with pytest.raises(ValueError, match=f"^{name}: "):
        cacheattn.cross_attention(**x, **case.attrs(), **launch)          # NumPy: the reference backend
    for key in ("key_cache", "value_cache", "context_buf", "cross_attentions"):
        assert_bits_equal(key, x[key], before[key])                         # nothing written
