"""Bad input, one argument at a time, for every public entry point: the operators, cacheattn.convert's export,
import_ and convert, and cacheattn.hf.Engine (construction and generate).

Each test draws a valid call (the conformance kit's strategies; the convert suite's for convert, where the kit
has none), shows that it runs, then breaks one argument as one row of a table says (cacheattn.testing.breakage
for the operators; the convert and Engine tables below) and requires, on the reference and on the kernels
(backend="numba", the simulator here): a ValueError or TypeError led by the broken argument's name, and every
array of the call bit-identical afterwards. Rows are data: adding a breakage is one line in its table.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from cacheattn import convert
from cacheattn.examples import copy_inputs
from cacheattn.testing._core import call as call_operator
from cacheattn.testing._operators import OPERATORS
from cacheattn.testing.breakage import (
    BREAKAGES,
    Call,
    Inapplicable,
    broken,
    check_refused,
    need,
    required,
    sets,
    snapshot,
    tensor_bits,
)

# A few draws per row: the rows, not the draws, are what this file covers (CACHEATTN_EXAMPLES scales them). No
# shrinking: a failure's message names the row and what happened, and the drawn calls are small already.
EXAMPLES = 2 * int(os.environ.get("CACHEATTN_EXAMPLES", "1"))
ROWS = settings(max_examples=EXAMPLES, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
BACKENDS = ("reference", "numba")


def refuse_everywhere(run, call: Call, breakage) -> None:
    """The broken call refused on every backend. One set of arguments serves both: a refusal writes nothing (the
    check says so after each), and a copy could mend a breakage (a strided view copies contiguous)."""
    for backend in BACKENDS:
        check_refused(lambda c, backend=backend: run(c, backend), call, breakage)


def broken_copy(breakage, inputs: dict, attrs: dict) -> Call:
    """The breakage applied to copies of a valid call; draws another example where it does not fit."""
    call = Call(copy_inputs(inputs), dict(attrs))
    try:
        breakage.break_(call)
    except Inapplicable:
        assume(False)
    return call


# ---------------------------------------------------------------------------------------------- the check itself

def test_the_check_fails_on_silence_on_another_name_and_on_a_write():
    """check_refused must be able to fail: a call that accepts, one that blames another argument, one that writes
    before refusing, and one that raises something other than ValueError/TypeError."""
    row = broken("cache", "anything", sets())
    cache = np.arange(4.0)

    def writes(call):
        call["cache"][0] = -1.0
        raise ValueError("cache: refused too late")

    def refuse(message, kind=ValueError):
        def run(call):
            raise kind(message)
        return run

    for run, said in ((lambda call: None, "accepted silently"), (refuse("scale: no"), "blamed on scale"),
                      (writes, "wrote into cache"), (refuse("cache", IndexError), "got IndexError")):
        with pytest.raises(AssertionError, match=said):
            check_refused(run, Call(dict(cache=cache.copy()), {}), row)
    check_refused(refuse("cache: expected shape (4,), got (5,)"), Call(dict(cache=cache), {}), row)
    check_refused(refuse("weights.key_weight.kernel: no", TypeError), Call({}, {}),
                  broken("weights.key_weight", "anything", sets()))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float32"])
def test_the_snapshot_sees_a_write_into_a_torch_tensor_of_any_float_dtype(dtype):
    """NumPy lacks bfloat16 and torch's float8 types: the snapshot reads their bits, so a refused call that wrote
    one element of such a tensor is caught, and an untouched one compares equal."""
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32))
    tensor = tensor.to(getattr(torch, dtype))[:, 1:]                        # a strided view, as callers pass
    call = Call(dict(past=tensor), {})
    before = snapshot(call)
    assert snapshot(call) == before

    def writes(c):
        c["past"][1, 0, 2] = -tensor[1, 0, 2].float() - 1
        raise ValueError("past: refused too late")

    with pytest.raises(AssertionError, match=r"wrote into past first"):
        check_refused(writes, call, broken("past", "anything", sets()))


# ---------------------------------------------------------------------------------------------- the operators

def _operator_rows():
    return [pytest.param(name, row, id=f"{name}-{row}") for name, rows in BREAKAGES.items() for row in rows]


def _space(op):
    """Every feature the operator has, at the kit's small sizes (FasterTransformer: its two cheap head sizes)."""
    features = frozenset(f for f in op.features if f != "all_head_sizes")
    return op.strategy(features, op.dtypes)


