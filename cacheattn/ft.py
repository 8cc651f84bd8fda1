"""FasterTransformer decoder cross attention: `cacheattn.cross_attention`.

Arguments keep FasterTransformer's tensor names (DecoderCrossAttentionLayer's input/output TensorMaps) and
`weights` its AttentionWeight attribute names. Validation names the argument at fault, then NumPy arrays go
to `reference.cross_attention` and GPU arrays (or backend="numba") to the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import reference
from reference.ft_cross_attention import chunk_elements

from . import _arrays as arrays
from ._types import AttentionWeight, DenseWeight, IndexTensor, Tensor
from ._validate import (
    FLOAT_T1,
    check_contiguous,
    check_dtype,
    check_int,
    check_launch,
    check_same_dtype,
    check_shape,
)
from .kernel_choice import AttentionShape, KernelPlan
from .kernel_choice import choose_kernel as plan_kernels

# FasterTransformer's masked-MHA dispatch: one kernel per head size (built for the next power of two).
# spec: ft/head-size-dispatch
HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256)
RUNGS = (1, 3, 4)      # the kernel ladder's rungs the attention kernel offers (docs/kernel-ladder.md)
PLAN_OPTIONS = dict(rungs=RUNGS)      # what `cacheattn.choose_kernel` chooses among


class CrossAttentionOutputs(NamedTuple):
    """What `cross_attention` returns.

    Attributes
    ----------
    hidden_features : Tensor
        `[B, d_model]`: `context · attention_output_weight.kernel`, before the caller's output bias.
    context : Tensor
        `[B, head_num * size_per_head]`: the attention context (FasterTransformer's context_buf).
    """
    hidden_features: Tensor
    context: Tensor


def _weight_arrays(weights, use_ia3) -> dict:
    """{'query_weight.kernel': array, ...}: every weight array the call reads, named as the error names it."""
    out = {}
    names = ["query_weight", "key_weight", "value_weight", "attention_output_weight"]
    if use_ia3:
        names += ["ia3_key_weight", "ia3_value_weight"]
    for name in names:
        dense = getattr(weights, name, None)
        if name.startswith("ia3") and dense is None:
            raise ValueError(f"ia3_tasks: given, but weights.{name} is None (IA3 needs both IA3 weights)")
        if dense is None or not hasattr(dense, "kernel"):
            raise ValueError(f"weights.{name}: expected a DenseWeight-like object with .kernel, got {dense!r}")
        out[f"weights.{name}.kernel"] = dense.kernel
        if name.startswith("ia3"):
            continue
        bias = getattr(dense, "bias", None)
        if bias is not None and name != "attention_output_weight":   # the output bias is the caller's to add
            out[f"weights.{name}.bias"] = bias
    return out


def validate(input_query, encoder_output, encoder_sequence_length, step, key_cache, value_cache, finished, ia3_tasks,
             context_buf, cross_attentions, weight_arrays, *, head_num, size_per_head, q_scaling,
             is_batch_major_cache):
    """Checks every argument; returns host (lengths, finished or None, ia3_tasks or None)."""
    # spec: ft/step
    check_int("step", step, low=1)
    check_int("head_num", head_num, low=1)
    # spec: ft/head-size-dispatch
    if isinstance(size_per_head, bool) or size_per_head not in HEAD_SIZES:
        raise ValueError(f"size_per_head: expected one of {HEAD_SIZES}, got {size_per_head!r}")
    # NaN fails the comparison; an infinite q_scaling would flatten every score to 0 (uniform attention).
    if isinstance(q_scaling, (bool, np.bool_)) or not isinstance(q_scaling, (int, float, np.integer, np.floating)) \
            or not 0 < q_scaling < np.inf:
        raise ValueError(f"q_scaling: expected a positive finite float, got {q_scaling!r}")
    if is_batch_major_cache not in (True, False):
        raise ValueError(f"is_batch_major_cache: expected True or False, got {is_batch_major_cache!r}")
    hidden = head_num * size_per_head

    # spec: ft/input-query
    check_dtype("input_query", input_query, FLOAT_T1)
    check_shape("input_query", input_query, (None, None), "[batch_size, d_model]")
    batch, d_model = (int(s) for s in input_query.shape)
    # spec: ft/encoder-output
    check_same_dtype("encoder_output", encoder_output, "input_query", input_query, allowed=FLOAT_T1)
    check_shape("encoder_output", encoder_output, (batch, None, None), "[batch_size, mem_max_seq_len, mem_d_model]")
    mem_len, mem_d = int(encoder_output.shape[1]), int(encoder_output.shape[2])
    if mem_len < 1:
        raise ValueError("encoder_output: expected mem_max_seq_len >= 1, got 0")

    # spec: ft/caches
    x = chunk_elements(input_query.dtype)
    if is_batch_major_cache:
        k_want, k_text = (batch, head_num, size_per_head // x, mem_len, x), f"[B, H, Dh/x, mem_max_seq_len, x={x}]"
        v_want, v_text = (batch, head_num, mem_len, size_per_head), "[B, H, mem_max_seq_len, Dh]"
    else:
        k_want = v_want = (batch, mem_len, head_num, size_per_head)
        k_text = v_text = "[B, mem_max_seq_len, H, Dh]"
    for name, cache, want, text in (("key_cache", key_cache, k_want, k_text),
                                    ("value_cache", value_cache, v_want, v_text)):
        check_same_dtype(name, cache, "input_query", input_query, allowed=FLOAT_T1)
        check_shape(name, cache, want, text)
        check_contiguous(name, cache)

    shapes = {"query_weight": (d_model, hidden), "key_weight": (mem_d, hidden), "value_weight": (mem_d, hidden),
              "attention_output_weight": (hidden, d_model)}
    num_tasks = None
    for name, w in weight_arrays.items():
        check_same_dtype(name, w, "input_query", input_query, allowed=FLOAT_T1)
        member, part = name.split(".")[1:]
        if member.startswith("ia3"):
            num_tasks = int(w.shape[0]) if getattr(w, "ndim", 0) == 2 else num_tasks
            check_shape(name, w, (num_tasks, hidden), "[num_tasks, H*Dh]")
        elif part == "kernel":
            check_shape(name, w, shapes[member], "[in, out]")
        else:
            check_shape(name, w, (hidden,), "[H*Dh]")

    # spec: ft/encoder-lengths
    lengths = arrays.index_array("encoder_sequence_length", encoder_sequence_length)
    check_shape("encoder_sequence_length", lengths, (batch,), "[batch_size]")
    if (lengths < 1).any() or (lengths > mem_len).any():
        raise ValueError(f"encoder_sequence_length: expected values in [1, {mem_len}] (mem_max_seq_len), "
                         f"got {lengths.tolist()}")
    # spec: ft/finished
    done = None
    if finished is not None:
        done = np.asarray(arrays.to_host(finished))
        if done.dtype != np.bool_:
            raise TypeError(f"finished: expected a bool tensor, got dtype {done.dtype}")
        check_shape("finished", done, (batch,), "[batch_size]")
    tasks = None
    if ia3_tasks is not None:
        if num_tasks is None:
            raise ValueError("ia3_tasks: given, but weights has no ia3_key_weight / ia3_value_weight")
        tasks = arrays.index_array("ia3_tasks", ia3_tasks)
        check_shape("ia3_tasks", tasks, (batch,), "[batch_size]")
        if (tasks < 0).any() or (tasks >= num_tasks).any():
            raise ValueError(f"ia3_tasks: expected values in [0, {num_tasks}) (num_tasks), got {tasks.tolist()}")
    if context_buf is not None:
        check_same_dtype("context_buf", context_buf, "input_query", input_query, allowed=FLOAT_T1)
        check_shape("context_buf", context_buf, (batch, hidden), "[batch_size, H*Dh]")
        check_contiguous("context_buf", context_buf)
    if cross_attentions is not None:
        check_dtype("cross_attentions", cross_attentions, ("float32",))
        check_shape("cross_attentions", cross_attentions, (batch, head_num, None, mem_len),
                    "[B, H, max_decoder_seq_len, mem_max_seq_len]")
        check_contiguous("cross_attentions", cross_attentions)
        if cross_attentions.shape[2] < step:
            raise ValueError(f"cross_attentions: expected max_decoder_seq_len >= step ({step}), "
                             f"got {cross_attentions.shape[2]}")
    return lengths, done, tasks


@arrays.accepts_torch
def cross_attention(input_query: Tensor, encoder_output: Tensor, encoder_sequence_length: IndexTensor, step: int,
                    key_cache: Tensor, value_cache: Tensor, finished: Tensor | None = None,
                    ia3_tasks: IndexTensor | None = None, context_buf: Tensor | None = None,
                    cross_attentions: Tensor | None = None, *, weights: AttentionWeight, head_num: int,
                    size_per_head: int, q_scaling: float = 1.0, is_batch_major_cache: bool = True,
                    backend: str = "auto", threads: int = 128, rung: int | None = None,
                    num_splits: int | None = None) -> CrossAttentionOutputs:
    """One decoder step of FasterTransformer's cross attention (DecoderCrossAttentionLayer).

    At `step` 1 the encoder output is projected into the caches once: every position gets
    `encoder_output · Wk` (and `· Wv`), and positions below the row's length then get the bias `bk` (`bv`)
    added and, when `ia3_tasks` is given, are multiplied by the IA3 weight of the row's task; later steps only
    read the caches. Every step, for row b, head h and encoder position `j < encoder_sequence_length[b]` (keys
    past the length are not visited):

        q = input_query[b] · Wq + bq
        s[j] = q[h] · K[b, h, j] / (sqrt(size_per_head) · q_scaling)           (float32)
        p = exp(s - max s) / (sum exp(s - max s) + 1e-6)
        context[b, h] = p @ V[b, h]
        hidden_features[b] = context[b] · Wo                                   (no output bias)

    A `finished` row is left alone: its context row and `cross_attentions` row are not written, and at step 1
    its cache rows keep the unbiased projection (the bias and IA3 write-back skip it).

    Parameters
    ----------
    input_query : Tensor
        `[B, d_model]`, float16 or float32: the decoder's normalised self-attention output.
    encoder_output : Tensor
        `[B, mem_max_seq_len, mem_d_model]`, the dtype of `input_query`.
    encoder_sequence_length : IndexTensor
        `[B]`, integer in `[1, mem_max_seq_len]`.
    step : int
        The decoding step, counting from 1 (step 1 writes the caches).
    key_cache : Tensor
        In-out (written at step 1). Batch-major: `[B, head_num, size_per_head / x, mem_max_seq_len, x]` with
        `x = 16 / itemsize` (8 for float16, 4 for float32); otherwise `[B, mem_max_seq_len, head_num,
        size_per_head]`. The dtype of `input_query`, C-contiguous.
    value_cache : Tensor
        In-out. Batch-major: `[B, head_num, mem_max_seq_len, size_per_head]`; otherwise like `key_cache`.
    finished : Tensor or None, optional
        `[B]` bool: rows whose decoding has ended.
    ia3_tasks : IndexTensor or None, optional
        `[B]`, integer in `[0, num_tasks)`: each row's row of `weights.ia3_key_weight` / `ia3_value_weight`
        (applied at step 1 only; both weights required).
    context_buf : Tensor or None, optional
        In-out `[B, head_num * size_per_head]`, the dtype of `input_query`: receives the attention context
        (a finished row keeps its old contents). None: a new zero-filled buffer.
    cross_attentions : Tensor or None, optional
        In-out float32 `[B, head_num, max_decoder_seq_len, mem_max_seq_len]` (`max_decoder_seq_len ≥ step`):
        row `step - 1` receives the probabilities of positions `[0, length)`.
    weights : AttentionWeight
        The projections, in the dtype of `input_query`: `query_weight` `[d_model, head_num * size_per_head]`,
        `key_weight` and `value_weight` `[mem_d_model, head_num * size_per_head]`, `attention_output_weight`
        `[head_num * size_per_head, d_model]`, biases `[head_num * size_per_head]` or None.
    head_num : int
        Heads, ≥ 1.
    size_per_head : int
        One of 32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 256 (FasterTransformer's kernel dispatch).
    q_scaling : float, default 1.0
        > 0 and finite; divides the scores besides `sqrt(size_per_head)`.
    is_batch_major_cache : bool, default True
        Which cache layout (see `key_cache`).
    backend : str, default "auto"
        "auto", "reference" or "numba".
    threads : int, default 128
        The kernels' block size, 1 to 1024 (a multiple of 32 for rungs 3 and 4).
    rung : int or None, default None
        The attention kernel of the kernel ladder (docs/kernel-ladder.md): 1 shared-memory tiles, 3 16-byte
        vector loads walking the cache, 4 rung 3 split over `num_splits` key ranges and combined. None: the
        plan's choice (`cacheattn.ft.kernel_plan`: rung 3, or 4 when the heads of the running sequences leave SMs
        idle). Rungs 3 and 4 need caches that start on a 16-byte boundary; a call they cannot serve runs on
        rung 1. The reference ignores it.
    num_splits : int or None, default None
        Rung 4's key ranges, 1 to 64; alone it asks for rung 4. None: chosen from the SMs the grid leaves idle.

    Returns
    -------
    CrossAttentionOutputs
        `(hidden_features, context)`: `hidden_features` `[B, d_model]` (before the caller's output bias) and
        `context` `[B, head_num * size_per_head]` (`context_buf` when given), in the dtype of `input_query`.

    Raises
    ------
    ValueError
        Named by the argument (`weights.key_weight.kernel` for a weight): shapes, `step` < 1, a
        `size_per_head` FasterTransformer has no kernel for, lengths outside `[1, mem_max_seq_len]`, `ia3_tasks`
        without IA3 weights or out of range, `max_decoder_seq_len` < `step`, a non-contiguous cache; a `rung`
        other than 1, 3 or 4, `num_splits` outside 1 to 64 or with rung 1 or 3, `threads` outside 1 to 1024
        or not whole warps for rung 3 or 4.
    TypeError
        Mismatched dtypes, a non-bool `finished`, float index tensors.

    Notes
    -----
    Sources: NVIDIA FasterTransformer's
    [decoder guide](https://github.com/NVIDIA/FasterTransformer/blob/main/docs/decoder_guide.md) and its
    DecoderCrossAttentionLayer, as GiantPandaCV's "FasterTransformer Decoding 源码分析(六)-CrossAttention介绍"
    walks through it (docs/ft.md).

    Examples
    --------
    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> B, L, d, H, Dh = 2, 5, 16, 2, 32
    >>> def dense(rows, cols):
    ...     return cacheattn.DenseWeight(rng.standard_normal((rows, cols)).astype(np.float32) / rows ** 0.5,
    ...                                  rng.standard_normal(cols).astype(np.float32))
    >>> weights = cacheattn.AttentionWeight(dense(d, H * Dh), dense(d, H * Dh), dense(d, H * Dh), dense(H * Dh, d))
    >>> key_cache = np.full((B, H, Dh // 4, L, 4), np.nan, np.float32)      # batch-major, x = 4 for float32
    >>> value_cache = np.full((B, H, L, Dh), np.nan, np.float32)
    >>> out = cacheattn.cross_attention(
    ...     rng.standard_normal((B, d)).astype(np.float32), rng.standard_normal((B, L, d)).astype(np.float32),
    ...     np.array([5, 3]), 1, key_cache, value_cache, weights=weights, head_num=H, size_per_head=Dh)
    >>> out.hidden_features.shape, out.context.shape
    ((2, 16), (2, 64))
    >>> bool(np.isfinite(key_cache).all() and np.isfinite(value_cache).all())      # step 1 wrote both caches
    True
    """
    use_ia3 = ia3_tasks is not None
    weight_arrays = _weight_arrays(weights, use_ia3)
    data = dict(input_query=input_query, encoder_output=encoder_output, key_cache=key_cache,
                value_cache=value_cache, context_buf=context_buf, cross_attentions=cross_attentions, **weight_arrays)
    engine = arrays.resolve_backend(backend, data)
    attrs = dict(head_num=head_num, size_per_head=size_per_head, q_scaling=q_scaling,
                 is_batch_major_cache=is_batch_major_cache)
    check_launch(rung, threads, num_splits, rungs=RUNGS, min_threads=1)
    lengths, done, tasks = validate(input_query, encoder_output, encoder_sequence_length, step, key_cache,
                                    value_cache, finished, ia3_tasks, context_buf, cross_attentions, weight_arrays,
                                    **attrs)
    # A rung asked for by name is checked on either backend, so the call fails the same way wherever it runs.
    launch = None
    if engine != "reference" or rung not in (None, 1) or num_splits is not None:
        caches = {name: arrays.as_kernel_array(data[name]) if engine != "reference" else data[name]
                  for name in ("key_cache", "value_cache")}
        launch = _plan(input_query.dtype, lengths, done, caches, head_num, size_per_head, rung, num_splits, threads,
                       None)
    if engine == "reference":
        def call(h):
            return reference.cross_attention(
                h["input_query"], h["encoder_output"], lengths, step, h["key_cache"], h["value_cache"], done, tasks,
                h["context_buf"], h["cross_attentions"], weights=_host_weights(h, use_ia3), **attrs)
        return CrossAttentionOutputs(*arrays.run_reference(
            data, ("key_cache", "value_cache", "context_buf", "cross_attentions"), call))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    like = data["input_query"]
    return CrossAttentionOutputs(*arrays.kernels().cross_attention(
        data["input_query"], data["encoder_output"], arrays.to_kind(like, lengths), step, data["key_cache"],
        data["value_cache"], None if done is None else arrays.to_kind(like, done),
        None if tasks is None else arrays.to_kind(like, tasks), data["context_buf"], data["cross_attentions"],
        weights=_host_weights(data, use_ia3), threads=launch.threads, rung=launch.rung, num_splits=launch.num_splits,
        **attrs))


@arrays.accepts_torch
def kernel_plan(encoder_sequence_length: IndexTensor, key_cache: Tensor, value_cache: Tensor,
                finished: Tensor | None = None, *, head_num: int, size_per_head: int, rung: int | None = None,
                num_splits: int | None = None, threads: int = 128, sms: int | None = None) -> KernelPlan:
    """The kernel plan `cross_attention` runs its attention with, for these arguments (the same names).

    Each step's attention is one query row per running sequence over its `encoder_sequence_length[b]` cached
    keys, on `head_num` heads with their own keys: `cacheattn.choose_kernel` of that shape, over the rungs this
    operator offers (1, 3, 4). Without `rung` that is rung 3, or rung 4 when the running sequences' heads
    leave SMs idle; rungs 3 and 4 read 16-byte chunks, so a cache that does not start on a 16-byte boundary
    (or, without `rung`, a block size of partial warps) runs on rung 1, with the reason in the plan.

    Parameters
    ----------
    encoder_sequence_length, key_cache, value_cache, finished, head_num, size_per_head, rung, num_splits, threads
        As `cross_attention` takes them.
    sms : int or None, default None
        The GPU's multiprocessors; None reads the current device (132, an H100 SXM, without one).

    Returns
    -------
    KernelPlan
        `rung`, `num_splits`, `threads` and a one-line `reason`.

    Examples
    --------
    >>> import numpy as np, cacheattn
    >>> B, H, Dh, L = 64, 16, 64, 1024                                  # float16: x = 8
    >>> k, v = np.zeros((B, H, Dh // 8, L, 8), np.float16), np.zeros((B, H, L, Dh), np.float16)
    >>> chosen = cacheattn.ft.kernel_plan(np.full(B, L), k, v, head_num=H, size_per_head=Dh, sms=132)
    >>> chosen.rung, chosen.num_splits
    (3, 1)
    >>> few = cacheattn.ft.kernel_plan(np.full(2, L), k[:2], v[:2], head_num=H, size_per_head=Dh, sms=132)
    >>> few.rung, few.num_splits
    (4, 9)
    """
    check_launch(rung, threads, num_splits, rungs=RUNGS, min_threads=1)
    lengths = arrays.index_array("encoder_sequence_length", encoder_sequence_length)
    done = None if finished is None else np.asarray(arrays.to_host(finished), bool)
    caches = {"key_cache": key_cache, "value_cache": value_cache}
    return _plan(np.dtype(key_cache.dtype), lengths, done, caches, head_num, size_per_head, rung, num_splits,
                 threads, sms)


def _plan(dtype, lengths, done, caches, head_num, size_per_head, rung, num_splits, threads, sms) -> KernelPlan:
    """`kernel_plan` on validated arguments (host lengths and finished flags, the caches as the kernels get them)."""
    from kernels_numba.ft_cross_attention import fast_rung_problem

    running = max(1, int(len(lengths) - (0 if done is None else np.count_nonzero(done))))
    shape = AttentionShape(batch=running, max_query_len=1, max_kv_len=int(np.max(lengths, initial=1)),
                           num_heads=head_num, num_kv_heads=head_num, head_dim=size_per_head, query_dtype=dtype,
                           decode_sequences=running)
    chosen = plan_kernels(shape, rung=rung, num_splits=num_splits, threads=threads, sms=sms, **PLAN_OPTIONS)
    problem = fast_rung_problem(dtype, size_per_head, caches) if chosen.rung in (3, 4) else None
    if problem:
        return KernelPlan(1, 1, threads, f"fallback to shared-memory tiles: {problem}")
    return chosen


def _host_weights(h: dict, use_ia3: bool) -> AttentionWeight:
    """An AttentionWeight over the (host or kernel) arrays of `h`, whatever object the caller passed."""
    def dense(name):
        kernel = h.get(f"weights.{name}.kernel")
        return None if kernel is None else DenseWeight(kernel, h.get(f"weights.{name}.bias"))
    ia3 = (dense("ia3_key_weight"), dense("ia3_value_weight")) if use_ia3 else (None, None)
    return AttentionWeight(dense("query_weight"), dense("key_weight"), dense("value_weight"),
                           dense("attention_output_weight"), *ia3)
