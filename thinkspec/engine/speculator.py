"""The engine's speculative step: propose, verify B x (k+1) positions in one target forward, accept.

Stages of `Speculator.step`, in order, each a call:
  propose        _propose: the draft lengths (adaptive_k: DraftPlanner, spec_decode/planner.py), then the
                 proposer drafts up to k tokens for each decode sequence (Proposal)
  build          _build_verify_batch: VerifyBatch (engine/verify_batch.py), what the target computes
  run target     _run_target: one forward; prefill chunks and plain rows ride along with the windows
  split logits   _split_logits: plain rows, and the windows padded to [S, k+1, V] (windows_of)
  verify         _sample_plain samples the plain rows; _verify: relax mask from the phase tracker, then
                 rejection_sample (sampling/rejection.py)
  to host        _to_host: one copy of everything the host needs (HostPack)
  outcomes       _outcomes: a StepOutcome per scheduled sequence; Scheduler.postprocess commits them

For a decode sequence with N committed tokens and n drafts d_1..d_n the target scores
[t_{N-1}, d_1 .. d_n] at positions N-1 .. N-1+n; row i scores d_{i+1}, row n the bonus token. With a
accepted drafts the sequence commits d_1..d_a plus the correction/bonus token and its K/V pointer
moves to N + a: the slots of rejected drafts are overwritten later (no block churn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from thinkspec.config import SpeculativeConfig
from thinkspec.engine.compiles import compile_count
from thinkspec.engine.cuda_graph import MAX_CAPTURE_BATCH, graph_batch_sizes
from thinkspec.engine.model_runner import ModelRunner
from thinkspec.engine.sampling_extras import PromptRows, StepExtras, attach_step_logprobs, sample_with_extras
from thinkspec.engine.scheduler import SchedulerOutput, StepOutcome
from thinkspec.engine.sequence import Sequence, mask_stops_before_min_tokens
from thinkspec.engine.verify_batch import HostPack, VerifyBatch, windows_of
from thinkspec.engine.verify_rows import VerifyRows
from thinkspec.reasoning.parsers import ResolvedReasoning
from thinkspec.reasoning.tracker import force_token
from thinkspec.sampling.logprobs import LogprobsTensors
from thinkspec.sampling.rejection import AcceptanceBatch, RejectionResult, implied_tv, rejection_sample
from thinkspec.sampling.sampler import Sampler, SamplingTensors, mix_seed, process_logits
from thinkspec.spec_decode.draft_model import DraftModelProposer
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.ngram import NgramProposer
from thinkspec.spec_decode.planner import Choice, DraftPlanner, PlannerInputs, decode_rows, request_metrics
from thinkspec.spec_decode.proposer import Proposal, ProposalInput, Proposer

_NO_STOP_ID = -2  # pads per-request stop-id lists; never equal to a draft (drafts are >= -1)
# Rows up to which a step runs the next one's first draft forward ahead: the host's work between
# steps weighs most at small batches, and the logits it keeps ([rows, vocab] float32, 19 MiB at 32
# rows of Qwen3's vocabulary) stay outside the memory the KV pool was sized around.
RUN_AHEAD_MAX_ROWS = 32
# _verify's result: (RejectionResult, thinking_before [S, k] bool, the windows' extras, their logprobs)
_Verified = tuple[RejectionResult, torch.Tensor, StepExtras | None, LogprobsTensors | None]


@dataclass(slots=True)
class _Decided:
    """What a step decided on the device before its copy to the host."""

    plain_index: list[int]  # [P] batch positions of the plain sampled rows
    plain_tokens: torch.Tensor | None = None  # [P] int64
    plain_extras: StepExtras | None = None
    plain_lp: LogprobsTensors | None = None  # of the plain rows asking
    verified: _Verified | None = None  # None when no row speculates
    prompt_lp: LogprobsTensors | None = None

    def packed(self) -> list[torch.Tensor]:
        """The logprobs that ride along with the copy, flat int64: plain rows, windows, prompts."""
        spec_lp = self.verified[3] if self.verified is not None else None
        return [t.pack() for t in (self.plain_lp, spec_lp, self.prompt_lp) if t is not None]


def _budget(params) -> int:
    """thinking_token_budget as an int for the device, -1 = none."""
    return -1 if params.thinking_token_budget is None else min(params.thinking_token_budget, 2**53)


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
        tokenizer: Any | None = None,  # decodes the tokens of logprobs entries
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
        self.tokenizer = tokenizer
        self.tracker = reasoning.tracker() if reasoning is not None else None
        self.proposer: Proposer
        if draft_runner is not None:
            self.proposer = DraftModelProposer(draft_runner, sampler, self.k, vocab_size)
        else:
            lookup = (config.prompt_lookup_min or 1, config.prompt_lookup_max or 1)
            self.proposer = NgramProposer(self.k, *lookup, self.device)
        self.has_draft_model = draft_runner is not None
        self.draft_runner = draft_runner
        # Run the next step's first draft forward before committing this step's tokens (run_ahead);
        # the engine sets it from async_scheduling.
        self.run_ahead = False
        self.metrics = SpecDecodeMetrics()
        # adaptive_k's draft lengths (its draft_length None drafts k every step); Triton's compile count
        # is GPU-only
        buckets, compiles = graph_batch_sizes(MAX_CAPTURE_BATCH), compile_count
        if self.device.type != "cuda":
            compiles = lambda: None
        inputs = PlannerInputs(
            self.k, target_runner, draft_runner, buckets, self.tracker is not None, self.metrics,
            self.relax_enabled, self.tokens_left, compiles,
        )  # fmt: skip
        self.planner = DraftPlanner(inputs, config.adaptive_k)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed + 1)

    # ---- per-request settings ------------------------------------------------------------------

    def relax_enabled(self, seq: Sequence) -> bool:
        """Whether this request relaxes its thinking phase (resolved when it was added)."""
        return seq.relax.enabled

    def tokens_left(self, seq: Sequence) -> int:
        """The most tokens the request may still emit (max_tokens, max_model_len)."""
        room = self.max_model_len - seq.num_tokens
        max_tokens = seq.sampling_params.max_tokens
        return room if max_tokens is None else min(room, max_tokens - seq.num_output_tokens)

    # ---- the step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, sched: SchedulerOutput) -> list[StepOutcome]:
        """Run one speculative step over sched; one StepOutcome per scheduled sequence (batch order)."""
        seqs, sample_mask = sched.seqs, sched.sample_mask()
        choice, spec_index, proposal = self._propose(sched, sample_mask)
        k = proposal.draft_token_ids.shape[1]  # this step's window: k + 1 rows per speculating sequence
        prompt_rows = PromptRows.build(seqs, sched.num_new_tokens, sample_mask)
        batch = self._build_verify_batch(sched, sample_mask, spec_index, proposal, prompt_rows)
        logits = self._run_target(seqs, batch)  # [N, V] float32
        plain_rows, target = self._split_logits(logits, batch, k, sample_mask)
        decided = self._sample_plain(logits, plain_rows, batch, sample_mask, seqs)
        if prompt_rows is not None:
            decided.prompt_lp = prompt_rows.logprobs(logits, batch.row_starts())
        if target is not None:
            decided.verified = self._verify([seqs[i] for i in spec_index], target, proposal)
        packed = decided.packed()
        if choice is not None:
            self.planner.learn()  # while the device runs this step's forwards
        host = self._to_host(seqs, batch, proposal, decided, packed, k, prompt_rows)
        if choice is not None:
            self.planner.observe_windows(choice[2], batch.num_drafts, host.num_accepted)
        outcomes = self._outcomes(sched, sample_mask, batch, proposal, host)
        if packed:
            self._attach_logprobs(outcomes, seqs, batch, decided, k, prompt_rows, host.extra)
        return outcomes

    # ---- stages --------------------------------------------------------------------------------

    def _propose(
        self, sched: SchedulerOutput, sample_mask: list[bool]
    ) -> tuple[Choice | None, list[int], Proposal]:
        """propose: the draft lengths (adaptive_k's plan, else k capped by each request's room), then the
        drafts. Returns (adaptive_k's choice or None, spec_index [S], the proposal; with adaptive_k
        narrowed to the longest window)."""
        seqs, num_new = sched.seqs, sched.num_new_tokens
        planner, choice = self.planner, None
        if planner.draft_length is None:
            spec_index = decode_rows(seqs, num_new, sample_mask)
            max_drafts = [planner.max_drafts_for(seqs[i]) for i in spec_index]
        else:
            choice = planner.choice_for(seqs, num_new, sample_mask)
            spec_index, max_drafts = choice[0], choice[1]
            if not spec_index and choice[3].size == len(seqs):  # row_ks [R]: every row decodes
                # The plain decode step: the draft model catches up when its rows speculate again. No
                # window: width 1, as narrowing an empty proposal gives.
                return choice, [], Proposal(torch.empty(0, 1, dtype=torch.long, device=self.device), [])
        proposal = self.proposer.propose(ProposalInput(seqs, num_new, spec_index, max_drafts))
        if choice is not None:
            proposal = proposal.narrow(max(1, max(proposal.num_drafts, default=1)))
        return choice, spec_index, proposal

    @staticmethod
    def _build_verify_batch(
        sched: SchedulerOutput,
        sample_mask: list[bool],
        spec_index: list[int],
        proposal: Proposal,
        prompt_rows: PromptRows | None,
    ) -> VerifyBatch:
        """build: what the target computes for every scheduled sequence (VerifyBatch.build; a stage of
        its own, so that profilers can time it by its name)."""
        return VerifyBatch.build(sched, sample_mask, spec_index, proposal, prompt_rows)

    def _run_target(self, seqs: list[Sequence], batch: VerifyBatch) -> torch.Tensor:
        """run target: one forward of every scheduled sequence's inputs; logits [N, V] float32."""
        return self.target_runner.execute_model(
            seqs, batch.num_new, batch.num_logits, input_token_ids=batch.input_ids,
            device_inputs=batch.device_inputs,
        )  # fmt: skip

    @staticmethod
    def _split_logits(
        logits: torch.Tensor, batch: VerifyBatch, k: int, sample_mask: list[bool]
    ) -> tuple[list[int], torch.Tensor | None]:
        """split logits: the plain sampled rows' indexes [P] in logits [N, V], and the windows
        [S, k+1, V] (None when no row speculates)."""
        plain_rows, windows = batch.logits_rows(k, sample_mask)
        return plain_rows, windows_of(logits, windows) if batch.spec_index else None

    def _sample_plain(
        self,
        logits: torch.Tensor,
        rows: list[int],
        batch: VerifyBatch,
        sample_mask: list[bool],
        seqs: list[Sequence],
    ) -> _Decided:
        """Tokens, extras and logprobs of the plain sampled rows (prefills that end, first output
        tokens) from logits [N, V] at rows [P]."""
        spec_of = batch.spec_of
        decided = _Decided([i for i, m in enumerate(sample_mask) if m and i not in spec_of])
        if decided.plain_index:
            plain = logits[torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)]
            think_end = self.tracker.think_end_id if self.tracker is not None else None
            plain_seqs = [seqs[i] for i in decided.plain_index]
            sampled = sample_with_extras(self.sampler, plain, plain_seqs, think_end)
            decided.plain_tokens, decided.plain_extras, decided.plain_lp = sampled
        return decided

    def _to_host(
        self,
        seqs: list[Sequence],
        batch: VerifyBatch,
        proposal: Proposal,
        decided: _Decided,
        packed: list[torch.Tensor],  # flat int64 logprobs (_Decided.packed)
        k: int,
        prompt_rows: PromptRows | None,
    ) -> HostPack:
        """to host: one copy of it all; when this step may run the next one's forward 1 ahead, it is
        queued behind the copy (see DraftModelProposer.run_ahead)."""
        verified = decided.verified
        result, thinking_before = (verified[0], verified[1]) if verified is not None else (None, None)
        drafter = launch = None
        every_row = len(batch.spec_index) == len(seqs)
        if self.run_ahead and result is not None and every_row and prompt_rows is None:
            drafter = self._ahead_proposer(seqs, proposal)
        if drafter is not None:
            assert result is not None
            out, accepted = result.output_token_ids, result.num_accepted

            def launch() -> None:
                drafter.run_ahead(seqs, proposal.num_drafts, out, accepted)

        host = HostPack.fetch(decided.plain_tokens, result, thinking_before, k, packed, then=launch)
        if drafter is not None:
            drafter.settle_ahead(host.tokens, host.num_accepted)
        return host

    def _ahead_proposer(self, seqs: list[Sequence], proposal: Proposal) -> DraftModelProposer | None:
        """The draft proposer when this step, whose rows all speculate, may run the next step's forward
        1 ahead (DraftModelProposer.run_ahead), else None: every row drafted and holds KV slots up to
        the last position the forward may feed (one past its window: reserved with the step's), not
        every row may finish by length in this step (nothing would use the forward), and there are
        at most RUN_AHEAD_MAX_ROWS rows."""
        proposer = self.proposer
        if not isinstance(proposer, DraftModelProposer) or proposal.draft_computed is None:
            return None
        if len(seqs) > RUN_AHEAD_MAX_ROWS:
            return None
        block_size = proposer.runner.block_size
        stays = False
        for seq, m in zip(seqs, proposal.num_drafts):
            if m == 0 or len(seq.block_table) * block_size < seq.num_tokens + m + 1:
                return None
            stays = stays or self.tokens_left(seq) > m + 1  # it emits at most m + 1 tokens now
        return proposer if stays else None

    def _verify(
        self,
        seqs: list[Sequence],
        target: torch.Tensor,  # [S, k+1, V] float32
        proposal: Proposal,
    ) -> tuple[RejectionResult, torch.Tensor, StepExtras | None, LogprobsTensors | None]:
        """rejection_sample plus the phase bookkeeping; returns (result, thinking_before [S, k] bool,
        the windows' extras, logprobs [L*(k+1) rows] of those asking). Penalties apply to the target's
        rows before acceptance: row i as if drafts 1..i were kept."""
        drafts = proposal.draft_token_ids  # [S, k]
        params = [s.sampling_params for s in seqs]
        all_greedy = all(p.is_greedy for p in params)
        rows = VerifyRows(
            [VerifyRows.row(n, s, _budget(p)) for n, s, p in zip(proposal.num_drafts, seqs, params)],
            self.device,
        )
        num_drafts, thinking = rows.num_drafts, rows.thinking
        extras = StepExtras.build(seqs, target.shape[-1], self.device)
        raw = extras.raw_rows(target) if extras is not None else None
        if extras is not None:
            target = extras.penalise_windows(target, drafts, num_drafts)
        mask_stops_before_min_tokens(target, seqs)
        if not all_greedy:
            flat = target.view(-1, target.shape[-1])
            t = SamplingTensors.from_params([p for p in params for _ in range(target.shape[1])], self.device)
            target = process_logits(flat, t).view_as(target)
        if self.tracker is not None and any(p.thinking_token_budget is not None for p in params):
            # Past the budget a row allows only </think>: no other draft is accepted there and the
            # correction token is the end marker, as in plain decoding.
            over = self.tracker.over_budget(thinking, rows.thinking_tokens, rows.budget, drafts)
            force_token(target, over, self.tracker.think_end_id)
        relax_mask, thinking_before = self._relax_mask(seqs, drafts, num_drafts, thinking, rows.relax_on)
        if self.tracker is None:  # no markers: each draft is in its row's phase
            thinking_before = thinking[:, None].expand_as(drafts)
        seeds = None
        if not all_greedy:
            seeds = [
                int(self.rng.integers(2**62)) if p.seed is None else mix_seed(p.seed, s.num_output_tokens)
                for p, s in zip(params, seqs)
            ]
            seeds = torch.tensor(seeds, dtype=torch.long).to(self.device, non_blocking=True)
        # Sampled rows reach rejection_sample already scaled, so their temperature is 1, 0 = greedy.
        # Lenient / typical rows ride in the rule fields; without them the default kernels run.
        rules = rows.rule_fields() if VerifyRows.any_rule(seqs) else {}
        batch = AcceptanceBatch(
            target, drafts, num_drafts, relax_mask, rows.temperature, rows.ratio, rows.top_k, rows.delta,
            draft_probs=proposal.draft_probs, seeds=seeds, all_greedy=all_greedy, **rules,
        )  # fmt: skip
        result = rejection_sample(batch, self.generator)
        probe = getattr(self, "tv_probe", None)  # set by the sweep: the distortion each step implies
        if probe is not None:
            probe.append((implied_tv(batch).sum(), num_drafts.sum()))
        lp = extras.logprobs(raw, result.output_token_ids) if extras is not None else None
        return result, thinking_before, extras, lp

    def _relax_mask(
        self,
        seqs: list[Sequence],
        drafts: torch.Tensor,  # [S, k] int64
        num_drafts: torch.Tensor,  # [S] int64
        thinking: torch.Tensor,  # [S] bool
        enabled: torch.Tensor,  # [S] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(relax_mask [S, k] bool, thinking_before [S, k] bool): the tracker's per-token mask, minus
        each request's own stop token ids (protected like EOS) and its relax_protect tokens."""
        if self.tracker is None:
            none = torch.zeros_like(drafts, dtype=torch.bool)
            return none, none
        relax_mask = self.tracker.relax_mask(thinking, drafts, num_drafts, enabled)
        thinking_before = self.tracker.phase_before(thinking, drafts)
        stop_ids = [sorted(s.sampling_params.stop_token_ids) for s in seqs]
        if any(stop_ids):
            width = max(len(x) for x in stop_ids)
            pad = torch.tensor([x + [_NO_STOP_ID] * (width - len(x)) for x in stop_ids], dtype=torch.long)
            pad = pad.to(self.device, non_blocking=True)  # [S, W]
            relax_mask &= ~(drafts[:, :, None] == pad[:, None, :]).any(dim=2)
        # relax_protect (token ids, classes such as digits): those drafts take the strict test too.
        protects = [s.relax.protect if s.relax.enabled else () for s in seqs]
        protected = self.tracker.protected_drafts(drafts, protects, self.tokenizer, self.vocab_size)
        if protected is not None:
            relax_mask &= ~protected
        return relax_mask, thinking_before

    def _outcomes(
        self,
        sched: SchedulerOutput,
        sample_mask: list[bool],
        batch: VerifyBatch,
        proposal: Proposal,
        host: HostPack,
    ) -> list[StepOutcome]:
        """What the step did to each scheduled sequence; counts the step in the metrics."""
        spec_of = batch.spec_of
        step = None
        if batch.spec_index:
            nd = np.asarray(batch.num_drafts, dtype=np.int64)
            step = self.metrics.observe(nd, host.num_accepted, host.relaxed, host.thinking_before)
        outcomes: list[StepOutcome] = []
        plain_tokens = iter(host.plain_tokens)
        for i, (seq, n, m) in enumerate(zip(sched.seqs, sched.num_new_tokens, sample_mask)):
            b = spec_of.get(i)
            if b is None:
                tokens = [next(plain_tokens)] if m else []
                computed = seq.num_computed_tokens + n
            else:
                a = int(host.num_accepted[b])
                tokens = host.tokens[b, : a + 1].tolist()
                computed = seq.num_computed_tokens + 1 + a
                request_metrics(seq).observe_step(step, b)
            draft = None
            if proposal.draft_computed is not None:  # the draft's K/V never runs past the target's
                draft = min(proposal.draft_computed[i], computed)
            outcomes.append(StepOutcome(tokens, computed, draft))
        return outcomes

    def _attach_logprobs(
        self,
        outcomes: list[StepOutcome],
        seqs: list[Sequence],
        batch: VerifyBatch,
        decided: _Decided,
        k: int,
        prompt_rows: PromptRows | None,
        extra: np.ndarray,  # [X] int64, HostPack.extra
    ) -> None:
        """Give the outcomes of the requests asking for logprobs their entries, unpacked from extra."""
        verified = decided.verified
        spec_extras, spec_lp = (verified[2], verified[3]) if verified is not None else (None, None)
        groups = [
            (decided.plain_extras if decided.plain_lp else None, decided.plain_index, 1),
            (spec_extras if spec_lp else None, batch.spec_index, k + 1),
        ]
        attach_step_logprobs(outcomes, seqs, groups, prompt_rows, extra, self.tokenizer)
