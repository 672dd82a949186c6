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
