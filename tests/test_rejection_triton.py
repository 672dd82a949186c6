"""Triton acceptance kernels against the torch reference.

On CPU the kernels run under the Triton interpreter. Triton reads TRITON_INTERPRET when a kernel is
decorated, so the interpreter cases run in a child pytest process that sets it
(`test_kernels_under_interpreter`, and `test_sampling_distributions_under_interpreter` for the slow
sampled-distribution cases); run them directly with
`TRITON_INTERPRET=1 pytest tests/test_rejection_triton.py -k test_interp_`. GPU cases are marked `gpu`.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable")

from distributions import (  # noqa: E402
    acceptance_probability,
    chi2_pvalue,
    dist_setup,
    lenient_acceptance,
    pi_distribution,
    pi_from_acceptance,
    relaxed_set,
    typical_acceptance,
    typical_set,
)
from scipy.stats import binomtest  # noqa: E402
from triton_interpreter import interp, parent_only, run_interpreter_cases  # noqa: E402

from thinkspec.sampling import rejection_triton as rt  # noqa: E402
from thinkspec.sampling.rejection import (  # noqa: E402
    AcceptanceBatch,
    rejection_sample,
    rejection_sample_reference,
)

NAN = float("nan")
NEG_INF = float("-inf")


@parent_only
def test_kernels_under_interpreter():
    run_interpreter_cases(__file__, "test_interp_ and not test_interp_sampling_distributions")


@parent_only
@pytest.mark.slow
def test_sampling_distributions_under_interpreter():
    run_interpreter_cases(__file__, "test_interp_sampling_distributions")


# ---------------------------------------------------------------- shared input builders


def _ref(**kw):
    return rejection_sample_reference(AcceptanceBatch(**kw))


def _tri(validate=False, **kw):
    return rt.rejection_sample_triton(AcceptanceBatch(**kw), validate=validate)


def _rs(generator=None, use_triton=None, **kw):
    return rejection_sample(AcceptanceBatch(**kw), generator, use_triton=use_triton)


def _greedy_batch(gen, b, k, v, *, n=None, integer=True):
    """Random greedy batch with ties (integer logits), -inf entries and padding rows."""
    if integer:
        logits = torch.randint(-3, 4, (b, k + 1, v), generator=gen).float()
    else:
        logits = torch.randn(b, k + 1, v, generator=gen)
    drop = torch.rand(b, k + 1, v, generator=gen) < 0.2
    drop[..., 0] = False  # at least one finite entry per row
    logits[drop] = NEG_INF
    drafts = torch.where(
        torch.rand(b, k, generator=gen) < 0.6,
        logits[:, :k].argmax(-1),
        torch.randint(0, v, (b, k), generator=gen),
    )
    if n is None:
        n = torch.randint(0, k + 1, (b,), generator=gen)
    for r in range(b):  # padding: garbage ids and NaN rows past num_draft_tokens
        drafts[r, int(n[r]) :] = -1
        logits[r, int(n[r]) + 1 :] = NAN
    return dict(
        target_logits=logits,
        draft_token_ids=drafts,
        num_draft_tokens=n,
        relax_mask=torch.rand(b, k, generator=gen) < 0.7,
        temperature=torch.zeros(b),
        relax_ratio=torch.tensor([0.0, 0.1, 0.3, 0.5, 0.9, 1.0])[torch.randint(0, 6, (b,), generator=gen)],
        relax_top_k=torch.randint(1, 5, (b,), generator=gen),
        relax_delta=torch.tensor([NAN, 0.0, 0.05, 0.2, 0.5, 1.0])[torch.randint(0, 6, (b,), generator=gen)],
    )


def _assert_same(a, b, rows=None, b_rows=None):
    """Results a[rows] and b[b_rows] (b_rows defaults to rows) are identical."""
    rows = slice(None) if rows is None else rows
    b_rows = rows if b_rows is None else b_rows
    rows, b_rows = (r.cpu() if isinstance(r, torch.Tensor) else r for r in (rows, b_rows))
    for name in ("output_token_ids", "num_accepted", "relaxed_accepted"):
        assert torch.equal(getattr(a, name).cpu()[rows], getattr(b, name).cpu()[b_rows]), name


def _check_structure(res, kw):
    out, acc = res.output_token_ids.cpu(), res.num_accepted.cpu()
    drafts, n = kw["draft_token_ids"].cpu(), kw["num_draft_tokens"].cpu()
    v = kw["target_logits"].shape[-1]
    for r in range(out.shape[0]):
        j = int(acc[r])
        assert 0 <= j <= int(n[r])
        assert out[r, :j].tolist() == drafts[r, :j].tolist()
        assert 0 <= int(out[r, j]) < v
        assert (out[r, j + 1 :] == -1).all()
        assert not res.relaxed_accepted[r, j:].any()


# ---------------------------------------------------------------- interpreter (CPU) cases


@pytest.fixture(params=[(1, True), (4, True), (4, False)], ids=["vec1", "vec4", "vec4-2launches"])
def small_tiles(monkeypatch, request):
    # Tiny tiles so small vocabularies still span several tiles per row, and several chunks of
    # several tiles each in the streamed stats pass; each case with 1 and 4 entries per lane, and
    # the accept logic both fused into the stats launch and as its own launch.
    vec, fuse = request.param
    monkeypatch.setattr(rt, "MAX_TILE", 8)
    monkeypatch.setattr(rt, "STATS_TILE", 8)
    monkeypatch.setattr(rt, "STATS_VEC", vec)
    monkeypatch.setattr(rt, "FUSE_ACCEPT", fuse)


@interp
@pytest.mark.parametrize("k, v", [(1, 1), (3, 5), (4, 37)])
def test_interp_greedy_matches_reference(small_tiles, k, v):
    gen = torch.Generator().manual_seed(100 * k + v)
    kw = _greedy_batch(gen, 10, k, v)
    _assert_same(_tri(**kw), _ref(**kw))
    _assert_same(_tri(**kw), _ref(**kw))  # counts were reset
    for buf in rt._COUNTERS.get(torch.device("cpu"), []):
        assert not buf.any()


@interp
def test_interp_many_chunks_per_row(small_tiles):
    # More chunk partials per row than the accept step reduces at once (NC_BLOCK): its running
    # max / lowest index / count / sum-exp merge across blocks, with ties and deltas in play.
    gen = torch.Generator().manual_seed(77)
    _, nc, _ = rt._stats_split(1 * 2, 400, torch.device("cpu"))
    assert nc > rt.NC_BLOCK
    for _ in range(3):
        kw = _greedy_batch(gen, 1, 1, 400, n=torch.ones(1, dtype=torch.long))
        _assert_same(_tri(**kw), _ref(**kw))


@interp
def test_interp_greedy_strict_equals_argmax_and_all_greedy_flag(small_tiles):
    gen = torch.Generator().manual_seed(5)
    kw = _greedy_batch(gen, 8, 3, 19, integer=False)
    kw["relax_mask"][:] = False
    res = _tri(**kw, all_greedy=True)
    _assert_same(res, _ref(**kw))
    assert not res.relaxed_accepted.any()


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interp_half_logits(small_tiles, dtype):
    gen = torch.Generator().manual_seed(9)
    kw = _greedy_batch(gen, 6, 2, 21)
    kw["target_logits"] = kw["target_logits"].to(dtype)
    _assert_same(_tri(**kw), _ref(**kw))


@interp
def test_interp_zero_drafts_and_k0(small_tiles):
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0, NEG_INF, 2.0, 0.5, 0.0, 1.0, 2.0]]])  # [1, 1, 10], K = 0
    kw = dict(
        target_logits=logits, draft_token_ids=torch.zeros(1, 0, dtype=torch.long),
        num_draft_tokens=torch.zeros(1, dtype=torch.long), relax_mask=torch.zeros(1, 0, dtype=torch.bool),
        temperature=torch.zeros(1), relax_ratio=torch.ones(1), relax_top_k=torch.ones(1, dtype=torch.long),
        relax_delta=torch.full((1,), NAN),
    )  # fmt: skip
    res = _tri(**kw)
    assert res.output_token_ids.tolist() == [[1]] and res.num_accepted.tolist() == [0]
    kw["temperature"] = torch.ones(1)
    res = _tri(**kw, seeds=torch.tensor([3]))
    assert res.num_accepted.tolist() == [0] and 0 <= int(res.output_token_ids[0, 0]) < 10
    assert int(res.output_token_ids[0, 0]) != 4  # -inf token


def _sampled_batch(gen, b, k, v):
    kw = _greedy_batch(gen, b, k, v, integer=False)
    kw["temperature"] = torch.rand(b, generator=gen) + 0.5
    kw["temperature"][::3] = 0.0  # every third request greedy
    kw["draft_probs"] = torch.softmax(torch.randn(b, k, v, generator=gen), -1)
    return kw


@interp
@pytest.mark.parametrize("with_q", [True, False])
def test_interp_mixed_batch(small_tiles, with_q):
    gen = torch.Generator().manual_seed(21 + with_q)
    kw = _sampled_batch(gen, 9, 3, 13)
    if not with_q:
        kw["draft_probs"] = None
    seeds = torch.arange(9) * 7919
    res = _tri(**kw, seeds=seeds, seed_offset=5)
    greedy = kw["temperature"] == 0
    _assert_same(res, _ref(**kw), rows=greedy)
    _check_structure(res, kw)
    # Deterministic per seed, and independent of the rest of the batch.
    again = _tri(**kw, seeds=seeds, seed_offset=5)
    _assert_same(res, again)
    perm = torch.tensor([4, 2, 7])
    sub = {name: (t[perm] if t is not None else None) for name, t in kw.items()}
    _assert_same(_tri(**sub, seeds=seeds[perm], seed_offset=5), res, b_rows=perm)


@interp
def test_interp_sampled_deterministic_cases(small_tiles):
    b, k, v = 6, 2, 12
    logits = torch.full((b, k + 1, v), NEG_INF)
    logits[:, :, 3] = 1.0  # p = one_hot(3) on every row
    logits[:, 2, 9] = 0.0  # row 2 (bonus of request 1 when both drafts accepted) has two tokens
    drafts = torch.tensor([[3, 3], [5, 3], [3, 3], [3, 3], [3, 3], [3, 3]])
    kw = dict(
        target_logits=logits, draft_token_ids=drafts, num_draft_tokens=torch.tensor([2, 2, 1, 0, 2, 1]),
        relax_mask=torch.zeros(b, k, dtype=torch.bool), temperature=torch.full((b,), 0.7),
        relax_ratio=torch.zeros(b), relax_top_k=torch.full((b,), v), relax_delta=torch.full((b,), NAN),
    )  # fmt: skip
    res = _tri(**kw, seeds=torch.arange(b))
    out = res.output_token_ids
    # p(d) = 1 = q(d): always accepted. Request 1 drafts 5 (p = 0): rejected, residual = p -> 3.
    assert res.num_accepted.tolist() == [2, 0, 1, 0, 2, 1]
    assert out[1].tolist() == [3, -1, -1]
    assert out[2].tolist() == [3, 3, -1] and out[3].tolist() == [3, -1, -1] and out[5].tolist() == [3, 3, -1]
    assert int(out[0, 2]) in (3, 9) and int(out[4, 2]) in (3, 9)
    assert not res.relaxed_accepted.any()
    # Relaxation on with ratio 0, top_k V: a draft with p(d) > 0 always passes; -inf drafts never do.
    logits[:, :, 7] = -5.0
    drafts[:, 0] = torch.tensor([7, 5, 7, 7, 7, 7])
    kw["relax_mask"][:] = True
    kw["draft_probs"] = torch.full((b, k, v), 1.0 / v)
    res = _tri(**kw, seeds=torch.arange(b))
    assert res.num_accepted.tolist() == [2, 0, 1, 0, 2, 1]
    assert res.output_token_ids[:, 0].tolist() == [7, 3, 7, 3, 7, 7]
    # p(7) < q(7) = 1/12, so the relaxed acceptances are flagged; p(3) > q(3) are not.
    assert res.relaxed_accepted.tolist() == [[True, False], [False, False], [True, False], [False, False],
                                             [True, False], [True, False]]  # fmt: skip


@interp
@pytest.mark.parametrize("with_q", [False, True])
def test_interp_residual_excludes_rejected_mass(small_tiles, with_q):
    # p = 1/2 on tokens 3 and 9 (different tiles); draft 3. On rejection the residual max(0, p - q)
    # has mass on 9 only, so a rejected request must emit 9.
    b, v = 16, 12
    logits = torch.full((b, 2, v), NEG_INF)
    logits[:, :, 3] = 0.0
    logits[:, :, 9] = 0.0
    q = torch.zeros(b, 1, v)
    q[:, 0, 3], q[:, 0, 9] = (1.0, 0.0) if not with_q else (0.8, 0.2)
    kw = dict(
        target_logits=logits, draft_token_ids=torch.full((b, 1), 3),
        num_draft_tokens=torch.ones(b, dtype=torch.long),
        relax_mask=torch.zeros(b, 1, dtype=torch.bool), temperature=torch.ones(b), relax_ratio=torch.ones(b),
        relax_top_k=torch.ones(b, dtype=torch.long), relax_delta=torch.full((b,), NAN),
        draft_probs=q if with_q else None,
    )  # fmt: skip
    res = _tri(**kw, seeds=torch.arange(b) + 1000)
    rejected = res.num_accepted == 0
    assert 0 < int(rejected.sum()) < b
    assert (res.output_token_ids[rejected, 0] == 9).all()
    assert (res.output_token_ids[~rejected, 0] == 3).all()
    bonus = res.output_token_ids[~rejected, 1].tolist()
    assert set(bonus) <= {3, 9}


@interp
def test_interp_dispatch_and_validate(small_tiles):
    gen = torch.Generator().manual_seed(2)
    kw = _greedy_batch(gen, 4, 2, 9)
    _assert_same(_rs(**kw, use_triton=True), _ref(**kw))
    kw["target_logits"][0, 0, 0] = NAN
    kw["num_draft_tokens"][0] = 1
    kw["draft_token_ids"][0, 0] = 0
    with pytest.raises(ValueError, match="NaN"):
        _tri(**kw, validate=True)
    kw["target_logits"][0, :2] = 0.0
    with pytest.raises(ValueError, match="all_greedy"):
        _tri(**{**kw, "temperature": torch.ones(4)}, all_greedy=True, validate=True)


# Requests per case: the interpreter runs four programs per request in Python (~50 ms a request on
# a 2-core machine), so the GPU case's 400,000 samples are out of reach. The exact checks below
# (accepted drafts kept, residual support, relaxed drafts always accepted, flags) catch a broken path
# on any sample; the statistical ones are sized for gross errors (see the power checks).
N_INTERP = 150


@interp
@pytest.mark.parametrize("relax", [False, True])
def test_interp_sampling_distributions(relax):
    temp, ratio, top_k = 0.8, 0.15, 3
    logits, p, q = dist_setup(seed=2)  # the distributions of test_rejection.py's relaxed case
    relaxed = relaxed_set(logits, temp, ratio, top_k, NAN) & relax  # [V] bool
    assert relaxed[1] == relax  # token 1: q's favourite, relaxable
    want = pi_distribution(p, q, relaxed) if relax else p
    n = N_INTERP
    drafts = torch.multinomial(q.float(), n, replacement=True, generator=torch.Generator().manual_seed(3))
    kw = dict(
        target_logits=logits.expand(n, 2, -1).contiguous(), draft_token_ids=drafts[:, None],
        num_draft_tokens=torch.ones(n, dtype=torch.long), relax_mask=torch.full((n, 1), relax),
        temperature=torch.full((n,), temp), relax_ratio=torch.full((n,), ratio),
        relax_top_k=torch.full((n,), top_k, dtype=torch.long), relax_delta=torch.full((n,), NAN),
        draft_probs=q.float().expand(n, 1, -1).contiguous(),
    )  # fmt: skip
    res = _tri(**kw, seeds=torch.arange(n) + 17)
    out = res.output_token_ids[:, 0]  # [N]
    acc = res.num_accepted == 1  # [N] bool
    # Exact: accepted drafts are kept; a rejected draft is replaced by a token of the residual
    # max(0, p - q); relaxable drafts are always accepted, and flagged where p(d) < q(d).
    assert torch.equal(out[acc], drafts[acc])
    residual = (p - q).clamp_min(0)
    assert (residual[out[~acc]] > 0).all(), "a rejected draft was replaced outside the residual"
    assert acc[relaxed[drafts]].all()
    assert torch.equal(res.relaxed_accepted[:, 0], acc & relaxed[drafts] & (p[drafts] < q[drafts]))
    # Statistical: acceptance count, emitted token ~ pi (= p when lossless), bonus token ~ p.
    assert binomtest(int(acc.sum()), n, acceptance_probability(p, q, relaxed)).pvalue > 1e-4
    assert chi2_pvalue(out, want) > 1e-4
    if relax:
        assert chi2_pvalue(out, p) < 1e-12  # power: these samples tell pi from p
    else:
        assert chi2_pvalue(out, q) < 1e-6  # power: and p from the draft distribution
    assert chi2_pvalue(res.output_token_ids[acc, 1], p) > 1e-4


def _rule_kw(n, rule, lam, eps, alpha, temp=0.8):
    """The relaxed-distribution case's inputs (dist_setup(seed=2), q-distributed drafts) under a rule."""
    logits, p, q = dist_setup(seed=2)
    drafts = torch.multinomial(q.float(), n, replacement=True, generator=torch.Generator().manual_seed(3))
    kw = dict(
        target_logits=logits.expand(n, 2, -1).contiguous(), draft_token_ids=drafts[:, None],
        num_draft_tokens=torch.ones(n, dtype=torch.long), relax_mask=torch.ones(n, 1, dtype=torch.bool),
        temperature=torch.full((n,), temp), relax_ratio=torch.full((n,), 0.15),
        relax_top_k=torch.full((n,), 3, dtype=torch.long), relax_delta=torch.full((n,), NAN),
        draft_probs=q.float().expand(n, 1, -1).contiguous(), relax_rule=torch.full((n,), rule),
        relax_lambda=torch.full((n,), float(lam)), posterior_threshold=torch.full((n,), float(eps)),
        posterior_alpha=torch.full((n,), float(alpha)),
    )  # fmt: skip
    return kw, drafts, p, q


