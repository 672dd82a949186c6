"""Acceptance of draft tokens: strict/relaxed greedy and lossless/relaxed sampling (torch reference).

`rejection_sample` is the single call site: CUDA tensors go to the fused Triton kernels in
`rejection_triton.py` when triton is installed; everything else (and any call with
`use_triton=False`, or with THINKSPEC_REJECTION_REFERENCE=1 in the environment) goes to
`rejection_sample_reference` below.

Per request b and draft position i < num_draft_tokens[b], with x = logits (greedy, temperature 0)
or logits / temperature (sampled; rows arrive already top-k/top-p filtered, -inf outside), p =
softmax(x), g = argmax x (lowest index on ties), d = draft token, rank(d) = #{v : x[v] > x[d]}:
  relaxed test   relax_mask[b, i] and x[d] > -inf and rank(d) < top_k and exp(x[d] - x[g]) >= ratio
                 and (delta unset or p[g] - p[d] <= delta)
  greedy         accept iff d == g or the relaxed test passes
  sampled        accept iff the relaxed test passes or u * q(d) < p(d), u ~ U[0, 1)
Rows whose relax_rule is lenient or typical replace the relaxed test (only where relax_mask):
  lenient        u * lambda * q(d) < p(d)   (accept with probability min(1, p(d) / (lambda q(d))))
  typical        p(d) > min(posterior_threshold, posterior_alpha * exp(-H(p)))
and never relax a greedy row. Every rule keeps the residual normalize(max(0, p - q)), which makes
the emitted distribution the closest to p that its acceptance allows (docs/ACCEPTANCE.md).
The first rejection stops the run; position num_accepted then emits a token: g (greedy) or a sample
of normalize(max(0, p - q)) (sampled) on rejection, and the bonus token g / a sample of p from row
num_draft_tokens[b] when every draft was accepted. q = draft_probs[b, i], or one_hot(d) when
draft_probs is None.

Randomness: with `seeds` [B] int64 each request draws from its own stream keyed by (seed,
seed_offset), so its result does not depend on the rest of the batch; otherwise draws come from
`generator` (or torch's default generator). The reference and the kernels use different streams.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from thinkspec.sampling.rejection_common import (
    RULE_LENIENT,
    RULE_TOPK_RATIO,
    RULE_TYPICAL,
    AcceptanceBatch,
    RejectionResult,
    check_values,
)
from thinkspec.sampling.sampler import exponential_race, mix_seed

__all__ = [
    "AcceptanceBatch",
    "RejectionResult",
    "implied_tv",
    "rejection_sample",
    "rejection_sample_reference",
    "relaxed_test",
]


def rejection_sample(
    batch: AcceptanceBatch,
    generator: torch.Generator | None = None,
    *,
    validate: bool = False,
    use_triton: bool | None = None,
) -> RejectionResult:
    """Routes CUDA tensors to the Triton kernels and everything else to the torch reference.

    Inputs as documented on `AcceptanceBatch`. `validate` makes the kernels check values too (a
    sync); the reference always checks them. `use_triton` forces the choice (None = by device).
    """
    if use_triton is None:
        use_triton = (
            batch.target_logits.is_cuda
            and os.environ.get("THINKSPEC_REJECTION_REFERENCE", "0") != "1"
            and importlib.util.find_spec("triton") is not None
        )
    if use_triton:
        from thinkspec.sampling.rejection_triton import rejection_sample_triton

        return rejection_sample_triton(batch, generator, validate=validate)
    return rejection_sample_reference(batch, generator)


def _draw_randoms(
    b: int, k: int, v: int, device: torch.device, generator: torch.Generator | None,
    seeds: torch.Tensor | None, seed_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Returns u [B, K] float32 uniforms in [0, 1) and e [B, V] float32 Exp(1) draws (> 0)."""
    if seeds is None:
        u = torch.rand(b, k, device=device, generator=generator)
        e = torch.empty(b, v, device=device).exponential_(generator=generator)
    else:
        u = torch.empty(b, k, device=device)
        e = torch.empty(b, v, device=device)
        for i, s in enumerate(seeds.tolist()):
            gen = torch.Generator(device=device).manual_seed(mix_seed(s, seed_offset))
            u[i] = torch.rand(k, device=device, generator=gen)
            e[i] = torch.empty(v, device=device).exponential_(generator=gen)
    return u, e.clamp_min(torch.finfo(torch.float32).tiny)


