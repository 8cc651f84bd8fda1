"""TensorRT-LLM's whole gpt_attention signature: every keyword accepted (used, without effect, or refused by name
when it asks for what is not built), the single-pool mapping, the page-race check, and the inputs this signature
adds: rotary_cos_sin read where TensorRT-LLM reads it, long_rope's switch and m-scales, yarn, logn_scaling and the
packed custom mask, on the reference and on the kernels (simulator)."""

import inspect
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cacheattn
import cacheattn.testing as kit
from cacheattn import trtllm
from kernels_numba import _launch
from reference import packed_mask, rope

from helpers import assert_bits_equal, assert_close
from strategies import REFERENCE, TrtCase, build_trt

# tensorrt_llm.functional.gpt_attention's keywords, in its order (release 1.0 and later).
TRT_KEYWORDS = (
    "qkv", "past_key_value", "attention_mask", "attention_packed_mask", "sequence_length",
    "host_past_key_value_lengths", "host_max_attention_window_sizes", "host_sink_token_length", "context_lengths",
    "cache_indirection", "host_request_types", "layer_idx", "num_heads", "num_kv_heads", "hidden_size_per_head",
    "q_scaling", "attn_logit_softcapping_scale", "rotary_embedding_dim", "rotary_embedding_base",
    "rotary_embedding_scale_type", "rotary_embedding_short_m_scale", "rotary_embedding_long_m_scale",
    "rotary_embedding_scale", "rotary_embedding_max_positions", "rotary_embedding_original_max_positions",
    "position_embedding_type", "rotary_inv_freq", "rotary_cos_sin", "kv_orig_quant_scale", "kv_quant_orig_scale",
    "attention_output_orig_quant_scale", "attention_output_sf_scale", "kv_cache_quant_mode", "max_context_length",
    "mask_type", "block_sparse_block_size", "block_sparse_homo_head_pattern", "block_sparse_num_local_blocks",
    "block_sparse_vertical_stride", "alibi_slopes", "tp_size", "tp_rank", "vision_start", "vision_length",
    "kv_cache_block_offsets", "host_kv_cache_block_offsets", "host_kv_cache_pool_pointers",
    "host_kv_cache_pool_mapping", "do_cross_attention", "cross_kv", "cross_kv_length", "encoder_input_lengths",
    "relative_attention_bias", "logn_scaling", "max_distance", "host_context_lengths", "qkv_bias", "use_cache",
    "spec_decoding_is_generation_length_variable", "spec_decoding_max_generation_length",
    "spec_decoding_generation_lengths", "spec_decoding_position_offsets", "spec_decoding_packed_mask",
    "spec_decoding_use", "long_rope_rotary_inv_freq", "long_rope_rotary_cos_sin", "mrope_rotary_cos_sin",
    "mrope_position_deltas", "host_runtime_perf_knobs", "host_context_progress", "is_mla_enabled_flag",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_b_proj", "kv_b_proj",
    "k_b_proj_trans", "skip_attn", "cp_group", "cp_size", "cp_rank", "num_kv_heads_origin")
# TensorRT-LLM's defaults of the keywords a call may leave out (those the base call below does not set).
TRT_DEFAULTS = dict(
    attention_packed_mask=None, rotary_embedding_short_m_scale=1.0, rotary_embedding_long_m_scale=1.0,
    rotary_embedding_original_max_positions=1024, rotary_cos_sin=None, attention_output_orig_quant_scale=None,
    attention_output_sf_scale=None, max_context_length=None, block_sparse_block_size=64,
    block_sparse_homo_head_pattern=False, block_sparse_num_local_blocks=16, block_sparse_vertical_stride=8,
    tp_size=1, tp_rank=0, vision_start=-1, vision_length=-1, host_kv_cache_block_offsets=None,
    host_kv_cache_pool_pointers=None, host_kv_cache_pool_mapping=None, cross_kv_length=None, logn_scaling=None,
    host_context_lengths=None, use_cache=True, spec_decoding_is_generation_length_variable=False,
    spec_decoding_max_generation_length=0, spec_decoding_generation_lengths=None,
    spec_decoding_position_offsets=None, spec_decoding_packed_mask=None, spec_decoding_use=None,
    long_rope_rotary_inv_freq=None, long_rope_rotary_cos_sin=None, mrope_rotary_cos_sin=None,
    mrope_position_deltas=None, host_runtime_perf_knobs=None, host_context_progress=None, is_mla_enabled_flag=False,
    q_lora_rank=0, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0, q_b_proj=None,
    kv_b_proj=None, k_b_proj_trans=None, skip_attn=None, cp_group=[0], cp_size=1, cp_rank=0, num_kv_heads_origin=-1)

