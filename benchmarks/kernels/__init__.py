"""Benchmark scripts: kernels."""
