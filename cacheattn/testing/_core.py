"""The checking machinery shared by every operator: the registry entry, one example, the hypothesis run,
the failure report and its reproducer.

An `Operator` says how to draw a problem (strategy), how to turn it into the documented arguments
(problem), and what the document expects of the result (expect). Everything else — calling the
implementation, comparing outputs and in-place tensors, naming the first bad index, shrinking, writing
the reproducer — is here, once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed

from cacheattn._arrays import to_host
from cacheattn.examples import TOLERANCE, copy_inputs, within_tolerance

# Arguments of cacheattn's functions that are ours, not the document's: never passed to an implementation.
OWN_PARAMETERS = ("backend", "threads", "rung", "num_splits")


class ConformanceError(AssertionError):
    """An implementation computed something the document does not allow; the message says what and how to
    reproduce it."""


@dataclass(frozen=True)
class Expect:
    """What one output must be: `bits` (bit-for-bit equal to `want`) or `close` (of dtype `dtype`, within the
    tolerance of `tolerance` (default: `dtype`) widened by `scale`, of the float64 `want`; infinities must match
    exactly; `dtype` None: any dtype, `tolerance` says which; `against` names what `want` is). For an in-place
    tensor a `close` rule applies to the elements the call writes; the rest stay bit-identical.

    `where` (bool, want's shape): the elements the document fixes; the others are not compared (padding rows).
    `slack` (low, high), float64 arrays of want's shape, NaN where none: a `bits` element that differs in its
    bits may still lie in [low, high] (as values of want's dtype: int8 codes, decoded e4m3); `why` says why in
    the report."""
    rule: str
    want: np.ndarray
    dtype: str | None = None
    scale: float = 1.0
    tolerance: str | None = None                # a float32 buffer of a float16 call is held to float16's
    where: np.ndarray | None = None
    slack: tuple | None = None
    why: str = ""
    against: str | None = "a float64 evaluation"    # what `want` is, for a `close` rule's report


@dataclass(frozen=True)
class Operator:
    """One operator in the registry (see the package docstring for adding one)."""
    name: str                                   # cacheattn.<name>: the documented signature, run as reference
    function: Callable
    features: Mapping[str, str]                 # feature name -> what a case with it exercises
    dtypes: tuple
    strategy: Callable                          # (features: frozenset, dtypes: tuple) -> SearchStrategy of cases
    uses: Callable                              # case -> frozenset of the features it exercises
    problem: Callable                           # case -> (inputs by documented name, keyword attributes)
    expect: Callable                            # (case, inputs, attrs) -> {output name: Expect or None}
    outputs: tuple                              # output names in the document's order
    in_place: tuple = ()                        # inputs the operator updates (cache, scale)
    aliases: Mapping[str, str] = field(default_factory=dict)   # output -> the in-place input it returns
    requires: tuple = ()                        # groups of features of which a declaration needs one
    needs: Mapping[str, tuple] = field(default_factory=dict)  # feature -> features of which it needs one
    case_imports: tuple = field(default=())     # names the reproducer imports from cacheattn.testing

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.function)

    @property
    def positional(self) -> tuple:
        return tuple(n for n, p in self.signature.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD)

    @property
    def attributes(self) -> tuple:
        """The keyword-only arguments: the attributes (of gpt_attention, every argument)."""
        return tuple(n for n, p in self.signature.parameters.items()
                     if p.kind is p.KEYWORD_ONLY and n not in OWN_PARAMETERS)

    def documented(self) -> str:
        names = list(self.positional) + ["*"] + list(self.attributes)
        return f"{self.name}({', '.join(names)})"

    def given(self, inputs: dict) -> dict:
        """The inputs a call passes, in its order: the positional ones, then those the signature takes by keyword
        only (every tensor of a keyword-only operator such as gpt_attention). A problem may hold more (shared
        builders): those are not passed."""
        return {**{n: inputs[n] for n in self.positional}, **{n: v for n, v in inputs.items() if n in self.attributes}}

    def arguments(self, inputs: dict, attrs: dict) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of the call: positional inputs in order; keyword inputs and
        attributes by keyword."""
        keyword = {n: v for n, v in inputs.items() if n in self.attributes}
        return tuple(inputs[n] for n in self.positional), {**keyword, **attrs}


@dataclass(frozen=True)
class Report:
    """What a passing check ran: stable text (no timings), so docs can print it."""
    operator: str
    examples: int
    dtypes: tuple
    features: tuple                             # declared features the examples exercised
    not_covered: tuple                          # declared features no example exercised

    def __str__(self) -> str:
        text = (f"{self.operator}: {self.examples} examples pass ({', '.join(self.dtypes)}); "
                f"features exercised: {', '.join(self.features) or 'none beyond the base case'}")
        if self.not_covered:
            text += f"; declared but not drawn: {', '.join(self.not_covered)}"
        return text


# ---------------------------------------------------------------------------------------------- arguments

def resolve_features(op: Operator, features, dtypes) -> tuple[frozenset, tuple]:
    """The declared features and dtypes, checked against the operator's."""
    declared = frozenset(op.features) if features is None else frozenset(_names("features", features))
    unknown = sorted(declared - set(op.features))
    if unknown:
        raise ValueError(f"features: unknown for {op.name}: {', '.join(unknown)}; known: {', '.join(op.features)}")
    for group in op.requires:
        if not declared & set(group):
            raise ValueError(f"features: {op.name} needs at least one of {', '.join(group)}")
    for feature, group in op.needs.items():
        if feature in declared and not declared & set(group):
            raise ValueError(f"features: {feature} needs {' or '.join(group)} declared too")
    chosen = op.dtypes if dtypes is None else tuple(_names("dtypes", dtypes))
    bad = [d for d in chosen if d not in op.dtypes]
    if bad or not chosen:
        raise ValueError(f"dtypes: expected a non-empty subset of {op.dtypes} for {op.name}, got {chosen}")
    return declared, chosen


def _names(what, value) -> list:
    if isinstance(value, str):
        return [value]
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{what}: expected a collection of names, got {value!r}") from None


def check_signature(op: Operator, impl) -> None:
    """impl must take the documented positional arguments in order and accept every keyword-only one (the
    attributes; every tensor too for a keyword-only operator such as gpt_attention) by keyword."""
    if not callable(impl):
        raise TypeError(f"impl: expected a callable with the signature {op.documented()}, got {impl!r}")
    try:
        params = inspect.signature(impl).parameters
    except (TypeError, ValueError):
        return                                    # no introspectable signature (some C callables): trust it
    kinds = inspect.Parameter
    prefix = f"impl: expected the signature {op.documented()}; "
    has_var_args = any(p.kind is kinds.VAR_POSITIONAL for p in params.values())
    has_var_kw = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    positional = [n for n, p in params.items() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if not has_var_args:
        for i, want in enumerate(op.positional):
            if i >= len(positional):
                raise TypeError(prefix + f"it takes {len(positional)} positional arguments, the document has "
                                          f"{len(op.positional)} (missing {want})")
            if positional[i] != want:
                raise TypeError(prefix + f"positional argument {i} is named {positional[i]!r}, expected {want!r}")
    for name in op.attributes:
        p = params.get(name)
        if p is None and not has_var_kw:
            raise TypeError(prefix + f"it does not accept the keyword argument {name!r}")
        if p is not None and p.kind is kinds.POSITIONAL_ONLY:
            raise TypeError(prefix + f"{name!r} must be accepted by keyword, it is positional-only")
    known = set(op.positional) | set(op.attributes)
    extra = [n for n, p in params.items() if n not in known and p.default is p.empty
             and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    if extra:
        raise TypeError(prefix + f"it requires arguments the document does not have: {', '.join(extra)}")


# ---------------------------------------------------------------------------------------------- one example

def as_numpy(x):
    """A NumPy view of anything array-like an implementation returns (NumPy, CuPy, CUDA array interface,
    DLPack, lists)."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not hasattr(x, "__cuda_array_interface__") and not hasattr(x, "get"):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError):
            pass
    return np.asarray(to_host(x))


def mismatch(name: str, got, expect: Expect, shown: int = 3, labels: np.ndarray | None = None,
             only: np.ndarray | None = None) -> str | None:
    """None when `got` satisfies `expect`, else one paragraph: the rule, how many differ, the first bad
    indices with got / expected. `labels` (bool, same shape) marks elements the call writes; `only` (bool)
    limits the comparison to those elements."""
    want = expect.want
    in_place = only is not None
    if expect.where is not None:
        only = expect.where if only is None else only & expect.where
    if got is None:
        return f"{name}: the implementation returned None, expected {want.dtype.name}{want.shape}"
    got = as_numpy(got)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape}, expected {want.shape}"
    if expect.rule == "bits":
        if got.dtype != want.dtype:
            return f"{name}: dtype {got.dtype.name}, expected {want.dtype.name}"
        g = got.reshape(*got.shape, 1).view(np.uint8) if got.ndim else got.reshape(1).view(np.uint8)
        w = want.reshape(*want.shape, 1).view(np.uint8) if want.ndim else want.reshape(1).view(np.uint8)
        bad = (g != w).any(axis=-1).reshape(want.shape)
        rule = "bit-exact"
        if expect.slack is not None:
            low, high = expect.slack
            value = got.astype(np.float64)
            with np.errstate(invalid="ignore"):
                bad &= ~((value >= low) & (value <= high))
    else:
        if expect.dtype is not None and got.dtype != np.dtype(expect.dtype):
            return f"{name}: dtype {got.dtype.name}, expected {np.dtype(expect.dtype).name} (the inputs' dtype)"
        g, w = got.astype(np.float64), want.astype(np.float64)
        infinite = np.isinf(w)
        tolerance = expect.tolerance or expect.dtype
        with np.errstate(invalid="ignore"):
            bad = np.where(infinite, g != w, ~within_tolerance(g, w, tolerance, expect.scale))
        atol, rtol = (t * expect.scale for t in TOLERANCE[np.dtype(tolerance)])
        rule = f"{np.dtype(tolerance).name} tolerance atol {atol:g}, rtol {rtol:g}"
        rule += f" against {expect.against}" if expect.against else ""
    if expect.why:
        rule += f"; {expect.why}"
    if only is not None:
        bad &= only
        rule += ", on the elements this call writes" if in_place and expect.rule == "close" else ""
        rule += ", on the elements the document defines" if expect.where is not None else ""
    if not bad.any():
        return None
    where = np.argwhere(bad)
    lines = [f"{name} ({rule}): {len(where)} of {bad.size if only is None else int(only.sum())} elements differ"]
    for index in where[:shown]:
        i = tuple(int(v) for v in index)
        note = ""
        if labels is not None:
            note = "  [a slot this call writes]" if labels[i] else "  [a slot this call must leave untouched]"
        lines.append(f"  at {i}: got {_scalar(got[i])}, expected {_scalar(want[i])}{note}")
    return "\n".join(lines)


def _scalar(x) -> str:
    return repr(x.item())          # the exact value (a float16 prints all its decimals), NaN and inf included


def _written(op: Operator, inputs: dict, attrs: dict) -> tuple[dict, dict]:
    """({in-place name: bool mask of the elements the reference call writes}, the inputs after its call).
    The reference runs on the inputs, then once per in-place tensor on a copy where only that tensor has every
    byte inverted: a written element comes out the same both times (it depends on the other inputs, which are
    unchanged: a later decoding step reads the cache to write its probabilities), an untouched one keeps its
    (different) old bytes."""
    def run(x):
        with np.errstate(all="ignore"):         # inverted float bytes are NaNs and infinities
            call(op, op.function, x, attrs, backend="reference")
        return x

    def as_bytes(a):
        return a.reshape(*a.shape, 1).view(np.uint8)

    plain = run(copy_inputs(inputs))
    masks = {}
    for name in op.in_place:
        if plain.get(name) is None:
            continue
        flipped = copy_inputs(inputs)
        flipped[name].view(np.uint8)[...] ^= 0xFF
        flipped = run(flipped)
        masks[name] = (as_bytes(plain[name]) == as_bytes(flipped[name])).all(axis=-1).reshape(plain[name].shape)
    return masks, plain


def call(op: Operator, fn, inputs: dict, attrs: dict, **extra):
    """fn called as the document lists the arguments: positional inputs in order, the rest by keyword."""
    args, keywords = op.arguments(inputs, attrs)
    return fn(*args, **keywords, **extra)


def run_example(op: Operator, impl, case) -> None:
    """One problem: raises ConformanceError (with a reproducer) unless impl's results and in-place tensors
    are what the document says."""
    inputs, attrs = op.problem(case)
    expected = op.expect(case, inputs, attrs)
    written, after = _written(op, inputs, attrs) if op.in_place else ({}, {})
    mine = copy_inputs(inputs)
    try:
        result = call(op, impl, mine, attrs)
    except Exception as exc:  # a crash on a valid problem is a failure like any other, with its reproducer
        raise ConformanceError(_report(op, impl, case, inputs, attrs,
                                       [f"the implementation raised {type(exc).__name__}: {exc}"])) from None
    results = (result,) if len(op.outputs) == 1 else tuple(result)
    if len(results) != len(op.outputs):
        raise ConformanceError(_report(op, impl, case, inputs, attrs, [
            f"expected {len(op.outputs)} outputs ({', '.join(op.outputs)}), got {len(results)}"]))
    problems = [m for name, got in zip(op.outputs, results) if expected.get(name) is not None
                for m in [mismatch(name, got, expected[name])] if m]
    for name in op.in_place:
        if name not in written:
            continue
        rule = expected.get(name)
        if rule is None:                        # every byte as the reference leaves it
            checks = [mismatch(name, mine[name], Expect("bits", after[name]), labels=written[name])]
        else:                                   # written elements by `rule`, the others untouched
            checks = [mismatch(name, mine[name], Expect("bits", after[name]), labels=written[name],
                               only=~written[name]),
                      mismatch(name, mine[name], rule, labels=written[name], only=written[name])]
        problems += [m for m in checks if m]
    for output, name in op.aliases.items():     # e.g. present_key_value: the cache impl updated, as it is now
        if mine.get(name) is not None:
            returned = results[op.outputs.index(output)]
            problems += [m for m in [mismatch(output, returned, Expect("bits", as_numpy(mine[name]),
                                                                        why=f"the {name} it updated"))] if m]
    if problems:
        raise ConformanceError(_report(op, impl, case, inputs, attrs, problems))


# ---------------------------------------------------------------------------------------------- the report

def _brief(x) -> str:
    """An array as dtype(shape), named tuples of arrays (FasterTransformer's weights) field by field."""
    if isinstance(x, np.ndarray):
        return f"{x.dtype.name}{x.shape}"
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return f"{type(x).__name__}({', '.join(f'{k}={_brief(v)}' for k, v in zip(x._fields, x))})"
    return repr(x)


def _describe(inputs: dict) -> str:
    return ", ".join(f"{name} {x.dtype.name}{x.shape}" if isinstance(x, np.ndarray) else f"{name}={_brief(x)}"
                     for name, x in inputs.items())


def impl_source(impl) -> tuple[list, str, str]:
    """(import lines, expression, comment) that rebuild impl in a fresh interpreter, when its origin says how;
    the comment asks for the definition when it cannot be imported (a function of a script or a notebook)."""
    if isinstance(impl, functools.partial):
        imports, inner, comment = impl_source(impl.func)
        args = [repr(a) for a in impl.args] + [f"{k}={v!r}" for k, v in impl.keywords.items()]
        return ["import functools"] + imports, f"functools.partial({', '.join([inner] + args)})", comment
    module, name = getattr(impl, "__module__", None), getattr(impl, "__qualname__", None)
    if module and name and "<locals>" not in name and module != "__main__" and not module.startswith("docs."):
        return [f"from {module} import {name.split('.')[0]}"], name, ""
    return [], name or "impl", f"  # {name or 'impl'} from {module or 'your code'}: paste or import it above"


def reproducer(op: Operator, impl, case) -> str:
    imports, expression, comment = impl_source(impl)
    names = ", ".join(sorted({type(case).__name__, *op.case_imports, "check_case", "problem"}))
    lines = imports + [f"from cacheattn.testing import {names}",
                       "",
                       f"impl = {expression}{comment}",
                       f"case = {case!r}",
                       f"args, attrs = problem({op.name!r}, case)     # NumPy inputs rebuilt from case.seed",
                       "result = impl(*args, **attrs)",
                       f"check_case({op.name!r}, impl, case)          # raises this report again"]
    return "\n".join("    " + line if line else "" for line in lines)


def _report(op: Operator, impl, case, inputs, attrs, problems) -> str:
    attributes = ", ".join(f"{k}={_brief(v)}" for k, v in attrs.items())
    return "\n".join([
        f"{op.name} does not conform to its document on this problem (the smallest hypothesis found):",
        *("  " + line for p in problems for line in p.splitlines()),
        f"  inputs: {_describe(op.given(inputs))}",
        f"  attributes: {attributes}",
        "reproducer:",
        reproducer(op, impl, case)])


# ---------------------------------------------------------------------------------------------- the run

def run_check(op: Operator, impl, *, max_examples: int, dtypes, features, seed: int | None) -> Report:
    """Draw up to max_examples problems within the declared features; on the first failure hypothesis
    shrinks it and ConformanceError reports the smallest. `seed` makes the run repeatable (no database)."""
    declared, chosen = resolve_features(op, features, dtypes)
    check_signature(op, impl)
    if not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples: expected a positive int, got {max_examples!r}")
    seen_features, seen_dtypes, count = set(), set(), [0]
    options = dict(max_examples=max_examples, deadline=None, verbosity=Verbosity.quiet, report_multiple_bugs=False,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    if seed is not None:
        options["database"] = None

    def conformance(case):
        count[0] += 1
        run_example(op, impl, case)
        seen_features.update(op.uses(case))
        seen_dtypes.add(case.dtype)

    # Every check shares this function's source; the operator and the claims keep their example-database
    # entries apart (hypothesis adds this to the key, as it does for pytest parametrizations).
    conformance._hypothesis_internal_add_digest = f"{op.name} {sorted(declared)} {chosen}".encode()
    conformance = settings(**options)(given(op.strategy(declared, chosen))(conformance))
    if seed is not None:
        conformance = hypothesis_seed(seed)(conformance)
    try:
        conformance()
    except ConformanceError as failure:
        raise ConformanceError(str(failure)) from None      # drop hypothesis' notes: the report has the case
    return Report(op.name, count[0], tuple(d for d in chosen if d in seen_dtypes),
                  tuple(f for f in op.features if f in seen_features),
                  tuple(f for f in op.features if f in declared and f not in seen_features))
