"""Benchmarks: `thinkspec bench` (one setting), `thinkspec sweep` (the relaxation grid), reports."""
