"""Runs one model over a ragged batch against its paged KV pool.

The ModelRunner owns the KV tensors of one model and builds each step's inputs from the
sequences' block tables; the BlockManager (the bookkeeping) lives outside, so a draft model can
get a second ModelRunner with its own pool of the same `num_blocks` and share the block tables.

KV pool: one tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]; layer l
gets the views kv[0, l] (k_cache) and kv[1, l] (v_cache).

Steps: every step's inputs are packed on the host into one pinned int64 buffer and go to the
device in one copy. Given a GraphSpec (CUDA only), steps whose shape fits a captured graph key
(decode, verification windows, draft steps) replay a CUDA graph instead of running eagerly; see
cuda_graph.py.

Tensor parallelism: a runner of a split model holds this rank's KV heads. On rank 0 it has a
StepChannel and execute_model broadcasts each packed step before running it; the other ranks' runners
run the same step from the broadcast (run_step, driven by engine/tp_worker.py).

Pool size: on CPU, `kv_cache_memory` bytes (default 256 MiB). On GPU, `gpu_memory_utilization`
is the fraction of the device's total memory this process may use, as in vLLM: after the models
are loaded, a profile forward of max_num_batched_tokens tokens measures the peak; the pool gets
utilization * total - peak - memory held outside PyTorch's allocator - CUDA-graph memory.
CUDA-graph memory (when graphs are on) is measured, not guessed: measure_cuda_graph_memory
captures, with a throw-away one-block KV pool, the graphs each runner captures before any other
(the largest batch bucket at every query width, largest first), and counts the growth of
torch.cuda.memory_reserved: the static buffers (inputs, block tables, logits) plus the shared graph
pool. Later captures of smaller keys reuse that pool memory, so after warm-up the process holds
about weights + KV + that measurement + the profiled activation peak + non-torch memory, i.e.
utilization * total. `kv_cache_memory`, when given, overrides all of this on either device.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence as Seq

import numpy as np
import torch
from torch import nn

from thinkspec.distributed.step_channel import StepChannel, StepHeader
from thinkspec.engine.cuda_graph import CUDAGraphCache, GraphSpec, pack_batch
from thinkspec.engine.sequence import Sequence
from thinkspec.layers.attention import Attention
from thinkspec.layers.forward_context import AttentionMetadata, forward_context
from thinkspec.models.loader import ModelInfo
from thinkspec.step_inputs import InputLayout
from thinkspec.utils import logger

DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 1024**2


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def use_triton_kernels(model: nn.Module) -> None:
    """Triton paged attention in every attention layer and the fused norm / rotary / SiLU kernels
    (CUDA, or TRITON_INTERPRET=1). Until a KV pool exists (the profiling run) attention falls back
    to the torch reference."""
    from thinkspec.layers.attention_triton import TritonAttentionBackend

    backend = TritonAttentionBackend()
    for layer in attention_layers(model):
        layer.backend = backend
    model.set_fused_kernels(True)


@torch.inference_mode()
def profile_run(
    model: nn.Module, *, num_tokens: int, max_model_len: int, num_seqs: int, vocab_size: int
) -> None:
    """A forward of `num_tokens` tokens as whole prompts (no KV pool yet), plus logits for up to
    `num_seqs` rows, to measure peak activation memory."""
    param = next(model.parameters())
    lens: list[int] = []
    remaining = num_tokens
    while remaining > 0:
        lens.append(min(remaining, max_model_len))
        remaining -= lens[-1]
    device = param.device
    starts = np.concatenate([[0], np.cumsum(lens)])
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.full((len(lens), 1), -1, dtype=torch.int32, device=device),
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    input_ids = torch.randint(0, vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    with forward_context(meta):
        hidden = model(input_ids, positions)
    rows = torch.arange(min(num_seqs, num_tokens), device=device)
    logits = model.compute_logits(hidden[rows])
    logits.sort(dim=-1)  # the sampler's largest temporary
    del hidden, logits


def determine_kv_cache_memory(
    model: nn.Module,
    *,
    device: torch.device,
    gpu_memory_utilization: float,
    kv_cache_memory: int | None,
    max_num_batched_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    vocab_size: int,
    reserved_bytes: int = 0,
) -> int:
    """Bytes available for KV pools (see the module docstring); raises ValueError when none is left.

    reserved_bytes: memory that will be taken after the pools exist and that the profile does not
    see (CUDA graphs: measure_cuda_graph_memory); subtracted on GPU."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_MEMORY
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_run(
        model,
        num_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_seqs=max_num_seqs,
        vocab_size=vocab_size,
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))  # CUDA context, others
    available = int(gpu_memory_utilization * total) - peak - outside_torch - reserved_bytes
    logger.info(
        "KV memory: total %.2f GiB x %.2f - peak %.2f GiB - non-torch %.2f GiB - CUDA graphs %.2f GiB "
        "= %.2f GiB",
        total / 2**30, gpu_memory_utilization, peak / 2**30, outside_torch / 2**30, reserved_bytes / 2**30,
        available / 2**30,
    )  # fmt: skip
    if available <= 0:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory for the KV cache "
            f"(model + activations use {peak / 2**30:.2f} GiB, CUDA graphs {reserved_bytes / 2**30:.2f} "
            f"GiB of {total / 2**30:.2f} GiB); raise it or lower max_num_batched_tokens"
        )
    return available


