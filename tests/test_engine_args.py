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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tensor_parallel_size": 2, "draft_tensor_parallel_size": 3},
            r"draft_tensor_parallel_size must be 1 or tensor_parallel_size \(2\), got 3",
        ),
        ({"draft_tensor_parallel_size": 0}, r"draft_tensor_parallel_size must be 1 or tensor_parallel_size"),
        (
            {"tensor_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                               "adaptive_k": True}},
            r"adaptive_k=True is not supported with tensor_parallel_size=2",
        ),  # fmt: skip
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2 is not supported"),
        ({"quantization": "fp8"}, "quantization='fp8' is not supported"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill=False is not supported"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"max_logprobs": -2}, "max_logprobs must be an integer >= 0"),
        ({"swap_space": -1}, "swap_space must be a number of GiB >= 0"),
        ({"served_model_name": []}, "served_model_name must be"),
        ({"revision": ""}, "revision must be a non-empty string"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be a bool"),
    ],
)
def test_vllm_arguments_thinkspec_cannot_honour_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("some/model", **kwargs)


def test_vllm_arguments_with_supported_values_work(tmp_path):
    from checkpoints import tiny_checkpoint

    from thinkspec import SamplingParams

    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    llm = LLM(
        str(tiny_checkpoint("qwen3", tied=True)), device="cpu", trust_remote_code=True, revision="main",
        tokenizer_revision="main", tensor_parallel_size=1, pipeline_parallel_size=1, quantization=None,
        chat_template=template, max_logprobs=5, download_dir=str(tmp_path), swap_space=0, cpu_offload_gb=0,
        disable_log_stats=True, enable_chunked_prefill=True, served_model_name=["a", "b"],
        kv_cache_memory_bytes=8 << 20,
    )  # fmt: skip
    assert llm.engine_args.kv_cache_memory == 8 << 20 and llm.engine_args.max_logprobs == 5
    assert llm.get_tokenizer().chat_template == template
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt == "[hi]"
    file = tmp_path / "t.jinja"
    file.write_text("{{ messages[0]['content'] }}!")
    from thinkspec.llm import load_chat_template

    assert load_chat_template(str(file)) == "{{ messages[0]['content'] }}!"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_revision_and_download_dir_reach_the_hub_download(monkeypatch, tmp_path):
    import thinkspec.models.loader as loader

    calls = []

    def fake(model, revision=None, download_dir=None):
        calls.append((model, revision, download_dir))
        raise FileNotFoundError("offline")

    monkeypatch.setattr(loader, "resolve_model_path", fake)
    with pytest.raises(FileNotFoundError):
        LLM("owner/name", revision="v1", tokenizer_revision="v2", download_dir=str(tmp_path))
    assert calls == [("owner/name", "v2", str(tmp_path))]  # the tokenizer's revision is fetched first
    calls.clear()
    with pytest.raises(FileNotFoundError):
        LLM("owner/name", revision="v1")
    assert calls == [("owner/name", "v1", None)]


def test_unknown_llm_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'speculative_model'"):
        LLM("some/model", speculative_model="x")
    with pytest.raises(TypeError, match="kv_cache_memory_bytes"):
        LLM("some/model", kv_cache_memory=1, kv_cache_memory_bytes=1)


def test_new_cli_flags_reach_the_engine_args():
    argv = [
        "--model", "some/model", "-tp", "1", "--kv-cache-memory-bytes", "4096", "--chat-template", "t.jinja",
        "--served-model-name", "a", "b", "--trust-remote-code", "--revision", "r", "--max-logprobs", "3",
        "--no-enable-chunked-prefill", "-pp", "1", "--quantization", "fp8", "--swap-space", "2",
        "--cpu-offload-gb", "0", "--disable-log-stats", "--download-dir", "d", "--tokenizer-revision", "tr",
    ]  # fmt: skip
    kwargs = engine_kwargs(parser().parse_args(argv))
    assert kwargs == {
        "model": "some/model", "tensor_parallel_size": 1, "kv_cache_memory": 4096, "chat_template": "t.jinja",
        "served_model_name": ["a", "b"], "trust_remote_code": True, "revision": "r", "max_logprobs": 3,
        "enable_chunked_prefill": False, "pipeline_parallel_size": 1, "quantization": "fp8",
        "swap_space": 2.0, "cpu_offload_gb": 0.0, "disable_log_stats": True, "download_dir": "d",
        "tokenizer_revision": "tr",
    }  # fmt: skip
    assert engine_kwargs(parser().parse_args(["m", "--kv-cache-memory", "8"]))["kv_cache_memory"] == 8
    assert engine_kwargs(parser().parse_args(["--model", "m"]))["model"] == "m"
    with pytest.raises(ValueError, match="given twice"):
        engine_kwargs(parser().parse_args(["m1", "--model", "m2"]))
