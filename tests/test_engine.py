"""End-to-end engine runs on tiny checkpoints, checked token for token against HF transformers."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import LLAMA3_ROPE, THINK_ID, hf_logits, tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.engine import LLMEngine
from thinkspec.engine.model_runner import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    ModelRunner,
    determine_kv_cache_memory,
    kv_cache_bytes_per_block,
    profile_run,
)
from thinkspec.engine.sequence import Sequence
from thinkspec.engine_args import EngineArgs
from thinkspec.models import load_model

ARCH_CASES = [
    ("qwen3", {"tied": False}),
    ("qwen2", {"tied": True}),
    ("llama", {"tied": False, "rope_scaling": LLAMA3_ROPE}),
]
GREEDY = dict(temperature=0.0)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks still in use"
    assert all(b.ref_count == 0 for b in bm.blocks)


def bytes_per_block(path, block_size: int, elem: int = 4) -> int:
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * elem


def random_ids(n: int, seed: int) -> list[int]:
    # byte tokens only, so prompts decode to text
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_HF: dict[tuple, object] = {}


def hf_model(path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    key = (str(path), dtype, device)
    if key not in _HF:
        _HF.clear()
        _HF[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return _HF[key]


def hf_greedy(path, prompt: list[int], max_new_tokens: int, device="cpu") -> list[int]:
    """HF transformers greedy continuation (stops after EOS like the engine)."""
    model = hf_model(path, device=device)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[0, len(prompt) :].tolist()


def spy_schedule(engine: LLMEngine) -> list[tuple[int, int, int]]:
    """Record (num_new_tokens, tokens left before the step, preempted count) per scheduled sequence."""
    log: list[tuple[int, int, int]] = []
    original = engine.scheduler.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        for seq, n in zip(out.seqs, out.num_new_tokens):
            log.append((n, seq.num_tokens - seq.num_computed_tokens, len(out.preempted)))
        return out

    engine.scheduler.schedule = schedule
    return log


@pytest.mark.parametrize("arch, kw", ARCH_CASES, ids=[a for a, _ in ARCH_CASES])
def test_greedy_matches_hf_with_prefix_cache_chunking_and_preemption(arch, kw):
    path = tiny_checkpoint(arch, **kw)
    block_size, num_blocks = 4, 24
    llm = LLM(
        str(path),
        device="cpu",
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        kv_cache_memory=num_blocks * bytes_per_block(path, block_size),
        seed=0,
    )
    engine = llm.llm_engine
    assert engine.block_manager.num_blocks == num_blocks
    log = spy_schedule(engine)
    shared = random_ids(20, seed=1)
    prompts = [shared + random_ids(3, 2), shared + random_ids(17, 3), random_ids(5, 4), random_ids(30, 5)]
    params = SamplingParams(max_tokens=14, **GREEDY)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 14)
    assert engine.num_preemptions > 0
    assert engine.prefix_cache_stats.hits_tokens > 0
    assert any(n < left for n, left, _ in log), "no prompt was split into chunks"
    assert all(o.metrics.num_generated_tokens == len(o.outputs[0].token_ids) for o in outs)
    assert_all_blocks_free(engine)

    # A second batch reuses the cached prefix blocks of the first.
    hits_before = engine.prefix_cache_stats.hits_tokens
    more = [shared + random_ids(6, 6), shared[:13] + random_ids(2, 7)]
    outs = llm.generate(more, params, use_tqdm=False)
    assert engine.prefix_cache_stats.hits_tokens - hits_before >= block_size
    assert sum(o.num_cached_tokens for o in outs) >= block_size
    for prompt, out in zip(more, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 14)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("arch, kw", ARCH_CASES, ids=[a for a, _ in ARCH_CASES])
def test_model_runner_logits_match_hf_for_chunks_and_multi_row(arch, kw):
    path = tiny_checkpoint(arch, **kw)
    model, info = load_model(path)
    bm = BlockManager(32, block_size=4)
    runner = ModelRunner(
        model,
        num_blocks=32,
        block_size=4,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype=info.dtype,
        device=torch.device("cpu"),
    )
    a = Sequence("a", random_ids(30, 10), SamplingParams())
    b = Sequence("b", random_ids(9, 11), SamplingParams())
    ref_a, ref_b = hf_logits(path, a.token_ids), hf_logits(path, b.token_ids)
    bm.allocate(a, 13)
    logits = runner.execute_model([a], [13], [13])  # every row of a first chunk
    assert logits.shape == (13, info.vocab_size) and logits.dtype == torch.float32
    assert_close_rel(logits, ref_a[:13])
    a.num_computed_tokens = 13
    bm.allocate(a, 30)
    bm.allocate(b, 9)
    # The rest of a with its last 3 rows (a verification-shaped request) next to all of b.
    logits = runner.execute_model([a, b], [17, 9], [3, 1])
    assert_close_rel(logits[:3], ref_a[27:30])
    assert_close_rel(logits[3:], ref_b[8:9])
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 32


def test_profile_run_and_kv_memory_budget_on_cpu():
    path = tiny_checkpoint("qwen3", tied=False)
    model, info = load_model(path)
    # The GPU memory profile's forward: whole prompts with no KV pool yet, split at max_model_len.
    profile_run(model, num_tokens=40, max_model_len=16, num_seqs=4, vocab_size=info.vocab_size)
    kw = dict(
        device=torch.device("cpu"),
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=64,
        max_model_len=64,
        max_num_seqs=4,
        vocab_size=info.vocab_size,
    )
    assert determine_kv_cache_memory(model, kv_cache_memory=None, **kw) == DEFAULT_CPU_KV_CACHE_MEMORY
    assert determine_kv_cache_memory(model, kv_cache_memory=12345, **kw) == 12345
    assert kv_cache_bytes_per_block(2, 4, 2, 32, torch.float32) == bytes_per_block(path, 4)
    assert kv_cache_bytes_per_block(2, 4, 2, 32, torch.bfloat16) == bytes_per_block(path, 4) // 2


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    err = (out - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item(), err


def test_abort_keeps_tokens_and_frees_blocks():
    path = tiny_checkpoint("qwen3", tied=False)
    engine = LLMEngine(EngineArgs(str(path), device="cpu", block_size=4))
    pa, pb = random_ids(11, 20), random_ids(6, 21)
    engine.add_request(pa, SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY), "a")
    engine.add_request(pb, SamplingParams(max_tokens=8, **GREEDY), "b")
    for _ in range(4):
        engine.step()
    engine.abort_request("a")
    engine.abort_request("missing")  # unknown ids are ignored
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    a, b = final["a"].outputs[0], final["b"].outputs[0]
    assert a.finish_reason == "abort" and 1 <= len(a.token_ids) < 30
    assert a.token_ids == hf_greedy(path, pa, len(a.token_ids))
    assert b.token_ids == hf_greedy(path, pb, 8)
    assert_all_blocks_free(engine)


def test_request_output_carries_reasoning_split():
    path = tiny_checkpoint("qwen3", tied=False)
    engine = LLMEngine(EngineArgs(str(path), device="cpu", reasoning_parser="qwen3"))
    seq = Sequence("r", [65, THINK_ID], SamplingParams(), starts_thinking=True)
    seq.output_text = "step one\n</think>\n\nthe answer"
    seq.finish("stop")
    comp = engine.make_output(seq).outputs[0]
    assert (comp.reasoning_content, comp.content) == ("step one", "the answer")
    seq2 = Sequence("s", [65, 66], SamplingParams())  # the output starts in the answer
    seq2.output_text = "plain reply"
    seq2.finish("stop")
    comp = engine.make_output(seq2).outputs[0]
    assert (comp.reasoning_content, comp.content) == (None, "plain reply")
    # add_request starts the phase where the qwen3 split starts: enable_thinking, default on.
    cases = [(None, True), ({"enable_thinking": True}, True), ({"enable_thinking": False}, False)]
    for kwargs, starts in cases:
        rid = engine.add_request({"prompt_token_ids": [65, 66], "chat_template_kwargs": kwargs})
        seq = engine.scheduler.requests[rid]
        assert seq.thinking is starts and seq.starts_thinking is starts
        engine.abort_request(rid)
    engine.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"block_size": 0}, r"block_size must be an integer in \[1, 1024\]"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"reasoning_parser": "nope"}, "reasoning_parser"),
        ({"model": ""}, "model"),
    ],
)
def test_engine_config_validation(kwargs, match):
    args = {"model": "some/model", **kwargs}
    with pytest.raises(ValueError, match=match):
        EngineArgs(**args)


def test_engine_limits_checked_at_construction():
    path = tiny_checkpoint("qwen3", tied=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineArgs(str(path), device="cpu", max_model_len=100_000))
    with pytest.raises(ValueError, match="holds no KV block"):
        LLMEngine(EngineArgs(str(path), device="cpu", kv_cache_memory=100))


# ---- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arch, kw", ARCH_CASES, ids=[a for a, _ in ARCH_CASES])
def test_cuda_fp32_greedy_matches_hf(arch, kw):
    path = tiny_checkpoint(arch, **kw)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        gpu_memory_utilization=0.5,
    )
    engine = llm.llm_engine
    shared = random_ids(40, seed=30)
    prompts = [shared + random_ids(5, 31), random_ids(90, 32), shared + random_ids(30, 33), random_ids(7, 34)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 24, device="cuda")
    outs = llm.generate([shared + random_ids(9, 35)], SamplingParams(max_tokens=24, **GREEDY))
    assert engine.prefix_cache_stats.hits_tokens >= 32
    assert outs[0].outputs[0].token_ids == hf_greedy(path, shared + random_ids(9, 35), 24, device="cuda")
    assert_all_blocks_free(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("arch, kw", ARCH_CASES, ids=[a for a, _ in ARCH_CASES])
def test_cuda_fp32_preemption_matches_hf(arch, kw):
    path = tiny_checkpoint(arch, **kw)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="float32",
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        kv_cache_memory=24 * bytes_per_block(path, 4),
    )
    prompts = [random_ids(n, 40 + n) for n in (9, 30, 17, 4)]
    # ignore_eos keeps every request to 14 tokens, so 30 blocks are needed and only 24 exist.
    outs = llm.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True, **GREEDY), use_tqdm=False)
    assert llm.llm_engine.num_preemptions > 0
    eos = llm.llm_engine.eos_token_ids
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(path, prompt, 14, device="cuda")  # HF stops at EOS: compare up to there
        assert out.outputs[0].token_ids[: len(ref)] == ref
        assert len(ref) == 14 or ref[-1] in eos
    assert_all_blocks_free(llm.llm_engine)


@pytest.mark.gpu
@pytest.mark.parametrize("arch, kw", ARCH_CASES, ids=[a for a, _ in ARCH_CASES])
def test_cuda_bf16_greedy_matches_hf_up_to_near_ties(arch, kw):
    path = tiny_checkpoint(arch, **kw)
    margin = 0.1
    llm = LLM(str(path), device="cuda", dtype="bfloat16", block_size=16, max_num_batched_tokens=64)
    assert llm.llm_engine.model_info.dtype == torch.bfloat16
    prompts = [random_ids(n, 50 + n) for n in (12, 70, 33, 5, 21, 48, 9, 27)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, **GREEDY), use_tqdm=False)
    hf = hf_model(path, dtype=torch.bfloat16, device="cuda")
    compared = 0
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            res = hf.generate(
                torch.tensor([prompt], device="cuda"),
                do_sample=False,
                max_new_tokens=32,
                temperature=None,
                top_p=None,
                top_k=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref = res.sequences[0, len(prompt) :].tolist()
        mine = out.outputs[0].token_ids
        # Compare while HF's choice is clear; stop at the first step whose top-2 gap is within margin.
        for step, step_logits in enumerate(res.logits):
            top2 = step_logits[0].float().topk(2).values
            if top2[0] - top2[1] <= margin:
                break
            assert step < len(mine), "engine output ended before HF's at a clear step"
            assert mine[step] == ref[step], f"step {step}: {mine[step]} != {ref[step]}"
            compared += 1
    assert compared >= 10, "too few clear steps for a meaningful comparison"
    assert_all_blocks_free(llm.llm_engine)


def test_dummy_load_format_runs_without_weights(tmp_path):
    import shutil

    from checkpoints import tiny_checkpoint

    from thinkspec import LLM, SamplingParams

    folder = tmp_path / "config_only"
    shutil.copytree(tiny_checkpoint("qwen3", tied=True), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        LLM(folder, device="cpu")
    llm = LLM(folder, device="cpu", load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate([[72, 105]], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(folder, device="cpu", load_format="pt")


def test_skip_tokenizer_init_takes_and_returns_token_ids(tmp_path):
    import shutil

    from checkpoints import tiny_checkpoint

    from thinkspec import LLM, SamplingParams

    src = tiny_checkpoint("qwen3", tied=True)
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, folder / name)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(src, device="cpu").generate([[72, 105, 33]], params, use_tqdm=False)[0]
    llm = LLM(folder, device="cpu", skip_tokenizer_init=True)
    out = llm.generate([[72, 105, 33], "text"], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected.outputs[0].token_ids and out[0].outputs[0].text == ""
    assert out[1].outputs[0].finish_reason == "error" and "token ids" in out[1].error
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="reasoning_parser needs the tokenizer"):
        LLM(folder, device="cpu", skip_tokenizer_init=True, reasoning_parser="qwen3")
