"""GLM chat format: the checkpoint's chat template, and the parsers of the model's output.

`ChatTemplate` renders messages with the checkpoint's own Jinja template (transformers'
renderer); options the template never reads (tools, reasoning_effort, extra template kwargs)
are rejected instead of silently ignored. `ReasoningParser` splits `<think>…</think>` off the
text into reasoning; `ToolCallParser` turns GLM tool-call blocks
(`<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`) into OpenAI tool
calls. Both parsers are incremental: they hold back a suffix that may be the start of a marker,
so the markup never leaks into content, and feeding text in any split gives the same result.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
# tokens the output parsers need to see even when special tokens are skipped
MARKER_TOKENS = (THINK_START, THINK_END, TOOL_START, TOOL_END, "<arg_key>", "</arg_key>",
                 "<arg_value>", "</arg_value>")


# OpenAI's `reasoning_effort` -> the value GLM-5.3's chat template is given. The release
# template names "low" and "high" and reads every other value, even "none", as its maximum, so
# no value is passed through unmapped: "none" turns thinking off instead (enable_thinking=false,
# the prompt ends with `<think></think>`); "minimal"/"low" ask for low, "medium"/"high" for
# high, and "max" (a GLM extension) for the maximum, which is also the template's default.
REASONING_EFFORTS: dict[str, str | None] = {"none": None, "minimal": "low", "low": "low",
                                            "medium": "high", "high": "high", "max": "max"}


class ChatTemplateError(ValueError):
    """A request the chat template cannot render (a client error)."""


class ChatTemplate:
    def __init__(self, tokenizer: Any) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise ValueError("the checkpoint's tokenizer has no chat template")
        self._tokenizer = tokenizer
        self.variables = frozenset(meta.find_undeclared_variables(
            jinja2.Environment().parse(template)))

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: list[dict[str, Any]] | None = None, reasoning_effort: str | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        kwargs = dict(template_kwargs or {})
        unknown = sorted(set(kwargs) - self.variables)
        if unknown:
            raise ChatTemplateError(f"the chat template does not use {', '.join(unknown)}")
        if tools is not None and "tools" not in self.variables:
            raise ChatTemplateError("this model's chat template does not support tools")
        if reasoning_effort is not None:
            kwargs.update(self._effort_kwargs(reasoning_effort, kwargs))
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message are "
                                    "mutually exclusive")
        try:
            text = self._tokenizer.apply_chat_template(
                [_template_message(m) for m in messages], tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise ChatTemplateError(f"chat template: {exc}") from exc
        return text


    def _effort_kwargs(self, effort: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Template variables for an OpenAI reasoning effort (REASONING_EFFORTS)."""
        if effort not in REASONING_EFFORTS:
            raise ChatTemplateError(f"unsupported reasoning_effort {effort!r}; one of "
                                    f"{', '.join(REASONING_EFFORTS)}")
        level = REASONING_EFFORTS[effort]
        if level is None:
            if "enable_thinking" not in self.variables:
                raise ChatTemplateError("this model's chat template cannot turn thinking off "
                                        "(reasoning_effort none)")
            if kwargs.get("enable_thinking", False):
                raise ChatTemplateError("reasoning_effort none contradicts enable_thinking")
            return {"enable_thinking": False}
        if "reasoning_effort" not in self.variables:
            raise ChatTemplateError("this model's chat template does not support "
                                    "reasoning_effort")
        if kwargs.get("enable_thinking", True) is False:
            raise ChatTemplateError(f"reasoning_effort {effort} contradicts "
                                    "enable_thinking false")
        return {"reasoning_effort": level}


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Templates iterate tool-call arguments as a mapping; OpenAI sends them as JSON text."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"] or "{}")
                except json.JSONDecodeError as exc:
                    raise ChatTemplateError(
                        f"tool call arguments are not valid JSON: {exc}") from exc
            call["function"] = fn
            fixed.append(call)
        out["tool_calls"] = fixed
    return out


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """Text in, (reasoning, content) deltas out. Starts inside reasoning when the prompt ended
    with `<think>` (the template opened it); otherwise a leading `<think>` opens it."""

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self._at_start = True  # a `<think>` may still open reasoning
        self._buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while self._buf:
            if self.in_reasoning:
                i = self._buf.find(THINK_END)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf = self._buf[i + len(THINK_END):]
                    self.in_reasoning, self._at_start = False, False
                    continue
                keep = 0 if final else _partial_marker(self._buf, THINK_END)
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._at_start:
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._buf = stripped[len(THINK_START):]
                    self.in_reasoning, self._at_start = True, False
                    continue
                if not final and THINK_START.startswith(stripped):
                    break  # maybe the start of `<think>`
                self._at_start = False
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


def parse_tool_call(body: str, tools: Sequence[Mapping[str, Any]] | None = None,
                    ) -> ToolCall | None:
    """One GLM tool-call block's inner text -> ToolCall (None if it is malformed). Values of
    parameters declared as strings stay text; others are read as JSON when they parse."""
    name, sep, rest = body.partition("<arg_key>")
    name = name.strip()
    if not _NAME.fullmatch(name):
        return None
    rest = sep + rest
    args: dict[str, Any] = {}
    for match in _ARG.finditer(rest):
        key, value = match.group(1).strip(), match.group(2)
        args[key] = value if _param_type(tools, name, key) == "string" else _json_or_text(value)
    if _ARG.sub("", rest).strip():
        return None  # stray text between arguments
    return ToolCall(name, json.dumps(args, ensure_ascii=False),
                    f"call_{uuid.uuid4().hex[:24]}")


def _param_type(tools: Sequence[Mapping[str, Any]] | None, name: str, key: str) -> str | None:
    for tool in tools or ():
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
            kind = prop.get("type")
            return kind if isinstance(kind, str) else None
    return None


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class ToolCallParser:
    """Content text in, (content, completed tool calls) out. A call is emitted once its block
    is complete; whitespace next to calls is layout and dropped; an unterminated or malformed
    block is given back as content, so no text is lost."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = tools
        self.num_calls = 0
        self._buf = ""
        self._inside = False
        self._space = ""  # whitespace-only content, held until we know what follows it

    def _content(self, text: str, out: list[str]) -> None:
        text = self._space + text
        if text.strip():
            out.append(text)
            self._space = ""
        else:
            self._space = text

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._buf:
            if self._inside:
                i = self._buf.find(TOOL_END)
                if i < 0:
                    if final:  # unterminated: give the raw text back
                        self._content(TOOL_START + self._buf, content)
                        self._buf = ""
                    break
                body = self._buf[:i]
                self._buf = self._buf[i + len(TOOL_END):]
                self._inside = False
                call = parse_tool_call(body, self.tools)
                if call is None:
                    self._content(TOOL_START + body + TOOL_END, content)
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            i = self._buf.find(TOOL_START)
            if i >= 0:
                self._content(self._buf[:i], content)
                self._space = ""  # whitespace before a call is layout
                self._buf = self._buf[i + len(TOOL_START):]
                self._inside = True
                continue
            keep = 0 if final else _partial_marker(self._buf, TOOL_START)
            self._content(self._buf[:len(self._buf) - keep], content)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        if final and self._space:
            if not self.num_calls:
                content.append(self._space)
            self._space = ""
        return "".join(content), calls
