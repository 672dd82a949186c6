from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from thinkspec.toy.analyze import (
    Relax,
    TokenIds,
    fork_agreement,
    format_table,
    speculative_generate,
    teacher_forced_acceptance,
)
from thinkspec.toy.task import TRAIN_MIXES, chat_prompt, generate_mixed_samples, generate_samples
from thinkspec.toy.tokenizer import build_task_tokenizer, save_tokenizer
from thinkspec.toy.train import IGNORE, ModelSize, TrainConfig, build_pool, lr_at, make_config, pack, run

TINY = ModelSize(hidden_size=64, num_layers=1, num_heads=2, head_dim=32, intermediate_size=128)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(build_task_tokenizer(n_samples=800, seed=3), d)
    return d


@pytest.fixture(scope="module")
def trained(tok_dir, tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("tiny") / "target"
    cfg = TrainConfig(steps=40, batch_size=8, seq_len=512, lr=3e-3, warmup_steps=5, samples=300, log_every=5)
    meta = run("target", out, TINY, cfg, tokenizer_path=str(tok_dir), device="cpu")
    return out, meta


def test_smoke_training_loss_falls_and_checkpoint_loads(trained):
    out, meta = trained
    losses = [v for _, v in meta["losses"]]
    assert meta["steps"] == 40 and len(losses) >= 5
    assert losses[-1] < 0.75 * losses[0]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.config.tie_word_embeddings and model.config.vocab_size % 64 == 0
    assert model.config.vocab_size >= len(tok)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    gen = json.loads((out / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id}
    ids = tok(chat_prompt("Mia has 12 apples. How many apples does Mia have now?"), return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits
    assert torch.isfinite(logits).all()
    assert json.loads((out / "train_meta.json").read_text())["params"] == meta["params"]


def test_pack_keeps_samples_whole_and_masks_prompts(tok_dir):
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    pool = build_pool(tok, 40, seed=1)
    x, y = pack(pool, 512, pad_id=tok.pad_token_id, seed=0)
    assert x.shape == y.shape and x.shape[1] == 512 and x.dtype == torch.int64
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert (x[:, 0] == im_start).all()
    assert int((y != IGNORE).sum()) == sum(len(ids) - n for ids, n in pool)
    flat = [r.tolist() for r in x]
    for ids, n in pool:
        ids = ids.tolist()
        hits = [(r, i) for r, row in enumerate(flat) for i in range(512 - len(ids) + 1)
                if row[i] == ids[0] and row[i:i + len(ids)] == ids]
        assert hits
        r, i = hits[0]
        assert (y[r, i:i + n] == IGNORE).all() and y[r, i + n:i + len(ids)].tolist() == ids[n:]
    s = generate_samples(1, seed=1_000_003)[0]
    assert pool[0][0].tolist() == tok(s.text, add_special_tokens=False)["input_ids"]


def test_range_mix_pool_and_positions(tok_dir):
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    pool = build_pool(tok, 30, seed=2, mix="range")
    first = generate_mixed_samples(1, seed=2 * 1_000_003, mix=TRAIN_MIXES["range"])[0]
    assert pool[0][0].tolist() == tok(first.text, add_special_tokens=False)["input_ids"]
    assert max(len(ids) for ids, _ in pool) > 512  # long problems are in the mix
    x, y = pack(pool, 2048, pad_id=tok.pad_token_id, seed=0)
    assert int((y != IGNORE).sum()) == sum(len(ids) - n for ids, n in pool)  # nothing dropped
    assert make_config(TINY, tok, 2048).max_position_embeddings == 2048
    with pytest.raises(ValueError, match="mix must be one of"):
        TrainConfig(mix="medium")
    with pytest.raises(ValueError, match=r"max_positions must be in \[seq_len=2048"):
        TrainConfig(seq_len=2048, max_positions=1024)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(1e-4)
    assert lr_at(9, 100, cfg) == pytest.approx(1e-3)
    assert lr_at(99, 100, cfg) == pytest.approx(1e-4, rel=0.01)
    mids = [lr_at(s, 100, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(mids, mids[1:]))


def test_bad_config_raises(tok_dir):
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSize(hidden_size=0, num_layers=1, num_heads=1, head_dim=8, intermediate_size=8)
    with pytest.raises(ValueError, match=r"lr must be in \(0, 1\]"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="seq_len"):
        TrainConfig(seq_len=4)
    with pytest.raises(ValueError, match="ratio"):
        Relax(ratio=1.5, top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        Relax(ratio=0.5, top_k=0)
    cfg = make_config(TINY, PreTrainedTokenizerFast.from_pretrained(tok_dir))
    assert cfg.vocab_size % 64 == 0 and cfg.eos_token_id == 2 and cfg.pad_token_id == 0


# --- the analysis simulator, on a random target and a perturbed copy as its draft ---


@pytest.fixture(scope="module")
def pair(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = make_config(TINY, tok)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(cfg).eval()
    # The draft is the target with noise: it often agrees, and when not, its token ranks high.
    draft = Qwen3ForCausalLM(cfg).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().clamp_min(1e-3))
    # Prompts end inside a think block, so decoding starts in the thinking phase.
    prompts = [tok(chat_prompt(s.problem.question) + "<think>\n", add_special_tokens=False)["input_ids"]
               for s in generate_samples(3, seed=8)]
    return tok, target, draft, prompts, TokenIds.from_tokenizer(tok)


def test_greedy_matches_hf_generate(pair):
    tok, target, _, prompts, ids = pair
    outs, stats, pmax = speculative_generate(target, None, prompts, ids, max_new_tokens=20)
    for p, o in zip(prompts, outs):
        ref = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
        assert o == ref
    assert stats.rounds["thinking"] + stats.rounds["answer"] == sum(len(o) for o in outs)
    assert len(pmax) > 0 and all(0 < v <= 1 for v in pmax)


def test_strict_speculation_is_lossless_and_matches_teacher_forcing(pair):
    _, target, draft, prompts, ids = pair
    greedy, _, _ = speculative_generate(target, None, prompts, ids, max_new_tokens=24)
    spec, st, _ = speculative_generate(target, draft, prompts, ids, k=4, max_new_tokens=24)
    assert spec == greedy
    tf = teacher_forced_acceptance(draft, prompts, greedy, ids, k=4)
    assert tf.rounds == st.rounds and tf.emitted == st.emitted
    assert st.relaxed_only == 0
    assert 1 < st.mean_acceptance_length("thinking") < 5  # the draft is neither perfect nor useless
    # The target drafting for itself accepts every proposal: rounds of k+1 tokens.
    self_tf = teacher_forced_acceptance(target, prompts, greedy, ids, k=4)
    assert sum(self_tf.rounds.values()) == sum(math.ceil(len(o) / 5) for o in greedy)


def _off_greedy_tokens(target, prompts, outs, ids):
    """(token, phase before it) for every output token that is not the target's greedy choice on its
    prefix, found by teacher forcing: in greedy speculation only a relaxed acceptance emits one."""
    found = []
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = target(torch.tensor([p + o])).logits[0]  # [len(p) + len(o), V]
        greedy = logits[len(p) - 1 : len(p) + len(o) - 1].argmax(-1).tolist()
        marks = [t for t in p if t in (ids.think_start, ids.think_end)]
        thinking = bool(marks) and marks[-1] == ids.think_start
        for t, g in zip(o, greedy):
            if t != g:
                found.append((t, thinking))
            thinking = t == ids.think_start or (thinking and t != ids.think_end)
    return found


def test_relaxed_acceptance_bounds(pair):
    tok, target, draft, prompts, ids = pair
    # The thinking prompts, and the same prompts with the think block closed and an answer begun
    # (answer phase; there the draft often disagrees with the target, so relaxing would show).
    closed = tok("</think>\n\n**Answer:** ", add_special_tokens=False)["input_ids"]
    prompts = prompts + [p + closed for p in prompts]
    strict, st, _ = speculative_generate(target, draft, prompts, ids, k=4, max_new_tokens=24)
    same, st1, _ = speculative_generate(target, draft, prompts, ids, k=4, max_new_tokens=24,
                                        relax=Relax(1.0, 1))
    assert same == strict and st1.relaxed_only == 0
    loose, st0, _ = speculative_generate(target, draft, prompts, ids, k=4, max_new_tokens=24,
                                         relax=Relax(0.0, 64))
    assert st0.relaxed_only > 0
    assert st0.mean_acceptance_length("thinking") > st.mean_acceptance_length("thinking")
    # Only thinking-phase, non-protected drafts may be relaxed: every token off the target's greedy
    # path was emitted while thinking and is not protected.
    off = _off_greedy_tokens(target, prompts, loose, ids)
    assert 0 < len(off) <= st0.relaxed_only  # fewer when a run is cut at EOS or max_new_tokens
    assert all(thinking for _, thinking in off), off
    assert not {t for t, _ in off} & set(ids.protected)
    # Answer-phase requests that never open a think block are decoded exactly as strict.
    answer_only = [(s, lo) for s, lo in zip(strict[3:], loose[3:]) if ids.think_start not in lo]
    assert answer_only and all(s == lo for s, lo in answer_only)
    assert st.mean_acceptance_length("answer") < 3  # ... and the answer phase had drafts to relax
    assert _off_greedy_tokens(target, prompts, strict, ids) == []  # the oracle finds none in strict
    # A draft that always proposes </think> (protected): relaxation must never accept it, while
    # thinking, where everything else would pass.
    pushy = copy.deepcopy(draft)
    head = torch.nn.Linear(pushy.lm_head.in_features, pushy.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(pushy.lm_head.weight)
        head.bias.zero_()
        head.bias[ids.think_end] = 100.0
    pushy.lm_head = head
    pushed, _, _ = speculative_generate(target, pushy, prompts[:3], ids, k=4, max_new_tokens=24,
                                        relax=Relax(0.0, 64))
    assert not {t for t, _ in _off_greedy_tokens(target, prompts[:3], pushed, ids)} & set(ids.protected)


def test_fork_agreement_splits_forks_from_determined_tokens(pair):
    tok, target, draft, _, _ = pair
    samples = generate_samples(4, seed=31)
    self_agree = fork_agreement(target, target, tok, samples)
    assert self_agree["fork_agreement"] == 1.0 and self_agree["determined_agreement"] == 1.0
    assert 0.15 <= self_agree["data_fork_share"] <= 0.3
    other = fork_agreement(target, draft, tok, samples)
    assert other["data_fork_share"] == self_agree["data_fork_share"]
    assert 0 <= other["fork_agreement"] <= 1 and other["determined_agreement"] < 1
    assert 0 < other["target_top1_at_forks"] <= 1


def test_format_table_names_every_draft():
    result = {"n_problems": 2, "k": 4,
              "target": {"accuracy": 1.0, "fork_fraction": 0.2, "thinking_token_share": 0.9},
              "drafts": [{"path": "d1", "params": 1_100_000,
                          "agreement": {"fork_agreement": 0.3, "determined_agreement": 0.9},
                          "strict": {"thinking_al": 2.5},
                          "relaxed": [{"ratio": 0.3, "top_k": 3, "thinking_al": 3.5, "accuracy": 1.0},
                                      {"ratio": 0.3, "top_k": 4, "skipped": "time budget"}]}]}
    table = format_table(result)
    assert "d1 | 1.10M | 0.30/0.90 | 2.50 | (0.3, 3): 3.50, x1.40, 1.000" in table
    assert "(0.3, 4)" not in table
