"""What `thinkspec bench` and `thinkspec sweep` measure: per-cell results, a sweep's cells with their
paired comparisons against strict, and a calibration pick. Plain records: no engine imports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from thinkspec.bench.stats import compare_paired, wilson_interval

SPEED_METRICS = ("tokens_per_s", "acceptance_length")


@dataclass(slots=True)
class CellResult:
    """Everything measured for one setting; `correct` keeps per-item outcomes for paired tests."""

    name: str
    setting: dict[str, Any]  # mode ("no_spec" | "strict" | "relaxed"), temperature, relax_* values
    correct: list[bool]
    output_tokens: list[int]
    truncated: int
    seconds: float
    latencies: list[float]  # [N] end-to-end seconds per request
    ttfts: list[float]  # [N] time to first token per request
    spec: dict[str, Any] | None = None  # SpecDecodeMetrics.to_dict() of the cell, None without speculation
    extra: dict[str, Any] = field(default_factory=dict)
    tokens_per_s_reps: list[float] = field(default_factory=list)  # [R] one per timed repetition

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / max(1, self.n)

    @property
    def tokens_per_s(self) -> float:
        """The median over the timed repetitions (the one run's figure without repetitions)."""
        if self.tokens_per_s_reps:
            return float(np.median(self.tokens_per_s_reps))
        return sum(self.output_tokens) / max(self.seconds, 1e-9)

    @property
    def mean_acceptance_length(self) -> float | None:
        return None if self.spec is None else self.spec["mean_acceptance_length"]

    def summary(self) -> dict[str, Any]:
        """Flat numbers for tables, CSV and JSON (per-item lists left out)."""
        low, high = wilson_interval(sum(self.correct), self.n)
        lat = np.asarray(self.latencies or [float("nan")])
        row: dict[str, Any] = {
            "name": self.name,
            **self.setting,
            "num_prompts": self.n,
            "num_correct": sum(self.correct),
            "accuracy": self.accuracy,
            "accuracy_ci_low": low,
            "accuracy_ci_high": high,
            "mean_output_tokens": float(np.mean(self.output_tokens)) if self.output_tokens else 0.0,
            "truncation_rate": self.truncated / max(1, self.n),
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_min": min(self.tokens_per_s_reps, default=self.tokens_per_s),
            "tokens_per_s_max": max(self.tokens_per_s_reps, default=self.tokens_per_s),
            "repeats": max(1, len(self.tokens_per_s_reps)),
            "latency_mean_s": float(np.mean(lat)),
            "latency_p50_s": float(np.percentile(lat, 50)),
            "latency_p90_s": float(np.percentile(lat, 90)),
            "ttft_mean_s": float(np.mean(self.ttfts)) if self.ttfts else float("nan"),
        }
        if self.spec is not None:
            by_phase = self.spec["by_phase"]
            row.update(
                mean_acceptance_length=self.spec["mean_acceptance_length"],
                thinking_acceptance_length=by_phase["thinking"]["mean_acceptance_length"],
                answer_acceptance_length=by_phase["answer"]["mean_acceptance_length"],
                draft_acceptance_rate=self.spec["draft_acceptance_rate"],
                relaxed_share=self.spec["relaxed_share"],
                acceptance_rate_per_pos=self.spec["acceptance_rate_per_pos"],
            )
        row.update(self.extra)
        return row

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellResult:
        return cls(**data)


def cell_name(temperature: float, mode: str, max_in_flight: int | None = None) -> str:
    """"T=0 strict", or "T=0 strict b=16" for a cell run with at most 16 requests in flight."""
    name = f"T={temperature:g} {mode}"
    return name if max_in_flight is None else f"{name} b={max_in_flight}"


def _group(cell: CellResult) -> tuple[float, int | None]:
    """Cells compared with each other: same temperature and same cap on requests in flight."""
    return cell.setting["temperature"], cell.setting.get("max_in_flight")


@dataclass(slots=True)
class SweepResult:
    """All cells, plus each cell's paired comparison with strict at its temperature."""

    config: dict[str, Any]
    cells: list[CellResult] = field(default_factory=list)
    comparisons: dict[str, dict[str, Any]] = field(default_factory=dict)  # cell name -> PairedComparison dict
    hf: list[CellResult] = field(default_factory=list)  # HF transformers side-by-side runs

    def cell(self, name: str) -> CellResult:
        for c in self.cells:
            if c.name == name:
                return c
        raise KeyError(name)

    def strict(self, temperature: float, max_in_flight: int | None = None) -> CellResult:
        return self.cell(cell_name(temperature, "strict", max_in_flight))

    def compare_all(self, num_resamples: int = 10_000, seed: int = 0) -> None:
        """Fill `comparisons`: every cell (strict included, a zero check) against strict."""
        self.comparisons = {}
        for c in self.cells:
            ref = self.strict(*_group(c))
            self.comparisons[c.name] = compare_paired(c.correct, ref.correct, num_resamples, seed).to_dict()

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per cell: summary numbers, the comparison with strict, frontier flags."""
        rows = []
        for c in self.cells:
            row = c.summary()
            for key, value in self.comparisons.get(c.name, {}).items():
                row[f"vs_strict_{key}"] = value
            for base in ("strict", "no_spec"):
                row.update(self._speedup(c, base))
            rows.append(row)
        for members in dict.fromkeys(_group(c) for c in self.cells):
            group = [r for r, c in zip(rows, self.cells) if _group(c) == members]
            for metric in SPEED_METRICS:
                key = "tokens_per_s" if metric == "tokens_per_s" else "mean_acceptance_length"
                pts = [(r["accuracy"], r.get(key)) for r in group]
                for r, on in zip(group, pareto_frontier(pts)):
                    r[f"frontier_{metric}"] = on
        return rows

    def _speedup(self, cell: CellResult, base: str) -> dict[str, float]:
        """tok/s over the `base` cell's at the same temperature, repetition by repetition (cells are
        timed round-robin, so repetition i of both ran close together): median, min and max."""
        try:
            ref = self.cell(cell_name(cell.setting["temperature"], base, cell.setting.get("max_in_flight")))
        except KeyError:
            return {}
        pairs = list(zip(cell.tokens_per_s_reps, ref.tokens_per_s_reps))
        pairs = pairs or [(cell.tokens_per_s, ref.tokens_per_s)]
        ratios = [a / b for a, b in pairs if b > 0]
        if not ratios:
            return {}
        key = f"speedup_vs_{base}"
        return {key: float(np.median(ratios)), f"{key}_min": min(ratios), f"{key}_max": max(ratios)}

    @property
    def temperatures(self) -> list[float]:
        return sorted({c.setting["temperature"] for c in self.cells})

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "rows": self.rows(),
            "comparisons": self.comparisons,
            "cells": [c.to_dict() for c in self.cells],
            "hf": [c.to_dict() for c in self.hf],
            "hf_rows": [c.summary() for c in self.hf],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepResult:
        return cls(
            config=data["config"],
            cells=[CellResult.from_dict(c) for c in data["cells"]],
            comparisons=data.get("comparisons", {}),
            hf=[CellResult.from_dict(c) for c in data.get("hf", [])],
        )


def pareto_frontier(points: Sequence[tuple[float, float | None]]) -> list[bool]:
    """Which (accuracy, speed) points no other point beats on both (>= on both, > on one).

    Points with speed None (no speculation has no acceptance length) are never on the frontier.
    """
    flags = []
    for i, (acc, speed) in enumerate(points):
        if speed is None:
            flags.append(False)
            continue
        dominated = any(
            s is not None and a >= acc and s >= speed and (a > acc or s > speed)
            for j, (a, s) in enumerate(points)
            if j != i
        )
        flags.append(not dominated)
    return flags


@dataclass(slots=True)
class Calibration:
    """The fastest setting whose accuracy drop against strict stays within the budget at 95%."""

    temperature: float
    accuracy_budget: float
    by: str
    chosen: str  # cell name
    speculative_config: dict[str, Any]
    candidates: list[dict[str, Any]]  # name, speed, vs-strict CI low, within_budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "accuracy_budget": self.accuracy_budget,
            "by": self.by,
            "chosen": self.chosen,
            "speculative_config": self.speculative_config,
            "candidates": self.candidates,
        }
