"""Benchmarks: kernel timings (``kernels``) and end-to-end runs."""