BASE = TrtCase(contexts=((0, 5), (2, 3)), generations=((3, 4),), beam_width=2, num_heads=4, num_kv_heads=2,
               head_size=8, dtype="float32", capacity=8, window=8, seed=3)
PAGED = replace(BASE, paged=True, tokens_per_block=2)


def fresh(args):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}


def run(args, backend="reference", **changes):
    args = fresh({**args, **changes})
    output, _ = cacheattn.gpt_attention(**args, backend=backend)
    return output, args


def test_every_keyword_of_the_signature_in_tensorrt_llms_order():
    params = list(inspect.signature(cacheattn.gpt_attention).parameters)
    missing = [k for k in TRT_KEYWORDS if k not in params]
    assert not missing, f"gpt_attention does not take {missing}"
    at = [params.index(k) for k in TRT_KEYWORDS]
    assert at == sorted(at), "keywords out of TensorRT-LLM's order"
    assert set(TRT_DEFAULTS) <= set(TRT_KEYWORDS)


@pytest.mark.parametrize("name", sorted(TRT_DEFAULTS))
def test_each_keyword_at_tensorrt_llms_default_changes_nothing(name):
    args = build_trt(BASE)
    want, _ = run(args)
    got, _ = run(args, **{name: TRT_DEFAULTS[name]})
    assert_bits_equal(name, got, want)


NOT_BUILT_VALUES = {name: (np.zeros(4, np.float32) if default is None else True if default is False else
                           default + 1) for name, (default, _) in trtllm.NOT_BUILT.items()}


@pytest.mark.parametrize("name", sorted(NOT_BUILT_VALUES))
def test_what_is_not_built_is_refused_by_name(name):
    args = build_trt(BASE)
    with _launch.recorded_launches() as launches, pytest.raises(ValueError, match=rf"^{name}: .* not built"):
        cacheattn.gpt_attention(**args, **{name: NOT_BUILT_VALUES[name]}, backend="numba")
    assert launches == []


def test_no_effect_keywords_take_other_values_too():
    args = build_trt(BASE)
    want, _ = run(args)
    got, _ = run(args, block_sparse_block_size=32, tp_size=2, tp_rank=1, num_kv_heads_origin=4, cp_group=[0, 1],
                 host_runtime_perf_knobs=np.zeros(16, np.int64), host_context_progress=np.zeros(1, np.int64))
    assert_bits_equal("output", got, want)


def test_one_pool_mapping_is_accepted_and_others_are_refused_by_name():
    args = build_trt(replace(PAGED, num_layers=2, layer_idx=1))
    want, _ = run(args)
    one_pool = np.array([[0, 0], [0, 1]], np.int32)
    got, _ = run(args, host_kv_cache_pool_mapping=one_pool)
    assert_bits_equal("output", got, want)
    for bad in (np.array([[0, 0], [1, 0]], np.int32), np.array([[0, 1], [0, 0]], np.int32), one_pool[:1]):
        with pytest.raises(ValueError, match="^host_kv_cache_pool_mapping: one pool"):
            run(args, host_kv_cache_pool_mapping=bad)
    with pytest.raises(ValueError, match="^host_kv_cache_pool_pointers: .*kv_cache_pool"):
        run(args, host_kv_cache_pool_pointers=np.zeros((1, 2), np.int64))


def test_negative_sinks_name_the_sinks():
    args = build_trt(BASE)
    with pytest.raises(ValueError, match=r"^host_sink_token_length: expected a number of sink tokens >= 0, got -1"):
        run(args, host_sink_token_length=np.array([-1], np.int32))


# ---- Pages shared between entries: written slots must not be shared ---------------------------------------------

