"""Benchmark scripts by subject (kernels, engine, speculative, toy) and what they share (common.py)."""
