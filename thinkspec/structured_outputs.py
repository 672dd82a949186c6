"""StructuredOutputsParams: the grammar a request's output must follow, in vLLM's shape (its
`structured_outputs`). Checked here; compiled and applied by thinkspec.sampling.structured."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one of the constraints. json: a JSON schema (dict or its
    JSON text); json_object: any JSON object; regex; choice: one of these strings; grammar: EBNF
    (xgrammar's dialect of GBNF)."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}, got {given}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): the cache key."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            return kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(value)
        return kind, "" if kind == "json_object" else value