def test_a_slot_two_entries_write_is_a_race_and_read_only_sharing_is_legal():
    """The generation sequence's two beams (entries 2, 3; prompt 3 tokens, 4 cached, tokens_per_block 2) write
    position 4: row 0 of their block 2. Giving both the same block 2 is a race; giving them the same block 0
    (positions 0-1, read by both, written by neither) is legal and computes what the copies would."""
    args = build_trt(PAGED)
    offsets = args["kv_cache_block_offsets"]
    raced = offsets.copy()
    raced[0, 3, :, 2] = raced[0, 2, :, 2]
    with _launch.recorded_launches() as launches, pytest.raises(
            ValueError, match=r"^kv_cache_block_offsets: entries 2 and 3 share block \d+ \(K\), and entry \d writes "
                              r"row 0 of it that entry \d writes .*data race.*read-only .* is legal"):
        cacheattn.gpt_attention(**fresh({**args, "kv_cache_block_offsets": raced}))
    assert launches == []
    # A writer and a reader: entry 3 reads its positions 2-3 (block 1) from entry 0's block 2, whose row 0 entry 0
    # (a 5-token context) writes now (its position 4).
    read_raced = offsets.copy()
    read_raced[0, 3, :, 1] = offsets[0, 0, :, 2]
    with pytest.raises(ValueError, match=r"^kv_cache_block_offsets: .* entry 0 writes row 0 of it that entry 3 "
                                         r"reads"):
        cacheattn.gpt_attention(**fresh({**args, "kv_cache_block_offsets": read_raced}))
    shared = offsets.copy()
    pool = args["kv_cache_pool"].copy()
    blocks = pool.reshape(-1, *pool.shape[3:])
    blocks[shared[0, 3, :, 0]] = blocks[shared[0, 2, :, 0]]      # the shared prefix holds what both beams cached
    shared[0, 3, :, 0] = shared[0, 2, :, 0]
    want, _ = run(args, kv_cache_pool=pool.copy())
    got, _ = run(args, kv_cache_block_offsets=shared, kv_cache_pool=pool)
    assert_bits_equal("output", got, want)


# ---- rotary_cos_sin, long_rope, yarn ----------------------------------------------------------------------------

ROPE_CASE = replace(BASE, position=2, rotary_dim=8, rope_table=True)


@pytest.mark.parametrize("position,scale_type", [(1, 0), (2, 1), (2, 4)])
def test_the_plugins_table_rotates_as_its_frequencies(position, scale_type):
    """A table built as create_sinusoidal_positions_for_attention_plugin (linear baked into the frequencies,
    llama3's frequencies) rotates as those frequencies do, within float32 cos/sin roundings."""
    case = replace(ROPE_CASE, position=position, rotary_scale_type=scale_type % 4, rotary_scale=2.0)
    args = build_trt(case)
    if scale_type == 4:
        freq, table = rope.plugin_tables(16, 8, 10000.0, scale_type=4, llama3=dict(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8))
        args.update(rotary_inv_freq=freq, rotary_cos_sin=table, rotary_embedding_scale_type=4)
    from_table, _ = run(args)
    from_freq, _ = run({k: v for k, v in args.items() if k != "rotary_cos_sin"})
    assert_close("table vs frequencies", from_table, from_freq.astype(np.float64), "float32")


def test_the_table_is_read_unless_tensorrt_llm_recomputes():
    """A table whose entries differ from the frequencies is what the call uses; past rotary_embedding_max_positions
    (8; every sequence here is longer in one variant), with dynamic scaling or StreamingLLM the kernels recompute
    from the frequencies, so the table changes nothing there."""
    args = build_trt(ROPE_CASE)
    halved = (args["rotary_cos_sin"] * np.float32(0.5)).astype(np.float32)
    plain, _ = run(args)
    read, _ = run(args, rotary_cos_sin=halved)
    assert np.abs(read - plain).max() > 1e-3
    for changes in (dict(rotary_embedding_max_positions=1), dict(rotary_embedding_scale_type=2)):
        without, _ = run({k: v for k, v in args.items() if k not in ("rotary_cos_sin", "rotary_inv_freq")},
                         **changes)
        ignored, _ = run({k: v for k, v in args.items() if k != "rotary_inv_freq"}, rotary_cos_sin=halved, **changes)
        assert_bits_equal(f"recomputed with {changes}", ignored, without)


def test_long_rope_switches_tables_per_phase_past_the_original_positions():
    """long_rope (original max positions 4): the context phase (lengths 5, 5) and the generation phase (5) are
    past it and read the long table; with original 5 both read the short one. The m-scale scales the tables."""
    case = replace(BASE, position=3, rotary_dim=8)
    args = build_trt(case)
    long_only = dict(rotary_inv_freq=args["long_rope_rotary_inv_freq"], rotary_cos_sin=args["long_rope_rotary_cos_sin"])
    short_only = dict(long_rope_rotary_inv_freq=args["rotary_inv_freq"],
                      long_rope_rotary_cos_sin=args["rotary_cos_sin"])
    got, _ = run(args)
    assert_bits_equal("long past the original", got, run(args, **long_only)[0])
    got, _ = run(args, rotary_embedding_original_max_positions=5)
    assert_bits_equal("short within it", got, run(args, rotary_embedding_original_max_positions=5, **short_only)[0])
    assert np.abs(got - run(args, **long_only, rotary_embedding_original_max_positions=5)[0]).max() > 1e-3
    assert args["rotary_embedding_short_m_scale"] == pytest.approx(np.sqrt(1 + np.log(6 / 4) / np.log(4)))


