"""Step-fault isolation: an exception inside a step fails the requests that caused it, frees their
KV blocks, and the engine serves everyone else with unchanged outputs (faults.py)."""

from __future__ import annotations

import time

import pytest
from checkpoints import tiny_checkpoint

from thinkspec.engine.engine import LLMEngine
from thinkspec.engine.faults import is_device_failure
from thinkspec.engine_args import EngineArgs
from thinkspec.sampling_params import SamplingParams

PROMPTS = ["q30", "q45", "q3", "q23", "hello", "abc"]
BAD = "r2"  # the request the injected fault follows


def make_engine(mode: str) -> LLMEngine:
    """mode: "plain", "speculative" (the checkpoint drafts for itself) or "async" (async scheduling:
    a fault may hit while a step's tokens are still in flight)."""
    path = tiny_checkpoint("qwen3", tied=True)
    speculative = {"model": str(path), "num_speculative_tokens": 2} if mode == "speculative" else None
    config = EngineArgs(
        model=str(path),
        device="cpu",
        max_model_len=96,
        speculative_config=speculative,
        async_scheduling=mode == "async",
    )
    return LLMEngine(config)


def params(i: int) -> SamplingParams:
    # greedy and seeded rows: each one's tokens depend only on itself, not on the batch
    if i % 2:
        return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)


def run(engine: LLMEngine, max_steps: int = 500) -> dict[str, object]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params(i), f"r{i}")
    final = {}
    for _ in range(max_steps):  # bounded: an engine that stops making progress fails, not hangs
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step(finished_only=True):
            final[out.request_id] = out
    raise AssertionError(f"requests unfinished after {max_steps} steps: {sorted(engine.scheduler.requests)}")


def inject(engine: LLMEngine, error: Exception, after_calls: int = 2) -> None:
    """Make the target model runner raise `error` in every forward that includes request BAD,
    from its `after_calls`-th such forward on (so BAD fails mid-decode, others share its batches)."""
    runner = engine.model_runner
    real = runner.execute_model
    seen = {"n": 0}

    def execute_model(seqs, *args, **kwargs):
        if any(s.request_id == BAD for s in seqs):
            seen["n"] += 1
            if seen["n"] >= after_calls:
                raise error
        return real(seqs, *args, **kwargs)

    runner.execute_model = execute_model


@pytest.mark.parametrize("mode", ["plain", "speculative", "async"])
@pytest.mark.parametrize(
    "error, status",
    [(RuntimeError("kernel exploded"), 500), (OverflowError("value too large"), 400)],
    ids=["internal", "input"],
)
def test_fault_fails_only_its_request(mode, error, status):
    reference = run(make_engine(mode))
    engine = make_engine(mode)
    inject(engine, error)
    outputs = run(engine)
    bad = outputs[BAD]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error_status == status and str(error) in bad.error
    for rid, ref in reference.items():
        if rid == BAD:
            continue
        got = outputs[rid].outputs[0]
        assert got.finish_reason == ref.outputs[0].finish_reason == "length"
        assert got.token_ids == ref.outputs[0].token_ids, rid
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.scheduler.requests
    # the next request runs as usual (the fault follows BAD only, which is gone)
    engine.add_request("q30", SamplingParams(temperature=0.0, max_tokens=4), "next")
    done = []
    while engine.has_unfinished_requests():
        done += engine.step(finished_only=True)
    assert [o.outputs[0].finish_reason for o in done] == ["length"]
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("also_forward", [False, True], ids=["commit", "forward-and-commit"])
def test_fault_while_committing_an_async_step(also_forward):
    """A failure in the middle of committing a step in flight (its tokens already taken off the
    queue) leaves the other requests' pending tokens undelivered: they are sampled again, and
    every request but the cause finishes as without the fault. With also_forward the cause's
    forward fails first, while a step holding its token is still in flight: committing that step
    fails too, and must not be charged to whichever request is probed first."""
    reference = run(make_engine("async"))
    engine = make_engine("async")
    if also_forward:
        inject(engine, RuntimeError("kernel exploded"))
    commit = engine.scheduler.commit
    seen = {"n": 0}

    def failing_commit(seq, token_ids):
        if seq.request_id == BAD:
            seen["n"] += 1
            # with also_forward: from its first commit, so the step in flight at the forward's
            # failure cannot be committed
            if seen["n"] >= (1 if also_forward else 3):
                raise RuntimeError("commit failed")
        return commit(seq, token_ids)

    engine.scheduler.commit = failing_commit
    outputs = run(engine)
    assert outputs[BAD].outputs[0].finish_reason == "error"
    for rid, ref in reference.items():
        if rid != BAD:
            assert outputs[rid].outputs[0].token_ids == ref.outputs[0].token_ids, rid
    assert engine.block_manager.num_used_blocks == 0


