"""Structured outputs through the server, in-process (FastAPI TestClient) on the toy model with the
qwen3 reasoning parser, fp32 on CPU: the answer follows the grammar, the reasoning stays separate,
streamed and not; a speculating server and a missing xgrammar get a 400 naming the reason."""

from __future__ import annotations

import json
import re
import sys

import pytest
from checkpoints import tiny_checkpoint

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from fastapi.testclient import TestClient  # noqa: E402
from server_process import running_engine  # noqa: E402
from structured_cases import QUESTION, SCHEMA  # noqa: E402

from thinkspec.entrypoints.openai.server import build_app  # noqa: E402
from thinkspec.entrypoints.openai.serving import ServingConfig  # noqa: E402
from thinkspec.model_names import TOY_MODELS  # noqa: E402

CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def client():
    if not (TOY_MODELS["toy-reasoner"] / "config.json").is_file():
        pytest.skip("the bundled toy checkpoint is not installed")
    with running_engine(
        model=str(TOY_MODELS["toy-reasoner"]), device="cpu", reasoning_parser="qwen3"
    ) as engine:
        yield TestClient(build_app(engine, ServingConfig("toy", 256)))


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 200, **extra}


def _valid(value: dict) -> bool:
    try:
        import jsonschema
    except ImportError:
        return (
            set(value) == {"answer", "unit"}
            and isinstance(value["answer"], int)
            and value["unit"] in ("books", "apples")
        )
    jsonschema.validate(value, SCHEMA)
    return True


def test_json_schema_response_format_and_reasoning_apart(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.post(CHAT, json=chat(response_format=fmt))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] and "</think>" not in message["reasoning"]
    assert _valid(json.loads(message["content"]))
    # streamed: the joined content is the same JSON
    r = client.post(CHAT, json=chat(response_format=fmt, stream=True))
    deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    content = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
    assert json.loads(content) == json.loads(message["content"])
    # json_object and the older guided_json name
    r = client.post(CHAT, json=chat(response_format={"type": "json_object"}))
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = client.post(CHAT, json=chat(guided_json=SCHEMA))
    assert r.json()["choices"][0]["message"]["content"] == message["content"]


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"regex": "[0-9]{2,4}"}}, lambda a: re.fullmatch("[0-9]{2,4}", a)),
        ({"guided_regex": "[0-9]{2,4}"}, lambda a: re.fullmatch("[0-9]{2,4}", a)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda a: a in ("yes", "no")),
        ({"guided_choice": ["yes", "no"]}, lambda a: a in ("yes", "no")),
        (
            {"structured_outputs": {"grammar": 'root ::= "It is " [0-9]+'}},
            lambda a: re.fullmatch("It is [0-9]+", a),
        ),
    ],
    ids=["regex", "guided_regex", "choice", "guided_choice", "grammar"],
)
def test_regex_choice_and_grammar_on_chat(client, extra, check):
    r = client.post(CHAT, json=chat(**extra))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] and check(message["content"]), message


def test_without_thinking_the_constraint_starts_at_the_first_token(client):
    body = chat(chat_template_kwargs={"enable_thinking": False}, guided_regex="[0-9]{3}")
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] is None
    assert re.fullmatch("[0-9]{3}", message["content"]), message
    # completions: the same from a raw prompt (token ids), constrained from its first token
    ids = client.post(
        "/tokenize", json={"messages": body["messages"], "chat_template_kwargs": {"enable_thinking": False}}
    )
    prompt = ids.json()["tokens"]
    r = client.post(
        COMP, json={"prompt": prompt, "temperature": 0, "max_tokens": 20, "guided_regex": "[0-9]{3}"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == message["content"]


def test_a_speculating_server_refuses_constrained_requests():
    path = tiny_checkpoint("qwen3", tied=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with running_engine(model=str(path), device="cpu", speculative_config=spec) as engine:
        client = TestClient(build_app(engine, ServingConfig("tiny", 16)))
        r = client.post(COMP, json={"prompt": "hi", "max_tokens": 2, "guided_regex": "a+"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "guided_regex" and error["code"] == "unsupported"
        assert "speculative decoding" in error["message"]
        assert client.post(COMP, json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_without_xgrammar_a_constrained_request_names_the_package(client, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    r = client.post(CHAT, json=chat(guided_regex="[a-z]+", max_tokens=4))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "guided_regex" and error["code"] == "unsupported"
    assert "xgrammar" in error["message"]
    assert client.post(CHAT, json=chat(max_tokens=4)).status_code == 200
