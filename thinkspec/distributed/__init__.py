"""Tensor parallelism: the rank layout and collectives (parallel_state), the per-step broadcast of
the packed inputs (step_channel) and the worker processes of ranks 1..N-1 (workers)."""
