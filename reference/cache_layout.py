"""The cache_layout tables of the two OpenPPL documents, as axis orders.

Axis names: B batch (static cache only), L layer, KV key-or-value (0 key, 1 value),
T token slot (MaxS or MaxT), H head, D head_dim (or head_dim / quant_group in `scale`,
head_dim / 2 in an int4 cache). `scale` has the layout of `cache`.
"""

from __future__ import annotations

import numpy as np

# KeyValueCache, "cache_layout": 0 (MaxB,L,2,MaxS,H,Dh), 1 (L,MaxB,2,H,MaxS,Dh).
STATIC_LAYOUTS = {0: "B L KV T H D", 1: "L B KV H T D"}
# MultiHeadCacheAttention, "cache_layout": 0 (MaxT,L,2,H,Dh), 1 (L,MaxT,2,H,Dh), 2 (L,2,MaxT,H,Dh), 3 (L,2,H,MaxT,Dh).
DYNAMIC_LAYOUTS = {0: "T L KV H D", 1: "L T KV H D", 2: "L KV T H D", 3: "L KV H T D"}

_CANONICAL = ("L", "KV", "B", "T", "H", "D")


def layer_views(tensor: np.ndarray, axes: str, layer_idx: int) -> tuple[np.ndarray, np.ndarray]:
    """Writable views (key part, value part) of one layer, each ordered ([B,] T, H, D)."""
    names = axes.split()
    canonical = [n for n in _CANONICAL if n in names]
    view = tensor.transpose([names.index(n) for n in canonical])[layer_idx]  # (2, [B,] T, H, D)
    return view[0], view[1]
