"""Qwen3-MoE / Qwen2-MoE model code against Hugging Face transformers on tiny random checkpoints
(8 experts, top-2, 3 layers, fp32, CPU), and the loader's handling of the experts' tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import PagedHarness, hf_logits
from moe_checkpoints import moe_checkpoint
from safetensors.torch import load_file, save_file

from thinkspec import LLM, SamplingParams
from thinkspec.layers.moe import SparseMoeBlock, moe_reference, route
from thinkspec.models import load_model
from thinkspec.models.config import DecoderConfig
from thinkspec.models.decoder import DecoderMLP

PROMPTS = [[72, 105, 33, 10], [65, 66, 67, 68, 69, 70, 71, 72, 73], [200, 17, 3, 99, 150, 42]]
NEW_TOKENS = 32


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' model, each from a full forward of the sequence so far."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(path, ids)[-1].argmax()))
    return ids[len(prompt) :]


def engine_greedy(path: Path) -> list[list[int]]:
    llm = LLM(path, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def sparse_layers(model: torch.nn.Module) -> list[bool]:
    return [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]


@pytest.mark.parametrize(
    ("arch", "options", "sparse"),
    [
        ("qwen3_moe", {"norm_topk_prob": True}, [True, True, True]),
        ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": (0,)}, [False, True, True]),
        ("qwen3_moe", {"decoder_sparse_step": 2}, [False, True, False]),
        ("qwen2_moe", {"norm_topk_prob": False}, [True, True, True]),
    ],
)
def test_greedy_output_equals_hf(arch: str, options: dict, sparse: list[bool]) -> None:
    path = moe_checkpoint(arch, **options)
    model, info = load_model(path)
    assert info.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]
    assert sparse_layers(model) == sparse
    got = engine_greedy(path)
    want = [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
    assert [len(t) for t in got] == [NEW_TOKENS] * len(PROMPTS)
    assert got == want
    assert len({tuple(t) for t in got}) == len(PROMPTS)  # the prompts lead to different outputs


def test_prefill_logits_match_hf_and_norm_topk_prob_matters() -> None:
    normed, plain = moe_checkpoint(norm_topk_prob=True), moe_checkpoint(norm_topk_prob=False)
    ids = PROMPTS[1] * 3
    for path in (normed, plain):
        model, _ = load_model(path)
        out = PagedHarness(model).step([(0, ids)])
        ref = hf_logits(path, ids)
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    # the same weights routed the other way give other logits: the option was exercised
    assert (hf_logits(normed, ids) - hf_logits(plain, ids)).abs().max() > 1e-2


def test_router_softmax_runs_in_float32() -> None:
    # bfloat16 router logits: the probabilities are the float32 softmax's, not bfloat16's
    logits = torch.tensor([[2.0, 2.015625, 0.0, -1.0]], dtype=torch.bfloat16)
    weights, ids = route(logits, top_k=2, norm_topk_prob=False)
    assert weights.dtype == torch.float32 and ids.tolist() == [[1, 0]]
    assert torch.equal(weights[0], torch.softmax(logits.float(), dim=-1)[0, [1, 0]])
    assert not torch.equal(weights[0], torch.softmax(logits, dim=-1)[0, [1, 0]].float())
    normed, _ = route(logits, top_k=2, norm_topk_prob=True)
    torch.testing.assert_close(normed.sum(-1), torch.ones(1))
    assert not torch.allclose(weights.sum(-1), torch.ones(1))


def test_reference_is_the_weighted_sum_of_each_rows_experts() -> None:
    g = torch.Generator().manual_seed(0)
    e, h, i, t = 4, 8, 6, 5
    x, w13, w2 = (
        torch.randn(t, h, generator=g),
        torch.randn(e, 2 * i, h, generator=g),
        torch.randn(e, h, i, generator=g),
    )
    weights, ids = route(torch.randn(t, e, generator=g), 2, True)
    out = moe_reference(x, w13, w2, weights, ids)
    for row in range(t):
        want = torch.zeros(h)
        for k in range(2):
            gate, up = (w13[ids[row, k]] @ x[row]).chunk(2)
            want += weights[row, k] * (w2[ids[row, k]] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)


def test_stacked_experts_checkpoint_loads_the_same(tmp_path: Path) -> None:
    # transformers 5 holds the experts stacked; a checkpoint saved so loads into the same weights
    src = moe_checkpoint()
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts"
        n = cfg.get("num_experts") or cfg["num_local_experts"]
        gate = [tensors.pop(f"{prefix}.{e}.gate_proj.weight") for e in range(n)]
        up = [tensors.pop(f"{prefix}.{e}.up_proj.weight") for e in range(n)]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(n)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(p) for p in zip(gate, up)])
        tensors[f"{prefix}.down_proj"] = torch.stack(down)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    a, _ = load_model(src)
    b, _ = load_model(dst)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


def test_missing_expert_and_bad_expert_index_raise(tmp_path: Path) -> None:
    src = moe_checkpoint()
    for case in ("missing", "bad_index"):
        dst = tmp_path / case
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        w = tensors.pop("model.layers.1.mlp.experts.7.up_proj.weight")
        if case == "bad_index":
            tensors["model.layers.1.mlp.experts.8.up_proj.weight"] = w
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        match = "missing 1 tensor.*experts.7.up_proj" if case == "missing" else "experts.<0..7>"
        with pytest.raises(ValueError, match=match):
            load_model(dst)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_experts_per_tok", 9, r"num_experts_per_tok=9 must be in \[1, num_local_experts=8\]"),
        ("num_experts_per_tok", 0, "num_experts_per_tok=0 must be a positive integer"),
        ("decoder_sparse_step", 0, "decoder_sparse_step=0 must be a positive integer"),
        ("mlp_only_layers", [-1], "mlp_only_layers=.* must be a list of layer indices >= 0"),
        ("moe_intermediate_size", None, "moe_intermediate_size=None must be a positive integer"),
    ],
)
def test_bad_routing_fields_raise(field: str, value: object, match: str) -> None:
    raw = json.loads((moe_checkpoint() / "config.json").read_text())
    raw[field] = value
    with pytest.raises(ValueError, match=match):
        DecoderConfig.from_dict(raw, "Qwen3MoeForCausalLM")


def test_dense_layers_of_a_moe_model_use_intermediate_size() -> None:
    model, _ = load_model(moe_checkpoint(mlp_only_layers=(0,), norm_topk_prob=False))
    dense = model.model.layers[0].mlp
    assert isinstance(dense, DecoderMLP) and dense.gate_up_proj.out_features == 2 * 96
    experts = model.model.layers[1].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 32, 64)
    assert tuple(experts.down_proj.shape) == (8, 64, 32)


def test_stacked_gate_up_cannot_be_split_over_ranks_but_down_can() -> None:
    from thinkspec.distributed.parallel_state import TPLayout
    from thinkspec.layers.moe import MoEExperts

    with torch.device("meta"):
        rank1 = MoEExperts(4, 16, 32, TPLayout(1, 2))
    assert rank1.checkpoint_slice("down_proj") == (2, 16, 16)
    with pytest.raises(
        ValueError, match="stacked experts.gate_up_proj cannot be split over tensor_parallel_size"
    ):
        rank1.checkpoint_slice("gate_up_proj")
    # per-expert tensors can: this rank's gate rows, up rows and down columns
    assert rank1.expert_target(3, "gate_proj", "weight")[1] == (0, 16, 16)
    assert rank1.expert_target(3, "down_proj", "weight")[1] == (1, 16, 16)


@pytest.mark.gpu
def test_cuda_fused_experts_with_graphs_greedy_equals_eager_and_hf() -> None:
    # the Triton path (CUDA graphs of padded batch buckets, and eager) against transformers, fp32
    path = moe_checkpoint()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", enforce_eager=eager)
        assert all(m.fused for m in llm.llm_engine.model.modules() if isinstance(m, SparseMoeBlock))
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        del llm
    assert [len(t) for t in runs[0]] == [NEW_TOKENS] * len(PROMPTS)
    assert runs[0] == runs[1] == [hf_greedy(path, p, NEW_TOKENS) for p in PROMPTS]
