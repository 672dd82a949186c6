"""n, logprobs, echo, prompt_logprobs and penalties through a real `thinkspec serve` of the toy pair
(speculative, relaxed thinking on by default) and the official `openai` client, fp32 on CPU.

References are transformers' own forward and generate on the same target weights: logprobs are
compared with a float64 log-softmax of its logits; penalised greedy output with its generate.
Logprobs under speculation come from the verify rows that decided each token.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator

import pytest
import torch
from checkpoints import _hf_model, hf_logits

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_process import serve_process  # noqa: E402

from thinkspec.model_names import TOY_MODELS  # noqa: E402

MODEL = "toy"
TARGET = TOY_MODELS["toy-reasoner"]
QUESTION = "Max has 608 books. He gets 350 more. How many books does Max have now?"
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"model": MODEL, "temperature": 0.0}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET))


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    spec = {"model": "toy-reasoner-draft", "num_speculative_tokens": 4, "relaxed_thinking": True}
    spec.update(relax_ratio=0.3, relax_top_k=3)
    with serve_process(
        "toy-reasoner", "--device", "cpu", "--reasoning-parser", "qwen3", "--served-model-name", MODEL,
        "--speculative-config", json.dumps(spec), "--max-model-len", "512",
    ) as (proc, url, _):  # fmt: skip
        yield url
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def prompt_ids(tok) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def token_ids(tok, tokens: list[str]) -> list[int]:
    """The ids of returned token strings: the toy's task text decodes one token to one string."""
    by_text: dict[str, list[int]] = {}
    for i in range(len(tok)):
        by_text.setdefault(tok.decode([i]), []).append(i)
    ids = [by_text[t] for t in tokens]
    assert all(len(c) == 1 for c in ids), [t for t, c in zip(tokens, ids) if len(c) != 1]
    return [c[0] for c in ids]


def joined_per_index(chunks, fields=("reasoning", "reasoning_content", "content")) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            got = out.setdefault(c.index, {f: "" for f in fields} | {"finish_reason": None, "logprobs": []})
            for f in fields:
                got[f] += getattr(c.delta, f, None) or ""
            if c.finish_reason is not None:
                assert got["finish_reason"] is None, "two finish chunks for one choice"
                got["finish_reason"] = c.finish_reason
            if c.logprobs is not None:
                got["logprobs"] += c.logprobs.content
    return out


# ---- n ------------------------------------------------------------------------------------------


def test_n_greedy_choices_identical_and_streams_join_per_index(client):
    kw = dict(GREEDY, messages=MESSAGES, max_tokens=400)
    resp = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    first = resp.choices[0].message
    assert first.reasoning and first.reasoning == first.reasoning_content
    assert "958" in first.content and resp.choices[0].finish_reason == "stop"  # thought, then answered
    assert all(c.message == first and c.finish_reason == resp.choices[0].finish_reason for c in resp.choices)
    single = client.chat.completions.create(**kw)
    assert single.choices[0].message == first
    assert resp.usage.completion_tokens == 3 * single.usage.completion_tokens
    reasoning = resp.usage.completion_tokens_details.reasoning_tokens
    assert reasoning == 3 * single.usage.completion_tokens_details.reasoning_tokens > 0

    chunks = list(
        client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw)
    )
    joined = joined_per_index(chunks)
    assert sorted(joined) == [0, 1, 2]
    for c in resp.choices:
        got = joined[c.index]
        assert got["reasoning"] == got["reasoning_content"] == c.message.reasoning
        assert got["content"] == (c.message.content or "") and got["finish_reason"] == c.finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert [ch.choices[0].index for ch in chunks[:3]] == [0, 1, 2]  # a role chunk per choice first
    assert all(ch.choices[0].delta.role == "assistant" for ch in chunks[:3])


def test_n_seeded_choices_differ_reproduce_and_stream_alike(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=1.0, seed=7, n=3)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [(c.message.reasoning, c.message.content) for c in a.choices]
    assert texts == [(c.message.reasoning, c.message.content) for c in b.choices]
    assert len(set(texts)) > 1
    joined = joined_per_index(client.chat.completions.create(stream=True, **kw))
    assert [(joined[i]["reasoning"] or None, joined[i]["content"] or None) for i in range(3)] == texts
    ckw = dict(model=MODEL, prompt=QUESTION, max_tokens=8, temperature=1.0, seed=3, n=2)
    comp = client.completions.create(**ckw)
    assert [c.index for c in comp.choices] == [0, 1]
    assert [c.text for c in comp.choices] == [c.text for c in client.completions.create(**ckw).choices]


