"""vLLM's /tokenize and /detokenize: a prompt or chat messages -> token ids, and back."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from thinkspec.entrypoints.openai.protocol import ChatMessage, OpenAIError, _Strict
from thinkspec.entrypoints.openai.serving import OpenAIServing


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def tokenize_model(body: dict[str, Any]) -> type[_Strict]:
    """A body with `messages` is a chat one (as in vLLM), else a prompt one."""
    return TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest


def tokenize(serving: OpenAIServing, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    tokenizer = serving.tokenizer
    if tokenizer is None:
        raise OpenAIError("the server runs without a tokenizer", param="prompt", code="invalid_value")
    if isinstance(req, TokenizeChatRequest):
        tokens = serving.chat_prompt(req, add_generation_prompt=req.add_generation_prompt)["prompt_token_ids"]
    else:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    tokens = [int(t) for t in tokens]
    out: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": serving.engine.engine.max_model_len,
        "tokens": tokens,
    }
    if req.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return out


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict[str, Any]:
    serving.check_model(req.model)
    tokenizer = serving.tokenizer
    if tokenizer is None:
        raise OpenAIError("the server runs without a tokenizer", param="tokens", code="invalid_value")
    vocab = len(tokenizer)
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(
            f"tokens: {bad} is outside the tokenizer's vocabulary [0, {vocab})",
            param="tokens",
            code="invalid_value",
        )
    return {"prompt": tokenizer.decode(req.tokens)}
