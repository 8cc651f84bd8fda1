"""What one rung's kernel makes of a call: its grid, its block's rows, the keys a block takes a step, its shared
memory, and whether it fits at all, asked once from the shape of the call.

Each kernel module answers with its own `fit(shape, threads)`, computed by the planning functions its launcher
calls, so the plan on the host and the launch cannot disagree:

- rung 1: `_attention_core.fit`; rung 2: `_attention_warp.fit`; rungs 3 and 4: `_attention_vector.fit` (the same
  grid: rung 4 splits each block's keys, a choice the plan makes from this answer);
- rung 5: `_attention_mma.fit` (keys staged through shared memory) and `_attention_gqa_mma.fit` (a decode batch's
  GQA group fed to the tensor cores from registers);
- rung 6: `_attention_flash.fit` (the FlashAttention-2 prefill, offered by OpenPPL's operators).

Registers are not part of the answer: what a kernel holds and issues is read from its committed machine code by
the bound model (`cacheattn.kernel_choice.SASS_WORK`).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Protocol


class CallShape(Protocol):
    """The facts of a call a fit reads (`cacheattn.AttentionShape` has them): sequences, the longest query, heads,
    head_dim, the query's and the cache's NumPy dtypes and the cache's quantization."""
    batch: int
    max_query_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_dtype: object
    cache_dtype: object
    quant_bit: int


# The facts a fit reads, CallShape's in its order: the plan asks each kernel once for each set of them and hands the
# fit just these (`CallFacts`), so that an answer cannot depend on anything else of the call (its key count).
CALL_FACTS = tuple(CallShape.__annotations__)
CallFacts = namedtuple("CallFacts", CALL_FACTS)


@dataclass(frozen=True)
class RungFit:
    """One kernel's answer for a call at a block size.

    Attributes
    ----------
    rung : int
        The rung of the ladder (3 for rungs 3 and 4).
    variant : str
        Which kernel of the rung: "tiles", "warp", "vector", "staged" (rung 5 through shared memory), "decode"
        (rung 5's register-fed decode kernel) or "flash" (rung 6).
    threads : int
        The block size asked about.
    fits : bool
        Whether the kernel runs the call at this block size.
    why_not : str
        Why not, empty when it fits: the ValueError text the launcher raises (naming `threads` or `head_dim`), or
        for the decode kernel why its launcher stages rung 5 instead.
    blocks : int
        The grid (query tiles x head groups x sequences), before any split of the keys: at least 1, but 0 on the
        decode kernel for a call of no sequences (a block a GQA group of each).
    heads_per_block : int
        Query heads of one block (of one GQA group).
    positions : int
        Query positions of each head one block holds (all its row tiles on rung 5).
    row_tiles : int
        Rung 5's row tiles a block (its warps split the keys warps / row_tiles ways); 1 elsewhere.
    keys_per_step : int
        Keys a block takes a step: what a split count is chosen from and a trip of the key loop walks.
    shared_bytes : int
        Shared memory one block declares.
    """
    rung: int
    variant: str
    threads: int
    fits: bool
    why_not: str = ""
    blocks: int = 0
    heads_per_block: int = 0
    positions: int = 0
    row_tiles: int = 1
    keys_per_step: int = 0
    shared_bytes: int = 0


def whole_warps(rung: int, variant: str, threads: int) -> RungFit | None:
    """The refusal of a block size that is not whole warps (rungs 2 to 5), as the launchers word it; None when it
    is."""
    if threads % 32:
        return RungFit(rung, variant, threads, False,
                       f"threads: expected a multiple of 32 for rung {rung} (whole warps), got {threads}")
    return None
