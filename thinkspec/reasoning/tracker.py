"""Per-token reasoning phase: which draft positions may be relaxed.

The phase state of a batch is a bool tensor `thinking [B]` (True = inside `<think>`) owned by
the caller. The phase after a run of tokens is decided by the last marker in the run (start
marker -> thinking, end marker -> answer), or is unchanged when the run has none. Everything
here is tensor ops on the inputs' device: no host sync, no Python loop over tokens or rows.
Pads (-1) never match a marker because marker ids are non-negative.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

# relax_protect's named classes (config.PROTECT_CLASSES validates the names; tests check they agree):
# a token belongs when its decoded text passes the predicate.
PROTECT_CLASSES: dict[str, Callable[[str], bool]] = {
    "digits": lambda text: any(ch.isdigit() for ch in text),
    "operators": lambda text: any(ch in "+-*/=<>^%" for ch in text),
}


def _check_token_id(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"PhaseTracker.{name} must be a non-negative int, got {value!r}")
    return value


def _phase_after(
    thinking: torch.Tensor,  # [B] bool
    token_ids: torch.Tensor,  # [B, N] int64
    valid: torch.Tensor | None,  # [B, N] bool or None (all valid)
    think_start_id: int,
    think_end_id: int,
    prefix: bool,
) -> torch.Tensor:  # [B, N] bool if prefix else [B] bool
    """Phase after each prefix (prefix=True) or after the whole valid run (prefix=False)."""
    is_start = token_ids == think_start_id
    is_marker = is_start | (token_ids == think_end_id)
    if valid is not None:
        is_marker &= valid
    pos = torch.arange(token_ids.shape[1], device=token_ids.device)
    # Encode position and marker kind in one key so the latest marker is a plain max.
    key = torch.where(is_marker, pos * 2 + is_start.long(), torch.full_like(token_ids, -1))
    last = key.cummax(dim=1).values if prefix else key.amax(dim=1)
    init = thinking[:, None] if prefix else thinking
    return torch.where(last >= 0, (last % 2) == 1, init)


def initial_phase(
    prompt_token_ids: Sequence[int] | torch.Tensor,  # [L] int
    think_start_id: int,
    think_end_id: int,
) -> bool:
    """True when the prompt's last think marker is the start marker (no marker -> False)."""
    ids = torch.as_tensor(prompt_token_ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] == 0:
        return False
    start = torch.zeros(1, dtype=torch.bool, device=ids.device)
    return bool(_phase_after(start, ids, None, think_start_id, think_end_id, prefix=False)[0])


