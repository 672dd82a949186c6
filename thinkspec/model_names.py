"""The bundled model names ("toy-reasoner", "toy-reasoner-draft") and the one function that turns a
model argument into what the loader reads.

Stdlib only and imports nothing of thinkspec: `thinkspec.engine_args` (the CLI's help), `thinkspec.llm`
(the offline API and the server's engine) and the bench harness all resolve names here.
"""

from __future__ import annotations

import difflib
from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_TOY = "toy-reasoner"  # the CLI's model when none is given
TOY_MODELS = {
    "toy-reasoner": ASSETS_DIR / "toy-reasoner" / "target",
    "toy-reasoner-draft": ASSETS_DIR / "toy-reasoner" / "draft",
}


def resolve_model_name(name: str, field: str = "model") -> str:
    """A bundled name -> its checkpoint folder; a folder or hub id 'owner/name' unchanged.

    field names the argument in errors ("model", "tokenizer", "speculative_config.model").
    ValueError when a bundled checkpoint is not installed, and for a name that is neither a folder
    nor a hub id (it has no '/'): the error lists the bundled names and the nearest one.
    """
    folder = TOY_MODELS.get(name)
    if folder is not None:
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"{field}={name!r}: the bundled checkpoint is missing (no config.json in {folder})"
            )
        return str(folder)
    # Without a '/' the loader could not fetch it from the hub either: most likely a mistyped name.
    if "/" not in name and not Path(name).expanduser().exists():
        bundled = ", ".join(map(repr, TOY_MODELS))
        near = difflib.get_close_matches(name, TOY_MODELS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(
            f"{field}={name!r} is not a folder, a hub id 'owner/name' or a bundled model "
            f"(bundled: {bundled}){hint}"
        )
    return name


def toy_name(path: str) -> str:
    """The short name of a bundled toy checkpoint folder ("toy-reasoner", ...); any other path unchanged.

    What reports record instead of the folder's absolute path, which differs from machine to machine
    (resolve_model_name turns the name back into the folder)."""
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError):
        return path
    return next((name for name, folder in TOY_MODELS.items() if folder == resolved), path)
