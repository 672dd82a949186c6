"""Benchmark scripts: engine."""
