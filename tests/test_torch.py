"""torch tensors go where NumPy arrays go: CPU tensors run the reference, results come back as CPU tensors,
and in-out caches are written in place through the tensor's own memory."""

import numpy as np
import pytest

import cacheattn
from cacheattn._arrays import map_leaves
from cacheattn.examples import (
    FTCase,
    OnnxCase,
    PPLCase,
    StaticCase,
    build_ft,
    build_onnx,
    build_ppl,
    build_static,
    copy_inputs,
    float64_onnx,
    float64_ppl_attention,
    onnx_dtype,
    reference_cache_state,
)

from helpers import assert_bits_equal, assert_close

torch = pytest.importorskip("torch")

PPL = PPLCase(seqlens=(1, 3), past=(4, 2), decoding_batches=1, num_heads=4, num_kv_heads=2, head_dim=16,
              dtype="float16", quant_bit=8, quant_group=8, scale_dtype="float16", cache_layout=2, cache_mode=1,
              page_size=4, num_layer=2, layer_idx=1, is_causal=True, is_alibi=False, mask="2d", mask_pad=1, seed=3)


def tensor(x):
    """x as a CPU tensor (a copy: the NumPy run keeps its own cache); anything else stays as it is."""
    if isinstance(x, np.ndarray):
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.copy())
    return x


def as_torch(inputs: dict) -> dict:
    """The inputs as CPU tensors, inside tuples too (FasterTransformer's weights)."""
    return {name: map_leaves(tensor, x) for name, x in inputs.items()}


def as_numpy(t):
    """A CPU tensor's values as NumPy (bfloat16 through its bits), after checking it is one."""
    assert isinstance(t, torch.Tensor) and t.device.type == "cpu", type(t)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(onnx_dtype("bfloat16"))
    return t.numpy()


@pytest.mark.spec("ppl-mhca/fused")
def test_multi_head_cache_attention_takes_and_returns_cpu_tensors():
    inputs = build_ppl(PPL)
    want_inputs = copy_inputs(inputs)
    want = cacheattn.multi_head_cache_attention(**want_inputs, **PPL.attrs())
    tensors = as_torch(inputs)
    got = cacheattn.multi_head_cache_attention(**tensors, **PPL.attrs())
    assert_bits_equal("attn_output", as_numpy(got), want)
    # The cache and scale tensors were written in place, exactly as the NumPy call wrote its arrays.
    assert_bits_equal("cache", as_numpy(tensors["cache"]), want_inputs["cache"])
    assert_bits_equal("scale", as_numpy(tensors["scale"]), want_inputs["scale"])
    assert not np.array_equal(want_inputs["cache"], inputs["cache"])    # the call did store something


@pytest.mark.spec("ppl-kvc/store", "ppl-kvc/extract", "ppl-kvc/in-out")
def test_static_key_value_cache_with_cpu_tensors():
    case = StaticCase(batch=2, max_batch=3, seqlen=2, start_pos=3, max_seqlen=8, num_heads=2, head_dim=8,
                      dtype="float32", quant_bit=0, quant_group=8, num_layer=1, layer_idx=0, num_repeat=2,
                      cache_layout=1, seed=5)
    inputs = build_static(case)
    attrs = dict(num_layer=1, layer_idx=0, quant_bit=0, quant_group=8, num_repeat=2, cache_layout=1)
    want_inputs = copy_inputs(inputs)
    want = cacheattn.key_value_cache(**want_inputs, **attrs)
    tensors = as_torch(inputs)
    tensors["start_pos"] = torch.tensor([case.start_pos])          # the document's one-element tensor form
    got = cacheattn.key_value_cache(**tensors, **attrs)
    assert type(got) is cacheattn.KeyValue
    for name in ("key", "value"):
        assert_bits_equal(name, as_numpy(getattr(got, name)), getattr(want, name))
    assert_bits_equal("cache", as_numpy(tensors["cache"]), want_inputs["cache"])


