"""The relaxed setting `thinkspec demo` shows for the bundled toy reasoner pair (its names and folders
live in `thinkspec.model_names`)."""

from __future__ import annotations

# The one the toy quality gates were measured with (docs/BENCHMARKS.md, "Toy pair and relaxation sweep").
DEMO_RELAX_RATIO = 0.1
DEMO_RELAX_TOP_K = 8
