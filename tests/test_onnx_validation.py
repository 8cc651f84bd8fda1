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


# ---- bfloat16: how it is passed, and where it cannot run ------------------------------------------------------------

def _bf16_call(dtype="bfloat16"):
    import ml_dtypes
    rng = np.random.default_rng(0)
    Q = rng.standard_normal((1, 2, 1, 8)).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    K = rng.standard_normal((1, 2, 3, 8)).astype(Q.dtype)
    return dict(Q=Q, K=K, V=K.copy())


def test_mixed_float16_and_bfloat16_names_both():
    """A float16 K beside a bfloat16 Q: a TypeError naming K and Q, with both ways to agree."""
    call = _bf16_call()
    call["K"] = call["K"].astype(np.float16)
    for backend in ("reference", "numba"):
        with pytest.raises(TypeError, match=r"^K: expected Q's dtype bfloat16, got float16: the call follows Q; "
                                            r"pass both as float16 or both as bfloat16"):
            cacheattn.onnx_attention(**call, backend=backend)


def test_bfloat16_below_sm_80_is_refused(monkeypatch):
    """The kernels round bfloat16 with cvt.rn.bf16x2.f32 (sm_80): on an older GPU (faked here) the call names Q and
    the architecture before any launch; sm_80 takes it."""
    import cacheattn._arrays as arrays
    monkeypatch.setattr(arrays, "compute_capability", lambda: (7, 5))
    with _launch.recorded_launches() as launches:
        with pytest.raises(TypeError, match=r"^Q: bfloat16 on the kernels needs a GPU of compute capability 8.0 "
                                            r"\(sm_80\) or newer, this one is 7.5 \(sm_75\)"):
            cacheattn.onnx_attention(**_bf16_call(), backend="numba")
        assert not launches
        cacheattn.onnx_attention(**_bf16_call("float16"), backend="numba")     # float16 runs on sm_75
        cacheattn.onnx_attention(**_bf16_call(), backend="reference")          # so does the reference
        monkeypatch.setattr(arrays, "compute_capability", lambda: (8, 0))
        cacheattn.onnx_attention(**_bf16_call(), backend="numba")
    assert launches


def test_uint16_names_the_bfloat16_wrapper():
    """CuPy has no bfloat16: a uint16 array is refused with the way to say it holds bfloat16 bits."""
    call = _bf16_call()
    call["Q"] = call["Q"].view(np.uint16)
    with pytest.raises(TypeError, match=r"^Q: expected dtype in .*got uint16; for bfloat16 bits on a GPU .*"
                                        r"cacheattn\.bfloat16\(x\)"):
        cacheattn.onnx_attention(**call)


class _FakeGpuArray:
    """What BFloat16Array needs of a GPU array (a NumPy array behind a CUDA array interface)."""

    def __init__(self, host):
        self.host = host
        self.dtype, self.shape, self.ndim, self.size, self.strides = (host.dtype, host.shape, host.ndim, host.size,
                                                                      host.strides)
        self.flags = host.flags
        self.__cuda_array_interface__ = dict(shape=host.shape, typestr=host.dtype.str, data=(0, False), version=3)

    def view(self, dtype):
        return _FakeGpuArray(self.host.view(dtype))

    def reshape(self, *shape):
        return _FakeGpuArray(self.host.reshape(*shape))

    def get(self):
        return self.host.copy()


def test_bfloat16_wraps_gpu_bits():
    """cacheattn.bfloat16 takes uint16 or int16 GPU bits: a bfloat16 dtype and the bits' shape for validation, the
    bits for the kernels, a NumPy bfloat16 copy from get(); float32 or NumPy arrays are refused."""
    import ml_dtypes
    host = np.array([[1.0, -2.5, 3.140625]], ml_dtypes.bfloat16)
    x = cacheattn.bfloat16(_FakeGpuArray(host.view(np.int16)))
    assert isinstance(x, cacheattn.BFloat16Array) and x.dtype == host.dtype and x.shape == (1, 3) and x.ndim == 2
    assert x.bits.dtype == np.uint16 and x.__cuda_array_interface__["typestr"] == "<u2"
    np.testing.assert_array_equal(x.get().view(np.uint16), host.view(np.uint16))
    assert x.reshape(3).shape == (3,)
    with pytest.raises(TypeError, match=r"^bits: expected the bfloat16 bits as a uint16 or int16 GPU array"):
        cacheattn.bfloat16(_FakeGpuArray(host.astype(np.float32)))
    with pytest.raises(TypeError, match=r"^bits: expected a GPU array"):
        cacheattn.bfloat16(host.view(np.uint16))
    # validation reads the wrapper like any bfloat16 tensor: a float16 K beside it names both
    Q = cacheattn.bfloat16(_FakeGpuArray(np.zeros((1, 2, 1, 8), np.uint16)))
    K = _FakeGpuArray(np.zeros((1, 2, 3, 8), np.float16))
    with pytest.raises(TypeError, match=r"^K: expected Q's dtype bfloat16, got float16"):
        cacheattn.onnx_attention(Q, K, K)
