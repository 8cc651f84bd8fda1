"""Bad input, as data: for each operator a table of breakages, each of which takes a valid call and breaks one
argument (a shape, a dtype, a range, an inconsistency between two arguments, a duplicate, a NaN where none is
allowed), and the check every breakage is held to:

- the call raises ValueError or TypeError whose message is led by the broken argument's name (`name: ...`, the
  way cacheattn names a parameter);
- every array it was given is bit-identical afterwards (nothing is written before the refusal).

    from cacheattn.testing.breakage import BREAKAGES, Call, check_refused
    row = BREAKAGES["onnx_attention"][0]            # Q: 5-D
    call = Call(inputs, attrs)                      # a valid call's arguments, by the document's names
    row.break_(call)
    check_refused(lambda c: cacheattn.onnx_attention(**c.inputs, **c.attrs), call, row)

A breakage changes its `Call` by rebinding arguments (never by writing into a given array); one that does not
fit the drawn call (a scale to break where the cache holds floats) raises `Inapplicable`, and the test draws
another. Adding a breakage is one line in the operator's table.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass

import numpy as np

from reference.cache_layout import DYNAMIC_LAYOUTS, STATIC_LAYOUTS


class Inapplicable(Exception):
    """The breakage does not fit the drawn call (the test discards the example)."""


class Accepted(AssertionError):
    """A broken call was accepted, blamed on another argument, or wrote into its inputs."""


class Call:
    """A call's arguments: `inputs` (tensors, by the document's names) and `attrs` (keywords). `call[name]`
    reads an argument wherever it is (None when not given); `call[name] = value` rebinds it where it is (new
    names go to attrs: every operator takes them by keyword)."""

    def __init__(self, inputs: dict, attrs: dict):
        self.inputs, self.attrs = dict(inputs), dict(attrs)

    def __getitem__(self, name):
        return self.inputs[name] if name in self.inputs else self.attrs.get(name)

    def __setitem__(self, name, value):
        (self.inputs if name in self.inputs else self.attrs)[name] = value


@dataclass(frozen=True)
class Breakage:
    """One way to break one argument. `argument`: the one changed; `how`: what is wrong with it; `apply(call)`
    changes the call; `names`: the parameter names the refusal may be led by (the broken argument, or either of
    two that no longer agree); `when(call)`: whether it fits a drawn call (None: every call)."""
    argument: str
    how: str
    apply: Callable
    names: tuple = ()
    when: Callable | None = None

    def break_(self, call: Call) -> None:
        """Apply the breakage to `call`; `Inapplicable` when it does not fit."""
        if self.when is not None and not self.when(call):
            raise Inapplicable
        self.apply(call)

    @property
    def allowed(self) -> tuple:
        return self.names or (self.argument,)

    def __str__(self) -> str:
        return f"{self.argument}: {self.how}"


def broken(argument: str, how: str, apply: Callable, *also: str, when: Callable | None = None) -> Breakage:
    """A table row: `apply` breaks `argument`, on the calls `when(call)` holds for (default: all); the message
    must be led by it (or by one of `also`)."""
    return Breakage(argument, how, apply, (argument, *also), when)


def sets(**changes) -> Callable:
    """A breakage's apply that rebinds arguments: each value is given, or computed from the call (a callable)."""
    def apply(call: Call):
        for name, value in changes.items():
            call[name] = value(call) if callable(value) else value
    return apply


def need(condition) -> None:
    """Inside an apply: the breakage fits this call only if `condition` holds."""
    if not condition:
        raise Inapplicable


def required(call: Call, name: str):
    """call[name], which this breakage needs to be given."""
    value = call[name]
    need(value is not None)
    return value


# ---------------------------------------------------------------------------------------------- the check

