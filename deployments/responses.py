"""One choice of an OpenAI response, and the JSON the API returns.

`ChoiceState` turns one engine request's RequestOutput deltas into OpenAI deltas:
ids -> incremental detokenizer -> stop strings -> reasoning split -> tool-call parser, with the
sampled tokens' logprobs alongside. The same pipeline serves streaming and non-streaming
requests, so their texts are identical by construction. The functions below render deltas as
chat / completion chunks and full responses (plain dicts); `ResponseFormatter` does it for all
choices of one request.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from glm53.raycluster.api import RequestOutput, TokenLogprob

from .chat import THINK_END, THINK_START, ReasoningParser, ToolCall, ToolCallParser
from .detokenizer import IncrementalDetokenizer, StopStrings
from .tiny_tokenizer import _gpt2_bytes_to_unicode


@dataclass
class Delta:
    index: int
    text: str = ""  # content (chat) or text (completions)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # echo
    finish_reason: str | None = None

    @property
    def empty(self) -> bool:
        return not (self.text or self.reasoning or self.tool_calls or self.logprobs
                    or self.prompt_logprobs or self.finish_reason)


class TokenTexts:
    """Per-token text and raw bytes for logprobs (byte-level vocabularies map back exactly)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of = ({c: b for b, c in _gpt2_bytes_to_unicode().items()}
                         if type(decoder).__name__ == "ByteLevel" else None)
        self._added = set(tokenizer.get_added_vocab().values())

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one instance per replica
    def text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def bytes(self, token_id: int) -> list[int]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return []
        if self._byte_of is not None and token_id not in self._added and all(
                c in self._byte_of for c in piece):
            return [self._byte_of[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))


class ChoiceState:
    def __init__(self, index: int, tokenizer: Any, *, stop_strings: list[str],
                 include_stop_str: bool, stop_token_ids: set[int], skip_ids: set[int],
                 reasoning_start: bool | None, tools: list[dict] | None,
                 echo_ids: list[int] | None = None, tool_prefix: str = "") -> None:
        self.index = index
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids)
        self._stops = StopStrings(stop_strings)
        self._include_stop = include_stop_str
        self._stop_ids = stop_token_ids
        self._reasoning = ReasoningParser(reasoning_start) if reasoning_start is not None else None
        self._tools = ToolCallParser(tools) if tools is not None else None
        if self._tools is not None and tool_prefix:  # a call the prompt already opened
            self._tools.feed(tool_prefix)
        self._echo_ids = echo_ids
        # echo: the first prompt token has no logprob (NaN marks it)
        self._prompt_lps = [TokenLogprob(echo_ids[0], math.nan, 0, ())] if echo_ids else []
        self.num_tokens = 0
        self.num_prompt_tokens = 0
        # token-level reasoning count (usage.completion_tokens_details.reasoning_tokens): the
        # tokens before `</think>` when the prompt opened reasoning, or a leading `<think>`
        self.num_reasoning_tokens = 0
        self._think_ids = (tokenizer.convert_tokens_to_ids(THINK_START),
                           tokenizer.convert_tokens_to_ids(THINK_END))
        self._in_reasoning = reasoning_start
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def feed(self, out: RequestOutput) -> Delta:
        delta = Delta(self.index)
        if out.prompt_logprobs and self._echo_ids is not None:
            self._prompt_lps.extend(out.prompt_logprobs)
        ids = list(out.new_token_ids)
        self._count_reasoning(ids)
        self.num_tokens += len(ids)
        delta.logprobs = list(out.logprobs or [])
        reason = out.finish_reason.value if out.finish_reason is not None else None
        if reason == "stop" and ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]  # the eos / stop token itself is not text
        final = reason is not None
        text = self._detok.add(ids) + (self._detok.flush() if final else "")
        if self._echo_ids is not None and (ids or final):
            prompt_text = self._tokenizer.decode(self._echo_ids, skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False)
            delta.prompt_logprobs, self._prompt_lps = self._prompt_lps, []
            self._echo_ids = None
        else:
            prompt_text = ""
        text = self._stops.process(text, final)
        if self._stops.hit is not None:
            final, reason = True, "stop"
            if self._include_stop:
                text += self._stops.hit
        if reason == "error":  # the engine failed; the server answers with an error
            self.error = f"engine error: {getattr(out, 'error', None) or 'unknown'}"
        content = text
        if self._reasoning is not None:
            delta.reasoning, content = self._reasoning.feed(text, final)
        if self._tools is not None:
            content, delta.tool_calls = self._tools.feed(content, final)
            if reason == "stop" and self._tools.num_calls:
                reason = "tool_calls"
        delta.text = prompt_text + content
        if final:
            self.finish_reason = delta.finish_reason = reason
        return delta


    def _count_reasoning(self, ids: list[int]) -> None:
        start_id, end_id = self._think_ids
        for i, token in enumerate(ids):
            if self._in_reasoning is None:
                return  # no reasoning split for this choice (completions)
            if self._in_reasoning:
                if token == end_id:
                    self._in_reasoning = None  # reasoning is over
                else:
                    self.num_reasoning_tokens += 1
            elif self.num_tokens + i == 0 and token == start_id:
                self._in_reasoning = True
            else:
                self._in_reasoning = None


