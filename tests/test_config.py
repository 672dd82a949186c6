import json
import math
import pathlib

import pytest

import thinkspec
from thinkspec.config import SpeculativeConfig, validate_relax_fields
from thinkspec.reasoning import ReasoningParser
from thinkspec.sampling_params import SamplingParams, resolve_relax

DRAFT = {"method": "draft_model", "model": "draft-ckpt", "num_speculative_tokens": 4}


RELAXED = {"relaxed_thinking": True, "reasoning_parser": "qwen3"}


def make(**overrides):
    return SpeculativeConfig(**{**DRAFT, **overrides})


def test_lazy_export():
    assert thinkspec.SpeculativeConfig is SpeculativeConfig


def test_defaults_are_strict_and_disabled():
    cfg = SpeculativeConfig()
    assert not cfg.enabled
    assert cfg.method is None and cfg.num_speculative_tokens is None
    assert cfg.relaxed_thinking is False
    assert cfg.relax_ratio is None and cfg.relax_top_k is None and cfg.relax_delta is None  # unset
    assert cfg.build_reasoning_parser() is None

    spec = make()
    assert spec.enabled and spec.relaxed_thinking is False
    assert (spec.relax_ratio, spec.relax_top_k, spec.relax_delta) == (None, None, None)
    # Unset, relax_ratio=1 with top_k=1 admits only the argmax: the relaxed test adds nothing even if enabled.
    on = make(relaxed_thinking=True, reasoning_parser="qwen3")
    relax = resolve_relax(SamplingParams(), on)
    assert (relax.enabled, relax.ratio, relax.top_k) == (True, 1.0, 1) and math.isnan(relax.delta)


def test_model_implies_draft_model_method():
    cfg = SpeculativeConfig(model="d", num_speculative_tokens=3)
    assert cfg.method == "draft_model"
    assert SpeculativeConfig(model=pathlib.Path("some/dir"), num_speculative_tokens=2).model == "some/dir"


def test_ngram_defaults_follow_vllm():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 3)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 2)
    cfg = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=4
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (1, 4)


BAD = [
    # (overrides on DRAFT, field named in the message, range/what named in the message)
    ({"method": "eagle"}, "method", "draft_model"),
    ({"method": 3}, "method", "ngram"),
    ({"model": ""}, "model", "non-empty"),
    ({"model": 5}, "model", "non-empty"),
    ({"model": None}, "model", "required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens", "[1, 16]"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens", "[1, 16]"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens", "[1, 16]"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens", "[1, 16]"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens", "[1, 16]"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens", "[1, 16]"),
    ({"num_speculative_tokens": None}, "num_speculative_tokens", "required"),
    ({"prompt_lookup_min": 2}, "prompt_lookup_min", "ngram"),
    ({"prompt_lookup_max": 2}, "prompt_lookup_max", "ngram"),
    ({"relaxed_thinking": 1, "reasoning_parser": "qwen3"}, "relaxed_thinking", "bool"),
    ({"relaxed_thinking": "yes", "reasoning_parser": "qwen3"}, "relaxed_thinking", "bool"),
    ({"relax_ratio": 1.5}, "relax_ratio", "[0, 1]"),
    ({"relax_ratio": -0.1}, "relax_ratio", "[0, 1]"),
    ({"relax_ratio": math.nan}, "relax_ratio", "[0, 1]"),
    ({"relax_ratio": math.inf}, "relax_ratio", "[0, 1]"),
    ({"relax_ratio": True}, "relax_ratio", "[0, 1]"),
    ({"relax_ratio": "0.5"}, "relax_ratio", "[0, 1]"),
    ({"relax_top_k": 0}, "relax_top_k", "[1, 64]"),
    ({"relax_top_k": 65}, "relax_top_k", "[1, 64]"),
    ({"relax_top_k": True}, "relax_top_k", "[1, 64]"),
    ({"relax_top_k": 2.0}, "relax_top_k", "[1, 64]"),
    ({"relax_delta": 1.01}, "relax_delta", "[0, 1]"),
    ({"relax_delta": -1e-9}, "relax_delta", "[0, 1]"),
    ({"relax_delta": math.nan}, "relax_delta", "[0, 1]"),
    ({"relax_delta": False}, "relax_delta", "[0, 1]"),
    ({"reasoning_parser": "r1"}, "reasoning_parser", "deepseek_r1"),
    ({"think_start_token": ""}, "think_start_token", "non-empty"),
    ({"think_end_token": 7}, "think_end_token", "non-empty"),
    ({"think_start_token": "<t>"}, "think_end_token", "required"),
    ({"think_end_token": "</t>"}, "think_start_token", "required"),
    ({"relaxed_thinking": True}, "relaxed_thinking", "reasoning_parser"),
    ({"relaxed_thinking": True, "think_start_token": "<t>"}, "think_end_token", "required"),
    ({"think_start_token": "<t>", "think_end_token": "<t>"}, "SpeculativeConfig", "neither"),
]


@pytest.mark.parametrize(("overrides", "name", "allowed"), BAD)
def test_invalid_values_name_field_and_range(overrides, name, allowed):
    with pytest.raises(ValueError) as info:
        make(**overrides)
    msg = str(info.value)
    assert name in msg and allowed in msg
    if name != "SpeculativeConfig":
        assert f"SpeculativeConfig.{name}" in msg


def test_error_message_shape():
    with pytest.raises(
        ValueError, match=r"^SpeculativeConfig\.relax_ratio must be a float in \[0, 1\], got 1\.5$"
    ):
        make(relax_ratio=1.5)
    with pytest.raises(ValueError, match=r"got nan$"):
        make(relax_delta=float("nan"))


@pytest.mark.parametrize(
    "overrides",
    [
        {"relax_ratio": 0.3},
        {"relax_top_k": 8},
        {"relax_delta": 0.1},
        {"relaxed_thinking": False, "relax_ratio": 0.3},
    ],
)
def test_relax_settings_without_the_flag_are_refused(overrides):
    # Without relaxed_thinking=True they would be ignored: strict speculation, no word said.
    (name,) = (n for n in overrides if n.startswith("relax_"))
    with pytest.raises(ValueError, match=rf"SpeculativeConfig\.{name} given without relaxed_thinking=True"):
        make(reasoning_parser="qwen3", **overrides)
    assert getattr(make(**{**overrides, **RELAXED}), name) == overrides[name]


def test_method_specific_rules():
    with pytest.raises(ValueError, match=r"SpeculativeConfig\.model must be None with method='ngram'"):
        SpeculativeConfig(method="ngram", model="x", num_speculative_tokens=2)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 needs a method"):
        SpeculativeConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match=r"prompt_lookup_min must be <= prompt_lookup_max"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"prompt_lookup_min must be an int in \[1, inf\), got 0"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=0, prompt_lookup_max=3)
    with pytest.raises(ValueError, match=r"prompt_lookup_max must be an int in \[1, inf\), got True"):
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=True
        )
    with pytest.raises(ValueError, match=r"relaxed_thinking=True needs speculative decoding"):
        SpeculativeConfig(relaxed_thinking=True, reasoning_parser="qwen3")


