"""The `LLM` API: prompt forms, stop conditions, failures of one request, chat, reasoning, seeds."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import END_THINK_ID, IM_END_ID, THINK_ID, tiny_checkpoint

from thinkspec import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = dict(temperature=0.0)


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks still in use"
    assert all(b.ref_count == 0 for b in bm.blocks)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen3", tied=False)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), device="cpu", block_size=4, max_model_len=96, max_num_batched_tokens=64)


@pytest.fixture(autouse=True)
def _blocks_free_after_each_test(request):
    yield
    if "llm" in request.fixturenames:
        assert_all_blocks_free(request.getfixturevalue("llm"))


def test_prompt_forms_and_input_order(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=6, **GREEDY)
    text = "Hello there"
    ids = tok.encode(text)
    other = random_ids(17, 1)
    outs = llm.generate([text, ids, {"prompt_token_ids": other}, {"prompt": text}], sp, use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 4
    assert isinstance(outs[0].outputs[0], CompletionOutput)
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert outs[1].prompt is None and outs[2].prompt_token_ids == other
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert len({o.request_id for o in outs}) == 4
    single = llm.generate(other, sp, use_tqdm=False)  # one token-id list is one prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert llm.generate(text, sp, use_tqdm=False)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_per_prompt_sampling_params_and_tqdm(llm):
    prompts = [random_ids(5, 2), random_ids(9, 3)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **GREEDY) for m in (3, 7)]
    outs = llm.generate(prompts, params, use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(prompts, [SamplingParams()] * 3)


def test_text_is_the_detokenized_output(llm):
    out = llm.generate(random_ids(8, 4), SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)[0]
    comp = out.outputs[0]
    decoded = llm.get_tokenizer().decode(comp.token_ids, skip_special_tokens=True)
    # Incomplete UTF-8 at the very end is held back; everything before it matches.
    assert decoded.startswith(comp.text) and len(decoded) - len(comp.text) <= 1


def reference(llm, prompt, n=16):
    sp = SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY)
    comp = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert len(comp.token_ids) == n
    return comp


def test_stop_token_ids(llm):
    prompt = random_ids(10, 5)
    ref = reference(llm, prompt).token_ids
    stop = ref[5]
    cut = ref.index(stop) + 1
    sp = SamplingParams(max_tokens=16, stop_token_ids=[stop], **GREEDY)
    comp = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == ref[:cut] and comp.finish_reason == "stop" and comp.stop_reason == stop


def test_eos_and_ignore_eos(llm):
    prompt = random_ids(10, 6)
    ref = reference(llm, prompt).token_ids
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({ref[4]})  # pretend this token is the model's EOS
    try:
        comp = llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY), use_tqdm=False)[0].outputs[0]
        assert comp.token_ids == ref[: ref.index(ref[4]) + 1]
        assert comp.finish_reason == "stop" and comp.stop_reason is None
        sp = SamplingParams(max_tokens=16, ignore_eos=True, **GREEDY)
        assert llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == ref
        # min_tokens masks EOS until enough tokens exist, so the greedy path changes there.
        sp = SamplingParams(max_tokens=16, min_tokens=ref.index(ref[4]) + 2, **GREEDY)
        comp = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        assert len(comp.token_ids) >= sp.min_tokens and ref[4] not in comp.token_ids[: sp.min_tokens]
    finally:
        engine.eos_token_ids = saved


def test_model_eos_ids_come_from_generation_config(llm):
    assert {IM_END_ID, llm.get_tokenizer().eos_token_id} <= llm.llm_engine.eos_token_ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(llm, include):
    prompt = random_ids(12, 7)
    ref = reference(llm, prompt, 24)
    text = ref.text
    start = next(i for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    idx = text.find(stop)
    sp = SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=include, **GREEDY)
    comp = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == (text[: idx + len(stop)] if include else text[:idx])
    assert comp.token_ids == ref.token_ids[: len(comp.token_ids)] and len(comp.token_ids) < 24


def test_max_tokens_and_max_model_len(llm):
    sp = SamplingParams(max_tokens=50, ignore_eos=True, **GREEDY)
    comp = llm.generate(random_ids(90, 8), sp, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == 96 - 90
    sp = SamplingParams(max_tokens=None, ignore_eos=True, **GREEDY)  # None: up to max_model_len
    comp = llm.generate(random_ids(80, 8), sp, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == 96 - 80


def test_overlong_prompt_fails_alone(llm):
    prompts = [random_ids(5, 9), random_ids(120, 10), random_ids(7, 11)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    bad = outs[1]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    assert "120" in bad.error and "96" in bad.error and "max_model_len" in bad.error
    assert bad.prompt_token_ids == prompts[1]
    for out in (outs[0], outs[2]):
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 4


def test_overlong_prompt_names_kv_capacity(path):
    per_block = bytes_per_block(path, 4)
    llm = LLM(str(path), device="cpu", block_size=4, kv_cache_memory=10 * per_block)
    assert llm.llm_engine.max_model_len == 40
    out = llm.generate([random_ids(41, 12)], SamplingParams(max_tokens=2))[0]
    assert "41" in out.error and "KV cache capacity 40" in out.error
    assert_all_blocks_free(llm)


def bytes_per_block(path, block_size):
    cfg = json.loads((path / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "What is 2+2?"}]
    sp = SamplingParams(max_tokens=5, **GREEDY)
    out = llm.chat(conv, sp, use_tqdm=False)[0]
    expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    same = llm.generate({"prompt_token_ids": out.prompt_token_ids}, sp, use_tqdm=False)[0]
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "4"}]], sp, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids
    off = llm.chat(conv, sp, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    assert off.prompt.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "prompt_tail, output, reasoning, content",
    [
        # Thinking switched off in the prompt: all content.
        ("<think>\n\n</think>\n\n", ["The answer is 4."], None, "The answer is 4."),
        # Prompt ends inside <think>: reasoning up to </think>; the newlines around markers go.
        ("<think>\n", ["add 2 and 2\n", END_THINK_ID, "\n\nIt is 4."], "add 2 and 2", "It is 4."),
        # No marker in the prompt: the answer phase, until the output opens its own block.
        ("", [THINK_ID, "\nhm\n", END_THINK_ID, "\n\nok"], "hm", "ok"),
        ("<think>\n", ["still thinking"], "still thinking", None),
    ],
    ids=["thinking-off", "prompt-opens-think", "output-opens-think", "never-closed"],
)
def test_reasoning_content_on_outputs(path, prompt_tail, output, reasoning, content):
    # The engine samples a scripted stream of token ids (the tiny random model would rarely emit a
    # think marker), so reasoning_content / content are known literally, not taken from the parser.
    llm = LLM(str(path), device="cpu", reasoning_parser="qwen3", max_model_len=128, async_scheduling=False)
    tok = llm.get_tokenizer()
    script = [t for part in output for t in ([part] if isinstance(part, int) else tok.encode(part))]
    script.append(IM_END_ID)

    def scripted_sampler(logits, params, num_output_tokens):  # logits [B, V] -> token ids [B] int64
        return torch.tensor([script[n] for n in num_output_tokens], dtype=torch.long)

    llm.llm_engine.sampler = scripted_sampler
    prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n" + prompt_tail
    sp = SamplingParams(max_tokens=64, stop_token_ids=[IM_END_ID], **GREEDY)
    comp = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == script and comp.finish_reason == "stop"
    assert (comp.reasoning_content, comp.content) == (reasoning, content)
    assert_all_blocks_free(llm)


def test_default_sampling_params_follow_generation_config(llm):
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.95, 20)


def test_seeded_sampling_is_independent_of_batch_and_preemption(path, llm):
    prompt = random_ids(9, 13)
    sp = SamplingParams(temperature=1.0, top_k=40, seed=1234, max_tokens=20)
    alone = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    small = LLM(
        str(path),
        device="cpu",
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_memory=20 * bytes_per_block(path, 4),
        seed=99,
    )
    others = [random_ids(n, 20 + n) for n in (25, 14, 30)]
    params = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True)] * 3
    outs = small.generate([*others, prompt], [*params, sp], use_tqdm=False)
    assert small.llm_engine.num_preemptions > 0
    assert outs[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_k=40, seed=4321, max_tokens=20)
    assert llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_all_blocks_free(small)


def test_abort_through_the_engine_returns_partial_output(llm):
    engine = llm.llm_engine
    rid = engine.add_request(random_ids(6, 14), SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    engine.step()
    engine.step()
    engine.abort_request(rid)
    outs = engine.step()
    final = [o for o in outs if o.request_id == rid]
    assert final and final[0].finished and final[0].outputs[0].finish_reason == "abort"
    assert len(final[0].outputs[0].token_ids) == 2
    assert final[0].metrics.finished_time is not None


def test_logprobs_above_max_logprobs_is_refused(llm):
    with pytest.raises(ValueError, match=r"logprobs=21 must be in \[0, 20\]"):
        llm.llm_engine.add_request([1, 2], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match=r"prompt_logprobs=21 must be in \[0, 20\]"):
        llm.llm_engine.add_request([1, 2], SamplingParams(prompt_logprobs=21))


def test_bad_llm_arguments_fail_before_loading():
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM("does/not-exist", max_num_seqs=0)
    with pytest.raises(ValueError, match="device"):
        LLM(str(tiny_checkpoint("qwen3", tied=False)), device="tpu")
