"""Running Triton kernel tests on CPU: Triton reads TRITON_INTERPRET when a kernel is defined, so the
`test_interp_*` cases of a test file run in a child pytest with the variable set, and a parent test
asserts they all passed. Import as `from triton_interpreter import ...` (tests/ is on sys.path)."""

from __future__ import annotations

import os
import subprocess
import sys

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


def run_interpreter_cases(test_file: str, select: str = "test_interp_") -> None:
    """Run test_file's cases matching the pytest -k expression `select` (default: every `test_interp_`
    case) under TRITON_INTERPRET=1; fail unless all of them pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning",
         test_file, "-k", select],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