class PhaseTracker:
    """Per-token phase for a batch, plus the relax mask of the acceptance contract."""

    def __init__(
        self,
        think_start_id: int,
        think_end_id: int,
        protected_token_ids: Sequence[int] | torch.Tensor = (),
    ) -> None:
        self.think_start_id = _check_token_id("think_start_id", think_start_id)
        self.think_end_id = _check_token_id("think_end_id", think_end_id)
        if think_start_id == think_end_id:
            raise ValueError(f"PhaseTracker markers must differ, got {think_start_id} for both")
        ids = torch.as_tensor(protected_token_ids, dtype=torch.long).reshape(-1).cpu()
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(
                f"PhaseTracker.protected_token_ids must be non-negative, got min {int(ids.min())}"
            )
        # The markers are always protected, whatever the caller passed.
        ids = torch.cat([ids, torch.tensor([think_start_id, think_end_id])]).unique(sorted=True)
        self.protected_token_ids = ids  # [P] int64, sorted, CPU
        self._protected_on: dict[torch.device, torch.Tensor] = {ids.device: ids}
        self._texts: list[str] | None = None  # each token's decoded text, for relax_protect
        self._protect_masks: dict[tuple[tuple[int | str, ...], int, torch.device], torch.Tensor] = {}

    def protect_mask(
        self, protect: tuple[int | str, ...], tokenizer: Any | None, vocab_size: int, device: torch.device
    ) -> torch.Tensor:  # [V] bool on device
        """Tokens a relax_protect setting covers (ids, named classes, "re:" regexes over the token's
        text), built once per setting and kept (token texts are decoded once per tracker). Ids at or
        past vocab_size can never be drafted and are skipped; classes and regexes need a tokenizer."""
        key = (protect, vocab_size, device)
        mask = self._protect_masks.get(key)
        if mask is not None:
            return mask
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        ids = [i for i in protect if isinstance(i, int) and i < vocab_size]
        mask[ids] = True
        tests = [PROTECT_CLASSES[i] if i in PROTECT_CLASSES else re.compile(i[3:]).search
                 for i in protect if isinstance(i, str)]  # fmt: skip
        if tests:
            if tokenizer is None:
                raise ValueError("relax_protect classes and regexes need a tokenizer; this engine has none")
            texts = self._token_texts(tokenizer, vocab_size)
            mask |= torch.tensor([any(t(text) for t in tests) for text in texts], dtype=torch.bool)
        self._protect_masks[key] = mask = mask.to(device)
        return mask

    def _token_texts(self, tokenizer: Any, vocab_size: int) -> list[str]:
        """[V] each token id's decoded text ("" past the tokenizer's vocabulary)."""
        if self._texts is None or len(self._texts) != vocab_size:
            size = min(vocab_size, len(tokenizer))
            texts = list(tokenizer.batch_decode([[i] for i in range(size)]))
            self._texts = texts + [""] * (vocab_size - size)
        return self._texts

    def protected_drafts(
        self,
        draft_token_ids: torch.Tensor,  # [B, K] int64, pads (-1) allowed
        protects: list[tuple[int | str, ...]],  # [B] each request's relax_protect
        tokenizer: Any | None,
        vocab_size: int,
    ) -> torch.Tensor | None:  # [B, K] bool, or None when no request protects anything
        """Drafts each request's relax_protect covers: they take the strict test."""
        out = None
        d = draft_token_ids.clamp(0, vocab_size - 1)
        for spec in {p for p in protects if p}:
            rows = torch.tensor([p == spec for p in protects], dtype=torch.bool).to(d.device)
            hit = self.protect_mask(spec, tokenizer, vocab_size, d.device)[d] & rows[:, None]
            out = hit if out is None else out | hit
        return out

    def protected_on(self, device: torch.device) -> torch.Tensor:  # [P] int64
        ids = self._protected_on.get(device)
        if ids is None:
            ids = self._protected_on[device] = self.protected_token_ids.to(device)
        return ids

    def is_protected(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [...] bool
        return torch.isin(token_ids, self.protected_on(token_ids.device))

    def initial_phase(self, prompt_token_ids: Sequence[int] | torch.Tensor) -> bool:
        return initial_phase(prompt_token_ids, self.think_start_id, self.think_end_id)

    def step_host(self, thinking: bool, token_id: int) -> tuple[bool, bool]:
        """(phase after token_id, whether it is a thinking token: emitted while thinking and not a
        marker), for one committed token on the host; the same rule as advance."""
        if token_id == self.think_start_id:
            return True, False
        if token_id == self.think_end_id:
            return False, False
        return thinking, thinking

    def over_budget(
        self,
        thinking: torch.Tensor,  # [B] bool
        num_thinking: torch.Tensor,  # [B] int64: thinking tokens committed so far
        budget: torch.Tensor,  # [B] int64: thinking_token_budget, -1 = none
        draft_token_ids: torch.Tensor,  # [B, K] int64
    ) -> torch.Tensor:  # [B, K+1] bool
        """True where row r of a verify window (the token after draft[:r]) must be the end marker:
        the phase there is thinking and the thinking tokens before it reach the budget. Counts
        along the drafts with the rule of step_host, on the device."""
        count = num_thinking[:, None]
        phase = thinking.bool()[:, None]
        if draft_token_ids.shape[1]:
            after = _phase_after(
                thinking.bool(), draft_token_ids, None, self.think_start_id, self.think_end_id, prefix=True
            )
            phase = torch.cat([phase, after], dim=1)  # [B, K+1]: phase before each row
            marker = (draft_token_ids == self.think_start_id) | (draft_token_ids == self.think_end_id)
            counted = (phase[:, :-1] & ~marker).long().cumsum(dim=1)
            count = torch.cat([count, count + counted], dim=1)
        return phase & (budget[:, None] >= 0) & (count >= budget[:, None])

    def phase_before(
        self,
        thinking: torch.Tensor,  # [B] bool
        draft_token_ids: torch.Tensor,  # [B, K] int64
    ) -> torch.Tensor:  # [B, K] bool: phase before each draft position
        if draft_token_ids.shape[1] == 0:
            return draft_token_ids.new_zeros(draft_token_ids.shape, dtype=torch.bool)
        after = _phase_after(
            thinking.bool(), draft_token_ids, None, self.think_start_id, self.think_end_id, prefix=True
        )
        return torch.cat([thinking.bool()[:, None], after[:, :-1]], dim=1)

    def relax_mask(
        self,
        thinking: torch.Tensor,  # [B] bool
        draft_token_ids: torch.Tensor,  # [B, K] int64, pads past num_draft_tokens
        num_draft_tokens: torch.Tensor,  # [B] int64
        enabled: torch.Tensor | None = None,  # [B] bool: request has relaxation on; None = all
    ) -> torch.Tensor:  # [B, K] bool
        """True where draft position i may take the relaxed test.

        Phase before i is thinking (a marker inside the window switches the later positions),
        i < num_draft_tokens, draft[i] is not protected, and the row has relaxation enabled.
        """
        k = draft_token_ids.shape[1]
        pos = torch.arange(k, device=draft_token_ids.device)
        mask = self.phase_before(thinking, draft_token_ids)
        mask &= pos[None, :] < num_draft_tokens[:, None]
        mask &= ~self.is_protected(draft_token_ids)
        if enabled is not None:
            mask &= enabled.bool()[:, None]
        return mask

    def advance(
        self,
        thinking: torch.Tensor,  # [B] bool
        token_ids: torch.Tensor,  # [B, N] int64: committed tokens, pads past num_tokens
        num_tokens: torch.Tensor,  # [B] int64
    ) -> torch.Tensor:  # [B] bool: phase after the first num_tokens[b] tokens of each row
        if token_ids.shape[1] == 0:
            return thinking.bool().clone()
        pos = torch.arange(token_ids.shape[1], device=token_ids.device)
        valid = pos[None, :] < num_tokens[:, None]
        return _phase_after(
            thinking.bool(), token_ids, valid, self.think_start_id, self.think_end_id, prefix=False
        )


def force_token(logits: torch.Tensor, rows: torch.Tensor, token_id: int) -> None:
    """In place: where rows [...] is true, logits [..., V] allow token_id only (any sampler, the
    greedy and the relaxed tests then emit it and accept no other draft)."""
    logits.masked_fill_(rows[..., None], float("-inf"))
    logits[..., token_id].masked_fill_(rows, 0.0)
