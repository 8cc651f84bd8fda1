"""Bad cross_attention input raises a ValueError/TypeError naming FasterTransformer's argument, before any kernel."""

import numpy as np
import pytest

import cacheattn
from cacheattn import AttentionWeight, DenseWeight
from cacheattn.examples import FTCase, build_ft, copy_inputs
from kernels_numba import _launch

CASE = FTCase(lengths=(2, 4), mem_len=4, head_num=2, size_per_head=32, d_model=16, mem_d_model=12, dtype="float32",
              is_batch_major_cache=True, step=1, finished=(False, True), num_tasks=3, ia3_tasks=(0, 2),
              max_decoder_seq_len=2, context_buf=True, q_scaling=1.0, seed=0)
BASE = build_ft(CASE)
W = BASE["weights"]


def call(**changes):
    return {**BASE, **CASE.attrs(), **changes}


def weights(**changes):
    return W._replace(**changes)


def halve(dense):
    return DenseWeight(dense.kernel.astype(np.float16), dense.bias)


BAD = [
    ("step 0", call(step=0), ValueError, "step"),
    ("step float", call(step=1.0), TypeError, "step"),
    ("head size 40", call(size_per_head=40, key_cache=np.zeros((2, 2, 10, 4, 4), np.float32),
                          value_cache=np.zeros((2, 2, 4, 40), np.float32)), ValueError, "size_per_head"),
    ("head size 16", call(size_per_head=16), ValueError, "size_per_head"),
    ("head_num 0", call(head_num=0), ValueError, "head_num"),
    ("q_scaling 0", call(q_scaling=0.0), ValueError, "q_scaling"),
    ("is_batch_major_cache 2", call(is_batch_major_cache=2), ValueError, "is_batch_major_cache"),
    ("split key cache in the plain layout", call(is_batch_major_cache=False), ValueError, "key_cache"),
    ("plain caches, wrong heads", call(is_batch_major_cache=False, key_cache=np.zeros((2, 4, 1, 32), np.float32),
                                       value_cache=np.zeros((2, 4, 1, 32), np.float32)), ValueError, "key_cache"),
    ("key cache x", call(key_cache=BASE["key_cache"].reshape(2, 2, 4, 4, 8)), ValueError, "key_cache"),
    ("key cache plain in batch-major", call(key_cache=np.zeros((2, 4, 2, 32), np.float32)), ValueError, "key_cache"),
    ("value cache length", call(value_cache=BASE["value_cache"][:, :, :3]), ValueError, "value_cache"),
    ("value cache heads", call(value_cache=BASE["value_cache"][:, :1]), ValueError, "value_cache"),
    ("cache batch", call(key_cache=BASE["key_cache"][:1]), ValueError, "key_cache"),
    ("key cache not contiguous", call(key_cache=np.asfortranarray(BASE["key_cache"])), ValueError, "key_cache"),
    ("length 0", call(encoder_sequence_length=np.array([0, 4])), ValueError, "encoder_sequence_length"),
    ("length past mem_max_seq_len", call(encoder_sequence_length=np.array([2, 5])), ValueError,
     "encoder_sequence_length"),
    ("length shape", call(encoder_sequence_length=np.array([2])), ValueError, "encoder_sequence_length"),
    ("length float", call(encoder_sequence_length=np.array([2.0, 4.0])), TypeError, "encoder_sequence_length"),
    ("finished int", call(finished=np.array([0, 1])), TypeError, "finished"),
    ("finished shape", call(finished=np.array([True])), ValueError, "finished"),
    ("ia3 task out of range", call(ia3_tasks=np.array([0, 3])), ValueError, "ia3_tasks"),
    ("ia3 task negative", call(ia3_tasks=np.array([-1, 0])), ValueError, "ia3_tasks"),
    ("ia3 without IA3 weights", call(weights=weights(ia3_key_weight=None, ia3_value_weight=None)), ValueError,
     "ia3_tasks"),
    ("ia3 weight shape", call(weights=weights(ia3_value_weight=DenseWeight(W.ia3_value_weight.kernel[:, :32]))),
     ValueError, "weights.ia3_value_weight.kernel"),
    ("query weight shape", call(weights=weights(query_weight=DenseWeight(W.query_weight.kernel[:8], None))),
     ValueError, "weights.query_weight.kernel"),
    ("key weight shape", call(weights=weights(key_weight=DenseWeight(W.key_weight.kernel.T.copy(), None))),
     ValueError, "weights.key_weight.kernel"),
    ("value bias shape", call(weights=weights(value_weight=DenseWeight(W.value_weight.kernel,
                                                                        W.value_weight.bias[:32]))),
     ValueError, "weights.value_weight.bias"),
    ("output weight shape", call(weights=weights(attention_output_weight=DenseWeight(W.query_weight.kernel))),
     ValueError, "weights.attention_output_weight.kernel"),
    ("missing key weight", call(weights=weights(key_weight=None)), ValueError, "weights.key_weight"),
    ("input_query 1-D", call(input_query=BASE["input_query"][0]), ValueError, "input_query"),
    ("input_query float64", call(input_query=BASE["input_query"].astype(np.float64)), TypeError, "input_query"),
    ("encoder_output float16", call(encoder_output=BASE["encoder_output"].astype(np.float16)), TypeError,
     "encoder_output"),
    ("value cache float16", call(value_cache=BASE["value_cache"].astype(np.float16)), TypeError, "value_cache"),
    ("weight float16", call(weights=weights(value_weight=halve(W.value_weight))), TypeError,
     "weights.value_weight.kernel"),
    ("encoder batch", call(encoder_output=BASE["encoder_output"][:1]), ValueError, "encoder_output"),
    ("context_buf shape", call(context_buf=BASE["context_buf"][:, :32]), ValueError, "context_buf"),
    ("context_buf float16", call(context_buf=BASE["context_buf"].astype(np.float16)), TypeError, "context_buf"),
    ("cross_attentions float16", call(cross_attentions=BASE["cross_attentions"].astype(np.float16)), TypeError,
     "cross_attentions"),
    ("cross_attentions too few rows", call(step=3), ValueError, "cross_attentions"),
    ("cross_attentions length", call(cross_attentions=BASE["cross_attentions"][..., :3]), ValueError,
     "cross_attentions"),
]


