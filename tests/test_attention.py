"""Torch reference attention backend against a dense float64 reference; rotary and RMSNorm units."""

from __future__ import annotations

import math

import pytest
import torch

from thinkspec.layers.attention import Attention
from thinkspec.layers.attention_torch import PaddedTorchAttentionBackend, TorchAttentionBackend, store_kvcache
from thinkspec.layers.forward_context import AttentionMetadata, forward_context
from thinkspec.layers.linear import MergedLinear
from thinkspec.layers.norm import RMSNorm
from thinkspec.layers.rotary import RotaryEmbedding, attention_factor, compute_inv_freq


def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [Lq, Hq, D] at the last Lq of keys/values: [L, Hkv, D] -> [Lq, Hq, D], float64 softmax
    qlen, seq_len, hq, hkv = q.shape[0], keys.shape[0], q.shape[1], keys.shape[1]
    out = torch.empty(qlen, hq, q.shape[2], dtype=torch.float64)
    for h in range(hq):
        kh = keys[:, h // (hq // hkv)].double()
        vh = values[:, h // (hq // hkv)].double()
        for j in range(qlen):
            visible = seq_len - qlen + j + 1
            s = (kh[:visible] @ q[j, h].double()) * scale
            out[j, h] = torch.softmax(s, 0) @ vh[:visible]
    return out


def make_case(
    spec: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    num_blocks: int,
    seed: int,
    pad: int = 0,
):
    """spec = [(cached_len, query_len), ...]; returns inputs, metadata, caches and per-sequence full K/V."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    free = torch.randperm(num_blocks, generator=g).tolist()
    qs, ks, vs, slots, starts, seq_lens, tables, full = [], [], [], [], [0], [], [], []
    for cached, qlen in spec:
        total = cached + qlen
        blocks = [free.pop() for _ in range(math.ceil(total / block_size))]
        keys, values = torch.randn(total, hkv, d, generator=g), torch.randn(total, hkv, d, generator=g)
        for pos in range(total):
            slot = blocks[pos // block_size] * block_size + pos % block_size
            if pos < cached:  # context from earlier steps is already in the cache
                k_cache.view(-1, hkv, d)[slot], v_cache.view(-1, hkv, d)[slot] = keys[pos], values[pos]
            else:
                slots.append(slot)
        qs.append(torch.randn(qlen, hq, d, generator=g))
        ks.append(keys[cached:])
        vs.append(values[cached:])
        starts.append(starts[-1] + qlen)
        seq_lens.append(total)
        tables.append(blocks)
        full.append((keys, values))
    width = max(len(t) for t in tables)
    qs.append(torch.randn(pad, hq, d, generator=g))
    ks.append(torch.randn(pad, hkv, d, generator=g))
    vs.append(torch.randn(pad, hkv, d, generator=g))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q for _, q in spec),
        max_seq_len=max(seq_lens),
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, full


CASES = {
    "decode": [(5, 1), (17, 1), (0, 1)],
    "prefill": [(0, 9), (0, 3)],
    "verify": [(11, 4), (3, 4), (30, 4)],
    "mixed": [(0, 13), (8, 1), (21, 5), (2, 7)],
    "empty-query": [(6, 0), (4, 3)],
}


@pytest.mark.parametrize("backend", [TorchAttentionBackend, PaddedTorchAttentionBackend])
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_dense_reference(
    case: str, hq: int, hkv: int, block_size: int, backend
) -> None:
    spec = CASES[case]
    d, scale = 8, 8**-0.5
    q, k, v, k_cache, v_cache, meta, full = make_case(
        spec, hq, hkv, d, block_size, 64, seed=list(CASES).index(case), pad=2
    )
    out = backend().forward(q, k, v, k_cache, v_cache, meta, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    start = 0
    for (_, qlen), (keys, values) in zip(spec, full):
        ref = dense_reference(q[start : start + qlen], keys, values, scale)
        torch.testing.assert_close(out[start : start + qlen].double(), ref, rtol=1e-5, atol=1e-5)
        start += qlen
    assert torch.equal(out[start:], torch.zeros_like(out[start:]))  # padding rows
    # every new token was stored; padding wrote nothing (the pool started as NaN)
    total_written = sum(c + ql for c, ql in spec)
    assert int((~torch.isnan(k_cache).flatten(2).any(-1)).sum()) == total_written
    assert int((~torch.isnan(v_cache).flatten(2).any(-1)).sum()) == total_written


def check_kv_stored_skips_the_store(backend, dtype=torch.float32) -> None:
    """With kv_stored=True the backend writes nothing and reads the new tokens from the cache: k/v
    stored beforehand (as a fused kernel would) and NaN k/v passed in give the stored path's output."""
    spec = [(5, 1), (0, 7), (19, 3)]
    q, k, v, k_cache, v_cache, meta, _ = make_case(spec, 4, 2, 16, 4, 32, seed=5, pad=2)
    q, k, v, k_cache, v_cache = (x.to(dtype) for x in (q, k, v, k_cache, v_cache))
    pre_k, pre_v = k_cache.clone(), v_cache.clone()
    ref = backend.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    store_kvcache(k, v, pre_k, pre_v, meta.slot_mapping)
    stored_k, stored_v = pre_k.clone(), pre_v.clone()
    nan = torch.full_like(k, float("nan"))
    out = backend.forward(q, nan, nan.clone(), pre_k, pre_v, meta, 0.25, kv_stored=True)
    assert torch.equal(out, ref)
    assert torch.equal(pre_k.nan_to_num(7.0), stored_k.nan_to_num(7.0))  # nothing written
    assert torch.equal(pre_v.nan_to_num(7.0), stored_v.nan_to_num(7.0))


@pytest.mark.parametrize("backend", [TorchAttentionBackend, PaddedTorchAttentionBackend])
def test_torch_backends_kv_stored_skips_the_store(backend) -> None:
    check_kv_stored_skips_the_store(backend())


def test_store_kvcache_writes_exact_slots() -> None:
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(1, 10, dtype=torch.float32).view(3, 1, 3)
    store_kvcache(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1, 0], k[0, 0]) and torch.equal(k_cache[0, 0, 0], k[2, 0])
    assert torch.equal(v_cache[2, 1, 0], -k[0, 0])
    assert int((k_cache != 0).any(-1).sum()) == 2  # the -1 row went nowhere (not the last slot)


def test_attention_module_without_cache_attends_to_prompt_only() -> None:
    # before the pool exists (profiling run), whole prompts attend to themselves
    spec = [(0, 6), (0, 2)]
    q, k, v, _, _, meta, full = make_case(spec, 4, 2, 8, 4, 16, seed=5)
    layer = Attention(4, 2, 8, 0.3)
    with forward_context(meta):
        out = layer(q, k, v)
    torch.testing.assert_close(out[:6].double(), dense_reference(q[:6], *full[0], 0.3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[6:].double(), dense_reference(q[6:], *full[1], 0.3), rtol=1e-5, atol=1e-5)
    meta.seq_lens[0] += 1  # a cached prefix cannot be read without a cache
    with forward_context(meta), pytest.raises(ValueError, match="without a KV cache"):
        layer(q, k, v)


def test_attention_errors() -> None:
    q, k, v, k_cache, v_cache, meta, _ = make_case([(0, 3)], 2, 2, 4, 4, 4, seed=6)
    meta.seq_lens[0] = 2
    with pytest.raises(ValueError, match="query_len=3 exceeds seq_len=2"):
        TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.5)
    with pytest.raises(RuntimeError, match="outside forward_context"):
        Attention(2, 2, 4, 0.5)(q, k, v)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads=3"):
        Attention(4, 3, 4, 0.5)


def test_backend_is_swappable() -> None:
    class Recording:
        def __init__(self) -> None:
            self.calls = 0

        def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_stored=False):
            self.calls += 1
            self.kv_stored = kv_stored
            return torch.zeros_like(q)

    q, k, v, k_cache, v_cache, meta, _ = make_case([(0, 3)], 2, 2, 4, 4, 4, seed=7)
    layer = Attention(2, 2, 4, 0.5)
    layer.backend = Recording()
    with forward_context(meta):
        layer(q, k, v)
    assert layer.backend.calls == 1 and layer.backend.kv_stored is False
    with forward_context(meta):
        layer(q, k, v, kv_stored=True)
    assert layer.backend.calls == 2 and layer.backend.kv_stored is True


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 3.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 100, "beta_fast": 16,
         "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
    ],
)  # fmt: skip
def test_inv_freq_matches_transformers(scaling: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling)
    if scaling is None:
        ref = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    else:
        ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        assert attention_factor(scaling) == pytest.approx(ref_factor, rel=1e-12)
    torch.testing.assert_close(compute_inv_freq(64, 500000.0, scaling), ref, rtol=1e-6, atol=0)


