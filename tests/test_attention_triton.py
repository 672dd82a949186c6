"""Triton paged-attention backend against the dense float64 reference and the torch backends.

On CPU the kernels run under the Triton interpreter. Triton reads TRITON_INTERPRET when a kernel is
decorated, so the interpreter cases run in a child pytest process that sets it
(`test_kernels_under_interpreter`); run them directly with
`TRITON_INTERPRET=1 pytest tests/test_attention_triton.py -k test_interp_`. GPU cases are marked `gpu`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from checkpoints import tiny_checkpoint  # noqa: E402
from test_attention import CASES, check_kv_stored_skips_the_store, dense_reference, make_case  # noqa: E402
from triton_interpreter import INTERPRETED, interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec import LLM, SamplingParams  # noqa: E402
from thinkspec.engine_args import EngineArgs  # noqa: E402
from thinkspec.layers.attention import Attention  # noqa: E402
from thinkspec.layers.attention_torch import PaddedTorchAttentionBackend, TorchAttentionBackend  # noqa: E402
from thinkspec.layers.attention_triton import TritonAttentionBackend  # noqa: E402
from thinkspec.layers.forward_context import AttentionMetadata, forward_context  # noqa: E402
from thinkspec.layers.norm import RMSNorm  # noqa: E402

gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _poisoned_empty_like(monkeypatch):
    """torch.empty_like gives NaN-filled tensors here, so rows the kernels never write show up."""
    full_like = torch.full_like

    def empty_like(x, **kwargs):
        if x.is_floating_point() and kwargs.get("dtype", x.dtype).is_floating_point:
            return full_like(x, float("nan"), **kwargs)
        return full_like(x, 0, **kwargs)

    monkeypatch.setattr(torch, "empty_like", empty_like)


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__)


def _check_case(spec, out, q, full, scale, k_cache, v_cache, tol):
    """Each sequence's rows match the float64 reference; padding rows are zero; only new tokens written."""
    assert out.shape == q.shape and out.dtype == q.dtype
    start = 0
    for (_, qlen), (keys, values) in zip(spec, full):
        ref = dense_reference(q[start : start + qlen].float(), keys, values, scale)
        torch.testing.assert_close(out[start : start + qlen].double(), ref, rtol=tol, atol=tol)
        start += qlen
    assert torch.equal(out[start:], torch.zeros_like(out[start:]))
    total_written = sum(c + ql for c, ql in spec)
    assert int((~torch.isnan(k_cache.float()).flatten(2).any(-1)).sum()) == total_written
    assert int((~torch.isnan(v_cache.float()).flatten(2).any(-1)).sum()) == total_written


# ---------------------------------------------------------------- host-side checks (no kernel launch)


def test_constructor_rejects_bad_settings():
    with pytest.raises(ValueError, match="block_n must be None or a power of two >= 16, got 24"):
        TritonAttentionBackend(block_n=24)
    with pytest.raises(ValueError, match="num_splits must be None or a power of two >= 1, got 3"):
        TritonAttentionBackend(num_splits=3)
    with pytest.raises(ValueError, match="max_splits must be a power of two >= 1, got 0"):
        TritonAttentionBackend(max_splits=0)
    with pytest.raises(ValueError, match="min_split_len must be an integer >= 1, got 0"):
        TritonAttentionBackend(min_split_len=0)
    with pytest.raises(ValueError, match="target_programs must be None or an integer >= 1, got 0"):
        TritonAttentionBackend(target_programs=0)
    with pytest.raises(ValueError, match="num_warps must be None or a power of two >= 1, got 3"):
        TritonAttentionBackend(num_warps=3)
    with pytest.raises(ValueError, match="num_stages must be None or an integer >= 1, got 0"):
        TritonAttentionBackend(num_stages=0)


