"""The measuring room, apart from the operators in `cacheattn/`.

- `record()` (`recorder`): Nsight Compute-style memory counters and compute-sanitizer-style findings (races,
  uninitialized shared reads, out-of-bounds indices) of any numba.cuda kernel launch, counted in numba's CUDA
  simulator;
- `sanitize` and `counters`: `python -m cacheattn lab [--sanitize]` over every kernel family of the project;
- benchmarks (`bench`, `bench_cpu`, `bench_gpu`, `bench_host`) and the GPU session runner (`gpu_session`).
"""

from .recorder import METRICS, Hazard, Launch, Recording, record

__all__ = ["METRICS", "Hazard", "Launch", "Recording", "record"]
