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
from thinkspec.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from thinkspec.entrypoints.openai.metrics import ServerMetrics
from thinkspec.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_unsupported,
    engine_error,
    sampling_error,
)
from thinkspec.outputs import CompletionOutput, RequestOutput
from thinkspec.sampling_params import SamplingParams


@dataclass(slots=True)
class ServingConfig:
    served_model_name: str
    max_tokens_limit: int  # largest max_tokens a request may ask; also the default


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _usage(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(out: RequestOutput, index: int = 0) -> str:
    reason = out.outputs[index].finish_reason
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


class _TextStream:
    """Incremental text of cumulative outputs, holding back what a stop string may still cut off."""

    __slots__ = ("sent", "hold")

    def __init__(self, params: SamplingParams) -> None:
        self.sent = 0
        # A stop string found later is removed from the text, and it may start up to
        # len(stop) - 1 characters before the end of what exists now.
        stops = params.stop if not params.include_stop_str_in_output else []
        self.hold = max((len(s) for s in stops), default=1) - 1

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
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
        if model is not None and model != self.config.served_model_name:
            raise OpenAIError(
                f"The model `{model}` does not exist; this server serves `{self.config.served_model_name}`.",
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
            "relax_delta", "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs",
        ):  # fmt: skip
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        if isinstance(req, ChatCompletionRequest):
            kwargs["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        else:
            kwargs["logprobs"] = req.logprobs
            if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
                kwargs["prompt_logprobs"] = req.logprobs  # echo shows the prompt's logprobs too
        try:
            return SamplingParams(
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
        self.metrics.observe_finished(last)

    # ---- chat ---------------------------------------------------------------------------------

    def chat_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
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
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - template errors come from the request's content
            raise OpenAIError(
                f"the chat template failed: {e}", param="messages", code="invalid_value"
            ) from None
        # The template wrote the special tokens; encoding must not add more.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self.sampling_params(req, max_tokens, field)
        prompt = self.chat_prompt(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self._add(request_id, prompt, params, "messages")
        starts_thinking = self.reasoning is not None and self.reasoning.initial_phase(
            prompt["prompt_token_ids"]
        )
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return self._chat_stream(stream, created, params, starts_thinking, include_usage)
        out = await self._collect(stream)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": [self._chat_choice(out, c, params, starts_thinking) for c in out.outputs],
            "usage": _usage(out),
        }

    def _chat_choice(
        self, out: RequestOutput, c: CompletionOutput, params: SamplingParams, starts_thinking: bool
    ) -> dict[str, Any]:
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(c.text, starts_thinking)
        else:
            reasoning, content = None, c.text
        logprobs = None
        if c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, params.logprobs or 0)
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
            "logprobs": logprobs,
            "finish_reason": _finish_reason(out, c.index),
        }

    def _chat_stream(
        self,
        stream: RequestStream,
        created: int,
        params: SamplingParams,
        starts_thinking: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        model = self.config.served_model_name
        base = {
            "id": stream.request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        def chunk(
            delta: dict[str, Any], index: int, finish_reason: str | None = None, logprobs: Any = None
        ) -> str:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return _sse({**base, "choices": [choice]})

        n = params.n
        texts = [_TextStream(params) for _ in range(n)]
        splits = [
            self.reasoning.stream(starts_thinking) if self.reasoning is not None else None for _ in range(n)
        ]
        sent_lp = [0] * n

        def choice_events(c: CompletionOutput) -> list[str]:
            i, finished = c.index, c.finish_reason is not None
            piece, split = texts[i].delta(c.text, finished), splits[i]
            if split is None:
                reasoning, content = None, piece or None
            else:
                reasoning, content = split.feed(piece)
                if finished:
                    tail_r, tail_c = split.finish()
                    reasoning = (reasoning or "") + (tail_r or "") or None
                    content = (content or "") + (tail_c or "") or None
            deltas = [
                (key, value)
                for key, value in (("reasoning_content", reasoning), ("content", content))
                if value
            ]
            logprobs = None
            if c.logprobs is not None and len(c.logprobs) > sent_lp[i]:
                new = slice(sent_lp[i], len(c.logprobs))
                logprobs = chat_logprobs(c.token_ids[new], c.logprobs[new], params.logprobs or 0)
                sent_lp[i] = len(c.logprobs)
                deltas = deltas or [("content", "")]
            last = len(deltas) - 1
            return [
                chunk({k: v}, i, logprobs=logprobs if j == last else None) for j, (k, v) in enumerate(deltas)
            ]

        def events(out: RequestOutput) -> list[str]:
            return [e for c in out.outputs for e in choice_events(c)]

        def final(last: RequestOutput) -> str:
            return "".join(chunk({}, c.index, _finish_reason(last, c.index)) for c in last.outputs)

        first = "".join(chunk({"role": "assistant", "content": ""}, i) for i in range(n))
        return self._sse_stream(stream, events, final, base, include_usage, first=first)

    async def _sse_stream(
        self,
        stream: RequestStream,
        events: Callable[[RequestOutput], list[str]],
        final: Callable[[RequestOutput], str],
        base: dict[str, Any],
        include_usage: bool,
        first: str | None = None,
    ) -> AsyncIterator[str]:
        """Server-sent events of one request: first, events per output, final, usage, [DONE].

        An engine failure or request error becomes an error event; the request is released
        (aborted if unfinished) whatever happens, including a client that goes away.
        """
        last: RequestOutput | None = None
        try:
            if first is not None:
                yield first
            async for out in stream:
                last = out
                for event in events(out):
                    yield event
            assert last is not None
            yield final(last)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(last)})
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
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return self._completion_stream(stream, created, params, include_usage, req)
        out = await self._collect(stream)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": [self._completion_choice(out, c, req) for c in out.outputs],
            "usage": _usage(out),
        }

    def _completion_choice(
        self, out: RequestOutput, c: CompletionOutput, req: CompletionRequest
    ) -> dict[str, Any]:
        prompt_text = self._prompt_text(out) if req.echo else ""
        logprobs = None
        if c.logprobs is not None:
            num = req.logprobs or 0
            ids, entries = list(c.token_ids), list(c.logprobs)
            if req.echo and out.prompt_logprobs is not None:
                ids, entries = list(out.prompt_token_ids) + ids, list(out.prompt_logprobs) + entries
            logprobs = completion_logprobs(ids, entries, num, self.tokenizer)
        return {
            "index": c.index,
            "text": prompt_text + c.text,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(out, c.index),
        }

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def _completion_stream(
        self,
        stream: RequestStream,
        created: int,
        params: SamplingParams,
        include_usage: bool,
        req: CompletionRequest,
    ) -> AsyncIterator[str]:
        model = self.config.served_model_name
        base = {"id": stream.request_id, "object": "text_completion", "created": created, "model": model}

        def chunk(piece: str, index: int, finish_reason: str | None = None, logprobs: Any = None) -> str:
            choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}
            return _sse({**base, "choices": [choice]})

        n, num = params.n, req.logprobs or 0
        texts = [_TextStream(params) for _ in range(n)]
        sent_lp = [0] * n
        echoed = [not req.echo] * n

        def choice_events(out: RequestOutput, c: CompletionOutput) -> list[str]:
            i = c.index
            piece = texts[i].delta(c.text, c.finish_reason is not None)
            ids: list[int] = []
            entries: list[Any] = []
            if not echoed[i]:
                echoed[i] = True
                piece = self._prompt_text(out) + piece
                if c.logprobs is not None and out.prompt_logprobs is not None:
                    ids, entries = list(out.prompt_token_ids), list(out.prompt_logprobs)
            if c.logprobs is not None and len(c.logprobs) > sent_lp[i]:
                ids += c.token_ids[sent_lp[i] :]
                entries += c.logprobs[sent_lp[i] :]
                sent_lp[i] = len(c.logprobs)
            logprobs = completion_logprobs(ids, entries, num, self.tokenizer) if ids else None
            return [chunk(piece, i, logprobs=logprobs)] if piece or logprobs else []

        def events(out: RequestOutput) -> list[str]:
            return [e for c in out.outputs for e in choice_events(out, c)]

        def final(last: RequestOutput) -> str:
            return "".join(chunk("", c.index, _finish_reason(last, c.index)) for c in last.outputs)

        return self._sse_stream(stream, events, final, base, include_usage)
