"""async_scheduling: a plain decode step launched before the previous step's tokens are committed
gives the same outputs as stepping synchronously (fp32, CPU, where the overlap is forced on)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import tiny_checkpoint
from test_engine import assert_all_blocks_free, bytes_per_block, random_ids

from thinkspec import LLM, SamplingParams
from thinkspec.engine.engine import LLMEngine, overlaps
from thinkspec.engine.sequence import PENDING_TOKEN
from thinkspec.engine_args import EngineArgs


def _llm(path, async_scheduling: bool, **kw) -> LLM:
    return LLM(str(path), device="cpu", seed=0, async_scheduling=async_scheduling, **kw)


def _count_run_ahead(engine: LLMEngine) -> list[int]:
    """Counts execute_model calls that took the previous step's tokens on the device."""
    calls = [0]
    original = engine.model_runner.execute_model

    def execute_model(*args, **kwargs):
        calls[0] += kwargs.get("device_inputs") is not None
        return original(*args, **kwargs)

    engine.model_runner.execute_model = execute_model
    return calls


def _pair(path, **kw) -> tuple[LLM, LLM]:
    return _llm(path, False, **kw), _llm(path, True, **kw)


def test_defaults_and_validation():
    path = tiny_checkpoint("qwen3", tied=False)
    assert not LLM(str(path), device="cpu").llm_engine.async_scheduling  # off on CPU unless asked
    assert _llm(path, True).llm_engine.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
        EngineArgs("some/model", async_scheduling="yes")


def test_greedy_equal_with_chunking_prefix_cache_and_preemption():
    path = tiny_checkpoint("qwen3", tied=False)
    block_size, num_blocks = 4, 24
    kw = dict(
        block_size=block_size, max_num_seqs=4, max_num_batched_tokens=24,
        kv_cache_memory=num_blocks * bytes_per_block(path, block_size),
    )  # fmt: skip
    sync, overlap = _pair(path, **kw)
    ahead = _count_run_ahead(overlap.llm_engine)
    shared = random_ids(20, seed=1)
    prompts = [shared + random_ids(3, 2), shared + random_ids(17, 3), random_ids(5, 4), random_ids(30, 5)]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (14, 3, 21, 9)]
    for _ in range(2):  # the second round reuses cached prefix blocks
        want = sync.generate(prompts, params, use_tqdm=False)
        got = overlap.generate(prompts, params, use_tqdm=False)
        for a, b in zip(got, want):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
            assert a.metrics.num_generated_tokens == len(a.outputs[0].token_ids)
    assert overlap.llm_engine.num_preemptions > 0 and sync.llm_engine.num_preemptions > 0
    assert ahead[0] > 10
    assert_all_blocks_free(overlap.llm_engine)


def test_sampling_stops_and_min_tokens_equal():
    path = tiny_checkpoint("qwen3", tied=False)
    sync, overlap = _pair(path, max_num_seqs=8)
    prompts = [random_ids(n, seed=30 + n) for n in (4, 9, 13, 6)]
    probe = sync.generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    stop_id = probe[0].outputs[0].token_ids[5]  # a token greedy decoding emits mid-way
    text = probe[0].outputs[0].text
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=8, stop_token_ids=[stop_id], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop=[text[4:6]] if len(text) >= 6 else None),
    ]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlap.generate(prompts, params, use_tqdm=False)
    assert want[0].outputs[0].finish_reason == "stop" and want[0].outputs[0].token_ids[-1] == stop_id
    for a, b in zip(got, want):
        assert (a.outputs[0].token_ids, a.outputs[0].text) == (b.outputs[0].token_ids, b.outputs[0].text)
        assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
            b.outputs[0].finish_reason, b.outputs[0].stop_reason,
        )  # fmt: skip
    assert_all_blocks_free(overlap.llm_engine)


