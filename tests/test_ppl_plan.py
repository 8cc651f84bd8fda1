"""multi_head_cache_attention planned once per batch step and run once per layer: the same outputs, caches and
scales as the one call, bit for bit, on both backends; the step's errors raised by the plan, the layer's by run;
no device read per layer."""

import inspect
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from test_ppl_validation import BAD_MHCA, BASE, mhca_call

import cacheattn
import reference
from cacheattn.examples import build_ppl, copy_inputs
from cacheattn.lab import bench_host
from cacheattn.ppl import LAYER_INPUTS
from kernels_numba import _launch

from helpers import assert_bits_equal
from strategies import KERNEL, REFERENCE, ppl_cases

RUN_INPUTS = (*LAYER_INPUTS, "backend")

# BAD_MHCA cases whose fault shows only against a layer's tensors: a slot past the cache's MaxT (the plan keeps
# the step's host copies and run checks them against the cache it gets), a rung that the query's dtype or the
# kernels' shared memory at that dtype rule out (planned at the first layer of each dtype).
AT_RUN = {"page outside MaxT", "last page runs past the end", "offset past MaxT", "rung 5 with a float32 query",
          "rung 6 with a float32 query",
          "rung 5 warps' merge past shared memory", "rung 2 warps' merge past shared memory",
          "rung 4 warps' merge past shared memory"}
# Without a layer the plan cannot count current_key's rows: seqstarts' lengths there disagree with kvstarts first.
AT_PLAN_NAMING = {"seqstarts total": "kvstarts"}


def split(args):
    """(step, layer): a call's arguments as plan_multi_head_cache_attention and run take them."""
    return ({k: v for k, v in args.items() if k not in RUN_INPUTS},
            {k: v for k, v in args.items() if k in RUN_INPUTS})


def two_layers(case):
    """The arguments of layer 0 and layer 1 of one step: their own query and current key/value, one cache (and
    scale) that both layers write, each its own layer of it."""
    first = {**build_ppl(replace(case, num_layer=2, layer_idx=0)), **replace(case, num_layer=2, layer_idx=0).attrs()}
    rng = np.random.default_rng(case.seed + 1)
    fresh = {name: rng.standard_normal(first[name].shape).astype(first[name].dtype)
             for name in ("query", "current_key", "current_value")}
    return first, dict(first, **fresh, layer_idx=1)


