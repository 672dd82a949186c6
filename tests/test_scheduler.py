import random

import pytest

from thinkspec.engine.block_manager import BlockManager
from thinkspec.engine.scheduler import Scheduler, SchedulerOutput
from thinkspec.engine.sequence import Sequence, SequenceStatus, commit_token
from thinkspec.sampling_params import SamplingParams

VOCAB = 97


class FakeKV:
    """A KV pool where slot s holds hash(prefix up to its position): a forward reads every context
    slot through the block table, so a wrong table, a stale block or a bad prefix hit fails."""

    def __init__(self, bm: BlockManager) -> None:
        self.bs = bm.block_size
        self.slots: list[int | None] = [None] * (bm.num_blocks * bm.block_size)
        self.forwards = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def run(self, out: SchedulerOutput) -> list[list[int]]:
        self.forwards += 1
        tokens = []
        for seq, n, sample in zip(out.seqs, out.num_new_tokens, out.sample_mask()):
            start = seq.num_computed_tokens
            assert len(seq.block_table) * self.bs >= start + n
            for pos in range(start, start + n):
                self.slots[self.slot(seq, pos)] = hash(tuple(seq.token_ids[: pos + 1]))
            for pos in range(start + n):
                assert self.slots[self.slot(seq, pos)] == hash(tuple(seq.token_ids[: pos + 1])), pos
            tokens.append([next_token(seq.token_ids)] if sample else [])
        return tokens


def next_token(context: list[int]) -> int:
    return hash(tuple(context)) % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=32, max_model_len=512):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(
        bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step, max_model_len=max_model_len
    )
    return sched, bm, FakeKV(bm)


def run_to_end(sched: Scheduler, kv: FakeKV, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        out = sched.schedule()
        assert not out.is_empty
        sched.postprocess(out, kv.run(out))
        outs.append(out)
    raise AssertionError("did not finish")


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def seq(rid, prompt, max_tokens=8, **kw):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw))


def test_chunked_prefill_respects_budget_and_outputs_match():
    sched, bm, kv = make_scheduler(max_tokens_per_step=10)
    rng = random.Random(1)
    seqs = [seq(f"r{i}", [rng.randrange(VOCAB) for _ in range(n)], 6) for i, n in enumerate([3, 25, 11, 40])]
    for s in seqs:
        sched.add(s)
    outs = run_to_end(sched, kv)
    assert all(o.num_batched_tokens <= 10 for o in outs)
    # The 40-token prompt needed several chunks: it appears in >= 4 prefill steps.
    long_prefill_steps = [o for o in outs for s, n in zip(o.seqs, o.num_new_tokens) if s is seqs[3] and n > 1]
    assert len(long_prefill_steps) >= 4
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 6)
        assert s.finish_reason == "length"
    assert_all_free(bm)


def test_max_num_seqs_bound():
    sched, bm, kv = make_scheduler(max_num_seqs=2, max_tokens_per_step=100)
    for i in range(5):
        sched.add(seq(f"r{i}", [i + 1, 2, 3], 4))
    outs = run_to_end(sched, kv)
    assert max(len(o.seqs) for o in outs) == 2
    assert_all_free(bm)


def test_preemption_resumes_with_unchanged_output():
    # 12 blocks of 4 tokens; 4 requests of 10 + 20 tokens cannot all stay resident.
    sched, bm, kv = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_tokens_per_step=64)
    rng = random.Random(2)
    seqs = [seq(f"r{i}", [rng.randrange(VOCAB) for _ in range(10)], 20) for i in range(4)]
    for s in seqs:
        sched.add(s)
    outs = run_to_end(sched, kv)
    assert sched.num_preemptions > 0
    assert any(o.preempted for o in outs)
    assert sum(s.metrics.num_preemptions for s in seqs) == sched.num_preemptions
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 20)
    assert_all_free(bm)


def test_prefix_cache_hit_skips_tokens():
    sched, bm, kv = make_scheduler(max_tokens_per_step=64)
    prefix = list(range(1, 14))
    a = seq("a", prefix + [20], 3)
    sched.add(a)
    run_to_end(sched, kv)
    b = seq("b", prefix + [30, 31], 3)
    sched.add(b)
    out = sched.schedule()
    assert out.num_new_tokens == [15 - 12]  # 3 full blocks from the cache
    assert b.num_cached_tokens == 12 and bm.stats.hits_tokens == 12
    sched.postprocess(out, kv.run(out))
    run_to_end(sched, kv)
    assert b.output_token_ids == reference_output(b.prompt_token_ids, 3)
    assert_all_free(bm)


def test_abort_waiting_and_running_frees_everything():
    sched, bm, kv = make_scheduler(max_num_seqs=1)
    a, b = seq("a", [1, 2, 3, 4, 5], 50), seq("b", [6, 7], 50)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        out = sched.schedule()
        sched.postprocess(out, kv.run(out))
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    generated = list(a.output_token_ids)
    assert sched.abort("a") is a
    assert a.finish_reason == "abort" and a.output_token_ids == generated
    assert sched.abort("b") is b and b.finish_reason == "abort"
    assert sched.abort("b") is None and sched.abort("nope") is None
    assert not sched.has_unfinished_requests()
    assert_all_free(bm)


def test_abort_between_schedule_and_postprocess():
    sched, bm, kv = make_scheduler()
    a = seq("a", [1, 2, 3], 5)
    sched.add(a)
    out = sched.schedule()
    tokens = kv.run(out)
    sched.abort("a")
    assert sched.postprocess(out, tokens) == []
    assert a.output_token_ids == []
    assert_all_free(bm)


