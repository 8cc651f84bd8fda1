"""The rung pages' standalone kernels (`kernels_numba.standalone`) against the production rungs they teach.

Same random inputs, outputs poisoned: each standalone kernel and `cacheattn.multi_head_cache_attention(...,
rung=n)` must agree with each other and with a float64 evaluation of the reference, and `cacheattn.lab.record()`
must count the same K/V load requests and sectors, shared-memory bank conflicts and HMMA for both (the same
keys, so the same per key). One mixed batch (a decode step and a 3-token causal prefill, GQA 4:1, head_dim 64)
per rung; rung 4 splits the decode steps of two sequences in 2 (its combine kernel takes a thread per output
element: prefill rows cost seconds in the simulator). Rung 6 copies K and V by cp.async, which the counts do not
see as loads: its test compares the HMMA and barriers, and a two-tile key range walks its double buffer.
"""

import inspect
from dataclasses import replace

import numpy as np
import pytest

import cacheattn
from cacheattn import lab
from cacheattn.examples import PPLCase, build_ppl, copy_inputs, float64_ppl_attention, reference_cache_state
from cacheattn.lab import recorder
from kernels_numba import _attention_core, standalone

from helpers import assert_close
from strategies import deep_only

CASE = PPLCase(seqlens=(1, 3), past=(20, 9), decoding_batches=1, num_heads=4, num_kv_heads=1, head_dim=64,
               dtype="float16", quant_bit=0, quant_group=8, scale_dtype="float16", cache_layout=0, cache_mode=0,
               page_size=16, num_layer=1, layer_idx=0, is_causal=True, is_alibi=False, mask="none", mask_pad=0,
               seed=7)


def slot_table_lines():
    """The production rung 1's lines that store each key's (row, scale row) pair for K and for V: int64 pairs
    16 bytes apart, a 2-way bank conflict the standalone kernel's one slot per key does not have."""
    lines, first = inspect.getsourcelines(_attention_core.make_attention_kernel)
    return {f"_attention_core.py:{first + n}" for n, line in enumerate(lines) if "= row_offsets(" in line}


def counts(rec, skip=()):
    """(K/V load requests, K/V load sectors, shared load conflicts, shared store conflicts) of the attention
    launches; skip: lines whose shared conflicts are left out."""
    requests = sectors = 0
    for launch in rec.launches:
        for name, figures in launch.arrays.items():
            if name == "cache" or name.startswith("k_src.data"):
                requests += figures["ld_requests"]
                sectors += figures["ld_sectors"]
    skipped = [rec.lines[line] for line in skip if line in rec.lines]
    conflicts = [sum(launch.metrics[metric] for launch in rec.launches) - sum(f[line] for f in skipped)
                 for metric, line in ((recorder.CONFLICTS_LD, "shared_ld_conflicts"),
                                      (recorder.CONFLICTS_ST, "shared_st_conflicts"))]
    return requests, sectors, *conflicts


@pytest.mark.parametrize("rung", standalone.RUNGS[:5])
def test_standalone_rung_equals_production_rung(rung):
    case = replace(CASE, seqlens=(1, 1), decoding_batches=2) if rung == 4 else CASE
    inputs = build_ppl(case)
    key, value, _, _ = reference_cache_state(inputs, case)
    want = float64_ppl_attention(inputs, case, key, value)
    x = copy_inputs(inputs)
    splits = {"num_splits": 2} if rung == 4 else {}
    with lab.record() as production:
        produced = cacheattn.multi_head_cache_attention(**x, **case.attrs(), backend="numba", rung=rung, threads=128,
                                                        **splits)
    # x["cache"] now holds the current tokens too, as the standalone kernel reads it
    with lab.record() as mine:
        got = standalone.module(rung).attention(x["query"], x["cache"], x["cachestarts"], x["seqstarts"],
                                                x["kvstarts"], x["max_seqlen"], case.num_kv_heads, threads=128,
                                                **splits)
    assert_close("production attn_output", produced, want, case.dtype)
    assert_close("standalone attn_output", got, want, case.dtype)
    assert_close("standalone vs production", got, produced.astype(np.float64), case.dtype)
    skip = slot_table_lines() if rung == 1 else ()
    figures = counts(mine)
    assert figures[0] > 0 and (rung != 1 or figures[2] > 0)        # the counts see the loads and rung 1's conflicts
    assert figures == counts(production, skip), "standalone rung counts differ from the production rung's"
    assert mine.extra[recorder.HMMA] == production.extra[recorder.HMMA] and (rung != 5 or mine.extra[recorder.HMMA])
    assert not mine.hazards, mine.report()


def check_rung6(case, threads):
    """Rung 6's standalone kernel against the production rung 6 and float64: outputs, HMMA, barriers, hazards."""
    inputs = build_ppl(case)
    key, value, _, _ = reference_cache_state(inputs, case)
    want = float64_ppl_attention(inputs, case, key, value)
    x = copy_inputs(inputs)
    with lab.record() as production:
        produced = cacheattn.multi_head_cache_attention(**x, **case.attrs(), backend="numba", rung=6,
                                                        threads=threads)
    with lab.record() as mine:
        got = standalone.module(6).attention(x["query"], x["cache"], x["cachestarts"], x["seqstarts"],
                                             x["kvstarts"], x["max_seqlen"], case.num_kv_heads, threads=threads)
    assert_close("production attn_output", produced, want, case.dtype)
    assert_close("standalone attn_output", got, want, case.dtype)
    assert_close("standalone vs production", got, produced.astype(np.float64), case.dtype)
    for metric in (recorder.HMMA, "barriers"):
        assert mine.extra[metric] > 0 and mine.extra[metric] == production.extra[metric], metric
    assert not mine.hazards and not production.hazards, mine.report()


def test_standalone_rung6_equals_production_rung6_small():
    """One warp at head_dim 16 (2 chunks a row: the narrow swizzle), 71 keys: two tiles, the double buffer."""
    check_rung6(replace(CASE, head_dim=16, num_heads=2, past=(70, 9)), threads=32)


@deep_only
def test_standalone_rung6_equals_production_rung6():
    """The rung pages' case at 4 warps and head_dim 64 (the full 8-row swizzle), with a two-tile sequence."""
    check_rung6(replace(CASE, past=(70, 9)), threads=128)


def test_diff_is_from_the_previous_rung():
    """The pages print the diff of one standalone module to the next: it names only lines that changed."""
    text = standalone.diff(2)
    assert text.startswith("@@") and "+from .._warp import WARP_SIZE, warp_sum" in text
    with pytest.raises(ValueError, match="rung"):
        standalone.module(7)
