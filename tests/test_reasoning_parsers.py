import itertools
import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from thinkspec.reasoning import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

WORDS = ["[UNK]", "user", "assistant", "What", "is", "two", "plus", "Let", "me", "think", "It", "four", "<t>"]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(markers=("<think>", "</think>"), pre_tokenizer=None) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL)
    # Qwen3 ships the think markers as added, non-special tokens.
    tok.add_tokens([AddedToken(m, special=False) for m in markers])
    return tok


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|im_end|>")


def chat_prompt(template: str) -> str:
    user = "<|im_start|>user\nWhat is two plus two<|im_end|>\n<|im_start|>assistant\n"
    return {
        "r1": user + "<think>\n",
        "qwen3_thinking": user,
        "qwen3_no_thinking": user + "<think>\n\n</think>\n\n",
        "history_then_r1": "<|im_start|>assistant\n<think>\nx\n</think>\n\nIt<|im_end|>\n"
        + user
        + "<think>\n",
    }[template]


@pytest.fixture(params=["raw", "transformers"])
def tokenizer(request):
    tok = build_tokenizer()
    return tok if request.param == "raw" else wrap(tok)


def encode(tokenizer, text):
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


# ---- resolving against a tokenizer ------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_resolve_marker_and_protected_ids(tokenizer, name):
    resolved = get_reasoning_parser(name).resolve(tokenizer)
    vocab = build_tokenizer().get_vocab(with_added_tokens=True)
    assert resolved.think_start_id == vocab["<think>"]
    assert resolved.think_end_id == vocab["</think>"]
    expected = {vocab[t] for t in [*SPECIAL, "<think>", "</think>"]}
    assert set(resolved.protected_token_ids) == expected
    assert list(resolved.protected_token_ids) == sorted(expected)
    for word in ("user", "think", "four", "[UNK]"):
        assert vocab[word] not in resolved.protected_token_ids


def test_resolve_extra_protected_ids(tokenizer):
    resolved = get_reasoning_parser("qwen3").resolve(tokenizer, extra_protected_token_ids=(3, 4))
    assert {3, 4} <= set(resolved.protected_token_ids)
    with pytest.raises(ValueError, match="extra_protected_token_ids"):
        get_reasoning_parser("qwen3").resolve(tokenizer, extra_protected_token_ids=(-1,))


def test_transformers_special_tokens_are_protected():
    fast = wrap(build_tokenizer())
    fast.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    resolved = get_reasoning_parser("qwen3").resolve(fast)
    assert fast.convert_tokens_to_ids("<|tool|>") in resolved.protected_token_ids
    assert fast.eos_token_id in resolved.protected_token_ids


@pytest.mark.parametrize("kind", ["raw", "transformers"])
def test_missing_marker_raises_naming_marker(kind):
    tok = build_tokenizer(markers=("<think>",))
    tok = tok if kind == "raw" else wrap(tok)
    with pytest.raises(ValueError, match=r"think_end marker '</think>' is not a token of tokenizer"):
        get_reasoning_parser("deepseek_r1").resolve(tok)
    with pytest.raises(ValueError, match=r"'generic'.*think_start marker '<x>'"):
        ReasoningParser.from_tokens("<x>", "</think>").resolve(tok)


@pytest.mark.parametrize("kind", ["raw", "transformers"])
def test_marker_that_is_not_a_single_token_raises(kind):
    # "<t>" is a vocabulary word, but this pre-tokenizer splits it into "<", "t", ">".
    tok = build_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace())
    tok = tok if kind == "raw" else wrap(tok)
    with pytest.raises(ValueError, match=r"think_start marker '<t>' does not encode to the single token 12"):
        ReasoningParser.from_tokens("<t>", "</think>").resolve(tok)


def test_resolve_rejects_other_objects():
    with pytest.raises(ValueError, match="tokenizer must be"):
        get_reasoning_parser("qwen3").resolve(object())