@pytest.mark.parametrize("name,breakage", _operator_rows())
def test_an_operator_names_the_argument_it_refuses_and_writes_nothing(name, breakage):
    op = OPERATORS[name]

    @ROWS
    @given(case=_space(op))
    def check(case):
        inputs, attrs = op.problem(case)
        call_operator(op, op.function, copy_inputs(inputs), attrs, backend="reference")     # the valid call runs
        broken = broken_copy(breakage, inputs, attrs)
        refuse_everywhere(lambda c, backend: call_operator(op, op.function, c.inputs, c.attrs, backend=backend),
                          broken, breakage)
    check()


# The array whose dtype disagrees with the one the call follows, and that one: the message names both and says
# both ways to agree, so that converting the broken one is not the only fix it offers.
LEADERS = [("onnx_attention", "K", "Q"), ("cross_attention", "encoder_output", "input_query"),
           ("multi_head_cache_attention", "current_key", "query"), ("dynamic_multi_head_attention", "key", "query")]


@pytest.mark.parametrize("name,argument,leader", LEADERS, ids=[f"{n}-{a}" for n, a, _ in LEADERS])
def test_a_dtype_disagreement_names_the_array_the_call_follows(name, argument, leader):
    op = OPERATORS[name]

    @ROWS
    @given(case=_space(op))
    def check(case):
        inputs, attrs = op.problem(case)
        call = Call(copy_inputs(inputs), dict(attrs))
        want, got = np.dtype(call[leader].dtype).name, {"float16": "float32"}.get(np.dtype(call[leader].dtype).name,
                                                                                   "float16")
        call[argument] = call[argument].astype(got)
        if name == "multi_head_cache_attention":          # current_value follows current_key
            call["current_value"] = call["current_value"].astype(got)
        for backend in BACKENDS:
            refusal = check_refused(lambda c, backend=backend: call_operator(op, op.function, c.inputs, c.attrs,
                                                                              backend=backend),
                                    call, broken(argument, "the other float dtype", sets()))
            assert str(refusal) == (f"{argument}: expected {leader}'s dtype {want}, got {got}: the call follows "
                                    f"{leader}; pass both as {got} or both as {want}")
    check()


# ---------------------------------------------------------------------------------------------- cacheattn.convert

from convert_formats import SEQUENCE, make, random_kv  # noqa: E402
from convert_formats import free_pages as free_pages_of  # noqa: E402

from strategies import convert_shapes, convert_variants  # noqa: E402

# The one-layer cache array of each format (its first array argument) and the length argument export reads.
CACHE_ARRAY = {"ppl": "cache", "trtllm": ("kv_cache_pool", "past_key_value"), "onnx": "past_key", "ft": "key_cache",
               "vllm": ("key_cache", "kv_cache"), "flashinfer": "paged_kv_cache", "hf": "past_key_values"}
# (format, its length argument that export reads, another argument a too-long length may be blamed on)
LENGTHS = [("ppl", "kvstarts", "cachestarts"), ("trtllm", "sequence_length"), ("onnx", "nonpad_kv_seqlen"),
           ("ft", "encoder_sequence_length"), ("vllm", "seq_lens", "block_tables"), ("flashinfer", "kv_last_page_len"),
           ("hf", "seq_len")]


def _cyclic(call) -> bool:
    """A TensorRT-LLM cache with a window: it holds the last tokens of a sequence of any length."""
    return call["format"] == "trtllm" and bool(call["host_max_attention_window_sizes"][0] < 64)


def _is(fmt):
    return lambda c: c["format"] == fmt


