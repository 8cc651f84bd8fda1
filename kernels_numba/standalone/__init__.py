"""The kernel ladder's rungs written out whole, one module each (`rung1` ... `rung6`), for the rung pages.

Each is OpenPPL's MultiHeadCacheAttention on one cache format (a float16 offset cache, cache_layout 0, a float16
query, float32 accumulation, GQA, causal prefill) with no device functions passed in: the whole key loop is on
the page. Each makes the same memory accesses per key on the same grid as its production rung (tested equal to
it, output and counts, in tests/test_standalone_rungs.py; rung 6's cp.async copies are not counted as loads, so
its HMMA and barriers are). `attention(query, cache, cachestarts, seqstarts,
kvstarts, max_seqlen, num_kv_heads, threads)` launches a rung's kernel on the cache as
`cacheattn.multi_head_cache_attention` leaves it, and returns attn_output.
"""

from __future__ import annotations

import difflib
import importlib
import inspect

RUNGS = (1, 2, 3, 4, 5, 6)


def module(rung: int):
    """The standalone module of `rung` (1 to 6)."""
    if rung not in RUNGS:
        raise ValueError(f"rung: expected one of {RUNGS}, got {rung!r}")
    return importlib.import_module(f"{__name__}.rung{rung}")


def source(rung: int) -> str:
    """The module of `rung` as it is on disk, from its first import on (the docstring is the page's prose)."""
    text = inspect.getsource(module(rung))
    return text[text.index("\nimport") + 1:].rstrip("\n")


def diff(rung: int) -> str:
    """A unified diff of rung - 1's module to `rung`'s, without file headers."""
    lines = difflib.unified_diff(source(rung - 1).splitlines(), source(rung).splitlines(), lineterm="", n=1)
    return "\n".join(line for line in lines if not line.startswith(("---", "+++")))
