"""Incremental detokenization: the deltas join to the full decode, on the fast and the plain path."""

from __future__ import annotations

import random

import pytest
from checkpoints import build_tokenizer

from thinkspec.utils import _decoder, detokenize_incrementally, initial_detokenize_offsets


def _stream(tok, prompt: list[int], output: list[int], skip: bool) -> str:
    ids = list(prompt)
    prefix, read = initial_detokenize_offsets(len(prompt))
    text = ""
    for t in output:
        ids.append(t)
        delta, prefix, read = detokenize_incrementally(tok, ids, prefix, read, skip)
        text += delta
    return text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("clean_up", [False, True])
def test_deltas_join_to_the_full_decode(skip, clean_up):
    tok = build_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    _decoder.cache_clear()
    assert _decoder(tok)([104, 105], skip) == tok.decode([104, 105], skip_special_tokens=skip)
    rng = random.Random(7)
    text = "héllo wörld ✓ 数学 <think> a+b </think> 🙂 done"
    base = tok.encode(text, add_special_tokens=False)
    checked = 0
    for trial in range(20):
        # Byte-level ids split multi-byte characters; special and added tokens mixed in.
        output = [rng.choice(base + [256, 257, 258, 259, 260]) for _ in range(rng.randint(1, 60))]
        prompt = base[: rng.randint(1, len(base))]
        full = tok.decode(prompt + output, skip_special_tokens=skip)
        head = tok.decode(prompt, skip_special_tokens=skip)
        joined = _stream(tok, prompt, output, skip)
        if full.startswith(head) and not full.endswith("\ufffd"):
            assert head + joined == full, trial
            checked += 1
    assert checked >= 10
    _decoder.cache_clear()


def test_toy_tokenizer_fast_path_matches_the_wrapper():
    from transformers import AutoTokenizer

    from thinkspec.toy.assets import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("toy-reasoner"))
    rng = random.Random(3)
    ids = [rng.randrange(len(tok)) for _ in range(500)]
    for skip in (True, False):
        for i in range(0, 500, 25):
            part = ids[i : i + 40]
            assert _decoder(tok)(part, skip) == tok.decode(part, skip_special_tokens=skip)
