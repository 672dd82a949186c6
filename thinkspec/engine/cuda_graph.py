"""CUDA-graph capture and replay of short-query steps: decode, (k+1)-token verification, draft steps.

A graph holds one whole model step (every layer's kernels plus the logits of the selected rows)
for a graph key (B', q): up to B' sequences (a batch bucket) that each feed at most q new tokens
(a query width). A step qualifies when its batch fits some key: every num_new_tokens <= q for a
captured width q, len(seqs) <= the largest bucket, sum(num_logits) <= B' * q and every block table
fits the static one. Anything else (prefill chunks, mixed steps, huge batches) runs eagerly.

  widths    the target: 1 (plain decode), and 2 and k+1 when speculating (verify windows);
            the draft model: 1 (draft steps) and 2 (its first forward of a round catches up 1 or 2 tokens)
  buckets   1, 2, 4, 8, then multiples of 8 up to max_num_seqs (vLLM's list), at most 512

Static buffers, one set per runner, shared by all of its graphs (a graph uses a prefix of each):
  inputs        int64 [F + B_max * W] device: the packed step inputs in InputLayout order, padded to
                the key's shape: input_ids [B'q], positions [B'q], slot_mapping [B'q] (-1 = padding,
                not written), logits_indices [B'q] (0 padded), query_start_loc [B'+1] (padding
                sequences repeat the total: query length 0), seq_lens [B'] (0 padded), then this
                step's block tables [B', w] (-1 padded). The host fills one pinned buffer in exactly
                this order and the whole of it goes over in one host->device copy.
  block_tables  int32 [B_max, W], W = blocks of max_model_len + lookahead: before a replay the
                step's [B', w] tables are copied in (device to device, cast to int32); columns >= w
                are kept at -1.
  logits        float32 [B_max * q_max, V]: the graph writes the logits of its B'q selected rows
                here; callers get a view of the first sum(num_logits) rows, valid until the same
                runner's next step.
Tokens stay packed at the front (sequence after sequence) and padding tokens follow them, so a
padded step computes exactly what the eager step computes for the real rows; the Triton kernels
skip query-length-0 sequences, slot -1 rows and rows past query_start_loc[-1].

Capture: lazily, when a key is first needed, under torch.inference_mode on the runner's device,
after one eager warm-up of the same shape (it compiles the Triton kernels, which must not load
during capture) with dummy inputs that write no KV slot. The attention metadata of a capture has
host ints fixed for its key: max_query_len = q and max_seq_len = max_model_len, so the split-KV
factor is the one chosen for the longest context; the kernels cut each sequence's actual range into
that many splits at run time (tiles_per_split is computed in-kernel), and empty splits weigh 0.
Every graph of the engine shares one memory pool (torch.cuda.graph_pool_handle()): graphs never
run concurrently and nothing one graph leaves in the pool is read by another. Before any key of a
runner is captured, the largest key of each width is captured first, largest first, so that every
later capture fits in memory the pool already holds; the KV-pool sizing measures exactly that set
(model_runner.measure_cuda_graph_memory).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from thinkspec.layers.forward_context import AttentionMetadata, forward_context
from thinkspec.step_inputs import InputLayout
from thinkspec.utils import logger

MAX_CAPTURE_BATCH = 512  # largest batch bucket (vLLM's max capture size)


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_BATCH) -> tuple[int, ...]:
    """Batch buckets 1, 2, 4, 8, 16, 24, ... up to the first one >= min(max_num_seqs, limit)."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and limit must be >= 1, got {max_num_seqs}, {limit}")
    top = min(max_num_seqs, limit)
    sizes: list[int] = []
    b = 1
    while True:
        sizes.append(b)
        if b >= top:
            return tuple(sizes)
        b = b * 2 if b < 8 else b + 8


def select_graph_key(
    num_new_tokens: Seq[int],
    num_logits: Seq[int],
    query_widths: Seq[int],
    batch_sizes: Seq[int],
) -> tuple[int, int] | None:
    """(bucket B', width q) of the smallest graph that runs this batch, or None (run it eagerly).

    query_widths and batch_sizes ascending. q is the smallest width >= every num_new_tokens, B' the
    smallest bucket >= the number of sequences; the logits rows must fit B' * q.
    """
    num_seqs = len(num_new_tokens)
    if num_seqs == 0 or not batch_sizes or num_seqs > batch_sizes[-1]:
        return None
    longest = max(num_new_tokens)
    q = next((w for w in query_widths if w >= longest), None)
    if q is None or min(num_new_tokens) < 1:
        return None
    bucket = next(b for b in batch_sizes if b >= num_seqs)
    if sum(num_logits) > bucket * q:
        return None
    return bucket, q


