"""Load a Hugging Face checkpoint folder (or hub id) into one of the project's model classes.

dtype "auto": the checkpoint's recorded dtype on GPU; float32 on CPU, where half-precision
matmuls are slow and float32 is the exact reference. An explicit "bfloat16"/"float16" is kept
on CPU. On a GPU without bfloat16 support, "auto" falls back to float16 (an explicit
"bfloat16" raises).

Tensor parallelism: built for a TPLayout, the model holds this rank's shards, and each checkpoint
tensor is read through safetensors' get_slice as only the rows / columns this rank holds (the
module's `checkpoint_slice`), so no rank materialises the whole model.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from thinkspec.distributed.parallel_state import TPLayout, check_tp_layout
from thinkspec.engine_args import LOAD_FORMATS
from thinkspec.layers.linear import MergedLinear
from thinkspec.layers.moe import MoEExperts
from thinkspec.layers.rotary import RotaryEmbedding
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderForCausalLM
from thinkspec.models.llama import LlamaForCausalLM
from thinkspec.models.qwen2 import Qwen2ForCausalLM
from thinkspec.models.qwen2_moe import Qwen2MoeForCausalLM
from thinkspec.models.qwen3 import Qwen3ForCausalLM
from thinkspec.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}
_MODEL_TYPES = {
    "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
}  # fmt: skip

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip

# Checkpoint tensors with no counterpart here (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class ModelInfo:
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: list[int]  # generation_config.json first, then config.json; deduplicated
    tie_word_embeddings: bool
    path: Path  # resolved local folder
    bos_token_id: int | None = None
    temperature: float | None = None  # generation_config.json defaults, None when absent
    top_p: float | None = None
    top_k: int | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)  # the raw file, {} when absent
    tp_size: int = 1  # ranks the model is split over

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads in each rank's cache (TPLayout.kv_heads)."""
        return TPLayout(0, self.tp_size).kv_heads(self.num_kv_heads)[1]


