"""Bad input to the OpenAI server: each kind gets its documented 4xx and an OpenAI error object.

In-process (FastAPI TestClient) on a tiny random checkpoint; TestClient re-raises any server
exception, so a 500 anywhere fails the test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from checkpoints import tiny_checkpoint

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from server_process import running_engine  # noqa: E402

from thinkspec.entrypoints.openai.server import build_app  # noqa: E402
from thinkspec.entrypoints.openai.serving import ServingConfig  # noqa: E402

API_KEY = "sk-test"
MODEL = "tiny"
MAX_MODEL_LEN = 96
MAX_TOKENS_LIMIT = 32
MAX_BYTES = 4096
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine():
    path = tiny_checkpoint("qwen3", tied=True)
    with running_engine(
        model=str(path), device="cpu", reasoning_parser="qwen3", max_model_len=MAX_MODEL_LEN
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine):
    app = build_app(
        engine, ServingConfig(MODEL, MAX_TOKENS_LIMIT), api_key=API_KEY, max_request_bytes=MAX_BYTES
    )
    return TestClient(app)


def chat(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def comp(**extra):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
LONG_PROMPT = "x" * (MAX_MODEL_LEN + 10)  # one token per byte in the tiny tokenizer

# (case, method, path, body: dict | bytes | None, headers, status, param, code)
CASES = [
    ("malformed JSON", "POST", CHAT, b'{"messages": [', AUTH, 400, None, "invalid_json"),
    ("NaN literal", "POST", COMP, b'{"prompt": "hi", "temperature": NaN}', AUTH, 400, None, "invalid_json"),
    ("body not an object", "POST", CHAT, b"[1, 2]", AUTH, 400, None, "invalid_json"),
    ("missing messages", "POST", CHAT, {"model": MODEL}, AUTH, 400, "messages", "missing"),
    ("missing prompt", "POST", COMP, {"model": MODEL}, AUTH, 400, "prompt", "missing"),
    ("messages not a list", "POST", CHAT, chat(messages="hi"), AUTH, 400, "messages", "list_type"),
    ("empty messages", "POST", CHAT, chat(messages=[]), AUTH, 400, "messages", "too_short"),
    (
        "bad role",
        "POST",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        AUTH,
        400,
        "messages.0.role",
        "literal_error",
    ),
    (
        "content of wrong type",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        AUTH,
        400,
        "messages.0.content",
        "string_type",
    ),
    (
        "tools",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        AUTH,
        400,
        "tools",
        "unsupported",
    ),
    ("tool_choice", "POST", CHAT, chat(tool_choice="required"), AUTH, 400, "tool_choice", "unsupported"),
    (
        "response_format xml",
        "POST",
        CHAT,
        chat(response_format={"type": "xml"}),
        AUTH,
        400,
        "response_format",
        "invalid_value",
    ),
    (
        "json_schema without a schema",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        AUTH,
        400,
        "response_format",
        "invalid_value",
    ),
    (
        "invalid JSON schema",
        "POST",
        COMP,
        comp(guided_json={"type": "integer", "minimum": 5, "maximum": 2}),
        AUTH,
        400,
        "guided_json",
        "invalid_value",
    ),
    (
        "invalid regex",
        "POST",
        COMP,
        comp(guided_regex="(unclosed"),
        AUTH,
        400,
        "guided_regex",
        "invalid_value",
    ),
    (
        "grammar accepting nothing",
        "POST",
        CHAT,
        chat(structured_outputs={"regex": "[^\\s\\S]"}),
        AUTH,
        400,
        "structured_outputs",
        "invalid_value",
    ),
    (
        "empty guided_choice",
        "POST",
        CHAT,
        chat(guided_choice=[]),
        AUTH,
        400,
        "guided_choice",
        "invalid_value",
    ),
    (
        "two structured fields",
        "POST",
        CHAT,
        chat(guided_regex="a", guided_choice=["a"]),
        AUTH,
        400,
        "guided_choice",
        "invalid_value",
    ),
    (
        "unknown structured_outputs key",
        "POST",
        CHAT,
        chat(structured_outputs={"structural_tag": "x"}),
        AUTH,
        400,
        "structured_outputs.structural_tag",
        "unsupported",
    ),
    (
        "logit_bias key not an id",
        "POST",
        CHAT,
        chat(logit_bias={"x": 1}),
        AUTH,
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        "logit_bias over 100",
        "POST",
        COMP,
        comp(logit_bias={"5": 100.5}),
        AUTH,
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        "logit_bias id outside the vocabulary",
        "POST",
        COMP,
        comp(logit_bias={"100000": 1}),
        AUTH,
        400,
        "logit_bias",
        "invalid_value",
    ),
    (
        "logit_bias value a string",
        "POST",
        CHAT,
        chat(logit_bias={"5": "1"}),
        AUTH,
        400,
        "logit_bias",
        "float_type",
    ),
    (
        "enable_thinking 0",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": 0}),
        AUTH,
        400,
        "chat_template_kwargs.enable_thinking",
        "invalid_value",
    ),
    (
        "enable_thinking empty string",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": ""}),
        AUTH,
        400,
        "chat_template_kwargs.enable_thinking",
        "invalid_value",
    ),
    (
        "enable_thinking []",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": []}),
        AUTH,
        400,
        "chat_template_kwargs.enable_thinking",
        "invalid_value",
    ),
    (
        "repetition_penalty 5e-324",
        "POST",
        CHAT,
        chat(repetition_penalty=5e-324),
        AUTH,
        400,
        "repetition_penalty",
        "invalid_value",
    ),
    (
        "repetition_penalty over 100",
        "POST",
        COMP,
        comp(repetition_penalty=101.0),
        AUTH,
        400,
        "repetition_penalty",
        "invalid_value",
    ),
    (
        "prompt + max_tokens over max_model_len",
        "POST",
        COMP,
        comp(prompt="x" * 80, max_tokens=20),
        AUTH,
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "messages + max_completion_tokens over max_model_len",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "x" * 60}], max_completion_tokens=30),
        AUTH,
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    ("temperature a string", "POST", CHAT, chat(temperature="0.5"), AUTH, 400, "temperature", "float_type"),
    ("temperature above 2", "POST", CHAT, chat(temperature=2.5), AUTH, 400, "temperature", "invalid_value"),
    ("temperature negative", "POST", COMP, comp(temperature=-0.1), AUTH, 400, "temperature", "invalid_value"),
    ("top_p zero", "POST", CHAT, chat(top_p=0.0), AUTH, 400, "top_p", "invalid_value"),
    ("top_p above 1", "POST", COMP, comp(top_p=1.5), AUTH, 400, "top_p", "invalid_value"),
    ("top_k below -1", "POST", CHAT, chat(top_k=-2), AUTH, 400, "top_k", "invalid_value"),
    ("min_p above 1", "POST", CHAT, chat(min_p=1.5), AUTH, 400, "min_p", "invalid_value"),
    ("n over 128", "POST", CHAT, chat(n=129), AUTH, 400, "n", "invalid_value"),
    ("n = 0", "POST", COMP, comp(n=0), AUTH, 400, "n", "invalid_value"),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), AUTH, 400, "max_tokens", "invalid_value"),
    (
        "max_tokens over limit",
        "POST",
        COMP,
        comp(max_tokens=10_000),
        AUTH,
        400,
        "max_tokens",
        "invalid_value",
    ),
    ("max_tokens a bool", "POST", CHAT, chat(max_tokens=True), AUTH, 400, "max_tokens", "int_type"),
    (
        "min_tokens over max_tokens",
        "POST",
        CHAT,
        chat(min_tokens=9),
        AUTH,
        400,
        "min_tokens",
        "invalid_value",
    ),
    ("seed a string", "POST", CHAT, chat(seed="7"), AUTH, 400, "seed", "int_type"),
    ("stop not a string/list", "POST", CHAT, chat(stop=5), AUTH, 400, "stop", "string_type"),
    ("stop with an empty string", "POST", COMP, comp(stop=[""]), AUTH, 400, "stop", "invalid_value"),
    (
        "stop_token_ids negative",
        "POST",
        COMP,
        comp(stop_token_ids=[-1]),
        AUTH,
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    # logprobs counts are at most the engine's max_logprobs (20 by default), named by their own field
    (
        "top_logprobs over max_logprobs",
        "POST",
        CHAT,
        chat(logprobs=True, top_logprobs=21),
        AUTH,
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (
        "top_logprobs negative",
        "POST",
        CHAT,
        chat(logprobs=True, top_logprobs=-1),
        AUTH,
        400,
        "top_logprobs",
        "invalid_value",
    ),
    (
        "top_logprobs without logprobs",
        "POST",
        CHAT,
        chat(top_logprobs=2),
        AUTH,
        400,
        "top_logprobs",
        "invalid_value",
    ),
    ("logprobs a number (chat)", "POST", CHAT, chat(logprobs=2), AUTH, 400, "logprobs", "bool_type"),
    ("logprobs over max_logprobs", "POST", COMP, comp(logprobs=21), AUTH, 400, "logprobs", "invalid_value"),
    ("logprobs negative", "POST", COMP, comp(logprobs=-1), AUTH, 400, "logprobs", "invalid_value"),
    (
        "prompt_logprobs over max_logprobs",
        "POST",
        CHAT,
        chat(prompt_logprobs=21),
        AUTH,
        400,
        "prompt_logprobs",
        "invalid_value",
    ),
    (
        "prompt_logprobs streamed",
        "POST",
        COMP,
        comp(prompt_logprobs=1, stream=True),
        AUTH,
        400,
        "prompt_logprobs",
        "invalid_value",
    ),
    ("echo not a bool", "POST", COMP, comp(echo=1), AUTH, 400, "echo", "bool_type"),
    ("max_tokens 0 without echo", "POST", COMP, comp(max_tokens=0), AUTH, 400, "max_tokens", "invalid_value"),
    ("best_of", "POST", COMP, comp(best_of=2), AUTH, 400, "best_of", "unsupported"),
    (
        "presence_penalty",
        "POST",
        CHAT,
        chat(presence_penalty=5.0),
        AUTH,
        400,
        "presence_penalty",
        "invalid_value",
    ),
    # Unknown fields are ignored (tests/test_server_compat.py); known ones keep their value checks.
    ("store not a bool", "POST", CHAT, chat(store="yes"), AUTH, 400, "store", "bool_type"),
    (
        "metadata value not a string",
        "POST",
        CHAT,
        chat(metadata={"k": 1}),
        AUTH,
        400,
        "metadata.k",
        "string_type",
    ),
    (
        "continuous_usage_stats not a bool",
        "POST",
        CHAT,
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": "on"}),
        AUTH,
        400,
        "stream_options.continuous_usage_stats",
        "bool_type",
    ),
    (
        "refusal not a string",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "hi", "refusal": 1}]),
        AUTH,
        400,
        "messages.0.refusal",
        "string_type",
    ),
    ("messages null", "POST", CHAT, chat(messages=None), AUTH, 400, "messages", "list_type"),
    (
        "detokenize a token outside vocab",
        "POST",
        "/detokenize",
        {"tokens": [1, 10**6]},
        AUTH,
        400,
        "tokens",
        "invalid_value",
    ),
    ("tokenize with no prompt", "POST", "/tokenize", {"model": MODEL}, AUTH, 400, "prompt", "missing"),
    ("unknown model id", "GET", "/v1/models/gpt-5", None, AUTH, 404, "model", "model_not_found"),
    (
        "stream_options without stream",
        "POST",
        CHAT,
        chat(stream_options={}),
        AUTH,
        400,
        "stream_options",
        "invalid_value",
    ),
    ("relax_ratio above 1", "POST", CHAT, chat(relax_ratio=1.5), AUTH, 400, "relax_ratio", "invalid_value"),
    ("relax_ratio a string", "POST", CHAT, chat(relax_ratio="high"), AUTH, 400, "relax_ratio", "float_type"),
    ("relax_top_k zero", "POST", CHAT, chat(relax_top_k=0), AUTH, 400, "relax_top_k", "invalid_value"),
    ("relax_top_k above 64", "POST", COMP, comp(relax_top_k=65), AUTH, 400, "relax_top_k", "invalid_value"),
    ("relax_delta negative", "POST", CHAT, chat(relax_delta=-0.1), AUTH, 400, "relax_delta", "invalid_value"),
    (
        "relaxed_thinking without speculation",
        "POST",
        CHAT,
        chat(relaxed_thinking=True),
        AUTH,
        400,
        "relaxed_thinking",
        "invalid_value",
    ),
    (
        "relaxed_thinking not a bool",
        "POST",
        CHAT,
        chat(relaxed_thinking=1),
        AUTH,
        400,
        "relaxed_thinking",
        "bool_type",
    ),
    (
        "chat_template_kwargs not an object",
        "POST",
        CHAT,
        chat(chat_template_kwargs=[1]),
        AUTH,
        400,
        "chat_template_kwargs",
        "dict_type",
    ),
    (
        "chat_template_kwargs reserved key",
        "POST",
        CHAT,
        chat(chat_template_kwargs={"tokenize": True}),
        AUTH,
        400,
        "chat_template_kwargs",
        "invalid_value",
    ),
    (
        "prompt too long (completions)",
        "POST",
        COMP,
        comp(prompt=LONG_PROMPT),
        AUTH,
        400,
        "prompt",
        "invalid_prompt",
    ),
    (
        "prompt too long (chat, streamed)",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": LONG_PROMPT}], stream=True),
        AUTH,
        400,
        "messages",
        "invalid_prompt",
    ),
    ("empty prompt", "POST", COMP, comp(prompt=""), AUTH, 400, "prompt", "invalid_prompt"),
    ("token id outside vocab", "POST", COMP, comp(prompt=[1, 10**6]), AUTH, 400, "prompt", "invalid_prompt"),
    ("several prompts", "POST", COMP, comp(prompt=["a", "b"]), AUTH, 400, "prompt", "invalid_value"),
    ("unknown model", "POST", CHAT, chat(model="gpt-5"), AUTH, 404, "model", "model_not_found"),
    (
        "body over the size limit",
        "POST",
        CHAT,
        b"{" + b" " * MAX_BYTES + b"}",
        AUTH,
        413,
        None,
        "request_too_large",
    ),
    ("missing API key", "POST", CHAT, chat(), {}, 401, None, "invalid_api_key"),
    (
        "wrong API key",
        "GET",
        "/v1/models",
        None,
        {"Authorization": "Bearer nope"},
        401,
        None,
        "invalid_api_key",
    ),
    (
        "API key without Bearer",
        "GET",
        "/v1/models",
        None,
        {"Authorization": API_KEY},
        401,
        None,
        "invalid_api_key",
    ),
    ("unknown route", "POST", "/v1/embeddings", chat(), AUTH, 404, None, "not_found"),
    ("wrong method", "GET", CHAT, None, AUTH, 405, None, "method_not_allowed"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(client, case):
    *_, status, param, code = case
    r = _send(client, case)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code


def _send(client, case):
    _, method, path, body, headers, *_ = case
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    return client.request(method, path, headers={**JSON, **headers}, content=content)


def _documented_errors() -> set[tuple[int, str]]:
    """(status, code) pairs of the error table in docs/SERVER.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "SERVER.md").read_text()
    rows = text.split("| input | status | param | code |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    pairs = set()
    for row in rows:
        _, _, status, _, codes, _ = row.split("|")
        pairs |= {(int(status), code) for code in re.findall(r"`(\w+)`", codes)}
    return pairs


def test_server_responses_cover_the_documented_error_table(client):
    # What the server answered, against docs/SERVER.md: every documented (status, code) is produced
    # by some case, and every answer is a documented one.
    answered = set()
    for case in CASES:
        r = _send(client, case)
        answered.add((r.status_code, r.json()["error"]["code"]))
    documented = _documented_errors()
    assert len(documented) >= 15
    assert answered - documented == set(), "answered but not documented"
    # Codes of the boundary guards (body, unicode, nesting, browser safety) are answered by the
    # cases of test_server_limits.py, which run the server with those guards configured.
    limits = (Path(__file__).resolve().parent / "test_server_limits.py").read_text()
    untested = {(status, code) for status, code in documented - answered if f'"{code}"' not in limits}
    assert untested == set(), "documented but answered by no test"


def test_prompt_too_long_message_names_length_and_limit(client):
    r = client.post(COMP, json=comp(prompt=LONG_PROMPT), headers=AUTH)
    message = r.json()["error"]["message"]
    assert str(len(LONG_PROMPT)) in message and str(MAX_MODEL_LEN) in message


def test_context_length_message_names_both_numbers(client):
    r = client.post(COMP, json=comp(prompt="x" * 80, max_tokens=20), headers=AUTH)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "80 tokens" in message and f"{MAX_MODEL_LEN} tokens" in message and "20 more" in message
    # left out, max_tokens fills what remains (as vLLM), and one that fits is accepted
    for body in (comp(prompt="x" * 80, max_tokens=None), comp(prompt="x" * 80, max_tokens=16)):
        r = client.post(COMP, json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 80
        assert 0 < r.json()["usage"]["completion_tokens"] <= 16


def test_served_or_empty_values_of_unsupported_fields_are_accepted(client):
    body = chat(response_format={"type": "text"}, tools=[], tool_choice="none", logit_bias={"5": -100})
    r = client.post(CHAT, json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = client.post(CHAT, json=chat(chat_template_kwargs={"enable_thinking": False}), headers=AUTH)
    assert r.status_code == 200, r.text


def test_streamed_body_over_limit_without_content_length(client):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BYTES // 256 + 1):
            yield b"a" * 256
        yield b'"}'

    r = client.post(COMP, content=chunks(), headers={**AUTH, **JSON})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_server_still_serves_after_bad_input(client, engine):
    for case in CASES[:10]:
        body = case[3]
        client.request(
            case[1],
            case[2],
            content=body if isinstance(body, bytes) else json.dumps(body),
            headers={**AUTH, **JSON},
        )
    r = client.post(CHAT, json=chat(temperature=0.0), headers=AUTH)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert client.get("/health").status_code == 200
    assert engine.dead_error is None


def test_public_routes_need_no_key_and_v1_routes_accept_it(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/metrics").status_code == 200
    r = client.get("/v1/models", headers=AUTH)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


def test_logprob_limits_accept_their_boundaries_as_vllm(client):
    # In range at the edges; top_logprobs=0 without logprobs and prompt_logprobs=0 in a stream are
    # accepted (vLLM does), the second with nothing to return.
    ok = [
        (CHAT, chat(logprobs=True, top_logprobs=20, max_tokens=1)),
        (CHAT, chat(top_logprobs=0, max_tokens=1)),
        (COMP, comp(logprobs=20, prompt_logprobs=20, echo=True, max_tokens=1)),
        (COMP, comp(prompt_logprobs=0, stream=True, max_tokens=1)),
        (COMP, comp(echo=True, max_tokens=0)),
    ]
    for path, body in ok:
        r = client.post(path, json=body, headers=AUTH)
        assert r.status_code == 200, (body, r.text)
    lp = client.post(CHAT, json=chat(logprobs=True, top_logprobs=20, max_tokens=1), headers=AUTH).json()
    assert len(lp["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    assert client.post(CHAT, json=chat(top_logprobs=0), headers=AUTH).json()["choices"][0]["logprobs"] is None


def test_client_gone_mid_body_logs_one_line(client, caplog):
    """A Content-Length larger than what arrives before the disconnect: one log line, no traceback,
    and nothing raised out of the app (uvicorn would log that as a second traceback)."""
    import asyncio
    import logging

    body = json.dumps(comp()).encode()
    messages = [
        {"type": "http.request", "body": body[:10], "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body) + 100).encode()),
        (b"authorization", AUTH["Authorization"].encode()),
    ]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": COMP, "raw_path": COMP.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    with caplog.at_level(logging.INFO):
        asyncio.run(client.app(scope, receive, send))
    records = [r for r in caplog.records if r.name.startswith(("thinkspec", "uvicorn", "fastapi"))]
    assert [r.exc_info for r in records] == [None]
    assert "disconnected after 10 of" in records[0].getMessage()
    assert sent and sent[0]["status"] == 400
