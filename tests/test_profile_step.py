"""The engine-step profiler (benchmarks/engine/profile_step.py) and the throughput benchmark run on CPU."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from script_env import ENV, ROOT


@pytest.mark.parametrize("spec", [0, 2], ids=["plain", "spec"])
def test_profile_step_smoke(tmp_path, spec):
    out = tmp_path / "step.json"
    cmd = [sys.executable, "benchmarks/engine/profile_step.py", "--small", "--device", "cpu", "--batch", "2",
           "--steps", "3", "--warmup", "3", "--spec", str(spec), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    phases = result["phases_ms"]
    assert result["batch"] == 2 and result["device_profile"] is None and result["spec_k"] == spec
    # what the engine ran with (CPU: no async scheduling, so nothing runs ahead)
    assert (
        result["engine_args"] == {} and result["async_scheduling"] is False and result["run_ahead"] is False
    )
    # Structure, not timings: each part is timed inside its step, so every per-step part (the
    # remainder included) is >= 0 and <= that step, and so are their medians.
    parts = ("schedule", "execute_model", "sample", "wait_and_commit")
    if spec:  # the speculative step's phases, each called once per step
        parts = (
            "schedule",
            "propose",
            "pack",
            "verify_forward",
            "accept",
            "fetch",
            "outcomes",
            "apply",
            "rest",
        )
        assert (
            "speculative step (k=2" in proc.stdout and phases["propose"] > 0 and phases["verify_forward"] > 0
        )
    assert set(phases) == {"step_mean", "step", "step_min", "step_max", *parts}
    for name in parts:
        assert 0 <= phases[name] <= phases["step_max"], (name, phases)
    assert 0 < phases["step_min"] <= phases["step"] <= phases["step_max"]
    assert phases["step_mean"] >= phases["step_min"]  # total wall time of the steps / steps


def test_profile_step_host_profile(tmp_path):
    """--host-profile: the host functions with the most own time, per step, the step's own
    functions among them."""
    out = tmp_path / "step.json"
    cmd = [sys.executable, "benchmarks/engine/profile_step.py", "--small", "--device", "cpu", "--steps", "3",
           "--warmup", "2", "--spec", "2", "--host-profile", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    host = result["host_profile_ms"]
    assert 0 < len(host) <= 25 and result["device_phases_ms"] is None
    assert list(host.values()) == sorted(host.values(), reverse=True) and min(host.values()) >= 0
    # own times of distinct functions: together no more than the steps took
    assert sum(host.values()) <= result["phases_ms"]["step_max"] * 2
    assert any(name.startswith("attention_torch.py:") for name in host)  # the eager forwards' attention
    assert "host functions, own ms per step:" in proc.stdout


def test_device_marks_are_removed_after_their_run():
    """_mark's undo puts the original method back, so the marks' own host time (CUDA events) stays
    out of the host profile and the device profile that run after them."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.engine import profile_step
    finally:
        sys.path.remove(str(ROOT))

    class Runner:
        def execute_model(self) -> str:
            return "ran"

    runner = Runner()
    original = runner.execute_model
    undo = profile_step._mark(runner, "execute_model", "draft_forward", [])
    assert runner.execute_model != original
    undo()
    assert runner.execute_model == original and runner.execute_model() == "ran"


