"""python -m cacheattn tour: a tiny LLM served end to end, then every implemented operator on its own.

First a serving loop (`cacheattn.serving`): a seeded random decoder-only model serves several prompts
with in-flight batching through `multi_head_cache_attention` on a paged int8 cache, on the reference and
on the kernels, every step's attention checked against float64, and the greedy tokens of the two runs
compared. Then every implemented operator, on the reference and on the kernels, for a handful of
realistic configurations, each compared with a float64 evaluation of the reference.

Attention outputs are compared with float64 at the dtype's tolerance. A cache-only operator (KeyValueCache) has
no attention output: its reference row compares the tokens it stored with the input tokens, within half a
quantization step, and its kernel row the kernel's cache with the reference's, to the bit. The legend printed
under the table says the same. On a machine without a GPU
the kernels run in numba's CUDA simulator, which is slow, so by default the serving model has one layer and
every configuration runs on smaller shapes (head dims of at most 16, at most 6 cached tokens per request);
`--full` runs two layers and the shapes the labels name (several minutes in the simulator, instant on a
GPU), and `--quick` (what the test suite runs) serves three short requests and runs the first configuration
of each operator on the smaller shapes.
"""

from __future__ import annotations

import time

import numpy as np

import cacheattn

from . import _console, serving
from .examples import (
    FTCase,
    OnnxCase,
    PPLCase,
    StaticCase,
    TrtCase,
    build_ft,
    build_onnx,
    build_ppl,
    build_static,
    build_trt,
    copy_inputs,
    float64_ft,
    float64_onnx,
    float64_ppl_attention,
    float64_trt,
    reference_cache_state,
    with_,
    within_tolerance,
)

ATTENTION_CASES = {
    "decode x4, GQA 8/2, Dh 64, paged int8 (page 16), fp16": PPLCase(
        seqlens=(1, 1, 1, 1), past=(17, 33, 5, 48), decoding_batches=4, num_heads=8, num_kv_heads=2, head_dim=64,
        dtype="float16", quant_bit=8, quant_group=8, scale_dtype="float16", cache_layout=0, cache_mode=1,
        page_size=16, num_layer=2, layer_idx=1, is_causal=True, is_alibi=False, mask="none", mask_pad=0, seed=1),
    "2 decode + 1 chunked prefill (12 after 20), ALiBi, fp32 offset cache L2": PPLCase(
        seqlens=(1, 1, 12), past=(9, 30, 20), decoding_batches=2, num_heads=4, num_kv_heads=4, head_dim=32,
        dtype="float32", quant_bit=0, quant_group=8, scale_dtype="float32", cache_layout=2, cache_mode=0,
        page_size=128, num_layer=1, layer_idx=0, is_causal=True, is_alibi=True, mask="none", mask_pad=0, seed=2),
    "prefill 2x9, MQA 4/1, int4 group 16, 3-D mask padded, fp16 layout 3": PPLCase(
        seqlens=(9, 9), past=(0, 4), decoding_batches=0, num_heads=4, num_kv_heads=1, head_dim=32,
        dtype="float16", quant_bit=4, quant_group=16, scale_dtype="float32", cache_layout=3, cache_mode=1,
        page_size=8, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False, mask="3d", mask_pad=5, seed=3),
}

STATIC_CASE = ("B 2, 4 new after 12, 4 heads x2 repeat, int8 layout 1, fp16", StaticCase(
    batch=2, max_batch=3, seqlen=4, start_pos=12, max_seqlen=20, num_heads=4, head_dim=64, dtype="float16",
    quant_bit=8, quant_group=8, num_layer=2, layer_idx=1, num_repeat=2, cache_layout=1, seed=4))


def _launch(backend):
    """Keyword arguments for a call on `backend`: under the simulator, whose cost is per thread, 32-thread blocks
    (every strided loop of a block then wraps more, not less); on a GPU the launchers' defaults."""
    from numba import config
    return {"threads": 32} if backend == "numba" and config.ENABLE_CUDASIM else {}


def _max_error(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)), initial=0.0))


def _close(got, want, dtype):
    return bool(np.all(within_tolerance(got, want, dtype)))


