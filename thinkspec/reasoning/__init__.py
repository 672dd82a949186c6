"""Reasoning-model support: think markers, output splitting and the per-token phase."""

from thinkspec.reasoning.parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
    ResolvedReasoning,
    get_reasoning_parser,
)
from thinkspec.reasoning.tracker import PhaseTracker, initial_phase

__all__ = [
    "REASONING_PARSERS",
    "PhaseTracker",
    "ReasoningParser",
    "ReasoningStream",
    "ResolvedReasoning",
    "get_reasoning_parser",
    "initial_phase",
]
