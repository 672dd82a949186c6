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
import random
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

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
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"relax ratio must be in [0, 1], got {self.ratio}")
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"relax top_k must be in [1, 64], got {self.top_k}")


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


def _spec_batch(
    target,
    draft,
    prompts,
    ids: TokenIds,
    k,
    relax,
    max_new_tokens,
    stats: SpecStats,
    pmax_thinking: list[float],
) -> list[list[int]]:
    dev = next(target.parameters()).device
    b = len(prompts)
    plen = torch.tensor([len(p) for p in prompts], device=dev)
    buf = torch.full((b, int(plen.max()) + max_new_tokens + k + 1), ids.eos[-1], dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p, device=dev)
    lens = plen.clone()
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    # Initial phase: the last think marker in the prompt decides.
    phase = torch.zeros(b, dtype=torch.bool, device=dev)
    for i, p in enumerate(prompts):
        for t in reversed(p):
            if t in (ids.think_start, ids.think_end):
                phase[i] = t == ids.think_start
                break
    protected = torch.tensor(ids.protected, device=dev)
    arange = torch.arange(k + 1, device=dev)
    while not bool(done.all()):
        act = (~done).nonzero().squeeze(1)
        x, ln, ph = buf[act], lens[act], phase[act]  # x [A, T]
        drafts = torch.empty(len(act), k, dtype=torch.long, device=dev)
        for j in range(k):
            d = _last_logits(draft, x, (ln - 1 + j).unsqueeze(1))[:, 0].argmax(-1)  # [A]
            drafts[:, j] = d
            x[torch.arange(len(act), device=dev), ln + j] = d
        logits = _last_logits(target, x, ln.unsqueeze(1) - 1 + arange)  # [A, k+1, V]
        g = logits.argmax(-1)  # [A, k+1]
        probs = logits.softmax(-1)
        pmax = probs.max(-1).values  # [A, k+1]
        # Phase before each draft position, advanced over the earlier drafts.
        phases = [ph]
        for j in range(k):
            phases.append(_phase_after(phases[-1], drafts[:, j], ids))
        phase_before = torch.stack(phases, 1)  # [A, k+1] bool
        strict = drafts == g[:, :k]  # [A, k]
        accept = strict
        if relax is not None and k:
            ld = logits[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [A, k]
            rank = (logits[:, :k] > ld.unsqueeze(-1)).sum(-1)
            pd = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            ok = (pd > 0) & (rank < relax.top_k) & (pd >= relax.ratio * pmax[:, :k])
            ok &= phase_before[:, :k] & ~torch.isin(drafts, protected)
            accept = strict | ok
        n_acc = accept.long().cumprod(-1).sum(-1)  # [A]
        # Emitted tokens: accepted drafts, then the target's token at the first rejection (or bonus).
        emit = torch.cat([drafts, g[:, -1:]], 1) if k else g  # [A, k+1]
        emit = torch.where(arange < n_acc.unsqueeze(1), emit, g)
        n_emit = n_acc + 1
        relaxed_only = (accept & ~strict & (arange[:k] < n_acc.unsqueeze(1))).sum(-1) if k else n_acc * 0
        # One host copy per round; the per-row bookkeeping below runs on plain lists.
        emit_l, n_l, ph_l, pm_l = emit.tolist(), n_emit.tolist(), ph.tolist(), pmax.tolist()
        ro_l, lens_l, plen_l = relaxed_only.tolist(), lens[act].tolist(), plen[act].tolist()
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
        nf = torch.tensor(n_final, device=dev)
        keep = arange.unsqueeze(0) < nf.unsqueeze(1)  # [A, k+1]
        rows = act.unsqueeze(1).expand_as(keep)
        buf[rows[keep], (lens[act].unsqueeze(1) + arange)[keep]] = emit[keep]
        lens[act] += nf
        phase[act] = torch.tensor(new_phase, device=dev)
        done[act] = torch.tensor(new_done, device=dev)
    return [buf[i, int(plen[i]) : int(lens[i])].tolist() for i in range(b)]


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
    ids = TokenIds.from_tokenizer(tok)
    problems = fresh_problems(n, seed, LEVELS[level])
    prompts = [tok(chat_prompt(p.question), add_special_tokens=False)["input_ids"] for p in problems]
    target = load(target_path, dev)
    t0 = time.time()
    outs, _, pmax = speculative_generate(
        target, None, prompts, ids, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    texts = tok.batch_decode(outs)
    n_think = [_count_thinking(o, ids) for o in outs]
    result: dict = {
        "n_problems": n,
        "seed": seed,
        "level": level,
        "k": k,
        "target": {
            "path": target_path,
            "accuracy": sum(grade(t, p) for t, p in zip(texts, problems)) / n,
            "fork_fraction": sum(v < 0.5 for v in pmax) / max(1, len(pmax)),
            "thinking_token_share": sum(n_think) / max(1, sum(len(o) for o in outs)),
            "mean_output_tokens": sum(len(o) for o in outs) / n,
            "seconds": round(time.time() - t0, 1),
        },
        "drafts": [],
    }
    log(json.dumps(result["target"]))
    for dp in draft_paths:
        draft = load(dp, dev)
        t0 = time.time()
        st = teacher_forced_acceptance(draft, prompts, outs, ids, k=k, batch_size=batch_size)
        references = generate_samples(agreement_samples, seed + 1, LEVELS[level])
        agreement = fork_agreement(target, draft, tok, references)
        n_params = sum(p.numel() for p in {id(p): p for p in draft.parameters()}.values())
        entry = {
            "path": dp,
            "params": n_params,
            "strict": {
                "thinking_al": st.mean_acceptance_length("thinking"),
                "answer_al": st.mean_acceptance_length("answer"),
            },
            "agreement": agreement,
            "relaxed": [],
        }
        for r in relax:
            if time_budget_s is not None and time.time() - start > time_budget_s:
                entry["relaxed"].append({**asdict(r), "skipped": "time budget"})
                continue
            r_outs, r_st, _ = speculative_generate(
                target,
                draft,
                prompts,
                ids,
                k=k,
                relax=r,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
            )
            r_texts = tok.batch_decode(r_outs)
            entry["relaxed"].append(
                {
                    **asdict(r),
                    "thinking_al": r_st.mean_acceptance_length("thinking"),
                    "answer_al": r_st.mean_acceptance_length("answer"),
                    "relaxed_only_accepted": r_st.relaxed_only,
                    "accuracy": sum(grade(t, p) for t, p in zip(r_texts, problems)) / n,
                    "mean_output_tokens": sum(len(o) for o in r_outs) / n,
                }
            )
        entry["seconds"] = round(time.time() - t0, 1)
        result["drafts"].append(entry)
        log(json.dumps(entry))
    return result


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
