"""The bundled toy reasoner pair: the demo's relaxed setting, and its names and folders.

The names and folders live in `thinkspec.model_names` (the engine resolves them there); they are
re-exported here for the demo and the benchmark scripts.
"""

from __future__ import annotations

from thinkspec.model_names import ASSETS_DIR, DEFAULT_TOY, TOY_MODELS, toy_name
from thinkspec.model_names import resolve_model_name as resolve_model_path

__all__ = [
    "ASSETS_DIR", "DEFAULT_TOY", "DEMO_RELAX_RATIO", "DEMO_RELAX_TOP_K", "TOY_MODELS", "resolve_model_path",
    "toy_name",
]  # fmt: skip

# The relaxed setting `thinkspec demo` shows: the one the toy quality gates were measured with
# (docs/BENCHMARKS.md).
DEMO_RELAX_RATIO = 0.1
DEMO_RELAX_TOP_K = 8
