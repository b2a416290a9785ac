"""The LLM-server replica without Ray (a scripted engine injected): prompts are prepared off
the event loop and bounded, an unhealthy engine gets 503 + Retry-After, a request that can never
be admitted gets 400, and engine failures reach the client without their text."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from glm53.deployments.config import ServingConfig
from glm53.deployments.llm_server import LLMServer
from glm53.deployments.openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from glm53.raycluster.api import EngineDeadError
from tests.deployments.scripted_engine import QUEUE_S, ScriptedEngine

LEAK = "ActorDiedError: actor 5f3ac0ffee at 10.0.0.7:6379, /home/ray/glm53/engine.py line 12"


@pytest.fixture
def server() -> LLMServer:
    config = ServingConfig(served_model_name="scripted", max_waiting_requests=4,
                           speculative="none", device="cpu")
    return LLMServer(config, "cpu", ScriptedEngine)


def chat(text: str, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="scripted", messages=[{"role": "user", "content": text}],
                                 **kw)


def items(generator) -> list:
    async def collect():
        return [item async for item in generator]
    return asyncio.run(collect())


def test_prompts_are_rendered_and_tokenised_off_the_event_loop(server, monkeypatch):
    threads = []
    encode = server.tokenizer.encode

    def spying_encode(*args, **kwargs):
        threads.append(threading.current_thread())
        return encode(*args, **kwargs)

    monkeypatch.setattr(server.tokenizer, "encode", spying_encode)
    out = items(server.chat(chat("SCRIPT:ok")))
    assert out[0]["choices"][0]["message"]["reasoning_content"] == "ok"
    out = items(server.completions(CompletionRequest(model="scripted", prompt="abc",
                                                     max_tokens=2)))
    assert out[0]["usage"]["prompt_tokens"] == 3
    assert len(threads) == 2 and threading.main_thread() not in threads


def test_a_prompt_too_long_for_any_context_is_refused_before_tokenising(server, monkeypatch):
    def no_encode(*args, **kwargs):
        raise AssertionError("tokenised a prompt that cannot fit")

    monkeypatch.setattr(server.tokenizer, "encode", no_encode)
    huge = "x" * (server.max_prompt_chars + 1)
    for generator in (server.chat(chat(huge)),
                      server.completions(CompletionRequest(model="scripted", prompt=huge))):
        (error,) = items(generator)
        assert isinstance(error, APIError) and error.status == 400
        assert error.code == "context_length_exceeded"


def test_prompt_preparation_is_bounded_in_time(server, monkeypatch):
    from glm53.deployments import llm_server

    encode = server.tokenizer.encode

    def slow_encode(*args, **kwargs):
        time.sleep(0.5)
        return encode(*args, **kwargs)

    monkeypatch.setattr(llm_server, "PREPARE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(server.tokenizer, "encode", slow_encode)
    (error,) = items(server.completions(CompletionRequest(model="scripted", prompt="abc")))
    assert error.status == 503 and error.headers == {"Retry-After": "1"}


def test_an_unhealthy_engine_gets_503_with_retry_after(server, monkeypatch):
    def dead():
        raise EngineDeadError(LEAK)

    monkeypatch.setattr(server.engine, "check_health", dead)
    (error,) = items(server.chat(chat("SCRIPT:x", stream=True)))
    assert isinstance(error, APIError) and error.status == 503
    assert error.headers == {"Retry-After": "1"} and LEAK not in error.message


def test_more_choices_than_the_server_ever_queues_is_400_not_503(server):
    (error,) = items(server.chat(chat("SCRIPT:x", n=5)))  # max_waiting_requests = 4
    assert isinstance(error, APIError) and error.status == 400 and error.param == "n"
    server._outstanding = 4  # but a full queue is still an overload: 503 + Retry-After
    (error,) = items(server.chat(chat("SCRIPT:x", n=1)))
    assert error.status == 503 and error.headers == {"Retry-After": "1"}


def test_response_format_reaches_the_engine_as_a_constraint(server, monkeypatch):
    """JSON mode is enforced, not only accepted: json_object and json_schema become the
    engine's output constraint (which the engine's grammar then applies)."""
    from glm53.actors.step import StructuredOutput

    seen = []
    generate = server.engine.generate

    def spying_generate(prompt_ids, params, *args):
        seen.append(params.structured_output)
        return generate(prompt_ids, params, *args)

    monkeypatch.setattr(server.engine, "generate", spying_generate)
    schema = {"type": "object", "properties": {"a": {"enum": ["x"]}}, "required": ["a"]}
    formats = [({"type": "json_object"}, StructuredOutput("json")),
               ({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                StructuredOutput("json_schema", json.dumps(schema))),
               ({"type": "text"}, None), (None, None)]
    for fmt, expected in formats:
        seen.clear()
        items(server.chat(chat("Answer in JSON. SCRIPT:{}", response_format=fmt)))
        assert seen == [expected], fmt


def test_stop_token_ids_beyond_the_vocabulary_are_400(server):
    (error,) = items(server.chat(chat("SCRIPT:x", stop_token_ids=[server.engine.vocab_size])))
    assert error.status == 400 and error.param == "stop_token_ids"


async def _raising(exc: Exception):
    """An engine stream that fails before its first output."""
    raise exc
    yield  # makes this an async generator


def test_engine_failures_carry_the_request_id_not_the_exception_text(server, monkeypatch):
    monkeypatch.setattr(server.engine, "generate", lambda *a: _raising(RuntimeError(LEAK)))
    (error,) = items(server.chat(chat("SCRIPT:x"), "req-42"))
    assert error.status == 500 and LEAK not in error.message and "req-42" in error.message
    out = items(server.chat(chat("SCRIPT:x", stream=True), "req-43"))
    assert out[0] is True and out[-1].endswith("data: [DONE]\n\n")
    assert LEAK not in out[-1] and "req-43" in out[-1] and '"server_error"' in out[-1]


def test_a_dead_engine_mid_request_is_503_with_retry_after(server, monkeypatch):
    def dead():
        raise EngineDeadError(LEAK)

    monkeypatch.setattr(server.engine, "generate", lambda *a: _raising(EngineDeadError(LEAK)))
    checks = iter([None])  # healthy at admission, dead by the time the request failed
    monkeypatch.setattr(server.engine, "check_health", lambda: next(checks, None) or dead())
    (error,) = items(server.chat(chat("SCRIPT:x"), "req-44"))
    assert error.status == 503 and error.headers == {"Retry-After": "1"}
    assert LEAK not in error.message and "req-44" in error.message


def test_queue_and_prefill_times_come_from_the_engines_timing(server):
    items(server.chat(chat("SCRIPT:abc")))

    def observed(name: str) -> float:
        return server.metrics.registry.get_sample_value(name, {"model_name": "scripted"})

    assert observed("vllm:request_queue_time_seconds_count") == 1
    assert QUEUE_S <= observed("vllm:request_queue_time_seconds_sum") < 1
    assert observed("vllm:request_prefill_time_seconds_count") == 1


def test_a_consumer_leaving_mid_stream_aborts_the_engine_request(server, monkeypatch):
    """What the ingress does when its client disconnects: it cancels the replica's stream,
    which closes this generator; the choice's engine stream is closed and aborted."""
    aborted = []

    async def abort(request_id):
        aborted.append(request_id)

    monkeypatch.setattr(server.engine, "abort", abort)

    async def leave_after_first_batch():
        stream = server.chat(chat("SCRIPT:" + "x" * 200, stream=True), "req-45")
        assert await stream.__anext__() is True
        assert (await stream.__anext__()).startswith("data: {")
        await stream.aclose()

    asyncio.run(leave_after_first_batch())
    assert server.engine.running == 0  # the engine's generator was closed
    assert len(aborted) == 1 and aborted[0].startswith("chatcmpl-")
    assert server._outstanding == 0
