"""The bounded-distortion relaxation rules (lenient, typical) in the torch reference: the emitted
distribution against its analytic pi (docs/ACCEPTANCE.md), their lossless limits, greedy rows, and
that topk_ratio rows are unchanged beside them. The Triton kernels' cases are in
test_rejection_triton.py (test_interp_rule_distributions)."""

from __future__ import annotations

import math

import pytest
import torch
from distributions import (
    chi2_pvalue,
    dist_setup,
    lenient_acceptance,
    pi_from_acceptance,
    relaxed_set,
    tv_distance,
    typical_acceptance,
    typical_set,
)

from thinkspec.sampling.rejection import AcceptanceBatch, implied_tv, rejection_sample_reference
from thinkspec.sampling.rejection_common import RULE_LENIENT, RULE_TOPK_RATIO, RULE_TYPICAL

NAN = float("nan")
N = 200_000
P_FLOOR = 1e-4
TEMP = 0.8


def _batch(logits, drafts, q, *, temp=TEMP, rule=RULE_LENIENT, lam=1.0, eps=0.0, alpha=0.0, relax=True, **kw):
    """One draft per request; logits [V] shared by every row, drafts [B], q [V] or None (one-hot)."""
    b, v = drafts.numel(), logits.numel()
    return AcceptanceBatch(
        target_logits=logits.expand(b, 2, v).contiguous(), draft_token_ids=drafts[:, None],
        num_draft_tokens=torch.ones(b, dtype=torch.long), relax_mask=torch.full((b, 1), relax),
        temperature=torch.full((b,), temp), relax_ratio=torch.full((b,), 0.15),
        relax_top_k=torch.full((b,), 3, dtype=torch.long), relax_delta=torch.full((b,), NAN),
        draft_probs=None if q is None else q.float().expand(b, 1, v).contiguous(),
        **({} if rule is None else dict(
            relax_rule=torch.full((b,), rule, dtype=torch.long), relax_lambda=torch.full((b,), lam),
            posterior_threshold=torch.full((b,), eps), posterior_alpha=torch.full((b,), alpha),
        )), **kw,
    )  # fmt: skip


def _sample(seed=0, **kw):
    logits, p, q = dist_setup(seed=2)
    drafts = torch.multinomial(q.float(), N, replacement=True, generator=torch.Generator().manual_seed(seed))
    res = rejection_sample_reference(_batch(logits, drafts, q, **kw), torch.Generator().manual_seed(seed + 1))
    assert res.output_token_ids.shape == (N, 2)
    return res, drafts, p, q


@pytest.mark.parametrize("lam", [0.5, 0.3])
def test_lenient_sampling_yields_pi(lam):
    res, drafts, p, q = _sample(seed=41, rule=RULE_LENIENT, lam=lam)
    acc_p = lenient_acceptance(p, q, lam)
    pi = pi_from_acceptance(p, q, acc_p)
    assert tv_distance(pi, p) > 0.1  # this setting moves pi visibly, so the power check means something
    out = res.output_token_ids[:, 0]
    assert chi2_pvalue(out, pi) > P_FLOOR
    assert chi2_pvalue(out, p) < 1e-12  # power: p itself is rejected
    # Power: the seed rule's pi (everything relaxable accepted) is rejected too.
    assert chi2_pvalue(out, pi_from_acceptance(p, q, torch.ones_like(p))) < 1e-12
    acc = res.num_accepted == 1
    assert abs(acc.double().mean().item() - float((q * acc_p).sum())) < 5 / math.sqrt(N)
    assert torch.equal(out[acc], drafts[acc])
    # Flags: only accepted drafts, and only those lossless could reject (p(d) < q(d)).
    assert not (res.relaxed_accepted[:, 0] & ~acc).any()
    assert not res.relaxed_accepted[p[drafts] >= q[drafts], 0].any()
    assert res.relaxed_accepted.any()


def test_lenient_lambda_one_is_lossless():
    res, _, p, q = _sample(seed=43, rule=RULE_LENIENT, lam=1.0)
    out = res.output_token_ids[:, 0]
    assert chi2_pvalue(out, p) > P_FLOOR
    assert chi2_pvalue(out, q) < 1e-12
    assert not res.relaxed_accepted.any()


