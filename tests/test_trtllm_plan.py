"""gpt_attention planned once per batch step and run once per layer: the same outputs and caches as the one call,
bit for bit, on both backends; the step's errors raised by the plan, the layer's by run; no device read per layer."""

import inspect
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from test_trtllm_validation import BAD, BASE, PAGED

import cacheattn
from cacheattn.examples import build_trt, copy_inputs
from cacheattn.lab import bench_host
from cacheattn.trtllm import LAYER_INPUTS
from kernels_numba import _launch

from helpers import assert_bits_equal
from strategies import KERNEL, REFERENCE, trt_cases

# BAD cases whose fault shows only under a layer's window or against a layer's pool: the plan keeps the step's host
# copies and checks them at the first layer with that window (a step may list windows of layers a model lacks).
AT_FIRST_LAYER = {"block offset outside the pool", "negative block offset", "too few blocks",
                  "longer than a non-cyclic cache", "beam search past the window", "window not above the sinks"}


def split(args):
    """(step, layer): a call's arguments as plan_gpt_attention and run take them."""
    return ({k: v for k, v in args.items() if k not in LAYER_INPUTS},
            {k: v for k, v in args.items() if k in LAYER_INPUTS})


def two_layers(case):
    """The arguments of layer 0 and layer 1 of one step: their own qkv, layer 1 its own cache (contiguous) or its
    layer of the pool it shares with layer 0 (paged)."""
    first = build_trt(replace(case, num_layers=2, layer_idx=0))
    rng = np.random.default_rng(case.seed + 1)
    second = dict(first, layer_idx=1, qkv=rng.standard_normal(first["qkv"].shape).astype(first["qkv"].dtype))
    if first["past_key_value"] is not None:
        second["past_key_value"] = np.ascontiguousarray(first["past_key_value"][:, :, :, ::-1])
    return first, second