def _layerless(fmt, arguments) -> bool:
    """A cache of a format that takes layer_idx but whose arrays have no layer axis: TensorRT-LLM's contiguous
    past_key_value, FasterTransformer's caches without a leading layer axis."""
    if fmt == "trtllm":
        return not arguments["paged_kv_cache"]
    if fmt == "ft":
        return arguments["key_cache"].ndim == (5 if arguments["is_batch_major_cache"] else 4)
    return False


# The layerless caches whose layer_idx means nothing, where a non-zero one is refused. TensorRT-LLM's contiguous
# cache has no row here: its layer_idx picks the layer's attention window from host_max_attention_window_sizes
# (repeated over the layers), as gpt_attention reads it, so any layer is a valid one there.
ONE_LAYER = {"ft": "a FasterTransformer cache without a layer axis"}

# A layer past the cache's, in general, in the layerless caches of formats that take layer_idx, and in transformers'.
LAYER_ROWS = [
    broken("layer_idx", "past the layers", sets(layer_idx=5),
           when=lambda c: not _layerless(c["format"], dict(c.inputs, **c.attrs))),
    *(broken("layer_idx", f"past the one layer of {what}", sets(layer_idx=5),
             when=lambda c, fmt=fmt: c["format"] == fmt and _layerless(fmt, dict(c.inputs, **c.attrs)))
      for fmt, what in ONE_LAYER.items()),
    broken("layer_idx", "past the layers of a transformers cache", sets(layer_idx=5), when=_is("hf")),
]


def _one_axis_more(fmt, name):
    """A row: the format's cache array `name` with one leading axis more (where the drawn variant has it)."""
    def apply(call):
        need(call["format"] == fmt and isinstance(call[name], np.ndarray))
        call[name] = call[name][None]
    return broken(name, "one axis more", apply)


def _kv(change):
    """Rebind kv to change(kv) (a new object: the drawn one is never written)."""
    def apply(call):
        call["kv"] = change(required(call, "kv"))
    return apply


def _kv_with(**changes):
    """A copy of kv with fields changed after construction (KV checks itself when built, as a caller's KV may
    change later): change(kv) per field."""
    def change(kv):
        edited = copy.copy(kv)
        for name, value_of in changes.items():
            setattr(edited, name, value_of(kv))
        return edited
    return _kv(change)


def _free_pages(change):
    def apply(call):
        call["free_pages"] = change(call, list(required(call, "free_pages")))
    return apply


def _pages_of_others(call) -> list:
    """Pages the other sequences of the drawn cache hold (import takes its pages from the front of free_pages)."""
    fmt = call["format"]
    if fmt == "ppl":
        rows = call["cachestarts"] // call["page_size"]
    elif fmt == "trtllm":
        rows = call["kv_cache_block_offsets"][0, :, 0] // (2 * call["kv_cache_pool"].shape[1])
    elif fmt == "vllm":
        rows = call["block_tables"]
    else:
        indptr = call["kv_indptr"]
        rows = [call["kv_indices"][indptr[b]:indptr[b + 1]] for b in range(len(indptr) - 1)]
    others = [int(p) for b, row in enumerate(rows) if b != SEQUENCE for p in np.ravel(row) if p >= 0]
    need(others)
    return others


def _row_past(name):
    """The page table with the converted sequence's entries far past any pool (import follows them when it
    takes no free pages)."""
    def value(call):
        table = np.array(required(call, name), copy=True)
        rows = table[:, SEQUENCE] if name == "kv_cache_block_offsets" else table[SEQUENCE]
        rows += 10 ** 6
        return table
    return value


def _paged(call) -> bool:
    return call["free_pages"] is not None


PAGE_TOKENS = 4                                  # every builder's pages hold 4 tokens


def _two_pages(call) -> bool:
    """The drawn sequence takes at least two pages."""
    return _paged(call) and call["kv"].tokens > PAGE_TOKENS


