"""Chat and text completions: request -> prompt + SamplingParams -> engine -> OpenAI-shaped response.

Non-streamed handlers return the response dict. Streamed handlers first queue the request (so a
prompt the engine refuses is still answered with a 400) and then return an async iterator of
server-sent-event strings ending with `data: [DONE]`. Closing that iterator early aborts the
request.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from thinkspec.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from thinkspec.entrypoints.openai.drain import Drain
from thinkspec.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs, raw_prompt_logprobs
from thinkspec.entrypoints.openai.metrics import ServerMetrics
from thinkspec.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    check_unsupported,
    engine_error,
    logit_bias_ids,
    sampling_error,
    structured_params,
)
from thinkspec.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from thinkspec.reasoning.parsers import ReasoningStream
from thinkspec.sampling.structured import XGRAMMAR_MISSING, grammar_cache
from thinkspec.sampling_params import SamplingParams

REASONING_FIELDS = ("both", "reasoning", "reasoning_content")

# Templating, tokenizing and encoding large bodies run here, off the event loop. One thread: each
# extra Python-busy thread makes the engine's thread (which gives up the GIL at every tensor op)
# wait longer to get it back, slowing every stream; the Rust tokenizer itself releases the GIL.
_TOKENIZE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="thinkspec-tokenize")
_T = TypeVar("_T")


async def off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) on the tokenizing thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, functools.partial(fn, *args))


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
    """Prompt tokens once, completion tokens summed over the n choices."""
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


def _finish_reason(out: RequestOutput, choice: CompletionOutput) -> str:
    """The finish_reason of one finished choice; a failed or drained request raises its error."""
    reason = choice.finish_reason
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

    def delta(self, text: str, finished: bool) -> str:
        """The new part of one choice's cumulative text."""
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        piece = text[self.sent : end]
        self.sent = end
        return piece


