"""Checks that run before any reference or kernel: each error names the document's parameter,
says what was expected and what came."""

from __future__ import annotations

import numpy as np

FLOAT_T1 = ("float16", "float32")


def dtype_of(x) -> np.dtype:
    return np.dtype(x.dtype)


def check_choice(name: str, value, choices) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")


def check_flag(name: str, value) -> int:
    """A 0/1 attribute (ONNX's is_causal): Python and NumPy bools are accepted as 0 and 1; returns the int."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if not isinstance(value, (int, np.integer)) or value not in (0, 1):
        raise ValueError(f"{name}: expected 0, 1, False or True, got {value!r}")
    return int(value)


def check_int(name: str, value, *, low: int, high: int | None = None) -> int:
    """An integer attribute in [low, high] (high None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: expected an int {span}, got {value}")
    return int(value)


MAX_SPLITS = 64     # split-K's most key ranges, the cap of kernels_numba._split_k.choose_splits too


def check_launch(rung, threads, num_splits, *, rungs: tuple, split_rungs: tuple = (4,), min_threads: int = 32,
                 float64: str | None = None):
    """The kernels' own keywords, checked alike on every operator and on either backend (a call fails the same way
    wherever it runs): `rung` None (the plan's choice) or one of `rungs`; `threads` None or a block size of
    min_threads to 1024, whole warps on any rung past 1; `num_splits` None or 1 to MAX_SPLITS, with a rung of
    `split_rungs` (split-K; TensorRT-LLM's rung 1 splits too, as its multi-block mode) or alone, which asks for
    it. `float64` names the call's input when it is float64: rungs 3 to 5 accumulate in float32 and cannot
    take it."""
    if rung is not None:
        check_choice("rung", rung, rungs)
        if float64 is not None and rung >= 3:
            raise ValueError(f"rung: {rung} accumulates in float32; a float64 {float64} runs on rung 1 "
                             "(rung None or 1)")
    if threads is not None:
        check_int("threads", threads, low=min_threads, high=1024)
        if (rung or 1) >= 2 and threads % 32:
            raise ValueError(f"threads: expected a multiple of 32 for rung {rung} (whole warps), got {threads}")
    if num_splits is not None:
        if rung is not None and rung not in split_rungs:
            raise ValueError(f"num_splits: only rung {' or '.join(map(str, split_rungs))} splits the keys, got "
                             f"num_splits={num_splits!r} with rung {rung}")
        check_int("num_splits", num_splits, low=1, high=MAX_SPLITS)


def check_dtype(name: str, x, allowed) -> None:
    if dtype_of(x).name not in allowed:
        raise TypeError(f"{name}: expected dtype in {tuple(allowed)}, got {dtype_of(x).name}{bits_hint(x, allowed)}")


def bits_hint(x, allowed) -> str:
    """What to add to a dtype error for a 16-bit integer tensor where bfloat16 is allowed: CuPy has no bfloat16, so
    its bits come as uint16, and cacheattn.bfloat16 says what they are."""
    if "bfloat16" in allowed and dtype_of(x).name in ("uint16", "int16"):
        return "; for bfloat16 bits on a GPU (CuPy has no bfloat16) pass cacheattn.bfloat16(x)"
    return ""


BFLOAT16_ARCH = (8, 0)      # cvt.rn.bf16x2.f32, which rounds the kernels' bfloat16 results, is sm_80+


def check_bfloat16_arch(name: str, x, compute_capability) -> None:
    """A bfloat16 `x` headed for the kernels needs a GPU of compute capability 8.0 or newer; compute_capability
    returns the current GPU's (major, minor), or None in the simulator (no architecture to check). It is asked only
    for a bfloat16 `x`: other dtypes need no device."""
    if dtype_of(x).name != "bfloat16":
        return
    compute_capability = compute_capability()
    if compute_capability is None:
        return
    if tuple(compute_capability) < BFLOAT16_ARCH:
        major, minor = compute_capability
        raise TypeError(f"{name}: bfloat16 on the kernels needs a GPU of compute capability 8.0 (sm_80) or newer, "
                        f"this one is {major}.{minor} (sm_{major}{minor}); pass float16 or float32, or "
                        "backend='reference'")


def check_same_dtype(name: str, x, other_name: str, other, *, allowed=None, why: str = "") -> None:
    """x must have the dtype of `other`, the array the call follows (its dtype is checked first); `allowed`: the
    dtypes the two may share (None: any), `why`: the rule, said in the message."""
    if dtype_of(x) != dtype_of(other):
        raise dtype_mismatch(name, x, other_name, other, allowed=allowed, why=why)


def dtype_mismatch(name: str, x, other_name: str, other, *, allowed=None, why: str = "") -> TypeError:
    """The TypeError for x whose dtype is not that of `other`, the array the call follows: it names both arrays and
    says how to make them agree (either dtype, where `allowed` takes it), so the fix is not always to convert x."""
    got, want = dtype_of(x).name, dtype_of(other).name
    rule = f" ({why})" if why else ""
    if allowed is None or got in allowed:
        fix = f"pass both as {got} or both as {want}"
    else:
        fix = f"pass {name} as {want}"
    return TypeError(f"{name}: expected {other_name}'s dtype {want}{rule}, got {got}: the call follows "
                     f"{other_name}; {fix}")


def check_shape(name: str, x, expected: tuple, meaning: str = "") -> None:
    """expected holds ints, or None where any extent is fine."""
    shape = tuple(int(s) for s in x.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape))
    if not ok:
        want = _shape_text(tuple("*" if e is None else str(e) for e in expected))
        raise ValueError(f"{name}: expected shape {want}{' ' + meaning if meaning else ''}, got {shape}")


def _shape_text(extents: tuple) -> str:
    """A shape as Python prints a tuple: (2,) for one extent, (2, 3) for two."""
    return "(" + ", ".join(extents) + ("," if len(extents) == 1 else "") + ")"


def check_contiguous(name: str, x) -> None:
    """Kernels address in-out tensors through flat views, so they must be C-contiguous."""
    flags = getattr(x, "flags", None)
    contiguous = flags["C_CONTIGUOUS"] if flags is not None else True
    if not contiguous:
        raise ValueError(f"{name}: expected a C-contiguous tensor for the kernels, got strides {x.strides}")


def check_starts(name: str, starts: np.ndarray, total: int | None, total_name: str) -> np.ndarray:
    """seqstarts / kvstarts: (B+1,), starting at 0, non-decreasing, ending at the packed length. Returns lengths."""
    if starts.ndim != 1 or starts.shape[0] < 2:
        raise ValueError(f"{name}: expected shape (B+1,) with B >= 1, got {starts.shape}")
    if starts[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {starts[0]}")
    lengths = np.diff(starts)
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"{name}: expected non-decreasing values, got {name}[{b + 1}] = {starts[b + 1]} "
                         f"< {name}[{b}] = {starts[b]}")
    if total is not None and starts[-1] != total:
        raise ValueError(f"{name}: expected {name}[B] == {total} ({total_name}), got {starts[-1]}")
    return lengths