# The read-only lengths argument through which import_ learns which pages the other sequences hold (a padded
# page table cannot tell a held page from padding without it): (its name, the page table, the table's sequence
# axis; the table's last axis is the pages of a sequence).
OTHERS_LENGTHS = {"ppl": ("kvstarts", "cachestarts", 0), "trtllm": ("sequence_length", "kv_cache_block_offsets", 1),
                  "vllm": ("seq_lens", "block_tables", 0)}


def _held_page_first_lengths_given(call) -> None:
    """free_pages led by a page another sequence holds, with the lengths argument saying every other sequence
    holds all the pages of its row (the converted sequence's own entry, which import_ does not read, says 0)."""
    name, table, axis = OTHERS_LENGTHS[call["format"]]
    shape = np.shape(required(call, table))
    lengths = np.full(shape[axis], shape[-1] * PAGE_TOKENS, np.int64)
    lengths[SEQUENCE] = 0
    call[name] = np.concatenate([[0], np.cumsum(lengths)]) if name == "kvstarts" else lengths
    _free_pages(lambda c, free: _pages_of_others(c)[:1] + free[1:])(call)


IMPORT = [
    broken("format", "unknown", sets(format="tgi")),
    broken("kv", "not a KV", _kv(lambda kv: (kv.key, kv.value))),
    broken("kv", "key and value token counts differ", _kv_with(value=lambda kv: kv.value[:, :-1])),
    broken("kv", "positions shorter than the tokens", _kv_with(positions=lambda kv: kv.positions[:-1])),
    broken("kv", "positions not increasing", _kv_with(positions=lambda kv: kv.positions[::-1].copy()),
           when=lambda c: c["kv"].tokens > 1),
    broken("kv", "int32 values", _kv_with(value=lambda kv: kv.value.astype(np.int32))),
    broken("kv", "a NaN position", _kv_with(positions=lambda kv: kv.positions.astype(np.float64) * np.nan)),
    broken("kv", "one head more than the cache", _kv(lambda kv: convert.KV(*(np.concatenate([x, x[:1]]) for x in (
        kv.key, kv.value)), kv.positions)), *[n for v in CACHE_ARRAY.values() for n in (v if isinstance(v, tuple)
                                                                                        else (v,))]),
    broken("sequence", "past the batch", sets(sequence=3)),
    broken("sequence", "negative", sets(sequence=-1)),
    broken("sequence", "a float", sets(sequence=float(SEQUENCE))),
    *LAYER_ROWS,
    broken("free_pages", "a page twice", _free_pages(lambda c, free: free[:1] * 2 + free[1:]), when=_two_pages),
    broken("free_pages", "a page past the pool", _free_pages(lambda c, free: [10 ** 6] + free[1:]), when=_paged),
    # ppl, trtllm and vllm learn the other sequences' pages from their lengths, which these rows pass (a caller
    # asks for the check so); FlashInfer's CSR page table says which pages each request holds by itself.
    broken("free_pages", "a page another sequence holds (flashinfer)", _free_pages(
        lambda c, free: _pages_of_others(c)[:1] + free[1:]), when=lambda c: _is("flashinfer")(c) and _paged(c)),
    *(broken("free_pages", f"a page another sequence holds, their lengths given ({fmt})",
             _held_page_first_lengths_given, when=lambda c, fmt=fmt: _is(fmt)(c) and _paged(c))
      for fmt in OTHERS_LENGTHS),
    broken("free_pages", "a float page", _free_pages(lambda c, free: [float(free[0])] + free[1:]), when=_paged),
    broken("free_pages", "a tuple", _free_pages(lambda c, free: tuple(free)), when=_paged),
    # each format's own arguments
    *(_one_axis_more(fmt, name) for fmt, names in CACHE_ARRAY.items() if fmt != "hf"
      for name in ((names,) if isinstance(names, str) else names)),
    broken("cache_layout", "7", sets(cache_layout=7), when=_is("ppl")),
    broken("quant_bit", "2", sets(quant_bit=2), when=_is("ppl")),
    broken("page_size", "0", sets(page_size=0), when=lambda c: _is("ppl")(c) and c["cache_mode"] == 1),
    broken("kv_quant_orig_scale", "NaN", sets(kv_quant_orig_scale=np.array([np.nan], np.float32)),
           when=lambda c: _is("trtllm")(c) and c["kv_cache_quant_mode"]),
    broken("kv_cache_quant_mode", "an unknown mode", sets(kv_cache_quant_mode=32), when=_is("trtllm")),
    broken("host_max_attention_window_sizes", "0", sets(host_max_attention_window_sizes=np.array([0], np.int32)),
           when=_is("trtllm")),
    broken("host_sink_token_length", "negative", sets(host_sink_token_length=np.array([-1], np.int32)),
           when=_is("trtllm")),
    broken("tokens_per_block", "3", sets(tokens_per_block=3), when=lambda c: _is("trtllm")(c) and c["paged_kv_cache"]),
    broken("past_value", "a token short", sets(past_value=lambda c: c["past_value"][:, :, :-1]), when=_is("onnx")),
    broken("is_batch_major_cache", "the other layout",
           sets(is_batch_major_cache=lambda c: not c["is_batch_major_cache"]), "key_cache", "value_cache",
           when=_is("ft")),
    broken("kv_cache_dtype", "int4", sets(kv_cache_dtype="int4"), when=_is("vllm")),
    broken("k_scale", "NaN", sets(k_scale=float("nan")), when=lambda c: c["format"] in ("vllm", "flashinfer")
           and c["k_scale"] is not None),
    broken("k_scale", "0", sets(k_scale=0.0), when=lambda c: c["format"] in ("vllm", "flashinfer")
           and c["k_scale"] is not None),
    broken("block_tables", "the sequence's row past the pool (no free_pages)",
           sets(block_tables=_row_past("block_tables"), free_pages=None), when=_is("vllm")),
    broken("cachestarts", "the sequence's page past the cache (no free_pages)",
           sets(cachestarts=_row_past("cachestarts"), free_pages=None), when=lambda c: _is("ppl")(c) and _paged(c)),
    broken("kv_cache_block_offsets", "the sequence's block past the pool (no free_pages)",
           sets(kv_cache_block_offsets=_row_past("kv_cache_block_offsets"), free_pages=None),
           when=lambda c: _is("trtllm")(c) and _paged(c)),
    broken("kv_layout", "NDH", sets(kv_layout="NDH"), when=_is("flashinfer")),
    broken("kv_indptr", "decreasing", sets(kv_indptr=lambda c: c["kv_indptr"][::-1].copy()), when=_is("flashinfer")),
    broken("kv_indices", "a page past the pool", sets(kv_indices=lambda c: c["kv_indices"] + 100),
           when=_is("flashinfer")),
    broken("dtype", "int8", sets(dtype="int8"), when=_is("hf")),
]


