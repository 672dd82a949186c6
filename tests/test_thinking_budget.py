"""thinking_token_budget: after N thinking tokens the next token is </think>, in plain decoding and
inside speculative windows (strict, relaxed, sampled), with the phase and the split following."""

from __future__ import annotations

import pytest
import torch

from thinkspec import LLM, SamplingParams
from thinkspec.model_names import resolve_model_name
from thinkspec.reasoning import PhaseTracker
from thinkspec.reasoning.tracker import force_token

PROMPTS = ["Sam has 12 apples. He buys 30 more. How many apples does Sam have now?",
           "Mia has 250 coins. She loses 75. How many coins does Mia have now?"]  # fmt: skip
DRAFT = {"model": resolve_model_name("toy-reasoner-draft"), "num_speculative_tokens": 4}
MODES = {
    "plain": {},
    "plain_async": {"async_scheduling": True},
    "strict": {"speculative_config": DRAFT},
    "relaxed": {
        "speculative_config": {**DRAFT, "relaxed_thinking": True, "relax_ratio": 0.1, "relax_top_k": 8}
    },
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}},
}


@pytest.fixture(scope="module")
def llms():
    target = resolve_model_name("toy-reasoner")
    return {name: LLM(target, reasoning_parser="qwen3", device="cpu", **kw) for name, kw in MODES.items()}


def chat(llm, budget, temperature=0.0, seed=None, max_tokens=400):
    params = SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, thinking_token_budget=budget
    )
    return llm.chat([[{"role": "user", "content": q}] for q in PROMPTS], params, use_tqdm=False)


@pytest.fixture(scope="module")
def plain_under_budget(llms):
    """Token ids [per prompt] of plain greedy decoding under a budget of 20 thinking tokens."""
    return [o.outputs[0].token_ids for o in chat(llms["plain"], 20)]


def end_index(llm, out) -> int:
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    return out.outputs[0].token_ids.index(end)


def test_sampling_params_validates_the_budget():
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM: unlimited
    for bad in (-2, 1.5, True, "3"):
        with pytest.raises(ValueError, match="thinking_token_budget must be an integer in"):
            SamplingParams(thinking_token_budget=bad)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_budget_closes_the_thought_then_the_toy_answers(llms, plain_under_budget, mode):
    llm = llms[mode]
    # The toy thinks well past the budget unforced: no </think> among its first 41 tokens (it closes
    # the thought after 81 and 129 of them); generating those 41 is enough to see it.
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    free = chat(llm, None, max_tokens=41)
    assert all(len(o.outputs[0].token_ids) == 41 and end not in o.outputs[0].token_ids for o in free)
    if mode == "relaxed":
        assert llm.last_spec_metrics.to_dict()["num_relaxed_accepted_tokens"] > 0
    for budget in (20, 0):
        outs = chat(llm, budget)
        for out in outs:
            c = out.outputs[0]
            assert end_index(llm, out) == budget  # exactly `budget` thinking tokens, then </think>
            assert c.finish_reason == "stop" and c.content and "**Answer:**" in c.content
            assert (c.reasoning_content is None) == (budget == 0)
        if budget == 20 and mode not in ("plain", "relaxed"):
            # exact modes decode what plain greedy decodes under the budget
            assert [o.outputs[0].token_ids for o in outs] == plain_under_budget


def test_budget_holds_when_sampling(llms):
    for mode in ("plain", "relaxed"):
        llm = llms[mode]
        # a few tokens past the budget show where </think> came; the answer after it does not matter
        for out in chat(llm, 20, temperature=1.0, seed=3, max_tokens=24):
            assert end_index(llm, out) <= 20


def test_budget_needs_a_reasoning_parser():
    llm = LLM(resolve_model_name("toy-reasoner"), device="cpu")
    out = llm.generate("hi", SamplingParams(thinking_token_budget=5), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "needs a reasoning parser" in out.error


def test_over_budget_rows_follow_the_drafts():
    tracker = PhaseTracker(think_start_id=1, think_end_id=2)
    drafts = torch.tensor([[5, 5, 5], [5, 2, 5], [2, 1, 5], [5, 5, 5]])
    rows = tracker.over_budget(
        torch.tensor([True, True, False, True]),
        torch.tensor([1, 2, 0, 0]),  # thinking tokens committed
        torch.tensor([3, 3, 0, -1]),  # budgets (-1: none)
        drafts,
    )
    expected = [
        [False, False, True, True],  # 1 + two drafts reach 3 at row 2; still thinking at row 3
        [False, True, False, False],  # reached at row 1, whose draft is </think>; then the answer
        [False, False, True, True],  # answer, then <think> re-opens a spent budget (0)
        [False, False, False, False],  # no budget
    ]
    assert rows.tolist() == expected
    logits = torch.randn(4, 4, 6)
    force_token(logits, rows, 2)
    assert (logits.argmax(-1)[rows] == 2).all() and torch.isinf(logits[rows][:, [0, 1, 3, 4, 5]]).all()
    assert torch.isfinite(logits[~rows]).all()


# README's prompts and other wordings: the toy's template opens the think block, so every prompt
# comes back split, with relaxed acceptances counted; questions in its format are answered right.
TOY_PROMPTS = [
    ("Sam has 12 apples. He buys 30 more. How many?", None),  # short form: the retrained pair says 12
    ("Sam has 12 apples. He buys 30 more. How many apples does Sam have now?", 42),
    ("Zoe has 305 stamps. She sells 120. Then she finds 45 more. How many stamps does Zoe have now?", 230),
    ("Ben has 48 cards. He ends up with 4 times as many. How many cards does Ben have now?", 192),
    ("Emma has 90 beads. She gets 15 more. How many beads does Emma have now?", 105),
    ("What is 37 + 48?", None),  # not the toy's format: split, but no right answer expected
    ("Max has 500 coins and loses 123. How many coins are left?", None),
]


@pytest.fixture(scope="module")
def toy_outputs(llms):
    """{question: RequestOutput} of the relaxed pair on every TOY_PROMPTS question, greedy, in one batch."""
    params = SamplingParams(temperature=0, max_tokens=600)
    outs = llms["relaxed"].chat(
        [[{"role": "user", "content": q}] for q, _ in TOY_PROMPTS], params, use_tqdm=False
    )
    return {q: out for (q, _), out in zip(TOY_PROMPTS, outs)}


@pytest.mark.parametrize(("question", "answer"), TOY_PROMPTS)
def test_toy_prompts_come_back_split_with_relaxed_acceptances(toy_outputs, question, answer):
    out = toy_outputs[question]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.reasoning_content and c.content and "</think>" not in c.content
    assert out.metrics.spec_decode.to_dict()["by_phase"]["thinking"]["num_relaxed_accepted_tokens"] > 0
    if answer is not None:
        assert c.content.endswith(f"**Answer:** {answer}")
