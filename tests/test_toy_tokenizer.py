from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from thinkspec.toy.task import HARD_CANDIDATES, TRAIN_MIXES, generate_samples
from thinkspec.toy.tokenizer import SPECIAL_TOKENS, build_task_tokenizer, build_tokenizer, save_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_task_tokenizer(n_samples=1500, seed=99)


@pytest.fixture(scope="module")
def samples():
    return generate_samples(200, seed=5)


def test_special_tokens_are_single_and_first(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i
        assert tok(f"a {t} b", add_special_tokens=False)["input_ids"].count(i) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # Think markers survive skip_special_tokens (as in Qwen3); the chat markers do not.
    text = tok.decode(tok("<|im_start|>x<think>\ny\n</think>", add_special_tokens=False)["input_ids"],
                      skip_special_tokens=True)
    assert text == "x<think>\ny\n</think>"


def test_every_digit_is_its_own_token(tok, samples):
    for s in samples[:50]:
        for piece in tok.convert_ids_to_tokens(tok(s.text, add_special_tokens=False)["input_ids"]):
            assert sum(c.isdigit() for c in piece) <= 1, piece
    ids = tok("12345 + 907", add_special_tokens=False)["input_ids"]
    assert len([t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]) == 8


def test_round_trip_and_arbitrary_text(tok, samples):
    for s in samples[:50]:
        assert tok.decode(tok(s.text, add_special_tokens=False)["input_ids"]) == s.text
    odd = "Ünïcödé ✓ text\twith\ttabs and 3.14159"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_prompt_completion_split_matches_full_encoding(tok, samples):
    for s in samples[:50]:
        full = tok(s.text, add_special_tokens=False)["input_ids"]
        prompt = tok(s.prompt, add_special_tokens=False)["input_ids"]
        assert full == prompt + tok(s.completion, add_special_tokens=False)["input_ids"]


def test_task_words_are_single_tokens(tok, samples):
    ids = tok(" carrying borrow column hundreds", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    # A wording fork starts on a token boundary, so it is a single-token decision.
    for s in samples[:50]:
        enc = tok(s.completion, add_special_tokens=False, return_offsets_mapping=True)
        starts = {a for a, _ in enc["offset_mapping"]}
        for off, _ in s.forks:
            assert off in starts, s.completion[off - 10:off + 10]


def test_thinking_share_and_fork_density(tok, samples):
    think = total = forks = 0
    for s in samples:
        enc = tok(s.completion, add_special_tokens=False, return_offsets_mapping=True)
        end = s.completion.index("</think>")
        in_think = [a >= len("<think>\n") and b <= end for a, b in enc["offset_mapping"]]
        think += sum(in_think)
        total += len(in_think)
        forks += sum(1 for _, m in s.forks if m >= 3)
    assert think / total >= 0.8
    # Uniform choices among >= 3 phrasings: the data's share of high-entropy thinking tokens.
    assert 0.15 <= forks / think <= 0.3


def test_saved_tokenizer_loads_with_auto_and_chat_template(tok, samples, tmp_path):
    save_tokenizer(tok, tmp_path)
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "tokenizer_config.json").exists()
    auto = AutoTokenizer.from_pretrained(tmp_path)
    s = samples[0]
    ids = tok(s.text, add_special_tokens=False)["input_ids"]
    assert auto(s.text, add_special_tokens=False)["input_ids"] == ids
    msgs = [{"role": "user", "content": s.problem.question}]
    # The generation prompt opens the think block, as in the training text that follows the prompt.
    opened = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert opened == s.prompt + "<think>\n" and s.text.startswith(opened)
    no_think = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    assert no_think == s.prompt + "<think>\n\n</think>\n\n"
    turn = msgs + [{"role": "assistant", "reasoning_content": s.thinking, "content": s.answer_text}]
    assert auto.apply_chat_template(turn, tokenize=False) == s.text + "\n"
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    rendered = auto.apply_chat_template(sys_msgs, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_bad_vocab_size_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(["abc"], vocab_size=100)


def test_easy_text_splits_as_the_bundled_tokenizer_does(tok):
    # The tokenizer is now learnt on the training range too; easy text must still split into the same
    # pieces (every word one token, every digit its own), whatever the ids.
    from thinkspec.model_names import resolve_model_name

    bundled = AutoTokenizer.from_pretrained(resolve_model_name("toy-reasoner"))
    for s in generate_samples(100, seed=77):
        ids = tok(s.text, add_special_tokens=False)["input_ids"]
        old = bundled(s.text, add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(ids) == bundled.convert_ids_to_tokens(old)


def test_hard_levels_are_tokenized_in_the_same_kind(tok):
    # Column names past the thousands are words of their own, and digits stay single tokens.
    assert tok.tokenize(" ten thousands column, hundred thousands") == [
        "Ġten", "Ġthousands", "Ġcolumn", ",", "Ġhundred", "Ġthousands"
    ]  # fmt: skip
    for s in generate_samples(30, seed=6, level=HARD_CANDIDATES[-1]):
        pieces = tok.tokenize(s.text)
        assert all(sum(c.isdigit() for c in p) <= 1 for p in pieces)
        assert tok.decode(tok(s.text, add_special_tokens=False)["input_ids"]) == s.text
        enc = tok(s.completion, add_special_tokens=False, return_offsets_mapping=True)
        starts = {a for a, _ in enc["offset_mapping"]}
        assert all(off in starts for off, _ in s.forks)


def test_level_budgets_fit_their_completions(tok):
    # Every level's max_new_tokens holds its longest completion with room to spare, and prompt plus
    # budget fits the retrained pair's 2,048 positions.
    for level, _ in TRAIN_MIXES["range"]:
        samples = generate_samples(150, seed=8, level=level)
        prompts = tok([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
        comps = tok([s.completion for s in samples], add_special_tokens=False)["input_ids"]
        longest = max(len(c) for c in comps)
        assert longest <= 0.95 * level.max_new_tokens, (level.label, longest)
        assert max(len(p) for p in prompts) + level.max_new_tokens <= 2048, level.label
