"""Rotary positional embedding (RoPE) as TensorRT-LLM's gpt_attention applies it (trtllm-gpt-attention.md,
"Rotary Positional Embedding (RoPE)").

Only the first `rot_dim` elements of a head rotate; the rest pass through. Element pairs rotate by the angle
position * inv_freq[i] with inv_freq[i] = 1 / base^(2i / rot_dim):

    GPT-J     pairs (x[2i], x[2i+1])             -- interleaved
    GPT-NeoX  pairs (x[i], x[i + rot_dim/2])      -- two halves

Scaling: linear divides the position by the scale; dynamic (NTK) raises the base once the sequence is longer
than the model's maximum; llama3 frequencies are computed on the host (`llama3_inv_freq`) and handed to the
operator as `rotary_inv_freq`, which is then used as it is.
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


def rotate(x: np.ndarray, positions: np.ndarray, freq: np.ndarray, style: str) -> np.ndarray:
    """x (T, heads, Dh) rotated at positions (T,) with frequencies freq (rot_dim / 2,); same dtype as x.

    The angles are formed in x's dtype (float32 for the float16/float32 inputs the operator promotes,
    float64 for float64).
    """
    half = freq.shape[0]
    rot_dim = 2 * half
    angle = positions.astype(x.dtype)[:, None] * freq.astype(x.dtype)[None, :]   # (T, rot_dim/2)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]             # (T, 1, rot_dim/2)
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
