"""Per-request relax settings: resolved once when a request is added, from its SamplingParams
overrides, else the engine's SpeculativeConfig, else the defaults; settings without relaxation
on are refused, never silently ignored."""

from __future__ import annotations

import math

import pytest
import torch
from checkpoints import THINK_ID, noisy_copy, tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.config import SpeculativeConfig
from thinkspec.sampling_params import RELAX_OFF, RelaxSettings, resolve_relax

DRAFT = {
    "method": "draft_model",
    "model": "draft-ckpt",
    "num_speculative_tokens": 4,
    "reasoning_parser": "qwen3",
}


def _spec(**overrides) -> SpeculativeConfig:
    return SpeculativeConfig(**{**DRAFT, **overrides})


def _as_tuple(r: RelaxSettings) -> tuple:
    return r.enabled, r.ratio, r.top_k, None if math.isnan(r.delta) else r.delta


def test_request_overrides_then_config_then_defaults():
    cfg = _spec(relaxed_thinking=True, relax_ratio=0.3, relax_top_k=8)
    assert _as_tuple(resolve_relax(SamplingParams(), cfg)) == (True, 0.3, 8, None)
    params = SamplingParams(relax_top_k=2, relax_delta=0.25)
    assert _as_tuple(resolve_relax(params, cfg)) == (True, 0.3, 2, 0.25)
    # Config relaxation on with nothing else set: the defaults (ratio 1, top-k 1).
    assert _as_tuple(resolve_relax(SamplingParams(), _spec(relaxed_thinking=True))) == (True, 1.0, 1, None)
    # A request opting in against a strict engine brings its own settings.
    params = SamplingParams(relaxed_thinking=True, relax_ratio=0.1, relax_top_k=8)
    assert _as_tuple(resolve_relax(params, _spec())) == (True, 0.1, 8, None)
    # Opting out, or no relaxation anywhere, is off.
    assert resolve_relax(SamplingParams(relaxed_thinking=False), cfg) is RELAX_OFF
    assert resolve_relax(SamplingParams(), _spec()) is RELAX_OFF
    assert resolve_relax(SamplingParams(), None) is RELAX_OFF
    assert not RELAX_OFF.enabled


@pytest.mark.parametrize("knob", [{"relax_ratio": 0.3}, {"relax_top_k": 4}, {"relax_delta": 0.1}])
@pytest.mark.parametrize("relaxed", [None, False])
def test_request_settings_without_relaxation_are_refused(knob, relaxed):
    params = SamplingParams(relaxed_thinking=relaxed, **knob)
    (name,) = knob
    for cfg in (_spec(), None):
        with pytest.raises(
            ValueError, match=rf"^request 'r1': {name} set but relaxed thinking is off; set relaxed_thinking"
        ):
            resolve_relax(params, cfg, "request 'r1'")


def test_engine_refuses_a_request_whose_relax_settings_would_be_ignored(tmp_path):
    target = tiny_checkpoint("qwen3", tied=True)
    draft = noisy_copy(target, tmp_path / "noisy", 0.05)
    cfg = {"model": str(draft), "num_speculative_tokens": 2, "reasoning_parser": "qwen3"}  # strict engine
    llm = LLM(target, device="cpu", speculative_config=cfg)
    ignored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, relax_ratio=0.1, relax_top_k=8)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[72, 105, 33, THINK_ID]] * 2, [ignored, plain], use_tqdm=False)
    assert len(outs) == 2
    assert outs[0].outputs[0].finish_reason == "error" and "relaxed_thinking" in outs[0].error
    assert "relax_ratio, relax_top_k" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 6


def test_verify_rows_read_back_each_request_by_name():
    # A verify step's per-request numbers cross to the device in one tensor; each named column must
    # read back what its request put in.
    from thinkspec.engine.sequence import Sequence
    from thinkspec.engine.verify_rows import VerifyRows

    relaxed = RelaxSettings(True, 0.25, 8, 0.5)
    a = Sequence(
        "a", [1, 2], SamplingParams(temperature=0), relax=relaxed, thinking=True, num_thinking_tokens=7
    )
    b = Sequence("b", [3], SamplingParams(temperature=0.7, thinking_token_budget=40))
    rows = VerifyRows([VerifyRows.row(3, a, -1), VerifyRows.row(0, b, 40)], torch.device("cpu"))
    assert rows.dev.shape == (2, 13) and rows.dev.dtype == torch.float64
    assert rows.num_drafts.tolist() == [3, 0] and rows.num_drafts.dtype == torch.int64
    assert rows.relax_on.tolist() == [True, False]
    assert rows.ratio.tolist() == [0.25, 1.0] and rows.top_k.tolist() == [8, 1]
    assert rows.delta[0].item() == 0.5 and math.isnan(rows.delta[1].item())
    assert rows.thinking.tolist() == [True, False] and rows.thinking_tokens.tolist() == [7, 0]
    assert rows.temperature.tolist() == [0.0, 1.0] and rows.budget.tolist() == [-1, 40]
    fields = rows.rule_fields()
    assert fields["relax_rule"].tolist() == [0, 0] and fields["relax_rule"].dtype == torch.int64
    assert fields["relax_lambda"].tolist() == [1.0, 1.0]
    assert not VerifyRows.any_rule([a, b])
    lenient = Sequence("c", [1], SamplingParams(temperature=0.6), relax=RelaxSettings(True, rule="typical",
                       threshold=0.25, alpha=0.5, lam=0.75))  # fmt: skip
    rows = VerifyRows([VerifyRows.row(1, lenient, -1), VerifyRows.row(0, b, 40)], torch.device("cpu"))
    fields = rows.rule_fields()
    assert fields["relax_rule"].tolist() == [2, 0] and fields["relax_lambda"].tolist() == [0.75, 1.0]
    assert fields["posterior_threshold"].tolist() == [0.25, 0.09000000357627869]
    assert fields["posterior_alpha"].tolist() == [0.5, 0.30000001192092896]
    assert VerifyRows.any_rule([a, lenient])


