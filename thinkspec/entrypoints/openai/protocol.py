"""Request bodies of the OpenAI-compatible API (pydantic) and the OpenAI error object.

Declared fields are validated strictly: wrong JSON types are errors (no "1" -> 1 coercion) and a
bad value gets a 400 naming the field. As in vLLM, fields outside the declared set are accepted
and ignored, with a warning logged the first time each name is seen, so clients that send extra
fields keep working. An explicit null means "unset": the field takes its default. Declared beyond
OpenAI's fields: the vLLM-style sampling extras and the per-request relaxation overrides.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from thinkspec.sampling_params import SamplingParams
from thinkspec.structured_outputs import StructuredOutputsParams
from thinkspec.utils import logger

# OpenAI's documented range; SamplingParams itself only needs >= 0.
MAX_TEMPERATURE = 2.0


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """Strict values for declared fields; unknown fields kept aside (model_extra) and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # A null for an optional (or unknown) field is dropped, so the default applies; a null for
        # a required field stays and fails its type check.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage on every chunk (with include_usage), as vLLM


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Accepted on assistant turns sent back (either name), not sent to the template.
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # sent back by clients that dump the previous response; ignored

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _CommonRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None  # None = the served model
    max_tokens: int | None = None
    temperature: float | None = None  # None = the checkpoint's generation_config default
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None  # accepted and ignored
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key) -> bias in [-100, 100]
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # per-request relaxation overrides (None = the engine's SpeculativeConfig)
    relaxed_thinking: bool | None = None
    relax_ratio: float | None = None
    relax_top_k: int | None = None
    relax_delta: float | None = None
    relax_rule: str | None = None  # "topk_ratio", "lenient" or "typical"
    relax_lambda: float | None = None
    posterior_threshold: float | None = None
    posterior_alpha: float | None = None
    relax_protect: list[int | str] | None = None  # token ids, "digits", "operators", "re:<regex>"
    thinking_token_budget: int | None = None  # vLLM's field: at most this many tokens inside <think>
    # Structured outputs (at most one of these; see structured_params)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # > 0 needs logprobs=true (0 without it is accepted, as vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    # Sent routinely by OpenAI clients; accepted and ignored (nothing is stored, there are no tools).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False  # the prompt is prepended to the text (and to the logprobs when asked)
    best_of: int | None = None  # only None/1 is supported


_SAMPLING_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_PARAM_RE = re.compile(r"^(?:SamplingParams\.)?(\w+)")
_FIELD_PART = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(body: bytes) -> dict[str, Any]:
    """bytes -> the JSON object; OpenAIError 400 for invalid JSON (NaN/Infinity included) or a non-object."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # nested past the interpreter's limit; shallower nesting is check_body's
        raise OpenAIError("the request body is nested too deeply", code="too_deep") from None
    if not isinstance(data, dict):
        raise OpenAIError(
            f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json"
        )
    return data


# Names already warned about; capped so that bodies full of invented names cannot grow it
# (or the log) without bound.
_warned_fields: set[str] = set()
MAX_WARNED_FIELDS = 256


def ignored_fields(obj: BaseModel, prefix: str = "") -> list[str]:
    """Names of the unknown fields in a validated body, nested ones as `messages.tool_calls`."""
    names = [prefix + key for key in obj.model_extra or {}]
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                names.extend(ignored_fields(item, f"{prefix}{name}."))
    return names


def parse_request(model: type[_Strict], data: dict[str, Any]) -> Any:
    """Validate a body into `model`; the first problem becomes an OpenAIError 400 naming its field.
    Unknown fields are ignored; each name is logged the first time it is seen."""
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        parts = [
            p for p in err["loc"] if isinstance(p, int) or (_FIELD_PART.match(p) and p not in _TYPE_TAGS)
        ]
        param = ".".join(str(p) for p in parts) or None
        if err["type"] == "missing":
            message = f"missing required field {param!r}"
        else:
            got = err.get("input")
            shown = json.dumps(got)[:80] if _jsonable(got) else type(got).__name__
            message = f"{param}: {err['msg'].lower()}, got {shown}"
        raise OpenAIError(message, param=param, code=err["type"]) from None
    for name in ignored_fields(req):
        if name not in _warned_fields and len(_warned_fields) < MAX_WARNED_FIELDS:
            _warned_fields.add(name)
            logger.warning("ignoring unknown request field %r (logged once per name)", name)
    return req


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def engine_error(e: ValueError, default_param: str) -> OpenAIError:
    """The engine's refusal of a request -> a 400 naming the sampling field it cites (`name=value`),
    else `default_param` (the prompt)."""
    text = str(e)
    cited = [m for m in re.findall(r"\b(\w+)=", text) if m in _SAMPLING_NAMES]
    if cited:
        return OpenAIError(text, param=cited[0], code="invalid_value")
    return OpenAIError(text, param=default_param, code="invalid_prompt")


def sampling_error(e: ValueError) -> OpenAIError:
    """SamplingParams' own ValueError -> a 400 whose param is the field it names."""
    text = str(e)
    m = _PARAM_RE.match(text)
    param = m.group(1) if m and m.group(1) in _SAMPLING_NAMES else None
    return OpenAIError(text, param=param, code="invalid_value")


