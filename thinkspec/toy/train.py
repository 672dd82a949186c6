"""Trains the toy reasoner's target or draft model (Qwen3 architecture) on the synthetic task.

    python -m thinkspec.toy.train --role target --out runs/toy/target
    python -m thinkspec.toy.train --role draft --tokenizer runs/toy/target --out runs/toy/draft

Samples are generated on the fly from a seed, tokenized, packed whole into fixed-length rows
(each row starts a fresh sample at position 0) and trained with AdamW and a cosine schedule.
The loss covers completion tokens only. Checkpoints are Hugging Face folders (bf16 safetensors,
config, generation config, tokenizer with chat template).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from thinkspec.toy.task import TRAIN_MIXES, generate_mixed_samples
from thinkspec.toy.tokenizer import ENDOFTEXT, IM_END, build_task_tokenizer

IGNORE = -100


@dataclass(slots=True)
class ModelSize:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and 1 <= v <= 8192):
                raise ValueError(f"{name} must be an integer in [1, 8192], got {v!r}")


SIZES = {
    "target": ModelSize(hidden_size=320, num_layers=8, num_heads=5, head_dim=64, intermediate_size=960),
    "draft": ModelSize(hidden_size=160, num_layers=3, num_heads=5, head_dim=32, intermediate_size=480),
}


@dataclass(slots=True)
class TrainConfig:
    steps: int = 3000
    batch_size: int = 128
    seq_len: int = 512
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    samples: int = 200_000
    seed: int = 0
    time_budget_s: float | None = None  # shrink `steps` to fit this wall time (measured early on)
    log_every: int = 100
    fork_bias: float = 0.0  # extra probability of each fork's first phrasing (see toy.task._Writer)
    mix: str = "easy"  # which TRAIN_MIXES entry the samples are drawn from
    max_positions: int = 1024  # the model's max_position_embeddings; rows must fit in it

    def __post_init__(self) -> None:
        checks = {
            "steps": (self.steps, 1, 10**7),
            "batch_size": (self.batch_size, 1, 65536),
            "seq_len": (self.seq_len, 16, 65536),
            "samples": (self.samples, 1, 10**8),
            "warmup_steps": (self.warmup_steps, 0, 10**7),
            "log_every": (self.log_every, 1, 10**7),
        }
        for name, (v, lo, hi) in checks.items():
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        if not 0 < self.lr <= 1:
            raise ValueError(f"lr must be in (0, 1], got {self.lr}")
        if not 0 <= self.fork_bias <= 1:
            raise ValueError(f"fork_bias must be in [0, 1], got {self.fork_bias}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0 or None, got {self.time_budget_s}")
        if self.mix not in TRAIN_MIXES:
            raise ValueError(f"mix must be one of {sorted(TRAIN_MIXES)}, got {self.mix!r}")
        if not self.seq_len <= self.max_positions <= 65536:
            raise ValueError(
                f"max_positions must be in [seq_len={self.seq_len}, 65536], got {self.max_positions}"
            )


def make_config(
    size: ModelSize, tokenizer: PreTrainedTokenizerFast, max_positions: int = 1024
) -> Qwen3Config:
    """Qwen3 config with tied embeddings; the vocabulary is padded to a multiple of 64."""
    vocab = (len(tokenizer) + 63) // 64 * 64
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads,
        head_dim=size.head_dim,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def _encode_chunk(args: tuple[int, int, str, float, str]) -> list[tuple[np.ndarray, int]]:
    n, seed, tokenizer_json, fork_bias, mix = args
    tok = Tokenizer.from_str(tokenizer_json)
    samples = generate_mixed_samples(n, seed, TRAIN_MIXES[mix], fork_bias=fork_bias)
    prompts = tok.encode_batch([s.prompt for s in samples], add_special_tokens=False)
    comps = tok.encode_batch([s.completion for s in samples], add_special_tokens=False)
    return [(np.asarray(p.ids + c.ids, dtype=np.int32), len(p.ids)) for p, c in zip(prompts, comps)]


def build_pool(
    tokenizer: PreTrainedTokenizerFast,
    n: int,
    seed: int,
    workers: int = 1,
    fork_bias: float = 0.0,
    mix: str = "easy",
) -> list[tuple[np.ndarray, int]]:
    """`n` tokenized samples of TRAIN_MIXES[mix] as (ids [L] int32, prompt length); chunks are
    seeded from `seed`."""
    chunk = 2000
    tj = tokenizer.backend_tokenizer.to_str()
    jobs = [
        (min(chunk, n - i), seed * 1_000_003 + i // chunk, tj, fork_bias, mix) for i in range(0, n, chunk)
    ]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            parts = list(ex.map(_encode_chunk, jobs))
    else:
        parts = [_encode_chunk(j) for j in jobs]
    return [x for part in parts for x in part]


def pack(
    pool: list[tuple[np.ndarray, int]], seq_len: int, pad_id: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack whole samples into rows; returns input_ids [N, T] int64 and labels [N, T] int64.

    labels[t] is the token at t (HF shifts internally); prompt and padding positions are IGNORE.
    """
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    rows_x: list[np.ndarray] = []
    rows_y: list[np.ndarray] = []
    x = np.full(seq_len, pad_id, dtype=np.int64)
    y = np.full(seq_len, IGNORE, dtype=np.int64)
    fill = 0
    for i in order:
        ids, n_prompt = pool[i]
        if len(ids) > seq_len:
            continue  # rare over-long sample: dropped rather than cut
        if fill + len(ids) > seq_len:
            rows_x.append(x)
            rows_y.append(y)
            x = np.full(seq_len, pad_id, dtype=np.int64)
            y = np.full(seq_len, IGNORE, dtype=np.int64)
            fill = 0
        x[fill : fill + len(ids)] = ids
        y[fill + n_prompt : fill + len(ids)] = ids[n_prompt:]
        fill += len(ids)
    if fill:
        rows_x.append(x)
        rows_y.append(y)
    return torch.from_numpy(np.stack(rows_x)), torch.from_numpy(np.stack(rows_y))


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train_model(
    model: Qwen3ForCausalLM,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    log: bool = True,
) -> dict:
    """Trains in place on rows input_ids/labels [N, T] int64; returns a summary with the loss curve."""
    model.to(device).train()
    use_cuda = device.type == "cuda"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=use_cuda,
    )
    if use_cuda:
        input_ids, labels = input_ids.to(device), labels.to(device)  # a few GB at most
    gen = torch.Generator().manual_seed(cfg.seed)
    n_rows = input_ids.shape[0]
    perm = torch.randperm(n_rows, generator=gen)
    cursor = 0
    total = cfg.steps
    losses: list[tuple[int, float]] = []
    t0 = time.time()
    step = 0
    while step < total:
        if cursor + cfg.batch_size > n_rows:
            perm, cursor = torch.randperm(n_rows, generator=gen), 0
        idx = perm[cursor : cursor + cfg.batch_size].to(input_ids.device)
        cursor += cfg.batch_size
        x = input_ids[idx].to(device, non_blocking=True)
        y = labels[idx].to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_cuda):
            loss = model(input_ids=x, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if cfg.time_budget_s is not None and step in (10, 30):
            # Time steps 10-30 (warm), then fit the schedule into the budget.
            if use_cuda:
                torch.cuda.synchronize()
            if step == 10:
                t10 = time.time()
            else:
                per_step = (time.time() - t10) / 20
                left = cfg.time_budget_s - (time.time() - t0)
                total = max(step + 1, min(cfg.steps, step + int(left / per_step)))
        if step % cfg.log_every == 0 or step == total or step == 1:
            v = float(loss.detach())
            losses.append((step, v))
            if log:
                print(
                    f"step {step}/{total} loss {v:.4f} lr {lr_at(step - 1, total, cfg):.2e} "
                    f"{time.time() - t0:.0f}s",
                    flush=True,
                )
    return {
        "steps": total,
        "seconds": round(time.time() - t0, 1),
        "losses": losses,
        "tokens_seen": total * cfg.batch_size * cfg.seq_len,
    }


def save_checkpoint(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    meta: dict | None = None,
) -> None:
    """Writes a Hugging Face folder: model.safetensors in `dtype`, configs, tokenizer, train_meta.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", dtype=dtype).eval()
    model.config.dtype = dtype
    eos = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    model.generation_config = GenerationConfig(
        eos_token_id=eos,
        pad_token_id=eos[1],
        do_sample=False,
        max_new_tokens=512,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    # Older readers look for these spellings; transformers 5 accepts them too.
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", model.config.rope_parameters["rope_theta"])
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    if meta is not None:
        (out / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def run(
    role: str,
    out: str | Path,
    size: ModelSize,
    cfg: TrainConfig,
    tokenizer_path: str | None = None,
    device: str | None = None,
    workers: int = 1,
) -> dict:
    """Builds (or loads) the tokenizer, generates data, trains one model and saves it to `out`."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tokenizer_path:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_path)
    else:
        tokenizer = build_task_tokenizer()
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    pool = build_pool(tokenizer, cfg.samples, cfg.seed, workers=workers, fork_bias=cfg.fork_bias, mix=cfg.mix)
    input_ids, labels = pack(pool, cfg.seq_len, tokenizer.convert_tokens_to_ids(ENDOFTEXT), cfg.seed)
    data_s = time.time() - t0
    kept = int((labels != IGNORE).sum())
    dropped = sum(len(ids) > cfg.seq_len for ids, _ in pool)
    print(
        f"{role}: {len(pool)} samples ({dropped} longer than a row, dropped) -> {input_ids.shape[0]} rows "
        f"of {cfg.seq_len}, {kept / 1e6:.1f}M completion tokens, in {data_s:.1f}s",
        flush=True,
    )
    model = Qwen3ForCausalLM(make_config(size, tokenizer, cfg.max_positions))
    n_params = count_params(model)
    print(f"{role}: {n_params / 1e6:.2f}M parameters {asdict(size)}", flush=True)
    summary = train_model(model, input_ids, labels, cfg, dev)
    meta = {
        "role": role,
        "params": n_params,
        "size": asdict(size),
        "train": asdict(cfg),
        "data_seconds": round(data_s, 1),
        "rows": int(input_ids.shape[0]),
        "dropped_samples": dropped,
        **summary,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    }
    save_checkpoint(model, tokenizer, out, meta=meta)
    return meta


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=sorted(SIZES), required=True, help="size preset")
    ap.add_argument("--out", required=True, help="output Hugging Face folder")
    ap.add_argument("--tokenizer", default=None, help="folder with a tokenizer to reuse (default: build one)")
    for f in ModelSize.__dataclass_fields__:
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=None, help="override the preset")
    defaults = TrainConfig()
    for f in TrainConfig.__dataclass_fields__:
        if f == "mix":
            ap.add_argument("--mix", choices=sorted(TRAIN_MIXES), default=defaults.mix, help="training data")
            continue
        typ = float if f in ("lr", "min_lr_ratio", "weight_decay", "time_budget_s", "fork_bias") else int
        ap.add_argument("--" + f.replace("_", "-"), type=typ, default=getattr(defaults, f))
    ap.add_argument("--device", default=None)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    base = asdict(SIZES[a.role])
    size = ModelSize(**{k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in base.items()})
    cfg = TrainConfig(**{f: getattr(a, f) for f in TrainConfig.__dataclass_fields__})
    run(a.role, a.out, size, cfg, tokenizer_path=a.tokenizer, device=a.device, workers=a.workers)


if __name__ == "__main__":
    main()
