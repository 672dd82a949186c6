"""Building an engine's parts from EngineArgs: models, tokenizer, KV sizing, runners, scheduler.

Order matters on a GPU: both models are loaded (their weights count) and the CUDA-graph memory is
measured before the KV pool takes what gpu_memory_utilization leaves (see model_runner.py).

Tensor parallelism: every rank runs load_models and build_runners with its own TPLayout (the same
collectives in the same order: profile forward, graph captures, the minimum of the ranks' KV block
counts); rank 0 alone builds the tokenizer, scheduler, sampler and speculator. A draft with
draft_tensor_parallel_size 1 lives on rank 0 only, whole.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from thinkspec.distributed.parallel_state import TPLayout
from thinkspec.distributed.step_channel import StepChannel
from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.cuda_graph import GraphSpec, graph_batch_sizes
from thinkspec.engine.model_runner import (
    ModelRunner,
    determine_kv_cache_memory,
    kv_cache_bytes_per_block,
    measure_cuda_graph_memory,
    use_triton_kernels,
)
from thinkspec.engine.scheduler import Scheduler
from thinkspec.engine.speculator import Speculator
from thinkspec.engine_args import EngineArgs
from thinkspec.models.loader import ModelInfo, load_model, load_tokenizer
from thinkspec.reasoning.parsers import ResolvedReasoning
from thinkspec.sampling.sampler import Sampler
from thinkspec.spec_decode.draft_model import check_draft_compatible
from thinkspec.utils import logger, resolve_device

# Query widths the runners replay as graphs. The target: decode 1, verify windows 1 + drafts
# (<= k+1; 2 for a single draft); the draft: its catch-up forward 1 or 2, its per-token steps 1.
DRAFT_GRAPH_WIDTHS = (1, 2)


def target_graph_widths(k: int, every_width: bool = False) -> tuple[int, ...]:
    """every_width (adaptive_k): any step may verify 1..k drafts per row, so widths 1..k+1."""
    if every_width and k:
        return tuple(range(1, k + 2))
    return (1,) if not k else tuple(sorted({1, 2, k + 1}))


def _adaptive(args: EngineArgs) -> bool:
    return args.speculative_config is not None and args.speculative_config.adaptive_k


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend an attention_backend setting means on device: "auto" is "triton" on CUDA and
    "torch" elsewhere; "torch" and "triton" stand for themselves."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


@dataclass(slots=True)
class Models:
    """The loaded models, tokenizer and what follows from them."""

    device: torch.device
    tp: TPLayout  # this process's rank of the target
    model: nn.Module
    info: ModelInfo
    tokenizer: Any | None
    no_tokenizer: str  # why tokenizer is None (for error messages); "" when there is one
    eos_token_ids: frozenset[int]
    draft_model: nn.Module | None  # None on ranks > 0 when the draft is not split
    draft_info: ModelInfo | None
    draft_split: bool  # the draft is split over the ranks as the target is
    attention_backend: str
    use_cuda_graphs: bool
    bytes_per_block: int  # K/V of one block across the target's layers plus the draft's
    lookahead: int  # drafts per step (0 without speculation)


@dataclass(slots=True)
class Runners:
    """KV sizing and the model runners of one rank."""

    configured_len: int  # max_model_len as set, else the model's max_position_embeddings
    max_model_len: int  # what a request may reach: configured_len capped by the KV pool
    num_blocks: int
    graph_memory_bytes: int
    pool: object  # the graph pool shared by all graphs (None without graphs)
    target: ModelRunner
    draft: ModelRunner | None


@dataclass(slots=True)
class EngineParts:
    """Everything LLMEngine runs on."""

    models: Models
    configured_len: int  # max_model_len as set, else the model's max_position_embeddings
    max_model_len: int  # what a request may reach: configured_len capped by the KV pool
    kv_capacity_tokens: int
    num_blocks: int
    graph_memory_bytes: int
    model_runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler
    sampler: Sampler
    reasoning: ResolvedReasoning | None
    speculator: Speculator | None


def build_engine_parts(args: EngineArgs) -> EngineParts:
    """Rank 0's engine (the whole engine without tensor parallelism; with it, the workers of ranks
    1..N-1 must already be running: see engine.py)."""
    models = load_models(args, TPLayout(0, args.tensor_parallel_size))
    run = build_runners(args, models)
    info = models.info
    kv_capacity = run.num_blocks * args.block_size
    if args.max_model_len is not None and args.max_model_len > kv_capacity:
        logger.warning(
            "max_model_len=%d exceeds the KV cache capacity of %d tokens; requests are capped there",
            args.max_model_len, kv_capacity,
        )  # fmt: skip
    block_manager = BlockManager(run.num_blocks, args.block_size, args.enable_prefix_caching)
    reasoning = _resolve_reasoning(args, models)
    scheduler = Scheduler(
        block_manager, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=run.max_model_len, tokenizer=models.tokenizer,
        tracker=reasoning.tracker() if reasoning is not None else None,
    )  # fmt: skip
    sampler = Sampler(args.seed, models.device)
    speculator = None
    if args.speculative_config is not None:
        speculator = Speculator(
            args.speculative_config, target_runner=run.target, draft_runner=run.draft, reasoning=reasoning,
            sampler=sampler, vocab_size=info.vocab_size, max_model_len=run.max_model_len, seed=args.seed,
            tokenizer=models.tokenizer,
        )  # fmt: skip
    return EngineParts(
        models, run.configured_len, run.max_model_len, kv_capacity, run.num_blocks, run.graph_memory_bytes,
        run.target, block_manager, scheduler, sampler, reasoning, speculator,
    )  # fmt: skip


def build_runners(args: EngineArgs, models: Models) -> Runners:
    """KV sizing and runners (every rank; see the module docstring). On a split model the runners
    get a StepChannel: rank 0's send each step to the other ranks, theirs receive it."""
    info = models.info
    if args.max_model_len is not None and args.max_model_len > info.max_position_embeddings:
        raise ValueError(
            f"max_model_len={args.max_model_len} exceeds the model's max_position_embeddings "
            f"({info.max_position_embeddings})"
        )
    configured_len = args.max_model_len or info.max_position_embeddings
    graph_memory = 0
    if models.use_cuda_graphs and args.kv_cache_memory is None:
        graph_memory = _measure_graph_memory(args, models, configured_len)
    num_blocks = _num_kv_blocks(args, models, configured_len, graph_memory)
    max_model_len = min(configured_len, num_blocks * args.block_size)
    pool = torch.cuda.graph_pool_handle() if models.use_cuda_graphs else None  # shared by all graphs
    channel = StepChannel(models.device, models.tp.rank) if models.tp.size > 1 else None
    target = ModelRunner.for_model(
        models.model, info, num_blocks=num_blocks, block_size=args.block_size, device=models.device,
        graphs=graph_spec(
            args, models, target_graph_widths(models.lookahead, _adaptive(args)), max_model_len, pool
        ),
        channel=channel, runner_index=0,
    )  # fmt: skip
    draft = None
    if models.draft_model is not None:
        assert models.draft_info is not None
        draft = ModelRunner.for_model(
            models.draft_model, models.draft_info, num_blocks=num_blocks, block_size=args.block_size,
            device=models.device, graphs=graph_spec(args, models, DRAFT_GRAPH_WIDTHS, max_model_len, pool),
            channel=channel if models.draft_split else None, runner_index=1,
        )  # fmt: skip
    return Runners(configured_len, max_model_len, num_blocks, graph_memory, pool, target, draft)


