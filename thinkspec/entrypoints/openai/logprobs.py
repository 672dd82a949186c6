"""Engine logprobs ({token id: Logprob} per position) in OpenAI's shapes for chat and completions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thinkspec.outputs import Logprob, PositionLogprobs


def _text(token_id: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"<{token_id}>"


def _top(entry: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely alternatives of one position, by rank (the chosen token only if among them)."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:num]


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs], num: int) -> dict[str, Any]:
    """{"content": [{"token", "logprob", "bytes", "top_logprobs": [num x {"token", "logprob", "bytes"}]}]}"""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        text = _text(token_id, chosen)
        top = [
            {"token": _text(t, lp), "logprob": lp.logprob, "bytes": list(_text(t, lp).encode())}
            for t, lp in _top(entry, num)
        ]
        content.append(
            {"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[PositionLogprobs | None],  # None: no logprob (the prompt's first token)
    num: int,
    tokenizer: Any,
    text_offset: int = 0,
) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs" ({token: logprob}, the chosen one included),
    "text_offset"}, as OpenAI's legacy completions return them."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            text = tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            chosen = entry[token_id]
            text = _text(token_id, chosen)
            out["token_logprobs"].append(chosen.logprob)
            top = {_text(t, lp): lp.logprob for t, lp in _top(entry, num)}
            top.setdefault(text, chosen.logprob)
            out["top_logprobs"].append(top)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out
