"""Programmatic dependent launch (layers/pdl.py): when it is used, and on the GPU that CUDA graphs of
whole model steps give the same bits with PDL as without, replay after replay."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from thinkspec.engine.block_manager import BlockManager  # noqa: E402
from thinkspec.engine.cuda_graph import GraphSpec, graph_batch_sizes  # noqa: E402
from thinkspec.engine.model_runner import ModelRunner, use_triton_kernels  # noqa: E402
from thinkspec.engine.sequence import Sequence  # noqa: E402
from thinkspec.layers import pdl  # noqa: E402
from thinkspec.models.loader import load_model  # noqa: E402
from thinkspec.sampling_params import SamplingParams  # noqa: E402

gpu = pytest.mark.gpu


def test_no_pdl_on_cpu():
    cpu = torch.device("cpu")
    assert not pdl.use_pdl(cpu)
    assert pdl.launch_args(cpu) == {"PDL": False}


def test_early_release_only_at_a_few_rows(monkeypatch):
    assert pdl.early_release(1) and pdl.early_release(2)  # on by default, at one and two rows
    assert not pdl.early_release(4)  # measured slower at 4 rows
    assert not pdl.early_release(pdl.EARLY_MAX_ROWS + 1)
    monkeypatch.setattr(pdl, "EARLY_RELEASE", False)
    assert not pdl.early_release(1)


def test_launch_args_follow_the_switch(monkeypatch):
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    dev = torch.device("cuda", 0)
    assert pdl.launch_args(dev) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(dev) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_supported", lambda index: False)  # before Hopper
    assert pdl.launch_args(dev) == {"PDL": False}


# ---- GPU ----------------------------------------------------------------------------------------------

QWEN3_8B_TWO_LAYERS = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, attention_bias=False, torch_dtype="bfloat16",
)  # fmt: skip


@gpu
def test_gpu_graph_steps_with_pdl_equal_steps_without(tmp_path, monkeypatch):
    # Qwen3-8B widths (two layers) so that every kernel PDL touches runs: the GEMV (batch 1), the skinny
    # GEMM with and without split-K (batch 16, 64), the fused norm / rotary / SiLU kernels and paged
    # attention, decode and 5-token verify windows. One runner captures its graphs with PDL, one
    # without, one with PDL and EARLY_RELEASE (at up to 2 rows: the next kernel let in after each
    # wait, the GEMV's first weight tile read before its wait); the same steps must give bit-identical
    # logits on every one of many replays (a kernel reading its input before the one before it
    # finished would show up as differing bits).
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 or newer")
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_TWO_LAYERS))
    device = torch.device("cuda")
    model, info = load_model(tmp_path, "bfloat16", device, load_format="dummy")
    use_triton_kernels(model)
    block, num_blocks, max_len = 16, 1024, 512
    spec = GraphSpec((1, 5), graph_batch_sizes(64), max_len, max_len // block + 1)
    modes = {"off": (False, False), "pdl": (True, False), "early": (True, True)}  # (ENABLED, EARLY_RELEASE)
    runners = {
        mode: ModelRunner.for_model(
            model, info, num_blocks=num_blocks, block_size=block, device=device, graphs=spec
        )
        for mode in modes
    }
    bm = BlockManager(num_blocks, block, enable_prefix_caching=False)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(64):
        prompt = torch.randint(0, 151936, (20 + 3 * i,), generator=gen).tolist()
        seq = Sequence(str(i), prompt, SamplingParams(), has_draft=False)
        bm.allocate(seq, len(prompt) + 8)
        seqs.append(seq)

    def step(mode: str, *args, **kwargs) -> torch.Tensor:
        enabled, early = modes[mode]  # read at capture (and by eager launches)
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        monkeypatch.setattr(pdl, "EARLY_RELEASE", early)
        return runners[mode].execute_model(*args, **kwargs).clone()

    for mode in modes:  # prefill eagerly into every pool
        for i in range(0, 64, 16):
            batch = seqs[i : i + 16]
            step(mode, batch, [s.num_tokens for s in batch], [1] * len(batch))
    for s in seqs:
        s.num_computed_tokens = s.num_tokens
    assert pdl.use_pdl(device)
    for size, width in ((1, 1), (2, 1), (4, 1), (16, 1), (64, 1), (16, 5)):
        batch = seqs[:size]
        starts = [s.num_tokens - 1 for s in batch]
        ids = [s.token_ids[-1:] * width for s in batch]
        args = (batch, [width] * size, [width] * size)
        kw = dict(input_token_ids=ids, start_positions=starts)
        want = step("off", *args, **kw)
        for mode in ("pdl", "early"):
            replays = runners[mode].graphs.num_replays
            for _ in range(30):
                got = step(mode, *args, **kw)
                assert torch.equal(got, want), f"batch {size} x {width}: {mode} changed the logits"
            assert runners[mode].graphs.num_replays == replays + 30, "the steps did not replay a graph"
        assert torch.equal(step("off", *args, **kw), want)