def rejection_sample_reference(
    batch: AcceptanceBatch, generator: torch.Generator | None = None
) -> RejectionResult:
    """Pure-torch acceptance, vectorised over the batch, computed in float32 on any device.

    Always validates values (syncs); `batch.all_greedy` is only checked. Raises ValueError on NaN
    or +inf in a used row (rows 0..num_draft_tokens[b]), on a used row that is all -inf, and on
    out-of-range inputs.
    """
    check_values(batch)
    b, k, v = batch.dims
    temperature, draft_probs = batch.temperature, batch.draft_probs
    dev = batch.target_logits.device
    n = batch.num_draft_tokens.long()  # [B]
    greedy = temperature == 0  # [B] bool
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [B]
    x = batch.target_logits.float() / temp[:, None, None]  # [B, K+1, V]
    g = x.argmax(-1)  # [B, K+1], first index of the max
    lse = torch.logsumexp(x[:, :k], -1)  # [B, K]

    d = batch.draft_token_ids.long().clamp(0, v - 1)  # [B, K], padding clamped so gathers stay in range
    xd = x[:, :k].gather(-1, d[..., None]).squeeze(-1)  # [B, K]
    pd = torch.exp(xd - lse)  # [B, K]
    relaxed = batch.relax_mask & relaxed_test(
        x[:, :k], d, batch.relax_ratio, batch.relax_top_k, batch.relax_delta
    )  # [B, K]

    strict = d == g[:, :k]  # [B, K]
    u, e = _draw_randoms(b, k, v, dev, generator, batch.seeds, batch.seed_offset)  # [B, K], [B, V]
    qd = (
        torch.ones_like(pd)
        if draft_probs is None
        else draft_probs[:, :k].float().gather(-1, d[..., None])[..., 0]
    )
    lossless = u * qd < pd  # [B, K]
    relaxed_only = torch.where(greedy[:, None], ~strict, pd < qd)  # [B, K]
    if batch.relax_rule is not None:
        rule_ok = batch.relax_mask & _rule_test(batch, x[:, :k], pd, qd, u)  # [B, K]
        topk_rows = (batch.relax_rule == RULE_TOPK_RATIO)[:, None]  # [B, 1]
        # Lenient / typical rows never relax a greedy row (p is one_hot(g) there: the strict test).
        relaxed = torch.where(topk_rows, relaxed, rule_ok & ~greedy[:, None])
        relaxed_only = torch.where(topk_rows, relaxed_only, ~lossless)
    accept = torch.where(greedy[:, None], strict | relaxed, relaxed | lossless)  # [B, K]
    pos = torch.arange(k, device=dev)
    accept &= pos[None, :] < n[:, None]
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]
    in_run = pos[None, :] < num_accepted[:, None]  # [B, K]
    relaxed_accepted = in_run & relaxed & relaxed_only

    # Emitted token from row j = num_accepted: correction if j < n, bonus if j == n.
    j = num_accepted  # [B]
    emitted = g.gather(1, j[:, None])[:, 0]  # [B]
    if not bool(greedy.all()):
        emitted = torch.where(greedy, emitted, _sample_emitted(x, j, n, d, draft_probs, e))

    out = torch.full((b, k + 1), -1, dtype=torch.long, device=dev)
    out[:, :k] = torch.where(in_run, batch.draft_token_ids.long(), -1)
    out.scatter_(1, j[:, None], emitted[:, None])
    return RejectionResult(output_token_ids=out, num_accepted=num_accepted, relaxed_accepted=relaxed_accepted)


