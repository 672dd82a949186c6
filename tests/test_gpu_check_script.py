"""scripts/gpu_check.sh reports each stage's status and exits non-zero when any stage failed.

The script runs with stand-ins for `python3` (through PYTHON) and `nvidia-smi` (on PATH), so no GPU,
model or benchmark is involved.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"

# pytest prints a result line and exits FAKE_TESTS_RC; a command whose arguments contain FAKE_HANG
# sleeps past its stage's timeout; one containing FAKE_FAIL exits 3; anything else exits 0.
FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *" pytest "*) echo "${FAKE_TESTS_LINE:-3 passed in 0.01s}"; exit "${FAKE_TESTS_RC:-0}" ;;
esac
if [ -n "${FAKE_HANG:-}" ]; then case "$*" in *"$FAKE_HANG"*) exec sleep 30 ;; esac; fi
if [ -n "${FAKE_FAIL:-}" ]; then case "$*" in *"$FAKE_FAIL"*) echo boom; exit 3 ;; esac; fi
echo "fake run: $*"
"""
FAKE_NVIDIA_SMI = "#!/bin/sh\necho 'Fake GPU, 1 MiB, 0.0'\n"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")  # fmt: skip


def _run(tmp_path: Path, stages: str, **env: str) -> tuple[int, str, str]:
    """Runs the script in tmp_path with the stand-ins; returns (exit status, stdout, summary.txt)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", FAKE_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "out"
    full_env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python3"),
                    OUT=str(out), STAGES=stages, **env)  # fmt: skip
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    return proc.returncode, proc.stdout, (out / "summary.txt").read_text()


def _summary_section(stdout: str) -> str:
    assert "==== summary ====" in stdout, stdout
    return stdout.split("==== summary ====", 1)[1]


def test_all_stages_ok_exit_zero(tmp_path):
    rc, stdout, summary = _run(tmp_path, "tests spec_round throughput")
    assert rc == 0, stdout
    lines = summary.splitlines()
    assert "tests: ok 3 passed in 0.01s" in lines
    assert "spec_round: ok" in lines and "throughput: ok" in lines
    assert lines[-1] == "all stages ok"
    assert "spec_round: ok" in _summary_section(stdout)


def test_failing_pytest_fails_the_script_and_later_stages_still_run(tmp_path):
    rc, stdout, summary = _run(tmp_path, "tests spec_round", FAKE_TESTS_RC="1",
                               FAKE_TESTS_LINE="1 failed, 2 passed in 0.01s")  # fmt: skip
    assert rc != 0
    lines = summary.splitlines()
    assert "tests: FAILED (exit 1) 1 failed, 2 passed in 0.01s" in lines
    assert "spec_round: ok" in lines
    assert lines[-1] == "FAILED: 1 stage(s): tests"
    assert "tests: FAILED (exit 1)" in _summary_section(stdout)


def test_pytest_error_exit_fails_the_script(tmp_path):
    # Exit 4 (usage error) or 5 (nothing collected) print no "failed" line, and still fail the run.
    rc, _, summary = _run(tmp_path, "tests", FAKE_TESTS_RC="5", FAKE_TESTS_LINE="no tests ran in 0.01s")
    assert rc != 0
    assert "tests: FAILED (exit 5) no tests ran in 0.01s" in summary.splitlines()


def test_timed_out_and_failing_benchmarks(tmp_path):
    rc, stdout, summary = _run(tmp_path, "spec_round throughput gemv argmax", FAKE_HANG="bench_spec_round",
                               SPEC_ROUND_TIMEOUT="1", FAKE_FAIL="bench_throughput")  # fmt: skip
    assert rc != 0
    lines = summary.splitlines()
    assert "spec_round: TIMED OUT after 1s" in lines
    assert "throughput: FAILED (exit 3)" in lines
    assert "gemv: ok" in lines and "argmax: ok" in lines
    assert "fake run: benchmarks/kernels/bench_argmax.py --out" in stdout
    assert lines[-1] == "FAILED: 2 stage(s): spec_round,throughput"
    assert "spec_round: TIMED OUT after 1s" in _summary_section(stdout)


@pytest.mark.parametrize("stage", ["adaptive", "overhead", "bookkeeping", "attention", "host"])
def test_stage_passes_its_args_and_is_time_boxed(tmp_path, stage):
    scripts = {"overhead": "toy/toy_plain_overhead", "bookkeeping": "engine/bench_plain_bookkeeping",
               "adaptive": "speculative/bench_adaptive", "attention": "kernels/bench_attention",
               "host": "engine/host_noise"}  # fmt: skip
    path = scripts[stage]
    script = path.split("/")[-1]
    rc, stdout, summary = _run(tmp_path, stage, **{f"{stage.upper()}_ARGS": "--batch-sizes 1,16 --repeats 1"})
    assert rc == 0 and f"{stage}: ok" in summary.splitlines()
    assert f"fake run: benchmarks/{path}.py --out" in stdout and "--batch-sizes 1,16 --repeats 1" in stdout
    rc, _, summary = _run(tmp_path, stage, FAKE_HANG=script, **{f"{stage.upper()}_TIMEOUT": "1"})
    assert rc != 0 and f"{stage}: TIMED OUT after 1s" in summary.splitlines()
    rc, _, summary = _run(tmp_path, stage, FAKE_FAIL=script)  # a failing benchmark fails its stage
    assert rc != 0 and f"{stage}: FAILED (exit 3)" in summary.splitlines()


def test_tp_stage_runs_the_gpu_test_and_the_benchmark(tmp_path):
    rc, stdout, summary = _run(tmp_path, "tp", TP_SIZE="4", TP_ARGS="--parts allreduce,plain")
    assert rc == 0, stdout
    lines = summary.splitlines()
    assert "tp_tests: ok 3 passed in 0.01s" in lines and "tp: ok" in lines
    assert "fake run: benchmarks/engine/bench_tp.py --tp 4 --out" in stdout
    assert "--parts allreduce,plain" in stdout


def test_tp_stage_can_skip_its_test(tmp_path):
    rc, stdout, summary = _run(tmp_path, "tp", TP_TESTS="0")
    assert rc == 0, stdout
    assert "tp: ok" in summary.splitlines() and "tp_tests" not in summary


def test_skinny_stage_passes_its_args_and_prints_the_table(tmp_path):
    rc, stdout, summary = _run(tmp_path, "skinny", SKINNY_ARGS="--rows 16,64")
    assert rc == 0 and "skinny: ok" in summary.splitlines()
    assert "fake run: benchmarks/kernels/bench_skinny_gemm.py --out" in stdout and "--rows 16,64" in stdout
    assert "fake run: benchmarks/kernels/bench_skinny_gemm.py --table-from" in stdout
    rc, _, summary = _run(tmp_path, "skinny", FAKE_FAIL="bench_skinny_gemm")
    assert rc != 0 and "skinny: FAILED (exit 3)" in summary.splitlines()


def test_step_modes_reach_profile_step(tmp_path):
    """STEP_RUNS modes: specK drafts K per step with the device phases timed, async_scheduling off;
    aheadK the same with it on (the first draft forward runs ahead); sync turns async scheduling
    off. A run listed twice keeps both results."""
    rc, stdout, summary = _run(tmp_path, "step", STEP_RUNS="1::spec4 1::ahead4 16::sync 1::spec4")
    assert rc == 0, stdout
    prefix = "fake run: benchmarks/engine/profile_step.py"
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    runs = list(dict.fromkeys(lines))  # each run's line is echoed and shown
    assert len(runs) == 4, stdout
    assert '--spec 4 --device-phases --engine-args {"async_scheduling": false}' in runs[0]
    assert '--spec 4 --device-phases --engine-args {"async_scheduling": true}' in runs[1]
    assert '--batch 16 --engine-args {"async_scheduling": false}' in runs[2]
    assert runs[0].replace("step_0_", "step_3_") == runs[3]


def test_trees_stage_compares_the_baseline_tree_with_the_working_tree(tmp_path):
    rc, stdout, summary = _run(tmp_path, "trees", OLD_TREE="base")
    assert rc == 0, stdout
    assert "trees: ok" in summary.splitlines()
    run = next(line for line in stdout.splitlines() if line.startswith("fake run:"))
    assert "benchmarks/engine/compare_trees.py --out" in run and "--old base --new . --repeats 3" in run