# torch's intra-op thread count when this module was imported, and the count set_cpu_threads last
# chose: any other count means the caller chose one (torch.set_num_threads), which is kept.
_IMPORT_THREADS = torch.get_num_threads()
_chosen_threads: int | None = None


def pick_cpu_threads(current: int, cores: int, busy: float, env: Mapping[str, str]) -> int:
    """Intra-op threads for the engine on CPU: one per core no other process keeps busy (at least 1,
    at most `current`), since torch's pool stalls each parallel region while a thread waits for a
    taken core. `current` (torch's count) stays when OMP_NUM_THREADS is set."""
    if env.get("OMP_NUM_THREADS"):
        return current
    return max(1, min(current, cores - round(busy)))


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of every core since boot, from /proc/stat; None where it is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def busy_cores(cores: int, interval: float = 0.2) -> float | None:
    """Cores other processes keep busy right now: the machine's busy share over `interval` seconds,
    during which this process sleeps, times the cores. A load average would lag a neighbour that just
    started by a minute and count this process itself. None where /proc/stat is missing."""
    before = _cpu_ticks()
    if before is None:
        return None
    time.sleep(interval)
    after = _cpu_ticks()
    if after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * cores


def set_cpu_threads() -> None:
    """Apply pick_cpu_threads to the cores busy now (each engine built looks again), unless
    OMP_NUM_THREADS is set or the caller chose a count with torch.set_num_threads."""
    global _chosen_threads
    full = _IMPORT_THREADS
    chosen_by_caller = torch.get_num_threads() not in (full, _chosen_threads)
    if full == 1 or os.environ.get("OMP_NUM_THREADS") or chosen_by_caller:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = busy_cores(cores)
    if busy is None:
        return
    threads = pick_cpu_threads(full, cores, busy, os.environ)
    if threads != full:
        logger.info("CPU: %d intra-op thread(s) of %d (other processes keep the rest busy)", threads, full)
    torch.set_num_threads(threads)
    _chosen_threads = threads


