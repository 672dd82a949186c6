"""The OpenAI server end to end: a real `thinkspec serve` process on a loopback port, driven by the
official `openai` client and httpx; plus in-process checks of the metrics and of engine failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from checkpoints import tiny_checkpoint

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from server_process import serve_process  # noqa: E402

from thinkspec.engine.engine import LLMEngine  # noqa: E402
from thinkspec.engine_args import EngineArgs  # noqa: E402
from thinkspec.entrypoints.async_engine import AsyncLLMEngine  # noqa: E402
from thinkspec.entrypoints.openai.server import build_app  # noqa: E402
from thinkspec.entrypoints.openai.serving import ServingConfig  # noqa: E402
from thinkspec.reasoning import get_reasoning_parser  # noqa: E402
from thinkspec.spec_decode.metrics import SpecDecodeMetrics  # noqa: E402

API_KEY = "sk-local"
MODEL = "tiny"
# With the tiny checkpoint some of these prompts make the model write "<think>" mid-answer, so the
# split has both a content part and a reasoning part.
PROMPTS = ["q30", "q45", "q3", "q23"]


@contextlib.contextmanager
def serve(*args: str) -> Iterator[str]:
    """Run `thinkspec serve ARGS` on a free loopback port; yields the base URL; always stops it
    (SIGTERM first, as an operator would)."""
    with serve_process(*args) as (proc, url, _):
        try:
            yield url
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return tiny_checkpoint("qwen3", tied=True)


@pytest.fixture(scope="module")
def server(ckpt) -> Iterator[str]:
    # Speculative decoding with relaxed thinking on; the tiny checkpoint drafts for itself.
    spec = {"model": str(ckpt), "num_speculative_tokens": 3, "relaxed_thinking": True}
    spec.update(relax_ratio=0.3, relax_top_k=3)
    with serve(
        str(ckpt), "--device", "cpu", "--reasoning-parser", "qwen3", "--served-model-name", MODEL,
        "--api-key", API_KEY, "--max-num-seqs", "64", "--speculative-config", json.dumps(spec),
    ) as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metric(text: str, name: str, **labels: str) -> float:
    """Value of one sample in a Prometheus text exposition (0.0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def scrape(url: str) -> str:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def wait_idle(url: str, timeout: float = 30.0) -> str:
    """Poll /metrics until no request runs or waits and no KV block is held; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(url)
        busy = sum(metric(text, f"thinkspec:{n}") for n in ("num_requests_running", "num_requests_waiting"))
        if busy == 0 and metric(text, "thinkspec:kv_blocks_used") == 0:
            return text
        assert time.monotonic() < deadline, f"engine not idle after {timeout} s:\n{text}"
        time.sleep(0.1)


# ---- the openai client --------------------------------------------------------------------------


def test_chat_with_openai_client_split_and_stream(client, ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    parser = get_reasoning_parser("qwen3")
    both = 0
    for prompt, template_kwargs in [(p, None) for p in PROMPTS] + [("q30", {"enable_thinking": False})]:
        messages = [{"role": "user", "content": prompt}]
        extra = {"chat_template_kwargs": template_kwargs} if template_kwargs else None
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0.0, extra_body=extra
        )
        choice = resp.choices[0]
        msg = choice.message
        assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == MODEL
        assert msg.role == "assistant" and choice.finish_reason in ("stop", "length")

        # Reference: the raw completion of the same templated prompt, split by the parser.
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        raw = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=16, temperature=0.0)
        # qwen3 (vLLM's rule): the output starts in reasoning unless enable_thinking is false.
        starts_thinking = (template_kwargs or {}).get("enable_thinking", True)
        assert (msg.reasoning_content, msg.content) == parser.split(raw.choices[0].text, starts_thinking)
        assert resp.usage.prompt_tokens == len(prompt_ids) == raw.usage.prompt_tokens
        assert resp.usage.completion_tokens == raw.usage.completion_tokens <= 16
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
        both += bool(msg.reasoning_content) and bool(msg.content)

        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        chunks = list(stream)
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
        assert chunks[0].choices[0].delta.role == "assistant"
        reasoning = "".join(
            getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
        )
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert reasoning == (msg.reasoning_content or "")
        assert content == (msg.content or "")
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finals == [choice.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == resp.usage.model_dump()
    assert both >= 1, "no prompt produced both reasoning_content and content"


def test_completions_with_openai_client(client):
    resp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0.0)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.choices[0].finish_reason in ("stop", "length")
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=12, temperature=0.0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        resp.choices[0].finish_reason
    ]
    # stop strings are cut from streamed text exactly as from the whole text
    text = resp.choices[0].text
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=12, temperature=0.0, stop=stop
        )
        streamed = client.completions.create(
            model=MODEL, prompt="hello there", max_tokens=12, temperature=0.0, stop=stop, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text == text[: text.index(stop)]


def test_models_and_api_key(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_sampled_request_with_seed_and_relax_overrides(client):
    """Extra body fields are accepted; the same seed gives the same text."""
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "q7"}],
        max_tokens=10,
        temperature=0.8,
        top_p=0.9,
        seed=11,
        extra_body={
            "top_k": 20,
            "relaxed_thinking": True,
            "relax_ratio": 0.3,
            "relax_top_k": 3,
            "min_p": 0.01,
        },
    )
    a = client.chat.completions.create(**kwargs).choices[0].message
    b = client.chat.completions.create(**kwargs).choices[0].message
    assert (a.content, a.reasoning_content) == (b.content, b.reasoning_content)


# ---- concurrency and disconnects ----------------------------------------------------------------


def test_concurrent_streams_with_disconnects(server):
    before = wait_idle(server)
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def one(http: httpx.AsyncClient, i: int, drop: bool) -> dict:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 64 if drop else 12,
            "ignore_eos": drop,  # dropped streams must still be running when they are dropped
            "temperature": 0.0,
            "stream": True,
        }
        events: list[str] = []
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if drop and len(events) == 3:
                    break  # leaving the block closes the connection mid-stream
        return {"drop": drop, "events": events}

    async def main() -> tuple[list[dict], list[int]]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server, timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(one(http, i, i % 5 == 0)) for i in range(50)]
            health = []
            while not all(t.done() for t in tasks):
                health.append((await http.get("/health")).status_code)
                await asyncio.sleep(0.2)
            return [t.result() for t in tasks], health

    results, health = asyncio.run(main())
    assert health and set(health) == {200}
    done = [r for r in results if not r["drop"]]
    assert len(done) == 40
    for r in done:
        assert r["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in r["events"][:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] in (
            ["length"],
            ["stop"],
        )
    assert all(len(r["events"]) == 3 and "[DONE]" not in r["events"] for r in results if r["drop"])

    after = wait_idle(server)  # no KV block stays held
    name = "thinkspec:request_success_total"
    assert metric(after, name, finished_reason="abort") - metric(before, name, finished_reason="abort") == 10
    finished = sum(
        metric(after, name, finished_reason=k) - metric(before, name, finished_reason=k)
        for k in ("stop", "length")
    )
    assert finished == 40
    assert httpx.get(f"{server}/health").status_code == 200


def test_non_streamed_client_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # The same request run to its end first: the client then gives up at a quarter of that time, so
    # the request is still running when it disconnects however fast this machine decodes.
    start = time.monotonic()
    assert httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
    full = time.monotonic() - start
    before = wait_idle(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=full / 4)
    after = wait_idle(server)
    name = "thinkspec:request_success_total"
    assert metric(after, name, finished_reason="abort") - metric(before, name, finished_reason="abort") == 1
    # it was stopped early, not run to its 400 tokens
    generated = metric(after, "thinkspec:generation_tokens_total") - metric(
        before, "thinkspec:generation_tokens_total"
    )
    assert generated < 400


def test_spec_decode_counters_move_by_phase(server, client):
    before = scrape(server)
    # qwen3: thinking on starts in reasoning, thinking off in the answer.
    for prompt, enable in zip(PROMPTS[:2], (True, False)):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0.0,
            extra_body={"chat_template_kwargs": {"enable_thinking": enable}},
        )  # fmt: skip
    after = scrape(server)
    name = "thinkspec:spec_decode_num_draft_tokens_total"
    moved = [metric(after, name, phase=p) - metric(before, name, phase=p) for p in ("thinking", "answer")]
    assert min(moved) > 0, moved
    accepted = "thinkspec:spec_decode_num_accepted_tokens_total"
    assert sum(metric(after, accepted, phase=p) for p in ("thinking", "answer")) > 0
    assert (
        metric(after, "thinkspec:spec_decode_num_accepted_tokens_per_pos_total", phase="answer", position="0")
        > 0
    )


def test_metrics_exposition_names(server):
    text = scrape(server)
    for name in (
        "thinkspec:request_success_total",
        "thinkspec:prompt_tokens_total",
        "thinkspec:generation_tokens_total",
        "thinkspec:num_requests_running",
        "thinkspec:num_requests_waiting",
        "thinkspec:kv_blocks_used",
        "thinkspec:kv_blocks_free",
        "thinkspec:engine_healthy",
    ):
        assert re.search(rf"^{re.escape(name)}[ {{]", text, re.MULTILINE), name
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_relaxed_accepted_tokens"):
        for phase in ("thinking", "answer"):
            assert f'thinkspec:spec_decode_{key}_total{{phase="{phase}"}}' in text
    assert metric(text, "thinkspec:prompt_tokens_total") > 0
    assert metric(text, "thinkspec:generation_tokens_total") > 0


# ---- in process: speculative counters and engine failure ----------------------------------------


@pytest.fixture()
def local_engine(ckpt):
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(ckpt), device="cpu", reasoning_parser="qwen3")))
    yield engine
    engine.shutdown()


def test_spec_decode_counters_exact(local_engine, monkeypatch):
    """/metrics shows exactly the engine's cumulative SpecDecodeMetrics, by phase and position; fed
    here by hand (random verify steps, one per engine step) so every count is known."""
    llm_engine = local_engine.engine
    monkeypatch.setattr(LLMEngine, "spec_metrics", SpecDecodeMetrics())
    step = llm_engine.step
    rng = np.random.default_rng(0)
    k = 3

    def step_and_observe():
        outputs = step()
        b = 2
        drafted = rng.integers(0, k + 1, size=b)
        accepted = np.minimum(drafted, rng.integers(0, k + 1, size=b))
        relaxed = rng.random((b, k)) < 0.5
        thinking = np.array([[True] * k, [False] * k])
        llm_engine.spec_metrics.observe(drafted, accepted, relaxed, thinking)
        # adaptive_k's chosen draft lengths, three decode rows (one a plain row when k = 0)
        llm_engine.spec_metrics.observe_draft_lengths(
            rng.integers(0, k + 1, size=3), np.array([1, 1, 0], bool)
        )
        return outputs

    llm_engine.step = step_and_observe
    local_engine.start()
    client = TestClient(build_app(local_engine, ServingConfig(MODEL, 32)))
    body = {"prompt": "hi", "max_tokens": 5, "temperature": 0.0}

    def exposed() -> dict:
        text = client.get("/metrics").text
        out = {}
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_relaxed_accepted_tokens"):
            for phase in ("thinking", "answer"):
                out[key, phase] = metric(text, f"thinkspec:spec_decode_{key}_total", phase=phase)
        for phase in ("thinking", "answer"):
            for pos in range(k):
                out["per_pos", phase, pos] = metric(
                    text,
                    "thinkspec:spec_decode_num_accepted_tokens_per_pos_total",
                    phase=phase,
                    position=str(pos),
                )
            for le in [*map(str, range(k + 1)), "+Inf"]:
                name = "thinkspec:spec_decode_draft_length_bucket"
                out["draft_length", phase, le] = metric(text, name, le=le, phase=phase)
            out["draft_length_sum", phase] = metric(
                text, "thinkspec:spec_decode_draft_length_sum", phase=phase
            )
        return out

    def expected() -> dict:
        spec = llm_engine.spec_metrics
        out = {}
        for phase in ("thinking", "answer"):
            counters = spec.phase(phase)
            for key in (
                "num_drafts",
                "num_draft_tokens",
                "num_accepted_tokens",
                "num_relaxed_accepted_tokens",
            ):
                out[key, phase] = float(getattr(counters, key))
            per_pos = counters.num_accepted_tokens_per_pos
            for pos in range(k):
                out["per_pos", phase, pos] = float(per_pos[pos] if pos < len(per_pos) else 0)
            hist = counters.draft_length_histogram
            for le in range(k + 1):  # cumulative buckets up to the largest length seen so far
                out["draft_length", phase, str(le)] = float(sum(hist[: le + 1])) if le < len(hist) else 0.0
            out["draft_length", phase, "+Inf"] = float(sum(hist))
            out["draft_length_sum", phase] = float(sum(i * c for i, c in enumerate(hist)))
        return out

    assert all(v == 0 for v in exposed().values())

    def settled() -> dict:
        # /metrics reads the stats the engine thread publishes after each step; the step that ends a
        # request can come after its response: wait (bounded) until they match the engine's counters
        deadline = time.monotonic() + 10.0
        while (now := exposed()) != expected() and time.monotonic() < deadline:
            time.sleep(0.01)
        return now

    assert client.post("/v1/completions", json=body).status_code == 200
    first = settled()
    assert first == expected()
    assert first["num_draft_tokens", "thinking"] > 0 and first["num_draft_tokens", "answer"] > 0
    assert first["draft_length", "thinking", "+Inf"] > 0 and first["draft_length", "answer", "+Inf"] > 0
    assert client.post("/v1/completions", json=body).status_code == 200
    second = settled()
    assert second == expected()
    assert second["num_drafts", "thinking"] > first["num_drafts", "thinking"]
    assert all(second[key] >= first[key] for key in first)


def test_engine_step_failure_fails_requests_and_health(local_engine):
    llm_engine = local_engine.engine
    step = llm_engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] >= 3:
            raise RuntimeError("device fell over")
        return step()

    llm_engine.step = failing_step
    local_engine.start()
    client = TestClient(build_app(local_engine, ServingConfig(MODEL, 32)), raise_server_exceptions=False)
    assert client.get("/health").status_code == 200

    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "temperature": 0.0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "device fell over" in error["message"] and error["type"] == "server_error"

    health = client.get("/health")
    assert health.status_code == 503 and "device fell over" in health.json()["error"]["message"]
    assert metric(client.get("/metrics").text, "thinkspec:engine_healthy") == 0
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_closing_generate_early_aborts_and_frees_blocks(local_engine):
    from thinkspec.sampling_params import SamplingParams

    llm_engine = local_engine.engine
    aborted: list[tuple[str, int]] = []
    abort = llm_engine.abort_request

    def spy_abort(request_id):
        seq = llm_engine.scheduler.requests.get(request_id)
        aborted.append((request_id, -1 if seq is None else seq.num_output_tokens))
        abort(request_id)

    llm_engine.abort_request = spy_abort
    local_engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def main() -> int:
        gen = local_engine.generate("hello", params, "early-close")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()
        return len(out.outputs[0].token_ids)

    assert asyncio.run(main()) < 300
    deadline = time.monotonic() + 10
    while local_engine.stats.num_kv_blocks_used or local_engine.stats.num_running:
        assert time.monotonic() < deadline, local_engine.stats
        time.sleep(0.05)
    assert local_engine.is_healthy
    # aborted while still running, long before its 300 tokens
    assert len(aborted) == 1 and aborted[0][0] == "early-close" and 0 < aborted[0][1] < 300


def test_add_failure_fails_one_request_only(local_engine):
    """An exception inside LLMEngine.add_request answers that request and leaves the engine up."""
    llm_engine = local_engine.engine
    add = llm_engine.add_request

    def picky_add(prompt, params, request_id):
        if params.max_tokens == 3:
            raise TypeError("unexpected prompt")
        return add(prompt, params, request_id)

    llm_engine.add_request = picky_add
    local_engine.start()
    client = TestClient(build_app(local_engine, ServingConfig(MODEL, 32)), raise_server_exceptions=False)
    bad = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0.0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200


# ---- the bundled toy pair with speculative decoding ---------------------------------------------


@pytest.mark.slow
def test_toy_pair_speculative_relaxed_stream_matches():
    from thinkspec.model_names import TOY_MODELS
    from thinkspec.toy.task import generate_samples

    missing = [name for name, path in TOY_MODELS.items() if not (path / "config.json").is_file()]
    assert not missing, f"bundled toy checkpoints missing: {missing}"
    prompt = generate_samples(1, seed=20261130)[0].prompt  # "<|im_start|>user\n{question}<|im_end|>..."
    question = prompt.removeprefix("<|im_start|>user\n").split("<|im_end|>")[0]
    messages = [{"role": "user", "content": question}]
    spec = {"model": "toy-reasoner-draft", "num_speculative_tokens": 4, "relaxed_thinking": True}
    spec.update(relax_ratio=0.3, relax_top_k=3)
    with serve(
        "toy-reasoner", "--device", "cpu", "--reasoning-parser", "qwen3", "--served-model-name", MODEL,
        "--speculative-config", json.dumps(spec),
    ) as url:  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=0.0)
        msg = resp.choices[0].message
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=400, temperature=0.0, stream=True
            )
        )
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert msg.reasoning_content and reasoning == msg.reasoning_content
        assert msg.content and "**Answer:**" in msg.content and content == msg.content
        assert "<think>" not in msg.content and "**Answer:**" not in msg.reasoning_content
        text = scrape(url)
        assert metric(text, "thinkspec:spec_decode_num_relaxed_accepted_tokens_total", phase="thinking") > 0
        assert metric(text, "thinkspec:spec_decode_num_relaxed_accepted_tokens_total", phase="answer") == 0
        assert metric(text, "thinkspec:spec_decode_num_draft_tokens_total", phase="thinking") > 0
        assert metric(text, "thinkspec:spec_decode_num_drafts_total", phase="thinking") > 0


def test_thinking_token_budget_through_extra_body(client):
    messages = [{"role": "user", "content": PROMPTS[0]}]

    def ask(budget, max_tokens):
        extra = {} if budget is None else {"thinking_token_budget": budget}
        return (
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0.0, extra_body=extra
            )
            .choices[0]
            .message
        )

    assert ask(None, 40).content is None  # unforced, this model never closes its thought
    first20 = ask(None, 20).reasoning_content
    assert first20 and ask(20, 20).reasoning_content == first20  # nothing forced before the budget
    cut = ask(20, 21)  # the 21st token is </think>: no content yet (it may flush held-back bytes)
    assert cut.reasoning_content.startswith(first20) and cut.content is None
    more = ask(20, 40)
    assert more.reasoning_content == cut.reasoning_content and more.content  # then the answer


def test_large_bodies_are_tokenized_off_the_event_loop(server):
    """Large chat and /tokenize bodies (each about 0.9 MB, a second or so of tokenizing) arrive while
    streams run: no stream waits 0.5 s between two events, nor /health 0.5 s for its answer."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = "What is 12 + 7? " * 55_000  # under the default 1 MiB body limit

    async def streams(stop: asyncio.Event) -> list[float]:
        gaps: list[float] = []
        body = {"model": MODEL, "prompt": "q30", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=60) as http:
            while not stop.is_set():
                last = None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            now = time.monotonic()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
        return gaps

    async def health(stop: asyncio.Event) -> list[float]:
        waits: list[float] = []
        async with httpx.AsyncClient(base_url=server, timeout=60) as http:
            while not stop.is_set():
                start = time.monotonic()
                assert (await http.get("/health")).status_code == 200
                waits.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
        return waits

    async def main() -> tuple[list[float], list[float], list[int]]:
        stop = asyncio.Event()
        watchers = asyncio.gather(streams(stop), health(stop))
        await asyncio.sleep(0.3)  # the first stream is running
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=120) as http:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 2}
            sent = [http.post("/v1/chat/completions", json=chat) for _ in range(4)]
            sent.append(http.post("/tokenize", json={"prompt": big}))
            answers = await asyncio.gather(*sent)
        stop.set()
        gaps, waits = await watchers
        return gaps, waits, [a.status_code for a in answers]

    gaps, waits, statuses = asyncio.run(main())
    assert statuses == [400] * 4 + [200]  # the chat prompts are too long for the model, once tokenized
    assert len(gaps) > 20 and len(waits) > 5
    assert max(gaps) < 0.5, sorted(gaps)[-5:]
    assert max(waits) < 0.5, sorted(waits)[-5:]
