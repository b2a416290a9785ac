"""Needle in a haystack: the prompts and the scoring of `glm53 bench needle`.

A cell is (length, depth). Its prompt holds at most `length` tokens of the model's tokenizer,
the chat template included, and as many whole filler sentences as fit (at least one). The user
message is filler text with one needle sentence ("Important record: the access code for the
Larkspur vault is 40718263.") placed `depth` of the way through the filler, counted in tokens
(0: before the first filler sentence, 1: after the last), then the question asking for that
code. Each cell draws its own 8-digit code, and the filler has no digits, so only the needle
can answer.

Without a chat template (or with `chat=False`) the prompt is the raw text
`{haystack}\\n\\n{question}\\nAnswer: `.

Scoring follows the reference runtime's needle gate (design/exl3-dflash-spec.md §A.7: 17 of 18
cells to 499K tokens, the miss being reasoning that ran out of tokens). The reply is the text
after the reasoning block; a cell is a hit when the reply holds the code as a whole number
(thousands separators allowed). Whether the reasoning found it is reported apart, and a reply
that never started because `max_tokens` ran out inside the reasoning is `unanswered`, not a
plain miss.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .chat import THINK_START, ChatTemplate

NEEDLE = "Important record: the access code for the Larkspur vault is {code}."
QUESTION = "What is the access code for the Larkspur vault? Reply with the code only."
RAW_FORMAT = "{content}\nAnswer: "  # the prompt when there is no chat template
# Plain, digit-free sentences; the haystack cycles through them in this order.
FILLER = (
    "The river bends twice before it reaches the old mill at the edge of town.",
    "Most mornings the baker opens his shutters while the street is still dark.",
    "A gardener once planted a row of pear trees along the northern wall.",
    "Travelers often stop at the inn to rest their horses and trade stories.",
    "The library keeps its oldest maps in a cool room behind the reading hall.",
    "In autumn the hills turn brown and the shepherds bring their flocks down.",
    "Children gather by the fountain in the square to watch the pigeons.",
    "The ferry crosses the lake slowly, and the captain hums while he steers.",
    "Every spring the council argues about repairing the narrow stone bridge.",
    "A light rain fell over the orchards, and the air smelled of wet leaves.",
    "The clockmaker repairs watches in a small shop that smells of oil and brass.",
    "Wild geese fly south over the marshes when the evenings grow cold.",
)
SEPARATOR = " "  # between sentences
REASONING_TAIL_CHARS = 240


@dataclass(frozen=True)
class NeedlePrompt:
    """One cell's prompt and where its parts landed, in token positions of `ids`."""

    length: int  # requested prompt tokens (a ceiling)
    depth: float  # requested depth in [0, 1]
    code: str
    ids: list[int]
    haystack: tuple[int, int]  # [start, end) of filler + needle
    needle: tuple[int, int]  # [start, end) of the needle sentence
    filler_sentences: int
    opens_reasoning: bool  # the prompt ends inside the reasoning block (`<think>`)

    @property
    def needle_depth(self) -> float:
        """Where the needle starts within the filler tokens around it (0..1)."""
        filler = (self.haystack[1] - self.haystack[0]) - (self.needle[1] - self.needle[0])
        return (self.needle[0] - self.haystack[0]) / filler if filler > 0 else 0.0


def needle_codes(cells: int, seed: int) -> list[str]:
    """One 8-digit code per cell, the same for the same seed."""
    rng = random.Random(seed)
    return [str(rng.randrange(10**7, 10**8)) for _ in range(cells)]