def test_choose_splits_from_host_shape_only():
    cpu = torch.device("cpu")
    be = TritonAttentionBackend(target_programs=256, min_split_len=512, max_splits=32)
    assert be.choose_splits(programs=8, max_seq_len=8192, device=cpu) == 16  # few programs, long context
    assert be.choose_splits(programs=8, max_seq_len=2000, device=cpu) == 4  # capped by context length
    assert be.choose_splits(programs=8, max_seq_len=1024, device=cpu) == 2  # splits of >= 256 keys
    assert be.choose_splits(programs=8, max_seq_len=100, device=cpu) == 1  # short context: no split
    assert be.choose_splits(programs=512, max_seq_len=8192, device=cpu) == 1  # grid already full
    assert be.choose_splits(programs=1, max_seq_len=10**6, device=cpu) == 32  # max_splits
    assert be.choose_splits(programs=3, max_seq_len=10**6, device=cpu) == 32  # capped by max_splits
    assert TritonAttentionBackend(num_splits=4).choose_splits(10**4, 1, cpu) == 4  # forced


def test_engine_config_attention_backend_validation():
    msg = r"attention_backend must be one of \('auto', 'torch', 'triton'\), got 'flash'"
    with pytest.raises(ValueError, match=msg):
        EngineArgs(model="m", attention_backend="flash")
    if not INTERPRETED:
        with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
            EngineArgs(model="m", device="cpu", attention_backend="triton")
    assert EngineArgs(model="m").attention_backend == "auto"  # triton on CUDA, torch elsewhere


# ---------------------------------------------------------------- interpreter (CPU) cases


@interp
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize(("block_size", "hq", "hkv"), [(16, 4, 4), (32, 4, 2), (16, 8, 2), (3, 4, 1)])
@pytest.mark.parametrize("case", list(CASES))
def test_interp_matches_dense_reference(case, block_size, hq, hkv, splits):
    spec = CASES[case]
    d, scale = 8, 8**-0.5
    q, k, v, k_cache, v_cache, meta, full = make_case(
        spec, hq, hkv, d, block_size, 64, seed=10 + list(CASES).index(case), pad=3
    )
    backend = TritonAttentionBackend(block_n=16, num_splits=splits)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    _check_case(spec, out, q, full, scale, k_cache, v_cache, 1e-5)


@interp
@pytest.mark.parametrize("splits", [2, 4, 64])
def test_interp_fused_merge_equals_combine_launch(splits):
    # The last split program merging in-kernel gives the separate combine launch's rows (same sums in
    # split order), padding rows zero, and leaves every arrival counter at zero for the next launch.
    spec = [(100, 1), (0, 5), (37, 3), (64, 2)]
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, 8, 2, 16, 16, 24, seed=splits, pad=3)
    fused = TritonAttentionBackend(block_n=16, num_splits=splits)
    out = fused.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    again = fused.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    launch = TritonAttentionBackend(block_n=16, num_splits=splits, fused_combine=False)
    ref = launch.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    _check_case(spec, ref, q, full, 0.25, k_cache, v_cache, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(out, again) and torch.equal(out[-3:], torch.zeros_like(out[-3:]))
    assert len(fused._counters) == 1 and not fused._counters[0].any()
    assert not launch._counters  # the combine launch needs no counters


@interp
def test_interp_splits_follow_each_query_tiles_length():
    # With the fused merge each query tile uses one split per tile of its own keys, up to the grid's S:
    # a tile of keys that fits one tile is written by its one program, bit for bit the unsplit launch's
    # rows; longer ones give the combine launch's rows (the same chunks, without the empty splits); the
    # idle split programs leave no counter behind.
    spec = [(100, 1), (0, 5), (37, 3), (10, 2), (64, 2), (40, 12)]  # 7, 1, 3, 1, 5 tiles; 2 query tiles
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, 4, 2, 16, 16, 40, seed=3, pad=2)
    dyn = TritonAttentionBackend(block_n=16, num_splits=4)
    out = dyn.forward(q, k, v, k_cache, v_cache, meta, 0.25)
    _check_case(spec, out, q, full, 0.25, k_cache, v_cache, 1e-5)
    unsplit = TritonAttentionBackend(block_n=16, num_splits=1).forward(q, k, v, k_cache, v_cache, meta, 0.25)
    split = TritonAttentionBackend(block_n=16, num_splits=4, fused_combine=False).forward(
        q, k, v, k_cache, v_cache, meta, 0.25, kv_stored=True
    )
    block_q, start, kinds = 8, 0, set()  # 8 queries per tile: 16 rows / GROUP_PAD 2
    for cached, qlen in spec:
        for tile_start in range(0, qlen, block_q):
            rows = slice(start + tile_start, start + min(qlen, tile_start + block_q))
            tiles = -(-min(cached + qlen, cached + tile_start + block_q) // 16)
            kinds.add(tiles == 1)
            want = unsplit if tiles == 1 else split
            assert torch.equal(out[rows], want[rows]), (cached, qlen, tile_start)
        start += qlen
    assert kinds == {True, False}
    assert not dyn._counters[0].any()
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))


