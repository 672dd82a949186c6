"""Analysis tool: speculative decoding of the toy pair, simulated with plain HF forwards.

This is a measurement stand-in, not the engine: every round recomputes full forwards (no KV
cache), which is simple and exact. It reports what the engine's quality gates need:

- greedy answer accuracy of the target on fresh problems;
- the fork fraction: share of thinking tokens where the target's top-1 probability is < 0.5;
- strict thinking-phase mean acceptance length of the draft at k (teacher-forced on the target's
  greedy trajectory, which is exact for greedy strict verification);
- relaxed acceptance (the greedy relaxed rule of docs/ACCEPTANCE.md, thinking phase only, protected tokens
  never relaxed), simulated round by round along the path the accepted drafts take, with the
  accuracy of the answers that path produces;
- draft/target top-1 agreement on reference traces, split into the data's wording forks and the
  determined tokens (where a draft's strict rejections come from).

    python -m thinkspec.toy.analyze --target DIR --draft DIR [--draft DIR2 ...] --n 500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from thinkspec.config import validate_relax_fields
from thinkspec.sampling.rejection import relaxed_test
from thinkspec.toy.task import (
    LEVELS,
    Level,
    Problem,
    Sample,
    chat_prompt,
    generate_problem,
    generate_samples,
    grade,
)
from thinkspec.toy.tokenizer import THINK_END, THINK_START


@dataclass(slots=True)
class Relax:
    ratio: float
    top_k: int

    def __post_init__(self) -> None:
        # The engine's own ranges and messages (Relax.relax_ratio / Relax.relax_top_k).
        validate_relax_fields(relax_ratio=self.ratio, relax_top_k=self.top_k, owner="Relax")


@dataclass(slots=True)
class SpecStats:
    """Acceptance counts split by the phase at the start of each verify round."""

    rounds: dict[str, int] = field(default_factory=lambda: {"thinking": 0, "answer": 0})
    emitted: dict[str, int] = field(default_factory=lambda: {"thinking": 0, "answer": 0})
    relaxed_only: int = 0

    def mean_acceptance_length(self, phase: str) -> float:
        r = self.rounds[phase]
        return self.emitted[phase] / r if r else float("nan")


@dataclass(slots=True)
class TokenIds:
    think_start: int
    think_end: int
    eos: list[int]
    protected: list[int]  # never relaxed: think markers, EOS/stop and every added token

    @classmethod
    def from_tokenizer(cls, tok: PreTrainedTokenizerBase) -> TokenIds:
        ts, te = tok.convert_tokens_to_ids(THINK_START), tok.convert_tokens_to_ids(THINK_END)
        eos = sorted({tok.eos_token_id, tok.pad_token_id})
        added = sorted(tok.get_added_vocab().values())
        return cls(think_start=ts, think_end=te, eos=eos, protected=sorted({ts, te, *eos, *added}))


def _last_logits(model: torch.nn.Module, buf: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Logits at positions pos [B, J] int64 of rows buf [B, T] int64 -> [B, J, V] float32."""
    width = int(pos.max()) + 1
    with torch.autocast(buf.device.type, dtype=torch.bfloat16, enabled=buf.device.type == "cuda"):
        hidden = model.model(input_ids=buf[:, :width]).last_hidden_state  # [B, width, H]
        h = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # [B, J, H]
        return model.lm_head(h).float()


def _phase_after(phase: torch.Tensor, tokens: torch.Tensor, ids: TokenIds) -> torch.Tensor:
    """Thinking flag [B] bool advanced over tokens [B] int64."""
    return torch.where(tokens == ids.think_start, True, torch.where(tokens == ids.think_end, False, phase))


@torch.no_grad()
def speculative_generate(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: list[list[int]],
    ids: TokenIds,
    k: int = 4,
    relax: Relax | None = None,
    max_new_tokens: int = 512,
    batch_size: int = 512,
) -> tuple[list[list[int]], SpecStats, list[float]]:
    """Greedy speculative decoding simulated with full forwards.

    draft=None (or k=0) is plain greedy decoding. Returns the generated ids per prompt (up to and
    including EOS), acceptance stats, and the target's top-1 probability for every token emitted
    in the thinking phase (its own distribution at that position).
    """
    if draft is None:
        k = 0
    stats = SpecStats()
    outs: list[list[int]] = []
    pmax_thinking: list[float] = []
    for s in range(0, len(prompts), batch_size):
        o = _spec_batch(
            target, draft, prompts[s : s + batch_size], ids, k, relax, max_new_tokens, stats, pmax_thinking
        )
        outs.extend(o)
    return outs, stats, pmax_thinking


