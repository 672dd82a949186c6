"""Honest timing of bench / sweep cells: round-robin repetitions, the build check and the
determinism check (thinkspec/bench/bench.py run_round_robin, thinkspec/bench/warmth.py)."""

from __future__ import annotations

import pytest

from thinkspec.bench import bench
from thinkspec.bench.results import CellResult
from thinkspec.bench.warmth import build_counts, check_no_builds


def _cell(name: str, seconds: float, digest: str = "d", temperature: float = 0.0) -> CellResult:
    return CellResult(
        name=name, setting={"mode": "strict", "temperature": temperature}, correct=[True], output_tokens=[10],
        truncated=0, seconds=seconds, latencies=[seconds], ttfts=[0.0], extra={"output_digest": digest},
    )  # fmt: skip


@pytest.fixture
def no_builds(monkeypatch):
    counts = {"graphs": 0, "kernels": 0}
    monkeypatch.setattr(bench, "build_counts", lambda llm: dict(counts))
    return counts


def test_cells_run_round_robin_and_keep_every_repetition(no_builds):
    calls: list[str] = []
    times = {"a": iter([1.0, 2.0, 4.0]), "b": iter([0.5, 0.5, 0.25])}

    def run(name: str):
        def go() -> CellResult:
            calls.append(name)
            return _cell(name, next(times[name]))

        return go

    a, b = bench.run_round_robin([(None, run("a")), (None, run("b"))], repeats=3, use_tqdm=False)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert a.tokens_per_s_reps == [10.0, 5.0, 2.5] and a.tokens_per_s == 5.0  # the median
    assert b.tokens_per_s_reps == [20.0, 20.0, 40.0] and b.tokens_per_s == 20.0
    row = a.summary()
    assert (row["tokens_per_s_min"], row["tokens_per_s_max"], row["repeats"]) == (2.5, 10.0, 3)


def test_a_timed_run_that_builds_fails_loudly(no_builds):
    def run() -> CellResult:
        no_builds["graphs"] += 1  # a graph captured inside the timed run
        return _cell("a", 1.0)

    with pytest.raises(RuntimeError, match="1 new graphs"):
        bench.run_round_robin([(None, run)], repeats=1, use_tqdm=False)


def test_greedy_outputs_must_repeat(no_builds):
    digests = iter(["x", "y"])
    with pytest.raises(RuntimeError, match="not deterministic"):
        bench.run_round_robin([(None, lambda: _cell("a", 1.0, next(digests)))], repeats=2, use_tqdm=False)
    sampled = iter(["x", "y"])  # seeded sampling is not held to it
    (cell,) = bench.run_round_robin(
        [(None, lambda: _cell("s", 1.0, next(sampled), temperature=0.7))], repeats=2, use_tqdm=False
    )
    assert len(cell.tokens_per_s_reps) == 2


def test_build_counts_of_a_cpu_engine_and_the_check():
    class Runner:
        graphs = None

    class Engine:
        model_runner = Runner()
        speculator = None

    class FakeLLM:
        llm_engine = Engine()

    counts = build_counts(FakeLLM())
    assert counts["graphs"] == 0 and counts["kernels"] >= 0
    check_no_builds(counts, dict(counts), "same")
    with pytest.raises(RuntimeError, match="2 new kernels"):
        check_no_builds({"graphs": 0, "kernels": 1}, {"graphs": 0, "kernels": 3}, "cell")


def test_generate_bounded_caps_requests_in_flight_and_matches_generate():
    from checkpoints import tiny_checkpoint

    from thinkspec import LLM, SamplingParams

    llm = LLM(tiny_checkpoint("qwen3", tied=True), device="cpu")
    prompts = [[65 + i, 66, 67 + i] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(5)]
    engine = llm.llm_engine
    step, peak = engine.step, [0]

    def counting_step(*args, **kwargs):
        sch = engine.scheduler
        peak[0] = max(peak[0], len(sch.running) + len(sch.waiting))
        return step(*args, **kwargs)

    engine.step = counting_step
    got = bench.generate_bounded(llm, prompts, params, max_in_flight=2)
    assert peak[0] == 2
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(ValueError, match="max_in_flight"):
        bench.generate_bounded(llm, prompts, params, max_in_flight=0)


def test_batch_size_flag_and_cell_names():
    from thinkspec.bench.results import cell_name
    from thinkspec.bench.sweep import _batch_sizes

    assert _batch_sizes("1, 16,all") == [1, 16, None]
    for bad in ("0", "x", ""):
        with pytest.raises(ValueError, match="batch-sizes"):
            _batch_sizes(bad)
    assert cell_name(0.0, "strict") == "T=0 strict" and cell_name(0.6, "strict", 16) == "T=0.6 strict b=16"