def test_recomputed_coefficients_carry_the_m_scale():
    """Past rotary_embedding_max_positions the coefficients come from the frequencies times the m-scale: scaling
    the rotated Q and K by m scales the logits by m^2, as q_scaling / m^2 does (RoPE over the whole head; whole
    contexts, so no cached key was rotated by an earlier call)."""
    args = build_trt(replace(BASE, position=2, rotary_dim=8, contexts=((0, 5), (0, 3)), generations=()))
    m = 2.0
    scaled, _ = run(args, rotary_embedding_short_m_scale=m, rotary_embedding_long_m_scale=m,
                    rotary_embedding_max_positions=1)
    assert np.abs(scaled - run(args, rotary_embedding_max_positions=1)[0]).max() > 1e-3
    same, _ = run(args, rotary_embedding_max_positions=1, q_scaling=1 / m ** 2)
    assert_close("m-scale", scaled, same.astype(np.float64), "float32")


def test_logn_scaling_generator_and_its_effect():
    logn = rope.logn_scaling(4, 10)
    want = [1, 1, 1, 1, np.log(5) / np.log(4), np.log(6) / np.log(4), np.log(7) / np.log(4), np.log(8) / np.log(4),
            np.log(9) / np.log(4), np.log(10) / np.log(4)]
    np.testing.assert_allclose(logn, want, rtol=1e-6)
    assert logn.dtype == np.float32
    args = build_trt(replace(BASE, rotary_dim=8, position=2))
    plain, _ = run(args)
    assert_bits_equal("factors of 1", run(args, logn_scaling=np.ones(9, np.float32))[0], plain)
    doubled, _ = run(args, logn_scaling=np.full(9, 2.0, np.float32))
    assert_close("Q doubled = q_scaling halved", doubled, run(args, q_scaling=0.5)[0].astype(np.float64), "float32")


# ---- The packed custom mask ----------------------------------------------------------------------------------

def test_packed_layout_puts_bits_where_the_fragments_read_them():
    """One bit at a time: (row, col) lands in the word of MMA thread t = warp*32 + lane_row*4 + pair of its tile,
    bit 4k + 2 half + low; the second sequence's rows start after the first's 128-row padding."""
    q_lens, kv_lens = [3, 70], [300, 70]
    assert packed_mask.packed_shape(q_lens, kv_lens) == (256, 16)
    mask = np.zeros((73, 300), bool)
    mask[2, 259] = True                                   # sequence 0, row 2, col 259: tile n 4, k 0, pair 1, low 1
    packed = packed_mask.pack_attention_mask(mask, q_lens, kv_lens)
    word = 0 * 8 * 128 + 4 * 128 + (0 * 32 + 2 * 4 + 1)
    assert np.flatnonzero(packed.reshape(-1)).tolist() == [word]
    assert packed.reshape(-1)[word] == 1 << (4 * 0 + 2 * 0 + 1)
    mask[:] = False
    mask[3 + 66, 13] = True                               # sequence 1, row 66 (tile 1, row 2 of it, +8 half: no)
    packed = packed_mask.pack_attention_mask(mask, q_lens, kv_lens)
    word = (2 + 1) * 8 * 128 + 0 * 128 + (0 * 32 + 2 * 4 + 2)
    assert np.flatnonzero(packed.reshape(-1)).tolist() == [word]
    assert packed.reshape(-1)[word] == 1 << (4 * 1 + 2 * 0 + 1)


