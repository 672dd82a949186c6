"""The fused MoE Triton kernels (layers/moe_triton.py) against the torch reference (layers/moe.py).

On CPU the kernels run under the Triton interpreter, in child pytests that set TRITON_INTERPRET=1
(`test_kernels_under_interpreter`); run them directly with
`TRITON_INTERPRET=1 pytest tests/test_moe_triton.py -k test_interp_`. Inputs are drawn afresh per case;
router logits are distinct per row (a permutation) so that top-k has no ties to break either way.
float32 agrees to the order of the float32 sums; bfloat16 to a few roundings of the output's scale
(the reference accumulates the experts in bfloat16, the kernel in float32).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.distributed.parallel_state import TPLayout  # noqa: E402
from thinkspec.layers import moe_triton  # noqa: E402
from thinkspec.layers.moe import SparseMoeBlock, moe_reference, route  # noqa: E402

gpu = pytest.mark.gpu


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _inputs(t: int, e: int, h: int, i: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    # x [T, H], gate_up [E, 2I, H], down [E, H, I], logits [T, E] with distinct values per row
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() * (4.0 / e)
    return [v.to(device, dtype) for v in (x, w13, w2, logits)]


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.numel() > 0
    scale = ref.float().abs().max().item()
    assert scale > 0
    tol = 1e-5 if out.dtype == torch.float32 else 4 * torch.finfo(out.dtype).eps
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"max abs error {err:.3g} exceeds {tol:.2g} x {scale:.3g}"


def _reference(x, w13, w2, logits, top_k, norm):
    weights, ids = route(logits, top_k, norm)
    return moe_reference(x, w13, w2, weights, ids)


# ---------------------------------------------------------------- CPU, no kernel launched


def test_bad_shapes_and_top_k_raise():
    x, w13, w2, logits = _inputs(3, 4, 16, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        moe_triton.fused_moe(x, w13, w2, logits, 5, True)
    with pytest.raises(ValueError, match=r"top_k=0 must be in \[1, num_experts=4\]"):
        moe_triton.route_topk(logits, 0, True)
    with pytest.raises(ValueError, match="fused_moe: mismatched shapes"):
        moe_triton.fused_moe(x, w13, w2[:, :, :4], logits, 2, True)


def test_block_rows_decode_form_up_to_8_tokens():
    assert [moe_triton.block_rows(t) for t in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert moe_triton.block_rows(9) == 16 and moe_triton.block_rows(1000) == 64


# ---------------------------------------------------------------- interpreter (CPU) cases


@interp
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("dtype", "top_k"), [(torch.float32, 2), (torch.bfloat16, 1), (torch.float32, 3)])
def test_interp_routing_matches_torch(dtype, top_k, norm):
    _, _, _, logits = _inputs(7, 6, 8, 8, dtype, seed=top_k)
    weights, ids = moe_triton.route_topk(logits, top_k, norm)
    want_w, want_ids = route(logits, top_k, norm)
    assert ids.shape == (7, top_k) and ids.dtype == torch.int32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


@interp
@pytest.mark.parametrize(
    ("t", "e", "top_k", "dtype"),
    [
        (1, 8, 2, torch.float32),  # decode form, one row per block
        (6, 8, 2, torch.bfloat16),  # decode form, 8-row blocks with padding rows
        (24, 8, 2, torch.float32),  # tl.dot form, 16-row blocks
        (20, 4, 1, torch.bfloat16),  # top-k = 1
    ],
)
def test_interp_fused_moe_matches_reference(t, e, top_k, dtype):
    x, w13, w2, logits = _inputs(t, e, 32, 48, dtype, seed=t + e)
    for norm in (True, False):
        _check(
            moe_triton.fused_moe(x, w13, w2, logits, top_k, norm), _reference(x, w13, w2, logits, top_k, norm)
        )


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_an_expert_with_no_tokens_and_all_tokens_to_one(dtype):
    x, w13, w2, logits = _inputs(18, 8, 32, 16, dtype, seed=3)
    logits[:, 3] = -30.0  # expert 3 is never chosen
    _, ids = route(logits, 2, True)
    assert not (ids == 3).any() and ids.unique().numel() > 2
    _check(moe_triton.fused_moe(x, w13, w2, logits, 2, True), _reference(x, w13, w2, logits, 2, True))
    logits[:, 5] = 30.0  # every token's first pick: 18 pairs, two 16-row blocks, 14 padding rows
    for top_k in (1, 2):
        _, ids = route(logits, top_k, True)
        assert (ids[:, 0] == 5).all()
        out = moe_triton.fused_moe(x, w13, w2, logits, top_k, False)
        _check(out, _reference(x, w13, w2, logits, top_k, False))


@interp
@pytest.mark.parametrize("t", [3, 40])
def test_interp_align_groups_pairs_by_expert_with_padding_rows(t):
    e, top_k = 6, 2
    _, _, _, logits = _inputs(t, e, 8, 8, torch.float32, seed=t)
    logits[:, 0] = -30.0  # expert 0 empty
    _, ids = moe_triton.route_topk(logits, top_k, False)
    block_m = moe_triton.block_rows(t)
    sorted_ids, block_end, max_blocks = moe_triton.align_by_expert(ids, e, block_m)
    pairs = ids.reshape(-1).long()
    assert sorted_ids.numel() == max_blocks * block_m
    start = 0
    for expert in range(e):
        end = int(block_end[expert]) * block_m
        rows = sorted_ids[start:end].long()
        want = (pairs == expert).nonzero().flatten()
        assert torch.equal(rows[: want.numel()], want)  # its pairs, in pair order
        assert (rows[want.numel() :] == pairs.numel()).all()  # then padding rows, fewer than a block
        assert 0 <= end - start - want.numel() < block_m or want.numel() == end - start == 0
        start = end
    assert int(block_end[0]) == 0 and start <= sorted_ids.numel()  # rows past `start` are never read
    if t <= moe_triton.DECODE_MAX_ROWS:  # decode form: one block per selected expert, none spare
        assert max_blocks == min(e, t * top_k)
        assert int(block_end[-1]) == pairs.unique().numel()


@interp
def test_interp_block_fused_path_equals_torch_path_with_zero_padding_rows():
    # a CUDA-graph bucket pads the batch with rows of zeros; they are routed and computed like any row
    block = SparseMoeBlock(
        32,
        num_experts=8,
        top_k=2,
        intermediate=16,
        norm_topk_prob=False,
        shared_intermediate=24,
        tp=TPLayout(),
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    x = torch.randn(5, 32, generator=g)
    x[3:] = 0.0
    want = block(x)
    block.fused = True
    _check(block(x), want)


@interp
@pytest.mark.parametrize(("t", "real"), [(8, 5), (24, 17)])
def test_interp_graph_padding_rows_read_no_expert_and_the_counter_counts_experts_read(t, real):
    # a CUDA graph's bucket: rows from `real` on are padding (query_start_loc[-1] = real)
    x, w13, w2, logits = _inputs(t, 8, 32, 16, torch.float32, seed=t)
    logits[real:, 6], logits[:real, 6] = 30.0, -30.0  # only padding rows would pick expert 6
    counter = torch.full((1,), 3, dtype=torch.int32)
    num_valid = torch.tensor([real], dtype=torch.int32)
    out = moe_triton.fused_moe(x, w13, w2, logits, 2, True, num_valid, counter)
    _check(out[:real], _reference(x[:real], w13, w2, logits[:real], 2, True))
    assert (out[real:] == 0).all()
    _, ids = route(logits[:real], 2, True)
    assert 6 not in ids and int(counter) == 3 + ids.unique().numel()
    moe_triton.fused_moe(x, w13, w2, logits, 2, True, None, counter)  # every row real: 6 is read too
    _, ids_all = route(logits, 2, True)
    assert 6 in ids_all and int(counter) == 3 + ids.unique().numel() + ids_all.unique().numel()


@interp
def test_interp_model_with_fused_experts_equals_torch_path_and_skips_padding_rows():
    from checkpoints import PagedHarness
    from moe_checkpoints import moe_checkpoint

    from thinkspec.models import load_model

    model, _ = load_model(moe_checkpoint(mlp_only_layers=(1,)))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2
    torch_count, fused_count = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    for m in blocks:
        m.expert_counter = torch_count
    batch = [(0, [72, 105, 33]), (1, [65])]
    want = PagedHarness(model).step(batch)
    for m in blocks:
        m.fused, m.expert_counter = True, fused_count
    got = PagedHarness(model).step(batch, pad_rows=4)
    assert got.shape == (8, want.shape[1])
    torch.testing.assert_close(got[:4], want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # the same experts read: none for the padding rows (4 real rows x top-2 leave some of the 8 unread)
    assert 0 < int(fused_count) == int(torch_count) < 2 * 8


# ---------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("t", [1, 4, 8, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_moe_matches_reference_at_qwen3_30b_a3b_shape(t, dtype):
    x, w13, w2, logits = _inputs(t, 128, 2048, 768, dtype, seed=t, device="cuda")
    _check(moe_triton.fused_moe(x, w13, w2, logits, 8, True), _reference(x, w13, w2, logits, 8, True))


@gpu
def test_gpu_fused_moe_replays_in_a_cuda_graph():
    x, w13, w2, logits = _inputs(8, 128, 512, 256, torch.bfloat16, seed=1, device="cuda")
    moe_triton.fused_moe(x, w13, w2, logits, 8, True)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = moe_triton.fused_moe(x, w13, w2, logits, 8, True)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (2, 3):
        x2, _, _, logits2 = _inputs(8, 128, 512, 256, torch.bfloat16, seed=seed, device="cuda")
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        _check(out, _reference(x, w13, w2, logits, 8, True))
