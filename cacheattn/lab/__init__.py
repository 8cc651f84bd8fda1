"""Measuring the kernels without a GPU, apart from the operators in `cacheattn/`.

- `record()` (`recorder`): Nsight Compute-style memory counters and compute-sanitizer-style findings (races,
  uninitialized shared reads, out-of-bounds indices) of any numba.cuda kernel launch, counted in numba's CUDA
  simulator; `sanitize` and `counters` run it over the project's kernels (`python -m cacheattn lab [--sanitize]`);
- `sass`: every rung's machine code (ptxas, nvdisasm), occupancy and key-loop instruction mix; `bounds`: the H100
  model that turns counted metrics into per-resource lower bounds;
- benchmarks (`bench`, `bench_cpu`, `bench_gpu`, `bench_host`) and the GPU session runner (`gpu_session`).
"""

from .recorder import METRICS, Hazard, Launch, Recording, record

__all__ = ["METRICS", "Hazard", "Launch", "Recording", "record"]
