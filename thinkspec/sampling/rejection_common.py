"""Result type and input validation shared by the torch reference and the Triton kernels (of acceptance,
and the greedy argmax's output buffer: check_tokens_out).

Shapes for a batch of B requests, K draft slots per request and vocabulary V:
  target_logits     [B, K+1, V] float   row i scores draft i; row K scores the bonus token
  draft_token_ids   [B, K] int64/int32  entries at positions >= num_draft_tokens[b] are padding
  num_draft_tokens  [B] int             in [0, K]
  relax_mask        [B, K] bool         relaxed test allowed at this position
  temperature       [B] float           0 = greedy request, > 0 = sampled request
  relax_ratio       [B] float           in [0, 1]
  relax_top_k       [B] int             >= 1
  relax_delta       [B] float           in [0, 1], NaN = unset
  draft_probs       [B, K, V] float     draft distribution q, or None (q = one_hot(draft))
  seeds             [B] int64           per-request RNG seeds, or None
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def check_shapes(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    relax_mask: torch.Tensor,
    temperature: torch.Tensor,
    relax_ratio: torch.Tensor,
    relax_top_k: torch.Tensor,
    relax_delta: torch.Tensor,
    draft_probs: torch.Tensor | None,
    seeds: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Metadata-only checks (no device sync); returns (B, K, V)."""
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
    _check_tensor("draft_token_ids", draft_token_ids, (b, k), _INT_DTYPES, dev)
    _check_tensor("num_draft_tokens", num_draft_tokens, (b,), _INT_DTYPES, dev)
    _check_tensor("relax_mask", relax_mask, (b, k), (torch.bool,), dev)
    _check_tensor("temperature", temperature, (b,), None, dev)
    _check_tensor("relax_ratio", relax_ratio, (b,), None, dev)
    _check_tensor("relax_top_k", relax_top_k, (b,), _INT_DTYPES, dev)
    _check_tensor("relax_delta", relax_delta, (b,), None, dev)
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, (b, k, v), None, dev)
    if seeds is not None:
        _check_tensor("seeds", seeds, (b,), (torch.int64,), dev)
    return b, k, v


def check_values(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    relax_ratio: torch.Tensor,
    relax_top_k: torch.Tensor,
    relax_delta: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> None:
    """Value checks; these sync with the device. Padding rows and positions are not inspected."""
    b, k1, v = target_logits.shape
    k = k1 - 1
    n = num_draft_tokens.long()
    bad = ((n < 0) | (n > k)).nonzero()
    _check(
        bad.numel() == 0,
        f"num_draft_tokens must be in [0, {k}], got {n[bad[:1, 0]].tolist()} at {bad[:1, 0].tolist()}",
    )
    t = temperature.float()
    _check(
        bool((torch.isfinite(t) & (t >= 0)).all()), f"temperature must be finite and >= 0, got {t.tolist()}"
    )
    r = relax_ratio.float()
    _check(bool(((r >= 0) & (r <= 1)).all()), f"relax_ratio must be in [0, 1], got {r.tolist()}")
    _check(bool((relax_top_k >= 1).all()), f"relax_top_k must be >= 1, got {relax_top_k.tolist()}")
    dl = relax_delta.float()
    _check(
        bool((dl.isnan() | ((dl >= 0) & (dl <= 1))).all()),
        f"relax_delta must be in [0, 1] or NaN (unset), got {dl.tolist()}",
    )
    pos = torch.arange(k1, device=target_logits.device)
    used_rows = pos[None, :] <= n[:, None]  # [B, K+1]
    used_pos = pos[None, :k] < n[:, None]  # [B, K]
    ids = draft_token_ids.long()
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
    if draft_probs is not None:
        q = draft_probs[used_pos]  # [R', V]
        _check(
            bool((torch.isfinite(q) & (q >= 0)).all()),
            "draft_probs must be finite and >= 0 at used positions",
        )
