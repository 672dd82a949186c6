import os

import pytest
import torch
from triton_interpreter import SHARD_ENV, shard_items


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