def test_compile_hook_counts_and_chains(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    from thinkspec.bench import warmth
    from thinkspec.engine import compiles

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *a, **k: seen.append(k))
    monkeypatch.setattr(compiles, "_hook_installed", False)
    assert compiles.install_compile_hook()
    before = warmth.compiled_kernels()
    knobs.runtime.jit_post_compile_hook(key="x", repr="k")  # what Triton calls after each compile
    assert warmth.compiled_kernels() == before + 1
    assert seen == [{"key": "x", "repr": "k"}]  # the hook that was there still runs
    key = ((("*bf16", "D"), ("i32", "D"), ("i32", "")), (64,))  # a key's shape: types, specialisations
    knobs.runtime.jit_post_compile_hook(key=key, repr="_attn[num_warps=4](q_ptr: (),\n n: i32)")
    want = "_attn[num_warps=4] ((('*bf16', 'D'), ('i32', 'D'), ('i32', '')), (64,))"
    assert compiles.recent_compiles(2) == ["k x", want]  # one line each
    with pytest.raises(RuntimeError, match="1 new kernels") as error:
        warmth.check_no_builds({"graphs": 0, "kernels": 0}, {"graphs": 0, "kernels": 1}, "cell")
    assert str(error.value).endswith(f"; built {want}")  # what was built, named


@pytest.mark.gpu
def test_a_new_kernel_variant_is_counted_on_cuda():
    torch = pytest.importorskip("torch")
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from thinkspec.bench.warmth import compiled_kernels

    @triton.jit
    def fill(out_ptr, value, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), value)

    out = torch.empty(64, device="cuda")
    before = compiled_kernels()
    fill[(1,)](out, 1.0, BLOCK=32)
    after_first = compiled_kernels()
    fill[(1,)](out, 2.0, BLOCK=32)  # same variant: cached
    fill[(1,)](out, 3.0, BLOCK=64)  # a new constexpr: a new variant
    torch.cuda.synchronize()
    assert after_first == before + 1
    assert compiled_kernels() == before + 2


def test_capture_graphs_covers_every_bucket_up_to_the_batch_at_every_width():
    from types import SimpleNamespace

    from thinkspec.bench.warmth import capture_graphs
    from thinkspec.engine.cuda_graph import GraphSpec

    class Cache:
        def __init__(self) -> None:
            self.spec = GraphSpec((1, 2, 5), (1, 2, 4, 8, 16, 24, 32), 64, 4)
            self.graphs: dict = {}

        def ensure_captured(self, key) -> None:
            self.graphs[key] = object()

    target, draft = SimpleNamespace(graphs=Cache()), SimpleNamespace(graphs=Cache())
    measured: list[int] = []  # adaptive_k's cost model is measured up to the same batch
    planner = SimpleNamespace(measure_costs=measured.append)
    speculator = SimpleNamespace(proposer=SimpleNamespace(runner=draft), planner=planner)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_runner=target, speculator=speculator))
    assert capture_graphs(llm, 20) == 2 * 3 * 6  # buckets 1..24 (24 holds 20 rows) x 3 widths x 2 runners
    assert measured == [20]
    assert set(target.graphs.graphs) == {(b, q) for b in (1, 2, 4, 8, 16, 24) for q in (1, 2, 5)}
    assert capture_graphs(llm, 20) == 0  # all there already
    plain = SimpleNamespace(model_runner=SimpleNamespace(graphs=None), speculator=None)
    assert capture_graphs(SimpleNamespace(llm_engine=plain), 8) == 0


def test_timed_runs_see_a_frozen_heap_and_report_their_gc_pauses(no_builds):
    import gc

    seen: list[int] = []

    def run() -> CellResult:
        seen.append(gc.get_freeze_count())  # what was alive before the run is out of the collector's walk
        cyclic = []
        for _ in range(2000):  # garbage in cycles, so a collection has work to do
            node: list = []
            node.append(node)
            cyclic.append(node)
        del cyclic
        gc.collect()
        return _cell("a", 1.0)

    (cell,) = bench.run_round_robin([(None, run)], repeats=2, use_tqdm=False)
    assert all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0  # thawed after each run
    for key in ("gc_pause_s_reps", "process_cpu_s_reps", "thread_cpu_s_reps"):  # one per repetition
        assert len(cell.extra[key]) == 2 and all(v > 0 for v in cell.extra[key]), key
