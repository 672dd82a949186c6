"""Structural limits on a parsed request body, checked before its fields are read.

The body is walked once, without recursion: nesting deeper than MAX_JSON_DEPTH, and strings (keys
included) that are not valid unicode (JSON escapes can spell lone surrogates, which no tokenizer
or response encoder accepts) are refused with a 400 naming the field where they occur. Field
values are checked by the request models (protocol.py) and by SamplingParams; integers there
must fit the engine's int64 and stop lists are capped (sampling_params.py).
"""

from __future__ import annotations

from typing import Any

from thinkspec.entrypoints.openai.protocol import OpenAIError

# Valid requests nest 4 levels (messages -> message -> content parts -> part);
# chat_template_kwargs may hold structured values, so some room is left.
MAX_JSON_DEPTH = 32


def _path(parts: tuple[Any, ...]) -> str | None:
    return ".".join(str(p) for p in parts) or None


def check_body(data: dict[str, Any]) -> None:
    """OpenAIError 400 for nesting over MAX_JSON_DEPTH (code `too_deep`) or a string that is not
    valid unicode (code `invalid_unicode`); param is the path to it, e.g. `messages.0.content`."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, path)
        elif isinstance(value, (dict, list)):
            if len(path) >= MAX_JSON_DEPTH:
                raise OpenAIError(
                    f"{_path(path[:1])}: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                    param=_path(path[:1]),
                    code="too_deep",
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_unicode(key, path)
                    stack.append((item, (*path, key)))
            else:
                stack.extend((item, (*path, i)) for i, item in enumerate(value))


def _check_unicode(text: str, path: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = _path(path)  # a bad key is reported at its parent (keys are checked first)
        raise OpenAIError(
            f"{param or 'the body'}: invalid unicode ({e.reason} at index {e.start})",
            param=param,
            code="invalid_unicode",
        ) from None
