"""cacheattn.convert refuses bad input before it writes: every import, on both backends, names the argument at fault
(`kv` and its fields included) and leaves every cache, table and free list bit-identical. The caches start as
random bytes (convert_formats.build), so a stray write shows."""

from __future__ import annotations

import numpy as np
import pytest
from convert_formats import SEQUENCE, as_bytes, build, random_kv, torch_available

from cacheattn import convert

BACKENDS = ("reference", "numba")
TOKENS = 7                                             # two pages of 4 in every paged fixture

# One variant of each format (quantized where the format can be, so that a non-finite value has no code).
VARIANTS = {
    "ppl": dict(cache_layout=1, quant_bit=8, cache_mode=1, dtype="float16"),
    "trtllm": dict(paged=True, quant=128, window=64, sinks=0, streamingllm=False, dtype="float32"),
    "onnx": dict(dtype="float32"),
    "ft": dict(batch_major=True, layered=True, dtype="float16"),
    "vllm": dict(layout="classic", cache_dtype="fp8", dtype="float32"),
    "flashinfer": dict(kv_layout="HND", split=True, cache_dtype="float8_e5m2"),
    "hf": dict(dtype="float32"),
}
FORMATS = [f for f in VARIANTS if f != "hf" or torch_available()]
PAGED = ("ppl", "trtllm", "vllm", "flashinfer")
QUANTIZED = ("ppl", "trtllm", "vllm", "flashinfer")
# The cache argument of each format, and its page table.
CACHE_ARGUMENT = dict(ppl="cache", trtllm="kv_cache_pool", onnx="past_key", ft="key_cache", vllm="key_cache",
                      flashinfer="paged_kv_cache", hf="past_key_values")
TABLE = dict(ppl="cachestarts", trtllm="kv_cache_block_offsets", vllm="block_tables", flashinfer="kv_indices")


def _layout(fmt, seed):
    rng = np.random.default_rng(seed)
    kv = random_kv(rng, 1, 16, TOKENS)
    scales = (float(np.abs(kv.key).max()) / 300, float(np.abs(kv.value).max()) / 300)
    if fmt == "trtllm":
        scales = (max(scales),) * 2
    return build(fmt, VARIANTS[fmt], heads=1, head_dim=16, tokens=TOKENS, rng=rng, scales=scales), kv


def _lengths(fmt):
    """The other sequences' lengths (every page of their rows in use), as the format's optional import argument."""
    lengths = np.array([16, 0, 16])
    if fmt == "ppl":
        return {"kvstarts": np.concatenate([[0], np.cumsum(lengths)])}
    if fmt == "trtllm":
        return {"sequence_length": np.array([24, 0, 24])}
    if fmt == "vllm":
        return {"seq_lens": lengths}
    return {}


def _page_of_another(layout):
    a = layout.arrays
    if layout.format == "ppl":
        return int(a["cachestarts"][0, 0]) // 4
    if layout.format == "trtllm":
        return int(a["kv_cache_block_offsets"][0, 0, 0, 0]) // (2 * a["kv_cache_pool"].shape[1])
    if layout.format == "vllm":
        return int(a["block_tables"][0, 0])
    return int(a["kv_indices"][0])


def _twice_in_the_table(layout):
    """The sequence's own row lists its first page twice (the import then takes no free pages)."""
    a = layout.arrays
    if layout.format == "ppl":
        a["cachestarts"][SEQUENCE, 1] = a["cachestarts"][SEQUENCE, 0]
    elif layout.format == "trtllm":
        a["kv_cache_block_offsets"][0, SEQUENCE, :, 1] = a["kv_cache_block_offsets"][0, SEQUENCE, :, 0]
    elif layout.format == "vllm":
        a["block_tables"][SEQUENCE, 1] = a["block_tables"][SEQUENCE, 0]
    else:
        first = a["kv_indptr"][SEQUENCE]
        a["kv_indices"][first + 1] = a["kv_indices"][first]


