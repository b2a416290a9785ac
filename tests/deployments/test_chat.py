"""GLM chat format: template options, reasoning split and tool-call parsing on fixed text,
fed whole and in every possible split (the incremental parsers must agree)."""

from __future__ import annotations

import json

import pytest

from glm53.deployments.chat import (
    ChatTemplate,
    ChatTemplateError,
    ReasoningParser,
    ToolCallParser,
    parse_tool_call,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def template(tiny_tokenizer):
    return ChatTemplate(tiny_tokenizer)


def splits(text: str):
    """The text whole, char by char, and cut once at every position."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def run_reasoning(pieces, in_reasoning):
    p = ReasoningParser(in_reasoning)
    outs = [p.feed(x) for x in pieces] + [p.feed("", final=True)]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize(("text", "start", "expected"), [
    ("plan it</think>The answer.", True, ("plan it", "The answer.")),
    ("no end yet", True, ("no end yet", "")),
    ("<think>x</think>y", False, ("x", "y")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("plain <think> later", False, ("", "plain <think> later")),
    ("a</thin", True, ("a</thin", "")),
    ("</think>", True, ("", "")),
])
def test_reasoning_split_in_every_split(text, start, expected):
    for pieces in splits(text):
        assert run_reasoning(pieces, start) == expected, pieces


def run_tools(pieces, tools=None):
    p = ToolCallParser(tools)
    outs = [p.feed(x) for x in pieces] + [p.feed("", final=True)]
    return "".join(c for c, _ in outs), [c for _, cs in outs for c in cs]


CALL = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n</tool_call>")


def test_tool_call_parsed_with_schema_types_in_every_split():
    text = "Let me check." + CALL + "\n"
    for pieces in splits(text):
        content, calls = run_tools(pieces, [WEATHER])
        assert content == "Let me check."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris", "days": 3, "zip": "75001"})]
        assert calls[0].id.startswith("call_")


def test_two_calls_glm47_compact_form_and_no_markup_leak():
    text = ("<tool_call>a<arg_key>x</arg_key><arg_value>{\"k\": [1, 2]}</arg_value></tool_call>\n"
            "<tool_call>b</tool_call>")
    for pieces in splits(text):
        content, calls = run_tools(pieces)
        assert content == ""
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("a", {"x": {"k": [1, 2]}}), ("b", {})]


def test_unterminated_or_malformed_blocks_come_back_as_content():
    assert run_tools(["x<tool_call>f\n<arg_key>a"]) == ("x<tool_call>f\n<arg_key>a", [])
    bad = "<tool_call>not a name!</tool_call>"
    assert run_tools([bad]) == (bad, [])
    assert parse_tool_call("f\n<arg_key>a</arg_key>junk<arg_value>1</arg_value>") is None


def test_text_after_calls_is_kept():
    content, calls = run_tools(["<tool_call>f</tool_call>\n", "more"])
    assert content == "\nmore" and len(calls) == 1


def test_template_renders_tools_and_tool_calls(template):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
                {"role": "tool", "content": "sunny"}]
    text = template.render(messages, tools=[WEATHER])
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert json.dumps(WEATHER, ensure_ascii=False) in text
    assert ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>") in text
    assert text.endswith("<|observation|>\nsunny<|assistant|>\n<think>")


def test_reasoning_effort_and_template_kwargs(template):
    user = [{"role": "user", "content": "hi"}]
    assert template.render(user, reasoning_effort="none").endswith("<think></think>")
    assert template.render(user, reasoning_effort="high").endswith("<think>")
    off = template.render(user, template_kwargs={"enable_thinking": False})
    assert off.endswith("<think></think>")
    with pytest.raises(ChatTemplateError, match="does not use foo"):
        template.render(user, template_kwargs={"foo": 1})
    with pytest.raises(ChatTemplateError, match="unsupported reasoning_effort"):
        template.render(user, reasoning_effort="extreme")
    with pytest.raises(ChatTemplateError, match="contradicts"):
        template.render(user, reasoning_effort="none",
                        template_kwargs={"enable_thinking": True})
    with pytest.raises(ChatTemplateError, match="contradicts"):
        template.render(user, reasoning_effort="low",
                        template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize(("effort", "line", "thinking"), [
    ("none", None, False), ("minimal", "low", True), ("low", "low", True),
    ("medium", "high", True), ("high", "high", True), ("max", None, True), (None, None, True)])
def test_reasoning_effort_mapping_is_explicit(template, effort, line, thinking):
    """The embedded template reads efforts as the release one does (only low/high named,
    anything else, even "none", is the maximum); the server's table maps every OpenAI value."""
    user = [{"role": "user", "content": "hi"}]
    text = template.render(user, reasoning_effort=effort)
    assert ("<|system|>\nReasoning effort: " in text) == (line is not None)
    if line is not None:
        assert f"Reasoning effort: {line}<|user|>" in text
    assert text.endswith("<think>" if thinking else "<think></think>")
    # what the mapping guards against: the raw template reads "none" as the maximum
    raw = template._tokenizer.apply_chat_template(user, tokenize=False,
                                                  add_generation_prompt=True,
                                                  reasoning_effort="none")
    assert raw.endswith("<think>") and "Reasoning effort" not in raw
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        template.render([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{"}}]}])