DONE = "data: [DONE]\n\n"


# Characters Python's str.splitlines (and so httpx's aiter_lines, requests' iter_lines) takes
# for line ends that json.dumps(ensure_ascii=False) leaves raw: a sampled token holding one would
# cut its event in two for those clients. JSON's \uXXXX escape keeps the text and the one line.
_LINE_BREAKS_KEPT_RAW = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event: compact JSON on one line for every line splitter."""
    text = json.dumps(obj, ensure_ascii=False, separators=(',', ':'))
    return f"data: {text.translate(_LINE_BREAKS_KEPT_RAW)}\n\n"


# ----- chat -----
def token_namer(texts: TokenTexts, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:{id}" (vLLM's
    return_tokens_as_token_ids, exact even where the text is a lone UTF-8 fragment)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else texts.text


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts,
                  name: Callable[[int], str]) -> dict[str, Any] | None:
    if not entries:
        return None

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": name(token_id), "logprob": max(logprob, -9999.0),
                "bytes": texts.bytes(token_id)}
    return {"content": [{**one(e.token_id, e.logprob),
                         "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


def chat_delta(delta: Delta, first: bool, tool_index: int, texts: TokenTexts,
               name: Callable[[int], str]) -> dict[str, Any] | None:
    """A chat.completion.chunk choice, or None when there is nothing to send."""
    if delta.empty and not first:
        return None
    body: dict[str, Any] = {}
    if first:
        body["role"] = "assistant"
        body["content"] = ""
    if delta.reasoning:
        body["reasoning_content"] = body["reasoning"] = delta.reasoning
    if delta.text:
        body["content"] = delta.text
    if delta.tool_calls:
        body["tool_calls"] = [call.to_openai(tool_index + k)
                              for k, call in enumerate(delta.tool_calls)]
    return {"index": delta.index, "delta": body,
            "logprobs": chat_logprobs(delta.logprobs, texts, name),
            "finish_reason": delta.finish_reason}


def chat_message(text: str, reasoning: str, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant",
                               "content": text if (text or not calls) else None,
                               "reasoning_content": reasoning or None,
                               "reasoning": reasoning or None}
    if calls:
        message["tool_calls"] = [call.to_openai() for call in calls]
    return message


# ----- completions -----
def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, offset: int,
                        name: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for e in entries:
        token = texts.text(e.token_id)
        out["tokens"].append(name(e.token_id))
        if math.isnan(e.logprob):  # the first prompt token has no logprob
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(max(e.logprob, -9999.0))
            out["top_logprobs"].append({name(t): max(lp, -9999.0) for t, lp in e.top})
        out["text_offset"].append(offset)
        offset += len(token)
    out["next_offset"] = offset
    return out


def usage(prompt_tokens: int, completion_tokens: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


class ResponseFormatter:
    """Turns the deltas of one request's choices into chunks or the final response."""

    def __init__(self, kind: str, response_id: str, created: int, model: str, request: Any,
                 choices: list[ChoiceState], texts: TokenTexts) -> None:
        self.kind, self.id, self.created, self.model = kind, response_id, created, model
        self.request, self.choices, self.texts = request, choices, texts
        self.name = token_namer(texts, request.return_tokens_as_token_ids)
        self.started: set[int] = set()
        self.tool_index = [0] * len(choices)
        self.text_offset = [0] * len(choices)  # completions logprobs: next token's offset
        self.acc = [{"text": [], "reasoning": [], "calls": [], "logprobs": [],
                     "prompt_logprobs": [], "finish": None} for _ in choices]

    def _usage(self) -> dict[str, Any]:
        prompts = self.choices[::self.request.n]
        return usage(sum(c.num_prompt_tokens for c in prompts),
                     sum(c.num_tokens for c in self.choices),
                     sum(c.num_reasoning_tokens for c in self.choices)
                     if self.kind == "chat" else None)

    def _chunk(self, choices: list[dict], with_usage: bool = False) -> str:
        obj = {"id": self.id, "object": ("chat.completion.chunk" if self.kind == "chat"
                                         else "text_completion"),
               "created": self.created, "model": self.model, "choices": choices}
        if self.request.include_usage:
            continuous = self.request.stream_options.continuous_usage_stats
            obj["usage"] = self._usage() if (with_usage or continuous) else None
        return sse(obj)

    def stream_chunks(self, deltas: list[Delta]) -> str:
        parts = []
        for d in deltas:
            if self.kind == "chat":
                first = d.index not in self.started
                self.started.add(d.index)
                choice = chat_delta(d, first, self.tool_index[d.index], self.texts, self.name)
                self.tool_index[d.index] += len(d.tool_calls)
            elif d.empty:
                choice = None
            else:
                choice = {"index": d.index, "text": d.text,
                          "logprobs": self._completion_lps(d), "finish_reason": d.finish_reason}
            if choice is not None:
                parts.append(self._chunk([choice]))
        return "".join(parts)

    def stream_end(self) -> str:
        return self._chunk([], with_usage=True) if self.request.include_usage else ""

    def _completion_lps(self, d: Delta) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        entries = (d.prompt_logprobs if self.request.echo else []) + d.logprobs
        out = completion_logprobs(entries, self.texts, self.text_offset[d.index], self.name)
        self.text_offset[d.index] = out.pop("next_offset")
        return out

    def accumulate(self, d: Delta) -> None:
        acc = self.acc[d.index]
        acc["text"].append(d.text)
        acc["reasoning"].append(d.reasoning)
        acc["calls"].extend(d.tool_calls)
        acc["logprobs"].extend(d.logprobs)
        acc["prompt_logprobs"].extend(d.prompt_logprobs)
        acc["finish"] = d.finish_reason or acc["finish"]

    def response(self) -> dict[str, Any]:
        choices = []
        for index, acc in enumerate(self.acc):
            text = "".join(acc["text"])
            if self.kind == "chat":
                lps = (chat_logprobs(acc["logprobs"], self.texts, self.name)
                       if self.request.logprobs else None)
                if lps is None and self.request.logprobs:
                    lps = {"content": []}
                choices.append({"index": index, "message": chat_message(
                    text, "".join(acc["reasoning"]), acc["calls"]),
                    "logprobs": lps, "finish_reason": acc["finish"]})
            else:
                lps = None
                if self.request.logprobs is not None:
                    entries = (acc["prompt_logprobs"] if self.request.echo else []) + acc[
                        "logprobs"]
                    lps = completion_logprobs(entries, self.texts, 0, self.name)
                    lps.pop("next_offset")
                choices.append({"index": index, "text": text, "logprobs": lps,
                                "finish_reason": acc["finish"]})
        return {"id": self.id,
                "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self._usage()}