def relaxed_test(
    x: torch.Tensor,  # [B, K, V] float logits of the draft rows (already divided by the temperature)
    draft_token_ids: torch.Tensor,  # [B, K] int64 in [0, V)
    relax_ratio: torch.Tensor,  # [B] float in [0, 1]
    relax_top_k: torch.Tensor,  # [B] int >= 1
    relax_delta: torch.Tensor,  # [B] float in [0, 1], NaN = unset
) -> torch.Tensor:
    """[B, K] bool, the relaxed test (docs/ACCEPTANCE.md) of each draft d under its row's
    p = softmax(x): p(d) > 0, rank(d) < top_k, p(d) >= ratio * p_max and, when delta is set,
    p_max - p(d) <= delta. The relax mask (phase, protected tokens) is the caller's."""
    x = x.float()
    xd = x.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, K]
    x_max = x.amax(-1)  # [B, K]
    lse = torch.logsumexp(x, -1)  # [B, K]
    rank = (x > xd[..., None]).sum(-1)  # [B, K]
    pd = torch.exp(xd - lse)
    pmax = torch.exp(x_max - lse)
    delta = relax_delta.float()[:, None]  # [B, 1]
    return (
        (xd > float("-inf"))
        & (rank < relax_top_k[:, None])
        & (torch.exp(xd - x_max) >= relax_ratio.float()[:, None])
        & (delta.isnan() | (pmax - pd <= delta))
    )


def _rule_test(
    batch: AcceptanceBatch,
    x: torch.Tensor,  # [B, K, V] float32 scaled logits of the draft rows
    pd: torch.Tensor,  # [B, K] float32 p(d)
    qd: torch.Tensor,  # [B, K] float32 q(d)
    u: torch.Tensor,  # [B, K] float32 the lossless test's uniforms
) -> torch.Tensor:
    """[B, K] bool: the lenient test u * lambda * q(d) < p(d) on lenient rows, the typical test
    p(d) > min(posterior_threshold, posterior_alpha * exp(-H(p))) on typical rows, False on
    topk_ratio rows. The same uniform as the lossless test, so lenient accepts a superset of it."""
    assert batch.relax_rule is not None and batch.relax_lambda is not None
    assert batch.posterior_threshold is not None and batch.posterior_alpha is not None
    rule = batch.relax_rule.long()[:, None]  # [B, 1]
    lenient = u * batch.relax_lambda.float()[:, None] * qd < pd
    entropy = torch.special.entr(torch.softmax(x, -1)).sum(-1)  # [B, K] nats; entr(0) = 0
    alpha = batch.posterior_alpha.float()[:, None]  # [B, 1]
    tau = torch.minimum(batch.posterior_threshold.float()[:, None], alpha * torch.exp(-entropy))
    typical = pd > tau
    return torch.where(rule == RULE_LENIENT, lenient, (rule == RULE_TYPICAL) & typical)


def _sample_emitted(
    x: torch.Tensor,  # [B, K+1, V] float32 scaled logits
    j: torch.Tensor,  # [B] int64 row that emits (= accepted drafts)
    n: torch.Tensor,  # [B] int64 drafts per request
    d: torch.Tensor,  # [B, K] int64 drafts, padding clamped into the vocabulary
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (one-hot drafts)
    e: torch.Tensor,  # [B, V] float32 Exp(1) draws
) -> torch.Tensor:
    """[B] int64: a sample of normalize(max(0, p - q)) where row j rejected its draft, of p where j
    is the bonus row."""
    b, k, v = x.shape[0], d.shape[1], x.shape[-1]
    pj = torch.softmax(x.gather(1, j[:, None, None].expand(b, 1, v))[:, 0], -1)  # [B, V]
    jc = j.clamp_max(max(k - 1, 0))  # [B], row K (bonus) has no draft; its q is unused
    if k == 0:
        qj = torch.zeros_like(pj)
    elif draft_probs is None:
        qj = torch.zeros_like(pj).scatter_(1, d.gather(1, jc[:, None]), 1.0)  # [B, V]
    else:
        qj = draft_probs.float().gather(1, jc[:, None, None].expand(b, 1, v))[:, 0]  # [B, V]
    r = torch.where((j < n)[:, None], (pj - qj).clamp_min(0), pj)  # [B, V]
    # p == q up to rounding leaves no residual mass; p is then the exact answer.
    r = torch.where(r.sum(-1, keepdim=True) > 0, r, pj)
    return exponential_race(r.log(), e)


