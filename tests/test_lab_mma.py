"""Rung 5's counted figures on a causal OpenPPL prefill, held to the ones that follow from its plan by hand.

32 new tokens, 4 query heads on 1 kv head, head_dim 128, float16 cache, 128 threads: the plan puts 4 row tiles (4
heads x 4 positions) in a block, so 2 blocks of 16 positions; block j walks the key tiles up to its last query,
j + 1 tiles of 16 keys. Every warp runs head_dim / 16 x 2 mma for S and head_dim / 8 for P·V per key tile, with
Q's fragments in registers.
"""

import os

import pytest

import cacheattn
from cacheattn.examples import build_ppl
from cacheattn.lab import recorder
from cacheattn.lab.bench_gpu import BenchCase

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="lab.record() counts in numba's CUDA simulator")

NEW, HEAD_DIM, WARPS = 32, 128, 4


def test_rung_5_prefill_loads_each_key_tile_once_per_block_in_whole_sectors():
    case = BenchCase("prefill 32", batch=1, context=0, new_tokens=NEW, num_heads=4, num_kv_heads=1,
                     head_dim=HEAD_DIM).ppl_case()
    with recorder.record() as rec:
        cacheattn.multi_head_cache_attention(**build_ppl(case), **case.attrs(), backend="numba", threads=32 * WARPS,
                                             rung=5)
    key_tiles = sum(j + 1 for j in range(NEW // 16))                       # (block, key tile) steps: 1 + 2
    assert rec.extra[recorder.HMMA] == key_tiles * WARPS * (2 * HEAD_DIM // 16 + HEAD_DIM // 8)
    # K and V: each staged key's row (HEAD_DIM float16) once per block, not once per warp, in whole sectors.
    kv = [f for launch in rec.launches for name, f in launch.arrays.items() if "_src.data" in name]
    assert sum(f["ld_bytes_requested"] for f in kv) == 2 * key_tiles * 16 * HEAD_DIM * 2
    assert sum(f["ld_bytes_requested"] for f in kv) == 32 * sum(f["ld_sectors"] for f in kv)
    # Shared memory, per (block, key tile): each warp reads 2 words a lane (2 wavefronts) for each of the 32 B
    # fragments of K and V; the block stores the tile's K and V, 16 x HEAD_DIM float16 each, 128 bytes a wavefront.
    # Q's A fragments stay in registers (float16 cache): 80 wavefronts per warp and 32 mma, 2.5 a mma.
    wavefronts = key_tiles * (WARPS * 2 * 16 * 2 + 2 * 16 * HEAD_DIM * 2 // 128)
    assert rec.metrics[recorder.WAVEFRONTS_LD] + rec.metrics[recorder.WAVEFRONTS_ST] == wavefronts
    # Staging stores and fragment reads: no bank conflicts.
    assert rec.metrics[recorder.CONFLICTS_LD] == 0 and rec.metrics[recorder.CONFLICTS_ST] == 0
    assert not rec.hazards
