"""Is an engine warm? Counts of what a timed run must never do: capture a CUDA graph or compile a
Triton kernel. A timed run that changes them paid for a build inside its time.
"""

from __future__ import annotations

import sys
from typing import Any

# The modules whose Triton kernels the engine launches.
KERNEL_MODULES = (
    "thinkspec.layers.attention_triton",
    "thinkspec.layers.fused_triton",
    "thinkspec.layers.gemv_triton",
    "thinkspec.sampling.rejection_triton",
)


def build_counts(llm: Any) -> dict[str, int]:
    """{"graphs": CUDA graphs captured by the engine's runners, "kernels": Triton kernels compiled in
    this process so far}."""
    engine = llm.llm_engine
    runners = [engine.model_runner]
    spec = engine.speculator
    proposer_runner = getattr(getattr(spec, "proposer", None), "runner", None)
    if proposer_runner is not None:
        runners.append(proposer_runner)
    graphs = sum(len(r.graphs.graphs) for r in runners if getattr(r, "graphs", None) is not None)
    return {"graphs": graphs, "kernels": compiled_kernels()}


def compiled_kernels() -> int:
    """Compiled variants held by the JIT caches of the kernel modules that are loaded (0 without
    Triton, or before any kernel ran)."""
    total = 0
    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            fn = getattr(value, "fn", value)  # autotuned kernels wrap the JIT function
            for binder in getattr(fn, "device_caches", {}).values():
                total += len(binder[0]) if isinstance(binder, tuple) and binder else 0
    return total


def check_no_builds(before: dict[str, int], after: dict[str, int], what: str) -> None:
    """RuntimeError when `what` (a timed run) captured or compiled anything."""
    grew = {k: after[k] - before[k] for k in before if after[k] != before[k]}
    if grew:
        raise RuntimeError(
            f"{what} built during its timed run ({', '.join(f'{n} new {k}' for k, n in grew.items())}): "
            "the warm-up did not cover its shapes, so its time includes the build"
        )