@interp
def test_interp_rules_exact(small_tiles):
    # Typical drafts always accepted, nothing else flagged; greedy rows strict; lambda = 1 flags nothing.
    kw, drafts, p, q = _rule_kw(40, 2, 1.0, 0.09, 0.3)
    res = _tri(**kw, seeds=torch.arange(40) + 5, validate=True)
    inside = typical_set(p, 0.09, 0.3)
    assert res.output_token_ids.shape == (40, 2)
    assert (res.num_accepted[inside[drafts]] == 1).all() and inside[drafts].any()
    assert not (res.relaxed_accepted[:, 0] & ~inside[drafts]).any()
    kw, drafts, p, q = _rule_kw(40, 1, 1.0, 0.0, 0.0)
    assert not _tri(**kw, seeds=torch.arange(40)).relaxed_accepted.any()
    # The entropy term decides: at (0.2, 0.36) token 1 (p < q) is typical only through
    # delta * exp(-H) < p(1); at (0.2, 0.15) token 3 (p < q) is not, and then is accepted w.p. p / q.
    for alpha, token, always in [(0.36, 1, True), (0.15, 3, False)]:
        assert typical_set(p, 0.2, alpha)[token] == always
        kw, _, _, _ = _rule_kw(24, 2, 1.0, 0.2, alpha)
        kw["draft_token_ids"] = torch.full((24, 1), token)
        acc = _tri(**kw, seeds=torch.arange(24) + 1).num_accepted
        assert bool((acc == 1).all()) == always and (acc == 1).any()
    kw, drafts, p, q = _rule_kw(40, 1, 0.01, 0.0, 0.0, temp=0.0)
    res = _tri(**kw, all_greedy=True)
    assert torch.equal(res.num_accepted, (drafts == 4).long()) and not res.relaxed_accepted.any()


