"""relax_protect: drafts in a protected set (token ids, named classes, regexes over token text) take
the strict test even where relaxation is on, like the think markers and EOS."""

from __future__ import annotations

import pytest
import torch
from checkpoints import THINK_ID, build_tokenizer, noisy_copy, tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.config import PROTECT_CLASSES, SpeculativeConfig
from thinkspec.reasoning import tracker as tracker_mod
from thinkspec.reasoning.tracker import PhaseTracker
from thinkspec.sampling_params import resolve_relax

SPEC = {"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "reasoning_parser": "qwen3"}


def test_class_names_agree_with_config():
    assert tuple(tracker_mod.PROTECT_CLASSES) == PROTECT_CLASSES


@pytest.mark.parametrize(
    "value, match",
    [
        (["letters"], "relax_protect items must be token ids >= 0, class names"),
        ([-1], "relax_protect items must be"),
        ([True], "relax_protect items must be"),
        (["re:("], r"relax_protect regex '\(' is invalid"),
        ({"digits": 1}, "relax_protect must be a list of at most 4096"),
        (list(range(4097)), "relax_protect must be a list of at most 4096"),
    ],
)
def test_bad_settings_raise(value, match):
    with pytest.raises(ValueError, match="SamplingParams." + match):
        SamplingParams(relax_protect=value)
    with pytest.raises(ValueError, match="SpeculativeConfig." + match):
        SpeculativeConfig(**SPEC, relaxed_thinking=True, relax_protect=value)


def test_resolved_per_request_over_the_engine():
    cfg = SpeculativeConfig(**SPEC, relaxed_thinking=True, relax_protect="digits")
    assert resolve_relax(SamplingParams(), cfg).protect == ("digits",)
    assert resolve_relax(SamplingParams(relax_protect=[7, "re:^x"]), cfg).protect == (7, "re:^x")
    assert resolve_relax(SamplingParams(relax_protect=[]), cfg).protect == ()
    with pytest.raises(ValueError, match="relax_protect set but relaxed thinking is off"):
        resolve_relax(SamplingParams(relax_protect=["digits"]), SpeculativeConfig(**SPEC))
    with pytest.raises(ValueError, match="given without relaxed_thinking=True"):
        SpeculativeConfig(**SPEC, relax_protect=["digits"])


def test_masks_from_token_text_are_built_once():
    tok = build_tokenizer()
    v = len(tok) + 3  # model vocabularies may be larger than the tokenizer's
    tr = PhaseTracker(THINK_ID, THINK_ID + 1)
    digits = tr.protect_mask(("digits",), tok, v, torch.device("cpu"))
    assert digits.shape == (v,) and digits.dtype == torch.bool
    want = [i for i in range(len(tok)) if any(c.isdigit() for c in tok.decode([i]))]
    assert torch.nonzero(digits)[:, 0].tolist() == want and len(want) >= 10
    assert tr.protect_mask(("digits",), tok, v, torch.device("cpu")) is digits  # cached
    mixed = tr.protect_mask((5, v + 9, "operators", "re:^x$"), tok, v, torch.device("cpu"))
    ops = {i for i in range(len(tok)) if any(c in "+-*/=<>^%" for c in tok.decode([i]))}
    assert set(torch.nonzero(mixed)[:, 0].tolist()) == ops | {5, tok.encode("x")[0]}
    with pytest.raises(ValueError, match="need a tokenizer"):
        PhaseTracker(THINK_ID, THINK_ID + 1).protect_mask(("digits",), None, v, torch.device("cpu"))
    drafts = torch.tensor([[48, 65, -1], [48, 65, 49]])  # '0', 'A', pad / '0', 'A', '1'
    hit = tr.protected_drafts(drafts, [("digits",), ()], tok, v)
    assert hit.tolist() == [[True, False, False], [False, False, False]]
    assert tr.protected_drafts(drafts, [(), ()], tok, v) is None


def test_protected_drafts_are_never_relaxed(tmp_path):
    # A very loose relaxed test changes the greedy output; protecting every token id brings back
    # exactly the strict output, and protecting none leaves the relaxed one.
    target = tiny_checkpoint("qwen3", tied=True)
    draft = noisy_copy(target, tmp_path / "noisy", 0.3)
    cfg = {"model": str(draft), "num_speculative_tokens": 3, "reasoning_parser": "qwen3"}
    relaxed = {**cfg, "relaxed_thinking": True, "relax_ratio": 0.0, "relax_top_k": 64}
    prompts = [[72, 105, 33, THINK_ID], [87, 104, 121, THINK_ID]]

    def run(spec, **kw):
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **kw)
        outs = LLM(target, device="cpu", speculative_config=spec).generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    strict = run(cfg)
    assert len(strict) == 2 and all(len(t) == 32 for t in strict)
    loose = run(relaxed)
    assert loose != strict
    assert run(relaxed, relax_protect=list(range(len(build_tokenizer())))) == strict
    assert run({**relaxed, "relax_protect": list(range(len(build_tokenizer())))}) == strict