def _attention_rows(label, case, backends=("reference", "numba")):
    inputs = build_ppl(case)
    key, value, want_cache, _ = reference_cache_state(inputs, case)
    want = float64_ppl_attention(inputs, case, key, value)
    rows = []
    for backend in backends:
        x = copy_inputs(inputs)
        out, seconds = _timed(cacheattn.multi_head_cache_attention, **x, **case.attrs(), backend=backend,
                              **_launch(backend))
        ok = _close(out, want, case.dtype) and np.array_equal(x["cache"], want_cache)
        rows.append(("multi_head_cache_attention", label, backend, _max_error(out, want), ok, seconds))
    return rows


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def _dynamic_attention_rows(label, case, backends=("reference", "numba")):
    """dynamic_batching.MultiHeadAttention alone, on the key/value the cache holds."""
    inputs = build_ppl(case)
    key, value, _, _ = reference_cache_state(inputs, case)
    want = float64_ppl_attention(inputs, case, key, value)
    attrs = dict(num_heads=case.num_heads, head_dim=case.head_dim, is_causal=case.is_causal,
                 is_alibi=case.is_alibi, num_kv_heads=case.num_kv_heads)
    args = (inputs["query"], key, value, inputs["seqstarts"], inputs["kvstarts"], case.decoding_batches,
            inputs["max_seqlen"], inputs["max_kvlen"], inputs["attn_mask"])
    rows = []
    for backend in backends:
        out, seconds = _timed(cacheattn.dynamic_multi_head_attention, *args, **attrs, backend=backend,
                              **_launch(backend))
        rows.append(("dynamic_multi_head_attention", label, backend, _max_error(out, want),
                     _close(out, want, case.dtype), seconds))
    return rows


def _quantization_bound(current, case):
    """Half a quantization step plus the input dtype's roundings: the most a stored token may move."""
    x = np.abs(current.astype(np.float64))
    u = 2.0**-11 if np.dtype(case.dtype) == np.float16 else 2.0**-24
    if not case.quant_bit:
        return 2 * u * x
    qmax = {8: 127, 4: 7}[case.quant_bit]
    absmax = x.reshape(*x.shape[:-1], -1, case.quant_group).max(-1)
    step = np.repeat(np.maximum(absmax / qmax, 1e-5), case.quant_group, axis=-1)
    return step * (0.5 + 2 * u * qmax) + 2 * u * x


def _key_value_rows(label, case, backends=("reference", "numba")):
    """Static KeyValueCache: the reference against the exact inputs (the stored tokens come back within the
    quantization bound), the kernels against the reference to the bit (dequantization is specified exactly)."""
    inputs = build_static(case)
    attrs = dict(num_layer=case.num_layer, layer_idx=case.layer_idx, quant_bit=case.quant_bit,
                 quant_group=case.quant_group, num_repeat=case.num_repeat, cache_layout=case.cache_layout)
    x, y = copy_inputs(inputs), copy_inputs(inputs)
    want, ref_seconds = _timed(cacheattn.key_value_cache, **x, **attrs, backend="reference")
    new = slice(case.start_pos, case.start_pos + case.seqlen)
    ref_err, ref_ok = 0.0, True
    for name, out in zip(("current_key", "current_value"), want):
        stored = out[:, new, ::case.num_repeat].astype(np.float64)
        exact = inputs[name].astype(np.float64)
        ref_err = max(ref_err, _max_error(stored, exact))
        ref_ok &= bool(np.all(np.abs(stored - exact) <= _quantization_bound(inputs[name], case)))
    rows = [("key_value_cache", label + " (vs input)", "reference", ref_err, ref_ok, ref_seconds)]
    if "numba" not in backends:
        return rows
    got, seconds = _timed(cacheattn.key_value_cache, **y, **attrs, backend="numba", **_launch("numba"))
    ok = all(np.array_equal(a, b) for a, b in zip(got, want)) and np.array_equal(x["cache"], y["cache"])
    return rows + [("key_value_cache", label + " (vs reference)", "numba",
                    max(_max_error(a, b) for a, b in zip(got, want)), ok, seconds)]


ONNX_CASES = {
    "opset 24 decode with past (11), GQA 8/2, causal, fp16 4-D": OnnxCase(
        batch=2, q_heads=8, kv_heads=2, q_len=1, kv_len=1, past_len=11, head_size=32, v_head_size=32,
        three_d=False, dtype="float16", mask="none", mask_shape=(), is_causal=1, nonpad=None, softcap=0.0,
        scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0, seed=5),
    "opset 24 external cache, nonpad (5, 9), bool mask, softcap 30, fp32 3-D": OnnxCase(
        batch=2, q_heads=4, kv_heads=4, q_len=3, kv_len=12, past_len=0, head_size=32, v_head_size=16,
        three_d=True, dtype="float32", mask="bool", mask_shape=(1, 3, 12), is_causal=1, nonpad=(5, 9),
        softcap=30.0, scale=None, left_window_size=-1, right_window_size=-1, qk_matmul_output_mode=0, seed=6),
    "opset 25 sliding window 4, padded float mask, qk mode 3, fp32": OnnxCase(
        batch=1, q_heads=2, kv_heads=1, q_len=6, kv_len=6, past_len=4, head_size=16, v_head_size=16,
        three_d=False, dtype="float32", mask="float", mask_shape=(6, 7), is_causal=1, nonpad=None, softcap=0.0,
        scale=0.1, left_window_size=4, right_window_size=-1, qk_matmul_output_mode=3, seed=7),
}