def test_streamed_outputs_never_show_the_pending_token_and_abort_in_flight():
    path = tiny_checkpoint("qwen3", tied=False)
    engine = _llm(path, True, block_size=4).llm_engine
    pa, pb = random_ids(11, 20), random_ids(6, 21)
    engine.add_request(pa, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "a")
    engine.add_request(pb, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "b")
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(5):
        for out in engine.step():
            ids = out.outputs[0].token_ids
            assert PENDING_TOKEN not in ids and ids[: len(seen[out.request_id])] == seen[out.request_id]
            seen[out.request_id] = ids
    assert engine._in_flight is not None  # "a" has a token in flight right now
    engine.async_scheduling = False  # switched off with a step in flight: the next step commits it first
    engine.step()
    assert engine._in_flight is None
    engine.async_scheduling = True
    for _ in range(2):
        for out in engine.step():
            seen[out.request_id] = out.outputs[0].token_ids
    assert engine._in_flight is not None
    engine.abort_request("a")
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PENDING_TOKEN not in out.outputs[0].token_ids
            if out.finished:
                final[out.request_id] = out
    a, b = final["a"].outputs[0], final["b"].outputs[0]
    assert a.finish_reason == "abort" and a.token_ids == seen["a"] and len(a.token_ids) < 30
    ref = _llm(path, False, block_size=4).generate(
        [pa, pb], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    assert a.token_ids == ref[0].outputs[0].token_ids[: len(a.token_ids)]
    assert b.token_ids == ref[1].outputs[0].token_ids[:8] and b.finish_reason == "length"
    assert_all_blocks_free(engine)


def test_the_last_step_commits_without_a_wasted_launch():
    # A request that ends by length is known to end: no step is launched past its last token.
    path = tiny_checkpoint("qwen3", tied=False)
    engine = _llm(path, True).llm_engine
    launched = []
    original = engine.model_runner.execute_model
    engine.model_runner.execute_model = lambda seqs, *a, **k: (
        launched.append(len(seqs)) or original(seqs, *a, **k)
    )
    engine.add_request(random_ids(5, 3), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "x")
    while engine.has_unfinished_requests():
        engine.step()
    assert len(launched) == 6  # one prefill and five decodes for six tokens
    assert_all_blocks_free(engine)


def test_rows_that_finish_by_length_leave_without_breaking_the_overlap():
    """Requests of different max_tokens: the step after the one that gives a request its last token
    still launches ahead of that step's commit, over the others only; outputs equal synchronous
    stepping and every decode step runs ahead."""
    path = tiny_checkpoint("qwen3", tied=False)
    sync, overlap = _pair(path)
    engine = overlap.llm_engine
    ahead = _count_run_ahead(engine)
    launches = []
    original = engine.model_runner.execute_model

    def execute_model(seqs, *args, **kwargs):
        launches.append(len(seqs))
        return original(seqs, *args, **kwargs)

    engine.model_runner.execute_model = execute_model
    prompts = [random_ids(5, 1), random_ids(7, 2), random_ids(4, 3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 9, 6)]
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlap.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    # one prefill, then 8 decodes (the longest request's 9 tokens): 3 rows, then 2, then 1
    assert launches == [3, 3, 3, 3, 2, 2, 1, 1, 1]
    assert ahead[0] == len(launches) - 1
    assert_all_blocks_free(engine)


def test_speculative_decoding_runs_its_first_draft_forward_ahead_with_async_scheduling():
    """With fixed-k speculation and a draft model async_scheduling runs each step's first draft
    forward ahead (the speculator's run_ahead); steps are not left in flight (only adaptive_k's plain
    steps are). It follows async_scheduling (default: on for CUDA only), and needs a draft model."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert EngineArgs("some/model", speculative_config=ngram, async_scheduling=True).async_scheduling
    path = tiny_checkpoint("qwen3", tied=False)
    draft = {"model": str(path), "num_speculative_tokens": 2}
    default = LLM(str(path), device="cpu", speculative_config=draft).llm_engine
    assert not default.async_scheduling and not default.speculator.run_ahead
    on = LLM(str(path), device="cpu", speculative_config=draft, async_scheduling=True).llm_engine
    assert not on.async_scheduling and on.speculator.run_ahead
    off = LLM(str(path), device="cpu", speculative_config=draft, async_scheduling=False).llm_engine
    assert not off.async_scheduling and not off.speculator.run_ahead
    # the default the engine resolves: on for CUDA, off elsewhere; an explicit value wins
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert overlaps(None, cuda) and not overlaps(None, cpu)
    assert overlaps(True, cpu) and not overlaps(False, cuda)
    assert not LLM(
        str(path), device="cpu", speculative_config=ngram, async_scheduling=True
    ).llm_engine.speculator.run_ahead


def test_async_server_engine_streams_and_aborts_with_overlap():
    # The server's engine thread (AsyncLLMEngine) over an overlapping LLMEngine: concurrent streams,
    # one closed early, the others equal to synchronous stepping; nothing is left held afterwards.
    import asyncio
    import time

    from thinkspec.entrypoints.async_engine import AsyncLLMEngine

    path = tiny_checkpoint("qwen3", tied=False)
    prompts = [random_ids(n, seed=50 + n) for n in (5, 8, 12)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 17, 40)]
    want = _llm(path, False).generate(prompts, params, use_tqdm=False)
    engine = AsyncLLMEngine(LLMEngine(EngineArgs(str(path), device="cpu", seed=0, async_scheduling=True)))
    engine.start()

    async def run(i: int, close_after: int | None) -> list[int]:
        ids: list[int] = []
        gen = engine.generate({"prompt_token_ids": prompts[i]}, params[i], f"r{i}")
        async for out in gen:
            new = out.outputs[0].token_ids
            assert PENDING_TOKEN not in new and new[: len(ids)] == ids
            ids = new
            if close_after is not None and len(ids) >= close_after:
                break
        await gen.aclose()
        return ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(run(0, None), run(1, None), run(2, 3))

    try:
        got = asyncio.run(main())
        assert got[0] == want[0].outputs[0].token_ids and got[1] == want[1].outputs[0].token_ids
        assert 3 <= len(got[2]) < 40 and got[2] == want[2].outputs[0].token_ids[: len(got[2])]
        deadline = time.monotonic() + 10
        while engine.stats.num_kv_blocks_used or engine.stats.num_running:
            assert time.monotonic() < deadline, engine.stats
            time.sleep(0.05)
        assert engine.is_healthy
    finally:
        engine.shutdown()
    assert_all_blocks_free(engine.engine)