# ---- chat logprobs ------------------------------------------------------------------------------


def _check_chat_logprobs(content, tok, prompt: list[int], strict: bool) -> tuple[list[int], int]:
    """Each returned token's logprob and its 5 alternatives against a float64 log-softmax of
    transformers' logits on prompt + output; returns the output ids and how many of them were not
    the target's first choice."""
    ids = token_ids(tok, [t.token for t in content])
    ref = hf_logits(TARGET, prompt + ids).double().log_softmax(-1)  # [P + T, V]
    for j, (t, entry) in enumerate(zip(ids, content)):
        row = ref[len(prompt) - 1 + j]
        top = row.topk(5)
        assert len(entry.top_logprobs) == 5
        assert [a.token for a in entry.top_logprobs] == [tok.decode([i]) for i in top.indices.tolist()]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode()) and all(
            a.bytes == list(a.token.encode()) for a in entry.top_logprobs
        )
        if strict:
            assert t == top.indices[0].item()
    return ids, sum(t != ref[len(prompt) - 1 + j].argmax().item() for j, t in enumerate(ids))


def test_chat_logprobs_agree_with_float64_log_softmax(client, tok):
    prompt = prompt_ids(tok)
    kw = dict(GREEDY, messages=MESSAGES, max_tokens=48, logprobs=True, top_logprobs=5)
    strict = client.chat.completions.create(**kw, extra_body={"relaxed_thinking": False})
    choice = strict.choices[0]
    ids, _ = _check_chat_logprobs(choice.logprobs.content, tok, prompt, strict=True)
    # Every output token has one entry, the reasoning ones included; the tokens spell the output.
    assert len(ids) == strict.usage.completion_tokens
    text = tok.decode(ids)
    assert choice.message.reasoning in text and (choice.message.content or "") in text
    with torch.no_grad():  # strict speculation is greedy decoding: transformers' generate agrees
        hf = (
            _hf_model(TARGET, torch.float32, "cpu")
            .generate(torch.tensor([prompt]), max_new_tokens=len(ids), do_sample=False)[0, len(prompt) :]
            .tolist()
        )
    assert hf[: len(ids)] == ids

    # Relaxed thinking may accept a draft token that is not the target's first choice; its logprob is
    # still the target's, from the verify row that decided it.
    relaxed = client.chat.completions.create(**kw)
    _, not_first = _check_chat_logprobs(relaxed.choices[0].logprobs.content, tok, prompt, strict=False)
    assert not_first > 0

    # Streamed: the logprobs of the deltas join to the non-streamed ones, token for token.
    chunks = list(client.chat.completions.create(stream=True, **kw, extra_body={"relaxed_thinking": False}))
    streamed = joined_per_index(chunks)[0]["logprobs"]
    assert [t.token for t in streamed] == [t.token for t in choice.logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx(
        [t.logprob for t in choice.logprobs.content], abs=1e-5
    )
    assert all(len(t.top_logprobs) == 5 for t in streamed)

    zero = (
        client.chat.completions.create(**dict(kw, top_logprobs=0, max_tokens=4)).choices[0].logprobs.content
    )
    assert len(zero) == 4 and all(t.top_logprobs == [] for t in zero)
    none = client.chat.completions.create(**dict(GREEDY, messages=MESSAGES, max_tokens=4))
    assert none.choices[0].logprobs is None


def test_chat_prompt_logprobs(client, tok):
    prompt = prompt_ids(tok)
    resp = client.chat.completions.create(
        **GREEDY, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    raw = resp.model_dump()["prompt_logprobs"]
    assert len(raw) == len(prompt) and raw[0] is None
    ref = hf_logits(TARGET, prompt).double().log_softmax(-1)
    for i in range(1, len(prompt)):
        entry = {int(k): v for k, v in raw[i].items()}
        assert next(iter(entry)) == prompt[i] and len(entry) in (2, 3)
        for t, v in entry.items():
            assert v["logprob"] == pytest.approx(ref[i - 1, t].item(), abs=1e-4)
            assert v["rank"] == int((ref[i - 1] > ref[i - 1, t]).sum()) + 1
            assert v["decoded_token"] == tok.decode([t])
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(
            **GREEDY, messages=MESSAGES, stream=True, extra_body={"prompt_logprobs": 1}
        )


# ---- completions logprobs, echo, prompt_logprobs ------------------------------------------------


def test_completions_logprobs_echo_and_prompt_logprobs(client, tok):
    prompt = prompt_ids(tok)
    prompt_text = tok.decode(prompt)
    kw = dict(GREEDY, max_tokens=12, logprobs=3, extra_body={"relaxed_thinking": False})
    plain = client.completions.create(prompt=prompt, **kw).choices[0]
    lp = plain.logprobs
    ids = token_ids(tok, lp.tokens)
    ref = hf_logits(TARGET, prompt + ids).double().log_softmax(-1)
    assert "".join(lp.tokens) == plain.text and lp.text_offset == [
        len("".join(lp.tokens[:i])) for i in range(len(ids))
    ]
    for j, t in enumerate(ids):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_logprobs[j] == pytest.approx(row[t].item(), abs=1e-4)
        top = {tok.decode([i]): v for v, i in zip(*row.topk(3))}
        assert list(lp.top_logprobs[j])[0] == lp.tokens[j]  # the chosen token first, then the 3 best
        assert set(lp.top_logprobs[j]) == set(top) | {lp.tokens[j]}
        for key, v in top.items():
            assert lp.top_logprobs[j][key] == pytest.approx(v.item(), abs=1e-4)

    echoed = client.completions.create(prompt=prompt, echo=True, **kw).choices[0]
    assert echoed.text == prompt_text + plain.text
    e = echoed.logprobs
    n = len(prompt)
    assert e.tokens == [tok.decode([i]) for i in prompt] + lp.tokens
    assert e.token_logprobs[0] is None and e.top_logprobs[0] is None  # nothing scores the first token
    for i in range(1, n):
        assert e.token_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        assert len(e.top_logprobs[i]) in (3, 4)
    assert e.token_logprobs[n:] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert e.text_offset == [len("".join(e.tokens[:i])) for i in range(len(e.tokens))]
    # vLLM's prompt_logprobs come along on the choice (raw: token id -> logprob, rank, decoded_token).
    raw = echoed.model_dump()["prompt_logprobs"]
    assert raw[0] is None and [next(iter(r)) for r in raw[1:]] == [str(t) for t in prompt[1:]]

    # Streamed with echo: the pieces join to the same text, logprobs and offsets.
    chunks = list(client.completions.create(prompt=prompt, echo=True, stream=True, **kw))
    text = "".join(c.choices[0].text for c in chunks)
    tokens, offsets, values = [], [], []
    for c in chunks:
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
            values += c.choices[0].logprobs.token_logprobs
    assert text == echoed.text and tokens == e.tokens and offsets == e.text_offset
    assert values[0] is None and values[1:] == pytest.approx(e.token_logprobs[1:], abs=1e-5)

    # echo with max_tokens=0 (scoring a text, as vLLM): the prompt alone with its logprobs.
    scored = client.completions.create(**GREEDY, prompt=prompt, echo=True, max_tokens=0, logprobs=0).choices[
        0
    ]
    assert scored.text == prompt_text and scored.logprobs.tokens == e.tokens[:n]
    assert scored.logprobs.token_logprobs[1:] == pytest.approx(e.token_logprobs[1:n], abs=1e-5)
    # echo without logprobs: text only; prompt_logprobs alone: the raw list, no echo.
    assert (
        client.completions.create(**GREEDY, prompt=prompt, echo=True, max_tokens=3)
        .choices[0]
        .text.startswith(prompt_text)
    )
    only = client.completions.create(**GREEDY, prompt=prompt, max_tokens=3, extra_body={"prompt_logprobs": 0})
    assert only.choices[0].logprobs is None and len(only.choices[0].model_dump()["prompt_logprobs"]) == n


@pytest.mark.parametrize("echo", [False, True])
def test_completions_n_with_logprobs_stream(client, tok, echo):
    prompt = prompt_ids(tok)
    kw = dict(GREEDY, prompt=prompt, max_tokens=10, logprobs=2, n=2, echo=echo)
    resp = client.completions.create(**kw)
    assert resp.choices[0].text.startswith(tok.decode(prompt)) == echo
    chunks = list(client.completions.create(stream=True, **kw))
    for c in resp.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text
        assert [t for m in mine if m.logprobs for t in m.logprobs.tokens] == c.logprobs.tokens
        assert [o for m in mine if m.logprobs for o in m.logprobs.text_offset] == c.logprobs.text_offset
        assert [m.finish_reason for m in mine if m.finish_reason] == [c.finish_reason]
    assert resp.choices[0].text == resp.choices[1].text


# ---- penalties ----------------------------------------------------------------------------------


def test_repetition_penalty_greedy_equals_transformers(client, tok):
    prompt = prompt_ids(tok)
    model = _hf_model(TARGET, torch.float32, "cpu")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    plain = client.completions.create(prompt=prompt, max_tokens=40, **GREEDY).choices[0].text
    for penalty in (1.3, 0.8):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt]), max_new_tokens=40, do_sample=False, repetition_penalty=penalty
            )[0, len(prompt) :].tolist()
        hf = hf[: hf.index(eos) + 1] if eos in hf else hf
        got = client.completions.create(
            prompt=prompt,
            max_tokens=40,
            logprobs=0,
            **GREEDY,
            extra_body={"repetition_penalty": penalty, "relaxed_thinking": False},
        ).choices[0]
        ids = token_ids(tok, got.logprobs.tokens)
        assert ids == hf, penalty
        assert got.text != plain  # the penalty changed the output
    # The toy is confident: OpenAI's penalties show over a longer output, at their largest value.
    long = client.completions.create(prompt=prompt, max_tokens=120, **GREEDY).choices[0].text
    for name in ("presence_penalty", "frequency_penalty"):
        pen = (
            client.completions.create(prompt=prompt, max_tokens=120, **GREEDY, **{name: 2.0}).choices[0].text
        )
        assert pen != long, name