@interp
def test_interp_max_splits_with_empty_splits():
    # 64 splits over at most 7 tiles: most splits are empty and must weigh nothing
    spec = [(100, 1), (0, 5), (37, 3)]
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, 4, 2, 8, 16, 16, seed=5, pad=2)
    out = TritonAttentionBackend(block_n=16, num_splits=64).forward(q, k, v, k_cache, v_cache, meta, 8**-0.5)
    _check_case(spec, out, q, full, 8**-0.5, k_cache, v_cache, 1e-5)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interp_half_precision(dtype):
    spec = [(40, 1), (0, 23), (17, 5)]
    d, scale = 32, 32**-0.5
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, 8, 2, d, 16, 16, seed=3, pad=1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    full = [(kk.to(dtype), vv.to(dtype)) for kk, vv in full]  # the reference sees the rounded K/V
    out = TritonAttentionBackend(block_n=32, num_splits=2).forward(q, k, v, k_cache, v_cache, meta, scale)
    _check_case(spec, out, q, full, scale, k_cache, v_cache, 2e-2 if dtype == torch.bfloat16 else 5e-3)


def test_block_n_choice():
    # host ints only: 128-key tiles for 16-bit caches at >= 64 programs, except a decode grid that
    # already fills target_programs; 64 for fp32, prefill tiles of 64 rows, few programs, or when set
    be = TritonAttentionBackend(target_programs=264)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert be.choose_block_n(128, 1, 16, bf16, cpu) == 128  # decode, batch 16 x 8 KV heads
    assert be.choose_block_n(256, 1, 16, torch.float16, cpu) == 128
    assert be.choose_block_n(264, 1, 16, bf16, cpu) == 64  # decode grid already full (batch 33+)
    assert be.choose_block_n(512, 5, 32, bf16, cpu) == 128  # verify windows, batch 64
    assert be.choose_block_n(32, 5, 32, bf16, cpu) == 64  # batch 4: not measured with 128
    assert be.choose_block_n(128, 1, 16, torch.float32, cpu) == 64
    assert be.choose_block_n(128, 300, 64, bf16, cpu) == 64  # prefill tiles
    assert TritonAttentionBackend(block_n=32).choose_block_n(512, 5, 32, bf16, cpu) == 32


@interp
def test_interp_auto_block_n_128_matches_reference():
    # 16 sequences x 4 KV heads of 2-query windows: the shape-chosen 128-key tiles, bf16, over
    # contexts shorter and longer than one tile, through shuffled paged blocks
    spec = [(c, 2) for c in (0, 3, 17, 64, 100, 127, 128, 129, 150, 200, 255, 256, 257, 31, 90, 300)]
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, 8, 4, 16, 16, 16 * 24, seed=8, pad=1)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    full = [(kk.bfloat16(), vv.bfloat16()) for kk, vv in full]
    be = TritonAttentionBackend(target_programs=1024, num_splits=1)
    assert be.choose_block_n(16 * 4, 2, 16, torch.bfloat16, q.device) == 128
    out = be.forward(q, k, v, k_cache, v_cache, meta, 16**-0.5)
    _check_case(spec, out, q, full, 16**-0.5, k_cache, v_cache, 2e-2)