def _import(call, backend):
    arguments = dict(call.inputs, **call.attrs)
    fmt, kv = arguments.pop("format"), arguments.pop("kv")
    if arguments.get("free_pages") is None:
        arguments.pop("free_pages", None)
    return convert.import_(fmt, kv, backend=backend, **arguments)


def _import_call(variant, shape):
    """A valid import_ of a random sequence into a random-filled cache of the variant: (inputs, attrs, layout)."""
    rng = np.random.default_rng(shape["seed"])
    kv = random_kv(rng, shape["heads"], shape["head_dim"], shape["tokens"])
    layout = make(variant, shape, kv, rng, shape["tokens"])
    inputs = dict(layout.args, kv=kv, free_pages=free_pages_of(layout).get("free_pages"))
    return inputs, dict(format=variant[0], sequence=SEQUENCE, layer_idx=layout.layer_idx), layout


@pytest.mark.parametrize("breakage", IMPORT, ids=str)
def test_convert_import_names_the_argument_it_refuses_and_writes_nothing(breakage):
    @ROWS
    @given(variant=convert_variants(), shape=convert_shapes())
    def check(variant, shape):
        _import(Call(*_import_call(variant, shape)[:2]), "reference")                     # the valid call runs
        call = broken_copy(breakage, *_import_call(variant, shape)[:2])                    # the same, unwritten
        refuse_everywhere(_import, call, breakage)
    check()


