"""Property-based fuzzing of the OpenAI endpoints: generated chat and completions bodies (valid and
invalid types, extreme numbers, odd unicode, missing and extra fields) against the real app and
engine. No body may get a 5xx (nor a server_error event inside a 200 stream), and the engine is
healthy and idle afterwards.

Deterministic (derandomize) and without an example database, so CI runs the same examples every
time; THINKSPEC_FUZZ_EXAMPLES=N runs N random examples instead (a longer local search).
"""

from __future__ import annotations

import json
import os
import time

import pytest
from checkpoints import tiny_checkpoint

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_process import running_engine  # noqa: E402

from thinkspec.entrypoints.openai.server import build_app  # noqa: E402
from thinkspec.entrypoints.openai.serving import ServingConfig  # noqa: E402

MODEL = "tiny"
EXAMPLES = int(os.environ.get("THINKSPEC_FUZZ_EXAMPLES", "2000"))
JSON = {"Content-Type": "application/json"}

# ---- strategies ----------------------------------------------------------------------------------

EXTREME_INTS = [
    0,
    1,
    -1,
    -2,
    2,
    64,
    65,
    96,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    10**30,
    10**400,
]
EXTREME_FLOATS = [
    0.0,
    -0.0,
    0.5,
    1.0,
    2.0,
    2.0000001,
    1e-300,
    5e-324,
    1e308,
    -1e308,
    float("inf"),
    float("nan"),
]
# all of unicode, lone surrogates included (json.dumps writes them as \ud800-style escapes)
odd_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12)
text = st.one_of(
    st.sampled_from(["", "hi", "q30", "<think>", "</think>", "<|im_end|>", "\x00", "é"]), odd_text
)
ints = st.one_of(st.integers(-3, 40), st.sampled_from(EXTREME_INTS), st.integers())
floats = st.one_of(st.floats(0, 2), st.sampled_from(EXTREME_FLOATS), st.floats())
scalars = st.one_of(st.none(), st.booleans(), ints, floats, text)
wild = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=4,
)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """A plausible value or anything JSON can hold."""
    return st.one_of(valid, wild)


COMMON = {
    "model": maybe(st.sampled_from([MODEL, None, "gpt-4o"]) | text),
    "max_tokens": maybe(st.integers(1, 4) | ints),
    "temperature": maybe(st.floats(0, 2) | floats),
    "top_p": maybe(st.floats(0.01, 1) | floats),
    "n": maybe(st.just(1) | ints),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "stop": maybe(text | st.lists(text, max_size=4)),
    "seed": maybe(ints),
    "frequency_penalty": maybe(st.just(0.0) | floats),
    "presence_penalty": maybe(st.just(0) | floats),
    "user": maybe(text),
    "top_k": maybe(ints),
    "min_p": maybe(st.floats(0, 1) | floats),
    "min_tokens": maybe(st.integers(0, 4) | ints),
    "stop_token_ids": maybe(st.lists(ints, max_size=4)),
    "ignore_eos": maybe(st.booleans()),
    "include_stop_str_in_output": maybe(st.booleans()),
    "skip_special_tokens": maybe(st.booleans()),
    "relaxed_thinking": maybe(st.booleans() | st.none()),
    "relax_ratio": maybe(st.floats(0, 1) | floats),
    "relax_top_k": maybe(st.integers(1, 64) | ints),
    "relax_delta": maybe(st.none() | st.floats(0, 1) | floats),
    "repetition_penalty": maybe(st.just(1.0) | floats),
    "prompt_logprobs": maybe(st.none() | ints),
    "logit_bias": maybe(
        st.dictionaries(
            st.sampled_from(["0", "5", "260", "261", "99999", "-1", "x", ""]) | text, floats, max_size=3
        )
    ),
    "response_format": maybe(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}])
        | st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries(
                    {"name": text, "schema": st.just({"type": "object"}) | wild}, optional={"strict": wild}
                ),
            }
        )
    ),
    "structured_outputs": maybe(
        st.dictionaries(
            st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "x"]), wild, max_size=2
        )
    ),
    "guided_regex": maybe(st.sampled_from(["a+", "[0-9]{2}", "(", "[^\\s\\S]", ""]) | text),
    "guided_choice": maybe(st.lists(text, max_size=3)),
    "guided_json": maybe(st.just({"type": "integer"}) | st.just("{")),
    "guided_grammar": maybe(st.sampled_from(['root ::= "a"', "root ::= x", ""]) | text),
}
part = st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(text)})
message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": maybe(text | st.lists(part, max_size=2)),
    },
    optional={"name": maybe(text), "reasoning_content": maybe(text), "extra": wild},
)
CHAT_FIELDS = {
    **COMMON,
    "max_completion_tokens": maybe(st.integers(1, 4) | ints),
    "logprobs": maybe(st.booleans()),
    "top_logprobs": maybe(st.none() | ints),
    "chat_template_kwargs": maybe(
        st.dictionaries(text, wild, max_size=2) | st.just({"enable_thinking": False})
    ),
}
COMP_FIELDS = {
    **COMMON,
    "logprobs": maybe(st.none() | ints),
    "echo": maybe(st.booleans()),
    "best_of": maybe(st.none() | ints),
}
extra_fields = st.dictionaries(
    st.sampled_from(["frobnicate", "tools", "tool_choice", "response_format", "guided_json", ""]) | text,
    wild | st.sampled_from([[], "none", {"type": "text"}, {"type": "json_object"}]),
    max_size=2,
)


