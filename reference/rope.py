"""Rotary positional embedding (RoPE) as TensorRT-LLM's gpt_attention applies it (trtllm-gpt-attention.md,
"Rotary Positional Embedding (RoPE)").

Only the first `rot_dim` elements of a head rotate; the rest pass through. Element pairs rotate by the angle
position * inv_freq[i] with inv_freq[i] = 1 / base^(2i / rot_dim):

    GPT-J     pairs (x[2i], x[2i+1])             -- interleaved
    GPT-NeoX  pairs (x[i], x[i + rot_dim/2])      -- two halves

Scaling: linear divides the position by the scale; dynamic (NTK) raises the base once the sequence is longer
than the model's maximum; llama3 frequencies are computed on the host (`llama3_inv_freq`) and handed to the
operator as `rotary_inv_freq`, which is then used as it is.

Cos/sin tables (`rotary_cos_sin`, TensorRT-LLM's `RopeEmbeddingUtils`): float32 `(1, num_pos * rot_dim)`, for
position p and pair i the cosine at `2 (p rot_dim/2 + i)` and the sine right after. The magnitude scale (m-scale)
of yarn and long_rope is baked into both. `cos_sin_table` builds one from frequencies; `plugin_tables`,
`long_rope_tables` and `yarn_tables` build frequencies and tables as RopeEmbeddingUtils'
`create_sinusoidal_positions_for_attention_plugin`, `..._long_rope_for_attention_plugin` and
`create_sinusoidal_positions_yarn` do (the yarn table in the layout the attention plugin reads: one cos/sin pair
per frequency, not duplicated).
"""

from __future__ import annotations

import math

import numpy as np

GPTJ, GPT_NEOX = "gptj", "gpt_neox"


def inv_freq(rot_dim: int, base: float, dtype=np.float32) -> np.ndarray:
    """(rot_dim / 2,) frequencies 1 / base^(2i / rot_dim)."""
    exponents = np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim
    return (1.0 / np.float64(base) ** exponents).astype(dtype)


def dynamic_ntk_base(base: float, rot_dim: int, scale: float, length: int, max_positions: int) -> float:
    """The base dynamic NTK scaling uses for a sequence of `length` tokens: unchanged up to max_positions,
    base * ((scale * length / max_positions) - (scale - 1))^(rot_dim / (rot_dim - 2)) beyond."""
    if length <= max_positions:
        return float(base)
    return float(base) * ((scale * length / max_positions) - (scale - 1)) ** (rot_dim / (rot_dim - 2))