@settings(max_examples=max(REFERENCE // 6, 5), deadline=None)
@given(st.lists(st.tuples(st.integers(1, 140), st.integers(0, 200)), min_size=1, max_size=3), st.integers(0, 2**32 - 1))
def test_pack_then_unpack_is_the_mask_inside_each_sequence(lengths, seed):
    q_lens = [q for q, _ in lengths]
    kv_lens = [q + extra for q, extra in lengths]
    mask = np.random.default_rng(seed).random((sum(q_lens), max(kv_lens) + 3)) < 0.5
    packed = packed_mask.pack_attention_mask(mask, q_lens, kv_lens)
    assert packed.dtype == np.int32 and packed.shape == packed_mask.packed_shape(q_lens, kv_lens)
    back = packed_mask.unpack_attention_mask(packed, q_lens, kv_lens)
    inside = np.zeros_like(back)
    start = 0
    for q, kv in zip(q_lens, kv_lens):
        inside[start:start + q, :kv] = True
        start += q
    assert np.array_equal(back, mask[:, :max(kv_lens)] & inside)
    assert sum(bin(w).count("1") for w in packed.reshape(-1).view(np.uint32).tolist()) == int(back.sum())


@pytest.mark.parametrize("backend", ["reference", "numba"])
def test_the_packed_mask_equals_the_same_attention_mask(backend):
    case = replace(PAGED, mask_type=6, packed_mask=True, num_heads=2, num_kv_heads=1, beam_width=1)
    args = build_trt(case)
    with_packed, _ = run(args, backend)
    without, _ = run({k: v for k, v in args.items() if k != "attention_packed_mask"}, backend)
    assert_bits_equal("packed = unpacked", with_packed, without)
    # The context rows read the packed one: clearing it hides every key from them (zero rows).
    cleared, _ = run(args, backend, attention_packed_mask=np.zeros_like(args["attention_packed_mask"]))
    context_rows = sum(case.new[:len(case.contexts)])
    assert not cleared[:context_rows].any() and np.array_equal(cleared[context_rows:], without[context_rows:])


PACKED_BAD = [
    ("shape", dict(attention_packed_mask=np.zeros((128, 8), np.int32)), ValueError),
    ("dtype", dict(attention_packed_mask=np.zeros((384, 8), np.int64)), TypeError),
    ("not custom", dict(mask_type=1, attention_mask=None), ValueError),
]


@pytest.mark.parametrize("name,changes,error", PACKED_BAD, ids=[p[0] for p in PACKED_BAD])
def test_bad_packed_masks_are_refused_by_name(name, changes, error):
    args = build_trt(replace(BASE, mask_type=6, packed_mask=True))
    with pytest.raises(error, match="^attention_packed_mask"):
        run(args, **changes)


TABLE_BAD = [
    ("table float64", dict(rotary_cos_sin=np.zeros((1, 80), np.float64)), TypeError, "rotary_cos_sin"),
    ("table too short", dict(rotary_cos_sin=np.zeros((1, 32), np.float32)), ValueError, "rotary_cos_sin"),
    ("table not a multiple", dict(rotary_cos_sin=np.zeros((1, 81), np.float32)), ValueError, "rotary_cos_sin"),
    ("long table without long_rope", dict(long_rope_rotary_cos_sin=np.zeros((1, 80), np.float32)), ValueError,
     "long_rope_rotary_cos_sin"),
    ("long_rope without its long table", dict(position_embedding_type=3, long_rope_rotary_inv_freq=np.ones(4)),
     ValueError, "long_rope_rotary_cos_sin"),
    ("yarn without frequencies", dict(position_embedding_type=8, rotary_inv_freq=None), ValueError,
     "rotary_inv_freq"),
    ("m-scale 0", dict(rotary_embedding_long_m_scale=0.0), ValueError, "rotary_embedding_long_m_scale"),
    ("logn too short", dict(logn_scaling=np.ones(4, np.float32)), ValueError, "logn_scaling"),
    ("logn float64", dict(logn_scaling=np.ones(9)), TypeError, "logn_scaling"),
]


@pytest.mark.parametrize("name,changes,error,param", TABLE_BAD, ids=[t[0] for t in TABLE_BAD])
def test_bad_rope_tables_and_logn_are_refused_by_name(name, changes, error, param):
    args = build_trt(ROPE_CASE)
    with pytest.raises(error, match=rf"^{param}\b"):
        run(args, **changes)


# ---- The kernels on the new inputs, through the kit ----------------------------------------------------------

CHOSEN = {
    "long-rope-logn-paged": replace(BASE, position=3, rotary_dim=6, logn=True, paged=True, tokens_per_block=4),
    "yarn-int8-gqa": replace(BASE, position=8, rotary_dim=8, quant=64, num_heads=6, num_kv_heads=2),
    "gptj-table-linear-fp16": replace(BASE, position=1, rotary_dim=8, rope_table=True, rotary_scale_type=1,
                                      rotary_scale=2.0, dtype="float16"),
    "packed-mask-unfused": replace(BASE, mask_type=6, packed_mask=True, context_fmha_type=0, beam_width=1),
}


@pytest.mark.parametrize("name", list(CHOSEN))
def test_kernels_on_the_new_inputs(name):
    def kernels(**args):
        return cacheattn.gpt_attention(**args, backend="numba", threads=64)
    kit.check_case("gpt_attention", kernels, CHOSEN[name])


def test_the_docstring_example_runs():
    import doctest
    result = doctest.testmod(trtllm, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0