@pytest.mark.parametrize("eps, alpha", [(0.09, 0.3), (0.1, 0.4)])
def test_typical_sampling_yields_pi(eps, alpha):
    res, drafts, p, q = _sample(seed=45, rule=RULE_TYPICAL, eps=eps, alpha=alpha)
    inside = typical_set(p, eps, alpha)
    assert inside[1] and not inside.all()  # q's favourite is typical; not every token is
    pi = pi_from_acceptance(p, q, typical_acceptance(p, q, eps, alpha))
    out = res.output_token_ids[:, 0]
    assert chi2_pvalue(out, pi) > P_FLOOR
    assert chi2_pvalue(out, p) < 1e-12  # power
    acc = res.num_accepted == 1
    assert acc[inside[drafts]].all()  # typical drafts are always accepted
    assert torch.equal(res.relaxed_accepted[:, 0] & ~inside[drafts], torch.zeros(N, dtype=torch.bool))


@pytest.mark.parametrize("alpha, token, always", [(0.36, 1, True), (0.15, 3, False)])
def test_typical_threshold_follows_the_entropy(alpha, token, always):
    # The threshold is min(eps, alpha * exp(-H(p))) with H in nats: these alphas put it just below
    # p(1) and just above p(3), both drafts with p < q, so only the entropy term decides.
    logits, p, q = dist_setup(seed=2)
    assert typical_set(p, 0.2, alpha)[token] == always and p[token] < q[token]
    drafts = torch.full((400,), token)
    res = rejection_sample_reference(
        _batch(logits, drafts, q, rule=RULE_TYPICAL, eps=0.2, alpha=alpha), torch.Generator().manual_seed(9)
    )
    acc = res.num_accepted == 1
    assert bool(acc.all()) == always and acc.any()


def test_typical_lossless_limit_and_most_lenient_limit():
    # Threshold 1 with alpha large enough that alpha * exp(-H) >= 1: no token passes, pi = p.
    res, _, p, q = _sample(seed=47, rule=RULE_TYPICAL, eps=1.0, alpha=1e6)
    out = res.output_token_ids[:, 0]
    assert chi2_pvalue(out, p) > P_FLOOR
    assert not res.relaxed_accepted.any()
    # Threshold 0 (vLLM's epsilon -> 0) is the other end: every draft with p(d) > 0 is accepted.
    res, drafts, p, q = _sample(seed=48, rule=RULE_TYPICAL, eps=0.0, alpha=0.3)
    assert torch.equal(res.num_accepted == 1, p[drafts] > 0)


def test_outside_relax_mask_rules_are_lossless():
    res, _, p, _ = _sample(seed=49, rule=RULE_LENIENT, lam=0.3, relax=False)
    assert chi2_pvalue(res.output_token_ids[:, 0], p) > P_FLOOR
    assert not res.relaxed_accepted.any()


@pytest.mark.parametrize("rule", [RULE_LENIENT, RULE_TYPICAL])
def test_greedy_rows_are_strict_under_the_new_rules(rule):
    logits, p, _ = dist_setup(seed=2)
    drafts = torch.arange(5)  # every finite token once; the argmax is token 4
    res = rejection_sample_reference(_batch(logits, drafts, None, temp=0.0, rule=rule, lam=0.01, eps=0.0))
    assert res.num_accepted.tolist() == [int(d == int(logits.argmax())) for d in drafts]
    assert not res.relaxed_accepted.any()
    # The seed rule does relax here: the same drafts under topk_ratio accept more.
    top = rejection_sample_reference(_batch(logits, drafts, None, temp=0.0, rule=RULE_TOPK_RATIO))
    assert int(top.num_accepted.sum()) > int(res.num_accepted.sum())