@interp
@pytest.mark.parametrize("rule, lam, eps, alpha", [(1, 0.3, 0.0, 0.0), (2, 1.0, 0.09, 0.3)])
def test_interp_sampling_distributions_rules(rule, lam, eps, alpha):
    n = N_INTERP
    kw, drafts, p, q = _rule_kw(n, rule, lam, eps, alpha)
    acc_p = lenient_acceptance(p, q, lam) if rule == 1 else typical_acceptance(p, q, eps, alpha)
    want = pi_from_acceptance(p, q, acc_p)
    res = _tri(**kw, seeds=torch.arange(n) + 29)
    out = res.output_token_ids[:, 0]  # [N]
    acc = res.num_accepted == 1
    assert torch.equal(out[acc], drafts[acc])
    assert ((p - q).clamp_min(0)[out[~acc]] > 0).all(), "a rejected draft was replaced outside the residual"
    assert binomtest(int(acc.sum()), n, float((q * acc_p).sum())).pvalue > 1e-4
    assert chi2_pvalue(out, want) > 1e-4
    assert chi2_pvalue(out, p) < 1e-6  # power: these samples tell pi from p


# ---------------------------------------------------------------- GPU cases (real sizes)

gpu = pytest.mark.gpu


def _near_boundary(kw) -> torch.Tensor:
    """[B] bool: requests whose relaxed test at a used position is within rounding of a threshold."""
    x = kw["target_logits"].double().cpu()
    b, k1, v = x.shape
    k = k1 - 1
    t = kw["temperature"].double().cpu()
    x = x / torch.where(t == 0, 1.0, t)[:, None, None]
    m = x.amax(-1)
    lse = torch.logsumexp(x, -1)
    d = kw["draft_token_ids"].cpu().clamp(0, v - 1)
    xd = x[:, :k].gather(-1, d[..., None])[..., 0]
    used = torch.arange(k)[None] < kw["num_draft_tokens"].cpu()[:, None]
    ratio = torch.exp(xd - m[:, :k]) - kw["relax_ratio"].double().cpu()[:, None]
    pmax_minus_pd = torch.exp(m[:, :k] - lse[:, :k]) - torch.exp(xd - lse[:, :k])
    delta = pmax_minus_pd - kw["relax_delta"].double().cpu()[:, None]
    near = (ratio.abs() < 1e-5) & (ratio != 0)
    near |= (delta.abs() < 1e-5).nan_to_num(False) & (xd != m[:, :k])
    return (near & used).any(-1)


