"""numba.cuda kernels, one module per reference module; host launchers apart from the @cuda.jit bodies.

Launchers take validated inputs (the `cacheattn` API validates) and arrays numba can
launch on: CuPy / `__cuda_array_interface__` arrays on a GPU, or NumPy arrays under
the CUDA simulator (NUMBA_ENABLE_CUDASIM=1). This package never imports `reference`.
"""

from .ft_cross_attention import cross_attention
from .onnx_attention import onnx_attention
from .ppl_dynamic_key_value_cache import dynamic_key_value_cache
from .ppl_dynamic_multi_head_attention import dynamic_multi_head_attention
from .ppl_key_value_cache import key_value_cache
from .ppl_multi_head_cache_attention import multi_head_cache_attention
from .trtllm_gpt_attention import gpt_attention

__all__ = ["dynamic_key_value_cache", "dynamic_multi_head_attention", "key_value_cache",
           "multi_head_cache_attention", "onnx_attention", "cross_attention", "gpt_attention"]
