"""The measuring room: benchmarks (`bench`, `bench_cpu`, `bench_gpu`, `bench_host`) and the GPU session runner
(`gpu_session`), apart from the operators in `cacheattn/`."""
