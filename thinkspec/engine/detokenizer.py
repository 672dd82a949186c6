"""Incremental detokenization: the text each committed output token adds to its sequence.

The fast path is one `tokenizers.decoders.DecodeStream` per sequence, primed with the last few
prompt tokens: each token costs one call into the Rust tokenizer, which decodes only the few
tokens since its last emitted text. The fallback decodes a small window twice per token
(`detokenize_incrementally`) and is used where the stream would not give `tokenizer.decode`'s text:

- the tokenizer has no Rust backend (a slow, Python tokenizer);
- it cleans up spaces after decoding (`clean_up_tokenization_spaces`): transformers does that in
  Python, after the backend's decode, so the stream would return the text before the clean-up;
- the prompt ends inside a character: the stream would hand the prompt's dangling bytes to the
  output, where the fallback leaves them (as U+FFFD) with the prompt;
- the stream refuses a step ("Invalid prefix": the decoded window no longer extends what was
  emitted, a rare merge case); the sequence goes on with the fallback from where the stream stopped.

Either way the deltas join to the full decode of the output, and a token that ends inside a
character adds nothing until the character is complete.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from tokenizers.decoders import DecodeStream

# Tokens decoded before the first unread one, so merges and leading spaces come out right.
DETOKENIZE_CONTEXT = 5
INVALID_PREFIX = "Invalid prefix"  # how tokenizers' DecodeStream words a window it cannot extend


def initial_detokenize_offsets(num_prompt_tokens: int) -> tuple[int, int]:
    """(prefix_offset, read_offset) for a sequence whose output starts after the prompt."""
    return max(num_prompt_tokens - DETOKENIZE_CONTEXT, 0), num_prompt_tokens


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
    backend directly (the Python wrapper costs several times the decode itself; docs/BENCHMARKS.md,
    "Figures behind code choices")."""
    backend = stream_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def stream_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer a DecodeStream may decode with, or None where its text would differ from
    tokenizer.decode (no backend, or a clean-up of spaces after the backend's decode)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    return backend


class IncrementalDetokenizer:
    """The output text of one sequence, one committed token at a time."""

    __slots__ = ("tokenizer", "skip_special_tokens", "backend", "stream", "prefix_offset", "read_offset")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The window the fallback would decode next; kept on the fast path too, so that a sequence
        # whose stream fails goes on exactly where the stream left off.
        self.prefix_offset, self.read_offset = initial_detokenize_offsets(len(prompt_token_ids))
        self.backend = stream_backend(tokenizer)
        self.stream: DecodeStream | None = None
        if self.backend is None:
            return
        context = prompt_token_ids[self.prefix_offset :]
        if self.backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            return  # the prompt ends inside a character
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token in context:  # as if the context had been generated; its text is the prompt's
            self.stream.step(self.backend, token)

    def step(self, token_ids: list[int]) -> str:
        """token_ids: the sequence's tokens, prompt included, the last one new -> the text it adds
        ("" while it ends inside a character)."""
        if self.stream is not None:
            try:
                text = self.stream.step(self.backend, token_ids[-1])
            except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
                if not str(e).startswith(INVALID_PREFIX):
                    raise
                self.stream = None  # the fallback takes over from the last emitted text
            else:
                if text:
                    self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
                return text or ""
        delta, self.prefix_offset, self.read_offset = detokenize_incrementally(
            self.tokenizer, token_ids, self.prefix_offset, self.read_offset, self.skip_special_tokens
        )
        return delta
