"""Fused Triton kernels (layers/fused_triton.py) against the torch code path they replace.

On CPU the kernels run under the Triton interpreter, in a child pytest that sets TRITON_INTERPRET=1
(`test_kernels_under_interpreter`); run them directly with
`TRITON_INTERPRET=1 pytest tests/test_fused_triton.py -k test_interp_`. float32 agrees to a few ulps
(only the order of the float32 sum of squares differs) and float16 to one rounding; bfloat16 gets a
few ulps under the interpreter, which truncates float32 -> bfloat16 casts where the GPU rounds to
nearest, and one rounding on the GPU. GPU cases (real sizes, kernel counts, CUDA graphs) are marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not importable")

from checkpoints import PagedHarness, tiny_checkpoint  # noqa: E402
from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.distributed.parallel_state import TPLayout  # noqa: E402
from thinkspec.layers import fused_triton  # noqa: E402
from thinkspec.layers.attention_torch import store_kvcache  # noqa: E402
from thinkspec.layers.forward_context import AttentionMetadata, forward_context  # noqa: E402
from thinkspec.layers.linear import Linear  # noqa: E402
from thinkspec.layers.norm import RMSNorm  # noqa: E402
from thinkspec.layers.rotary import RotaryEmbedding  # noqa: E402
from thinkspec.models.config import DecoderConfig  # noqa: E402
from thinkspec.models.decoder import DecoderAttention, DecoderLayer, DecoderMLP, set_fused_kernels  # noqa: E402
from thinkspec.models.loader import load_model  # noqa: E402

gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _check(out: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0) -> None:
    """out equals ref up to the float32 sum order (float32) or `ulps` roundings of the tensor's scale."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    eps = torch.finfo(out.dtype).eps
    scale = ref.float().abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulps * eps, atol=ulps * eps * scale)


def _ulps(dtype: torch.dtype, device: str = "cpu") -> float:
    # bfloat16 under the interpreter: each cast truncates (up to one ulp) and several compound
    return 4.0 if dtype == torch.bfloat16 and device == "cpu" else 1.0


def _norm(n: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu") -> RMSNorm:
    norm = RMSNorm(n, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.data = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dtype)
    return norm


def _randn(*shape: int, g: torch.Generator, dtype: torch.dtype, device: str = "cpu", std: float = 1.0):
    return (std * torch.randn(*shape, generator=g)).to(device, dtype)


def _qkv_views(t, hq, hkv, d, dtype, g, device="cpu"):
    # q [T, Hq, D], k [T, Hkv, D]: strided views into one merged qkv row, as DecoderAttention makes them
    qkv = _randn(t, (hq + 2 * hkv) * d, g=g, dtype=dtype, device=device, std=2.0)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d)


def _positions(t: int, max_positions: int, g: torch.Generator, device: str = "cpu") -> torch.Tensor:
    # random positions with both edges of the cos/sin cache present
    pos = torch.randint(0, max_positions, (t,), generator=g)
    pos[: min(t, 2)] = torch.tensor([max_positions - 1, 0])[: min(t, 2)]
    return pos.to(device)


# ---------------------------------------------------------------- torch path and host-side checks


def test_torch_residual_form_equals_plain_sum():
    # RMSNorm(x, residual) is (norm(x + residual), x + residual) bit for bit, in every dtype
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        norm = _norm(40, dtype, g)
        x, r = _randn(3, 40, g=g, dtype=dtype), _randn(3, 40, g=g, dtype=dtype)
        out, res = norm(x, r)
        assert torch.equal(res, r + x) and torch.equal(out, norm(r + x))


def test_decoder_layers_compute_the_unfused_formula_bit_for_bit():
    # the (x, residual) layer form is the pre-norm decoder x = x + attn(norm(x)); x = x + mlp(norm(x))
    model, _ = load_model(tiny_checkpoint("qwen3", tied=False))
    t = 7
    ids, positions = torch.arange(10, 10 + t), torch.arange(t)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32),
        slot_mapping=torch.full((t,), -1), block_tables=torch.full((1, 1), -1, dtype=torch.int32),
        max_query_len=t, max_seq_len=t,
    )  # fmt: skip
    with torch.no_grad(), forward_context(meta):
        hidden = model(ids, positions)
        x = model.model.embed_tokens(ids)
        for layer in model.model.layers:
            x = x + layer.self_attn(positions, layer.input_layernorm(x))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        assert torch.equal(hidden, model.model.norm(x))


