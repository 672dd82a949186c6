import pytest
import torch

from thinkspec.reasoning import PhaseTracker, initial_phase

START, END = 5, 6
EOS, IM_END = 1, 2
PROTECTED = [EOS, IM_END, START, END]


@pytest.fixture
def tracker():
    return PhaseTracker(START, END, PROTECTED)


def ref_phase_before(thinking, row):
    out, phase = [], thinking
    for tok in row:
        out.append(phase)
        if tok == START:
            phase = True
        elif tok == END:
            phase = False
    return out


def ref_relax_mask(thinking, drafts, num_drafts, enabled, protected):
    rows = []
    for b, row in enumerate(drafts.tolist()):
        phases = ref_phase_before(bool(thinking[b]), row)
        rows.append(
            [
                phases[i] and i < int(num_drafts[b]) and row[i] not in protected and bool(enabled[b])
                for i in range(len(row))
            ]
        )
    return torch.tensor(rows, dtype=torch.bool).reshape(drafts.shape)


def random_batch(gen, b, k, vocab=10):
    drafts = torch.randint(0, vocab, (b, k), generator=gen)
    num = torch.randint(0, k + 1, (b,), generator=gen)
    drafts = torch.where(torch.arange(k) < num[:, None], drafts, torch.full_like(drafts, -1))  # pads
    thinking = torch.randint(0, 2, (b,), generator=gen).bool()
    return thinking, drafts, num


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([], False),
        ([3, 4, 7], False),  # 0 markers: no reasoning block
        ([3, START], True),  # 1 marker: R1 template opens the block
        ([3, START, 9], True),
        ([3, END, 4], False),
        ([3, START, 9, END, 4], False),  # 2 markers: Qwen3 enable_thinking=False closes it
        ([START, END, 4, START, 8], True),  # history, then a new open block
    ],
)
def test_initial_phase(tracker, prompt, expected):
    assert initial_phase(prompt, START, END) is expected
    assert tracker.initial_phase(prompt) is expected
    assert tracker.initial_phase(torch.tensor(prompt, dtype=torch.long)) is expected


def test_end_marker_in_window_makes_later_positions_strict(tracker):
    thinking = torch.tensor([True, True, False])
    drafts = torch.tensor(
        [
            [7, 8, END, 9, 7],  # </think> at 2: positions 3, 4 are answer
            [7, 8, 9, 7, 8],  # thinking throughout
            [7, START, 8, 9, END],  # answer, <think> opens at 1: positions 2, 3 relaxable
        ]
    )
    num = torch.tensor([5, 5, 5])
    assert tracker.phase_before(thinking, drafts).tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, True],
        [False, False, True, True, True],
    ]
    assert tracker.relax_mask(thinking, drafts, num).tolist() == [
        [True, True, False, False, False],  # the marker itself is protected
        [True, True, True, True, True],
        [False, False, True, True, False],
    ]


def test_protected_tokens_never_relaxed(tracker):
    gen = torch.Generator().manual_seed(0)
    thinking = torch.ones(64, dtype=torch.bool)
    drafts = torch.randint(0, 8, (64, 6), generator=gen)
    mask = tracker.relax_mask(thinking, drafts, torch.full((64,), 6))
    protected = torch.isin(drafts, torch.tensor(PROTECTED))
    assert protected.any() and (~protected).any()
    assert not (mask & protected).any()
    # Before any marker every unprotected position of a thinking row is relaxable.
    first_marker = torch.where((drafts == START) | (drafts == END), torch.arange(6), 6).amin(dim=1)
    before = torch.arange(6) <= first_marker[:, None]
    assert torch.equal(mask & before, ~protected & before)


def test_markers_always_protected_and_cached():
    tracker = PhaseTracker(START, END, [EOS])
    assert tracker.protected_token_ids.tolist() == [EOS, START, END]
    assert tracker.protected_on(torch.device("cpu")) is tracker.protected_on(torch.device("cpu"))
    mask = tracker.relax_mask(torch.tensor([True]), torch.tensor([[START, END, EOS, 3]]), torch.tensor([4]))
    assert mask.tolist() == [
        [False, False, False, False]
    ]  # START reopens, END closes, EOS protected; 3 strict
    assert PhaseTracker(START, END).protected_token_ids.tolist() == [START, END]
    assert PhaseTracker(START, END, torch.tensor([9, 9, 1])).protected_token_ids.tolist() == [
        1,
        START,
        END,
        9,
    ]


