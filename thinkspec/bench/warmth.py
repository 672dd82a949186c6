"""Is an engine warm? Counts of what a timed run must never do: capture a CUDA graph or compile a
Triton kernel. A timed run that changes them paid for a build inside its time.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from thinkspec.engine.compiles import compile_count, recent_compiles

# The modules whose Triton kernels the engine launches.
KERNEL_MODULES = (
    "thinkspec.layers.attention_triton",
    "thinkspec.layers.fused_triton",
    "thinkspec.layers.gemv_triton",
    "thinkspec.layers.gemm_skinny_triton",
    "thinkspec.sampling.rejection_triton",
)


def _runners(llm: Any) -> list[Any]:
    """The engine's model runners: the target's, and the draft model's when it has one."""
    engine = llm.llm_engine
    runners = [engine.model_runner]
    proposer_runner = getattr(getattr(engine.speculator, "proposer", None), "runner", None)
    if proposer_runner is not None:
        runners.append(proposer_runner)
    return runners


def build_counts(llm: Any) -> dict[str, int]:
    """{"graphs": CUDA graphs captured by the engine's runners, "kernels": Triton kernels compiled in
    this process so far}."""
    graphs = sum(len(r.graphs.graphs) for r in _runners(llm) if getattr(r, "graphs", None) is not None)
    return {"graphs": graphs, "kernels": compiled_kernels()}


def capture_graphs(llm: Any, max_batch: int) -> int:
    """Capture every CUDA graph the runners may replay for up to max_batch sequences, at every query
    width. A batch that ends unevenly (rows finishing after different numbers of rounds, as
    speculation makes them) passes through buckets at random, so warming at the full batch alone
    leaves some uncaptured. With adaptive_k the cost model is measured at those buckets too.
    Returns the number of graphs captured (0 without CUDA graphs)."""
    before = build_counts(llm)["graphs"]
    for runner in _runners(llm):
        cache = getattr(runner, "graphs", None)
        if cache is None:
            continue
        spec = cache.spec
        top = next((b for b in spec.batch_sizes if b >= max_batch), spec.batch_sizes[-1])
        for q in spec.query_widths:
            for b in (b for b in spec.batch_sizes if b <= top):
                cache.ensure_captured((b, q))
    speculator = llm.llm_engine.speculator
    if speculator is not None:  # adaptive_k times graph replays per bucket the first time it sees one
        speculator.planner.measure_costs(max_batch)
    return build_counts(llm)["graphs"] - before


def compiled_kernels() -> int:
    """Triton compilations counted by the post-compile hook (installed on first call, so only
    differences between calls mean anything); without the hook, the compiled variants held by the
    JIT caches of the kernel modules that are loaded."""
    count = compile_count()
    if count is not None:
        return count
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
        built = recent_compiles(grew.get("kernels", 0))
        raise RuntimeError(
            f"{what} built during its timed run ({', '.join(f'{n} new {k}' for k, n in grew.items())}): "
            "the warm-up did not cover its shapes, so its time includes the build"
            + "".join(f"; built {b}" for b in built)
        )


@contextmanager
def quiet_heap() -> Iterator[dict[str, float]]:
    """Around one timed run: freeze what is alive before it (engines, earlier cells' results), so the
    collector's full passes do not walk the harness's own heap inside the run. Collection stays on:
    the engine's own garbage is part of what is timed. Yields a dict that on exit holds the run's
    gc_pause_s (collector pauses), process_cpu_s (all threads) and thread_cpu_s (this thread)."""
    gc.freeze()  # also empties the young generations, so no collection is due as the run starts
    stats = {"gc_pause_s": 0.0}
    started: list[float] = []

    def clock(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            stats["gc_pause_s"] += time.perf_counter() - started.pop()

    gc.callbacks.append(clock)
    cpu0, thread0 = time.process_time(), time.thread_time()
    try:
        yield stats
    finally:
        stats["process_cpu_s"] = time.process_time() - cpu0
        stats["thread_cpu_s"] = time.thread_time() - thread0
        gc.callbacks.remove(clock)
        gc.unfreeze()
