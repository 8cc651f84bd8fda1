"""Text pictures for the docs pages: masks and biases, page tables, cache layouts, source excerpts.

Everything returns a string, so a docs page prints it and the test suite checks it.
"""

from __future__ import annotations

import inspect

import numpy as np


def bias_grid(bias: np.ndarray, *, row_label: str = "i", col_label: str = "j", width: int = 5) -> str:
    """A (rows, cols) float bias as a table: '-inf' (hidden) drawn as '·', other values with one decimal."""
    rows, cols = bias.shape
    head = " " * (len(row_label) + 4) + "".join(f"{col_label}={j}".rjust(width) if j == 0 else f"{j}".rjust(width)
                                                 for j in range(cols))
    lines = [head]
    for i in range(rows):
        cells = "".join(("·" if np.isneginf(v) else f"{v:.1f}").rjust(width) for v in bias[i])
        lines.append(f"{row_label}={i}".ljust(len(row_label) + 4) + cells)
    return "\n".join(lines)


def visibility_grid(visible: np.ndarray, *, row_label: str = "i") -> str:
    """A boolean (rows, cols) mask: '#' where query row i sees key j, '.' where it does not (ASCII, so the columns
    stay under the key digits in any monospace font)."""
    lines = ["     key j: " + "".join(str(j % 10) for j in range(visible.shape[1]))]
    for i, row in enumerate(visible):
        lines.append(f"{row_label}={i}".rjust(11) + " " + "".join("#" if v else "." for v in row))
    return "\n".join(lines)


def slot_map(owners: dict, max_t: int) -> str:
    """Which batch's token lives in each cache slot: owners maps (batch, position) -> slot."""
    cells = ["  ."] * max_t
    for (b, t), slot in owners.items():
        cells[slot] = f"{'abcdefghij'[b]}{t:<2d}"
    lines = []
    for start in range(0, max_t, 16):
        lines.append(f"slot {start:3d} | " + " ".join(cells[start:start + 16]))
    return "\n".join(lines)


def memory_order(axes: str, extents: dict, count: int) -> str:
    """The first `count` elements of a tensor with named axes, in memory order, labelled by their indices.

    Shows what a layout means: which (kv, token, head, d) sits next to which in memory.
    """
    names = axes.split()
    shape = [extents[n] for n in names]
    labels = []
    for flat_index in range(min(count, int(np.prod(shape)))):
        idx = dict(zip(names, np.unravel_index(flat_index, shape)))
        kv = "KV"[idx["KV"]]
        labels.append(f"{kv}t{idx['T']}h{idx['H']}d{idx['D']}")
    return " ".join(labels)


def source_lines(func, *markers: str) -> str:
    """The lines of func's source that contain any of the markers, with file and line numbers. func may be a
    kernel factory under functools.cache, or a numba dispatcher (its Python function is quoted)."""
    func = inspect.unwrap(getattr(func, "py_func", func))
    lines, first = inspect.getsourcelines(func)
    first = max(first, 1)                       # a module's source starts at line 1; getsourcelines says 0
    path = inspect.getsourcefile(func)
    short = path[path.rfind("/", 0, path.rfind("/")) + 1:]
    out = [f"{short}:{first + n}: {line.strip()}" for n, line in enumerate(lines)
           if any(m in line for m in markers)]
    # A marker that matches nothing means the quoted code changed under the page: fail loudly, not quote less.
    missing = [m for m in markers if not any(m in line for line in lines)]
    if missing:
        raise LookupError(f"{short}: no line of {func.__qualname__} contains {missing}")
    return "\n".join(out)


# ---- TensorRT-LLM gpt_attention

def packed_batch(request_types, new_tokens) -> str:
    """Which entry each packed qkv row belongs to: 'C<e>' for a context entry, 'G<e>' for a generation beam."""
    cells = []
    for e, (kind, n) in enumerate(zip(request_types, new_tokens)):
        cells += [f"{'CG'[int(kind)]}{e}"] * int(n)
    return "qkv row: " + " ".join(f"{r:>3d}" for r in range(len(cells))) + "\nentry:   " + " ".join(
        f"{c:>3s}" for c in cells)


def block_table(offsets, *, num_layers: int, layer_idx: int, tokens_per_block: int, length: int) -> str:
    """A block table row (2, max_blocks) read the KV cache manager's way: offset o = block * num_layers * 2 + kv;
    this layer's K or V of that block is block o + 2 * layer_idx of the pool seen as blocks."""
    lines = []
    for kv, name in enumerate("KV"):
        for b in range(-(-length // tokens_per_block)):
            o = int(offsets[kv, b])
            first, last = b * tokens_per_block, min(length, (b + 1) * tokens_per_block) - 1
            lines.append(f"{name} tokens {first:2d}-{last:2d}: offset {o:3d} -> pool[{o // (2 * num_layers)}, "
                         f"layer {layer_idx}, {name}] = block {o + 2 * layer_idx} of the pool seen as blocks")
    return "\n".join(lines)


def cyclic_slots(slot_of, length: int, slots: int) -> str:
    """Which token each cache slot holds after `length` tokens, given slot_of(t) (later tokens overwrite)."""
    holder = ["."] * slots
    for t in range(length):
        holder[int(slot_of(t))] = str(t)
    return "slot:  " + " ".join(f"{s:>3d}" for s in range(slots)) + "\ntoken: " + " ".join(
        f"{h:>3s}" for h in holder)


# ---- kernel ladder

def _lane_grid(position, rows: int, cols: int, count: int) -> list[str]:
    """Rows of a (rows, cols) matrix tile, each element drawn as the warp lane that holds it."""
    grid = [["  ."] * cols for _ in range(rows)]
    for lane in range(32):
        for i in range(count):
            r, c = position(lane, i)
            grid[r][c] = f"{lane:3d}"
    return ["".join(row) for row in grid]


def mma_fragments(a_position, b_position, c_position) -> str:
    """The lanes of a warp holding each element of mma.m16n8k16's A (16x16), B (16x8) and C/D (16x8) tiles,
    side by side; position(lane, i) -> (row, col) of the lane's element i."""
    tiles = [("A: 16 x 16", _lane_grid(a_position, 16, 16, 8)), ("B: 16 x 8", _lane_grid(b_position, 16, 8, 4)),
             ("C, D: 16 x 8", _lane_grid(c_position, 16, 8, 4))]
    lines = ["    ".join(title.ljust(len(grid[0])) for title, grid in tiles).rstrip()]
    for r in range(16):
        lines.append("    ".join(grid[r] for _, grid in tiles))
    return "\n".join(lines)


# ---- cacheattn.convert

def kv_memory(array, row: int, group: int = 0) -> str:
    """A float cache in memory order, one character per element: the digit t where it holds +(t + 1) (key of
    token t), the letter 'abcdefghij'[t] where it holds -(t + 1) (value of token t), '.' where it holds NaN
    (bytes nobody wrote); `row` elements a line, prefixed by the line's first flat offset, a space every
    `group` elements."""
    flat = np.asarray(array, np.float64).reshape(-1)
    cells = []
    for x in flat:
        if np.isnan(x):
            cells.append(".")
        else:
            t = int(abs(x)) - 1
            cells.append(str(t % 10) if x > 0 else "abcdefghij"[t % 10])
    lines = []
    for start in range(0, len(cells), row):
        chunk = cells[start:start + row]
        if group:
            chunk = [" " + c if i and i % group == 0 else c for i, c in enumerate(chunk)]
        lines.append(f"{start:4d} | {''.join(chunk)}")
    return "\n".join(lines)
