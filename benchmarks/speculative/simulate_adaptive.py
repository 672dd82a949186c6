"""adaptive_k against plain decoding and every fixed draft length, replayed on measured step times.

A projection, not a measurement: it runs the engine's own chooser (AdaptiveDraftLength) over a
simulated closed batch whose step times come from a bench_adaptive.py JSON measured on the device,
so policies can be compared without the device's run-to-run noise (the H200 cells spread 5-18%
between repetitions, the criterion allows 5%).

The batch: --batch-size rows start together, each emits --output-len tokens (its first
thinking_tokens of the JSON's good profile thinking, the rest answer). A row that drafts k tokens
accepts them position by position with its phase's conditional rate (the profile's a_i / a_{i-1}),
and emits the accepted drafts plus one, capped by its room. A step's time is the JSON's median
timed step of the speculating engine's fixed-k cell at that batch size, k the step's longest window
(k = 0: the plain engine's time per token), linear in the number of unfinished rows between the
measured batch sizes. The draft's catch-up: every row falls one token behind in a plain step, and
the first drafting step after plain steps that left a row more than 2 behind costs --switch-ms more
(the engine's switch; the chooser is told the draft is behind, and learns the cost from that step).
What it leaves out: the cheaper draft forwards of rows with shorter windows, steps that a row leaving
breaks out of async scheduling. --draws token draws one uniform per row and output position at the
start of each run instead of fresh ones per step, as bench_adaptive.py's seeded profiles hash
(request, output position): the same token meets the same draw whatever window covers it, so every
policy of a seed meets the same hard tokens and policies compare paired (the default, step, keeps the
figures recorded with it reproducible).

Policies: plain, fixed k = 1..K and adaptive: AdaptiveDraftLength with the cost model the engine
measured (the JSON's graph-replay figures per bucket), learning its overheads from the simulated
step times and its acceptance from the simulated windows. Each batch size has its own chooser, kept
across a warm-up run and --runs timed runs (--shared: one chooser for every batch size, run in
bench_adaptive.py's order, as on the device), for each of --seeds seeds; tok/s = rows x
(output_len - 1) / time, the mean over runs and seeds, reported with the adaptive criterion of
bench_adaptive.py (and its least over the seeds). --set NAME=VALUE changes a constant of the chooser
(what-if runs, e.g. --set PLAIN_MARGIN=0). --phase-grid also runs every fixed pair (thinking rows
draft T, answer rows A) and reports the best: what a chooser that knew each phase's best k from the
start would give, the ceiling of any choice on these step times. --oracle also runs "oracle": the
chooser told the profile's true conditional rates, which it never updates (what a perfect acceptance
estimate would give; it still probes and learns its overheads). --thinking-rates / --answer-rates
replace the JSON's good profile by conditional rates per draft position (acceptance that falls or
rises along the window). The output JSON keeps each seed's tok/s: runs of two trees on the same
seeds and draws compare seed by seed.

    python3 benchmarks/speculative/simulate_adaptive.py \
        benchmarks/results/2026-12-01-adaptive-h200-tolerance-b1-b128.json --seeds 8 --runs 5 \
        [--set PLAIN_MARGIN=0 --set MAX_STEP_WEIGHT=1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from thinkspec.spec_decode import draft_length
from thinkspec.spec_decode.draft_length import (
    ANSWER,
    GROUPS,
    THINKING,
    THINKING_RELAXED,
    AcceptanceEstimates,
    AdaptiveDraftLength,
    drain_weights,
)
from thinkspec.spec_decode.step_costs import StepCostModel, StepCosts


def step_table(result: dict, k_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(batch sizes [M], ms [M, K+1]) from a bench_adaptive JSON: the median timed step of each
    fixed-k cell at its batch size, k = 0 the plain engine's ms per step. A k above the largest
    measured one is extrapolated linearly from the last two (the grids at large batch stop at 3 or 4).
    Raises ValueError when a plain cell, or a k below the largest measured one, is missing."""
    rows = {(r["cell"], r["batch"]): r for r in result["rows"]}
    batches = sorted({r["batch"] for r in result["rows"]})
    ms = np.zeros((len(batches), k_max + 1))
    for i, b in enumerate(batches):
        plain = rows.get(("plain", b))
        if plain is None:
            raise ValueError(f"no plain cell at batch {b}")
        ms[i, 0] = 1e3 * b / plain["tok_per_s"]
        measured = [
            k for k in range(1, k_max + 1) if str(k) in rows.get((f"good k={k}", b), {}).get("step_times", {})
        ]
        if not measured or measured != list(range(1, measured[-1] + 1)):
            raise ValueError(f"timed steps of good k=1..K at batch {b} needed, got k in {measured}")
        for k in measured:
            ms[i, k] = rows[(f"good k={k}", b)]["step_times"][str(k)]["median"]
        top = measured[-1]
        ms[i, top + 1 :] = ms[i, top] + (ms[i, top] - ms[i, top - 1]) * np.arange(1, k_max - top + 1)
    return np.array(batches), ms


