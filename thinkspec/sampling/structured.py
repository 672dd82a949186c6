"""Structured outputs on xgrammar: a grammar (JSON schema, JSON, regex, choice or EBNF) constrains
what a request may sample.

Plain decoding only: before each sampled row of a constrained sequence the grammar's bitmask sets
the logits of the tokens it forbids to -inf; the sampled token then advances the sequence's
matcher. With a reasoning parser the constraint starts at the first token after thinking ends
(a row sampled while the sequence thinks is left alone and not fed to the matcher); without one
it applies from the first token. Speculative engines refuse constrained requests (LLMEngine).

xgrammar is optional (`pip install 'thinkspec[structured]'`): it is imported only when a
constrained request arrives, and its absence is a ValueError naming the package. Grammars are
compiled by one GrammarCache per engine (xgrammar's compiler caches them); the server compiles
on its tokenizer thread before adding the request, so the engine's step loop finds them cached.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from thinkspec.structured_outputs import StructuredOutputsParams

XGRAMMAR_MISSING = "structured outputs need the xgrammar package: pip install 'thinkspec[structured]'"


def import_xgrammar() -> Any:
    """The xgrammar module; ValueError naming the package when it is not installed."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(XGRAMMAR_MISSING) from None
    return xgrammar


class GrammarCache:
    """Compiled grammars of one tokenizer (thread-safe); built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are always masked
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """-> xgrammar.CompiledGrammar; ValueError naming the problem (bad schema or regex, a grammar
        that accepts nothing, xgrammar missing)."""
        xgr = import_xgrammar()
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer; this engine has none")
        kind, text = spec.key()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info)
            compiler = self._compiler
        try:
            # No free whitespace between JSON tokens: a model may otherwise emit it without end.
            if kind == "json":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                compiled = compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c) for c in json.loads(text))
                )
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar reports bad input with several types
            raise ValueError(f"structured_outputs.{kind}: invalid {kind}: {str(e).strip()[:300]}") from None
        _check_accepts_something(xgr, compiled, kind, self.vocab_size)
        return compiled


def _check_accepts_something(xgr: Any, compiled: Any, kind: str, vocab_size: int) -> None:
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask)
    if not bool((mask != 0).any()):
        raise ValueError(f"structured_outputs.{kind}: the grammar accepts nothing")


@dataclass(slots=True)
class GrammarState:
    """One sequence's matcher and the output positions fed to it (ascending)."""

    matcher: Any
    fed: list[int] = field(default_factory=list)
    pending: int = -1  # the output position of the row masked this step, -1 = none


# Sequence -> its state, keyed by id() with the sequence kept to tell a reused id apart; entries of
# finished sequences are dropped when the next step looks them up.
_STATES: dict[int, tuple[Any, GrammarState]] = {}


def register(seq: Any, compiled: Any) -> None:
    xgr = import_xgrammar()
    _STATES[id(seq)] = (seq, GrammarState(xgr.GrammarMatcher(compiled)))


def grammar_rows(seqs: list[Any]) -> list[tuple[int, GrammarState]]:
    """(row, state) of the constrained sequences among seqs (one row each)."""
    if not _STATES:
        return []
    for key, (seq, _) in list(_STATES.items()):
        if seq.is_finished:
            del _STATES[key]
    rows = []
    for i, seq in enumerate(seqs):
        entry = _STATES.get(id(seq))
        if entry is not None and entry[0] is seq:
            rows.append((i, entry[1]))
    return rows


def apply_grammar(logits: torch.Tensor, seqs: list[Any], rows: list[tuple[int, GrammarState]]) -> None:
    """logits [S, V] float32, masked in place: each constrained row past thinking allows only what
    its grammar accepts next. Tokens fed but not committed (a failed step) are rolled back first."""
    xgr = import_xgrammar()
    masked = []
    for i, state in rows:
        seq = seqs[i]
        state.pending = -1
        while state.fed and state.fed[-1] >= seq.num_output_tokens:
            state.matcher.rollback(1)
            state.fed.pop()
        if seq.thinking:
            continue
        if not state.matcher.is_terminated():
            state.pending = seq.num_output_tokens
        masked.append((i, state))
    if not masked:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab)
    for i, state in masked:
        if state.pending >= 0:
            state.matcher.fill_next_token_bitmask(bitmask, i)
        else:  # the grammar is complete and its stop token was sampled (ignore_eos): only stop tokens
            bitmask[i] = 0
            for t in state.matcher.stop_token_ids:
                bitmask[i, t // 32] |= 1 << (t % 32)
    index = [i for i, _ in masked]
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=index)
    else:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=index)


def advance_grammar(tokens: torch.Tensor, rows: list[tuple[int, GrammarState]]) -> None:
    """tokens [S] int64 sampled: each masked row's token goes to its matcher (one host copy)."""
    pending = [(i, s) for i, s in rows if s.pending >= 0]
    if not pending:
        return
    host = tokens.tolist()
    for i, state in pending:
        if state.matcher.accept_token(int(host[i])):
            state.fed.append(state.pending)
        state.pending = -1


def grammar_cache(engine: Any) -> GrammarCache:
    """The engine's GrammarCache, made on first use (its tokenizer, the logits' width, its EOS ids)."""
    cache = getattr(engine, "_grammar_cache", None)
    if cache is None:
        eos = sorted(engine.eos_token_ids)
        cache = GrammarCache(engine.tokenizer, engine.model_info.vocab_size, eos)
        engine._grammar_cache = cache
    return cache


def compile_for_request(engine: Any, request_id: str, params: Any) -> Any:
    """The compiled grammar of a request being added to `engine` (LLMEngine); ValueError when it
    speculates (its verify rows are not masked yet: a constrained request there would not be
    constrained) or the grammar is bad."""
    if engine.speculator is not None:
        raise ValueError(
            f"request {request_id!r}: structured_outputs=... is not supported with speculative decoding "
            "yet; serve without --speculative-config for constrained requests"
        )
    return grammar_cache(engine).compile(params.structured_outputs)
