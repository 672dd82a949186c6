"""The per-request numbers a verify step needs on the device, packed so they cross in one copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from thinkspec.engine.sequence import Sequence


class VerifyRows:
    """One float64 [S, C] host tensor, a row per request in `row`'s column order, copied to the
    device once per step (non_blocking) and read back by named column. float64 holds every count
    here exactly (all < 2**53)."""

    # Column indices, in `row`'s order.
    NUM_DRAFTS, RELAX_ON, RATIO, TOP_K, DELTA, THINKING, SAMPLED, THINKING_TOKENS, BUDGET = range(9)
    RULE, LAMBDA, THRESHOLD, ALPHA = range(9, 13)

    __slots__ = ("dev",)

    def __init__(self, rows: list[tuple[float, ...]], device: torch.device) -> None:
        self.dev = torch.tensor(rows, dtype=torch.float64).to(device, non_blocking=True)  # [S, C]

    @staticmethod
    def row(num_drafts: int, seq: Sequence, budget: int) -> tuple[float, ...]:
        """One request's row: its drafts this step, its resolved relax settings, its phase, whether it
        samples, its thinking tokens, its thinking budget (-1 = none), then its relax rule's code and
        parameters (lambda, posterior_threshold, posterior_alpha)."""
        relax = seq.relax
        return (
            float(num_drafts), float(relax.enabled), relax.ratio, float(relax.top_k), relax.delta,
            float(seq.thinking), float(not seq.sampling_params.is_greedy), float(seq.num_thinking_tokens),
            float(budget), float(relax.rule_code), relax.lam, relax.threshold, relax.alpha,
        )  # fmt: skip

    @staticmethod
    def any_rule(seqs: list[Sequence]) -> bool:
        """Whether a request relaxes with a rule other than topk_ratio (the acceptance then needs the
        rule columns; without one the default kernels run)."""
        return any(s.relax.enabled and s.relax.rule_code != 0 for s in seqs)

    def rule_fields(self) -> dict[str, torch.Tensor]:
        """AcceptanceBatch's rule fields: relax_rule [S] int64, relax_lambda / posterior_threshold /
        posterior_alpha [S] float32."""
        d = self.dev
        return dict(
            relax_rule=d[:, self.RULE].long(), relax_lambda=d[:, self.LAMBDA].float(),
            posterior_threshold=d[:, self.THRESHOLD].float(), posterior_alpha=d[:, self.ALPHA].float(),
        )  # fmt: skip

    @property
    def num_drafts(self) -> torch.Tensor:  # [S] int64
        return self.dev[:, self.NUM_DRAFTS].long()

    @property
    def relax_on(self) -> torch.Tensor:  # [S] bool
        return self.dev[:, self.RELAX_ON].bool()

    @property
    def ratio(self) -> torch.Tensor:  # [S] float32
        return self.dev[:, self.RATIO].float()

    @property
    def top_k(self) -> torch.Tensor:  # [S] int64
        return self.dev[:, self.TOP_K].long()

    @property
    def delta(self) -> torch.Tensor:  # [S] float32, NaN = unset
        return self.dev[:, self.DELTA].float()

    @property
    def thinking(self) -> torch.Tensor:  # [S] bool
        return self.dev[:, self.THINKING].bool()

    @property
    def temperature(self) -> torch.Tensor:  # [S] float32: 1 = sampled (rows arrive scaled), 0 = greedy
        return self.dev[:, self.SAMPLED].float()

    @property
    def thinking_tokens(self) -> torch.Tensor:  # [S] int64
        return self.dev[:, self.THINKING_TOKENS].long()

    @property
    def budget(self) -> torch.Tensor:  # [S] int64, -1 = none
        return self.dev[:, self.BUDGET].long()
