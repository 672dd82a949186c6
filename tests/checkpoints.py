"""Tiny random-weight Hugging Face checkpoints for tests, and a paged-KV harness to run them.

Import from tests as `from checkpoints import ...` (pytest puts tests/ on sys.path).

- `make_tiny_checkpoint(path, arch, tied=...)` builds and saves a complete model folder with
  transformers: config.json, safetensors (optionally sharded), generation_config.json and a
  byte-level tokenizer with Qwen-style special tokens and chat template.
- `tiny_checkpoint(arch, tied=...)` is the same, cached per process in one temporary folder,
  so test modules can share checkpoints without rebuilding them.
- `PagedHarness` allocates a KV pool for a loaded model and runs ragged steps over it with
  scattered block tables, building the AttentionMetadata the engine's ModelRunner builds.
"""

from __future__ import annotations

import atexit
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from thinkspec.layers.attention import Attention
from thinkspec.layers.forward_context import AttentionMetadata, forward_context

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
THINK_TOKENS = ["<think>", "</think>"]  # ids 259, 260
TOKENIZER_SIZE = 256 + len(SPECIAL_TOKENS) + len(THINK_TOKENS)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID, THINK_ID, END_THINK_ID = range(256, 261)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_ARCH_PREFIX = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable character table used by byte-level BPE
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_tokenizer():
    """Byte-level BPE (token id = byte value, no merges) plus <|endoftext|> <|im_start|> <|im_end|>
    (special) and <think> </think> (added, not special, as in Qwen3); eos and pad are <|endoftext|>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def fill_random(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Seeded random weights that keep a tiny model's logits spread out: norms near 1, biases and
    weights small noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(init_std * noise)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "qwen3",
    *,
    tied: bool,
    rope_scaling: dict | None = None,
    vocab_size: int = TOKENIZER_SIZE,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sharded: bool = False,
    tokenizer: bool = True,
    init_std: float = 0.25,
) -> Path:
    """Save a random-weight `arch` model ("qwen3" | "qwen2" | "llama") to `path`; returns the folder.

    Weights are redrawn with std `init_std` (transformers' 0.02 gives near-uniform logits on a
    model this small), norm weights near 1 and non-zero biases, so every tensor matters.
    Qwen3 gets an explicit head_dim of 32 (unequal to hidden/heads) unless given.
    """
    import transformers

    if arch not in _ARCH_PREFIX:
        raise ValueError(f"arch={arch!r}; expected one of {sorted(_ARCH_PREFIX)}")
    if tokenizer and vocab_size < TOKENIZER_SIZE:
        raise ValueError(f"vocab_size={vocab_size} is below the tokenizer's {TOKENIZER_SIZE} tokens")
    # without the tokenizer a smaller vocabulary may be asked for; its last id then serves as eos
    eos, im_end = (
        (ENDOFTEXT_ID, IM_END_ID) if vocab_size >= TOKENIZER_SIZE else (vocab_size - 1, vocab_size - 1)
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    prefix = _ARCH_PREFIX[arch]
    if head_dim is None:
        head_dim = 32 if arch == "qwen3" else hidden_size // num_heads
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    fill_random(model, seed, init_std)
    model = model.to(dtype)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=list(dict.fromkeys([im_end, eos])),
        pad_token_id=eos,
        do_sample=True,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
    )
    model.save_pretrained(path, max_shard_size="40KB" if sharded else "10GB")
    if tokenizer:
        build_tokenizer().save_pretrained(path)
    return path


_CACHE: dict[str, Path] = {}
_CACHE_ROOT: Path | None = None


def tiny_checkpoint(arch: str = "qwen3", **kwargs: Any) -> Path:
    """`make_tiny_checkpoint` cached per process by its arguments (folders removed at exit)."""
    global _CACHE_ROOT
    key = json.dumps({"arch": arch, **kwargs}, sort_keys=True, default=str)
    if key not in _CACHE:
        if _CACHE_ROOT is None:
            _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="thinkspec-ckpt-"))
            atexit.register(shutil.rmtree, _CACHE_ROOT, True)
        _CACHE[key] = make_tiny_checkpoint(_CACHE_ROOT / f"ckpt{len(_CACHE)}", arch, **kwargs)
    return _CACHE[key]


def hf_logits(path: Path, token_ids: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Logits [len(token_ids), V] float32 of transformers' own model on the full sequence."""

    model = _hf_model(path, dtype, device)
    with torch.no_grad():
        ids = torch.tensor([token_ids], device=device)
        return model(ids).logits[0].float()


_HF_MODELS: dict[tuple[str, torch.dtype, str], Any] = {}


def _hf_model(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    key = (str(path), dtype, device)
    if key not in _HF_MODELS:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        _HF_MODELS.clear()  # keep one at a time
        _HF_MODELS[key] = model
    return _HF_MODELS[key]


class PagedHarness:
    """Test-only stand-in for the ModelRunner's KV bookkeeping.

    Allocates a pool of `num_blocks` blocks per layer, hands blocks out in a shuffled order (so
    block tables are non-contiguous and unsorted), and runs ragged steps: each step feeds new
    tokens for any set of sequences; `truncate` drops trailing tokens (rejected drafts).
    """

    def __init__(
        self, model: torch.nn.Module, num_blocks: int = 64, block_size: int = 4, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        for layer in (m for m in model.modules() if isinstance(m, Attention)):
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            # NaN-filled so reading a slot that was never written shows up in the output
            layer.k_cache = torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)
            layer.v_cache = torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, batch: list[tuple[int, list[int]]], pad_rows: int = 0) -> torch.Tensor:
        """Feed `batch` = [(seq_id, new token ids), ...] in one forward; returns logits [T, V] float32
        for every row, the `pad_rows` padding rows (slot -1) last."""
        input_ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq_id, tokens in batch:
            blocks = self.blocks.setdefault(seq_id, [])
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop())
            for pos, tok in zip(range(start, end), tokens):
                input_ids.append(tok)
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            self.lens[seq_id] = end
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
        input_ids += [0] * pad_rows
        positions += [0] * pad_rows
        slots += [-1] * pad_rows
        width = max(len(self.blocks[s]) for s, _ in batch)
        tables = [self.blocks[s] + [-1] * (width - len(self.blocks[s])) for s, _ in batch]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(len(t) for _, t in batch),
            max_seq_len=max(seq_lens),
        )
        with torch.no_grad(), forward_context(meta):
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev),
            )
            return self.model.compute_logits(hidden)

    def truncate(self, seq_id: int, length: int) -> None:
        """Forget every token of `seq_id` from position `length` on (their slots get overwritten)."""
        self.lens[seq_id] = min(self.lens[seq_id], length)


def noisy_copy(src: Path, dst: Path, noise: float, seed: int = 7) -> Path:
    """A copy of checkpoint src with N(0, noise) added to every weight: a draft that agrees with
    the target often, not always."""
    from safetensors.torch import load_file, save_file

    if dst.exists():
        return dst
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    weights = {k: v + noise * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
