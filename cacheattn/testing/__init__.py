"""Conformance kit: is your implementation of one of these operators computing what its document says?

    import cacheattn.testing as kit
    report = kit.check_multi_head_cache_attention(my_impl, max_examples=100,
                                                  features={"causal", "gqa", "cache_layout_0", "cache_mode_1"})
    print(report)

`impl` is called exactly like the cacheattn function of the same name (same positional arguments in the
same order, the attributes by keyword; gpt_attention, keyword-only, gets every tensor by keyword too), with
NumPy arrays in; it may return NumPy, CuPy, DLPack or any array-like. Each example compares its outputs with
the reference (float64 evaluation, per-dtype tolerance; bit-exact where the document fixes every bit: caches,
scales, dequantized keys, ONNX presents) and its in-place cache/scale updates bit for bit, untouched slots
included (gpt_attention's RoPE'd keys within a rounding rule: see ROPE_SLACK in _operators.py). The first
failure is shrunk by hypothesis and raised as `ConformanceError` (an AssertionError) naming the smallest
problem, the first bad indices, and a ready-to-paste reproducer. `features=` declares what impl supports
(default: all of `FEATURES[op]`); `dtypes=` narrows the dtypes; `seed=` makes the run repeatable (no example
database).
`python -m pytest --cacheattn-impl=module:function --cacheattn-op=NAME` runs the same check as one test.

Adding an operator: write its case strategy in `cacheattn/testing/strategies.py`, add one `Operator(...)` to
`OPERATORS` in `cacheattn/testing/_operators.py` (function, features, strategy, uses, problem, expect,
outputs, in_place; aliases for an output that returns an in-place input), and one line here, as
`check_gpt_attention = _checker("gpt_attention")`, plus its name in `__all__`. The pytest plugin, reports,
reproducers and signature checks follow from the entry.

hypothesis is needed here only (`pip install cacheattn[testing]`); `import cacheattn` does not import it.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("cacheattn.testing needs hypothesis: pip install 'cacheattn[testing]' "
                      "(or pip install 'hypothesis>=6.100')") from exc

from collections.abc import Callable, Iterable

from cacheattn.examples import FTCase, OnnxCase, PPLCase, StaticCase, TrtCase

from ._core import ConformanceError, Report, call, run_check, run_example
from ._operators import OPERATORS, DynamicCacheCase, FTRequest, OnnxRequest

FEATURES = {name: tuple(op.features) for name, op in OPERATORS.items()}


def _operator(op: str):
    if op not in OPERATORS:
        raise ValueError(f"op: expected one of {', '.join(OPERATORS)}, got {op!r}")
    return OPERATORS[op]


def check(op: str, impl: Callable, *, max_examples: int = 100, dtypes: Iterable[str] | None = None,
          features: Iterable[str] | None = None, seed: int | None = None) -> Report:
    """Check `impl` against operator `op` on up to `max_examples` problems that hypothesis draws.

    Parameters
    ----------
    op : str
        A key of `OPERATORS`: "multi_head_cache_attention", "dynamic_multi_head_attention",
        "dynamic_key_value_cache", "key_value_cache", "onnx_attention", "cross_attention" or "gpt_attention".
    impl : Callable
        Called like `cacheattn.<op>` (same positional arguments in the same order, attributes by keyword;
        gpt_attention's every argument by keyword) with NumPy arrays; may return NumPy, CuPy, DLPack or any
        array-like, and must update the in-place tensors (`cache`, `scale`, ...) as the document says.
    max_examples : int, default 100
        Problems to draw.
    dtypes : iterable of str or None, default None
        A subset of the operator's dtypes (None: all of them).
    features : iterable of str or None, default None
        What `impl` supports, a subset of `FEATURES[op]` (None: all); problems use only these.
    seed : int or None, default None
        A repeatable run (no example database is kept either way).

    Returns
    -------
    Report
        What ran: the examples, dtypes and the declared features the draws exercised (`str` prints it).

    Raises
    ------
    ConformanceError
        The first problem `impl` gets wrong, shrunk by hypothesis: the output, the first bad indices, the
        inputs and a ready-to-paste reproducer.
    ValueError
        An unknown `op`, feature or dtype, or an `impl` whose signature does not take the operator's arguments.

    See Also
    --------
    check_multi_head_cache_attention, check_dynamic_multi_head_attention, check_dynamic_key_value_cache,
    check_key_value_cache, check_onnx_attention, check_cross_attention, check_gpt_attention :
        `check` with `op` fixed; each one's `help()` lists its operator's features and what each exercises.

    Examples
    --------
    >>> import cacheattn, cacheattn.testing as kit
    >>> kit.FEATURES["key_value_cache"]
    ('int8', 'int4', 'cache_layout_0', 'cache_layout_1', 'num_repeat')
    >>> print(kit.check("key_value_cache", cacheattn.key_value_cache, max_examples=3, seed=0))
    key_value_cache: 3 examples pass (float16, float32); features exercised: ...
    >>> def scaled(*args, **kwargs):                 # a wrong implementation: keys 1.5 times too large
    ...     out = cacheattn.key_value_cache(*args, **kwargs)
    ...     out.key[...] *= 1.5
    ...     return out
    >>> kit.check("key_value_cache", scaled, max_examples=3, seed=0)
    Traceback (most recent call last):
    ...
    cacheattn.testing._core.ConformanceError: key_value_cache does not conform to its document on this problem ...
    """
    return run_check(_operator(op), impl, max_examples=max_examples, dtypes=dtypes, features=features, seed=seed)


def problem(op: str, case) -> tuple[tuple, dict]:
    """The arguments of the problem `case` describes, NumPy arrays rebuilt from its seed.

    Parameters
    ----------
    op : str
        A key of `OPERATORS`.
    case : PPLCase, StaticCase, DynamicCacheCase, OnnxRequest, FTRequest or TrtCase
        A case as the operator's strategy draws it (a failure report prints the one to pass).

    Returns
    -------
    tuple of (tuple, dict)
        `(positional arguments, keyword arguments)`; a keyword-only operator (gpt_attention) has every
        argument, tensors too, in the second.

    Examples
    --------
    >>> from cacheattn import testing as kit
    >>> case = kit.StaticCase(batch=1, max_batch=2, seqlen=2, start_pos=3, max_seqlen=6, num_heads=2,
    ...                       head_dim=8, dtype="float32", quant_bit=0, quant_group=8, num_layer=1, layer_idx=0,
    ...                       num_repeat=1, cache_layout=0, seed=0)
    >>> args, kwargs = kit.problem("key_value_cache", case)
    >>> [getattr(a, "shape", a) for a in args]        # current_key, current_value, start_pos, cache, scale
    [(1, 2, 2, 8), (1, 2, 2, 8), 3, (2, 1, 2, 6, 2, 8), None]
    >>> kwargs["num_repeat"], kwargs["cache_layout"]
    (1, 0)
    """
    operator = _operator(op)
    return operator.arguments(*operator.problem(case))


def check_case(op: str, impl: Callable, case) -> None:
    """Check `impl` on one problem, as a reproducer replays it.

    Parameters
    ----------
    op : str
        A key of `OPERATORS`.
    impl : Callable
        Called like `cacheattn.<op>` (see `check`).
    case : object
        The problem, as `problem` takes it.

    Raises
    ------
    ConformanceError
        Unless `impl` conforms on this problem.
    """
    run_example(_operator(op), impl, case)


def reference(op: str, case):
    """What cacheattn's reference returns for `case` (its in-place tensors updated on copies).

    Parameters
    ----------
    op : str
        A key of `OPERATORS`.
    case : object
        The problem, as `problem` takes it.

    Returns
    -------
    object
        The operator's return value on the reference backend (an array or a named tuple of arrays).
    """
    operator = _operator(op)
    inputs, attrs = operator.problem(case)
    return call(operator, operator.function, inputs, attrs, backend="reference")


def _checker(op: str):
    operator = OPERATORS[op]

    def checker(impl: Callable, *, max_examples: int = 100, dtypes: Iterable[str] | None = None,
                features: Iterable[str] | None = None, seed: int | None = None) -> Report:
        return check(op, impl, max_examples=max_examples, dtypes=dtypes, features=features, seed=seed)

    checker.__name__ = checker.__qualname__ = f"check_{op}"
    checker.__doc__ = _checker_doc(op, operator)
    return checker


def _checker_doc(op: str, operator) -> str:
    """`check_<op>`'s NumPy-style docstring: `check`'s, with this operator's call, dtypes and features."""
    features = "\n".join(f"        - `{name}`: {meaning}" for name, meaning in operator.features.items())
    return f"""Check `impl` against `cacheattn.{op}` on up to `max_examples` drawn problems (see `check`).

    `impl` is called like `cacheattn.{operator.documented()}`.

    Parameters
    ----------
    impl : Callable
        The implementation under test, called with NumPy arrays.
    max_examples : int, default 100
        Problems to draw.
    dtypes : iterable of str or None, default None
        A subset of {", ".join(operator.dtypes)} (None: all).
    features : iterable of str or None, default None
        What `impl` supports (None: all of them):

{features}
    seed : int or None, default None
        A repeatable run.

    Returns
    -------
    Report
        The examples, dtypes and features exercised.

    Raises
    ------
    ConformanceError
        The first (shrunk) problem `impl` gets wrong, with a reproducer.
    ValueError
        An unknown feature or dtype, or a signature that does not take the operator's arguments.
    """


check_multi_head_cache_attention = _checker("multi_head_cache_attention")
check_dynamic_multi_head_attention = _checker("dynamic_multi_head_attention")
check_dynamic_key_value_cache = _checker("dynamic_key_value_cache")
check_key_value_cache = _checker("key_value_cache")
check_onnx_attention = _checker("onnx_attention")
check_cross_attention = _checker("cross_attention")
check_gpt_attention = _checker("gpt_attention")

__all__ = ["FEATURES", "OPERATORS", "ConformanceError", "DynamicCacheCase", "FTCase", "FTRequest", "OnnxCase",
           "OnnxRequest", "PPLCase", "Report", "StaticCase", "TrtCase", "check", "check_case",
           "check_cross_attention", "check_dynamic_key_value_cache", "check_gpt_attention",
           "check_dynamic_multi_head_attention", "check_key_value_cache", "check_multi_head_cache_attention",
           "check_onnx_attention", "problem", "reference"]
