"""thinkspec model code against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from checkpoints import LLAMA3_ROPE, PagedHarness, hf_logits, tiny_checkpoint

from thinkspec.layers.attention import Attention
from thinkspec.models import load_model

ARCHS = ["qwen3", "qwen2", "llama"]
RTOL = 1e-4


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    # error relative to the scale of the reference logits
    assert out.shape == ref.shape
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3g} exceeds {rtol} x {scale:.3g}"


def random_ids(n: int, seed: int, vocab: int = 261) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(arch: str, tied: bool) -> None:
    path = tiny_checkpoint(arch, tied=tied)
    model, info = load_model(path)
    assert info.tie_word_embeddings is tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    ids = random_ids(40, seed=1)
    ref = hf_logits(path, ids)
    out = PagedHarness(model).step([(0, ids)])
    assert out.dtype == torch.float32
    assert_close_rel(out, ref)
    # a meaningful comparison: the tiny model's logits are far from uniform
    assert ref.std(dim=-1).min() > 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_logits_into_a_buffer(dtype: torch.dtype) -> None:
    # CUDA graphs have compute_logits write into their static float32 buffer: the same values as a
    # new tensor, every row of the given view written, nothing around it
    model, _ = load_model(tiny_checkpoint("qwen3", tied=False), dtype=dtype)
    hidden = torch.randn(5, model.config.hidden_size).to(dtype)
    want = model.compute_logits(hidden)
    assert want.dtype == torch.float32
    buf = torch.full((8, model.config.vocab_size), float("nan"))
    got = model.compute_logits(hidden, out=buf[1:6])
    assert got.data_ptr() == buf[1:6].data_ptr()
    assert torch.equal(buf[1:6], want)
    assert buf[0].isnan().all() and buf[6:].isnan().all()


def test_llama3_rope_scaling_beyond_original_context() -> None:
    path = tiny_checkpoint("llama", tied=False, rope_scaling=LLAMA3_ROPE)
    plain = tiny_checkpoint("llama", tied=False)
    model, _ = load_model(path)
    ids = random_ids(3 * LLAMA3_ROPE["original_max_position_embeddings"], seed=2)
    ref = hf_logits(path, ids)
    out = PagedHarness(model).step([(0, ids)])
    assert_close_rel(out, ref)
    # same weights without scaling give different logits, so the scaling was exercised
    assert (hf_logits(plain, ids) - ref).abs().max() > 1e-2


def test_linear_rope_scaling() -> None:
    path = tiny_checkpoint("qwen2", tied=False, rope_scaling={"rope_type": "linear", "factor": 4.0})
    model, _ = load_model(path)
    ids = random_ids(50, seed=3)
    assert_close_rel(PagedHarness(model).step([(0, ids)]), hf_logits(path, ids))


def test_yarn_rope_scaling() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = tiny_checkpoint("qwen3", tied=True, rope_scaling=yarn)
    model, _ = load_model(path)
    ids = random_ids(90, seed=19)
    ref = hf_logits(path, ids)
    assert_close_rel(PagedHarness(model).step([(0, ids)]), ref)
    assert (hf_logits(tiny_checkpoint("qwen3", tied=True), ids) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint(arch: str) -> None:
    path = tiny_checkpoint(arch, tied=False, sharded=True)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    model, _ = load_model(path)
    ids = random_ids(20, seed=4)
    assert_close_rel(PagedHarness(model).step([(0, ids)]), hf_logits(path, ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_one_forward(arch: str) -> None:
    path = tiny_checkpoint(arch, tied=arch == "qwen2")
    model, _ = load_model(path)
    seqs = {0: random_ids(7, seed=5), 1: random_ids(1, seed=6), 2: random_ids(23, seed=7)}
    out = PagedHarness(model, block_size=4).step(list(seqs.items()))
    row = 0
    for ids in seqs.values():
        assert_close_rel(out[row : row + len(ids)], hf_logits(path, ids))
        row += len(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_verification_and_rollback(arch: str) -> None:
    path = tiny_checkpoint(arch, tied=arch == "llama")
    model, _ = load_model(path)
    prompt, other = random_ids(37, seed=8), random_ids(30, seed=9)
    harness = PagedHarness(model, block_size=4, seed=1)
    # The prompt arrives in three chunks, interleaved with a second sequence's chunks.
    out_a = harness.step([(0, prompt[:10]), (1, other[:16])])
    out_b = harness.step([(1, other[16:]), (0, prompt[10:25])])
    out_c = harness.step([(0, prompt[25:])])
    ref = hf_logits(path, prompt)
    assert_close_rel(out_a[:10], ref[:10])
    assert_close_rel(out_b[14:], ref[10:25])
    assert_close_rel(out_c, ref[25:])
    assert_close_rel(out_a[10:], hf_logits(path, other[:16]))
    assert_close_rel(out_b[:14], hf_logits(path, other)[16:])
    # Verification: k+1 = 5 tokens for sequence 0 next to a decode step of sequence 1.
    drafts, nxt = random_ids(5, seed=10), random_ids(1, seed=11)
    out = harness.step([(0, drafts), (1, nxt)])
    assert_close_rel(out[:5], hf_logits(path, prompt + drafts)[37:])
    assert_close_rel(out[5:], hf_logits(path, other + nxt)[30:])
    # Rejection after two drafts: roll back and continue with other tokens over the stale slots.
    harness.truncate(0, 37 + 2)
    fresh = random_ids(4, seed=12)
    out = harness.step([(0, fresh)])
    assert_close_rel(out, hf_logits(path, prompt + drafts[:2] + fresh)[39:])


def test_block_tables_are_scattered_and_padding_is_not_written() -> None:
    path = tiny_checkpoint("qwen3", tied=False)
    model, _ = load_model(path)
    harness = PagedHarness(model, num_blocks=32, block_size=4, seed=3)
    seqs = [(0, random_ids(13, seed=13)), (1, random_ids(9, seed=14))]
    out = harness.step(seqs, pad_rows=3)
    blocks = harness.blocks[0] + harness.blocks[1]
    assert blocks != sorted(blocks) and max(blocks) - min(blocks) >= len(blocks)
    assert_close_rel(out[:13], hf_logits(path, seqs[0][1]))
    assert_close_rel(out[13:22], hf_logits(path, seqs[1][1]))
    assert torch.isfinite(out[22:]).all()
    # Exactly 13 + 9 slots were written in every layer; the cache started as NaN.
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        written = ~torch.isnan(layer.k_cache).flatten(2).any(-1)  # [num_blocks, block_size]
        assert int(written.sum()) == 22
        assert int((~torch.isnan(layer.v_cache).flatten(2).any(-1)).sum()) == 22


def test_bf16_on_cpu_greedy_matches_hf_where_not_tied() -> None:
    path = tiny_checkpoint("qwen3", tied=False)
    model, info = load_model(path, dtype="bfloat16")
    assert info.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.bfloat16
    ids = random_ids(64, seed=15)
    out = PagedHarness(model).step([(0, ids)])
    ref = hf_logits(path, ids, dtype=torch.bfloat16)
    assert_greedy_equal_with_margin(out, ref, margin=0.1)


def assert_greedy_equal_with_margin(out: torch.Tensor, ref: torch.Tensor, margin: float) -> None:
    # argmax must agree wherever the reference's top-2 gap exceeds `margin`
    top2 = ref.float().topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    assert clear.float().mean() > 0.5, "too few rows with a clear winner for a meaningful check"
    assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_fp32_matches_hf(arch: str) -> None:
    path = tiny_checkpoint(arch, tied=arch == "qwen2", rope_scaling=LLAMA3_ROPE if arch == "llama" else None)
    model, _ = load_model(path, dtype="float32", device="cuda")
    harness = PagedHarness(model, block_size=16)
    seqs = {0: random_ids(100, seed=16), 1: random_ids(3, seed=17)}
    out = harness.step(list(seqs.items()))
    assert_close_rel(out[:100], hf_logits(path, seqs[0], device="cuda"))
    assert_close_rel(out[100:], hf_logits(path, seqs[1], device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_bf16_greedy_matches_hf(arch: str) -> None:
    path = tiny_checkpoint(arch, tied=False, rope_scaling=LLAMA3_ROPE if arch == "llama" else None)
    model, info = load_model(path, dtype="bfloat16", device="cuda")
    ids = random_ids(200, seed=18)
    harness = PagedHarness(model, block_size=16)
    out = torch.cat([harness.step([(0, ids[:120])]), harness.step([(0, ids[120:])])])
    ref = hf_logits(path, ids, dtype=torch.bfloat16, device="cuda")
    assert_greedy_equal_with_margin(out, ref, margin=0.1)