def test_logit_bias_greedy_equals_transformers_under_speculation(client, tok):
    """The bias applies to the target's verify rows too: strict speculation with it gives exactly
    transformers' greedy output with the same additive bias (its sequence_bias on single tokens)."""
    prompt = prompt_ids(tok)
    model = _hf_model(TARGET, torch.float32, "cpu")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    plain = client.completions.create(prompt=prompt, max_tokens=40, logprobs=0, **GREEDY).choices[0]
    plain_ids = token_ids(tok, plain.logprobs.tokens)
    assert len(plain_ids) > 8
    # ban a token of the plain output, and push another one up a little
    bias = {plain_ids[6]: -100.0, plain_ids[2]: 1.5}
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
            sequence_bias={(t,): b for t, b in bias.items()},
        )[0, len(prompt) :].tolist()  # fmt: skip
    hf = hf[: hf.index(eos) + 1] if eos in hf else hf
    got = client.completions.create(
        prompt=prompt,
        max_tokens=40,
        logprobs=0,
        logit_bias={str(t): b for t, b in bias.items()},  # type: ignore[misc]
        **GREEDY,
        extra_body={"relaxed_thinking": False},
    ).choices[0]
    ids = token_ids(tok, got.logprobs.tokens)
    assert len(ids) == len(hf) > 0
    assert ids == hf
    assert plain_ids[6] not in ids and ids != plain_ids  # the bias changed the output
    with pytest.raises(openai.BadRequestError) as e:  # an id outside the vocabulary
        client.completions.create(prompt=prompt, max_tokens=2, logit_bias={str(len(tok) + 5): 1}, **GREEDY)
    assert e.value.body["param"] == "logit_bias"


