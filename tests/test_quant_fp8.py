"""Float8 draft weights (layers/quant_fp8.py): the quantizer, the widening reference, Linear's dispatch,
the GEMV and skinny GEMM reading float8 tiles with per-row scales, and the engine option.

Kernel cases run under the Triton interpreter in a child pytest (`test_kernels_under_interpreter`;
directly: `TRITON_INTERPRET=1 pytest tests/test_quant_fp8.py -k test_interp_`). The reference for a
kernel is the float32 product with the widened float8 weight, scaled after the sum, as the kernels do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import tiny_checkpoint

from thinkspec.config import SpeculativeConfig
from thinkspec.layers.linear import Linear, MergedLinear
from thinkspec.layers.quant_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_rows,
    fp8_linear,
    quantize_linears_fp8,
    quantize_rows,
)
from thinkspec.models.loader import load_model

gpu = pytest.mark.gpu


def _reference(x, q, scale, bias, glu=False) -> torch.Tensor:
    # x [M, K] -> float32 [M, N]: sums over the widened float8 weight in float32, then the scale
    y = F.linear(x.float(), q.float()) * scale
    if bias is not None:
        y = y + bias.float()
    if glu:  # as fused_triton.silu_mul: gate and up rounded to x's dtype, SiLU rounded to it
        n = y.shape[1] // 2
        gate, up = y[:, :n].to(x.dtype), y[:, n:].to(x.dtype)
        y = F.silu(gate).float() * up.float()
    return y


# ---- the quantizer ------------------------------------------------------------------------------


def test_quantize_rows_error_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 2, 64)[:, None]  # rows of every scale
    w[5] = 0.0
    q, scale = quantize_rows(w)
    assert (
        q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (64,) and scale.dtype == torch.float32
    )
    amax = w.abs().amax(dim=1)
    assert scale[5] == 1.0 and (q[5].float() == 0).all()  # an all-zero row
    ok = amax > 0
    torch.testing.assert_close(scale[ok], amax[ok] / FP8_MAX)
    assert (q.float().abs().amax(dim=1)[ok] == FP8_MAX).all()  # each row's largest entry maps to 448
    back = dequantize_rows(q, scale, torch.float32)
    # e4m3: 3 mantissa bits, half an ulp relative for normals; subnormals (below 2^-6) step by 2^-9
    bound = torch.maximum(w.abs() * 2.0**-4, scale[:, None] * 2.0**-10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert (back - w).abs().max() > 0  # the check can fail: quantization does lose bits


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_quantize_rows_refuses_non_finite_weights(bad):
    w = torch.ones(3, 4)
    w[1, 2] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_rows(w)
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize_rows(torch.ones(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_the_scaled_product(dtype):
    gen = torch.Generator().manual_seed(1)
    q, scale = quantize_rows(torch.randn(24, 40, generator=gen))
    x = torch.randn(5, 40, generator=gen).to(dtype)
    bias = torch.randn(24, generator=gen).to(dtype)
    y = fp8_linear(x, q, scale, bias)
    assert y.dtype == dtype and y.shape == (5, 24)
    ref = _reference(x, q, scale, bias)
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# ---- Linear --------------------------------------------------------------------------------------


def test_linear_quantized_runs_the_widening_reference_off_triton():
    gen = torch.Generator().manual_seed(2)
    lin = Linear(32, 20, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(20, 32, generator=gen))
        lin.bias.copy_(torch.randn(20, generator=gen))
    dense = lin.weight.detach().clone()
    lin.quantize_fp8()
    assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale is not None
    assert "weight_scale" in dict(lin.named_buffers())  # moves with the module (.to(device))
    x = torch.randn(7, 32, generator=gen)
    assert lin.triton_kernel(x) is None
    torch.testing.assert_close(lin(x), _reference(x, lin.weight, lin.weight_scale, lin.bias))
    assert (lin(x) - F.linear(x, dense, lin.bias)).abs().max() > 0  # not the dense product
    out = torch.empty(7, 20)
    assert lin.product(x, lin.bias, out=out) is out
    with pytest.raises(ValueError, match="float8 already"):
        lin.quantize_fp8()


def test_merged_linear_quantized_scales_each_shard():
    # gate and up rows of one merged weight keep their own row scales
    gen = torch.Generator().manual_seed(3)
    lin = MergedLinear(16, {"gate": 12, "up": 12}, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 16, generator=gen))
        lin.weight[12:] *= 1000.0  # up rows far larger than gate rows
    lin.quantize_fp8()
    x = torch.randn(3, 16, generator=gen)
    gate, up = lin.split(lin(x))
    ref = _reference(x, lin.weight, lin.weight_scale, None)
    torch.testing.assert_close(torch.cat([gate, up], 1), ref)
    assert lin.weight_scale[12:].min() > lin.weight_scale[:12].max()


def test_quantize_linears_fp8_keeps_a_tied_embedding():
    model, info = load_model(tiny_checkpoint("qwen3", tied=True))
    assert info.tie_word_embeddings
    embed = model.model.embed_tokens.weight
    before = embed.detach().clone()
    count = quantize_linears_fp8(model)
    # q/k/v, o, gate/up and down of every layer, and the lm_head
    assert count == 4 * info.num_layers + 1
    assert model.lm_head.weight.dtype == FP8_DTYPE and model.lm_head.weight is not embed
    assert embed.dtype == info.dtype and torch.equal(embed, before)
    assert all(
        m.weight.dtype == FP8_DTYPE and m.weight_scale is not None
        for m in model.modules()
        if isinstance(m, Linear)
    )
    hidden = torch.randn(3, info.hidden_size, generator=torch.Generator().manual_seed(4)).to(info.dtype)
    logits = model.compute_logits(hidden)
    lm = model.lm_head
    assert logits.dtype == torch.float32 and logits.shape == (3, info.vocab_size)
    torch.testing.assert_close(logits, _reference(hidden, lm.weight, lm.weight_scale, None))


# ---- configuration --------------------------------------------------------------------------------


def test_speculative_config_quantization_is_checked():
    cfg = SpeculativeConfig(model="d", num_speculative_tokens=3, quantization="fp8")
    assert cfg.quantization == "fp8"
    with pytest.raises(ValueError, match=r"SpeculativeConfig\.quantization must be one of \('fp8',\)"):
        SpeculativeConfig(model="d", num_speculative_tokens=3, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization='fp8' applies to a draft model; method 'ngram'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, quantization="fp8")


# ---- kernels under the interpreter ----------------------------------------------------------------

pytest.importorskip("triton", reason="triton is not importable")

from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.layers.gemm_skinny_triton import skinny_gemm, skinny_gemm_rms_norm  # noqa: E402
from thinkspec.layers.gemv_triton import gemv  # noqa: E402


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _operands(rows: int, n: int, k: int, glu: bool, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(2 * n if glu else n, k, generator=gen) * torch.rand(2 * n if glu else n, 1, generator=gen)
    q, scale = quantize_rows(w)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(q.shape[0], generator=gen).to(dtype)
    return x, q, scale, bias


@interp
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 37, 96), (2, 64, 100), (3, 8, 513), (4, 130, 64)])
def test_interp_gemv_fp8_matches_the_scaled_product(rows, n, k, glu):
    # odd N (partial output blocks), K not a multiple of the tile (masked loads), 1-4 rows
    x, q, scale, bias = _operands(rows, n, k, glu, seed=rows * 1000 + n)
    y = gemv(x, q, bias, glu=glu, scale=scale)
    ref = _reference(x, q, scale, bias, glu)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * k**0.5)


@interp
def test_interp_gemv_fp8_checks_the_scale():
    x, q, scale, _ = _operands(1, 8, 32, False, seed=5)
    with pytest.raises(ValueError, match="needs its per-row scale"):
        gemv(x, q)
    with pytest.raises(ValueError, match="needs its per-row scale"):
        gemv(x, q.float(), scale=scale)
    with pytest.raises(ValueError, match=r"contiguous float32 \[8\]"):
        gemv(x, q, scale=scale[:4])


@interp
@pytest.mark.parametrize(
    ("rows", "n", "k", "glu", "config"),
    [
        (3, 40, 96, False, None),
        (16, 64, 256, False, (32, 64, 2, 4, 1)),  # K split in two: the scale on each partial
        (5, 24, 100, True, (16, 32, 1, 4, 1)),  # SiLU * up, masked K
        (64, 32, 128, False, (32, 32, 4, 4, 1)),
    ],
)
def test_interp_skinny_gemm_fp8_matches_the_scaled_product(rows, n, k, glu, config):
    x, q, scale, bias = _operands(rows, n, k, glu, seed=rows + n, dtype=torch.bfloat16)
    out = torch.empty(rows, n, dtype=torch.float32)
    y = skinny_gemm(x, q, bias, config=config, glu=glu, out=out, scale=scale)
    assert y is out
    ref = _reference(x, q, scale, bias, glu)
    # SiLU * up rounds gate and up to bf16: a different float32 sum order may flip those roundings
    tol = 4 * torch.finfo(torch.bfloat16).eps if glu else 1e-5 * k**0.5
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())


@interp
def test_interp_skinny_gemm_rms_norm_fp8_is_the_two_steps():
    x, q, scale, bias = _operands(4, 64, 256, False, seed=9, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(10)
    residual = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    norm_w = torch.rand(64, generator=gen).to(torch.bfloat16)
    config = (32, 64, 2, 4, 1)
    from thinkspec.layers.fused_triton import rms_norm

    normed, stream = skinny_gemm_rms_norm(x, q, bias, residual, norm_w, 1e-6, config=config, scale=scale)
    want_normed, want_stream = rms_norm(
        skinny_gemm(x, q, bias, config=config, scale=scale), norm_w, 1e-6, residual
    )
    assert torch.equal(stream, want_stream) and torch.equal(normed, want_normed)


@interp
@pytest.mark.parametrize(
    ("rows", "kernel"), [(1, "gemv"), (2, "gemv"), (3, "skinny"), (64, "skinny"), (65, None)]
)
def test_interp_linear_dispatch_fp8(rows, kernel):
    # float8 weights take the Triton kernels whatever the shape (no table), the reference past 64 rows
    gen = torch.Generator().manual_seed(rows)
    lin = Linear(64, 48, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen))
    lin.quantize_fp8()
    lin.gemv = lin.skinny_gemm = True
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    assert lin.triton_kernel(x) == kernel
    out = torch.empty(rows, 48, dtype=torch.float32)
    y = lin.product(x, None, out=out)
    ref = _reference(x, lin.weight, lin.weight_scale, None)
    eps = torch.finfo(torch.bfloat16).eps  # the reference path rounds its product to bf16 first
    torch.testing.assert_close(y, ref, rtol=2 * eps, atol=2 * eps * ref.abs().max().item())


# ---- GPU ------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64])
@pytest.mark.parametrize(
    ("n", "k", "glu"), [(4096, 1024, False), (1024, 2048, False), (3072, 1024, True), (1024, 3072, False)]
)
def test_gpu_fp8_products_at_the_draft_shapes(n, k, glu, rows):
    # Qwen3-0.6B's q/k/v, o, gate/up (SiLU * up) and down in bf16 with float8 weights, through Linear
    lin = MergedLinear(k, {"gate": n, "up": n}, bias=False) if glu else Linear(k, n, bias=False)
    lin = lin.to("cuda", torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    lin.quantize_fp8()
    lin.gemv = lin.skinny_gemm = True
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    assert lin.triton_kernel(x, glu) == ("gemv" if rows <= 2 else "skinny")
    y = lin.silu_and_mul(x) if glu else lin(x)
    ref = _reference(x, lin.weight, lin.weight_scale, None, glu)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(y.float(), ref, rtol=2 * eps, atol=2 * eps * ref.abs().max().item())


@gpu
def test_gpu_fp8_lm_head_logits():
    # the 0.6B lm_head (151,936 x 1,024) at one and two rows, float32 logits straight from the GEMV
    lin = Linear(1024, 151936, bias=False).to("cuda", torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    lin.quantize_fp8()
    lin.gemv = lin.skinny_gemm = True
    for rows in (1, 2):
        x = torch.randn(rows, 1024, device="cuda").to(torch.bfloat16)
        out = torch.empty(rows, 151936, device="cuda")
        lin.product(x, None, out=out)
        ref = _reference(x, lin.weight, lin.weight_scale, None)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