def measure_cuda_graph_memory(
    models: Seq[tuple[nn.Module, ModelInfo, GraphSpec]], *, block_size: int, device: torch.device
) -> int:
    """Bytes of device memory the CUDA graphs of these models take (see the module docstring).

    Each (model, info, spec), in the order given (the order the engine's runners first capture),
    gets a throw-away runner with a one-block KV pool that captures the graphs its real runner
    captures first (spec.first_keys()), all into one fresh graph pool; the growth of
    torch.cuda.memory_reserved over that is the answer. Everything is freed again
    before returning; the Triton kernels stay compiled. The models' attention layers must already
    use the backend the engine will run (graphs need the Triton one).
    """
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    pool = torch.cuda.graph_pool_handle()
    runners = []
    for model, info, spec in models:
        runner = ModelRunner.for_model(
            model, info, num_blocks=1, block_size=block_size, device=device,
            graphs=dataclasses.replace(spec, pool=pool),
        )  # fmt: skip
        assert runner.graphs is not None
        for key in spec.first_keys():
            runner.graphs.ensure_captured(key)
        runners.append(runner)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    kv_bytes = sum(r.kv_cache.numel() * r.kv_cache.element_size() for r in runners)
    used = torch.cuda.memory_reserved(device) - before - kv_bytes
    for runner in runners:
        runner.release()
    del runners, pool
    gc.collect()
    torch.cuda.empty_cache()
    logger.info("CUDA graphs: %.1f MiB of static buffers and graph pool", used / 2**20)
    return max(0, used)


