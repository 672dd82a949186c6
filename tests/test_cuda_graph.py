"""CUDA graphs for decode, verify and draft steps: host-side pieces on CPU, replay vs eager on GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.cuda_graph import GraphSpec, graph_batch_sizes, pack_batch, select_graph_key
from thinkspec.engine.factory import resolve_attention_backend
from thinkspec.engine.model_runner import ModelRunner, attention_layers
from thinkspec.engine.sequence import Sequence
from thinkspec.engine_args import EngineArgs, engine_kwargs
from thinkspec.entrypoints.cli import build_parser
from thinkspec.model_names import resolve_model_name
from thinkspec.models import load_model
from thinkspec.step_inputs import InputLayout

gpu = pytest.mark.gpu


def _seq(name: str, num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(name, list(range(100, 100 + num_tokens)), SamplingParams())
    seq.block_table = list(blocks)
    return seq


# ---- buckets and keys ---------------------------------------------------------------------------


def test_graph_batch_sizes_follow_vllm_list():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(3) == (1, 2, 4)
    assert graph_batch_sizes(8) == (1, 2, 4, 8)
    assert graph_batch_sizes(12) == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    big = graph_batch_sizes(10_000)
    assert big[-1] == 512 and len(big) == 4 + 63
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_select_graph_key():
    widths, buckets = (1, 2, 5), (1, 2, 4, 8)
    assert select_graph_key([1], [1], widths, buckets) == (1, 1)
    assert select_graph_key([1, 1, 1], [1, 1, 1], widths, buckets) == (4, 1)  # smaller than its bucket
    assert select_graph_key([1, 2, 1], [1, 1, 0], widths, buckets) == (4, 2)  # draft catch-up
    assert select_graph_key([5, 3, 1, 4, 5], [5, 3, 1, 4, 5], widths, buckets) == (8, 5)  # ragged verify
    assert select_graph_key([3], [3], widths, buckets) == (1, 5)
    assert select_graph_key([6], [1], widths, buckets) is None  # a prefill chunk: eager
    assert select_graph_key([1, 40], [1, 1], widths, buckets) is None  # mixed prefill + decode: eager
    assert select_graph_key([1] * 9, [1] * 9, widths, buckets) is None  # more than the largest bucket
    assert select_graph_key([], [], widths, buckets) is None
    assert select_graph_key([1], [3], widths, buckets) is None  # more logits rows than bucket * q
    assert select_graph_key([0], [0], widths, buckets) is None


def test_graph_spec_validation_and_capture_order():
    spec = GraphSpec(query_widths=(1, 2, 5), batch_sizes=(1, 2, 4), max_model_len=64, max_blocks_per_seq=18)
    assert spec.first_keys() == [(4, 5), (4, 2), (4, 1)]
    assert spec.select([1, 1], [1, 1], table_width=18) == (2, 1)
    assert spec.select([1, 1], [1, 1], table_width=19) is None  # wider than the static block table
    for bad in [(), (2, 1), (1, 1), (0, 1)]:
        with pytest.raises(ValueError, match="query_widths must be ascending distinct ints >= 1"):
            GraphSpec(query_widths=bad, batch_sizes=(1,), max_model_len=8, max_blocks_per_seq=1)
    with pytest.raises(ValueError, match="max_blocks_per_seq must be an int >= 1"):
        GraphSpec(query_widths=(1,), batch_sizes=(1,), max_model_len=8, max_blocks_per_seq=0)


# ---- padded host layout -------------------------------------------------------------------------


def test_pack_batch_pads_a_graph_shaped_step():
    bs = 4
    a = _seq("a", 9, [7, 3, 5])  # verify window: last token + 2 drafts at positions 8..10
    b = _seq("b", 5, [2, 6])  # decode: one token at position 4
    layout = InputLayout(num_tokens=4 * 5, num_rows=4 * 5, num_seqs=4, width=3)  # bucket 4, q 5
    host = np.full(layout.size + 3, 99, dtype=np.int64)
    max_q, max_len = pack_batch(
        host, layout, [a, b], [3, 1], [3, 1], bs, input_token_ids=[[108, 1, 2], [104]],
        start_positions=[8, 4],
    )  # fmt: skip
    assert (max_q, max_len) == (3, 11)
    ids, pos, slot, rows, qsl, lens, table = layout.split(host)
    assert ids.tolist() == [108, 1, 2, 104] + [0] * 16
    assert pos.tolist() == [8, 9, 10, 4] + [0] * 16
    # position p of a lives in block a.block_table[p // 4] at offset p % 4
    assert slot.tolist() == [5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 6 * 4 + 0] + [-1] * 16
    assert rows.tolist() == [0, 1, 2, 3] + [0] * 16
    assert qsl.tolist() == [0, 3, 4, 4, 4]  # padding sequences: query length 0
    assert lens.tolist() == [11, 5, 0, 0]
    assert table.reshape(4, 3).tolist() == [[7, 3, 5], [2, 6, -1], [-1, -1, -1], [-1, -1, -1]]
    assert host[layout.size :].tolist() == [99, 99, 99]  # nothing written past the layout
    assert layout.fixed_size == 4 * 20 + 5 + 4

    # The eager layout of the same batch is the unpadded version.
    eager = InputLayout(num_tokens=4, num_rows=4, num_seqs=2, width=3)
    host2 = np.zeros(eager.size, dtype=np.int64)
    pack_batch(host2, eager, [a, b], [3, 1], [3, 1], bs, [[108, 1, 2], [104]], [8, 4])
    e = eager.split(host2)
    assert e[0].tolist() == ids[:4].tolist() and e[2].tolist() == slot[:4].tolist()
    assert e[4].tolist() == [0, 3, 4] and e[6].reshape(2, 3).tolist() == table.reshape(4, 3)[:2].tolist()


def test_pack_batch_rejects_batches_that_do_not_fit():
    a = _seq("a", 9, [7, 3, 5])
    small = InputLayout(num_tokens=2, num_rows=2, num_seqs=1, width=3)
    host = np.zeros(64, dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit"):
        pack_batch(host, small, [a], [3], [1], 4, start_positions=[6])
    with pytest.raises(ValueError, match="block table wider than 2"):
        pack_batch(host, InputLayout(4, 4, 1, 2), [a], [1], [1], 4, start_positions=[8])
    with pytest.raises(RuntimeError, match="no KV slots"):
        pack_batch(host, InputLayout(4, 4, 1, 3), [a], [2], [1], 4, start_positions=[11])
    with pytest.raises(ValueError, match="2 sequences do not fit"):
        pack_batch(host, InputLayout(4, 4, 1, 3), [a, a], [1, 1], [1, 1], 4)


# ---- configuration --------------------------------------------------------------------------------


def test_engine_args_enforce_eager_and_auto_backend():
    cfg = EngineArgs(model="m")
    assert cfg.attention_backend == "auto" and cfg.enforce_eager is False
    assert EngineArgs(model="m", enforce_eager=True).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be a bool, got 'yes'"):
        EngineArgs(model="m", enforce_eager="yes")
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'torch', 'triton'\)"):
        EngineArgs(model="m", attention_backend="flash")
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_attention_backend("torch", torch.device("cuda", 0)) == "torch"


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "sweep"])
def test_cli_enforce_eager_flag(command):
    args = build_parser().parse_args([command, "--enforce-eager", "--attention-backend", "triton"])
    kwargs = engine_kwargs(args)
    assert kwargs["enforce_eager"] is True and kwargs["attention_backend"] == "triton"
    kwargs = engine_kwargs(build_parser().parse_args([command]))
    assert "enforce_eager" not in kwargs and "attention_backend" not in kwargs  # LLM defaults


def test_runner_refuses_graphs_off_cuda():
    model, info = load_model(tiny_checkpoint("qwen3", tied=False))
    spec = GraphSpec(query_widths=(1,), batch_sizes=(1,), max_model_len=64, max_blocks_per_seq=16)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ModelRunner.for_model(
            model, info, num_blocks=4, block_size=4, device=torch.device("cpu"), graphs=spec
        )


def test_cpu_engine_never_tries_graphs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a CUDA graph was requested on CPU")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", refuse)
    path = str(tiny_checkpoint("qwen3", tied=False))
    llm = LLM(
        path,
        device="cpu",
        skip_tokenizer_init=True,
        speculative_config={"model": path, "num_speculative_tokens": 3},
    )
    engine = llm.llm_engine
    assert engine.attention_backend == "torch" and not engine.use_cuda_graphs
    assert engine.model_runner.graphs is None and engine.speculator.proposer.runner.graphs is None
    outs = llm.generate(
        [[1, 2, 3], list(range(5, 30))], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


# ---- GPU ----------------------------------------------------------------------------------------------


def _gpu_runner(path, widths, max_num_seqs=8, block_size=4, num_blocks=256, max_model_len=256):
    from thinkspec.layers.attention_triton import TritonAttentionBackend

    device = torch.device("cuda")
    model, info = load_model(path, "float32", device)
    backend = TritonAttentionBackend()
    for layer in attention_layers(model):
        layer.backend = backend
    spec = GraphSpec(
        query_widths=widths,
        batch_sizes=graph_batch_sizes(max_num_seqs),
        max_model_len=max_model_len,
        max_blocks_per_seq=-(-(max_model_len + widths[-1]) // block_size),
    )
    runner = ModelRunner.for_model(
        model, info, num_blocks=num_blocks, block_size=block_size, device=device, graphs=spec
    )
    return runner, BlockManager(num_blocks, block_size, enable_prefix_caching=False)


def _both(runner, *args, **kwargs):
    """(eager logits, replayed logits) of the same step; the step runs twice (same K/V written)."""
    replays = runner.graphs.num_replays
    runner.use_cuda_graphs = False
    eager = runner.execute_model(*args, **kwargs).clone()
    runner.use_cuda_graphs = True
    replayed = runner.execute_model(*args, **kwargs)
    assert runner.graphs.num_replays == replays + 1, "the step did not replay a graph"
    return eager, replayed


@gpu
def test_gpu_replay_matches_eager_logits():
    path = tiny_checkpoint("qwen3", tied=False)
    k = 4
    runner, bm = _gpu_runner(path, widths=(1, 2, k + 1))
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(8):
        n = 7 + 9 * i
        seq = Sequence(str(i), torch.randint(0, 256, (n,), generator=gen).tolist(), SamplingParams())
        bm.allocate(seq, n + k)
        seqs.append(seq)
    # Prefill eagerly (prompts are longer than any width), in one mixed batch.
    runner.execute_model(seqs, [s.num_tokens for s in seqs], [1] * 8)
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
    assert runner.graphs.num_replays == 0

    def grow(batch, n):
        for s in batch:
            s.token_ids.extend(torch.randint(0, 256, (n,), generator=gen).tolist())
            bm.allocate(s, s.num_tokens + k)

    # Decode batches of 1, 3 (bucket 4) and 8 sequences.
    for size in (1, 3, 8):
        batch = seqs[:size]
        grow(batch, 1)
        eager, replayed = _both(runner, batch, [1] * size, [1] * size)
        assert replayed.shape == (size, eager.shape[1]) and replayed.dtype == torch.float32
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
        for s in batch:
            s.num_computed_tokens += 1

    # Ragged verify windows (last token + drafts) for 5 sequences: bucket 8, width k+1.
    batch = seqs[2:7]
    windows = [5, 3, 1, 5, 2]
    grow(batch, k)
    inputs = [
        s.token_ids[s.num_computed_tokens - 1 : s.num_computed_tokens - 1 + n] for s, n in zip(batch, windows)
    ]
    starts = [s.num_computed_tokens - 1 for s in batch]
    eager, replayed = _both(runner, batch, windows, windows, input_token_ids=inputs, start_positions=starts)
    assert replayed.shape[0] == sum(windows)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
    # Fewer logits rows than tokens (the draft's catch-up forward): width 2, bucket 4.
    windows = [2, 1, 2]
    inputs = [s.token_ids[st : st + n] for s, st, n in zip(batch, starts, windows)]
    eager, replayed = _both(
        runner, batch[:3], windows, [1, 0, 1], input_token_ids=inputs, start_positions=starts[:3]
    )
    assert replayed.shape[0] == 2
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)

    # Draft-style step: tokens already on the device go straight into the static input_ids.
    batch = seqs[2:5]
    toks = torch.tensor([s.token_ids[s.num_computed_tokens] for s in batch], device="cuda")
    kw = dict(
        input_token_ids=[[0]] * 3,
        start_positions=[s.num_computed_tokens for s in batch],
        device_inputs=(torch.arange(3, device="cuda"), toks),
    )
    eager, replayed = _both(runner, batch, [1] * 3, [1] * 3, **kw)
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=0)
    host = runner.execute_model(
        batch,
        [1] * 3,
        [1] * 3,
        input_token_ids=[[int(t)] for t in toks],
        start_positions=kw["start_positions"],
    )
    torch.testing.assert_close(host, eager, atol=1e-4, rtol=0)
    assert set(runner.graphs.graphs) >= {(8, 5), (8, 2), (8, 1), (1, 1), (4, 1), (4, 2), (4, 1)}


def _block_bytes(target: str, spec: dict | None, block_size: int = 16) -> int:
    """fp32 bytes of one KV block of the target (plus the draft model's, when there is one)."""
    import json
    from pathlib import Path

    from thinkspec.engine.model_runner import kv_cache_bytes_per_block

    total = 0
    for path in [target] + ([spec["model"]] if spec and "model" in spec else []):
        cfg = json.loads((Path(path) / "config.json").read_text())
        total += kv_cache_bytes_per_block(
            cfg["num_hidden_layers"], block_size, cfg["num_key_value_heads"], cfg["head_dim"], torch.float32
        )
    return total


def _toy_prompts(n: int) -> list[str]:
    from thinkspec.toy.task import chat_prompt, generate_samples

    return [chat_prompt(s.problem.question) for s in generate_samples(n, seed=77)]


def _generate(path, prompts, params, *, enforce_eager, **kw):
    llm = LLM(path, device="cuda", dtype="float32", enforce_eager=enforce_eager, **kw)
    engine = llm.llm_engine
    assert engine.attention_backend == "triton" and engine.use_cuda_graphs == (not enforce_eager)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    runners = [engine.model_runner]
    if engine.speculator is not None and engine.speculator.has_draft_model:
        runners.append(engine.speculator.proposer.runner)
    replays = [r.graphs.num_replays if r.graphs is not None else 0 for r in runners]
    return [o.outputs[0].token_ids for o in outs], replays, engine


@gpu
@pytest.mark.parametrize("mode", ["plain", "draft", "ngram"])
def test_gpu_generate_with_graphs_equals_enforce_eager(mode):
    """Greedy tokens with graphs equal the eager ones, with mixed prefill + decode steps (small token
    budget, prompts of different lengths) and preemption (a KV pool too small for every request)."""
    target = resolve_model_name("toy-reasoner")
    spec = {
        "plain": None,
        "draft": {"model": resolve_model_name("toy-reasoner-draft"), "num_speculative_tokens": 4},
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    }[mode]
    prompts = _toy_prompts(6)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(
        speculative_config=spec, max_num_seqs=4, max_num_batched_tokens=96, block_size=16,
        kv_cache_memory=14 * _block_bytes(target, spec),
        reasoning_parser="qwen3",
    )  # fmt: skip
    eager, eager_replays, _ = _generate(target, prompts, params, enforce_eager=True, **kw)
    graphs, replays, engine = _generate(target, prompts, params, enforce_eager=False, **kw)
    assert eager_replays == [0] * len(eager_replays)
    assert all(r > 0 for r in replays), replays
    assert engine.num_preemptions > 0
    assert graphs == eager


@gpu
def test_gpu_graph_memory_is_measured_and_held_to():
    """The KV sizing reserves what the graphs take: after capturing every key the pool grew by no
    more than the measurement."""
    path = str(tiny_checkpoint("qwen3", tied=False))
    spec = {"model": path, "num_speculative_tokens": 3}
    llm = LLM(path, device="cuda", dtype="float32", skip_tokenizer_init=True, max_num_seqs=8,
              gpu_memory_utilization=0.3, speculative_config=spec)  # fmt: skip
    engine = llm.llm_engine
    assert engine.graph_memory_bytes > 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for runner in (engine.model_runner, engine.speculator.proposer.runner):
        spec = runner.graphs.spec
        for q in spec.query_widths:
            for b in spec.batch_sizes:
                runner.graphs.ensure_captured((b, q))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    grown = torch.cuda.memory_reserved() - before
    assert grown <= engine.graph_memory_bytes + (2 << 20), (grown, engine.graph_memory_bytes)
    outs = llm.generate(
        [[1, 2, 3], list(range(5, 60))], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)


@gpu
@pytest.mark.parametrize("mode", ["plain", "draft"])
def test_gpu_steady_state_step_syncs_at_most_once(mode):
    """A decode step (plain) or speculative round (draft) with graphs waits for the device at most
    once: the copy of its results to the host. Counted with torch's sync debug mode."""
    import warnings

    target = resolve_model_name("toy-reasoner")
    spec = None
    if mode == "draft":
        spec = {"model": resolve_model_name("toy-reasoner-draft"), "num_speculative_tokens": 4}
    llm = LLM(target, device="cuda", dtype="bfloat16", max_num_seqs=8, speculative_config=spec,
              reasoning_parser="qwen3", gpu_memory_utilization=0.3)  # fmt: skip
    engine = llm.llm_engine
    for i, prompt in enumerate(_toy_prompts(4)):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), str(i))
    for _ in range(8):  # prefill, then decode steps: every graph this batch needs is captured
        engine.step()
    per_step = []
    try:
        torch.cuda.set_sync_debug_mode("warn")
        for _ in range(5):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            per_step.append([f"{w.filename}:{w.lineno}" for w in syncs])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(len(s) <= 1 for s in per_step), per_step
    while engine.has_unfinished_requests():
        engine.step()
