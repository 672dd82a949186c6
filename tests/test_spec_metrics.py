import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from thinkspec.spec_decode.metrics import PhaseCounters, SpecDecodeMetrics, SpecDecodeStep

T, F = True, False
# Four requests, K = 4.
NUM_DRAFT = [4, 3, 0, 2]
NUM_ACCEPTED = [2, 3, 0, 0]
RELAXED = [
    [F, T, T, F],  # position 2 passed the relaxed test but lies after the first rejection
    [F, F, F, F],
    [F, F, F, F],
    [F, F, F, F],
]
THINKING_BEFORE = [
    [T, T, T, F],  # </think> drafted at position 2
    [F, F, F, F],
    [T, T, T, T],  # no drafts: not a speculative step
    [T, T, T, T],
]


def example_tensors():
    return (
        torch.tensor(NUM_DRAFT),
        torch.tensor(NUM_ACCEPTED),
        torch.tensor(RELAXED),
        torch.tensor(THINKING_BEFORE),
    )


def check_hand_example(m: SpecDecodeMetrics):
    th, an, tot = m.phase("thinking"), m.phase("answer"), m.phase(None)
    assert (th.num_drafts, th.num_emitted_tokens) == (2, 4)  # rows 0 and 3: 3 + 1 emitted
    assert (th.num_draft_tokens, th.num_accepted_tokens, th.num_relaxed_accepted_tokens) == (5, 2, 1)
    assert th.num_draft_tokens_per_pos == [2, 2, 1, 0]
    assert th.num_accepted_tokens_per_pos == [1, 1, 0, 0]
    assert (an.num_drafts, an.num_emitted_tokens) == (1, 4)
    assert (an.num_draft_tokens, an.num_accepted_tokens, an.num_relaxed_accepted_tokens) == (4, 3, 0)
    assert an.num_draft_tokens_per_pos == [1, 1, 1, 1]
    assert an.num_accepted_tokens_per_pos == [1, 1, 1, 0]
    assert (tot.num_drafts, tot.num_emitted_tokens, tot.num_draft_tokens, tot.num_accepted_tokens) == (
        3,
        8,
        9,
        5,
    )
    assert tot.num_accepted_tokens_per_pos == [2, 2, 1, 0]

    assert m.mean_acceptance_length() == pytest.approx(8 / 3)
    assert m.mean_acceptance_length("thinking") == pytest.approx(2.0)
    assert m.mean_acceptance_length("answer") == pytest.approx(4.0)
    assert m.draft_acceptance_rate() == pytest.approx(5 / 9)
    assert m.draft_acceptance_rate("thinking") == pytest.approx(2 / 5)
    assert m.draft_acceptance_rate("answer") == pytest.approx(3 / 4)
    assert m.acceptance_rate_per_pos() == pytest.approx([2 / 3, 2 / 3, 1 / 2, 0.0])
    assert m.acceptance_rate_per_pos("thinking") == pytest.approx([1 / 2, 1 / 2, 0.0, 0.0])
    assert m.acceptance_rate_per_pos("answer") == pytest.approx([1.0, 1.0, 1.0, 0.0])
    assert m.relaxed_share() == pytest.approx(1 / 5)
    assert m.relaxed_share("thinking") == pytest.approx(1 / 2)
    assert m.relaxed_share("answer") == 0.0


def test_hand_computed_example_from_tensors():
    m = SpecDecodeMetrics()
    step = m.observe(*example_tensors())
    check_hand_example(m)
    assert isinstance(step, SpecDecodeStep) and step.relaxed_accepted.dtype == bool


def test_hand_computed_example_from_numpy_and_lists():
    m = SpecDecodeMetrics()
    m.observe(np.array(NUM_DRAFT), np.array(NUM_ACCEPTED), np.array(RELAXED), np.array(THINKING_BEFORE))
    check_hand_example(m)
    m2 = SpecDecodeMetrics()
    m2.observe(NUM_DRAFT, NUM_ACCEPTED, RELAXED, THINKING_BEFORE)
    assert m2 == m


