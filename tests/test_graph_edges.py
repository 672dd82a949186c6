"""benchmarks/kernels/graph_edges.py on a GPU: capture records a PDL launch as a programmatic edge, and the
rewrite of a full edge into a programmatic one takes effect (a consumer that does not wait then reads
before its producer has written; one that waits does not), so bench_cublas_chain's race test can
tell a waiting kernel from one that does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

gpu = pytest.mark.gpu
needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))
    from benchmarks.kernels import bench_cublas_chain, graph_edges

    return graph_edges, bench_cublas_chain


def _fill_then_copy(bench, x, row, wait: bool, pdl: bool, scratch=None):
    """The slow fill of x's row 0, then (a memset of scratch, when given) the copy of it into row."""
    _, chain = bench
    block = chain.FILL_BLOCK
    chain._slow_fill[(x.shape[1] // block,)](x, 20_000, 0.5, 0.5, BLOCK=block)
    if scratch is not None:
        chain.memset(scratch)
    chain._copy[(x.shape[1] // block,)](x, row, WAIT=wait, BLOCK=block, launch_pdl=pdl)


def _stale_replays(g, x, row, scratch=None, replays: int = 3) -> int:
    """Instantiates g (fill row 0 of x -> copy it into row) and replays it from x = 0, row = 7 and
    scratch = 1: each replay the fill writes x[0] = 1 (and the memset zeroes scratch); returns in how
    many replays the copy read x[0] before it was written."""
    g.instantiate()
    stale = 0
    for _ in range(replays):
        x.zero_()
        row.fill_(7)
        if scratch is not None:
            scratch.fill_(1)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(x[0] == 1)
        assert scratch is None or torch.all(scratch == 0)
        stale += int(not torch.equal(row, x[0]))
    return stale


@gpu
@needs_hopper
def test_capture_records_a_pdl_launch_as_a_programmatic_edge(bench):
    edges_mod, chain = bench
    x = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)
    row = torch.empty(2048, device="cuda", dtype=torch.bfloat16)
    for pdl, expected in ((False, edges_mod.FULL), (True, edges_mod.PROGRAMMATIC)):
        g = chain.capture_graph(lambda pdl=pdl: _fill_then_copy(bench, x, row, True, pdl), keep=True)
        graph = g.raw_cuda_graph()
        found = [(edges_mod.node_name(a), edges_mod.node_name(b), d) for a, b, d in edges_mod.edges(graph)]
        assert found == [("_slow_fill", "_copy", expected)]


@gpu
@needs_hopper
@pytest.mark.parametrize("wait", [False, True])
def test_a_rewritten_edge_lets_the_consumer_start_early(bench, wait):
    edges_mod, chain = bench
    x = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)
    row = torch.empty(2048, device="cuda", dtype=torch.bfloat16)
    g = chain.capture_graph(lambda: _fill_then_copy(bench, x, row, wait, False), keep=True)
    graph = g.raw_cuda_graph()
    assert edges_mod.make_programmatic(graph, lambda name: name == "_slow_fill") == 1
    assert [d for _, _, d in edges_mod.edges(graph)] == [edges_mod.PROGRAMMATIC]
    assert edges_mod.make_programmatic(graph, lambda name: name == "_slow_fill") == 0  # nothing full is left
    assert _stale_replays(g, x, row) == (0 if wait else 3)


@gpu
@needs_hopper
def test_a_memset_between_moves_ahead_of_the_producer(bench):
    """cuBLAS puts a memset before some products; through_memsets moves it ahead of the producer, which
    then has a programmatic edge to the kernel: the memset still runs, and the consumer starts early."""
    edges_mod, chain = bench
    x = torch.zeros(2, 2048, device="cuda", dtype=torch.bfloat16)
    row = torch.empty(2048, device="cuda", dtype=torch.bfloat16)
    scratch = torch.empty(4096, device="cuda", dtype=torch.uint8)
    g = chain.capture_graph(lambda: _fill_then_copy(bench, x, row, False, False, scratch), keep=True)
    graph = g.raw_cuda_graph()
    fill = lambda name: name == "_slow_fill"  # noqa: E731
    assert edges_mod.make_programmatic(graph, fill) == 0  # a memset is in the way
    assert edges_mod.make_programmatic(graph, fill, through_memsets=True) == 1
    found = sorted((edges_mod.node_name(a), edges_mod.node_name(b), d) for a, b, d in edges_mod.edges(graph))
    full, programmatic = edges_mod.FULL, edges_mod.PROGRAMMATIC
    assert found == [("<memset>", "_slow_fill", full), ("_slow_fill", "_copy", programmatic)]
    assert _stale_replays(g, x, row, scratch) == 3
