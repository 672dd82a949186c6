"""Reasoning parsers: think markers, their token ids, and the reasoning/content split of an output.

Splitting rule (identical for a whole output and for a stream of deltas):

- Where the output starts (`ReasoningParser.starts_in_thinking`, vLLM's rules): `deepseek_r1`
  always starts in reasoning, so everything before a lone end marker is reasoning; `qwen3`
  starts in reasoning unless the chat template was asked for `enable_thinking=False` (for a raw
  prompt, unless the prompt itself closed the block, as that template does); a parser built
  from explicit markers starts in the phase the prompt leaves it in (`initial_phase`). The
  engine's phase tracker starts in the same phase, so relaxation covers exactly the text
  returned as reasoning. Every character belongs to the phase in effect where it stands;
  `think_start` switches to thinking, `think_end` switches to the answer, and both markers are
  dropped wherever they occur. So an output that starts in the answer and opens with text
  before `<think>` has that text as content, and an output with no end marker is all reasoning
  after the start (an unfinished thought).
- The newlines chat templates put around the markers are dropped, exactly: one `\\n` right
  after a start marker (or at the very start of an output that starts in thinking, whose start
  marker closed the prompt), up to two `\\n` right after an end marker, and one `\\n` right
  before an end marker. R1/Qwen3 write `<think>\\n...\\n</think>\\n\\n`.
- `reasoning_content` / `content` are None when empty, else the text; stream deltas follow the
  same rule, and concatenating a stream's deltas gives the whole-output split for any chunking.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thinkspec.reasoning.tracker import PhaseTracker, initial_phase

_START_RULES = ("thinking", "enable_thinking", "prompt")


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A pair of think markers given as token strings, plus the text split they imply."""

    name: str
    think_start: str
    think_end: str
    # Where an output starts: "thinking" (always), "enable_thinking" (the chat template flag,
    # default on), "prompt" (the prompt's last marker). See starts_in_thinking.
    start_rule: str = "prompt"
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for label, marker in (("think_start", self.think_start), ("think_end", self.think_end)):
            if not isinstance(marker, str) or not marker:
                raise ValueError(f"ReasoningParser.{label} must be a non-empty string, got {marker!r}")
            if "\n" in marker:
                raise ValueError(f"ReasoningParser.{label} must not contain a newline, got {marker!r}")
        # One marker inside the other would make the split depend on match order.
        if self.think_start in self.think_end or self.think_end in self.think_start:
            raise ValueError(
                "ReasoningParser markers must differ and neither may contain the other, got "
                f"think_start={self.think_start!r}, think_end={self.think_end!r}"
            )
        if self.start_rule not in _START_RULES:
            raise ValueError(
                f"ReasoningParser.start_rule must be one of {_START_RULES}, got {self.start_rule!r}"
            )
        pattern = re.compile(f"({re.escape(self.think_start)}|{re.escape(self.think_end)})")
        object.__setattr__(self, "_pattern", pattern)

    @classmethod
    def from_tokens(cls, think_start: str, think_end: str) -> ReasoningParser:
        """A generic parser from explicit marker token strings."""
        return cls(name="generic", think_start=think_start, think_end=think_end)

    def starts_in_thinking(self, prompt_state: bool | None, enable_thinking: bool | None = None) -> bool:
        """Whether the output starts in reasoning. prompt_state: True when the prompt's last think
        marker opens the block, False when it closes it, None when it has none; enable_thinking:
        the chat template's flag when the prompt came from a chat request, else None."""
        if self.start_rule == "thinking":
            return True
        if self.start_rule == "enable_thinking":
            if enable_thinking is not None:
                return bool(enable_thinking)
            return prompt_state is not False
        return prompt_state is True

    def split(self, text: str, starts_in_thinking: bool) -> tuple[str | None, str | None]:
        """Whole-output split -> (reasoning_content, content); each None when empty."""
        pieces = self._pattern.split(text)  # [text, marker, text, marker, ..., text]
        thinking = starts_in_thinking
        lead = 1 if starts_in_thinking else 0
        reasoning: list[str] = []
        content: list[str] = []
        for i in range(0, len(pieces), 2):
            segment = pieces[i]
            following = pieces[i + 1] if i + 1 < len(pieces) else None
            for _ in range(lead):
                if not segment.startswith("\n"):
                    break
                segment = segment[1:]
            if following == self.think_end and segment.endswith("\n"):
                segment = segment[:-1]
            (reasoning if thinking else content).append(segment)
            if following is not None:
                thinking = following == self.think_start
                lead = 1 if thinking else 2
        return "".join(reasoning) or None, "".join(content) or None

    def stream(self, starts_in_thinking: bool) -> ReasoningStream:
        return ReasoningStream(self, starts_in_thinking)

    def resolve(self, tokenizer: Any, extra_protected_token_ids: Sequence[int] = ()) -> ResolvedReasoning:
        """Find the marker ids and the protected ids in a transformers or raw `tokenizers` tokenizer.

        Raises ValueError naming the marker when it is not one token of the vocabulary.
        """
        vocab, added, special_ids, encode, tok_name = _tokenizer_view(tokenizer)
        ids = []
        for label, marker in (("think_start", self.think_start), ("think_end", self.think_end)):
            token_id = vocab.get(marker)
            if token_id is None:
                raise ValueError(
                    f"reasoning parser {self.name!r}: {label} marker {marker!r} is not a token of "
                    f"tokenizer {tok_name}"
                )
            encoded = list(encode(marker))
            if encoded != [token_id]:
                raise ValueError(
                    f"reasoning parser {self.name!r}: {label} marker {marker!r} does not encode to the "
                    f"single token {token_id} with tokenizer {tok_name}, got {encoded}"
                )
            ids.append(token_id)
        protected = {*ids, *added, *special_ids}
        for extra in extra_protected_token_ids:
            if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
                raise ValueError(f"extra_protected_token_ids must be non-negative ints, got {extra!r}")
            protected.add(extra)
        return ResolvedReasoning(
            parser=self,
            think_start_id=ids[0],
            think_end_id=ids[1],
            protected_token_ids=tuple(sorted(protected)),
        )


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", "<think>", "</think>", start_rule="thinking"),
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>", start_rule="enable_thinking"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"reasoning_parser must be one of {tuple(REASONING_PARSERS)}, got {name!r}")
    return parser


