"""cacheattn: the attention operators that LLM servers run against a key/value cache, as their documents
define them. One function per operator; NumPy arrays in -> NumPy reference, GPU arrays in -> numba.cuda
kernels, the same array kind out. `backend="reference"` or `"numba"` forces one."""

from ._arrays import BFloat16Array, bfloat16
from .ft import AttentionWeight, CrossAttentionOutputs, DenseWeight, cross_attention
from .kernel_choice import AttentionShape, KernelPlan, choose_kernel
from .onnx import AttentionOutputs, onnx_attention
from .ppl import (
                  KeyValue,
                  MultiHeadCacheAttentionPlan,
                  dynamic_key_value_cache,
                  dynamic_multi_head_attention,
                  key_value_cache,
                  multi_head_cache_attention,
                  plan_multi_head_cache_attention,
)

__all__ = ["bfloat16", "BFloat16Array", "AttentionShape", "KernelPlan", "choose_kernel",
           "AttentionOutputs", "KeyValue", "dynamic_key_value_cache", "dynamic_multi_head_attention",
           "key_value_cache", "multi_head_cache_attention", "MultiHeadCacheAttentionPlan",
           "plan_multi_head_cache_attention", "onnx_attention",
           "AttentionWeight", "CrossAttentionOutputs", "DenseWeight", "cross_attention"]

from .trtllm import (  # noqa: E402
                     AttentionMaskType,
                     GptAttentionPlan,
                     PositionEmbeddingType,
                     QuantMode,
                     RequestType,
                     RotaryScalingType,
                     gpt_attention,
                     plan_gpt_attention,
)

__all__ += ["AttentionMaskType", "PositionEmbeddingType", "QuantMode", "RequestType", "RotaryScalingType",
            "gpt_attention", "GptAttentionPlan", "plan_gpt_attention"]