@interp
def test_interp_auto_split_long_context_matches_padded_torch():
    # few sequences, long contexts: the shape-chosen split is used and agrees with the torch backend
    spec = [(300, 1), (150, 4), (0, 1)]
    hq, hkv, d, bs = 4, 2, 16, 16
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, hq, hkv, d, bs, 40, seed=21, pad=2)
    be = TritonAttentionBackend(block_n=32, target_programs=64, min_split_len=32)
    assert be.choose_splits(3 * 1 * hkv, meta.max_seq_len, q.device) == 8
    out = be.forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    _check_case(spec, out, q, full, d**-0.5, k_cache, v_cache, 1e-5)
    ref = PaddedTorchAttentionBackend().forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@interp
@pytest.mark.parametrize("splits", [1, 2])
def test_interp_kv_stored_skips_the_store(splits):
    check_kv_stored_skips_the_store(TritonAttentionBackend(block_n=16, num_splits=splits))


@interp
def test_interp_no_tokens_and_no_pool():
    be = TritonAttentionBackend()
    empty = torch.zeros(0, 2, 8)
    meta = AttentionMetadata(
        query_start_loc=torch.zeros(1, dtype=torch.int32), seq_lens=torch.zeros(0, dtype=torch.int32),
        slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=torch.zeros(0, 1, dtype=torch.int32),
        max_query_len=0, max_seq_len=0,
    )  # fmt: skip
    cache = torch.full((4, 16, 2, 8), float("nan"))
    assert be.forward(empty, empty, empty, cache, cache.clone(), meta, 0.3).shape == (0, 2, 8)
    assert torch.isnan(cache).all()
    # before the pool exists (profiling run) whole prompts attend to themselves via the reference
    spec = [(0, 6), (0, 2)]
    q, k, v, _, _, meta, full = make_case(spec, 4, 2, 8, 4, 16, seed=5)
    out = be.forward(q, k, v, torch.empty(0), torch.empty(0), meta, 0.3)
    ref = TorchAttentionBackend().forward(q, k, v, torch.empty(0), torch.empty(0), meta, 0.3)
    torch.testing.assert_close(out, ref)


@interp
def test_interp_attention_module_and_shape_errors():
    spec = CASES["mixed"]
    q, k, v, k_cache, v_cache, meta, full = make_case(spec, 4, 2, 8, 16, 64, seed=8, pad=1)
    layer = Attention(4, 2, 8, 0.4)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    layer.backend = TritonAttentionBackend()
    with forward_context(meta):
        out = layer(q, k, v)
    _check_case(spec, out, q, full, 0.4, k_cache, v_cache, 1e-5)
    with pytest.raises(ValueError, match="does not match 2 kv heads x 8"):
        TritonAttentionBackend().forward(q, k, v, k_cache[..., :4], v_cache[..., :4], meta, 0.4)


def _narrow_checkpoint(arch: str):
    """Folder of a model narrower than the default tiny one: hidden 32, MLP 64, 2 query heads sharing
    1 KV head, of 8 (qwen3: unequal to hidden / heads, as in the default) or 16 (qwen2), vocabulary 64.
    Seeds whose greedy continuations of the test's prompts vary (a repeated token checks less)."""
    head_dim, seed = (8, 2) if arch == "qwen3" else (None, 0)
    return tiny_checkpoint(
        arch, tied=False, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
        head_dim=head_dim, vocab_size=64, tokenizer=False, seed=seed,
    )  # fmt: skip