def test_boundaries_accepted():
    for k in (1, 16):
        assert make(num_speculative_tokens=k).num_speculative_tokens == k
    for top_k in (1, 64):
        assert make(relax_top_k=top_k, **RELAXED).relax_top_k == top_k
    for value in (0, 1, 0.0, 1.0):
        cfg = make(relax_ratio=value, relax_delta=value, **RELAXED)
        assert cfg.relax_ratio == float(value) and isinstance(cfg.relax_ratio, float)
        assert cfg.relax_delta == float(value) and isinstance(cfg.relax_delta, float)


def test_relaxed_thinking_with_parser_or_explicit_tokens():
    cfg = make(relaxed_thinking=True, reasoning_parser="deepseek_r1", relax_ratio=0.3, relax_top_k=3)
    assert cfg.build_reasoning_parser() == ReasoningParser("deepseek_r1", "<think>", "</think>", "thinking")
    cfg = make(relaxed_thinking=True, think_start_token="<t>", think_end_token="</t>")
    parser = cfg.build_reasoning_parser()
    assert (parser.name, parser.think_start, parser.think_end) == ("generic", "<t>", "</t>")
    # One override on a named parser keeps the parser's other marker.
    parser = make(reasoning_parser="qwen3", think_end_token="[/THINK]").build_reasoning_parser()
    assert (parser.name, parser.think_start, parser.think_end) == ("qwen3", "<think>", "[/THINK]")
    assert parser.start_rule == "enable_thinking"  # an override keeps where the output starts


@pytest.mark.parametrize(
    "cfg",
    [
        SpeculativeConfig(),
        SpeculativeConfig(**DRAFT),
        SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4),
        SpeculativeConfig(
            model="d",
            num_speculative_tokens=8,
            relaxed_thinking=True,
            relax_ratio=0.25,
            relax_top_k=4,
            relax_delta=0.5,
            reasoning_parser="qwen3",
            think_start_token="<s>",
        ),
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=2,
            relaxed_thinking=True,
            think_start_token="<t>",
            think_end_token="</t>",
        ),
    ],
)
def test_json_and_dict_round_trip(cfg):
    assert SpeculativeConfig.from_json(cfg.to_json()) == cfg
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg
    assert json.loads(cfg.to_json()) == cfg.to_dict()
    assert set(cfg.to_dict()) == set(SpeculativeConfig.field_names())


def test_from_json_like_vllm_flag():
    cfg = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "relaxed_thinking": true, '
        '"reasoning_parser": "deepseek_r1", "relax_top_k": 2}'
    )
    assert (
        cfg.method == "ngram" and cfg.prompt_lookup_min == 4 and cfg.relax_top_k == 2 and cfg.relaxed_thinking
    )


def test_parse_accepts_every_form():
    cfg = SpeculativeConfig(**DRAFT)
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse("null") is None
    assert SpeculativeConfig.parse(cfg) is cfg
    assert SpeculativeConfig.parse(dict(DRAFT)) == cfg
    assert SpeculativeConfig.parse(json.dumps(DRAFT)) == cfg
    with pytest.raises(ValueError, match="speculative_config must be"):
        SpeculativeConfig.parse(42)
    with pytest.raises(ValueError, match="JSON is invalid"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="built from a dict, got list"):
        SpeculativeConfig.parse("[1, 2]")


def test_unknown_keys_listed():
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_dict({**DRAFT, "num_spec_tokens": 3, "draft": "x"})
    msg = str(info.value)
    assert "['draft', 'num_spec_tokens']" in msg
    for key in SpeculativeConfig.field_names():
        assert key in msg


def test_validate_relax_fields_for_per_request_overrides():
    assert validate_relax_fields() == (None, None, None, None)
    assert validate_relax_fields(relaxed_thinking=True, relax_ratio=1, relax_top_k=5, relax_delta=0) == (
        True,
        1.0,
        5,
        0.0,
    )
    cases = [
        ({"relaxed_thinking": 0}, "relaxed_thinking"),
        ({"relax_ratio": 2}, "relax_ratio"),
        ({"relax_ratio": float("nan")}, "relax_ratio"),
        ({"relax_top_k": False}, "relax_top_k"),
        ({"relax_top_k": 100}, "relax_top_k"),
        ({"relax_delta": -0.5}, "relax_delta"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{name} must be"):
            validate_relax_fields(**kwargs, owner="SamplingParams")
