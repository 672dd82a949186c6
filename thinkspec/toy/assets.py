"""Where the bundled toy reasoner pair lives, and the short names that point at it."""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_TOY = "toy-reasoner"  # the CLI's model when none is given
TOY_MODELS = {
    "toy-reasoner": ASSETS_DIR / "toy-reasoner" / "target",
    "toy-reasoner-draft": ASSETS_DIR / "toy-reasoner" / "draft",
}


def resolve_model_path(name_or_path: str) -> str:
    """Map "toy-reasoner" / "toy-reasoner-draft" to the bundled checkpoint folder; anything else unchanged.

    Raises ValueError when a toy name is asked for but its folder is not installed.
    """
    path = TOY_MODELS.get(name_or_path)
    if path is None:
        return name_or_path
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name_or_path!r}: the bundled checkpoint is missing (no config.json in {path})"
        )
    return str(path)


def toy_name(path: str) -> str:
    """The short name of a bundled toy checkpoint folder ("toy-reasoner", ...); any other path unchanged.

    What reports record instead of the folder's absolute path, which differs from machine to machine
    (the CLI resolves the name back with resolve_model_path)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):
        return path
    return next((name for name, folder in TOY_MODELS.items() if folder == resolved), path)


# The relaxed setting `thinkspec demo` shows: the one the toy quality gates were measured with
# (docs/BENCHMARKS.md).
DEMO_RELAX_RATIO = 0.1
DEMO_RELAX_TOP_K = 8
