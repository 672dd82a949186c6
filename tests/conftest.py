import os

import pytest
import torch
from triton_interpreter import SHARD_ENV, shard_items

# On CPU the tests' models are tiny: one thread runs them as fast as a pool, and a pool that shares
# a small machine's cores with other processes (the tests' own servers and tensor-parallel workers,
# or anything else running) stalls at every parallel region: a smoke sweep took 133 s with two
# threads beside one busy process, 14 s with one. Child processes inherit the setting.
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy BLAS, e.g. in Triton interpreter runs
        os.environ.setdefault(name, "1")
    torch.set_num_threads(1)


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