def pack_batch(
    host: np.ndarray,
    layout: InputLayout,
    seqs: Seq[Any],
    num_new_tokens: Seq[int],
    num_logits: Seq[int],
    block_size: int,
    input_token_ids: Seq[Seq[int]] | None = None,
    start_positions: Seq[int] | None = None,
) -> tuple[int, int]:
    """Fill host[: layout.size] (int64) with the ragged batch, padded to the layout's sizes.

    Sequence i feeds num_new_tokens[i] tokens at positions start ... start+n-1, start being
    start_positions[i] or else seq.num_computed_tokens (the tokens are seq.token_ids there, or
    input_token_ids[i] when given), and wants logits for its last num_logits[i] rows. Padding:
    tokens id 0, position 0, slot -1; logits rows 0; sequences query length 0 (query_start_loc
    repeats the total), seq_len 0, block table -1. Returns (max query length, max seq_len) of the
    real sequences. Raises ValueError / RuntimeError for a batch that does not fit or is malformed.
    """
    num_seqs = len(seqs)
    _check_fits(layout, num_seqs, num_new_tokens, num_logits)
    sections = layout.split(host)
    table_h = sections[6].reshape(layout.num_seqs, layout.width)
    table_h.fill(-1)
    # Plain Python lists, written to the buffer once per section: per-sequence numpy calls cost
    # microseconds each, which adds up to milliseconds per step at hundreds of sequences.
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    qsl = [0]
    lens: list[int] = []
    t = 0
    max_q = max_len = 0
    for i, (seq, n, k) in enumerate(zip(seqs, num_new_tokens, num_logits)):
        start = seq.num_computed_tokens if start_positions is None else start_positions[i]
        end = start + n
        table = seq.block_table
        if n < 1 or not 0 <= k <= n:
            raise ValueError(f"sequence {seq.request_id!r}: num_new_tokens={n}, num_logits={k}")
        if len(table) * block_size < end:
            raise RuntimeError(f"sequence {seq.request_id!r} has no KV slots for positions up to {end}")
        if len(table) > layout.width:
            raise ValueError(f"sequence {seq.request_id!r}: block table wider than {layout.width}")
        tokens = seq.token_ids[start:end] if input_token_ids is None else input_token_ids[i]
        if len(tokens) != n:
            raise ValueError(f"sequence {seq.request_id!r}: {len(tokens)} input tokens for {n} positions")
        ids.extend(tokens)
        if n == 1:  # decode: the common case, no ranges
            pos.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            pos.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        rows.extend(range(t + n - k, t + n))
        table_h[i, : len(table)] = table
        t += n
        qsl.append(t)
        lens.append(end)
        max_q = max(max_q, n)
        max_len = max(max_len, end)
    _write_padded(sections, ids, pos, slots, rows, qsl, lens)
    return max_q, max_len


def _check_fits(layout: InputLayout, num_seqs: int, num_new_tokens: Seq[int], num_logits: Seq[int]) -> None:
    if num_seqs > layout.num_seqs:
        raise ValueError(f"{num_seqs} sequences do not fit a layout of {layout.num_seqs}")
    if sum(num_new_tokens) > layout.num_tokens or sum(num_logits) > layout.num_rows:
        raise ValueError(
            f"{sum(num_new_tokens)} tokens / {sum(num_logits)} logits rows do not fit a layout of "
            f"{layout.num_tokens} / {layout.num_rows}"
        )


