"""HF transformers side by side: plain `generate` and assisted generation, batch 1, greedy.

The same target/draft folders and prompts as the engine; each prompt is generated alone (HF
assisted generation only supports batch 1), so tokens/s here is single-stream speed.
"""

from __future__ import annotations

import time
from typing import Any

from thinkspec.bench.datasets import BenchItem
from thinkspec.bench.results import CellResult


def _torch_dtype(dtype: str) -> Any:
    import torch

    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def run_hf_generate(
    target: str,
    items: list[BenchItem],
    draft: str | None = None,
    max_tokens: int = 512,
    device: str = "cpu",
    dtype: str = "float32",
    use_tqdm: bool = True,
) -> CellResult:
    """Greedy HF generate per item; with `draft`, assisted generation (assistant_model=draft)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype).to(device).eval()
    assistant = None
    if draft is not None:
        assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch_dtype).to(device).eval()
    has_template = getattr(tokenizer, "chat_template", None) is not None
    mode = "hf_assisted" if draft is not None else "hf_generate"
    correct, lengths, latencies = [], [], []
    truncated = 0
    total = 0.0
    warm = True  # the first item runs once untimed (kernel selection, allocator warm-up)
    for item in tqdm(items, desc=mode, disable=not use_tqdm, dynamic_ncols=True):
        text = item.prompt
        if item.chat and has_template:
            msgs = [{"role": "user", "content": item.prompt}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(device)  # [1, P]
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        if assistant is not None:
            kwargs["assistant_model"] = assistant
        if warm:
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), **{**kwargs, "max_new_tokens": 8})
            warm = False
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)  # [1, P + L]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1] :].tolist()
        ended = bool(new) and new[-1] == tokenizer.eos_token_id
        if ended:
            new = new[:-1]  # the engine does not count or show the end-of-turn token either
        truncated += not ended and len(new) >= max_tokens
        completion = tokenizer.decode(new, skip_special_tokens=True)
        correct.append(item.grade(completion))
        lengths.append(len(new) + int(ended))
        latencies.append(seconds)
        total += seconds
    return CellResult(
        name=mode,
        setting={"mode": mode, "temperature": 0.0},
        correct=correct,
        output_tokens=lengths,
        truncated=truncated,
        seconds=total,
        latencies=latencies,
        ttfts=[],
    )