def test_rule_resolves_request_then_config_then_default():
    cfg = _spec(relaxed_thinking=True, relax_rule="lenient", relax_lambda=0.5)
    r = resolve_relax(SamplingParams(), cfg)
    assert (r.rule, r.lam, r.threshold, r.alpha) == ("lenient", 0.5, 0.09, 0.3)
    r = resolve_relax(SamplingParams(relax_rule="typical", posterior_threshold=0.2), cfg)
    assert (r.rule, r.lam, r.threshold, r.alpha, r.rule_code) == ("typical", 0.5, 0.2, 0.3, 2)
    r = resolve_relax(SamplingParams(), _spec(relaxed_thinking=True))
    assert (r.rule, r.lam, r.rule_code) == ("topk_ratio", 1.0, 0)
    with pytest.raises(ValueError, match="relax_lambda set but relaxed thinking is off"):
        resolve_relax(SamplingParams(relax_lambda=0.5), _spec())


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("relax_rule", "greedy", r"relax_rule must be one of \['topk_ratio', 'lenient', 'typical'\]"),
        ("relax_lambda", 0.0, r"relax_lambda must be a float in \(0, 1\]"),
        ("relax_lambda", 1.01, r"relax_lambda must be a float in \(0, 1\]"),
        ("posterior_threshold", 1.5, r"posterior_threshold must be a float in \[0, 1\]"),
        ("posterior_alpha", -1.0, "posterior_alpha must be a finite float >= 0"),
        ("posterior_alpha", math.inf, "posterior_alpha must be a finite float >= 0"),
    ],
)
def test_rule_fields_are_validated_at_construction(field, value, match):
    with pytest.raises(ValueError, match="SamplingParams." + match):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="SpeculativeConfig." + match):
        _spec(relaxed_thinking=True, **{field: value})
    with pytest.raises(ValueError, match="given without relaxed_thinking=True"):
        _spec(**{field: "lenient" if field == "relax_rule" else 0.5})


def test_lenient_lambda_one_matches_strict_end_to_end(tmp_path):
    # Lenient with lambda = 1 accepts exactly where the lossless test does (same uniforms), so with
    # the same seed its tokens are the strict engine's; a small lambda relaxes and changes them.
    target = tiny_checkpoint("qwen3", tied=True)
    draft = noisy_copy(target, tmp_path / "noisy", 0.3)
    cfg = {"model": str(draft), "num_speculative_tokens": 3, "reasoning_parser": "qwen3"}
    prompts = [[72, 105, 33, THINK_ID]] * 3
    strict = LLM(target, device="cpu", speculative_config=cfg)
    relaxed = {**cfg, "relaxed_thinking": True, "relax_rule": "lenient"}
    lenient = LLM(target, device="cpu", speculative_config=relaxed)

    def run(llm, **kw):
        params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=7, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    base = run(strict)
    assert len(base) == 3 and all(len(t) == 24 for t in base)
    assert run(lenient, relax_lambda=1.0) == base
    assert run(lenient, relax_lambda=0.05) != base


def test_typical_knobs_reach_the_acceptance_end_to_end(tmp_path):
    # Threshold min(eps, alpha * exp(-H)): eps = 1 with a huge alpha passes nothing (strict's
    # tokens); either knob at 0 passes every draft with p > 0, and the output changes.
    target = tiny_checkpoint("qwen3", tied=True)
    draft = noisy_copy(target, tmp_path / "noisy", 0.3)
    cfg = {"model": str(draft), "num_speculative_tokens": 3, "reasoning_parser": "qwen3"}
    prompts = [[72, 105, 33, THINK_ID]] * 3
    strict = LLM(target, device="cpu", speculative_config=cfg)
    typical = LLM(
        target, device="cpu", speculative_config={**cfg, "relaxed_thinking": True, "relax_rule": "typical"}
    )

    def run(llm, **kw):
        params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=11, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    base = run(strict)
    assert len(base) == 3 and all(len(t) == 24 for t in base)
    assert run(typical, posterior_threshold=1.0, posterior_alpha=1e6) == base
    assert run(typical, posterior_threshold=1.0, posterior_alpha=0.0) != base
    assert run(typical, posterior_threshold=0.0, posterior_alpha=1e6) != base