def test_per_request_metrics_sum_to_batch_metrics():
    batch = SpecDecodeMetrics()
    step = batch.observe(*example_tensors())
    per_request = [SpecDecodeMetrics().observe_step(step, i) for i in range(len(NUM_DRAFT))]
    assert per_request[2] == SpecDecodeMetrics(
        PhaseCounters(num_draft_tokens_per_pos=[0] * 4, num_accepted_tokens_per_pos=[0] * 4),
        PhaseCounters(num_draft_tokens_per_pos=[0] * 4, num_accepted_tokens_per_pos=[0] * 4),
    )
    assert per_request[1].mean_acceptance_length() == 4.0
    assert per_request[1].mean_acceptance_length("thinking") == 0.0  # no thinking steps: 0, not an error
    total = SpecDecodeMetrics()
    for m in per_request:
        total.merge(m)
    assert total == batch
    subset = SpecDecodeMetrics().observe_step(step, [0, 3])
    assert subset == per_request[0].merge(per_request[3])
    first_two = SpecDecodeMetrics()
    first_two.observe(NUM_DRAFT[:2], NUM_ACCEPTED[:2], RELAXED[:2], THINKING_BEFORE[:2])
    assert SpecDecodeMetrics().observe_step(step, slice(0, 2)) == first_two
    assert SpecDecodeMetrics().observe_step(step, []).phase(None).num_drafts == 0
    assert SpecDecodeMetrics().observe_step(step, np.array([1])) == per_request[1]


def test_accumulates_over_steps_and_varying_k():
    m = SpecDecodeMetrics()
    m.observe(*example_tensors())
    m.observe([1], [1], [[True]], [[True]])  # K = 1 step, relaxed accept
    th = m.phase("thinking")
    assert th.num_draft_tokens_per_pos == [3, 2, 1, 0]
    assert th.num_accepted_tokens_per_pos == [2, 1, 0, 0]
    assert (th.num_drafts, th.num_emitted_tokens, th.num_relaxed_accepted_tokens) == (3, 6, 2)
    other = SpecDecodeMetrics()
    other.observe([2], [2], [[F, F]], [[F, F]])
    m.merge(other)
    assert m.phase("answer").num_accepted_tokens_per_pos == [2, 2, 1, 0]


def reference(num_draft, num_accepted, relaxed, thinking):
    counts = {
        p: dict(drafts=0, emitted=0, draft=0, acc=0, relaxed=0, dpos=[0] * 8, apos=[0] * 8) for p in (T, F)
    }
    for nd, na, rel, th in zip(num_draft, num_accepted, relaxed, thinking):
        if nd >= 1:
            counts[th[0]]["drafts"] += 1
            counts[th[0]]["emitted"] += na + 1
        for k in range(nd):
            c = counts[th[k]]
            c["draft"] += 1
            c["dpos"][k] += 1
            if k < na:
                c["acc"] += 1
                c["apos"][k] += 1
                c["relaxed"] += rel[k]
    return counts


def test_random_steps_match_loop_reference():
    rng = np.random.default_rng(0)
    m = SpecDecodeMetrics()
    totals = {p: None for p in (T, F)}
    for _ in range(20):
        b, k = rng.integers(1, 9), rng.integers(1, 9)
        nd = rng.integers(0, k + 1, size=b)
        na = np.array([rng.integers(0, d + 1) for d in nd])
        relaxed = rng.random((b, k)) < 0.3
        thinking = rng.random((b, k)) < 0.6
        m.observe(
            torch.from_numpy(nd), torch.from_numpy(na), torch.from_numpy(relaxed), torch.from_numpy(thinking)
        )
        ref = reference(nd.tolist(), na.tolist(), relaxed.tolist(), thinking.tolist())
        for p in (T, F):
            if totals[p] is None:
                totals[p] = ref[p]
            else:
                for key, value in ref[p].items():
                    totals[p][key] = (
                        [a + b for a, b in zip(totals[p][key], value)]
                        if isinstance(value, list)
                        else totals[p][key] + value
                    )
    for p, name in ((T, "thinking"), (F, "answer")):
        got, want = m.phase(name), totals[p]
        assert got.num_drafts == want["drafts"] and got.num_emitted_tokens == want["emitted"]
        assert got.num_draft_tokens == want["draft"] and got.num_accepted_tokens == want["acc"]
        assert got.num_relaxed_accepted_tokens == want["relaxed"]
        kmax = len(got.num_draft_tokens_per_pos)
        assert got.num_draft_tokens_per_pos == want["dpos"][:kmax] and not any(want["dpos"][kmax:])
        assert got.num_accepted_tokens_per_pos == want["apos"][:kmax]
    tot = m.phase(None)
    assert Fraction(tot.num_emitted_tokens, tot.num_drafts) == Fraction(
        tot.num_drafts + tot.num_accepted_tokens, tot.num_drafts
    )  # mean acceptance length = 1 + accepted drafts per step


