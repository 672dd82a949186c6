"""The question and JSON schema that the structured-output tests (engine and server) constrain the toy
reasoner with. Import as `from structured_cases import QUESTION, SCHEMA` (tests/ is on sys.path)."""

from __future__ import annotations

QUESTION = "Max has 608 books. He gets 350 more. How many books does Max have now?"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"type": "string", "enum": ["books", "apples"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
