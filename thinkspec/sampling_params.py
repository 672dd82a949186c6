"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from thinkspec.config import (
    RELAX_RULES,
    RULE_KNOBS,
    validate_protect,
    validate_relax_fields,
    validate_rule_fields,
)
from thinkspec.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from thinkspec.config import SpeculativeConfig

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5

# Integers travel to the device as int64; anything wider cannot be held.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Every stop string is searched for after every new token of its request, on the thread that runs
# all requests, so their number and length are capped.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
# Parallel sampling: each of the n sequences is a request of its own in the batch.
MAX_N = 128
# vLLM's ranges for the OpenAI penalties.
MAX_ABS_PENALTY = 2.0
# repetition_penalty divides or multiplies logits: outside this range a logit overflows to inf or
# underflows to 0 (vLLM asks only > 0, and 5e-324 then breaks the step).
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# logit_bias: OpenAI's range of one bias; token ids are checked against the vocabulary when added.
MAX_ABS_LOGIT_BIAS = 100.0
# The relaxed test's settings where neither the request nor the engine gives them: ratio 1 with
# top-k 1 admits only a draft tied with the argmax.
DEFAULT_RELAX_RATIO = 1.0
DEFAULT_RELAX_TOP_K = 1
# The lenient and typical rules' defaults: lambda 1 is lossless; vLLM's typical acceptance sampler's.
DEFAULT_RELAX_LAMBDA = 1.0
DEFAULT_POSTERIOR_THRESHOLD = 0.09
DEFAULT_POSTERIOR_ALPHA = 0.3
_RELAX_KNOBS = ("relax_ratio", "relax_top_k", "relax_delta", *RULE_KNOBS, "relax_protect")


def _show(value: object, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters (a 400-digit integer is echoed by its head only)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, lo: int, hi: int, what: str | None = None) -> None:
    allowed = what or f"an integer in [{lo}, {hi}]"
    if not _is_int(value) or not lo <= value <= hi:  # type: ignore[operator]
        raise ValueError(f"{name} must be {allowed}, got {_show(value)}")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Validated at construction; bad values raise ValueError.

    Sampling order per row: temperature, then top-k, top-p, min-p on the scaled logits
    (HF transformers' order). The speculative fields (relaxed_thinking, relax_*) default to
    None, meaning "use the engine's SpeculativeConfig". Integers must fit int64; at most
    MAX_STOP_STRINGS stop strings of at most MAX_STOP_STRING_CHARS characters each and
    MAX_STOP_TOKEN_IDS stop token ids (the engine also checks those against its vocabulary).
    """

    n: int = 1
    temperature: float = 1.0  # >= 0; 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = off, else >= 1
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # same seed + same prompt -> same output, whatever the batch
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0  # EOS / stop tokens are masked until this many tokens exist
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # [-2, 2]: minus this from tokens already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count in the output
    # [0.01, 100]: HF's, over prompt + output (divide positive logits, multiply negative ones)
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> value in [-100, 100] added to its logit
    logprobs: int | None = None  # top log-probabilities per output token (+ the chosen one); 0 = chosen only
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    relaxed_thinking: bool | None = None
    relax_ratio: float | None = None
    relax_top_k: int | None = None
    relax_delta: float | None = None
    relax_rule: str | None = None  # "topk_ratio", "lenient" or "typical" (docs/ACCEPTANCE.md)
    relax_lambda: float | None = None  # (0, 1], lenient
    posterior_threshold: float | None = None  # [0, 1], typical
    posterior_alpha: float | None = None  # >= 0, typical
    # Drafts checked strictly: token ids, "digits", "operators", "re:<regex>" (replaces the engine's)
    relax_protect: list[int | str] | tuple[int | str, ...] | None = None
    # At most this many tokens inside <think>; then the next token is </think>. -1 = None = no limit.
    thinking_token_budget: int | None = None
    # A grammar the output must follow (past the thinking, with a reasoning parser); needs xgrammar.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, what="(0, 1]")
        _check_int("top_k", self.top_k, -1, INT64_MAX, f"-1 or 0 (off) or an integer in [1, {INT64_MAX}]")
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0, what="[0, 1]")
        if self.seed is not None:
            _check_int(
                "seed", self.seed, INT64_MIN, INT64_MAX, f"an integer in [{INT64_MIN}, {INT64_MAX}] or None"
            )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT64_MAX, f"an integer in [1, {INT64_MAX}] or None")
        _check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), lo=-MAX_ABS_PENALTY, hi=MAX_ABS_PENALTY)
        lo, hi = MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        _check_number("repetition_penalty", self.repetition_penalty, lo=lo, hi=hi)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                # The engine also caps them at its max_logprobs.
                _check_int(name, value, 0, INT64_MAX, "None or an integer >= 0")
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {_show(self.stop)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            longest = max(len(s) for s in stop)
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}"
            )
        self.stop = stop
        ids = list(self.stop_token_ids or [])
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in ids):
            raise ValueError(
                f"stop_token_ids must be integers in [0, {INT64_MAX}], got {_show(self.stop_token_ids)}"
            )
        self.stop_token_ids = ids
        if self.thinking_token_budget == -1 and _is_int(self.thinking_token_budget):
            self.thinking_token_budget = None  # vLLM's spelling of "unlimited"
        if self.thinking_token_budget is not None:
            _check_int(
                "thinking_token_budget", self.thinking_token_budget, 0, INT64_MAX,
                f"an integer in [0, {INT64_MAX}], -1 or None",
            )  # fmt: skip
        (self.relaxed_thinking, self.relax_ratio, self.relax_top_k, self.relax_delta) = validate_relax_fields(
            relaxed_thinking=self.relaxed_thinking,
            relax_ratio=self.relax_ratio,
            relax_top_k=self.relax_top_k,
            relax_delta=self.relax_delta,
        )
        rule_knobs = (self.relax_rule, self.relax_lambda, self.posterior_threshold, self.posterior_alpha)
        rule_knobs = validate_rule_fields("SamplingParams", *rule_knobs)
        self.relax_rule, self.relax_lambda, self.posterior_threshold, self.posterior_alpha = rule_knobs
        self.relax_protect = validate_protect("SamplingParams", self.relax_protect)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_logit_bias(bias: object) -> dict[int, float] | None:
    """None or {token id >= 0: finite value in [-100, 100]} (an empty dict is None)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_show(bias)}")
    for token, value in bias.items():
        _check_int("logit_bias", token, 0, INT64_MAX, f"keyed by token ids in [0, {INT64_MAX}]")
        _check_number("logit_bias", value, lo=-MAX_ABS_LOGIT_BIAS, hi=MAX_ABS_LOGIT_BIAS)
    return {int(t): float(v) for t, v in bias.items()} or None


