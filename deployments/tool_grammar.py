"""The grammar of a forced GLM tool call's arguments (EBNF for the engine's grammar matcher).

When `tool_choice` forces a call, the prompt already ends with `<tool_call>` (and, for a named
tool, `NAME\\n`); the rest of the call is constrained to the tool's parameter schema, in the
layout the chat template renders (`<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n` per
argument, then `</tool_call>`):

- arguments in the schema's property order, each required one present, optional ones
  skippable, no others (`additionalProperties` is not honoured: a forced call names only
  declared parameters);
- values by the property's type: `string` as raw text without `<` (the parser keeps string
  parameters as text), string `enum`s as one of their values, `integer` / `number` /
  `boolean` / `null` as JSON literals of that type, anything else (objects, arrays, unions)
  as any JSON value. Nested schemas are not enforced beyond being JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

JSON_RULES = r"""
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" ws (json_member ("," ws json_member)*)? "}"
json_member ::= json_string ws ":" ws json_value ws
json_array ::= "[" ws (json_value ws ("," ws json_value ws)*)? "]"
json_string ::= "\"" ([^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" hex hex hex hex))* "\""
hex ::= [0-9a-fA-F]
json_integer ::= "-"? ("0" | [1-9] [0-9]*)
json_number ::= json_integer ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
ws ::= " "?
raw_text ::= [^<]*
"""
_TYPED = {"integer": "json_integer", "number": "json_number", "boolean": '("true" | "false")',
          "null": '"null"'}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value_rule(prop: Mapping[str, Any]) -> str:
    enum = prop.get("enum")
    kind = prop.get("type")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_literal(v) for v in enum) + ")"
    if kind == "string":
        return "raw_text"
    return _TYPED.get(kind, "json_value") if isinstance(kind, str) else "json_value"


def _arguments(function: Mapping[str, Any], prefix: str) -> list[str]:
    """Rules `{prefix}` = the arguments of one function, then `</tool_call>`."""
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    rules, parts = [], []
    for i, (key, prop) in enumerate(props.items()):
        name = f"{prefix}_arg{i}"
        rules.append(f"{name} ::= {_literal(f'<arg_key>{key}</arg_key>')} \"\\n\" "
                     f"\"<arg_value>\" {_value_rule(prop or {})} \"</arg_value>\" \"\\n\"")
        parts.append(name if key in required else f"{name}?")
    rules.insert(0, f"{prefix} ::= {' '.join(parts)} \"</tool_call>\"".replace("  ", " "))
    return rules


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None) -> str:
    """EBNF for the output after a forced call's prefix: `name` given (the prompt holds
    `<tool_call>NAME\\n`): its arguments; else (`<tool_call>` only) any tool's name, a newline
    and that tool's arguments."""
    functions = [t.get("function", t) for t in tools]
    if name is not None:
        (function,) = [f for f in functions if f.get("name") == name]
        rules = _arguments(function, "call")
        root = "root ::= call"
    else:
        rules, options = [], []
        for i, function in enumerate(functions):
            rules += _arguments(function, f"call{i}")
            options.append(f"{_literal(function['name'] + chr(10))} call{i}")
        root = "root ::= " + " | ".join(options)
    return "\n".join([root, *rules]) + JSON_RULES
