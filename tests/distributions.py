"""Analytic distributions of the sampled acceptance paths, shared by the torch reference tests
(test_rejection.py) and the Triton kernel tests (test_rejection_triton.py). Import as
`from distributions import ...` (tests/ is on sys.path)."""

from __future__ import annotations

import math

import torch
from scipy.stats import chisquare

NEG_INF = float("-inf")


def dist_setup(
    v: int = 6, temp: float = 0.8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [V] float32 with one -inf entry, p = softmax(logits / temp) [V] float64, q [V] float64)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(v, generator=gen)
    logits[v - 1] = NEG_INF  # a filtered token
    p = torch.softmax(logits.double() / temp, -1)
    # q favours token 1 (third by p at seed 2), so relaxation visibly moves mass onto it.
    q = torch.rand(v, generator=gen).double() * 0.1 + 0.05
    q[1] += 0.5
    q /= q.sum()
    return logits, p, q


def chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of samples [N] int64 (any device) against probs [V]; fails on a token of
    probability 0."""
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    keep = probs > 0
    return float(chisquare(counts[keep].numpy(), (probs[keep] * samples.numel()).numpy()).pvalue)


def relaxed_set(logits: torch.Tensor, temp: float, ratio: float, top_k: int, delta: float) -> torch.Tensor:
    """[V] bool: drafts that pass the relaxed test on the row logits [V] at this temperature."""
    x = logits.double() / temp
    p = torch.softmax(x, -1)
    rank = (x[None, :] > x[:, None]).sum(-1)
    ok = (x > NEG_INF) & (rank < top_k) & (torch.exp(x - x.max()) >= ratio)
    if not math.isnan(delta):
        ok &= p.max() - p <= delta
    return ok


def pi_distribution(p: torch.Tensor, q: torch.Tensor, relaxed: torch.Tensor) -> torch.Tensor:
    """[V] float64: distribution of the token emitted at one sampled position with draft d ~ q."""
    acc = torch.where(relaxed | (q == 0), torch.ones_like(p), torch.clamp(p / q, max=1.0))
    residual = (p - q).clamp_min(0)
    residual /= residual.sum()
    p_reject = (q * (1 - acc)).sum()
    return q * acc + p_reject * residual


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, relaxed: torch.Tensor) -> float:
    """P(draft d ~ q is accepted) = sum_d q(d) * (1 if d relaxed else min(1, p(d) / q(d)))."""
    acc = torch.where(relaxed, torch.ones_like(p), torch.clamp(p / q, max=1.0))
    return float((q * acc).sum())


def pi_from_acceptance(p: torch.Tensor, q: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """[V] float64: emitted distribution for drafts d ~ q accepted with probability acc[d] and the
    residual normalize(max(0, p - q)) on rejection (docs/ACCEPTANCE.md, any relaxation rule)."""
    residual = (p - q).clamp_min(0)
    residual /= residual.sum()
    return q * acc + (1 - (q * acc).sum()) * residual


def lenient_acceptance(p: torch.Tensor, q: torch.Tensor, lam: float) -> torch.Tensor:
    """[V] float64: min(1, p / (lambda q)), 1 where q = 0."""
    return torch.where(q > 0, torch.clamp(p / (lam * q), max=1.0), torch.ones_like(p))


def typical_set(p: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """[V] bool: p(x) > min(threshold, alpha * exp(-H(p)))."""
    entropy = float(torch.special.entr(p).sum())
    return p > min(threshold, alpha * math.exp(-entropy))


def typical_acceptance(p: torch.Tensor, q: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """[V] float64: 1 in the typical set, min(1, p / q) elsewhere (the lossless test)."""
    lossless = torch.where(q > 0, torch.clamp(p / q, max=1.0), torch.ones_like(p))
    return torch.where(typical_set(p, threshold, alpha), torch.ones_like(p), lossless)


def tv_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance of two distributions [V]."""
    return 0.5 * float((a - b).abs().sum())
