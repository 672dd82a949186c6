"""EngineArgs: the one source of engine options, its CLI flags, and LLM(**kwargs) forwarding into it."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import MISSING, fields

import pytest

from thinkspec.engine_args import DTYPES, EngineArgs, add_engine_args, engine_kwargs
from thinkspec.llm import LLM
from thinkspec.reasoning import REASONING_PARSERS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_field_has_help_and_a_flag():
    text = parser().format_help()
    for f in fields(EngineArgs):
        assert f.metadata["help"], f.name
        if f.name != "model":
            assert "--" + f.name.replace("_", "-") in text


def test_flags_not_given_keep_the_defaults():
    kwargs = engine_kwargs(parser().parse_args(["some/model"]))
    assert kwargs == {"model": "some/model"}
    defaults = EngineArgs(**kwargs)
    for f in fields(EngineArgs):
        if f.default is not MISSING:
            assert getattr(defaults, f.name) == f.default, f.name


def test_flags_reach_every_field_with_its_type():
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    argv = [
        "some/model", "--tokenizer", "tok", "--dtype", "bf16", "--device", "cpu", "--max-model-len", "128",
        "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--block-size", "8",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "4096", "--no-enable-prefix-caching",
        "--seed", "7", "--reasoning-parser", "qwen3", "--speculative-config", spec,
        "--load-format", "dummy", "--attention-backend", "torch", "--enforce-eager",
        "--no-async-scheduling",
    ]  # fmt: skip
    kwargs = engine_kwargs(parser().parse_args(argv))
    assert kwargs == {
        "model": "some/model", "tokenizer": "tok", "dtype": "bf16", "device": "cpu", "max_model_len": 128,
        "max_num_seqs": 3, "max_num_batched_tokens": 64, "block_size": 8, "gpu_memory_utilization": 0.5,
        "kv_cache_memory": 4096, "enable_prefix_caching": False, "seed": 7, "reasoning_parser": "qwen3",
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "load_format": "dummy",
        "attention_backend": "torch", "enforce_eager": True, "async_scheduling": False,
    }  # fmt: skip
    args = EngineArgs(**kwargs)
    assert args.speculative_config is not None and args.speculative_config.reasoning_parser == "qwen3"


def test_flag_choices_match_the_engine():
    by_name = {f.name: f for f in fields(EngineArgs)}
    assert set(by_name["reasoning_parser"].metadata["choices"]) == set(REASONING_PARSERS)
    from thinkspec.models.loader import _DTYPES

    assert set(DTYPES) == {"auto", *_DTYPES}
    with pytest.raises(SystemExit):
        parser().parse_args(["m", "--attention-backend", "flash"])


def test_validation_names_field_value_and_range():
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, 1024\], got 0"):
        EngineArgs("m", block_size=0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        EngineArgs("m", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineArgs("m", load_format="pt")


def test_llm_rejects_an_unknown_keyword_by_name():
    with pytest.raises(TypeError, match="'max_num_seq'"):
        LLM("some/model", max_num_seq=4)


def test_cli_help_needs_no_torch():
    code = (
        "import sys\n"
        "from thinkspec.entrypoints.cli import build_parser\n"
        "build_parser().format_help()\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