def _tokenizer_view(tokenizer: Any):
    """(vocab incl. added tokens, added ids, special ids, encode-without-specials, display name)."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        added = list(tokenizer.get_added_tokens_decoder())
        encode = lambda s: tokenizer.encode(s, add_special_tokens=False).ids
        return vocab, added, [], encode, "tokenizers.Tokenizer"
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "added_tokens_decoder"):
        vocab = tokenizer.get_vocab()
        added = list(tokenizer.added_tokens_decoder)
        special = [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None]
        for attr in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(tokenizer, attr, None)
            special.extend(
                value if isinstance(value, (list, tuple)) else [value] if value is not None else []
            )
        encode = lambda s: tokenizer.encode(s, add_special_tokens=False)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        return vocab, added, special, encode, repr(name)
    raise ValueError(
        "tokenizer must be a transformers tokenizer or a tokenizers.Tokenizer, "
        f"got {type(tokenizer).__name__}"
    )


@dataclass(frozen=True, slots=True)
class ResolvedReasoning:
    """A parser bound to one tokenizer: marker ids and the ids relaxation must never touch."""

    parser: ReasoningParser
    think_start_id: int
    think_end_id: int
    protected_token_ids: tuple[int, ...]  # sorted, unique: markers, eos/pad/bos, all special and added

    def initial_phase(self, prompt_token_ids: Sequence[int] | torch.Tensor) -> bool:
        """True when the prompt leaves the model thinking (its last marker is the start marker)."""
        return initial_phase(prompt_token_ids, self.think_start_id, self.think_end_id)

    def starts_in_thinking(
        self,
        prompt_token_ids: Sequence[int] | torch.Tensor,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """The phase an output starts in (see ReasoningParser.starts_in_thinking): the split and the
        engine's phase tracker both start here."""
        ids = [int(t) for t in torch.as_tensor(prompt_token_ids).reshape(-1).tolist()]
        state = None
        if self.think_start_id in ids or self.think_end_id in ids:
            state = self.initial_phase(ids)
        enable = (chat_template_kwargs or {}).get("enable_thinking")
        return self.parser.starts_in_thinking(state, None if enable is None else bool(enable))

    def tracker(self) -> PhaseTracker:
        return PhaseTracker(self.think_start_id, self.think_end_id, self.protected_token_ids)

    def split(self, text: str, starts_in_thinking: bool) -> tuple[str | None, str | None]:
        return self.parser.split(text, starts_in_thinking)

    def stream(self, starts_in_thinking: bool) -> ReasoningStream:
        return ReasoningStream(self.parser, starts_in_thinking)