def test_duplicate_request_id_rejected():
    sched, _, _ = make_scheduler()
    sched.add(seq("x", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(seq("x", [2]))


def test_lookahead_slots_reserved_for_decoding_rows():
    sched, bm, kv = make_scheduler(block_size=4, max_tokens_per_step=64)
    a = seq("a", [1, 2, 3], 5)
    sched.add(a)
    out = sched.schedule(num_lookahead_tokens=6)
    assert len(a.block_table) == 3  # 3 prompt tokens + 6 lookahead slots = 9 -> 3 blocks
    sched.postprocess(out, kv.run(out))
    sched.abort("a")
    assert_all_free(bm)


# ---- per-token stop checking -------------------------------------------------------------


def commit_all(s: Sequence, tokens, max_model_len=1000, tokenizer=None):
    for t in tokens:
        if commit_token(s, t, max_model_len=max_model_len, tokenizer=tokenizer):
            break
    return s


def test_stop_token_ids_eos_and_max_tokens():
    s = commit_all(seq("a", [1], 10, stop_token_ids=[7]), [3, 4, 7, 8])
    assert s.output_token_ids == [3, 4, 7] and s.finish_reason == "stop" and s.stop_reason == 7
    s = Sequence("b", [1], SamplingParams(max_tokens=10), eos_token_ids=frozenset({9}))
    commit_all(s, [3, 9, 4])
    assert s.output_token_ids == [3, 9] and s.finish_reason == "stop" and s.stop_reason is None
    s = Sequence("c", [1], SamplingParams(max_tokens=10, ignore_eos=True), eos_token_ids=frozenset({9}))
    commit_all(s, [3, 9, 4])
    assert s.output_token_ids == [3, 9, 4] and not s.is_finished
    s = commit_all(seq("d", [1], 3), [5, 5, 5, 5, 5])
    assert s.output_token_ids == [5, 5, 5] and s.finish_reason == "length"
    s = commit_all(seq("e", [1, 2], 100), [5] * 10, max_model_len=6)
    assert s.num_tokens == 6 and s.finish_reason == "length"
    s = Sequence("f", [1], SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids=frozenset({9}))
    commit_all(s, [9, 9, 4])
    assert s.output_token_ids == [9, 9] and s.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="finished"):
        commit_token(s, 1, max_model_len=100, tokenizer=None)


class CharTokenizer:
    """Token id = character code; id 0 is a special token that decodes to '' when skipped."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if (i == 0 and skip_special_tokens) else "<s>" if i == 0 else chr(i) for i in ids)


def text_ids(text):
    return [ord(c) for c in text]


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_on_incremental_text(include):
    tok = CharTokenizer()
    s = seq("a", text_ids("Q:"), 50, stop=["END", "##"], include_stop_str_in_output=include)
    commit_all(s, text_ids("hello EN") + text_ids("D more"), tokenizer=tok)
    assert s.finish_reason == "stop" and s.stop_reason == "END"
    assert s.output_text == ("hello END" if include else "hello ")
    assert s.output_token_ids == text_ids("hello END")


def _commit_through_scheduler(stream: list[int], per_step: int) -> tuple[Sequence, int, BlockManager]:
    """Feeds stream to one request with stop string "##" through Scheduler.schedule/postprocess,
    per_step tokens per step; returns (the request, steps taken, its block manager)."""
    sched, bm, _ = make_scheduler()
    sched.tokenizer = CharTokenizer()
    s = seq("a", [65], 50, stop="##")
    sched.add(s)
    steps = 0
    while sched.has_unfinished_requests():
        assert steps * per_step < len(stream), "the stream ran out before the stop string"
        out = sched.schedule()
        sched.postprocess(out, [stream[steps * per_step : (steps + 1) * per_step]])
        steps += 1
    return s, steps, bm


def test_multi_token_commit_stops_where_single_steps_would():
    # One token per step (plain decode) against the whole stream in one step (a speculative round's
    # accepted run): the multi-token commit must stop at the stop string, drop what follows, free.
    stream = text_ids("abc##def")
    single, single_steps, single_bm = _commit_through_scheduler(stream, 1)
    batched, batched_steps, batched_bm = _commit_through_scheduler(stream, len(stream))
    assert (single_steps, batched_steps) == (5, 1)
    assert single.output_token_ids == batched.output_token_ids == text_ids("abc##")
    assert single.output_text == batched.output_text == "abc"
    assert single.finish_reason == batched.finish_reason == "stop"
    assert_all_free(single_bm)
    assert_all_free(batched_bm)


def test_stop_token_text_is_dropped_unless_requested():
    tok = CharTokenizer()
    s = commit_all(seq("a", [65], 50, stop_token_ids=[ord("!")]), text_ids("hi!x"), tokenizer=tok)
    assert s.output_text == "hi" and s.output_token_ids == text_ids("hi!")
    s = commit_all(
        seq("b", [65], 50, stop_token_ids=[ord("!")], include_stop_str_in_output=True),
        text_ids("hi!x"),
        tokenizer=tok,
    )
    assert s.output_text == "hi!"
    s = commit_all(seq("c", [65], 5, skip_special_tokens=False), [104, 0, 105], tokenizer=tok)
    assert s.output_text == "h<s>i"


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="empty"):
        seq("a", [])