def array_leaves(value, path: str):
    """(path, array) for every array in an argument: NumPy arrays, torch tensors, and those inside named tuples
    (FasterTransformer's weights), dataclasses (cacheattn.convert.KV), cacheattn.convert.Cache, transformers
    caches (their layers' keys and values), lists and dicts."""
    if isinstance(value, np.ndarray):
        yield path, value
    elif hasattr(value, "detach") and hasattr(value, "numpy"):    # a torch tensor, as its bits
        yield path, tensor_bits(value)
    elif isinstance(getattr(value, "arguments", None), dict):                  # a cacheattn.convert.Cache
        yield from array_leaves(value.arguments, path)
    elif isinstance(getattr(value, "layers", None), list):                      # a transformers Cache
        for i, layer in enumerate(value.layers):
            for name in ("keys", "values"):
                yield from array_leaves(getattr(layer, name, None), f"{path}.layers[{i}].{name}")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for name, item in zip(value._fields, value):
            yield from array_leaves(item, f"{path}.{name}")
    elif is_dataclass(value) and not isinstance(value, type):
        for f in fields(value):
            yield from array_leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from array_leaves(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from array_leaves(item, f"{path}[{key!r}]")


def tensor_bits(tensor) -> np.ndarray:
    """A torch tensor's elements as NumPy integers of the same width, bit for bit: NumPy has no bfloat16 (nor
    torch's float8 types), so `.numpy()` refuses them, but not a same-width integer view of them."""
    import torch
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    return (flat if width is None else flat.view(width)).numpy()


def snapshot(call: Call) -> dict:
    """path -> (dtype, shape, bytes) of every array the call holds (lists too: free page lists are inputs)."""
    shot = {}
    for where in (call.inputs, call.attrs):
        for name, value in where.items():
            for path, array in array_leaves(value, name):
                shot[path] = (array.dtype, array.shape, np.ascontiguousarray(array).tobytes())
            if isinstance(value, list):
                shot[f"{name} (list)"] = (None, None, repr(value))
    return shot


def leading_name(message: str) -> str:
    """The parameter a message is led by: the text before its first ': '."""
    return message.split(": ", 1)[0].strip() if ": " in message else ""


def names_argument(message: str, allowed: tuple) -> bool:
    """The message is led by one of `allowed`, or by a part of one (`weights.key_weight.kernel` for
    `weights.key_weight`, `kv.positions` for `kv`, `free_pages[0]` for `free_pages`)."""
    lead = leading_name(message)
    return any(lead == name or re.match(re.escape(name) + r"[.\[]", lead) for name in allowed)


def check_refused(run: Callable, call: Call, breakage: Breakage) -> BaseException:
    """run(call) must raise ValueError or TypeError led by one of breakage's names, and leave every array of the
    call bit-identical. Returns the exception; raises `Accepted` (an AssertionError) saying what happened."""
    before = snapshot(call)
    try:
        run(call)
    except (ValueError, TypeError) as error:
        refusal = error
    except Exception as error:  # noqa: BLE001 - any other exception is the finding, reported as such
        raise Accepted(f"{breakage}: expected ValueError/TypeError led by {' or '.join(breakage.allowed)}, got "
                       f"{type(error).__name__}: {error}") from error
    else:
        raise Accepted(f"{breakage}: accepted silently (expected ValueError/TypeError led by "
                       f"{' or '.join(breakage.allowed)})")
    message = str(refusal)
    if not names_argument(message, breakage.allowed):
        raise Accepted(f"{breakage}: refused, but blamed on {leading_name(message) or 'no argument'}: "
                       f"{type(refusal).__name__}: {message}")
    after = snapshot(call)
    changed = sorted(path for path in before if after.get(path) != before[path])
    if changed:
        raise Accepted(f"{breakage}: refused ({message}), but wrote into {', '.join(changed)} first")
    return refusal


# ---------------------------------------------------------------------------------------------- helpers

def grow(name: str, axis: int, by: int = 1) -> Callable:
    """call[name] with `by` more entries along `axis`: repeats of its last one (ones after an empty axis)."""
    def value(call):
        x = required(call, name)
        extra = list(x.shape)
        extra[axis] = by
        tail = np.take(x, [-1] * by, axis=axis) if x.shape[axis] else np.ones(extra, x.dtype)
        return np.concatenate([x, tail], axis=axis)
    return value


def shrink(name: str, axis: int) -> Callable:
    """call[name] one entry shorter along `axis`."""
    def value(call):
        x = required(call, name)
        return np.take(x, range(x.shape[axis] - 1), axis=axis)
    return value


def cast(name: str, dtype, other=None) -> Callable:
    """call[name] as `dtype` (as `other` when it already is `dtype`)."""
    def value(call):
        x = required(call, name)
        want = np.dtype(other) if other is not None and x.dtype == np.dtype(dtype) else np.dtype(dtype)
        with np.errstate(invalid="ignore"):             # -inf mask entries have no int8 value: any will do
            return x.astype(want)
    return value


def other_half(name: str) -> Callable:
    """call[name] in the other of the 16-bit floats: bfloat16 for float16, float16 for anything else."""
    def value(call):
        import ml_dtypes
        x = required(call, name)
        return x.astype(ml_dtypes.bfloat16 if x.dtype == np.float16 else np.float16)
    return value


def bfloat16_bits(name: str) -> Callable:
    """call[name] as uint16 (bfloat16's bits, as a caller without cacheattn.bfloat16 would pass them)."""
    def value(call):
        x = required(call, name)
        return x.astype(np.float32).view(np.uint32).astype(np.uint16)
    return value


def other_float(name: str) -> Callable:
    """call[name] in the other of float16 / float32 (float32 for anything else)."""
    def value(call):
        x = required(call, name)
        return x.astype(np.float32 if x.dtype == np.float16 else np.float16)
    return value


def plus(name: str, delta) -> Callable:
    def value(call):
        return required(call, name) + delta
    return value


def with_entry(name: str, index, value_of: Callable) -> Callable:
    """A copy of call[name] with entry `index` set to value_of(call, array)."""
    def value(call):
        x = np.array(required(call, name), copy=True)
        x[index] = value_of(call, x)
        return x
    return value


# ---------------------------------------------------------------------------------------------- OpenPPL

def _max_t(call: Call, static: bool = False) -> int:
    axes = (STATIC_LAYOUTS if static else DYNAMIC_LAYOUTS)[call["cache_layout"]].split()
    return int(required(call, "cache").shape[axes.index("T")])


def _cache_axis(call: Call, axis: str, static: bool = False) -> int:
    return (STATIC_LAYOUTS if static else DYNAMIC_LAYOUTS)[call["cache_layout"]].split().index(axis)


def _lengths(call: Call):
    """(seqlens, start_pos, kvlens) of a dynamic call, as int64 arrays."""
    seqlens = np.diff(np.asarray(call["seqstarts"], np.int64))
    start = np.asarray(call["start_pos"], np.int64)
    return seqlens, start, start + seqlens


def _slot(call: Call, b: int, position: int) -> int:
    starts = call["cachestarts"]
    if call["cache_mode"] == 0:
        return int(starts[b]) + position
    page = call["page_size"]
    return int(starts[b, position // page]) + position % page


def _shared_slot_across(call: Call) -> None:
    """Sequence 1 stores its first current token into the slot sequence 0 stores its first one into."""
    seqlens, start, kvlens = _lengths(call)
    need(len(seqlens) >= 2)
    target = _slot(call, 0, int(start[0]))
    starts = np.array(call["cachestarts"], copy=True)
    if call["cache_mode"] == 0:
        first = target - int(start[1])                       # sequence 1's region moved onto sequence 0's slot
        need(0 <= first and first + kvlens[1] <= _max_t(call))
        starts[1] = first
    else:
        page, p = call["page_size"], int(start[1])
        first = target - p % page                            # the page holding position p starts there
        need(0 <= first and first + page <= _max_t(call))
        starts[1, p // page] = first
    call["cachestarts"] = starts


def _alias_pages(clash: Callable) -> Callable:
    """One sequence's last written page made the page of an earlier position (paged cache), for the first
    sequence where clash(start_pos, kvlen, page_size) says the two pages' slots collide as this breakage wants."""
    def apply(call):
        need(call["cache_mode"] == 1)
        seqlens, start, kvlens = _lengths(call)
        page = call["page_size"]
        for b in range(len(seqlens)):
            earlier = clash(int(start[b]), int(kvlens[b]), page)
            if earlier is not None:
                starts = np.array(call["cachestarts"], copy=True)
                starts[b, (int(kvlens[b]) - 1) // page] = starts[b, earlier]
                call["cachestarts"] = starts
                return
        raise Inapplicable
    return apply


def _written_twice(start: int, kvlen: int, page: int):
    """The page of start_pos, when the last page's written slots (offsets 0 .. (kvlen-1) % page) include one of
    its written ones (start_pos % page and on): two current tokens then share a slot."""
    first, last = start // page, (kvlen - 1) // page
    return first if last > first and (kvlen - 1) % page >= start % page else None


def _written_over_read(start: int, kvlen: int, page: int):
    """Page 0, when it holds cached positions this call reads and the last (written) page is another page: a
    current token then overwrites a cached one that the same call attends to."""
    last = (kvlen - 1) // page
    return 0 if start > 0 and last > 0 and last > (start - 1) // page else None


def _page_outside(call: Call) -> None:
    starts = np.array(required(call, "cachestarts"), copy=True)
    if call["cache_mode"] == 0:
        starts[0] = _max_t(call)
    else:
        starts[0, 0] = _max_t(call)
    call["cachestarts"] = starts


def _negative_start(call: Call) -> None:
    """start_pos[0] = -1, kvstarts kept consistent with it (kvlen = start_pos + seqlen)."""
    seqlens, start, _ = _lengths(call)
    start = start.copy()
    start[0] = -1
    call["start_pos"] = start
    call["kvstarts"] = np.concatenate([[0], np.cumsum(start + seqlens)]).astype(np.asarray(call["kvstarts"]).dtype)


def _decreasing(name: str) -> Callable:
    def apply(call):
        x = np.array(required(call, name), copy=True)
        need(len(x) >= 3 and x[2] > 0)
        x[1] = x[2] + 1
        call[name] = x
    return apply


def _decoding_over_prefill(call: Call) -> None:
    seqlens = np.diff(np.asarray(call["seqstarts"], np.int64))
    longer = np.flatnonzero(seqlens > 1)
    need(longer.size)
    call["decoding_batches"] = int(longer[0]) + 1


def _mask_columns_short(call: Call) -> None:
    mask = required(call, "attn_mask")
    total_kv = int(np.asarray(call["kvstarts"])[-1])
    call["attn_mask"] = mask[..., :total_kv - 1]


def quantized(call: Call) -> bool:
    return bool(call["quant_bit"])


def paged(call: Call) -> bool:
    return call["cache_mode"] == 1


def along(name: str, change: Callable, axis_of: Callable) -> Callable:
    """call[name] changed by change(name, axis) along the axis axis_of(call) names (a layout-dependent axis)."""
    return lambda call: change(name, axis_of(call))(call)


PPL_CACHE = [       # dynamic_batching.KeyValueCache's arguments, shared with MultiHeadCacheAttention
    broken("current_key", "int32", sets(current_key=cast("current_key", np.int32))),
    broken("current_value", "the other float dtype", sets(current_value=other_float("current_value"))),
    broken("current_value", "a row short", sets(current_value=shrink("current_value", 0))),
    broken("seqstarts", "not starting at 0", sets(seqstarts=plus("seqstarts", 1))),
    broken("seqstarts", "float", sets(seqstarts=cast("seqstarts", np.float64))),
    broken("seqstarts", "decreasing", _decreasing("seqstarts")),
    broken("seqstarts", "ending past the packed tokens",
           sets(seqstarts=with_entry("seqstarts", -1, lambda c, x: x[-1] + 1))),
    broken("kvstarts", "a length not start_pos + seqlen",
           sets(kvstarts=with_entry("kvstarts", -1, lambda c, x: x[-1] + 1))),
    broken("kvstarts", "one entry short", sets(kvstarts=shrink("kvstarts", 0))),
    broken("start_pos", "negative", _negative_start),
    broken("start_pos", "one entry more", sets(start_pos=grow("start_pos", 0))),
    broken("start_pos", "float", sets(start_pos=cast("start_pos", np.float64))),
    broken("cachestarts", "a page outside the cache", _page_outside),
    broken("cachestarts", "two sequences storing into one slot", _shared_slot_across),
    broken("cachestarts", "one sequence's two written pages the same page", _alias_pages(_written_twice)),
    broken("cachestarts", "a written page the one of cached positions it reads", _alias_pages(_written_over_read)),
    broken("cachestarts", "float", sets(cachestarts=cast("cachestarts", np.float64))),
    broken("max_seqlen", "below the longest seqlen", sets(max_seqlen=lambda c: int(_lengths(c)[0].max()) - 1)),
    broken("max_kvlen", "below the longest kvlen", sets(max_kvlen=lambda c: int(_lengths(c)[2].max()) - 1)),
    broken("max_kvlen", "a float", sets(max_kvlen=lambda c: float(c["max_kvlen"]))),
    broken("cache", "float64", sets(cache=cast("cache", np.float64))),
    broken("cache", "one kv head more", sets(cache=along("cache", grow, lambda c: _cache_axis(c, "H")))),
    broken("cache", "float16 codes with quant_bit set", sets(cache=cast("cache", np.float16)), when=quantized),
    broken("scale", "missing with quant_bit set", sets(scale=None), when=quantized),
    broken("scale", "a group short", sets(scale=shrink("scale", -1)), when=quantized),
    broken("scale", "int8", sets(scale=cast("scale", np.int8)), when=quantized),
    broken("num_layer", "one more than the cache holds", sets(num_layer=plus("num_layer", 1)), "cache"),
    broken("layer_idx", "= num_layer", sets(layer_idx=lambda c: c["num_layer"])),
    broken("layer_idx", "negative", sets(layer_idx=-1)),
    broken("quant_bit", "2", sets(quant_bit=2)),
    broken("quant_group", "not dividing head_dim", sets(quant_group=lambda c: c["current_key"].shape[-1] + 1),
           when=quantized),
    broken("quant_group", "0", sets(quant_group=0)),
    broken("cache_mode", "2", sets(cache_mode=2)),
    broken("cache_layout", "4", sets(cache_layout=4)),
    broken("page_size", "0 with a paged cache", sets(page_size=0), when=paged),
    broken("page_size", "a float with a paged cache", sets(page_size=lambda c: float(c["page_size"])), when=paged),
]

PPL_ATTENTION = [   # MultiHeadAttention's arguments, shared with MultiHeadCacheAttention
    broken("query", "one axis more", sets(query=lambda c: required(c, "query")[..., None])),
    broken("query", "int32", sets(query=cast("query", np.int32))),
    broken("query", "a head missing", sets(query=shrink("query", 1))),
    broken("query", "a row short", sets(query=shrink("query", 0)), "seqstarts"),
    broken("decoding_batches", "more than the batch", sets(decoding_batches=lambda c: len(c["seqstarts"]))),
    broken("decoding_batches", "negative", sets(decoding_batches=-1)),
    broken("decoding_batches", "over a prefill sequence", _decoding_over_prefill, "seqstarts"),
    broken("decoding_batches", "a float", sets(decoding_batches=lambda c: float(c["decoding_batches"]))),
    broken("attn_mask", "a row short", sets(attn_mask=shrink("attn_mask", -2))),
    broken("attn_mask", "fewer columns than sum kvlens", _mask_columns_short),
    broken("attn_mask", "the other float dtype", sets(attn_mask=other_float("attn_mask"))),
    broken("attn_mask", "one axis more", sets(attn_mask=lambda c: required(c, "attn_mask")[None, None])),
    broken("num_heads", "twice the query's", sets(num_heads=lambda c: 2 * c["num_heads"]), "query"),
    broken("num_kv_heads", "not dividing num_heads", sets(num_kv_heads=lambda c: c["num_heads"] + 1)),
    broken("head_dim", "one more than the query's", sets(head_dim=plus("head_dim", 1)), "query"),
    broken("is_causal", "a string", sets(is_causal="yes")),
    broken("is_alibi", "2", sets(is_alibi=2)),
]

PPL_LAUNCH = [      # the kernels' own keywords (not the document's), checked on both backends
    broken("rung", "7", sets(rung=7)),
    broken("threads", "0", sets(threads=0)),
    broken("num_splits", "with rung 3", sets(num_splits=2, rung=3)),        # alone, num_splits asks for rung 4
    broken("num_splits", "0", sets(num_splits=0)),
]

MULTI_HEAD_CACHE_ATTENTION = PPL_CACHE + PPL_ATTENTION + PPL_LAUNCH + [
    broken("current_key", "a kv head missing", sets(current_key=shrink("current_key", 1))),
    # the call follows the query: the message names both (either may change)
    broken("current_key", "current key and value in the other float dtype than the query", sets(
        current_key=other_float("current_key"), current_value=other_float("current_value")), "query"),
]

DYNAMIC_KEY_VALUE_CACHE = PPL_CACHE + [
    # no num_kv_heads here: current_key's heads are the call's, so current_value (or the cache) disagrees
    broken("current_key", "a kv head missing", sets(current_key=shrink("current_key", 1)), "current_value", "cache"),
    broken("num_repeat", "0", sets(num_repeat=0)),
]

DYNAMIC_MULTI_HEAD_ATTENTION = PPL_ATTENTION + PPL_LAUNCH + [
    broken("key", "the other float dtype", sets(key=other_float("key"))),
    broken("key", "a kv head missing", sets(key=shrink("key", 1))),
    broken("key", "a row short", sets(key=shrink("key", 0)), "kvstarts"),
    broken("value", "a row short", sets(value=shrink("value", 0))),
    broken("value", "one more head", sets(value=grow("value", 1))),
    broken("seqstarts", "not starting at 0", sets(seqstarts=plus("seqstarts", 1))),
    broken("seqstarts", "float", sets(seqstarts=cast("seqstarts", np.float64))),
    broken("kvstarts", "decreasing", _decreasing("kvstarts")),
    broken("kvstarts", "one entry more", sets(kvstarts=lambda c: np.concatenate([c["kvstarts"], c["kvstarts"][-1:]])),
           "seqstarts"),
    broken("max_seqlen", "below the longest seqlen", sets(max_seqlen=plus("max_seqlen", -1))),
    broken("max_kvlen", "below the longest kvlen", sets(max_kvlen=lambda c: int(np.diff(c["kvstarts"]).max()) - 1)),
]


def _static_batch_past_max(call: Call) -> None:
    max_b = int(required(call, "cache").shape[_cache_axis(call, "B", static=True)])
    extra = max_b + 1 - call["current_key"].shape[0]
    call["current_key"] = grow("current_key", 0, extra)(call)
    call["current_value"] = grow("current_value", 0, extra)(call)


def _static_start(value_of: Callable) -> Callable:
    return sets(start_pos=lambda c: value_of(c, int(np.asarray(c["start_pos"])), int(c["current_key"].shape[1])))


KEY_VALUE_CACHE = [
    broken("current_key", "int32", sets(current_key=cast("current_key", np.int32))),
    broken("current_key", "rank 3", sets(current_key=lambda c: required(c, "current_key")[:, 0])),
    broken("current_key", "a batch past MaxB", _static_batch_past_max),
    broken("current_value", "the other float dtype", sets(current_value=other_float("current_value"))),
    broken("current_value", "a batch row short", sets(current_value=shrink("current_value", 0))),
    broken("start_pos", "negative", _static_start(lambda c, start, s: -1)),
    broken("start_pos", "past MaxS - S", _static_start(lambda c, start, s: _max_t(c, static=True) - s + 1)),
    broken("start_pos", "two values", _static_start(lambda c, start, s: np.array([start, start]))),
    broken("start_pos", "a float", _static_start(lambda c, start, s: float(start))),
    broken("cache", "float64", sets(cache=cast("cache", np.float64))),
    broken("cache", "one head more", sets(cache=along("cache", grow, lambda c: _cache_axis(c, "H", static=True)))),
    broken("cache", "float16 codes with quant_bit set", sets(cache=cast("cache", np.float16)), when=quantized),
    broken("scale", "missing with quant_bit set", sets(scale=None), when=quantized),
    broken("scale", "a group short", sets(scale=shrink("scale", -1)), when=quantized),
    broken("num_layer", "one more than the cache holds", sets(num_layer=plus("num_layer", 1)), "cache"),
    broken("layer_idx", "= num_layer", sets(layer_idx=lambda c: c["num_layer"])),
    broken("quant_bit", "16", sets(quant_bit=16)),
    broken("quant_group", "odd for int4", sets(quant_group=1), when=lambda c: c["quant_bit"] == 4),
    broken("num_repeat", "0", sets(num_repeat=0)),
    broken("cache_layout", "2", sets(cache_layout=2)),
]


# ---------------------------------------------------------------------------------------------- ONNX

def _seq_axis(call: Call) -> int:
    """The sequence axis of Q/K/V: 2 of a 4-D tensor, 1 of a 3-D one."""
    return 2 if required(call, "Q").ndim == 4 else 1


def _rank_of_q_differs(call: Call) -> None:
    v = required(call, "V")
    if v.ndim == 4:                                   # (batch, heads, seq, size) -> (batch, seq, heads * size)
        call["V"] = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).reshape(v.shape[0], v.shape[2], -1)
    else:
        call["V"] = v.reshape(v.shape[0], v.shape[1], 1, -1).transpose(0, 2, 1, 3)


def _head_size_plus_one(name: str) -> Callable:
    def apply(call):
        x = required(call, name)
        if x.ndim == 4:
            call[name] = grow(name, 3)(call)
        else:                                         # one more element per head: heads more columns
            heads = call["kv_num_heads"]
            call[name] = grow(name, 2, heads)(call)
    return apply


def _nonpad_with_past(call: Call) -> None:
    need(call["past_key"] is not None)
    k = call["K"]
    call["nonpad_kv_seqlen"] = np.full(k.shape[0], k.shape[_seq_axis(call)], np.int64)


def _mask_lead_axis(call: Call) -> None:
    """The query axis of the mask neither 1 nor q_seq."""
    mask = required(call, "attn_mask")
    need(mask.ndim >= 2)
    q_len = call["Q"].shape[_seq_axis(call)]
    rows = q_len + 1 if mask.shape[-2] in (1, q_len) else mask.shape[-2]
    call["attn_mask"] = np.resize(mask, mask.shape[:-2] + (rows + (rows == 1),) + mask.shape[-1:])


def _mask_past_total(call: Call) -> None:
    mask = required(call, "attn_mask")
    total = call["K"].shape[_seq_axis(call)] + (0 if call["past_key"] is None else call["past_key"].shape[2])
    call["attn_mask"] = np.resize(mask, mask.shape[:-1] + (total + 1,))


def four_d(call: Call) -> bool:
    return required(call, "Q").ndim == 4


def three_d(call: Call) -> bool:
    return required(call, "Q").ndim == 3


ONNX_ATTENTION = [
    broken("Q", "5-D", sets(Q=lambda c: required(c, "Q").reshape((1,) * (5 - c["Q"].ndim) + c["Q"].shape))),
    broken("Q", "int32", sets(Q=cast("Q", np.int32))),
    broken("Q", "uint16 (bfloat16 bits, unwrapped)", sets(Q=bfloat16_bits("Q"))),
    broken("K", "another float dtype", sets(K=cast("K", np.float64, np.float32))),
    broken("K", "the other 16-bit float (float16 / bfloat16)", sets(K=other_half("K")), "Q"),
    broken("V", "another float dtype", sets(V=cast("V", np.float64, np.float32))),
    broken("K", "one batch more", sets(K=grow("K", 0))),
    broken("V", "one batch more", sets(V=grow("V", 0))),
    broken("V", "a token short", sets(V=along("V", shrink, _seq_axis))),
    broken("K", "head_size one more", _head_size_plus_one("K")),
    broken("V", "not the rank of Q", _rank_of_q_differs),
    broken("past_value", "missing beside past_key", sets(past_value=None), when=lambda c: c["past_key"] is not None),
    broken("past_key", "missing beside past_value", sets(past_key=None), when=lambda c: c["past_value"] is not None),
    broken("past_value", "a token short", sets(past_value=shrink("past_value", 2))),
    broken("past_key", "another float dtype", sets(past_key=cast("past_key", np.float64, np.float32))),
    broken("past_key", "one kv head more", sets(past_key=grow("past_key", 1))),
    broken("nonpad_kv_seqlen", "with a past", _nonpad_with_past),
    broken("nonpad_kv_seqlen", "past kv_sequence_length", sets(nonpad_kv_seqlen=lambda c: np.full_like(
        required(c, "nonpad_kv_seqlen"), c["K"].shape[_seq_axis(c)] + 1))),
    broken("nonpad_kv_seqlen", "negative", sets(nonpad_kv_seqlen=lambda c: required(c, "nonpad_kv_seqlen") * 0 - 1)),
    broken("nonpad_kv_seqlen", "float", sets(nonpad_kv_seqlen=cast("nonpad_kv_seqlen", np.float64))),
    broken("nonpad_kv_seqlen", "one entry more", sets(nonpad_kv_seqlen=grow("nonpad_kv_seqlen", 0))),
    broken("attn_mask", "a last dim past total_sequence_length", _mask_past_total),
    broken("attn_mask", "int8", sets(attn_mask=cast("attn_mask", np.int8))),
    broken("attn_mask", "a query axis neither 1 nor q_sequence_length", _mask_lead_axis),
    broken("attn_mask", "5-D", sets(attn_mask=lambda c: required(c, "attn_mask").reshape((1,) * 4 + (-1,)))),
    broken("is_causal", "2", sets(is_causal=2)),
    broken("q_num_heads", "missing with 3-D inputs", sets(q_num_heads=None), when=three_d),
    broken("q_num_heads", "not dividing the hidden size", sets(q_num_heads=lambda c: c["Q"].shape[2] + 1), "Q",
           when=three_d),
    broken("kv_num_heads", "not K's head axis (4-D)", sets(kv_num_heads=lambda c: c["K"].shape[1] + 1), when=four_d),
    broken("kv_num_heads", "not dividing q_num_heads (3-D)", sets(kv_num_heads=lambda c: c["q_num_heads"] + 1),
           "K", "V", when=lambda c: three_d(c) and c["q_num_heads"] > 1),
    broken("qk_matmul_output_mode", "4", sets(qk_matmul_output_mode=4)),
    broken("scale", "0", sets(scale=0.0)),
    broken("scale", "negative", sets(scale=-0.5)),
    broken("scale", "NaN", sets(scale=float("nan"))),
    broken("scale", "infinite", sets(scale=float("inf"))),
    broken("softcap", "negative", sets(softcap=-1.0)),
    broken("softcap", "NaN", sets(softcap=float("nan"))),
    broken("softcap", "infinite", sets(softcap=float("inf"))),
    broken("softmax_precision", "2", sets(softmax_precision=2)),
    broken("left_window_size", "-2", sets(left_window_size=-2)),
    broken("right_window_size", "set at opset 24", sets(right_window_size=1), when=lambda c: c["opset"] == 24),
    broken("opset", "22", sets(opset=22)),
]


# ---------------------------------------------------------------------------------------------- FasterTransformer

def _weight(member: str, part: str, change: Callable) -> Callable:
    """Rebind weights.<member>.<part> (kernel or bias) to change(array): a new AttentionWeight."""
    def apply(call):
        weights = call["weights"]
        dense = getattr(weights, member)
        need(dense is not None and getattr(dense, part) is not None)
        call["weights"] = weights._replace(**{member: dense._replace(**{part: change(getattr(dense, part))})})
    return apply


def _lengths_entry(value_of: Callable) -> Callable:
    return sets(encoder_sequence_length=with_entry("encoder_sequence_length", 0,
                                                   lambda c, x: value_of(c["encoder_output"].shape[1])))


def _no_ia3(call: Call) -> None:
    """ia3_tasks given, the IA3 weights not."""
    call["ia3_tasks"] = np.zeros(call["input_query"].shape[0], np.int64)
    call["weights"] = call["weights"]._replace(ia3_key_weight=None, ia3_value_weight=None)


CROSS_ATTENTION = [
    broken("input_query", "int32", sets(input_query=cast("input_query", np.int32))),
    broken("input_query", "rank 3", sets(input_query=lambda c: required(c, "input_query")[:, None])),
    broken("encoder_output", "the other float dtype", sets(encoder_output=other_float("encoder_output"))),
    broken("encoder_output", "one batch more", sets(encoder_output=grow("encoder_output", 0))),
    broken("encoder_output", "no positions", sets(encoder_output=lambda c: required(c, "encoder_output")[:, :0])),
    broken("encoder_sequence_length", "0", _lengths_entry(lambda mem: 0)),
    broken("encoder_sequence_length", "past mem_max_seq_len", _lengths_entry(lambda mem: mem + 1)),
    broken("encoder_sequence_length", "float", sets(encoder_sequence_length=cast("encoder_sequence_length",
                                                                                 np.float64))),
    broken("encoder_sequence_length", "one entry more",
           sets(encoder_sequence_length=grow("encoder_sequence_length", 0))),
    broken("step", "0", sets(step=0)),
    broken("step", "a float", sets(step=lambda c: float(c["step"]))),
    broken("key_cache", "the value cache's shape", sets(key_cache=lambda c: np.zeros_like(required(c, "value_cache"))),
           when=lambda c: c["is_batch_major_cache"]),
    broken("key_cache", "the other float dtype", sets(key_cache=other_float("key_cache"))),
    broken("key_cache", "not C-contiguous",
           sets(key_cache=lambda c: np.repeat(required(c, "key_cache"), 2, -1)[..., ::2])),
    broken("value_cache", "one position short", sets(value_cache=along(
        "value_cache", shrink, lambda c: 2 if c["is_batch_major_cache"] else 1))),
    broken("finished", "int8", sets(finished=cast("finished", np.int8))),
    broken("finished", "one entry more", sets(finished=grow("finished", 0))),
    broken("ia3_tasks", "= num_tasks", sets(ia3_tasks=with_entry(
        "ia3_tasks", 0, lambda c, x: c["weights"].ia3_key_weight.kernel.shape[0]))),
    broken("ia3_tasks", "given without IA3 weights", _no_ia3, when=lambda c: c["ia3_tasks"] is None),
    broken("context_buf", "one column short", sets(context_buf=shrink("context_buf", 1))),
    broken("cross_attentions", "float16", sets(cross_attentions=cast("cross_attentions", np.float16))),
    broken("cross_attentions", "max_decoder_seq_len below step",
           sets(cross_attentions=lambda c: required(c, "cross_attentions")[:, :, :c["step"] - 1].copy())),
    broken("weights.query_weight", "kernel one row short", _weight("query_weight", "kernel", lambda w: w[:-1])),
    broken("weights.key_weight", "bias one short", _weight("key_weight", "bias", lambda w: w[:-1])),
    broken("weights.value_weight", "kernel float64", _weight("value_weight", "kernel", lambda w: w.astype(np.float64))),
    broken("weights.attention_output_weight", "kernel one column short",
           _weight("attention_output_weight", "kernel", lambda w: w[:, :-1])),
    broken("weights.query_weight", "None", sets(weights=lambda c: c["weights"]._replace(query_weight=None))),
    broken("head_num", "0", sets(head_num=0)),
    broken("head_num", "one more than the caches hold", sets(head_num=plus("head_num", 1)), "key_cache"),
    broken("size_per_head", "33", sets(size_per_head=33)),
    broken("q_scaling", "0", sets(q_scaling=0.0)),
    broken("q_scaling", "NaN", sets(q_scaling=float("nan"))),
    broken("q_scaling", "infinite", sets(q_scaling=float("inf"))),
    broken("is_batch_major_cache", "a string", sets(is_batch_major_cache="yes")),
]


# ---------------------------------------------------------------------------------------------- TensorRT-LLM

def _contexts(call: Call) -> int:
    return int((np.asarray(call["host_request_types"]) == 0).sum())


def _generation_first(call: Call) -> None:
    types = np.array(required(call, "host_request_types"), copy=True)
    need(0 < _contexts(call) < len(types))
    call["host_request_types"] = types[::-1].copy()


def _block_offsets(change: Callable) -> Callable:
    def apply(call):
        need(trt_paged(call))
        call["kv_cache_block_offsets"] = change(call, np.array(required(call, "kv_cache_block_offsets"), copy=True))
    return apply


def _offset_past_pool(call: Call, offsets):
    pool = call["kv_cache_pool"]
    offsets[0, 0, 0, 0] = pool.shape[0] * pool.shape[1] * 2
    return offsets


def _two_entries_one_slot(call: Call, offsets):
    """Entry 1's block of its first new token made the block entry 0 writes its first new token into, where the
    two tokens land on one slot (no window, no sinks: position t sits at block t // tokens_per_block, slot
    t % tokens_per_block): two writes into one slot, a race on a GPU."""
    need(offsets.shape[1] >= 2 and not call["do_cross_attention"] and not call["streamingllm"])
    lengths, past = np.asarray(call["sequence_length"]), np.asarray(call["host_past_key_value_lengths"])
    need(call["host_max_attention_window_sizes"][call["layer_idx"]] >= lengths.max())
    need(not np.asarray(call["host_sink_token_length"]).any())
    block = call["tokens_per_block"]
    (p0, end0), p1 = (int(past[0]), int(lengths[0])), int(past[1])
    # entry 0 writes slots p0 % block .. of its block p0 // block, up to its last token or the block's end
    last0 = min(block - 1, end0 - 1 - (p0 // block) * block)
    need(p0 % block <= p1 % block <= last0)
    offsets[0, 1, :, p1 // block] = offsets[0, 0, :, p0 // block]
    return offsets


def kv_quantized(call: Call) -> bool:
    return bool(call["kv_cache_quant_mode"])


def trt_paged(call: Call) -> bool:
    return bool(call["paged_kv_cache"])


def trt_contiguous(call: Call) -> bool:
    return not call["paged_kv_cache"]


def present(name: str) -> Callable:
    return lambda call: call[name] is not None


def _pool_beside_contiguous(call: Call):
    """A pool of two blocks of 4 tokens shaped for the contiguous cache's heads and head size."""
    past = required(call, "past_key_value")                       # (E, 2, Hkv, capacity, Dh)
    return np.zeros((2, 1, 2, past.shape[2], 4, past.shape[4]), past.dtype)


GPT_ATTENTION = [
    broken("qkv", "int32", sets(qkv=cast("qkv", np.int32))),
    broken("qkv", "a column short", sets(qkv=shrink("qkv", -1))),
    broken("qkv", "a row short", sets(qkv=shrink("qkv", 0)), "context_lengths", "sequence_length",
           when=lambda c: c["remove_input_padding"]),
    broken("sequence_length", "one entry more", sets(sequence_length=grow("sequence_length", 0))),
    broken("sequence_length", "float", sets(sequence_length=cast("sequence_length", np.float32))),
    broken("sequence_length", "not past + new", sets(sequence_length=plus("sequence_length", 1)),
           "host_past_key_value_lengths"),
    broken("host_past_key_value_lengths", "negative", sets(host_past_key_value_lengths=with_entry(
        "host_past_key_value_lengths", 0, lambda c, x: -1))),
    broken("context_lengths", "0 for a context request", sets(context_lengths=with_entry(
        "context_lengths", 0, lambda c, x: 0)), "qkv", when=_contexts),
    broken("host_request_types", "3", sets(host_request_types=with_entry("host_request_types", 0, lambda c, x: 3))),
    broken("host_request_types", "generation before context", _generation_first),
    broken("host_max_attention_window_sizes", "0", sets(host_max_attention_window_sizes=lambda c: np.zeros_like(
        required(c, "host_max_attention_window_sizes")))),
    # (a shorter one is repeated over the layers, as TensorRT-LLM does: an empty one has no window at all)
    broken("host_max_attention_window_sizes", "empty", sets(
        host_max_attention_window_sizes=lambda c: required(c, "host_max_attention_window_sizes")[:0])),
    broken("host_max_attention_window_sizes", "2-D", sets(
        host_max_attention_window_sizes=lambda c: required(c, "host_max_attention_window_sizes")[None])),
    broken("host_sink_token_length", "negative", sets(host_sink_token_length=np.array([-1], np.int32))),
    broken("cache_indirection", "capacity below the longest sequence (no window)", sets(
        cache_indirection=lambda c: required(c, "cache_indirection")[..., :int(np.max(c["sequence_length"])) - 1]),
        "sequence_length", when=lambda c: c["host_max_attention_window_sizes"][c["layer_idx"]]
        >= np.max(c["sequence_length"])),
    broken("cache_indirection", "a beam index past beam_width", sets(
        cache_indirection=lambda c: required(c, "cache_indirection") + required(c, "cache_indirection").shape[1])),
    broken("layer_idx", "negative", sets(layer_idx=-1)),
    broken("num_kv_heads", "not dividing num_heads", sets(num_kv_heads=lambda c: c["num_heads"] + 1)),
    broken("hidden_size_per_head", "one more than qkv holds", sets(hidden_size_per_head=plus(
        "hidden_size_per_head", 1)), "qkv"),
    broken("q_scaling", "0", sets(q_scaling=0.0)),
    broken("q_scaling", "NaN", sets(q_scaling=float("nan"))),
    broken("q_scaling", "infinite", sets(q_scaling=float("inf"))),
    broken("q_scaling", "a string", sets(q_scaling="1.0")),
    broken("attn_logit_softcapping_scale", "negative", sets(attn_logit_softcapping_scale=-1.0)),
    broken("attn_logit_softcapping_scale", "NaN", sets(attn_logit_softcapping_scale=float("nan"))),
    broken("attn_logit_softcapping_scale", "infinite", sets(attn_logit_softcapping_scale=float("inf"))),
    broken("rotary_embedding_base", "NaN", sets(rotary_embedding_base=float("nan"))),
    broken("rotary_embedding_scale", "0", sets(rotary_embedding_scale=0.0)),
    broken("rotary_embedding_short_m_scale", "infinite", sets(rotary_embedding_short_m_scale=float("inf"))),
    broken("rotary_embedding_dim", "odd with RoPE", sets(rotary_embedding_dim=plus("rotary_embedding_dim", -1)),
           when=lambda c: c["rotary_embedding_dim"]),
    broken("rotary_embedding_dim", "past the head", sets(rotary_embedding_dim=plus("hidden_size_per_head", 2)),
           when=lambda c: c["rotary_embedding_dim"]),
    broken("position_embedding_type", "99", sets(position_embedding_type=99)),
    broken("kv_cache_quant_mode", "an unknown mode", sets(kv_cache_quant_mode=3)),
    broken("kv_quant_orig_scale", "missing with a quantized cache", sets(kv_quant_orig_scale=None), when=kv_quantized),
    broken("kv_quant_orig_scale", "NaN", sets(kv_quant_orig_scale=np.array([np.nan], np.float32)), when=kv_quantized),
    broken("kv_orig_quant_scale", "0", sets(kv_orig_quant_scale=np.array([0.0], np.float32)), when=kv_quantized),
    broken("mask_type", "99", sets(mask_type=99)),
    broken("tokens_per_block", "3 with a paged cache", sets(tokens_per_block=3), when=trt_paged),
    broken("kv_cache_block_offsets", "an offset past the pool", _block_offsets(_offset_past_pool)),
    broken("kv_cache_block_offsets", "two entries writing one slot", _block_offsets(_two_entries_one_slot)),
    broken("kv_cache_pool", "given with paged_kv_cache False", sets(kv_cache_pool=_pool_beside_contiguous),
           when=trt_contiguous),
    broken("kv_cache_pool", "the other float dtype", sets(kv_cache_pool=other_float("kv_cache_pool")),
           when=lambda c: trt_paged(c) and not kv_quantized(c)),
    broken("past_key_value", "the other float dtype", sets(past_key_value=other_float("past_key_value")),
           "qkv", when=lambda c: trt_contiguous(c) and not kv_quantized(c)),
    # the cache follows qkv: a qkv of another dtype is named with the cache (or a table of qkv's dtype) it leaves
    broken("qkv", "the other float dtype than its cache", sets(qkv=other_float("qkv")), "past_key_value",
           "kv_cache_pool", "qkv_bias", "cross_kv", "relative_attention_bias", when=lambda c: not kv_quantized(c)),
    broken("past_key_value", "float32 with a quantized cache", sets(past_key_value=cast("past_key_value", np.float32)),
           when=lambda c: trt_contiguous(c) and kv_quantized(c)),
    broken("kv_cache_pool", "float32 with a quantized cache", sets(kv_cache_pool=cast("kv_cache_pool", np.float32)),
           when=lambda c: trt_paged(c) and kv_quantized(c)),
    broken("past_key_value", "missing with a contiguous cache", sets(past_key_value=None), when=trt_contiguous),
    broken("past_key_value", "one kv head short", sets(past_key_value=shrink("past_key_value", 2)),
           when=trt_contiguous),
    broken("past_key_value", "int8 without kv_cache_quant_mode", sets(past_key_value=cast("past_key_value", np.int8)),
           when=lambda c: trt_contiguous(c) and not kv_quantized(c)),
    broken("qkv_bias", "one short", sets(qkv_bias=lambda c: np.zeros(c["qkv"].shape[-1] - 1, c["qkv"].dtype))),
    broken("qkv_bias", "the other 16-bit float (float16 / bfloat16)", sets(qkv_bias=other_half("qkv_bias")), "qkv",
           when=present("qkv_bias")),
    broken("qkv", "uint16 (bfloat16 bits, unwrapped)", sets(qkv=bfloat16_bits("qkv"))),
    broken("alibi_slopes", "a head short", sets(alibi_slopes=shrink("alibi_slopes", 0)), when=present("alibi_slopes")),
    broken("relative_attention_bias", "a head short",
           sets(relative_attention_bias=shrink("relative_attention_bias", 0)),
           when=present("relative_attention_bias")),
    broken("logn_scaling", "NaN", sets(logn_scaling=with_entry("logn_scaling", -1, lambda c, x: np.nan)),
           when=present("logn_scaling")),
    broken("logn_scaling", "0 at position 0", sets(logn_scaling=with_entry("logn_scaling", 0, lambda c, x: 0.0)),
           when=present("logn_scaling")),
    broken("alibi_slopes", "infinite", sets(alibi_slopes=with_entry("alibi_slopes", 0, lambda c, x: np.inf)),
           when=present("alibi_slopes")),
    broken("relative_attention_bias", "NaN", sets(relative_attention_bias=with_entry(
        "relative_attention_bias", (0, 0), lambda c, x: np.nan)), when=present("relative_attention_bias")),
    broken("rotary_cos_sin", "NaN", sets(rotary_cos_sin=with_entry("rotary_cos_sin", (0, 1), lambda c, x: np.nan)),
           when=present("rotary_cos_sin")),
    broken("rotary_inv_freq", "NaN", sets(rotary_inv_freq=with_entry("rotary_inv_freq", 0, lambda c, x: np.nan)),
           when=present("rotary_inv_freq")),
    broken("attention_mask", "a row short", sets(attention_mask=shrink("attention_mask", 0)),
           when=present("attention_mask")),
]


BREAKAGES = {
    "multi_head_cache_attention": MULTI_HEAD_CACHE_ATTENTION,
    "dynamic_key_value_cache": DYNAMIC_KEY_VALUE_CACHE,
    "dynamic_multi_head_attention": DYNAMIC_MULTI_HEAD_ATTENTION,
    "key_value_cache": KEY_VALUE_CACHE,
    "onnx_attention": ONNX_ATTENTION,
    "cross_attention": CROSS_ATTENTION,
    "gpt_attention": GPT_ATTENTION,
}

__all__ = ["Accepted", "BREAKAGES", "Breakage", "Call", "Inapplicable", "broken", "check_refused", "need",
           "required", "sets", "snapshot", "tensor_bits"]