def _cuda(kw):
    return {name: (t.cuda() if isinstance(t, torch.Tensor) else t) for name, t in kw.items()}


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k, v", [(1, 1), (2, 7), (4, 1000), (8, 32000), (16, 151936), (3, 262144)])
def test_gpu_greedy_matches_reference(dtype, k, v):
    gen = torch.Generator().manual_seed(k * 1_000_003 + v)
    b = 24 if v < 100_000 else 6
    kw = _greedy_batch(gen, b, k, v)
    kw["target_logits"] = kw["target_logits"].to(dtype)
    want = _ref(**kw)
    got = _rs(**_cuda(kw))
    assert got.output_token_ids.is_cuda
    keep = ~_near_boundary(kw)
    assert keep.float().mean() > 0.8
    _assert_same(got, want, rows=keep)


@gpu
@pytest.mark.parametrize("v", [50, 151936])
def test_gpu_mixed_batch_and_seeds(v):
    gen = torch.Generator().manual_seed(v)
    kw = _sampled_batch(gen, 12, 5, v)
    want = _ref(**kw)
    kwc = _cuda(kw)
    seeds = torch.arange(12, device="cuda") * 31
    res = _rs(**kwc, seeds=seeds, seed_offset=2)
    greedy = kw["temperature"] == 0
    keep = greedy & ~_near_boundary(kw)
    _assert_same(res, want, rows=keep)
    _check_structure(res, kw)
    _assert_same(res, _rs(**kwc, seeds=seeds, seed_offset=2))
    perm = torch.tensor([11, 3, 4])
    sub = {name: t[perm.to(t.device)] for name, t in kwc.items()}
    _assert_same(_rs(**sub, seeds=seeds[perm.cuda()], seed_offset=2), res, b_rows=perm.cuda())


