"""EngineArgs: every engine option in one dataclass, with its help text; the CLI flags derive from it.

A leaf module: the stdlib and `thinkspec.model_names` at import time (so `thinkspec --help` stays
cheap); torch, the reasoning parsers and SpeculativeConfig are imported when an EngineArgs is
validated.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from thinkspec.model_names import DEFAULT_TOY

if TYPE_CHECKING:
    import torch

    from thinkspec.config import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
# The names of thinkspec.reasoning.REASONING_PARSERS, spelled out so the CLI needs no torch.
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def json_arg(text: str) -> dict[str, Any]:
    """argparse type of --speculative-config: a JSON object, else a usage error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at char {e.pos}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _option(default: Any, help_text: str, **cli: Any) -> Any:
    """A field with its help text; cli holds extra add_argument settings (choices, type)."""
    return field(default=default, metadata={"help": help_text, **cli})


@dataclass(slots=True)
class EngineArgs:
    """Engine settings; validated at construction (ValueError names the field, value and range).

    Each field's help text is in its metadata["help"]; `add_engine_args` turns the fields into the
    CLI's flags (`max_model_len` -> `--max-model-len`, as vLLM spells them).
    """

    model: str = field(metadata={"help": "Hugging Face checkpoint folder or hub id"})
    tokenizer: str | None = _option(None, "tokenizer folder or hub id (default: the model's)")
    dtype: str | torch.dtype = _option(
        "auto",
        "weight and activation dtype; auto = the checkpoint's dtype on GPU, float32 on CPU",
        choices=DTYPES,
    )
    device: str = _option("auto", "cuda, cpu or auto (cuda when available)")
    max_model_len: int | None = _option(
        None,
        "context length limit (prompt + output); default the model's max_position_embeddings, "
        "capped by the KV pool's capacity. Prompts longer than min(max_model_len, KV capacity) fail",
    )
    max_num_seqs: int = _option(64, "most requests in one batch")
    max_logprobs: int = _option(
        20, "most log-probabilities a request may ask per token (SamplingParams logprobs / prompt_logprobs)"
    )
    max_num_batched_tokens: int = _option(
        2048, "most tokens in one forward; longer prompts are prefilled in chunks"
    )
    block_size: int = _option(16, "tokens per KV-cache block")
    gpu_memory_utilization: float = _option(
        0.9, "fraction of GPU memory the engine may use, weights and KV cache together (GPU only)"
    )
    kv_cache_memory: int | None = _option(
        None,
        "KV-cache size in bytes (default 256 MiB on CPU; on GPU it overrides gpu_memory_utilization); "
        "LLM() also takes vLLM's name kv_cache_memory_bytes",
        flags=("--kv-cache-memory-bytes", "--kv-cache-memory"),
    )
    enable_prefix_caching: bool = _option(True, "reuse KV blocks of shared prompt prefixes")
    seed: int = _option(0, "engine random seed")
    reasoning_parser: str | None = _option(
        None,
        "split outputs into reasoning_content and content, and find the thinking phase",
        choices=REASONING_PARSER_NAMES,
    )
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = _option(
        None,
        "speculative decoding: a SpeculativeConfig, a dict or (on the command line) a JSON object, "
        'e.g. \'{"method": "draft_model", '
        '"model": "PATH", "num_speculative_tokens": 4, "relaxed_thinking": true, "relax_ratio": 0.3, '
        '"relax_top_k": 3}\'',
        type=json_arg,
    )
    load_format: str = _option(
        "auto", "dummy = random weights from config.json alone (speed benchmarks)", choices=LOAD_FORMATS
    )
    skip_tokenizer_init: bool = _option(False, "token ids in and out only (no text, chat or reasoning split)")
    attention_backend: str = _option(
        "auto",
        "attention kernels: triton (CUDA, or TRITON_INTERPRET=1), torch (the reference); auto = triton "
        "on CUDA, else torch. triton also runs the models' norms, residual adds, rotary and SiLU * up "
        "as fused Triton kernels",
        choices=ATTENTION_BACKENDS,
    )
    enforce_eager: bool = _option(
        False,
        "never use CUDA graphs (by default decode, verify and draft steps replay them on CUDA with the "
        "triton backend)",
    )
    async_scheduling: bool | None = _option(
        None,
        "launch each plain decode step (without speculative decoding, or adaptive_k's plain steps) "
        "before the previous step's tokens reach the host, which then commits them while the device "
        "works, and with a draft model run each speculative step's first draft forward for the next "
        "step before committing the step; outputs are unchanged (default: on for CUDA)",
    )

    # vLLM's common constructor arguments: the supported values work, others are refused.
    served_model_name: str | list[str] | None = _option(
        None,
        "model name(s) the server answers to; the first is the one in responses (default: MODEL)",
        nargs="+",
    )
    tokenizer_revision: str | None = _option(
        None, "hub revision of the tokenizer (default: revision); ignored for a local folder"
    )
    revision: str | None = _option(
        None, "hub revision (branch, tag or commit) of the model; ignored for a local folder"
    )
    download_dir: str | None = _option(None, "where hub checkpoints are downloaded (default: the hub cache)")
    trust_remote_code: bool = _option(
        False,
        "accepted for vLLM compatibility; no effect: model code is built in, none is run from checkpoints",
    )
    chat_template: str | None = _option(
        None, "chat template used by chat requests: a file, or the template itself (default: the tokenizer's)"
    )
    tensor_parallel_size: int = _option(
        1,
        "ranks the target model is split over: one process and one GPU each (gloo processes on CPU); "
        "it must divide the model's attention heads and MLP width",
        flags=("-tp",),
    )
    draft_tensor_parallel_size: int | None = _option(
        None,
        "ranks the draft model is split over: tensor_parallel_size (the default) or 1, the whole "
        "draft on rank 0",
    )
    pipeline_parallel_size: int = _option(1, "pipeline stages; only 1 is supported", flags=("-pp",))
    quantization: str | None = _option(None, "weight quantization; none is supported (weights run as dtype)")
    cpu_offload_gb: float = _option(0.0, "weights kept in CPU memory, in GiB; only 0 is supported")
    swap_space: float = _option(
        4.0, "CPU swap space per GPU in GiB; accepted, unused (preempted requests are recomputed)"
    )
    enable_chunked_prefill: bool | None = _option(
        None, "prefills longer than max_num_batched_tokens always run in chunks; False is refused"
    )
    max_logprobs: int = _option(20, "most logprobs a request may ask for (-1 = the vocabulary size)")
    disable_log_stats: bool = _option(False, "do not log speculative-decoding statistics after each LLM call")

    def __post_init__(self) -> None:
        from thinkspec.utils import resolve_device

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint folder or hub id, got {self.model!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be a path / hub id or None, got {self.tokenizer!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 or None, got {self.max_model_len!r}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if not _is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )
        if not _is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        kv = self.kv_cache_memory
        if kv is not None and (not _is_int(kv) or kv < 1):
            raise ValueError(f"kv_cache_memory must be a number of bytes >= 1 or None, got {kv!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.reasoning_parser is not None:
            from thinkspec.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # raises ValueError listing the known names
        self.speculative_config = _parse_speculative_config(self.speculative_config, self.reasoning_parser)
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ValueError(f"skip_tokenizer_init must be a bool, got {self.skip_tokenizer_init!r}")
        if self.skip_tokenizer_init and self.reasoning_parser is not None:
            raise ValueError(
                "reasoning_parser needs the tokenizer; it cannot be used with skip_tokenizer_init"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if (
            self.attention_backend == "triton"
            and resolve_device(self.device).type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1), "
                f"got device={self.device!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        _check_vllm_args(self)

    @property
    def draft_tp_size(self) -> int:
        """Ranks the draft model is split over: draft_tensor_parallel_size, else tensor_parallel_size."""
        draft = self.draft_tensor_parallel_size
        return self.tensor_parallel_size if draft is None else draft


def _check_vllm_args(a: EngineArgs) -> None:
    """vLLM's common arguments: wrong types and values thinkspec cannot honour are refused."""
    names = [a.served_model_name] if isinstance(a.served_model_name, str) else a.served_model_name
    if names is not None and (
        not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names)
    ):
        raise ValueError(f"served_model_name must be a name or a non-empty list of names, got {names!r}")
    for name in ("revision", "tokenizer_revision", "download_dir", "chat_template"):
        value = getattr(a, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
    for name in ("trust_remote_code", "disable_log_stats"):
        if not isinstance(getattr(a, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(a, name)!r}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(a, name)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if a.pipeline_parallel_size > 1:
        raise ValueError(f"pipeline_parallel_size={a.pipeline_parallel_size} is not supported (only 1)")
    _check_tensor_parallel(a)
    if a.quantization is not None:
        raise ValueError(f"quantization={a.quantization!r} is not supported: weights run unquantized")
    for name in ("cpu_offload_gb", "swap_space"):
        value = getattr(a, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a number of GiB >= 0, got {value!r}")
    if a.cpu_offload_gb > 0:
        raise ValueError(f"cpu_offload_gb={a.cpu_offload_gb} is not supported: weights stay on the device")
    if a.enable_chunked_prefill is not None and not isinstance(a.enable_chunked_prefill, bool):
        raise ValueError(f"enable_chunked_prefill must be a bool or None, got {a.enable_chunked_prefill!r}")
    if a.enable_chunked_prefill is False:
        raise ValueError("enable_chunked_prefill=False is not supported: long prefills always run in chunks")
    if not _is_int(a.max_logprobs) or a.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be an integer >= -1, got {a.max_logprobs!r}")
    if a.chat_template is not None and a.skip_tokenizer_init:
        raise ValueError("chat_template needs the tokenizer; it cannot be used with skip_tokenizer_init")


def _check_tensor_parallel(a: EngineArgs) -> None:
    """tensor_parallel_size fits the devices; draft_tensor_parallel_size is None, 1 or the target's."""
    import torch

    from thinkspec.utils import resolve_device

    tp = a.tensor_parallel_size
    draft = a.draft_tensor_parallel_size
    if draft is not None and (not _is_int(draft) or draft not in (1, tp)):
        raise ValueError(
            f"draft_tensor_parallel_size must be 1 or tensor_parallel_size ({tp}), "
            f"got {a.draft_tensor_parallel_size!r}"
        )
    if tp == 1:
        return
    if a.speculative_config is not None and a.speculative_config.adaptive_k:
        # Its cost model times graph replays on rank 0 alone, which a split model cannot run.
        raise ValueError(
            f"speculative_config.adaptive_k=True is not supported with tensor_parallel_size={tp} "
            "(allowed: tensor_parallel_size=1)"
        )
    if resolve_device(a.device).type == "cuda":
        if a.device not in ("auto", "cuda", "cuda:0"):
            raise ValueError(
                f"tensor_parallel_size={tp} runs rank r on cuda:r; device must be 'cuda', got {a.device!r}"
            )
        if tp > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible "
                f"(allowed: 1..{torch.cuda.device_count()})"
            )


def _parse_speculative_config(value: Any, reasoning_parser: str | None) -> SpeculativeConfig | None:
    """SpeculativeConfig.parse, where the engine's reasoning parser stands in for one the speculative
    config does not name (as with vLLM's separate --reasoning-parser flag)."""
    from thinkspec.config import SpeculativeConfig

    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config JSON is invalid: {exc}; got {value!r}") from None
    if (
        isinstance(value, Mapping)
        and reasoning_parser is not None
        and value.get("reasoning_parser") is None
        and value.get("think_start_token") is None
    ):
        value = {**value, "reasoning_parser": reasoning_parser}
    return SpeculativeConfig.parse(dict(value) if isinstance(value, Mapping) else value)


# argparse type per field annotation (its first alternative); other fields name theirs in metadata.
_ARG_TYPES: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float}


def _add_field_flag(p: argparse._ActionsContainer, f: Field[Any]) -> None:
    """--NAME for one EngineArgs field. Every flag defaults to None, meaning "not given", so
    engine_kwargs leaves the field at its EngineArgs default. Booleans get --NAME / --no-NAME."""
    help_text = f.metadata["help"]
    if f.default is not None and f.default is not MISSING:
        help_text += f" (default: {f.default})"
    # metadata["flags"]: the flag names when they differ from --NAME, or short aliases added to it.
    extra = f.metadata.get("flags", ())
    long_flag = "--" + f.name.replace("_", "-")
    flags = list(extra) if extra and extra[0].startswith("--") else [long_flag, *extra]
    kind = str(f.type).split(" | ")[0]
    if kind == "bool":
        p.add_argument(
            *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
        )
        return
    arg_type = f.metadata["type"] if "type" in f.metadata else _ARG_TYPES[kind]
    p.add_argument(
        *flags,
        dest=f.name,
        type=arg_type,
        choices=f.metadata.get("choices"),
        nargs=f.metadata.get("nargs"),
        default=None,
        help=help_text,
    )


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """One flag per EngineArgs field, named as in vLLM; MODEL is positional, the toy pair by default.
    The flags form p's "engine arguments" group, which help lists after p's own options."""
    group = p.add_argument_group("engine arguments")
    for f in fields(EngineArgs):
        if f.name != "model":
            _add_field_flag(group, f)
        elif model_positional:
            help_text = f"{f.metadata['help']}; '{DEFAULT_TOY}' = the bundled toy pair's target"
            p.add_argument("model", nargs="?", default=None, help=f"{help_text} (default: {DEFAULT_TOY})")
            group.add_argument("--model", dest="model_flag", default=None, help="MODEL, given as a flag")


def resolve_model_arg(args: argparse.Namespace) -> None:
    """Set args.model from the positional MODEL or --model (ValueError if both differ), else the toy."""
    flag, positional = getattr(args, "model_flag", None), getattr(args, "model", None)
    if flag is not None and positional is not None and flag != positional:
        raise ValueError(f"the model is given twice: {positional!r} and --model {flag!r}")
    args.model = flag or positional or DEFAULT_TOY


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) / EngineArgs(...) keyword arguments from parsed engine flags; flags not given keep
    the EngineArgs defaults. Bundled names ("toy-reasoner", ...) stay names: the engine's builder
    resolves them (thinkspec.model_names.resolve_model_name), as it does for LLM(...)."""
    resolve_model_arg(args)
    given = (f.name for f in fields(EngineArgs) if getattr(args, f.name, None) is not None)
    return {name: getattr(args, name) for name in given}