def test_rotary_matches_rotate_half_formula() -> None:
    rope = RotaryEmbedding(16, 300, 10000.0)
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    positions = torch.tensor([0, 1, 7, 150, 299])
    rq, rk = rope(positions, q, k)
    freqs = positions[:, None].float() * compute_inv_freq(16, 10000.0, None)[None]
    cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 8:], x[..., :8]), -1)

    torch.testing.assert_close(rq, q * cos + rotate_half(q) * sin, rtol=0, atol=1e-6)
    torch.testing.assert_close(rk, k * cos + rotate_half(k) * sin, rtol=0, atol=1e-6)
    assert torch.equal(rq[0], q[0])  # position 0 is the identity
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        RotaryEmbedding(7, 10, 10000.0)
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        compute_inv_freq(8, 1e4, {"rope_type": "dynamic", "factor": 2.0})


def test_rmsnorm_matches_formula_in_bf16() -> None:
    g = torch.Generator().manual_seed(9)
    norm = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=g))
    x = torch.randn(6, 32, generator=g) * 5
    torch.testing.assert_close(norm(x), norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = norm.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), norm.weight.float() * x / x.pow(2).mean(-1, keepdim=True).sqrt(),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


def test_merged_linear_shards() -> None:
    layer = MergedLinear(4, {"q": 6, "k": 2, "v": 2}, bias=True)
    assert layer.weight.shape == (10, 4)
    layer.shard_view("weight", "k").fill_(1.0)
    layer.shard_view("bias", "v").fill_(2.0)
    assert torch.equal(layer.weight[6:8], torch.ones(2, 4))
    assert torch.equal(layer.bias[8:], torch.full((2,), 2.0))
    q, k, v = layer.split(torch.zeros(3, 10))
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (6, 2, 2)