@interp
@pytest.mark.parametrize(("arch", "speculative"), [("qwen3", False), ("qwen3", True), ("qwen2", True)])
def test_interp_llm_greedy_tokens_match_torch_backend(arch, speculative):
    # attention_backend="triton" means Triton attention and the fused decoder kernels, in the target
    # and the draft; greedy tokens equal the torch path's. The model is narrower than the default tiny
    # one because the interpreter's cost grows with the programs launched; the cases above cover the
    # kernels' shapes and masks one by one.
    path = str(_narrow_checkpoint(arch))
    # the 20-token prompt spans two KV blocks and is prefilled in two chunks, the second one batched
    # with the other request's first decode
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(10, 30))}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    spec = {"model": path, "num_speculative_tokens": 3} if speculative else None
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path, device="cpu", block_size=16, max_num_batched_tokens=16, skip_tokenizer_init=True,
            speculative_config=spec, attention_backend=backend,
        )  # fmt: skip
        engine = llm.llm_engine
        for model in [engine.model] + ([engine.draft_model] if speculative else []):
            layers = [m for m in model.modules() if isinstance(m, Attention)]
            assert all(isinstance(m.backend, TritonAttentionBackend) == (backend == "triton") for m in layers)
            assert all(m.fused == (backend == "triton") for m in model.modules() if isinstance(m, RMSNorm))
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"] and all(len(t) == 8 for t in tokens["torch"])


# ---------------------------------------------------------------- GPU cases (real sizes)