def test_topk_ratio_rows_are_unchanged_beside_rule_fields():
    logits, p, q = dist_setup(seed=2)
    drafts = torch.multinomial(q.float(), 4000, replacement=True, generator=torch.Generator().manual_seed(5))
    plain = rejection_sample_reference(_batch(logits, drafts, q, rule=None), torch.Generator().manual_seed(6))
    coded = rejection_sample_reference(
        _batch(logits, drafts, q, rule=RULE_TOPK_RATIO, lam=0.2), torch.Generator().manual_seed(6)
    )
    assert plain.output_token_ids.shape == (4000, 2)
    assert torch.equal(plain.output_token_ids, coded.output_token_ids)
    assert torch.equal(plain.relaxed_accepted, coded.relaxed_accepted)
    assert relaxed_set(logits, TEMP, 0.15, 3, NAN)[1] and plain.relaxed_accepted.any()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("relax_lambda", 0.0, r"relax_lambda must be in \(0, 1\]"),
        ("relax_lambda", 1.5, r"relax_lambda must be in \(0, 1\]"),
        ("posterior_threshold", -0.1, r"posterior_threshold must be in \[0, 1\]"),
        ("posterior_alpha", float("inf"), "posterior_alpha must be finite and >= 0"),
        ("relax_rule", 3, r"relax_rule must be in \[0, 2\]"),
    ],
)
def test_bad_rule_values_raise(field, value, match):
    logits, _, q = dist_setup()
    batch = _batch(logits, torch.tensor([0, 1]), q, lam=0.5)
    dtype = torch.long if field == "relax_rule" else torch.float32
    fields = {f: getattr(batch, f) for f in batch.__slots__}
    bad = AcceptanceBatch(**{**fields, field: torch.full((2,), value, dtype=dtype)})
    with pytest.raises(ValueError, match=match):
        rejection_sample_reference(bad)


def test_rule_fields_come_together():
    logits, _, q = dist_setup()
    batch = _batch(logits, torch.tensor([0, 1]), q, lam=0.5)
    with pytest.raises(ValueError, match="must be given together"):
        AcceptanceBatch(**{**{f: getattr(batch, f) for f in batch.__slots__}, "posterior_alpha": None})


@pytest.mark.parametrize(
    "rule, kw, acceptance",
    [
        (RULE_LENIENT, dict(lam=0.5), lambda p, q: lenient_acceptance(p, q, 0.5)),
        (RULE_TYPICAL, dict(eps=0.09, alpha=0.3), lambda p, q: typical_acceptance(p, q, 0.09, 0.3)),
        (RULE_TOPK_RATIO, {}, lambda p, q: torch.where(
            relaxed_set(*dist_setup(seed=2)[:1], TEMP, 0.15, 3, NAN), torch.ones_like(p), (p / q).clamp(max=1)
        )),
        (RULE_LENIENT, dict(lam=1.0), lambda p, q: (p / q).clamp(max=1)),
    ],
)  # fmt: skip
def test_implied_tv_matches_the_analytic_pi(rule, kw, acceptance):
    logits, p, q = dist_setup(seed=2)
    batch = _batch(logits, torch.tensor([0, 1, 4]), q, rule=rule, **kw)
    tv = implied_tv(batch)
    assert tv.shape == (3, 1)
    want = tv_distance(pi_from_acceptance(p, q, acceptance(p, q)), p)
    assert torch.allclose(tv, torch.full((3, 1), want, dtype=torch.float32), atol=1e-5)
    assert (want == 0) == (rule == RULE_LENIENT and kw["lam"] == 1.0)


def test_implied_tv_greedy_and_padding():
    logits, _, _ = dist_setup(seed=2)
    drafts = torch.arange(5)  # argmax is 4
    top = implied_tv(_batch(logits, drafts, None, temp=0.0, rule=RULE_TOPK_RATIO))
    relaxed = relaxed_set(logits, 1.0, 0.15, 3, NAN)[:5]
    assert top[:, 0].tolist() == [float(relaxed[i] and i != 4) for i in range(5)] and top.sum() > 0
    assert implied_tv(_batch(logits, drafts, None, temp=0.0, rule=RULE_LENIENT, lam=0.1)).sum() == 0
    batch = _batch(logits, drafts, None, temp=0.0, rule=RULE_TOPK_RATIO)
    padded = AcceptanceBatch(
        **{
            **{f: getattr(batch, f) for f in batch.__slots__},
            "num_draft_tokens": torch.zeros(5, dtype=torch.long),
        }
    )
    assert implied_tv(padded).abs().sum() == 0