class ModelRunner:
    """One model's KV pool and step execution.

    graphs: a GraphSpec to replay CUDA graphs for the steps that fit one (CUDA only; the Triton
    attention backend must be installed on the model); None runs every step eagerly.
    use_cuda_graphs can be switched off at any time (e.g. to compare with eager runs).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        graphs: GraphSpec | None = None,
        channel: StepChannel | None = None,
        runner_index: int = 0,
    ) -> None:
        self.model = model
        self.channel = channel  # set when the model is split over ranks (tensor parallelism)
        self.runner_index = runner_index  # which runner of the ranks' runners this is (StepHeader.runner)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        layers = attention_layers(model)
        if not layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to give a KV cache")
        if graphs is not None and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        # [2, L, num_blocks, block_size, Hkv, D] model dtype; zeros so unwritten slots are finite.
        self.kv_cache = torch.zeros(
            2, len(layers), num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        for i, layer in enumerate(layers):
            if (layer.num_kv_heads, layer.head_dim) != (num_kv_heads, head_dim):
                raise ValueError(
                    f"attention layer {i} has {layer.num_kv_heads} kv heads x {layer.head_dim}, "
                    f"expected {num_kv_heads} x {head_dim}"
                )
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._copy_done = torch.cuda.Event() if self._pin else None  # guards reuse of self._host
        self.graphs = CUDAGraphCache(model, graphs, device) if graphs is not None else None
        self.use_cuda_graphs = self.graphs is not None

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        info: ModelInfo,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        graphs: GraphSpec | None = None,
        channel: StepChannel | None = None,
        runner_index: int = 0,
    ) -> ModelRunner:
        """A runner whose pool has the KV layout of a loaded model (heads, head_dim, dtype from info)."""
        return cls(
            model,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=info.kv_heads_per_rank,
            head_dim=info.head_dim,
            dtype=info.dtype,
            device=device,
            graphs=graphs,
            channel=channel,
            runner_index=runner_index,
        )

    def release(self) -> None:
        """Drop the graphs and the KV pool (the model's layers keep empty caches)."""
        self.graphs = None
        self.use_cuda_graphs = False
        mine = self.kv_cache.untyped_storage().data_ptr()
        for layer in attention_layers(self.model):
            if layer.k_cache.numel() and layer.k_cache.untyped_storage().data_ptr() == mine:
                layer.k_cache = torch.empty(0)
                layer.v_cache = torch.empty(0)
        self.kv_cache = torch.empty(0)

    def prepare_inputs(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        num_logits: Seq[int],
        input_token_ids: Seq[Seq[int]] | None = None,
        start_positions: Seq[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Pack the ragged batch with one host->device copy.

        Sequence i feeds num_new_tokens[i] tokens at positions start ... start+n-1, start being
        start_positions[i] or else seq.num_computed_tokens (the tokens are seq.token_ids there, or
        input_token_ids[i] when given) and wants logits for its last num_logits[i] rows.
        Returns input_ids [T] int64, positions [T] int64, metadata, logits_indices [N] int64.
        """
        num_seqs = len(seqs)
        layout = InputLayout(
            num_tokens=int(sum(num_new_tokens)),
            num_rows=int(sum(num_logits)),
            num_seqs=num_seqs,
            width=max(len(s.block_table) for s in seqs),
        )
        buf = self._host_buffer(layout.size)
        max_q, max_len = pack_batch(
            buf.numpy(), layout, seqs, num_new_tokens, num_logits, self.block_size,
            input_token_ids, start_positions,
        )  # fmt: skip
        dev = self._to_device(buf[: layout.size])
        parts = layout.split(dev)
        meta = AttentionMetadata(
            query_start_loc=parts[4].to(torch.int32),
            seq_lens=parts[5].to(torch.int32),
            slot_mapping=parts[2],
            block_tables=parts[6].view(num_seqs, layout.width).to(torch.int32),
            max_query_len=max_q,
            max_seq_len=max_len,
        )
        return parts[0], parts[1], meta, parts[3]

    @torch.inference_mode()
    def execute_model(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        num_logits: Seq[int],
        input_token_ids: Seq[Seq[int]] | None = None,
        start_positions: Seq[int] | None = None,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Forward the batch, write its K/V into the pool, return logits [N, V] float32 for the
        selected rows (sequence after sequence, N = sum(num_logits)).

        device_inputs = (index [M] int64, values [M] int64), both on the device, overwrites the
        packed inputs (InputLayout) at index after the host copy: values that live on the device go
        straight in without a device->host round trip. input_ids come first in the layout, so index i <
        num_tokens is token row i (draft tokens); the run-ahead forward also writes positions, slots
        and seq_lens (DraftModelProposer.run_ahead). The host entries they replace are placeholders.

        With CUDA graphs the logits are a view of a static buffer that this runner's next
        execute_model overwrites: consume (or clone) them before calling it again.
        With a StepChannel (rank 0 of a tensor-parallel model) the other ranks run the same step.
        """
        if not seqs:
            raise ValueError("execute_model needs at least one sequence")
        key, layout = self.step_layout(num_new_tokens, num_logits, max(len(s.block_table) for s in seqs))
        buf = self._host_buffer(layout.size)
        max_q, max_len = pack_batch(
            buf.numpy(), layout, seqs, num_new_tokens, num_logits, self.block_size,
            input_token_ids, start_positions,
        )  # fmt: skip
        m = 0 if device_inputs is None else int(device_inputs[0].numel())
        header = StepHeader(
            self.runner_index, *(key or (0, 0)), layout.num_tokens, layout.num_rows, layout.num_seqs,
            layout.width, max_q, max_len, int(sum(num_logits)), m,
        )  # fmt: skip
        if self.channel is None:
            return self.run_step(header, buf[: layout.size], device_inputs)
        try:
            self.channel.send_header(header)
            return self.run_step(header, buf[: layout.size], device_inputs)
        except Exception as e:
            # the other ranks may be stuck in this step's collectives: the group is unusable now
            raise self.channel.fail(e) from e

    def step_layout(
        self, num_new_tokens: Seq[int], num_logits: Seq[int], width: int
    ) -> tuple[tuple[int, int] | None, InputLayout]:
        """(graph key or None, layout of the packed inputs) of the step execute_model runs for this
        batch (width: its widest block table), so that a caller can address device_inputs."""
        if self.graphs is not None and self.use_cuda_graphs:
            key = self.graphs.spec.select(num_new_tokens, num_logits, width)
            if key is not None:
                return key, self.graphs.layout(key, width)
        return None, InputLayout(int(sum(num_new_tokens)), int(sum(num_logits)), len(num_new_tokens), width)

    def run_step(
        self,
        header: StepHeader,
        host: torch.Tensor | None,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run one packed step (every rank of a tensor-parallel model runs it together).

        host: the packed int64 inputs [header.layout.size] on rank 0 (and without tensor
        parallelism); None on the other ranks, which receive them (and the device tokens) from rank 0.
        Returns logits [header.num_out_rows, V] float32."""
        channel = self.channel
        key = header.graph_key
        if key is not None:
            graphs = self.graphs
            assert graphs is not None
            graphs.ensure_captured(key)
            layout = graphs.layout(key, header.width)
            dst = graphs.inputs[: layout.size]
            if host is not None:
                dst.copy_(host, non_blocking=True)
                self._copy_done.record()
            if channel is not None:
                channel.broadcast(dst)
                device_inputs = channel.share_device_inputs(header, device_inputs)
            return graphs.replay(key, layout, header.num_out_rows, device_inputs)
        layout = header.layout
        if host is not None:
            dev = self._to_device(host)
        else:
            dev = torch.empty(layout.size, dtype=torch.int64, device=self.device)
        if channel is not None:
            channel.broadcast(dev)
            device_inputs = channel.share_device_inputs(header, device_inputs)
        if device_inputs is not None:
            dev = dev.index_put((device_inputs[0],), device_inputs[1])  # not in place: dev may be `host`
        parts = layout.split(dev)
        meta = AttentionMetadata(
            query_start_loc=parts[4].to(torch.int32),
            seq_lens=parts[5].to(torch.int32),
            slot_mapping=parts[2],
            block_tables=parts[6].view(layout.num_seqs, layout.width).to(torch.int32),
            max_query_len=header.max_query_len,
            max_seq_len=header.max_seq_len,
        )
        with forward_context(meta):
            hidden = self.model(parts[0], parts[1])  # [T, H]
        return self.model.compute_logits(hidden[parts[3]])

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self._copy_done is None:
            return host
        dev = host.to(self.device, non_blocking=True)
        self._copy_done.record()
        return dev

    def _host_buffer(self, size: int) -> torch.Tensor:
        # Reused across steps: wait until the previous step's non_blocking copy has read it.
        if self._copy_done is not None:
            self._copy_done.synchronize()
        if self._host.numel() < size:
            size = max(size, 2 * self._host.numel())
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=self._pin)
        return self._host
