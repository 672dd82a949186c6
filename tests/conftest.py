import collections
import os

import pytest
import torch
from triton_interpreter import (
    INTERP_MARK,
    INTERPRETED,
    SHARD_ENV,
    record_report,
    report_interpreted,
    shard_items,
)

# On CPU the tests' models are tiny: one thread runs them as fast as a pool, and a pool that shares
# a small machine's cores with other processes (the tests' own servers and tensor-parallel workers,
# or anything else running) stalls at every parallel region: a smoke sweep took 133 s with two
# threads beside one busy process, 14 s with one. Child processes inherit the setting.
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy BLAS, e.g. in Triton interpreter runs
        os.environ.setdefault(name, "1")
    torch.set_num_threads(1)

# Triton 3.9 warns once per process when a kernel is built with FP fusion left to its default (the
# sm_90 builds of test_kernels_compile); 1 keeps the default those builds and the GPU runs have.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def pytest_configure(config):
    """With pytest-xdist's -n and no --dist, each file stays on one worker (--dist loadfile): its module
    fixtures start once, and its interpreter cases take their outcomes from its parent test's children
    (tests/triton_interpreter.py). Set here, not in addopts: pytest without xdist (the GPU machine's)
    would refuse the option."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"


@pytest.hookimpl(trylast=True)  # after -k has deselected, so that a shard splits the selection
def pytest_collection_modifyitems(config, items):
    if os.environ.get(SHARD_ENV):
        shard_items(config, items, os.environ[SHARD_ENV])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    if os.environ.get(SHARD_ENV):
        record_report(report, os.environ[SHARD_ENV])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """In the parent, an `interp` case ends as its run in an interpreter child ended (its file's
    parent test ran the children first: pytest-xdist keeps a file on one worker, --dist loadfile)."""
    if INTERPRETED or not pyfuncitem.get_closest_marker(INTERP_MARK):
        return None
    report_interpreted(pyfuncitem)
    return True


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count, in place of -rs's line per test location."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count} skipped: {reason}")