@pytest.mark.spec("onnx/pattern", "onnx/types")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_onnx_attention_takes_and_returns_cpu_tensors(dtype):
    case = OnnxCase(batch=2, q_heads=4, kv_heads=2, q_len=3, kv_len=5, past_len=2, head_size=8, v_head_size=6,
                    three_d=False, dtype=dtype, mask="bool", mask_shape=(3, 6), is_causal=0, nonpad=None,
                    softcap=0.0, scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0,
                    seed=7)
    inputs = build_onnx(case)
    attrs = case.attrs()
    want = cacheattn.onnx_attention(**inputs, **attrs, return_qk_matmul_output=True)
    got = cacheattn.onnx_attention(**as_torch(inputs), **attrs, return_qk_matmul_output=True)
    assert type(got) is cacheattn.AttentionOutputs
    for name in got._fields:
        assert_bits_equal(name, as_numpy(getattr(got, name)), getattr(want, name))
    if dtype == "float32":
        assert_close("Y", as_numpy(got.Y), float64_onnx(inputs, case)[0], np.float32)


def test_cross_attention_takes_torch_weights_inside_its_weight_tuples():
    """FasterTransformer's weights come as AttentionWeight(DenseWeight(kernel, bias), ...): tensors nested in
    the tuples are converted too, and the cache written in place through the tensors' memory."""
    case = FTCase(lengths=(2, 3), mem_len=3, head_num=2, size_per_head=32, d_model=8, mem_d_model=8,
                  dtype="float32", is_batch_major_cache=True, step=1, finished=None, num_tasks=2, ia3_tasks=(1, 0),
                  max_decoder_seq_len=0, context_buf=False, q_scaling=1.0, seed=5)
    inputs = build_ft(case)
    want_inputs = copy_inputs(inputs)
    want = cacheattn.cross_attention(**want_inputs, **case.attrs())
    tensors = as_torch(inputs)
    assert isinstance(tensors["weights"].query_weight.kernel, torch.Tensor)
    got = cacheattn.cross_attention(**tensors, **case.attrs())
    assert_bits_equal("hidden_features", as_numpy(got.hidden_features), want.hidden_features)
    assert_bits_equal("key_cache", as_numpy(tensors["key_cache"]), want_inputs["key_cache"])


def test_torch_inputs_are_validated_by_document_name():
    inputs = as_torch(build_ppl(PPL))
    inputs["query"] = inputs["query"].float()            # query float32, current_key float16
    with pytest.raises(TypeError, match=r"^current_key"):
        cacheattn.multi_head_cache_attention(**inputs, **PPL.attrs())


@pytest.mark.gpu
@pytest.mark.spec("ppl-mhca/fused", "ppl-mhca/cache-in-out")
def test_multi_head_cache_attention_cuda_tensors_run_the_kernels_in_place():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    inputs = build_ppl(PPL)
    key, value, want_cache, want_scale = reference_cache_state(inputs, PPL)
    want = float64_ppl_attention(inputs, PPL, key, value)
    tensors = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in as_torch(inputs).items()}
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):                     # the kernels must follow torch's current stream
        got = cacheattn.multi_head_cache_attention(**tensors, **PPL.attrs())
    stream.synchronize()
    assert isinstance(got, torch.Tensor) and got.device == tensors["query"].device
    assert_close("attn_output", got.cpu().numpy(), want, PPL.dtype)
    assert_bits_equal("cache", tensors["cache"].cpu().numpy(), want_cache)        # written in place (DLPack view)
    assert_bits_equal("scale", tensors["scale"].cpu().numpy(), want_scale)


@pytest.mark.gpu
@pytest.mark.spec("onnx/types")
def test_onnx_attention_cuda_bfloat16_tensors_run_the_kernels_on_their_bits():
    """torch CUDA bfloat16 tensors (CuPy has no bfloat16) reach the kernels as their bits and come back as
    bfloat16 tensors on the device: Y within bfloat16's tolerance, the present tensors bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    case = OnnxCase(batch=2, q_heads=4, kv_heads=2, q_len=1, kv_len=1, past_len=5, head_size=16, v_head_size=16,
                    three_d=False, dtype="bfloat16", mask="float", mask_shape=(2, 1, 1, 6), is_causal=1, nonpad=None,
                    softcap=0.0, scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0,
                    seed=8)
    inputs = build_onnx(case)
    tensors = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in as_torch(inputs).items()}
    got = cacheattn.onnx_attention(**tensors, **case.attrs())
    assert got.Y.dtype == torch.bfloat16 and got.Y.device == tensors["Q"].device
    want = float64_onnx(inputs, case)
    assert_close("Y", as_numpy(got.Y.cpu()), want[0], case.dtype)
    assert_bits_equal("present_key", as_numpy(got.present_key.cpu()), want[1].astype(onnx_dtype("bfloat16")))
