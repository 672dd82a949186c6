"""Where tests run the repository's scripts (benchmarks/) in a subprocess: the repository root, with
this checkout's thinkspec first on the import path (a script runs from benchmarks/, so without it
the subprocess would import whichever thinkspec is installed)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
