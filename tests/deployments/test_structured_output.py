"""Structured output and the thinking budget through the served API with the `openai` client
(tiny random checkpoint, MTP speculative decoding on): sampled answers to a JSON schema with
nested objects, enums and arrays all validate; JSON mode gives an object; a thinking budget
caps the reasoning tokens and the answer follows; bad schemas are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from glm53.deployments.app import ingress_app, server_app
from glm53.deployments.config import ServingConfig

# the full tier (make test-all, CI): serves through Ray Serve, samples 70 constrained answers
pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{0,7}$"},
        "mode": {"enum": ["car", "bus", "walk"]},
        "stops": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                  "minItems": 1, "maxItems": 3},
        "plan": {"type": "object",
                 "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 30},
                                "ok": {"type": "boolean"},
                                "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                         "maxItems": 2}},
                 "required": ["days", "ok", "tags"], "additionalProperties": False},
    },
    "required": ["city", "mode", "stops", "plan"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA,
                                                  "strict": True}}
ASK = [{"role": "user", "content": "Plan a trip as JSON."}]


@pytest.fixture(scope="module")
def client(serve_url, tiny_checkpoints):
    from ray import serve

    path = tiny_checkpoints(seed=2, mtp=True)
    config = ServingConfig(served_model_name="tiny", model=str(path), device="cpu",
                           max_model_len=2048, max_num_seqs=16, num_blocks=1024,
                           speculative="mtp:2")
    serve.run(ingress_app({"tiny": server_app(config, "cpu")}), name="structured-test",
              route_prefix="/", logging_config={"log_level": "WARNING",
                                                "enable_access_log": False})
    yield openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused",
                        max_retries=0, timeout=300)
    serve.delete("structured-test")


def test_50_sampled_answers_validate_against_the_schema(client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed):
        return client.chat.completions.create(
            model="tiny", messages=ASK, response_format=FORMAT, temperature=1.0, seed=seed,
            max_tokens=200, reasoning_effort="none")

    # as many at once as the server batches (max_num_seqs): fewer engine steps in all
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(ask, range(50)))
    for r in responses:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_mode_gives_an_object(client):
    """The tiny model ends a JSON object within the budget only sometimes; every answer that
    stops parses as an object, and every truncated one is an object's prefix."""
    r = client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, temperature=1.0,
        seed=3, n=8, max_tokens=120, reasoning_effort="none")
    stopped = [c for c in r.choices if c.finish_reason == "stop"]
    for c in stopped:
        assert isinstance(json.loads(c.message.content), dict)
    for c in r.choices:
        assert c.message.content.startswith("{")


def test_thinking_budget_caps_reasoning_and_the_answer_follows(client):
    for budget in (0, 4, 12):
        r = client.chat.completions.create(
            model="tiny", messages=ASK, response_format=FORMAT, temperature=1.0, seed=budget,
            max_tokens=300, extra_body={"thinking_token_budget": budget, "min_tokens": 60})
        usage = r.usage.completion_tokens_details
        assert usage.reasoning_tokens <= budget
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("fmt,message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
     "json schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_schemas_are_400(client, fmt, message, stream):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt,
                                       max_tokens=8, stream=stream)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer"}, "note": {"type": "boolean"}},
    "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}}}]


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_arguments_follow_the_schema(client, tool_choice):
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
        seed=1, n=6, max_tokens=250, reasoning_effort="none")
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["city"] in ("Paris", "Rome") and isinstance(args["days"], int)
            assert set(args) <= {"city", "days", "note"}
        else:
            assert tool_choice == "required" and args == {"zone": args["zone"]}
            assert args["zone"] in ("UTC", "CET")
