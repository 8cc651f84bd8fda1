"""Names the public signatures use for their array arguments (read by the API reference)."""

from __future__ import annotations

from typing import Any, NamedTuple

#: An array of any kind an operator takes and returns: a NumPy array (runs the reference), a CuPy array or any
#: object with `__cuda_array_interface__` or DLPack on a CUDA device (runs the kernels), or a torch tensor (CPU:
#: the reference, CUDA: the kernels). Results come back as the kind that came in.
Tensor = Any

#: An integer index tensor (`seqstarts`, `kvstarts`, `cachestarts`, `start_pos`, lengths): any integer dtype,
#: read on the host for validation (int64 device arrays reach the kernels without a copy).
IndexTensor = Any


# FasterTransformer's weight structs live here, below both the operator (`ft`) and the example builders
# (`examples`), so neither imports the other.
class DenseWeight(NamedTuple):
    """FasterTransformer's DenseWeight: one projection.

    Attributes
    ----------
    kernel : Tensor
        `[in, out]`: the input times `kernel` is the projection.
    bias : Tensor or None
        `[out]`, or None (no bias).
    """
    kernel: Tensor
    bias: Tensor | None = None


class AttentionWeight(NamedTuple):
    """FasterTransformer's AttentionWeight: the members cross attention reads, in the dtype of the input.

    Attributes
    ----------
    query_weight : DenseWeight
        `[d_model, head_num * size_per_head]`, bias `[head_num * size_per_head]` (added in the kernel).
    key_weight : DenseWeight
        `[mem_d_model, head_num * size_per_head]`; its bias is added to the cache at step 1.
    value_weight : DenseWeight
        `[mem_d_model, head_num * size_per_head]`, likewise.
    attention_output_weight : DenseWeight
        `[head_num * size_per_head, d_model]`; its bias is the caller's to add (FasterTransformer adds it
        outside the layer), so it is not read.
    ia3_key_weight : DenseWeight or None
        IA3 key scaling: `kernel` `[num_tasks, head_num * size_per_head]` (bias unused), or None.
    ia3_value_weight : DenseWeight or None
        IA3 value scaling, likewise.
    """
    query_weight: DenseWeight
    key_weight: DenseWeight
    value_weight: DenseWeight
    attention_output_weight: DenseWeight
    ia3_key_weight: DenseWeight | None = None
    ia3_value_weight: DenseWeight | None = None