def test_kernel_gaps_counts_idle_device_time_only():
    """kernel_gaps: idle time between kernels by transition, per step; overlapping kernels (PDL) and a
    kernel inside a longer one leave no gap."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.engine import profile_step
    finally:
        sys.path.remove(str(ROOT))

    class Span:
        def __init__(self, start: float, end: float) -> None:
            self.start, self.end = start, end

    class Event:
        def __init__(self, name: str, start: float, end: float) -> None:
            self.name, self.time_range = name, Span(start, end)

    events = [  # us; unsorted, as the profiler may list them
        Event("void at::native::argmax_kernel<float>(int)", 30.0, 34.0),
        Event("_gemv_kernel", 0.0, 10.0),
        Event("_rms_norm_kernel", 8.0, 12.0),  # overlaps the GEMV: no gap
        Event("_tiny_kernel", 9.0, 11.0),  # inside the norm: no gap, and the norm stays the latest end
        Event("_gemv_kernel", 20.0, 25.0),  # 8 us after the norm
        Event("_gemv_kernel", 40.0, 42.0),  # 6 us after the argmax
    ]
    gaps = profile_step.kernel_gaps(events, steps=2)
    assert gaps["idle_ms_per_step"] == pytest.approx((8 + 5 + 6) / 1e3 / 2)
    assert gaps["top_ms_per_step"] == {
        "_rms_norm_kernel -> _gemv_kernel": pytest.approx(0.004),
        "argmax_kernel -> _gemv_kernel": pytest.approx(0.003),
        "_gemv_kernel -> argmax_kernel": pytest.approx(0.0025),
    }
    assert gaps["top_count_per_step"]["_rms_norm_kernel -> _gemv_kernel"] == 0.5
    # critical_path: what each kernel adds past the latest end so far (the busy time, split by kernel)
    crit = profile_step.critical_path(events, steps=2)
    assert crit["top_ms_per_step"] == {
        "_gemv_kernel": pytest.approx((10 + 5 + 2) / 1e3 / 2),
        "argmax_kernel": pytest.approx(4 / 1e3 / 2),
        "_rms_norm_kernel": pytest.approx(2 / 1e3 / 2),  # 10 -> 12 only; the tiny kernel adds nothing
    }
    assert crit["busy_ms_per_step"] == pytest.approx(23 / 1e3 / 2)
    assert crit["top_count_per_step"]["_gemv_kernel"] == 1.5


@pytest.mark.gpu
def test_gpu_profile_step_device_phases(tmp_path):
    """--device-phases: device ms between the step's marks; the draft's forwards, the verify and
    the gaps between them add up to the step (the marks tile it)."""
    out = tmp_path / "step.json"
    cmd = [sys.executable, "benchmarks/engine/profile_step.py", "--small", "--steps", "5", "--warmup", "3",
           "--spec", "3", "--device-phases", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    marks = json.loads(out.read_text())["device_phases_ms"]
    for key in ("verify_forward<|verify_forward>", "draft_forward<|draft_forward> (first)",
                "draft_forward<|draft_forward>", "accept<|accept>", "step"):  # fmt: skip
        assert marks[key] > 0, (key, marks)
    parts = sum(v for k, v in marks.items() if k != "step")
    # medians per key do not add up exactly to the median step; each key is within a step
    assert (
        parts == pytest.approx(marks["step"], rel=0.25)
        and max(v for k, v in marks.items() if k != "step") < marks["step"]
    )


def test_profile_step_switch(tmp_path):
    """--switch: cycles of plain steps and one drafting step; the switch step catches the draft up
    over every row's plain-step tokens."""
    out = tmp_path / "switch.json"
    cmd = [sys.executable, "benchmarks/engine/profile_step.py", "--small", "--device", "cpu", "--batch", "2",
           "--steps", "3", "--warmup", "1", "--spec", "2", "--switch", "5", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    switch = result["switch_ms"]
    assert "switch step after 5 plain steps (k=2" in proc.stdout and result["profile_unit"] == "cycle"
    # 2 rows x (5 plain tokens + the last drafting step's bonus, its drafts not yet fed to the draft)
    assert switch["plain_steps"] == 5 and 2 * 5 < switch["catch_up_tokens"] <= 2 * (5 + 3)
    assert switch["switch_step"] == result["phases_ms"]["step"] > 0 and switch["plain_step"] > 0
    assert switch["switch_extra"] == pytest.approx(switch["switch_step"] - switch["steady_step"])


def test_bench_throughput_times_decode_from_the_first_token(tmp_path):
    """time_thinkspec's seconds: from the batch's first token to its last, as the requests' own
    timestamps say (the prefill left out without a second, 1-token run)."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import common
    finally:
        sys.path.remove(str(ROOT))
    from thinkspec import LLM

    folder = common.write_config(tmp_path / "t", common.SMALL_TARGET, 1024)
    llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy", skip_tokenizer_init=True,
              max_num_seqs=2, max_num_batched_tokens=64)  # fmt: skip
    spans = []
    generate = llm.generate

    def spy(*args, **kwargs):
        outs = generate(*args, **kwargs)
        firsts = [o.metrics.first_token_time for o in outs]
        spans.append(max(o.metrics.finished_time for o in outs) - min(firsts))
        return outs

    llm.generate = spy
    seconds, al, steps = common.time_thinkspec(llm, [[5, 6, 7], [8, 9]], 6, warm_up=False)
    assert len(spans) == 1 and seconds == spans[0] > 0 and al is None
    assert steps["count"] >= 6  # the prefill step and five decode steps, at least


def test_bench_throughput_smoke(tmp_path):
    # benchmarks/engine/bench_throughput.py on CPU at tiny shapes: plain, sync and one speculative row,
    # each with its engine-step summary over the timed run
    out = tmp_path / "throughput.json"
    cmd = [sys.executable, "benchmarks/engine/bench_throughput.py", "--small", "--device", "cpu", "--skip-hf",
           "--batch-sizes", "1,2", "--output-len", "12", "--acceptance-lengths", "3",
           "--repeats", "2", "--compare", "cublas,noearly,noprefetch", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["batch"]) for r in rows] == [
        ("thinkspec", 1), ("thinkspec_sync", 1), ("thinkspec_cublas", 1), ("thinkspec_noearly", 1),
        ("thinkspec_noprefetch", 1),
        ("thinkspec", 2), ("thinkspec_sync", 2), ("thinkspec_cublas", 2), ("thinkspec_noearly", 2),
        ("thinkspec_noprefetch", 2),
        ("thinkspec_spec_al3", 1), ("thinkspec_spec_al3", 2),
    ]  # fmt: skip
    for r in rows[:10]:  # plain cells: the median of --repeats round-robin runs
        assert len(r["seconds_reps"]) == 2 and r["seconds"] == pytest.approx(sum(r["seconds_reps"]) / 2)
    for r in rows:
        st = r["steps"]
        # "seconds": from the batch's first token to its last (the requests' timestamps)
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0
        assert r["tok_per_s"] == pytest.approx(r["batch"] * 11 / r["seconds"])  # 11 decode steps
        assert r["ms_per_step"] == pytest.approx(r["seconds"] / 11 * 1e3)
        assert st["count"] >= 2 and 0 < st["median_ms"] <= st["max_ms"]
        assert 0 <= st["slow_steps"] < st["count"] and st["slow_excess_ms"] >= 0
    plain = [r for r in rows if not r["engine"].startswith("thinkspec_spec")]
    assert all(r["steps"]["count"] >= 12 for r in plain)  # prefill + 11 decode steps, at least
    assert all(r["acceptance_length"] >= 1 for r in rows if r["engine"].startswith("thinkspec_spec"))

    png = tmp_path / "throughput.png"
    cmd = [sys.executable, "benchmarks/engine/plot_throughput.py", str(out), "--out", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
