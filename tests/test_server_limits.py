"""Limits at the server's boundary: integers the engine can hold, token ids the tokenizer knows,
capped stop lists, nesting and unicode, JSON-only POSTs, Host and Origin checks; and the same
checks in the Python API (SamplingParams, LLMEngine.add_request).

In-process (FastAPI TestClient) on a tiny random checkpoint that drafts for itself, so requests
take the speculative path too; TestClient re-raises any server exception, so a 500 fails a test.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import TOKENIZER_SIZE, tiny_checkpoint

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from fastapi.testclient import TestClient  # noqa: E402
from server_process import running_engine  # noqa: E402

from thinkspec.entrypoints.openai.server import build_app  # noqa: E402
from thinkspec.entrypoints.openai.serving import ServingConfig  # noqa: E402
from thinkspec.entrypoints.openai.validation import MAX_JSON_DEPTH  # noqa: E402
from thinkspec.sampling_params import (  # noqa: E402
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

MODEL = "tiny"
PADDED_VOCAB = TOKENIZER_SIZE + 27  # embedding rows past the tokenizer's last id
JSON = {"Content-Type": "application/json"}
CHAT, COMP = "/v1/chat/completions", "/v1/completions"
HUGE = "1" + "0" * 400  # the integer 10**400 as JSON


@pytest.fixture(scope="module")
def engine():
    path = tiny_checkpoint("qwen3", tied=True, vocab_size=PADDED_VOCAB)
    spec = {"model": str(path), "num_speculative_tokens": 2}
    with running_engine(
        model=str(path), device="cpu", reasoning_parser="qwen3", max_model_len=96, speculative_config=spec
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(build_app(engine, ServingConfig(MODEL, 16)))


def chat(**extra):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def comp(**extra):
    return {"prompt": "hi", "max_tokens": 4, **extra}


def raw(body: dict, **fields: str) -> bytes:
    """body as JSON with `fields` spliced in as raw JSON text (numbers json.dumps cannot write)."""
    text = json.dumps(body)[:-1]
    for name, value in fields.items():
        text += f', "{name}": {value}'
    return (text + "}").encode()


def nested(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


# (case, path, body: dict | bytes, status, param, code)
CASES = [
    ("top_k 10**400 (sampled)", CHAT, raw(chat(), top_k=HUGE), 400, "top_k", "invalid_value"),
    (
        "stop_token_ids 2**63 (greedy)",
        CHAT,
        chat(stop_token_ids=[2**63], temperature=0),
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    ("stop_token_ids 2**63 (completions)", COMP, comp(stop_token_ids=[2**63]), 400, "stop_token_ids", None),
    (
        "stop_token_ids past the tokenizer",
        COMP,
        comp(stop_token_ids=[TOKENIZER_SIZE]),
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    (
        "too many stop_token_ids",
        COMP,
        comp(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
        400,
        "stop_token_ids",
        "invalid_value",
    ),
    ("seed 2**63", CHAT, chat(seed=2**63), 400, "seed", "invalid_value"),
    ("seed -2**63 - 1", COMP, comp(seed=-(2**63) - 1), 400, "seed", "invalid_value"),
    ("max_tokens 10**400", COMP, raw({"prompt": "hi"}, max_tokens=HUGE), 400, "max_tokens", "invalid_value"),
    (
        "max_completion_tokens 0",
        CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    (
        "max_completion_tokens 10**400",
        CHAT,
        raw({"messages": [{"role": "user", "content": "hi"}]}, max_completion_tokens=HUGE),
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    ("min_tokens 2**64", CHAT, chat(min_tokens=2**64), 400, "min_tokens", "invalid_value"),
    ("n 10**400", CHAT, raw(chat(), n=HUGE), 400, "n", "invalid_value"),
    ("relax_top_k 10**400", COMP, raw(comp(), relax_top_k=HUGE), 400, "relax_top_k", "invalid_value"),
    ("temperature 1e400", CHAT, raw(chat(), temperature="1e400"), 400, "temperature", "invalid_value"),
    ("top_p 10**400", CHAT, raw(chat(), top_p=HUGE), 400, "top_p", "float_type"),
    ("too many stop strings", CHAT, chat(stop=["x"] * (MAX_STOP_STRINGS + 1)), 400, "stop", "invalid_value"),
    ("100,000 stop strings", COMP, comp(stop=["zz"] * 100_000), 400, "stop", "invalid_value"),
    (
        "stop string too long",
        COMP,
        comp(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]),
        400,
        "stop",
        "invalid_value",
    ),
    (
        "prompt id in the padded embedding",
        COMP,
        comp(prompt=[1, TOKENIZER_SIZE]),
        400,
        "prompt",
        "invalid_prompt",
    ),
    (
        "lone surrogate in content",
        CHAT,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages.0.content",
        "invalid_unicode",
    ),
    (
        "lone surrogate in a content part",
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        400,
        "messages.0.content.0.text",
        "invalid_unicode",
    ),
    ("lone surrogate in prompt", COMP, b'{"prompt": "\\ud83d"}', 400, "prompt", "invalid_unicode"),
    (
        "lone surrogate in model",
        COMP,
        b'{"prompt": "hi", "model": "\\ud800"}',
        400,
        "model",
        "invalid_unicode",
    ),
    ("lone surrogate in a key", COMP, b'{"prompt": "hi", "\\ud800": 1}', 400, None, "invalid_unicode"),
    (
        "lone surrogate in stop",
        COMP,
        b'{"prompt": "hi", "stop": ["\\udc00"]}',
        400,
        "stop.0",
        "invalid_unicode",
    ),
    (
        "nesting 1000 deep",
        CHAT,
        ('{"messages": ' + "[" * 1000 + "]" * 1000 + "}").encode(),
        400,
        None,
        "too_deep",
    ),
    (
        f"chat_template_kwargs nested {MAX_JSON_DEPTH + 1} deep",
        CHAT,
        raw(chat(), chat_template_kwargs=nested(MAX_JSON_DEPTH)),
        400,
        "chat_template_kwargs",
        "too_deep",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_limit(client, case):
    _, path, body, status, param, code = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=content, headers=JSON)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_nesting_just_under_the_cap_is_accepted(client):
    body = raw(chat(temperature=0), chat_template_kwargs=nested(MAX_JSON_DEPTH - 1))
    assert client.post(CHAT, content=body, headers=JSON).status_code == 200


def test_engine_killers_get_400_and_the_engine_answers_next(client, engine):
    """The two requests that used to kill the engine: now each a 400, and a normal request right
    after answers exactly as before them."""
    normal = chat(temperature=0, max_tokens=8)
    before = client.post(CHAT, json=normal)
    assert before.status_code == 200
    for body in (
        raw(chat(), top_k=HUGE),  # sampled (default temperature)
        json.dumps(chat(stop_token_ids=[2**63], temperature=0)).encode(),
        json.dumps(comp(stop_token_ids=[2**63], temperature=0)).encode(),
    ):
        path = CHAT if b"messages" in body else COMP
        assert client.post(path, content=body, headers=JSON).status_code == 400
        assert client.get("/health").status_code == 200
    after = client.post(CHAT, json=normal)
    assert after.status_code == 200
    assert after.json()["choices"] == before.json()["choices"]
    assert engine.is_healthy


def test_top_k_beyond_int32_samples_like_no_top_k(client):
    body = chat(temperature=1.0, seed=11, max_tokens=6, top_k=0)  # 0: off, whatever the checkpoint says
    off = client.post(CHAT, json=body).json()["choices"]
    big = client.post(CHAT, json={**body, "top_k": 2**62}).json()["choices"]
    assert big == off


# ---- browser safety ------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_needs_a_json_content_type(client, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = client.post(COMP, content=json.dumps(comp()).encode(), headers=headers)
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_content_types_are_accepted(client):
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = client.post(COMP, content=json.dumps(comp(temperature=0)), headers={"Content-Type": content_type})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def loopback_client(engine):
    app = build_app(engine, ServingConfig(MODEL, 16), loopback_only=True)
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "[::1]:8000", "localhost:1"])
def test_loopback_server_accepts_loopback_hosts(loopback_client, host):
    assert loopback_client.get("/health", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "10.0.0.1", "127.0.0.1.evil.example"])
def test_loopback_server_refuses_other_hosts(loopback_client, host):
    r = loopback_client.post(COMP, json=comp(), headers={"Host": host})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_host"


def test_no_cors_by_default_and_foreign_origins_refused(client):
    r = client.post(COMP, json=comp(temperature=0), headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    ok = client.post(COMP, json=comp(temperature=0))
    assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers


def test_allowed_origins_get_cors(engine):
    origin = "http://app.example"
    c = TestClient(build_app(engine, ServingConfig(MODEL, 16), allowed_origins=[origin]))
    pre = c.options(
        COMP,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
    r = c.post(COMP, json=comp(temperature=0), headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert c.post(COMP, json=comp(), headers={"Origin": "http://other.example"}).status_code == 403


# ---- the Python API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"top_k": 10**400}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": "s" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_sampling_params_refuse_what_the_engine_cannot_hold(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_top_k_past_int32_is_packed_as_off():
    """A top_k no vocabulary reaches is "off" on the device: it must not go through float64
    packing, where 2**63 - 1 rounds to 2**63 and overflows int64."""
    from thinkspec.sampling.sampler import MAX_TOP_K, SamplingTensors

    params = [SamplingParams(top_k=k) for k in (2**63 - 1, MAX_TOP_K + 1, MAX_TOP_K, 5)]
    tensors = SamplingTensors.from_params(params, torch.device("cpu"))
    assert tensors.top_k.tolist() == [0, 0, MAX_TOP_K, 5]


def test_engine_add_request_refuses_bad_ids_and_text(engine):
    llm_engine = engine.engine
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _add_direct(llm_engine, [1, TOKENIZER_SIZE], SamplingParams())
    with pytest.raises(ValueError, match="stop_token_ids="):
        _add_direct(llm_engine, [1, 2], SamplingParams(stop_token_ids=[PADDED_VOCAB - 1]))
    with pytest.raises(ValueError, match="not valid unicode"):
        _add_direct(llm_engine, "a\ud800", SamplingParams())


def _add_direct(llm_engine, prompt, params):
    # Every call here fails its checks before anything is queued, so the engine thread is untouched.
    llm_engine.add_request(prompt, params, "direct-check")


def test_llm_generate_fails_bad_inputs_alone():
    """LLM.generate: a prompt the engine refuses (ValueError inside) fails alone with its reason."""
    from thinkspec.llm import LLM

    path = tiny_checkpoint("qwen3", tied=True, vocab_size=PADDED_VOCAB)
    llm = LLM(str(path), device="cpu", max_model_len=96)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    outs = llm.generate([[1, TOKENIZER_SIZE], "a\udfffb", [1, 2, 3]], params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert "outside the vocabulary" in outs[0].error and "not valid unicode" in outs[1].error
