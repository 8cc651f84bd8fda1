"""What the operators' plans share (`plan_gpt_attention`, `plan_multi_head_cache_attention`): a plan takes its
operator's arguments minus the per-layer ones and backend, with the operator's names, order and defaults."""

from __future__ import annotations

import inspect


def plan_signature(operator, layer_inputs, returns: str) -> inspect.Signature:
    """operator's signature without `layer_inputs` and backend: the signature of its plan function."""
    kept = [p for name, p in inspect.signature(operator).parameters.items()
            if name not in layer_inputs and name != "backend"]
    return inspect.Signature(kept, return_annotation=returns)


def bind_step(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """A plan function's arguments bound to its signature, defaults applied (TypeError for an unknown or missing
    argument, as the operator raises): the step as a dict of name to value."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