def _write_padded(
    sections: list[np.ndarray],
    ids: list[int],
    pos: list[int],
    slots: list[int],
    rows: list[int],
    qsl: list[int],
    lens: list[int],
) -> None:
    """Write the packed lists into the first six sections, padding the rest (see pack_batch)."""
    ids_h, pos_h, slot_h, rows_h, qsl_h, lens_h = sections[:6]
    t, r, num_seqs = len(ids), len(rows), len(lens)
    ids_h[:t] = ids
    pos_h[:t] = pos
    slot_h[:t] = slots
    rows_h[:r] = rows
    qsl_h[: num_seqs + 1] = qsl
    lens_h[:num_seqs] = lens
    ids_h[t:] = 0
    pos_h[t:] = 0
    slot_h[t:] = -1
    rows_h[r:] = 0
    qsl_h[num_seqs + 1 :] = t
    lens_h[num_seqs:] = 0


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """Which graphs a runner may capture and the shapes they are captured for.

    query_widths / batch_sizes: ascending, distinct, >= 1. max_model_len: the longest context (the
    split-KV factor of every graph is chosen for it). max_blocks_per_seq: block-table width W of the
    static buffer (blocks of max_model_len + lookahead slots). pool: a torch.cuda.graph_pool_handle()
    shared by the engine's runners, or None for one of the runner's own.
    """

    query_widths: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    max_model_len: int
    max_blocks_per_seq: int
    pool: Any = None

    def __post_init__(self) -> None:
        for name in ("query_widths", "batch_sizes"):
            values = getattr(self, name)
            if (
                not values
                or any(not isinstance(v, int) or v < 1 for v in values)
                or list(values) != sorted(set(values))
            ):
                raise ValueError(f"GraphSpec.{name} must be ascending distinct ints >= 1, got {values!r}")
        for name in ("max_model_len", "max_blocks_per_seq"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"GraphSpec.{name} must be an int >= 1, got {getattr(self, name)!r}")

    def select(
        self, num_new_tokens: Seq[int], num_logits: Seq[int], table_width: int
    ) -> tuple[int, int] | None:
        """The graph key for this batch (see select_graph_key), None when its tables are too wide."""
        if table_width > self.max_blocks_per_seq:
            return None
        return select_graph_key(num_new_tokens, num_logits, self.query_widths, self.batch_sizes)

    def first_keys(self) -> list[tuple[int, int]]:
        """The largest bucket at every width, most tokens first: what is captured before anything else."""
        top = self.batch_sizes[-1]
        return [(top, q) for q in sorted(self.query_widths, reverse=True)]


