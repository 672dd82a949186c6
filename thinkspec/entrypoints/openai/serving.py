"""Chat and text completions: request -> prompt + SamplingParams -> engine -> OpenAI-shaped response.

Non-streamed handlers return the response dict. Streamed handlers first queue the request (so a
prompt the engine refuses is still answered with a 400) and then return an async iterator of
server-sent-event strings ending with `data: [DONE]`. Closing that iterator early aborts the
request.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from thinkspec.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from thinkspec.entrypoints.openai.drain import Drain
from thinkspec.entrypoints.openai.metrics import ServerMetrics
from thinkspec.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_unsupported,
    engine_error,
    sampling_error,
)
from thinkspec.outputs import RequestOutput
from thinkspec.sampling_params import SamplingParams

REASONING_FIELDS = ("both", "reasoning", "reasoning_content")


@dataclass(slots=True)
class ServingConfig:
    served_model_name: str  # the name in responses
    max_tokens_limit: int  # largest max_tokens a request may ask; also the default
    other_model_names: tuple[str, ...] = ()  # also listed by /v1/models and accepted as `model`
    # The key(s) of reasoning text in messages and deltas: vLLM's newer `reasoning`, the older
    # `reasoning_content` that many clients still read, or both (the same text twice).
    reasoning_field: str = "both"

    def __post_init__(self) -> None:
        if self.reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"reasoning_field must be one of {REASONING_FIELDS}, got {self.reasoning_field!r}"
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.other_model_names)

    def reasoning_keys(self) -> tuple[str, ...]:
        if self.reasoning_field == "both":
            return ("reasoning", "reasoning_content")
        return (self.reasoning_field,)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _refuse_unserved(req: Any) -> None:
    """Fields the engine supports (LLM.generate) that these endpoints do not return yet: refused with
    a 400 rather than silently dropped."""
    unserved = {
        "n": req.n != 1,
        "logprobs": bool(getattr(req, "logprobs", None)),
        "echo": bool(getattr(req, "echo", False)),
        "prompt_logprobs": req.prompt_logprobs is not None,
    }
    for name, asked in unserved.items():
        if asked:
            raise OpenAIError(
                f"{name} is not supported by the server yet (it is by LLM.generate)", param=name,
                code="unsupported",
            )  # fmt: skip


def count_reasoning_tokens(token_ids: list[int], starts_thinking: bool, start_id: int, end_id: int) -> int:
    """Output tokens generated inside the thinking phase, the think markers themselves not counted
    (as vLLM counts them). The phase follows the last marker, as the engine's tracker does."""
    thinking, count = starts_thinking, 0
    for token in token_ids:
        if token == start_id:
            thinking = True
        elif token == end_id:
            thinking = False
        elif thinking:
            count += 1
    return count


def _finish_reason(out: RequestOutput) -> str:
    reason = out.outputs[0].finish_reason
    if reason == "error":
        status = out.error_status or 500
        code = "invalid_input" if status < 500 else "engine_error"
        raise OpenAIError(out.error or "the request failed in the engine", status=status, code=code)
    if reason == "abort":  # only the drain aborts a request whose client is still there
        raise OpenAIError(
            "the server is shutting down; the request was ended before it finished",
            status=503,
            code="server_shutting_down",
        )
    return reason or "stop"