def _too_long(name):
    """The length argument saying the converted sequence holds 10,000 tokens (hf's seq_len is an int; kvstarts
    the running sum)."""
    def value(call):
        x = required(call, name)
        if not isinstance(x, np.ndarray):
            return 10 ** 4
        x = x.copy()
        if name == "kvstarts":
            x[SEQUENCE + 1:] += 10 ** 4
        else:
            x[SEQUENCE] = 10 ** 4
        return x
    return value


EXPORT = [
    broken("format", "unknown", sets(format="tgi")),
    broken("sequence", "past the batch", sets(sequence=3)),
    broken("sequence", "negative", sets(sequence=-1)),
    *LAYER_ROWS,
    *(broken(name, "past what the cache holds", sets(**{name: _too_long(name)}), *also,
             when=lambda c, fmt=fmt: c["format"] == fmt and not _cyclic(c)) for fmt, name, *also in LENGTHS),
]


def _export(call, backend):
    arguments = dict(call.inputs, **call.attrs)
    return convert.export(arguments.pop("format"), backend=backend, **arguments)


def _export_call(variant, shape):
    """A valid export of the sequence a valid import wrote, as (inputs, attrs)."""
    inputs, attrs, layout = _import_call(variant, shape)
    _import(Call(inputs, attrs), "reference")
    cache = layout.export_cache(inputs["kv"].tokens, inputs["kv"].positions)
    return dict(cache.arguments), dict(format=variant[0], sequence=SEQUENCE, layer_idx=attrs["layer_idx"])


@pytest.mark.parametrize("breakage", EXPORT, ids=str)
def test_convert_export_names_the_argument_it_refuses_and_writes_nothing(breakage):
    @ROWS
    @given(variant=convert_variants(), shape=convert_shapes())
    def check(variant, shape):
        inputs, attrs = _export_call(variant, shape)
        _export(Call(inputs, attrs), "reference")                                          # the valid call runs
        refuse_everywhere(_export, broken_copy(breakage, inputs, attrs), breakage)
    check()


CONVERT = [
    broken("src", "not a Cache", sets(src=lambda c: c["src"].arguments)),
    broken("dst", "not a Cache", sets(dst=lambda c: c["dst"].arguments)),
    broken("sequence", "past the batch", sets(sequence=3)),
    broken("dst_sequence", "negative", sets(dst_sequence=-1)),
    *(broken(name, "past the layers", sets(**{name: 5}),
             when=lambda c, side=side: not _layerless(c[side].format, c[side].arguments))
      for name, side in (("layer_idx", "src"), ("dst_layer_idx", "dst"))),
    *(broken(name, f"past the one layer of {what}", sets(**{name: 5}),
             when=lambda c, side=side, fmt=fmt: c[side].format == fmt and _layerless(fmt, c[side].arguments))
      for name, side in (("layer_idx", "src"), ("dst_layer_idx", "dst")) for fmt, what in ONE_LAYER.items()),
    broken("free_pages", "a page twice", sets(free_pages=lambda c: c["free_pages"][:1] * 2 + c["free_pages"][1:]),
           when=lambda c: bool(c["free_pages"]) and c["drawn"]["tokens"] > 4),
    broken("rope", "not a Rope", sets(rope="gpt_neox"), when=lambda c: c["drawn"]["rope_needed"]),
]


def _convert(call, backend):
    arguments = dict(call.inputs, **call.attrs)
    arguments.pop("drawn")
    if arguments.get("free_pages") is None:
        arguments.pop("free_pages", None)
    return convert.convert(arguments.pop("src"), arguments.pop("dst"), backend=backend, **arguments)


