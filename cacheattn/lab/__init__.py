"""Measuring the kernels without a GPU: counters, sanitizers, machine code and bounds (issue 16)."""
