"""Tensor parallelism on CPU (gloo, one process per rank): outputs equal TP=1 token for token on
tiny fp32 checkpoints, with and without speculation, strict and relaxed; workers leave no orphans
and their failures reach the main process.

Each TP engine costs seconds to start (every worker process imports torch), so each one serves
several assertions.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import astuple
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoints import END_THINK_ID, THINK_ID, noisy_copy, tiny_checkpoint

import thinkspec
import thinkspec.distributed.workers as tp_workers
from thinkspec import LLM, SamplingParams
from thinkspec.distributed.step_channel import EXIT, StepHeader, TensorParallelError
from thinkspec.distributed.workers import TPWorkers, exit_with_parent, init_distributed, report_failure
from thinkspec.engine_args import EngineArgs

K = 4
THINKING = [[72 + i, 105, 33 + i, THINK_ID] for i in range(3)]
ANSWERING = [[70, 71, THINK_ID, 10, 11, END_THINK_ID, 10]]
PROMPTS = [*THINKING, *ANSWERING, [65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76] * 2, [97]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
STRICT = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, relaxed_thinking=False)
RELAXED = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, relaxed_thinking=True)
RELAX = {"reasoning_parser": "qwen3", "relaxed_thinking": True, "relax_ratio": 0.1, "relax_top_k": 8}
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the workers: 2 cores for many processes


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run(path: Path, params: SamplingParams, **kwargs) -> tuple[list[list[int]], object]:
    """Outputs of PROMPTS and the spec metrics on an engine that is shut down afterwards."""
    llm = LLM(str(path), device="cpu", **kwargs)
    try:
        out = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
        return out, llm.last_spec_metrics
    finally:
        llm.shutdown()


def _worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.tp_workers.procs]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def qwen3() -> Path:
    return tiny_checkpoint("qwen3", tied=True)


@pytest.fixture(scope="module")
def llama() -> Path:
    return tiny_checkpoint("llama", tied=False)


@pytest.fixture(scope="module")
def qwen3_draft(qwen3: Path, tmp_path_factory) -> Path:
    return noisy_copy(qwen3, tmp_path_factory.mktemp("draft") / "noisy", 0.05)


# ---- equality with TP=1 ---------------------------------------------------------------------------


def test_qwen3_tp2_draft_model_strict_and_relaxed_equal_tp1(qwen3, qwen3_draft):
    spec = {"model": str(qwen3_draft), "num_speculative_tokens": K, **RELAX}
    greedy, _ = _run(qwen3, GREEDY)
    relaxed_tp1, m1 = _run(qwen3, RELAXED, speculative_config=spec)
    # async_scheduling: the draft's first forwards run ahead, their headers sent to the other rank too
    llm = LLM(
        str(qwen3), device="cpu", tensor_parallel_size=2, speculative_config=spec, async_scheduling=True
    )
    try:
        proposer = llm.llm_engine.speculator.proposer
        assert proposer.runner.channel is not None  # the draft is split too
        assert _tokens(llm.generate(PROMPTS, STRICT, use_tqdm=False)) == greedy
        relaxed = _tokens(llm.generate(PROMPTS, RELAXED, use_tqdm=False))
        m2 = llm.last_spec_metrics
        assert proposer.num_used_ahead > 0
    finally:
        llm.shutdown()
    assert relaxed == relaxed_tp1
    assert m2.phase("thinking").num_relaxed_accepted_tokens > 0  # the relaxation did act
    assert (
        m2.phase("thinking").num_relaxed_accepted_tokens == m1.phase("thinking").num_relaxed_accepted_tokens
    )
    assert relaxed != greedy


def test_qwen3_tp4_replicated_draft_equals_tp1(qwen3, qwen3_draft):
    spec = {"model": str(qwen3_draft), "num_speculative_tokens": K}
    greedy, _ = _run(qwen3, GREEDY)
    llm = LLM(
        str(qwen3),
        device="cpu",
        tensor_parallel_size=4,
        draft_tensor_parallel_size=1,
        speculative_config=spec,
    )
    pids = _worker_pids(llm)
    try:
        assert llm.llm_engine.speculator.proposer.runner.channel is None  # the whole draft on rank 0
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        assert _tokens(llm.generate(PROMPTS, STRICT, use_tqdm=False)) == greedy
        assert llm.last_spec_metrics.total.num_accepted_tokens > 0
    finally:
        del llm
        gc.collect()  # deleting the LLM stops its workers
    assert not [p for p in pids if _alive(p)]
    assert not dist.is_initialized()


def test_llama_tp4_ngram_strict_and_relaxed_equal_tp1(llama):
    spec = {**NGRAM, **RELAX}
    greedy, _ = _run(llama, GREEDY)
    relaxed_tp1, _ = _run(llama, RELAXED, speculative_config=spec)
    llm = LLM(str(llama), device="cpu", tensor_parallel_size=4, speculative_config=spec)
    try:
        assert _tokens(llm.generate(PROMPTS, STRICT, use_tqdm=False)) == greedy
        assert llm.last_spec_metrics.total.num_drafts > 0
        assert _tokens(llm.generate(PROMPTS, RELAXED, use_tqdm=False)) == relaxed_tp1
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def llama_tp2(llama):
    llm = LLM(str(llama), device="cpu", tensor_parallel_size=2)
    yield llm
    llm.shutdown()


def test_llama_tp2_greedy_equals_tp1(llama, llama_tp2):
    greedy, _ = _run(llama, GREEDY)
    assert _tokens(llama_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy


def test_killed_worker_fails_the_engine_with_its_rank(llama_tp2):
    """Runs after the equality test on the same engine (module fixture)."""
    pids = _worker_pids(llama_tp2)
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=r"worker rank 1 exited with code -9"):
        llama_tp2.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(TensorParallelError, match="failed earlier"):  # the engine stays failed
        llama_tp2.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llama_tp2.shutdown()
    assert not [p for p in pids if _alive(p)]
    assert not dist.is_initialized()


@pytest.mark.slow
def test_qwen3_tp8_ngram_equals_tp1():
    """Eight ranks: 8 query heads, 2 KV heads (each held by 4 ranks), vocabulary 261 in shards of 33.
    Short: eight processes share the CI machine's cores."""
    path = tiny_checkpoint("qwen3", tied=True, num_heads=8, num_kv_heads=2)
    prompts = [PROMPTS[0], PROMPTS[4]]
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy = _tokens(LLM(str(path), device="cpu").generate(prompts, short, use_tqdm=False))
    llm = LLM(str(path), device="cpu", tensor_parallel_size=8, speculative_config=NGRAM)
    try:
        assert _tokens(llm.generate(prompts, short, use_tqdm=False)) == greedy
        assert llm.last_spec_metrics.total.num_drafts > 0
    finally:
        llm.shutdown()


