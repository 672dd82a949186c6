"""n, logprobs, echo and penalties through a real `thinkspec serve` process and the official `openai`
client (fp32, CPU). Speculation is on (n-gram), so logprobs come from verify windows too."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from checkpoints import hf_logits, tiny_checkpoint

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from server_process import serve_process  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("qwen3", tied=True)


@pytest.fixture(scope="module")
def client(ckpt) -> Iterator[openai.OpenAI]:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    args = [
        str(ckpt),
        "--device",
        "cpu",
        "--served-model-name",
        MODEL,
        "--speculative-config",
        json.dumps(spec),
    ]
    with serve_process(*args) as (proc, url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        proc.terminate()
        proc.wait(15)


MESSAGES = [{"role": "user", "content": "q12"}]


def test_chat_n_choices_with_indices(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=8, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) == 1  # greedy: identical
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert resp.usage.completion_tokens == 3 * single.usage.completion_tokens
    assert resp.choices[0].message.content == single.choices[0].message.content
    seeded = dict(model=MODEL, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=5)
    a, b = client.chat.completions.create(**seeded), client.chat.completions.create(**seeded)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    chunks = list(client.chat.completions.create(**seeded, stream=True))
    texts = {i: "" for i in range(3)}
    finals = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finals[c.index] = c.finish_reason
    assert [texts[i] for i in range(3)] == [c.message.content for c in a.choices]
    assert sorted(finals) == [0, 1, 2]


def test_chat_logprobs_shape_and_values(client, ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5
    )
    content = resp.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 5 for t in content)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    top = hf_logits(ckpt, prompt).double().log_softmax(-1)[-1].topk(5)
    first = content[0]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert [t.token for t in first.top_logprobs] == [tok.decode([i]) for i in top.indices.tolist()]
    assert first.logprob == pytest.approx(top.values[0].item(), abs=1e-5)  # greedy: the top token
    assert first.token == first.top_logprobs[0].token and first.bytes == list(first.token.encode())
    # Completions on the same prompt ids: the same tokens and values in the legacy shape.
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=5)
    lp = raw.choices[0].logprobs
    assert lp.tokens == [t.token for t in content]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in content], abs=1e-5)
    # Keyed by text: tokens that decode alike (byte pieces) share one key, as in OpenAI's API.
    for d, t in zip(lp.top_logprobs, content):
        assert 1 <= len(d) <= 5 and set(d) == {a.token for a in t.top_logprobs}
    assert lp.text_offset[0] == 0


def test_completions_echo_and_prompt_logprobs(client, ckpt):
    prompt = [72, 105, 33, 90, 91, 92]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logits(ckpt, prompt).double().log_softmax(-1)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-5)
    assert choice.text.startswith("".join(lp.tokens[: len(prompt)]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_penalties_and_limits(client):
    base = dict(model=MODEL, prompt="abcabcabc", max_tokens=16, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    pen = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=1.0).choices[0].text
    rep = client.completions.create(**base, extra_body={"repetition_penalty": 1.8}).choices[0].text
    assert pen != plain and rep != plain
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, logprobs=21)
    assert "max_logprobs" in str(e.value)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(**base, presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
