"""The Triton GEMV (layers/gemv_triton.py) against F.linear, and Linear's dispatch to it.

On CPU the kernel runs under the Triton interpreter in a child pytest (`test_kernels_under_interpreter`);
run those cases directly with `TRITON_INTERPRET=1 pytest tests/test_gemv_triton.py -k test_interp_`.
float32 agrees up to the order of the float32 sums; half types to one rounding of the result (the
products are summed in float32 either way). GPU cases (Qwen3-8B shapes, CUDA graphs) are marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not importable")

from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.layers import gemv_triton, linear  # noqa: E402
from thinkspec.layers.gemv_triton import gemv  # noqa: E402

gpu = pytest.mark.gpu


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _check(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        # sum order only: error grows with sqrt(K) x the products' scale
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * max(k, 1) ** 0.5)
        return
    eps = torch.finfo(out.dtype).eps
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    # one rounding each side (cuBLAS/CPU round too, from a differently ordered float32 sum)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=2 * eps * scale + 1e-6)


def test_gemv_config_fits_the_shape():
    for rows in (1, 2, 3, 4):
        for k in (1, 7, 300, 4096, 12288):
            block_n, block_k, warps, stages = gemv_triton.gemv_config(rows, 4096, k)
            assert min(k, 512) <= block_k <= 512 and block_k & (block_k - 1) == 0
            assert block_n >= 1 and warps in (2, 4) and stages >= 1


def test_gemv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="M <= 4"):
        gemv(torch.zeros(5, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match=r"\(3, 7\)"):
        gemv(torch.zeros(1, 8), torch.zeros(3, 7))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (37, 100), (64, 512), (5, 1500), (130, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_gemv_matches_linear(dtype, m, n, k, bias):
    # n not a multiple of BLOCK_N (37, 5, 130), K under, at and past BLOCK_K, uneven K (100, 1500)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    _check(gemv(x, w, b), ref, k)


@interp
@pytest.mark.parametrize("config", [(1, 16, 1, 1), (2, 32, 4, 1), (16, 64, 2, 3), (8, 128, 4, 1)])
def test_interp_gemv_launch_shapes_agree(config):
    # every launch shape computes the same products; x and w are strided views (rows of wider tensors)
    g = torch.Generator().manual_seed(7)
    wide_x = torch.randn(3, 200, generator=g)
    wide_w = torch.randn(45, 220, generator=g)
    x, w = wide_x[:, :150], wide_w[:, 10:160]
    _check(gemv(x, w, config=config), F.linear(x, w), 150)


@interp
def test_interp_gemv_ties_infinities_and_nan_propagate():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0]])
    inf, nan = float("inf"), float("nan")
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [inf, 0.0, 0.0, 0.0], [0.0, nan, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = gemv(x, w)
    assert out[0, 0] == out[0, 3] == -0.5
    assert out[0, 1] == float("inf") and torch.isnan(out[0, 2])


@interp
def test_interp_gemv_empty_shapes():
    assert gemv(torch.zeros(0, 8), torch.zeros(3, 8)).shape == (0, 3)
    assert gemv(torch.zeros(2, 8), torch.zeros(0, 8)).shape == (2, 0)
    out = gemv(torch.zeros(2, 0), torch.zeros(3, 0), torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(out, torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]))


@interp
def test_interp_linear_sends_skinny_products_to_the_gemv(monkeypatch):
    calls = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    layer = linear.Linear(64, 48, bias=True)
    x = torch.randn(4, 64)
    assert torch.equal(layer(x[:1]), F.linear(x[:1], layer.weight, layer.bias))
    assert not calls  # off by default
    layer.gemv = True
    for rows in range(1, 5):
        out = layer(x[:rows])
        torch.testing.assert_close(out, F.linear(x[:rows], layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [(1, 64), (2, 64)]  # up to GEMV_MAX_ROWS rows
    layer(x[:1].unsqueeze(0))  # [1, 1, in]: not a 2-d batch of rows
    monkeypatch.setattr(linear, "GEMV_MAX_WEIGHT", 64 * 48 - 1)
    layer(x[:1])  # a weight over the limit stays on F.linear
    assert calls == [(1, 64), (2, 64)]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k"), [(1, 256), (2, 300), (4, 37)])
def test_interp_gemv_glu_equals_silu_and_mul_then_gemv(dtype, m, k):
    # SiLU(gate) * up inside the GEMV's launch: the same bits as silu_and_mul's output fed to it,
    # including gates whose SiLU is -0 / inf / NaN
    from thinkspec.layers.fused_triton import silu_and_mul

    g = torch.Generator().manual_seed(m * 100 + k)
    gate_up = (3 * torch.randn(m, 2 * k, generator=g)).to(dtype)
    gate_up[0, :3] = torch.tensor([-200.0, float("inf"), float("nan")]).to(dtype)
    w = (torch.randn(70, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    fused = gemv(gate_up, w, b, glu=True)
    two = gemv(silu_and_mul(gate_up), w, b)
    assert torch.equal(fused.isnan(), two.isnan())
    assert torch.equal(fused.nan_to_num(), two.nan_to_num())
    act = (F.silu(gate_up[:, :k].float()).to(dtype).float() * gate_up[:, k:].float()).to(dtype)
    ref = F.linear(act.float(), w.float(), b.float())
    assert torch.equal(fused.isnan(), ref.isnan()) and fused[0].isnan().all()
    # bf16: the interpreter's casts to bf16 do not round as torch's do, so SiLU(gate) * up is off by
    # up to a bf16 step in most elements before the product (the GPU test compares with torch)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (5e-2, 0.25)
    torch.testing.assert_close(fused[1:].float(), ref[1:], rtol=tol[0], atol=tol[1])
    with pytest.raises(ValueError, match="2K"):
        gemv(gate_up[:, :-1], w, b, glu=True)


@interp
def test_interp_linear_glu_goes_into_the_gemv(monkeypatch):
    from thinkspec.layers import fused_triton

    silu_calls = []
    real_silu = fused_triton.silu_and_mul
    monkeypatch.setattr(fused_triton, "silu_and_mul", lambda x: silu_calls.append(x.shape) or real_silu(x))
    layer = linear.Linear(32, 48, bias=True)
    gate_up = torch.randn(4, 64)
    ref = F.linear(F.silu(gate_up[:, :32]) * gate_up[:, 32:], layer.weight, layer.bias)
    layer.gemv = True
    for rows in (1, 2, 4):  # 1-2 rows: one GEMV launch; 4: silu_and_mul, then F.linear
        torch.testing.assert_close(layer(gate_up[:rows], glu=True), ref[:rows], rtol=1e-5, atol=1e-5)
    assert silu_calls == [(4, 64)]


# ---------------------------------------------------------------- GPU cases (real sizes)


@gpu
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (4096, 12288), (1024, 3072), (151936, 1024)]
)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gpu_gemv_matches_cublas_at_model_shapes(n, k, m):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    out = gemv(x, w, b)
    # the float32 result rounded once: within a bf16 rounding of the exact value, nearly all bit-exact
    assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
    assert (out == ref.bfloat16()).float().mean().item() > 0.99


@gpu
@torch.inference_mode()
def test_gpu_gemv_replays_in_a_cuda_graph():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    eager = gemv(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    assert torch.equal(captured, gemv(x, w))


@gpu
@pytest.mark.parametrize(("n", "k"), [(4096, 12288), (1024, 3072)])
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_gemv_glu_prologue_equals_silu_and_mul_then_gemv(n, k, m):
    # the down projections of Qwen3-8B and 0.6B with SiLU(gate) * up in the GEMV's input prologue:
    # bit-identical to silu_and_mul's output fed to the GEMV, and within a rounding of torch
    from thinkspec.layers.fused_triton import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    gate_up = (2 * torch.randn(m, 2 * k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    fused = gemv(gate_up, w, glu=True)
    assert torch.equal(fused, gemv(silu_and_mul(gate_up), w))
    act = (F.silu(gate_up[:, :k].float()).bfloat16().float() * gate_up[:, k:].float()).bfloat16()
    ref = F.linear(act.float(), w.float())
    assert ((fused.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-6).all()
