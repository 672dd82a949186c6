"""Confidence intervals and paired tests for accuracy, in numpy only.

Accuracy is a vector of per-problem 0/1 outcomes. Cells of a sweep answer the same problems
with the same seeds, so comparisons between cells are paired: a problem both cells get right (or
both wrong) says nothing about the difference, only the discordant ones do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def _as_bool(x: Sequence[bool] | np.ndarray, name: str) -> np.ndarray:  # [N] bool
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of outcomes, got shape {a.shape}")
    return a.astype(bool)


def wilson_interval(num_correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when n == 0.

    Unlike the normal approximation it stays inside [0, 1] and is not degenerate at 0 or n.
    """
    if n < 0 or not 0 <= num_correct <= max(n, 0):
        raise ValueError(f"need 0 <= num_correct <= n, got num_correct={num_correct}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = num_correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_bootstrap_diff_ci(
    a: Sequence[bool] | np.ndarray,  # [N] bool: outcomes of the cell
    b: Sequence[bool] | np.ndarray,  # [N] bool: outcomes of the reference, same problems
    num_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): percentile bootstrap CI resampling problems, pairs kept."""
    a, b = _as_bool(a, "a"), _as_bool(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have the same length, got {a.size} and {b.size}")
    if a.size == 0:
        raise ValueError("paired outcomes are empty")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    d = a.astype(np.int8) - b.astype(np.int8)  # [N] in {-1, 0, 1}
    rng = np.random.default_rng(seed)
    means = np.empty(num_resamples)
    chunk = max(1, 2_000_000 // d.size)  # bound the [chunk, N] index matrix
    for start in range(0, num_resamples, chunk):
        stop = min(num_resamples, start + chunk)
        idx = rng.integers(0, d.size, size=(stop - start, d.size))
        means[start:stop] = d[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(d.mean()), float(low), float(high)


def mcnemar_exact_p(
    a: Sequence[bool] | np.ndarray,  # [N] bool
    b: Sequence[bool] | np.ndarray,  # [N] bool
) -> float:
    """Two-sided exact McNemar p-value: binomial test of the discordant pairs at p = 1/2."""
    a, b = _as_bool(a, "a"), _as_bool(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have the same length, got {a.size} and {b.size}")
    only_a = int(np.sum(a & ~b))
    only_b = int(np.sum(~a & b))
    return binomial_two_sided_p(min(only_a, only_b), only_a + only_b)


def binomial_two_sided_p(k: int, n: int) -> float:
    """P(X <= k) + P(X >= n - k) for X ~ Binomial(n, 1/2), k <= n/2; 1.0 when n == 0."""
    if n == 0:
        return 1.0
    k = min(k, n - k)
    # Sum in log space: n can be in the thousands, 2**-n underflows.
    log_terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(k + 1)]
    peak = max(log_terms)
    tail = math.exp(peak + math.log(sum(math.exp(t - peak) for t in log_terms)) - n * math.log(2))
    return min(1.0, 2 * tail)


@dataclass(slots=True)
class PairedComparison:
    """A cell's accuracy against a reference on the same problems."""

    diff: float  # accuracy(cell) - accuracy(reference)
    ci_low: float
    ci_high: float
    mcnemar_p: float
    only_cell: int  # problems the cell solves and the reference does not
    only_reference: int

    def to_dict(self) -> dict[str, float | int]:
        return {
            "diff": self.diff,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "mcnemar_p": self.mcnemar_p,
            "only_cell": self.only_cell,
            "only_reference": self.only_reference,
        }


def compare_paired(
    cell: Sequence[bool] | np.ndarray,  # [N] bool
    reference: Sequence[bool] | np.ndarray,  # [N] bool
    num_resamples: int = 10_000,
    seed: int = 0,
) -> PairedComparison:
    a, b = _as_bool(cell, "cell"), _as_bool(reference, "reference")
    diff, low, high = paired_bootstrap_diff_ci(a, b, num_resamples=num_resamples, seed=seed)
    return PairedComparison(
        diff=diff,
        ci_low=low,
        ci_high=high,
        mcnemar_p=mcnemar_exact_p(a, b),
        only_cell=int(np.sum(a & ~b)),
        only_reference=int(np.sum(~a & b)),
    )
