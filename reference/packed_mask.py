"""TensorRT-LLM's packed attention mask (`attention_packed_mask` of gpt_attention), which its context FMHA reads.

Shape int32 `(sum_b roundUp(q_len_b, 128), roundUp(max_kv_len, 256) / 32)`: sequence b's query rows start at
m-tile cuMmasM_b = sum over earlier sequences of roundUp(q_len, 128) / 64. The bits are not row-major: they sit in
the order the MMA fragments of a 64 x 64 tile read them. For m-tile mi and n-tile n of a sequence, thread t of 128
owns word `(cuMmasM_b + mi) * mmasN * 128 + n * 128 + t` (mmasN = roundUp(max_kv_len, 256) / 64), anchored at
row = mi*64 + ((t / 32) % 4) * 16 + (t % 32) / 4 and col = n*64 + (t % 4) * 2; its bits 4k + {0, 1, 2, 3}
(k = 0..7) hold (row, col + 8k), (row, col + 8k + 1), (row + 8, col + 8k), (row + 8, col + 8k + 1). A bit is 1
only inside (q_len_b, kv_len_b) where the mask attends. `pack_attention_mask` builds it (TensorRT-LLM's
`pack_fmha_mask_by_input`), `unpack_attention_mask` reads it back; both go through `bit_address`, the one place
the layout is written down.
"""

from __future__ import annotations

import numpy as np

TILE, Q_ROUND, KV_ROUND, THREADS = 64, 128, 256, 128


def round_up(x, multiple):
    return -(-np.asarray(x, np.int64) // multiple) * multiple


def packed_shape(q_lens, kv_lens) -> tuple:
    """(rows, words per row) of the packed mask for these sequences."""
    return int(round_up(q_lens, Q_ROUND).sum()), int(round_up(max(int(np.max(kv_lens)), 1), KV_ROUND)) // 32


def bit_address(row, col, first_tile, words_per_row):
    """(word, bit) of query row `row`, key column `col` of the sequence whose rows start at m-tile `first_tile`
    (arrays broadcast). Inverts the fragment order above: the 16-row group is the warp, the row in it picks
    lane (t % 32) / 4 and the +8 half, the column picks k = col / 8, the lane's pair (t % 4) and the low bit."""
    row, col = np.asarray(row, np.int64), np.asarray(col, np.int64)
    m_tile, r = np.divmod(row, TILE)
    n_tile, c = np.divmod(col, TILE)
    warp, within = np.divmod(r, 16)
    half, lane_row = np.divmod(within, 8)
    k, c8 = np.divmod(c, 8)
    pair, low = np.divmod(c8, 2)
    thread = warp * 32 + lane_row * 4 + pair
    tiles_n = words_per_row // 2                          # mmasN = roundUp(max_kv, 256) / 64 = words_per_row / 2
    word = (first_tile + m_tile) * tiles_n * THREADS + n_tile * THREADS + thread
    return word, 4 * k + 2 * half + low


def _first_tiles(q_lens):
    return np.concatenate([[0], np.cumsum(round_up(q_lens, Q_ROUND) // TILE)])[:-1]


def pack_attention_mask(attention_mask, q_lens, kv_lens) -> np.ndarray:
    """int32 packed mask of a bool mask (True = attend): `attention_mask` packed `(sum q_lens, >= max kv_lens)`
    (row = query token, sequences one after another) or padded `(batch, >= max q_lens, >= max kv_lens)`."""
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    rows, per_row = packed_shape(q_lens, kv_lens)
    words = np.zeros(rows * per_row, np.uint32)
    mask = np.asarray(attention_mask, bool)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    for b, (first, q, kv) in enumerate(zip(_first_tiles(q_lens), q_lens, kv_lens)):
        block = mask[b, :q, :kv] if mask.ndim == 3 else mask[starts[b]:starts[b + 1], :kv]   # (q, kv)
        row, col = np.nonzero(block)
        word, bit = bit_address(row, col, first, per_row)
        np.bitwise_or.at(words, word, np.left_shift(np.uint32(1), bit.astype(np.uint32)))
    return words.view(np.int32).reshape(rows, per_row)


def unpack_attention_mask(packed, q_lens, kv_lens, columns: int | None = None) -> np.ndarray:
    """bool (sum q_lens, columns) mask read back from a packed one, rows packed like qkv's tokens; False past
    each sequence's kv_len. columns defaults to max kv_lens."""
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    per_row = np.asarray(packed).shape[-1]
    flat = np.asarray(packed).reshape(-1).view(np.uint32)
    columns = int(kv_lens.max()) if columns is None else columns
    out = np.zeros((int(q_lens.sum()), columns), bool)
    start = 0
    for first, q, kv in zip(_first_tiles(q_lens), q_lens, kv_lens):
        row, col = np.meshgrid(np.arange(q), np.arange(min(kv, columns)), indexing="ij")
        word, bit = bit_address(row, col, first, per_row)
        out[start:start + q, :min(kv, columns)] = (flat[word] >> bit.astype(np.uint32)) & 1 == 1
        start += q
    return out