def _onnx_rows(label, case, backends=("reference", "numba")):
    inputs = build_onnx(case)
    want = float64_onnx(inputs, case)
    rows = []
    for backend in backends:
        got, seconds = _timed(cacheattn.onnx_attention, **inputs, **case.attrs(), return_qk_matmul_output=True,
                              backend=backend, **_launch(backend))
        ok = _close(got.Y, want[0], case.dtype)
        rows.append(("onnx_attention", label, backend, _max_error(got.Y, want[0]), ok, seconds))
    return rows


FT_CASES = {
    "step 1 (fill + bias), B3, 4 heads x 64, batch-major K, IA3, 1 finished, fp16": FTCase(
        lengths=(9, 4, 12), mem_len=12, head_num=4, size_per_head=64, d_model=96, mem_d_model=80, dtype="float16",
        is_batch_major_cache=True, step=1, finished=(False, True, False), num_tasks=2, ia3_tasks=(1, 0, 1),
        max_decoder_seq_len=4, context_buf=True, q_scaling=1.0, seed=8),
    "step 3 (reads the cache), B2, 4 heads x 48, plain layout, q_scaling 2, fp32": FTCase(
        lengths=(7, 13), mem_len=13, head_num=4, size_per_head=48, d_model=64, mem_d_model=64, dtype="float32",
        is_batch_major_cache=False, step=3, finished=None, num_tasks=0, ia3_tasks=None, max_decoder_seq_len=0,
        context_buf=False, q_scaling=2.0, seed=9),
}


def _ft_rows(label, case, backends=("reference", "numba")):
    """FasterTransformer cross attention: context (scale 2) and hidden_features (scale 4, after the output GEMM)
    within the dtype's tolerance of float64, as tests/test_ft_properties.py holds them."""
    inputs = build_ft(case)
    want_hidden, want_context, *_ = float64_ft(copy_inputs(inputs), case)
    rows = []
    for backend in backends:
        # The launchers' block size: its step-1 layout kernel strides by block, and 32 threads cost 7x here.
        got, seconds = _timed(cacheattn.cross_attention, **copy_inputs(inputs), **case.attrs(), backend=backend)
        ok = (bool(np.all(within_tolerance(got.context, want_context, case.dtype, 2.0)))
              and bool(np.all(within_tolerance(got.hidden_features, want_hidden, case.dtype, 4.0))))
        rows.append(("cross_attention", label, backend, _max_error(got.hidden_features, want_hidden), ok, seconds))
    return rows


TRT_CASES = {
    "in-flight chunk + 2 beams, GQA 8/2, paged INT8 pool layer 1, NeoX RoPE, fp16": TrtCase(
        contexts=((4, 5),), generations=((6, 9),), beam_width=2, num_heads=8, num_kv_heads=2, head_size=32,
        dtype="float16", capacity=16, window=16, paged=True, tokens_per_block=4, quant=64, position=2, rotary_dim=32,
        num_layers=2, layer_idx=1, seed=10),
    "StreamingLLM: 2 sinks, window 8, cyclic contiguous FP8 cache, GPT-J RoPE, fp32": TrtCase(
        contexts=((0, 6),), generations=((4, 11),), beam_width=1, num_heads=4, num_kv_heads=4, head_size=16,
        dtype="float32", capacity=8, window=8, sinks=2, streamingllm=True, quant=128, position=1, rotary_dim=16,
        seed=11),
}


def _trt_rows(label, case, backends=("reference", "numba")):
    """TensorRT-LLM gpt_attention: the output within 4x the dtype's tolerance of float64 (both backends round Q/K to
    the input dtype after bias and RoPE, as tests/test_trtllm_kernels.py holds them)."""
    inputs = build_trt(case)
    want, _ = float64_trt(copy_inputs(inputs))
    rows = []
    for backend in backends:
        (out, _), seconds = _timed(cacheattn.gpt_attention, **copy_inputs(inputs), backend=backend,
                                   **_launch(backend))
        ok = bool(np.all(within_tolerance(out, want, case.dtype, 4.0)))
        rows.append(("gpt_attention", label, backend, _max_error(out, want), ok, seconds))
    return rows