@st.composite
def body(draw, required: dict, fields: dict, max_fields: int = 5, extras: bool = True) -> dict:
    """The required fields, up to max_fields of the optional ones, and sometimes unknown fields."""
    out = {name: draw(strategy) for name, strategy in required.items()}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=max_fields, unique=True)):
        out[name] = draw(fields[name])
    if extras and draw(st.integers(0, 7)) == 0:
        out = {**draw(extra_fields), **out}
    return out


chat_body = body({"messages": maybe(st.lists(message, min_size=1, max_size=3))}, CHAT_FIELDS)
prompt = st.one_of(
    text,
    st.lists(st.integers(0, 300), min_size=1, max_size=6),
    st.lists(ints, max_size=3),
    st.lists(text, max_size=2),
)
comp_body = body({"prompt": maybe(prompt)}, COMP_FIELDS)
# In range field by field, so that most of these reach the engine (some combinations still do not).
plain_text = st.sampled_from(["hi", "q30", "q45", "<think>", "</think>", "é", "a b"])
VALID = {
    "model": st.sampled_from([MODEL, None]),
    "max_tokens": st.integers(1, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stream": st.booleans(),
    "stop": plain_text | st.lists(plain_text, max_size=3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "top_k": st.integers(-1, 300) | st.just(2**62),
    "min_p": st.floats(0, 1),
    "stop_token_ids": st.lists(st.integers(0, 260), max_size=3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "relaxed_thinking": st.booleans() | st.none(),
    "relax_ratio": st.floats(0, 1),
    "relax_top_k": st.integers(1, 64),
    "relax_delta": st.none() | st.floats(0, 1),
    "n": st.integers(1, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "prompt_logprobs": st.none() | st.integers(0, 3),
    "logit_bias": st.dictionaries(st.integers(0, 260).map(str), st.floats(-100, 100), max_size=3),
}
valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": odd_text}
)
valid_chat = body(
    {"messages": st.lists(valid_message, min_size=1, max_size=2)},
    {
        **VALID,
        "chat_template_kwargs": st.just({"enable_thinking": False}),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 3),
    },
    max_fields=8,
    extras=False,
)
valid_comp = body(
    {"prompt": odd_text | st.lists(st.integers(0, 260), min_size=1, max_size=6)},
    {**VALID, "logprobs": st.integers(0, 3), "echo": st.booleans()},
    max_fields=8,
    extras=False,
)
requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), valid_chat),
    st.tuples(st.just("/v1/completions"), valid_comp),
    st.tuples(st.just("/v1/chat/completions"), chat_body),
    st.tuples(st.just("/v1/completions"), comp_body),
    # a required field left out
    st.tuples(st.just("/v1/chat/completions"), body({}, CHAT_FIELDS)),
    st.tuples(st.just("/v1/completions"), body({}, COMP_FIELDS)),
)

# ---- the app -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    path = tiny_checkpoint("qwen3", tied=True)
    spec = {"model": str(path), "num_speculative_tokens": 2, "relaxed_thinking": True}
    args = dict(device="cpu", reasoning_parser="qwen3", max_model_len=96, speculative_config=spec)
    with running_engine(model=str(path), **args) as engine:
        # As a context manager the client keeps one event loop for every request (much faster).
        app = build_app(engine, ServingConfig(MODEL, 2))
        with TestClient(app, raise_server_exceptions=False) as client:
            yield engine, client


def test_no_generated_body_gets_a_5xx(served):
    engine, client = served
    seen = {"total": 0, "ok": 0}

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize="THINKSPEC_FUZZ_EXAMPLES" not in os.environ,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )
    @given(requests)
    def check(request):
        path, payload = request
        content = json.dumps(payload, ensure_ascii=True)  # NaN / Infinity literals included
        r = client.post(path, content=content, headers=JSON)
        seen["total"] += 1
        assert r.status_code < 500, (r.status_code, r.text[:500])
        if r.status_code == 200:
            seen["ok"] += 1
            if r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]")
                assert "server_error" not in r.text, r.text[-500:]
        else:
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"]

    check()
    print(f"{seen['total']} bodies, {seen['ok']} answered 200")
    assert seen["total"] >= EXAMPLES
    assert seen["ok"] > EXAMPLES // 5  # the engine was really exercised, not only the validators

    assert engine.is_healthy and client.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while engine.stats.num_kv_blocks_used or engine.stats.num_running or engine.stats.num_waiting:
        assert time.monotonic() < deadline, engine.stats
        time.sleep(0.05)
    r = client.post("/v1/completions", json={"prompt": "q30", "max_tokens": 2, "temperature": 0.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