def test_to_dict_names_and_json():
    m = SpecDecodeMetrics()
    m.observe(*example_tensors())
    d = json.loads(json.dumps(m.to_dict()))
    for key in (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_accepted_tokens_per_pos",
        "num_relaxed_accepted_tokens",
        "num_emitted_tokens",
        "mean_acceptance_length",
        "draft_acceptance_rate",
        "acceptance_rate_per_pos",
    ):
        assert key in d and key in d["by_phase"]["thinking"] and key in d["by_phase"]["answer"]
    assert d["num_drafts"] == 3 and d["by_phase"]["thinking"]["num_relaxed_accepted_tokens"] == 1
    assert d["mean_acceptance_length"] == pytest.approx(8 / 3)


def test_empty_metrics_and_errors():
    m = SpecDecodeMetrics()
    assert m.mean_acceptance_length() == 0.0 and m.draft_acceptance_rate("answer") == 0.0
    assert m.acceptance_rate_per_pos() == [] and m.relaxed_share() == 0.0
    m.observe(
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, dtype=torch.long),
        torch.zeros(2, 0, dtype=torch.bool),
        torch.zeros(2, 0, dtype=torch.bool),
    )
    assert m.phase(None).num_drafts == 0
    with pytest.raises(ValueError, match="phase must be one of"):
        m.phase("reasoning")
    with pytest.raises(ValueError, match=r"num_accepted must be in \[0, num_draft_tokens\]"):
        m.observe([1], [2], [[F, F]], [[T, T]])
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[0, 2\]"):
        m.observe([3], [0], [[F, F]], [[T, T]])
    with pytest.raises(ValueError, match=r"expected num_draft_tokens \[B\]"):
        m.observe(torch.tensor([1, 1]), torch.tensor([0]), torch.zeros(2, 2).bool(), torch.zeros(2, 2).bool())
    with pytest.raises(ValueError, match=r"thinking_before \[B, K\]"):
        m.observe([1], [0], [[F, F]], [[T]])
    assert m.phase(None).num_drafts == 0  # failed observations add nothing


def test_per_request_rows_accumulate_as_the_batch_path_over_random_steps():
    """observe_step(step, i) (the per-request fast path) equals observe_step(step, [i]) over steps
    whose K varies, rows without drafts included."""
    rng = np.random.default_rng(1)
    b = 6
    fast = [SpecDecodeMetrics() for _ in range(b)]
    slow = [SpecDecodeMetrics() for _ in range(b)]
    for _ in range(30):
        k = int(rng.integers(1, 9))
        nd = rng.integers(0, k + 1, size=b)
        na = np.array([rng.integers(0, d + 1) for d in nd])
        step = SpecDecodeMetrics().observe(nd, na, rng.random((b, k)) < 0.3, rng.random((b, k)) < 0.6)
        for i in range(b):
            fast[i].observe_step(step, i)
            slow[i].observe_step(step, [i])
    assert fast == slow
    assert any(m.phase(None).num_relaxed_accepted_tokens for m in fast)


def test_small_steps_count_in_python_as_numpy_does(monkeypatch):
    """Steps of up to SMALL_STEP_ROWS rows are counted in Python (their numpy calls cost more than the
    work, on the host's path between steps): the same packed rows and sums as the numpy count, over
    random steps (K = 0 included), for all rows, a slice and a list of rows."""
    from thinkspec.spec_decode import metrics

    rng = np.random.default_rng(2)
    for _ in range(200):
        b, k = int(rng.integers(1, metrics.SMALL_STEP_ROWS + 1)), int(rng.integers(0, 9))
        nd = rng.integers(0, k + 1, size=b)
        na = np.array([rng.integers(0, d + 1) for d in nd])
        args = (nd, na, rng.random((b, k)) < 0.3, rng.random((b, k)) < 0.6)
        small = SpecDecodeStep.from_tensors(*args)
        rows = [None, slice(1, None), sorted(set(rng.integers(0, b, size=2).tolist()))]
        got = small.row_lists(), [small.packed_sum(r) for r in rows]
        monkeypatch.setattr(metrics, "SMALL_STEP_ROWS", 0)
        large = SpecDecodeStep.from_tensors(*args)
        assert got == (large.row_lists(), [large.packed_sum(r) for r in rows])
        monkeypatch.undo()