def test_input_fault_found_by_recheck_is_a_400():
    """A stop token id the engine cannot index (slipped past add_request) is attributed to the
    input: 400 naming the field."""
    engine = make_engine("plain")
    engine.add_request("q30", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4), "ok")
    engine.add_request("q45", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4), BAD)
    engine.scheduler.requests[BAD].sampling_params.stop_token_ids = [10**6]
    real = engine.model_runner.execute_model

    def execute_model(seqs, *args, **kwargs):
        for s in seqs:
            if any(t >= 10**6 for t in s.sampling_params.stop_token_ids):
                raise IndexError("index 1000000 is out of bounds")
        return real(seqs, *args, **kwargs)

    engine.model_runner.execute_model = execute_model
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            outs[out.request_id] = out
    assert outs[BAD].error_status == 400 and "stop_token_ids=1000000" in outs[BAD].error
    assert outs["ok"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


def test_device_failure_is_not_isolated():
    engine = make_engine("plain")
    inject(engine, RuntimeError("CUDA error: an illegal memory access was encountered"), after_calls=1)
    engine.add_request("q30", SamplingParams(temperature=0.0, max_tokens=4), BAD)
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()


def test_is_device_failure():
    assert is_device_failure(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_device_failure(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"))
    assert not is_device_failure(RuntimeError("shape mismatch"))
    assert not is_device_failure(OverflowError("int too large to convert to float"))


def test_server_answers_a_fault_in_openai_shape_and_stays_up():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from thinkspec.entrypoints.async_engine import AsyncLLMEngine
    from thinkspec.entrypoints.openai.server import build_app
    from thinkspec.entrypoints.openai.serving import ServingConfig

    llm_engine = make_engine("plain")
    real = llm_engine.model_runner.execute_model
    faults = {
        "boom": RuntimeError("kernel exploded"),
        "huge": OverflowError("Python int too large to convert to C long"),
        "gone": RuntimeError("CUDA error: unspecified launch failure"),
    }

    def execute_model(seqs, *args, **kwargs):
        for s in seqs:
            if s.prompt in faults:
                raise faults[s.prompt]
        return real(seqs, *args, **kwargs)

    llm_engine.model_runner.execute_model = execute_model
    engine = AsyncLLMEngine(llm_engine)
    engine.start()
    try:
        client = TestClient(build_app(engine, ServingConfig("tiny", 16)))
        body = {"prompt": "q30", "max_tokens": 4, "temperature": 0.0}
        ok = client.post("/v1/completions", json=body).json()
        r = client.post("/v1/completions", json={**body, "prompt": "boom"})
        assert r.status_code == 500
        assert (
            r.json()["error"]["code"] == "engine_error" and "kernel exploded" in r.json()["error"]["message"]
        )
        with client.stream("POST", "/v1/completions", json={**body, "prompt": "boom", "stream": True}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "kernel exploded" in events[-2]
        r = client.post("/v1/completions", json={**body, "prompt": "huge"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input"
        assert client.get("/health").status_code == 200
        again = client.post("/v1/completions", json=body).json()
        assert again["choices"] == ok["choices"]
        # the engine thread publishes its stats after the step that ends the request, which can come
        # after the response: wait for it (bounded)
        deadline = time.monotonic() + 10.0
        while engine.stats.num_kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats.num_kv_blocks_used == 0
        # a device failure is reported as such: 503, and /health says why
        r = client.post("/v1/completions", json={**body, "prompt": "gone"})
        assert r.status_code == 503 and "CUDA error" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "CUDA error" in health.json()["error"]["message"]
    finally:
        engine.shutdown()