class ReasoningStream:
    """Incremental split of one output; holds back only what may still turn into a marker.

    Held back: a suffix that is a proper prefix of a marker, and a `\\n` (plus such a suffix)
    that may turn out to stand right before an end marker.
    """

    __slots__ = ("_start", "_end", "_special", "_thinking", "_lead", "_buf", "_finished")

    def __init__(self, parser: ReasoningParser, starts_in_thinking: bool) -> None:
        self._start = parser.think_start
        self._end = parser.think_end
        # Characters that need a closer look; everything between them is plain text.
        self._special = re.compile("[" + re.escape("\n" + parser.think_start[0] + parser.think_end[0]) + "]")
        self._thinking = bool(starts_in_thinking)
        self._lead = 1 if starts_in_thinking else 0  # leading newlines still to drop
        self._buf = ""
        self._finished = False

    @property
    def thinking(self) -> bool:
        """Phase at the end of the text consumed so far."""
        return self._thinking

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        """Consume one delta -> (reasoning_delta, content_delta); each None when empty."""
        if self._finished:
            raise ValueError("ReasoningStream.feed called after finish()")
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        """Flush what was held back; the stream accepts no more text."""
        if self._finished:
            raise ValueError("ReasoningStream.finish called twice")
        out = self._drain(final=True)
        self._finished = True
        return out

    def _pending_prefix(self, buf: str, i: int) -> bool:
        # buf[i:] is too short to decide and could still grow into a marker.
        rest = buf[i:]
        return any(len(rest) < len(m) and m.startswith(rest) for m in (self._start, self._end))

    def _drain(self, final: bool) -> tuple[str | None, str | None]:
        buf, start, end = self._buf, self._start, self._end
        out: dict[bool, list[str]] = {True: [], False: []}
        i, n = 0, len(buf)
        while i < n:
            match = self._special.search(buf, i)
            j = n if match is None else match.start()
            if j > i:  # plain run
                out[self._thinking].append(buf[i:j])
                self._lead = 0
                i = j
                continue
            if buf.startswith(start, i) or buf.startswith(end, i):
                is_start = buf.startswith(start, i)
                i += len(start) if is_start else len(end)
                self._thinking = is_start
                self._lead = 1 if is_start else 2
                continue
            if not final and self._pending_prefix(buf, i):
                break
            ch = buf[i]
            if ch == "\n":
                if self._lead > 0:
                    self._lead -= 1
                    i += 1
                    continue
                if buf.startswith(end, i + 1):
                    i += 1  # the newline before an end marker is dropped
                    continue
                rest = buf[i + 1 :]
                if not final and len(rest) < len(end) and end.startswith(rest):
                    break
            else:
                self._lead = 0
            out[self._thinking].append(ch)
            i += 1
        self._buf = buf[i:]
        return "".join(out[True]) or None, "".join(out[False]) or None