# ---- worker failures and validation -----------------------------------------------------------------


def _failing_worker(rank: int, size: int, init_method: str, args: object, errors: object) -> None:
    try:
        init_distributed(rank, size, init_method, torch.device("cpu"))
        raise ValueError(f"shard file unreadable on rank {rank}")
    except BaseException:
        report_failure(errors, rank)
        raise SystemExit(1) from None


def test_worker_error_reaches_rank0_with_its_message():
    workers = TPWorkers.start(2, None, torch.device("cpu"), _failing_worker)
    try:
        with pytest.raises(RuntimeError) as info:
            dist.all_reduce(torch.ones(1))  # the worker never joins it: gloo fails when it exits
        error = workers.failure(info.value)
        assert isinstance(error, TensorParallelError)
        assert "worker rank 1 failed" in str(error)
        assert "ValueError: shard file unreadable on rank 1" in str(error)
    finally:
        workers.shutdown()
    assert not [p for p in workers.procs if _alive(p.pid)]
    assert not dist.is_initialized()


def _worker_waiting_for_exit(rank: int, size: int, init_method: str, args: object, errors: object) -> None:
    """A worker with no model: joins the group, waits for rank 0's EXIT header, leaves."""
    init_distributed(rank, size, init_method, torch.device("cpu"))
    header = torch.zeros(len(astuple(StepHeader(EXIT, *([0] * 10)))), dtype=torch.int64)
    dist.broadcast(header, src=0)
    assert int(header[0]) == EXIT
    dist.destroy_process_group()


