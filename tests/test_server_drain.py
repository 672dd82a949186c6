"""Graceful drain of a real `thinkspec serve` process (drain.py): after SIGTERM new requests get
503, requests in flight may finish for --shutdown-timeout seconds, the rest end cleanly (503 /
error event + [DONE]), and the process exits with status 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from server_process import serve_process  # noqa: E402

from thinkspec.model_names import TOY_MODELS  # noqa: E402

SHUTDOWN_TIMEOUT_S = 3.0


@contextlib.contextmanager
def toy_server(*args: str):
    """`thinkspec serve toy-reasoner` on a free loopback port: yields (process, base URL, log reader)."""
    if not (TOY_MODELS["toy-reasoner"] / "config.json").is_file():
        pytest.skip("the bundled toy checkpoint is not installed")
    with serve_process("toy-reasoner", "--device", "cpu", *args) as running:
        yield running


def body(max_tokens: int, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": "What is 12 + 7?"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }


async def read_stream(http, payload: dict, started: asyncio.Event, sent: dict) -> dict:
    events, after_signal = [], 0
    async with http.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                after_signal += "at" in sent
                if len(events) >= 2:
                    started.set()
    return {"events": events, "after_signal": after_signal, "end": time.monotonic()}


def test_sigterm_drains_then_ends_the_rest_and_exits_0():
    with toy_server("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)) as (proc, url, log_text):

        async def main():
            sent: dict = {}
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                long_started, short_started = asyncio.Event(), asyncio.Event()
                long_stream = asyncio.create_task(read_stream(http, body(400, True), long_started, sent))
                short_stream = asyncio.create_task(read_stream(http, body(24, True), short_started, sent))
                long_plain = asyncio.create_task(http.post("/v1/chat/completions", json=body(400, False)))
                await asyncio.wait_for(asyncio.gather(long_started.wait(), short_started.wait()), 60)
                proc.send_signal(signal.SIGTERM)
                sent["at"] = time.monotonic()
                # new requests are refused in OpenAI shape as soon as the signal is handled, long
                # before the drain timeout
                for _ in range(20):
                    refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                    if refused.status_code == 503:
                        break
                    await asyncio.sleep(0.02)
                sent["refused"] = time.monotonic()
                return sent, refused, await long_stream, await short_stream, await long_plain

        sent, refused, long_stream, short_stream, long_plain = asyncio.run(main())
        assert refused.status_code == 503, refused.text
        assert sent["refused"] - sent["at"] < SHUTDOWN_TIMEOUT_S / 2
        assert refused.json()["error"]["code"] == "server_shutting_down"
        # the short one was in flight at the signal and finished normally
        assert short_stream["after_signal"] > 0
        assert short_stream["events"][-1] == "[DONE]"
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in short_stream["events"][:-1]]
        assert finish[-1] == "length"
        # the long ones were given the drain time, then ended cleanly
        assert long_stream["end"] - sent["at"] >= SHUTDOWN_TIMEOUT_S - 0.5
        assert long_stream["events"][-1] == "[DONE]"
        error = json.loads(long_stream["events"][-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
        assert long_plain.status_code == 503
        assert long_plain.json()["error"]["code"] == "server_shutting_down"
        assert proc.wait(30) == 0, log_text()


def test_sigint_when_idle_exits_0_at_once():
    with toy_server() as (proc, url, log_text):
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log_text()
        assert time.monotonic() - start < 10


def test_second_sigterm_ends_requests_in_flight_and_exits_at_once():
    """A second signal while draining: what is in flight ends now with its 503 / error event (not
    a plain-text 500), and the process exits 0 without waiting for --shutdown-timeout."""
    with toy_server("--shutdown-timeout", "60") as (proc, url, log_text):

        async def main():
            sent: dict = {}
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                started = asyncio.Event()
                stream = asyncio.create_task(read_stream(http, body(400, True), started, sent))
                plain = asyncio.create_task(http.post("/v1/chat/completions", json=body(400, False)))
                await asyncio.wait_for(started.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                sent["at"] = time.monotonic()
                await asyncio.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
                sent["second"] = time.monotonic()
                return sent, await stream, await plain

        sent, stream, plain = asyncio.run(main())
        assert proc.wait(10) == 0, log_text()
        assert time.monotonic() - sent["second"] < 5
        assert stream["end"] - sent["second"] < 2
        assert stream["events"][-1] == "[DONE]"
        assert json.loads(stream["events"][-2])["error"]["code"] == "server_shutting_down"
        assert plain.status_code == 503, plain.text
        assert plain.json()["error"]["code"] == "server_shutting_down"