def cost_model(result: dict, k_max: int) -> StepCostModel:
    """The chooser's cost model as the engine measured it (graph replays per bucket), overheads
    unlearnt."""
    table = {}
    for bucket, entry in result["cost_model"].items():
        if "verify_ms" in entry:
            b, verify = int(bucket), entry["verify_ms"]
            table[b] = [StepCosts(b, k, verify[0], entry["draft_ms"], verify[k]) for k in range(k_max + 1)]
    return StepCostModel(k_max, sorted(int(b) for b in result["cost_model"]), table)


def profile_shares(text: str, k_max: int) -> list[float]:
    """[K] a profile's shares a_i from comma-separated conditional rates c_1, c_2, ... (--thinking-rates,
    --answer-rates; the last one repeats up to K): a_i = c_1 ... c_i. Raises ValueError on a rate
    outside [0, 1] or an empty list."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"conditional rates in [0, 1] needed, got {text!r}")
    rates = (rates + rates[-1:] * k_max)[:k_max]
    return np.cumprod(rates).tolist()


def conditional_rates(shares: list[float]) -> np.ndarray:
    """[K] c_i = a_i / a_{i-1} from the profile's shares a_i of rounds accepting draft i."""
    full = np.array([1.0, *shares])
    return np.divide(full[1:], full[:-1], out=np.zeros(len(shares)), where=full[:-1] > 0)


class ClosedBatch:
    """One simulated run: rows, their progress and the step times (see the module docstring)."""

    def __init__(
        self,
        batch: int,
        output_len: int,
        thinking_tokens: int,
        steps: tuple,
        rates: np.ndarray,
        switch_ms: float = 0.0,
        draws: str = "step",
    ):
        self.batch, self.output_len, self.thinking_tokens = batch, output_len, thinking_tokens
        self.step_batches, self.step_ms = steps  # [M], [M, K+1]
        self.rates = rates  # [G, K] conditional acceptance per group (only answer and thinking used)
        self.switch_ms = switch_ms  # a drafting step's extra ms when plain steps left the draft behind
        self.drain = DRAIN  # the chooser weighs rows by the tokens they have left, as the engine's does
        if draws not in DRAWS:
            raise ValueError(f"draws must be one of {DRAWS}, got {draws!r}")
        self.draws = draws  # "step": fresh uniforms per step; "token": one per row and output position

    def step_time(self, rows: int, kmax: int) -> float:
        return float(np.interp(rows, self.step_batches, self.step_ms[:, kmax]))

    def run(self, policy, rng: np.random.Generator) -> float:
        """Simulated seconds of one run; policy: an AdaptiveDraftLength, a fixed k (int) or a fixed
        (thinking k, answer k) pair."""
        done = np.ones(self.batch, dtype=np.int64)  # output tokens so far (the first one from the prefill)
        lag = 0  # plain steps since the last drafting step: tokens every row's draft is behind
        seconds = 0.0
        k_max = self.rates.shape[1]
        # [rows, output_len + K] the draw of each row's output position (a window may reach past the end)
        by_token = rng.random((self.batch, self.output_len + k_max)) if self.draws == "token" else None
        while True:
            live = np.flatnonzero(done < self.output_len)
            if live.size == 0:
                return seconds
            groups = np.where(done[live] < self.thinking_tokens, THINKING, ANSWER)
            if isinstance(policy, AdaptiveDraftLength):
                counts = np.bincount(groups, minlength=len(GROUPS))
                drain = drain_weights(groups, self.output_len - done[live]) if self.drain else None
                ks = policy.choose(counts, behind=[lag > 2] * len(GROUPS), drain=drain)[groups]
                if policy.probe_rows is not None:  # a probe out of plain decoding: its first rows only
                    ks[np.flatnonzero(ks)[policy.probe_rows :]] = 0
            elif isinstance(policy, tuple):
                ks = np.where(groups == THINKING, policy[0], policy[1])
            else:
                ks = np.full(live.size, policy)
            ks = np.minimum(ks, self.output_len - done[live] - 1)  # the room each row has left
            if by_token is None:
                u = rng.random((live.size, k_max))  # [R, K]
            else:  # draft i of a row covers its output position done + i
                u = by_token[live[:, None], done[live][:, None] + np.arange(k_max)[None, :]]
            trials = u < self.rates[groups]  # [R, K]
            streak = np.cumprod(trials, axis=1).sum(axis=1)
            accepted = np.minimum(streak, ks)
            done[live] += accepted + 1
            drafting = ks > 0
            ms = self.step_time(live.size, int(ks.max()))
            switch = bool(drafting.any()) and lag > 2
            if switch:
                ms += self.switch_ms
            lag = 0 if drafting.any() else lag + 1
            if isinstance(policy, AdaptiveDraftLength):
                policy.observe(groups[drafting], ks[drafting], accepted[drafting])
                (policy.observe_switch if switch else policy.observe_time)(ks, ms)
            seconds += ms / 1e3


