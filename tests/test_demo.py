"""`thinkspec demo` on the bundled toy pair, at a reduced size."""

from __future__ import annotations

from thinkspec.entrypoints.cli import main


def test_demo_prints_both_modes_and_an_example(capsys):
    assert main(["demo", "--num-problems", "2", "--device", "cpu", "--seed", "7"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "strict" in out and "relaxed (ratio" in out
    # Progress on stderr: a bar per mode through loading, warm-up and the problems.
    for label in ("[1/3] plain decoding", "[2/3] strict", "[3/3] relaxed"):
        assert label in captured.err
    assert "loading" in captured.err and "warming up" in captured.err and "4/4" in captured.err
    plain = next(line for line in out.splitlines() if line.startswith("plain decoding"))
    accuracy, accept_len, thinking_len, tokens_per_s, vs_plain = plain.split()[-5:]
    assert accuracy == "2/2" and accept_len == thinking_len == "-" and float(tokens_per_s) > 0
    assert vs_plain == "1.00x"
    assert "--- reasoning_content ---" in out and "--- content ---" in out
    assert "**Answer:**" in out  # the answer part, shown apart from the reasoning
    # Table rows: mode, accuracy "correct/total", accept len, accept len in thinking, tokens/s.
    rows = {}
    for line in out.splitlines():
        if line.startswith(("strict", "relaxed")):
            accuracy, accept_len, thinking_len, _, vs_plain = line.split()[-5:]
            assert vs_plain.endswith("x") and float(vs_plain[:-1]) > 0
            correct, total = map(int, accuracy.split("/"))
            rows[line.split()[0]] = (correct, total, float(accept_len), float(thinking_len))
    assert set(rows) == {"strict", "relaxed"}
    strict, relaxed = rows["strict"], rows["relaxed"]
    # The bundled pair scored 100% strict and 99% relaxed on 500 fresh problems (README, "Measured"):
    # both right strict, at most one miss relaxed.
    assert strict[:2] == (2, 2)
    assert relaxed[1] == 2 and relaxed[0] >= 1
    # k = 4: between 1 (every draft rejected) and 5 tokens per round; the bundled draft helps, and
    # relaxing the thinking phase accepts more there (2.8 vs 4.6 at this seed).
    for _, _, accept_len, thinking_len in (strict, relaxed):
        assert 1 < accept_len <= 5 and 1 < thinking_len <= 5
    assert relaxed[3] > strict[3] + 0.5


def test_cpu_threads_leave_busy_cores_alone(monkeypatch):
    import torch

    from thinkspec.engine import factory

    pick = factory.pick_cpu_threads
    assert pick(2, 2, 1.1, {}) == 1  # a neighbour keeps one of two cores busy
    assert pick(2, 2, 3.0, {}) == 1  # never below one
    assert pick(2, 2, 0.2, {}) == 2  # alone: every core
    assert pick(8, 32, 4.0, {}) == 8  # never above torch's count
    assert pick(2, 2, 1.1, {"OMP_NUM_THREADS": "2"}) == 2  # the user's setting wins
    before = torch.get_num_threads()
    busy = [1.0]
    try:
        monkeypatch.setattr(factory, "_IMPORT_THREADS", 2)
        monkeypatch.setattr(factory, "_chosen_threads", None)
        monkeypatch.setattr(factory, "busy_cores", lambda cores: busy[0])
        monkeypatch.setattr(factory.os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        factory.set_cpu_threads()
        assert torch.get_num_threads() == 1
        busy[0] = 0.1  # the neighbour left: the next engine built takes both cores again
        factory.set_cpu_threads()
        assert torch.get_num_threads() == 2
        torch.set_num_threads(3)  # set by the caller: kept
        busy[0] = 1.0
        factory.set_cpu_threads()
        assert torch.get_num_threads() == 3
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's setting: kept
        factory.set_cpu_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_busy_cores_counts_other_processes_now(monkeypatch):
    """The busy share of the machine's ticks over the window, times the cores; a neighbour that has just
    started counts at once (a load average would lag it by a minute)."""
    from thinkspec.engine import factory

    ticks = iter([(1_000, 10_000), (1_150, 10_200)])  # 150 of 200 ticks busy
    monkeypatch.setattr(factory, "_cpu_ticks", lambda: next(ticks))
    assert factory.busy_cores(2, interval=0) == 1.5
    monkeypatch.setattr(factory, "_cpu_ticks", lambda: None)
    assert factory.busy_cores(2, interval=0) is None
    monkeypatch.undo()
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/stat"):
        return
    alone = factory.busy_cores(2, interval=0.3)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        factory.busy_cores(2, interval=0.1)  # the child starts up
        beside = factory.busy_cores(2, interval=0.3)
    finally:
        spin.kill()
        spin.wait()
    assert alone is not None and 0 <= alone <= 2.01
    assert beside is not None and beside >= 0.8  # one spinning process keeps about one core busy


def test_sweep_shows_loading_and_warm_up_progress(capsys):
    """The sweep's first minutes (loading both engines, graphs, warm-up runs) move a progress bar."""
    from checkpoints import tiny_checkpoint

    from thinkspec.bench.datasets import BenchItem
    from thinkspec.bench.sweep import RelaxSetting, run_sweep

    ckpt = str(tiny_checkpoint("qwen3", tied=True))
    items = [BenchItem(prompt=f"q{i}", answer="0", grader=lambda text: False) for i in range(2)]
    spec = {"model": ckpt, "num_speculative_tokens": 2, "reasoning_parser": "qwen3"}
    result = run_sweep(
        {"model": ckpt, "device": "cpu"}, spec, items, [RelaxSetting(relax_ratio=0.5, relax_top_k=2)],
        max_tokens=4, repeats=1,
    )  # fmt: skip
    assert [c.name for c in result.cells] == ["T=0 no_spec", "T=0 strict", "T=0 r=0.5 k=2"]
    err = capsys.readouterr().err
    for stage in ("loading the plain engine", "loading the spec engine", "graphs of the spec engine",
                  "warm-up run T=0 strict", "warm-up run T=0 r=0.5 k=2"):  # fmt: skip
        assert stage in err, stage
    # 2 engines loaded, 2 graph captures (none on CPU), 3 warm-up runs (no_spec, strict, relaxed).
    assert "7/7" in err
