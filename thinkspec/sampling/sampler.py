"""Token sampling over a batch of logits rows: greedy, temperature, top-k, top-p, min-p, seeds.

Per row, in HF transformers' order: logits / temperature, then keep the top-k, then the
smallest set of highest-probability tokens whose mass reaches top_p, then the tokens with
p >= min_p * p_max. Filtered-out tokens get -inf. Greedy rows (temperature ~ 0) take the argmax,
lowest index on ties. Sampled rows use the Gumbel-max trick, token = argmax(l - log(E)),
E ~ Exp(1) i.i.d., which draws exactly from softmax(l).

Seeds: a row with a seed draws its noise from a generator seeded by (seed, output position),
so its token depends only on its own logits, seed and position: not on the rest of the batch,
nor on preemption. Unseeded rows share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from thinkspec.sampling.rejection_common import check_tokens_out
from thinkspec.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
MAX_TOP_K = 2**31 - 1  # larger top_k values mean "no top-k filter"


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, output position) via splitmix64."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(slots=True)
class SamplingTensors:
    """Per-row parameters on the logits' device. N rows."""

    temperature: torch.Tensor  # [N] float32, 1.0 on greedy rows (unused there)
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float32, 1.0 = off
    min_p: torch.Tensor  # [N] float32, 0.0 = off
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device) -> SamplingTensors:
        greedy = [p.is_greedy for p in params]
        # A k beyond any vocabulary keeps every token: off, and it would not survive float64 packing.
        top_k = [p.top_k if 0 < p.top_k <= MAX_TOP_K else 0 for p in params]
        # One host->device copy: rows temperature, top_k, top_p, min_p, greedy as float64
        # (exact for every int top_k a vocabulary can have).
        packed = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                top_k,
                [p.top_p for p in params],
                [p.min_p for p in params],
                greedy,
            ],
            dtype=torch.float64,
        ).to(device, non_blocking=True)
        return cls(
            temperature=packed[0].float(),
            top_k=packed[1].long(),
            top_p=packed[2].float(),
            min_p=packed[3].float(),
            greedy=packed[4].bool(),
            all_greedy=all(greedy),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
        )


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [N, V] float32, temperature [N] float32 (> 0) -> [N, V] float32 (new tensor)."""
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Set filtered-out entries to -inf; applied to temperature-scaled logits. Returns a new tensor.

    logits [N, V] float32; top_k [N] int64 (0 = off; ties with the k-th value are kept);
    top_p [N] float32 in (0, 1] (keep a token if the mass of strictly higher-ranked tokens, after
    top-k, is < top_p); min_p [N] float32 in [0, 1] (keep p >= min_p * p_max). None = off for all rows.
    """
    logits = logits.clone()
    vocab = logits.shape[-1]
    if top_k is not None or top_p is not None:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [N, V]
        if top_k is not None:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if top_p is not None:
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = mass_before >= top_p.unsqueeze(1)
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if min_p is not None:
        # p >= min_p * p_max  <=>  l - l_max >= log(min_p)
        l_max = logits.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits - l_max < torch.log(min_p).unsqueeze(1), float("-inf"))
    return logits


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The one logits pipeline of sampled rows: / temperature, then top-k, top-p, min-p (-inf outside).

    logits [N, V] float32 -> [N, V] float32 (a new tensor); greedy rows come back unchanged, as the
    relaxed acceptance test reads their raw logits. Used by the sampler, the draft proposer and the
    verifier alike.
    """
    if t.all_greedy:
        return logits
    scaled = apply_temperature(logits.float(), t.temperature)
    filtered = apply_top_k_top_p_min_p(
        scaled,
        t.top_k if t.any_top_k else None,
        t.top_p if t.any_top_p else None,
        t.min_p if t.any_min_p else None,
    )
    return torch.where(t.greedy.unsqueeze(1), logits, filtered)


def exponential_race(log_weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log_weights [N, V] (unnormalised, -inf = excluded), noise [N, V] Exp(1) > 0 -> [N] int64:
    argmax(log w - log E), an exact draw from normalize(w) (the Gumbel-max trick)."""
    return (log_weights - noise.log()).argmax(dim=-1)


def greedy_sample(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] -> [N] int64, argmax with the lowest index on ties, NaN the max (into `out` [N]
    int64, any stride, when given): one Triton launch where argmax_triton.use_kernel says so (CUDA),
    torch.argmax elsewhere."""
    if logits.is_cuda:  # triton is a GPU-only dependency
        from thinkspec.sampling import argmax_triton

        if argmax_triton.use_kernel(logits):
            return argmax_triton.argmax_triton(logits, out)
    check_tokens_out(logits, out)
    tokens = logits.argmax(dim=-1)
    return tokens if out is None else out.copy_(tokens)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        tensors: SamplingTensors | None = None,
    ) -> torch.Tensor:
        """logits [N, V] float32, params/positions one per row -> [N] int64 tokens.

        positions[i] is the output index of the token being drawn (seeded rows mix it into the seed).
        """
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
            raise ValueError(
                f"logits {tuple(logits.shape)} must be [N, V] with N = len(params) = len(positions) "
                f"({len(params)}, {len(positions)})"
            )
        greedy_tokens = greedy_sample(logits)
        if tensors is None and all(p.is_greedy for p in params):
            return greedy_tokens  # no per-row tensors to build or copy
        t = tensors or SamplingTensors.from_params(params, logits.device)
        if t.all_greedy:
            return greedy_tokens
        filtered = process_logits(logits, t)
        noise = self.exponential_noise(filtered.shape, params, positions, filtered.device)
        return torch.where(t.greedy, greedy_tokens, exponential_race(filtered, noise))

    def exponential_noise(
        self,
        shape: torch.Size,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        device: torch.device,
    ) -> torch.Tensor:
        """[N, V] float32 Exp(1) noise, clamped away from 0; seeded rows from their own generator."""
        noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=self.generator)
        for i, (p, pos) in enumerate(zip(params, positions)):
            if p.seed is not None and not p.is_greedy:
                gen = torch.Generator(device=device)
                gen.manual_seed(mix_seed(p.seed, pos))
                noise[i].exponential_(generator=gen)
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)
