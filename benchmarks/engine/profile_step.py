"""Where one engine step goes at a given batch: phases on the host, busy and idle time on the device.

Builds the engine on Qwen3-8B-shaped random weights (`--shape 0.6b`: the draft's shape; `--small` for
a CPU smoke test), starts --batch requests of --prompt-len random tokens (greedy, EOS ignored), runs
--warmup steps, then times --steps steady-state decode steps two ways:
  phases    steps run back to back (as generate() runs them: outputs of finished requests only,
            none here); step_mean = their wall time / steps; each step's wall time split into
            schedule, execute_model (input packing, graph replay or eager forward, logits), sample
            (the sampler's launches), wait + commit (the rest: the device->host copy of the tokens,
            which waits for the device, and the scheduler's postprocess and outputs), each the
            median over the steps (ms). With async scheduling a step waits for the previous one's
            tokens, so its wall time is the device's step time whenever the host keeps ahead.
  device    the same steps under torch.profiler (CUDA only): device busy time per step (sum of
            kernel and copy durations), idle = wall - busy, and the kernels outside CUDA graphs
With --spec K the engine speculates with a Qwen3-0.6B-shaped draft (dummy weights), every step
drafting K tokens per row, acceptance synthetic (--spec-rate: each draft accepted with that
probability given the ones before it were); the phases are then schedule, propose (the draft's
forwards and sampling), pack (the verify batch), verify_forward (the target's execute_model),
accept (rejection sampling, the phase bookkeeping), fetch (the one device->host copy, which waits for
the device), outcomes, apply (the scheduler's commit) and rest, each the median over the steps; the
device profile shows what of the step the graph replays do not cover.
With --switch L (and --spec K) the engine is an adaptive_k one, async scheduling off (one step per
choice), whose draft length is forced: L plain steps, then one step drafting K (the draft first
catches up over the L tokens in one forward without graphs: the switch out of plain decoding);
--warmup and --steps then count such cycles. The phases are the switch steps', the device profile
is per cycle (L plain steps and the switch), and plain_step / switch_step / steady_step are the
median wall ms of the cycles' plain steps, of their switch steps and of as many K-drafting steps run
back to back afterwards (switch_extra = switch_step - steady_step: what leaving plain decoding costs
beyond a steady step).
Writes JSON (--out) and prints a short table last.

    python benchmarks/engine/profile_step.py --out step.json                       # H200, batch 1
    python benchmarks/engine/profile_step.py --batch 64 --spec 3 --out spec.json   # H200, speculative step
    python benchmarks/engine/profile_step.py --batch 16 --spec 3 --switch 24 --steps 10 --out switch.json
    python benchmarks/engine/profile_step.py --small --device cpu --steps 5        # smoke test
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common

from benchmarks.common import QWEN3_0_6B, QWEN3_8B, SMALL_DRAFT, SMALL_TARGET, write_config, write_json
from thinkspec import LLM, SamplingParams
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.engine import speculator as speculator_module
from thinkspec.spec_decode.draft_length import GROUPS, ForcedDraftLength
from thinkspec.spec_decode.draft_model import draft_lag


def _wrap(obj: object, attr: str, name: str, sums: dict[str, float]) -> None:
    """Replace obj.attr by a wrapper that adds each call's wall time (ms) to sums[name]."""
    fn = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sums[name] += (time.perf_counter() - t0) * 1e3
        return out

    setattr(obj, attr, wrapper)


# Step phases: (attribute path from the engine, name in the table)
SPEC_PHASES = (
    ("scheduler.schedule", "schedule"), ("speculator.proposer.propose", "propose"),
    ("speculator._build_verify_batch", "pack"), ("speculator.target_runner.execute_model", "verify_forward"),
    ("speculator._verify", "accept"), ("speculator._outcomes", "outcomes"), ("scheduler.apply", "apply"),
)  # fmt: skip
PLAIN_PHASES = (
    ("scheduler.schedule", "schedule"), ("model_runner.execute_model", "execute_model"),
    ("sampler", "sample"),
)  # fmt: skip