@dataclass(slots=True)
class _Rows:
    """Device state of a batch of simulated requests: token buffer [B, T] int64 (prompt, then
    output), prompt and current lengths [B] int64, finished and thinking flags [B] bool."""

    buf: torch.Tensor
    plen: torch.Tensor
    lens: torch.Tensor
    done: torch.Tensor
    phase: torch.Tensor

    @classmethod
    def start(cls, prompts: list[list[int]], ids: TokenIds, width: int, dev: torch.device) -> _Rows:
        b = len(prompts)
        plen = torch.tensor([len(p) for p in prompts], device=dev)
        buf = torch.full((b, int(plen.max()) + width), ids.eos[-1], dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            buf[i, : len(p)] = torch.tensor(p, device=dev)
        # Initial phase: the last think marker in the prompt decides.
        phase = torch.tensor([_initial_phase(p, ids) for p in prompts], dtype=torch.bool, device=dev)
        return cls(buf, plen, plen.clone(), torch.zeros(b, dtype=torch.bool, device=dev), phase)


@dataclass(slots=True)
class _Round:
    """One verify round of the active rows A: emitted tokens [A, k+1] int64 (accepted drafts, then
    the target's token), emitted counts [A] int64, the target's top-1 probability per row [A, k+1]
    float32 and the relaxed-only acceptances [A] int64."""

    emit: torch.Tensor
    n_emit: torch.Tensor
    pmax: torch.Tensor
    relaxed_only: torch.Tensor


def _spec_batch(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: list[list[int]],
    ids: TokenIds,
    k: int,
    relax: Relax | None,
    max_new_tokens: int,
    stats: SpecStats,
    pmax_thinking: list[float],
) -> list[list[int]]:
    dev = next(target.parameters()).device
    rows = _Rows.start(prompts, ids, max_new_tokens + k + 1, dev)
    arange = torch.arange(k + 1, device=dev)
    while not bool(rows.done.all()):
        act = (~rows.done).nonzero().squeeze(1)
        r = _verify_round(target, draft, rows.buf[act], rows.lens[act], rows.phase[act], ids, k, relax)
        nf, new_phase, new_done = _bookkeep(r, act, rows, ids, max_new_tokens, stats, pmax_thinking)
        keep = arange.unsqueeze(0) < nf.unsqueeze(1)  # [A, k+1]
        idx = act.unsqueeze(1).expand_as(keep)
        rows.buf[idx[keep], (rows.lens[act].unsqueeze(1) + arange)[keep]] = r.emit[keep]
        rows.lens[act] += nf
        rows.phase[act] = new_phase
        rows.done[act] = new_done
    return [rows.buf[i, int(rows.plen[i]) : int(rows.lens[i])].tolist() for i in range(len(prompts))]


def _verify_round(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    x: torch.Tensor,  # [A, T] int64 token rows of the active requests (a copy: drafts are written in)
    ln: torch.Tensor,  # [A] int64 their lengths
    ph: torch.Tensor,  # [A] bool their phase (True = thinking)
    ids: TokenIds,
    k: int,
    relax: Relax | None,
) -> _Round:
    """k greedy drafts per row, then the target's verdict: strict greedy, or the library's relaxed
    test (sampling/rejection.py) in the thinking phase with protected tokens never relaxed."""
    a, dev = len(x), x.device
    arange = torch.arange(k + 1, device=dev)
    drafts = torch.empty(a, k, dtype=torch.long, device=dev)
    for j in range(k):
        d = _last_logits(draft, x, (ln - 1 + j).unsqueeze(1))[:, 0].argmax(-1)  # [A]
        drafts[:, j] = d
        x[torch.arange(a, device=dev), ln + j] = d
    logits = _last_logits(target, x, ln.unsqueeze(1) - 1 + arange)  # [A, k+1, V]
    g = logits.argmax(-1)  # [A, k+1]
    pmax = logits.softmax(-1).max(-1).values  # [A, k+1]
    strict = drafts == g[:, :k]  # [A, k]
    accept = strict
    if relax is not None and k:
        # Phase before each draft position, advanced over the earlier drafts.
        phases = [ph]
        for j in range(k - 1):
            phases.append(_phase_after(phases[-1], drafts[:, j], ids))
        mask = torch.stack(phases, 1) & ~torch.isin(drafts, torch.tensor(ids.protected, device=dev))  # [A, k]
        ratio, top_k = torch.full((a,), relax.ratio, device=dev), torch.full((a,), relax.top_k, device=dev)
        ok = relaxed_test(logits[:, :k], drafts, ratio, top_k, torch.full((a,), math.nan, device=dev))
        accept = strict | (mask & ok)
    n_acc = accept.long().cumprod(-1).sum(-1)  # [A]
    # Emitted tokens: accepted drafts, then the target's token at the first rejection (or bonus).
    emit = torch.cat([drafts, g[:, -1:]], 1) if k else g  # [A, k+1]
    emit = torch.where(arange < n_acc.unsqueeze(1), emit, g)
    relaxed_only = (accept & ~strict & (arange[:k] < n_acc.unsqueeze(1))).sum(-1) if k else n_acc * 0
    return _Round(emit, n_acc + 1, pmax, relaxed_only)


def _bookkeep(
    r: _Round,
    act: torch.Tensor,  # [A] int64 active rows
    rows: _Rows,
    ids: TokenIds,
    max_new_tokens: int,
    stats: SpecStats,
    pmax_thinking: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cuts each row's emitted tokens at EOS and the length limit and counts the round; returns the
    tokens kept [A] int64, the phase after them [A] bool and whether each row finished [A] bool."""
    # One host copy per round; the per-row bookkeeping below runs on plain lists.
    emit_l, n_l, ph_l, pm_l = r.emit.tolist(), r.n_emit.tolist(), rows.phase[act].tolist(), r.pmax.tolist()
    ro_l, lens_l, plen_l = r.relaxed_only.tolist(), rows.lens[act].tolist(), rows.plen[act].tolist()
    n_final, new_phase, new_done = [], [], []
    for a in range(len(act)):
        toks, n = emit_l[a], n_l[a]
        fin = False
        for j in range(n):
            if toks[j] in ids.eos:
                n, fin = j + 1, True
                break
        room = plen_l[a] + max_new_tokens - lens_l[a]
        if n >= room:
            n, fin = room, True
        p_i = ph_l[a]
        key = "thinking" if p_i else "answer"
        stats.rounds[key] += 1
        stats.emitted[key] += n
        stats.relaxed_only += ro_l[a]
        for j in range(n):
            if p_i:
                pmax_thinking.append(pm_l[a][j])
            t = toks[j]
            p_i = t == ids.think_start or (p_i and t != ids.think_end)
        n_final.append(n)
        new_phase.append(p_i)
        new_done.append(fin)
    dev = act.device
    return (
        torch.tensor(n_final, device=dev),
        torch.tensor(new_phase, dtype=torch.bool, device=dev),
        torch.tensor(new_done, dtype=torch.bool, device=dev),
    )


@torch.no_grad()
def teacher_forced_acceptance(
    draft: torch.nn.Module,
    prompts: list[list[int]],
    outputs: list[list[int]],
    ids: TokenIds,
    k: int = 4,
    batch_size: int = 256,
) -> SpecStats:
    """Strict greedy acceptance of `draft` along the target's greedy outputs (exact for greedy)."""
    dev = next(draft.parameters()).device
    stats = SpecStats()
    for s in range(0, len(prompts), batch_size):
        seqs = [p + o for p, o in zip(prompts[s : s + batch_size], outputs[s : s + batch_size])]
        width = max(len(q) for q in seqs)
        x = torch.full((len(seqs), width), ids.eos[-1], dtype=torch.long, device=dev)
        for i, q in enumerate(seqs):
            x[i, : len(q)] = torch.tensor(q, device=dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            pred = draft(input_ids=x).logits.argmax(-1).cpu()  # [B, width]: prediction for position t+1
        for i, q in enumerate(seqs):
            p0, end = len(prompts[s + i]), len(q)
            match = (pred[i, p0 - 1 : end - 1] == torch.tensor(q[p0:end])).tolist()
            phase = _initial_phase(prompts[s + i], ids)
            t = 0
            n_out = end - p0
            while t < n_out:
                n = 0
                while n < k and t + n < n_out - 1 and match[t + n]:
                    n += 1
                key = "thinking" if phase else "answer"
                stats.rounds[key] += 1
                stats.emitted[key] += n + 1
                for tok in q[p0 + t : p0 + t + n + 1]:
                    phase = (tok == ids.think_start) or (phase and tok != ids.think_end)
                t += n + 1
    return stats


@torch.no_grad()
def fork_agreement(
    target: torch.nn.Module, draft: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, samples: list[Sample]
) -> dict[str, float]:
    """Teacher-forced top-1 agreement of draft and target on reference traces, split by token kind.

    "fork" tokens start a uniform wording choice of the data (known from the generator), the rest of
    the thinking tokens are "determined". Also returns the target's mean top-1 probability at forks.
    """
    dev = next(target.parameters()).device
    hits = {"fork": 0, "determined": 0}
    counts = {"fork": 0, "determined": 0}
    top1_at_forks: list[float] = []
    for s in samples:
        enc = tokenizer(s.completion, add_special_tokens=False, return_offsets_mapping=True)
        prompt = tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        x = torch.tensor([prompt + enc["input_ids"]], device=dev)  # [1, L]
        starts = {a: i for i, (a, _) in enumerate(enc["offset_mapping"])}
        forks = {starts[off] for off, m in s.forks if m >= 3 and off in starts}
        begin, end = len(THINK_START) + 1, s.completion.index(THINK_END)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            lt = (
                target(input_ids=x).logits[0, len(prompt) - 1 : -1].float()
            )  # [C, V]: rows predict completion
            ld = draft(input_ids=x).logits[0, len(prompt) - 1 : -1].float()
        agree = (lt.argmax(-1) == ld.argmax(-1)).tolist()
        pmax = lt.softmax(-1).max(-1).values.tolist()
        for i, (a, b) in enumerate(enc["offset_mapping"]):
            if a < begin or b > end:
                continue
            key = "fork" if i in forks else "determined"
            hits[key] += agree[i]
            counts[key] += 1
            if key == "fork":
                top1_at_forks.append(pmax[i])
    return {
        "fork_agreement": hits["fork"] / max(1, counts["fork"]),
        "determined_agreement": hits["determined"] / max(1, counts["determined"]),
        "data_fork_share": counts["fork"] / max(1, counts["fork"] + counts["determined"]),
        "target_top1_at_forks": sum(top1_at_forks) / max(1, len(top1_at_forks)),
    }


def _initial_phase(prompt: list[int], ids: TokenIds) -> bool:
    for t in reversed(prompt):
        if t in (ids.think_start, ids.think_end):
            return t == ids.think_start
    return False


def fresh_problems(n: int, seed: int, level: Level | None = None) -> list[Problem]:
    rng = random.Random(seed)
    return [generate_problem(rng, level) for _ in range(n)]


def load(path: str, device: torch.device) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


@dataclass(slots=True)
class _Setup:
    """What every measurement of one analysis shares: the problems, their prompts and the settings."""

    tok: PreTrainedTokenizerBase
    ids: TokenIds
    problems: list[Problem]
    prompts: list[list[int]]
    k: int
    max_new_tokens: int
    batch_size: int
    seed: int
    level: str


def analyze(
    target_path: str,
    draft_paths: list[str],
    n: int = 500,
    seed: int = 20261130,
    k: int = 4,
    relax: list[Relax] | None = None,
    max_new_tokens: int = 512,
    device: str | None = None,
    batch_size: int = 512,
    time_budget_s: float | None = None,
    agreement_samples: int = 50,
    log=print,
    level: str = "easy",
) -> dict:
    """All measurements for one target and one or more drafts; returns a JSON-able dict.

    Relaxed simulations are skipped (and marked so) once `time_budget_s` has passed.
    """
    start = time.time()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    relax = relax if relax is not None else [Relax(0.3, 3), Relax(0.3, 4)]
    tok = AutoTokenizer.from_pretrained(target_path)
    problems = fresh_problems(n, seed, LEVELS[level])
    prompts = [tok(chat_prompt(p.question), add_special_tokens=False)["input_ids"] for p in problems]
    setup = _Setup(
        tok, TokenIds.from_tokenizer(tok), problems, prompts, k, max_new_tokens, batch_size, seed, level
    )
    target = load(target_path, dev)
    outs, target_entry = _measure_target(target, setup)
    result: dict = {
        "n_problems": n,
        "seed": seed,
        "level": level,
        "k": k,
        "target": {"path": target_path, **target_entry},
        "drafts": [],
    }
    log(json.dumps(result["target"]))
    deadline = None if time_budget_s is None else start + time_budget_s
    for dp in draft_paths:
        entry = _measure_draft(load(dp, dev), target, outs, setup, relax, agreement_samples, deadline)
        result["drafts"].append({"path": dp, **entry})
        log(json.dumps(result["drafts"][-1]))
    return result


def _measure_target(target: torch.nn.Module, setup: _Setup) -> tuple[list[list[int]], dict]:
    """The target's greedy outputs and their accuracy, fork fraction and thinking share."""
    t0, n = time.time(), len(setup.problems)
    outs, _, pmax = speculative_generate(
        target,
        None,
        setup.prompts,
        setup.ids,
        max_new_tokens=setup.max_new_tokens,
        batch_size=setup.batch_size,
    )
    texts = setup.tok.batch_decode(outs)
    n_think = [_count_thinking(o, setup.ids) for o in outs]
    return outs, {
        "accuracy": sum(grade(t, p) for t, p in zip(texts, setup.problems)) / n,
        "fork_fraction": sum(v < 0.5 for v in pmax) / max(1, len(pmax)),
        "thinking_token_share": sum(n_think) / max(1, sum(len(o) for o in outs)),
        "mean_output_tokens": sum(len(o) for o in outs) / n,
        "seconds": round(time.time() - t0, 1),
    }


def _measure_draft(
    draft: torch.nn.Module,
    target: torch.nn.Module,
    outs: list[list[int]],
    setup: _Setup,
    relax: list[Relax],
    agreement_samples: int,
    deadline: float | None,
) -> dict:
    """One draft: strict acceptance along the target's outputs, agreement on reference traces, and
    one relaxed simulation per setting (skipped once `deadline`, a time.time() value, has passed)."""
    t0, n = time.time(), len(setup.problems)
    st = teacher_forced_acceptance(
        draft, setup.prompts, outs, setup.ids, k=setup.k, batch_size=setup.batch_size
    )
    references = generate_samples(agreement_samples, setup.seed + 1, LEVELS[setup.level])
    entry: dict = {
        "params": sum(p.numel() for p in {id(p): p for p in draft.parameters()}.values()),
        "strict": {
            "thinking_al": st.mean_acceptance_length("thinking"),
            "answer_al": st.mean_acceptance_length("answer"),
        },
        "agreement": fork_agreement(target, draft, setup.tok, references),
        "relaxed": [],
    }
    for r in relax:
        if deadline is not None and time.time() > deadline:
            entry["relaxed"].append({**asdict(r), "skipped": "time budget"})
            continue
        r_outs, r_st, _ = speculative_generate(
            target, draft, setup.prompts, setup.ids, k=setup.k, relax=r,
            max_new_tokens=setup.max_new_tokens, batch_size=setup.batch_size,
        )  # fmt: skip
        r_texts = setup.tok.batch_decode(r_outs)
        entry["relaxed"].append(
            {
                **asdict(r),
                "thinking_al": r_st.mean_acceptance_length("thinking"),
                "answer_al": r_st.mean_acceptance_length("answer"),
                "relaxed_only_accepted": r_st.relaxed_only,
                "accuracy": sum(grade(t, p) for t, p in zip(r_texts, setup.problems)) / n,
                "mean_output_tokens": sum(len(o) for o in r_outs) / n,
            }
        )
    entry["seconds"] = round(time.time() - t0, 1)
    return entry


def _count_thinking(out: list[int], ids: TokenIds) -> int:
    """Tokens strictly between <think> and </think> in one output."""
    try:
        a = out.index(ids.think_start)
    except ValueError:
        return 0
    b = out.index(ids.think_end) if ids.think_end in out else len(out)
    return max(0, b - a - 1)


def format_table(result: dict) -> str:
    t = result["target"]
    lines = [
        f"target: accuracy {t['accuracy']:.3f}  fork fraction {t['fork_fraction']:.3f}  "
        f"thinking share {t['thinking_token_share']:.3f}  "
        f"({result['n_problems']} problems, k={result['k']})",
        "draft | params | agreement fork/determined | strict thinking AL | "
        "relaxed (ratio, top_k): thinking AL, x strict, accuracy",
    ]
    for d in result["drafts"]:
        s = d["strict"]["thinking_al"]
        ag = d["agreement"]
        rel = "; ".join(
            f"({r['ratio']}, {r['top_k']}): {r['thinking_al']:.2f}, x{r['thinking_al'] / s:.2f}, "
            f"{r['accuracy']:.3f}"
            for r in d["relaxed"]
            if "skipped" not in r
        )
        lines.append(
            f"{d['path']} | {d['params'] / 1e6:.2f}M | {ag['fork_agreement']:.2f}/"
            f"{ag['determined_agreement']:.2f} | {s:.2f} | {rel}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Simulated speculative-decoding measurements of the toy pair")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", action="append", default=[])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--relax", action="append", default=None, help="ratio,top_k (repeatable)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--level", choices=sorted(LEVELS), default="easy", help="toy problem difficulty")
    a = ap.parse_args(argv)
    relax = None
    if a.relax:
        relax = [Relax(float(r.split(",")[0]), int(r.split(",")[1])) for r in a.relax]
    res = analyze(
        a.target,
        a.draft,
        n=a.n,
        seed=a.seed,
        k=a.k,
        relax=relax,
        max_new_tokens=a.max_new_tokens,
        device=a.device,
        batch_size=a.batch_size,
        time_budget_s=a.time_budget_s,
        level=a.level,
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(format_table(res))


if __name__ == "__main__":
    main()