# Fields that change what a response must hold, which the server does not serve: refused (400
# `unsupported`) rather than ignored. Each maps to the value that asks for nothing (also accepted).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "allowed_token_ids": None,
    "bad_words": [],
    "logits_processors": [],
    "suffix": "",
}


def logit_bias_ids(req: _CommonRequest) -> dict[int, float] | None:
    """logit_bias with its JSON keys read as token ids; a key that is not a decimal id is a 400."""
    if req.logit_bias is None:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 19:
            raise OpenAIError(
                f"logit_bias: keys must be token ids (decimal integers >= 0), got {json.dumps(key)[:40]}",
                param="logit_bias",
                code="invalid_value",
            )
        out[int(key)] = value
    return out


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")  # fmt: skip
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_params(req: _CommonRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's structured-output constraint, the field that set it), from OpenAI's
    response_format (json_object, json_schema), vLLM's structured_outputs or its older guided_*
    fields; a 400 naming the field for a bad or second one. response_format text is no constraint."""
    given = [name for name in STRUCTURED_FIELDS if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise OpenAIError(f"set at most one of {', '.join(given)}", param=given[1], code="invalid_value")
    if not given:
        return None, None
    name = given[0]
    value = getattr(req, name)
    try:
        if name == "response_format":
            kwargs = _response_format(value)
        elif name == "structured_outputs":
            unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
            if unknown:
                raise OpenAIError(
                    f"structured_outputs: {unknown} not supported (only {', '.join(_STRUCTURED_KEYS)})",
                    param=f"structured_outputs.{unknown[0]}",
                    code="unsupported",
                )
            kwargs = {k: v for k, v in value.items() if v is not None}
        else:
            kwargs = {name.removeprefix("guided_"): value}
        return StructuredOutputsParams(**kwargs), name
    except ValueError as e:
        raise OpenAIError(f"{name}: {e}", param=name, code="invalid_value") from None


def _response_format(value: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format -> StructuredOutputsParams' keyword arguments; ValueError if bad."""
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("json_schema.schema must be a JSON schema object")
        if not isinstance(spec.get("strict", False), bool):
            raise ValueError("json_schema.strict must be a bool")
        return {"json": spec["schema"]}  # strict or not, the schema is enforced
    raise ValueError(f"type must be one of text, json_object, json_schema; got {json.dumps(kind)[:40]}")


def check_unsupported(req: _CommonRequest) -> None:
    """OpenAI features the engine does not implement; refused rather than silently ignored."""
    for name, value in (req.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS and value != UNSUPPORTED_FIELDS[name]:
            raise OpenAIError(f"{name} is not supported by this server", param=name, code="unsupported")
    t = req.temperature
    if t is not None and not 0.0 <= t <= MAX_TEMPERATURE:
        raise OpenAIError(
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {t}",
            param="temperature",
            code="invalid_value",
        )
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options needs stream=true", param="stream_options", code="invalid_value")
    if isinstance(req, CompletionRequest) and req.best_of not in (None, 1):
        raise OpenAIError(
            f"best_of={req.best_of} is not supported: only 1", param="best_of", code="unsupported"
        )
