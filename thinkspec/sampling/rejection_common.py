"""Inputs, result and input validation shared by the torch reference and the Triton kernels (of
acceptance, and the greedy argmax's output buffer: check_tokens_out).

`AcceptanceBatch` documents the acceptance inputs once; `rejection_sample` and both of its
implementations take one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinkspec.config import RELAX_RULES


@dataclass(frozen=True, slots=True)
class AcceptanceBatch:
    """One verify step's acceptance inputs: B requests, K draft slots each, vocabulary V.

    Shapes, dtypes and devices are checked at construction (metadata only, no device sync); values
    by `check_values` (a sync).
    """

    target_logits: torch.Tensor  # [B, K+1, V] float: row i scores draft i, row num_draft_tokens[b] the bonus
    draft_token_ids: torch.Tensor  # [B, K] int64/int32; positions >= num_draft_tokens[b] are padding
    num_draft_tokens: torch.Tensor  # [B] int64/int32 in [0, K]
    relax_mask: torch.Tensor  # [B, K] bool: the relaxed test is allowed here (phase, protected tokens)
    temperature: torch.Tensor  # [B] float: 0 = greedy; > 0 = sampled (rows already top-k/top-p filtered)
    relax_ratio: torch.Tensor  # [B] float in [0, 1]
    relax_top_k: torch.Tensor  # [B] int64/int32 >= 1
    relax_delta: torch.Tensor  # [B] float in [0, 1], NaN = unset
    draft_probs: torch.Tensor | None = None  # [B, K, V] float draft distribution q; None: q = one_hot(draft)
    seeds: torch.Tensor | None = None  # [B] int64 per-request seeds; None: draws come from the generator
    seed_offset: int = 0  # per-step offset mixed into every request's stream
    all_greedy: bool | None = None  # True promises every temperature is 0: kernels skip the sampling launches
    # The bounded-distortion rules (docs/ACCEPTANCE.md); all four None = every row uses topk_ratio.
    relax_rule: torch.Tensor | None = None  # [B] int64/int32: RULE_TOPK_RATIO, RULE_LENIENT or RULE_TYPICAL
    relax_lambda: torch.Tensor | None = None  # [B] float in (0, 1]: lenient rows' lambda
    posterior_threshold: torch.Tensor | None = None  # [B] float in [0, 1]: typical rows' epsilon
    posterior_alpha: torch.Tensor | None = None  # [B] float >= 0: typical rows' delta

    def __post_init__(self) -> None:
        check_shapes(self)

    @property
    def dims(self) -> tuple[int, int, int]:
        """(B, K, V)."""
        b, k1, v = self.target_logits.shape
        return b, k1 - 1, v


# relax_rule codes, in SpeculativeConfig.relax_rule's names (RELAX_RULES order).
RULE_TOPK_RATIO, RULE_LENIENT, RULE_TYPICAL = (
    RELAX_RULES.index(r) for r in ("topk_ratio", "lenient", "typical")
)
_RULE_FIELDS = ("relax_rule", "relax_lambda", "posterior_threshold", "posterior_alpha")


@dataclass(slots=True)
class RejectionResult:
    output_token_ids: torch.Tensor  # [B, K+1] int64, accepted drafts then the emitted token, -1 padded
    num_accepted: torch.Tensor  # [B] int64, accepted drafts (the emitted token is not counted)
    relaxed_accepted: torch.Tensor  # [B, K] bool, accepted only thanks to the relaxed test


_INT_DTYPES = (torch.int64, torch.int32)


def check_tokens_out(logits: torch.Tensor, out: torch.Tensor | None) -> None:
    """ValueError unless out is None or an int64 [N] for logits [N, V]."""
    if out is not None and (out.shape != logits.shape[:1] or out.dtype != torch.int64):
        raise ValueError(f"out must be int64 [{logits.shape[0]}], got {out.dtype} {tuple(out.shape)}")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(
    name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None, device: torch.device
) -> None:
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    _check(tuple(t.shape) == shape, f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if dtypes is None:
        _check(t.dtype.is_floating_point, f"{name} must be a floating-point tensor, got {t.dtype}")
    else:
        _check(t.dtype in dtypes, f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    _check(t.device == device, f"{name} is on {t.device} but target_logits is on {device}")


def check_shapes(batch: AcceptanceBatch) -> None:
    """Metadata-only checks (no device sync)."""
    target_logits = batch.target_logits
    _check(isinstance(target_logits, torch.Tensor), "target_logits must be a torch.Tensor")
    _check(
        target_logits.dim() == 3 and target_logits.shape[1] >= 1 and target_logits.shape[2] >= 1,
        f"target_logits must have shape [B, K+1, V] with K >= 0 and V >= 1, got {list(target_logits.shape)}",
    )
    _check(
        target_logits.dtype.is_floating_point,
        f"target_logits must be a floating-point tensor, got {target_logits.dtype}",
    )
    b, k1, v = target_logits.shape
    k, dev = k1 - 1, target_logits.device
    _check_tensor("draft_token_ids", batch.draft_token_ids, (b, k), _INT_DTYPES, dev)
    _check_tensor("num_draft_tokens", batch.num_draft_tokens, (b,), _INT_DTYPES, dev)
    _check_tensor("relax_mask", batch.relax_mask, (b, k), (torch.bool,), dev)
    _check_tensor("temperature", batch.temperature, (b,), None, dev)
    _check_tensor("relax_ratio", batch.relax_ratio, (b,), None, dev)
    _check_tensor("relax_top_k", batch.relax_top_k, (b,), _INT_DTYPES, dev)
    _check_tensor("relax_delta", batch.relax_delta, (b,), None, dev)
    rule_set = [getattr(batch, f) is not None for f in _RULE_FIELDS]
    _check(all(rule_set) or not any(rule_set), f"{', '.join(_RULE_FIELDS)} must be given together or not")
    if batch.relax_rule is not None:
        _check_tensor("relax_rule", batch.relax_rule, (b,), _INT_DTYPES, dev)
        for name in _RULE_FIELDS[1:]:
            _check_tensor(name, getattr(batch, name), (b,), None, dev)
    if batch.draft_probs is not None:
        _check_tensor("draft_probs", batch.draft_probs, (b, k, v), None, dev)
    if batch.seeds is not None:
        _check_tensor("seeds", batch.seeds, (b,), (torch.int64,), dev)


def check_values(batch: AcceptanceBatch) -> None:
    """Value checks; these sync with the device. Padding rows and positions are not inspected."""
    target_logits = batch.target_logits
    b, k, v = batch.dims
    k1 = k + 1
    n = batch.num_draft_tokens.long()
    bad = ((n < 0) | (n > k)).nonzero()
    _check(
        bad.numel() == 0,
        f"num_draft_tokens must be in [0, {k}], got {n[bad[:1, 0]].tolist()} at {bad[:1, 0].tolist()}",
    )
    t = batch.temperature.float()
    _check(
        bool((torch.isfinite(t) & (t >= 0)).all()), f"temperature must be finite and >= 0, got {t.tolist()}"
    )
    r = batch.relax_ratio.float()
    _check(bool(((r >= 0) & (r <= 1)).all()), f"relax_ratio must be in [0, 1], got {r.tolist()}")
    top_k = batch.relax_top_k
    _check(bool((top_k >= 1).all()), f"relax_top_k must be >= 1, got {top_k.tolist()}")
    dl = batch.relax_delta.float()
    _check(
        bool((dl.isnan() | ((dl >= 0) & (dl <= 1))).all()),
        f"relax_delta must be in [0, 1] or NaN (unset), got {dl.tolist()}",
    )
    if batch.relax_rule is not None:
        _check_rule_values(batch)
    pos = torch.arange(k1, device=target_logits.device)
    used_rows = pos[None, :] <= n[:, None]  # [B, K+1]
    used_pos = pos[None, :k] < n[:, None]  # [B, K]
    ids = batch.draft_token_ids.long()
    bad = (used_pos & ((ids < 0) | (ids >= v))).nonzero()
    _check(
        bad.numel() == 0,
        f"draft_token_ids must be in [0, {v}) at used positions; bad (b, i): {bad[:4].tolist()}",
    )
    rows = target_logits[used_rows]  # [R, V]
    _check(not bool(rows.isnan().any()), "target_logits contains NaN in a used row")
    _check(not bool((rows == float("inf")).any()), "target_logits contains +inf in a used row")
    _check(
        not bool((rows == float("-inf")).all(-1).any()),
        "target_logits has a used row that is all -inf (no token can be emitted)",
    )
    if batch.draft_probs is not None:
        q = batch.draft_probs[used_pos]  # [R', V]
        _check(
            bool((torch.isfinite(q) & (q >= 0)).all()),
            "draft_probs must be finite and >= 0 at used positions",
        )
    if batch.all_greedy and bool((batch.temperature != 0).any()):
        raise ValueError("all_greedy=True but some temperature is not 0")


def _check_rule_values(batch: AcceptanceBatch) -> None:
    """Ranges of the rule fields (a sync); checked on every row, since each request's are resolved."""
    assert batch.relax_lambda is not None and batch.posterior_threshold is not None
    assert batch.relax_rule is not None and batch.posterior_alpha is not None
    rule = batch.relax_rule.long()
    ok = bool(((rule >= 0) & (rule < len(RELAX_RULES))).all())
    _check(ok, f"relax_rule must be in [0, {len(RELAX_RULES) - 1}], got {rule.tolist()}")
    lam = batch.relax_lambda.float()
    _check(bool(((lam > 0) & (lam <= 1)).all()), f"relax_lambda must be in (0, 1], got {lam.tolist()}")
    eps = batch.posterior_threshold.float()
    ok = bool(((eps >= 0) & (eps <= 1)).all())
    _check(ok, f"posterior_threshold must be in [0, 1], got {eps.tolist()}")
    alpha = batch.posterior_alpha.float()
    _check(
        bool((torch.isfinite(alpha) & (alpha >= 0)).all()),
        f"posterior_alpha must be finite and >= 0, got {alpha.tolist()}",
    )