# --no-drain: the chooser counts every row alike and sees no spread (the engine while requests wait)
DRAIN = True
DRAWS = ("step", "token")  # see ClosedBatch.draws

# Chooser constants --set may change (what-if runs): module constants of draft_length, and the
# weights of its acceptance estimates
SETTABLE = (
    "PLAIN_MARGIN",
    "PLAIN_PROBE_ROWS",
    "PLAIN_PROBE_PERIOD",
    "PROBE_PERIOD",
    "REFRESH",
    "REFRESH_PLAIN",
    "SWITCH_HORIZON",
    "SPREAD_MIN_LEFT",
)
ESTIMATE_WEIGHTS = {"RATE_ALPHA": "alpha", "MAX_STEP_WEIGHT": "max_weight", "SHRINK": "shrink"}


def chooser(result: dict, k_max: int, settings: dict[str, float]) -> AdaptiveDraftLength:
    """The engine's chooser on the JSON's cost model, with settings applied (see SETTABLE; module
    constants stay set for the rest of the process, which runs one what-if)."""
    for name, value in settings.items():
        if name in SETTABLE:
            setattr(draft_length, name, type(getattr(draft_length, name))(value))
    policy = AdaptiveDraftLength(k_max, cost_model(result, k_max))
    for name, attr in ESTIMATE_WEIGHTS.items():
        if name in settings:
            setattr(policy.estimates, attr, float(settings[name]))
    return policy