QUICK_HEAD_DIM, QUICK_PAST = 16, 6


def _quick(case):
    """The case on smaller shapes: every configuration choice (quantization, layout, GQA, masks, phases) kept,
    head dims cut to QUICK_HEAD_DIM and cached tokens to QUICK_PAST, so the simulator runs it in seconds."""
    if isinstance(case, PPLCase):
        head_dim = min(case.head_dim, QUICK_HEAD_DIM)
        return with_(case, head_dim=head_dim, past=tuple(min(p, QUICK_PAST) for p in case.past),
                     seqlens=tuple(min(s, QUICK_PAST) for s in case.seqlens),
                     quant_group=min(case.quant_group, head_dim))
    if isinstance(case, FTCase):                  # head sizes are FasterTransformer's list: keep the smallest
        return with_(case, size_per_head=min(case.size_per_head, 32 if case.size_per_head % 32 == 0 else 48),
                     mem_len=min(case.mem_len, 2 * QUICK_PAST),
                     lengths=tuple(min(n, 2 * QUICK_PAST) for n in case.lengths))
    if isinstance(case, TrtCase):
        return with_(case, head_size=min(case.head_size, QUICK_HEAD_DIM),
                     rotary_dim=min(case.rotary_dim, QUICK_HEAD_DIM))
    if isinstance(case, StaticCase):
        return with_(case, head_dim=min(case.head_dim, QUICK_HEAD_DIM), start_pos=min(case.start_pos, QUICK_PAST),
                     max_seqlen=min(case.start_pos, QUICK_PAST) + case.seqlen)
    past = min(case.past_len, QUICK_PAST)
    return with_(case, head_size=min(case.head_size, QUICK_HEAD_DIM),
                 v_head_size=min(case.v_head_size, QUICK_HEAD_DIM), past_len=past,
                 mask_shape=case.mask_shape[:-1] + (min(case.mask_shape[-1], past + case.kv_len),)
                 if case.mask_shape else ())


def _serving_rows(quick: bool, full: bool, backends, cache_bits: int):
    """The serving loop for each operator and backend: (operator, backend, requests, tokens, steps, peak pages,
    max err, tokens equal the reference backend's, passed, seconds)."""
    model = serving.TinyModel(serving.ModelConfig(num_layers=2 if full else 1))
    requests = serving.QUICK_REQUESTS if quick else serving.DEFAULT_REQUESTS
    rows = []
    for operator in serving.PATHS:
        results = []
        for backend in [b for b in backends if b == "reference" or _has_kernels(operator)]:
            with _console.progress(serving.steps_to_serve(requests), f"{operator} ({backend})") as step:
                results.append(serving.serve(model, requests, serving.ServeConfig(quant_bit=cache_bits),
                                             backend=backend, operator=operator,
                                             threads=_launch(backend).get("threads", 128),
                                             on_step=lambda i, what: step(f"step {i}: {what}")))
        for r in results:
            same = r.generated == results[0].generated
            rows.append((operator, r.backend, len(requests), r.tokens_processed, r.steps, r.peak_pages, r.max_error,
                         same, same and r.max_error <= TOLERANCE_F32, r.seconds))
    return rows


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _seconds(s: float) -> str:
    return f"{s:.2f}"


def _error(e: float) -> str:
    return f"{e:.2e}"


# The two tables' columns: short headers, a legend for the abbreviated ones, raw values in --format json.
SERVING_COLUMNS = (
    _console.Column("operator"), _console.Column("backend"),
    _console.Column("reqs", "requests", right=True, means="requests served"),
    _console.Column("tokens", right=True, means="tokens through attention (prompts and generated)"),
    _console.Column("steps", right=True),
    _console.Column("pages", "peak_pages", right=True, means="most cache pages in use at once"),
    _console.Column("max |err|", "max_error", _error, right=True,
                    means="attention output against float64, every layer and step"),
    _console.Column("same", "tokens_equal_reference", lambda same: "yes" if same else "NO",
                    means="greedy tokens equal the reference backend's"),
    _console.Column("result", "passed", _verdict),
    _console.Column("s", "seconds", _seconds, right=True, means="seconds"),
)
OPERATOR_COLUMNS = (
    _console.Column("operator"), _console.Column("config"), _console.Column("backend"),
    _console.Column("max |err|", "max_error", _error, right=True, means="against a float64 evaluation"),
    _console.Column("result", "passed", _verdict),
    _console.Column("s", "seconds", _seconds, right=True, means="seconds"),
)


