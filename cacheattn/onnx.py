"""ONNX `Attention` (opsets 23, 24; opset 25's windows): `cacheattn.onnx_attention`.

Inputs and attributes keep the ONNX names; validation names the ONNX input or attribute
at fault, then NumPy arrays go to `reference.onnx_attention` and GPU arrays (or
backend="numba") to the kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

import reference

from . import _arrays as arrays
from ._types import IndexTensor, Tensor
from ._validate import (
    bits_hint,
    check_bfloat16_arch,
    check_choice,
    check_flag,
    check_int,
    check_launch,
    check_shape,
    dtype_mismatch,
)
from .kernel_choice import AttentionShape, KernelPlan
from .kernel_choice import choose_kernel as plan_kernels

T1 = ("float16", "float32", "float64", "bfloat16")
OPSETS = (23, 24, 25)
RUNGS = (1, 3, 4, 5, 6)    # the kernel ladder's rungs ONNX Attention runs on (docs/kernel-ladder.md)
# What `cacheattn.choose_kernel` chooses among: those rungs, rung 5 staging its keys in decode as in prefill, rung 6
# (the FlashAttention-2 prefill) for a float16 or bfloat16 prefill.
PLAN_OPTIONS = dict(rungs=RUNGS, register_decode=False)


class AttentionOutputs(NamedTuple):
    """The four ONNX outputs, in ONNX order.

    Attributes
    ----------
    Y : Tensor
        `(batch, q_num_heads, q_seq, v_head_size)`, or `(batch, q_seq, q_num_heads * v_head_size)` for 3-D inputs.
    present_key : Tensor
        `(batch, kv_num_heads, total_sequence_length, head_size)`: `past_key` then `K`.
    present_value : Tensor
        `(batch, kv_num_heads, total_sequence_length, v_head_size)`.
    qk_matmul_output : Tensor or None
        `(batch, q_num_heads, q_seq, total_sequence_length)` at the stage `qk_matmul_output_mode` names; None
        unless `return_qk_matmul_output` was set.
    """
    Y: Tensor
    present_key: Tensor
    present_value: Tensor
    qk_matmul_output: Tensor | None


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def _check_float(name, x, like=None):
    if _dtype_name(x) not in T1:
        raise TypeError(f"{name}: expected dtype in {T1}, got {_dtype_name(x)}{bits_hint(x, T1)}")
    if like is not None and np.dtype(x.dtype) != np.dtype(like[1].dtype):
        raise dtype_mismatch(name, x, like[0], like[1], allowed=T1)


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _heads(name, x, num_heads, attr):
    """(heads, seq, size) of a 3-D or 4-D Q/K/V."""
    if x.ndim == 4:
        if num_heads is not None and num_heads != x.shape[1]:
            raise ValueError(f"{attr}: expected {x.shape[1]} (the head axis of 4-D {name}) or None, got {num_heads}")
        return int(x.shape[1]), int(x.shape[2]), int(x.shape[3])
    if num_heads is None:
        raise ValueError(f"{attr}: required with 3-D {name} (batch, seq, heads * size), got None")
    check_int(attr, num_heads, low=1)
    if x.shape[2] % num_heads:
        raise ValueError(f"{name}: expected a hidden size divisible by {attr} = {num_heads}, got {x.shape[2]}")
    return num_heads, int(x.shape[1]), int(x.shape[2]) // num_heads


def validate(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, *, is_causal, kv_num_heads, q_num_heads,
             qk_matmul_output_mode, scale, softcap, softmax_precision, left_window_size, right_window_size, opset):
    """Checks every input and attribute; returns the host nonpad_kv_seqlen (or None)."""
    check_choice("opset", opset, OPSETS)
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if getattr(x, "ndim", None) not in (3, 4):
            raise ValueError(f"{name}: expected a 3-D or 4-D tensor, got shape {tuple(getattr(x, 'shape', ()))}")
    for name, x in (("K", K), ("V", V)):
        if x.ndim != Q.ndim:
            raise ValueError(f"{name}: expected the rank of Q ({Q.ndim}-D), got {x.ndim}-D")
    _check_float("Q", Q)
    _check_float("K", K, ("Q", Q))
    _check_float("V", V, ("Q", Q))
    if opset == 25 and Q.ndim == 4 and (q_num_heads is not None or kv_num_heads is not None):
        named = "q_num_heads" if q_num_heads is not None else "kv_num_heads"
        raise ValueError(f"{named}: opset 25 forbids q_num_heads / kv_num_heads with 4-D inputs (the head axis "
                         f"says), got {named} = {q_num_heads if q_num_heads is not None else kv_num_heads}")
    q_heads, q_len, head_size = _heads("Q", Q, q_num_heads, "q_num_heads")
    kv_heads, kv_len, k_size = _heads("K", K, kv_num_heads, "kv_num_heads")
    v_heads, v_len, v_size = _heads("V", V, kv_num_heads, "kv_num_heads")
    batch = int(Q.shape[0])
    for name, x in (("K", K), ("V", V)):
        if x.shape[0] != batch:
            raise ValueError(f"{name}: expected batch_size {batch} (Q's), got {x.shape[0]}")
    if k_size != head_size:
        raise ValueError(f"K: expected head_size {head_size} (Q's), got {k_size}")
    if (v_heads, v_len) != (kv_heads, kv_len):
        raise ValueError(f"V: expected {kv_heads} heads and kv_sequence_length {kv_len} (K's), got {v_heads}, {v_len}")
    if q_heads % kv_heads:
        raise ValueError(f"kv_num_heads: expected a divisor of q_num_heads ({q_heads}), got {kv_heads}")

    past_len = 0
    # spec: onnx/past-together
    if (past_key is None) != (past_value is None):
        missing = "past_value" if past_value is None else "past_key"
        raise ValueError(f"{missing}: past_key and past_value come together; got only one of them")
    if past_key is not None:
        _check_float("past_key", past_key, ("Q", Q))
        _check_float("past_value", past_value, ("Q", Q))
        check_shape("past_key", past_key, (batch, kv_heads, None, head_size), "(batch, kv_num_heads, past, head_size)")
        past_len = int(past_key.shape[2])
        check_shape("past_value", past_value, (batch, kv_heads, past_len, v_size),
                    "(batch, kv_num_heads, past_sequence_length, v_head_size)")
    total = past_len + kv_len

    nonpad = None
    if nonpad_kv_seqlen is not None:
        if opset < 24:
            raise ValueError(f"nonpad_kv_seqlen: an opset 24 input, got it at opset {opset}")
        # spec: onnx/nonpad-no-past
        if past_key is not None:
            raise ValueError("nonpad_kv_seqlen: not allowed with past_key / past_value (two KV-cache use cases)")
        nonpad = arrays.index_array("nonpad_kv_seqlen", nonpad_kv_seqlen)
        check_shape("nonpad_kv_seqlen", nonpad, (batch,), "(batch_size,)")
        if (nonpad < 0).any() or (nonpad > kv_len).any():
            raise ValueError(f"nonpad_kv_seqlen: expected values in [0, {kv_len}], got {nonpad.tolist()}")

    if attn_mask is not None:
        if _dtype_name(attn_mask) != "bool" and np.dtype(attn_mask.dtype) != np.dtype(Q.dtype):
            raise TypeError(f"attn_mask: expected bool or Q's dtype ({_dtype_name(Q)}), got {_dtype_name(attn_mask)}")
        target = (batch, q_heads, q_len, total)
        shape = tuple(int(s) for s in attn_mask.shape)
        lead_ok = 1 <= len(shape) <= 4 and all(s in (1, t) for s, t in zip(shape[-2::-1], target[-2::-1]))
        if not lead_ok or shape[-1] > total:
            raise ValueError(f"attn_mask: expected a shape broadcastable to {target} (last dim may be shorter), "
                             f"got {shape}")
        if nonpad is not None and shape[-1] < nonpad.max(initial=0):
            raise ValueError(f"attn_mask: expected a last dim >= max(nonpad_kv_seqlen) = {nonpad.max()}, "
                             f"got {shape[-1]}")

    check_flag("is_causal", is_causal)
    check_choice("qk_matmul_output_mode", qk_matmul_output_mode, (0, 1, 2, 3))
    # NaN fails every comparison, and an infinite scale or cap only turns the scores into NaN: both refused.
    if scale is not None and not (_is_real(scale) and 0 < scale < np.inf):
        raise ValueError(f"scale: expected a positive finite float or None, got {scale!r}")
    if not (_is_real(softcap) and 0 <= softcap < np.inf):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 disables it), got {softcap!r}")
    if softmax_precision is not None:
        check_choice("softmax_precision", softmax_precision, (1, 10, 11, 16))
    for name, size in (("left_window_size", left_window_size), ("right_window_size", right_window_size)):
        check_int(name, size, low=-1)
        if opset < 25 and size != -1:
            raise ValueError(f"{name}: an opset 25 attribute, got {size} at opset {opset}")
    return nonpad


@arrays.accepts_torch
def onnx_attention(Q: Tensor, K: Tensor, V: Tensor, attn_mask: Tensor | None = None, past_key: Tensor | None = None,
                   past_value: Tensor | None = None, nonpad_kv_seqlen: IndexTensor | None = None, *,
                   is_causal: int | bool = 0, kv_num_heads: int | None = None, q_num_heads: int | None = None,
                   qk_matmul_output_mode: int = 0, scale: float | None = None, softcap: float = 0.0,
                   softmax_precision: int | None = None, left_window_size: int = -1, right_window_size: int = -1,
                   opset: int = 24, return_qk_matmul_output: bool = False, backend: str = "auto",
                   threads: int | None = None, rung: int | None = None,
                   num_splits: int | None = None) -> AttentionOutputs:
    """ONNX `Attention` (opsets 23 and 24; opset 25's sliding windows): scaled dot-product attention with an
    optional KV cache.

    With `K'` = `[past_key; K]` and `V'` = `[past_value; V]` along the sequence axis (`total_sequence_length`
    = past + kv), and kv head `g = h // (q_num_heads // kv_num_heads)`:

        qk   = (Q[h] · sqrt(scale)) @ (K'[g] · sqrt(scale))ᵀ                     -> mode 0
        qk   = softcap · tanh(qk / softcap)        if softcap > 0                 -> mode 1
        qk   = qk + bias                                                         -> mode 2
        p    = softmax(qk)                          (in softmax_precision)        -> mode 3
        Y[h] = p @ V'[g]

    `bias` is the float `attn_mask`, or 0 / -inf from a bool one (True = attend), padded with -inf past its
    last column; plus -inf where `is_causal` hides key j from query i (`j > i + offset`), outside the windows
    (`j < i + offset - left_window_size`, `j > i + offset + right_window_size`) and at keys
    `≥ nonpad_kv_seqlen[b]`. `offset` is the past length with `past_key`, else `nonpad_kv_seqlen[b] - q_seq`
    when given, else 0. A row with every key hidden gives zeros, never NaN. Softcap comes before the mask,
    as in onnx's reference implementation (1.23.x).

    Parameters
    ----------
    Q : Tensor
        `(batch, q_num_heads, q_seq, head_size)`, or 3-D `(batch, q_seq, q_num_heads * head_size)`;
        float16, float32, float64 or bfloat16 (NumPy: ml_dtypes'; GPU: a torch bfloat16 tensor, or
        `cacheattn.bfloat16(bits)` around a uint16 CuPy array).
    K : Tensor
        `(batch, kv_num_heads, kv_seq, head_size)` or 3-D `(batch, kv_seq, kv_num_heads * head_size)`,
        the dtype and rank of `Q`.
    V : Tensor
        `(batch, kv_num_heads, kv_seq, v_head_size)` or 3-D `(batch, kv_seq, kv_num_heads * v_head_size)`.
    attn_mask : Tensor or None, optional
        bool (True = attend) or the dtype of `Q` (added); broadcastable to
        `(batch, q_num_heads, q_seq, total_sequence_length)`; its last dim may be shorter (padded with
        False / -inf), and covers `max(nonpad_kv_seqlen)` when that is given.
    past_key : Tensor or None, optional
        `(batch, kv_num_heads, past, head_size)`; comes with `past_value`.
    past_value : Tensor or None, optional
        `(batch, kv_num_heads, past, v_head_size)`.
    nonpad_kv_seqlen : IndexTensor or None, optional
        `(batch,)`, integer in `[0, kv_seq]`: the valid keys of each batch (opset ≥ 24; not with a past).
    is_causal : int or bool, default 0
        0/1, or False/True: bottom-right causal mask (see `offset`).
    kv_num_heads : int or None, default None
        Required with 3-D inputs; with 4-D ones None or the head axis of `K`.
    q_num_heads : int or None, default None
        Required with 3-D inputs; divisible by `kv_num_heads`.
    qk_matmul_output_mode : int, default 0
        Which stage `qk_matmul_output` shows: 0 the matmul, 1 after softcap, 2 after the bias, 3 after softmax.
    scale : float or None, default None
        > 0 and finite; None means `1 / sqrt(head_size)`. Applied as `sqrt(scale)` on Q and on K.
    softcap : float, default 0.0
        ≥ 0 and finite; 0 disables it.
    softmax_precision : int or None, default None
        A TensorProto element type for the softmax: 1 float32, 10 float16, 11 float64, 16 bfloat16; None: the
        input dtype.
    left_window_size : int, default -1
        Opset 25: keys more than this far before the query's position are hidden; -1 none.
    right_window_size : int, default -1
        Opset 25: keys more than this far after it are hidden; -1 none.
    opset : int, default 24
        23, 24 or 25: which schema's inputs and attributes are allowed.
    return_qk_matmul_output : bool, default False
        Compute the fourth output.
    backend : str, default "auto"
        "auto", "reference" or "numba".
    threads : int or None, default None
        The kernels' block size, 32 to 1024 (a multiple of 32 on rungs 3 and 4); None: the plan's (128).
    rung : int or None, default None
        The kernel of the ladder (docs/kernel-ladder.md) that computes `Y`: 1 shared-memory tiles, 3 lane groups
        with 16-byte vector loads, 4 rung 3 with split-K, 5 tensor cores (`mma.sync`, a float16 `Q` only), 6
        FlashAttention-2 tiles on tensor cores (a float16 or bfloat16 `Q`, head sizes 16 to 128, K's and V's
        equal; where the present tensors' rows are not 16-byte aligned it runs rung 5 for float16, rung 1 for
        bfloat16). None: the plan's choice (`cacheattn.onnx.kernel_plan` shows it and why): decode (one query a
        batch) on rung 3, or 4 when the grid leaves SMs idle; a float16 or bfloat16 prefill on rung 6 or 5 by
        their bounds; other prefill, float64 (rungs 3 to 6 accumulate in float32) and head sizes their registers
        and shared memory cannot hold on rung 1. Rungs 3 to 5 read `past_key` / `past_value` and `K` / `V` where
        they are, rung 6 reads the present tensors. The reference ignores it.
    num_splits : int or None, default None
        Rung 4's count of key ranges, 1 to 64 (None: chosen from the SMs the grid leaves idle); only with rung 4
        or None (then it asks for rung 4).

    Returns
    -------
    AttentionOutputs
        `(Y, present_key, present_value, qk_matmul_output)`: `Y` is `(batch, q_num_heads, q_seq, v_head_size)`
        (3-D `(batch, q_seq, q_num_heads * v_head_size)` for 3-D inputs); `present_key` / `present_value` are
        `(batch, kv_num_heads, total_sequence_length, head_size / v_head_size)`; `qk_matmul_output` is
        `(batch, q_num_heads, q_seq, total_sequence_length)`, or None unless `return_qk_matmul_output`.
        All in the dtype of `Q`.

    Raises
    ------
    ValueError
        Named by the ONNX input or attribute: ranks, head counts, sizes, a mask not broadcastable,
        `past_key` without `past_value`, `nonpad_kv_seqlen` with a past or at opset 23, attributes out of
        range (`is_causal` other than 0/1/False/True; a NaN or infinite `scale` or `softcap`), an opset 25
        attribute at opset 24.
    TypeError
        A dtype outside the four floats (a uint16 array names `cacheattn.bfloat16`), mismatched dtypes (float16
        beside bfloat16 too), a float `nonpad_kv_seqlen`; a bfloat16 call on the kernels of a GPU below sm_80.

    Notes
    -----
    Source: ONNX [Attention](https://github.com/onnx/onnx/blob/main/docs/Operators.md#Attention)
    (`onnx.defs.get_schema("Attention", 24).doc`). All 93 onnx node test cases for Attention pass on both
    backends (docs/conformance.md).

    Examples
    --------
    >>> import numpy as np, cacheattn
    >>> rng = np.random.default_rng(0)
    >>> Q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)            # 4 query heads
    >>> K, V = rng.standard_normal((2, 1, 2, 3, 8)).astype(np.float32)      # 2 kv heads (GQA)
    >>> past = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    >>> out = cacheattn.onnx_attention(Q, K, V, past_key=past, past_value=past, is_causal=True)
    >>> out.Y.shape, out.present_key.shape, out.qk_matmul_output
    ((1, 4, 2, 8), (1, 2, 8, 8), None)
    >>> bool(np.array_equal(out.present_key[:, :, 5:], K))
    True
    """
    data = dict(Q=Q, K=K, V=V, attn_mask=attn_mask, past_key=past_key, past_value=past_value)
    engine = arrays.resolve_backend(backend, data)
    attrs = dict(is_causal=check_flag("is_causal", is_causal), kv_num_heads=kv_num_heads, q_num_heads=q_num_heads,
                 qk_matmul_output_mode=qk_matmul_output_mode, scale=scale, softcap=softcap,
                 softmax_precision=softmax_precision, left_window_size=left_window_size,
                 right_window_size=right_window_size)
    nonpad = validate(Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen, opset=opset, **attrs)
    check_choice("return_qk_matmul_output", int(bool(return_qk_matmul_output)), (0, 1))
    check_launch(rung, threads, num_splits, rungs=RUNGS, float64="Q" if _dtype_name(Q) == "float64" else None)
    if rung == 5 and _dtype_name(Q) != "float16":
        raise ValueError(f"rung: 5 (tensor cores, mma.sync on float16) needs a float16 Q, got {_dtype_name(Q)}")
    if rung == 6 and _dtype_name(Q) not in ("float16", "bfloat16"):
        raise ValueError(f"rung: 6 (tensor cores, mma.sync on float16 or bfloat16) needs a float16 or bfloat16 Q, "
                         f"got {_dtype_name(Q)}")
    if engine != "reference":
        check_bfloat16_arch("Q", Q, arrays.compute_capability)
        launch = kernel_plan(Q, K, V, past_key, q_num_heads=q_num_heads, kv_num_heads=kv_num_heads,
                             is_causal=attrs["is_causal"], rung=rung, num_splits=num_splits, threads=threads)
    if engine == "reference":
        return AttentionOutputs(*arrays.run_reference(data, (), lambda h: reference.onnx_attention(
            h["Q"], h["K"], h["V"], h["attn_mask"], h["past_key"], h["past_value"], nonpad,
            return_qk_matmul_output=return_qk_matmul_output, **attrs)))
    data = {name: arrays.as_kernel_array(x) for name, x in data.items()}
    return AttentionOutputs(*arrays.kernels().onnx_attention(
        data["Q"], data["K"], data["V"], data["attn_mask"], data["past_key"], data["past_value"],
        None if nonpad is None else arrays.kernel_index(data["Q"], nonpad_kv_seqlen, nonpad),
        return_qk_matmul_output=return_qk_matmul_output, threads=launch.threads, rung=launch.rung,
        num_splits=launch.num_splits if launch.rung == 4 else None, **attrs))


def kernel_plan(Q, K, V, past_key=None, *, q_num_heads=None, kv_num_heads=None, is_causal=0, rung=None,
                num_splits=None, threads=None, sms=None) -> KernelPlan:
    """The `KernelPlan` (rung, splits, block size, reason) the kernels run `onnx_attention` with for these
    inputs (validated ones: `onnx_attention` checks them first): `cacheattn.choose_kernel` of the call's shape. Decode
    (one query a batch) on rung 3 or 4, or rung 5 where the tensor cores are faster; prefill on rung 6 or 5 when
    the plan picks it (rung 6: a float16 or bfloat16 Q, K's and V's head sizes equal; rung 5: a float16 Q), else on
    rung 1 unless `rung` asks for 3 or 4; rung 1 where the others cannot:
    float64, a block size of partial warps, or head sizes whose rows do not fit their registers and shared
    memory. A 4-D prefill is not split (rung 4's combine writes (token, head) rows) and runs on rung 3.

    Examples
    --------
    >>> import numpy as np
    >>> from cacheattn.onnx import kernel_plan
    >>> Q = np.zeros((1, 32, 1, 128), np.float16)                      # decode: one query a batch
    >>> K = V = np.zeros((1, 8, 1, 128), np.float16)
    >>> past = np.zeros((1, 8, 32768, 128), np.float16)
    >>> p = kernel_plan(Q, K, V, past, sms=132)
    >>> p.rung, p.num_splits
    (4, 33)
    >>> kernel_plan(Q.astype(np.float64), K, V, past, sms=132).reason
    'fallback to shared-memory tiles: rungs 3 and 4 accumulate in float32, Q is float64'
    """
    four_d = Q.ndim == 4
    q_heads = int(Q.shape[1]) if four_d else int(q_num_heads)
    kv_heads = int(K.shape[1]) if four_d else int(kv_num_heads)
    q_len = int(Q.shape[2] if four_d else Q.shape[1])
    head_size = int(Q.shape[-1]) if four_d else int(Q.shape[-1]) // q_heads
    v_size = int(V.shape[-1]) if four_d else int(V.shape[-1]) // kv_heads
    total = int(K.shape[2] if four_d else K.shape[1]) + (0 if past_key is None else int(past_key.shape[2]))
    if _dtype_name(Q) == "float64" and rung in (None, 1):
        return KernelPlan(1, 1, threads or 128, "fallback to shared-memory tiles: rungs 3 and 4 accumulate in "
                                                "float32, Q is float64" if rung is None else "rung=1 asked for")
    dtype = np.dtype(Q.dtype)          # bfloat16 too: the kernels read its bits, 2 bytes an element
    batch = int(Q.shape[0])
    shape = AttentionShape(batch=batch, max_query_len=q_len, max_kv_len=total, num_heads=q_heads,
                           num_kv_heads=kv_heads, head_dim=max(head_size, v_size), query_dtype=dtype,
                           decode_sequences=batch if q_len == 1 else 0, causal=bool(is_causal),
                           keys_apart=True)       # K and V are inputs of their own: fewer keys than queries is fine
    if rung == 1:
        return plan_kernels(shape, rung=1, threads=threads, sms=sms, **PLAN_OPTIONS)
    # Rung 6 holds one head size for K and V (its tiles are rows of head_dim): another V runs on the others.
    one_size = head_size == v_size
    if rung == 6 and not one_size:
        raise ValueError(f"rung: 6 needs K's and V's head sizes equal (its K and V tiles are rows of one head size), "
                         f"got {head_size} and {v_size}; rung=5 or None runs it")
    options = PLAN_OPTIONS if one_size else dict(PLAN_OPTIONS, rungs=tuple(r for r in RUNGS if r != 6))
    chosen = plan_kernels(shape, rung=rung, num_splits=num_splits, threads=threads, sms=sms, **options)
    if not one_size and q_len > 1 and rung is None:
        chosen = replace(chosen, reason=f"{chosen.reason}; not rung 6: head_size {head_size} and v_head_size "
                                        f"{v_size} differ")
    if rung is None and num_splits is None and q_len > 1 and chosen.rung not in (5, 6):
        return KernelPlan(1, 1, threads or 128, f"prefill runs on shared-memory tiles unless the tensor cores serve "
                                                f"it or rung=3 or 4 asks for the vector kernel ({chosen.reason})")
    if chosen.rung == 4 and four_d and q_len > 1:
        chosen = KernelPlan(3, 1, chosen.threads, f"{chosen.reason}; a 4-D prefill runs unsplit on rung 3 (rung 4's "
                                                  "combine writes (token, head) rows)")
    return chosen
