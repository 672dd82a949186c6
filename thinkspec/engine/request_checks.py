"""Checks of one request's inputs against the engine: well-formed text, token ids the tokenizer knows.

Shared by LLMEngine.add_request (refusing a request up front) and the step-fault handler
(deciding whether a request's own input caused a failed step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thinkspec.sampling_params import SamplingParams


def token_vocab_size(tokenizer: Any | None, model_vocab_size: int) -> int:
    """Token ids a request may use: [0, this). The embedding is often padded past the tokenizer's
    last id (Qwen3: 151,669 tokens, 151,936 rows); the padding rows are untrained and never valid."""
    if tokenizer is None:
        return model_vocab_size
    return min(model_vocab_size, len(tokenizer))


def check_text(name: str, text: str) -> None:
    """ValueError unless `text` encodes as UTF-8 (no lone surrogates, which tokenizers refuse)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid unicode: {e.reason} at index {e.start}") from None


def check_prompt_input(prompt: Any) -> None:
    """The text parts of a prompt (a string or a dict's "prompt") are valid unicode."""
    if isinstance(prompt, str):
        check_text("the prompt", prompt)
    elif isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
        check_text("the prompt", prompt["prompt"])


def check_stop_token_ids(request_id: str, params: SamplingParams, vocab_size: int) -> None:
    bad = next((t for t in params.stop_token_ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"request {request_id!r}: stop_token_ids={bad} is outside the vocabulary [0, {vocab_size})"
        )


def input_problem(
    request_id: str, token_ids: list[int], params: SamplingParams, vocab_size: int
) -> str | None:
    """Why this request's input cannot run (a message), or None when its input is fine."""
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"request {request_id!r}: token id {bad} is outside the vocabulary [0, {vocab_size})"
    try:
        check_stop_token_ids(request_id, params, vocab_size)
    except ValueError as e:
        return str(e)
    return None
