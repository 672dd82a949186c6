"""adaptive_k: the draft-length chooser, its acceptance estimates and cost model, the histogram."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.config import SpeculativeConfig
from thinkspec.engine.factory import target_graph_widths
from thinkspec.spec_decode import step_costs
from thinkspec.spec_decode.draft_length import (
    ANSWER,
    GROUPS,
    PLAIN_MARGIN,
    PLAIN_PROBE_PERIOD,
    PLAIN_PROBE_ROWS,
    PRIOR_RATE,
    PROBE_PERIOD,
    REFRESH,
    REFRESH_PLAIN,
    SPREAD_MIN_LEFT,
    SWITCH_HORIZON,
    THINKING,
    THINKING_RELAXED,
    AcceptanceEstimates,
    AdaptiveDraftLength,
    Drain,
    ForcedDraftLength,
    drain_weights,
    expected_largest_normal,
    expected_tokens,
    spread_factor,
)
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.spec_decode.step_costs import StepCostModel, StepCosts

K = 4


def _costs(plain: float = 5.0, draft: float = 0.5, per_token: float = 0.0) -> StepCostModel:
    """Buckets 1 and 64; verify of b x q tokens = plain + per_token * b * (q - 1)."""
    table = {
        b: [StepCosts(b, k, plain, draft, plain + per_token * b * k) for k in range(K + 1)] for b in (1, 64)
    }
    return StepCostModel(K, (1, 2, 4, 8, 16, 32, 64), table)


def test_expected_tokens():
    rates = np.array([[0.5, 0.5, 1.0, 0.0]])
    # 1 + 0.5 + 0.25 + 0.25 + 0
    np.testing.assert_allclose(expected_tokens(rates)[0], [1.0, 1.5, 1.75, 2.0, 2.0])


def test_estimates_count_tried_and_accepted_positions():
    """Without shrinkage and with a window of one step (alpha 1) a tried position's estimate is the last
    step's ratio and an untried one its group's pooled rate (the prior's one try gone with the step)."""
    est = AcceptanceEstimates(K, prior=0.5, alpha=1.0, max_weight=1.0, shrink=0.0)
    groups = np.array([THINKING, THINKING, ANSWER])
    est.observe(groups, num_drafts=np.array([4, 2, 3]), num_accepted=np.array([1, 2, 0]))
    # thinking: pos 0 tried by both, accepted by both; pos 1 tried by both, accepted by row 1;
    # pos 2 tried by neither (row 0 stopped at 1, row 1 drafted 2). answer: pos 0 tried, rejected.
    # Each tried position's two tries count as one (the whole window): pooled (1 + 0.5) / 2.
    np.testing.assert_allclose(est.rates[THINKING], [1.0, 0.5, 0.75, 0.75])
    np.testing.assert_allclose(est.rates[ANSWER], [0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(est.rates[THINKING_RELAXED], 0.5)  # no row: the prior, untouched
    np.testing.assert_allclose(est.prior_tries, [0.0, 0.0, 1.0])


def test_one_step_weighs_at_most_max_weight():
    """A step's tries of a position count as at most max_weight / alpha tries (64 rows at batch 64
    would otherwise outweigh the whole window), one try as one, and the older counts keep the rest."""
    est = AcceptanceEstimates(K, prior=0.5, alpha=0.05, max_weight=0.2)
    rows = np.full(64, THINKING)
    est.observe(rows, num_drafts=np.full(64, 1), num_accepted=np.full(64, 1))  # 64 tries, all accepted
    np.testing.assert_allclose(est.tries[THINKING], [0.2 / 0.05, 0, 0, 0])
    np.testing.assert_allclose(est.accepts[THINKING], [0.2 / 0.05, 0, 0, 0])
    est.observe(np.array([THINKING]), num_drafts=np.array([1]), num_accepted=np.array([0]))
    np.testing.assert_allclose(est.tries[THINKING, 0], 0.95 * 4.0 + 1.0)
    np.testing.assert_allclose(est.accepts[THINKING, 0], 0.95 * 4.0)
    # the prior starts as a window's tries (1 / alpha) and ages as the counts do
    prior = 20.0 * 0.8 * 0.95
    np.testing.assert_allclose(est.prior_tries[THINKING], prior)
    pooled = (0.95 * 4.0 + 0.5 * prior) / (0.95 * 4.0 + 1.0 + prior)
    shrink = est.shrink
    np.testing.assert_allclose(est.rates[THINKING, 0], (0.95 * 4.0 + shrink * pooled) / (4.8 + shrink))
    np.testing.assert_allclose(est.rates[THINKING, 1:], pooled)


def test_an_untried_position_takes_its_groups_pooled_rate():
    """Rows that draft one token accepted 80% of the time: the positions they never reach estimate
    about 0.8 (the group's rate), not the prior 0.7 a probe would have to correct."""
    rng = np.random.default_rng(0)
    est = AcceptanceEstimates(K)
    for _ in range(400):
        est.observe(np.array([THINKING]), np.array([1]), (rng.random(1) < 0.8).astype(np.int64))
    assert est.tries[THINKING, 1:].sum() == 0
    assert abs(est.rates[THINKING, 0] - 0.8) < 0.08
    np.testing.assert_allclose(est.rates[THINKING, 1:], est.rates[THINKING, 1])
    assert abs(est.rates[THINKING, 1] - 0.8) < 0.08 and est.rates[THINKING, 1] != PRIOR_RATE


def test_an_unlucky_start_does_not_set_the_estimates_alone():
    """Eight first steps whose drafts are all rejected: the prior still weighs most of a window of tries,
    so the group's pooled rate stays near it (the untried positions about 0.6) and the first position
    near 0.48, instead of all dropping below 0.1 and sending the group to plain decoding, where no
    draft would be tried again to correct them."""
    est = AcceptanceEstimates(K)
    for _ in range(8):
        est.observe(np.array([ANSWER]), np.array([3]), np.array([0]))
    rates = est.rates[ANSWER]
    assert 0.4 < rates[0] < 0.55 < rates[1:].min() <= rates.max() < PRIOR_RATE
    assert est.prior_tries[ANSWER] > 0.8 / est.alpha


def test_estimates_shrink_a_positions_noise_toward_its_group():
    """Every position accepts 80%: over many steps the per-position estimates spread less than the
    same counts' own ratios do (the pooled rate takes the noise out), and sit near the truth."""
    rng = np.random.default_rng(1)
    est = AcceptanceEstimates(K)
    spread_own, spread_est = [], []
    for _ in range(3000):
        accepted = np.cumprod(rng.random(K) < 0.8).sum()
        est.observe(np.array([THINKING]), np.array([K]), np.array([accepted]))
        own = est.accepts[THINKING] / np.maximum(est.tries[THINKING], 1e-9)
        spread_own.append(np.abs(own - 0.8).mean())
        spread_est.append(np.abs(est.rates[THINKING] - 0.8).mean())
    assert np.mean(spread_est[500:]) < 0.8 * np.mean(spread_own[500:])
    assert np.abs(est.rates[THINKING] - 0.8).max() < 0.1


def test_estimates_forget_old_acceptance():
    """Acceptance falls from 0.9 to 0.2 for rows drafting 2: within four windows (1/alpha tries each) the
    first position, tried every step, follows, and so do the untried positions 2-3 (the pooled rate).
    The window counts tries, so position 1, now reached one step in five, forgets more slowly."""
    rng = np.random.default_rng(2)
    est = AcceptanceEstimates(K)
    for rate in (0.9, 0.2):
        for _ in range(int(4 / est.alpha)):
            accepted = np.cumprod(rng.random(2) < rate).sum()
            est.observe(np.array([ANSWER]), np.array([2]), np.array([accepted]))
        assert abs(est.rates[ANSWER, 0] - rate) < 0.1
        assert np.abs(est.rates[ANSWER, 2:] - rate).max() < 0.15
    assert est.rates[ANSWER, 1] > est.rates[ANSWER, 0]  # still weighs its 0.9-era tries


def test_choice_follows_acceptance_per_group():
    # One verify forward pads every row to the longest window, so what an answer row's drafts cost
    # is the draft forwards that run it, 0.05 ms per row here, from the second on (the first runs
    # every row anyway, to keep the draft's K/V current).
    table = {b: [StepCosts(b, k, 5.0, 0.5 + 0.05 * b, 5.0) for k in range(K + 1)] for b in (1, 64)}
    chooser = AdaptiveDraftLength(K, StepCostModel(K, (1, 2, 4, 8, 64), table))
    chooser.estimates.rates[THINKING] = 0.95
    chooser.estimates.rates[ANSWER] = 0.05
    counts = np.zeros(len(GROUPS), dtype=np.int64)
    counts[[THINKING, ANSWER]] = 3
    ks = chooser.choose(counts)
    assert ks[THINKING] == K and ks[ANSWER] == 1
    chooser = AdaptiveDraftLength(K, chooser.costs)
    chooser.estimates.rates[:] = 0.0  # nothing is ever accepted: the plain step
    assert chooser.choose(counts).tolist() == [0, 0, 0]


def test_cost_of_verify_width_shortens_drafts():
    """Verify cost growing with tokens per row (large batch) pulls k down at the same acceptance."""
    counts = np.array([0, 64, 0])
    cheap = AdaptiveDraftLength(K, _costs(per_token=0.0))
    dear = AdaptiveDraftLength(K, _costs(per_token=0.02))
    for c in (cheap, dear):
        c.estimates.rates[:] = 0.8
    assert dear.choose(counts)[THINKING] < cheap.choose(counts)[THINKING] == K


def test_drafting_must_beat_plain_by_the_margin():
    """A choice modelled a little above the plain step (under PLAIN_MARGIN) keeps the plain step; a
    clear win drafts. Costs: plain 5 ms, a draft step 0.5 ms, verify as plain; one row drafting k=1
    emits 1 + c tokens in 5.5 ms against 1 in 5 ms."""
    counts = np.array([0, 1, 0])
    for rate, drafts in (
        (1.1 * (1 + PLAIN_MARGIN) - 1 - 0.01, False),
        (1.1 * (1 + PLAIN_MARGIN) - 1 + 0.01, True),
    ):
        chooser = AdaptiveDraftLength(K, _costs(plain=5.0, draft=0.5))
        chooser.estimates.rates[:] = 0.0
        chooser.estimates.rates[THINKING, 0] = rate  # only k = 1 can pay: later positions accept nothing
        chooser.trace = []
        ks = chooser.choose(counts)
        assert bool(ks.any()) == drafts, rate
        entry = chooser.trace[0]
        # both sides of the margin rate drafting above plain; only a clear win is taken
        assert entry["best_drafting_tok_per_ms"] > entry["plain_tok_per_ms"]


def test_mixed_step_cost_counts_only_rows_still_drafting():
    chooser = AdaptiveDraftLength(K, _costs(plain=5.0, draft=0.5))
    # 1 row drafts 4, 1 row drafts 1, batch 2 (draft_ms flat at 0.5): 4 x 0.5 + verify 5 = 7;
    # draft forwards 2..4 run one row, as costly here as two (flat), so no correction.
    assert chooser.modelled_ms(np.array([4, 1])) == pytest.approx(7.0)
    sloped = {b: [StepCosts(b, k, 5.0, 0.1 * b, 5.0) for k in range(K + 1)] for b in (1, 64)}
    chooser = AdaptiveDraftLength(K, StepCostModel(K, (1, 2, 64), sloped))
    # draft(2) = 0.2, draft(1) = 0.1: forward 1 over both rows, forwards 2..4 over one
    assert chooser.modelled_ms(np.array([4, 1])) == pytest.approx(5.0 + 0.2 + 3 * 0.1)
    assert chooser.modelled_ms(np.array([0, 0])) == pytest.approx(5.0)


def test_overhead_is_learned_per_window():
    costs = _costs()
    assert costs.overhead_ms(16).tolist() == [0.0] * (K + 1)  # nothing measured
    costs.observe(16, 2, measured_ms=99.0, modelled_ms=7.0)  # the first measurement sets it
    np.testing.assert_allclose(costs.overhead_ms(16), [0, 92, 92, 92, 92])  # windows borrow, plain not
    costs.observe(16, 2, measured_ms=9.0, modelled_ms=7.0)  # the least of the first three (a compile)
    costs.observe(16, 2, measured_ms=60.0, modelled_ms=7.0)
    np.testing.assert_allclose(costs.overhead_ms(16), [0, 2, 2, 2, 2])
    for _ in range(200):
        costs.observe(16, 4, measured_ms=10.0, modelled_ms=7.0)
        costs.observe(16, 0, measured_ms=5.5, modelled_ms=5.0)
    np.testing.assert_allclose(costs.overhead_ms(16), [0.5, 2, 2, 2, 3], atol=1e-3)  # tie: the shorter
    np.testing.assert_allclose(costs.overhead_ms(64), [0.5, 2, 2, 2, 3], atol=1e-3)  # nearest bucket
    costs.observe(16, 4, measured_ms=1e4, modelled_ms=7.0)  # an outlier moves it a little
    assert costs.overhead_ms(16)[4] < 3.5


def test_an_overhead_entry_learns_a_short_runs_cost_within_the_run():
    """After the least of its first MIN_OF, an entry is the running mean of that least and the
    measurements since (a window drafted for 8 steps of a run learns what it costs in that run);
    once a measurement's share falls to OVERHEAD_ALPHA it moves as the moving average."""
    costs = _costs()
    for extra in (2.0, 2.5, 2.4):  # the least of the first three: 2.0
        costs.observe(64, 3, measured_ms=10.0 + extra, modelled_ms=10.0)
    for _ in range(5):
        costs.observe(64, 3, measured_ms=13.0, modelled_ms=10.0)
    assert costs.overhead_ms(64)[3] == pytest.approx((2.0 + 5 * 3.0) / 6)  # 2.226 as a 5% average
    n_mean = round(1 / step_costs.OVERHEAD_ALPHA)  # values in the mean when its weight reaches alpha
    for _ in range(n_mean - 6):
        costs.observe(64, 3, measured_ms=13.0, modelled_ms=10.0)
    before = costs.overhead_ms(64)[3]
    assert before == pytest.approx((2.0 + (n_mean - 1) * 3.0) / n_mean)
    costs.observe(64, 3, measured_ms=14.0, modelled_ms=10.0)
    assert costs.overhead_ms(64)[3] == pytest.approx(before + step_costs.OVERHEAD_ALPHA * (4.0 - before))


def test_probing_recovers_a_pessimistic_estimate():
    """Acceptance is really 0.9 but the estimates learnt 0 (a window of rejected drafts): the chooser
    drafts nothing, probes one token every PROBE_PERIOD steps, and climbs to K."""
    rng = np.random.default_rng(0)
    chooser = AdaptiveDraftLength(K, _costs())
    for _ in range(int(5 / chooser.estimates.alpha)):
        chooser.observe(np.full(4, THINKING), np.full(4, K), np.zeros(4, dtype=np.int64))
    assert chooser.estimates.rates[THINKING].max() < 0.05
    counts = np.array([0, 4, 0])
    first = chooser.choose(counts)[THINKING]
    ks = []
    for _ in range(40 * PROBE_PERIOD):
        k = int(chooser.choose(counts)[THINKING])
        ks.append(k)
        if k:
            accepted = np.cumprod(rng.random((4, k)) < 0.9, axis=1).sum(axis=1)
            chooser.observe(np.full(4, THINKING), np.full(4, k), accepted)
    assert first == 0 and ks[-1] >= K - 1


def test_a_probe_out_of_plain_decoding_drafts_a_few_rows():
    """While drafting, a probe lengthens the group's k for every row (probe_rows None); out of plain
    decoding only PLAIN_PROBE_ROWS rows draft, since each first catches its draft up."""
    counts = np.array([0, 64, 0])
    for rate, period, rows in ((0.5, PROBE_PERIOD, None), (0.0, PLAIN_PROBE_PERIOD, PLAIN_PROBE_ROWS)):
        chooser = AdaptiveDraftLength(K, _costs())
        chooser.estimates.rates[:] = rate
        seen = []
        for _ in range(period):
            ks = chooser.choose(counts)
            seen.append((int(ks[THINKING]), chooser.probe_rows))
        base = seen[0][0]
        assert base < K
        assert seen[:-1] == [(base, None)] * (period - 1)
        assert seen[-1] == (base + 1, rows)
        chooser.choose(counts)
        assert chooser.probe_rows is None


def test_engine_probes_out_of_plain_decoding_with_a_few_rows(monkeypatch):
    """End to end on CPU: drafts never accepted, so the engine decodes plainly and probes now and
    then; a probe step drafts for PLAIN_PROBE_ROWS of the 6 rows only, and the output is plain greedy's."""
    from thinkspec.spec_decode import draft_length

    monkeypatch.setattr(draft_length, "PLAIN_PROBE_PERIOD", 8)
    target = tiny_checkpoint("qwen3", tied=True)
    # a draft of other weights: the steering rejects a draft by pushing it below its row's best token,
    # so a draft that is the target's own choice (a draft of the same weights) would change the output
    draft = tiny_checkpoint("qwen3", tied=True, seed=1)
    cfg = {"model": str(draft), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    install_synthetic_acceptance(llm, rate=0.0)
    spec = llm.llm_engine.speculator
    spec.planner.draft_length.observe_time = lambda *args: None  # device model only
    drafting = []  # rows drafting, per step
    observe = SpecDecodeMetrics.observe_draft_lengths

    def counting(metrics, ks, thinking):
        drafting.append(int((ks > 0).sum()))
        observe(metrics, ks, thinking)

    monkeypatch.setattr(SpecDecodeMetrics, "observe_draft_lengths", counting)
    observe_plain = SpecDecodeMetrics.observe_plain_rows

    def counting_plain(metrics, *args):
        drafting.append(0)
        observe_plain(metrics, *args)

    monkeypatch.setattr(SpecDecodeMetrics, "observe_plain_rows", counting_plain)
    prompts = [[72, 105, 33], [65, 66], [1, 2, 3, 4], [9], [40, 41], [7, 8, 9]]
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    plain = LLM(target, device="cpu").generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # the first step samples each request's first token plainly; then rows draft until the estimates
    # learn that nothing is accepted, and decode plainly from there
    first_draft = next(i for i, n in enumerate(drafting) if n)
    first_plain = next(i for i in range(first_draft, len(drafting)) if drafting[i] == 0)
    probes = [n for n in drafting[first_plain:] if n]
    assert len(probes) >= 3 and max(probes) == draft_length.PLAIN_PROBE_ROWS


@pytest.mark.parametrize(("rate", "period"), [(0.9, REFRESH), (0.0, REFRESH_PLAIN)], ids=["draft", "plain"])
def test_a_choice_is_reused_for_its_refresh_period(monkeypatch, rate, period):
    """The grid search runs once per REFRESH choices while rows draft, once per REFRESH_PLAIN while
    every group decodes plainly (nothing about acceptance is learned then), and at once when the
    groups' sizes move by more than 1/8."""
    chooser = AdaptiveDraftLength(K, _costs())
    chooser.estimates.rates[:] = rate
    searches = []
    evaluate = chooser.evaluate
    monkeypatch.setattr(chooser, "evaluate", lambda *args: (searches.append(1), evaluate(*args))[1])
    counts = np.array([0, 16, 0])
    ks = [int(chooser.choose(counts)[THINKING]) for _ in range(4 * period - 1)]
    assert len(searches) == 4
    assert (max(ks) > 0) == (rate > 0)
    chooser.choose(np.array([0, 14, 0]))  # within 1/8: the same choice
    assert len(searches) == 4
    chooser.choose(np.array([0, 13, 0]))  # beyond it: a new search
    assert len(searches) == 5
    chooser.choose(np.array([1, 13, 0]))  # a new group
    assert len(searches) == 6


def test_refresh_searches_ahead_of_the_choice_that_would_find_the_cache_old(monkeypatch):
    """refresh (called while the device runs a step) redoes the search only when the next choice would
    find the cached one too old, with the last choice's counts and context: that choice then searches
    nothing and picks what a search at choose time would have."""
    chooser = AdaptiveDraftLength(K, _costs())
    chooser.estimates.rates[:] = 0.9
    searches = []
    evaluate = chooser.evaluate
    monkeypatch.setattr(chooser, "evaluate", lambda *args: (searches.append(args[1]), evaluate(*args))[1])
    counts = np.array([0, 16, 0])
    first = chooser.choose(counts, context=3000)
    for _ in range(REFRESH - 1):
        chooser.refresh()  # young: nothing to redo
        chooser.choose(counts, context=3000)
    assert searches == [3000]
    chooser.refresh()  # the next choice is the REFRESH-th since the search: redo it now
    assert searches == [3000, 3000]
    assert np.array_equal(chooser.choose(counts, context=3100), first)
    assert len(searches) == 2
    chooser.refresh()
    assert len(searches) == 2


def test_drain_weights_given_as_a_function_are_worked_out_only_for_a_search(monkeypatch):
    """The engine hands the drain weights over as a function (reading every row's tokens left costs
    host time before each step): the chooser calls it only when it searches, at a choice that finds
    no fresh cached one and at a refresh that redoes the search, and the search weighs the groups
    with what it returns, as with the weights given directly."""
    calls, searched = [], []
    direct = AdaptiveDraftLength(K, _costs())
    lazy = AdaptiveDraftLength(K, _costs())
    evaluate = lazy.evaluate
    monkeypatch.setattr(lazy, "evaluate", lambda *args: (searched.append(args[3]), evaluate(*args))[1])

    def weights() -> Drain:
        calls.append(1)
        return Drain([0.0, 3.5, 0.0], [0, 200, 0])

    counts = np.array([0, 16, 0])
    for chooser in (direct, lazy):
        chooser.estimates.rates[:] = 0.9
        chooser.trace = []
    assert np.array_equal(lazy.choose(counts, drain=weights), direct.choose(counts, drain=weights()))
    assert len(calls) == 2 and searched == [Drain([0.0, 3.5, 0.0], [0, 200, 0])]
    assert lazy.trace[0]["weights"] == direct.trace[0]["weights"] == {"thinking": 3.5}
    assert lazy.trace[0]["longest"] == direct.trace[0]["longest"] == {"thinking": 200}
    for _ in range(REFRESH - 1):
        lazy.choose(counts, drain=weights)  # the cached choice: no call
    assert len(calls) == 2
    lazy.refresh()  # the next choice would find it old: the search is redone now, with the weights
    assert len(calls) == 3 and len(searched) == 2


def test_the_chooser_learns_while_the_device_runs_the_next_step(monkeypatch):
    """A speculative step queues what it accepted; the next drafting step's chooser work (learning the
    queued windows and step times, and any search refresh) runs after its forwards are launched and
    before it waits for their tokens, not between the steps (a plain step learns when planned: its
    host work overlaps the step in flight under async scheduling); nothing queued is lost by the end
    of the run, and the output is plain greedy's."""
    import thinkspec.engine.speculator as speculator_module

    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    spec = llm.llm_engine.speculator
    policy = ForcedDraftLength.fixed(K, 2)
    events = []
    policy.observe = lambda groups, nd, accepted: events.append("accept")
    policy.observe_time = lambda ks, ms, context=0: events.append("time")
    spec.planner.draft_length = policy

    def logging(name, fn):
        return lambda *a, **kw: (events.append(name), fn(*a, **kw))[1]

    monkeypatch.setattr(spec.proposer, "propose", logging("propose", spec.proposer.propose))
    monkeypatch.setattr(
        spec.target_runner, "execute_model", logging("verify", spec.target_runner.execute_model)
    )
    monkeypatch.setattr(
        speculator_module.HostPack, "fetch", logging("fetch", speculator_module.HostPack.fetch)
    )
    prompts = [[72, 105, 33], [65, 66]]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    plain = LLM(target, device="cpu").generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    steps = events.count("fetch")
    assert steps > 5 and events.count("accept") == steps  # every step's windows learnt, the last at the end
    assert events.count("time") >= steps - 3  # every decode step but the last is timed
    segment: list[str] = []  # one step's events, up to its fetch
    drafting_steps = 0
    for e in events:
        segment.append(e)
        if e != "fetch":
            continue
        if "propose" in segment:  # a drafting step: its chooser work after the launches, before the fetch
            learnt = [i for i, x in enumerate(segment) if x in ("accept", "time")]
            assert all(i > segment.index("verify") for i in learnt), segment
            drafting_steps += bool(learnt)
        segment = []
    assert drafting_steps >= steps - 4
    assert set(segment) <= {"accept", "time"}  # after the last step: the rest, learnt at the end


def test_histogram_counts_and_merges():
    m = SpecDecodeMetrics()
    m.observe_draft_lengths(np.array([0, 3, 3, 1]), np.array([True, True, False, False]))
    m.count_draft_length(5, thinking=False)
    assert m.thinking.draft_length_histogram == [1, 0, 0, 1]
    assert m.answer.draft_length_histogram == [0, 1, 0, 1, 0, 1]
    total = SpecDecodeMetrics().merge(m).merge(m)
    assert total.phase(None).draft_length_histogram == [2, 2, 0, 4, 0, 2]
    assert m.to_dict()["by_phase"]["answer"]["draft_length_histogram"] == [0, 1, 0, 1, 0, 1]
    # the plain step's path counts what observe_draft_lengths counts for all-zero rows, in new lists
    for start in (SpecDecodeMetrics(), SpecDecodeMetrics().merge(m)):
        fast, slow = SpecDecodeMetrics().merge(start), SpecDecodeMetrics().merge(start)
        before = fast.thinking.draft_length_histogram
        fast.observe_plain_rows(3, 5)
        fast.observe_plain_rows(0, 2)
        slow.observe_draft_lengths(np.zeros(5, dtype=np.int64), np.array([True, False, True, True, False]))
        slow.observe_draft_lengths(np.zeros(2, dtype=np.int64), np.zeros(2, dtype=bool))
        assert fast.to_dict() == slow.to_dict()
        assert fast.thinking.draft_length_histogram is not before


def test_config():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive_k=True)
    assert cfg.adaptive_k and not SpeculativeConfig(method="ngram", num_speculative_tokens=3).adaptive_k
    with pytest.raises(ValueError, match=r"adaptive_k must be a bool"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive_k=1)
    with pytest.raises(ValueError, match=r"adaptive_k=True needs a speculative method"):
        SpeculativeConfig(adaptive_k=True)
    assert target_graph_widths(4, every_width=True) == (1, 2, 3, 4, 5)
    assert target_graph_widths(4) == (1, 2, 5)


@pytest.mark.parametrize("rate, max_tokens", [(0.0, 150), (1.0, 120)])
def test_engine_chooses_by_acceptance(rate, max_tokens):
    """End to end on CPU: the acceptance the engine sees drives the choice. Drafts never accepted
    turn speculation off (plain steps), drafts always accepted get the full K."""
    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    install_synthetic_acceptance(llm, rate=rate)
    # On a CPU the toy's speculative step may well cost more than the tokens it saves: the default
    # device model alone decides here, the learned host overhead is left out.
    timings = []
    llm.llm_engine.speculator.planner.draft_length.observe_time = lambda *sample: timings.append(sample)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([[72, 105, 33], [65, 66]], sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    # Every decode-only step but the last is a timing sample (steps that captured nothing: CPU).
    # a plain step's rows come as their number, a drafting step's as their draft lengths
    rows = [ks if isinstance(ks, int) else len(ks) for ks, _, _ in timings]
    assert len(timings) >= max_tokens // (K + 1) - 2 and rows == [2] * len(rows)
    assert all(ms > 0 for _, ms, _ in timings)
    # each sample's context: the two sequences' tokens (prompts of 3 and 2), growing step by step
    contexts = [c for _, _, c in timings]
    assert contexts[0] > 5 and contexts == sorted(contexts) and contexts[-1] <= 5 + 2 * max_tokens
    hist = llm.last_spec_metrics.answer.draft_length_histogram
    hist = hist + [0] * (K + 1 - len(hist))
    if rate == 0.0:
        assert hist[0] > 0.7 * sum(hist)  # plain rows once learnt, with a probe now and then
    else:
        assert hist[K] > 0.7 * sum(hist)  # the rest: the last steps, capped by max_tokens


def test_engine_chooses_per_phase_group(monkeypatch):
    """The synthetic profile's phases (thinking for the first 100 tokens: every draft accepted; then
    answer: none) are the groups the chooser learns: thinking rows draft K, answer rows stop. (The two
    rows drain; the spread term, tested apart, is off: the first choice, made at the prior rates
    before any acceptance is seen, is close between K and K - 1, and with the term it drafts K - 1
    for its 8 steps, 16 of the 44 thinking row-steps.)"""
    from thinkspec.spec_decode import draft_length

    monkeypatch.setattr(draft_length, "SPREAD_MIN_LEFT", 10**9)
    target = tiny_checkpoint("qwen3", tied=True)
    profile = {"thinking": [1.0] * K, "answer": [0.0] * K, "thinking_tokens": 100}
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    install_synthetic_acceptance(llm, profile=profile)
    llm.llm_engine.speculator.planner.draft_length.observe_time = lambda *args: None  # device model only
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.generate([[72, 105, 33], [65, 66]], sp, use_tqdm=False)
    m = llm.last_spec_metrics
    think, answer = m.thinking.draft_length_histogram, m.answer.draft_length_histogram
    assert think[K] >= 0.7 * sum(think) and answer[0] >= 0.6 * sum(answer)
    assert m.thinking.num_accepted_tokens == m.thinking.num_draft_tokens > 0
    assert m.answer.num_accepted_tokens == 0


def test_forced_k_is_capped_by_the_room_left():
    """k chosen for a group is cut, per row, to what the request may still emit (max_model_len and
    max_tokens), as a fixed k is: the output stops exactly there, equal to plain decoding."""
    from thinkspec.spec_decode.draft_length import ForcedDraftLength

    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", max_model_len=23, speculative_config=cfg)
    llm.llm_engine.speculator.planner.draft_length = ForcedDraftLength.fixed(K, K)
    plain = LLM(target, device="cpu", max_model_len=23)
    prompts = [[72, 105, 33], [65, 66, 67, 68]]
    for sp in (SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)):  # fmt: skip
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
        assert got == want and [len(g) for g in got] == ([20, 19] if sp.max_tokens == 100 else [13, 13])
    hist = llm.llm_engine.spec_metrics.answer.draft_length_histogram
    assert 0 < sum(hist[:K]) < hist[K]  # the last steps of each request drafted fewer


def test_adaptive_plain_steps_run_ahead_with_async_scheduling(caplog):
    """With async scheduling an adaptive engine's plain steps (every row k = 0) are the engine's own
    plain step, left in flight while the next one launches; runs of plain and speculative steps
    (k forced: 3 steps of 0, 3 of 2, ...) give plain greedy decoding's tokens."""
    from thinkspec.spec_decode.draft_length import ForcedDraftLength

    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", async_scheduling=True, speculative_config=cfg)
    engine = llm.llm_engine
    assert engine.async_scheduling
    engine.speculator.planner.draft_length = ForcedDraftLength(
        K, lambda step, counts: np.full(3, 2 * ((step // 3) % 2))
    )
    launches = []
    launch = engine._copies.launch
    engine._copies.launch = lambda tokens: launches.append(1) or launch(tokens)
    prompts = [[72, 105, 33], [65, 66, 67, 68, 69], [97]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 23, 31)]
    with caplog.at_level("WARNING", logger="thinkspec"):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert "engine step failed" not in caplog.text  # fault isolation would hide a failing step
    plain = LLM(target, device="cpu")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert got == want
    m = llm.last_spec_metrics
    hist = m.answer.draft_length_histogram
    assert len(launches) > 3 and hist[0] > 0 and hist[2] > 0 and engine._in_flight is None
    # every row counted with k drafts did draft k: the step ran as planned, in flight or not
    assert m.total.num_draft_tokens == sum(k * n for k, n in enumerate(hist))
    fixed = LLM(target, device="cpu", async_scheduling=True, speculative_config={**cfg, "adaptive_k": False})
    assert not fixed.llm_engine.async_scheduling  # fixed k: its steps speculate, none is left in flight


# ---- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["adaptive", "forced"])
def test_adaptive_greedy_on_cuda_equals_plain_on_the_toy_pair(policy):
    """The bundled toy pair on CUDA, fp32, CUDA graphs: adaptive_k (and k forced to vary per step and
    phase group, so graph widths 1..K+1 and mixed windows all run) emits plain greedy's tokens."""
    from thinkspec.model_names import TOY_MODELS
    from thinkspec.spec_decode.draft_length import ForcedDraftLength
    from thinkspec.toy.task import generate_samples

    prompts = [s.prompt for s in generate_samples(12, seed=20261201)]
    sp = SamplingParams(temperature=0, max_tokens=160)
    common = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.3, reasoning_parser="qwen3")
    plain = LLM(TOY_MODELS["toy-reasoner"], **common)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    cfg = {"model": str(TOY_MODELS["toy-reasoner-draft"]), "num_speculative_tokens": K, "adaptive_k": True}
    spec = LLM(TOY_MODELS["toy-reasoner"], speculative_config=cfg, **common)
    if policy == "forced":
        spec.llm_engine.speculator.planner.draft_length = ForcedDraftLength(
            K, lambda step, counts: np.array([(step + 2 * g) % (K + 1) for g in range(len(GROUPS))])
        )
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)]
    assert got == expected
    m = spec.last_spec_metrics
    assert m.total.num_accepted_tokens > 0 and sum(m.thinking.draft_length_histogram) > 0
    assert spec.llm_engine.model_runner.graphs.num_replays > 0


@pytest.mark.gpu
def test_cost_model_measured_from_graph_replays_writes_no_kv():
    """measure_costs times the captured graphs on dummy inputs: every width 1..K+1 of the target
    and the draft step, at each bucket up to the batch; the KV pools are untouched."""
    from thinkspec.model_names import TOY_MODELS

    cfg = {"model": str(TOY_MODELS["toy-reasoner-draft"]), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(TOY_MODELS["toy-reasoner"], device="cuda", gpu_memory_utilization=0.3, speculative_config=cfg)
    spec = llm.llm_engine.speculator
    sp = SamplingParams(temperature=0, max_tokens=40)
    first = llm.generate(["Sam has 3 apples."], sp, use_tqdm=False)[0].outputs[0].token_ids
    kv = [r.kv_cache.clone() for r in (spec.target_runner, spec.draft_runner)]
    spec.planner.measure_costs(4)
    costs = spec.planner.draft_length.costs
    assert sorted(costs.costs) == [1, 2, 4]
    for rows in costs.costs.values():
        assert [r.k for r in rows] == list(range(K + 1))
        assert all(r.verify_ms > 0 and r.draft_ms > 0 for r in rows)
        assert rows[K].verify_ms >= 0.5 * rows[0].verify_ms
        # attention over CONTEXT_PROBE tokens of context per row costs something in both models
        assert all(r.verify_ctx_ms > 0 and r.draft_ctx_ms > 0 for r in rows)
    assert costs.context_ms(4)[K] > costs.context_ms(4)[0] > 0
    assert spec.target_runner.graphs.spec.query_widths == tuple(range(1, K + 2))
    for before, runner in zip(kv, (spec.target_runner, spec.draft_runner)):
        assert torch.equal(before, runner.kv_cache)
    # the static buffers are left as a capture leaves them: the next steps bring their own inputs
    assert llm.generate(["Sam has 3 apples."], sp, use_tqdm=False)[0].outputs[0].token_ids == first


def _kmax(row_ks: np.ndarray | int) -> int:
    """The longest draft of a timing sample's rows (an int: a plain step's number of rows)."""
    return 0 if isinstance(row_ks, int) else int(row_ks.max())


def _rows(row_ks: np.ndarray | int) -> list[int]:
    """A timing sample's draft lengths, row by row (an int: a plain step's number of rows)."""
    return [0] * row_ks if isinstance(row_ks, int) else row_ks.tolist()


def _context_costs(draft_ctx: float, verify_ctx: float) -> StepCostModel:
    """_costs() plus attention per token of context: draft_ctx per draft forward, verify_ctx per
    target forward and window token (so a width-(k+1) verify costs verify_ctx * (k + 1))."""
    table = {
        b: [StepCosts(b, k, 5.0, 0.5, 5.0, draft_ctx, verify_ctx * (k + 1)) for k in range(K + 1)]
        for b in (1, 64)
    }
    return StepCostModel(K, (1, 2, 4, 8, 16, 32, 64), table)


def test_context_term_of_the_cost_model():
    costs = _context_costs(draft_ctx=1e-4, verify_ctx=2e-4)
    # all rows draft k: k draft forwards and one verify of width k + 1, per token of context
    np.testing.assert_allclose(costs.context_ms(16), [k * 1e-4 + 2e-4 * (k + 1) for k in range(K + 1)])
    chooser = AdaptiveDraftLength(K, costs)
    row_ks = np.array([3, 1])
    assert chooser.modelled_ms(row_ks, context=1000) == pytest.approx(
        chooser.modelled_ms(row_ks) + 1000 * costs.context_ms(2)[3]
    )
    # the learned overhead is what the model leaves out, whatever the context
    for context in (1000, 50_000):
        chooser.observe_time(row_ks, chooser.modelled_ms(row_ks, context=context) + 1.0, context)
    assert costs.overhead_ms(2)[3] == pytest.approx(1.0)


def test_long_contexts_make_drafting_dearer():
    """Each draft forward reads the whole context again: the same rows and acceptance draft K at a
    short context and fewer, or none, at a long one."""
    counts = np.array([0, 16, 0])
    picks = []
    for context in (16 * 300, 16 * 30_000):
        chooser = AdaptiveDraftLength(K, _context_costs(draft_ctx=2e-5, verify_ctx=2e-5))
        chooser.estimates.rates[:] = 0.8
        picks.append(int(chooser.choose(counts, context)[THINKING]))
    assert picks[0] == K and picks[1] < K


def test_trace_records_each_fresh_choice():
    chooser = AdaptiveDraftLength(K, _costs(per_token=0.01))
    counts = np.array([2, 30, 0])
    chooser.choose(counts)
    assert chooser.trace is None  # off unless asked for
    chooser = AdaptiveDraftLength(K, _costs(per_token=0.01))
    chooser.trace = []
    chooser.estimates.rates[THINKING] = 0.9
    first = chooser.choose(counts)
    for _ in range(REFRESH - 1):  # reused while fresh: no new entry
        chooser.choose(counts)
    chooser.estimates.rates[THINKING] = 0.05  # the next evaluation goes plain
    for _ in range(REFRESH_PLAIN):
        chooser.choose(counts)
    assert len(chooser.trace) == 2
    one, two = chooser.trace
    assert one["choice"] == 1 and one["counts"] == [2, 30, 0] and two["choice"] == REFRESH + 1
    assert first[THINKING] > 0
    assert one["ks"] == {"answer": int(first[ANSWER]), "thinking": int(first[THINKING])}
    assert one["tok_per_ms"] > one["plain_tok_per_ms"] > 0 and len(one["overhead_ms"]) == K + 1
    assert one["rates"]["thinking"] == [0.9] * K and set(one["rates"]) == {"answer", "thinking"}
    assert two["ks"] == {"answer": 0, "thinking": 0} and two["tok_per_ms"] == two["plain_tok_per_ms"]
    assert one["weights"] is None  # every row counted alike
    chooser.choose(np.array([2, 20, 0]), drain=Drain([0.5, 12.25, 0.0], [9, 40, 0]))  # other counts: searched
    assert len(chooser.trace) == 3 and chooser.trace[-1]["weights"] == {"answer": 0.5, "thinking": 12.25}
    assert chooser.trace[-1]["longest"] == {"answer": 9, "thinking": 40}


def test_switch_cost_is_learned_from_switch_steps():
    """The least of the first three samples (a first one may compile), then a moving average; a step
    faster than the steady model counts as no cost. The chooser samples it beyond the model and the
    learned overhead of a steady step."""
    costs = _costs()
    assert costs.switch_ms() == 0.0  # nothing measured
    for extra in (900.0, 40.0, -3.0):
        costs.observe_switch(extra)
    assert costs.switch_ms() == 0.0
    costs.observe_switch(40.0)
    assert 0.0 < costs.switch_ms() < 40.0
    chooser = AdaptiveDraftLength(K, _costs())
    row_ks = np.array([2, 2])
    chooser.observe_time(row_ks, chooser.modelled_ms(row_ks) + 1.0)  # steady: overhead 1 ms
    chooser.observe_switch(row_ks, chooser.modelled_ms(row_ks) + 31.0)
    assert chooser.costs.switch_ms() == pytest.approx(30.0)
    assert chooser.costs.overhead_ms(2)[2] == pytest.approx(1.0)  # the switch moved no overhead


def test_a_draft_behind_pays_the_switch_cost():
    """Drafting one row k = 1 at acceptance 0.3 emits 1.3 tokens in 5.5 ms against 1 in 5 ms (18%
    more per ms): with the draft in step it drafts. Behind, with a switch cost of 1 ms per step over
    SWITCH_HORIZON, drafting is 1.3 tokens in 6.5 ms, no better than plain: it stays plain. A plain
    choice made while behind is not reused once the draft is in step again, nor the reverse."""
    counts = np.array([0, 1, 0])
    late, in_step = [False, True, False], [False] * 3
    chooser = AdaptiveDraftLength(K, _costs(plain=5.0, draft=0.5))
    chooser.estimates.rates[:] = 0.0
    chooser.estimates.rates[THINKING, 0] = 0.3
    chooser.costs.observe_switch(1.0 * SWITCH_HORIZON)  # 1 ms per step over the horizon
    assert chooser.choose(counts, behind=late).tolist() == [0, 0, 0]
    assert chooser.choose(counts, behind=in_step)[THINKING] == 1
    assert chooser.choose(counts, behind=late)[THINKING] == 0
    free = AdaptiveDraftLength(K, _costs(plain=5.0, draft=0.5))  # no switch measured yet: no cost
    free.estimates.rates[:] = chooser.estimates.rates
    assert free.choose(counts, behind=late)[THINKING] == 1


def test_only_groups_behind_pay_the_switch():
    """Thinking rows in step draft on while the answer rows, behind, stay plain: the switch is paid
    by a choice that drafts with the answer group only."""
    counts = np.array([4, 4, 0])
    chooser = AdaptiveDraftLength(K, _costs(plain=5.0, draft=0.5))
    chooser.estimates.rates[THINKING] = 0.9
    chooser.estimates.rates[ANSWER] = 0.9
    chooser.costs.observe_switch(1e3 * SWITCH_HORIZON)  # prohibitive
    ks = chooser.choose(counts, behind=[True, False, False])
    assert ks[THINKING] > 0 and ks[ANSWER] == 0
    chooser.trace = []
    ks = chooser.choose(counts, behind=[False, False, False])  # the answer rows caught up: a new choice
    assert ks[THINKING] > 0 and ks[ANSWER] > 0 and chooser.trace[0]["behind"] == []


def test_engine_samples_the_switch_at_the_first_drafting_step_after_plain_steps():
    """End to end on CPU with a forced policy (plain for 6 steps, then K): the engine tells the chooser
    the draft is behind once plain steps ran, and the first drafting step after them is the one switch
    sample, its steady steps the timing samples; the output is plain greedy's."""
    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    spec = llm.llm_engine.speculator
    policy = ForcedDraftLength(K, lambda step, counts: np.full(len(GROUPS), 0 if 1 <= step <= 6 else K))
    behind, log = [], []
    choose = policy.choose

    def choosing(counts, context=0, late=None, drain=None):
        behind.append(any(late or []))
        return choose(counts, context, late, drain)

    policy.choose = choosing
    policy.observe_time = lambda ks, ms, context=0: log.append(("steady", _kmax(ks)))
    policy.observe_switch = lambda ks, ms, context=0: log.append(("switch", _kmax(ks)))
    spec.planner.draft_length = policy
    prompts = [[72, 105, 33], [65, 66]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    plain = LLM(target, device="cpu").generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    # choice 0: the prefill step; 1-6 plain, the draft 1, 2 (in step), then 3-6 tokens behind; 7 drafts
    # while behind (the switch) and catches up; 8 on, in step again
    assert behind[:8] == [False, False, False, True, True, True, True, True] and not any(behind[8:])
    assert log[:7] == [("steady", 0)] * 6 + [("switch", K)]
    assert len(log) > 8 and log[7:] == [("steady", K)] * (len(log) - 7)


def test_a_step_that_compiled_is_no_timing_sample():
    """A Triton compile inside a step (a first catch-up forward at a new shape, say) makes its time no
    sample, of the steady step or of the switch: with a forced k = K, one compile in the middle of
    the run removes exactly one of the timing samples."""

    def samples(compile_at: int | None) -> int:
        target = tiny_checkpoint("qwen3", tied=True)
        cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
        llm = LLM(target, device="cpu", speculative_config=cfg)
        policy = ForcedDraftLength.fixed(K, K)
        log = []
        policy.observe_time = policy.observe_switch = lambda ks, ms, context=0: log.append(ms)
        spec = llm.llm_engine.speculator
        spec.planner.draft_length = policy
        calls = [0]

        def count() -> int:  # the compile count as the engine reads it: 1 from the compile_at-th read
            calls[0] += 1
            return int(compile_at is not None and calls[0] >= compile_at)

        spec.planner.inputs.compile_count = count  # on CUDA, the count of thinkspec.engine.compiles
        sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        llm.generate([[72, 105, 33], [65, 66]], sp, use_tqdm=False)
        return len(log)

    assert samples(None) > 3
    assert samples(4) == samples(None) - 1


def test_a_few_drafting_rows_catch_up_alone():
    """After plain steps, a step where only 2 of 4 rows draft catches up those 2: the draft's first
    forward does not feed the others, more than CATCH_UP_WIDTH behind, until they draft; the output
    is plain greedy's."""
    from thinkspec.spec_decode.draft_model import CATCH_UP_WIDTH

    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    spec = llm.llm_engine.speculator
    policy = ForcedDraftLength(K, lambda step, counts: np.full(len(GROUPS), 0 if 1 <= step <= 6 else K))
    policy.probe_rows = 2  # every drafting step: the first 2 decode rows only
    samples = []
    policy.observe_time = lambda ks, ms, context=0: samples.append("steady")
    policy.observe_switch = lambda ks, ms, context=0: samples.append("switch")
    spec.planner.draft_length = policy
    fed = []  # tokens per row of every catch-up forward (forward 1)
    runner = spec.proposer.runner
    execute = runner.execute_model

    def recording(seqs, num_new_tokens, *args, **kwargs):
        if "input_token_ids" not in kwargs:
            fed.append(list(num_new_tokens))
        return execute(seqs, num_new_tokens, *args, **kwargs)

    runner.execute_model = recording
    prompts = [[72, 105, 33], [65, 66], [1, 2, 3, 4], [9, 8]]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    plain = LLM(target, device="cpu").generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    decode_forwards = fed[1:]  # fed[0]: the prompts' prefill
    # two switches: rows 0-1 after the 6 plain steps (their 6 tokens and the one before), then rows
    # 2-3, the first two decode rows once 0-1 finished, over all their tokens since
    switch = [f for f in decode_forwards if max(f) > CATCH_UP_WIDTH]
    assert len(switch) == 2 and switch[0] == [7, 7] and len(switch[1]) == 2 and min(switch[1]) > 7
    assert all(len(f) == 2 for f in decode_forwards)  # the two rows not drafting are never fed
    # the steps in between draft with rows in step: steady samples, though two rows lag behind
    assert samples.count("switch") == 2 and samples.count("steady") > 2


def test_drain_weights_count_rows_by_the_tokens_they_have_left():
    groups = [ANSWER] * 12 + [THINKING] * 4
    drain = drain_weights(groups, [20] * 12 + [50] * 4)
    assert drain.weights == pytest.approx([12 * 0.4, 4.0, 0.0]) and drain.longest == [20, 50, 0]
    alike = drain_weights([THINKING, THINKING], [7, 7])
    assert alike.weights == pytest.approx([0.0, 2.0, 0.0]) and alike.longest == [0, 7, 0]  # all alike: counts
    assert drain_weights([], []) == ([0.0, 0.0, 0.0], [0, 0, 0])
    assert drain_weights([ANSWER], [0]) == ([0.0, 0.0, 0.0], [0, 0, 0])  # nothing left: no division by zero


def test_expected_largest_normal_matches_draws():
    rng = np.random.default_rng(0)
    for n, within in ((2, 0.05), (4, 0.03), (16, 0.03), (64, 0.03)):
        drawn = rng.standard_normal((20000, n)).max(axis=1).mean()
        assert expected_largest_normal(n) == pytest.approx(drawn, rel=within)
    assert expected_largest_normal(1) == expected_largest_normal(0.4) == 0.0  # one row: nothing to lose to
    assert 0.0 < expected_largest_normal(1.5) < expected_largest_normal(2)  # a fractional drain weight


def _tokens_per_step(rates: np.ndarray, k: int) -> np.ndarray:
    """[k+1] the probability that a step drafting k with conditional rates [K] emits 1..k+1 tokens."""
    reach = np.concatenate([[1.0], np.cumprod(rates[:k])])  # P(at least i drafts accepted), i = 0..k
    return reach - np.append(reach[1:], 0.0)


def test_spread_factor_from_the_tokens_a_step_emits():
    """1 / (1 + z_n sigma(k) / sqrt(E(k) L)) with sigma(k) the spread of the tokens a step emits, worked
    out here from their distribution; 1 at k = 0, for one row, and below SPREAD_MIN_LEFT tokens left."""
    rates = np.array([[0.8, 0.7, 0.9, 0.6], [0.5, 0.5, 0.5, 0.5]])
    drain = Drain([0.0, 16.0, 4.0], [0, 300, 200])
    got = spread_factor(expected_tokens(rates), drain, np.array([THINKING, THINKING_RELAXED]))
    for p, (n, left) in enumerate(((16.0, 300), (4.0, 200))):
        for k in range(K + 1):
            probs = _tokens_per_step(rates[p], k)
            tokens = np.arange(1, k + 2)
            mean = (probs * tokens).sum()
            sigma = np.sqrt((probs * tokens**2).sum() - mean**2)
            want = 1.0 / (1.0 + expected_largest_normal(n) * sigma / np.sqrt(mean * left))
            assert got[p, k] == pytest.approx(want)
    assert np.all(got[:, 0] == 1.0) and np.all(got[:, 1:] < 1.0)
    one_row = spread_factor(expected_tokens(rates), Drain([0.0, 1.0, 0.0], [0, 300, 0]), np.array([THINKING]))
    near_end = Drain([0.0, 16.0, 0.0], [0, SPREAD_MIN_LEFT - 1, 0])
    near_end = spread_factor(expected_tokens(rates), near_end, np.array([THINKING]))
    assert np.all(one_row == 1.0) and np.all(near_end == 1.0)


def test_spread_factor_predicts_when_a_closed_batchs_last_row_ends():
    """64 rows with 255 tokens to go, all drafting k = 3 at rate 0.8: the last row ends at about
    L / (E(3) x factor) steps (within 4%), where L / E(3), the mean row's, is over 8% short."""
    rates = np.full((1, K), 0.8)
    rng = np.random.default_rng(1)
    rows, left, k = 64, 255, 3
    probs = _tokens_per_step(rates[0], k)
    last = []
    for _ in range(200):
        done, steps = np.zeros(rows), 0
        while (done < left).any():
            done += rng.choice(np.arange(1, k + 2), size=rows, p=probs)
            steps += 1
        last.append(steps)
    table = expected_tokens(rates)
    mean_tokens = table[0, k]
    factor = spread_factor(table, Drain([0.0, float(rows), 0.0], [0, left, 0]), np.array([THINKING]))[0, k]
    assert left / (mean_tokens * factor) == pytest.approx(np.mean(last), rel=0.04)
    assert left / mean_tokens < 0.92 * np.mean(last)


def test_a_closed_batch_does_not_draft_for_a_gain_its_last_row_loses():
    """Rows at their start, drafting k = 3 (rate 0.8; a fourth draft is never accepted) modelled 6%
    over plain per ms: with 64 rows that drain (no request waits) the last row ends ~10% after the mean
    one, and the chooser stays plain; with rows that are refilled (no drain) it drafts. One row has no
    spread to lose to: it drafts with or without the drain."""
    for batch in (64, 1):
        costs = _costs(plain=5.0, draft=0.3)
        counts = np.array([0, batch, 0])
        drain = drain_weights([THINKING] * batch, [255] * batch)
        probe = AdaptiveDraftLength(K, costs)
        probe.estimates.rates[THINKING] = [0.8, 0.8, 0.8, 0.0]
        grid, gain, cost = probe.evaluate(counts)
        three = int(np.flatnonzero(grid[0] == 3)[0])
        extra = gain[three] / (1.06 * gain[0] / cost[0]) - cost[three]  # the overhead that makes it 6%
        costs.observe(batch, 0, 5.0, 5.0)
        costs.observe(batch, 3, 10.0 + extra, 10.0)
        for given, drafts in ((None, True), (drain, batch == 1)):
            chooser = AdaptiveDraftLength(K, costs)
            chooser.estimates.rates[THINKING] = [0.8, 0.8, 0.8, 0.0]
            ks = chooser.choose(counts, drain=given)
            assert ks[THINKING] == (3 if drafts else 0), (batch, given is not None)


def test_a_draining_batch_drafts_for_its_longest_rows():
    """12 answer rows near their end and 4 thinking rows with more left: counted alike, the plain
    step emits the most tokens per ms; weighted by what each row has left (a batch that drains takes
    as long as its longest rows), drafting for the thinking rows wins. Costs: plain 5 ms, a draft
    forward 0.5 ms, verify as plain; thinking k = 1 emits 12 + 4 x 1.5 tokens in 5.5 ms against 16 in
    5 ms (under PLAIN_MARGIN), weighted 1.2 + 4 x 1.5 against 5.2."""
    counts = np.array([12, 4, 0])
    weights = drain_weights([ANSWER] * 12 + [THINKING] * 4, [4] * 12 + [40] * 4)
    for w, drafts in ((None, False), (weights, True)):
        chooser = AdaptiveDraftLength(K, _costs(plain=5.0, draft=0.5))
        chooser.estimates.rates[ANSWER] = 0.0  # an answer row's drafts are never accepted
        chooser.estimates.rates[THINKING] = 0.5
        ks = chooser.choose(counts, drain=w)
        assert bool(ks[THINKING]) == drafts and ks[ANSWER] == 0
    chooser.trace = []
    for _ in range(REFRESH - 1):  # the cached choice, reused
        chooser.choose(counts, drain=weights)
    assert not chooser.trace
    chooser.refresh()  # due now: searches again, with the last choice's weights
    assert len(chooser.trace) == 1 and chooser.trace[0]["ks"]["thinking"] > 0


def test_engine_weighs_rows_by_what_they_have_left_only_while_no_request_waits(monkeypatch):
    """A closed batch drains: the chooser gets each group's rows weighted by their tokens left. With a
    request waiting for a slot it gets none (every row counts alike: its slot is refilled)."""
    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    seen = []
    for max_num_seqs, n in ((2, 2), (1, 2)):
        llm = LLM(target, device="cpu", speculative_config=cfg, max_num_seqs=max_num_seqs)
        install_synthetic_acceptance(llm, rate=0.5)
        chooser = llm.llm_engine.speculator.planner.draft_length
        real = chooser.choose
        seen.clear()

        def spy(c, ctx=0, b=None, w=None, real=real):  # the weights at the choice (w may work them out)
            seen.append(w() if callable(w) else w)
            return real(c, ctx, b, w)

        monkeypatch.setattr(chooser, "choose", spy)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 6)][:n]
        llm.generate([[72, 105, 33], [65, 66]], params, use_tqdm=False)
        if max_num_seqs == 2:  # both admitted at once: the batch drains from the first step
            assert seen and all(w is not None for w in seen)
            first = next(w for w in seen if sum(w.weights))  # the first with decode rows: 11 and 5 left
            assert sum(first.weights) == pytest.approx(1 + 5 / 11) and max(first.longest) == 11
        else:  # the second request waits while the first runs, then drains alone
            assert seen[0] is None and seen[-1] is not None


_THINK = 80  # output tokens in the thinking phase (_plain_streak_run)


def _plain_streak_run(monkeypatch, reuse: int, async_scheduling: bool, n: int = 1, max_num_seqs: int = 8):
    """A CPU run where drafts are never accepted (the engine decodes plainly once it learns that) and
    the synthetic profile's phase turns from thinking to answer at _THINK output tokens; probes out of
    plain decoding every 16th choice. Returns (outputs, each finished request's counters as its
    output first gave them, the speculator, the chooser's timing samples without their wall time,
    _choose's calls)."""
    from thinkspec.spec_decode import draft_length
    from thinkspec.spec_decode.planner import DraftPlanner

    monkeypatch.setattr(draft_length, "PLAIN_PROBE_PERIOD", 16)
    target = tiny_checkpoint("qwen3", tied=True)
    profile = {"thinking": [0.0] * K, "answer": [0.0] * K, "thinking_tokens": _THINK}
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    llm = LLM(
        target, device="cpu", async_scheduling=async_scheduling, max_num_seqs=max_num_seqs,
        speculative_config=cfg,
    )  # fmt: skip
    install_synthetic_acceptance(llm, profile=profile)
    engine = llm.llm_engine
    spec = engine.speculator
    spec.planner.reuse_streaks = bool(reuse)
    chooser = spec.planner.draft_length
    chooser.trace = []
    samples = []  # device model only: the wall times differ from run to run
    chooser.observe_time = lambda ks, ms, context: samples.append((_rows(ks), context))
    chooser.observe_switch = lambda ks, ms, context: samples.append(("switch", _rows(ks), context))
    calls = []
    choose = DraftPlanner._choose
    monkeypatch.setattr(DraftPlanner, "_choose", lambda self, *a: calls.append(1) or choose(self, *a))
    first_read = {}  # request id -> its counters when its finished output was made
    make_output = engine.make_output

    def reading(seq):
        out = make_output(seq)
        if out.finished:
            first_read[out.request_id] = out.metrics.spec_decode.to_dict()
        return out

    engine.make_output = reading
    # [9]: a one-token prompt, admitted (max_num_seqs 2) when the second request finishes, both thinking
    prompts = [[72, 105, 33], [65, 66], [9], [1, 2, 3, 4], [40, 41], [7, 8, 9]]
    lengths = (100, 60, 85, 44, 90, 52)  # plain steps from about the 30th step on
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=n) for m in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, first_read, spec, samples, len(calls)


@pytest.mark.parametrize("max_num_seqs", [8, 2])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_plain_streaks_reuse_the_choice_as_a_fresh_pass_would_make_it(
    monkeypatch, async_scheduling, max_num_seqs
):
    """A plain step over the same rows as the one before takes the chooser's cached plain choice without
    the per-row pass, and counts its rows' draft lengths when their outputs are read: the same tokens,
    choices, probes, timing samples and per-request histograms as when every step takes the pass. With
    max_num_seqs 2, finished rows make room for waiting requests, one of whose prompts is one token."""
    runs = [_plain_streak_run(monkeypatch, r, async_scheduling, max_num_seqs=max_num_seqs) for r in (0, 1)]
    (outs_a, read_a, spec_a, samples_a, calls_a), (outs_b, read_b, spec_b, samples_b, calls_b) = runs
    assert calls_b < 0.7 * calls_a  # most plain steps reused the choice
    assert [o.outputs[0].token_ids for o in outs_a] == [o.outputs[0].token_ids for o in outs_b]
    assert samples_a == samples_b and len(samples_a) > 50
    trace_a, trace_b = spec_a.planner.draft_length.trace, spec_b.planner.draft_length.trace
    assert [(t["choice"], t["counts"], t["ks"], t["context"]) for t in trace_a] == [
        (t["choice"], t["counts"], t["ks"], t["context"]) for t in trace_b
    ]
    assert spec_a.planner.draft_length.num_choices == spec_b.planner.draft_length.num_choices
    assert spec_a.metrics.to_dict() == spec_b.metrics.to_dict()
    assert spec_b.metrics.total.num_draft_tokens > 0  # probes drafted
    assert read_a == read_b and len(read_b) == len(outs_b)
    assert spec_b.planner._streak is None  # idle: the engine let go of the streak's rows
    for out in outs_b:
        assert read_b[out.request_id] == out.metrics.spec_decode.to_dict()  # complete when first read
        # every decode step emitted one token (nothing is accepted): the request's first token came
        # from its prefill, each later one from a step counted in the phase it was planned in
        hist = out.metrics.spec_decode
        emitted = len(out.outputs[0].token_ids)
        assert sum(hist.thinking.draft_length_histogram) == min(emitted, _THINK) - 1
        assert sum(hist.answer.draft_length_histogram) == max(emitted - _THINK, 0)


def test_plain_streak_counts_reach_each_completion_of_a_parallel_request(monkeypatch):
    """n = 2: the request's output merges its completions' counts, each settled when it is read."""
    outs, read, _, _, _ = _plain_streak_run(monkeypatch, True, True, n=2)
    for out in outs:
        assert read[out.request_id] == out.metrics.spec_decode.to_dict()
        m = out.metrics.spec_decode
        steps = sum(len(c.token_ids) - 1 for c in out.outputs)
        assert sum(m.thinking.draft_length_histogram) + sum(m.answer.draft_length_histogram) == steps


def test_choose_plain_again_reuses_only_what_choose_would():
    """The cached plain choice is taken again while fresh, never on a probe's choice, never in place of
    a drafting choice; a refusal changes nothing (choose then searches or probes as ever)."""
    from thinkspec.spec_decode import draft_length

    counts = np.array([0, 16, 0])
    drafting = AdaptiveDraftLength(K, _costs())
    assert not drafting.choose_plain_again(100)  # nothing chosen yet
    drafting.estimates.rates[:] = 0.9
    assert drafting.choose(counts)[THINKING] > 0
    assert not drafting.choose_plain_again(100) and drafting.num_choices == 1  # the cached choice drafts
    chooser, twin = AdaptiveDraftLength(K, _costs()), AdaptiveDraftLength(K, _costs())  # twin: choose alone
    searches = []
    for c in (chooser, twin):
        c.estimates.rates[:] = 0.0
        c.choose(counts)
    evaluate = chooser.evaluate
    chooser.evaluate = lambda *args: (searches.append(1), evaluate(*args))[1]
    reused = []
    for _ in range(draft_length.PLAIN_PROBE_PERIOD + 2):
        again = chooser.choose_plain_again(200)
        ks = np.zeros(len(GROUPS), dtype=np.int64) if again else chooser.choose(counts, 200)
        assert np.array_equal(ks, twin.choose(counts, 200)) and chooser.num_choices == twin.num_choices
        assert chooser.probe_rows == twin.probe_rows
        reused.append(again)
    # refused: each choice that searches (every REFRESH_PLAIN-th: no refresh between) and the probe's
    refused = [n for n, again in enumerate(reused, start=2) if not again]
    probe = draft_length.PLAIN_PROBE_PERIOD
    assert refused == sorted({*range(1 + REFRESH_PLAIN, probe + 4, REFRESH_PLAIN), probe})
    assert len(searches) == len(refused) - 1  # the probe reused the search


def test_a_streak_is_left_when_a_row_stops_decoding():
    """The same rows, but one of them feeding a chunk or sampling nothing: the per-row pass runs again
    and the step is no plain decode step."""
    from thinkspec.engine.sequence import Sequence

    target = tiny_checkpoint("qwen3", tied=True)
    cfg = {"model": str(target), "num_speculative_tokens": K, "adaptive_k": True}
    spec = LLM(target, device="cpu", speculative_config=cfg).llm_engine.speculator
    spec.planner.draft_length.estimates.rates[:] = 0.0  # plain steps
    # device model only: the time between these plan calls (a loaded host's) is no step's, and a large
    # learned plain overhead against unmeasured drafting ones could make drafting look cheaper
    spec.planner.draft_length.observe_time = lambda *args: None
    seqs = []
    for i in range(3):
        seq = Sequence(str(i), [1, 2, 3], SamplingParams(temperature=0, max_tokens=64))
        seq.token_ids += [4] * 8  # decoding, its draft 8 tokens behind
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    calls = []
    choose = spec.planner._choose
    spec.planner._choose = lambda *a: calls.append(1) or choose(*a)
    assert spec.planner.plan(seqs, [1, 1, 1], [True] * 3)
    spec.planner.record_plan()
    assert spec.planner.plan(seqs, [1, 1, 1], [True] * 3) and len(calls) == 1  # reused
    spec.planner.record_plan()
    assert not spec.planner.plan(seqs, [1, 4, 1], [True] * 3) and len(calls) == 2
    spec.planner.record_plan()
    assert spec.planner.plan(seqs, [1, 1, 1], [True] * 3) and len(calls) == 3  # a new streak
    spec.planner.record_plan()
    assert not spec.planner.plan(seqs, [1, 1, 1], [True, False, True]) and len(calls) == 4


def test_a_plain_steps_sample_given_as_its_rows_learns_what_its_draft_lengths_would():
    """A plain step's timing sample may come as its number of rows (no numpy on the plain path): the
    same overhead, steps record and modelled time as its row_ks of zeros."""
    by_rows, by_ks = (AdaptiveDraftLength(K, _context_costs(draft_ctx=2e-5, verify_ctx=3e-5)) for _ in "ab")
    for chooser in (by_rows, by_ks):
        chooser.steps = []
    for wall, context in ((9.0, 3000), (7.5, 3016), (8.25, 3032), (6.0, 3048)):
        by_rows.observe_time(16, wall, context)
        by_ks.observe_time(np.zeros(16, dtype=np.int64), wall, context)
    assert np.array_equal(by_rows.costs.overhead, by_ks.costs.overhead, equal_nan=True)
    assert by_rows.steps == by_ks.steps and by_rows.steps[0][:2] == (16, 0)
    assert by_rows.costs.plain_ms(16, 3000) == by_ks.modelled_ms(np.zeros(16, dtype=np.int64), context=3000)
    forced = ForcedDraftLength.fixed(K, 0)
    forced.steps = []
    forced.observe_time(16, 5.0)
    forced.observe_time(np.array([0, 2]), 6.0)
    assert [s[:3] for s in forced.steps] == [(16, 0, 5.0), (2, 2, 6.0)]


def test_plain_ms_follows_a_bucket_measured_after_it_was_read():
    """plain_ms caches per batch until a bucket is added: a measurement that lands later (the engine
    measures buckets as batches first reach them) moves it as it moves round_ms."""
    table = {b: [StepCosts(b, k, 5.0, 0.5, 5.0 + k, 0.0, 1e-4) for k in range(K + 1)] for b in (1, 64)}
    costs = StepCostModel(K, (1, 2, 4, 8, 16, 32, 64), table)
    assert costs.plain_ms(16, 1000) == pytest.approx(5.0 + 1000 * 1e-4)
    costs.add([StepCosts(16, k, 3.0, 0.5, 3.0 + k, 0.0, 2e-4) for k in range(K + 1)])
    assert costs.plain_ms(16, 1000) == pytest.approx(3.0 + 1000 * 2e-4)
    assert costs.plain_ms(16, 1000) == float(costs.round_ms(16)[0] + 1000 * costs.context_ms(16)[0])
