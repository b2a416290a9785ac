"""The embedded tiny GLM-style tokenizer: a byte-level BPE that can encode any text.

Owns the tokenizer files of the tiny checkpoint (`tokenizer.json`, `tokenizer_config.json`):
the vocabulary layout, the special tokens and their ids, and the GLM chat template (kept in
`templates/glm53_chat.jinja` and embedded into the config). The vocabulary is the 256
byte-level symbols (id == byte value, no merges) followed by GLM's special tokens, so every
UTF-8 string round-trips and the ids are stable without training anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
)
NUM_BYTE_TOKENS = 256
TINY_VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)
SPECIAL_TOKEN_IDS: dict[str, int] = {
    tok: NUM_BYTE_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS)
}

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|endoftext|>"
# GLM stops a turn on end-of-text, or when the model starts the next user/tool turn.
EOS_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")
DEFAULT_MODEL_MAX_LENGTH = 131072
CHAT_TEMPLATE_NAME = "glm53_chat.jinja"
# transformers 5.x aliases PreTrainedTokenizerFast to TokenizersBackend; the alias is the name
# every transformers version can resolve, so the files also load with older readers.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


@dataclass(frozen=True)
class TokenizerIds:
    """The ids a model config / generation config needs from the tokenizer."""

    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    bos_token_id: int | None = None


def chat_template() -> str:
    """The GLM chat template shipped as package data (no trailing newline)."""
    src = resources.files("glm53.deployments").joinpath("templates", CHAT_TEMPLATE_NAME)
    return src.read_text(encoding="utf-8").rstrip("\n")


def build_tiny_tokenizer() -> Tokenizer:
    """A `tokenizers.Tokenizer` with byte ids 0..255 and the special tokens at 256.."""
    symbol_of_byte = _gpt2_bytes_to_unicode()
    # The pre-tokenizer maps bytes with the same table; a mismatch would make bytes unknown.
    if set(symbol_of_byte.values()) != set(ByteLevel.alphabet()):
        raise RuntimeError("byte-level alphabet of `tokenizers` differs from the GPT-2 table")
    vocab = {symbol_of_byte[b]: b for b in range(NUM_BYTE_TOKENS)}  # id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    # add_prefix_space=False: the text is encoded exactly as given (no invisible leading space).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    added = tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    if added != len(SPECIAL_TOKENS) or tok.get_vocab_size() != TINY_VOCAB_SIZE:
        raise RuntimeError("tiny tokenizer vocabulary does not have the expected layout")
    return tok


def tokenizer_config(model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> dict:
    """The `tokenizer_config.json` contents for the tiny tokenizer."""
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        # The v4 key; transformers 5 reads it as `extra_special_tokens`.
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "model_max_length": model_max_length,
        "padding_side": "left",
        # The default clean-up rewrites " ." to "." on decode, which breaks round-trips.
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template(),
    }


def write_tiny_tokenizer(
    out_dir: Path, *, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH
) -> TokenizerIds:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir` (same bytes every run)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return tiny_tokenizer_ids()


def tiny_tokenizer_ids() -> TokenizerIds:
    return TokenizerIds(
        vocab_size=TINY_VOCAB_SIZE,
        eos_token_ids=[SPECIAL_TOKEN_IDS[t] for t in EOS_TOKENS],
        pad_token_id=SPECIAL_TOKEN_IDS[PAD_TOKEN],
        bos_token_id=None,
    )


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level table (what ByteLevel uses): printable bytes stand for themselves,
    # the other 68 bytes are shifted to U+0100.. in byte order.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping
