"""LLMEngine: requests in, RequestOutputs out, one scheduled forward + sample per step()."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from thinkspec.distributed.workers import TPWorkers
from thinkspec.engine.async_scheduling import InFlight, TokenCopies
from thinkspec.engine.factory import build_engine_parts
from thinkspec.engine.faults import recover_from_step_fault
from thinkspec.engine.parallel_sampling import ParentRequest, child_id, child_params
from thinkspec.engine.request_checks import check_prompt_input, check_stop_token_ids, token_vocab_size
from thinkspec.engine.sampling_extras import PromptRows, StepExtras, attach_step_logprobs, sample_with_extras
from thinkspec.engine.scheduler import SchedulerOutput, StepOutcome
from thinkspec.engine.sequence import Sequence
from thinkspec.engine.tp_worker import run_worker
from thinkspec.engine_args import EngineArgs
from thinkspec.models.loader import check_tensor_parallel_size
from thinkspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from thinkspec.sampling.logprobs import LogprobsTensors
from thinkspec.sampling.structured import compile_for_request
from thinkspec.sampling.structured import register as register_grammar
from thinkspec.sampling_params import SamplingParams, resolve_relax
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.utils import logger, resolve_device

PromptType = str | list[int] | Mapping[str, Any]


def start_tp_workers(config: EngineArgs) -> TPWorkers | None:
    """Ranks 1..N-1 of a tensor-parallel engine, started before rank 0 loads anything (every rank
    loads its own shards at once); None for tensor_parallel_size 1. The model's head counts are
    checked first, so a size that cannot split it fails here with a ValueError."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_tensor_parallel_size(config.model, size, "tensor_parallel_size")
    spec = config.speculative_config
    if spec is not None and spec.model is not None and config.draft_tp_size == size:
        check_tensor_parallel_size(spec.model, size, "draft_tensor_parallel_size")
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    return TPWorkers.start(size, config, device, run_worker)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def overlaps(async_scheduling: bool | None, device: torch.device) -> bool:
    """Whether an engine overlaps the host's work with the device's (EngineArgs.async_scheduling,
    None: on for CUDA): plain steps left in flight, and with a draft model each speculative step's
    next first draft forward run ahead."""
    return async_scheduling if async_scheduling is not None else device.type == "cuda"