def _fresh(drawn):
    """A drawn convert call with its destination cache copied (a valid run writes into it)."""
    inputs, attrs = drawn
    dst = inputs["dst"]
    copied = convert.Cache(dst.format, **copy_inputs(dst.arguments)) if dst.format != "hf" else dst
    return dict(inputs, dst=copied, free_pages=None if inputs["free_pages"] is None else list(inputs["free_pages"])), \
        attrs


@st.composite
def convert_calls(draw):
    """(inputs, attrs) of a valid convert between two random variants."""
    src_variant, dst_variant, shape = draw(convert_variants()), draw(convert_variants()), draw(convert_shapes())
    source, source_attrs = _export_call(src_variant, shape)
    # A cyclic TensorRT-LLM source exports the tokens its window holds: the destination is made for those.
    tokens = _export(Call(source, source_attrs), "reference").tokens
    rng = np.random.default_rng(shape["seed"] + 1)
    layout = make(dst_variant, dict(shape, tokens=tokens), random_kv(rng, shape["heads"], shape["head_dim"], tokens),
                  rng, tokens)
    # StreamingLLM keeps keys un-rotated, every other format rotated: a Rope turns them (given either way).
    rope_needed = bool(src_variant[1].get("streamingllm")) != bool(dst_variant[1].get("streamingllm"))
    return dict(src=convert.Cache(src_variant[0], **source), dst=convert.Cache(dst_variant[0], **layout.args),
                free_pages=layout.free_pages), dict(
        sequence=SEQUENCE, layer_idx=source_attrs["layer_idx"], dst_layer_idx=layout.layer_idx,
        rope=convert.Rope(shape["head_dim"]), drawn=dict(rope_needed=rope_needed, tokens=tokens))


@pytest.mark.parametrize("breakage", CONVERT, ids=str)
def test_convert_convert_names_the_argument_it_refuses_and_writes_nothing(breakage):
    @ROWS
    @given(drawn=convert_calls())
    def check(drawn):
        inputs, attrs = drawn
        _convert(Call(*_fresh(drawn)), "reference")                                        # the valid call runs
        refuse_everywhere(_convert, broken_copy(breakage, *_fresh(drawn)), breakage)
    check()


# ---------------------------------------------------------------------------------------------- cacheattn.hf.Engine

def _hf_available() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(n) is not None for n in ("torch", "transformers"))


needs_hf = pytest.mark.skipif(not _hf_available(), reason="cacheattn.hf needs the hf extra (torch, transformers)")

def _per_tensor(call) -> bool:
    """gpt_attention's int8 / fp8 caches: the ones with per-tensor scales (kv_scales)."""
    return call["operator"] == "gpt_attention" and call["kv_cache_dtype"] in ("int8", "fp8")


