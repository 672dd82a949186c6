"""Running Triton kernel tests on CPU: Triton reads TRITON_INTERPRET when a kernel is defined, so the
`test_interp_*` cases of a test file (marked `interp`) run in child pytest processes with the variable
set, each running its share of the cases, and a parent test asserts they all passed. In the parent each
`interp` case then reports the outcome its run in a child had (conftest.py), so it counts once, as run.
Import as `from triton_interpreter import ...` (tests/ is on sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERP_MARK = "triton_interp"
interp = getattr(pytest.mark, INTERP_MARK)  # runs here under TRITON_INTERPRET=1, else in a child
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
CHILD_TIMEOUT_S = 900  # one child may run a whole file's cases on its own (one core per xdist worker)

# In the parent: nodeid -> (outcome, report text) of each case a child ran in this process
_outcomes: dict[str, tuple[str, str]] = {}


def shard_items(config: pytest.Config, items: list[pytest.Item], shard: str) -> None:
    """In a child: keep every n-th selected case from the i-th, and write how many were selected."""
    i, n, path = shard.split("/", 2)
    with open(path, "w") as f:
        f.write(str(len(items)))
    keep = items[int(i) :: int(n)]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


def record_report(report: pytest.TestReport, shard: str) -> None:
    """In a child: append one phase's outcome of a case (a JSON line) for the parent to read."""
    if report.when != "call" and report.passed:
        return  # setup and teardown count only when they fail or skip
    text = report.longreprtext if report.failed else ""
    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2].removeprefix("Skipped: ")  # (path, line, reason)
    with open(shard.split("/", 2)[2] + ".outcomes", "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "outcome": report.outcome, "text": text}) + "\n")


def _read_outcomes(path: str) -> dict[str, tuple[str, str]]:
    """A child's outcome lines -> nodeid -> (outcome, text); a failed or skipped phase wins over a pass."""
    found: dict[str, tuple[str, str]] = {}
    if not os.path.exists(path):
        return found
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if found.get(row["nodeid"], ("passed",))[0] == "passed":
                found[row["nodeid"]] = (row["outcome"], row["text"])
    return found


def _num_shards() -> int:
    # the interpreter runs on one core and the parent waits meanwhile, so each core can run a child;
    # under pytest-xdist each worker has its share of the cores
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(cores // workers, 4))


def _run_children(args: list[str], n: int) -> list[tuple[int, str, int, dict[str, tuple[str, str]]]]:
    """Run `pytest ARGS` under TRITON_INTERPRET=1 split over n children; per child: (exit code, log,
    number of cases the selection had, nodeid -> (outcome, text) of the cases it ran). Every case's
    outcome is also kept for the parent's `interp` items (report_interpreted)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        procs, logs = [], []
        for i in range(n):
            env = dict(os.environ, TRITON_INTERPRET="1", **{SHARD_ENV: f"{i}/{n}/{tmp}/selected{i}"})
            logs.append(stack.enter_context(open(os.path.join(tmp, f"log{i}"), "w+")))
            procs.append(subprocess.Popen([*cmd, *args], env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=CHILD_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                p.kill()
        runs = []
        for i, (code, log) in enumerate(zip(codes, logs)):
            log.seek(0)
            selected = os.path.join(tmp, f"selected{i}")
            assert os.path.exists(selected), log.read()[-5000:]  # the child failed before selecting
            with open(selected) as f:
                count = int(f.read())
            outcomes = _read_outcomes(selected + ".outcomes")
            _outcomes.update(outcomes)
            runs.append((code, log.read(), count, outcomes))
    return runs


def run_interpreter_cases(test_file: str, select: str = "test_interp_") -> None:
    """Run test_file's cases matching the pytest -k expression `select` (default: every `test_interp_`
    case) under TRITON_INTERPRET=1, split over one child pytest per core; fail unless every selected
    case ran and passed."""
    n = _num_shards()
    runs = _run_children([test_file, "-k", select], n)
    total = runs[0][2]
    for i, (code, out, count, outcomes) in enumerate(runs):
        assert count == total > 0, ([run[2] for run in runs], out[-3000:])  # all selected the same cases
        share = len(range(i, total, n))
        if share == 0:  # more children than cases: this one had none to run
            assert code == pytest.ExitCode.NO_TESTS_COLLECTED and not outcomes, out[-3000:]
            continue
        assert code == 0, out[-5000:]
        summary = out.strip().splitlines()[-1]
        assert summary.startswith(f"{share} passed") and "skipped" not in summary, summary
        assert len(outcomes) == share and all(o == "passed" for o, _ in outcomes.values()), outcomes


def report_interpreted(item: pytest.Item) -> None:
    """In the parent, in place of an `interp` case's body: end as the case's run in a child ended. A
    case whose file's parent test did not run first in this process runs in a child of its own."""
    nodeid = item.nodeid
    if nodeid not in _outcomes:
        code, out, _, _ = _run_children([str(item.path) + nodeid[nodeid.index("::") :]], 1)[0]
        assert nodeid in _outcomes, f"no interpreter child ran {nodeid} (exit {code}):\n{out[-5000:]}"
    outcome, text = _outcomes[nodeid]
    if outcome == "skipped":
        pytest.skip(f"in the interpreter child: {text}")
    if outcome != "passed":
        pytest.fail(f"in the interpreter child:\n{text}", pytrace=False)