def test_shutdown_returns_when_leaving_the_group_blocks(monkeypatch):
    """NCCL's destroy can block at shutdown: rank 0 waits for it a bounded time, then aborts the group."""
    workers = TPWorkers.start(2, None, torch.device("cpu"), _worker_waiting_for_exit)
    release = threading.Event()
    real_destroy = dist.destroy_process_group
    monkeypatch.setattr(tp_workers, "LEAVE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *args, **kwargs: release.wait())
    closing = threading.Thread(target=workers.shutdown, daemon=True)
    start = time.monotonic()
    try:
        closing.start()
        closing.join(10.0)
        elapsed = time.monotonic() - start
    finally:
        release.set()
        monkeypatch.undo()
        closing.join(10.0)
        if dist.is_initialized():
            real_destroy()
    assert elapsed < 5.0, f"shutdown took {elapsed:.1f} s with the group's destroy blocked"
    assert workers.closed and not [p for p in workers.procs if _alive(p.pid)]


def _worker_failing_before_rendezvous(rank: int, size: int, init_method: str, args: object, errors) -> None:
    try:
        raise RuntimeError(f"no device for rank {rank}")
    except RuntimeError:
        report_failure(errors, rank)
        raise SystemExit(1) from None


def test_worker_failing_before_the_rendezvous_fails_the_start_at_once():
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="(?s)worker rank 1 failed.*no device for rank 1"):
        TPWorkers.start(2, None, torch.device("cpu"), _worker_failing_before_rendezvous)
    assert time.monotonic() - start < 30  # not the rendezvous timeout
    assert not dist.is_initialized()


def _idle_worker(rank: int, size: int, init_method: str, args: object, errors: object) -> None:
    exit_with_parent()
    init_distributed(rank, size, init_method, torch.device("cpu"))
    while True:  # no collective to fail: only the parent watch can end this process
        time.sleep(1)


RANK0_SCRIPT = """
import sys, time, torch
sys.path[:0] = [{tests!r}, {root!r}]
from test_tensor_parallel import _idle_worker
from thinkspec.distributed.workers import TPWorkers
workers = TPWorkers.start(2, None, torch.device("cpu"), _idle_worker)
print(workers.procs[0].pid, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_rank0_is_killed():
    tests = str(Path(__file__).parent)
    root = str(Path(thinkspec.__file__).resolve().parent.parent)  # this checkout's package
    code = RANK0_SCRIPT.format(tests=tests, root=root)
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tests)
    try:
        worker = int(rank0.stdout.readline())
        assert _alive(worker)
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_sizes_that_do_not_split_the_model_are_refused_before_any_process_starts(qwen3, qwen3_draft):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=4"):
        LLM(str(qwen3), device="cpu", tensor_parallel_size=3)
    spec = {"model": str(qwen3_draft), "num_speculative_tokens": K}
    with pytest.raises(
        ValueError, match=r"draft_tensor_parallel_size must be 1 or tensor_parallel_size \(2\)"
    ):
        EngineArgs(str(qwen3), device="cpu", tensor_parallel_size=2, draft_tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide num_attention_heads=4"):
        LLM(str(qwen3), device="cpu", tensor_parallel_size=8, speculative_config=spec)
    assert time.monotonic() - start < 5
    assert not dist.is_initialized()


def test_moe_tp2_greedy_and_ngram_equal_tp1():
    # the experts' intermediate dimension (and Qwen2-MoE's shared expert) split over 2 ranks
    from moe_checkpoints import moe_checkpoint

    for arch in ("qwen3_moe", "qwen2_moe"):
        path = moe_checkpoint(arch, mlp_only_layers=(2,))
        greedy, _ = _run(path, GREEDY)
        llm = LLM(str(path), device="cpu", tensor_parallel_size=2, speculative_config=NGRAM)
        try:
            assert _tokens(llm.generate(PROMPTS, STRICT, use_tqdm=False)) == greedy
            assert llm.last_spec_metrics.total.num_drafts > 0
        finally:
            llm.shutdown()
        assert [len(t) for t in greedy] == [GREEDY.max_tokens] * len(PROMPTS)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide moe_intermediate_size=33"):
        LLM(str(moe_checkpoint(moe_intermediate_size=33)), device="cpu", tensor_parallel_size=2)
