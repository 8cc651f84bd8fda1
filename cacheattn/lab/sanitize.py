"""python -m cacheattn lab --sanitize: one representative call of every kernel family under `lab.record()`.

Every operator runs on the kernels in numba's CUDA simulator on the tour's example cases, cut to the tour's quick
shapes (`cacheattn.tour`): OpenPPL's KeyValueCache, dynamic KeyValueCache, MultiHeadAttention and
MultiHeadCacheAttention at every rung of the kernel ladder on float16, int8 and int4 caches (rung 4's split-K on
float16, its loop rung 3's; every cache with --full); ONNX Attention (rung 1,
rungs 3 and 4 on decode with past, rung 3 on a prefill);
TensorRT-LLM gpt_attention (in-flight context + generation on a paged INT8 pool, StreamingLLM on a cyclic FP8 cache,
generation on rungs 1 (multi-block), 3 and 4, the context phase on rung 5, the unfused and FP8 context paths, cross
attention); FasterTransformer
cross attention (step 1 and a later step, by the plan and on rungs 1, 3 and 4). A table gives each call's launches,
kernels and findings (race, uninitialized shared read, out-of-bounds index), a second one every finding; the pass
ends with the total, `0 findings` when clean.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import cacheattn

from .. import _console
from ..examples import (
    build_ft,
    build_onnx,
    build_ppl,
    build_static,
    build_trt,
    copy_inputs,
    reference_cache_state,
    with_,
)
from . import recorder

THREADS = 32          # the simulator's cost is per thread: one warp a block (rungs 2-5 need whole warps)


@dataclass(frozen=True)
class Call:
    """One representative operator call: the family it stands for, a label, and the call itself."""
    family: str
    label: str
    run: Callable[[], object]


def _ppl_calls(full: bool) -> list[Call]:
    from ..tour import ATTENTION_CASES, STATIC_CASE, _quick

    decode, chunked, prefill = (_quick(case) for case in ATTENTION_CASES.values())
    static = _quick(STATIC_CASE[1])
    calls = [Call("ppl key_value_cache", "static cache, int8 layout 1, num_repeat 2",
                  lambda: _static(static))]
    calls.append(Call("ppl dynamic key_value_cache", "paged int8 cache, fp16", lambda: _dynamic_cache(decode)))
    calls.append(Call("ppl dynamic multi_head_attention", "2 decode + chunked prefill, ALiBi, fp32",
                      lambda: _dynamic_attention(chunked)))
    # Rung 1 on the tour's three cases (paged int8 decode, offset float32 chunked prefill, paged int4 prefill
    # with a 3-D mask); rungs 2, 3 and 5 on decode with float16, int8 and int4 caches; rung 4 (forced to 3 splits)
    # on float16, its loop rung 3's on every cache, its partials and combine the same for each (full: every cache).
    cases = [("paged int8 decode, fp16", decode), ("offset fp32 cache, chunked prefill, ALiBi", chunked),
             ("paged int4 prefill, 3-D mask", prefill)]
    for label, case in cases:
        calls.append(Call("ppl multi_head_cache_attention rung 1", label, lambda case=case: _mhca(case, 1)))
    caches = {"float16": dict(quant_bit=0), "int8": dict(quant_bit=8), "int4": dict(quant_bit=4)}
    rungs = (2, 3, 4, 5)
    for rung in rungs:
        for cache, change in caches.items():
            if rung == 4 and cache != "float16" and not full:
                continue
            case = with_(decode, **change)
            extra = {"num_splits": 3} if rung == 4 else {}
            calls.append(Call(f"ppl multi_head_cache_attention rung {rung}", f"paged {cache} decode, fp16",
                              lambda case=case, rung=rung, extra=extra: _mhca(case, rung, **extra)))
    # Rung 6, the FlashAttention-2 prefill (cp.async copies, ldmatrix), on the tour's paged prefill with a float16
    # cache and query: its 3-D mask compiled in.
    flash = with_(prefill, quant_bit=0, dtype="float16")
    calls.append(Call("ppl multi_head_cache_attention rung 6", "paged fp16 prefill, 3-D mask",
                      lambda: _mhca(flash, 6)))
    if full:                                      # the prefill cases on every later rung too
        for rung in rungs:
            for label, case in cases[1:]:
                if rung == 5 and case.dtype != "float16":
                    continue
                calls.append(Call(f"ppl multi_head_cache_attention rung {rung}", label,
                                  lambda case=case, rung=rung: _mhca(case, rung)))
    return calls


def _static(case):
    x = build_static(case)
    return cacheattn.key_value_cache(**x, num_layer=case.num_layer, layer_idx=case.layer_idx,
                                     quant_bit=case.quant_bit, quant_group=case.quant_group,
                                     num_repeat=case.num_repeat, cache_layout=case.cache_layout, backend="numba",
                                     threads=THREADS)


def _dynamic_cache(case):
    x = build_ppl(case)
    return cacheattn.dynamic_key_value_cache(
        x["current_key"], x["current_value"], x["seqstarts"], x["kvstarts"], x["cachestarts"], x["start_pos"],
        x["max_seqlen"], x["max_kvlen"], x["cache"], x["scale"], num_layer=case.num_layer, layer_idx=case.layer_idx,
        quant_bit=case.quant_bit, quant_group=case.quant_group, cache_mode=case.cache_mode,
        cache_layout=case.cache_layout, page_size=case.page_size, backend="numba", threads=THREADS)


def _dynamic_attention(case):
    x = build_ppl(case)
    key, value, _, _ = reference_cache_state(x, case)     # packed key/value of kvstarts[B] tokens
    return cacheattn.dynamic_multi_head_attention(
        x["query"], key, value, x["seqstarts"], x["kvstarts"], case.decoding_batches, x["max_seqlen"],
        x["max_kvlen"], x["attn_mask"], num_heads=case.num_heads, head_dim=case.head_dim, is_causal=case.is_causal,
        is_alibi=case.is_alibi, num_kv_heads=case.num_kv_heads, backend="numba", threads=THREADS)


def _mhca(case, rung, **extra):
    x = build_ppl(case)
    return cacheattn.multi_head_cache_attention(**x, **case.attrs(), backend="numba", threads=THREADS, rung=rung,
                                                **extra)


def _onnx_calls(full: bool) -> list[Call]:
    from ..tour import ONNX_CASES, _quick

    quick = {label: _quick(case) for label, case in ONNX_CASES.items()}
    calls = [Call("onnx attention", label, lambda case=case: _onnx(case, rung=1)) for label, case in quick.items()]
    # Rungs 3 and 4: decode with past through the vector kernel's key walker (past, then the call's own K/V), and a
    # prefill on rung 3.
    decode, _, prefill = quick.values()
    calls.append(Call("onnx attention rung 3", "decode with past, GQA 8/2, causal, fp16 4-D",
                      lambda: _onnx(decode, rung=3)))
    calls.append(Call("onnx attention rung 4", "decode with past, GQA 8/2, causal, fp16 4-D, 3 splits",
                      lambda: _onnx(decode, rung=4, num_splits=3)))
    calls.append(Call("onnx attention rung 3", "prefill, window 4, padded float mask, fp32",
                      lambda: _onnx(prefill, rung=3)))
    # Rung 5: the same prefill on the tensor cores (a float16 Q), K and V staged through shared memory.
    calls.append(Call("onnx attention rung 5", "prefill, window 4, padded float mask, fp16",
                      lambda: _onnx(replace(prefill, dtype="float16"), rung=5)))
    return calls


def _onnx(case, **launch):
    return cacheattn.onnx_attention(**build_onnx(case), **case.attrs(), return_qk_matmul_output=True,
                                    backend="numba", threads=THREADS, **launch)


def _trt_calls(full: bool) -> list[Call]:
    from ..tour import TRT_CASES, _quick

    inflight, streaming = (_quick(case) for case in TRT_CASES.values())
    calls = [Call("trtllm gpt_attention context+generation paged int8", "in-flight chunk + 2 beams, NeoX RoPE",
                  lambda: _trt(inflight)),
             Call("trtllm gpt_attention fp8 streaming", "2 sinks, window 8, cyclic FP8 cache, GPT-J RoPE",
                  lambda: _trt(streaming))]
    # Multi-block on rung 1: one generation sequence on few blocks, longer than a key tile (32): the launcher
    # splits the keys in two and combines. Rung 4: the vector kernel's splits over a paged INT8 pool, and the
    # combine (the in-flight calls above run their generation on rung 3).
    generation = with_(inflight, contexts=(), generations=((6, 40),), beam_width=1, paged=False, quant=0,
                       capacity=48, window=48)
    calls.append(Call("trtllm gpt_attention generation multi-block", "1 sequence, past 40, contiguous fp16",
                      lambda: _trt(generation, rung=1)))
    calls.append(Call("trtllm gpt_attention generation rung 4", "1 sequence, past 40, paged INT8, 3 splits",
                      lambda: _trt(with_(generation, paged=True, quant=64), rung=4, num_splits=3)))
    # The context phase on rung 5 (tensor cores; the in-flight call's context runs there too, over its INT8 pool):
    # a chunked float16 context on a contiguous cache, the packed custom mask read per (row, key).
    context = with_(inflight, generations=(), beam_width=1, quant=0, paged=False, mask_type=6, packed_mask=True)
    calls.append(Call("trtllm gpt_attention context rung 5", "chunk + packed custom mask, contiguous fp16, mma.sync",
                      lambda: _trt(context)))
    unfused = with_(inflight, generations=(), context_fmha_type=0, quant=0, paged=False)
    calls.append(Call("trtllm gpt_attention context unfused", "context_fmha_type 0, contiguous fp16",
                      lambda: _trt(unfused)))
    fp8_fmha = with_(inflight, generations=(), quant=128, fp8_context_fmha=True)
    calls.append(Call("trtllm gpt_attention context fp8 fmha", "use_fp8_context_fmha, paged FP8",
                      lambda: _trt(fp8_fmha)))
    cross = with_(inflight, contexts=((0, 3),), generations=((2, 4),), beam_width=1, encoder_lengths=(5, 4),
                  position=0, rotary_dim=0, quant=0, paged=False)
    calls.append(Call("trtllm gpt_attention cross attention", "encoder K/V stored by context, read by generation",
                      lambda: _trt(cross)))
    return calls


def _trt(case, **launch):
    return cacheattn.gpt_attention(**build_trt(case), backend="numba", threads=THREADS, **launch)


def _ft_calls(full: bool) -> list[Call]:
    from ..tour import FT_CASES, _quick

    quick = {label: _quick(case) for label, case in FT_CASES.items()}
    calls = [Call("ft cross_attention", label, lambda case=case: _ft(case)) for label, case in quick.items()]
    # The plan's choice above; each rung of the attention kernel by name on step 1 and on a later step (rung 4
    # forced to 3 splits).
    (first, step1), (later, step3) = quick.items()
    for rung, extra in ((1, {}), (3, {}), (4, {"num_splits": 3})):
        for label, case in ((first, step1), (later, step3)):
            calls.append(Call(f"ft cross_attention rung {rung}", label.split(",")[0],
                              lambda case=case, rung=rung, extra=extra: _ft(case, threads=THREADS, rung=rung,
                                                                            **extra)))
    return calls


def _ft(case, **launch):
    return cacheattn.cross_attention(**copy_inputs(build_ft(case)), **case.attrs(), backend="numba", **launch)


def calls(full: bool = False) -> list[Call]:
    """The representative calls, every kernel family at least once; full: more cases per family."""
    return _ppl_calls(full) + _onnx_calls(full) + _trt_calls(full) + _ft_calls(full)


@dataclass
class Checked:
    """What one representative call gave under the recorder: its launches' kernels, its findings, and the error
    that stopped it, if one did."""
    call: Call
    launches: int
    kernels: tuple
    hazards: list
    error: str | None
    seconds: float


def check_calls(selected, on_call=None) -> list[Checked]:
    """Run each call under `lab.record()`; on_call(label) once per call, as it finishes (a progress bar's step)."""
    on_call = on_call or (lambda label: None)
    checked = []
    for call in selected:
        began = time.perf_counter()
        error = None
        try:
            with recorder.record() as rec:
                call.run()
        except Exception as exc:  # a launch that fails (an index past the end) still shows what was found
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        checked.append(Checked(call, len(rec.launches), tuple(sorted({launch.kernel for launch in rec.launches})),
                               list(rec.hazards), error, time.perf_counter() - began))
        on_call(f"{call.family}: {call.label}")
    return checked


def calls_table(checked: list[Checked]) -> _console.Table:
    """One row per call: its family, what it runs, its launches and their kernels, its findings and seconds (a call
    that failed shows in `findings_table`)."""
    columns = (_console.Column("family"), _console.Column("call"),
               _console.Column("launches", right=True), _console.Column("kernels", show=", ".join),
               _console.Column("findings", right=True),
               _console.Column("s", "seconds", lambda s: f"{s:.1f}", right=True, means="seconds in the simulator"))
    return _console.make_table("Every kernel family under the recorder (race, uninitialized, out of bounds)",
                               columns, [(c.call.family, c.call.label, c.launches, c.kernels,
                                          len(c.hazards), c.seconds) for c in checked])


def findings_table(checked: list[Checked]) -> _console.Table:
    """One row per finding (or failed call): the call and what was found."""
    rows = [(f"{c.call.family}: {c.call.label}", f"FAILED {c.error}") for c in checked if c.error]
    rows += [(f"{c.call.family}: {c.call.label}", str(hazard)) for c in checked for hazard in c.hazards]
    return _console.make_table("Findings", (_console.Column("call"), _console.Column("finding")), rows)


def sanitize(full: bool = False, only: str | None = None) -> int:
    """Run every representative call under `lab.record()` (a progress bar on a terminal), print a row per call,
    then every finding, and end with the count. Returns the number of findings plus failed calls (0: clean).
    only: run the calls whose family contains it."""
    start = time.perf_counter()
    selected = [call for call in calls(full) if not only or only in call.family]
    with _console.progress(len(selected), "sanitizing kernel families") as step:
        checked = check_calls(selected, on_call=step)
    _console.print_table(calls_table(checked))
    findings = findings_table(checked)
    if findings.rows:
        _console.print_table(findings)
    total = sum(len(c.hazards) for c in checked)
    failed = sum(c.error is not None for c in checked)
    _console.say(f"{total} findings{f', {failed} failed calls' if failed else ''} in {len(checked)} calls "
                 f"({time.perf_counter() - start:.0f} s)")
    return total + failed
