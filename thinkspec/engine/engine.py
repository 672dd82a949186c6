"""LLMEngine: requests in, RequestOutputs out, one scheduled forward + sample per step()."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from thinkspec.config import SpeculativeConfig
from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.cuda_graph import GraphSpec, graph_batch_sizes
from thinkspec.engine.faults import recover_from_step_fault
from thinkspec.engine.model_runner import (
    ModelRunner,
    determine_kv_cache_memory,
    kv_cache_bytes_per_block,
    measure_cuda_graph_memory,
    use_triton_kernels,
)
from thinkspec.engine.request_checks import check_prompt_input, check_stop_token_ids, token_vocab_size
from thinkspec.engine.scheduler import Scheduler, SchedulerOutput
from thinkspec.engine.sequence import Sequence, mask_stops_before_min_tokens
from thinkspec.models.loader import LOAD_FORMATS
from thinkspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from thinkspec.sampling.sampler import Sampler
from thinkspec.sampling_params import SamplingParams
from thinkspec.spec_decode.draft_model import check_draft_compatible
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.speculator import Speculator
from thinkspec.utils import logger, resolve_device

PromptType = str | list[int] | Mapping[str, Any]
PENDING_TOKEN = -1  # stands for a sampled token still on its way to the host (never an input)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend an attention_backend setting means on device: "auto" is "triton" on CUDA and
    "torch" elsewhere; "torch" and "triton" stand for themselves."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; validated at construction (ValueError names the field, value and range).

    max_model_len: longest prompt + output; default the model's max_position_embeddings, capped
        by the KV pool's capacity. Prompts longer than min(max_model_len, KV capacity) fail.
    max_num_batched_tokens: token budget of one forward; longer prompts are prefilled in chunks.
    kv_cache_memory: bytes for the KV pool (default 256 MiB on CPU; on GPU it overrides
        gpu_memory_utilization).
    attention_backend: "auto" (default: "triton" on CUDA, "torch" elsewhere), "torch" (the
        reference) or "triton" (CUDA, or TRITON_INTERPRET=1); "triton" also runs the models' norms,
        residual adds, rotary and SiLU * up as fused Triton kernels (layers/fused_triton.py).
    enforce_eager: never use CUDA graphs (vLLM's flag). Otherwise decode, verification and draft
        steps replay CUDA graphs when the device is CUDA and the attention backend is Triton.
    async_scheduling: let a plain (non-speculative) decode step start on the device before the
        previous step's tokens reach the host, which then commits them while the device works (as
        vLLM's flag); outputs are unchanged. None (default): on for CUDA without speculative
        decoding, off otherwise; True with speculative decoding is refused.
    """

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    reasoning_parser: str | None = None
    speculative_config: Any = None  # SpeculativeConfig | dict | JSON str | None
    load_format: str = "auto"  # "dummy": random weights from config.json alone (speed benchmarks)
    skip_tokenizer_init: bool = False  # token ids in and out only (no text, chat or reasoning split)
    attention_backend: str = "auto"  # "auto" | "torch" (reference) | "triton" (CUDA, or TRITON_INTERPRET=1)
    enforce_eager: bool = False
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint folder or hub id, got {self.model!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ValueError(f"tokenizer must be a path / hub id or None, got {self.tokenizer!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 or None, got {self.max_model_len!r}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if not _is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}"
            )
        if not _is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or isinstance(util, bool) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        kv = self.kv_cache_memory
        if kv is not None and (not _is_int(kv) or kv < 1):
            raise ValueError(f"kv_cache_memory must be a number of bytes >= 1 or None, got {kv!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.reasoning_parser is not None:
            from thinkspec.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # raises ValueError listing the known names
        self.speculative_config = _parse_speculative_config(self.speculative_config, self.reasoning_parser)
        if not isinstance(self.skip_tokenizer_init, bool):
            raise ValueError(f"skip_tokenizer_init must be a bool, got {self.skip_tokenizer_init!r}")
        if self.skip_tokenizer_init and self.reasoning_parser is not None:
            raise ValueError(
                "reasoning_parser needs the tokenizer; it cannot be used with skip_tokenizer_init"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if (
            self.attention_backend == "triton"
            and resolve_device(self.device).type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1), "
                f"got device={self.device!r}"
            )
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError(
                "async_scheduling=True is not supported with speculative decoding (leave it None)"
            )


def _parse_speculative_config(value: Any, reasoning_parser: str | None) -> SpeculativeConfig | None:
    """SpeculativeConfig.parse, where the engine's reasoning parser stands in for one the speculative
    config does not name (as with vLLM's separate --reasoning-parser flag)."""
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config JSON is invalid: {exc}; got {value!r}") from None
    if (
        isinstance(value, Mapping)
        and reasoning_parser is not None
        and value.get("reasoning_parser") is None
        and value.get("think_start_token") is None
    ):
        value = {**value, "reasoning_parser": reasoning_parser}
    return SpeculativeConfig.parse(dict(value) if isinstance(value, Mapping) else value)


@dataclass(slots=True)
class _InFlight:
    """A plain step launched on the device whose sampled tokens the host has not committed yet.

    Each pending (row, seq) got PENDING_TOKEN appended to its token_ids when the step was launched
    (so the scheduler schedules its next position as usual); committing replaces it."""

    tokens: torch.Tensor  # [S] int64 on the device: row i is the token sampled for batch row i
    host: torch.Tensor  # [S] int64: the host copy of tokens (pinned, filled by a non-blocking copy)
    done: torch.cuda.Event | None  # recorded after the copy (None on CPU: tokens is the host copy)
    pending: list[tuple[int, Sequence]] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        from thinkspec.models.loader import load_model

        self.config = config
        self.device = resolve_device(config.device)
        self.model, self.model_info = load_model(config.model, config.dtype, self.device, config.load_format)
        info = self.model_info
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else AutoTokenizer.from_pretrained(config.tokenizer or str(info.path))
        )
        eos = list(info.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in eos:
            eos.append(tok_eos)
        self.eos_token_ids = frozenset(eos)

        if config.max_model_len is not None and config.max_model_len > info.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings "
                f"({info.max_position_embeddings})"
            )
        self.model_len = model_len = config.max_model_len or info.max_position_embeddings

        self.bytes_per_block = kv_cache_bytes_per_block(
            info.num_layers, config.block_size, info.num_kv_heads, info.head_dim, info.dtype
        )
        spec = config.speculative_config
        self.draft_model = self.draft_info = None
        if spec is not None and spec.method == "draft_model":  # loaded before sizing: its weights count
            assert spec.model is not None
            self.draft_model, self.draft_info = load_model(
                spec.model, info.dtype, self.device, config.load_format
            )
            check_draft_compatible(self.tokenizer, info, self.draft_info)
            d = self.draft_info
            # Both pools share the block tables, so one block costs the sum of the two.
            self.bytes_per_block += kv_cache_bytes_per_block(
                d.num_layers, config.block_size, d.num_kv_heads, d.head_dim, d.dtype
            )
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        if self.attention_backend == "triton":
            for model in (m for m in (self.model, self.draft_model) if m is not None):
                use_triton_kernels(model)
        self.use_cuda_graphs = (
            self.device.type == "cuda" and not config.enforce_eager and self.attention_backend == "triton"
        )
        # Query widths: target decode 1, verify windows 1 + drafts (<= k+1); the draft's catch-up
        # forward 1 or 2 and its per-token steps 1.
        self._lookahead = lookahead = (spec.num_speculative_tokens or 0) if spec is not None else 0
        self._target_widths = (1,) if not lookahead else tuple(sorted({1, 2, lookahead + 1}))
        self._draft_widths = (1, 2)
        self.graph_memory_bytes = 0
        if self.use_cuda_graphs and config.kv_cache_memory is None:
            # In the order the runners first capture: a speculative step runs the draft first.
            probe = [(self.model, info, self._graph_spec(self._target_widths, model_len, None))]
            if self.draft_model is not None:
                draft_spec = self._graph_spec(self._draft_widths, model_len, None)
                probe.insert(0, (self.draft_model, self.draft_info, draft_spec))
            self.graph_memory_bytes = measure_cuda_graph_memory(
                probe, block_size=config.block_size, device=self.device
            )

        kv_bytes = determine_kv_cache_memory(
            self.model,
            device=self.device,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory=config.kv_cache_memory,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=model_len,
            max_num_seqs=config.max_num_seqs,
            vocab_size=info.vocab_size,
            reserved_bytes=self.graph_memory_bytes,
        )
        num_blocks = kv_bytes // self.bytes_per_block
        # More blocks than every running sequence at full length twice over only feed the prefix
        # cache, and the host bookkeeping grows with them (tiny models on big GPUs).
        max_useful = 2 * config.max_num_seqs * -(-model_len // config.block_size)
        if num_blocks > max_useful and config.kv_cache_memory is None:
            logger.info("KV pool capped at %d blocks (memory for %d)", max_useful, num_blocks)
            num_blocks = max_useful
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={kv_bytes} bytes holds no KV block; one block of {config.block_size} "
                f"tokens needs {self.bytes_per_block} bytes"
            )
        self.kv_capacity_tokens = num_blocks * config.block_size
        # Longest prompt + output any request may reach.
        self.max_model_len = min(model_len, self.kv_capacity_tokens)
        if config.max_model_len is not None and config.max_model_len > self.kv_capacity_tokens:
            logger.warning(
                "max_model_len=%d exceeds the KV cache capacity of %d tokens; requests are capped there",
                config.max_model_len, self.kv_capacity_tokens,
            )  # fmt: skip

        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None  # shared by all graphs
        self.model_runner = ModelRunner.for_model(
            self.model,
            info,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=self.device,
            graphs=self._graph_spec(self._target_widths, self.max_model_len, pool),
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
        )
        self.sampler = Sampler(config.seed, self.device)
        self.reasoning = None
        protect = tuple(sorted(self.eos_token_ids))
        if spec is not None and spec.build_reasoning_parser() is not None:
            self.reasoning = spec.resolve_reasoning(self.tokenizer, extra_protected_token_ids=protect)
        elif config.reasoning_parser is not None:
            from thinkspec.reasoning import get_reasoning_parser

            self.reasoning = get_reasoning_parser(config.reasoning_parser).resolve(
                self.tokenizer, extra_protected_token_ids=protect
            )
        self.speculator: Speculator | None = None
        if spec is not None:
            draft_runner = None
            if self.draft_model is not None:
                draft_runner = ModelRunner.for_model(
                    self.draft_model,
                    self.draft_info,
                    num_blocks=num_blocks,
                    block_size=config.block_size,
                    device=self.device,
                    graphs=self._graph_spec(self._draft_widths, self.max_model_len, pool),
                )
            self.speculator = Speculator(
                spec,
                target_runner=self.model_runner,
                draft_runner=draft_runner,
                reasoning=self.reasoning,
                sampler=self.sampler,
                vocab_size=info.vocab_size,
                max_model_len=self.max_model_len,
                seed=config.seed,
            )
        self._request_counter = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.async_scheduling = self.speculator is None and (
            config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        )
        self._in_flight: _InFlight | None = None
        if self.async_scheduling:
            pin = self.device.type == "cuda"
            # Two host buffers: a step's tokens land in one while the previous step's are read.
            self._token_host = [
                torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in "ab"
            ]
            self._row_index = torch.arange(config.max_num_seqs, device=self.device)
        logger.info(
            "engine ready: %s (%s, %s) on %s; KV pool %d blocks x %d tokens (%.1f MiB), max_model_len %d; "
            "attention %s, CUDA graphs %s",
            info.architecture, info.path.name, str(info.dtype).removeprefix("torch."), self.device,
            num_blocks, config.block_size, num_blocks * self.bytes_per_block / 2**20, self.max_model_len,
            self.attention_backend, "on" if self.use_cuda_graphs else "off",
        )  # fmt: skip

    def _graph_spec(self, widths: tuple[int, ...], max_model_len: int, pool: object) -> GraphSpec | None:
        """What a runner captures (None: no graphs): widths x buckets up to max_num_seqs, block tables
        wide enough for max_model_len plus the speculative lookahead slots."""
        if not self.use_cuda_graphs:
            return None
        return GraphSpec(
            query_widths=widths,
            batch_sizes=graph_batch_sizes(self.config.max_num_seqs),
            max_model_len=max_model_len,
            max_blocks_per_seq=-(-(max_model_len + self._lookahead) // self.config.block_size),
            pool=pool,
        )

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
        check_stop_token_ids(request_id, params, token_vocab_size(self.tokenizer, self.model_info.vocab_size))
        if params.relaxed_thinking and (self.speculator is None or self.reasoning is None):
            raise ValueError(
                f"request {request_id!r}: relaxed_thinking=True needs speculative decoding with a reasoning "
                "parser (speculative_config with reasoning_parser or think_start/end tokens)"
            )
        seq = Sequence(request_id, token_ids, params, prompt=text, eos_token_ids=self.eos_token_ids)
        seq.has_draft = self.draft_model is not None
        if self.reasoning is not None:
            seq.thinking = self.reasoning.initial_phase(token_ids)
        self.scheduler.add(seq)
        return request_id

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids) for a string, a token-id list or a vLLM-style dict."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need the tokenizer (skip_tokenizer_init=True): pass token ids")
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
            why = f"max_model_len={self.model_len}"
            if self.kv_capacity_tokens < self.model_len:
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
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            flight = self._in_flight
            if flight is not None and any(p is seq for _, p in flight.pending):
                seq.token_ids.pop()  # its in-flight token is dropped with it
                flight.pending = [(r, p) for r, p in flight.pending if p is not seq]
            self._pending_outputs.append(self.make_output(seq))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending_outputs)
            or self._in_flight is not None
        )

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished_requests()

    # ---- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """_step(), where an exception fails the requests that caused it and not the engine: see
        faults.recover_from_step_fault. Errors of the device itself are re-raised."""
        pending = list(self._pending_outputs)
        unfinished = list(self.scheduler.requests.values())
        try:
            return self._step(finished_only)
        except Exception as error:  # noqa: BLE001 - attributed to requests, or re-raised
            return recover_from_step_fault(self, error, finished_only, pending, unfinished)

    def _step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Schedule, run the model, sample, commit. Returns outputs of requests that produced
        tokens or finished this step (cumulative text and token ids); with finished_only, of the
        requests that finished (what LLM.generate needs: no per-step copies of running outputs).

        With async_scheduling a plain step whose every sequence samples a token is left in flight:
        the next step() launches the following step first, feeding it those tokens on the device,
        and only then waits for them and commits them; its outputs come one step() later."""
        outputs, self._pending_outputs = self._pending_outputs, []
        flight = self._in_flight
        if flight is not None and not (self.async_scheduling and self._can_run_ahead(flight)):
            outputs += self._commit_in_flight(finished_only)
            flight = None
        spec = self.speculator
        sched = self.scheduler.schedule(num_lookahead_tokens=spec.k if spec is not None else 0)
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
            result = spec.step(sched)
            # KV now holds the accepted tokens only; rejected drafts' slots are reused later.
            sched.num_new_tokens = result.num_computed
            for seq in self.scheduler.postprocess(sched, result.token_ids):
                if seq.is_finished or not finished_only:
                    outputs.append(self.make_output(seq))
            return outputs
        sample_mask = sched.sample_mask()
        num_logits = [int(m) for m in sample_mask]
        device_tokens = None
        if flight is not None:  # every sequence of this step decodes the token pending in flight
            rows = {id(seq): r for r, seq in flight.pending}
            src = [rows[id(seq)] for seq in sched.seqs]
            index = self._row_index[: len(src)]
            if src == list(range(len(src))):
                device_tokens = (index, flight.tokens[: len(src)])
            else:
                device_tokens = (index, flight.tokens[torch.tensor(src, device=self.device)])
        logits = self.model_runner.execute_model(
            sched.seqs, sched.num_new_tokens, num_logits, device_tokens=device_tokens
        )
        sampled = [s for s, m in zip(sched.seqs, sample_mask) if m]
        tokens_dev = None
        if sampled:
            mask_stops_before_min_tokens(logits.unsqueeze(1), sampled)
            params = [s.sampling_params for s in sampled]
            tokens_dev = self.sampler(logits, params, [s.num_output_tokens for s in sampled])
        if tokens_dev is not None and self.async_scheduling and all(sample_mask):
            new_flight = self._launch_copy(tokens_dev)
            if flight is not None:  # the previous step's tokens: wait for them (the device runs on)
                outputs += self._commit_in_flight(finished_only)
            self._leave_in_flight(sched, new_flight)
            return outputs
        assert flight is None  # a step after one in flight decodes every sequence
        tokens = tokens_dev.tolist() if tokens_dev is not None else []
        it = iter(tokens)
        committed = [[next(it)] if m else [] for m in sample_mask]
        for seq in self.scheduler.postprocess(sched, committed):
            if seq.is_finished or not finished_only:
                outputs.append(self.make_output(seq))
        return outputs

    # ---- async scheduling ---------------------------------------------------------------------

    def _can_run_ahead(self, flight: _InFlight) -> bool:
        """Whether the next step may launch before flight's tokens are committed: it must be a decode
        of exactly the sequences pending in flight, none of which can finish by length with the
        pending token (those are known finished), without preempting anyone for KV blocks."""
        sch = self.scheduler
        running = sch.running
        if sch.waiting or not running or len(running) > sch.max_num_batched_tokens:
            return False
        pending = {id(seq) for _, seq in flight.pending}
        bm = self.block_manager
        new_blocks = 0
        for seq in running:
            if id(seq) not in pending or seq.num_tokens - seq.num_computed_tokens != 1:
                return False
            max_tokens = seq.sampling_params.max_tokens
            if (
                max_tokens is not None and seq.num_output_tokens >= max_tokens
            ) or seq.num_tokens >= self.max_model_len:
                return False
            # The slots it needs (as the scheduler counts them, no lookahead): up to the pending token.
            new_blocks += max(0, bm.blocks_for(seq.num_tokens) - len(seq.block_table))
        return new_blocks <= bm.num_free_blocks

    def _launch_copy(self, tokens: torch.Tensor) -> _InFlight:
        """Start the device->host copy of a step's sampled tokens [S] int64."""
        if self.device.type != "cuda":
            return _InFlight(tokens=tokens, host=tokens, done=None)
        self._token_host.reverse()  # the other buffer: the previous step's may still be unread
        host = self._token_host[0][: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _InFlight(tokens=tokens, host=host, done=done)

    def _leave_in_flight(self, sched: SchedulerOutput, flight: _InFlight) -> None:
        """Advance sched's sequences past this step's inputs with a PENDING_TOKEN each (sequences
        that finished while it was launched keep nothing) and remember the step as in flight."""
        for row, seq in enumerate(sched.seqs):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += sched.num_new_tokens[row]
            self.block_manager.cache_blocks(seq)  # every token it hashes is committed
            seq.token_ids.append(PENDING_TOKEN)
            flight.pending.append((row, seq))
        self._in_flight = flight

    def _commit_in_flight(self, finished_only: bool) -> list[RequestOutput]:
        """Wait for the in-flight step's tokens and commit them (one host sync)."""
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        if flight.done is not None:
            flight.done.synchronize()
        tokens = flight.host.tolist()
        outputs = []
        for row, seq in flight.pending:
            # A finished seq has no pending entry (abort_request drops it): never pop a real token.
            if seq.is_finished:
                continue
            seq.token_ids.pop()  # PENDING_TOKEN
            self.scheduler.commit(seq, [tokens[row]])
            if seq.is_finished or not finished_only:
                outputs.append(self.make_output(seq))
        return outputs

    def make_output(self, seq: Sequence) -> RequestOutput:
        """Cumulative output of seq. reasoning_content / content are filled once it is finished
        (streaming consumers split deltas themselves with the parser's ReasoningStream)."""
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        if self.reasoning is not None and seq.is_finished:
            starts_thinking = self.reasoning.initial_phase(seq.prompt_token_ids)
            completion.reasoning_content, completion.content = self.reasoning.split(
                seq.output_text, starts_thinking
            )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            num_cached_tokens=seq.metrics.num_cached_tokens,
        )

    @staticmethod
    def error_output(request_id: str, prompt: str | None, token_ids: list[int], error: str) -> RequestOutput:
        """The output of a request that failed before it ran (finish_reason "error")."""
        import time

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