def test_relax_mask_respects_num_draft_tokens_and_enabled(tracker):
    thinking = torch.tensor([True, True, True, True])
    drafts = torch.tensor([[7, 8, 9], [7, 8, -1], [-1, -1, -1], [7, 8, 9]])
    num = torch.tensor([3, 2, 0, 3])
    enabled = torch.tensor([True, True, True, False])
    assert tracker.relax_mask(thinking, drafts, num, enabled).tolist() == [
        [True, True, True],
        [True, True, False],
        [False, False, False],
        [False, False, False],
    ]


def test_relax_mask_matches_reference_on_random_batches(tracker):
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        b, k = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        thinking, drafts, num = random_batch(gen, b, k)
        enabled = torch.randint(0, 2, (b,), generator=gen).bool() if trial % 2 else None
        got = tracker.relax_mask(thinking, drafts, num, enabled)
        want = ref_relax_mask(
            thinking, drafts, num, enabled if enabled is not None else [True] * b, PROTECTED
        )
        assert got.dtype == torch.bool and got.shape == (b, k)
        assert torch.equal(got, want), (thinking, drafts, num, enabled)
        want_phase = torch.tensor([ref_phase_before(bool(t), r) for t, r in zip(thinking, drafts.tolist())])
        assert torch.equal(tracker.phase_before(thinking, drafts), want_phase.reshape(b, k))


def test_advance_matches_reference(tracker):
    gen = torch.Generator().manual_seed(2)
    for _ in range(30):
        b, n = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 7, (1,), generator=gen))
        thinking, tokens, num = random_batch(gen, b, n)
        # Markers past num_tokens must not count: put stale markers in the pad slots.
        stale = torch.where(tokens < 0, torch.tensor(END), tokens)
        want = []
        for t, row, m in zip(thinking.tolist(), tokens.tolist(), num.tolist()):
            phase = ref_phase_before(t, row[:m] + [0])[-1]
            want.append(phase)
        assert tracker.advance(thinking, tokens, num).tolist() == want
        assert tracker.advance(thinking, stale, num).tolist() == want


def test_advance_edge_cases(tracker):
    thinking = torch.tensor([True, False])
    assert tracker.advance(
        thinking, torch.empty(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    ).tolist() == [
        True,
        False,
    ]
    tokens = torch.tensor([[7, END, START], [START, 7, END]])
    assert tracker.advance(thinking, tokens, torch.tensor([3, 3])).tolist() == [True, False]
    assert tracker.advance(thinking, tokens, torch.tensor([2, 1])).tolist() == [False, True]
    assert tracker.advance(thinking, tokens, torch.tensor([0, 0])).tolist() == [True, False]
    pads = torch.full((2, 3), -1)
    assert tracker.advance(thinking, pads, torch.tensor([3, 3])).tolist() == [True, False]
    assert tracker.phase_before(thinking, torch.empty(2, 0, dtype=torch.long)).shape == (2, 0)


def test_constructor_validation():
    with pytest.raises(ValueError, match="think_start_id must be a non-negative int, got True"):
        PhaseTracker(True, END)
    with pytest.raises(ValueError, match="think_end_id must be a non-negative int, got -1"):
        PhaseTracker(START, -1)
    with pytest.raises(ValueError, match="markers must differ"):
        PhaseTracker(START, START)
    with pytest.raises(ValueError, match="protected_token_ids must be non-negative"):
        PhaseTracker(START, END, [-1, 3])


@pytest.mark.gpu
def test_cuda_matches_cpu_without_host_sync(tracker):
    gen = torch.Generator().manual_seed(3)
    thinking, drafts, num = random_batch(gen, 16, 5)
    want_mask = tracker.relax_mask(thinking, drafts, num)
    want_next = tracker.advance(thinking, drafts, num)
    dev = torch.device("cuda")
    args = (thinking.to(dev), drafts.to(dev), num.to(dev))
    tracker.relax_mask(*args)  # warm-up copies the protected ids to the device once
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = tracker.relax_mask(*args)
        nxt = tracker.advance(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert mask.device.type == "cuda" and nxt.device.type == "cuda"
    assert torch.equal(mask.cpu(), want_mask) and torch.equal(nxt.cpu(), want_next)
