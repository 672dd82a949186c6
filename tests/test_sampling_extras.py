"""n > 1, logprobs, penalties and logit_bias through LLM.generate, plain and speculative (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import _hf_model, hf_logits, tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.sampling.penalties import PenaltyTensors, apply_penalties, window_counts

PROMPT = list(range(40, 60))  # 20 tokens: 5 full blocks of 4


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen3", tied=True)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), device="cpu", block_size=4)


def _ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


# ---- n > 1 --------------------------------------------------------------------------------------


def test_n_greedy_choices_are_identical_and_share_the_prompt(path):
    llm = LLM(str(path), device="cpu", block_size=4)  # a fresh prefix cache
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert _ids(out)[0] == _ids(out)[1] == _ids(out)[2] and len(_ids(out)[0]) == 8
    # Sequences 1 and 2 took the prompt's full blocks from the cache (the last token is recomputed).
    assert out.num_cached_tokens == 2 * 16
    assert llm.llm_engine.prefix_cache_stats.hits_tokens == 2 * 16
    single = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert _ids(single)[0] == _ids(out)[0]


def test_n_seeded_choices_differ_and_reproduce(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    a = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    b = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    assert _ids(a) == _ids(b)
    assert len({tuple(t) for t in _ids(a)}) == 3
    # Choice i samples as a single request seeded seed + i.
    one = llm.generate(
        PROMPT, SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert _ids(one[0])[0] == _ids(a)[1]


def test_n_abort_ends_every_choice(llm):
    engine = llm.llm_engine
    rid = engine.add_request(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(rid)
    final = [o for o in engine.step() if o.request_id == rid]
    assert final and final[0].finished and len(final[0].outputs) == 2
    assert all(c.finish_reason == "abort" for c in final[0].outputs)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.has_unfinished_requests()


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_agree_with_float64_log_softmax(llm, path):
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    out = llm.generate(PROMPT, sp, use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = hf_logits(path, PROMPT + comp.token_ids).double().log_softmax(-1)  # [P + T, V]
    assert len(comp.logprobs) == len(comp.token_ids) == 6
    total = 0.0
    for j, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(PROMPT) - 1 + j]
        top = row.topk(5)
        assert list(entry)[0] == token  # the chosen token first
        alternatives = sorted(entry.items(), key=lambda kv: kv[1].rank)[:5]
        assert [t for t, _ in alternatives] == top.indices.tolist()
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < 1e-5
            assert lp.rank == int((row > row[t]).sum()) + 1
            assert lp.decoded_token == llm.get_tokenizer().decode([t])
        total += entry[token].logprob
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-9)
    prompt_lp = out.prompt_logprobs
    assert len(prompt_lp) == len(PROMPT) and prompt_lp[0] is None
    for i in range(1, len(PROMPT)):
        row = ref[i - 1]
        entry = prompt_lp[i]
        assert list(entry)[0] == PROMPT[i] and len(entry) in (5, 6)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < 1e-5


def test_logprobs_are_off_by_default(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_logprobs_zero_gives_the_chosen_token_only(llm):
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=4, logprobs=0, ignore_eos=True)
    comp = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in comp.logprobs] == [[t] for t in comp.token_ids]


# ---- penalties ----------------------------------------------------------------------------------


def test_penalties_tensor_semantics():
    logits = torch.tensor([[[2.0, -1.0, 0.5, 3.0]]])  # [1, 1, 4]
    t = PenaltyTensors.build([(0.5, 0.25, 2.0)], [[0]], [[1, 1, 2]], 4, torch.device("cpu"))
    got = apply_penalties(logits, t, t.output_counts[:, None])[0, 0]
    # token 0: prompt, 2 / 2; token 1: output x2, -1 * 2 - 2 * 0.25 - 0.5; token 2: 0.5 / 2 - 0.25 - 0.5.
    assert got.tolist() == [1.0, -3.0, -0.5, 3.0]
    counts = window_counts(t.output_counts, torch.tensor([[3, 1, -1]]), torch.tensor([2]))
    assert counts[0, :, 3].tolist() == [0, 1, 1, 1] and counts[0, :, 1].tolist() == [2, 2, 3, 3]


def test_repetition_penalty_greedy_equals_transformers(llm, path):
    model = _hf_model(path, torch.float32, "cpu")
    prompts = [PROMPT, [72, 105, 33, 90, 91, 92, 90, 91]]
    for prompt in prompts:
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3
            )[0, len(prompt) :].tolist()
        ours = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3), use_tqdm=False
        )
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        assert _ids(ours[0])[0] == hf
        assert _ids(ours[0])[0] != _ids(plain[0])[0]  # the penalty changed the output


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_change_the_output(llm, name):
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    pen = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **{name: 2.0}), use_tqdm=False
    )
    got, plain = _ids(pen[0])[0], _ids(base[0])[0]
    assert got != plain
    # A strong penalty on output tokens makes repeats rarer than without it.
    assert len(set(got)) >= len(set(plain))


# ---- speculative decoding -----------------------------------------------------------------------

SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft": {"num_speculative_tokens": 3},
}


@pytest.mark.parametrize("method", list(SPEC))
def test_speculative_penalised_greedy_and_logprobs_equal_plain(method, llm, path):
    prompts = [PROMPT, [72, 105, 33, 90, 91, 92, 90, 91], [88, 89, 90, 91] * 4]
    sp = [
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, logprobs=3, prompt_logprobs=2),
        SamplingParams(
            temperature=0, max_tokens=30, frequency_penalty=0.4, presence_penalty=0.3, ignore_eos=True
        ),
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=0.9, logprobs=1, ignore_eos=True),
    ]
    plain = llm.generate(prompts, sp, use_tqdm=False)
    cfg = dict(SPEC[method])
    if method == "draft":
        cfg["model"] = str(path)  # a self-draft proposes unpenalised tokens: some get rejected
    spec = LLM(str(path), device="cpu", block_size=4, speculative_config=cfg)
    got = spec.generate(prompts, sp, use_tqdm=False)
    assert [_ids(o) for o in got] == [_ids(o) for o in plain]
    assert spec.last_spec_metrics.total.num_drafts > 0
    for a, b in zip(plain, got):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.logprobs is None) == (cb.logprobs is None)
        for ea, eb in zip(ca.logprobs or [], cb.logprobs or []):
            assert list(ea) == list(eb)
            assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
    assert [list(e) if e else e for e in got[0].prompt_logprobs] == [
        list(e) if e else e for e in plain[0].prompt_logprobs
    ]


# ---- logit_bias ---------------------------------------------------------------------------------

BIAS_PROMPTS = [list(range(40, 60)), [88, 89, 90, 91] * 4]


def _first(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_logit_bias_greedy_equals_plain(method, llm, path):
    """The bias applies to every verify row: a self-draft proposes unbiased tokens, which are
    rejected where the bias moves the argmax, and the output is plain decoding's with the bias."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    unbiased = _first(llm.generate(BIAS_PROMPTS, greedy, use_tqdm=False))
    assert all(len(t) == 24 for t in unbiased)
    biases = [{unbiased[0][5]: -100.0, unbiased[0][2]: 3.0}, {unbiased[1][1]: -100.0}]
    sp = [SamplingParams(temperature=0, max_tokens=24, logit_bias=b, ignore_eos=True) for b in biases]
    plain = _first(llm.generate(BIAS_PROMPTS, sp, use_tqdm=False))
    assert plain != unbiased and all(len(t) == 24 for t in plain)
    assert unbiased[0][5] not in plain[0] and unbiased[1][1] not in plain[1]
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft":
        cfg = {"model": str(path), "num_speculative_tokens": 3}
    spec = LLM(str(path), device="cpu", block_size=4, speculative_config=cfg)
    got = _first(spec.generate(BIAS_PROMPTS, sp, use_tqdm=False))
    assert got == plain
    assert spec.last_spec_metrics.total.num_drafts > 0


def test_logit_bias_out_of_vocabulary_is_refused(llm):
    vocab = llm.llm_engine.model_info.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias=\d+ is outside the vocabulary"):
        llm.llm_engine.add_request(BIAS_PROMPTS[0], SamplingParams(max_tokens=2, logit_bias={vocab + 3: 1.0}))


@pytest.mark.parametrize(
    "bias, match",
    [({1: 100.5}, r"logit_bias must be in \[-100.0, 100.0\]"), ({-1: 1.0}, "logit_bias must be keyed"),
     ({1: float("nan")}, "logit_bias must be a number"), ([1], "logit_bias must be a dict")],
)  # fmt: skip
def test_logit_bias_values_are_checked(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("value", [5e-324, 0.0, 0.009, 100.5, float("inf")])
def test_repetition_penalty_range(value):
    with pytest.raises(ValueError, match=r"repetition_penalty must be .*\[0.01, 100.0\]"):
        SamplingParams(repetition_penalty=value)
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01
