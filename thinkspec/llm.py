"""`LLM`: offline batch generation in vLLM's shape."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from thinkspec.engine.engine import LLMEngine, PromptType
from thinkspec.engine_args import EngineArgs
from thinkspec.model_names import resolve_model_name
from thinkspec.outputs import RequestOutput
from thinkspec.sampling_params import SamplingParams
from thinkspec.spec_decode.metrics import SpecDecodeMetrics
from thinkspec.utils import logger

Conversation = list[dict[str, Any]]


class LLM:
    """A model plus engine for offline generation.

    LLM(model, **kwargs): model is a checkpoint folder, a hub id or a bundled name ("toy-reasoner",
    "toy-reasoner-draft", also as speculative_config's model); kwargs are EngineArgs fields (see
    thinkspec/engine_args.py for each one's meaning and default), e.g. reasoning_parser="qwen3" or
    speculative_config={"method": "draft_model", "model": PATH, "num_speculative_tokens": 4,
    "relaxed_thinking": True}. An unknown name raises TypeError. When speculating, each
    RequestOutput's metrics.spec_decode holds that request's counters and `last_spec_metrics` the
    whole last generate()/chat() call's.

    A request whose prompt cannot run (longer than max_model_len or the KV pool, empty, bad token
    ids) fails alone: its RequestOutput has `error` set and finish_reason "error"; the other
    requests complete.
    """

    def __init__(self, model: str | os.PathLike[str], **kwargs: Any) -> None:
        if "kv_cache_memory_bytes" in kwargs:  # vLLM's name
            if "kv_cache_memory" in kwargs:
                raise TypeError("LLM() got both kv_cache_memory and kv_cache_memory_bytes; give one")
            kwargs["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
        known = {f.name for f in fields(EngineArgs)}
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s): {', '.join(map(repr, unknown))}")
        if kwargs.get("tokenizer") is not None:
            kwargs["tokenizer"] = str(kwargs["tokenizer"])
        args = EngineArgs(model=str(model), **kwargs)
        self.llm_engine = build_llm_engine(args)
        self.engine_args = args
        self.last_spec_metrics: SpecDecodeMetrics | None = None

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (deleting the LLM does it too)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (temperature, top_p,
        top_k), as vLLM does; plain SamplingParams() when there are none."""
        info = self.llm_engine.model_info
        names = ("temperature", "top_p", "top_k")
        kwargs = {k: getattr(info, k) for k in names if getattr(info, k) is not None}
        return SamplingParams(**kwargs)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list: strings, token-id lists, or {"prompt_token_ids": [...]}
        dicts. sampling_params: one for all, or one per prompt. Returns outputs in input order."""
        if isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        return self._run(prompts, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of
        them, through the tokenizer's chat template with add_generation_prompt=True."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError(f"chat() needs a tokenizer, there is none ({self.llm_engine._no_tokenizer})")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; use generate() with a formatted prompt")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts: list[PromptType] = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
            )
            # The template already wrote any special tokens; encoding must not add more.
            ids = tokenizer.encode(text, add_special_tokens=False)
            # The kwargs go along: enable_thinking decides where the reasoning split starts.
            prompts.append({
                "prompt": text, "prompt_token_ids": ids, "chat_template_kwargs": chat_template_kwargs
            })
        return self._run(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
                )
        engine = self.llm_engine
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, sp in zip(prompts, params):
            request_id = engine.next_request_id()
            order.append(request_id)
            try:
                engine.add_request(prompt, sp, request_id)
            except ValueError as e:
                text = prompt if isinstance(prompt, str) else None
                ids: list[int] = []
                if isinstance(prompt, Mapping):
                    text = prompt.get("prompt")
                    ids = list(prompt.get("prompt_token_ids") or [])
                elif isinstance(prompt, (list, tuple)):
                    ids = list(prompt)
                logger.warning("request %s failed: %s", request_id, e)
                results[request_id] = engine.error_output(request_id, text, ids, str(e))
        self._drive(results, len(order), use_tqdm and len(order) > 1)
        outputs = [results[r] for r in order]
        if engine.speculator is not None and not self.engine_args.disable_log_stats:
            total = SpecDecodeMetrics()
            for out in outputs:
                if out.metrics is not None and out.metrics.spec_decode is not None:
                    total.merge(out.metrics.spec_decode)
            self.last_spec_metrics = total
            logger.info(
                "speculative decoding: mean acceptance length %.3f (thinking %.3f, answer %.3f), "
                "draft acceptance rate %.3f, relaxed-only share %.3f",
                total.mean_acceptance_length(), total.mean_acceptance_length("thinking"),
                total.mean_acceptance_length("answer"), total.draft_acceptance_rate(), total.relaxed_share(),
            )  # fmt: skip
        return outputs

    def _drive(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, initial=len(results))
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step(finished_only=True):
                    results[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids)
                    out_tokens += len(out.outputs[0].token_ids)
                    if bar is not None:
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(
                            f"est. speed input: {in_tokens / elapsed:.2f} toks/s, "
                            f"output: {out_tokens / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()


def build_llm_engine(args: EngineArgs) -> LLMEngine:
    """The engine for validated EngineArgs, as LLM(...) and `thinkspec serve` build it: bundled model
    names become their folders (args is updated in place to what the engine loads), a hub revision or
    download_dir is fetched first, and chat_template replaces the tokenizer's template."""
    chat_template = load_chat_template(args.chat_template)
    resolve_model_names(args)
    _fetch_hub_revisions(args)
    engine = LLMEngine(args)
    if chat_template is not None:
        if engine.tokenizer is None:
            engine.shutdown()
            raise ValueError(f"chat_template needs a tokenizer, there is none ({engine._no_tokenizer})")
        engine.tokenizer.chat_template = chat_template
    return engine


def resolve_model_names(args: EngineArgs) -> None:
    """The model, tokenizer and draft model given by a bundled name become its folder; ValueError
    naming the argument (e.g. speculative_config.model) for a mistyped name."""
    args.model = resolve_model_name(args.model)
    if args.tokenizer is not None:
        args.tokenizer = resolve_model_name(args.tokenizer, "tokenizer")
    spec = args.speculative_config
    if spec is not None and spec.model is not None:
        spec.model = resolve_model_name(spec.model, "speculative_config.model")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template / chat_template: a file's contents, or the value itself when it is a
    template (it has Jinja delimiters); a value that is neither is taken for a missing file."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template={value!r} is neither a file nor a Jinja template")


def _fetch_hub_revisions(args: EngineArgs) -> None:
    """Download a hub model (or its tokenizer) at the revision / into download_dir asked for, and
    point args at the local folder; local folders and plain hub ids are left to the loader."""
    wanted = (args.revision, args.tokenizer_revision, args.download_dir)
    if all(v is None for v in wanted) or Path(args.model).expanduser().exists():
        return
    from thinkspec.models.loader import resolve_model_path

    tokenizer_source = args.tokenizer or args.model
    tokenizer_revision = args.tokenizer_revision or args.revision
    if not Path(tokenizer_source).expanduser().exists() and tokenizer_revision != args.revision:
        args.tokenizer = str(resolve_model_path(tokenizer_source, tokenizer_revision, args.download_dir))
    args.model = str(resolve_model_path(args.model, args.revision, args.download_dir))
