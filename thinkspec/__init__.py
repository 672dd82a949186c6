"""thinkspec: speculative decoding for reasoning models with phase-aware relaxed acceptance."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names resolve lazily so `import thinkspec` stays cheap and server-free.
_EXPORTS = {
    "LLM": "thinkspec.llm",
    "SamplingParams": "thinkspec.sampling_params",
    "SpeculativeConfig": "thinkspec.config",
    "RequestOutput": "thinkspec.outputs",
    "CompletionOutput": "thinkspec.outputs",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'thinkspec' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
