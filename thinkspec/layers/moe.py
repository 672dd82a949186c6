"""The mixture-of-experts block of Qwen3-MoE and Qwen2-MoE.

Each token's router logits (model dtype) go through a softmax in float32; the top-k experts are
kept, their probabilities renormalised to sum to 1 when `norm_topk_prob` is set, and cast back to the
model dtype (as transformers does). Each selected expert computes down(SiLU(gate(x)) * up(x)); the
block's output is the routing-weighted sum. Qwen2-MoE adds a shared expert (a dense MLP) scaled by
sigmoid(shared_expert_gate(x)).

Two paths compute the same values: `moe_reference` (torch ops, one matmul pair per selected expert;
the CPU path) and the fused Triton kernels of moe_triton.py (CUDA, or TRITON_INTERPRET=1), chosen by
`fused` (set with the other fused kernels, models/decoder.py:set_fused_kernels).

Experts' weights are stacked as transformers 5 holds them: gate_up_proj [E, 2 * I, H] (each expert's
gate rows, then its up rows) and down_proj [E, H, I]. Checkpoints store them either so or per expert
(`experts.{e}.gate_proj.weight` ...: what save_pretrained writes and the released checkpoints hold);
the loader copies the latter into their rows with `expert_target`.

Tensor parallelism: like the dense MLP, each rank holds I / size features of every expert (gate/up
rows, down columns) and of the shared expert; the router is replicated; the block's partial sums
(experts and shared expert together, the shared gate being the same on every rank) take one
all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from thinkspec.distributed.parallel_state import TPLayout, all_reduce
from thinkspec.layers.forward_context import get_forward_context
from thinkspec.layers.linear import CheckpointSlice, Linear, MergedLinear, RowParallelLinear
from thinkspec.layers.norm import RMSNorm

_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] model dtype -> (weights [T, top_k] float32, ids [T, top_k] int64), each row's
    experts by falling probability (softmax in float32; renormalised over the top-k if asked)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; weights: [T, K] (cast to x's dtype first, as
    transformers does); ids: [T, K] int -> [T, H] x's dtype, the weighted sum of each row's experts.
    Experts are visited in increasing order and accumulated in x's dtype, as transformers does (so
    float32 results agree to the bit). Host syncs (which experts are used): not for CUDA graphs."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


def _real_rows() -> torch.Tensor | None:
    """[1] int32 on the device: the step's real rows (query_start_loc[-1]; a CUDA graph pads rows
    after them), or None outside a forward context."""
    try:
        return get_forward_context().query_start_loc[-1:]
    except RuntimeError:
        return None


class MoEExperts(nn.Module):
    """num_experts experts of this rank's `intermediate / tp.size` features each (layout above)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPLayout) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.intermediate = size = tp.split(intermediate, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, size))

    def checkpoint_slice(self, leaf: str, shard: str | None = None) -> CheckpointSlice:
        """Part of a stacked checkpoint tensor (`experts.gate_up_proj` / `experts.down_proj`) held here."""
        if self.tp.size == 1:
            return None
        if leaf == "down_proj":
            return 2, self.tp.rank * self.intermediate, self.intermediate
        # this rank's gate rows and up rows are two ranges of the stacked tensor, not one
        raise ValueError(
            "a checkpoint with stacked experts.gate_up_proj cannot be split over tensor_parallel_size > 1; "
            "save it with one tensor per expert (gate_proj / up_proj / down_proj)"
        )

    def expert_target(self, expert: int, proj: str, leaf: str) -> tuple[torch.Tensor, CheckpointSlice]:
        """(the rows of this module a per-expert checkpoint tensor `experts.{expert}.{proj}.{leaf}`
        loads into, the part of that tensor this rank holds or None); ValueError for unknown names."""
        if leaf != "weight" or proj not in _EXPERT_PROJS or not 0 <= expert < self.num_experts:
            raise ValueError(
                f"checkpoint tensor experts.{expert}.{proj}.{leaf}: expected "
                f"experts.<0..{self.num_experts - 1}>.<{'|'.join(_EXPERT_PROJS)}>.weight"
            )
        size, start = self.intermediate, self.tp.rank * self.intermediate
        whole = self.tp.size == 1
        if proj == "down_proj":
            return self.down_proj.data[expert], None if whole else (1, start, size)
        rows = self.gate_up_proj.data[expert].narrow(0, 0 if proj == "gate_proj" else size, size)
        return rows, None if whole else (0, start, size)

    def checkpoint_names(self, prefix: str) -> list[str]:
        """Per-expert checkpoint names of this module (`prefix` = its own name)."""
        return [f"{prefix}.{e}.{p}.weight" for e in range(self.num_experts) for p in _EXPERT_PROJS]

    def covered_names(self, prefix: str, leaf: str) -> list[str]:
        """The per-expert names that stacked tensor `prefix.leaf` stands for."""
        projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        return [f"{prefix}.{e}.{p}.weight" for e in range(self.num_experts) for p in projs]


class SparseMoeBlock(nn.Module):
    """Router `gate` [E, H] (replicated), `experts`, and for Qwen2-MoE `shared_expert` (gate_up_proj,
    down_proj) with `shared_expert_gate` [1, H]; parameter names follow the checkpoints."""

    def __init__(
        self,
        hidden: int,
        *,
        num_experts: int,
        top_k: int,
        intermediate: int,
        norm_topk_prob: bool,
        shared_intermediate: int,
        tp: TPLayout,
    ) -> None:
        # intermediate: each expert's FFN width; shared_intermediate: the shared expert's, 0 = none
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.tp = tp
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = MoEExperts(num_experts, hidden, intermediate, tp)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: Linear | None = None
        if shared_intermediate:
            shared = nn.Module()
            size = tp.split(shared_intermediate, "shared_expert_intermediate_size")
            starts = {"gate": tp.rank * size, "up": tp.rank * size} if tp.size > 1 else None
            shared.gate_up_proj = MergedLinear(hidden, {"gate": size, "up": size}, False, starts)
            shared.down_proj = RowParallelLinear(shared_intermediate, hidden, False, tp=tp)
            self.shared_expert = shared
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
        self.fused = False  # True: the Triton kernels of moe_triton.py
        # [1] int32 on the device, += the number of experts each forward reads (benchmarks), or None
        self.expert_counter: torch.Tensor | None = None

    def experts_sum(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> this rank's partial sum of the routed experts [T, H]
        logits = self.gate(x)  # [T, E] model dtype, as transformers computes it
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if self.fused:
            from thinkspec.layers.moe_triton import fused_moe

            num_valid = _real_rows()
            return fused_moe(
                x, w13, w2, logits, self.top_k, self.norm_topk_prob, num_valid, self.expert_counter
            )
        weights, ids = route(logits, self.top_k, self.norm_topk_prob)
        if self.expert_counter is not None:
            self.expert_counter += ids.unique().numel()
        return moe_reference(x, w13, w2, weights, ids)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: RMSNorm | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> the block's output [T, H]; with residual and norm: (norm(s), s), s = that
        # output + residual (as DecoderMLP.forward)
        out = self.experts_sum(x)
        if self.shared_expert is not None:
            gate, up = self.shared_expert.gate_up_proj.split(self.shared_expert.gate_up_proj(x))
            shared = self.shared_expert.down_proj.product(F.silu(gate) * up, None)  # no all-reduce yet
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        if self.tp.size > 1:
            out = all_reduce(out)
        return out if norm is None else norm(out, residual)
