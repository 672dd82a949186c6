"""Speculative decoding on a mixture-of-experts target (tiny random Qwen3-MoE, fp32, CPU): greedy
output with a draft model and with n-gram drafting equals plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import THINK_ID, noisy_copy
from moe_checkpoints import moe_checkpoint

from thinkspec import LLM, SamplingParams

K = 4
MAX_TOKENS = 24
PROMPTS = [
    [72, 105, 33, THINK_ID],
    [65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76] * 2,
    [97],
    [200, 17, 3, 99, 150, 42, THINK_ID],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def target() -> Path:
    return moe_checkpoint(mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def plain(target: Path) -> list[list[int]]:
    out = LLM(target, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_greedy_equals_plain_on_a_moe_target(method, target, plain, tmp_path_factory):
    if method == "draft":  # a MoE draft too: the target with noise added, agreeing often
        draft = noisy_copy(target, tmp_path_factory.mktemp("draft") / "noisy", 0.05)
        spec = {"model": str(draft), "num_speculative_tokens": K}
    else:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    llm = LLM(target, device="cpu", speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [len(t) for t in got] == [MAX_TOKENS] * len(PROMPTS)
    assert got == plain
    metrics = llm.last_spec_metrics
    assert metrics is not None and metrics.total.num_drafts > 0
    assert metrics.total.num_accepted_tokens > 0
