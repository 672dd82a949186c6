"""Benchmark scripts: speculative."""
