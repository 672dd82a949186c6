"""Engine-level speculative decoding configuration (vLLM's `--speculative-config`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thinkspec.reasoning.parsers import REASONING_PARSERS, ReasoningParser, get_reasoning_parser

if TYPE_CHECKING:
    from thinkspec.reasoning.parsers import ResolvedReasoning

SPEC_METHODS = ("draft_model", "ngram")
MAX_SPECULATIVE_TOKENS = 16
MAX_RELAX_TOP_K = 64
# Relaxed acceptance rules (docs/ACCEPTANCE.md); the first is the default. Their codes on the device
# are the indices here (thinkspec.sampling.rejection_common.RULE_*).
RELAX_RULES = ("topk_ratio", "lenient", "typical")
# The rule-specific knobs beside relax_ratio / relax_top_k / relax_delta.
RULE_KNOBS = ("relax_rule", "relax_lambda", "posterior_threshold", "posterior_alpha")
# relax_protect: named token classes (thinkspec.reasoning.tracker.PROTECT_CLASSES defines them), and
# the most items and regex characters one setting may hold.
PROTECT_CLASSES = ("digits", "operators")
MAX_PROTECT_ITEMS = 4096
MAX_PROTECT_REGEX_CHARS = 512
# vLLM's n-gram defaults: both bounds unset -> 5/5; one set -> the other copies it.
DEFAULT_PROMPT_LOOKUP = 5


def _is_int(value: Any) -> bool:
    # bool is a subclass of int; a flag passed where a count is expected is a mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _check_int(owner: str, name: str, value: Any, low: int, high: int | None = None) -> int:
    if not _is_int(value) or value < low or (high is not None and value > high):
        upper = f"{high}]" if high is not None else "inf)"
        raise ValueError(f"{owner}.{name} must be an int in [{low}, {upper}, got {value!r}")
    return value


def _check_unit_float(owner: str, name: str, value: Any) -> float:
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}.{name} must be a float in [0, 1], got {value!r}")
    return float(value)


def _check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be a bool (true or false), got {value!r}")
    return value


def _check_optional_str(owner: str, name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}.{name} must be a non-empty string or None, got {value!r}")
    return value


def validate_relax_fields(
    *,
    relaxed_thinking: bool | None = None,
    relax_ratio: float | None = None,
    relax_top_k: int | None = None,
    relax_delta: float | None = None,
    owner: str = "SamplingParams",
) -> tuple[bool | None, float | None, int | None, float | None]:
    """Validate the relaxed-acceptance knobs shared by SpeculativeConfig and per-request overrides.

    None means "not set" (use the engine default) and passes through. Returns the values
    normalised (ints given for floats become floats) in argument order; raises ValueError naming
    `owner.field`, the allowed range and the value.
    """
    if relaxed_thinking is not None:
        relaxed_thinking = _check_bool(owner, "relaxed_thinking", relaxed_thinking)
    if relax_ratio is not None:
        relax_ratio = _check_unit_float(owner, "relax_ratio", relax_ratio)
    if relax_top_k is not None:
        relax_top_k = _check_int(owner, "relax_top_k", relax_top_k, 1, MAX_RELAX_TOP_K)
    if relax_delta is not None:
        relax_delta = _check_unit_float(owner, "relax_delta", relax_delta)
    return relaxed_thinking, relax_ratio, relax_top_k, relax_delta


def validate_rule_fields(
    owner: str,
    relax_rule: str | None,
    relax_lambda: float | None,
    posterior_threshold: float | None,
    posterior_alpha: float | None,
) -> tuple[str | None, float | None, float | None, float | None]:
    """Validate the relax rule and its knobs (None = unset passes through); floats normalised.
    ValueError names `owner.field` and the allowed range."""
    if relax_rule is not None and relax_rule not in RELAX_RULES:
        raise ValueError(f"{owner}.relax_rule must be one of {list(RELAX_RULES)}, got {relax_rule!r}")
    if relax_lambda is not None:
        if not _is_real(relax_lambda) or not 0.0 < relax_lambda <= 1.0:
            raise ValueError(f"{owner}.relax_lambda must be a float in (0, 1], got {relax_lambda!r}")
        relax_lambda = float(relax_lambda)
    if posterior_threshold is not None:
        posterior_threshold = _check_unit_float(owner, "posterior_threshold", posterior_threshold)
    if posterior_alpha is not None:
        if not _is_real(posterior_alpha) or posterior_alpha < 0:
            raise ValueError(f"{owner}.posterior_alpha must be a finite float >= 0, got {posterior_alpha!r}")
        posterior_alpha = float(posterior_alpha)
    return relax_rule, relax_lambda, posterior_threshold, posterior_alpha


def validate_protect(owner: str, value: Any) -> tuple[int | str, ...] | None:
    """relax_protect as a tuple of items (None = unset): token ids >= 0, class names in
    PROTECT_CLASSES, or "re:<regex>" (a regex searched in each token's text). One item alone may be
    given without a list. ValueError names `owner.relax_protect` and what it allows."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, int)) else value
    regex = f"'re:<regex>' (<= {MAX_PROTECT_REGEX_CHARS} chars)"
    what = f"token ids >= 0, class names {list(PROTECT_CLASSES)} or {regex}"
    if not isinstance(items, (list, tuple)) or len(items) > MAX_PROTECT_ITEMS:
        most = f"a list of at most {MAX_PROTECT_ITEMS}"
        raise ValueError(f"{owner}.relax_protect must be {most} {what}, got {value!r}")
    for item in items:
        ok = (_is_int(item) and item >= 0) or item in PROTECT_CLASSES
        if isinstance(item, str) and item.startswith("re:") and len(item) <= MAX_PROTECT_REGEX_CHARS + 3:
            try:
                re.compile(item[3:])
                ok = True
            except re.error as exc:
                raise ValueError(f"{owner}.relax_protect regex {item[3:]!r} is invalid: {exc}") from None
        if not ok:
            raise ValueError(f"{owner}.relax_protect items must be {what}, got {item!r}")
    return tuple(items)


@dataclass(slots=True)
class SpeculativeConfig:
    """How the engine speculates, and how it relaxes acceptance inside `<think>`.

    The defaults are strict: no speculation at all, and with speculation configured
    (`method`/`model` + `num_speculative_tokens`) exact verification unless
    `relaxed_thinking=True`.

    - method: "draft_model", "ngram" or None. None with a `model` becomes "draft_model"
      (as vLLM infers it); None without a model means no speculation.
    - model: draft checkpoint (folder or hub id); required by "draft_model", refused by "ngram".
    - num_speculative_tokens: drafts per verify step, in [1, 16]; required when speculating. With
      adaptive_k it is the most a step may draft (K).
    - adaptive_k: before each step choose, per phase group (answer / thinking strict / thinking
      relaxed), how many tokens to draft, 0..K, for the most expected tokens per second (see
      spec_decode/draft_length.py); k = 0 is a plain decode step. False: always K.
    - prompt_lookup_min / prompt_lookup_max: n-gram match lengths (ngram only),
      1 <= min <= max; both unset -> 5 and 5, one unset -> it takes the other's value.
    - relaxed_thinking / relax_ratio / relax_top_k / relax_delta: the relaxed test
      (see docs/ACCEPTANCE.md); engine defaults, overridable per request.
    - relax_rule: "topk_ratio" (the relaxed test above, default), "lenient" (relax_lambda in
      (0, 1]) or "typical" (posterior_threshold in [0, 1], posterior_alpha >= 0); per request too.
    - relax_protect: drafts checked strictly even where relaxation is on, like the think markers:
      token ids, named classes ("digits": text has a digit; "operators") and "re:<regex>" over
      token text; a request's list replaces the engine's.
    - reasoning_parser: "deepseek_r1" or "qwen3"; think_start_token / think_end_token override
      its markers, or without a parser (both given) define a generic one.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    relaxed_thinking: bool = False
    relax_ratio: float | None = None  # None = unset: the request's, else 1.0
    relax_top_k: int | None = None  # None = unset: the request's, else 1
    relax_delta: float | None = None
    relax_rule: str | None = None  # None = unset: the request's, else "topk_ratio"
    relax_lambda: float | None = None  # None = unset: the request's, else 1 (lossless)
    posterior_threshold: float | None = None  # None = unset: the request's, else 0.09 (vLLM's)
    posterior_alpha: float | None = None  # None = unset: the request's, else 0.3 (vLLM's)
    relax_protect: Any = None  # None = unset; validated into a tuple of ids / class names / "re:..."
    reasoning_parser: str | None = None
    think_start_token: str | None = None
    think_end_token: str | None = None
    adaptive_k: bool = False

    def __post_init__(self) -> None:
        owner = "SpeculativeConfig"
        self._check_method(owner)
        self._check_prompt_lookup(owner)
        _check_bool(owner, "adaptive_k", self.adaptive_k)
        if self.adaptive_k and self.method is None:
            raise ValueError(
                f"{owner}.adaptive_k=True needs a speculative method ({' or '.join(SPEC_METHODS)})"
            )
        check_relax_settings(self, owner)
        self._check_reasoning(owner)

    def _check_method(self, owner: str) -> None:
        """method, model and num_speculative_tokens, each against the others."""
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        self.model = _check_optional_str(owner, "model", self.model)
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"{owner}.method must be one of {SPEC_METHODS} or None, got {self.method!r}")
        if self.method is None and self.model is not None:
            self.method = "draft_model"

        if self.method is None:
            if self.num_speculative_tokens is not None:
                raise ValueError(
                    f"{owner}.num_speculative_tokens={self.num_speculative_tokens!r} needs a method "
                    f"({' or '.join(SPEC_METHODS)}) or a draft model"
                )
        else:
            if self.num_speculative_tokens is None:
                raise ValueError(
                    f"{owner}.num_speculative_tokens is required with method={self.method!r}; "
                    f"an int in [1, {MAX_SPECULATIVE_TOKENS}]"
                )
            _check_int(
                owner, "num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS
            )
        if self.method == "draft_model" and self.model is None:
            raise ValueError(f"{owner}.model is required with method='draft_model', got None")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"{owner}.model must be None with method='ngram', got {self.model!r}")

    def _check_reasoning(self, owner: str) -> None:
        """reasoning_parser and the think markers, and what relaxed_thinking needs of them."""
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"{owner}.reasoning_parser must be one of {tuple(REASONING_PARSERS)} or None, "
                f"got {self.reasoning_parser!r}"
            )
        self.think_start_token = _check_optional_str(owner, "think_start_token", self.think_start_token)
        self.think_end_token = _check_optional_str(owner, "think_end_token", self.think_end_token)
        if self.reasoning_parser is None and (self.think_start_token is None) != (
            self.think_end_token is None
        ):
            missing = "think_end_token" if self.think_end_token is None else "think_start_token"
            raise ValueError(
                f"{owner}.{missing} is required when the other marker is given without a reasoning_parser"
            )
        if self.relaxed_thinking:
            if self.method is None:
                raise ValueError(
                    f"{owner}.relaxed_thinking=True needs speculative decoding: set method "
                    f"({' or '.join(SPEC_METHODS)}) and num_speculative_tokens"
                )
            if self.reasoning_parser is None and self.think_start_token is None:
                raise ValueError(
                    f"{owner}.relaxed_thinking=True needs reasoning_parser (one of "
                    f"{tuple(REASONING_PARSERS)}) or both think_start_token and think_end_token"
                )
        # Building the parser checks the markers themselves (distinct, no newline, no nesting).
        try:
            self.build_reasoning_parser()
        except ValueError as exc:
            raise ValueError(f"{owner}: {exc}") from None

    def _check_prompt_lookup(self, owner: str) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:
                    raise ValueError(f"{owner}.{name} applies only to method='ngram', got {value!r}")
            return
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check_int(owner, "prompt_lookup_min", lo, 1)
        _check_int(owner, "prompt_lookup_max", hi, 1)
        if lo > hi:
            raise ValueError(
                f"{owner}.prompt_lookup_min must be <= prompt_lookup_max, got min={lo} > max={hi}"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @property
    def enabled(self) -> bool:
        """True when the engine speculates at all."""
        return self.method is not None

    def build_reasoning_parser(self) -> ReasoningParser | None:
        """The configured parser with explicit marker overrides applied; None when none is configured."""
        if self.reasoning_parser is None:
            if self.think_start_token is None or self.think_end_token is None:
                return None
            return ReasoningParser.from_tokens(self.think_start_token, self.think_end_token)
        parser = get_reasoning_parser(self.reasoning_parser)
        if self.think_start_token is None and self.think_end_token is None:
            return parser
        return ReasoningParser(
            name=parser.name,
            think_start=self.think_start_token or parser.think_start,
            think_end=self.think_end_token or parser.think_end,
            start_rule=parser.start_rule,
        )

    def resolve_reasoning(
        self, tokenizer: Any, extra_protected_token_ids: tuple[int, ...] = ()
    ) -> ResolvedReasoning | None:
        """Resolve the markers against the target's tokenizer (raises ValueError naming a missing marker)."""
        parser = self.build_reasoning_parser()
        if parser is None:
            return None
        return parser.resolve(tokenizer, extra_protected_token_ids=extra_protected_token_ids)

    # ---- (de)serialisation -------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(data, dict):
            raise ValueError(f"SpeculativeConfig must be built from a dict, got {type(data).__name__}")
        known = cls.field_names()
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(f"SpeculativeConfig got unknown keys {unknown}; known keys: {list(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"SpeculativeConfig JSON is invalid: {exc}; got {text!r}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """What `LLM(speculative_config=...)` and `--speculative-config` accept.

        None, an empty string and "null" mean no speculation and return None.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                data = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"SpeculativeConfig JSON is invalid: {exc}; got {value!r}") from None
            return None if data is None else cls.from_dict(data)
        raise ValueError(
            "speculative_config must be None, a dict, a JSON string or a SpeculativeConfig, "
            f"got {type(value).__name__}"
        )


def check_relax_settings(cfg: SpeculativeConfig, owner: str) -> None:
    """Validates the relax fields in place (ints given for floats become floats), and refuses
    relax_ratio / relax_top_k / relax_delta without relaxed_thinking=True: they only act where
    relaxation is on, so without the flag they would be ignored without a word."""
    _, cfg.relax_ratio, cfg.relax_top_k, cfg.relax_delta = validate_relax_fields(
        relaxed_thinking=cfg.relaxed_thinking,
        relax_ratio=cfg.relax_ratio,
        relax_top_k=cfg.relax_top_k,
        relax_delta=cfg.relax_delta,
        owner=owner,
    )
    cfg.relax_rule, cfg.relax_lambda, cfg.posterior_threshold, cfg.posterior_alpha = validate_rule_fields(
        owner, cfg.relax_rule, cfg.relax_lambda, cfg.posterior_threshold, cfg.posterior_alpha
    )
    cfg.relax_protect = validate_protect(owner, cfg.relax_protect)
    knobs = ("relax_ratio", "relax_top_k", "relax_delta", *RULE_KNOBS, "relax_protect")
    given = [name for name in knobs if getattr(cfg, name) is not None]
    if given and cfg.relaxed_thinking is not True:
        raise ValueError(
            f"{owner}.{', '.join(given)} given without relaxed_thinking=True, so they would be ignored: "
            'add "relaxed_thinking": true (requests can still opt out with relaxed_thinking=False) '
            "or leave them out"
        )