def load_model(
    model: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    tp: TPLayout | None = None,
) -> tuple[nn.Module, ModelInfo]:
    """Build the model for a checkpoint folder or hub id and load its weights; returns (model, info).

    tp: this process's rank of a tensor-parallel model (None: the whole model); ValueError naming
    tensor_parallel_size when the model's head counts or MLP width do not split that way.

    The model is in eval mode with no gradients, on `device`, in the resolved dtype.
    load_format "dummy" (as vLLM's) reads only config.json and draws random weights: for speed
    benchmarks of a model shape without its checkpoint.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model_path(model)
    raw = _read_json(path / "config.json", required=True)
    arch = _architecture(raw)
    cfg = DecoderConfig.from_dict(raw, arch)
    tp = tp or TPLayout()
    _check_tp_layout(cfg, tp.size)
    gen = _read_json(path / "generation_config.json", required=False) or {}
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r} requested but CUDA is not available")
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device("meta"):
            net = ARCHITECTURES[arch](cfg, tp)
    finally:
        torch.set_default_dtype(previous)
    net.to_empty(device=device)
    net.tie_weights()  # to_empty gives shared parameters separate storage
    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_cache(device)
    if load_format == "dummy":
        init_dummy_weights(net, seed=tp.rank)
    else:
        load_weights(net, path)
    net.eval().requires_grad_(False)

    eos: list[int] = []
    gen_eos = gen.get("eos_token_id")
    for i in ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])) + cfg.eos_token_ids:
        if i not in eos:
            eos.append(int(i))
    info = ModelInfo(
        architecture=arch,
        num_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        dtype=torch_dtype,
        eos_token_ids=eos,
        tie_word_embeddings=cfg.tie_word_embeddings,
        path=path,
        bos_token_id=gen.get("bos_token_id", cfg.bos_token_id),
        temperature=gen.get("temperature"),
        top_p=gen.get("top_p"),
        top_k=gen.get("top_k"),
        generation_config=gen,
        tp_size=tp.size,
    )
    return net, info


def check_tensor_parallel_size(model: str | Path, size: int, field_name: str) -> None:
    """ValueError naming `field_name` when the checkpoint's head counts or MLP width cannot be split
    `size` ways (read from config.json alone, before any process starts)."""
    raw = _read_json(resolve_model_path(model) / "config.json", required=True) or {}
    cfg = DecoderConfig.from_dict(raw, _architecture(raw))
    try:
        _check_tp_layout(cfg, size)
    except ValueError as e:
        raise ValueError(str(e).replace("tensor_parallel_size", field_name, 1) + f" ({model})") from None


def _check_tp_layout(cfg: DecoderConfig, size: int) -> None:
    # ValueError (naming tensor_parallel_size) when the heads, MLP or experts do not split `size` ways
    check_tp_layout(
        size, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
    )  # fmt: skip
    if cfg.moe is not None:
        layout = TPLayout(0, size)
        layout.split(cfg.moe.moe_intermediate_size, "moe_intermediate_size")
        if cfg.moe.shared_expert_intermediate_size:
            layout.split(cfg.moe.shared_expert_intermediate_size, "shared_expert_intermediate_size")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Random weights in place: N(0, std) for matrices and embeddings, 1 for norms, 0 for biases."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def resolve_model_path(
    model: str | Path, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """A local folder as is; otherwise a hub id downloaded (or found in the hub cache) by huggingface_hub,
    at `revision` (default: main) into `download_dir` (default: the hub cache)."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model={str(model)!r} is a file; expected a checkpoint folder")
        return path.resolve()
    name = str(model)
    if path.is_absolute() or name.startswith((".", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model folder {name!r} does not exist (and it is not a hub id 'owner/name')")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise FileNotFoundError(
            f"model={name!r} is not a local folder, and huggingface_hub is not installed to download it "
            "(pip install 'thinkspec[hub]', or pass a local checkpoint folder)"
        ) from e
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
    try:
        return Path(
            snapshot_download(
                repo_id=name, allow_patterns=patterns, revision=revision, cache_dir=download_dir
            )
        )
    except Exception as e:  # offline, unknown repo, gated repo: all end here
        raise FileNotFoundError(
            f"model={name!r} is not a local folder and could not be fetched from the Hugging Face hub: {e}"
        ) from e


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: torch.device) -> torch.dtype:
    """The dtype to run in; raises ValueError for an unknown name or one the device cannot run."""
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        resolved = _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.float32)
        if resolved == torch.bfloat16 and device.type == "cuda" and not _cuda_bf16(device):
            return torch.float16
        return resolved
    if isinstance(dtype, torch.dtype):
        resolved = dtype
        if resolved not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; supported: float32, float16, bfloat16, auto")
    else:
        resolved = _DTYPES.get(str(dtype).lower().removeprefix("torch."))
        if resolved is None:
            raise ValueError(f"dtype={dtype!r} is not supported; supported: auto, {', '.join(_DTYPES)}")
    if resolved == torch.bfloat16 and device.type == "cuda" and not _cuda_bf16(device):
        raise ValueError(f"dtype=bfloat16 is not supported on {torch.cuda.get_device_name(device)}; use fp16")
    if resolved != torch.float32:
        try:
            a = torch.ones(2, 2, dtype=resolved, device=device)
            (a @ a).sum().item()
        except RuntimeError as e:
            raise ValueError(f"dtype={resolved} cannot run on device {device}: {e}") from e
    return resolved


def _cuda_bf16(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 8


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path.name} not found in checkpoint folder {path.parent}")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[raw["model_type"]]]
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    found = archs or [raw.get("model_type")]
    raise ValueError(f"unsupported architecture {found}; supported: {sorted(ARCHITECTURES)}")