class LLMEngine:
    def __init__(self, config: EngineArgs) -> None:
        self.config = config
        self.tp_workers = start_tp_workers(config)  # None without tensor parallelism
        try:
            parts = build_engine_parts(config)  # see factory.py for what each part is
        except BaseException as e:
            if self.tp_workers is None:
                raise
            workers, self.tp_workers = self.tp_workers, None
            error = e if isinstance(e, (ValueError, TypeError)) else workers.failure(e)
            workers.shutdown()
            if error is e:
                raise
            raise error from e
        if self.tp_workers is not None:  # the target's channel, shared by a split draft
            assert parts.model_runner.channel is not None
            parts.model_runner.channel.explain = self.tp_workers.failure
        m = parts.models
        self.device, self.model, self.model_info, self.tokenizer = m.device, m.model, m.info, m.tokenizer
        self._no_tokenizer = m.no_tokenizer
        self.eos_token_ids, self.draft_model, self.draft_info = m.eos_token_ids, m.draft_model, m.draft_info
        self.attention_backend, self.use_cuda_graphs = m.attention_backend, m.use_cuda_graphs
        self.configured_max_model_len, self.max_model_len = parts.configured_len, parts.max_model_len
        self.kv_capacity_tokens, self.graph_memory_bytes = parts.kv_capacity_tokens, parts.graph_memory_bytes
        self.model_runner, self.block_manager = parts.model_runner, parts.block_manager
        self.scheduler, self.sampler = parts.scheduler, parts.sampler
        self.reasoning, self.speculator = parts.reasoning, parts.speculator
        self._request_counter = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._parents: dict[str, ParentRequest] = {}  # requests with n > 1, by request id
        # adaptive_k's plain steps are the engine's own, so they may be left in flight too.
        self._adaptive = self.speculator is not None and self.speculator.planner.draft_length is not None
        overlap = overlaps(config.async_scheduling, self.device)
        self.async_scheduling = (self.speculator is None or self._adaptive) and overlap
        if self.speculator is not None:  # the next step's first draft forward runs ahead
            self.speculator.run_ahead = overlap and self.speculator.has_draft_model
        self._in_flight: InFlight | None = None
        self._copies = TokenCopies(config.max_num_seqs, self.device) if self.async_scheduling else None
        info = self.model_info
        logger.info(
            "engine ready: %s (%s, %s) on %s; KV pool %d blocks x %d tokens (%.1f MiB), max_model_len %d; "
            "attention %s, CUDA graphs %s",
            info.architecture, info.path.name, str(info.dtype).removeprefix("torch."), self.device,
            parts.num_blocks, config.block_size, parts.num_blocks * m.bytes_per_block / 2**20,
            self.max_model_len, self.attention_backend, "on" if self.use_cuda_graphs else "off",
        )  # fmt: skip

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); the engine cannot step after."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    # ---- requests -----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one request; returns its id. Raises ValueError for a prompt the engine cannot run
        (too long for max_model_len or the KV pool, empty, token ids outside the vocabulary)."""
        request_id = self.next_request_id() if request_id is None else request_id
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        check_prompt_input(prompt)
        text, token_ids = self.tokenize_prompt(prompt)
        self.check_prompt(request_id, token_ids)
        vocab = token_vocab_size(self.tokenizer, self.model_info.vocab_size)
        check_stop_token_ids(request_id, params, vocab)
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: logit_bias={bad} is outside the vocabulary [0, {vocab})"
            )
        if params.relaxed_thinking and (self.speculator is None or self.reasoning is None):
            raise ValueError(
                f"request {request_id!r}: relaxed_thinking=True needs speculative decoding with a reasoning "
                "parser (speculative_config with reasoning_parser or think_start/end tokens)"
            )
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ValueError(
                f"request {request_id!r}: thinking_token_budget needs a reasoning parser "
                "(reasoning_parser, or think_start/end tokens in speculative_config)"
            )
        spec = self.speculator.config if self.speculator is not None else None
        relax = resolve_relax(params, spec, f"request {request_id!r}")
        grammar = None if params.structured_outputs is None else compile_for_request(self, request_id, params)
        # The parser's starting phase, so relaxation covers exactly the text returned as reasoning.
        kwargs = prompt.get("chat_template_kwargs") if isinstance(prompt, Mapping) else None
        starts = self.reasoning is not None and self.reasoning.starts_in_thinking(token_ids, kwargs)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(
                    f"request {request_id!r}: {name}={value} must be in [0, {self.config.max_logprobs}] "
                    "(the engine's max_logprobs)"
                )
        if params.n > 1 and request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seqs = [
            Sequence(
                child_id(request_id, i) if params.n > 1 else request_id, token_ids,
                child_params(params, i) if params.n > 1 else params, prompt=text,
                eos_token_ids=self.eos_token_ids, has_draft=self.draft_model is not None,
                thinking=starts, starts_thinking=starts, relax=relax,
                parent_id=request_id if params.n > 1 else None, index=i,
            )
            for i in range(params.n)
        ]  # fmt: skip
        for seq in seqs if grammar is not None else ():
            register_grammar(seq, grammar)
        self.scheduler.add(seqs[0])
        if params.n > 1:
            self._parents[request_id] = ParentRequest(request_id, seqs, held=seqs[1:])
        return request_id

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) for a string, a token-id list or a vLLM-style dict."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"text prompts need a tokenizer, there is none ({self._no_tokenizer}): pass token ids"
                )
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if isinstance(prompt.get("prompt"), str):
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)) and all(_is_int(t) for t in prompt):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty (0 tokens)")
        if n > self.max_model_len:
            why = f"max_model_len={self.configured_max_model_len}"
            if self.kv_capacity_tokens < self.configured_max_model_len:
                why += f", KV cache capacity {self.kv_capacity_tokens} tokens"
            raise ValueError(
                f"request {request_id!r}: prompt has {n} tokens, more than the limit of "
                f"{self.max_model_len} ({why})"
            )
        vocab = token_vocab_size(self.tokenizer, self.model_info.vocab_size)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {request_id!r}: token id {bad} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its final output (finish_reason "abort", tokens so far) comes with the
        next step()."""
        parent = self._parents.get(request_id)
        seqs = parent.seqs if parent is not None else [self.scheduler.requests.get(request_id)]
        if parent is not None:
            for seq in parent.held:
                seq.finish("abort")
            parent.held = []
        aborted = None
        for target in seqs:
            if target is None or target.is_finished:
                continue
            flight = self._in_flight
            pending = flight is not None and any(p is target for _, p in flight.pending)
            seq = self.scheduler.abort(target.request_id, drop_pending=pending)  # with its in-flight token
            if seq is not None:
                if pending:
                    flight.drop(seq)
                aborted = seq
        if aborted is not None:
            self._pending_outputs.append(self.make_output(aborted))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending_outputs)
            or any(p.held for p in self._parents.values())
            or self._in_flight is not None
        )

    # ---- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """_step(), where an exception fails the requests that caused it and not the engine: see
        faults.recover_from_step_fault. Errors of the device itself are re-raised."""
        pending = list(self._pending_outputs)
        unfinished = list(self.scheduler.requests.values())
        try:
            outputs = self.run_step(finished_only)
            if self._adaptive and not self.scheduler.has_unfinished_requests():
                self.speculator.planner.forget_last_step()  # idle until the next request: no step's time
            return outputs
        except Exception as error:  # noqa: BLE001 - attributed to requests, or re-raised
            return recover_from_step_fault(self, error, finished_only, pending, unfinished)

    def run_step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Schedule, run the model, sample, commit. Returns outputs of requests that produced
        tokens or finished this step (cumulative text and token ids); with finished_only, of the
        requests that finished (what LLM.generate needs: no per-step copies of running outputs).

        With async_scheduling a plain step whose every sequence samples a token is left in flight:
        the next step() launches the following step first, feeding it those tokens on the device,
        and only then waits for them and commits them; its outputs come one step() later."""
        outputs, self._pending_outputs = self._pending_outputs, []
        for parent in self._parents.values():
            for seq in parent.release():
                self.scheduler.add(seq)
        flight = self._in_flight
        spec = self.speculator
        if flight is not None and not self._runs_ahead(flight):
            outputs += self._commit_in_flight(finished_only)
            flight = None
        # a step run ahead writes the draft's K/V at the bonus token's position: one slot more
        sched = self.scheduler.schedule(
            num_lookahead_tokens=spec.k + spec.run_ahead if spec is not None else 0
        )
        if spec is not None:  # adaptive_k: no request waits to take a finished row's place
            spec.planner.draining = not self.scheduler.waiting
        if sched.is_empty:
            if flight is not None:
                return outputs + self._commit_in_flight(finished_only)
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError(
                    f"no request fits the KV pool ({self.block_manager.num_free_blocks} of "
                    f"{self.block_manager.num_blocks} blocks free)"
                )
            return outputs
        if spec is not None:
            # adaptive_k with async scheduling: a step whose rows all draft 0 is the plain step below
            plain = flight is not None or (
                self._adaptive and self.async_scheduling
                and spec.planner.plan(sched.seqs, sched.num_new_tokens, sched.sample_mask())
            )  # fmt: skip
            if not plain:
                changed = self.scheduler.apply(sched, spec.step(sched))
                return outputs + self._outputs(changed, finished_only)
            spec.planner.record_plan()  # the plan's choice: all rows 0, counted as such
        return outputs + self._plain_step(sched, flight, finished_only)

    def _runs_ahead(self, flight: InFlight) -> bool:
        """Whether the next step may launch before the step in flight commits: it decodes the same
        sequences but those its tokens finish by length (Scheduler.run_ahead_rows) and, with
        adaptive_k, is a plain step too."""
        if not self.async_scheduling:
            return False
        rows = self.scheduler.run_ahead_rows([s for _, s in flight.pending])
        if rows is None:
            return False
        if self.speculator is None:
            return True
        n = len(rows)
        return self.speculator.planner.plan(rows, [1] * n, [True] * n)

    def settle_in_flight(self, finished_only: bool) -> list[RequestOutput]:
        """Commit a step left in flight, if any (fault recovery starts from committed state)."""
        return self._commit_in_flight(finished_only) if self._in_flight is not None else []

    def repair_pending(self) -> None:
        """Requests holding a pending token that no step in flight will deliver (a step failed
        while committing) drop it; their last input position is computed again."""
        flight = self._in_flight
        delivered = {id(seq) for _, seq in flight.pending} if flight is not None else set()
        for seq in list(self.scheduler.requests.values()):
            if id(seq) not in delivered:
                self.scheduler.rollback_pending(seq)

    def _plain_step(
        self, sched: SchedulerOutput, flight: InFlight | None, finished_only: bool
    ) -> list[RequestOutput]:
        """One forward + sample; with async scheduling, left in flight when every sequence samples
        and none asks for penalties or logprobs (those need the committed tokens on the host)."""
        sample_mask = sched.sample_mask()
        device_inputs = None
        if flight is not None:  # every sequence of this step decodes the token pending in flight
            assert self._copies is not None
            device_inputs = self._copies.feed(flight, sched.seqs)
        prompt_rows = PromptRows.build(sched.seqs, sched.num_new_tokens, sample_mask)
        num_logits = [int(m) for m in sample_mask] if prompt_rows is None else prompt_rows.num_logits
        logits = self.model_runner.execute_model(
            sched.seqs, sched.num_new_tokens, num_logits, device_inputs=device_inputs
        )  # [N, V] float32, one row per sampling sequence (and prompt rows for prompt_logprobs)
        prompt_lp = None
        if prompt_rows is not None:
            prompt_lp = prompt_rows.logprobs(logits)
            logits = logits[torch.tensor(prompt_rows.sample_rows, dtype=torch.long).to(logits.device)]
        sampled = [s for s, m in zip(sched.seqs, sample_mask) if m]
        tokens = extras = lp = None
        if sampled:
            think_end = self.reasoning.think_end_id if self.reasoning is not None else None
            tokens, extras, lp = sample_with_extras(self.sampler, logits, sampled, think_end)
        if (
            tokens is not None and self.async_scheduling and self._copies is not None and all(sample_mask)
            and extras is None and prompt_rows is None
        ):  # fmt: skip
            new_flight = self._copies.launch(tokens)
            outputs = self._commit_in_flight(finished_only) if flight is not None else []
            new_flight.pending = self.scheduler.launch_pending(sched)
            self._in_flight = new_flight
            return outputs
        assert flight is None  # a step after one in flight decodes every sequence
        outcomes = self._plain_outcomes(sched, sample_mask, tokens, extras, lp, prompt_rows, prompt_lp)
        return self._outputs(self.scheduler.apply(sched, outcomes), finished_only)

    def _plain_outcomes(
        self,
        sched: SchedulerOutput,
        sample_mask: list[bool],
        tokens: torch.Tensor | None,  # [S] int64
        extras: StepExtras | None,
        lp: LogprobsTensors | None,
        prompt_rows: PromptRows | None,
        prompt_lp: LogprobsTensors | None,
    ) -> list[StepOutcome]:
        """Bring tokens and logprobs to the host in one copy; one StepOutcome per scheduled sequence."""
        parts = [
            t
            for t in (tokens, lp.pack() if lp else None, prompt_lp.pack() if prompt_lp else None)
            if t is not None
        ]
        if not parts:
            host = np.zeros(0, dtype=np.int64)
        else:
            host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
        num_tokens = 0 if tokens is None else tokens.numel()
        it = iter(host[:num_tokens].tolist())
        outcomes = sched.plain_outcomes([[next(it)] if m else [] for m in sample_mask])
        sampled_index = [i for i, m in enumerate(sample_mask) if m]
        groups = [(extras if lp is not None else None, sampled_index, 1)]
        rows = prompt_rows if prompt_lp is not None else None
        attach_step_logprobs(outcomes, sched.seqs, groups, rows, host[num_tokens:], self.tokenizer)
        return outcomes

    def _commit_in_flight(self, finished_only: bool) -> list[RequestOutput]:
        """Wait for the in-flight step's tokens and commit them (one host sync)."""
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        tokens = TokenCopies.wait(flight)
        changed = [
            seq for row, seq in flight.pending
            if not seq.is_finished and self.scheduler.commit_pending(seq, tokens[row])
        ]  # fmt: skip
        return self._outputs(changed, finished_only)

    def _outputs(self, seqs: list[Sequence], finished_only: bool) -> list[RequestOutput]:
        outputs, parents = [], set()
        for s in seqs:
            if s.parent_id is not None:  # one output per request, however many of its sequences moved
                if s.parent_id in parents or (finished_only and not self._parents[s.parent_id].finished):
                    continue
                parents.add(s.parent_id)
            if s.is_finished or not finished_only or s.parent_id is not None:
                outputs.append(self.make_output(s))
        return outputs

    def make_output(self, seq: Sequence) -> RequestOutput:
        """Cumulative output of seq's request (all n completions when n > 1). reasoning_content /
        content are filled once a completion is finished (streaming consumers split deltas
        themselves with the parser's ReasoningStream)."""
        parent = self._parents.get(seq.parent_id) if seq.parent_id is not None else None
        seqs = parent.seqs if parent is not None else [seq]
        finished = all(s.is_finished for s in seqs)
        if self._adaptive:  # counts of plain steps that wait in the planner (DraftPlanner.settle)
            for s in seqs:
                self.speculator.planner.settle(s)
        metrics = parent.metrics() if parent is not None else seq.metrics
        if parent is not None and finished:
            del self._parents[parent.request_id]
        return RequestOutput(
            request_id=seq.parent_id or seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[self._completion(s) for s in seqs],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
            prompt_logprobs=list(seqs[0].prompt_logprobs) if seqs[0].prompt_logprobs is not None else None,
        )

    def _completion(self, seq: Sequence) -> CompletionOutput:
        logprobs = seq.output_logprobs
        completion = CompletionOutput(
            index=seq.index,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        if self.reasoning is not None and seq.is_finished:
            completion.reasoning_content, completion.content = self.reasoning.split(
                seq.output_text, seq.starts_thinking
            )
        return completion

    @staticmethod
    def error_output(request_id: str, prompt: str | None, token_ids: list[int], error: str) -> RequestOutput:
        """The output of a request that failed before it ran (finish_reason "error")."""
        now = time.monotonic()
        return RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
            finished=True,
            metrics=RequestMetrics(now, finished_time=now, num_prompt_tokens=len(token_ids)),
            error=error,
        )

    # ---- statistics ---------------------------------------------------------------------------

    @property
    def spec_metrics(self) -> SpecDecodeMetrics | None:
        """Cumulative speculative-decoding counters of this engine; None when not speculating."""
        return self.speculator.metrics if self.speculator is not None else None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self):
        return self.block_manager.stats
