"""A vLLM user switching: tolerant request parsing, the reasoning fields, reasoning_tokens, vLLM's
extra endpoints and server flags. In-process (TestClient) on a tiny checkpoint, plus one real
`thinkspec serve` of the toy reasoner driven by the official openai client."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
from pathlib import Path

import pytest
from checkpoints import END_THINK_ID, THINK_ID, tiny_checkpoint

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402
from server_process import serve_process  # noqa: E402

from thinkspec import __version__  # noqa: E402
from thinkspec.engine.engine import LLMEngine  # noqa: E402
from thinkspec.engine_args import EngineArgs  # noqa: E402
from thinkspec.entrypoints.async_engine import AsyncLLMEngine  # noqa: E402
from thinkspec.entrypoints.openai import protocol  # noqa: E402
from thinkspec.entrypoints.openai.server import api_keys, build_app  # noqa: E402
from thinkspec.entrypoints.openai.serving import ServingConfig, count_reasoning_tokens  # noqa: E402

KEYS = ["sk-one", "sk-two"]
NAMES = ("tiny", "tiny-alias")
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def engine():
    path = tiny_checkpoint("qwen3", tied=True)
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(str(path), device="cpu", reasoning_parser="qwen3")))
    engine.start()
    yield engine
    engine.shutdown()


def make_client(engine, reasoning_field: str = "both") -> TestClient:
    config = ServingConfig(NAMES[0], 32, other_model_names=NAMES[1:], reasoning_field=reasoning_field)
    return TestClient(build_app(engine, config, api_key=KEYS))


@pytest.fixture(scope="module")
def client(engine):
    return make_client(engine)


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(**extra):
    # "q30" makes the tiny model write "<think>" mid-answer (see test_server.PROMPTS).
    return {"messages": [{"role": "user", "content": "q30"}], "max_tokens": 12, "temperature": 0, **extra}


def test_unknown_fields_are_ignored_and_logged_once(client, caplog, monkeypatch):
    monkeypatch.setattr(protocol, "_warned_fields", set())
    body = chat(frobnicate=1, messages=[{"role": "user", "content": "q30", "cache_hint": "x"}])
    with caplog.at_level(logging.WARNING, logger="thinkspec"):
        first = client.post(CHAT, json=body, headers=auth())
        second = client.post(CHAT, json=body, headers=auth())
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert len(warned) == 2 and "'frobnicate'" in warned[0] and "'messages.cache_hint'" in warned[1]


def test_warned_names_are_capped(client, monkeypatch):
    monkeypatch.setattr(protocol, "_warned_fields", set())
    monkeypatch.setattr(protocol, "MAX_WARNED_FIELDS", 3)
    r = client.post(CHAT, json=chat(**{f"x{i}": i for i in range(10)}, max_tokens=1), headers=auth())
    assert r.status_code == 200
    assert len(protocol._warned_fields) == 3


def test_nulls_mean_unset_and_openai_routine_fields_are_accepted(client):
    plain = client.post(CHAT, json=chat(), headers=auth()).json()
    nulls = dict.fromkeys(["n", "stream", "min_tokens", "ignore_eos", "frequency_penalty", "stop", "seed"])
    routine = {"store": False, "metadata": {"k": "v"}, "parallel_tool_calls": True, "user": "u"}
    r = client.post(CHAT, json=chat(**nulls, **routine), headers=auth())
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"]


def test_message_and_deltas_carry_both_reasoning_names(client):
    resp = client.post(CHAT, json=chat(), headers=auth()).json()
    msg = resp["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] and msg["reasoning"]  # "q30" yields reasoning
    body = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    with client.stream("POST", CHAT, json=body, headers=auth()) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("reasoning") or "" for d in deltas) == msg["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == (msg["content"] or "")
    # continuous usage: every chunk after the role chunk carries the usage so far
    counts = [e["usage"]["completion_tokens"] for e in events[1:]]
    assert counts == sorted(counts) and counts[-1] == resp["usage"]["completion_tokens"]
    assert events[-1]["usage"] == resp["usage"]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_field_flag_keeps_one_name(engine, field):
    client = make_client(engine, field)
    msg = client.post(CHAT, json=chat(), headers=auth()).json()["choices"][0]["message"]
    other = ({"reasoning", "reasoning_content"} - {field}).pop()
    assert msg[field] and other not in msg
    with client.stream("POST", CHAT, json=chat(stream=True), headers=auth()) as r:
        deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert any(field in d["choices"][0]["delta"] for d in deltas)
    assert not any(other in d["choices"][0]["delta"] for d in deltas)


def test_reasoning_tokens_count_the_thinking_phase():
    t, e = THINK_ID, END_THINK_ID
    assert count_reasoning_tokens([1, t, 2, 3, e, 4], False, t, e) == 2
    assert count_reasoning_tokens([1, 2, e, 4, t, 5], True, t, e) == 3
    assert count_reasoning_tokens([1, 2], False, t, e) == 0


def test_usage_reports_reasoning_tokens(client, engine):
    from thinkspec import LLM, SamplingParams

    resp = client.post(CHAT, json=chat(max_tokens=16), headers=auth()).json()
    # Reference: the same greedy request offline, its token ids counted by hand.
    llm = LLM(str(tiny_checkpoint("qwen3", tied=True)), device="cpu", reasoning_parser="qwen3")
    out = llm.chat(chat()["messages"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    assert ids.count(THINK_ID) >= 1
    expected = count_reasoning_tokens(ids, True, THINK_ID, END_THINK_ID)  # qwen3 starts thinking
    assert 0 < expected < len(ids)
    assert resp["usage"]["completion_tokens"] == len(ids)
    assert resp["usage"]["completion_tokens_details"] == {"reasoning_tokens": expected}


def test_assistant_turn_sent_back_with_either_name(client):
    for name in ("reasoning", "reasoning_content"):
        turn = {"role": "assistant", "content": "a", name: "r", "refusal": None, "tool_calls": None}
        body = chat(messages=[{"role": "user", "content": "q"}, turn, {"role": "user", "content": "q30"}])
        assert client.post(CHAT, json=body, headers=auth()).status_code == 200


def test_models_retrieve_names_and_keys(client):
    listed = client.get("/v1/models", headers=auth(KEYS[1])).json()["data"]
    assert [m["id"] for m in listed] == list(NAMES)
    card = client.get(f"/v1/models/{NAMES[1]}", headers=auth()).json()
    assert card["id"] == NAMES[1] and card["object"] == "model"
    missing = client.get("/v1/models/gpt-5", headers=auth())
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    r = client.post(CHAT, json=chat(model=NAMES[1]), headers=auth(KEYS[1]))
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]
    assert client.get("/v1/models", headers=auth("sk-three")).status_code == 401
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401


def test_tokenize_detokenize_version_ping(client, engine):
    tok = client.post("/tokenize", json={"prompt": "hello", "return_token_strs": True}, headers=auth()).json()
    assert tok["count"] == len(tok["tokens"]) == 5 and len(tok["token_strs"]) == 5
    assert tok["max_model_len"] == engine.engine.max_model_len
    back = client.post("/detokenize", json={"tokens": tok["tokens"]}, headers=auth()).json()
    assert back == {"prompt": "hello"}
    templated = engine.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=False
    )
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                       "add_generation_prompt": False}, headers=auth())  # fmt: skip
    assert client.post("/detokenize", json={"tokens": r.json()["tokens"]}, headers=auth()).json() == {
        "prompt": templated
    }
    assert client.get("/version").json() == {"version": __version__}
    assert client.get("/ping").status_code == 200 and client.get("/ping").json() == {"status": "ok"}


def test_api_keys_from_flags_else_environment():
    ns = argparse.Namespace
    env = {"THINKSPEC_API_KEY": "a", "VLLM_API_KEY": "b"}
    assert api_keys(ns(api_key=["x", "y"]), env) == ["x", "y"]
    assert api_keys(ns(api_key=None), env) == ["a"]
    assert api_keys(ns(api_key=None), {"VLLM_API_KEY": "b"}) == ["b"]
    assert api_keys(ns(api_key=None), {"THINKSPEC_API_KEY": ""}) == []


# ---- a real server and the official client ------------------------------------------------------


@pytest.fixture(scope="module")
def toy_server(tmp_path_factory):
    from transformers import AutoTokenizer

    from thinkspec.model_names import TOY_MODELS

    template = AutoTokenizer.from_pretrained(str(TOY_MODELS["toy-reasoner"])).chat_template
    template_file = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template_file.write_text("{{- 'Be brief.' -}}" + template)
    env_key = "sk-from-env"
    with contextlib.ExitStack() as stack:
        stack.enter_context(pytest.MonkeyPatch.context()).setenv("VLLM_API_KEY", env_key)
        proc, url, _ = stack.enter_context(serve_process(
            "--model", "toy-reasoner", "--device", "cpu", "--reasoning-parser", "qwen3", "-tp", "1",
            "--served-model-name", "toy", "toy-2", "--chat-template", str(template_file),
            "--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512",
        ))  # fmt: skip
        yield url, env_key, template_file
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)


def test_official_client_end_to_end(toy_server):
    url, key, template_file = toy_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
    messages = [
        {"role": "user", "content": "Max has 608 books. He gets 350 more. How many books does Max have now?"}
    ]
    kw = dict(model="toy-2", max_tokens=24, temperature=0.0)
    resp = client.chat.completions.create(messages=messages, store=True, metadata={"run": "1"},
                                          parallel_tool_calls=False, **kw)  # fmt: skip
    msg = resp.choices[0].message
    assert msg.reasoning and msg.reasoning == msg.reasoning_content  # the toy thinks first
    assert 0 < resp.usage.completion_tokens_details.reasoning_tokens <= resp.usage.completion_tokens
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    joined = {
        name: "".join(getattr(c.choices[0].delta, name, None) or "" for c in chunks if c.choices)
        for name in ("reasoning", "reasoning_content", "content")
    }
    assert joined == {
        "reasoning": msg.reasoning,
        "reasoning_content": msg.reasoning,
        "content": msg.content or "",
    }

    second = [*messages, msg.model_dump(), {"role": "user", "content": "And 5 more?"}]
    assert client.chat.completions.create(messages=second, **kw).choices[0].finish_reason in (
        "stop",
        "length",
    )

    assert client.models.retrieve("toy").id == "toy"
    assert [m.id for m in client.models.list().data] == ["toy", "toy-2"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()

    import httpx
    from transformers import AutoTokenizer

    from thinkspec.model_names import TOY_MODELS

    headers = {"Authorization": f"Bearer {key}"}
    tok = httpx.post(f"{url}/tokenize", json={"model": "toy", "messages": messages}, headers=headers).json()
    reference = AutoTokenizer.from_pretrained(str(TOY_MODELS["toy-reasoner"]))
    reference.chat_template = Path(template_file).read_text()
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("Be brief.")  # the --chat-template file is the one used
    assert tok["tokens"] == reference.encode(text, add_special_tokens=False) and tok["max_model_len"] == 512
    back = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}, headers=headers).json()
    assert back == {"prompt": text}


def _sample(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, name
    return values[0]


def test_latency_kv_and_prefix_cache_metrics(client):
    before = client.get("/metrics").text
    body = chat(messages=[{"role": "user", "content": "a long shared prefix " * 4}], max_tokens=6)
    for _ in range(2):  # the second request finds the first one's prompt blocks in the prefix cache
        assert client.post(CHAT, json=body, headers=auth()).status_code == 200
    with client.stream("POST", CHAT, json={**body, "stream": True}, headers=auth()) as r:
        assert sum(1 for _ in r.iter_lines()) > 3
    after = client.get("/metrics").text

    def delta(name: str) -> float:
        return _sample(after, name) - _sample(before, name)

    assert delta("thinkspec:time_to_first_token_seconds_count") == 3
    assert delta("thinkspec:e2e_request_latency_seconds_count") == 3
    assert delta("thinkspec:inter_token_latency_seconds_count") >= 3  # 6 tokens each, several steps
    assert delta("thinkspec:e2e_request_latency_seconds_sum") > 0
    assert delta("thinkspec:prefix_cache_queries_total") >= 3 * 80
    assert delta("thinkspec:prefix_cache_hits_total") >= 2 * 64
    assert 0.0 <= _sample(after, "thinkspec:kv_cache_usage_perc") <= 1.0
