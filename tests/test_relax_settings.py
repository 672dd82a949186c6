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
    assert rows.dev.shape == (2, 9) and rows.dev.dtype == torch.float64
    assert rows.num_drafts.tolist() == [3, 0] and rows.num_drafts.dtype == torch.int64
    assert rows.relax_on.tolist() == [True, False]
    assert rows.ratio.tolist() == [0.25, 1.0] and rows.top_k.tolist() == [8, 1]
    assert rows.delta[0].item() == 0.5 and math.isnan(rows.delta[1].item())
    assert rows.thinking.tolist() == [True, False] and rows.thinking_tokens.tolist() == [7, 0]
    assert rows.temperature.tolist() == [0.0, 1.0] and rows.budget.tolist() == [-1, 40]
