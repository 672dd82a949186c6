"""Incremental detokenization: the deltas join to the full decode, on the fast and the plain path."""

from __future__ import annotations

import random

import pytest
from checkpoints import build_tokenizer
from tokenizers.decoders import DecodeStream

from thinkspec.engine.detokenizer import (
    IncrementalDetokenizer,
    _decoder,
    detokenize_incrementally,
    initial_detokenize_offsets,
)


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

    from thinkspec.model_names import resolve_model_name

    tok = AutoTokenizer.from_pretrained(resolve_model_name("toy-reasoner"))
    rng = random.Random(3)
    ids = [rng.randrange(len(tok)) for _ in range(500)]
    for skip in (True, False):
        for i in range(0, 500, 25):
            part = ids[i : i + 40]
            assert _decoder(tok)(part, skip) == tok.decode(part, skip_special_tokens=skip)


# ---- the DecodeStream path ----------------------------------------------------------------------


def _toy_tokenizer():
    from transformers import AutoTokenizer

    from thinkspec.model_names import resolve_model_name

    return AutoTokenizer.from_pretrained(resolve_model_name("toy-reasoner"))


def _byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: `▁` word marks, `<0xNN>` byte tokens for what the vocabulary lacks,
    and a decoder that strips the first leading space, so a window's text depends on where it
    starts (tokenizers' DecodeStream then refuses some steps)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "▁a", "a", "b", "lo", "d", "e", "."]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


TOKENIZERS = {"byte-level": build_tokenizer, "toy": _toy_tokenizer, "byte-fallback": _byte_fallback_tokenizer}


def _run(tok, prompt: list[int], output: list[int], skip: bool):
    """(the detokenizer's deltas, the window decode's deltas, the detokenizer at the end)."""
    detok = IncrementalDetokenizer(tok, prompt, skip)
    ids = list(prompt)
    prefix, read = initial_detokenize_offsets(len(prompt))
    got, want = [], []
    for t in output:
        ids.append(t)
        got.append(detok.step(ids))
        delta, prefix, read = detokenize_incrementally(tok, ids, prefix, read, skip)
        want.append(delta)
    return got, want, detok


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_stream_deltas_equal_the_window_decode(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(11)
    text = "héllo wörld ✓ 数学 <think> a+b </think> 🙂 done. Sam has 12 apples"
    base = tok.encode(text, add_special_tokens=False)
    extra = [t for t in tok.all_special_ids] + [rng.randrange(len(tok)) for _ in range(8)]
    whole, mid_char, refused, checked = 0, 0, 0, 0
    for trial in range(300):
        skip = trial % 2 == 0
        prompt = base[: rng.randint(1, len(base))]  # often cut inside a character
        output = [rng.choice(base + extra) for _ in range(rng.randint(1, 50))]
        on_stream = IncrementalDetokenizer(tok, prompt, skip).stream is not None
        got, want, detok = _run(tok, prompt, output, skip)
        assert got == want, (name, trial)  # delta for delta, on either path
        if not on_stream:
            head = tok.decode(prompt[-5:], skip_special_tokens=skip)
            assert head.endswith("\ufffd"), (name, trial)  # the one reason to start on the fallback
            mid_char += 1
        elif detok.stream is None:
            refused += 1
        else:
            whole += 1
        full = tok.decode(prompt + output, skip_special_tokens=skip)
        head = tok.decode(prompt, skip_special_tokens=skip)
        # (Byte-fallback pieces decode differently alone than inside a window, for either path.)
        if name != "byte-fallback" and full.startswith(head) and not full.endswith("\ufffd"):
            assert head + "".join(got) == full, (name, trial)
            checked += 1
    assert whole >= 50 and mid_char >= 10, (whole, mid_char)
    if name == "byte-fallback":
        assert refused >= 10  # "Invalid prefix": the fallback took over mid-stream, same deltas
    else:
        assert refused == 0 and checked >= 50


class _CountingStream:
    steps = 0

    def __init__(self, *args, **kwargs):
        self.stream = DecodeStream(*args, **kwargs)

    def step(self, tokenizer, token_id):
        _CountingStream.steps += 1
        return self.stream.step(tokenizer, token_id)


def test_stream_costs_one_step_and_no_python_decode_per_token(monkeypatch):
    import thinkspec.engine.detokenizer as detokenizer

    calls = {"window": 0}
    window = detokenizer.detokenize_incrementally

    def counted(*args):
        calls["window"] += 1  # two decodes each
        return window(*args)

    monkeypatch.setattr(detokenizer, "DecodeStream", _CountingStream)
    monkeypatch.setattr(detokenizer, "detokenize_incrementally", counted)
    tok = _toy_tokenizer()
    prompt = tok.encode("Sam has 12 apples. He buys 30 more.", add_special_tokens=False)
    rng = random.Random(5)
    output = [rng.randrange(len(tok)) for _ in range(400)]
    _CountingStream.steps = 0
    got, want, detok = _run(tok, prompt, output, True)
    assert detok.stream is not None and got == want
    assert _CountingStream.steps == 5 + len(output)  # the primed context, then one step per token
    assert calls["window"] == 0  # no Python-side decode (_run's reference calls its own import)

    # A tokenizer that cleans up spaces in Python after decoding keeps the window decode.
    tok.clean_up_tokenization_spaces = True
    calls["window"] = _CountingStream.steps = 0
    _, _, detok = _run(tok, prompt, output, True)
    assert detok.stream is None and _CountingStream.steps == 0 and calls["window"] == len(output)


def test_bench_detokenize_smoke(tmp_path):
    # benchmarks/engine/bench_detokenize.py runs and both paths agree (it asserts so); figures in
    # BENCHMARKS.md
    import json
    import subprocess
    import sys

    from script_env import ENV, ROOT

    out = tmp_path / "detok.json"
    cmd = [
        sys.executable,
        "benchmarks/engine/bench_detokenize.py",
        "--num-tokens",
        "500",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["window_us_per_token"] > 0 and result["stream_us_per_token"] > 0
