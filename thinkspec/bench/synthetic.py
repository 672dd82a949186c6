"""Synthetic acceptance, a benchmark tool: each draft is accepted with a set probability whatever the
models say, so that speed can be measured at a chosen acceptance length on random weights. Outputs are
not the model's; never use it to generate text.

install_synthetic_acceptance(llm, rate=..., profile=...) wraps the target runner's execute_model. In
each verify window (a sequence fed [last token, d_1 .. d_n], row i of its logits scoring d_{i+1}) it
draws whether each draft passes and edits the target's logits so that the engine's own acceptance
decides as drawn: a passing draft becomes its row's unique argmax by STEER, a failing one falls STEER
below the row's max. The real rejection kernel runs and is timed; the token emitted after the run is
the target's argmax of the (edited) row, so never the rejected draft.

- rate: every draft passes with this probability, in [0, 1].
- profile: per phase and draft position, {"thinking": [a_0 .. a_{K-1}], "answer": [...],
  "thinking_tokens": N}: a_i is the share of rounds whose draft i is accepted (non-increasing in i, in
  [0, 1]), so draft i passes with a_i / a_{i-1} once i - 1 did; a request is thinking for its first N
  output tokens. An optional "seed" (int >= 0) draws each verdict from a hash of (seed, prompt, output
  position) instead of a generator (synthetic_uniforms): the same token of the same request meets the
  same draw whatever k or step drafts it, so settings compared on the same prompts meet the same hard
  tokens. The profile's phase is also the request's phase for the engine (its Sequence.thinking after
  every commit, as a reasoning tracker would set it at a think end marker): adaptive_k groups rows by
  it and the metrics count each draft in it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from thinkspec.config import _check_int, _check_unit_float

if TYPE_CHECKING:
    from thinkspec.engine.scheduler import Scheduler, SchedulerOutput, StepOutcome
    from thinkspec.engine.sequence import Sequence

_OWNER = "install_synthetic_acceptance"
_MASK64 = (1 << 64) - 1
STEER = 1e4  # logit margin of a steered draft: far beyond any model's (and any temperature's) spread


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def synthetic_uniforms(keys: np.ndarray, positions: np.ndarray, k: int, seed: int) -> np.ndarray:
    """[S, k] float64 uniforms in [0, 1), entry [s, j] a hash of (seed, keys[s], positions[s] + j)
    alone; keys [S] uint64 (one per request), positions [S] uint64 (output index of draft 0)."""
    base = _splitmix64(keys ^ np.uint64(seed & _MASK64))  # [S]
    with np.errstate(over="ignore"):
        at = base[:, None] + positions[:, None] + np.arange(k, dtype=np.uint64)[None, :]  # [S, k]
    return (_splitmix64(at) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def check_synthetic(rate: Any, profile: Any, k: int) -> tuple[float | None, dict[str, Any] | None]:
    """(rate, profile) validated for an engine drafting up to k (ValueError naming the argument)."""
    if rate is not None:
        if profile is not None:
            raise ValueError(f"{_OWNER}: profile excludes rate; give one of them")
        return _check_unit_float(_OWNER, "rate", rate), None
    if profile is None:
        return None, None
    name = f"{_OWNER}.profile"
    keys = {"thinking", "answer", "thinking_tokens"}
    if not isinstance(profile, dict) or not keys <= set(profile) <= keys | {"seed"}:
        allowed = "thinking, answer, thinking_tokens (seed optional)"
        raise ValueError(f"{name} must be a dict with keys {allowed}, got {profile!r}")
    seed = profile.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise ValueError(f"{name}['seed'] must be a non-negative integer or None, got {seed!r}")
    for phase in ("thinking", "answer"):
        shares = profile[phase]
        ok = isinstance(shares, list) and len(shares) == k
        ok = ok and all(
            isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1 for a in shares
        )
        if not ok or any(b > a for a, b in zip(shares, shares[1:])):
            raise ValueError(f"{name}[{phase!r}] must be {k} non-increasing shares in [0, 1], got {shares!r}")
    _check_int(name, "thinking_tokens", profile["thinking_tokens"], 0, 2**31 - 1)
    return None, dict(profile)


def _conditional_rates(profile: dict[str, Any]) -> np.ndarray:
    """[2, K] float32: the chance draft i passes once i - 1 did, answer row 0, thinking row 1."""
    rows = []
    for phase in ("answer", "thinking"):
        shares = [1.0, *profile[phase]]
        rows.append([b / a if a > 0 else 0.0 for a, b in zip(shares, shares[1:])])
    return np.array(rows, dtype=np.float32)


class SyntheticAcceptance:
    """The target runner's execute_model, with each verify window's logits steered by the draws."""

    def __init__(self, execute_model: Any, seed: int) -> None:
        self.inner = execute_model
        self.rate: float | None = None
        self.profile: dict[str, Any] | None = None
        self.table: np.ndarray | None = None  # [2, K] _conditional_rates of the profile
        self.rng = np.random.default_rng(seed)  # the draws without a profile seed
        self.keys: dict[tuple[str, int], int] = {}  # (request id, index) -> hash of its prompt

    def configure(self, rate: float | None, profile: dict[str, Any] | None) -> None:
        self.rate, self.profile = rate, profile
        self.table = _conditional_rates(profile) if profile is not None else None

    def __call__(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        num_logits: Seq[int],
        input_token_ids: Seq[Seq[int]] | None = None,
        start_positions: Seq[int] | None = None,
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """ModelRunner.execute_model, then the steering (logits [N, V] float32, edited in place) of a
        forward that may verify: inputs given, positions not (the speculator's target forward)."""
        logits = self.inner(
            seqs, num_new_tokens, num_logits, input_token_ids=input_token_ids,
            start_positions=start_positions, device_inputs=device_inputs,
        )  # fmt: skip
        verifies = input_token_ids is not None and start_positions is None
        if verifies and (self.rate is not None or self.profile is not None):
            self._steer(logits, seqs, num_new_tokens, num_logits, input_token_ids, device_inputs)
        return logits

    def _steer(
        self,
        logits: torch.Tensor,  # [N, V] float32
        seqs: Seq[Sequence],
        num_new: Seq[int],
        num_logits: Seq[int],
        input_ids: Seq[Seq[int]],
        device_inputs: tuple[torch.Tensor, torch.Tensor] | None,  # (packed positions [D], drafts [D])
    ) -> None:
        """Steer the draft rows of every verify window: a sequence that feeds past its committed
        tokens (its drafts) and wants a logits row per input."""
        windows = []  # (batch row, its first logits row, its first packed input, its drafts)
        row = pos = 0
        for i, (seq, n, nl) in enumerate(zip(seqs, num_new, num_logits)):
            nd = seq.num_computed_tokens + n - seq.num_tokens
            if nd > 0 and nl == n:
                windows.append((i, row, pos, nd))
            row, pos = row + nl, pos + n
        if not windows:
            return
        index, first_row, first_input, num_drafts = zip(*windows)
        nd = np.array(num_drafts)
        width = int(nd.max())
        live = np.arange(width)[None, :] < nd[:, None]  # [S, width]: the windows' draft positions
        passes = self.verdicts([seqs[i] for i in index], width)[live]  # [D]
        at = np.arange(width)[None, :]
        rows = (np.array(first_row)[:, None] + at)[live]  # [D] the logits row scoring each draft
        positions = (np.array(first_input)[:, None] + 1 + at)[live]  # [D] each draft's packed input
        drafts = np.concatenate([input_ids[i][1 : 1 + m] for i, m in zip(index, num_drafts)])
        pack = np.stack([rows, drafts, passes, positions]).astype(np.int64)  # [4, D]
        dev = torch.from_numpy(pack).to(logits.device, non_blocking=True)
        draft_ids = dev[1]
        if device_inputs is not None:  # drafts made on the device: the host holds placeholders
            packed = torch.zeros(sum(num_new), dtype=torch.long, device=logits.device)
            packed[dev[3]] = draft_ids
            packed[device_inputs[0]] = device_inputs[1]
            draft_ids = packed[dev[3]]
        top = logits.amax(dim=-1)[dev[0]]  # [D]
        logits[dev[0], draft_ids] = torch.where(dev[2].bool(), top + STEER, top - STEER)

    def verdicts(self, seqs: list[Sequence], width: int) -> np.ndarray:
        """[S, width] bool: whether draft j of each window passes its draw, given j - 1 did."""
        profile = self.profile
        if profile is not None and profile.get("seed") is not None:
            keys = np.array([self._key(s) for s in seqs], dtype=np.uint64)
            positions = np.array([s.num_output_tokens for s in seqs], dtype=np.uint64)
            u = synthetic_uniforms(keys, positions, width, int(profile["seed"]))
        else:
            u = self.rng.random((len(seqs), width))
        if profile is None:
            return u < self.rate
        assert self.table is not None
        thinking = np.array([s.num_output_tokens < profile["thinking_tokens"] for s in seqs], dtype=np.int64)
        return u < self.table[thinking, :width]

    def _key(self, seq: Sequence) -> int:
        """A request's key for the seeded draws: its prompt's hash (Python hashes tuples of ints the
        same in every process), so that the same prompts give the same keys in every run."""
        name = (seq.request_id, seq.index)
        key = self.keys.get(name)
        if key is None:
            if len(self.keys) > 1 << 16:
                self.keys.clear()
            key = self.keys[name] = hash((tuple(seq.prompt_token_ids), seq.index)) & _MASK64
        return key

    def follow_phase(self, scheduler: Scheduler) -> None:
        """Give each request the profile's phase whenever its tokens change (a commit, or a token left
        pending by an async step), as a reasoning tracker sets it at a think end marker."""
        commit, launch_pending = scheduler.commit, scheduler.launch_pending

        def committing(seq: Sequence, outcome: StepOutcome) -> bool:
            changed = commit(seq, outcome)
            self.set_phase(seq)
            return changed

        def launching(out: SchedulerOutput) -> list[tuple[int, Sequence]]:
            pending = launch_pending(out)
            for _, seq in pending:
                self.set_phase(seq)
            return pending

        scheduler.commit, scheduler.launch_pending = committing, launching

    def set_phase(self, seq: Sequence) -> None:
        if self.profile is not None:
            seq.thinking = seq.num_output_tokens < self.profile["thinking_tokens"]


def install_synthetic_acceptance(
    llm: Any, rate: float | None = None, profile: dict[str, Any] | None = None
) -> SyntheticAcceptance:
    """Make llm's speculating engine accept drafts synthetically (see the module docstring): rate or
    profile, validated for its K; neither turns it off. Installing again replaces the settings. Returns
    the wrapper now in the target runner's execute_model."""
    engine = llm.llm_engine
    spec = engine.speculator
    if spec is None:
        if rate is None and profile is None:
            raise ValueError(f"{_OWNER} needs a speculating engine (speculative_config with a method)")
        which = "rate" if rate is not None else "profile"
        raise ValueError(f"{_OWNER}.{which} needs a speculative method (speculative_config)")
    rate, profile = check_synthetic(rate, profile, spec.k)
    first = not isinstance(spec.target_runner.execute_model, SyntheticAcceptance)
    steer = steer_runner(spec.target_runner, rate, profile, engine.config.seed)
    if first:
        steer.follow_phase(engine.scheduler)
    return steer


def steer_runner(
    runner: Any, rate: float | None, profile: dict[str, Any] | None, seed: int
) -> SyntheticAcceptance:
    """The wrapper in runner.execute_model, put there unless it is (then only given the settings, so
    that draws are never steered twice); rate and profile as check_synthetic returns them. For a
    speculator built without an engine; install_synthetic_acceptance also follows the profile's phase."""
    steer = runner.execute_model
    if not isinstance(steer, SyntheticAcceptance):
        steer = runner.execute_model = SyntheticAcceptance(runner.execute_model, seed)
    steer.configure(rate, profile)
    return steer