N_GPU = 400_000


@gpu
@pytest.mark.parametrize("relax", [False, True])
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
def test_gpu_sampling_distributions(relax, logit_dtype):
    temp, ratio, top_k, v = 0.8, 0.15, 3, 6
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(v, generator=gen)
    logits[v - 1] = NEG_INF
    logits = logits.to(logit_dtype).float()  # the exact values the kernel sees
    p = torch.softmax(logits.double() / temp, -1)
    q = torch.rand(v, generator=gen).double() * 0.1 + 0.05
    q[1] += 0.5
    q /= q.sum()
    x = logits.double() / temp
    rank = (x[None, :] > x[:, None]).sum(-1)
    relaxed = (x > NEG_INF) & (rank < top_k) & (torch.exp(x - x.max()) >= ratio) & relax
    want = pi_distribution(p, q, relaxed) if relax else p
    n = N_GPU
    drafts = torch.multinomial(q.float(), n, replacement=True, generator=gen)
    kw = dict(
        target_logits=logits.to(logit_dtype).cuda().expand(n, 2, v), draft_token_ids=drafts.cuda()[:, None],
        num_draft_tokens=torch.ones(n, dtype=torch.long, device="cuda"),
        relax_mask=torch.full((n, 1), relax, device="cuda"),
        temperature=torch.full((n,), temp, device="cuda"),
        relax_ratio=torch.full((n,), ratio, device="cuda"),
        relax_top_k=torch.full((n,), top_k, dtype=torch.long, device="cuda"),
        relax_delta=torch.full((n,), NAN, device="cuda"),
        draft_probs=q.float().cuda().expand(n, 1, v).contiguous(),
    )  # fmt: skip
    res = _rs(**kw, generator=torch.Generator(device="cuda").manual_seed(7))
    assert chi2_pvalue(res.output_token_ids[:, 0], want) > 1e-4
    if relax:
        assert chi2_pvalue(res.output_token_ids[:, 0], p) < 1e-12
    # Bonus rows (all drafts accepted) come from row 1, which equals row 0 here: also ~ p.
    bonus = res.output_token_ids[res.num_accepted == 1, 1]
    assert chi2_pvalue(bonus, p) > 1e-4


