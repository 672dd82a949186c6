"""The skinny tensor-core GEMM (layers/gemm_skinny_triton.py) against F.linear, and Linear's dispatch.

On CPU the kernel runs under the Triton interpreter in a child pytest (`test_kernels_under_interpreter`);
run those cases directly with `TRITON_INTERPRET=1 pytest tests/test_gemm_skinny_triton.py -k test_interp_`.
The kernel sums float32 products and rounds once to bf16/fp16, so it agrees with F.linear in float32
to one rounding of the result plus the float32 sums' order. GPU cases (Qwen3-8B shapes, CUDA graphs)
are marked `gpu`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not importable")

from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.layers import gemm_skinny_triton as gs  # noqa: E402
from thinkspec.layers import linear  # noqa: E402
from thinkspec.layers.gemm_skinny_triton import skinny_gemm  # noqa: E402

gpu = pytest.mark.gpu


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _reference(x, w, b):
    # x [M, K], w [N, K], b [N] or None -> float32 [M, N] from the operands' exact values
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = _reference(x, w, b)
    assert out.dtype == x.dtype and out.shape == ref.shape
    eps = torch.finfo(out.dtype).eps
    # one rounding of the result, plus float32 sums in another order (|x| |w| bounds their error)
    sum_err = 1e-6 * x.shape[1] * (x.float().abs() @ w.float().abs().T)
    bound = ref.abs() * eps + sum_err + 1e-30
    err = (out.float() - ref).abs()
    assert (err <= bound).all(), (
        f"max error {err.max().item()} (bound there {bound[err.argmax() // ref.shape[1]]})"
    )


def _operands(m: int, n: int, k: int, bias: bool, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed + m * 1000 + n * 7 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def test_config_fits_the_shape():
    for rows in (3, 16, 64):
        for n, k in ((4096, 4096), (6144, 4096), (4096, 12288), (151936, 4096), (37, 100), *DRAFT_SHAPES):
            block_n, block_k, split, warps, stages = gs.skinny_gemm_config(rows, n, k)
            assert block_n in (32, 64, 128) and block_k & (block_k - 1) == 0 and 16 <= block_k <= 256
            assert split in (1, 2, 4) and warps in (4, 8) and stages >= 1
            assert split == 1 or triton_cdiv(n, block_n) < 264  # split only when SMs would idle


# Qwen3-0.6B's (the draft's) products as (N, K): q/k/v, o, gate_up, down, lm_head
DRAFT_SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_row_buckets():
    assert [gs.row_bucket(r) for r in (3, 4, 5, 8, 9, 16, 17, 33, 64)] == [4, 4, 8, 8, 16, 16, 32, 64, 64]


def test_lm_head_goes_to_the_skinny_gemm_at_3_to_64_rows():
    # The table's lm_head entries (4 to 64 rows) beat cuBLAS in bench_skinny_gemm; one and two rows stay
    # on cuBLAS (the weight is past GEMV_MAX_WEIGHT), and so does the verify's 65 rows and more
    for hidden in (4096, 1024):  # Qwen3-8B's and Qwen3-0.6B's (the draft's)
        lm_head = linear.Linear(hidden, 151936, bias=False, device="meta", dtype=torch.bfloat16)
        lm_head.gemv = lm_head.skinny_gemm = True
        for rows in (1, 2, 3, 8, 16, 17, 32, 33, 64, 65, 320):
            want = "skinny" if 3 <= rows <= 64 else None
            x = torch.empty(rows, hidden, device="meta", dtype=torch.bfloat16)
            assert lm_head.triton_kernel(x) == want, (hidden, rows)


def test_the_drafts_products_go_to_the_skinny_gemm_at_3_to_64_rows():
    # Qwen3-0.6B's q/k/v, o and down beat cuBLAS at every bucket (bench_skinny_gemm --model 0.6b), and its
    # gate_up with SiLU * up fused; one and two rows go to the GEMV (not the lm_head), more than 64 to cuBLAS
    for n, k in DRAFT_SHAPES:
        layer = linear.Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16)
        layer.gemv = layer.skinny_gemm = True
        for rows in (1, 2, 3, 5, 16, 33, 64, 65, 128):
            small = "gemv" if n * k <= linear.GEMV_MAX_WEIGHT else None  # lm_head: cuBLAS, as above
            want = small if rows <= 2 else "skinny" if rows <= 64 else None
            x = torch.empty(rows, k, device="meta", dtype=torch.bfloat16)
            assert layer.triton_kernel(x) == want, (n, k, rows)
    gate_up = linear.Linear(1024, 6144, bias=False, device="meta", dtype=torch.bfloat16)
    gate_up.gemv = gate_up.skinny_gemm = True
    for rows in (3, 8, 64):
        assert (
            gate_up.triton_kernel(torch.empty(rows, 1024, device="meta", dtype=torch.bfloat16), glu=True)
            == "skinny"
        )


def test_rejects_bad_operands():
    with pytest.raises(ValueError, match="M <= 64"):
        skinny_gemm(torch.zeros(65, 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\(3, 7\)"):
        skinny_gemm(torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(3, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        skinny_gemm(torch.zeros(4, 8), torch.zeros(3, 8))


# Small blocks keep the interpreter quick; every path still runs: K tail (100, 300), N tail (37, 130),
# split K (2 and 3 slices, the last one short), padding rows (3, 17 -> 16, 32).
SMALL = (32, 64, 1, 4, 3)
SPLIT2 = (32, 64, 2, 4, 3)
SPLIT3 = (16, 32, 3, 4, 2)


@interp
@pytest.mark.parametrize("m", [3, 16, 17, 64])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (130, 256), (64, 300)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [SMALL, SPLIT2], ids=["split1", "split2"])
def test_interp_matches_linear(m, n, k, bias, config):
    x, w, b = _operands(m, n, k, bias)
    _check(skinny_gemm(x, w, b, config=config), x, w, b)


@interp
@pytest.mark.parametrize("config", [SPLIT3, (64, 128, 1, 4, 3), (128, 16, 4, 8, 5)])
def test_interp_launch_shapes_and_strided_operands(config):
    # every launch shape computes the same products; x and w are strided views (rows of wider tensors)
    x, w, b = _operands(20, 150, 420, True, dtype=torch.float16, seed=3)
    wide_x = torch.randn(20, 500).half()
    wide_w = torch.randn(150, 450).half()
    wide_x[:, 30:450] = x
    wide_w[:, 10:430] = w
    xs, ws = wide_x[:, 30:450], wide_w[:, 10:430]
    _check(skinny_gemm(xs, ws, b, config=config), x, w, b)


def test_use_tma_needs_16_byte_addresses_and_rows(monkeypatch):
    x = torch.zeros(4, 512, dtype=torch.bfloat16)
    w = torch.zeros(64, 512, dtype=torch.bfloat16)
    assert gs.use_tma(x, w)
    assert gs.use_tma(x[:, :100], w[:, :100])  # a narrower view: rows still 1,024 bytes apart
    assert not gs.use_tma(x[:, 1:101], w[:, :100])  # x starts 2 bytes past a 16-byte boundary
    assert not gs.use_tma(x[:, :100], w[:, 8:108][:, 1:])  # so does w
    assert not gs.use_tma(torch.zeros(4, 100, dtype=torch.bfloat16), w[:, :100])  # 200-byte rows
    monkeypatch.setattr(gs, "TMA", False)
    assert not gs.use_tma(x, w)


@interp
@pytest.mark.parametrize(("m", "n", "k"), [(3, 37, 352), (17, 130, 256), (64, 64, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("config", "glu"), [(SMALL, False), (SPLIT3, False), (SMALL, True)])
def test_interp_tensor_descriptors_give_the_pointer_loads_bits(monkeypatch, m, n, k, bias, config, glu):
    # K tails (352 = 5.5 tiles of 64), N tails, padding rows, split K, GLU: the copy engine's zero fill
    # must stand in for every mask
    from triton.tools import tensor_descriptor

    x, w, b = _operands(m, 2 * n if glu else n, k, bias)
    made = []
    real = tensor_descriptor.TensorDescriptor.from_tensor
    monkeypatch.setattr(
        tensor_descriptor.TensorDescriptor, "from_tensor", lambda *a, **kw: made.append(a) or real(*a, **kw)
    )
    with_tma = skinny_gemm(x, w, b, config=config, glu=glu)
    assert len(made) == 2  # x and w went through descriptors
    monkeypatch.setattr(gs, "TMA", False)
    assert torch.equal(with_tma, skinny_gemm(x, w, b, config=config, glu=glu))
    assert len(made) == 2
    if not glu:
        _check(with_tma, x, w, b)


@interp
def test_interp_misaligned_views_take_pointer_loads():
    # rows 1,024 bytes apart but starting 2 bytes past a 16-byte boundary: no descriptor can take them
    x, w, b = _operands(9, 70, 420, True, seed=5)
    wide_x = torch.randn(9, 512).to(torch.bfloat16)
    wide_w = torch.randn(70, 512).to(torch.bfloat16)
    wide_x[:, 1:421] = x
    wide_w[:, 1:421] = w
    _check(skinny_gemm(wide_x[:, 1:421], wide_w[:, 1:421], b, config=SMALL), x, w, b)


@interp
def test_interp_zeros_and_large_values():
    x, w, b = _operands(5, 70, 200, True)
    # zero rows give exactly the bias; zero weight rows exactly 0 (+ bias)
    x[1].zero_()
    w[3].zero_()
    for config in (SMALL, SPLIT2):
        out = skinny_gemm(x, w, b, config=config)
        assert torch.equal(out[1], b)
        assert torch.equal(out[:, 3], b[3].expand(5))
        assert torch.equal(skinny_gemm(x, w, None, config=config)[:, 3], torch.zeros(5, dtype=x.dtype))
        _check(out, x, w, b)
    # large magnitudes (products and sums ~1e33, past fp16's range): float32 accumulation, still finite
    big_x, big_w = (x.float() * 1e17).bfloat16(), (w.float() * 1e17).bfloat16()
    for config in (SMALL, SPLIT2):
        out = skinny_gemm(big_x, big_w, b, config=config)
        assert torch.isfinite(out).all()
        _check(out, big_x, big_w, b)


@interp
def test_interp_default_config_and_empty_shapes():
    x, w, b = _operands(9, 300, 520, True)
    _check(skinny_gemm(x, w, b), x, w, b)  # skinny_gemm_config's rule, splitting K
    bf = torch.bfloat16
    assert skinny_gemm(torch.zeros(0, 8, dtype=bf), torch.zeros(3, 8, dtype=bf)).shape == (0, 3)
    assert skinny_gemm(torch.zeros(4, 8, dtype=bf), torch.zeros(0, 8, dtype=bf)).shape == (4, 0)
    bias = torch.tensor([1.0, 2.0, 3.0], dtype=bf)
    out = skinny_gemm(torch.zeros(2, 0, dtype=bf), torch.zeros(3, 0, dtype=bf), bias)
    assert torch.equal(out, bias.expand(2, 3))


@interp
def test_interp_linear_dispatches_by_the_table(monkeypatch):
    calls = []
    real = gs.skinny_gemm
    monkeypatch.setattr(gs, "skinny_gemm", lambda *a, **kw: calls.append(tuple(a[0].shape)) or real(*a, **kw))
    monkeypatch.setattr(gs, "SKINNY_GEMM_TABLE", {})
    layer = linear.Linear(96, 70, bias=True).to(torch.bfloat16)
    other = linear.Linear(96, 40, bias=False).to(torch.bfloat16)
    x = torch.randn(64, 96).to(torch.bfloat16)

    def agree(lay, rows):
        out = lay(x[:rows])
        ref = F.linear(x[:rows], lay.weight, lay.bias)
        _check(out, x[:rows], lay.weight.detach(), None if lay.bias is None else lay.bias.detach())
        return out, ref

    layer.skinny_gemm = other.skinny_gemm = True
    for rows in (3, 8, 16):
        out, ref = agree(layer, rows)
        assert torch.equal(out, ref)  # empty table: cuBLAS (F.linear) itself
    assert not calls
    # the table names (bucket 8, N 70, K 96) and (bucket 64, 70, 96): rows 5..8 and 33..64 of this layer
    monkeypatch.setattr(gs, "SKINNY_GEMM_TABLE", {(8, 70, 96): SMALL, (64, 70, 96): SPLIT2})
    for rows in (3, 4, 5, 8, 9, 16, 33, 64):
        agree(layer, rows)
    agree(other, 8)  # another shape: not in the table
    assert calls == [(5, 96), (8, 96), (33, 96), (64, 96)]
    layer.skinny_gemm = False  # switched off: cuBLAS whatever the table says
    out, ref = agree(layer, 8)
    assert torch.equal(out, ref) and len(calls) == 4
    layer.skinny_gemm = True
    layer.float()  # float32 layers stay on F.linear
    layer(x[:8].float())
    layer(x[:8].float().unsqueeze(0))  # [1, rows, in]: not a 2-d batch of rows
    assert len(calls) == 4


@interp
def test_interp_benchmark_smoke(tmp_path):
    # bench_skinny_gemm --small: tiny shapes, each launch shape checked against F.linear, JSON written,
    # and --table-from reads it back
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "bench_skinny_gemm.py"
    out = tmp_path / "skinny.json"
    flags = ["--rows", "16", "--block-n", "32", "--block-k", "64", "--split", "1,2", "--warps", "4",
             "--stages", "3", "--refine", "1"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(script), "--small", *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {(r["shape"], r["rows"]) for r in result["rows"]} == {
        (s, m) for s in ("qkv", "o", "gate_up", "down", "lm_head") for m in (16,)
    }
    assert all(r["best"] in r["triton"] for r in result["rows"])
    assert [t["rows"] for t in result["step_totals"]] == [16]
    proc = subprocess.run([sys.executable, str(script), "--table-from", str(out), "--min-gain", "-1"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.count("(32, 64, 1, 4, 3)") == 5, proc.stdout


@interp
@pytest.mark.parametrize("m", [3, 16, 17])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (64, 256)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [SMALL, SPLIT2], ids=["split1", "split2"])
def test_interp_glu_is_the_product_then_silu_and_mul(m, n, k, bias, config):
    from thinkspec.layers.fused_triton import silu_and_mul

    x, w, b = _operands(m, 2 * n, k, bias)
    w = w * 3  # gates across SiLU's bend
    fused = skinny_gemm(x, w, b, config=config, glu=True)
    assert fused.shape == (m, n) and fused.dtype == x.dtype
    # never split (SiLU needs whole sums): the same bits as the unsplit product, then silu_and_mul
    unsplit = config[:2] + (1,) + config[3:]
    assert torch.equal(fused, silu_and_mul(skinny_gemm(x, w, b, config=unsplit)))
    gate, up = F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype).chunk(2, -1)
    ref = F.silu(gate) * up
    torch.testing.assert_close(fused.float(), ref.float(), rtol=0.02, atol=0.02 * ref.abs().max().item())


@interp
def test_interp_writes_into_a_float32_out():
    x, w, _ = _operands(16, 70, 200, False)
    out = torch.full((16, 70), float("nan"))
    for config in (SMALL, SPLIT2):
        assert skinny_gemm(x, w, config=config, out=out) is out
        # the float32 sums themselves, not rounded to bf16
        torch.testing.assert_close(out, _reference(x, w, None), rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, out.bfloat16().float())
    with pytest.raises(ValueError, match="N even"):
        skinny_gemm(x, w[:69], glu=True)


@interp
def test_interp_merged_linear_fuses_silu_where_a_kernel_takes_it(monkeypatch):
    from thinkspec.layers import gemv_triton
    from thinkspec.layers.fused_triton import silu_and_mul

    calls = []

    def spy(name, real):
        return lambda *a, **kw: calls.append((name, kw)) or real(*a, **kw)

    monkeypatch.setattr(gemv_triton, "gemv", spy("gemv", gemv_triton.gemv))
    monkeypatch.setattr(gs, "skinny_gemm", spy("skinny", gs.skinny_gemm))
    monkeypatch.setattr(gs, "SKINNY_GLU_TABLE", {(16, 40, 96): SMALL})
    monkeypatch.setattr(gs, "SKINNY_GEMM_TABLE", {})
    layer = linear.MergedLinear(96, {"gate": 40, "up": 40}, bias=True).to(torch.bfloat16)
    layer.gemv = layer.skinny_gemm = True
    x = torch.randn(16, 96).to(torch.bfloat16)

    def unfused(rows):
        return silu_and_mul(F.linear(x[:rows], layer.weight, layer.bias))

    for rows, kernel in ((1, "gemv"), (2, "gemv"), (16, "skinny"), (9, "skinny")):
        calls.clear()
        out = layer.silu_and_mul(x[:rows])
        assert [(c, kw["glu"]) for c, kw in calls] == [(kernel, True)]  # one launch
        torch.testing.assert_close(out.float(), unfused(rows).float(), rtol=0.02, atol=0.02)
    calls.clear()
    out = layer.silu_and_mul(x[:4])  # bucket 4: not in the GLU table -> cuBLAS, then silu_and_mul
    assert calls == [] and torch.equal(out, unfused(4))
    three = linear.MergedLinear(96, {"q": 8, "k": 8, "v": 8}, bias=False)
    with pytest.raises(ValueError, match="two equal shards"):
        three.silu_and_mul(x.float())


def _norm_operands(m: int, n: int, seed: int = 1):
    # residual [m, n] and norm weight [n] in bf16, the weight spread around 1 as trained ones are
    g = torch.Generator().manual_seed(seed + m + n)
    residual = (3 * torch.randn(m, n, generator=g)).bfloat16()
    return residual, (1 + 0.2 * torch.randn(n, generator=g)).bfloat16()


@interp
@pytest.mark.parametrize(("m", "n", "k"), [(3, 37, 100), (16, 64, 256), (17, 200, 130)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [SMALL, SPLIT2, SPLIT3], ids=["split1", "split2", "split3"])
def test_interp_rms_norm_in_the_sum_launch_is_the_two_launches(monkeypatch, m, n, k, bias, config):
    from thinkspec.layers.fused_triton import rms_norm

    x, w, b = _operands(m, n, k, bias)
    residual, norm_w = _norm_operands(m, n)
    two = rms_norm(skinny_gemm(x, w, b, config=config), norm_w, 1e-6, residual)
    calls = []
    monkeypatch.setattr(gs, "rms_norm", lambda *a: calls.append(1) or rms_norm(*a))
    normed, stream = gs.skinny_gemm_rms_norm(x, w, b, residual, norm_w, 1e-6, config=config)
    assert torch.equal(stream, two[1]) and torch.equal(normed, two[0])  # bit for bit
    assert calls == ([1] if config == SMALL else [])  # the norm's own launch only when K is not split
    # and the formula itself: s = bf16(x @ w.T + b) + residual, weight * bf16(s * rsqrt(mean(s^2) + eps))
    h = _reference(x, w, b)
    sf = (h.bfloat16().float() + residual.float()).bfloat16().float()
    # the product's rounding and the sum's, each an ulp at most (and the product's float32 sum order)
    assert ((stream.float() - sf).abs() <= (h.abs() + sf.abs()) * 2**-7 + 1e-3).all()
    ref = norm_w.float() * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
    torch.testing.assert_close(normed.float(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item())


@interp
def test_interp_rms_norm_in_the_sum_launch_rejects_bad_operands():
    x, w, _ = _operands(8, 64, 128, False)
    residual, norm_w = _norm_operands(8, 64)
    with pytest.raises(ValueError, match="residual"):
        gs.skinny_gemm_rms_norm(x, w, None, residual[:, :32], norm_w, 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        gs.skinny_gemm_rms_norm(x, w, None, residual.float(), norm_w, 1e-6)


@interp
def test_interp_row_parallel_linear_adds_and_norms_in_the_sum_launch(monkeypatch):
    from thinkspec.distributed.parallel_state import TPLayout
    from thinkspec.layers.norm import RMSNorm

    calls = []
    real = gs.skinny_gemm_rms_norm
    monkeypatch.setattr(gs, "skinny_gemm_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(gs, "SKINNY_GEMM_TABLE", {(16, 64, 256): SPLIT2})
    layer = linear.RowParallelLinear(256, 64, bias=True, tp=TPLayout()).to(torch.bfloat16)
    norm = RMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_norm_operands(1, 64)[1])
    x = torch.randn(16, 256).bfloat16()
    residual = _norm_operands(16, 64)[0]
    for fused in (False, True):  # the torch path, then the kernels (norm.fused decides the fusion)
        layer.skinny_gemm = norm.fused = fused
        with torch.no_grad():
            out = layer.add_rms_norm(x, residual, norm)
            ref = norm(layer(x), residual)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
        assert len(calls) == int(fused)
    with torch.no_grad():
        layer.add_rms_norm(x[:4], residual[:4], norm)  # bucket 4: not in the table, cuBLAS and the norm
    assert len(calls) == 1


@interp
def test_interp_decoder_runs_each_norm_in_the_sum_launch_before_it(monkeypatch):
    # a tiny Qwen3 whose o_proj and down_proj split K on the skinny GEMM at 16 rows: the model's hidden
    # states are those of the same kernels with the norms as their own launches, bit for bit
    from checkpoints import tiny_checkpoint

    from thinkspec.layers.forward_context import AttentionMetadata, forward_context
    from thinkspec.models.loader import load_model

    model, _ = load_model(tiny_checkpoint("qwen3", tied=False))
    model.to(torch.bfloat16)
    cfg = model.config
    o, down = model.model.layers[0].self_attn.o_proj, model.model.layers[0].mlp.down_proj
    table = {(16, cfg.hidden_size, o.in_features): SPLIT2, (16, cfg.hidden_size, down.in_features): SPLIT2}
    monkeypatch.setattr(gs, "SKINNY_GEMM_TABLE", table)
    model.set_fused_kernels(True)
    t = 16
    ids, positions = torch.arange(10, 10 + t), torch.arange(t)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32), slot_mapping=torch.full((t,), -1),
        block_tables=torch.full((1, 1), -1, dtype=torch.int32),
        max_query_len=t, max_seq_len=t,
    )  # fmt: skip
    calls = []
    real = gs.skinny_gemm_rms_norm
    monkeypatch.setattr(gs, "skinny_gemm_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad(), forward_context(meta):
        fused = model(ids, positions)
        assert len(calls) == 2 * cfg.num_hidden_layers  # every norm but the first layer's input norm
        monkeypatch.setattr(
            linear.RowParallelLinear, "add_rms_norm", lambda self, x, residual, norm: norm(self(x), residual)
        )
        assert torch.equal(fused, model(ids, positions))


@interp
def test_interp_paged_model_runs_the_norms_in_the_sum_launches(monkeypatch):
    # a tiny bf16 Qwen3 over a paged KV pool whose o and down products split K at 4 and 32 rows: logits
    # over a prefill (with padding rows), a decode and a verify step equal those with the norms as their
    # own launches, bit for bit
    from checkpoints import PagedHarness, tiny_checkpoint

    from thinkspec.models.loader import load_model

    model, _ = load_model(tiny_checkpoint("qwen3", tied=False))
    model.to(torch.bfloat16)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden = model.config.hidden_size
    shapes = [(hidden, attn.o_proj.in_features), (hidden, mlp.down_proj.in_features)]
    table = {(rows, n, k): cfg for rows, cfg in ((4, SPLIT2), (32, SPLIT3)) for n, k in shapes}
    monkeypatch.setattr(gs, "SKINNY_GEMM_TABLE", table)
    calls = []
    real = gs.skinny_gemm_rms_norm
    monkeypatch.setattr(gs, "skinny_gemm_rms_norm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    steps = [[(0, list(range(20, 33))), (1, [5, 6, 7])], [(0, [40]), (1, [41])], [(1, [42, 43, 44])]]

    def logits():
        model.set_fused_kernels(True)
        h = PagedHarness(model, num_blocks=16, block_size=4, seed=1)
        with torch.no_grad():
            return [h.step(batch, pad_rows=2 if i == 0 else 0) for i, batch in enumerate(steps)]

    fused = logits()
    assert len(calls) == 2 * 2 * model.config.num_hidden_layers  # the 18- and 3-row steps
    monkeypatch.setattr(
        linear.RowParallelLinear, "add_rms_norm", lambda self, x, residual, norm: norm(self(x), residual)
    )
    for a, b in zip(fused, logits()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- GPU cases (real sizes)

# The launch shapes the GPU cases fix beside the tables' (config None), and their row counts:
# test_kernels_compile checks on the CPU that each fits the H200's shared memory at those rows
GPU_ROWS = (3, 16, 64)
GPU_SHAPES = ((64, 128, 1, 4, 4), (32, 256, 4, 4, 3))
GPU_GLU_SHAPES = ((32, 128, 1, 4, 4), (64, 128, 1, 4, 3))
GPU_NORM_ROWS = (4, 8, 16, 64)
GPU_NORM_SHAPES = ((64, 128, 2, 4, 5), (32, 256, 4, 4, 3))


@gpu
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), *DRAFT_SHAPES]
)
@pytest.mark.parametrize("m", GPU_ROWS)
def test_gpu_matches_cublas_at_model_shapes(n, k, m):
    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for config in (None, *GPU_SHAPES):
        out = skinny_gemm(x, w, b, config=config)
        assert ((out.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all()
        assert (out == ref.bfloat16()).float().mean().item() > 0.99


@gpu
@torch.inference_mode()
@pytest.mark.parametrize("split", [1, 4])
def test_gpu_replays_in_a_cuda_graph(split):
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    config = (64, 128, split, 4, 4)
    eager = skinny_gemm(x, w, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_gemm(x, w, config=config)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(captured, eager)
    assert torch.equal(captured, skinny_gemm(x, w, config=config))


@gpu
@pytest.mark.parametrize("m", GPU_ROWS)
@pytest.mark.parametrize("config", [None, *GPU_GLU_SHAPES])
@pytest.mark.parametrize(("inter", "hidden"), [(12288, 4096), (3072, 1024)])
def test_gpu_glu_matches_the_two_launches(m, config, inter, hidden):
    # Qwen3-8B's gate_up (2 x 12288 rows) and Qwen3-0.6B's (2 x 3072) with SiLU(gate) * up in the
    # epilogue, against the unfused product at the same launch shape followed by silu_and_mul
    from thinkspec.layers.fused_triton import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * inter, hidden, device="cuda", generator=g) * 0.05).bfloat16()
    b = torch.randn(2 * inter, device="cuda", generator=g).bfloat16()
    cfg = config or gs.skinny_gemm_config(m, inter, hidden, glu=True)
    fused = skinny_gemm(x, w, b, config=config, glu=True)
    two = silu_and_mul(skinny_gemm(x, w, b, config=cfg))
    err = (fused.float() - two.float()).abs()
    assert (err <= two.float().abs() * 2**-7 + 1e-6).all()
    assert (fused == two).float().mean().item() > 0.999


@gpu
@torch.inference_mode()
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 12288), (1024, 2048), (1024, 3072)])
@pytest.mark.parametrize("m", GPU_NORM_ROWS)
def test_gpu_rms_norm_in_the_sum_launch_is_the_two_launches(n, k, m):
    # Qwen3-8B's and Qwen3-0.6B's o and down with the residual add + RMSNorm after them, at the launch
    # shapes the tables give (split or not): the same bits as the product, then fused_triton.rms_norm
    from thinkspec.layers.fused_triton import rms_norm

    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    residual = (4 * torch.randn(m, n, device="cuda", generator=g)).bfloat16()
    norm_w = (1 + 0.2 * torch.randn(n, device="cuda", generator=g)).bfloat16()
    for config in (None, *GPU_NORM_SHAPES):
        normed, stream = gs.skinny_gemm_rms_norm(x, w, None, residual, norm_w, 1e-6, config=config)
        two = rms_norm(skinny_gemm(x, w, config=config), norm_w, 1e-6, residual)
        assert torch.equal(stream, two[1]) and torch.equal(normed, two[0])


@gpu
@torch.inference_mode()
def test_gpu_logits_in_float32_straight_from_the_product():
    # Linear.product into a float32 buffer, at the verify's 320 rows (cuBLAS, float32 output) and the
    # decode's 64 and 16 (skinny GEMM, table entries): the float32 sums, not bf16-rounded values
    lm_head = linear.Linear(4096, 151936, bias=False).to("cuda", torch.bfloat16)
    lm_head.gemv = lm_head.skinny_gemm = True
    for rows in (320, 64, 16, 1):
        x = torch.randn(rows, 4096, device="cuda").bfloat16()
        out = torch.empty(rows, 151936, device="cuda")
        assert lm_head.product(x, None, out=out) is out
        ref = F.linear(x.float(), lm_head.weight.float())
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert (out != out.bfloat16().float()).float().mean().item() > 0.9  # not rounded to bf16