def load_models(args: EngineArgs, tp: TPLayout) -> Models:
    """Target, tokenizer and draft (loaded before KV sizing: its weights count), with their kernels;
    rank tp.rank's shards of them (the tokenizer on rank 0 only)."""
    device = resolve_device(args.device)
    if tp.size > 1 and device.type == "cuda":
        device = torch.device("cuda", tp.rank)  # one GPU per rank
    if device.type == "cpu":
        set_cpu_threads()
    model, info = load_model(args.model, args.dtype, device, args.load_format, tp)
    tokenizer, no_tokenizer = None, "skip_tokenizer_init=True"
    if not args.skip_tokenizer_init and tp.rank == 0:
        # A folder without a fitting tokenizer runs as skip_tokenizer_init does: token ids only.
        source = args.tokenizer or str(info.path)
        tokenizer, no_tokenizer = load_tokenizer(source, info.vocab_size, explicit=args.tokenizer is not None)
        if tokenizer is None:
            logger.warning("no tokenizer: %s; only token-id prompts can run", no_tokenizer)
    eos = list(info.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in eos:
        eos.append(tok_eos)
    bytes_per_block = kv_cache_bytes_per_block(
        info.num_layers, args.block_size, info.kv_heads_per_rank, info.head_dim, info.dtype
    )
    spec = args.speculative_config
    draft_model = draft_info = None
    draft_split = args.draft_tp_size == tp.size > 1
    if spec is not None and spec.method == "draft_model" and (draft_split or tp.rank == 0):
        assert spec.model is not None
        draft_tp = tp if draft_split else TPLayout()
        try:
            draft_model, draft_info = load_model(spec.model, info.dtype, device, args.load_format, draft_tp)
        except FileNotFoundError as e:  # the target loaded: say which checkpoint is missing
            raise FileNotFoundError(f"speculative_config.model: {e}") from e
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        check_draft_compatible(tokenizer, info, draft_info)
        d = draft_info
        # Both pools share the block tables, so one block costs the sum of the two.
        bytes_per_block += kv_cache_bytes_per_block(
            d.num_layers, args.block_size, d.kv_heads_per_rank, d.head_dim, d.dtype
        )
    backend = resolve_attention_backend(args.attention_backend, device)
    if backend == "triton":
        for m in (m for m in (model, draft_model) if m is not None):
            use_triton_kernels(m)
    return Models(
        device=device, tp=tp, model=model, info=info, tokenizer=tokenizer, no_tokenizer=no_tokenizer,
        eos_token_ids=frozenset(eos),
        draft_model=draft_model, draft_info=draft_info, draft_split=draft_split, attention_backend=backend,
        use_cuda_graphs=device.type == "cuda" and not args.enforce_eager and backend == "triton",
        bytes_per_block=bytes_per_block,
        lookahead=(spec.num_speculative_tokens or 0) if spec is not None else 0,
    )  # fmt: skip


def graph_spec(
    args: EngineArgs, models: Models, widths: tuple[int, ...], max_model_len: int, pool: object
) -> GraphSpec | None:
    """What a runner captures (None: no graphs): widths x buckets up to max_num_seqs, block tables
    wide enough for max_model_len plus the speculative lookahead slots."""
    if not models.use_cuda_graphs:
        return None
    return GraphSpec(
        query_widths=widths,
        batch_sizes=graph_batch_sizes(args.max_num_seqs),
        max_model_len=max_model_len,
        max_blocks_per_seq=-(-(max_model_len + models.lookahead) // args.block_size),
        pool=pool,
    )


def _measure_graph_memory(args: EngineArgs, models: Models, configured_len: int) -> int:
    # In the order the runners first capture: a speculative step runs the draft first.
    widths = target_graph_widths(models.lookahead, _adaptive(args))
    target = graph_spec(args, models, widths, configured_len, None)
    probe = [(models.model, models.info, target)]
    if models.draft_model is not None:
        draft = graph_spec(args, models, DRAFT_GRAPH_WIDTHS, configured_len, None)
        probe.insert(0, (models.draft_model, models.draft_info, draft))
    return measure_cuda_graph_memory(probe, block_size=args.block_size, device=models.device)


def _num_kv_blocks(args: EngineArgs, models: Models, configured_len: int, graph_memory: int) -> int:
    kv_bytes = determine_kv_cache_memory(
        models.model, device=models.device, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=configured_len, max_num_seqs=args.max_num_seqs, vocab_size=models.info.vocab_size,
        reserved_bytes=graph_memory,
    )  # fmt: skip
    num_blocks = kv_bytes // models.bytes_per_block
    if models.tp.size > 1:  # every rank holds the same blocks: the fewest any rank can hold
        count = torch.tensor([num_blocks], dtype=torch.int64, device=models.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
        num_blocks = int(count.item())
    # More blocks than every running sequence at full length twice over only feed the prefix
    # cache, and the host bookkeeping grows with them (tiny models on big GPUs).
    max_useful = 2 * args.max_num_seqs * -(-configured_len // args.block_size)
    if num_blocks > max_useful and args.kv_cache_memory is None:
        logger.info("KV pool capped at %d blocks (memory for %d)", max_useful, num_blocks)
        num_blocks = max_useful
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory={kv_bytes} bytes holds no KV block; one block of {args.block_size} "
            f"tokens needs {models.bytes_per_block} bytes"
        )
    return num_blocks


def _resolve_reasoning(args: EngineArgs, models: Models) -> ResolvedReasoning | None:
    """Think markers and protected tokens; EOS ids are protected from relaxation too."""
    protect = tuple(sorted(models.eos_token_ids))
    spec = args.speculative_config
    wants_parser = args.reasoning_parser is not None or (spec is not None and spec.build_reasoning_parser())
    if models.tokenizer is None and wants_parser:
        raise ValueError(f"reasoning_parser needs a tokenizer, and there is none: {models.no_tokenizer}")
    if spec is not None and spec.build_reasoning_parser() is not None:
        return spec.resolve_reasoning(models.tokenizer, extra_protected_token_ids=protect)
    if args.reasoning_parser is not None:
        from thinkspec.reasoning import get_reasoning_parser

        return get_reasoning_parser(args.reasoning_parser).resolve(
            models.tokenizer, extra_protected_token_ids=protect
        )
    return None
