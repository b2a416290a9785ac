"""The embedded tiny tokenizer: byte round-trips, special-token ids, chat template, determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm53.deployments.tiny_tokenizer import (
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    TokenizerIds,
    write_tiny_tokenizer,
)
from glm53.deployments.tokenizer import apply_chat_template, decode

TEXTS = [
    "Hello from glm53",
    "hello , world . spaces  kept ",
    "héllo 世界",
    "emoji 🚀\n\ttabs and newlines\r\n",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tiny_tokenizer_dir: Path) -> Path:
    return tiny_tokenizer_dir


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def test_ids_returned(tmp_path: Path) -> None:
    ids = write_tiny_tokenizer(tmp_path)
    assert isinstance(ids, TokenizerIds)
    assert ids.vocab_size == TINY_VOCAB_SIZE == 256 + len(SPECIAL_TOKENS)
    assert ids.eos_token_ids == [256, 256 + 7, 256 + 9]  # endoftext, user, observation
    assert ids.pad_token_id == 256
    assert ids.bos_token_id is None
    with pytest.raises(AttributeError):
        ids.vocab_size = 1  # type: ignore[misc]  # frozen


def test_vocab_layout(tok) -> None:
    assert len(tok) == TINY_VOCAB_SIZE
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 256
    assert tok.pad_token_id == 256
    assert tok.bos_token_id is None
    assert tok.padding_side == "left"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    # No merges: one id per UTF-8 byte, and the id is the byte value.
    assert ids == list(text.encode("utf-8"))
    assert decode(tok, ids) == text


def test_special_tokens_are_single_ids_in_order(tok) -> None:
    for i, special in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(special) == 256 + i
        assert tok.encode(special, add_special_tokens=False) == [256 + i]
    mixed = "a<|user|>b"
    assert tok.encode(mixed, add_special_tokens=False) == [ord("a"), 263, ord("b")]
    assert decode(tok, tok.encode(mixed, add_special_tokens=False)) == mixed
    assert decode(tok, [ord("a"), 263, ord("b")], skip_special=True) == "ab"


MESSAGES = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Yo", "reasoning_content": "greet back"},
    {"role": "observation", "content": "{}"},
    {"role": "user", "content": "héllo 世界"},
]
HISTORY = (
    "[gMASK]<sop><|system|>\nBe terse.<|user|>\nHi<|assistant|>\n<think>greet back</think>Yo"
    "<|observation|>\n{}<|user|>\nhéllo 世界"
)


def test_chat_template_thinking_on(tok) -> None:
    ids = apply_chat_template(tok, MESSAGES)
    assert decode(tok, ids) == HISTORY + "<|assistant|>\n<think>"
    assert ids[:2] == [258, 260]  # [gMASK] <sop> as single ids
    assert ids[-3:] == [264, ord("\n"), 266]  # <|assistant|> \n <think>


def test_chat_template_thinking_off(tok) -> None:
    ids = apply_chat_template(tok, MESSAGES, enable_thinking=False)
    assert decode(tok, ids) == HISTORY + "<|assistant|>\n<think></think>"
    assert ids[-4:] == [264, ord("\n"), 266, 267]


def test_chat_template_without_generation_prompt(tok) -> None:
    ids = apply_chat_template(tok, MESSAGES, add_generation_prompt=False)
    assert decode(tok, ids) == HISTORY


def test_chat_template_tool_alias_and_parts(tok) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "r"},
    ]
    text = decode(tok, apply_chat_template(tok, messages, add_generation_prompt=False))
    assert text == "[gMASK]<sop><|user|>\nab<|assistant|>\n<think></think><|observation|>\nr"


def test_chat_template_rejects_unknown_role(tok) -> None:
    with pytest.raises(Exception, match="unsupported chat role"):
        apply_chat_template(tok, [{"role": "wizard", "content": "x"}])


def test_files_are_deterministic(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path / "a")
    # The second write runs in a fresh interpreter with another hash seed, so nothing may
    # depend on set/dict iteration order of one process.
    code = "import sys; from pathlib import Path; "
    code += "from glm53.deployments.tiny_tokenizer import write_tiny_tokenizer as w; "
    code += "w(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, env=env)
    names = ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"].startswith("{#-")
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
