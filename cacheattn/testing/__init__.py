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
    """Check impl against operator `op` (a key of OPERATORS) on up to max_examples drawn problems."""
    return run_check(_operator(op), impl, max_examples=max_examples, dtypes=dtypes, features=features, seed=seed)


def problem(op: str, case) -> tuple[tuple, dict]:
    """(positional arguments, keyword arguments) of the problem `case` describes: NumPy arrays rebuilt from its
    seed. A keyword-only operator (gpt_attention) has every argument, tensors too, in the second."""
    operator = _operator(op)
    return operator.arguments(*operator.problem(case))


def check_case(op: str, impl: Callable, case) -> None:
    """One problem, as a reproducer replays it: raises ConformanceError unless impl conforms on it."""
    run_example(_operator(op), impl, case)


def reference(op: str, case):
    """What cacheattn's reference returns for `case` (its in-place tensors updated on copies)."""
    operator = _operator(op)
    inputs, attrs = operator.problem(case)
    return call(operator, operator.function, inputs, attrs, backend="reference")


def _checker(op: str):
    operator = OPERATORS[op]

    def checker(impl: Callable, *, max_examples: int = 100, dtypes: Iterable[str] | None = None,
                features: Iterable[str] | None = None, seed: int | None = None) -> Report:
        return check(op, impl, max_examples=max_examples, dtypes=dtypes, features=features, seed=seed)

    checker.__name__ = checker.__qualname__ = f"check_{op}"
    checker.__doc__ = (f"Check impl, called like cacheattn.{operator.documented()}, against the reference.\n\n"
                       f"dtypes: a subset of {operator.dtypes}. features (default all):\n"
                       + "\n".join(f"    {name}: {meaning}" for name, meaning in operator.features.items()))
    return checker


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
