"""Decode attention of a small batch over the paged KV cache: Triton launch shapes side by side.

Qwen3-8B heads (32 query, 8 KV, head dim 128; --heads 16,8: Qwen3-0.6B's), bf16, KV block size 16,
block tables shuffled.
For each context length and batch, builds one KV cache per layer (so a step's caches do not sit
in L2, as in a real step), captures a CUDA graph of one backend forward per layer (KV store,
zero-fill, attention and, when split, the merge: everything a decode step pays for
attention) and reports microseconds per layer and the ratio to the HBM floor of reading the K/V
once (--bandwidth). Each launch shape is checked against the split-free default first. Writes
JSON (--out) and prints the best shape per context last.

--layouts nhd,hnd times each case over two cache layouts side by side: nhd is the engine's [blocks,
16, HKV, D] (a block's tokens interleave their heads: one head's rows lie 2 KiB apart), hnd stores
each block head-major ([blocks, HKV, 16, D], seen through a permuted view of the same shape, so one
head's 16 rows are 4 KiB in a row); the kernels read either through their strides.

    python benchmarks/kernels/bench_attention.py --out attention.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import graph_us, write_json
from thinkspec.layers.attention_triton import TritonAttentionBackend
from thinkspec.layers.forward_context import AttentionMetadata

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16


def decode_case(
    batch: int, context: int, layers: int, dev: torch.device, gen: torch.Generator, queries: int = 1,
    heads: tuple[int, int] = (HQ, HKV),
):
    """(q, k, v [batch * queries, H, D], per-layer (k_cache, v_cache) [blocks, 16, HKV, D], metadata):
    each sequence feeds its last `queries` positions of `context` (1: decode, k+1: a verify); heads:
    (query heads H, KV heads HKV)."""
    hq, hkv = heads
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_seq]
    tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    pos = torch.arange(context - queries, context)  # [queries]
    slots = (tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    meta = AttentionMetadata(
        query_start_loc=(torch.arange(batch + 1, dtype=torch.int32) * queries).to(dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32).to(dev),
        slot_mapping=slots.to(dev),
        block_tables=tables.to(dev),
        max_query_len=queries,
        max_seq_len=context,
    )
    shape = (num_blocks, BLOCK_SIZE, hkv, D)
    caches = [
        (
            torch.randn(shape, device=dev, dtype=torch.bfloat16),
            torch.randn(shape, device=dev, dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    q = torch.randn(batch * queries, hq, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch * queries, hkv, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(batch * queries, hkv, D, device=dev, dtype=torch.bfloat16)
    return q, k, v, caches, meta


def relayout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """cache [blocks, 16, HKV, D] -> the same values in `layout` order (hnd: a permuted view of a
    [blocks, HKV, 16, D] tensor)."""
    if layout == "nhd":
        return cache
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def layer_us(backend: TritonAttentionBackend, case) -> float:
    """Microseconds per layer of a graph of one forward per layer's cache."""
    q, k, v, caches, meta = case
    return graph_us(lambda: [backend.forward(q, k, v, kc, vc, meta, D**-0.5) for kc, vc in caches]) / len(
        caches
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--contexts", default="128,256,384,1024,4096")
    ap.add_argument("--queries", default="1", help="query tokens per sequence: 1 = decode, k+1 = verify")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--heads", default=f"{HQ},{HKV}", help="query heads, KV heads (16,8: Qwen3-0.6B)")
    ap.add_argument("--layouts", default="nhd", help="cache layouts to time side by side: nhd, hnd")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=1, help="timings per shape, interleaved; median kept")
    ap.add_argument("--bandwidth", type=float, default=4.21e12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    grid = list(itertools.product(ints(args.block_n), ints(args.splits), ints(args.warps), ints(args.stages)))
    gen = torch.Generator().manual_seed(0)
    heads = ints(args.heads)
    if len(heads) != 2 or min(heads) < 1 or heads[0] % heads[1]:
        ap.error(f"--heads takes 'query heads,KV heads', a multiple of the KV heads, got {args.heads!r}")
    hq, hkv = heads
    layouts = args.layouts.split(",")
    if any(lay not in ("nhd", "hnd") for lay in layouts):  # "" (an empty list item) included
        ap.error(f"--layouts takes nhd and/or hnd, comma-separated, got {args.layouts!r}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    shapes: list = ["default", *[list(s) for s in grid]]
    rows = []
    for queries, batch, context in itertools.product(
        ints(args.queries), ints(args.batches), ints(args.contexts)
    ):
        q, k, v, caches, meta = decode_case(batch, context, args.layers, dev, gen, queries, (hq, hkv))
        floor_us = batch * context * hkv * D * 2 * 2 / args.bandwidth * 1e6
        ref = TritonAttentionBackend().forward(q, k, v, *caches[0], meta, D**-0.5).float()
        cases = {}
        for lay in layouts:  # the same values in each layout, so every output is checked against ref
            cases[lay] = (q, k, v, [tuple(relayout(c, lay) for c in pair) for pair in caches], meta)
        del caches
        backends = {}
        for lay, shape in itertools.product(layouts, shapes):
            if shape == "default":
                be = TritonAttentionBackend()
            else:
                block_n, splits, warps, stages = shape
                be = TritonAttentionBackend(
                    block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages
                )
            kc, vc = cases[lay][3][0]
            err = (be.forward(q, k, v, kc, vc, meta, D**-0.5).float() - ref).abs().max().item()
            if not err < 2e-2:
                raise AssertionError(f"{lay} {shape} at context {context}: max error {err}")
            backends[lay, str(shape)] = be
        times: dict[tuple[str, str], list[float]] = {key: [] for key in backends}
        for _ in range(args.repeats):  # layouts and shapes interleaved within each repeat
            for (lay, shape_key), be in backends.items():
                times[lay, shape_key].append(layer_us(be, cases[lay]))
        for lay, shape in itertools.product(layouts, shapes):
            ts = sorted(times[lay, str(shape)])
            rows.append(
                {"batch": batch, "queries": queries, "context": context, "layout": lay, "shape": shape,
                 "us": ts[len(ts) // 2], "us_all": ts, "floor_us": floor_us}
            )  # fmt: skip
        for lay in layouts:
            here = [r for r in rows if (r["batch"], r["queries"], r["context"], r["layout"]) ==
                    (batch, queries, context, lay)]  # fmt: skip
            default_us = next(r["us"] for r in here if r["shape"] == "default")
            best = min(here, key=lambda r: r["us"])
            unsplit = min(
                (r for r in here if r["shape"] == "default" or r["shape"][1] == 1), key=lambda r: r["us"]
            )
            print(
                f"batch {batch:>3} queries {queries} context {context:>6} {lay}: default {default_us:6.2f} "
                f"us/layer, best {best['us']:6.2f} "
                f"(block_n, splits, warps, stages) = {best['shape']}, best unsplit {unsplit['us']:6.2f} "
                f"{unsplit['shape']}, floor {floor_us:5.2f} us",
                flush=True,
            )
        del cases, backends
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(dev)
    result = {"device": device, "layers": args.layers, "heads": [hq, hkv], "rows": rows}
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
