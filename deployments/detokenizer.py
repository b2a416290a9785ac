"""Incremental detokenization and stop strings: token ids in, text deltas out.

`IncrementalDetokenizer` turns a growing list of ids into text deltas whose concatenation is
exactly `tokenizer.decode(all ids)`. It decodes a small window (vLLM's prefix/read offsets),
and holds back text that ends in U+FFFD: with a byte-level vocabulary a character may span
several tokens, and its first bytes alone decode to a replacement char that the next token
may still complete. Only `flush` (end of the request) releases a trailing U+FFFD, i.e. where
the final text has one.

`StopStrings` cuts text at the stop string that completes first and never lets one leak: it
holds back the longest suffix that could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_ids: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = frozenset(skip_ids)
        self.ids: list[int] = []
        # decode window: ids[prefix:] is decoded with ids[prefix:read] as context (a character
        # boundary; tokenizers like SentencePiece render a token differently without its left
        # neighbour); `extra` chars past the context's text are already released too
        self._prefix_offset = 0
        self._read_offset = 0
        self._extra = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)

    def add(self, ids: Iterable[int]) -> str:
        """Append ids; return the text that is now final."""
        self.ids.extend(i for i in ids if i not in self._skip)
        return self._release(final=False)

    def flush(self) -> str:
        """The rest of the text (end of the request), incomplete characters included."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        start = len(prefix) + self._extra
        # Only a trailing U+FFFD can still change (into a character completed by later bytes);
        # lossy UTF-8 decoding never revises an earlier replacement.
        clean = final or not full.endswith(REPLACEMENT)
        end = len(full) if clean else len(full) - 1
        delta = full[start:end] if end > start else ""
        if clean:
            self._prefix_offset, self._read_offset, self._extra = (
                self._read_offset, len(self.ids), 0)
        else:
            self._extra += len(delta)
        return delta


class StopStrings:
    """Releases text up to the first stop string; `hit` once one was found."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self._pending = ""
        self.hit: str | None = None

    def process(self, text: str, final: bool = False) -> str:
        if self.hit is not None:
            return ""
        window = self._pending + text
        if not self.stops:
            return window
        # the stop that completes first wins (what a token-by-token check sees), so the
        # result does not depend on how the text was split into pieces
        found = [(i + len(s), i, s) for s in self.stops if (i := window.find(s)) >= 0]
        if found:
            _, index, self.hit = min(found)
            self._pending = ""
            return window[:index]
        if final:
            self._pending = ""
            return window
        keep = self._holdback(window)
        self._pending = window[len(window) - keep:] if keep else ""
        return window[:len(window) - keep]

    def _holdback(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(window)), best, -1):
                if window.endswith(stop[:k]):
                    best = k
                    break
        return best
