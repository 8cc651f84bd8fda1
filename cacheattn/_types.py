"""Names the public signatures use for their array arguments (read by the API reference)."""

from __future__ import annotations

from typing import Any

#: An array of any kind an operator takes and returns: a NumPy array (runs the reference), a CuPy array or any
#: object with `__cuda_array_interface__` or DLPack on a CUDA device (runs the kernels), or a torch tensor (CPU:
#: the reference, CUDA: the kernels). Results come back as the kind that came in.
Tensor = Any

#: An integer index tensor (`seqstarts`, `kvstarts`, `cachestarts`, `start_pos`, lengths): any integer dtype,
#: read on the host for validation (int64 device arrays reach the kernels without a copy).
IndexTensor = Any