class KnownRates(AcceptanceEstimates):
    """Estimates that are the true conditional rates [G, K] and learn nothing (--oracle)."""

    def __init__(self, rates: np.ndarray) -> None:
        super().__init__(rates.shape[1])
        self.rates = rates.copy()

    def observe(self, groups: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        pass


def oracle(result: dict, k_max: int, settings: dict[str, float], rates: np.ndarray) -> AdaptiveDraftLength:
    """The chooser of `chooser` told the profile's conditional rates [G, K] (relaxed thinking rows as
    thinking ones), which it keeps."""
    policy = chooser(result, k_max, settings)
    known = rates.copy()
    known[THINKING_RELAXED] = known[THINKING]
    policy.estimates = KnownRates(known)
    return policy


def closed_batch(
    result: dict, batch: int, k_max: int, switch_ms: float = 0.0, draws: str = "step"
) -> ClosedBatch:
    """The JSON's good profile and step times at one batch size; switch_ms, draws: see ClosedBatch."""
    profile = result["profiles"]["good"]
    rates = np.zeros((len(GROUPS), k_max))
    rates[ANSWER] = conditional_rates(profile["answer"])[:k_max]
    rates[THINKING] = conditional_rates(profile["thinking"])[:k_max]
    return ClosedBatch(
        batch, result["output_len"], profile["thinking_tokens"], step_table(result, k_max), rates, switch_ms,
        draws,
    )  # fmt: skip


def simulate(
    result: dict,
    batch: int,
    k_max: int,
    runs: int,
    seed: int,
    settings: dict[str, float] | None = None,
    switch_ms: float = 0.0,
    phase_grid: bool = False,
    draws: str = "step",
    with_oracle: bool = False,
) -> dict[str, float]:
    """Mean tok/s of plain, fixed k = 1..k_max and adaptive at one batch size (its own chooser);
    phase_grid: also every fixed (thinking k, answer k) pair, as "k=T/A"; with_oracle: also the chooser
    told the true rates, as "oracle"; draws: see ClosedBatch."""
    sim = closed_batch(result, batch, k_max, switch_ms, draws)
    tokens = batch * (sim.output_len - 1)
    out = {}
    policies: list[tuple[str, object]] = [("plain", 0)] + [(f"k={k}", k) for k in range(1, k_max + 1)]
    if phase_grid:
        pairs = [(t, a) for t in range(k_max + 1) for a in range(k_max + 1) if t != a]
        policies += [(f"k={t}/{a}", (t, a)) for t, a in pairs]
    policies.append(("adaptive", chooser(result, k_max, settings or {})))
    if with_oracle:
        policies.append(("oracle", oracle(result, k_max, settings or {}, sim.rates)))
    for name, policy in policies:
        rng = np.random.default_rng(seed)
        sim.run(policy, rng)  # warm-up: the chooser learns, as bench_adaptive.py's warm-up run
        out[name] = float(np.mean([tokens / sim.run(policy, rng) for _ in range(runs)]))
    return out


def simulate_shared(
    result: dict,
    batches: list[int],
    k_max: int,
    runs: int,
    seed: int,
    settings: dict[str, float] | None = None,
    switch_ms: float = 0.0,
    draws: str = "step",
) -> dict[int, float]:
    """Mean tok/s of adaptive at each batch size with one chooser for all of them, run in
    bench_adaptive.py's order: a warm-up pass over the batch sizes, then runs passes."""
    sims = {b: closed_batch(result, b, k_max, switch_ms, draws) for b in batches}
    policy = chooser(result, k_max, settings or {})
    rng = np.random.default_rng(seed)
    for b in batches:
        sims[b].run(policy, rng)
    tok: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(runs):
        for b in batches:
            tok[b].append(b * (sims[b].output_len - 1) / sims[b].run(policy, rng))
    return {b: float(np.mean(v)) for b, v in tok.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a bench_adaptive.py JSON with every fixed k 1..K at each batch size")
    ap.add_argument("--batch-sizes", default=None, help="default: the JSON's")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per policy, batch size and seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, each its own warm-up and runs")
    ap.add_argument(
        "--shared", action="store_true",
        help="one chooser across the batch sizes, in bench_adaptive.py's order (as the device runs it)",
    )  # fmt: skip
    names = (*SETTABLE, *ESTIMATE_WEIGHTS)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help=f"a chooser constant for a what-if run: {', '.join(names)}")  # fmt: skip
    ap.add_argument("--phase-grid", action="store_true",
                    help="also every fixed (thinking k, answer k) pair: the best k per phase")  # fmt: skip
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="extra ms of a drafting step after plain steps (the draft's catch-up)")  # fmt: skip
    ap.add_argument("--no-drain", action="store_true",
                    help="the chooser counts every row alike, not by the tokens it has left")  # fmt: skip
    ap.add_argument("--draws", choices=DRAWS, default="step",
                    help="token: one draw per row and output position, as on the device")  # fmt: skip
    ap.add_argument("--thinking-rates", default=None, metavar="C1,C2,...",
                    help="thinking rows' acceptance per draft position (default: the JSON's)")  # fmt: skip
    ap.add_argument("--answer-rates", default=None, metavar="C1,C2,...",
                    help="the same for answer rows")  # fmt: skip
    ap.add_argument("--oracle", action="store_true",
                    help="also the chooser told the profile's true rates (a perfect estimate)")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    global DRAIN
    DRAIN = not args.no_drain
    settings = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in names or not value:
            ap.error(f"--set takes NAME=VALUE with NAME one of {', '.join(names)}, got {item!r}")
        settings[name] = float(value)
    result = json.loads(Path(args.result).read_text())
    k_max = result["k_max"]
    for phase in ("thinking", "answer"):
        text = getattr(args, f"{phase}_rates")
        if text is not None:
            try:
                result["profiles"]["good"][phase] = profile_shares(text, k_max)
            except ValueError as e:
                ap.error(f"--{phase}-rates: {e}")
    batches = sorted({r["batch"] for r in result["rows"]})
    if args.batch_sizes:
        batches = [int(b) for b in args.batch_sizes.split(",")]
    shared = []
    if args.shared:
        shared = [
            simulate_shared(result, batches, k_max, args.runs, seed, settings, args.switch_ms, args.draws)
            for seed in range(args.seeds)
        ]
    options = {"switch_ms": args.switch_ms, "phase_grid": args.phase_grid, "draws": args.draws,
               "with_oracle": args.oracle}  # fmt: skip
    table = []
    for b in batches:
        per_seed = [
            simulate(result, b, k_max, args.runs, seed, settings, **options) for seed in range(args.seeds)
        ]
        for t, adaptive in zip(per_seed, shared):
            t["adaptive"] = adaptive[b]
        tok = {name: float(np.mean([t[name] for t in per_seed])) for name in per_seed[0]}
        fixed = {n: v for n, v in tok.items() if n.startswith("k=") and "/" not in n}
        best = max(fixed, key=fixed.__getitem__)
        # the pairs T/A with T == A are the fixed cells
        pairs = {n: v for n, v in tok.items() if "/" in n} | {f"{n}/{n[2:]}": v for n, v in fixed.items()}
        pair = max(pairs, key=pairs.__getitem__) if args.phase_grid else None
        table.append({
            "batch": b, "tok_per_s": tok, "best_fixed": best,
            "adaptive_over_best": tok["adaptive"] / max(tok["plain"], fixed[best]),
            "adaptive_over_best_min": min(t["adaptive"] / max(t["plain"], t[best]) for t in per_seed),
            "adaptive_over_plain": tok["adaptive"] / tok["plain"],
            **({"best_phase_ks": pair, "best_phase_ks_tok_per_s": pairs[pair],
                "adaptive_over_best_phase_ks": tok["adaptive"] / pairs[pair],
                "best_phase_ks_over_plain": pairs[pair] / tok["plain"]} if pair else {}),
            **({"oracle_over_best": tok["oracle"] / max(tok["plain"], fixed[best]),
                "adaptive_over_oracle": tok["adaptive"] / tok["oracle"]} if args.oracle else {}),
            # per seed, for paired comparisons between runs of other trees or settings on the same draws
            "per_seed": {name: [t[name] for t in per_seed] for name in ("plain", "adaptive", "oracle")
                         if name in per_seed[0]},
        })  # fmt: skip
    out = {"source": Path(args.result).name, "runs": args.runs, "seeds": args.seeds, "settings": settings,
           "switch_ms": args.switch_ms, "shared_chooser": args.shared, "draws": args.draws,
           "profile": {p: result["profiles"]["good"][p] for p in ("thinking", "answer")},
           "rows": table}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"simulated closed batch on the step times of {out['source']}: {args.seeds} seed(s) x {args.runs} "
          f"runs, mean tok/s, settings {settings or 'as in the engine'}, "
          f"switch {args.switch_ms} ms, draws per {args.draws}")  # fmt: skip
    heads = ("plain", "best fixed", "adaptive", "ad/best", "(least)", "ad/plain")
    print(f"{'batch':>6} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, (9, 16, 9, 8, 8, 8))))
    for row in table:
        t, best = row["tok_per_s"], row["best_fixed"]
        ratios = " ".join(f"{row[key]:>8.3f}" for key in ("adaptive_over_best", "adaptive_over_best_min"))
        line = f"{row['batch']:>6} {t['plain']:>9.0f} {best:>6} {t[best]:>9.0f} {t['adaptive']:>9.0f}"
        print(f"{line} {ratios} {row['adaptive_over_plain']:>8.2f}")
        if row.get("best_phase_ks"):
            pair_tok = f"{row['best_phase_ks_tok_per_s']:.0f} tok/s"
            print(f"{'':>6} best fixed pair (thinking k / answer k) {row['best_phase_ks']} {pair_tok}, "
                  f"{row['best_phase_ks_over_plain']:.3f} x plain; adaptive / it "
                  f"{row['adaptive_over_best_phase_ks']:.3f}")  # fmt: skip
        if "oracle" in t:
            print(f"{'':>6} oracle (the true rates) {t['oracle']:.0f} tok/s, "
                  f"{row['oracle_over_best']:.3f} x the best fixed k; "
                  f"adaptive / it {row['adaptive_over_oracle']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
