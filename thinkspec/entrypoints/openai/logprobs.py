"""Engine logprobs ({token id: Logprob} per position) in the response shapes of the OpenAI API:
chat's `logprobs.content`, legacy completions' `logprobs`, and vLLM's raw `prompt_logprobs`.

JSON has no infinity, so a log-probability of -inf is sent as LOGPROB_FLOOR (as OpenAI and vLLM do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thinkspec.outputs import Logprob, PositionLogprobs

LOGPROB_FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    # `>=` is False for NaN too, so nothing that JSON cannot carry leaves here.
    return lp.logprob if lp.logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _text(token_id: int, lp: Logprob, tokenizer: Any | None = None) -> str:
    if lp.decoded_token is not None:
        return lp.decoded_token
    return _decode(token_id, tokenizer)


def _decode(token_id: int, tokenizer: Any | None) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"<{token_id}>"


def _top(entry: PositionLogprobs, num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely tokens of one position, by rank (the chosen one only if among them)."""
    return sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:num]


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[PositionLogprobs], num: int, tokenizer: Any | None = None
) -> dict[str, Any]:
    """One entry per token: {"content": [{"token", "logprob", "bytes", "top_logprobs": [num x
    {"token", "logprob", "bytes"}]}]}; top_logprobs are the `num` most likely tokens by rank."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        text = _text(token_id, chosen, tokenizer)
        top = []
        for t, lp in _top(entry, num):
            alt = _text(t, lp, tokenizer)
            top.append({"token": alt, "logprob": _value(lp), "bytes": list(alt.encode())})
        content.append(
            {"token": text, "logprob": _value(chosen), "bytes": list(text.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[PositionLogprobs | None],  # None: no logprob (the prompt's first token)
    num: int,
    tokenizer: Any | None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry each per token, as
    legacy completions return them. top_logprobs: {token text: logprob}, the chosen token first and
    then the `num` most likely (tokens that decode alike share a key); text_offset: where each
    token's text starts, counted from `text_offset`."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        if entry is None:
            text = _decode(token_id, tokenizer)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            chosen = entry[token_id]
            text = _text(token_id, chosen, tokenizer)
            out["token_logprobs"].append(_value(chosen))
            top = {text: _value(chosen)}
            for t, lp in _top(entry, num):
                top.setdefault(_text(t, lp, tokenizer), _value(lp))
            out["top_logprobs"].append(top)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def raw_prompt_logprobs(entries: Sequence[PositionLogprobs | None]) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {"logprob",
    "rank", "decoded_token"}}, the prompt's own token first."""
    return [
        None
        if entry is None
        else {
            t: {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]
