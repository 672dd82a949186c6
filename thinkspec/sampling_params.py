"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass

from thinkspec.config import validate_relax_fields

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Validated at construction; bad values raise ValueError.

    Sampling order per row: temperature, then top-k, top-p, min-p on the scaled logits
    (HF transformers' order). The speculative fields (relaxed_thinking, relax_*) default to
    None, meaning "use the engine's SpeculativeConfig".
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
    relaxed_thinking: bool | None = None
    relax_ratio: float | None = None
    relax_top_k: int | None = None
    relax_delta: float | None = None

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: thinkspec generates one completion per request")
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, what="(0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0, what="[0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        (self.relaxed_thinking, self.relax_ratio, self.relax_top_k, self.relax_delta) = validate_relax_fields(
            relaxed_thinking=self.relaxed_thinking,
            relax_ratio=self.relax_ratio,
            relax_top_k=self.relax_top_k,
            relax_delta=self.relax_delta,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


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
        raise ValueError(f"{name} must be a number in {allowed}, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be in {allowed}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be in {allowed}, got {value}")