def _check_number(
    name: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    what: str | None = None,
) -> None:
    allowed = what or (f">= {lo}" if hi is None else f"[{lo}, {hi}]")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number in {allowed}, got {_show(value)}")
    if isinstance(value, int):
        try:
            value = float(value)  # an integer too large for a float is out of every range here
        except OverflowError:
            raise ValueError(f"{name} must be in {allowed}, got {_show(value)}") from None
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be a finite number in {allowed}, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be in {allowed}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be in {allowed}, got {value}")


@dataclass(frozen=True, slots=True)
class RelaxSettings:
    """One request's relaxed acceptance inside <think>, resolved once when it is added
    (`resolve_relax`); the defaults are relaxation off."""

    enabled: bool = False
    ratio: float = DEFAULT_RELAX_RATIO  # [0, 1]
    top_k: int = DEFAULT_RELAX_TOP_K  # [1, MAX_RELAX_TOP_K]
    delta: float = math.nan  # [0, 1], NaN = unset
    rule: str = RELAX_RULES[0]  # one of RELAX_RULES
    lam: float = DEFAULT_RELAX_LAMBDA  # (0, 1], lenient
    threshold: float = DEFAULT_POSTERIOR_THRESHOLD  # [0, 1], typical
    alpha: float = DEFAULT_POSTERIOR_ALPHA  # >= 0, typical
    protect: tuple[int | str, ...] = ()  # relax_protect: drafts checked strictly (token ids, classes)

    @property
    def rule_code(self) -> int:
        """The rule's index in RELAX_RULES (the device's relax_rule code)."""
        return RELAX_RULES.index(self.rule)


RELAX_OFF = RelaxSettings()


def resolve_relax(
    params: SamplingParams, config: SpeculativeConfig | None, owner: str = "request"
) -> RelaxSettings:
    """Each setting from the request's override, else the engine's `config`, else the default.

    A request that sets relax_ratio, relax_top_k or relax_delta while its relaxation is off (its
    relaxed_thinking, else the config's, is not True) gets a ValueError naming relaxed_thinking:
    those settings would otherwise be ignored without a word. `owner` starts the message.
    """
    enabled = params.relaxed_thinking
    if enabled is None:
        enabled = config is not None and config.relaxed_thinking
    if not enabled:
        given = [name for name in _RELAX_KNOBS if getattr(params, name) is not None]
        if given:
            raise ValueError(
                f"{owner}: {', '.join(given)} set but relaxed thinking is off; set relaxed_thinking=True "
                "(on the request, or in speculative_config) or leave them unset"
            )
        return RELAX_OFF

    c = config
    ratio = _first_set(params.relax_ratio, c.relax_ratio if c else None, DEFAULT_RELAX_RATIO)
    top_k = _first_set(params.relax_top_k, c.relax_top_k if c else None, DEFAULT_RELAX_TOP_K)
    delta = _first_set(params.relax_delta, c.relax_delta if c else None, math.nan)
    rule = params.relax_rule or (c.relax_rule if c else None) or RELAX_RULES[0]
    lam = _first_set(params.relax_lambda, c.relax_lambda if c else None, DEFAULT_RELAX_LAMBDA)
    eps = _first_set(
        params.posterior_threshold, c.posterior_threshold if c else None, DEFAULT_POSTERIOR_THRESHOLD
    )
    alpha = _first_set(params.posterior_alpha, c.posterior_alpha if c else None, DEFAULT_POSTERIOR_ALPHA)
    protect = params.relax_protect if params.relax_protect is not None else (c.relax_protect if c else None)
    settings = (float(ratio), int(top_k), float(delta), rule, float(lam), float(eps), float(alpha))
    return RelaxSettings(True, *settings, tuple(protect or ()))


def _first_set(*values: float | None) -> float:
    return next(v for v in values if v is not None)
