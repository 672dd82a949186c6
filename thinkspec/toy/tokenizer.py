"""Byte-level BPE tokenizer for the toy reasoner, in Qwen3's layout and chat format.

Pre-tokenization follows Qwen2/Qwen3's split pattern, so every digit is its own token (a space
before a number joins its first digit); BPE merges are learnt on task text, so the task's words
become single tokens (a wording fork is then one token). Any UTF-8 text still encodes, through
the 256 byte symbols.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK_START, THINK_END)
DEFAULT_VOCAB_SIZE = 1024

# Qwen2/Qwen3 pre-tokenizer pattern (single digits, letters with one leading non-letter), except that
# a space joins the digit after it and punctuation never absorbs the newlines after it, so a fork
# after "." stays one clean token.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's chat format for the parts this model uses: system/user/assistant turns, thinking
# blocks, `add_generation_prompt`, and `enable_thinking=False` (an empty closed think block).
# The generation prompt opens the think block, as the R1-distill and QwQ templates do, so the
# model answers any prompt with reasoning first rather than deciding whether to think.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.get('reasoning_content') -%}"
    "{{- '<think>\\n' + message['reasoning_content'].strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}"
    "{{- '<think>\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `corpus` and wrap it for transformers.

    Ids 0-4 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`; the last
    two are added tokens that are not "special" (as in Qwen3) so decoding with
    `skip_special_tokens=True` keeps the think block visible.
    """
    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 65536:
        raise ValueError(f"vocab_size must be in ({256 + len(SPECIAL_TOKENS)}, 65536], got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    specials = (ENDOFTEXT, IM_START, IM_END)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build_task_tokenizer(
    n_samples: int = 4000, seed: int = 1234, vocab_size: int = DEFAULT_VOCAB_SIZE, n_range_samples: int = 1000
) -> PreTrainedTokenizerFast:
    """The toy reasoner's tokenizer, learnt on `n_samples` easy task samples from `seed` plus
    `n_range_samples` from the training range (seed + 1), so the words of the harder levels (column
    names past the thousands) are single tokens too."""
    from thinkspec.toy.task import TRAIN_MIXES, generate_mixed_samples, generate_samples

    texts = [s.text for s in generate_samples(n_samples, seed)]
    texts += [s.text for s in generate_mixed_samples(n_range_samples, seed + 1, TRAIN_MIXES["range"])]
    return build_tokenizer(texts, vocab_size)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, path: str | Path) -> None:
    """Writes tokenizer.json, tokenizer_config.json (with the chat template) and friends."""
    tokenizer.save_pretrained(str(path))