def implied_tv(batch: AcceptanceBatch) -> torch.Tensor:
    """[B, K] float32: TV(pi, p) at each used draft position (0 at padding), where pi is the
    distribution the position emits given its draft distribution q and the row's rule
    (docs/ACCEPTANCE.md: TV = sum_v max(0, q(v) a(v) - p(v)), a = the acceptance probability).
    Greedy rows take p = one_hot(g) and q = one_hot(d): 1 where a draft d != g passes the relaxed
    test. Builds [B, K, V] tensors: a measurement for the sweep, not a step of the engine."""
    b, k, v = batch.dims
    greedy = (batch.temperature == 0)[:, None, None]  # [B, 1, 1]
    temp = torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature).float()
    x = batch.target_logits[:, :k].float() / temp[:, None, None]  # [B, K, V]
    p_soft = torch.softmax(x, -1)
    d = batch.draft_token_ids.long().clamp(0, v - 1)  # [B, K]
    one_d = torch.zeros_like(x).scatter_(-1, d[..., None], 1.0)
    p = torch.where(greedy, torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0), p_soft)
    q = one_d if batch.draft_probs is None else torch.where(greedy, one_d, batch.draft_probs.float())
    ratio_of = torch.where(q > 0, p / q.clamp_min(1e-30), torch.ones_like(p))  # p / q, 1 where q = 0
    a = _acceptance_all(batch, x, p_soft, ratio_of, greedy)  # [B, K, V]
    tv = (q * a - p).clamp_min(0).sum(-1)  # [B, K]
    used = torch.arange(k, device=x.device)[None, :] < batch.num_draft_tokens.long()[:, None]
    return torch.where(used, tv, torch.zeros_like(tv))


def _acceptance_all(
    batch: AcceptanceBatch,
    x: torch.Tensor,  # [B, K, V] float32 scaled logits
    p_soft: torch.Tensor,  # [B, K, V] float32 softmax(x)
    ratio_of: torch.Tensor,  # [B, K, V] float32 p / q (1 where q = 0), p one-hot on greedy rows
    greedy: torch.Tensor,  # [B, 1, 1] bool
) -> torch.Tensor:  # [B, K, V] float32: probability that each token, drafted here, is accepted
    """Each row's acceptance probability for every token as the draft: the lossless min(1, p / q),
    raised to 1 inside the relaxed set (topk_ratio) or the typical set, or min(1, p / (lambda q))."""
    lossless = ratio_of.clamp(max=1.0)
    top_k = batch.relax_top_k.long().clamp(1, x.shape[-1])  # [B]
    kth = x.topk(int(top_k.max()), -1).values.gather(-1, (top_k - 1)[:, None, None].expand(*x.shape[:2], 1))
    pmax = p_soft.amax(-1, keepdim=True)
    delta = batch.relax_delta.float()[:, None, None]
    in_r = (x > float("-inf")) & (x >= kth) & (p_soft >= batch.relax_ratio.float()[:, None, None] * pmax)
    in_r &= delta.isnan() | (pmax - p_soft <= delta)
    relax = batch.relax_mask[..., None]  # [B, K, 1]
    a = torch.where(relax & in_r, torch.ones_like(lossless), lossless)
    if batch.relax_rule is None:
        return a
    assert batch.relax_lambda is not None and batch.posterior_threshold is not None
    assert batch.posterior_alpha is not None
    rule = batch.relax_rule.long()[:, None, None]
    lam = batch.relax_lambda.float()[:, None, None]
    lenient = (ratio_of / lam).clamp(max=1.0)
    entropy = torch.special.entr(p_soft).sum(-1, keepdim=True)
    alpha = batch.posterior_alpha.float()[:, None, None]
    tau = torch.minimum(batch.posterior_threshold.float()[:, None, None], alpha * torch.exp(-entropy))
    typical = torch.where(p_soft > tau, torch.ones_like(lossless), lossless)
    ruled = torch.where(rule == RULE_LENIENT, lenient, typical)
    ruled = torch.where(relax & ~greedy, ruled, lossless)  # the new rules never relax a greedy row
    return torch.where(rule == RULE_TOPK_RATIO, a, ruled)
