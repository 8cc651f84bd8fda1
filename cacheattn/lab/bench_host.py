"""python -m cacheattn bench --host: what one decode call costs the host, before any kernel runs.

A decode step launches a few kernels that each run for tens of microseconds, so the host work around them
(validation, argument preparation, numba's launch) can decide the step time. For each operator at decode
shapes this measures, with every launch recorded instead of run (`_launch.recorded_launches`):

  - host time per call (median): validation + argument preparation; and of that, validation alone (the
    launcher swapped for a stub);
  - launches per call, and the kernel parameters after numba flattens the arguments: an array becomes
    5 + 2 * ndim parameters (meminfo, parent, size, itemsize, data pointer, shape, strides), a tuple its
    members', a scalar one; numba-cuda's launch cost grows with that count;
  - device reads per call: tensors validation copies back to the host. On a GPU each one waits for the
    stream to drain (a host sync). The index tensors a server holds on the device are passed as device
    arrays here (as CuPy on a GPU; on the CPU as a NumPy array that presents itself as a device array, so
    the reads are counted the same way).

gpt_attention and OpenPPL's multi_head_cache_attention are measured a second way too, as a server runs them:
`cacheattn.plan_gpt_attention` / `cacheattn.plan_multi_head_cache_attention` once per batch step (validation of
the step's index tensors, their one read back), then `plan.run` once per layer (the layer's own inputs, the
launches); a table for each sets run's host time beside the one call's (timed in turn, ten calls of each at a
time, so they see the same machine load).

`HOST_READS` lists every place the package reads device data back, found by reading the code; the table's
counts are the ones these calls make. Without a GPU the figures are CPU figures of the same host code
(NumPy arrays, simulator mode): they show where the host time goes, not what a GPU machine's host takes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import numpy as np

import cacheattn

from .. import _arrays
from ..examples import OnnxCase, TrtCase, build_onnx, build_ppl, build_trt
from .bench import _decode_case


@dataclass(frozen=True)
class HostRead:
    """One place that copies device data to the host (a sync on a GPU)."""
    where: str
    reads: str
    why: str
    status: str


HOST_READS = (
    HostRead("cacheattn/ppl.py `_index_arrays` (MultiHeadCacheAttention's plan, dynamic KeyValueCache)",
             "seqstarts, kvstarts, cachestarts, start_pos",
             "proves every cache slot the kernels follow lies inside MaxT; the grids need the max lengths",
             "kept, once per step with plan_multi_head_cache_attention (none per layer in plan.run); none when "
             "the caller passes them as NumPy arrays"),
    HostRead("cacheattn/ppl.py `dynamic_multi_head_attention`", "seqstarts, kvstarts",
             "lengths against query/key rows, max_seqlen / max_kvlen", "kept; none for NumPy index tensors"),
    HostRead("cacheattn/ppl.py `key_value_cache`", "start_pos when given as a tensor",
             "start_pos + S must fit MaxS", "kept; none when start_pos is an int"),
    HostRead("kernels_numba/ppl_dynamic_key_value_cache.py `gather`", "kvstarts[B] (the output's row count)",
             "sized the packed key/value outputs", "removed: the row count comes from validation's host copy "
             "(the static KeyValueCache read back its own upload)"),
    HostRead("cacheattn/onnx.py `validate`", "nonpad_kv_seqlen", "values in [0, kv_sequence_length]",
             "kept; none for a NumPy tensor (decode with past_key has none)"),
    HostRead("cacheattn/trtllm.py `validate_step`", "sequence_length, context_lengths, cache_indirection, "
             "kv_cache_block_offsets (device tensors in TensorRT-LLM)",
             "every slot and block the kernels follow inside the cache; the launcher plans its grid and "
             "entry table from them on the host", "kept, once per step with plan_gpt_attention (none per layer "
             "in plan.run); none for NumPy tensors"),
    HostRead("cacheattn/trtllm.py `validate_step`", "host_past_key_value_lengths, host_request_types, "
             "host_max_attention_window_sizes, host_sink_token_length, host_context_lengths, "
             "host_kv_cache_block_offsets", "as above", "host tensors in TensorRT-LLM: no read when NumPy"),
    HostRead("cacheattn/trtllm.py `_positive_scale`, rotary check", "kv_orig_quant_scale, kv_quant_orig_scale, "
             "rotary_inv_freq", "scales finite and > 0 (the kernels take them as scalars)",
             "kept (the KV scales per layer in plan.run too); none when the scales are floats or NumPy"),
    HostRead("cacheattn/ft.py `cross_attention`", "encoder_sequence_length, finished, ia3_tasks",
             "lengths within mem_len, task ids within num_tasks", "kept; none for NumPy tensors"),
)


class DeviceIndex(np.ndarray):
    """A NumPy array that presents itself as a device array: validation copies it back through `get()` as it
    would a CuPy one, so the host benchmark counts the same reads without a GPU."""

    @property
    def __cuda_array_interface__(self):
        return self.__array_interface__

    def get(self):
        return np.asarray(self).copy()


@dataclass(frozen=True)
class HostCase:
    label: str
    operator: str
    arguments: dict                # keyword arguments of cacheattn.<operator>, NumPy
    device_index: tuple            # index tensors a server keeps on the device


def host_cases(batch: int = 64, context: int = 256) -> tuple[HostCase, ...]:
    """Decode calls of the three serving operators: 32/8 heads, head_dim 128, float16, `batch` requests with
    `context` cached tokens each (the host path does not depend on the context length, only on the batch)."""
    ppl = _decode_case(batch, (context - 1,) * batch, 0)
    onnx = OnnxCase(batch=batch, q_heads=32, kv_heads=8, q_len=1, kv_len=1, past_len=context - 1, head_size=128,
                    v_head_size=128, three_d=False, dtype="float16", mask="none", mask_shape=(), is_causal=0,
                    nonpad=None, softcap=0.0, scale=None, left_window_size=-1, right_window_size=-1,
                    qk_matmul_output_mode=0, seed=0)
    trt = TrtCase(contexts=(), generations=((context // 2, context - 1),) * batch, beam_width=1, num_heads=32,
                  num_kv_heads=8, head_size=128, dtype="float16", capacity=context, window=context, paged=True,
                  tokens_per_block=64)
    return (
        HostCase(f"PPL MultiHeadCacheAttention paged decode B{batch}", "multi_head_cache_attention",
                 {**build_ppl(ppl), **ppl.attrs()}, ("seqstarts", "kvstarts", "cachestarts", "start_pos")),
        HostCase(f"ONNX Attention decode with past B{batch}", "onnx_attention",
                 {**build_onnx(onnx), **onnx.attrs()}, ()),
        HostCase(f"gpt_attention paged generation B{batch}", "gpt_attention", build_trt(trt),
                 ("sequence_length", "context_lengths", "cache_indirection", "kv_cache_block_offsets")),
    )


def kernel_parameters(arg) -> int:
    """How many parameters numba-cuda passes for one kernel argument (see its dispatcher's _prepare_args)."""
    if isinstance(arg, tuple):
        return sum(kernel_parameters(a) for a in arg)
    if isinstance(arg, np.generic):
        return 2 if np.iscomplexobj(arg) else 1
    if isinstance(arg, np.ndarray) or hasattr(arg, "__cuda_array_interface__"):
        return 5 + 2 * len(arg.shape)
    return 1


def _kernel_name(kernel) -> str:
    return getattr(getattr(kernel, "py_func", kernel), "__name__", type(kernel).__name__)


class _NoKernels:
    """Stands in for kernels_numba when only validation is timed: every launcher (a module's too) returns four
    Nones at once."""

    def __getattr__(self, name):
        return _NoKernels()

    def __call__(self, *args, **kwargs):
        return (None,) * 4


def _on_device(case: HostCase, gpu: bool) -> dict:
    """The case's arguments as a server would pass them: data and device index tensors on the device."""
    data = {k: v for k, v in case.arguments.items() if isinstance(v, np.ndarray)}
    if gpu:
        import cupy
        # Everything but TensorRT-LLM's host_* tensors: the data, and the index tensors in case.device_index.
        moved = {k: cupy.asarray(v) for k, v in data.items() if not k.startswith("host_")}
    else:
        moved = {k: np.ascontiguousarray(data[k]).view(DeviceIndex) for k in case.device_index}
    return {**case.arguments, **moved}


def _median_us(fn, repeat: int, launches: list | None = None) -> float:
    """Median time of fn() in microseconds. `launches`, the recorder's list, is emptied after each call, outside
    the timing: launches held over would keep every call's buffers alive, and fresh memory for each call (page
    faults) would then be timed as host work."""
    fn()                                                # warm-up: kernel factories, dispatch caches
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if launches is not None:
            launches.clear()
    return float(np.median(times)) * 1e6


def _counting_reads():
    """(context manager, counter): device arrays that _arrays.to_host copies back while it is active."""
    reads = [0]
    to_host = _arrays.to_host

    def counting_to_host(x):
        reads[0] += _arrays.is_device_array(x)
        return to_host(x)
    return mock.patch.object(_arrays, "to_host", counting_to_host), reads


BLOCK = 10          # measure_per_layer: calls of one path timed back to back before the next path's


def planned_operators() -> dict:
    """{operator: (its plan function, its per-layer inputs)}: the operators a server plans once per step."""
    from .. import ppl, trtllm
    return {"gpt_attention": (cacheattn.plan_gpt_attention, trtllm.LAYER_INPUTS),
            "multi_head_cache_attention": (cacheattn.plan_multi_head_cache_attention, ppl.LAYER_INPUTS)}


def measure_per_layer(case: HostCase, *, gpu: bool, repeat: int) -> dict:
    """The operator's one call beside a plan built once and run per layer (module docstring): times in
    microseconds, medians with their 25th and 75th percentiles; the paths are timed in turn, BLOCK calls at a
    time."""
    from kernels_numba import _launch

    plan_step, layer_inputs = planned_operators()[case.operator]
    operator = getattr(cacheattn, case.operator)
    arguments = _on_device(case, gpu)
    step = {k: v for k, v in arguments.items() if k not in layer_inputs}
    layer = {k: v for k, v in arguments.items() if k in layer_inputs}

    def one_call():
        return operator(**arguments, backend="numba")

    def run():
        return plan.run(**layer, backend="numba")

    with _launch.recorded_launches() as launches:
        counting, one_call_reads = _counting_reads()
        with counting:
            one_call()
        counting, plan_reads = _counting_reads()
        with counting:
            plan = plan_step(**step)
        run()                                           # the first layer prepares the step's launches
        launches.clear()
        counting, run_reads = _counting_reads()
        with counting:
            run()
        per_layer = list(launches)
        # Blocks of calls in turn: each path runs back to back as a server runs it (its caches warm), and a
        # change in the machine's load falls on all three.
        times = {"one call": [], "plan": [], "run": []}
        for _ in range(-(-repeat // BLOCK)):
            for name, fn in (("one call", one_call), ("plan", lambda: plan_step(**step)),
                             ("run", run)):
                for _ in range(BLOCK):
                    start = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - start) * 1e6)
                    launches.clear()                    # as _median_us: buffers do not outlive their call
    with mock.patch.object(_arrays, "kernels", _NoKernels):
        run_validation = _median_us(run, repeat)
    spread = {name: [float(np.percentile(t, q)) for q in (50, 25, 75)] for name, t in times.items()}
    return dict(label=case.label, one_call_us=spread["one call"], plan_us=spread["plan"], run_us=spread["run"],
                run_validation_us=run_validation, run_ratio=spread["run"][0] / spread["one call"][0],
                one_call_reads=one_call_reads[0], plan_reads=plan_reads[0], run_reads=run_reads[0],
                run_launches=len(per_layer),
                run_parameters=sum(kernel_parameters(a) for _, args in per_layer for a in args))


def measure(case: HostCase, *, gpu: bool, repeat: int) -> dict:
    """Host figures of one case (module docstring): times in microseconds."""
    from kernels_numba import _launch

    operator = getattr(cacheattn, case.operator)
    arguments = _on_device(case, gpu)

    def call():
        return operator(**arguments, backend="numba")

    counting, reads = _counting_reads()
    with _launch.recorded_launches() as launches:
        with counting:
            call()
        one_call = list(launches)
        total = _median_us(call, repeat, launches)
    with mock.patch.object(_arrays, "kernels", _NoKernels):
        validation = _median_us(call, repeat)
    return dict(label=case.label, host_us=total, validation_us=validation, launches=len(one_call),
                kernels=[(_kernel_name(kernel), sum(kernel_parameters(a) for a in args)) for kernel, args in one_call],
                parameters=sum(kernel_parameters(a) for _, args in one_call for a in args), device_reads=reads[0])


def tables(rows: list, where: str, per_layer: list | None = None) -> list:
    """The figures, the list of host reads and (given per_layer, measure_per_layer's rows) each planned
    operator's one call beside plan and run, as `_console` tables (what the terminal, markdown and JSON forms and
    host.md show)."""
    from .. import _console

    figures = _console.make_table(
        f"Host time per decode call, launches recorded instead of run ({where}).",
        (_console.Column("call", "label"),
         _console.Column("host µs", "host_us", lambda us: f"{us:.0f}", right=True,
                         means="median host time of one call"),
         _console.Column("valid. µs", "validation_us", lambda us: f"{us:.0f}", right=True,
                         means="of which validation (launchers stubbed out)"),
         _console.Column("launches", right=True),
         _console.Column("params", "parameters", right=True,
                         means="kernel parameters after numba flattens the arguments, all launches"),
         _console.Column("per launch", "kernels", lambda ks: ", ".join(f"{name} {n}" for name, n in ks),
                         means="each launch's kernel and its parameters"),
         _console.Column("reads", "device_reads", right=True, means="device tensors read back to the host")),
        [(r["label"], r["host_us"], r["validation_us"], r["launches"], r["parameters"], r["kernels"],
          r["device_reads"]) for r in rows])
    reads = _console.make_table("Where device data comes back to the host (a sync on a GPU):",
                                ("where", "reads", "why", "status"),
                                [(h.where, h.reads, h.why, h.status) for h in HOST_READS])
    return [figures, reads, *(_paths_table(p, where) for p in per_layer or ())]


def _paths_table(p: dict, where: str):
    """One operator's one call, plan and run (a measure_per_layer row)."""
    from .. import _console
    return _console.make_table(
        f"{p['label']}: one call, or plan once per step and run once per layer ({where}).",
        (_console.Column("path"),
         _console.Column("host µs", "us", lambda us: f"{us[0]:.0f}", right=True,
                         means="median host time (JSON: median, 25th and 75th percentile)"),
         _console.Column("spread", "spread", right=True, means="25th to 75th percentile, µs"),
         _console.Column("reads", right=True, means="device tensors read back to the host"),
         _console.Column("× one call", "ratio", lambda r: f"{r:.2f}", right=True,
                         means="host time over the one call's")),
        [(name, us, f"{us[1]:.0f}–{us[2]:.0f}", reads, us[0] / p["one_call_us"][0])
         for name, us, reads in (("one call", p["one_call_us"], p["one_call_reads"]),
                                 ("plan (per step)", p["plan_us"], p["plan_reads"]),
                                 ("run (per layer)", p["run_us"], p["run_reads"]))])


def markdown(rows: list, where: str, per_layer: list | None = None) -> str:
    """host.md: the tables in markdown."""
    from .. import _console
    return "\n".join(_console.render_markdown(t) for t in tables(rows, where, per_layer))


def host_overhead(*, gpu: bool = False, repeat: int = 30, batch: int = 64, context: int = 256,
                  out_dir: Path | str | None = None, show: bool = True) -> list:
    """Measure every host case; print the tables (unless show=False); write host.json and host.md into out_dir
    only when one is given; return the rows."""
    from .. import _console

    cases = host_cases(batch, context)
    rows = [measure(case, gpu=gpu, repeat=repeat) for case in cases]
    per_layer = [measure_per_layer(case, gpu=gpu, repeat=repeat) for case in cases
                 if case.operator in planned_operators()]
    where = "GPU machine's host, CuPy arrays" if gpu else "CPU figures: NumPy arrays, no GPU"
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host.json").write_text(json.dumps({"where": where, "rows": rows, "per_layer": per_layer,
                                                   "host_reads": [asdict(h) for h in HOST_READS]}, indent=2) + "\n")
        (out / "host.md").write_text(markdown(rows, where, per_layer))
    if show:
        for table in tables(rows, where, per_layer):
            _console.print_table(table)
    return rows
