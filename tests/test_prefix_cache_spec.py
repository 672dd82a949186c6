"""Prefix caching under speculative decoding: every cache hit attaches K/V written for exactly the
requester's tokens, for the target and the draft (fp32, CPU, tiny random-weight checkpoints).

The oracle is independent of the block manager's hashes: each runner's forwards are shadowed
slot by slot with the token context whose K/V they wrote (the slot of position p holds the
context of slot p-1 plus the token fed at p), and each prefix-cache hit is checked against the
requesting sequence's own tokens when it is attached.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_checkpoint

from thinkspec import LLM, SamplingParams
from thinkspec.engine.block_manager import BlockManager, hash_block
from thinkspec.engine.model_runner import ModelRunner
from thinkspec.engine.sequence import Sequence
from thinkspec.spec_decode.draft_model import DraftModelProposer
from thinkspec.spec_decode.proposer import Proposal

BLOCK = 4
K = 4
# Target and draft K/V of one 4-token block of the tiny Qwen3 (2 layers x 2 KV heads x 32, fp32).
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4


class KVOracle:
    """Shadows what each runner's K/V pool holds and checks every prefix-cache hit against it."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.llm_engine
        self.block_size = engine.block_manager.block_size
        self.runners: dict[str, ModelRunner] = {"target": engine.model_runner}
        spec = engine.speculator
        if spec is not None and isinstance(spec.proposer, DraftModelProposer):
            self.runners["draft"] = spec.proposer.runner
        self.slots: dict[str, dict[int, tuple[int, ...] | None]] = {name: {} for name in self.runners}
        self.hit_blocks = 0
        self.hit_tokens = 0
        self.false_hits: list[str] = []
        self.bad_reads: list[str] = []  # forwards that attended to K/V of other tokens
        for name, runner in self.runners.items():
            self._wrap_runner(name, runner)
        self._wrap_allocate(engine.block_manager)

    def _wrap_runner(self, name: str, runner: ModelRunner) -> None:
        inner = runner.execute_model
        shadow = self.slots[name]
        bs = self.block_size

        def execute_model(seqs, num_new_tokens, num_logits, input_token_ids=None, start_positions=None,
                          device_inputs=None):  # fmt: skip
            flat: list[int] = []
            starts = []
            for i, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
                start = seq.num_computed_tokens if start_positions is None else start_positions[i]
                starts.append(start)
                ids = seq.token_ids[start : start + n] if input_token_ids is None else input_token_ids[i]
                flat.extend(int(t) for t in ids)
            if device_inputs is not None:  # drafts that never left the device
                for idx, tok in zip(device_inputs[0].tolist(), device_inputs[1].tolist()):
                    flat[idx] = int(tok)
            for seq, start in zip(seqs, starts):  # what the forward reads must be its own tokens
                for p in range(min(start, seq.num_tokens)):
                    got = shadow.get(seq.block_table[p // bs] * bs + p % bs)
                    if got != tuple(seq.token_ids[: p + 1]):
                        self.bad_reads.append(f"{name} request {seq.request_id} position {p}")
                        break
            offset = 0
            for seq, n, start in zip(seqs, num_new_tokens, starts):
                for p in range(start, start + n):
                    prev: tuple[int, ...] | None = ()
                    if p > 0:
                        prev_slot = seq.block_table[(p - 1) // bs] * bs + (p - 1) % bs
                        prev = shadow.get(prev_slot)
                    slot = seq.block_table[p // bs] * bs + p % bs
                    shadow[slot] = None if prev is None else (*prev, flat[offset + p - start])
                offset += n
            return inner(seqs, num_new_tokens, num_logits, input_token_ids, start_positions, device_inputs)

        runner.execute_model = execute_model

    def _wrap_allocate(self, bm: BlockManager) -> None:
        inner = bm.allocate
        bs = self.block_size

        def allocate(seq: Sequence, num_tokens: int, computed_blocks: Seq[int] = ()) -> None:
            for i, block_id in enumerate(computed_blocks):
                self.hit_blocks += 1
                self.hit_tokens += bs
                for name, shadow in self.slots.items():
                    for o in range(bs):
                        want = tuple(seq.token_ids[: i * bs + o + 1])
                        got = shadow.get(block_id * bs + o)
                        if got != want:
                            self.false_hits.append(
                                f"{name} block {block_id} (request {seq.request_id}, block {i}) offset {o}: "
                                f"holds {None if got is None else got[-bs:]}, wanted {want[-bs:]}"
                            )
                            break
            inner(seq, num_tokens, computed_blocks)

        bm.allocate = allocate


@pytest.fixture(scope="module")
def target() -> Path:
    return tiny_checkpoint("qwen3", tied=True)


def _prompts() -> list[list[int]]:
    """Prompts sharing prefixes: repeats, extensions and a shared head."""
    a = [72, 105, 33, 80, 81, 82, 83, 84, 85]
    b = [65, 66, 67, 68, 69, 70, 71]
    return [a, b, a, a, b, a + [90, 91], a, b, a, a[:5]]


def _params(temperature: float) -> list[SamplingParams]:
    """Seeds repeat every third request, so equal prompts share sampled outputs for a while and
    then diverge: blocks with equal heads and different tails."""
    return [
        SamplingParams(temperature=temperature, seed=i % 3, max_tokens=20 + i % 4 * 4, ignore_eos=True)
        for i in range(len(_prompts()))
    ]


def _spec_config(method: str, target: Path) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":
        return dict(method="ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=2)
    return {"model": str(target), "num_speculative_tokens": K}  # the target drafts itself: long accepts


def _llm(target: Path, method: str, *, prefix_caching: bool, num_blocks: int) -> LLM:
    per_block = BLOCK_BYTES * (2 if method == "draft" else 1)
    return LLM(
        target, device="cpu", block_size=BLOCK, kv_cache_memory=num_blocks * per_block,
        max_num_batched_tokens=16, enable_prefix_caching=prefix_caching,
        speculative_config=_spec_config(method, target),
    )  # fmt: skip


def _run_two_rounds(llm: LLM, temperature: float) -> list[list[int]]:
    out = []
    for _ in range(2):  # round two reuses round one's blocks through the cache
        got = llm.generate(_prompts(), _params(temperature), use_tqdm=False)
        out += [o.outputs[0].token_ids for o in got]
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.2, 0.7])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_every_hit_holds_the_requesters_tokens_and_outputs_match_cache_off(target, method, temperature):
    num_blocks = 20  # a few sequences' worth: preemption happens
    llm = _llm(target, method, prefix_caching=True, num_blocks=num_blocks)
    oracle = KVOracle(llm)
    got = _run_two_rounds(llm, temperature)
    assert oracle.false_hits == []
    assert oracle.hit_blocks >= 20  # the workload exercises the cache
    assert llm.llm_engine.num_preemptions > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks

    off = _llm(target, method, prefix_caching=False, num_blocks=num_blocks)
    assert got == _run_two_rounds(off, temperature)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_repeated_conversation_reuses_as_much_as_plain_decoding(target, method):
    """Turn two carries turn one's prompt and answer: speculation leaves as many of those tokens in
    the cache as plain decoding does, give or take the last incomplete block."""
    prompt = [72, 105, 33, 80, 81, 82, 83]
    params = SamplingParams(temperature=0, max_tokens=27, ignore_eos=True)
    reused = {}
    for m in ("none", method):
        llm = _llm(target, m, prefix_caching=True, num_blocks=64)
        oracle = KVOracle(llm)
        first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        second = llm.generate([prompt + first + [10, 11]], params, use_tqdm=False)[0]
        assert oracle.false_hits == []
        reused[m] = second.num_cached_tokens
    full = (len(prompt) + 27) // BLOCK * BLOCK
    assert reused["none"] == full
    assert reused[method] >= reused["none"] - BLOCK


def test_hashes_cover_committed_tokens_only(target):
    """After each step every hash a sequence stores describes full blocks of its own tokens whose
    K/V both models have written."""
    llm = _llm(target, "draft", prefix_caching=True, num_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=30, ignore_eos=True)
    for i, prompt in enumerate(_prompts()[:3]):
        engine.add_request(prompt, params, request_id=str(i))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            parent = b""
            for i, h in enumerate(seq.block_hashes):
                block = seq.token_ids[i * BLOCK : (i + 1) * BLOCK]
                assert len(block) == BLOCK
                assert h == hash_block(parent, block)
                parent = h
                checked += 1
            assert seq.num_hashed_blocks * BLOCK <= min(seq.num_kv_complete_tokens, seq.num_tokens)
    assert checked > 0


def test_draft_kv_guard_keeps_blocks_the_draft_has_not_written_out_of_the_cache(target):
    """When every draft is accepted the draft's K/V ends one token behind the target's. A request
    that finishes right then leaves a full block whose last draft slot was never written: it must
    not be offered to the cache, or a later request runs the draft over stale K/V."""
    llm = _llm(target, "draft", prefix_caching=True, num_blocks=64)
    oracle = KVOracle(llm)
    # Self-drafting accepts everything. Prompt 3, max_tokens 6: the prefill emits one token, one
    # round of 4 drafts + bonus ends with the target's K/V at 8 tokens (blocks 0-1 full) and the
    # draft's at 7. Prompt 4, max_tokens 5: 3 drafts + bonus, the same 8 and 7.
    prompts = [[72, 105, 33], [40, 41, 42, 43]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 5)]
    first = llm.generate(prompts, params, use_tqdm=False)
    seqs_done = [p + o.outputs[0].token_ids for p, o in zip(prompts, first)]
    assert [len(s) for s in seqs_done] == [9, 9]
    again = [s + [10] for s in seqs_done]
    second = llm.generate(again, params, use_tqdm=False)
    assert oracle.false_hits == []
    assert oracle.hit_blocks >= 2  # block 0 of each was cached; block 1 only once both models wrote it
    assert [o.num_cached_tokens for o in second] == [4, 4]


class _FixedProposer:
    """Proposes the same drafts every round (for a run of known target tokens)."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, batch):
        out = torch.full((len(batch.spec_index), K), -1, dtype=torch.long)  # [S, k] int64, -1 padded
        for b, n in enumerate(batch.max_drafts):
            out[b, :n] = torch.tensor(self.drafts[:n])
        return Proposal(out, list(batch.max_drafts))


def test_stop_inside_an_accepted_run_caches_committed_blocks_only(target):
    """A stop token inside an accepted draft run ends the request with the target's K/V written past
    its last token: only the blocks of committed tokens may be hashed."""
    prompt = [72, 105, 33]
    plain = _llm(target, "none", prefix_caching=False, num_blocks=64)
    g = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    g = g.outputs[0].token_ids
    i = next(i for i in range(1, 4) if g[i] not in g[:i])
    llm = _llm(target, "ngram", prefix_caching=True, num_blocks=64)
    oracle = KVOracle(llm)
    llm.llm_engine.speculator.proposer = _FixedProposer(g[1:5])
    # The prefill emits g[0]; one round accepts g[1..4] + bonus with the target's K/V at 8 tokens;
    # the stop at g[i] keeps 3 + i + 1 < 8 of them.
    sp = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[g[i]])
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (g[: i + 1], "stop")
    assert llm.last_spec_metrics.total.num_accepted_tokens == 4
    again = llm.generate([prompt + g[: i + 1] + [10, 11, 12]], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == BLOCK
    assert oracle.false_hits == []


def test_oracle_sees_a_false_hit(target):
    """The oracle itself can fail: a block whose hash is registered for other tokens is reported."""
    llm = _llm(target, "none", prefix_caching=True, num_blocks=64)
    oracle = KVOracle(llm)
    bm = llm.llm_engine.block_manager
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([[1, 2, 3, 4, 5, 6]], params, use_tqdm=False)
    # Register the first block's hash under the tokens of another prompt.
    other = [9, 9, 9, 9, 5, 6]
    h = next(iter(bm.cached_block_ids))
    bm.cached_block_ids[hash_block(b"", other[:4])] = bm.cached_block_ids[h]
    llm.generate([other], params, use_tqdm=False)
    assert oracle.false_hits and "target" in oracle.false_hits[0]
