"""logit_bias through LLM.generate: plain decoding and strict speculation (fp32, CPU)."""

from __future__ import annotations

import pytest
from checkpoints import tiny_checkpoint

from thinkspec import LLM, SamplingParams

PROMPTS = [list(range(40, 60)), [88, 89, 90, 91] * 4]


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen3", tied=True)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), device="cpu", block_size=4)


def _first(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_logit_bias_greedy_equals_plain(method, llm, path):
    """The bias applies to every verify row: a self-draft proposes unbiased tokens, which are
    rejected where the bias moves the argmax, and the output is plain decoding's with the bias."""
    unbiased = _first(llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False))
    assert all(len(t) == 24 for t in unbiased)
    biases = [{unbiased[0][5]: -100.0, unbiased[0][2]: 3.0}, {unbiased[1][1]: -100.0}]
    sp = [SamplingParams(temperature=0, max_tokens=24, logit_bias=b, ignore_eos=True) for b in biases]
    plain = _first(llm.generate(PROMPTS, sp, use_tqdm=False))
    assert plain != unbiased and all(len(t) == 24 for t in plain)
    assert unbiased[0][5] not in plain[0] and unbiased[1][1] not in plain[1]
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft":
        cfg = {"model": str(path), "num_speculative_tokens": 3}
    spec = LLM(str(path), device="cpu", block_size=4, speculative_config=cfg)
    got = _first(spec.generate(PROMPTS, sp, use_tqdm=False))
    assert got == plain
    assert spec.last_spec_metrics.total.num_drafts > 0


def test_logit_bias_out_of_vocabulary_is_refused(llm):
    vocab = llm.llm_engine.model_info.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias=\d+ is outside the vocabulary"):
        llm.llm_engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, logit_bias={vocab + 3: 1.0}))


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