# The simulator's cost is blocks x threads: one warp a block, and few drawn cases on the kernels.
@pytest.mark.parametrize("backend,examples", [("reference", REFERENCE // 6), ("numba", max(KERNEL // 6, 2))])
def test_plan_then_run_per_layer_is_the_one_call_bit_for_bit(backend, examples):
    """Layer 0 then layer 1 of one step through one plan: each gives the one call's output and leaves the cache
    and scale as the one call does (on the kernels layer 1 only, where the plan reuses what layer 0 prepared)."""

    @settings(max_examples=examples, deadline=None)
    @given(case=ppl_cases(max_batch=2, max_seqlen=3, max_past=5))
    def two_layers_agree(case):
        first, second = two_layers(case)
        plan = cacheattn.plan_multi_head_cache_attention(**split(first)[0] | {"threads": 32})
        for layer in (first, second):
            one_call = copy_inputs(layer)
            got = plan.run(**split(layer)[1], backend=backend)
            if layer is first and backend == "numba":
                continue                                    # the same lines on fresh arrays: a launch spared
            document = copy_inputs(one_call)
            want = cacheattn.multi_head_cache_attention(**one_call, backend=backend, threads=32)
            assert_bits_equal("attn_output", got, want)
            for name in ("cache", "scale"):
                if layer[name] is not None:
                    assert_bits_equal(name, layer[name], one_call[name])
            if backend == "reference":
                # Apart from the lines the two paths share: the document's NumPy code, this layer's index.
                assert_bits_equal("attn_output", got, reference.multi_head_cache_attention(**document))
                assert all(layer[k] is None or layer[k].tobytes() == document[k].tobytes() for k in ("cache", "scale"))
    two_layers_agree()


@pytest.mark.parametrize("name,mutate,error,param,case", BAD_MHCA, ids=[b[0] for b in BAD_MHCA])
def test_the_steps_errors_are_raised_by_the_plan(name, mutate, error, param, case):
    """Every bad-input case of multi_head_cache_attention fails the same way, naming the same argument: at plan
    time when the argument is the step's, in run when it is the layer's (or shows only against the layer's
    tensors); before any launch, the cache untouched."""
    inputs, attrs = mhca_call(mutate, case)
    step, layer = split({**inputs, **attrs})
    param = AT_PLAN_NAMING.get(name, param)
    before = {k: layer[k].copy() for k in ("cache", "scale") if layer.get(k) is not None}
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        plan = cacheattn.plan_multi_head_cache_attention(**step)
        assert param in RUN_INPUTS or name in AT_RUN, "the plan accepted a bad step"
        plan.run(**{"backend": "numba", **layer})
    assert launches == [] and all(before[k].tobytes() == layer[k].tobytes() for k in before)


def test_run_reads_nothing_back_from_the_device():
    """With the step's index tensors on the device (counted as bench --host counts them), the plan reads each back
    once and run reads none, layer after layer."""
    case = next(c for c in bench_host.host_cases(batch=2, context=8) if c.operator == "multi_head_cache_attention")
    step, layer = split(bench_host._on_device(case, gpu=False))
    with _launch.recorded_launches() as launches:
        counting, plan_reads = bench_host._counting_reads()
        with counting:
            plan = cacheattn.plan_multi_head_cache_attention(**step)
        counting, run_reads = bench_host._counting_reads()
        with counting:
            for _ in range(3):
                plan.run(**layer, backend="numba")
    assert plan_reads[0] == len(case.device_index) and run_reads[0] == 0 and len(launches) == 3 * 2


def _fewer_rows(args):
    return dict(current_key=args["current_key"][:-1], current_value=args["current_value"][:-1])


WRONG_LAYER = [
    ("current key/value of another step's tokens", _fewer_rows, "current_key"),
    ("query of other heads", lambda a: dict(query=a["query"][:, :2]), "query"),
    ("current_value of another dtype", lambda a: dict(current_value=a["current_value"].astype(np.float32)),
     "current_value"),
    ("cache of other kv heads", lambda a: dict(cache=a["cache"][:, :, :, :1]), "cache"),
    ("scale left out", lambda a: dict(scale=None), "scale"),
    ("layer outside the cache", lambda a: dict(layer_idx=2), "layer_idx"),
    ("attn_mask of fewer keys", lambda a: dict(attn_mask=a["attn_mask"][..., :4]), "attn_mask"),
    # The step's pages lie past a smaller cache's MaxT: named after the table, as the one call names it.
    ("cache of too few slots", lambda a: dict(cache=a["cache"][:, :4], scale=a["scale"][:, :4]), "cachestarts"),
]


@pytest.mark.parametrize("name,change,param", WRONG_LAYER, ids=[w[0] for w in WRONG_LAYER])
def test_a_layer_input_that_does_not_fit_the_plan_is_refused_naming_it(name, change, param):
    step, layer = split({**build_ppl(BASE), **BASE.attrs()})
    plan = cacheattn.plan_multi_head_cache_attention(**step)
    before = {k: layer[k].copy() for k in ("cache", "scale")}
    with _launch.recorded_launches() as launches, pytest.raises((ValueError, TypeError), match=rf"^{param}\b"):
        plan.run(**dict(layer, **change(layer)), backend="numba")
    assert launches == [] and all(before[k].tobytes() == layer[k].tobytes() for k in before)


def test_plan_takes_the_one_calls_step_arguments():
    """plan_multi_head_cache_attention's signature is multi_head_cache_attention's without the layer's inputs and
    backend, in its order and with its defaults; run's parameters are exactly those inputs and backend."""
    full = inspect.signature(cacheattn.multi_head_cache_attention).parameters
    planned = inspect.signature(cacheattn.plan_multi_head_cache_attention).parameters
    assert list(planned) == [k for k in full if k not in RUN_INPUTS]
    assert all(planned[k].default == full[k].default and planned[k].kind == full[k].kind for k in planned)
    run = inspect.signature(cacheattn.MultiHeadCacheAttentionPlan.run).parameters
    assert [k for k in run if k != "self"] == [k for k in full if k in RUN_INPUTS]
    with pytest.raises(TypeError):
        cacheattn.plan_multi_head_cache_attention(**split({**build_ppl(BASE), **BASE.attrs()})[0], query=None)
