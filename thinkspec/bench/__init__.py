"""Benchmarks: `thinkspec bench` (one setting), `thinkspec sweep` (the relaxation grid), reports, and
the toy pair's measurement across difficulty levels (`python -m thinkspec.bench.difficulty`)."""