@pytest.mark.spec("ft/input-query", "ft/encoder-output", "ft/encoder-lengths", "ft/finished", "ft/step",
                  "ft/caches", "ft/head-size-dispatch")
@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,args,error,param", BAD, ids=[b[0] for b in BAD])
def test_bad_cross_attention_input(name, args, error, param, backend):
    before = {k: v.copy() for k, v in args.items() if isinstance(v, np.ndarray)}
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        cacheattn.cross_attention(**args, backend=backend)
    assert launches == []
    for k, v in before.items():            # nothing ran, so nothing was written
        assert np.array_equal(args[k], v), k


def test_ia3_weights_without_tasks_are_ignored_and_the_base_call_is_valid():
    args = call(ia3_tasks=None, weights=AttentionWeight(*W[:4]))
    plain = cacheattn.cross_attention(**copy_inputs(args))
    with_weights = cacheattn.cross_attention(**copy_inputs(call(ia3_tasks=None)))
    assert plain.hidden_features.shape == (2, 16) and plain.context.shape == (2, 64)
    assert np.array_equal(plain.hidden_features, with_weights.hidden_features)


def test_weights_are_duck_typed():
    """Any object with FasterTransformer's attribute names works, not only cacheattn's NamedTuples."""
    from types import SimpleNamespace

    ns = SimpleNamespace(**{name: SimpleNamespace(kernel=d.kernel, bias=d.bias) for name, d in W._asdict().items()})
    a = cacheattn.cross_attention(**copy_inputs(call(weights=ns)))
    b = cacheattn.cross_attention(**copy_inputs(call()))
    assert np.array_equal(a.hidden_features, b.hidden_features) and np.array_equal(a.context, b.context)
