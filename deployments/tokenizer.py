"""Loading a checkpoint's tokenizer and turning chat messages into prompt ids.

Owns the one place where transformers' tokenizer machinery is touched, so the rest of the
serving code deals only in token ids and strings. Loading never reaches the network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer stored in `model_dir` (tokenizer.json + tokenizer_config.json), offline."""
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    enable_thinking: bool = True,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt ids for `messages` rendered with the tokenizer's chat template.

    Rendering to text first and encoding without extra special tokens keeps the ids exactly
    what the template says (no BOS/EOS added by a post-processor), whatever transformers'
    `apply_chat_template(tokenize=True)` return type is in the installed version.
    """
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], *, skip_special: bool = False
) -> str:
    """Text of `ids`; byte-exact inverse of `encode` for the tiny tokenizer."""
    return tokenizer.decode(
        list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
    )