def _break(case, layout, kv):
    """(kv, import arguments, the argument the error must name) of one broken import."""
    args = {**layout.args, "layer_idx": layout.layer_idx}
    free = layout.free_pages
    if free is not None:
        args["free_pages"] = free
    fmt = layout.format
    if case == "value tokens":
        kv.value = kv.value[:, :-1]                  # a KV edited after it was built: import checks it again
        return kv, args, "kv.value"
    if case == "short positions":
        kv.positions = kv.positions[:4]
        return kv, args, "kv.positions"
    if case == "not a KV":
        return (kv.key, kv.value, kv.positions), args, "kv"
    if case == "heads":
        return convert.KV(np.concatenate([kv.key] * 2), np.concatenate([kv.value] * 2), kv.positions), args, "kv"
    if case == "cache type":
        args[CACHE_ARGUMENT[fmt]] = {"data": np.zeros(4)}
        return kv, args, CACHE_ARGUMENT[fmt]
    if case == "sequence type":
        args["sequence"] = str(SEQUENCE)
        return kv, args, "sequence"
    if case == "non-finite":
        kv.key[0, 3, 5] = np.inf
        return kv, args, "kv.key"
    if case == "duplicate pages":
        args["free_pages"] = [free[0], free[0], free[1]]
    elif case == "page out of range":
        args["free_pages"] = [free[0], 10_000]
    elif case == "negative page":
        args["free_pages"] = [-1, free[0]]
    elif case == "page of another sequence":
        args.update(_lengths(fmt), free_pages=[free[0], _page_of_another(layout)])
    elif case == "a page twice further down the list":
        args["free_pages"] = free[:3] + [free[2]]        # the import takes two: a later one would take it twice
    elif case == "free_pages a tuple":
        args["free_pages"] = tuple(free)
    elif case == "page twice in the table":
        _twice_in_the_table(layout)
        args.pop("free_pages")
        return kv, args, TABLE[fmt]
    return kv, args, "free_pages"


GENERAL = ["value tokens", "short positions", "not a KV", "heads", "cache type", "sequence type"]
PAGES = ["duplicate pages", "a page twice further down the list", "page out of range", "negative page",
         "page of another sequence", "free_pages a tuple", "page twice in the table"]
CASES = ([(f, c) for f in FORMATS for c in GENERAL] + [(f, c) for f in PAGED for c in PAGES]
         + [(f, "non-finite") for f in QUANTIZED])


def _snapshot(layout):
    data = {n: as_bytes(a) for n, a in layout.byte_arrays().items()}
    tables = {n: as_bytes(a) for n, a in layout.arrays.items() if a is not None and n not in data}
    return data, tables, None if layout.free_pages is None else list(layout.free_pages)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt, case", CASES, ids=[f"{f}-{c}" for f, c in CASES])
def test_a_broken_import_names_its_argument_and_writes_nothing(fmt, case, backend):
    layout, kv = _layout(fmt, seed=sum(map(ord, fmt + case)))
    kv, args, name = _break(case, layout, kv)
    before = _snapshot(layout)
    with pytest.raises((ValueError, TypeError), match=f"^{name}:"):
        convert.import_(fmt, kv, backend=backend, **{"sequence": SEQUENCE, **args})
    after = _snapshot(layout)
    for (n, old), new in zip(before[0].items(), after[0].values()):
        assert np.array_equal(old, new), f"{fmt} {case}: {n} changed"
    for (n, old), new in zip(before[1].items(), after[1].values()):
        assert np.array_equal(old, new), f"{fmt} {case}: table {n} changed"
    assert before[2] == after[2], "the free list changed"


@pytest.mark.parametrize("fmt", PAGED)
def test_the_other_sequences_lengths_let_free_pages_through_that_no_one_holds(fmt):
    """The check against other sequences' pages refuses only pages they hold: the fixture's free list (pages no
    other row lists) imports, and export gives the tokens back."""
    layout, kv = _layout(fmt, seed=11)
    free = layout.free_pages
    taken = free[:2]
    info = convert.import_(fmt, kv, sequence=SEQUENCE, layer_idx=layout.layer_idx, free_pages=free,
                           **layout.args, **_lengths(fmt))
    assert info["pages"] == taken and taken[0] not in free
    back = convert._call(convert._module(fmt).export, layout.export_cache(kv.tokens, kv.positions).arguments,
                         sequence=SEQUENCE, layer_idx=layout.layer_idx)
    np.testing.assert_array_equal(back.positions, kv.positions)


LENGTH = dict(ppl="kvstarts", trtllm="sequence_length", onnx="nonpad_kv_seqlen", ft="encoder_sequence_length",
              vllm="seq_lens", flashinfer="kv_last_page_len", hf="seq_len")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_length_past_what_the_cache_holds_is_blamed_on_the_length(fmt):
    layout, kv = _layout(fmt, seed=12)
    convert.import_(fmt, kv, sequence=SEQUENCE, layer_idx=layout.layer_idx, **layout.args,
                    **({} if layout.free_pages is None else {"free_pages": layout.free_pages}))
    arguments = dict(layout.export_cache(kv.tokens, kv.positions).arguments)
    name = LENGTH[fmt]
    if fmt == "hf":
        arguments[name] = 10_000
    elif fmt == "ppl":
        arguments[name] = arguments[name] + np.array([0, 0, 10_000, 10_000])
    else:
        arguments[name] = np.array(arguments[name], copy=True)
        arguments[name][SEQUENCE] = 10_000
    with pytest.raises(ValueError, match=f"^{name}: "):
        convert.export(fmt, sequence=SEQUENCE, layer_idx=layout.layer_idx, **arguments)


