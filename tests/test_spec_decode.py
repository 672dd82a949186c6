"""Speculative decoding in the engine, end to end on tiny random-weight checkpoints (fp32, CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import END_THINK_ID, THINK_ID, build_tokenizer, hf_logits, noisy_copy, tiny_checkpoint
from scipy.stats import chisquare

from thinkspec import LLM, SamplingParams
from thinkspec.bench.synthetic import install_synthetic_acceptance
from thinkspec.spec_decode.draft_length import GROUPS, AdaptiveDraftLength, ForcedDraftLength
from thinkspec.spec_decode.proposer import Proposal

K = 4


@pytest.fixture(scope="module")
def target() -> Path:
    return tiny_checkpoint("qwen3", tied=True)


@pytest.fixture(scope="module")
def draft(target: Path, tmp_path_factory) -> Path:
    return noisy_copy(target, tmp_path_factory.mktemp("draft") / "noisy", 0.05)


def _assert_blocks_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---- lossless ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_target(target: Path, tmp_path_factory) -> Path:
    """The target with an EOS id the model actually emits, so EOS stops happen mid-run."""
    dst = tmp_path_factory.mktemp("eos") / "target"
    shutil.copytree(target, dst)
    cfg_path = dst / "generation_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token_id"] = [118]  # 'v': frequent in this model's greedy outputs
    cfg_path.write_text(json.dumps(cfg))
    return dst


def _mixed_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [
        [72, 105, 33, THINK_ID],
        [65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, THINK_ID],
        [97],
        [70, 71, THINK_ID, 10, 11, END_THINK_ID],
        [88, 89, 90, 91, 92, 93, 94, 95] * 5,
        [74, 105, 35, THINK_ID],
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[214]),
        SamplingParams(temperature=0, max_tokens=33),  # EOS (118) mid-output
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=["KKK"]),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40),
    ]
    return prompts, params


SPEC_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft": {"num_speculative_tokens": K},
    "draft_relaxed_ratio1_topk1": {
        "num_speculative_tokens": K,
        "reasoning_parser": "qwen3",
        "relaxed_thinking": True,
        "relax_ratio": 1.0,
        "relax_top_k": 1,
    },
}


# How a speculating engine picks each step's draft length: always k ("fixed", adaptive_k off), the
# adaptive chooser, or forced to vary per step and per phase group (0 = plain rows and steps), so that
# one verify batch mixes windows of different lengths.
POLICIES = ("fixed", "adaptive", "forced")


def _varying_k(step: int, counts: np.ndarray) -> np.ndarray:
    return np.array([(step + 2 * g) % (K + 1) for g in range(len(GROUPS))])


def _with_policy(cfg: dict, policy: str) -> dict:
    return {**cfg, "adaptive_k": policy != "fixed"}


def _apply_policy(llm: LLM, policy: str) -> None:
    """Install the forced chooser (the engine was built with adaptive_k for it)."""
    spec = llm.llm_engine.speculator
    if policy == "forced":
        spec.planner.draft_length = ForcedDraftLength(spec.k, _varying_k)
    assert isinstance(spec.planner.draft_length, {"fixed": type(None), "adaptive": AdaptiveDraftLength,
                                          "forced": ForcedDraftLength}[policy])  # fmt: skip


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_lossless_greedy_matches_plain_decoding(name, policy, eos_target, draft):
    prompts, params = _mixed_batch()
    kv = 9 * 2 * (2 * 2 * 16 * 2 * 32 * 4)  # 9 blocks of target + draft: forces preemption
    plain = LLM(eos_target, device="cpu", kv_cache_memory=kv // 2, max_num_batched_tokens=24)
    expected = plain.generate(prompts, params, use_tqdm=False)
    cfg = _with_policy(SPEC_CONFIGS[name], policy)
    if cfg.get("method") != "ngram":
        cfg["model"] = str(draft)
    else:
        kv //= 2  # no draft pool
    spec = LLM(
        eos_target, device="cpu", kv_cache_memory=kv, max_num_batched_tokens=24, speculative_config=cfg
    )
    _apply_policy(spec, policy)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    stops = [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in expected]
    assert stops[:4] == [("stop", 214), ("stop", None), ("length", None), ("stop", "KKK")]
    assert spec.llm_engine.num_preemptions > 0
    metrics = spec.last_spec_metrics
    assert metrics is not None and metrics.total.num_drafts > 0
    assert metrics.total.num_accepted_tokens > 0
    assert metrics.total.num_relaxed_accepted_tokens == 0
    assert all(o.metrics.spec_decode is not None for o in got if len(o.outputs[0].token_ids) > 1)
    hist = [metrics.phase(p).draft_length_histogram for p in ("thinking", "answer")]
    if policy == "forced":  # plain rows and every draft length up to K were chosen
        assert all(sum(h[k] for h in hist if k < len(h)) > 0 for k in range(min(K, 3) + 1))
        if name.startswith("draft_relaxed"):  # both phase groups present
            assert sum(hist[0]) > 0 and sum(hist[1]) > 0
    elif policy == "fixed":
        assert hist == [[], []]
    _assert_blocks_free(spec)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["draft", "draft_relaxed_ratio1_topk1"])
def test_lossless_greedy_with_the_first_draft_forward_run_ahead(name, policy, eos_target, draft):
    """async_scheduling: each step whose rows all drafted runs the next step's first draft forward
    before it commits; the next step takes those logits when it feeds the same rows the same tokens
    (and runs its own otherwise: rows that stop, join, draft nothing or are preempted). Greedy
    output stays plain decoding's."""
    prompts, params = _mixed_batch()
    kv = 9 * 2 * (2 * 2 * 16 * 2 * 32 * 4)  # 9 blocks of target + draft: forces preemption
    plain = LLM(eos_target, device="cpu", kv_cache_memory=kv // 2, max_num_batched_tokens=24)
    expected = plain.generate(prompts, params, use_tqdm=False)
    cfg = {**_with_policy(SPEC_CONFIGS[name], policy), "model": str(draft)}
    spec = LLM(
        eos_target, device="cpu", kv_cache_memory=kv, max_num_batched_tokens=24, speculative_config=cfg,
        async_scheduling=True,
    )  # fmt: skip
    _apply_policy(spec, policy)
    assert spec.llm_engine.speculator.run_ahead
    got = spec.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert spec.llm_engine.num_preemptions > 0
    proposer = spec.llm_engine.speculator.proposer
    assert proposer.num_used_ahead <= proposer.num_run_ahead
    # the adaptive chooser drafts for few steps on this pair (for every row in none of them); the
    # forced one drafts with the adaptive engine's machinery (plain steps in flight among them)
    assert policy == "adaptive" or proposer.num_used_ahead > 0
    if policy == "fixed":  # most steps after the first drafting one use the forward run ahead
        assert proposer.num_used_ahead >= spec.last_spec_metrics.total.num_drafts // 4
    _assert_blocks_free(spec)


def test_run_ahead_feeds_every_row_and_serves_the_rows_that_stay(target):
    """A self-draft accepts every draft, so each step after the prefill speculates for every row. The
    forward run ahead feeds every row of its step before the step's outcome is known, and the next
    step takes the logits of the rows it keeps: after a row stops on a token id (step 3) the other
    rows' logits serve; a row left with one token (no draft next step) is fed by that forward without
    logits, and the step where it drafts nothing (4) runs nothing ahead; a step whose every row may
    finish by length (the last, 9) runs nothing ahead either. Every forward run ahead is used."""
    plain = LLM(target, device="cpu")
    prompts = [[72, 105, 33], [70, 71, 72], [97, 98], [100, 101]]
    probe = plain.generate(
        [prompts[1]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    out = probe[0].outputs[0].token_ids
    i = next(j for j in range(8, 40) if out[j] not in out[:j])  # B stops there, mid-run
    params = [
        SamplingParams(temperature=0, max_tokens=1 + 3 * (K + 1), ignore_eos=True),  # by length, step 4
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop_token_ids=[out[i]]),
        SamplingParams(temperature=0, max_tokens=1 + 8 * (K + 1), ignore_eos=True),  # the last
        SamplingParams(temperature=0, max_tokens=2 + 2 * (K + 1), ignore_eos=True),  # one token left at 4
    ]
    # 16-token KV blocks: the last position the forward run ahead may feed (the bonus token's, when
    # every draft is accepted) is reserved with the step's (one slot past its window)
    llm = LLM(target, device="cpu", speculative_config={"model": str(target), "num_speculative_tokens": K},
              async_scheduling=True, block_size=16)  # fmt: skip
    engine = llm.llm_engine
    for n, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request({"prompt_token_ids": prompt}, sp, str(n))
    proposer = engine.speculator.proposer
    steps, finished, ran, used = 0, {}, [], []
    while engine.has_unfinished_requests():
        steps += 1
        counts = proposer.num_run_ahead, proposer.num_used_ahead
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = (steps, o.outputs[0].finish_reason, o.outputs[0].token_ids)
        ran.append(proposer.num_run_ahead - counts[0])
        used.append(proposer.num_used_ahead - counts[1])
    assert finished["0"][:2] == (4, "length") and finished["3"][:2] == (4, "length")
    assert finished["1"][:2] == (3, "stop") and finished["1"][2] == out[: i + 1]
    assert finished["2"][:2] == (9, "length") and steps == 9
    assert ran == [0, 1, 1, 0, 1, 1, 1, 1, 0]
    assert used == [0, 0, 1, 1, 0, 1, 1, 1, 1]


def test_run_ahead_needs_every_row_drafting_with_the_slot_past_its_window(target):
    """Speculator._ahead_proposer: a step runs the next forward 1 ahead only when every row drafted and
    holds KV slots up to the last position that forward may feed (num_tokens + drafts), and some row
    may outlive the step (the forward would otherwise serve nothing)."""
    from thinkspec.spec_decode.proposer import Proposal

    llm = LLM(target, device="cpu", speculative_config={"model": str(target), "num_speculative_tokens": K},
              async_scheduling=True, block_size=16)  # fmt: skip
    engine = llm.llm_engine
    prompts = ([72, 105, 33, 40, 41, 42, 43, 44, 45, 46, 47], [65, 66, 67])
    for rid, (prompt, n) in enumerate(zip(prompts, (40, 20))):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        engine.add_request({"prompt_token_ids": prompt}, sp, str(rid))
    engine.step()
    spec, seqs = engine.speculator, list(engine.scheduler.running)

    def proposer_for(num_drafts: list[int], blocks: list[int]):
        for s, n in zip(seqs, blocks):
            s.block_table = list(range(n))
        drafts = torch.zeros(len(seqs), K, dtype=torch.long)
        return spec._ahead_proposer(seqs, Proposal(drafts, num_drafts, None, draft_computed=[0, 0]))

    fits = [-(-(s.num_tokens + K + 1) // 16) for s in seqs]  # blocks holding num_tokens + K + 1 slots
    assert proposer_for([K, K], fits) is spec.proposer
    assert proposer_for([K, 0], fits) is None  # a row drafts nothing
    assert (seqs[0].num_tokens + K) % 16 == 0  # one block fewer holds exactly one slot too few
    assert proposer_for([K, K], [fits[0] - 1, fits[1]]) is None
    assert proposer_for([K - 1, K], [fits[0] - 1, fits[1]]) is spec.proposer  # one draft fewer: it fits
    for s, n in zip(seqs, fits):
        s.block_table = list(range(n))
    seqs[0].sampling_params.max_tokens = seqs[0].num_output_tokens + K + 1  # it ends at most here
    seqs[1].sampling_params.max_tokens = seqs[1].num_output_tokens + 2
    both_end = Proposal(torch.zeros(2, K), [K, 1], None, draft_computed=[0, 0])
    assert spec._ahead_proposer(seqs, both_end) is None
    seqs[1].sampling_params.max_tokens += 1  # now row 1 may outlive the step
    assert spec._ahead_proposer(seqs, both_end) is spec.proposer


def test_run_ahead_forward_serves_only_what_forward_1_would_feed(target):
    """ForwardAhead.serves: each sequence of forward 1 fed by the forward run ahead, ending at the same
    position and starting no later, with the same tokens and KV blocks; the rows of its logits that
    forward 1 wants come back (rows it fed that forward 1 leaves out are not used); anything else
    runs its own forward 1."""
    from thinkspec.spec_decode.draft_model import ForwardAhead

    llm = LLM(target, device="cpu", speculative_config={"model": str(target), "num_speculative_tokens": K})
    engine = llm.llm_engine
    for rid, prompt in (("r", [72, 105, 33, 40, 41]), ("s", [65, 66, 67])):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20), rid)
    engine.step()
    seq, twin = engine.scheduler.running
    bs = engine.speculator.proposer.runner.block_size

    def fed(s):  # its last two positions: (start, tokens, blocks)
        start = s.num_tokens - 2
        return start, list(s.token_ids[start:]), s.block_table[start // bs : (s.num_tokens - 1) // bs + 1]

    start, tokens, blocks = fed(seq)
    ahead = ForwardAhead([seq], [start], [tokens], [blocks], torch.zeros(1, 4))
    assert ahead.serves([seq], [2], [start], [1], bs) == [0]
    assert ahead.serves([seq], [1], [start + 1], [1], bs) == [0]  # it fed one committed token more
    assert ahead.serves([seq], [2], [start], [0], bs) == []  # fed, no logits wanted
    assert ahead.serves([seq], [3], [start - 1], [1], bs) is None  # forward 1 starts earlier
    assert ahead.serves([seq], [1], [start], [1], bs) is None  # another end
    assert ahead.serves([seq, twin], [2, 2], [start, start], [1, 1], bs) is None  # twin was not fed
    other = ForwardAhead([seq], [start], [[tokens[0], tokens[1] + 1]], [blocks], torch.zeros(1, 4))
    assert other.serves([seq], [2], [start], [1], bs) is None  # other tokens
    moved = ForwardAhead([seq], [start], [tokens], [[b + 1 for b in blocks]], torch.zeros(1, 4))
    assert moved.serves([seq], [2], [start], [1], bs) is None  # the positions live in other blocks now
    assert ahead.serves([twin], [2], [start], [1], bs) is None  # another sequence object
    t_start, t_tokens, t_blocks = fed(twin)
    logits = torch.zeros(2, 4)
    both = ForwardAhead([seq, twin], [start, t_start], [tokens, t_tokens], [blocks, t_blocks], logits)
    assert both.serves([twin], [2], [t_start], [1], bs) == [1]  # seq left out (it finished)
    assert both.serves([twin, seq], [2, 2], [t_start, start], [1, 1], bs) == [1, 0]


def test_self_draft_accepts_everything(target):
    llm = LLM(target, device="cpu", speculative_config={"model": str(target), "num_speculative_tokens": K})
    sp = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    llm.generate([[72, 105, 33], [65, 66]], sp, use_tqdm=False)
    m = llm.last_spec_metrics
    # 40 tokens after the prefill token: 8 rounds of k + 1, every draft accepted.
    assert m.total.num_draft_tokens == m.total.num_accepted_tokens == 2 * 8 * K
    assert m.mean_acceptance_length() == K + 1


# ---- sampling keeps the target's distribution ---------------------------------------------------


def _exact_second_token_distribution(
    path: Path, prompt: list[int], penalties: dict | None = None
) -> np.ndarray:
    """P(x2 | prompt) = sum_x1 P(x1) P(x2 | prompt, x1), with transformers' own model, float64;
    with penalties, each row penalised as SamplingParams specifies (repetition over prompt + output,
    presence / frequency over the output)."""
    import transformers

    pen = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, **(penalties or {})}
    rep = pen["repetition_penalty"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        l1 = model(ids).logits[0, -1].double()  # [V]
        vocab = l1.shape[0]
        batch = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        l2 = model(batch).logits[:, -1].double()  # [V, V]
    in_prompt = torch.zeros(vocab, dtype=torch.bool)
    in_prompt[prompt] = True
    l1 = torch.where(in_prompt, torch.where(l1 > 0, l1 / rep, l1 * rep), l1)
    seen = in_prompt[None, :] | torch.eye(vocab, dtype=torch.bool)  # row x1 has x1 in its output
    l2 = torch.where(seen, torch.where(l2 > 0, l2 / rep, l2 * rep), l2)
    l2 = l2 - (pen["presence_penalty"] + pen["frequency_penalty"]) * torch.eye(vocab, dtype=torch.float64)
    p1, p2 = l1.softmax(-1), l2.softmax(-1)
    return (p1[:, None] * p2).sum(0).numpy()


PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.8}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, penalties, policy",
    [
        ("draft", None, "fixed"),
        ("ngram", None, "fixed"),
        ("draft", PENALTIES, "fixed"),
        ("ngram", PENALTIES, "fixed"),
        ("draft", None, "forced"),  # k varying per step, plain steps included
    ],
)
def test_seeded_sampling_keeps_target_distribution(method, penalties, policy, target, draft):
    # Most tokens occur in the prompt, so the n-gram proposer finds a continuation for most x1.
    prompt = [72, 105, 33, *range(34, 250), 72, 105]
    expected = _exact_second_token_distribution(target, prompt, penalties)
    cfg = (
        {"model": str(draft), "num_speculative_tokens": K}
        if method == "draft"
        else {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    )
    cfg = _with_policy(cfg, policy)
    llm = LLM(target, device="cpu", max_num_seqs=256, max_num_batched_tokens=4096, speculative_config=cfg)
    _apply_policy(llm, policy)
    n = 3000
    params = [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i, **(penalties or {}))
        for i in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    second = np.array([o.outputs[0].token_ids[1] for o in outs])
    m = llm.last_spec_metrics
    assert m.total.num_draft_tokens > 0  # the second token went through verification
    assert m.total.num_accepted_tokens > 0
    observed = np.bincount(second, minlength=expected.shape[0]).astype(float)
    # Merge the rare tokens into one bin so every expected count is >= 5.
    common = expected * n >= 5
    obs = np.append(observed[common], observed[~common].sum())
    exp = np.append(expected[common], expected[~common].sum()) * n
    p_value = chisquare(obs, exp).pvalue
    assert p_value > 1e-3, p_value
    if policy != "fixed":
        # A seeded token depends on the window it was verified in (as it depends on k with a fixed
        # k): with k chosen per step, a rerun need not draw the same sample.
        return
    # Same seeds, same outputs: the run is reproducible request by request.
    again = llm.generate([prompt] * 8, params[:8], use_tqdm=False)
    assert _tokens(again) == _tokens(outs[:8])


# ---- relaxed acceptance -------------------------------------------------------------------------

RELAXED = {"relaxed_thinking": True, "relax_ratio": 0.1, "relax_top_k": 8}


def test_relaxation_raises_thinking_acceptance_and_keeps_answers_strict(target, draft):
    thinking = [[72 + i, 105, 33 + i, THINK_ID] for i in range(4)]
    answering = [[70 + i, 71, THINK_ID, 10, 11, END_THINK_ID, 10] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Answers end where the model would open a new think block (it may; the phase would follow).
    sp_answer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[THINK_ID])
    params = [sp] * len(thinking) + [sp_answer] * len(answering)
    base = {"model": str(draft), "num_speculative_tokens": K, "reasoning_parser": "qwen3"}
    strict = LLM(target, device="cpu", speculative_config=base)
    relaxed = LLM(target, device="cpu", speculative_config={**base, **RELAXED})
    strict_out = strict.generate(thinking + answering, params, use_tqdm=False)
    relaxed_out = relaxed.generate(thinking + answering, params, use_tqdm=False)
    s, r = strict.last_spec_metrics, relaxed.last_spec_metrics
    assert r.mean_acceptance_length("thinking") >= 1.3 * s.mean_acceptance_length("thinking")
    assert r.phase("thinking").num_relaxed_accepted_tokens > 0
    assert r.phase("answer").num_drafts > 0
    assert r.phase("answer").num_relaxed_accepted_tokens == 0
    # Prompts that closed the think block decode the answer strictly: identical to strict.
    assert _tokens(relaxed_out[len(thinking) :]) == _tokens(strict_out[len(thinking) :])
    assert _tokens(relaxed_out[: len(thinking)]) != _tokens(strict_out[: len(thinking)])


def test_answer_after_relaxed_thinking_equals_strict_continuation(target, draft):
    """With '</think>' played by a token the model emits, the answer that follows a relaxed
    thought is exactly what strict greedy decoding produces from that same thinking prefix."""
    end = 118  # 'v'
    end_text = build_tokenizer().convert_ids_to_tokens(end)
    cfg = {
        "model": str(draft),
        "num_speculative_tokens": K,
        "think_start_token": "<think>",
        "think_end_token": end_text,
        **RELAXED,
    }
    prompts = [[72 + i, 105, 33 + i, THINK_ID] for i in range(8)]
    max_tokens = 40
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    relaxed = LLM(target, device="cpu", speculative_config=cfg)
    outs = relaxed.generate(prompts, sp, use_tqdm=False)
    m = relaxed.last_spec_metrics
    assert m.phase("thinking").num_relaxed_accepted_tokens > 0
    assert m.phase("answer").num_drafts > 0 and m.phase("answer").num_relaxed_accepted_tokens == 0
    plain = LLM(target, device="cpu")
    checked = 0
    for prompt, out in zip(prompts, outs):
        ids = out.outputs[0].token_ids
        if end not in ids[:-1]:
            continue
        cut = ids.index(end) + 1
        cont = plain.generate(
            [prompt + ids[:cut]],
            SamplingParams(temperature=0, max_tokens=max_tokens - cut, ignore_eos=True),
            use_tqdm=False,
        )[0]
        assert cont.outputs[0].token_ids == ids[cut:]
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("mode", ["seeded_sampling", "relaxed_greedy"])
def test_first_draft_forward_run_ahead_changes_no_token(mode, target, draft):
    """The forward run ahead feeds what the step's own forward 1 would (same tokens, positions, K/V),
    so seeded sampling (draft noise keyed by position) and relaxed acceptance emit the same tokens
    with async_scheduling on and off."""
    cfg = {"model": str(draft), "num_speculative_tokens": K}
    prompts = [[72 + i, 105, 33 + i, THINK_ID] for i in range(5)]
    if mode == "seeded_sampling":
        params = [
            SamplingParams(temperature=1.0, top_k=20, max_tokens=30, ignore_eos=True, seed=i)
            for i in range(5)
        ]
    else:
        cfg.update(reasoning_parser="qwen3", **RELAXED)
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 5
    outs = {}
    for ahead in (False, True):
        llm = LLM(target, device="cpu", speculative_config=cfg, async_scheduling=ahead)
        outs[ahead] = _tokens(llm.generate(prompts, params, use_tqdm=False))
        proposer = llm.llm_engine.speculator.proposer
        assert (proposer.num_used_ahead > 0) == ahead
    assert outs[True] == outs[False]


def _relaxed_llm(target: Path, draft: Path, policy: str) -> LLM:
    cfg = {"model": str(draft), "num_speculative_tokens": K, "reasoning_parser": "qwen3", **RELAXED}
    llm = LLM(target, device="cpu", speculative_config=_with_policy(cfg, policy))
    _apply_policy(llm, policy)
    return llm


def test_adaptive_relaxed_with_k_forced_to_K_equals_fixed_k(target, draft):
    """The adaptive machinery (groups, narrowed windows, every graph width) leaves relaxed
    acceptance as it is: forced to draft K every step, it is the fixed-k run token for token."""
    prompts = [[72 + i, 105, 33 + i, THINK_ID] for i in range(4)] + [[70, 71, THINK_ID, 10, END_THINK_ID, 10]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fixed = _relaxed_llm(target, draft, "fixed")
    forced = _relaxed_llm(target, draft, "adaptive")
    forced.llm_engine.speculator.planner.draft_length = ForcedDraftLength.fixed(K, K)
    want = fixed.generate(prompts, sp, use_tqdm=False)
    got = forced.generate(prompts, sp, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    f, a = fixed.last_spec_metrics, forced.last_spec_metrics
    assert a.total.num_relaxed_accepted_tokens == f.total.num_relaxed_accepted_tokens > 0
    assert a.phase("thinking").num_accepted_tokens_per_pos == f.phase("thinking").num_accepted_tokens_per_pos
    assert a.phase("thinking").draft_length_histogram[K] > 0


def test_relaxed_with_varying_k_follows_the_acceptance_rule(target, draft):
    """With k varying per step and group, every emitted token is one the acceptance contract allows
    at its prefix: the target's argmax g, or (thinking before it, not a marker) the draft's greedy
    token d passing the relaxed test exp(l[d] - l[g]) >= ratio and rank(d) < top_k. Answer tokens
    are all g."""
    prompts = [[72 + i, 105, 33 + i, THINK_ID] for i in range(4)] + [[70, 71, THINK_ID, 10, END_THINK_ID, 10]]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = _relaxed_llm(target, draft, "forced")
    outs = llm.generate(prompts, sp, use_tqdm=False)
    relaxed_tokens = 0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out.outputs[0].token_ids
        lt, ld = hf_logits(target, ids), hf_logits(draft, ids)
        thinking = prompt[-1] == THINK_ID
        for p in range(len(prompt), len(ids)):
            t, row = ids[p], lt[p - 1]
            g = int(row.argmax())
            if t != g:
                rank = int((row > row[t]).sum())
                assert thinking and t not in (THINK_ID, END_THINK_ID), (p, t, g)
                assert t == int(ld[p - 1].argmax()) and rank < RELAXED["relax_top_k"], (p, t, g)
                assert float(torch.exp(row[t] - row[g])) >= RELAXED["relax_ratio"]
                relaxed_tokens += 1
            thinking = thinking if t not in (THINK_ID, END_THINK_ID) else t == THINK_ID
    m = llm.last_spec_metrics
    assert relaxed_tokens > 0 and m.total.num_relaxed_accepted_tokens == relaxed_tokens
    assert m.phase("answer").num_relaxed_accepted_tokens == 0
    assert m.phase("thinking").draft_length_histogram[0] > 0  # plain steps rode along


class _ScriptedProposer:
    """Proposes fixed drafts for the first round, then copies of the last token (valid ids)."""

    def __init__(self, first: list[int], k: int) -> None:
        self.first, self.k, self.rounds = first, k, 0

    def propose(self, batch):
        drafts = torch.full((len(batch.spec_index), self.k), -1, dtype=torch.long)
        for b, i in enumerate(batch.spec_index):
            row = self.first if self.rounds == 0 else [batch.seqs[i].last_token_id] * self.k
            drafts[b, : batch.max_drafts[b]] = torch.tensor(row[: batch.max_drafts[b]])
        self.rounds += bool(batch.spec_index)
        return Proposal(drafts, list(batch.max_drafts))


def test_think_end_drafted_mid_window_makes_later_positions_strict(target):
    """End to end: after the prefill token, one verify window [a, e, y, y] where a e are the target's
    greedy tokens and y is its second choice after them. With e as the think-end marker, y is
    verified strictly and rejected; with a marker outside the window, y passes the relaxed test
    (ratio 0, top-k 2) and is accepted."""
    base_prompt = [72, 105, 33, THINK_ID]
    plain = LLM(target, device="cpu")
    g = plain.generate([base_prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    g = g.outputs[0].token_ids
    # e = g[j]: a printable ASCII token (a one-token marker text) not seen before it.
    j = next(j for j in range(2, len(g) - 1) if 33 <= g[j] <= 126 and g[j] not in base_prompt + g[:j])
    prompt = base_prompt + g[: j - 2]  # the prefill step then emits g[j-2]; the window is g[j-1], g[j], ...
    y = int(hf_logits(target, base_prompt + g[: j + 1])[-1].topk(2).indices[1])  # 2nd choice after e
    assert y != g[j + 1]
    tok = build_tokenizer()
    outside = next(t for t in range(33, 127) if t not in prompt + g[: j + 2] + [y])
    results = {}
    for marker in (g[j], outside):
        cfg = {
            "method": "ngram",
            "num_speculative_tokens": K,
            "think_start_token": "<think>",
            "think_end_token": tok.convert_ids_to_tokens(marker),
            "relaxed_thinking": True,
            "relax_ratio": 0.0,
            "relax_top_k": 2,
        }
        llm = LLM(target, device="cpu", speculative_config=cfg)
        llm.llm_engine.speculator.proposer = _ScriptedProposer([g[j - 1], g[j], y, y], K)
        # max_tokens = 5: the prefill token, then one verify round of 3 drafts (+ bonus/correction).
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
        results[marker] = (out.outputs[0].token_ids, llm.last_spec_metrics)
    ids_marker, m_marker = results[g[j]]
    ids_control, m_control = results[outside]
    assert m_marker.total.num_drafts == m_control.total.num_drafts == 1
    assert m_marker.total.num_accepted_tokens_per_pos[:3] == [1, 1, 0]  # strict after the marker
    assert ids_marker[:4] == g[j - 2 : j + 2]  # y rejected: the target's own token emitted instead
    assert m_control.total.num_accepted_tokens_per_pos[:3] == [1, 1, 1]  # relaxed test accepted y
    assert ids_control[:4] == [*g[j - 2 : j + 1], y]
    assert m_control.phase("thinking").num_relaxed_accepted_tokens >= 1
    assert m_marker.total.num_relaxed_accepted_tokens == 0


def _relaxable_second_choice(target: Path, prompt: list[int]) -> tuple[list[int], int, int]:
    """(greedy continuation g, j, y): the window after prompt + g[:j] has g[j+1] then y, the target's
    second choice after g[: j + 2], a byte token that greedy decoding does not emit early."""
    plain = LLM(target, device="cpu")
    g = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    g = g.outputs[0].token_ids
    assert END_THINK_ID not in g[:8]  # the window stays in the thinking phase
    for j in range(4):
        y = int(hf_logits(target, prompt + g[: j + 2])[-1].topk(2).indices[1])
        if y < 256 and y not in prompt + g[: j + 6]:
            return g, j, y
    raise AssertionError("no byte-token second choice in the first windows")


def _relaxed_window(target: Path, prompt: list[int], g: list[int], j: int, y: int, params: SamplingParams):
    """Output tokens and metrics of one verify round whose drafts are [g[j+1], y, y, y], relaxed at
    ratio 0 / top-k 2 (so y passes the relaxed test unless it is protected)."""
    cfg = {
        "method": "ngram", "num_speculative_tokens": K, "reasoning_parser": "qwen3",
        "relaxed_thinking": True, "relax_ratio": 0.0, "relax_top_k": 2,
    }  # fmt: skip
    llm = LLM(target, device="cpu", speculative_config=cfg)
    llm.llm_engine.speculator.proposer = _ScriptedProposer([g[j + 1], y, y, y], K)
    # The prefill emits g[j]; one verify round of 4 drafts follows.
    out = llm.generate([prompt + g[:j]], params, use_tqdm=False)[0]
    return out.outputs[0], llm.last_spec_metrics


PROTECT_PROMPT = [72, 105, 33, THINK_ID]


def test_request_stop_token_is_never_relaxed(target):
    g, j, y = _relaxable_second_choice(target, PROTECT_PROMPT)
    sp = SamplingParams(temperature=0, max_tokens=6)
    control, m_control = _relaxed_window(target, PROTECT_PROMPT, g, j, y, sp)
    assert control.token_ids[:3] == [g[j], g[j + 1], y]  # y is relaxable here
    assert m_control.total.num_relaxed_accepted_tokens >= 1
    sp = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[y])
    out, m = _relaxed_window(target, PROTECT_PROMPT, g, j, y, sp)
    assert out.token_ids[:3] == g[j : j + 3]  # the target's own token instead of the stop token
    assert out.finish_reason == "length"
    assert m.total.num_relaxed_accepted_tokens == 0


def test_generation_config_eos_is_never_relaxed(target, tmp_path):
    g, j, y = _relaxable_second_choice(target, PROTECT_PROMPT)
    eos_y = tmp_path / "eos_y"
    shutil.copytree(target, eos_y)
    cfg_path = eos_y / "generation_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "eos_token_id": [y]}))
    out, m = _relaxed_window(eos_y, PROTECT_PROMPT, g, j, y, SamplingParams(temperature=0, max_tokens=6))
    assert out.token_ids[:3] == g[j : j + 3]
    assert out.finish_reason == "length"
    assert m.total.num_relaxed_accepted_tokens == 0


# ---- configuration ------------------------------------------------------------------------------


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    from checkpoints import make_tiny_checkpoint

    wide = make_tiny_checkpoint(tmp_path / "wide", "qwen3", tied=True, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 300"):
        LLM(target, device="cpu", speculative_config={"model": str(wide), "num_speculative_tokens": 2})
    other_tok = tmp_path / "other_tok"
    shutil.copytree(target, other_tok)
    cfg_path = other_tok / "tokenizer.json"
    data = json.loads(cfg_path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|im_end|>"]
    cfg_path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="draft"):
        LLM(target, device="cpu", speculative_config={"model": str(other_tok), "num_speculative_tokens": 2})


def test_per_request_relaxation_overrides(target, draft):
    prompts = [[72 + i, 105, 33 + i, THINK_ID] for i in range(4)]
    cfg = {"model": str(draft), "num_speculative_tokens": K, "reasoning_parser": "qwen3"}
    llm = LLM(target, device="cpu", speculative_config=cfg)  # relaxation off by default
    strict = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    relaxed = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, relaxed_thinking=True, relax_ratio=0.1, relax_top_k=8
    )
    outs = llm.generate(prompts, [strict, relaxed, strict, relaxed], use_tqdm=False)
    relaxed_counts = [o.metrics.spec_decode.total.num_relaxed_accepted_tokens for o in outs]
    assert relaxed_counts[0] == relaxed_counts[2] == 0
    assert relaxed_counts[1] > 0 and relaxed_counts[3] > 0
    assert llm.last_spec_metrics.total.num_relaxed_accepted_tokens == sum(relaxed_counts)

    no_parser = LLM(
        target, device="cpu", speculative_config={"model": str(draft), "num_speculative_tokens": K}
    )
    outs = no_parser.generate([prompts[0], prompts[1]], [relaxed, strict], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "relaxed_thinking" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 30


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_synthetic_acceptance_rate(target, draft, rate):
    """The engine's own acceptance, steered by the synthetic draws (bench/synthetic.py), accepts every
    draft at rate 1 and none at 0."""
    llm = LLM(target, device="cpu", speculative_config={"model": str(draft), "num_speculative_tokens": K})
    steer = install_synthetic_acceptance(llm, rate=1.0 - rate)
    assert install_synthetic_acceptance(llm, rate=rate) is steer  # settings replaced, never steered twice
    llm.generate(
        [[72, 105, 33]] * 3, SamplingParams(temperature=0, max_tokens=41, ignore_eos=True), use_tqdm=False
    )
    m = llm.last_spec_metrics.total
    assert m.num_drafts > 0
    assert m.num_accepted_tokens == (m.num_draft_tokens if rate == 1.0 else 0)
    assert llm.last_spec_metrics.mean_acceptance_length() == (K + 1 if rate == 1.0 else 1.0)


def test_synthetic_steering_edits_only_the_draft_rows_of_verify_windows():
    """A window row whose draft passes makes it the row's unique argmax; one that fails puts it below the
    row's max; plain rows, bonus rows and forwards given start positions (not the speculator's verify
    forward) are left alone; drafts held on the device are read from device_inputs."""
    from types import SimpleNamespace

    from thinkspec.bench.synthetic import STEER, SyntheticAcceptance

    base = torch.randn(6, 11)
    base[1, 3] = base[1].max() + 1.0  # the failing draft is its row's argmax before the steering
    # a plain decode row (1 logits row), then a window of 3 drafts [last, 3, 5, 7] (4 rows), then a
    # prefill chunk of 4 tokens wanting its last row only
    seqs = [SimpleNamespace(num_computed_tokens=9, num_tokens=10, num_output_tokens=2),
            SimpleNamespace(num_computed_tokens=19, num_tokens=20, num_output_tokens=4),
            SimpleNamespace(num_computed_tokens=0, num_tokens=4, num_output_tokens=0)]  # fmt: skip
    num_new, num_logits = [1, 4, 4], [1, 4, 1]

    def run(passes, device_inputs=None, start_positions=None, inputs=(9, 3, 5, 7)):
        steer = SyntheticAcceptance(lambda *a, **kw: base.clone(), seed=0)
        steer.configure(0.5, None)
        steer.verdicts = lambda window_seqs, width: np.array([passes])  # [S=1, width]
        ids = [[1], list(inputs), [1, 2, 3, 4]]
        return steer(seqs, num_new, num_logits, ids, start_positions, device_inputs)

    out = run([False, True, True])  # logits rows 1, 2, 3 score drafts 3, 5, 7; row 4 the bonus
    assert out.shape == base.shape
    changed = (out != base).nonzero().tolist()
    assert changed == [[1, 3], [2, 5], [3, 7]]
    assert out[1].argmax() != 3 and out[1, 3] == base[1].max() - STEER
    assert out[2].argmax() == 5 and out[2, 5] == base[2].max() + STEER
    assert out[3].argmax() == 7 and (out[3] == out[3].max()).sum() == 1
    assert torch.equal(run([True] * 3, start_positions=[9, 19, 0]), base)  # no verify forward
    on_device = (torch.tensor([2, 3, 4]), torch.tensor([3, 5, 7]))  # packed inputs 2..4 hold the drafts
    assert torch.equal(run([False, True, True], on_device, inputs=(9, 0, 0, 0)), out)


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_synthetic_acceptance_steers_host_drafts_too(target, rate):
    """n-gram drafts reach the target as host inputs (no device_inputs): the steering finds them there.
    A repeating prompt gives the n-gram proposer drafts to make."""
    cfg = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(target, device="cpu", speculative_config=cfg)
    install_synthetic_acceptance(llm, rate=rate)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], sp, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 30
    m = llm.last_spec_metrics.total
    assert m.num_draft_tokens > 0
    assert m.num_accepted_tokens == (m.num_draft_tokens if rate == 1.0 else 0)


# ---- GPU ----------------------------------------------------------------------------------------


def _first_near_tie(path: Path, prompt: list[int], output: list[int], margin: float) -> int:
    """Index of the first output position whose top-2 logit gap (HF, bf16, CUDA) is below margin."""
    logits = hf_logits(path, prompt + output, dtype=torch.bfloat16, device="cuda")[len(prompt) - 1 : -1]
    top2 = logits.float().topk(2, dim=-1).values
    close = ((top2[:, 0] - top2[:, 1]) < margin).nonzero()
    return int(close[0]) if len(close) else len(output)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["draft", "ngram", "draft_run_ahead"])
def test_lossless_greedy_on_cuda(dtype, method, target, draft):
    """draft_run_ahead: async_scheduling's CUDA default, each step's first draft forward for the next
    step runs from the CUDA graphs before the step commits (its logits copied out of the graph's
    buffer); draft: async_scheduling=False, every step runs its own."""
    prompts, _ = _mixed_batch()
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, device="cuda", dtype=dtype, gpu_memory_utilization=0.3)
    expected = _tokens(plain.generate(prompts, sp, use_tqdm=False))
    cfg = dict(SPEC_CONFIGS[method if method == "ngram" else "draft"])
    if method != "ngram":
        cfg["model"] = str(draft)
    spec = LLM(
        target, device="cuda", dtype=dtype, gpu_memory_utilization=0.3, speculative_config=cfg,
        async_scheduling=None if method == "draft_run_ahead" else False,
    )  # fmt: skip
    got = _tokens(spec.generate(prompts, sp, use_tqdm=False))
    assert spec.last_spec_metrics.total.num_accepted_tokens > 0
    if method != "ngram":
        assert spec.llm_engine.speculator.run_ahead == (method == "draft_run_ahead")
    if method == "draft_run_ahead":
        assert spec.llm_engine.speculator.proposer.num_used_ahead > 0
    if dtype == "float32":
        assert got == expected
        return
    compared = 0
    for prompt, g, e in zip(prompts, got, expected):
        n = _first_near_tie(target, prompt, e, margin=0.1)
        assert g[:n] == e[:n]
        compared += n
    assert compared >= 20  # bf16 logits of a tiny random model tie often; the rest is not decided


def test_synthetic_acceptance_profile_per_phase(target, draft):
    """Thinking rows (the first 13 output tokens) accept every draft, answer rows none."""
    profile = {"thinking": [1.0] * K, "answer": [0.0] * K, "thinking_tokens": 13}
    llm = LLM(target, device="cpu", speculative_config={"model": str(draft), "num_speculative_tokens": K})
    install_synthetic_acceptance(llm, profile=profile)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = llm.generate([[72, 105, 33]], sp, use_tqdm=False)
    m = llm.last_spec_metrics.total
    # Prefill token, then rounds of 5 tokens while output < 13: at 1, 6, 11 -> 16 tokens; then one per
    # round, the last of which has no room for a draft.
    assert m.num_drafts == 3 + (30 - 16 - 1)
    assert m.num_accepted_tokens == 3 * K
    assert len(out[0].outputs[0].token_ids) == 30
    by_phase = llm.last_spec_metrics  # the profile's phases, as the metrics counted them
    assert by_phase.thinking.num_drafts == 3 and by_phase.answer.num_drafts == 30 - 16 - 1
    with pytest.raises(ValueError, match="non-increasing"):
        install_synthetic_acceptance(llm, profile={**profile, "answer": [0, 1, 0, 0]})
    for seed in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"profile\['seed'\] must be a non-negative integer"):
            install_synthetic_acceptance(llm, profile={**profile, "seed": seed})
    with pytest.raises(ValueError, match="seed optional"):
        install_synthetic_acceptance(llm, profile={**profile, "x": 1})
    with pytest.raises(ValueError, match=r"install_synthetic_acceptance\.rate must be a float in \[0, 1\]"):
        install_synthetic_acceptance(llm, rate=1.5)
    with pytest.raises(ValueError, match="profile excludes rate"):
        install_synthetic_acceptance(llm, rate=0.5, profile=profile)
    with pytest.raises(ValueError, match="rate needs a speculative method"):
        install_synthetic_acceptance(LLM(target, device="cpu"), rate=0.5)


def test_seeded_synthetic_draws_depend_on_request_and_output_position_only():
    from thinkspec.bench.synthetic import synthetic_uniforms

    keys = np.array([3, 3, 99], dtype=np.uint64)
    u = synthetic_uniforms(keys, np.array([5, 5, 5], dtype=np.uint64), 4, seed=7)  # [3, 4]
    shifted = synthetic_uniforms(keys, np.array([6, 6, 6], dtype=np.uint64), 3, seed=7)
    assert u.shape == (3, 4) and np.array_equal(u[:, 1:], shifted)  # a draw is its output position's
    assert np.array_equal(u[0], u[1]) and not np.array_equal(u[0], u[2])  # and its request's
    assert not np.array_equal(u, synthetic_uniforms(keys, np.full(3, 5, dtype=np.uint64), 4, seed=8))
    many = synthetic_uniforms(np.arange(200, dtype=np.uint64), np.zeros(200, dtype=np.uint64), 50, seed=1)
    assert many.min() >= 0 and many.max() < 1
    counts = np.histogram(many, bins=10, range=(0, 1))[0]  # 10,000 draws, 1,000 expected per bin
    assert abs(many.mean() - 0.5) < 0.01 and counts.min() > 880 and counts.max() < 1120


def _seeded_verdicts(target, draft, k: int, rate: float, seed: int, monkeypatch) -> tuple[dict, float]:
    """Run 4 prompts with a seeded constant-rate profile drafting k: ({(prompt, output position):
    accepted} for every draft the runs tried, share of first drafts accepted), as the engine's own
    acceptance decided them (each step's outcomes)."""
    from thinkspec.engine import speculator as spec_mod

    profile = {"thinking": [rate ** (i + 1) for i in range(k)], "answer": [0.0] * k, "thinking_tokens": 1000,
               "seed": seed}  # fmt: skip
    llm = LLM(target, device="cpu", speculative_config={"model": str(draft), "num_speculative_tokens": k})
    install_synthetic_acceptance(llm, profile=profile)
    verdicts: dict = {}
    firsts = []
    original = spec_mod.Speculator._outcomes

    def spy(self, sched, sample_mask, batch, proposal, host):
        seqs = [sched.seqs[i] for i in batch.spec_index]
        for s, n, a in zip(seqs, batch.num_drafts, host.num_accepted.tolist()):
            prompt = tuple(s.prompt_token_ids)
            for j in range(min(a + 1, n)):  # tried: every accepted draft and the first rejected
                verdicts[(prompt, s.num_output_tokens + j)] = j < a
            if n > 0:
                firsts.append(a > 0)
        return original(self, sched, sample_mask, batch, proposal, host)

    monkeypatch.setattr(spec_mod.Speculator, "_outcomes", spy)
    prompts = [[72, 105, 33], [5, 6, 7, 8], [40, 41], [9, 90, 19, 91, 29]]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    return verdicts, float(np.mean(firsts))


def test_seeded_synthetic_acceptance_is_common_to_every_draft_length(target, draft, monkeypatch):
    """With a seed, a token of a request is accepted or not whatever window drafts it (common random
    numbers for the settings a benchmark compares), and the per-position rate stays the profile's."""
    v2, first2 = _seeded_verdicts(target, draft, 2, 0.6, seed=11, monkeypatch=monkeypatch)
    v4, first4 = _seeded_verdicts(target, draft, 4, 0.6, seed=11, monkeypatch=monkeypatch)
    common = v2.keys() & v4.keys()
    assert len(common) > 50 and all(v2[p] == v4[p] for p in common)
    for prompt in {p for p, _ in v4}:  # every request meets easy and hard tokens
        assert {v for (q, _), v in v4.items() if q == prompt} == {True, False}
    for first in (first2, first4):  # ~150 first drafts each: 0.6 within about 3 standard deviations
        assert 0.47 < first < 0.73
    v4b, _ = _seeded_verdicts(target, draft, 4, 0.6, seed=12, monkeypatch=monkeypatch)
    common = v4.keys() & v4b.keys()
    assert sum(v4[p] != v4b[p] for p in common) > 10  # another seed, other hard tokens


def test_verify_windows_are_a_view_when_they_cover_the_logits_in_order():
    from thinkspec.engine.verify_batch import windows_of as _windows_of

    logits = torch.randn(13, 7)
    full = np.arange(12).reshape(3, 4)  # every sequence speculating with the full window
    view = _windows_of(logits, full)
    assert view.shape == (3, 4, 7) and view.data_ptr() == logits.data_ptr()  # no copy
    assert torch.equal(view, logits[:12].view(3, 4, 7))
    padded = np.array([[0, 1, 2, 3], [4, 5, 4, 4], [6, 7, 8, 9]])  # a shorter window, padded
    gathered = _windows_of(logits, padded)
    assert gathered.data_ptr() != logits.data_ptr()
    assert torch.equal(gathered, logits[torch.from_numpy(padded)])
    shifted = np.arange(1, 13).reshape(3, 4)  # a plain row first: the windows start at row 1
    assert torch.equal(_windows_of(logits, shifted), logits[1:13].view(3, 4, 7))