class _ChoiceStream:
    """What has been sent of one choice of a streamed response."""

    __slots__ = ("text", "split", "num_tokens", "text_offset", "echoed", "done")

    def __init__(self, params: SamplingParams, split: ReasoningStream | None = None) -> None:
        self.text = _TextStream(params)
        self.split = split  # the reasoning split of a chat choice, when the server has a parser
        self.num_tokens = 0  # output tokens whose logprobs went out
        self.text_offset = 0  # completions: where the next logprobs token's text starts
        self.echoed = False  # completions: the prompt went out (echo)
        self.done = False  # the finish chunk went out

    def split_delta(self, c: CompletionOutput) -> tuple[str | None, str | None]:
        """(reasoning, content) text new in chat choice c since the last call; each None when empty."""
        piece = self.text.delta(c.text, c.finished)
        split = self.split
        if split is None:
            return None, piece or None
        reasoning, content = split.feed(piece)
        if c.finished:
            tail_r, tail_c = split.finish()
            reasoning = (reasoning or "") + (tail_r or "") or None
            content = (content or "") + (tail_c or "") or None
        return reasoning, content

    def new_tokens(self, c: CompletionOutput) -> tuple[list[int], list[PositionLogprobs]]:
        """Output tokens since the last call, with their logprobs ([] when not asked)."""
        start, self.num_tokens = self.num_tokens, len(c.token_ids)
        return c.token_ids[start:], (c.logprobs or [])[start:]


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
        self.max_logprobs: int = llm_engine.config.max_logprobs

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
            "relax_delta", "relax_rule", "relax_lambda", "posterior_threshold", "posterior_alpha",
            "relax_protect", "thinking_token_budget", "presence_penalty", "frequency_penalty",
            "repetition_penalty",
        ):  # fmt: skip
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        kwargs.update(self.logprob_params(req))
        kwargs["logit_bias"] = logit_bias_ids(req)
        kwargs["structured_outputs"] = structured_params(req)[0]
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
        return params

    def logprob_params(self, req: ChatCompletionRequest | CompletionRequest) -> dict[str, int | None]:
        """SamplingParams' logprobs and prompt_logprobs for a request. Each count must be in [0,
        max_logprobs] (a 400 naming the request's own field); the rest follows vLLM: chat's
        top_logprobs > 0 needs logprobs, prompt_logprobs > 0 cannot stream, and completions' echo
        with logprobs scores the prompt too."""
        limit = self.max_logprobs
        for name in ("top_logprobs", "logprobs", "prompt_logprobs"):
            value = getattr(req, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= limit:
                raise OpenAIError(
                    f"{name} must be an integer in [0, {limit}] (the server's max_logprobs), got {value}",
                    param=name,
                    code="invalid_value",
                )
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs and not req.logprobs:
                raise OpenAIError(
                    "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value"
                )
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        prompt = req.prompt_logprobs
        if req.stream and prompt:
            raise OpenAIError(
                "prompt_logprobs are not returned when stream=true",
                param="prompt_logprobs",
                code="invalid_value",
            )
        if req.stream:
            prompt = None  # 0 is accepted (as vLLM) and there is nothing to return
        if isinstance(req, CompletionRequest) and req.echo and logprobs is not None and prompt is None:
            prompt = logprobs
        return {"logprobs": logprobs, "prompt_logprobs": prompt}

    async def compile_grammar(
        self, req: ChatCompletionRequest | CompletionRequest, params: SamplingParams
    ) -> None:
        """Compile the request's grammar, if any, on the tokenizer thread (the engine's cache then has
        it); a 400 naming the field that set it when it is bad, xgrammar is missing or the engine
        speculates (its verify rows are not constrained yet)."""
        so = params.structured_outputs
        if so is None:
            return
        field = structured_params(req)[1]
        engine = self.engine.engine
        if engine.speculator is not None:
            raise OpenAIError(
                f"{field}: structured outputs are not supported with speculative decoding yet; serve "
                "without --speculative-config for constrained requests",
                param=field,
                code="unsupported",
            )
        try:
            await off_loop(grammar_cache(engine).compile, so)
        except ValueError as e:
            code = "unsupported" if str(e) == XGRAMMAR_MISSING else "invalid_value"
            raise OpenAIError(f"{field}: {e}", param=field, code=code) from None

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
        for choice in last.outputs:
            if not choice.finished:
                choice.finish_reason = "abort"
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
        # The template tests the flag by Jinja truthiness and the reasoning split by Python's, which
        # differ for values such as [] or "": only a bool means the same to both.
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise OpenAIError(
                f"chat_template_kwargs.enable_thinking must be true or false, got "
                f"{json.dumps(kwargs['enable_thinking'])[:40]}",
                param="chat_template_kwargs.enable_thinking",
                code="invalid_value",
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
        await self.compile_grammar(req, params)
        # Templating and tokenizing a large body takes a while: off the event loop.
        prompt = await off_loop(self.chat_prompt, req)
        asked = params.max_tokens if max_tokens is not None else None
        self.check_length(len(prompt["prompt_token_ids"]), asked, field, "messages")
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
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": [self._chat_choice(out, c, params, starts_thinking) for c in out.outputs],
            "usage": usage(out),
        }
        if out.prompt_logprobs is not None:  # vLLM's extension, top level in chat
            response["prompt_logprobs"] = raw_prompt_logprobs(out.prompt_logprobs)
        return response

    def _chat_choice(
        self, out: RequestOutput, c: CompletionOutput, params: SamplingParams, starts_thinking: bool
    ) -> dict[str, Any]:
        """One choice of a non-streamed chat response; logprobs cover every output token, the
        reasoning ones included (as vLLM)."""
        finish_reason = _finish_reason(out, c)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(c.text, starts_thinking)
        else:
            reasoning, content = None, c.text
        message = {"role": "assistant", "content": content}
        message.update(dict.fromkeys(self.config.reasoning_keys(), reasoning))
        logprobs = None
        if params.logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, params.logprobs, self.tokenizer)
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chat_usage(self, starts_thinking: bool) -> Callable[[RequestOutput], dict[str, Any]]:
        """usage of a chat response (all choices), with completion_tokens_details.reasoning_tokens."""
        reasoning = self.reasoning

        def usage(out: RequestOutput) -> dict[str, Any]:
            n = 0
            if reasoning is not None:
                start, end = reasoning.think_start_id, reasoning.think_end_id
                n = sum(count_reasoning_tokens(c.token_ids, starts_thinking, start, end) for c in out.outputs)
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
        """Chunks of each choice (index i): its reasoning and content deltas, the logprobs of its new
        tokens (on the last chunk of the step, or on an empty delta when no text came out), then its
        finish chunk as soon as it finishes."""
        model = self.config.served_model_name
        kind = "chat.completion.chunk"
        base = {"id": stream.request_id, "object": kind, "created": created, "model": model}

        def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        reasoning, keys = self.reasoning, self.config.reasoning_keys()
        states = [
            _ChoiceStream(params, reasoning.stream(starts_thinking) if reasoning is not None else None)
            for _ in range(params.n)
        ]

        def choice_events(out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
            state = states[c.index]
            if state.done:
                return []
            r, content = state.split_delta(c)
            chunks = []
            if r is not None:
                chunks.append(chunk(c.index, dict.fromkeys(keys, r)))
            if content is not None:
                chunks.append(chunk(c.index, {"content": content}))
            ids, entries = state.new_tokens(c)
            if params.logprobs is not None and entries:
                chunks = chunks or [chunk(c.index, {})]
                lp = chat_logprobs(ids, entries, params.logprobs, self.tokenizer)
                chunks[-1]["choices"][0]["logprobs"] = lp
            if c.finished:
                state.done = True
                chunks.append(chunk(c.index, {}, _finish_reason(out, c)))
            return chunks

        def events(out: RequestOutput) -> list[dict[str, Any]]:
            return [e for c in out.outputs for e in choice_events(out, c)]

        first = [chunk(i, {"role": "assistant", "content": ""}) for i in range(params.n)]
        return self._sse_stream(stream, events, base, usage_mode, usage, first)

    async def _sse_stream(
        self,
        stream: RequestStream,
        events: Callable[[RequestOutput], list[dict[str, Any]]],
        base: dict[str, Any],
        usage_mode: tuple[bool, bool],
        usage: Callable[[RequestOutput], dict[str, Any]] = _usage,
        first: Sequence[dict[str, Any]] = (),
    ) -> AsyncIterator[str]:
        """Server-sent events of one request: first, the events of each output (each choice's
        finish chunk among them), usage, [DONE].

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
            for event in first:
                yield _sse(event)
            async for out in stream:
                last = out
                for event in events(out):
                    yield sse(event, out)
            assert last is not None
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

    async def completion_prompt(self, req: CompletionRequest) -> str | list[int] | dict[str, Any]:
        """The prompt for the engine: token ids as sent, or a text with its token ids (tokenized off
        the event loop, as the engine would: `tokenizer.encode(text)`); the text alone without a
        tokenizer (the engine then refuses it)."""
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise OpenAIError(
                    f"a list of {len(prompt)} prompts is not supported: send one prompt per request",
                    param="prompt",
                    code="invalid_value",
                )
            prompt = prompt[0]
        if not isinstance(prompt, str) or self.tokenizer is None:
            return prompt
        ids = await off_loop(self.tokenizer.encode, prompt)
        return {"prompt": prompt, "prompt_token_ids": list(ids)}

    def check_length(self, num_prompt: int, max_tokens: int | None, field: str, prompt_field: str) -> None:
        """A 400 naming both numbers when the prompt, or the prompt plus an explicit max_tokens
        (None: left out), exceeds max_model_len, as vLLM and OpenAI answer. A prompt too long is
        refused here, before the engine's thread would spend time on its token ids."""
        limit = self.engine.engine.max_model_len
        if num_prompt > limit:
            raise OpenAIError(
                f"the prompt has {num_prompt} tokens, more than the limit of {limit} (max_model_len)",
                param=prompt_field,
                code="invalid_prompt",
            )
        if not max_tokens or num_prompt + max_tokens <= limit:
            return
        raise OpenAIError(
            f"this model's maximum context length is {limit} tokens; the prompt has {num_prompt} tokens "
            f"and {field} asks for {max_tokens} more ({num_prompt + max_tokens} in all): lower {field} "
            f"to at most {limit - num_prompt} or shorten the prompt",
            param=field,
            code="context_length_exceeded",
        )

    async def completion(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        self.check_model(req.model)
        # vLLM: echo with max_tokens=0 returns the prompt alone (one token is generated and dropped).
        echo_only = req.echo and req.max_tokens == 0
        params = self.sampling_params(req, 1 if echo_only else req.max_tokens)
        await self.compile_grammar(req, params)
        prompt = await self.completion_prompt(req)
        if isinstance(prompt, dict | list):
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
            asked = params.max_tokens if req.max_tokens is not None else None
            self.check_length(len(ids), asked, "max_tokens", "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await self._add(request_id, prompt, params, "prompt")
        if req.stream:
            return self._completion_stream(stream, created, params, req.echo, echo_only, _usage_mode(req))
        out = await self._collect(stream)
        choices = []
        for c in out.outputs:
            finish_reason = _finish_reason(out, c)
            ids, entries, text = ([], [], "") if echo_only else (c.token_ids, c.logprobs or [], c.text)
            if req.echo:
                text, ids, entries = self._echo(out, text, ids, entries)
            logprobs = None
            if params.logprobs is not None:
                logprobs = completion_logprobs(ids, entries, params.logprobs, self.tokenizer)
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            if out.prompt_logprobs is not None:  # vLLM's extension, on each choice in completions
                choice["prompt_logprobs"] = raw_prompt_logprobs(out.prompt_logprobs)
            choices.append(choice)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": _usage(out),
        }

    def _echo(
        self, out: RequestOutput, text: str, ids: list[int], entries: list[PositionLogprobs]
    ) -> tuple[str, list[int], list[PositionLogprobs | None]]:
        """(text, token ids, logprobs) with the prompt's put in front: its text as sent (decoded
        when it came as token ids) and, when computed, its logprobs (the first token has none)."""
        prompt_ids = out.prompt_token_ids
        if out.prompt is not None:
            prompt_text = out.prompt
        else:
            prompt_text = self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else ""
        prompt_entries: list[PositionLogprobs | None] = [None] * len(prompt_ids)
        if out.prompt_logprobs is not None:
            # Complete in every output: the engine reports a request once a choice has a token, and
            # the first choice scores the whole prompt before its first token.
            assert len(out.prompt_logprobs) == len(prompt_ids), "prompt logprobs are incomplete"
            prompt_entries = list(out.prompt_logprobs)
        return prompt_text + text, [*prompt_ids, *ids], [*prompt_entries, *entries]

    def _completion_stream(
        self,
        stream: RequestStream,
        created: int,
        params: SamplingParams,
        echo: bool,
        echo_only: bool,
        usage_mode: tuple[bool, bool],
    ) -> AsyncIterator[str]:
        """Chunks of each choice (index i): its text delta with the logprobs of its new tokens
        (text_offset continuing across chunks), the prompt first with echo, then its finish chunk."""
        model = self.config.served_model_name
        base = {"id": stream.request_id, "object": "text_completion", "created": created, "model": model}

        def chunk(i: int, piece: str, logprobs: Any = None, finish_reason: str | None = None) -> dict:
            choice = {"index": i, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**base, "choices": [choice]}

        states = [_ChoiceStream(params) for _ in range(params.n)]

        def choice_events(out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
            state = states[c.index]
            if state.done:
                return []
            piece = state.text.delta(c.text, c.finished)
            ids, entries = state.new_tokens(c)
            if echo_only:
                piece, ids, entries = "", [], []
            if echo and not state.echoed:
                state.echoed = True
                piece, ids, entries = self._echo(out, piece, ids, entries)
            lp = None
            if params.logprobs is not None and ids:
                lp = completion_logprobs(ids, entries, params.logprobs, self.tokenizer, state.text_offset)
                state.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            chunks = [chunk(c.index, piece, lp)] if piece or lp else []
            if c.finished:
                state.done = True
                chunks.append(chunk(c.index, "", finish_reason=_finish_reason(out, c)))
            return chunks

        def events(out: RequestOutput) -> list[dict[str, Any]]:
            return [e for c in out.outputs for e in choice_events(out, c)]

        return self._sse_stream(stream, events, base, usage_mode)
