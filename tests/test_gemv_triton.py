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

from thinkspec.layers import gemv_triton, linear, pdl  # noqa: E402
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


def test_gemv_config_gives_few_long_rows_wider_k_tiles():
    # the 0.6B's o (1024 x 2048) and down (1024 x 3072) at 1-2 rows: 2 outputs, 2048-wide K tiles
    for rows in (1, 2):
        for k in (2048, 3072):
            assert gemv_triton.gemv_config(rows, 1024, k) == (2, 2048, 4, 1)
        assert gemv_triton.gemv_config(rows, 1024, 1024) == (4, 512, 2, 1)  # short rows: the default
        assert gemv_triton.gemv_config(rows, 4096, 4096) == (4, 512, 2, 1)  # many outputs: the default
        assert gemv_triton.gemv_config(rows, 1024, 3072, glu=True) == (2, 512, 2, 1)
    assert gemv_triton.gemv_config(4, 1024, 3072) == (2, 512, 4, 1)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2])
def test_interp_gemv_few_outputs_over_long_rows(dtype, m):
    # gemv_config's 2048-wide K tiles (n <= SMALL_N, k >= 2048 at 1-2 rows), K not a multiple of them
    assert gemv_triton.gemv_config(m, 37, 2100)[1] == 2048
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2100, generator=g).to(dtype)
    w = (torch.randn(37, 2100, generator=g) / 2100**0.5).to(dtype)
    b = torch.randn(37, generator=g).to(dtype)
    _check(gemv(x, w, b), F.linear(x.float(), w.float(), b.float()).to(dtype), 2100)


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


def _glu_reference(x, w, b):
    # x [M, K], w [2N, K], b [2N] or None -> SiLU(gate) * up [M, N] float32, as the torch path rounds:
    # the product in x's dtype, then F.silu in it, then the product of the two
    y = F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize(("n", "k"), [(1, 5), (37, 100), (64, 512), (5, 1500)])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_gemv_glu_is_the_product_then_silu_and_mul(dtype, m, n, k, bias):
    from thinkspec.layers.fused_triton import silu_and_mul

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5 * 3).to(dtype)  # gates across SiLU's bend
    b = torch.randn(2 * n, generator=g).to(dtype) if bias else None
    fused = gemv(x, w, b, glu=True)
    assert fused.shape == (m, n) and fused.dtype == dtype
    # the same sums, roundings and SiLU as the two launches it replaces: the same bits
    assert torch.equal(fused, silu_and_mul(gemv(x, w, b)))
    ref = _glu_reference(x, w, b)
    eps = torch.finfo(dtype).eps
    tol = 1e-5 * k**0.5 if dtype == torch.float32 else 4 * eps
    torch.testing.assert_close(fused.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item() + 1e-6)


@interp
def test_interp_gemv_glu_edges():
    from thinkspec.layers.fused_triton import silu_and_mul

    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, 2.0]])
    # gate rows then up rows: gate -inf -> SiLU 0 (x up 3), gate +inf -> inf, NaN propagates, gate 0 -> 0
    w = torch.tensor([[-inf, 0.0], [inf, 0.0], [nan, 0.0], [0.0, 0.0],
                      [3.0, 0.0], [1.0, 0.0], [1.0, 0.0], [5.0, 0.0]])  # fmt: skip
    out = gemv(x, w, glu=True)
    torch.testing.assert_close(out, silu_and_mul(gemv(x, w)), rtol=0, atol=0, equal_nan=True)
    # F.silu(-inf) is NaN in torch as well (-inf * 0)
    torch.testing.assert_close(out, F.silu(F.linear(x, w[:4])) * F.linear(x, w[4:]), equal_nan=True)
    assert torch.isnan(out[0, 0]) and out[0, 1] == float("inf") and torch.isnan(out[0, 2]) and out[0, 3] == 0
    with pytest.raises(ValueError, match="N even"):
        gemv(x, torch.zeros(3, 2), glu=True)
    # K = 0: SiLU(gate bias) * up bias; no bias: zeros
    bias = torch.tensor([1.0, -2.0, 3.0, 4.0])
    empty = gemv(torch.zeros(2, 0), torch.zeros(4, 0), bias, glu=True)
    torch.testing.assert_close(empty, (F.silu(bias[:2]) * bias[2:]).expand(2, 2))
    assert torch.equal(gemv(torch.zeros(2, 0), torch.zeros(4, 0), glu=True), torch.zeros(2, 2))


@interp
@pytest.mark.parametrize("m", [1, 2])
def test_interp_gemv_writes_into_a_float32_out(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 300, generator=g).bfloat16()
    w = (torch.randn(70, 300, generator=g) / 300**0.5).bfloat16()
    out = torch.full((m, 70), float("nan"))
    assert gemv(x, w, out=out) is out
    # the float32 sums themselves, not rounded to bf16
    torch.testing.assert_close(out, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, out.bfloat16().float())
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(m, 71))


@interp
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m", [1, pdl.EARLY_MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (64, 512), (6, 1500)])
def test_interp_gemv_early_release_gives_the_same_bits(monkeypatch, glu, m, n, k):
    # pdl.EARLY_RELEASE: the first weight tile read before the wait, the same sums in the same order
    # (a K shorter than one tile, exactly one tile, many tiles with a ragged last one), at the
    # default launch shape and a small one
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * n if glu else n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(w.shape[0], generator=g).bfloat16()
    got = {}
    for early in (False, True):
        monkeypatch.setattr(pdl, "EARLY_RELEASE", early)
        assert pdl.early_release(m) == early
        got[early] = [gemv(x, w, b, glu=glu, config=c) for c in (None, (2, 32, 4, 1))]
    assert all(torch.equal(a, e) for a, e in zip(got[False], got[True]))
    _check(got[True][0], _glu_reference(x, w, b) if glu else F.linear(x, w, b), k)


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
@pytest.mark.parametrize(("n", "k"), [(3072, 1024), (12288, 4096)])  # 0.6B and 8B gate_up -> SiLU * up
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_gemv_glu_matches_the_two_launches(n, k, m):
    from thinkspec.layers.fused_triton import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(n + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * n, k, device="cuda", generator=g) * 0.05).bfloat16()
    fused = gemv(x, w, glu=True)
    for config in (None, gemv_triton.gemv_config(m, n, k, glu=True)):
        two = silu_and_mul(gemv(x, w, config=config))
        err = (fused.float() - two.float()).abs()
        assert (err <= two.float().abs() * 2**-7 + 1e-6).all()  # a bf16 rounding apart at most
        same = (fused == two).float().mean().item()
        assert same > (0.999 if config else 0.98), same  # the same launch shape: the same bits


@gpu
def test_gpu_gemv_float32_out():
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    w = (torch.randn(4096, 4096, device="cuda") * 0.02).bfloat16()
    out = torch.empty(1, 4096, device="cuda")
    assert gemv(x, w, out=out) is out
    torch.testing.assert_close(out, F.linear(x.float(), w.float()), rtol=1e-4, atol=1e-4)