class CUDAGraphCache:
    """The captured graphs of one ModelRunner and their static buffers (see the module docstring)."""

    def __init__(self, model: nn.Module, spec: GraphSpec, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.spec = spec
        self.device = device
        self.pool = spec.pool if spec.pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        b_max, q_max = spec.batch_sizes[-1], spec.query_widths[-1]
        top = InputLayout(b_max * q_max, b_max * q_max, b_max, spec.max_blocks_per_seq)
        self.inputs = torch.zeros(top.size, dtype=torch.int64, device=device)
        self.block_tables = torch.full((b_max, spec.max_blocks_per_seq), -1, dtype=torch.int32, device=device)
        self._clean_from = 0  # every column >= this of block_tables holds -1
        self.logits: torch.Tensor | None = None  # [b_max * q_max, V] float32, made by the first warm-up

    def layout(self, key: tuple[int, int], width: int) -> InputLayout:
        bucket, q = key
        return InputLayout(bucket * q, bucket * q, bucket, width)

    # ---- capture ------------------------------------------------------------------------------

    def ensure_captured(self, key: tuple[int, int]) -> None:
        """Capture key's graph unless it exists (the largest key of each width first, see above)."""
        if key in self.graphs:
            return
        if not self.graphs:
            for first in self.spec.first_keys():
                self.capture(first)
        if key not in self.graphs:
            self.capture(key)

    @torch.inference_mode()
    def capture(self, key: tuple[int, int]) -> None:
        bucket, q = key
        if bucket not in self.spec.batch_sizes or q not in self.spec.query_widths:
            raise ValueError(f"graph key {key} is not in {self.spec}")
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            self._dummy_inputs(bucket, q)
            self._forward(key)  # warm-up: compiles kernels, sizes the logits buffer
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(key)
            except RuntimeError as e:
                raise RuntimeError(
                    f"CUDA graph capture of batch {bucket} x {q} tokens failed: {e}; "
                    "enforce_eager=True (--enforce-eager) runs without graphs"
                ) from e
            torch.cuda.synchronize(self.device)
        self.graphs[key] = graph
        logger.info(
            "CUDA graph captured: batch %d x %d token(s) per sequence (%.0f ms)",
            bucket, q, 1e3 * (time.perf_counter() - t0),
        )  # fmt: skip

    @torch.inference_mode()
    def time_replay(
        self, key: tuple[int, int], reps: int = 5, context: int = 0, num_blocks: int = 1, block_size: int = 1
    ) -> float:
        """Median ms of one replay of key's graph (captured first if missing) on the capture's dummy
        inputs, which write no KV slot; the cost model of the adaptive draft length reads it.
        context > q: every sequence attends over `context` tokens instead of its q, in blocks of its
        own (row r reads blocks r*W..r*W+W-1 modulo num_blocks of block_size slots), so that the
        time includes attention over that much K/V as a real step's does.
        Leaves the static buffers as a capture does: the next replay brings its own inputs."""
        self.ensure_captured(key)
        graph = self.graphs[key]
        with torch.cuda.device(self.device):
            self._dummy_inputs(*key, context=context, num_blocks=num_blocks, block_size=block_size)
            graph.replay()  # first replay after capture may pay for lazy allocations
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            if context > key[1]:
                self._dummy_inputs(*key)
        return float(np.median(times))

    def _dummy_inputs(
        self, bucket: int, q: int, context: int = 0, num_blocks: int = 1, block_size: int = 1
    ) -> None:
        """Inputs of a capture: every sequence q tokens at positions 0..q-1, no KV slot written;
        block tables point at block 0 (reads of it are harmless). context > q (time_replay): the q
        tokens at positions context-q..context-1 over distinct blocks instead."""
        layout = self.layout((bucket, q), 0)
        host = np.zeros(layout.fixed_size, dtype=np.int64)
        ids, pos, slot, rows, qsl, lens, _ = layout.split(host)
        length = max(context, q)
        pos[:] = np.tile(np.arange(length - q, length), bucket)
        slot[:] = -1
        rows[:] = np.arange(bucket * q)
        qsl[:] = np.arange(bucket + 1) * q
        lens[:] = length
        self.inputs[: layout.fixed_size].copy_(torch.from_numpy(host))
        self.block_tables.fill_(0)
        if length > q:
            width = -(-length // block_size)
            if width > self.spec.max_blocks_per_seq:
                raise ValueError(
                    f"context {length} needs {width} blocks, the tables hold {self.spec.max_blocks_per_seq}"
                )
            blocks = torch.arange(bucket * width, device=self.device, dtype=torch.int32) % num_blocks
            self.block_tables[:bucket, :width] = blocks.view(bucket, width)
        self._clean_from = self.spec.max_blocks_per_seq

    def _forward(self, key: tuple[int, int]) -> None:
        """The captured computation: static inputs -> self.logits[: B'q]."""
        bucket, q = key
        layout = self.layout(key, 0)
        ids, pos, slot, rows, qsl, lens, _ = layout.split(self.inputs)
        meta = AttentionMetadata(
            query_start_loc=qsl.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            slot_mapping=slot,
            block_tables=self.block_tables[:bucket],
            max_query_len=q,
            max_seq_len=self.spec.max_model_len,
        )
        with forward_context(meta):
            hidden = self.model(ids, pos)  # [B'q, H]
        if self.logits is None:
            b_max, q_max = self.spec.batch_sizes[-1], self.spec.query_widths[-1]
            vocab = self.model.config.vocab_size
            self.logits = torch.empty(b_max * q_max, vocab, dtype=torch.float32, device=self.device)
        self.model.compute_logits(hidden[rows], out=self.logits[: bucket * q])  # [B'q, V] float32

    # ---- replay -------------------------------------------------------------------------------

    def replay(
        self,
        key: tuple[int, int],
        layout: InputLayout,
        num_rows: int,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run key's graph on the inputs already copied into self.inputs[: layout.size].

        Writes device_inputs (index into the packed inputs, values) over them, copies the step's
        block tables into the static int32 table, replays, and returns logits [num_rows, V] float32: a
        view of the static buffer, overwritten by this runner's next replay.
        """
        bucket, _ = key
        w = layout.width
        if device_inputs is not None:
            self.inputs[: layout.size].index_put_((device_inputs[0],), device_inputs[1])
        tables = self.inputs[layout.fixed_size : layout.size].view(bucket, w)
        self.block_tables[:bucket, :w].copy_(tables)
        if self._clean_from > w:
            self.block_tables[:, w : self._clean_from].fill_(-1)
        self._clean_from = w
        self.graphs[key].replay()
        self.num_replays += 1
        assert self.logits is not None
        return self.logits[:num_rows]