def _usage_mode(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of a streamed request."""
    opts = req.stream_options
    if opts is None or not opts.include_usage:
        return False, False
    return True, opts.continuous_usage_stats


class _TextStream:
    """Incremental text of cumulative outputs, holding back what a stop string may still cut off."""

    __slots__ = ("sent", "hold")

    def __init__(self, params: SamplingParams) -> None:
        self.sent = 0
        # A stop string found later is removed from the text, and it may start up to
        # len(stop) - 1 characters before the end of what exists now.
        stops = params.stop if not params.include_stop_str_in_output else []
        self.hold = max((len(s) for s in stops), default=1) - 1

    def delta(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        end = len(text) if out.finished else max(self.sent, len(text) - self.hold)
        piece = text[self.sent : end]
        self.sent = end
        return piece


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        config: ServingConfig,
        metrics: ServerMetrics | None,
        drain: Drain | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.drain = drain or Drain()
        llm_engine = engine.engine
        self.tokenizer = llm_engine.tokenizer
        self.reasoning = llm_engine.reasoning  # ResolvedReasoning or None
        info = llm_engine.model_info
        # The checkpoint's generation_config defaults apply where a request leaves a field out (as vLLM).
        self.defaults = {k: getattr(info, k, None) for k in ("temperature", "top_p", "top_k")}

    # ---- shared -------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.model_names:
            served = ", ".join(f"`{name}`" for name in self.config.model_names)
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves {served}.",
                status=404,
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        max_tokens: int | None,
        max_tokens_field: str = "max_tokens",
    ) -> SamplingParams:
        """max_tokens_field: the request field max_tokens came from, named in errors."""
        check_unsupported(req)
        limit = self.config.max_tokens_limit
        if max_tokens is not None and max_tokens > limit:
            shown = str(max_tokens) if max_tokens < 10**20 else f"{str(max_tokens)[:20]}... (too large)"
            raise OpenAIError(
                f"{max_tokens_field} must be at most {limit}, got {shown}",
                param=max_tokens_field,
                code="invalid_value",
            )
        kwargs: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(req, name)
            value = self.defaults[name] if value is None else value
            if value is not None:
                kwargs[name] = value
        for name in (
            "min_p", "seed", "stop", "stop_token_ids", "relaxed_thinking", "relax_ratio", "relax_top_k",
            "relax_delta", "thinking_token_budget", "presence_penalty", "frequency_penalty",
            "repetition_penalty",
        ):  # fmt: skip
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        try:
            params = SamplingParams(
                n=req.n,
                max_tokens=limit if max_tokens is None else max_tokens,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                **kwargs,
            )
        except ValueError as e:
            error = sampling_error(e)
            if error.param == "max_tokens" and max_tokens_field != "max_tokens":
                error.param = max_tokens_field
                error.message = f"{max_tokens_field} (as max_tokens): {error.message}"
            raise error from None
        _refuse_unserved(req)  # after the value checks: a bad value is still named as such
        return params

    async def _add(self, request_id: str, prompt: Any, params: SamplingParams, param: str) -> RequestStream:
        if self.drain.closed:
            raise OpenAIError("the server is shutting down", status=503, code="server_shutting_down")
        try:
            stream = await self.engine.add_request(request_id, prompt, params)
            self.drain.active.add(request_id)
            return stream
        except asyncio.CancelledError:  # the client left while the request was being queued
            if self.metrics is not None:
                self.metrics.observe_aborted_early()
            raise
        except ValueError as e:
            raise engine_error(e, param) from None
        except EngineDeadError as e:
            raise OpenAIError(str(e), status=503, code="engine_dead") from None
        except RuntimeError as e:  # the engine thread is gone (shut down) while being asked
            raise OpenAIError(f"the engine is not running: {e}", status=503, code="engine_dead") from None

    async def _collect(self, stream: RequestStream) -> RequestOutput:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except EngineDeadError as e:
            raise OpenAIError(str(e), status=503, code="engine_dead") from None
        finally:
            self._done(stream, final)
        assert final is not None
        return final

    def _done(self, stream: RequestStream, last: RequestOutput | None) -> None:
        """After a stream ends, normally or not: abort if unfinished, and count the request (one
        that ends before its first output counts as an abort with no tokens)."""
        self.drain.active.discard(stream.request_id)
        if not stream.finished:
            self.engine.abort(stream.request_id)
        if self.metrics is None:
            return
        if last is None:
            if not stream.finished:
                self.metrics.observe_aborted_early()
            return
        if not last.finished:
            last.outputs[0].finish_reason = "abort"
        self.metrics.observe_finished(last, stream.token_gaps)

    # ---- chat ---------------------------------------------------------------------------------

    def chat_prompt(self, req: Any, add_generation_prompt: bool = True) -> dict[str, Any]:
        """The templated prompt of req.messages (with req.chat_template_kwargs): text and token ids."""
        tokenizer = self.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise OpenAIError("the model has no chat template; use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        kwargs = req.chat_template_kwargs or {}
        reserved = {
            "conversation",
            "tokenize",
            "add_generation_prompt",
            "return_dict",
            "chat_template",
            "tools",
        }
        if bad := sorted(reserved & set(kwargs)):
            raise OpenAIError(
                f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs", code="invalid_value"
            )
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - template errors come from the request's content
            raise OpenAIError(
                f"the chat template failed: {e}", param="messages", code="invalid_value"
            ) from None
        # The template wrote the special tokens; encoding must not add more.
        ids = tokenizer.encode(text, add_special_tokens=False)
        # The kwargs go along: enable_thinking decides where the reasoning split starts.
        return {"prompt": text, "prompt_token_ids": ids, "chat_template_kwargs": kwargs}

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self.sampling_params(req, max_tokens, field)
        prompt = self.chat_prompt(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self._add(request_id, prompt, params, "messages")
        starts_thinking = self.reasoning is not None and self.reasoning.starts_in_thinking(
            prompt["prompt_token_ids"], prompt["chat_template_kwargs"]
        )
        usage = self._chat_usage(starts_thinking)
        if req.stream:
            return self._chat_stream(stream, created, params, starts_thinking, _usage_mode(req), usage)
        out = await self._collect(stream)
        completion = out.outputs[0]
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(completion.text, starts_thinking)
        else:
            reasoning, content = None, completion.text
        message = {"role": "assistant", "content": content}
        message.update(dict.fromkeys(self.config.reasoning_keys(), reasoning))
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": _finish_reason(out),
                }
            ],
            "usage": usage(out),
        }

    def _chat_usage(self, starts_thinking: bool) -> Callable[[RequestOutput], dict[str, Any]]:
        """usage of a chat response, with completion_tokens_details.reasoning_tokens."""
        reasoning = self.reasoning

        def usage(out: RequestOutput) -> dict[str, Any]:
            n = 0
            if reasoning is not None:
                ids = out.outputs[0].token_ids
                start, end = reasoning.think_start_id, reasoning.think_end_id
                n = count_reasoning_tokens(ids, starts_thinking, start, end)
            return {**_usage(out), "completion_tokens_details": {"reasoning_tokens": n}}

        return usage

    def _chat_stream(
        self,
        stream: RequestStream,
        created: int,
        params: SamplingParams,
        starts_thinking: bool,
        usage_mode: tuple[bool, bool],
        usage: Callable[[RequestOutput], dict[str, Any]],
    ) -> AsyncIterator[str]:
        model = self.config.served_model_name
        base = {
            "id": stream.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        text = _TextStream(params)
        split = self.reasoning.stream(starts_thinking) if self.reasoning is not None else None
        reasoning_keys = self.config.reasoning_keys()

        def events(out: RequestOutput) -> list[dict[str, Any]]:
            piece = text.delta(out)
            if split is None:
                reasoning, content = None, piece or None
            else:
                reasoning, content = split.feed(piece)
                if out.finished:
                    tail_r, tail_c = split.finish()
                    reasoning = (reasoning or "") + (tail_r or "") or None
                    content = (content or "") + (tail_c or "") or None
            chunks = []
            if reasoning is not None:
                chunks.append(chunk(dict.fromkeys(reasoning_keys, reasoning)))
            if content is not None:
                chunks.append(chunk({"content": content}))
            return chunks

        return self._sse_stream(
            stream,
            events,
            lambda last: chunk({}, _finish_reason(last)),
            base,
            usage_mode,
            usage,
            first=chunk({"role": "assistant", "content": ""}),
        )

    async def _sse_stream(
        self,
        stream: RequestStream,
        events: Callable[[RequestOutput], list[dict[str, Any]]],
        final: Callable[[RequestOutput], dict[str, Any]],
        base: dict[str, Any],
        usage_mode: tuple[bool, bool],
        usage: Callable[[RequestOutput], dict[str, Any]] = _usage,
        first: dict[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events of one request: first, events per output, final, usage, [DONE].

        usage_mode: (include_usage, continuous_usage_stats); with both, every chunk carries the
        usage so far. An engine failure or request error becomes an error event; the request is
        released (aborted if unfinished) whatever happens, including a client that goes away.
        """
        include_usage, continuous = usage_mode
        last: RequestOutput | None = None

        def sse(event: dict[str, Any], out: RequestOutput | None) -> str:
            if continuous and out is not None:
                event = {**event, "usage": usage(out)}
            return _sse(event)

        try:
            if first is not None:
                yield _sse(first)
            async for out in stream:
                last = out
                for event in events(out):
                    yield sse(event, out)
            assert last is not None
            yield sse(final(last), last)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": usage(last)})
        except EngineDeadError as e:
            yield _sse(OpenAIError(str(e), status=503, code="engine_dead").to_dict())
        except OpenAIError as e:
            yield _sse(e.to_dict())
        finally:
            self._done(stream, last)
        yield SSE_DONE

    # ---- text completions ---------------------------------------------------------------------

    def completion_prompt(self, req: CompletionRequest) -> str | list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise OpenAIError(
                    f"a list of {len(prompt)} prompts is not supported: send one prompt per request",
                    param="prompt",
                    code="invalid_value",
                )
            return prompt[0]
        return prompt

    async def completion(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        params = self.sampling_params(req, req.max_tokens)
        prompt = self.completion_prompt(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self._add(request_id, prompt, params, "prompt")
        if req.stream:
            return self._completion_stream(stream, created, params, _usage_mode(req))
        out = await self._collect(stream)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "text": out.outputs[0].text,
                    "logprobs": None,
                    "finish_reason": _finish_reason(out),
                }
            ],
            "usage": _usage(out),
        }

    def _completion_stream(
        self, stream: RequestStream, created: int, params: SamplingParams, usage_mode: tuple[bool, bool]
    ) -> AsyncIterator[str]:
        model = self.config.served_model_name
        base = {"id": stream.request_id, "object": "text_completion", "created": created, "model": model}

        def chunk(piece: str, finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        text = _TextStream(params)

        def events(out: RequestOutput) -> list[dict[str, Any]]:
            piece = text.delta(out)
            return [chunk(piece)] if piece else []

        return self._sse_stream(
            stream, events, lambda last: chunk("", _finish_reason(last)), base, usage_mode
        )
