"""What the operators' plans share (`plan_gpt_attention`, `plan_multi_head_cache_attention`): a plan takes its
operator's arguments minus the per-layer ones and backend, with the operator's names, order and defaults."""

from __future__ import annotations

import difflib
import inspect


def plan_signature(operator, layer_inputs, returns: str) -> inspect.Signature:
    """operator's signature without `layer_inputs` and backend: the signature of its plan function."""
    kept = [p for name, p in inspect.signature(operator).parameters.items()
            if name not in layer_inputs and name != "backend"]
    return inspect.Signature(kept, return_annotation=returns)


def bind_step(signature: inspect.Signature, args: tuple, kwargs: dict, *, function: str,
              layer_inputs: tuple = ()) -> dict:
    """A plan function's arguments bound to its signature, defaults applied: the step as a dict of name to value.

    A TypeError names the argument and `function` where Python's own message (from `Signature.bind`) names neither
    the function nor the fix: a per-layer argument (`layer_inputs`, and backend) belongs to the plan's `.run(...)`;
    an unknown one lists the close names; a missing one says what to pass."""
    params = signature.parameters
    positional = [name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    per_layer = (*layer_inputs, "backend")
    for name in kwargs:
        if name in params:
            continue
        if name in per_layer:
            raise TypeError(f"{name}: expected in plan.run(...), got in {function}: it is per layer, and {function} "
                            f"takes the step's arguments only; pass it to plan.run({name}=...) for each layer")
        close = difflib.get_close_matches(name, [*params, *per_layer], n=3)
        hint = ("; did you mean " + " or ".join(f"{c} (per layer: plan.run)" if c in per_layer else c for c in close)
                + "?") if close else ""
        raise TypeError(f"{name}: expected an argument of {function}, got an unknown name{hint}")
    if len(args) > len(positional):
        raise TypeError(f"{function}: expected at most {len(positional)} positional arguments ({', '.join(positional)}"
                        f"), got {len(args)}; per-layer tensors go to plan.run(...)")
    by_position = positional[:len(args)]
    for name in by_position:
        if name in kwargs:
            raise TypeError(f"{name}: expected once, got it by position and by keyword in {function}")
    missing = [name for name, p in params.items()
               if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               and name not in kwargs and name not in by_position]
    if missing:
        also = f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise TypeError(f"{missing[0]}: expected a value, got none: {function} requires it{also}; pass "
                        f"{missing[0]}=...")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def phase_line(phase: str, rung: int, splits: int, reason: str, *, threads: int | None = None) -> str:
    """One phase's kernel choice as a plan's repr prints it: `phase: rung r, n splits[, t threads]: why`."""
    block = f", {threads} threads" if threads is not None else ""
    return f"  {phase}: rung {rung}, {splits} split{'s' if splits != 1 else ''}{block}: {reason}"


def asked_text(launch: dict) -> str:
    """The kernel keywords a plan was given (threads, rung, num_splits), None ones as the plan's choice."""
    return "kernel keywords " + ", ".join(f"{name}={launch[name]!r}" for name in ("rung", "num_splits", "threads"))
