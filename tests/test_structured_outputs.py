"""Structured outputs (xgrammar) through LLM.generate on the toy model, fp32 on CPU: the grammar
constrains the answer after the thinking, the thinking is left alone, bad grammars are refused,
a speculating engine refuses constrained requests, and without xgrammar they get an error naming it."""

from __future__ import annotations

import json
import re
import sys

import pytest
from checkpoints import tiny_checkpoint
from structured_cases import QUESTION, SCHEMA

from thinkspec import LLM, SamplingParams
from thinkspec.model_names import TOY_MODELS
from thinkspec.sampling.structured import import_xgrammar
from thinkspec.structured_outputs import StructuredOutputsParams as SO

xgrammar = pytest.importorskip("xgrammar")



@pytest.fixture(scope="module")
def llm():
    if not (TOY_MODELS["toy-reasoner"] / "config.json").is_file():
        pytest.skip("the bundled toy checkpoint is not installed")
    return LLM("toy-reasoner", device="cpu", reasoning_parser="qwen3")


@pytest.fixture(scope="module")
def prompt(llm):
    messages = [{"role": "user", "content": QUESTION}]
    return llm.llm_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _greedy(llm, prompt, so, max_tokens=200):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]


def _check_schema(value, schema) -> None:
    try:
        import jsonschema
    except ImportError:  # the hand check of SCHEMA
        assert set(value) == {"answer", "unit"} and isinstance(value["answer"], int)
        assert value["unit"] in ("books", "apples")
    else:
        jsonschema.validate(value, schema)


def test_json_schema_constrains_the_answer_not_the_thinking(llm, prompt):
    plain = _greedy(llm, prompt, None)
    got = _greedy(llm, prompt, SO(json=SCHEMA))
    thinking, sep, answer = got.text.partition("</think>")
    assert sep and thinking, got.text
    assert plain.text.startswith(thinking + sep)  # the thinking is plain decoding's, token for token
    assert got.finish_reason == "stop"
    _check_schema(json.loads(answer), SCHEMA)
    # the plain answer is prose, so the grammar did change it
    assert not plain.text.partition("</think>")[2].lstrip().startswith("{")
    # the same schema as JSON text, and any JSON object
    text = _greedy(llm, prompt, SO(json=json.dumps(SCHEMA))).text
    assert text == got.text
    obj = json.loads(_greedy(llm, prompt, SO(json_object=True)).text.partition("</think>")[2])
    assert isinstance(obj, dict)


@pytest.mark.parametrize(
    "so, check",
    [
        (SO(regex=r"[0-9]{2,4}"), lambda a: re.fullmatch(r"[0-9]{2,4}", a)),
        (SO(choice=["yes", "no", "maybe so"]), lambda a: a in ("yes", "no", "maybe so")),
        (
            SO(grammar='root ::= "The answer is " [0-9]+ "."'),
            lambda a: re.fullmatch(r"The answer is [0-9]+\.", a),
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_hold(llm, prompt, so, check):
    got = _greedy(llm, prompt, so)
    thinking, sep, answer = got.text.partition("</think>")
    assert sep and thinking and answer, got.text
    assert check(answer), answer


def test_without_a_reasoning_parser_the_constraint_starts_at_once():
    llm = LLM("toy-reasoner", device="cpu")
    tok = llm.llm_engine.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    got = _greedy(llm, prompt, SO(json=SCHEMA))
    assert "<think>" not in got.text and got.token_ids
    _check_schema(json.loads(got.text), SCHEMA)


@pytest.mark.parametrize(
    "so, match",
    [
        (
            SO(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
            r"structured_outputs.json: invalid",
        ),
        (SO(regex="(unclosed"), r"structured_outputs.regex: invalid"),
        (SO(grammar="root ::= undefined_rule"), r"structured_outputs.grammar: invalid"),
        (SO(json={"type": "integer", "minimum": 5, "maximum": 2}), r"structured_outputs.json: invalid"),
        (SO(regex=r"[^\s\S]"), r"structured_outputs.regex: the grammar accepts nothing"),
        (
            SO(grammar=r"root ::= [^\x00-\U0010FFFF]"),
            r"structured_outputs.grammar: the grammar accepts nothing",
        ),
    ],
    ids=["schema", "regex", "grammar", "empty range", "empty regex", "empty grammar"],
)
def test_bad_grammars_are_refused(llm, so, match):
    with pytest.raises(ValueError, match=match):
        llm.llm_engine.add_request("hi", SamplingParams(max_tokens=2, structured_outputs=so))
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"choice": [1]}, {"regex": ""}, {"json": 5}],
)
def test_structured_outputs_params_are_checked(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        SO(**kwargs)


def test_a_speculating_engine_refuses_constrained_requests():
    path = tiny_checkpoint("qwen3", tied=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(path), device="cpu", speculative_config=spec)
    with pytest.raises(ValueError, match="structured_outputs=.* not supported with speculative decoding"):
        llm.llm_engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, structured_outputs=SO(regex="a+")))


def test_without_xgrammar_the_engine_runs_and_a_constrained_request_names_it(monkeypatch):
    path = tiny_checkpoint("qwen3", tied=True)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ValueError, match=r"xgrammar package"):
        import_xgrammar()
    llm = LLM(str(path), device="cpu")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"xgrammar package: pip install 'thinkspec\[structured\]'"):
        llm.llm_engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, structured_outputs=SO(regex="a+")))


def test_a_complete_grammar_allows_only_stop_tokens_even_with_ignore_eos(llm):
    tok = llm.llm_engine.tokenizer
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    prompt = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    sp = SamplingParams(
        temperature=0,
        max_tokens=12,
        ignore_eos=True,
        skip_special_tokens=False,
        structured_outputs=SO(choice=["yes", "no"]),
    )
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12
    answer = tok.decode(out.token_ids[:-10])
    assert answer in ("yes", "no"), out.text
    assert set(out.token_ids[-10:]) <= set(llm.llm_engine.eos_token_ids)