def _gpu_case(batch, ctx_lens, qlen, seed, block_size=16, hq=32, hkv=8, d=128, dtype=torch.bfloat16):
    """Random ragged bf16 batch on CUDA with a permuted pool; returns q, k, v, caches, meta."""
    g = torch.Generator().manual_seed(seed)
    total = [c + qlen for c in ctx_lens]
    need = [-(-t // block_size) for t in total]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=g)
    tables, slots, at = [], [], 0
    for b in range(batch):
        blocks = perm[at : at + need[b]]
        at += need[b]
        tables.append(blocks.tolist() + [-1] * (max(need) - need[b]))
        pos = torch.arange(ctx_lens[b], total[b])
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    dev = "cuda"
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dev, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dev, dtype)
    t = batch * qlen
    q = torch.randn(t, hq, d, generator=g).to(dev, dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dev, dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dev, dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, t + 1, qlen, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(total, dtype=torch.int32, device=dev),
        slot_mapping=torch.cat(slots).to(dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        max_query_len=qlen,
        max_seq_len=max(total),
    )
    return q, k, v, k_cache, v_cache, meta


@gpu
@pytest.mark.parametrize(
    ("batch", "max_ctx", "qlen"),
    [(1, 8192, 1), (4, 8192, 5), (16, 4096, 1), (64, 2048, 5), (64, 1024, 1), (2, 6000, 512), (8, 300, 17)],
)
def test_gpu_matches_torch_backend(batch, max_ctx, qlen):
    g = torch.Generator().manual_seed(batch * 7 + qlen)
    ctx = torch.randint(0, max_ctx, (batch,), generator=g).tolist()
    ctx[0] = max_ctx - qlen  # one sequence at the longest context
    q, k, v, k_cache, v_cache, meta = _gpu_case(batch, ctx, qlen, seed=batch + qlen)
    ref_cache = (k_cache.clone(), v_cache.clone())
    ref_be = PaddedTorchAttentionBackend() if qlen <= 16 else TorchAttentionBackend()
    ref = ref_be.forward(q.float(), k.float(), v.float(), *(c.float() for c in ref_cache), meta, 128**-0.5)
    for splits in (None, 1, 8, 64):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = TritonAttentionBackend(num_splits=splits).forward(q, k, v, kc, vc, meta, 128**-0.5)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=kc.device)
        written[meta.slot_mapping] = True
        for new, before, after in ((k, k_cache, kc), (v, v_cache, vc)):
            assert torch.equal(after.view(-1, 8, 128)[meta.slot_mapping], new)  # new tokens written
            assert torch.equal(after.view(-1, 8, 128)[~written], before.view(-1, 8, 128)[~written])


@gpu
@pytest.mark.parametrize(
    ("batch", "qlen", "splits", "max_ctx"),
    [(1, 1, None, 3000), (16, 1, None, 3000), (16, 5, 8, 3000), (4, 5, 32, 3000), (16, 1, None, 600),
     (16, 5, 8, 600)],
)  # fmt: skip
def test_gpu_fused_merge_is_race_free(batch, qlen, splits, max_ctx):
    # The in-kernel merge (the last split program of each sequence, query tile and KV head reads the
    # others' partials) against the separate combine launch, over many launches of one CUDA graph:
    # every replay gives the same rows, close to the combine launch's, and the counters end at zero.
    # max_ctx 600: sequences of one to a few key tiles (one tile: written without the merge).
    g = torch.Generator().manual_seed(batch + qlen + max_ctx)
    ctx = torch.randint(1, max_ctx, (batch,), generator=g).tolist()
    q, k, v, k_cache, v_cache, meta = _gpu_case(batch, ctx, qlen, seed=batch * 3 + qlen)
    meta.max_seq_len = 40960  # as the engine's graphs set it (max_model_len): the shape's own splits
    launch = TritonAttentionBackend(num_splits=splits, fused_combine=False)
    ref = launch.forward(q, k, v, k_cache, v_cache, meta, 128**-0.5)
    fused = TritonAttentionBackend(num_splits=splits)
    out = fused.forward(q, k, v, k_cache, v_cache, meta, 128**-0.5)  # warm-up: compile, counters
    programs = batch * 8  # one query tile per sequence (16 or 32 rows)
    assert fused.choose_splits(programs, meta.max_seq_len, q.device) > 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            out = fused.forward(q, k, v, k_cache, v_cache, meta, 128**-0.5, kv_stored=True)
    first = None
    for _ in range(25):  # 500 launches
        graph.replay()
        torch.cuda.synchronize()
        if first is None:
            first = out.clone()
        assert torch.equal(out, first)
    torch.testing.assert_close(first.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert not any(c.any() for c in fused._counters)


@gpu
@pytest.mark.parametrize("speculative", [False, True])
def test_gpu_llm_greedy_tokens_match_torch_backend(speculative):
    path = str(tiny_checkpoint("qwen3", tied=False))
    prompts = [{"prompt_token_ids": list(range(1, 1 + n))} for n in (5, 40, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    spec = {"model": path, "num_speculative_tokens": 3} if speculative else None
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, device="cuda", dtype="float32", skip_tokenizer_init=True, speculative_config=spec,
                  attention_backend=backend, kv_cache_memory=64 << 20)  # fmt: skip
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


@gpu
@pytest.mark.parametrize("fused_combine", [True, False])
def test_gpu_one_build_across_table_widths_and_token_counts(fused_combine):
    # Eager launches (the draft's catch-up, a closed batch's last steps) change the block-table
    # width with the longest sequence and the token (and sequence) count with the batch. After the
    # first launch the others must reuse its build: an int that turns 1 or a multiple of 16 would
    # otherwise build a variant in mid-run. (The split count is compiled in: another split count is
    # another build, kept so because a run-time one measured up to 4% slower, docs/BENCHMARKS.md.)
    # Cases: (batch, context, block-table width, padding rows).
    from thinkspec.engine.compiles import compile_count

    cases = ((3, 40, 5, 2), (1, 10, 1, 0), (16, 40, 16, 0), (4, 40, 17, 17), (2, 200, 32, 30))
    backend = TritonAttentionBackend(block_n=64, num_splits=2, fused_combine=fused_combine)

    def launch(batch: int, ctx: int, width: int, pad: int) -> None:
        q, k, v, k_cache, v_cache, meta = _gpu_case(batch, [ctx] * batch, 1, seed=batch * 31 + width)
        tables = meta.block_tables
        meta.block_tables = torch.cat([tables, tables.new_full((batch, width - tables.shape[1]), -1)], 1)
        assert meta.block_tables.stride(0) == width
        if pad:  # rows past the last sequence: zero out, no KV written
            q, k, v = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (q, k, v))
            meta.slot_mapping = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
        ref = TorchAttentionBackend().forward(
            q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, 128**-0.5
        )
        out = backend.forward(q, k, v, k_cache, v_cache, meta, 128**-0.5)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

    launch(*cases[0])  # builds (or finds) the kernels
    before = compile_count()
    assert before is not None
    for case in cases[1:]:  # widths 1 / 16 / 17 / 32, token counts 1 / 16 / 21 / 32
        launch(*case)
    assert compile_count() == before, "a launch built a new kernel variant"