class HaystackBuilder:
    """Builds `NeedlePrompt`s with the model's tokenizer (and its chat template when `chat`
    and the tokenizer has one; `thinking=False` renders the template's thinking-off prompt)."""

    def __init__(self, tokenizer: Any, chat: bool = True, thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer) if chat and _has_template(tokenizer) else None
        if self.template is not None and not thinking \
                and "enable_thinking" not in self.template.variables:
            raise ValueError("this model's chat template cannot turn thinking off")
        self.thinking = thinking
        # tokens of each filler sentence with its separator; sums estimate a haystack's size
        self.sentence_tokens = [len(self._encode(s + SEPARATOR)) for s in FILLER]

    @property
    def format(self) -> str:
        if self.template is None:
            return "raw"
        return "chat" if self.thinking else "chat, thinking off"

    def build(self, length: int, depth: float, code: str) -> NeedlePrompt:
        """The prompt of at most `length` tokens with the needle at `depth`; ValueError when
        the needle, the question and one filler sentence do not fit."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        least = self._assemble(1, depth, code, length)
        if len(least.ids) > length:
            raise ValueError(f"length {length} cannot hold the needle, the question and one "
                             f"filler sentence ({len(least.ids)} tokens)")
        n = 1 + self._estimate_sentences(length - len(least.ids), start=1)
        prompt = self._assemble(n, depth, code, length)
        while len(prompt.ids) > length:  # the estimate missed tokens merged across sentences
            over = len(prompt.ids) - length
            n = max(1, n - -(-over // max(self.sentence_tokens)))
            prompt = self._assemble(n, depth, code, length)
        while True:  # the estimate may leave room for one more sentence
            grown = self._assemble(n + 1, depth, code, length)
            if len(grown.ids) > length:
                return prompt
            n, prompt = n + 1, grown

    def _estimate_sentences(self, room: int, start: int) -> int:
        """How many filler sentences after the first `start` fit in `room` tokens."""
        tokens = self.sentence_tokens[start:] + self.sentence_tokens[:start]  # in cycle order
        cycle = sum(tokens)
        n = (room // cycle) * len(FILLER)
        room -= (room // cycle) * cycle
        for t in tokens:
            if t > room:
                break
            n, room = n + 1, room - t
        return n

    def _assemble(self, n: int, depth: float, code: str, length: int) -> NeedlePrompt:
        sentences = [FILLER[i % len(FILLER)] for i in range(n)]
        # the needle goes between the sentences whose token count is nearest depth * total
        cum = [0]
        for i in range(n):
            cum.append(cum[-1] + self.sentence_tokens[i % len(FILLER)])
        target = depth * cum[-1]
        k = bisect.bisect_left(cum, target)
        if k > 0 and (k == len(cum) or target - cum[k - 1] <= cum[k] - target):
            k -= 1
        needle = NEEDLE.format(code=code)
        before = "".join(s + SEPARATOR for s in sentences[:k])
        haystack = before + needle + "".join(SEPARATOR + s for s in sentences[k:])
        content = f"{haystack}\n\n{QUESTION}"
        text = self._render(content)
        ids, offsets = self._encode_with_offsets(text)
        start = text.find(content)
        if start < 0:
            raise ValueError("the chat template changed the message text; use --raw")
        at = start + len(before)
        return NeedlePrompt(length, depth, code, ids,
                            _token_span(offsets, start, start + len(haystack)),
                            _token_span(offsets, at, at + len(needle)), n,
                            self.template is not None and text.endswith(THINK_START))

    def _render(self, content: str) -> str:
        if self.template is None:
            return RAW_FORMAT.format(content=content)
        kwargs = None if self.thinking else {"enable_thinking": False}
        return self.template.render([{"role": "user", "content": content}],
                                    template_kwargs=kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                             verbose=False)  # no warning past the tokenizer's nominal length
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _has_template(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(template)


def _token_span(offsets: Sequence[tuple[int, int]], begin: int, end: int) -> tuple[int, int]:
    """[first, last + 1) of the tokens that overlap characters [begin, end); a token merged
    across an edge counts as inside. Offsets of one encoding are in text order."""
    first = bisect.bisect_right([e for _, e in offsets], begin)
    return first, bisect.bisect_left([s for s, _ in offsets], end, lo=first)


def split_reasoning(ids: Sequence[int], opens_reasoning: bool, think_start: int | None,
                    think_end: int | None) -> tuple[list[int], list[int]]:
    """(reasoning ids, reply ids) of an output: reasoning runs from the prompt's open `<think>`
    (or a leading one in the output) to `</think>`; without `</think>` it never ended."""
    ids = list(ids)
    if not opens_reasoning:
        if not ids or ids[0] != think_start:
            return [], ids
        ids = ids[1:]
    if think_end in ids:
        i = ids.index(think_end)
        return ids[:i], ids[i + 1:]
    return ids, []


@dataclass(frozen=True)
class NeedleScore:
    outcome: str  # "hit", "miss" or "unanswered" (max_tokens ran out before the reply)
    hit: bool  # the reply holds the code
    reasoning_hit: bool  # the reasoning holds the code

    @property
    def label(self) -> str:
        return {"hit": "HIT", "miss": "miss", "unanswered": "no reply"}[self.outcome]


def holds_code(text: str, code: str) -> bool:
    """`code` appears in `text` as a whole number; separators inside it (1,234 / 1 234) are
    ignored."""
    joined = re.sub(r"(?<=\d)[,\s_](?=\d)", "", text)
    return re.search(rf"(?<!\d){re.escape(code)}(?!\d)", joined) is not None


def score_answer(reply: str, reasoning: str, code: str, finish_reason: str) -> NeedleScore:
    """Score one cell: its reply and reasoning text and why generation stopped."""
    hit = holds_code(reply, code)
    if hit:
        outcome = "hit"
    elif finish_reason == "length" and not reply.strip():
        outcome = "unanswered"
    else:
        outcome = "miss"
    return NeedleScore(outcome, hit, holds_code(reasoning, code))


def reasoning_tail(reasoning: str) -> str:
    return reasoning[-REASONING_TAIL_CHARS:]