def _has_kernels(operator: str) -> bool:
    from . import _arrays
    return hasattr(_arrays.kernels(), operator)


TOLERANCE_F32 = 1e-4     # a float32 model's attention output against float64, absolute


def _legend() -> list[str]:
    """What each kind of operator row compares and what makes it pass, the tolerances read from where the checks
    take them."""
    from .examples import TOLERANCE

    f16, f32 = (TOLERANCE[np.dtype(d)][0] for d in ("float16", "float32"))
    return [
        "How to read the rows. An attention row compares the output on its backend with a float64 evaluation of "
        f"the reference and passes when every element is within atol = rtol = {f16:g} (float16) or {f32:g} "
        "(float32); gpt_attention gets 4 times that (Q and K are rounded to the input dtype after bias and RoPE), "
        "cross_attention 2 times on its context and 4 times on hidden_features (after the output projection; "
        "the error shown), and multi_head_cache_attention must also leave the cache exactly as the reference "
        "does.",
        "key_value_cache only stores tokens: its output is the cache, so there is no float64 attention to compare "
        "with. Its reference row, \"(vs input)\", reads the stored tokens back and compares them with the input "
        "tokens: an int8 or int4 cache keeps each group of values as codes times one scale, so the error is the "
        "quantization's, up to half a step (the group's largest |value| / 127 for int8, / 7 for int4) plus the "
        "input dtype's rounding, and the row passes when every token is within that bound. Its kernel row, "
        "\"(vs reference)\", compares the kernel's cache with the reference's and passes only when they are equal "
        "to the bit (the quantization is specified exactly), its error 0.00e+00.",
    ]


def tour(quick: bool = False, full: bool = False, backends=("reference", "numba"), cache_bits: int = 8) -> int:
    """Run the serving loop and every operator row; returns 0 when all pass. See the module docstring for
    the three sizes: quick, default (smaller shapes), full. backends: which backends run; cache_bits: the
    serving loop's OpenPPL cache (8 int8, 4 int4, 0 the model's float32)."""
    serve_rows = _serving_rows(quick, full, backends, cache_bits)
    _console.table("A tiny model served with in-flight batching on a paged cache (page 4; finished requests return "
                   f"their pages): OpenPPL {({8: 'int8', 4: 'int4', 0: 'float32'})[cache_bits]} cache, TensorRT-LLM "
                   "float32 pool", SERVING_COLUMNS, serve_rows)
    serve_failed = sum(not passed for *_, passed, _ in serve_rows)

    shrink = (lambda case: case) if full else _quick
    suffix = "" if full else " (small)"
    cases = [("attention", label, case) for label, case in ATTENTION_CASES.items()]
    label, case = next(iter(ATTENTION_CASES.items()))
    cases.append(("dynamic", label.replace("paged int8", "packed K/V"), case))
    cases.append(("static", *STATIC_CASE))
    cases += [("onnx", label, case) for label, case in ONNX_CASES.items()]
    cases += [("trt", label, case) for label, case in TRT_CASES.items()]
    cases += [("ft", label, case) for label, case in FT_CASES.items()]
    if quick:                                         # the first configuration of each operator
        cases = [c for n, c in enumerate(cases) if all(c[0] != other[0] for other in cases[:n])]
    run = {"attention": _attention_rows, "dynamic": _dynamic_attention_rows, "static": _key_value_rows,
           "onnx": _onnx_rows, "trt": _trt_rows, "ft": _ft_rows}
    rows = []
    with _console.progress(len(cases), "operators") as step:
        for kind, label, case in cases:
            rows += run[kind](label + suffix, shrink(case), backends)
            step(label)
    if not full:
        _console.say(f"{'quick: three requests, the first configuration of each operator; ' if quick else ''}one "
                     f"serving layer; (small): head dims <= {QUICK_HEAD_DIM}, at most {QUICK_PAST} cached tokens per "
                     "request (--full: the shapes the labels name)")
        _console.say()
    _console.table("Every operator on both backends, against a float64 evaluation", OPERATOR_COLUMNS, rows)
    for paragraph in _legend():
        _console.say(paragraph)
    _console.say()
    failed = sum(not r[4] for r in rows)
    _console.say(f"{len(rows) - failed} passed, {failed} failed; serving loop: "
                 f"{len(serve_rows) - serve_failed} passed, {serve_failed} failed")
    return 1 if failed or serve_failed else 0