@pytest.mark.parametrize(
    ("template", "thinking"),
    [("r1", True), ("qwen3_thinking", False), ("qwen3_no_thinking", False), ("history_then_r1", True)],
)
def test_initial_phase_from_chat_prompts(tokenizer, template, thinking):
    resolved = get_reasoning_parser("deepseek_r1").resolve(tokenizer)
    ids = encode(tokenizer, chat_prompt(template))
    markers = [i for i in ids if i in (resolved.think_start_id, resolved.think_end_id)]
    assert (
        len(markers) == {"r1": 1, "qwen3_thinking": 0, "qwen3_no_thinking": 2, "history_then_r1": 3}[template]
    )
    assert resolved.initial_phase(ids) is thinking


# ---- parser construction ---------------------------------------------------------------------


def test_known_parsers_and_errors():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert get_reasoning_parser("qwen3").think_start == "<think>"
    with pytest.raises(
        ValueError, match=r"reasoning_parser must be one of \('deepseek_r1', 'qwen3'\), got 'r1'"
    ):
        get_reasoning_parser("r1")
    for start, end, what in [
        ("", "</t>", "think_start must be a non-empty string"),
        ("<t>", None, "think_end must be a non-empty string"),
        ("<t>\n", "</t>", "must not contain a newline"),
        ("<t>", "<t>", "neither may contain the other"),
        ("<t>", "<t>x", "neither may contain the other"),
    ]:
        with pytest.raises(ValueError, match=what):
            ReasoningParser.from_tokens(start, end)


# ---- whole-output split ----------------------------------------------------------------------

R1 = get_reasoning_parser("deepseek_r1")

SPLIT_CASES = [
    # R1: the prompt opened the block (and put the newline after <think>).
    ("Let me think\n</think>\n\nIt is four", True, ("Let me think", "It is four")),
    (
        "\nLet me think\n</think>\n\nIt is four",
        True,
        ("Let me think", "It is four"),
    ),  # prompt ended at <think>
    ("Let me think", True, ("Let me think", None)),  # unfinished thought
    ("a\n\nb\n\n</think>\n\n\nc\n", True, ("a\n\nb\n", "\nc\n")),  # only the template newlines go
    ("</think>\n\nIt", True, (None, "It")),
    ("", True, (None, None)),
    ("\n", True, (None, None)),
    # Qwen3 thinking on: the output opens the block itself.
    ("<think>\nLet me think\n</think>\n\nIt is four", False, ("Let me think", "It is four")),
    ("<think>\n\n</think>\n\nIt is four", False, (None, "It is four")),
    ("<think>\nLet me", False, ("Let me", None)),
    ("Sure. <think>\nhm\n</think>\n\nfour", False, ("hm", "Sure. four")),  # text before the start marker
    # Qwen3 thinking off / plain answers: no marker, all content, untouched.
    ("It is four", False, (None, "It is four")),
    ("\n\nIt is four\n", False, (None, "\n\nIt is four\n")),
    # Stray or repeated markers still switch phases and are dropped.
    ("a</think>b<think>c</think>d", False, ("c", "abd")),
    ("a<think>b<think>c", True, ("abc", None)),
    ("<think>x\n<think>\ny</think>z", False, ("x\ny", "z")),
    ("x\n\n</think>", True, ("x\n", None)),
    ("<thinking> is not a marker", False, (None, "<thinking> is not a marker")),
]


@pytest.mark.parametrize(("text", "starts", "expected"), SPLIT_CASES)
def test_split_cases(text, starts, expected):
    assert R1.split(text, starts) == expected
    assert get_reasoning_parser("qwen3").split(text, starts) == expected


def test_split_end_to_end_with_tokenizer(tokenizer):
    resolved = get_reasoning_parser("qwen3").resolve(tokenizer)
    for template, output, expected in [
        ("r1", "Let me think\n</think>\n\nIt is four", ("Let me think", "It is four")),
        ("qwen3_thinking", "<think>\nLet me think\n</think>\n\nIt is four", ("Let me think", "It is four")),
        ("qwen3_no_thinking", "It is four", (None, "It is four")),
    ]:
        starts = resolved.initial_phase(encode(tokenizer, chat_prompt(template)))
        assert resolved.split(output, starts) == expected