ENGINE = [
    # construction
    broken("model", "not a transformers model", sets(model="llama")),
    broken("operator", "unknown", sets(operator="flash_attention")),
    broken("cache", "a kind the operator does not keep", sets(cache="ring")),
    broken("kv_cache_dtype", "a dtype the operator has not", sets(kv_cache_dtype="int2")),
    broken("page_size", "0", sets(page_size=0)),
    broken("page_size", "not a power of two for gpt_attention's pages", sets(page_size=3),
           when=lambda c: c["operator"] == "gpt_attention" and c["cache"] == "paged"),
    broken("page_size", "a float", sets(page_size=4.0)),
    broken("quant_group", "0", sets(quant_group=0)),
    broken("quant_group", "not dividing head_dim", sets(quant_group=5),
           when=lambda c: c["operator"] == "multi_head_cache_attention" and c["kv_cache_dtype"] in ("int8", "int4")),
    broken("backend", "unknown", sets(backend="cuda")),
    broken("num_pages", "0", sets(num_pages=0)),
    broken("kv_scales", "NaN", sets(kv_scales=np.array([np.nan])), when=_per_tensor),
    broken("kv_scales", "negative", sets(kv_scales=np.array([-0.1])), when=_per_tensor),
    broken("kv_scales", "one per layer and one more", sets(kv_scales=np.array([0.1, 0.1])), when=_per_tensor),
    broken("kv_scales", "for a cache without per-tensor scales", sets(kv_scales=np.array([0.1])),
           when=lambda c: not _per_tensor(c)),
    # generate
    broken("prompts", "text", sets(prompts=["hello"])),
    broken("prompts", "a token id past the vocabulary",
           sets(prompts=lambda c: [np.append(p, 97) for p in c["prompts"]])),
    broken("prompts", "a negative token id", sets(prompts=lambda c: [np.append(p, -1) for p in c["prompts"]])),
    broken("prompts", "float token ids", sets(prompts=lambda c: [p.astype(np.float64) for p in c["prompts"]])),
    broken("prompts", "an empty prompt", sets(prompts=lambda c: c["prompts"][:-1] + [np.zeros(0, np.int64)])),
    broken("prompts", "none at all", sets(prompts=[])),
    broken("max_new_tokens", "0", sets(max_new_tokens=0)),
    broken("max_new_tokens", "a float", sets(max_new_tokens=2.0)),
    broken("arrivals", "one short", sets(arrivals=lambda c: c["arrivals"][:-1])),
    broken("arrivals", "negative", sets(arrivals=lambda c: [-1] + c["arrivals"][1:])),
    broken("on_step", "not callable", sets(on_step="progress")),
]
CONSTRUCTION = ("model", "operator", "cache", "kv_cache_dtype", "page_size", "quant_group", "backend", "kv_scales",
                "num_pages")


@pytest.fixture(scope="module")
def tiny_llama():
    import torch
    torch.set_num_threads(1)
    from cacheattn.hf.models import tiny_model
    return tiny_model("llama", layers=1)


@st.composite
def engine_calls(draw):
    """A valid Engine construction and generate call on the tiny Llama: (inputs, attrs)."""
    from cacheattn.hf.engine import CACHE_KINDS, KV_DTYPES
    operator = draw(st.sampled_from(sorted(CACHE_KINDS)))
    prompts = draw(st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=4), min_size=1, max_size=2))
    attrs = dict(operator=operator, cache=draw(st.sampled_from(CACHE_KINDS[operator])),
                 kv_cache_dtype=draw(st.sampled_from(KV_DTYPES[operator])), page_size=draw(st.sampled_from([1, 2, 4])),
                 quant_group=4, max_new_tokens=draw(st.integers(1, 2)),
                 arrivals=draw(st.lists(st.integers(0, 2), min_size=len(prompts), max_size=len(prompts))))
    return dict(prompts=[np.asarray(p, np.int64) for p in prompts]), attrs


def _engine_run(model):
    """run(call, backend): Engine(model, **construction arguments) then generate(**the rest); a breakage's model
    or backend replaces the drawn one."""
    from cacheattn.hf import Engine

    def run(call, backend):
        arguments = dict(call.inputs, **call.attrs)
        built = {name: arguments.pop(name) for name in CONSTRUCTION if name in arguments}
        built.setdefault("backend", backend)
        return Engine(built.pop("model", model), **built).generate(**arguments)
    return run


def _weights(model) -> dict:
    return {name: tensor_bits(p).tobytes() for name, p in model.state_dict().items()}


@needs_hf
@pytest.mark.parametrize("breakage", ENGINE, ids=str)
def test_the_engine_names_the_argument_it_refuses_and_changes_nothing(tiny_llama, breakage):
    run = _engine_run(tiny_llama)
    weights = _weights(tiny_llama)

    @ROWS
    @given(drawn=engine_calls())
    def check(drawn):
        inputs, attrs = drawn
        run(Call(copy_inputs(inputs), dict(attrs, max_new_tokens=1)), "reference")           # the valid call runs
        call = broken_copy(breakage, inputs, attrs)
        refuse_everywhere(run, call, breakage)
        assert _weights(tiny_llama) == weights and tiny_llama.config._attn_implementation != "cacheattn"
    check()
