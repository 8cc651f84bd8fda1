"""cacheattn.hf: Hugging Face transformers models served through cacheattn's operators and caches.

`Engine(model, operator=..., cache=..., kv_cache_dtype=...)` runs every attention layer of every step of a
transformers model through one operator (OpenPPL, TensorRT-LLM or ONNX; FasterTransformer's cross attention for
encoder-decoder models) on a cache the engine owns in that operator's format, with in-flight batching.
Needs the `hf` extra (torch, transformers); `cacheattn.hf.blocks` (the page/slot managers) needs neither, so the
engine's names load on first use.
"""

from __future__ import annotations

__all__ = ["Engine", "GenerateResult", "OPERATORS", "register"]


def __getattr__(name):
    if name in __all__:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'cacheattn.hf' has no attribute {name!r}")