# ---- streaming ----------------------------------------------------------------------------------


def chunkings(text):
    """Every way to cut text into non-empty chunks (2^(n-1) of them)."""
    n = len(text)
    for cuts in itertools.product((False, True), repeat=max(n - 1, 0)):
        chunks, last = [], 0
        for i, cut in enumerate(cuts, start=1):
            if cut:
                chunks.append(text[last:i])
                last = i
        chunks.append(text[last:])
        yield chunks


def run_stream(parser, chunks, starts):
    stream = parser.stream(starts)
    reasoning, content = [], []
    for part in [*(stream.feed(c) for c in chunks), stream.finish()]:
        for out, delta in zip((reasoning, content), part):
            assert delta is None or delta != ""  # empty deltas are None, never ""
            if delta is not None:
                out.append(delta)
    return "".join(reasoning) or None, "".join(content) or None


SHORT = ReasoningParser.from_tokens("<t>", "</t>")
PIECES = ["a", "\n", "\n", "<t>", "</t>", "<", "</", "t", ">"]


def short_texts():
    rng = random.Random(0)
    texts = {
        "",
        "\n",
        "<t>",
        "</t>",
        "<t>\na\n</t>\n\nb",
        "a\n</t>\n\nb",
        "<t>\n\n</t>\n\n",
        "<</t>",
        "</<t>",
        "\n\n\n</t>",
        "a\n<t",
        "<t>\n</t",
        "a</t><t>b",
    }
    while len(texts) < 70:
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 7)))
        if len(text) <= 11:
            texts.add(text)
    return sorted(texts)


@pytest.mark.parametrize("starts", [True, False])
def test_stream_equals_split_for_every_chunking(starts):
    checked = 0
    for text in short_texts():
        whole = SHORT.split(text, starts)
        for chunks in chunkings(text):
            assert run_stream(SHORT, chunks, starts) == whole, (text, chunks)
            checked += 1
    assert checked > 5000


@pytest.mark.parametrize("starts", [True, False])
def test_stream_equals_split_random_chunkings_real_markers(starts):
    rng = random.Random(1)
    pieces = ["It", " is", "\n", "\n\n", "<think>", "</think>", "<thi", "</th", "<", "four", "nk>", "</"]
    texts = [text for text, _, _ in SPLIT_CASES]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))) for _ in range(60)]
    for text in texts:
        whole = R1.split(text, starts)
        for _ in range(40):
            cuts = (
                sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
                if len(text) > 1
                else []
            )
            chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
            assert run_stream(R1, chunks, starts) == whole, (text, chunks)
        assert run_stream(R1, list(text), starts) == whole
        assert run_stream(R1, [text], starts) == whole


def test_stream_holds_back_only_possible_markers():
    stream = R1.stream(starts_in_thinking=False)
    assert stream.feed("It is") == (None, "It is")
    assert stream.feed(" four <") == (None, " four ")  # "<" may start a marker
    assert stream.feed("b>") == (None, "<b>")
    assert stream.feed("<think") == (None, None)
    assert stream.feed(">\nLet") == ("Let", None)
    assert stream.thinking
    assert stream.feed(" me\n") == (" me", None)  # the newline may precede </think>
    assert stream.feed("x") == ("\nx", None)
    assert stream.feed("\n</think>\n") == (None, None)
    assert not stream.thinking
    assert stream.feed("\nIt") == (None, "It")
    assert stream.feed("\n") == (None, None)  # a stray </think> may follow, which drops the newline
    assert stream.feed("\n</") == (None, "\n")
    assert stream.finish() == (None, "\n</")


def test_stream_lifecycle():
    stream = R1.stream(True)
    stream.finish()
    with pytest.raises(ValueError, match="after finish"):
        stream.feed("x")
    with pytest.raises(ValueError, match="finish called twice"):
        stream.finish()


def test_resolved_stream_matches_split(tokenizer):
    resolved = get_reasoning_parser("deepseek_r1").resolve(tokenizer)
    text = "<think>\nLet me think\n</think>\n\nIt is four"
    assert run_stream(resolved, [text[:9], text[9:25], text[25:]], False) == resolved.split(text, False)


