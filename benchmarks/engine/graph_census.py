"""Which dependencies in the engine's captured CUDA graphs are full launch boundaries, and into what.

Runs bench_spec_round's engines (Qwen3-8B target and Qwen3-0.6B draft shapes, dummy weights) for a
few rounds with every graph kept for reading (torch's keep_graph=True; graphs are instantiated at
their first replay as before), then sorts each graph's edges (graph_edges.py) into programmatic ones
(the engine's Triton kernels launched with PDL: placed before the kernel ahead of them has finished)
and full ones, and names the nodes full edges lead into. A full edge is a launch boundary PDL does
not hide: into cuBLAS's kernels (which do not wait on a programmatic edge; bench_cublas_chain.py
shows it), memsets, torch's own kernels.

    python benchmarks/graph_census.py --batch-sizes 1,64 --k 4 --out census.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.kernels.graph_edges import FULL, PROGRAMMATIC

Named = tuple[int, int, str, tuple[int, int, int]]  # (from node, to node, to node's name, edge kind)


def summarize(named: list[Named]) -> dict:
    """Counts of one graph's edges: nodes (that have an edge), edges, programmatic, full, and full
    edges by the name of the node they lead into (most first)."""
    nodes = {a for a, _, _, _ in named} | {b for _, b, _, _ in named}
    kinds = Counter(kind for *_, kind in named)
    into = Counter(name for _, _, name, kind in named if kind == FULL)
    return dict(nodes=len(nodes), edges=len(named), programmatic=kinds[PROGRAMMATIC], full=kinds[FULL],
                full_into=into.most_common())  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("graph_census needs a CUDA device (the graphs are the engine's CUDA graphs)")
    from benchmarks.kernels.graph_edges import edges, node_name
    from benchmarks.speculative import bench_spec_round
    from thinkspec.engine import cuda_graph

    class KeptGraph(torch.cuda.CUDAGraph):  # the engine's torch.cuda.CUDAGraph(), kept for reading
        def __new__(cls, keep_graph: bool = True):
            return super().__new__(cls, True)

        def __init__(self, keep_graph: bool = True) -> None:
            super().__init__(True)

    captured = []  # (hidden size, graph key, graph)
    capture = cuda_graph.CUDAGraphCache.capture

    def capture_and_keep(self, key):
        capture(self, key)
        captured.append((self.model.config.hidden_size, key, self.graphs[key]))

    torch.cuda.CUDAGraph = KeptGraph
    cuda_graph.CUDAGraphCache.capture = capture_and_keep
    with tempfile.TemporaryDirectory() as tmp:
        round_args = ["--rounds", "2", "--warmup", "1", "--reps", "1", "--out", str(Path(tmp) / "round.json")]
        sys.argv = ["bench_spec_round.py", "--batch-sizes", args.batch_sizes, "--k", str(args.k), *round_args]
        bench_spec_round.main()
    graphs = []
    for hidden, (bucket, width), graph in captured:
        named = [(a, b, node_name(b), kind) for a, b, kind in edges(graph.raw_cuda_graph())]
        role = "target" if hidden == 4096 else "draft"
        graphs.append(dict(role=role, batch=bucket, tokens_per_row=width, **summarize(named)))
    print(f"{'graph':>22} {'nodes':>6} {'PDL':>5} {'full':>5}  full edges into")
    for g in graphs:
        into = ", ".join(f"{n} {name[:40]}" for name, n in g["full_into"][:4])
        print(f"{g['role']:>6} batch {g['batch']:>3} x {g['tokens_per_row']} {g['nodes']:>6} "
              f"{g['programmatic']:>5} {g['full']:>5}  {into}")  # fmt: skip
    if args.out:
        device = torch.cuda.get_device_name()
        Path(args.out).write_text(json.dumps(dict(device=device, k=args.k, graphs=graphs), indent=1))


if __name__ == "__main__":
    main()