def test_set_fused_kernels_switches_every_module():
    model, _ = load_model(tiny_checkpoint("qwen3", tied=False))
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, DecoderAttention, DecoderMLP))]
    assert len(switched) == 1 + 2 * (4 + 1 + 1)  # final norm; per layer 4 norms, attention, MLP
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 1 + 2 * 4  # lm_head; per layer qkv, o, gate_up, down
    assert not any(m.fused for m in switched) and not any(m.gemv or m.skinny_gemm for m in linears)
    model.set_fused_kernels(True)
    assert all(m.fused for m in switched) and all(m.gemv and m.skinny_gemm for m in linears)
    set_fused_kernels(model, False)
    assert not any(m.fused for m in switched) and not any(m.gemv or m.skinny_gemm for m in linears)


def test_wrappers_reject_bad_shapes():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"weight shape \(6,\) does not match hidden size 8"):
        fused_triton.rms_norm(x, torch.ones(6), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        fused_triton.rms_norm(x, torch.ones(8), 1e-6, torch.zeros(3, 8))
    q, k, cache = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(16, 2, 4)
    with pytest.raises(ValueError, match="pass both q_weight and k_weight, or neither"):
        fused_triton.qk_norm_rope(torch.zeros(2, dtype=torch.int64), q, k, cache, torch.ones(8))
    with pytest.raises(ValueError, match="does not fit head_dim 8"):
        fused_triton.qk_norm_rope(torch.zeros(2, dtype=torch.int64), q, k, torch.zeros(16, 2, 8))
    with pytest.raises(ValueError, match="disagree"):
        fused_triton.qk_norm_rope(torch.zeros(3, dtype=torch.int64), q, k, cache)
    with pytest.raises(ValueError, match="gate_up width 7 is odd"):
        fused_triton.silu_and_mul(torch.zeros(2, 7))


# ---------------------------------------------------------------- interpreter (CPU) cases


@interp
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("rows", "n"), [(1, 40), (5, 96), (0, 64), (3, 130)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_interp_rms_norm_matches_torch(dtype, rows, n, residual):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    norm = _norm(n, dtype, g)
    x = _randn(rows, n, g=g, dtype=dtype, std=2.0)
    if not residual:
        _check(fused_triton.rms_norm(x, norm.weight, norm.eps), norm(x), _ulps(dtype))
        return
    r = _randn(rows, n, g=g, dtype=dtype, std=2.0)
    out, res = fused_triton.rms_norm(x, norm.weight, norm.eps, r)
    ref_out, ref_res = norm(x, r)
    if dtype == torch.bfloat16:
        _check(res, ref_res, _ulps(dtype))
    else:
        assert res.dtype == dtype and torch.equal(res, ref_res)
    _check(out, ref_out, _ulps(dtype))


@interp
def test_interp_rms_norm_strided_rows_and_heads():
    g = torch.Generator().manual_seed(3)
    norm = _norm(40, torch.float32, g)
    wide = _randn(4, 100, g=g, dtype=torch.float32)
    x, r = wide[:, :40], wide[:, 50:90]  # row stride 100
    out, res = fused_triton.rms_norm(x, norm.weight, 1e-6, r)
    ref_out, ref_res = norm(x, r)
    assert torch.equal(res, ref_res) and out.is_contiguous()
    _check(out, ref_out)
    heads = _randn(3, 5, 40, g=g, dtype=torch.float16)  # [T, H, D] normalises each head
    _check(fused_triton.rms_norm(heads, norm.weight.half(), 1e-6), norm.half()(heads))
    mixed = _randn(3, 40, g=g, dtype=torch.float16)  # float32 weight: float32 out, as torch promotes
    _check(fused_triton.rms_norm(mixed, norm.weight.float(), 1e-6), norm.float()(mixed))


QK_CASES = [(1, 4, 4, 32), (3, 4, 1, 64), (5, 8, 2, 128), (0, 4, 2, 32), (2, 6, 2, 96), (70, 6, 2, 32)]


@interp
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), QK_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_interp_qk_norm_rope_matches_torch(dtype, t, hq, hkv, d, qk_norm):
    g = torch.Generator().manual_seed(t * 100 + hq * 10 + d)
    rotary = RotaryEmbedding(d, 64, 10000.0)
    q, k = _qkv_views(t, hq, hkv, d, dtype, g)
    pos = _positions(t, 64, g)
    if qk_norm:
        q_norm, k_norm = _norm(d, dtype, g), _norm(d, dtype, g)
        out_q, out_k = fused_triton.qk_norm_rope(
            pos, q, k, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, 1e-6
        )
        ref_q, ref_k = rotary(pos, q_norm(q), k_norm(k))
    else:
        out_q, out_k = fused_triton.qk_norm_rope(pos, q, k, rotary.cos_sin_cache)
        ref_q, ref_k = rotary(pos, q, k)
    assert out_q.shape == (t, hq, d) and out_k.shape == (t, hkv, d)
    if dtype != torch.bfloat16 and not qk_norm:  # same products, same roundings: bit for bit
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    _check(out_q, ref_q, _ulps(dtype))
    _check(out_k, ref_k, _ulps(dtype))


@interp
@pytest.mark.parametrize(
    ("t", "hq", "hkv", "d", "block_size"),
    # both block sizes on the one-head-per-program shapes; the 4-heads-per-program shape (t >= 64)
    # with block size 3, where its 70 slots span the most blocks
    [(1, 4, 4, 32, 16), (1, 4, 4, 32, 3), (5, 8, 2, 128, 16), (5, 8, 2, 128, 3), (70, 6, 2, 32, 3),
     (0, 4, 2, 32, 16), (0, 4, 2, 32, 3)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_qk_norm_rope_stores_kv(dtype, t, hq, hkv, d, block_size):
    # kv_store: q/k come out as without it, and the caches hold exactly what attention's KV store
    # writes from them (rotated k, v as given) at each slot; slot -1 rows and other slots untouched
    g = torch.Generator().manual_seed(t * 7 + d + block_size)
    rotary = RotaryEmbedding(d, 64, 10000.0)
    qkv = _randn(t, (hq + 2 * hkv) * d, g=g, dtype=dtype, std=2.0)
    q, k, v = (x.view(t, h, d) for x, h in zip(qkv.split([hq * d, hkv * d, hkv * d], dim=-1), (hq, hkv, hkv)))
    pos = _positions(t, 64, g)
    q_norm, k_norm = _norm(d, dtype, g), _norm(d, dtype, g)
    num_blocks = (t + 1) // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[::4] = -1  # padding rows: no slot
    k_cache = _randn(num_blocks, block_size, hkv, d, g=g, dtype=dtype)
    v_cache = _randn(num_blocks, block_size, hkv, d, g=g, dtype=dtype)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    args = (pos, q, k, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, 1e-6)
    ref_q, ref_k = fused_triton.qk_norm_rope(*args)
    store_kvcache(ref_k, v, ref_k_cache, ref_v_cache, slots)
    out_q, out_k = fused_triton.qk_norm_rope(*args, kv_store=(v, k_cache, v_cache, slots))
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)


def test_qk_norm_rope_kv_store_rejects_bad_shapes():
    q, k, v = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
    cache = torch.zeros(3, 16, 2, 8)
    cs = RotaryEmbedding(8, 16, 10000.0).cos_sin_cache
    pos, slots = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="kv_store: v"):
        fused_triton.qk_norm_rope(pos, q, k, cs, kv_store=(torch.zeros(2, 2, 4), cache, cache, slots))
    with pytest.raises(ValueError, match="kv_store: v"):
        fused_triton.qk_norm_rope(pos, q, k, cs, kv_store=(v, torch.zeros(3, 16, 4, 8), cache, slots))
    with pytest.raises(ValueError, match="kv_store: slot_mapping must be"):
        fused_triton.qk_norm_rope(pos, q, k, cs, kv_store=(v, cache, cache, slots[:1]))


@interp
@pytest.mark.parametrize(("t", "n"), [(1, 40), (4, 96), (0, 64), (3, 1500)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_interp_silu_and_mul_matches_torch(dtype, t, n):
    g = torch.Generator().manual_seed(t + n)
    wide = _randn(t, 2 * n + 8, g=g, dtype=dtype, std=3.0)
    gate_up = wide[:, : 2 * n]  # row stride 2n + 8
    gate, up = gate_up.split([n, n], dim=-1)
    _check(fused_triton.silu_and_mul(gate_up), F.silu(gate) * up, _ulps(dtype))


def _harness_logits(model, fused: bool) -> list[torch.Tensor]:
    # a prefill of two sequences with padding rows, then one decode and one 3-token verify step
    model.set_fused_kernels(fused)
    h = PagedHarness(model, num_blocks=16, block_size=4, seed=1)
    steps = [
        [(0, list(range(20, 33))), (1, [5, 6, 7])],
        [(0, [40]), (1, [41])],
        [(1, [42, 43, 44])],
    ]
    return [h.step(batch, pad_rows=2 if i == 0 else 0) for i, batch in enumerate(steps)]


@interp
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_interp_model_logits_fused_match_torch(arch):
    # qwen3: q/k norm; qwen2: biases and no q/k norm
    model, _ = load_model(tiny_checkpoint(arch, tied=False))
    ref = _harness_logits(model, fused=False)
    out = _harness_logits(model, fused=True)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# The engine-level check (greedy tokens with attention_backend="triton", which turns the fused
# kernels on in target and draft, equal the torch path's) is in test_attention_triton.py.


# ---------------------------------------------------------------- GPU cases (real sizes)


def _check_gpu(out: torch.Tensor, ref: torch.Tensor) -> None:
    # one rounding at most; in bfloat16 nearly every element bit for bit (a float32 ulp of difference
    # in the statistics moves a bfloat16 rounding only rarely; in float32 it moves most elements)
    _check(out, ref, 1.0)
    if out.numel() and out.dtype != torch.float32:
        assert (out == ref).float().mean().item() > 0.99


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    norm = _norm(4096, dtype, g, "cuda")
    for rows in (1, 7, 64):
        x = _randn(rows, 4096, g=g, dtype=dtype, device="cuda", std=2.0)
        r = _randn(rows, 4096, g=g, dtype=dtype, device="cuda", std=2.0)
        _check_gpu(fused_triton.rms_norm(x, norm.weight, 1e-6), norm(x))
        out, res = fused_triton.rms_norm(x, norm.weight, 1e-6, r)
        ref_out, ref_res = norm(x, r)
        assert torch.equal(res, ref_res)
        _check_gpu(out, ref_out)


@gpu
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_qk_norm_rope_matches_torch(dtype, qk_norm):
    g = torch.Generator().manual_seed(2)
    rotary = RotaryEmbedding(128, 40960, 1e6).to("cuda")
    q_norm, k_norm = _norm(128, dtype, g, "cuda"), _norm(128, dtype, g, "cuda")
    for t in (1, 16, 64):
        q, k = _qkv_views(t, 32, 8, 128, dtype, g, "cuda")
        pos = _positions(t, 40960, g, "cuda")
        if qk_norm:
            out = fused_triton.qk_norm_rope(
                pos, q, k, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, 1e-6
            )
            ref = rotary(pos, q_norm(q), k_norm(k))
        else:
            out = fused_triton.qk_norm_rope(pos, q, k, rotary.cos_sin_cache)
            ref = rotary(pos, q, k)
        for a, b in zip(out, ref):
            if qk_norm:
                _check_gpu(a, b)
            else:  # same products, same roundings, no FMA contraction: bit for bit
                assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_silu_and_mul_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    for t in (1, 64):
        gate_up = _randn(t, 2 * 12288, g=g, dtype=dtype, device="cuda", std=3.0)
        gate, up = gate_up.chunk(2, dim=-1)
        _check_gpu(fused_triton.silu_and_mul(gate_up), F.silu(gate) * up)


def _qwen3_8b_layer(t: int, dtype: torch.dtype = torch.bfloat16):
    """One Qwen3-8B-shaped decoder layer with random weights on CUDA, a Triton-attention KV cache and
    the inputs of a T-token step of one sequence with 100 cached tokens: (layer, positions, x, residual,
    meta)."""
    from thinkspec.layers.attention_triton import TritonAttentionBackend

    cfg = DecoderConfig.from_dict(
        {
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 1,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1024,
            "max_position_embeddings": 40960, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        },
        "Qwen3ForCausalLM",
    )  # fmt: skip
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
            layer = DecoderLayer(
                cfg, rotary, qkv_bias=False, o_bias=False, qk_norm=True, mlp_bias=False, tp=TPLayout()
            )
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g, device="cuda"))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device="cuda"))
    ctx, block_size, num_blocks = 100, 16, 16
    attn = layer.self_attn.attn
    shape = (num_blocks, block_size, 8, 128)
    attn.k_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    attn.v_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    attn.backend = TritonAttentionBackend()
    pos = torch.arange(ctx, ctx + t, device="cuda")
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([ctx + t], dtype=torch.int32, device="cuda"),
        slot_mapping=pos.clone(),  # blocks 0, 1, ... in order
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device="cuda")[None],
        max_query_len=t,
        max_seq_len=ctx + t,
    )
    x = (0.5 * torch.randn(t, 4096, generator=g, device="cuda")).to(dtype)
    residual = torch.randn(t, 4096, generator=g, device="cuda").to(dtype)
    return layer, pos, x, residual, meta


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cuda_kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@gpu
@torch.inference_mode()
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_qwen3_8b_layer_fused_launches_fewer_kernels_and_matches(t):
    # t = 1: the GEMV; t = 64: the skinny GEMM, whose o / down split K and run the norms after them
    layer, pos, x, residual, meta = _qwen3_8b_layer(t=t)
    next_norm = layer.input_layernorm  # any norm of the hidden size stands for the next layer's
    with forward_context(meta):
        run = lambda: layer(pos, x, residual, next_norm)
        ref = run()  # torch path (also warms up cuBLAS and the attention kernels)
        torch_names = _cuda_kernel_names(run)
        set_fused_kernels(layer, True)
        out = run()  # compiles the fused kernels
        fused_names = _cuda_kernel_names(run)
        for a, b in zip(out, ref):  # rare one-rounding flips, carried through the matmuls
            assert _relative_error(a, b) < 1e-2

        # one CUDA graph of the fused layer replays what it computes eagerly
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(pos, x, residual, next_norm)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(captured, out):
            assert _relative_error(a, b) < 1e-2

    print(f"kernels per layer: torch path {len(torch_names)}, fused {len(fused_names)}: {fused_names}")
    assert len(torch_names) >= 40, torch_names  # the profiler saw the unfused element-wise kernels
    assert len(fused_names) <= len(torch_names) - 40
    if t == 1:
        kernels = ("_rms_norm_kernel", "_rms_norm_kernel", "_qk_norm_rope_kernel", "_silu_and_mul_kernel")
    else:  # both norms in the split-K sum launches; SiLU * up in the gate/up product
        kernels = ("_split_k_sum_rms_norm_kernel", "_split_k_sum_rms_norm_kernel", "_qk_norm_rope_kernel")
        assert not any("_rms_norm_kernel" in n and "split" not in n for n in fused_names), fused_names
    for kernel in set(kernels):
        assert sum(kernel in n for n in fused_names) >= kernels.count(kernel), (kernel, fused_names)
    # no torch element-wise, reduction, cat or gather kernel is left but the attention output's fill
    aten = [n for n in fused_names if "at::native" in n and "Fill" not in n]
    assert not aten, aten