def llama3_inv_freq(rot_dim: int, base: float, *, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> np.ndarray:
    """float32 (rot_dim / 2,) llama3 frequencies, computed on the host as HF transformers'
    `_compute_llama3_parameters` does, for the operator's `rotary_inv_freq`.

    Long wavelengths (beyond original_max / low_freq_factor) are slowed down by `factor`, short ones (below
    original_max / high_freq_factor) are kept, and the band between blends the two linearly in
    original_max / wavelength.
    """
    freq = inv_freq(rot_dim, base, np.float64)
    wavelen = 2 * math.pi / freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def coefficients(positions: np.ndarray, freq: np.ndarray, dtype, m_scale: float = 1.0):
    """(cos, sin), each (T, rot_dim / 2) in `dtype`: m_scale * cos(position * freq[i]), the angles formed in dtype."""
    angle = positions.astype(dtype)[:, None] * freq.astype(dtype)[None, :]      # (T, rot_dim/2)
    cos, sin = np.cos(angle), np.sin(angle)
    if m_scale != 1.0:
        cos, sin = cos * dtype.type(m_scale), sin * dtype.type(m_scale)
    return cos, sin


def table_coefficients(table: np.ndarray, positions: np.ndarray, rot_dim: int, dtype):
    """(cos, sin), each (T, rot_dim / 2) in `dtype`, read from a cos/sin table at integer positions (T,)."""
    pairs = np.asarray(table).reshape(-1, rot_dim // 2, 2)                      # (num_pos, rot_dim/2, [cos, sin])
    at = pairs[positions.astype(np.int64)]                                       # (T, rot_dim/2, 2)
    return at[..., 0].astype(dtype), at[..., 1].astype(dtype)


def rotate(x: np.ndarray, positions: np.ndarray, freq: np.ndarray, style: str) -> np.ndarray:
    """x (T, heads, Dh) rotated at positions (T,) with frequencies freq (rot_dim / 2,); same dtype as x.

    The angles are formed in x's dtype (float32 for the float16/float32 inputs the operator promotes,
    float64 for float64).
    """
    # spec: trtllm/rope
    return rotate_with(x, *coefficients(positions, freq, x.dtype), style)


def rotate_with(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x (T, heads, Dh) rotated by the coefficients cos, sin (T, rot_dim / 2) in x's dtype; dims past rot_dim pass."""
    half = cos.shape[1]
    rot_dim = 2 * half
    cos, sin = cos[:, None, :], sin[:, None, :]                                  # (T, 1, rot_dim/2)
    out = x.copy()
    if style == GPTJ:
        first, second = x[..., 0:rot_dim:2], x[..., 1:rot_dim:2]                # interleaved pairs
    else:
        first, second = x[..., :half], x[..., half:rot_dim]                     # halves
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    if style == GPTJ:
        out[..., 0:rot_dim:2], out[..., 1:rot_dim:2] = rotated_first, rotated_second
    else:
        out[..., :half], out[..., half:rot_dim] = rotated_first, rotated_second
    return out


# ---- Host helpers: frequencies and cos/sin tables as TensorRT-LLM's RopeEmbeddingUtils builds them --------------

def cos_sin_table(freq: np.ndarray, num_pos: int, m_scale: float = 1.0) -> np.ndarray:
    """float32 (1, num_pos * rot_dim) table of m_scale * (cos, sin)(p * freq[i]) for p < num_pos, pairs
    interleaved as the attention plugin reads them (angles and values in float32)."""
    angle = np.arange(num_pos, dtype=np.float32)[:, None] * np.asarray(freq, np.float32)[None, :]
    pairs = np.stack([np.cos(angle), np.sin(angle)], axis=-1)                   # (num_pos, rot_dim/2, 2)
    return (pairs * np.float32(m_scale)).astype(np.float32).reshape(1, -1)


def plugin_tables(num_pos: int, rot_dim: int, base: float = 10000.0, scale: float = 1.0, scale_type: int = 0,
                  llama3: dict | None = None):
    """(rotary_inv_freq float32 (rot_dim/2,), rotary_cos_sin float32 (1, num_pos * rot_dim)) as
    `create_sinusoidal_positions_for_attention_plugin`: linear scaling (scale_type 1) is baked into the
    frequencies (freq / scale), llama3 (scale_type 4) takes `llama3` = dict(factor=, low_freq_factor=,
    high_freq_factor=, original_max_position_embeddings=)."""
    if scale_type == 4:
        freq = llama3_inv_freq(rot_dim, base, **(llama3 or {}))
    else:
        freq = inv_freq(rot_dim, base) / np.float32(scale if scale_type == 1 else 1.0)
    return freq.astype(np.float32), cos_sin_table(freq, num_pos)


def long_rope_m_scale(num_pos: int, original_max_positions: int) -> float:
    """Phi-3's magnitude scale sqrt(1 + ln(s) / ln(original)), s = num_pos / original (1 when s <= 1)."""
    s = num_pos / original_max_positions
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original_max_positions))


def long_rope_tables(num_pos: int, original_max_positions: int, rot_dim: int, base: float, short_factors,
                     long_factors, m_scale: float | None = None) -> dict:
    """long_rope (Phi-3 LongRoPE) inputs of gpt_attention, as `create_sinusoidal_positions_long_rope_for_attention_
    plugin`: frequencies 1 / (factor_i base^(2i/rot_dim)) with the short or the long rescale factors, each table
    scaled by the m-scale (default `long_rope_m_scale(num_pos, original_max_positions)`).

    Returns the keyword arguments rotary_inv_freq, rotary_cos_sin, long_rope_rotary_inv_freq,
    long_rope_rotary_cos_sin, rotary_embedding_short_m_scale, rotary_embedding_long_m_scale and
    rotary_embedding_original_max_positions."""
    if m_scale is None:
        m_scale = long_rope_m_scale(num_pos, original_max_positions)
    powers = (np.float64(base) ** (np.arange(0, rot_dim, 2) / rot_dim)).astype(np.float32)

    def freq_of(factors):
        return (1.0 / (np.asarray(factors, np.float64) * powers)).astype(np.float32)

    short, long_ = freq_of(short_factors), freq_of(long_factors)
    return dict(rotary_inv_freq=short, rotary_cos_sin=cos_sin_table(short, num_pos, m_scale),
                long_rope_rotary_inv_freq=long_, long_rope_rotary_cos_sin=cos_sin_table(long_, num_pos, m_scale),
                rotary_embedding_short_m_scale=m_scale, rotary_embedding_long_m_scale=m_scale,
                rotary_embedding_original_max_positions=original_max_positions)


def yarn_m_scale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor 0.1 mscale ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(rot_dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float = 32,
                  beta_slow: float = 1) -> np.ndarray:
    """float32 (rot_dim/2,) YaRN frequencies: base frequencies (extrapolation) for the fast-turning dims,
    freq / factor (interpolation) for the slow ones, a linear ramp between the dims where a wavelength fits
    beta_fast and beta_slow turns into the original context."""
    def correction_dim(rotations):
        return rot_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rot_dim - 1)
    powers = np.float32(base) ** (np.arange(0, rot_dim, 2, dtype=np.float32) / np.float32(rot_dim))
    extrapolation, interpolation = 1.0 / powers, 1.0 / (np.float32(factor) * powers)
    ramp = np.clip((np.arange(rot_dim // 2, dtype=np.float32) - low) / np.float32(max(high - low, 0.001)), 0, 1)
    keep = 1 - ramp                                                             # 1: extrapolate, 0: interpolate
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def yarn_tables(num_pos: int, rot_dim: int, base: float, factor: float, original_max_positions: int,
                beta_fast: float = 32, beta_slow: float = 1, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> dict:
    """yarn inputs of gpt_attention, as `create_sinusoidal_positions_yarn` (mscale_all_dim 0 outside DeepSeek):
    `yarn_inv_freq` and its table scaled by yarn_m_scale(factor, mscale) / yarn_m_scale(factor, mscale_all_dim).

    Returns the keyword arguments rotary_inv_freq, rotary_cos_sin, rotary_embedding_short_m_scale and
    rotary_embedding_long_m_scale (the m-scale applied where cos/sin are recomputed from the frequencies)."""
    freq = yarn_inv_freq(rot_dim, base, factor, original_max_positions, beta_fast, beta_slow)
    m_scale = yarn_m_scale(factor, mscale) / yarn_m_scale(factor, mscale_all_dim)
    return dict(rotary_inv_freq=freq, rotary_cos_sin=cos_sin_table(freq, num_pos, m_scale),
                rotary_embedding_short_m_scale=m_scale, rotary_embedding_long_m_scale=m_scale)


def logn_scaling(seq_length: int, max_position_embeddings: int) -> np.ndarray:
    """float32 (max_position_embeddings,) Qwen's logn attention factors (`generate_logn_scaling`): entry k is
    log_{seq_length}(k + 1) once k + 1 > seq_length, else 1; gpt_attention multiplies Q by it at the position."""
    ratio = np.log(np.arange(1, max_position_embeddings + 1, dtype=np.float64)) / math.log(seq_length)
    return np.maximum(ratio, 1.0).astype(np.float32)