# ---- response shapes (no server) ----------------------------------------------------------------


def test_logprob_shapes_order_and_clamp_infinity():
    from thinkspec.entrypoints.openai.logprobs import (
        LOGPROB_FLOOR,
        chat_logprobs,
        completion_logprobs,
        raw_prompt_logprobs,
    )
    from thinkspec.outputs import Logprob

    # chosen token 7 (rank 3, -inf as the raw logits can give), then the two best
    entry = {7: Logprob(float("-inf"), 3, "c"), 5: Logprob(-0.1, 1, "a"), 6: Logprob(-2.5, 2, "b")}
    chat = chat_logprobs([7], [entry], 2)["content"][0]
    assert chat["token"] == "c" and chat["logprob"] == LOGPROB_FLOOR == -9999.0 and chat["bytes"] == [99]
    assert [(t["token"], t["logprob"]) for t in chat["top_logprobs"]] == [("a", -0.1), ("b", -2.5)]
    comp = completion_logprobs([1, 7], [None, entry], 2, None, text_offset=4)
    assert comp["tokens"] == ["<1>", "c"] and comp["token_logprobs"] == [None, -9999.0]
    assert comp["top_logprobs"][0] is None and list(comp["top_logprobs"][1].items()) == [
        ("c", -9999.0),
        ("a", -0.1),
        ("b", -2.5),
    ]
    assert comp["text_offset"] == [4, 7]
    nan = {7: Logprob(float("nan"), 1, "c")}
    assert raw_prompt_logprobs([None, nan]) == [
        None,
        {7: {"logprob": -9999.0, "rank": 1, "decoded_token": "c"}},
    ]
    json.dumps([chat, comp], allow_nan=False)  # what the JSON responses need
