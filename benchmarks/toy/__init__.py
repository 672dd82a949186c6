"""Benchmark scripts: toy."""