# ---------------------------------------------------------------------------------------------- the reports

def _reproducer_kv():
    k = np.arange(7, dtype=np.float32)[None, :, None].repeat(4, 2) + 1
    return convert.KV(k, -k, np.arange(7))


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_free_pages_are_refused_before_the_page_table_changes(backend):
    kv_cache = np.random.default_rng(0).standard_normal((2, 4, 4, 1, 4)).astype(np.float32)
    block_tables = np.zeros((1, 2), np.int32)
    before, free = kv_cache.copy(), [2, 2]
    with pytest.raises(ValueError, match="^free_pages: .*distinct.* 2 twice"):
        convert.import_("vllm", _reproducer_kv(), kv_cache=kv_cache, block_tables=block_tables, sequence=0,
                        free_pages=free, backend=backend)
    assert block_tables.tolist() == [[0, 0]] and free == [2, 2] and np.array_equal(kv_cache, before)
    # Distinct pages: the round trip gives the keys back in order.
    convert.import_("vllm", _reproducer_kv(), kv_cache=kv_cache, block_tables=block_tables, sequence=0,
                    free_pages=[2, 3], backend=backend)
    back = convert.export("vllm", kv_cache=kv_cache, block_tables=block_tables, seq_lens=np.array([7]), sequence=0)
    assert back.key[0, :, 0].tolist() == [1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kv_whose_key_and_value_disagree_is_refused_naming_kv(backend):
    k = _reproducer_kv().key
    with pytest.raises(ValueError, match="^kv.value: "):
        convert.KV(k, -k[:, :5], np.arange(7))
    kv = _reproducer_kv()
    kv.value = kv.value[:, :5]
    key_cache = np.random.default_rng(1).standard_normal((2, 1, 1, 4, 4)).astype(np.float32)
    value_cache = np.random.default_rng(2).standard_normal((2, 1, 4, 4)).astype(np.float32)
    before = key_cache.copy(), value_cache.copy()
    with pytest.raises(ValueError, match="^kv.value: "):
        convert.import_("vllm", kv, key_cache=key_cache, value_cache=value_cache, block_tables=np.array([[1, 0]]),
                        sequence=0, backend=backend)
    assert np.array_equal(key_cache, before[0]) and np.array_equal(value_cache, before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_positions_are_refused_not_half_written(backend):
    k = _reproducer_kv().key
    with pytest.raises(ValueError, match="^kv.positions: "):
        convert.KV(k, -k, np.arange(4))
    kv = _reproducer_kv()
    kv.positions = np.arange(4)
    past_key_value = np.random.default_rng(3).standard_normal((1, 2, 1, 8, 4)).astype(np.float32)
    before = past_key_value.copy()
    with pytest.raises(ValueError, match="^kv.positions: "):
        convert.import_("trtllm", kv, past_key_value=past_key_value, host_max_attention_window_sizes=np.array([8]),
                        host_sink_token_length=np.array([0]), sequence=0, backend=backend)
    assert np.array_equal(past_key_value, before)


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_below_one_is_named_as_the_window(window):
    past_key_value = np.zeros((1, 2, 1, 8, 4), np.float32)
    with pytest.raises(ValueError, match="^host_max_attention_window_sizes: "):
        convert.import_("trtllm", _reproducer_kv(), past_key_value=past_key_value, sequence=0,
                        host_max_attention_window_sizes=np.array([window]), host_sink_token_length=np.array([0]))
    with pytest.raises(ValueError, match="^host_sink_token_length: "):
        convert.import_("trtllm", _reproducer_kv(), past_key_value=past_key_value, sequence=0,
                        host_max_attention_window_sizes=np.array([4]), host_sink_token_length=np.array([4]))


def test_every_public_entry_names_a_wrong_type():
    kv = _reproducer_kv()
    past = dict(past_key=np.zeros((1, 1, 8, 4), np.float32), past_value=np.zeros((1, 1, 8, 4), np.float32))
    onnx = convert.Cache("onnx", **past)
    cases = [
        (lambda: convert.convert(onnx, {"past_key": None}, sequence=0), "dst"),
        (lambda: convert.convert(dict(past), onnx, sequence=0), "src"),
        (lambda: convert.convert(onnx, onnx, sequence=0, rope="gpt_neox"), "rope"),
        (lambda: convert.convert(onnx, onnx, sequence=0.0), "sequence"),
        (lambda: convert.convert(onnx, onnx, sequence=0, dst_layer_idx="1"), "dst_layer_idx"),
        (lambda: convert.convert(onnx, onnx, sequence=0, backend=None), "backend"),
        (lambda: convert.export(("onnx",), sequence=0), "format"),
        (lambda: convert.export("onnx", sequence=np.float32(0), **past), "sequence"),
        (lambda: convert.export("onnx", [[0.0]], past["past_value"], sequence=0), "past_key"),
        (lambda: convert.export("onnx", nonpad_kv_seqlen=np.array([2.0]), sequence=0, **past), "nonpad_kv_seqlen"),
        (lambda: convert.import_("onnx", kv.key, sequence=0, **past), "kv"),
        (lambda: convert.error_bound(past, kv), "dst"),
        (lambda: convert.match_rope(kv, True, 64), "rope"),
        (lambda: convert.Cache("onnx", past_keys=past["past_key"]), "past_keys"),
        (lambda: convert.Cache("onnx", sequence=0, **past), "sequence"),
        (lambda: convert.KV(kv.key.astype(np.int32), kv.value, kv.positions), "kv.key"),
        (lambda: convert.KV(kv.key, kv.value, kv.positions.astype(np.float64)), "kv.positions"),
        (lambda: convert.KV(kv.key, kv.value, kv.positions, rotated="yes"), "kv.rotated"),
        (lambda: convert.KV(kv.key, kv.value, kv.positions, quant=1.0), "kv.quant"),
    ]
    for call, name in cases:
        with pytest.raises(TypeError, match=f"^{name}:"):
            call()


def test_a_kv_keeps_what_its_docstring_promises():
    rng = np.random.default_rng(4)
    key = rng.standard_normal((2, 3, 8)).astype(np.float32)
    assert convert.KV(key, key, [0, 1, 2]).positions.dtype == np.int64
    assert convert.KV(key[:, :0], key[:, :0], []).tokens == 0
    assert convert.KV(key, key[..., :4], np.array([0, 5, 9])).value.shape == (2, 3, 4)     # ONNX's v_head_size
    for positions, why in (([0, 2, 2], "increasing"), ([-1, 0, 1], "non-negative")):
        with pytest.raises(ValueError, match=f"^kv.positions: expected {why}"):
            convert.KV(key, key, positions)
    codes = np.zeros((2, 3, 8), np.int8)
    with pytest.raises(ValueError, match="^kv.quant.value_scale: "):
        convert.KV(key, key, np.arange(3), quant=convert.Quant("int8", codes, codes, 0.5, np.nan))
    with pytest.raises(ValueError, match="^kv.quant.key_codes: "):
        convert.KV(key, key, np.arange(3), quant=convert.Quant("int4_group", codes, codes, key[..., :2],
                                                                key[..., :2], 4))
    with pytest.raises(TypeError, match="^kv.quant.key_codes: "):
        convert.KV(key, key, np.arange(3), quant=convert.Quant("fp8_e4m3", codes, codes, 1.0, 1.0))


def test_dst_arguments_of_convert_are_named_as_given():
    past = dict(past_key=np.zeros((2, 1, 8, 4), np.float32), past_value=np.zeros((2, 1, 8, 4), np.float32))
    src = convert.Cache("onnx", **past)
    with pytest.raises(ValueError, match="^dst_sequence: "):
        convert.convert(src, convert.Cache("onnx", **past), sequence=0, dst_sequence=2)
    with pytest.raises(ValueError, match="^sequence: "):
        convert.convert(src, convert.Cache("onnx", **past), sequence=2)


def test_a_layer_index_no_side_uses_is_refused():
    """One-layer formats take that layer's tensors: a layer index is refused where it would select nothing, and
    used where one side holds several layers (a one-layer source's layer_idx names the destination's layer)."""
    past = dict(past_key=np.zeros((1, 1, 8, 4), np.float32), past_value=np.zeros((1, 1, 8, 4), np.float32))
    onnx = convert.Cache("onnx", **past)
    ppl = convert.Cache("ppl", cache=np.zeros((8, 2, 2, 1, 4), np.float32), cachestarts=np.array([0]), num_layer=2)
    for dst, given, name in ((onnx, dict(layer_idx=1), "layer_idx"), (ppl, dict(layer_idx=1, dst_layer_idx=0),
                                                                      "layer_idx"),
                             (onnx, dict(dst_layer_idx=1), "dst_layer_idx")):
        with pytest.raises(ValueError, match=f"^{name}: "):
            convert.convert(onnx, dst, sequence=0, **given)
    convert.convert(onnx, ppl, sequence=0, layer_idx=1)


@pytest.mark.skipif(not torch_available(), reason="the hf format needs torch and transformers")
def test_a_transformers_layer_past_the_next_one_is_named_as_the_layer():
    layout, kv = _layout("hf", seed=13)
    with pytest.raises(ValueError, match="^layer_idx: "):
        convert.import_("hf", kv, sequence=SEQUENCE, layer_idx=5, **layout.args)
    with pytest.raises(ValueError, match="^sequence: "):                # the next layer is made from row 0 only
        convert.import_("hf", kv, sequence=SEQUENCE, layer_idx=1, **layout.args)
