"""Small shared helpers: the package logger, device resolution, incremental detokenization."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("thinkspec")

# Tokens decoded before the first unread one, so merges and leading spaces come out right.
_DETOKENIZE_CONTEXT = 5


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else is validated."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def detokenize_incrementally(
    tokenizer: Any,
    token_ids: list[int],
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool,
) -> tuple[str, int, int]:
    """Text added by token_ids[read_offset:], decoded with a little context before it.

    Returns (new_text, prefix_offset, read_offset). When the tail decodes to an incomplete
    character (U+FFFD) nothing is emitted and the offsets stay, so the bytes join the next token.
    """
    decode = _decoder(tokenizer)
    prefix_text = decode(token_ids[prefix_offset:read_offset], skip_special_tokens)
    full_text = decode(token_ids[prefix_offset:], skip_special_tokens)
    if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
        # The context decodes identically as a prefix except in rare merge cases; slicing by length
        # follows vLLM and keeps the concatenated deltas equal to the full decode in practice.
        return full_text[len(prefix_text) :], read_offset, len(token_ids)
    return "", prefix_offset, read_offset


@functools.lru_cache(maxsize=16)
def _decoder(tokenizer: Any) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens) for this tokenizer. A fast (Rust-backed) HF tokenizer that
    does no clean-up of spaces decodes exactly what its `tokenizers` backend decodes: call the
    backend directly (the Python wrapper costs several times the decode itself, twice per token per step;
    docs/BENCHMARKS.md, "Figures behind code choices")."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def initial_detokenize_offsets(num_prompt_tokens: int) -> tuple[int, int]:
    """(prefix_offset, read_offset) for a sequence whose output starts after the prompt."""
    return max(num_prompt_tokens - _DETOKENIZE_CONTEXT, 0), num_prompt_tokens
