"""One speculative step: propose, verify B x (k+1) positions in one target forward, accept, commit.

Decode sequences of the step (one new token, at the end of their known tokens) speculate; prefill
chunks ride along in the same target forward unchanged. For a decode sequence with N committed
tokens and n drafts d_1..d_n the target scores [t_{N-1}, d_1 .. d_n] at positions N-1 .. N-1+n;
row i scores d_{i+1}, row n the bonus token. With a accepted drafts the sequence commits
d_1..d_a plus the correction/bonus token, and its KV pointer moves to N + a: the slots of the
rejected drafts are simply overwritten later (no block churn).

Everything the host needs from the device (tokens, acceptance counts, relaxed flags, phases) comes
back in one copy per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from thinkspec.config import SpeculativeConfig
from thinkspec.engine.model_runner import ModelRunner
from thinkspec.engine.scheduler import SchedulerOutput
from thinkspec.engine.sequence import Sequence, mask_stops_before_min_tokens
from thinkspec.reasoning.parsers import ResolvedReasoning
from thinkspec.sampling.rejection import RejectionResult, rejection_sample
from thinkspec.sampling.sampler import (
    Sampler,
    SamplingTensors,
    apply_temperature,
    apply_top_k_top_p_min_p,
    mix_seed,
)
from thinkspec.spec_decode.draft_model import DraftModelProposer
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.ngram import ngram_propose


@dataclass(slots=True)
class SpecStepResult:
    """Host-side outcome of one step, one entry per scheduled sequence (batch order)."""

    token_ids: list[list[int]]  # tokens to commit (empty for a mid-prompt chunk)
    num_computed: list[int]  # tokens whose target KV is now valid (replaces num_new_tokens)


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        target_runner: ModelRunner,
        draft_runner: ModelRunner | None,
        reasoning: ResolvedReasoning | None,
        sampler: Sampler,
        vocab_size: int,
        max_model_len: int,
        seed: int,
    ) -> None:
        if config.num_speculative_tokens is None:
            raise ValueError("SpeculativeConfig.num_speculative_tokens is required to speculate")
        self.config = config
        self.k = config.num_speculative_tokens
        self.target_runner = target_runner
        self.device = target_runner.device
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tracker = reasoning.tracker() if reasoning is not None else None
        self.proposer = (
            DraftModelProposer(draft_runner, sampler, self.k, vocab_size)
            if draft_runner is not None
            else None
        )
        self.metrics = SpecDecodeMetrics()
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + 1)

    # ---- per-request settings ------------------------------------------------------------------

    def relax_settings(self, seq: Sequence) -> tuple[bool, float, int, float]:
        """(enabled, ratio, top_k, delta or NaN) for one request: its overrides, else the config."""
        p, c = seq.sampling_params, self.config
        enabled = c.relaxed_thinking if p.relaxed_thinking is None else p.relaxed_thinking
        ratio = c.relax_ratio if p.relax_ratio is None else p.relax_ratio
        top_k = c.relax_top_k if p.relax_top_k is None else p.relax_top_k
        delta = c.relax_delta if p.relax_delta is None else p.relax_delta
        return bool(enabled), float(ratio), int(top_k), math.nan if delta is None else float(delta)

    def num_drafts_for(self, seq: Sequence) -> int:
        """Drafts worth proposing: no more than the tokens the request may still emit, minus the bonus."""
        p = seq.sampling_params
        room = self.max_model_len - seq.num_tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens)
        return max(0, min(self.k, room - 1))

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, sched: SchedulerOutput) -> SpecStepResult:
        seqs, num_new = sched.seqs, sched.num_new_tokens
        sample_mask = sched.sample_mask()
        # Decodes speculate; a request's first output token is always sampled plainly (whether its
        # prompt came from the cache or not), so seeded outputs do not depend on the schedule.
        spec_index = [
            i
            for i, (seq, n, m) in enumerate(zip(seqs, num_new, sample_mask))
            if m and n == 1 and seq.num_output_tokens > 0
        ]
        num_drafts = [self.num_drafts_for(seqs[i]) for i in spec_index]
        k, device = self.k, self.device

        host_drafts: list[list[int]] | None = None
        draft_probs = None
        if self.proposer is not None:
            drafts, draft_probs = self.proposer.propose(seqs, num_new, spec_index, num_drafts)
        elif spec_index:
            host_drafts, num_drafts = self._propose_ngram([seqs[i] for i in spec_index], num_drafts)
            drafts = torch.full((len(spec_index), k), -1, dtype=torch.long)
            for b, row in enumerate(host_drafts):
                drafts[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            drafts = drafts.to(device, non_blocking=True)
        else:
            drafts = torch.empty(0, k, dtype=torch.long, device=device)

        # Target forward over prefill chunks + verify windows.
        spec_of = {i: b for b, i in enumerate(spec_index)}
        t_num, t_logits, t_inputs = [], [], []
        dev_pos: list[int] = []  # packed input positions that take a device-side draft token
        dev_src: list[int] = []  # flat index into drafts [S*k]
        offset = 0
        for i, (seq, n, m) in enumerate(zip(seqs, num_new, sample_mask)):
            b = spec_of.get(i)
            if b is None:
                t_num.append(n)
                t_logits.append(int(m))
                t_inputs.append(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
            else:
                nd = num_drafts[b]
                t_num.append(1 + nd)
                t_logits.append(1 + nd)
                if host_drafts is not None:
                    t_inputs.append([seq.last_token_id, *host_drafts[b]])
                else:
                    t_inputs.append([seq.last_token_id] + [0] * nd)
                    dev_pos.extend(range(offset + 1, offset + 1 + nd))
                    dev_src.extend(range(b * k, b * k + nd))
            offset += t_num[-1]
        device_tokens = None
        if dev_pos:
            index = torch.tensor(dev_pos, dtype=torch.long).to(device, non_blocking=True)
            src = torch.tensor(dev_src, dtype=torch.long).to(device, non_blocking=True)
            device_tokens = (index, drafts.view(-1)[src])
        logits = self.target_runner.execute_model(
            seqs, t_num, t_logits, input_token_ids=t_inputs, device_tokens=device_tokens
        )  # [N, V] float32

        # Split the logits rows: plain sampled rows and the spec rows padded to [S, k+1, V].
        plain_rows: list[int] = []
        spec_rows = np.zeros((len(spec_index), k + 1), dtype=np.int64)
        row = 0
        for i, nl in enumerate(t_logits):
            b = spec_of.get(i)
            if b is None:
                if nl:
                    plain_rows.append(row)
            else:
                spec_rows[b, :nl] = np.arange(row, row + nl)
                spec_rows[b, nl:] = row  # padding rows: any valid row, never read as a decision
            row += nl

        plain_seqs = [seqs[i] for i, m in enumerate(sample_mask) if m and i not in spec_of]
        parts: list[torch.Tensor] = []
        if plain_seqs:
            plain_logits = logits[torch.tensor(plain_rows, dtype=torch.long).to(device, non_blocking=True)]
            mask_stops_before_min_tokens(plain_logits.unsqueeze(1), plain_seqs)
            parts.append(
                self.sampler(
                    plain_logits,
                    [s.sampling_params for s in plain_seqs],
                    [s.num_output_tokens for s in plain_seqs],
                )
            )
        num_spec = len(spec_index)
        if num_spec:
            spec_seqs = [seqs[i] for i in spec_index]
            target = logits[torch.from_numpy(spec_rows).to(device, non_blocking=True)]  # [S, k+1, V]
            result, phase_before, thinking_after = self._verify(
                spec_seqs, target, drafts, num_drafts, draft_probs
            )
            pack = torch.cat(
                [
                    result.output_token_ids,
                    result.num_accepted[:, None],
                    result.relaxed_accepted.long(),
                    phase_before.long(),
                    thinking_after.long()[:, None],
                ],
                dim=1,
            )  # [S, 3k + 3]
            parts.append(pack.flatten())
        host = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, dtype=np.int64)

        plain_tokens = host[: len(plain_seqs)].tolist()
        spec_host = host[len(plain_seqs) :].reshape(num_spec, 3 * k + 3)
        out_tokens = spec_host[:, : k + 1]
        num_accepted = spec_host[:, k + 1]
        if num_spec:
            nd_host = np.asarray(num_drafts, dtype=np.int64)
            step = self.metrics.observe(
                nd_host,
                num_accepted,
                spec_host[:, k + 2 : 2 * k + 2].astype(bool),
                spec_host[:, 2 * k + 2 : 3 * k + 2].astype(bool),
            )
        token_ids: list[list[int]] = []
        computed: list[int] = []
        it = iter(plain_tokens)
        for i, (seq, n, m) in enumerate(zip(seqs, num_new, sample_mask)):
            b = spec_of.get(i)
            if b is None:
                token_ids.append([next(it)] if m else [])
                computed.append(n)
                if m and self.tracker is not None:  # e.g. the model's own <think> right after the prompt
                    tok = token_ids[-1][0]
                    if tok in (self.tracker.think_start_id, self.tracker.think_end_id):
                        seq.thinking = tok == self.tracker.think_start_id
                continue
            a = int(num_accepted[b])
            token_ids.append(out_tokens[b, : a + 1].tolist())
            computed.append(1 + a)
            seq.thinking = bool(spec_host[b, 3 * k + 2])
            seq.num_draft_computed_tokens = min(
                seq.num_draft_computed_tokens, seq.num_computed_tokens + 1 + a
            )
            if seq.metrics.spec_decode is None:
                seq.metrics.spec_decode = SpecDecodeMetrics()
            seq.metrics.spec_decode.observe_step(step, b)
        return SpecStepResult(token_ids, computed)

    # ---- pieces --------------------------------------------------------------------------------

    def _propose_ngram(self, seqs: list[Sequence], caps: list[int]) -> tuple[list[list[int]], list[int]]:
        """Prompt lookup over each sequence's own tokens, on the host (where the tokens live)."""
        c = self.config
        width = max(s.num_tokens for s in seqs)
        tokens = np.full((len(seqs), width), -1, dtype=np.int64)
        for b, s in enumerate(seqs):
            tokens[b, : s.num_tokens] = s.token_ids
        lens = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)
        drafts, num = ngram_propose(
            torch.from_numpy(tokens), lens, self.k, c.prompt_lookup_min or 1, c.prompt_lookup_max or 1
        )
        num_l = [min(int(n), cap) for n, cap in zip(num.tolist(), caps)]
        return [drafts[b, :n].tolist() for b, n in enumerate(num_l)], num_l

    def _verify(
        self,
        seqs: list[Sequence],
        target: torch.Tensor,  # [S, k+1, V] float32
        drafts: torch.Tensor,  # [S, k] int64
        num_drafts: list[int],
        draft_probs: torch.Tensor | None,  # [S, k, V] float32 or None
    ) -> tuple[RejectionResult, torch.Tensor, torch.Tensor]:
        """rejection_sample plus the phase bookkeeping; returns (result, phase_before [S,k], thinking [S])."""
        device, k = self.device, self.k
        num_spec = len(seqs)
        params = [s.sampling_params for s in seqs]
        settings = [self.relax_settings(s) for s in seqs]
        all_greedy = all(p.is_greedy for p in params)
        host = torch.tensor(
            [
                [
                    float(n),
                    float(en),
                    ratio,
                    float(top_k),
                    delta,
                    float(s.thinking),
                    0.0 if p.is_greedy else 1.0,
                ]
                for n, (en, ratio, top_k, delta), s, p in zip(num_drafts, settings, seqs, params)
            ],
            dtype=torch.float64,
        )
        dev = host.to(device, non_blocking=True)
        num_drafts_t = dev[:, 0].long()
        enabled = dev[:, 1].bool()
        thinking = dev[:, 5].bool()

        mask_stops_before_min_tokens(target, seqs)
        temperature = dev[:, 6].float()
        if not all_greedy:
            t = SamplingTensors.from_params(params, device)
            flat = target.view(num_spec * (k + 1), -1)
            rep = lambda x: x.repeat_interleave(k + 1)  # noqa: E731
            scaled = apply_temperature(flat, rep(t.temperature))
            filtered = apply_top_k_top_p_min_p(
                scaled,
                rep(t.top_k) if t.any_top_k else None,
                rep(t.top_p) if t.any_top_p else None,
                rep(t.min_p) if t.any_min_p else None,
            ).view_as(target)
            # Sampled rows arrive scaled and filtered, so the sampler sees temperature 1 there.
            target = torch.where(t.greedy.view(-1, 1, 1), target, filtered)

        if self.tracker is not None:
            relax_mask = self.tracker.relax_mask(thinking, drafts, num_drafts_t, enabled)
            phase_before = self.tracker.phase_before(thinking, drafts)
        else:
            relax_mask = torch.zeros_like(drafts, dtype=torch.bool)
            phase_before = relax_mask
        stop_ids = [sorted(s.sampling_params.stop_token_ids) for s in seqs]
        if any(stop_ids):  # request-level stop tokens are protected too
            width = max(len(x) for x in stop_ids)
            pad = torch.tensor([x + [-2] * (width - len(x)) for x in stop_ids], dtype=torch.long).to(
                device, non_blocking=True
            )
            relax_mask &= ~(drafts[:, :, None] == pad[:, None, :]).any(dim=2)

        seeds = None
        if not all_greedy:
            seeds = torch.tensor(
                [
                    mix_seed(p.seed, s.num_output_tokens)
                    if p.seed is not None
                    else int(self.rng.integers(2**62))
                    for p, s in zip(params, seqs)
                ],
                dtype=torch.long,
            ).to(device, non_blocking=True)
        result = rejection_sample(
            target,
            drafts,
            num_drafts_t,
            relax_mask,
            temperature,
            dev[:, 2].float(),
            dev[:, 3].long(),
            dev[:, 4].float(),
            draft_probs,
            self.generator,
            seeds=seeds,
            all_greedy=all_greedy,
        )
        rate = self.config.synthetic_acceptance_rate
        if rate is not None:
            result = self._synthetic(result, target, drafts, num_drafts_t, rate)
        thinking_after = (
            self.tracker.advance(thinking, result.output_token_ids, result.num_accepted + 1)
            if self.tracker is not None
            else thinking
        )
        return result, phase_before, thinking_after

    def _synthetic(
        self,
        result: RejectionResult,
        target: torch.Tensor,  # [S, k+1, V]
        drafts: torch.Tensor,  # [S, k]
        num_drafts: torch.Tensor,  # [S]
        rate: float,
    ) -> RejectionResult:
        """Benchmark mode: draft i is accepted with probability `rate` regardless of the models."""
        num_spec, k = drafts.shape
        u = torch.rand(num_spec, k, generator=self.generator, device=drafts.device)
        pos = torch.arange(k, device=drafts.device)
        ok = (u < rate) & (pos[None, :] < num_drafts[:, None])
        num_accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)  # [S]
        emitted = target.argmax(dim=-1).gather(1, num_accepted[:, None])  # [S, 1]
        out = torch.full((num_spec, k + 1), -1, dtype=torch.long, device=drafts.device)
        out[:, :k] = torch.where(pos[None, :] < num_accepted[:, None], drafts, -1)
        out.scatter_(1, num_accepted[:, None], emitted)
        return RejectionResult(out, num_accepted, torch.zeros_like(result.relaxed_accepted))