@gpu
@pytest.mark.parametrize("rule, lam, eps, alpha", [(1, 0.5, 0, 0), (1, 1.0, 0, 0), (2, 1.0, 0.2, 0.36)])
def test_gpu_rule_distributions(rule, lam, eps, alpha):
    # The lenient and typical kernels at GPU sample sizes: emitted ~ the analytic pi (p at lambda 1),
    # with the power to tell pi from p; a mixed batch's topk_ratio rows beside them stay lossless.
    n = N_GPU
    kw, drafts, p, q = _rule_kw(n, rule, lam, eps, alpha)
    kw["relax_rule"][: n // 4] = 0  # topk_ratio rows with relax on: the seed rule's pi
    acc_p = lenient_acceptance(p, q, lam) if rule == 1 else typical_acceptance(p, q, eps, alpha)
    res = _rs(**_cuda(kw), generator=torch.Generator(device="cuda").manual_seed(11))
    out = res.output_token_ids[n // 4 :, 0].cpu()
    want = pi_from_acceptance(p, q, acc_p)
    assert out.numel() == n - n // 4
    assert chi2_pvalue(out, want) > 1e-4
    if lam != 1.0 or rule == 2:
        assert chi2_pvalue(out, p) < 1e-12
    seed_pi = pi_distribution(p, q, relaxed_set(dist_setup(seed=2)[0], 0.8, 0.15, 3, NAN))
    assert chi2_pvalue(res.output_token_ids[: n // 4, 0].cpu(), seed_pi) > 1e-4


@gpu
def test_gpu_large_vocab_race_spans_tiles():
    # Six finite tokens spread over a 262,144 vocabulary: the race must combine tiles correctly.
    v, n, temp = 262144, 100_000, 1.0
    ids = torch.tensor([5, 9000, 70000, 140000, 200001, 262143])
    vals = torch.tensor([0.3, -1.0, 1.2, 0.0, 0.8, -0.4])
    row = torch.full((v,), NEG_INF)
    row[ids] = vals
    p_small = torch.softmax(vals.double() / temp, -1)
    d = 70000  # one-hot draft on the most likely token: residual excludes it
    kw = dict(
        target_logits=row.cuda().expand(n, 2, v), draft_token_ids=torch.full((n, 1), d, device="cuda"),
        num_draft_tokens=torch.ones(n, dtype=torch.long, device="cuda"),
        relax_mask=torch.zeros(n, 1, dtype=torch.bool, device="cuda"),
        temperature=torch.full((n,), temp, device="cuda"), relax_ratio=torch.ones(n, device="cuda"),
        relax_top_k=torch.ones(n, dtype=torch.long, device="cuda"),
        relax_delta=torch.full((n,), NAN, device="cuda"),
    )  # fmt: skip
    res = _rs(**kw, seeds=torch.arange(n, device="cuda"))
    first = res.output_token_ids[:, 0].cpu().contiguous()
    assert torch.isin(first, ids).all()
    pos = torch.searchsorted(ids, first)
    assert chi2_pvalue(pos, p_small) > 1e-4  # lossless: the emitted token ~ p
    acc = (res.num_accepted == 1).float().mean().item()
    assert abs(acc - float(p_small[2])) < 5 / math.sqrt(n)


@gpu
def test_gpu_cuda_graph_capture():
    gen = torch.Generator().manual_seed(4)
    kw = _cuda(_sampled_batch(gen, 16, 4, 5000))
    seeds = torch.arange(16, device="cuda")
    static = {name: t.clone() for name, t in kw.items()}
    eager = _rs(**static, seeds=seeds)  # compiles the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _rs(**static, seeds=seeds)
    graph.replay()
    _assert_same(captured, eager)
    fresh = _cuda(_sampled_batch(torch.Generator().manual_seed(5), 16, 4, 5000))
    for name, t in fresh.items():
        static[name].copy_(t)
    graph.replay()
    _assert_same(captured, _rs(**fresh, seeds=seeds))


@gpu
def test_gpu_one_build_across_batch_sizes_and_draft_lengths():
    # The stats pass's chunks per row (NC) follow the row count, and the draft length K the
    # step's choice: a batch whose NC turns 1 (or a multiple of 16), or a K of 16 next to 17 (one
    # K1_P2), must reuse the kernels built for the others, not build a variant in mid-run.
    from thinkspec.engine.compiles import compile_count

    v, dev = 151936, torch.device("cuda")
    by_kind: dict[str, int] = {}  # kind of NC at k = 3 -> the first batch size giving it
    for b in range(1, 1025):
        nc = rt._stats_split(b * 4, v, dev)[1]
        by_kind.setdefault("one" if nc == 1 else "x16" if nc % 16 == 0 else "other", b)
    assert {"one", "other"} <= set(by_kind), by_kind

    def launch(b: int, k: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(b * 100 + k)
        logits = torch.randn(b, k + 1, v, device="cuda", generator=gen).to(torch.bfloat16)
        drafts = logits[:, :k].argmax(-1)
        drafts[::2, 1] = 0  # a rejection in every other request (unless 0 is the argmax)
        kw = dict(
            target_logits=logits,
            draft_token_ids=drafts,
            num_draft_tokens=torch.full((b,), k, device="cuda"),
            relax_mask=torch.zeros(b, k, dtype=torch.bool, device="cuda"),
            temperature=torch.where(torch.arange(b, device="cuda") % 3 == 0, 0.8, 0.0),
            relax_ratio=torch.zeros(b, device="cuda"),
            relax_top_k=torch.ones(b, dtype=torch.int64, device="cuda"),
            relax_delta=torch.full((b,), NAN, device="cuda"),
        )
        res = _rs(**kw, seeds=torch.arange(b, device="cuda"))
        greedy = kw["temperature"] == 0
        strict = (drafts == logits[:, :k].argmax(-1)).cumprod(-1).sum(-1)
        assert torch.equal(res.num_accepted[greedy], strict[greedy])

    launch(by_kind["other"], 3)
    launch(5, 17)
    before = compile_count()
    assert before is not None
    for b in sorted(set(by_kind.values()) - {by_kind["other"]}):
        launch(b, 3)
    launch(5, 16)
    assert compile_count() == before, f"a launch built a new kernel variant (batches by NC kind: {by_kind})"
