"""The host helpers that build gpt_attention's long_rope and yarn inputs (reference/rope.py, as TensorRT-LLM's
RopeEmbeddingUtils) against transformers' own rotary embeddings: Phi-3's longrope and Llama's yarn give the same
cos/sin (m-scale included) at every position, and the same frequencies. Skipped without transformers (the `hf`
extra: torch, transformers)."""

import numpy as np
import pytest

import cacheattn
from reference import rope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DIM, ORIGINAL, MAX_POSITIONS, BASE = 16, 32, 128, 10000.0


def hf_cos_sin(embedding, positions: int):
    """transformers' (cos, sin) (positions, DIM / 2): its tables repeat the half (rotate_half layout)."""
    cos, sin = embedding(torch.zeros(1, 1, DIM), torch.arange(positions)[None])
    return cos[0, :, :DIM // 2].double().numpy(), sin[0, :, :DIM // 2].double().numpy()


def pairs(table, positions):
    return table.reshape(-1, DIM // 2, 2)[:positions].astype(np.float64)


def phi3_longrope_config():
    """(short factors, long factors, a Phi-3 config whose longrope uses them)."""
    from transformers import Phi3Config
    short = np.linspace(1.0, 1.5, DIM // 2)
    long_ = np.linspace(1.0, 8.0, DIM // 2)
    config = Phi3Config(hidden_size=2 * DIM, num_attention_heads=2, max_position_embeddings=MAX_POSITIONS,
                        original_max_position_embeddings=ORIGINAL,
                        rope_parameters={"rope_type": "longrope", "rope_theta": BASE, "short_factor": short.tolist(),
                                         "long_factor": long_.tolist(), "factor": MAX_POSITIONS / ORIGINAL,
                                         "original_max_position_embeddings": ORIGINAL})
    return short, long_, config


def test_long_rope_tables_are_phi3s_longrope():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    short, long_, config = phi3_longrope_config()
    embedding = Phi3RotaryEmbedding(config)
    ours = rope.long_rope_tables(MAX_POSITIONS, ORIGINAL, DIM, BASE, short, long_)
    assert ours["rotary_embedding_short_m_scale"] == pytest.approx(embedding.attention_scaling, rel=1e-12)
    # Phi-3 switches to the long factors once the sequence passes the original positions, as gpt_attention does.
    for positions, table in ((ORIGINAL, "rotary_cos_sin"), (MAX_POSITIONS, "long_rope_rotary_cos_sin")):
        cos, sin = hf_cos_sin(embedding, positions)
        got = pairs(ours[table], positions)
        np.testing.assert_allclose(got[..., 0], cos, atol=2e-6, rtol=0)
        np.testing.assert_allclose(got[..., 1], sin, atol=2e-6, rtol=0)
    np.testing.assert_allclose(ours["long_rope_rotary_inv_freq"], embedding.long_inv_freq.numpy(), rtol=1e-6)


@pytest.mark.parametrize("factor,beta_fast", [(4.0, 32), (16.0, 8)])
def test_yarn_tables_are_transformers_yarn(factor, beta_fast):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    config = LlamaConfig(hidden_size=2 * DIM, num_attention_heads=2, max_position_embeddings=MAX_POSITIONS,
                         rope_parameters={"rope_type": "yarn", "rope_theta": BASE, "factor": factor,
                                          "beta_fast": beta_fast, "original_max_position_embeddings": ORIGINAL})
    embedding = LlamaRotaryEmbedding(config)
    ours = rope.yarn_tables(MAX_POSITIONS, DIM, BASE, factor, ORIGINAL, beta_fast=beta_fast)
    assert ours["rotary_embedding_short_m_scale"] == pytest.approx(embedding.attention_scaling, rel=1e-12)
    np.testing.assert_allclose(ours["rotary_inv_freq"], embedding.inv_freq.numpy(), rtol=1e-6)
    cos, sin = hf_cos_sin(embedding, MAX_POSITIONS)
    got = pairs(ours["rotary_cos_sin"], MAX_POSITIONS)
    np.testing.assert_allclose(got[..., 0], cos, atol=2e-6, rtol=0)
    np.testing.assert_allclose(got[..., 1], sin, atol=2e-6, rtol=0)


@pytest.mark.parametrize("tokens", [ORIGINAL, ORIGINAL + 8])
def test_gpt_attention_caches_keys_rotated_as_phi3_rotates_them(tokens):
    """End to end: a long_rope context request of `tokens` tokens caches K rotated as Phi-3's attention rotates it
    (transformers' apply_rotary_pos_emb with Phi3RotaryEmbedding's cos/sin): the short factors up to the original
    positions, the long ones past them, the m-scale in both."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
    short, long_, config = phi3_longrope_config()
    qkv = np.random.default_rng(0).standard_normal((tokens, 3 * DIM)).astype(np.float32)
    cache = np.zeros((1, 2, 1, tokens, DIM), np.float32)
    cacheattn.gpt_attention(
        qkv=qkv, past_key_value=cache, sequence_length=np.array([tokens]), host_past_key_value_lengths=np.array([0]),
        host_max_attention_window_sizes=np.array([tokens], np.int32), host_sink_token_length=np.array([0], np.int32),
        context_lengths=np.array([tokens]), cache_indirection=np.zeros((1, 1, tokens), np.int32),
        host_request_types=np.array([0]), layer_idx=0, num_heads=1, num_kv_heads=1, hidden_size_per_head=DIM,
        q_scaling=1.0, rotary_embedding_dim=DIM, position_embedding_type=cacheattn.PositionEmbeddingType.long_rope,
        **rope.long_rope_tables(MAX_POSITIONS, ORIGINAL, DIM, BASE, short, long_))
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, 1, DIM), torch.arange(tokens)[None])
    key = torch.from_numpy(qkv[:, DIM:2 * DIM])[None, None]                      # (1, 1, tokens, DIM)
    _, want = apply_rotary_pos_emb(key, key, cos, sin)
    np.testing.assert_allclose(cache[0, 0, 0], want[0, 0].numpy(), atol=3e-5, rtol=0)
