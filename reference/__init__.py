"""NumPy references that mirror the source documents line by line; no numba or cupy here."""

from .ft_cross_attention import cross_attention
from .onnx_attention import onnx_attention
from .ppl_dynamic_key_value_cache import dynamic_key_value_cache
from .ppl_dynamic_multi_head_attention import dynamic_multi_head_attention
from .ppl_key_value_cache import key_value_cache
from .ppl_multi_head_cache_attention import multi_head_cache_attention

__all__ = [
    "dynamic_key_value_cache",
    "dynamic_multi_head_attention",
    "key_value_cache",
    "multi_head_cache_attention",
    "onnx_attention",
    "cross_attention",
]

from .trtllm_gpt_attention import combine_partials, gpt_attention, split_attention  # noqa: E402

__all__ += ["combine_partials", "gpt_attention", "split_attention"]
