"""docs/ARCHITECTURE.md names only modules, classes and functions that exist."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"


def resolve(dotted: str) -> object:
    """The object a dotted name means: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError names what is missing
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_named_thing_exists():
    names = sorted(set(re.findall(r"`(thinkspec(?:\.\w+)+)`", DOC.read_text())))
    assert len(names) > 30
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, "docs/ARCHITECTURE.md names what does not exist:\n" + "\n".join(missing)


def test_a_missing_name_is_reported():
    try:
        resolve("thinkspec.engine.scheduler.Scheduler.no_such_method")
    except AttributeError:
        return
    raise AssertionError("resolve accepted a name that does not exist")