# ---- where an output starts, and the phase tracker agreeing with the split ------------------------

PROMPT_STATES = {"r1": True, "qwen3_thinking": None, "qwen3_no_thinking": False, "history_then_r1": True}


@pytest.mark.parametrize("template", sorted(PROMPT_STATES))
@pytest.mark.parametrize("enable", [None, True, False])
def test_starts_in_thinking_follows_vllm_rules(tokenizer, template, enable):
    ids = encode(tokenizer, chat_prompt(template))
    kwargs = None if enable is None else {"enable_thinking": enable}
    # deepseek_r1: everything before a lone </think> is reasoning, whatever the prompt or the flag.
    assert get_reasoning_parser("deepseek_r1").resolve(tokenizer).starts_in_thinking(ids, kwargs) is True
    # qwen3: the template flag decides (default on); a raw prompt that closed the block starts the answer.
    qwen3 = get_reasoning_parser("qwen3").resolve(tokenizer).starts_in_thinking(ids, kwargs)
    assert qwen3 is (enable if enable is not None else PROMPT_STATES[template] is not False)
    # A parser from explicit markers: the prompt's last marker.
    generic = ReasoningParser.from_tokens("<think>", "</think>").resolve(tokenizer)
    assert generic.starts_in_thinking(ids, kwargs) is (PROMPT_STATES[template] is True)


def test_start_rule_is_validated():
    with pytest.raises(ValueError, match="start_rule must be one of"):
        ReasoningParser("x", "<a>", "</a>", start_rule="sometimes")


def _toy_tokenizer():
    from transformers import AutoTokenizer

    from thinkspec.model_names import resolve_model_name

    return AutoTokenizer.from_pretrained(resolve_model_name("toy-reasoner"))


def _random_outputs(tok, rng, n):
    words = ["Okay", ",", " let", " me", " add", " 12", " +", " 30", ".", "\n", "\n\n", " So", "**Answer:**"]
    pieces = [tok.encode(w, add_special_tokens=False) for w in words]
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    pieces += [[start], [end], [end], tok.encode("\n</think>\n\n", add_special_tokens=False)]
    return [[t for _ in range(rng.randint(0, 30)) for t in rng.choice(pieces)] for _ in range(n)]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("enable", [True, False])
def test_tracker_and_split_agree_on_whole_outputs_and_streams(name, enable):
    """Every token the tracker counts as thinking is text the parser returns as reasoning, and the
    rest is content, for whole outputs and token by token through the stream."""
    tok = _toy_tokenizer()
    resolved = get_reasoning_parser(name).resolve(tok)
    kwargs = {"enable_thinking": enable}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True, **kwargs)  # fmt: skip
    starts = resolved.starts_in_thinking(tok.encode(prompt, add_special_tokens=False), kwargs)
    assert starts is (True if name == "deepseek_r1" else enable)
    tracker = resolved.tracker()
    markers = (resolved.think_start_id, resolved.think_end_id)
    for output in _random_outputs(tok, random.Random(5), 40):
        by_phase = {True: [], False: []}
        stream = resolved.stream(starts)
        streamed = {True: [], False: []}
        thinking = starts
        for t in output:
            text = tok.decode([t], skip_special_tokens=True)
            if t not in markers:
                by_phase[thinking].append(text)
            thinking, _ = tracker.step_host(thinking, t)
            for phase, delta in zip((True, False), stream.feed(text)):
                streamed[phase].append(delta or "")
            assert stream.thinking is thinking, output
        for phase, delta in zip((True, False), stream.finish()):
            streamed[phase].append(delta or "")
        whole = resolved.split(tok.decode(output, skip_special_tokens=True), starts)
        for phase, part in zip((True, False), whole):
            # The split drops only the template's newlines around markers.
            assert (part or "").replace("\n", "") == "".join(by_phase[phase]).replace("\n", ""), output
            assert "".join(streamed[phase]) == (part or "")