def _owner(engine, path: str) -> tuple[object, str]:
    """(object, attribute name) of an attribute path from the engine, e.g. "speculator._verify"."""
    *parents, attr = path.split(".")
    obj = engine
    for part in parents:
        obj = getattr(obj, part)
    return obj, attr


def _time_phases(engine, phases, sums: dict[str, float]) -> None:
    """Wrap each phase's method (see _wrap); the sums are keyed by the phases' names."""
    for path, name in phases:
        _wrap(*_owner(engine, path), name, sums)


# Device marks (--device-phases): CUDA events recorded before and after each of these calls, so the
# device time between two marks is what the device did between them (the host keeps ahead at batch 1).
DEVICE_MARKS = (
    ("speculator.proposer.runner.execute_model", "draft_forward"),
    ("speculator.proposer._sample", "draft_sample"), ("speculator._build_verify_batch", "pack"),
    ("speculator.target_runner.execute_model", "verify_forward"), ("speculator._verify", "accept"),
)  # fmt: skip


def _mark(obj: object, attr: str, name: str, marks: list[tuple[str, torch.cuda.Event]]) -> Callable[[], None]:
    """Replace obj.attr by a wrapper that records a CUDA event before ("name<") and after ("name>");
    returns what puts the original back."""
    fn = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        marks.append((name + "<", _event()))
        out = fn(*args, **kwargs)
        marks.append((name + ">", _event()))
        return out

    setattr(obj, attr, wrapper)
    return lambda: setattr(obj, attr, fn)


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def device_phases(engine, steps: int) -> dict[str, float]:
    """Median device ms per step between consecutive marks, keyed "a|b" (a draft forward's own time is
    "draft_forward<|draft_forward>"; "x>|y<" is eager work, or an idle device, between two calls).
    The steps run back to back, as generate() runs them (one synchronisation after the last), so work
    queued ahead of a step (the forward run ahead) is still running when its "step<" mark is reached."""
    marks: list[tuple[str, torch.cuda.Event]] = []
    restore = []
    for path, name in DEVICE_MARKS:
        restore.append(_mark(*_owner(engine, path), name, marks))
    recorded = []
    for _ in range(steps):
        marks.append(("step<", _event()))
        engine.step(finished_only=True)
        marks.append(("step>", _event()))
        recorded.append(list(marks))
        marks.clear()
    torch.cuda.synchronize()
    per_step = []
    for step_marks in recorded:
        sums: dict[str, float] = defaultdict(float)
        seen: dict[str, int] = defaultdict(int)
        for (a, ea), (b, eb) in zip(step_marks, step_marks[1:]):
            key = f"{a}|{b}"
            seen[key] += 1
            if key == "draft_forward<|draft_forward>" and seen[key] == 1:
                # the step's first draft forward call: forward 1, or 2 when forward 1 ran ahead
                key = "draft_forward<|draft_forward> (first)"
            sums[key] += ea.elapsed_time(eb)
        sums["step"] = step_marks[0][1].elapsed_time(step_marks[-1][1])
        per_step.append(sums)
    for undo in restore:  # the marks' own host time stays out of what runs after
        undo()
    keys = sorted(
        {k for s in per_step for k in s}, key=lambda k: -statistics.median(s.get(k, 0.0) for s in per_step)
    )
    return {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameters, at most 48 characters."""
    return re.sub(r"[<(].*", "", name.removeprefix("void ")).split("::")[-1][:48]


def kernel_gaps(events: list, steps: int, top: int = 15) -> dict:
    """Idle device time between consecutive kernels and copies (profiler events sorted by start), per
    step: the total, and the transitions ("previous -> next" kernel) with the most of it, ms per step.
    Under programmatic dependent launch a kernel may start before the one before it ends (no gap)."""
    spans = sorted((e.time_range.start, e.time_range.end, _short(e.name)) for e in events)
    gaps: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    end, prev = None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            key = f"{prev} -> {name}"
            gaps[key] += (start - end) / 1e3 / steps  # us -> ms
            counts[key] += 1
        if end is None or stop >= end:
            end, prev = stop, name
    worst = sorted(gaps.items(), key=lambda kv: -kv[1])[:top]
    return {"idle_ms_per_step": sum(gaps.values()),
            "top_ms_per_step": {k: round(v, 4) for k, v in worst},
            "top_count_per_step": {k: counts[k] / steps for k, _ in worst}}  # fmt: skip


def critical_path(events: list, steps: int, top: int = 15) -> dict:
    """How far each kernel moves the device's finish line, per step: for events sorted by start, the
    part of a kernel's span past the latest end so far (ms per step, by kernel name, with counts).
    Under programmatic dependent launch a kernel is placed while the one before it runs and waits
    for it; its own span then overlaps, and only what it adds past that kernel's end counts here."""
    spans = sorted((e.time_range.start, e.time_range.end, _short(e.name)) for e in events)
    added: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    end = None
    for start, stop, name in spans:
        if end is None or stop > end:
            added[name] += (stop - (start if end is None else max(start, end))) / 1e3 / steps  # us -> ms
            end = stop
        counts[name] += 1
    worst = sorted(added.items(), key=lambda kv: -kv[1])[:top]
    return {"busy_ms_per_step": sum(added.values()),
            "top_ms_per_step": {k: round(v, 4) for k, v in worst},
            "top_count_per_step": {k: counts[k] / steps for k, _ in worst}}  # fmt: skip


def profile_host(engine, steps: int, top: int = 25) -> dict[str, float]:
    """The host functions with the most own time under cProfile, ms per step ("file:line function")."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step(finished_only=True)
    prof.disable()
    # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {f"{Path(f).name}:{line} {name}": own * 1e3 / steps for (f, line, name), (_, _, own, _, _) in rows}


def start_cycles(engine, k: int, cycle: int) -> None:
    """--switch: a forced policy whose choice n drafts k tokens per row when n is a multiple of cycle,
    else none; steps run until the next one makes choice 1, which starts a cycle (the prefill step
    makes no choice; choice 0 drafts with the draft in step)."""
    policy = ForcedDraftLength(k, lambda step, counts: np.full(len(GROUPS), k if step % cycle == 0 else 0))
    engine.speculator.planner.draft_length = policy
    while policy.num_choices != 1:
        engine.step(finished_only=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--shape", choices=("8b", "0.6b"), default="8b", help="the target's shape (draft: 0.6B)")
    ap.add_argument("--spec", type=int, default=0, help="speculate with K drafts per row (0: plain steps)")
    ap.add_argument("--spec-rate", type=float, default=0.8, help="synthetic acceptance rate (--spec)")
    ap.add_argument("--switch", type=int, default=0,
                    help="(--spec) cycles of this many plain steps and one drafting step")  # fmt: skip
    ap.add_argument("--engine-args", default="{}", help="extra LLM(...) keyword arguments as JSON")
    ap.add_argument("--device-phases", action="store_true",
                    help="(CUDA, --spec) time the device between the step's calls (CUDA events)")  # fmt: skip
    ap.add_argument("--host-profile", action="store_true",
                    help="also time the steps under cProfile (host functions, own ms)")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.switch and not args.spec:
        ap.error("--switch needs --spec K")
    device = torch.device(args.device)
    cycle = args.switch + 1  # engine steps per timed unit
    vocab = 1024 if args.small else 151936
    with tempfile.TemporaryDirectory() as tmp:
        shape = QWEN3_0_6B if args.shape == "0.6b" else QWEN3_8B
        folder = write_config(Path(tmp) / "target", SMALL_TARGET if args.small else shape, vocab)
        engine_args = dict(
            device=args.device, dtype="float32" if device.type == "cpu" else "bfloat16",
            load_format="dummy", skip_tokenizer_init=True, max_num_seqs=max(args.batch, 1),
            max_model_len=args.prompt_len + (args.warmup + 3 * args.steps) * (args.spec + cycle) + 16,
        )  # fmt: skip
        if args.spec:
            draft = write_config(Path(tmp) / "draft", SMALL_DRAFT if args.small else QWEN3_0_6B, vocab)
            engine_args["speculative_config"] = {
                "model": str(draft), "num_speculative_tokens": args.spec, "adaptive_k": bool(args.switch),
            }  # fmt: skip
        if args.switch:  # one engine step per choice, so the cycles' steps are known by number
            engine_args["async_scheduling"] = False
        # --engine-args overrides, e.g. '{"max_model_len": 32768}' (split-KV follows max_model_len)
        llm = LLM(folder, **{**engine_args, **json.loads(args.engine_args)})
        if args.spec:
            install_synthetic_acceptance(llm, rate=args.spec_rate)
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(
        temperature=0, max_tokens=(args.warmup + 3 * args.steps + 8) * (args.spec + cycle), ignore_eos=True
    )
    for i in range(args.batch):
        ids = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        engine.add_request({"prompt_token_ids": ids}, params, str(i))
    if args.switch:  # cycles from choice 1 on: plain choices 1..L, the switch at L + 1
        start_cycles(engine, args.spec, cycle)
    for _ in range(args.warmup * cycle):  # (prefill,) decode steps: graphs for this batch are captured
        engine.step(finished_only=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sums: dict[str, float] = defaultdict(float)
    timed_phases = SPEC_PHASES if args.spec else PLAIN_PHASES
    phase_names = [name for _, name in timed_phases]
    _time_phases(engine, timed_phases, sums)
    if args.spec:
        # a classmethod: the wrapper goes on the class, called through it as the speculator does
        _wrap(speculator_module.HostPack, "fetch", "fetch", sums)
        phase_names.append("fetch")
    rows = []
    sync()
    start = time.perf_counter()
    plain_walls = []  # --switch: the cycles' plain steps
    behind = []  # --switch: tokens the draft catches up over in each switch step, all rows
    for i in range(args.steps * cycle):  # back to back, as generate() steps (no sync between steps)
        sums.clear()
        if args.switch and (i + 1) % cycle == 0:
            behind.append(sum(draft_lag(s) for s in engine.scheduler.running))
        t0 = time.perf_counter()
        engine.step(finished_only=True)
        wall = (time.perf_counter() - t0) * 1e3
        if (i + 1) % cycle:  # a plain step of a --switch cycle
            plain_walls.append(wall)
            continue
        rows.append(dict(wall=wall, **{n: sums.get(n, 0.0) for n in phase_names}))
    sync()
    phases = {
        "step_mean": (time.perf_counter() - start) * 1e3 / (args.steps * cycle),
        "step": statistics.median(r["wall"] for r in rows),
        "step_min": min(r["wall"] for r in rows),
        "step_max": max(r["wall"] for r in rows),  # a lazy graph capture or an eager step shows here
    }
    for name in phase_names:
        phases[name] = statistics.median(r[name] for r in rows)
    # plain: the device->host copy (waits for the device) and the commit; spec: what no phase covers
    rest = "rest" if args.spec else "wait_and_commit"
    phases[rest] = statistics.median(r["wall"] - sum(r[n] for n in phase_names) for r in rows)
    switch = None
    if args.switch:
        steady = ForcedDraftLength.fixed(args.spec, args.spec)
        engine.speculator.planner.draft_length = steady
        for _ in range(2):  # the first of them catches the draft up over the last cycle's plain steps
            engine.step(finished_only=True)
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step(finished_only=True)
            walls.append((time.perf_counter() - t0) * 1e3)
        switch = dict(
            plain_steps=args.switch, catch_up_tokens=statistics.median(behind),
            plain_step=statistics.median(plain_walls), switch_step=phases["step"],
            steady_step=statistics.median(walls), switch_extra=phases["step"] - statistics.median(walls),
        )  # fmt: skip
        start_cycles(engine, args.spec, cycle)  # back to cycles for the device profile

    marks = None
    if args.device_phases and device.type == "cuda" and args.spec and not args.switch:
        marks = device_phases(engine, args.steps)

    host_profile = None
    if args.host_profile and not args.switch:
        host_profile = profile_host(engine, args.steps)

    device_stats = None
    if device.type == "cuda":
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        sync()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.steps * cycle):
                engine.step(finished_only=True)
            sync()
        wall = (time.perf_counter() - t0) * 1e3 / args.steps
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in events) / 1e3 / args.steps  # us -> ms
        by_name: dict[str, float] = defaultdict(float)
        for e in events:
            by_name[e.name] += e.device_time / 1e3 / args.steps
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
        # Host time inside CUDA runtime calls (graph launches, copies, waits for the device).
        runtime: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda"):
                runtime[e.name] += e.cpu_time_total / 1e3 / args.steps
        device_stats = dict(
            wall_ms_per_step=wall, busy_ms_per_step=busy, idle_ms_per_step=wall - busy,
            kernels_per_step=len(events) / args.steps, top_kernels_ms_per_step=dict(top),
            runtime_ms_per_step=dict(sorted(runtime.items(), key=lambda kv: -kv[1])[:6]),
            gaps=kernel_gaps(events, args.steps), critical_path=critical_path(events, args.steps),
        )  # fmt: skip

    floor_ms = sum(t.numel() * t.element_size() for t in engine.model.parameters()) / 4.21e12 * 1e3
    result = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        shape="small" if args.small else f"Qwen3-{args.shape.upper()}", batch=args.batch,
        prompt_len=args.prompt_len,
        spec_k=args.spec, spec_rate=args.spec_rate if args.spec else None, steps=args.steps,
        floor_ms=floor_ms, phases_ms=phases, device_phases_ms=marks, host_profile_ms=host_profile,
        device_profile=device_stats,
        switch_ms=switch, profile_unit="cycle" if args.switch else "step",
        engine_args=json.loads(args.engine_args), async_scheduling=engine.async_scheduling,
        run_ahead=engine.speculator is not None and engine.speculator.run_ahead,
    )  # fmt: skip
    if args.out:
        write_json(args.out, result)
    what = f"speculative step (k={args.spec}, rate {args.spec_rate})" if args.spec else "engine step"
    if switch:
        what = f"switch step after {args.switch} plain steps (k={args.spec}, rate {args.spec_rate})"
    print(f"{what}, {result['shape']}, batch {args.batch}, floor {floor_ms:.2f} ms (medians, ms)")
    print("  " + "  ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if switch:
        print(f"  plain step {switch['plain_step']:.3f}  switch step {switch['switch_step']:.3f}  "
              f"steady step {switch['steady_step']:.3f}  switch extra {switch['switch_extra']:.3f}  "
              f"catch-up tokens {switch['catch_up_tokens']:.0f}")  # fmt: skip
    if host_profile:
        print(
            "  host functions, own ms per step: " + "  ".join(f"{k} {v:.3f}" for k, v in host_profile.items())
        )
    if marks:
        print(
            "  device ms between marks (median per step): "
            + "  ".join(f"{k} {v:.3f}" for k, v in marks.items())
        )
    if device_stats:
        d = device_stats
        print(f"  profiled: wall {d['wall_ms_per_step']:.3f}  device busy {d['busy_ms_per_step']:.3f}  "
              f"idle {d['idle_ms_per_step']:.3f}  kernels/step {d['kernels_per_step']:.0f}")  # fmt: skip
        print(
            "  host in CUDA runtime calls: "
            + "  ".join(f"{k} {v:.3f}" for k, v in d["runtime_ms_per_step"].items())
        )
        for name, ms in d["top_kernels_ms_per_step"].items():
            print(f"    {ms:8.3f}  {name[:90]}")
        print(f"  idle between kernels {d['gaps']['idle_ms_per_step']:.3f} ms per step, largest:")
        for key, ms in d["gaps"]["top_ms_per_step"].items():
            print(f"    {ms:8.4f}  ({d['gaps']['top_count_per_step'][key]:.1f}x)  {key}")
        crit = d["critical_path"]
        print(f"  kernels moving the finish line, {crit['busy_ms_per_step']:.3f} ms per step, largest:")
        for key, ms in crit["top_ms_per_step"].items():
            print(f"    {ms:8.4f}  ({crit['top_count_per_step'][key]:.1f}x)  {key}")


if __name__ == "__main__":
    main()
