"""Weight-only float8 quantization of linear layers (W8A16), for the draft model.

A draft's one-row forward reads its weights once per drafted token: at batch 1 the Qwen3-0.6B draft
spends most of its step streaming 1.2 GB of bf16 weights. Stored as float8 e4m3 with one float32
scale per output row, the weights are half the bytes; activations, sums and outputs stay in the
model's dtype and float32:

  scale[n] = max_k |W[n, k]| / 448  (448: the largest e4m3 value; 1 for an all-zero row)
  Wq[n, k] = e4m3(W[n, k] / scale[n])  (round to nearest)
  y[m, n]  = scale[n] * sum_k x[m, k] * Wq[n, k]  (+ bias[n])

The Triton GEMV (1..4 rows) and the skinny GEMM (3..64 rows) read Wq and apply the scale in their
epilogue (layers/gemv_triton.py, layers/gemm_skinny_triton.py); every other product (prefill, CPU)
widens Wq to x's dtype (exact: every e4m3 value is a bf16 / fp16 / fp32 value) and scales the
product (`fp8_linear`, the reference). The draft's lm_head is quantized too (its tied embedding
keeps the model's dtype). Only the draft: speculative output stays the target's (verification is
unchanged); quantization can change which tokens the draft proposes, so acceptance is measured,
not assumed (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (Wq [N, K] float8 e4m3, scale [N] float32), one scale per output row.
    ValueError if the weight holds inf or NaN (no scale represents it)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_rows takes a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.float()
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_rows: the weight holds inf or NaN; it cannot be scaled to float8")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Wq [N, K] float8, scale [N] float32 -> scale[n] * Wq[n, k] [N, K] in dtype."""
    return (q.float() * scale[:, None]).to(dtype)


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32), Wq [N, K] float8, scale [N] -> scale * (x @ Wq.T) + bias
    [..., N] in x's dtype: Wq widened to x's dtype (exactly), the product in x's dtype, then scaled
    in float32 and rounded once more."""
    y = F.linear(x, q.to(x.dtype)).float() * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_linears_fp8(model: nn.Module) -> int:
    """Quantize every layers.linear.Linear of `model` (its projections and lm_head) to float8 with
    per-row scales, in place (Linear.quantize_fp8); returns how many. A tied lm_head gets its own
    float8 copy and the embedding keeps its weight."""
    from thinkspec.layers.linear import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.quantize_fp8()
    return len(layers)
