"""Load on a real CPU server with the bundled toy model: 200 concurrent streams, 50 of which
disconnect at random points. Every other stream completes with the answer the same request gets
alone, and [DONE]; afterwards no KV block is held and the abort counter moved by exactly the
number of disconnects."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from test_server import metric, wait_idle
from test_server_drain import toy_server

httpx = pytest.importorskip("httpx")

NUM_STREAMS, NUM_DROPS = 200, 50
MAX_TOKENS = 6
QUESTIONS = [
    f"What is {a} + {b}?" for a, b in ((12, 7), (3, 4), (25, 17), (8, 9), (40, 2), (6, 6), (11, 30), (5, 13))
]
SUCCESS = "thinkspec:request_success_total"


def chat_body(question: str, stream: bool, drop: bool = False) -> dict:
    return {
        "messages": [{"role": "user", "content": question}],
        # dropped streams must still be running when they are dropped
        "max_tokens": 200 if drop else MAX_TOKENS,
        "ignore_eos": drop,
        "temperature": 0.0,
        "stream": stream,
    }


async def one_stream(http, question: str, drop_after: int | None) -> dict:
    """Read one stream; with drop_after, leave after that many events (0: right after the headers)."""
    events: list[str] = []
    async with http.stream(
        "POST", "/v1/chat/completions", json=chat_body(question, True, drop_after is not None)
    ) as r:
        assert r.status_code == 200
        if drop_after == 0:
            return {"events": events}
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if drop_after is not None and len(events) >= drop_after:
                    break  # leaving the block closes the connection mid-stream
    return {"events": events}


def joined(events: list[str]) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a stream's chunks."""
    reasoning, content, finish = "", "", None
    for event in events:
        choice = json.loads(event)["choices"][0]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_200_streams_with_50_random_disconnects():
    rng = random.Random(20261130)
    drops = set(rng.sample(range(NUM_STREAMS), NUM_DROPS))
    plan = [
        (QUESTIONS[i % len(QUESTIONS)], rng.randint(0, 5) if i in drops else None) for i in range(NUM_STREAMS)
    ]
    with toy_server("--reasoning-parser", "deepseek_r1", "--max-num-seqs", "64") as (_, url, log_text):
        # the answer each question gets alone
        reference = {}
        for question in QUESTIONS:
            r = httpx.post(f"{url}/v1/chat/completions", json=chat_body(question, False), timeout=60)
            message = r.json()["choices"][0]["message"]
            reference[question] = (message["reasoning_content"] or "", message["content"] or "")
        before = wait_idle(url)

        async def main() -> list[dict]:
            limits = httpx.Limits(max_connections=NUM_STREAMS + 10, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
                return await asyncio.gather(*(one_stream(http, q, d) for q, d in plan))

        results = asyncio.run(main())
        for (question, drop_after), result in zip(plan, results):
            events = result["events"]
            if drop_after is not None:
                assert "[DONE]" not in events
                continue
            assert events[-1] == "[DONE]", events
            reasoning, content, finish = joined(events[:-1])
            assert finish in ("length", "stop")
            assert (reasoning, content) == reference[question], question

        after = wait_idle(url)  # no request left, no KV block held
        assert metric(after, "thinkspec:kv_blocks_used") == 0
        moved = {
            k: metric(after, SUCCESS, finished_reason=k) - metric(before, SUCCESS, finished_reason=k)
            for k in ("stop", "length", "abort")
        }
        assert moved["abort"] == NUM_DROPS, (moved, log_text())
        assert moved["stop"] + moved["length"] == NUM_STREAMS - NUM_DROPS
        assert httpx.get(f"{url}/health").status_code == 200
