"""Running Triton kernel tests on CPU: Triton reads TRITON_INTERPRET when a kernel is defined, so the
`test_interp_*` cases of a test file run in child pytest processes with the variable set (one per
core, each running its share of the cases), and a parent test asserts they all passed. Import as
`from triton_interpreter import ...` (tests/ is on sys.path)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process of test_kernels_under_interpreter"
)
parent_only = pytest.mark.skipif(INTERPRETED, reason="this is the parent of the interpreter run")


def _patch_lang_once_per_launch() -> None:
    """Speed up the interpreter (about 2x on these kernels): on every call of a nested @triton.jit
    function it patches triton.language again (a scan of every member of the modules), although the
    launch running it has already patched those modules and undoes that when it ends. Here, inside a
    launch, a nested function whose language modules are patched already skips the repeat; launches
    and anything else go through Triton's own code. Nothing changes if Triton's internals differ."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return
    original = getattr(ti, "_patch_lang", None)
    executor = getattr(ti, "GridExecutor", None)
    if original is None or executor is None or not hasattr(ti, "_LangPatchScope"):
        return
    if getattr(original, "_once_per_launch", False):
        return
    launch = executor.__call__
    state = {"depth": 0, "patched": set()}  # launches running; ids of the modules they patched

    def run_launch(self, *args, **kwargs):
        state["depth"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if not state["depth"]:
                state["patched"].clear()

    def patch_lang(fn):
        needed = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if not state["depth"] or not needed <= state["patched"]:
            scope = original(fn)
            state["patched"] |= needed if state["depth"] else set()
            return scope
        return ti._LangPatchScope()  # Triton drops a nested call's scope: nothing to restore

    patch_lang._once_per_launch = True
    ti._patch_lang = patch_lang
    executor.__call__ = run_launch


if INTERPRETED:
    _patch_lang_once_per_launch()


SHARD_ENV = "THINKSPEC_INTERP_SHARD"  # "i/n/path": the child runs cases i, i + n, ... of its selection


def shard_items(config: pytest.Config, items: list[pytest.Item], shard: str) -> None:
    """In a child: keep every n-th selected case from the i-th, and write how many were selected."""
    i, n, path = shard.split("/", 2)
    with open(path, "w") as f:
        f.write(str(len(items)))
    keep = items[int(i) :: int(n)]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


def _num_shards() -> int:
    # the interpreter runs on one core; the parent waits meanwhile, so each core can run a child
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 4))


def run_interpreter_cases(test_file: str, select: str = "test_interp_") -> None:
    """Run test_file's cases matching the pytest -k expression `select` (default: every `test_interp_`
    case) under TRITON_INTERPRET=1, split over one child pytest per core; fail unless every selected
    case ran and passed."""
    n = _num_shards()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        procs, logs = [], []
        for i in range(n):
            env = dict(os.environ, TRITON_INTERPRET="1", **{SHARD_ENV: f"{i}/{n}/{tmp}/selected{i}"})
            logs.append(stack.enter_context(open(os.path.join(tmp, f"log{i}"), "w+")))
            child = [*cmd, test_file, "-k", select]
            procs.append(
                subprocess.Popen(child, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True)
            )
        try:
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            for p in procs:
                p.kill()
        counts = []
        for i, (code, log) in enumerate(zip(codes, logs)):
            log.seek(0)
            out = log.read()
            selected = os.path.join(tmp, f"selected{i}")
            assert os.path.exists(selected), out[-5000:]  # the child failed before selecting its cases
            with open(selected) as f:
                counts.append(int(f.read()))
            assert counts[i] == counts[0] > 0, (counts, out[-3000:])  # all selected the same cases
            share = len(range(i, counts[0], n))
            if share == 0:  # more children than cases: this one had none to run
                assert code == pytest.ExitCode.NO_TESTS_COLLECTED, out[-3000:]
                continue
            assert code == 0, out[-5000:]
            summary = out.strip().splitlines()[-1]
            assert summary.startswith(f"{share} passed") and "skipped" not in summary, summary
