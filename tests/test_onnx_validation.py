"""Bad ONNX Attention input raises a ValueError/TypeError naming the ONNX input or attribute, before any kernel."""

import numpy as np
import pytest

import cacheattn
from kernels_numba import _launch

rng = np.random.default_rng(0)
Q4 = rng.standard_normal((2, 4, 3, 8)).astype(np.float32)
K4 = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
V4 = rng.standard_normal((2, 2, 5, 6)).astype(np.float32)
PAST = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
PAST_V = rng.standard_normal((2, 2, 4, 6)).astype(np.float32)


def call(**changes):
    args = dict(Q=Q4, K=K4, V=V4)
    args.update(changes)
    return args


BAD = [
    ("rank mix", call(K=K4.reshape(2, 5, 16)), ValueError, "K"),
    ("2-D Q", call(Q=Q4[0, 0]), ValueError, "Q"),
    ("Q integer", call(Q=Q4.astype(np.int32)), TypeError, "Q"),
    ("V dtype", call(V=V4.astype(np.float16)), TypeError, "V"),
    ("heads not dividing", call(K=K4[:, :1].repeat(3, axis=1), V=V4[:, :1].repeat(3, axis=1)), ValueError,
     "kv_num_heads"),
    ("head size", call(K=K4[..., :4]), ValueError, "K"),
    ("V length", call(V=V4[:, :, :4]), ValueError, "V"),
    ("3-D without q_num_heads", call(Q=Q4.reshape(2, 3, 32), K=K4.reshape(2, 5, 16), V=V4.reshape(2, 5, 12),
                                     kv_num_heads=2), ValueError, "q_num_heads"),
    ("3-D hidden not divisible", call(Q=Q4.reshape(2, 3, 32), K=K4.reshape(2, 5, 16), V=V4.reshape(2, 5, 12),
                                      q_num_heads=5, kv_num_heads=2), ValueError, "Q"),
    ("4-D head attr mismatch", call(q_num_heads=3), ValueError, "q_num_heads"),
    ("mask not broadcastable", call(attn_mask=np.zeros((2, 3, 3, 5), np.float32)), ValueError, "attn_mask"),
    ("mask too long", call(attn_mask=np.zeros((3, 6), np.float32)), ValueError, "attn_mask"),
    ("mask rank 5", call(attn_mask=np.zeros((1, 2, 4, 3, 5), bool)), ValueError, "attn_mask"),
    ("mask dtype", call(attn_mask=np.zeros((3, 5), np.float16)), TypeError, "attn_mask"),
    ("past without past_value", call(past_key=PAST), ValueError, "past_value"),
    ("past_value without past_key", call(past_value=PAST_V), ValueError, "past_key"),
    ("past heads", call(past_key=PAST[:, :1], past_value=PAST_V[:, :1]), ValueError, "past_key"),
    ("nonpad with past", call(past_key=PAST, past_value=PAST_V, nonpad_kv_seqlen=np.array([3, 4])), ValueError,
     "nonpad_kv_seqlen"),
    ("nonpad at opset 23", call(nonpad_kv_seqlen=np.array([3, 4]), opset=23), ValueError, "nonpad_kv_seqlen"),
    ("nonpad too long", call(nonpad_kv_seqlen=np.array([3, 6])), ValueError, "nonpad_kv_seqlen"),
    ("nonpad shape", call(nonpad_kv_seqlen=np.array([3])), ValueError, "nonpad_kv_seqlen"),
    ("nonpad float", call(nonpad_kv_seqlen=np.array([3.0, 4.0])), TypeError, "nonpad_kv_seqlen"),
    ("mask shorter than nonpad", call(attn_mask=np.zeros((3, 2), np.float32), nonpad_kv_seqlen=np.array([3, 4])),
     ValueError, "attn_mask"),
    ("window at opset 24", call(left_window_size=2), ValueError, "left_window_size"),
    ("window below -1", call(right_window_size=-2, opset=25), ValueError, "right_window_size"),
    ("opset 22", call(opset=22), ValueError, "opset"),
    ("mode 4", call(qk_matmul_output_mode=4), ValueError, "qk_matmul_output_mode"),
    ("is_causal 2", call(is_causal=2), ValueError, "is_causal"),
    ("negative softcap", call(softcap=-1.0), ValueError, "softcap"),
    ("zero scale", call(scale=0.0), ValueError, "scale"),
    ("softmax_precision int32", call(softmax_precision=6), ValueError, "softmax_precision"),
    ("opset 25 head attrs with 4-D", call(q_num_heads=4, kv_num_heads=2, opset=25), ValueError, "q_num_heads"),
]


@pytest.mark.spec("onnx/past-together", "onnx/nonpad-no-past", "onnx/types", "onnx/num-heads-3d", "onnx/mask-shape",
                  "onnx/nonpad-mask-length", "onnx/gqa", "onnx/qk-output-modes")
@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("name,args,error,param", BAD, ids=[b[0] for b in BAD])
def test_bad_onnx_attention_input(name, args, error, param, backend):
    with _launch.recorded_launches() as launches, pytest.raises(error, match=rf"^{param}\b"):
        cacheattn.onnx_attention(**args, backend=backend)
    assert launches == []


def test_the_base_call_is_valid():
    out = cacheattn.onnx_attention(Q4, K4, V4, np.ones((3, 5), bool), nonpad_kv_seqlen=np.array([4, 5]))
    assert out.Y.shape == (2, 4, 3, 6) and out.qk_matmul_output is None


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_is_causal_takes_python_and_numpy_bools(backend):
    """ONNX's is_causal is an int attribute; a Python user writes True, which means 1 (and False 0). The flag is
    turned into 0/1 before dispatch, so the kernels need one case (the simulator is slow)."""
    q, k, v = Q4[:1], K4[:1], V4[:1]
    flags = ((True, 1), (np.True_, 1), (False, 0)) if backend == "reference" else ((True, 1),)
    for flag, same_as in flags:
        got = cacheattn.onnx_attention(q, k, v, is_causal=flag, backend=backend).Y
        np.testing.assert_array_equal(got, cacheattn.onnx_attention(q, k, v, is_causal=same_as, backend=backend).Y)
    unmasked = cacheattn.onnx_attention(q, k, v, is_causal=False).Y
    assert not np.allclose(cacheattn.onnx_attention(q, k, v, is_causal=True).Y, unmasked)