# The simulator's cost is blocks x threads: one warp a block, and few drawn cases on the kernels.
@pytest.mark.parametrize("backend,examples", [("reference", REFERENCE // 3), ("numba", max(KERNEL // 6, 2))])
def test_plan_then_run_per_layer_is_the_one_call_bit_for_bit(backend, examples):
    """Layer 0 then layer 1 of one step through one plan: each gives the one call's output and leaves the cache
    as the one call does (on the kernels layer 1 only, where the plan reuses what layer 0 prepared)."""

    @settings(max_examples=examples, deadline=None)
    @given(case=trt_cases(streaming=(False, True), cross=(False, True)))
    def two_layers_agree(case):
        first, second = two_layers(case)
        plan = cacheattn.plan_gpt_attention(**split(first)[0], threads=32)
        for layer in (first, second):
            one_call = copy_inputs(layer)
            got, present = plan.run(**split(layer)[1], backend=backend)
            if layer is first and backend == "numba":
                continue                                    # the same lines on fresh arrays: a launch spared
            want, _ = cacheattn.gpt_attention(**one_call, backend=backend, threads=32)
            assert_bits_equal("output", got, want)
            for name in ("past_key_value", "kv_cache_pool"):
                if layer.get(name) is not None:
                    assert_bits_equal(name, layer[name], one_call[name])
            assert present is layer["past_key_value"]
    two_layers_agree()


@pytest.mark.parametrize("name,args,error,param", BAD, ids=[b[0] for b in BAD])
def test_the_steps_errors_are_raised_by_the_plan(name, args, error, param):
    """Every bad-input case of gpt_attention fails the same way, naming the same argument: at plan time when the
    argument is the step's, in run when it is the layer's (or shows only under the layer's window or pool); before
    any launch."""
    step, layer = split(args)
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        plan = cacheattn.plan_gpt_attention(**step)
        assert param in LAYER_INPUTS or name in AT_FIRST_LAYER, "the plan accepted a bad step"
        plan.run(**layer, backend="numba")
    assert launches == []


def test_run_reads_nothing_back_from_the_device():
    """With the step's index tensors on the device (counted as bench --host counts them), the plan reads each back
    once and run reads none, layer after layer."""
    case = bench_host.host_cases(batch=2, context=8)[2]
    step, layer = split(bench_host._on_device(case, gpu=False))
    with _launch.recorded_launches() as launches:
        counting, plan_reads = bench_host._counting_reads()
        with counting:
            plan = cacheattn.plan_gpt_attention(**step)
        counting, run_reads = bench_host._counting_reads()
        with counting:
            for layer_idx in (0, 0, 0):
                plan.run(**dict(layer, layer_idx=layer_idx), backend="numba")
    assert plan_reads[0] == len(case.device_index) and run_reads[0] == 0 and len(launches) == 3 * 2


WRONG_LAYER = [
    ("qkv of another step's tokens", BASE, lambda a: dict(qkv=a["qkv"][:-1]), "qkv"),
    ("qkv of other heads", BASE, lambda a: dict(qkv=a["qkv"][:, :-8]), "qkv"),
    ("qkv of another dtype", BASE, lambda a: dict(qkv=a["qkv"].astype(np.float16)), "past_key_value"),
    ("cache of too few slots", BASE, lambda a: dict(past_key_value=a["past_key_value"][:, :, :, :2]), "past_key_value"),
    ("pool of other heads", PAGED, lambda a: dict(kv_cache_pool=a["kv_cache_pool"][:, :, :, :1]), "kv_cache_pool"),
    ("layer outside the pool", PAGED, lambda a: dict(layer_idx=2), "layer_idx"),
    ("qkv_bias of another width", BASE, lambda a: dict(qkv_bias=np.ones(8, np.float32)), "qkv_bias"),
]


@pytest.mark.parametrize("name,case,change,param", WRONG_LAYER, ids=[w[0] for w in WRONG_LAYER])
def test_a_layer_input_that_does_not_fit_the_plan_is_refused_naming_it(name, case, change, param):
    args = build_trt(case)
    step, layer = split(args)
    plan = cacheattn.plan_gpt_attention(**step)
    before = {k: layer[k].copy() for k in ("past_key_value", "kv_cache_pool") if layer.get(k) is not None}
    with _launch.recorded_launches() as launches, pytest.raises((ValueError, TypeError), match=rf"^{param}\b"):
        plan.run(**dict(layer, **change(layer)), backend="numba")
    assert launches == [] and all(before[k].tobytes() == layer[k].tobytes() for k in before)


def test_plan_takes_gpt_attentions_step_arguments():
    """plan_gpt_attention's signature is gpt_attention's without the layer's inputs and backend; run's keywords are
    exactly those inputs and backend."""
    full = inspect.signature(cacheattn.gpt_attention).parameters
    planned = inspect.signature(cacheattn.plan_gpt_attention).parameters
    assert list(planned) == [k for k in full if k not in LAYER_INPUTS and k != "backend"]
    assert all(planned[k].default == full[k].default for k in planned)
    run = inspect.signature(cacheattn.GptAttentionPlan.run).parameters
    assert sorted(k for k in run if k != "self") == sorted((*LAYER_INPUTS, "backend"))
    with pytest.raises(TypeError):
        cacheattn.plan_gpt_attention(**split(build_trt(BASE))[0], qkv=None)


@pytest.mark.parametrize("change,rung,why", [
    (dict(beam_width=2), 5, "slot map (2 beams' cache_indirection)"),
    (dict(sinks=4, streamingllm=True), 5, "slot map (4 sink tokens)"),
    (dict(window=24, capacity=24), 5, "slot map (a sequence past the cyclic window of 24)"),
    (dict(mask_type=0, encoder_lengths=(30,)), 5, "mma's registers"),
    (dict(sinks=4, streamingllm=True, position=1, rotary_dim=8), 3, "does not serve it: StreamingLLM with RoPE")])
def test_plan_says_which_generation_cases_take_rung_5(change, rung, why):
    """Beams, sink tokens and a wrapped cyclic window take rung 5's decode kernel through its slot map, cross
    attention without one; StreamingLLM with RoPE stays on rung 3 (or 4), and the plan says why. The launches are
    recorded, not run."""
    base = dict(contexts=(), generations=((3, 40),), beam_width=1, num_heads=4, num_kv_heads=2, head_size=32,
                dtype="float16", capacity=48, window=48, tokens_per_block=16, num_layers=1, layer_idx=0)
    case = replace(PAGED, **{**base, **change})
    step, layer = split(build_trt(case))
    plan = cacheattn.plan_gpt_attention(**step)
    with _launch.recorded_launches():
        plan.run(**layer, backend="numba")
    line = [x for x in repr(plan).splitlines() if x.lstrip().startswith("generation")][0]
    assert why in line and ("slot map" in line) == ("slot map" in why), line
    if rung == 5:
        assert ": rung 5," in line and "rung 5's decode kernel:" in line, line
    else:                                # rung 4 where multi-block mode splits the one sequence's keys
        assert ": rung 3," in line or ": rung 4," in line, line