def weight_files(path: Path) -> list[Path]:
    """Safetensors files of a checkpoint: the index's shards, model.safetensors, or every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (_read_json(index, required=True) or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"weight shard {f.name} listed in {index.name} is missing in {path}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights in {path}: expected model.safetensors, model.safetensors.index.json or *.safetensors"
        )
    return files


def load_weights(model: DecoderForCausalLM, path: Path) -> None:
    """Copy every checkpoint tensor into `model` (cast to its dtype); raises on missing/bad/corrupt data."""
    params = dict(model.named_parameters())
    expected = _expected_tensors(model)
    loaded: set[str] = set()
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    found = _target(model, name, params)
                    if found is None:
                        continue
                    target, part = found
                    if part is None:
                        tensor = f.get_tensor(name)
                    else:
                        tensor = _read_slice(f.get_slice(name), part, name, file.name)
                        target = _pad_rows(target, tensor, part)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(
                            f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    loaded.update(_covered(model, name))
        except SafetensorError as e:
            raise ValueError(f"corrupt safetensors file {file}: {e}") from e
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}")


def _expected_tensors(model: DecoderForCausalLM) -> list[str]:
    # checkpoint names every parameter needs; a merged projection needs one tensor per shard
    names = []
    merged = {n: m for n, m in model.named_modules() if isinstance(m, MergedLinear)}
    inverse = {(mod, shard): ckpt for ckpt, (mod, shard) in model.packed_modules.items()}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, MoEExperts)}
    for pname, _ in model.named_parameters():  # tied lm_head.weight appears once, as embed_tokens
        module_name, _, leaf = pname.rpartition(".")
        if module_name in experts:  # stacked or per expert: expected as the per-expert names
            if leaf == "gate_up_proj":
                names.extend(experts[module_name].checkpoint_names(module_name))
        elif module_name in merged:
            parent, _, short = module_name.rpartition(".")
            for shard in merged[module_name].shard_sizes:
                names.append(f"{parent}.{inverse[(short, shard)]}.{leaf}")
        else:
            names.append(pname)
    return names


def _covered(model: DecoderForCausalLM, name: str) -> list[str]:
    # the names _expected_tensors lists that checkpoint tensor `name` loads (a stacked experts
    # tensor stands for one name per expert)
    module_name, _, leaf = name.rpartition(".")
    if leaf in ("gate_up_proj", "down_proj") and module_name.endswith("experts"):
        module = model.get_submodule(module_name)
        if isinstance(module, MoEExperts):
            return module.covered_names(module_name, leaf)
    return [name]


def _read_slice(sl: Any, part: tuple[int, int, int], name: str, file: str) -> torch.Tensor:
    """The (dim, start, length) part of a checkpoint tensor, read alone; clipped at the tensor's end
    (vocabulary padding of the last rank)."""
    dim, start, length = part
    shape = sl.get_shape()
    if dim >= len(shape) or start >= shape[dim]:
        raise ValueError(f"tensor {name!r} in {file} has shape {tuple(shape)}: no part {part} to load")
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, min(start + length, shape[dim]))
    return sl[tuple(index)]


def _pad_rows(target: torch.Tensor, tensor: torch.Tensor, part: tuple[int, int, int]) -> torch.Tensor:
    """The part of target that a clipped slice fills; the padding past it is zeroed."""
    dim, _, length = part
    got = tensor.shape[dim]
    if got < length and target.shape[dim] == length:
        target.narrow(dim, got, length - got).zero_()
        return target.narrow(dim, 0, got)
    return target


def _target(
    model: DecoderForCausalLM, name: str, params: dict[str, nn.Parameter]
) -> tuple[torch.Tensor, tuple[int, int, int] | None] | None:
    # (the parameter or merged-parameter slice that checkpoint tensor `name` loads into, the part of
    # the tensor this rank holds or None for all of it); None = skip
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None  # some tied checkpoints store a copy of the embedding
    parts = name.split(".")
    if name in params:
        module = model.get_submodule(name.rpartition(".")[0])
        part = module.checkpoint_slice(parts[-1]) if hasattr(module, "checkpoint_slice") else None
        return params[name].data, part
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():  # experts.{e}.{proj}.weight
        experts = _submodule(model, ".".join(parts[:-3]))
        if isinstance(experts, MoEExperts):
            return experts.expert_target(int(parts[-3]), parts[-2], parts[-1])
    if len(parts) >= 2 and parts[-2] in model.packed_modules:
        merged_name, shard = model.packed_modules[parts[-2]]
        merged_param = ".".join([*parts[:-2], merged_name, parts[-1]])
        if merged_param in params:
            module = model.get_submodule(merged_param.rpartition(".")[0])
            return module.shard_view(parts[-1], shard), module.checkpoint_slice(parts[-1], shard)
    cls = type(model).__name__
    warnings.warn(f"checkpoint tensor {name!r} has no counterpart in {cls}; ignored", stacklevel=3)
    return None


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def load_tokenizer(source: str, vocab_size: int, *, explicit: bool) -> tuple[Any | None, str]:
    """(tokenizer, "") when `source` holds one that fits a model of `vocab_size` logits, else
    (None, why not). A fitting tokenizer has at least one ordinary (not added or special) token and
    at most vocab_size tokens: transformers 5 loads a folder without tokenizer files as a tokenizer
    of its one special token, which would reject every token id but 0.
    explicit: the user named `source` as the tokenizer; then a load failure or misfit raises."""
    from transformers import AutoTokenizer  # here: workers (ranks > 0) skip its import time

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as e:  # missing files, bad json, unknown class: all mean "no tokenizer"
        if explicit:
            raise ValueError(f"tokenizer={source!r} could not be loaded: {e}") from e
        return None, f"{source} has no tokenizer that loads ({type(e).__name__})"
    size, ordinary = len(tokenizer), len(tokenizer) - len(tokenizer.get_added_vocab())
    if ordinary > 0 and size <= vocab_size:
        return tokenizer, ""
    why = (
        f"the tokenizer in {source} has {size} tokens ({ordinary} ordinary); a model with {vocab_size} "
        f"logits needs 1..{vocab_size} tokens, at least one ordinary"
    )
    if explicit:
        raise ValueError(f"tokenizer={source!r} does not fit the model: {why}")
    return None, why
