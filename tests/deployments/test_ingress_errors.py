"""The OpenAI ingress without Ray: its FastAPI app over stand-in deployment handles, so each
edge case (hostile bodies, replicas that die or hang, streams cut mid-way) is one quick call.

Checks that every numeric field is bounded at the edge, JSON the engine cannot take is a 400,
errors carry a request id and never exception text, a dead replica is a 503 + Retry-After, a
broken stream ends with an error event and [DONE], a client leaving cancels the replica's
request, and /health answers 503 within a second when a replica is gone or silent.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest
from ray import serve
from ray.exceptions import ActorDiedError

from glm53.deployments import ingress
from glm53.deployments.openai_schema import INT32_MAX, MAX_MESSAGES, MAX_STOP_CHARS

LEAK = "actor 5f3ac0ffee at 10.0.0.7:6379, /home/ray/glm53/engine.py line 12"


class Stream:
    """Stands in for a streaming DeploymentResponseGenerator: its items, then `error`."""

    def __init__(self, items: list, error: BaseException | None = None, hang: bool = False):
        self.items, self.error, self.hang = list(items), error, hang
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        if self.hang:
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class Server:
    """Stands in for an LLM-server deployment handle."""

    def __init__(self, stream: Stream | None = None, health=None):
        self.stream, self.calls = stream, []
        self.chat = self.completions = Method(self._generate)
        self.health = Method(health or _healthy)

    def options(self, **kwargs):
        return self

    def _generate(self, body, *args):
        self.calls.append((body, *args))
        return self.stream


async def _healthy():
    return True


@pytest.fixture
def servers(monkeypatch) -> dict:
    """The ingress's servers (tests add "m"); the app resolves `self` to this ingress."""
    original = ingress.OpenAIIngress.__mro__[1]  # the class before @serve.ingress wrapped it
    instance = original({})
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(servable_object=instance))
    return instance.servers


def call(method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=ingress.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "x", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}


# ----- validation at the edge -----
HOSTILE = [
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', None),
    (b'{"model": "m", "prompt": "x", "top_p": NaN}', None),
    (b'{"model": "m", "prompt": "x", "repetition_penalty": Infinity}', None),
    (b'{"model": "m", "prompt": "x", "temperature": 1e999}', "temperature"),
    (b'{"model": "m", "prompt": "x", "logit_bias": {"1": -Infinity}}', None),
    (b'{"model": "m", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", None),
    (b"[" * 1000 + b"]" * 1000, None),
    (json.dumps(completion(top_k=2**31)).encode(), "top_k"),
    (json.dumps(completion(max_tokens=2**31)).encode(), "max_tokens"),
    (json.dumps(completion(min_tokens=2**31)).encode(), "min_tokens"),
    (json.dumps(completion(seed=2**63)).encode(), "seed"),
    (json.dumps(completion(seed=-(2**63) - 1)).encode(), "seed"),
    (json.dumps(completion(stop_token_ids=[2**40])).encode(), "stop_token_ids"),
    (json.dumps(completion(stop_token_ids=[1] * 2000)).encode(), "stop_token_ids"),
    (json.dumps(completion(prompt=[2**40])).encode(), "prompt"),
    (json.dumps(completion(prompt=["x"] * 1000)).encode(), "prompt"),
    (json.dumps(completion(stop="x" * (MAX_STOP_CHARS + 1))).encode(), "stop"),
    (json.dumps(completion(repetition_penalty=1e30)).encode(), "repetition_penalty"),
    (json.dumps(completion(logprobs=21)).encode(), "logprobs"),
    (json.dumps(completion(model="m" * 1000)).encode(), "model"),
    (json.dumps(chat(max_completion_tokens=2**31)).encode(), "max_completion_tokens"),
    (json.dumps(chat(logit_bias={"1": 1e9})).encode(), "logit_bias"),
    (json.dumps(chat(messages=[{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1))).encode(),
     "messages"),
    (json.dumps(chat(logprobs=True, top_logprobs=2**31)).encode(), "top_logprobs"),
]


@pytest.mark.parametrize(("body", "param"), HOSTILE, ids=[f"{i}-{p}" for i, (_, p) in
                                                          enumerate(HOSTILE)])
def test_values_the_engine_cannot_take_are_400_at_the_edge(servers, body, param):
    server = servers["m"] = Server(Stream([{"ok": True}]))
    path = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
    r = call("POST", path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"].startswith(param)
    assert not server.calls  # nothing reached the replica


def test_the_type_limits_themselves_pass(servers):
    server = servers["m"] = Server(Stream([{"ok": True}]))
    r = call("POST", "/v1/completions", json=completion(
        top_k=INT32_MAX, max_tokens=INT32_MAX, seed=2**63 - 1, stop_token_ids=[INT32_MAX]))
    assert r.status_code == 200 and r.json() == {"ok": True}
    assert len(server.calls) == 1


# ----- error bodies -----
def _request_id(r: httpx.Response) -> str:
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16 and rid in r.json()["error"]["message"]
    return rid


def test_internal_errors_carry_a_request_id_not_the_exception(servers):
    servers["m"] = Server(Stream([], RuntimeError(LEAK)))
    r = call("POST", "/v1/completions", json=completion())
    assert r.status_code == 500
    assert LEAK not in r.text and "RuntimeError" not in r.text and "Traceback" not in r.text
    first = _request_id(r)
    assert _request_id(call("POST", "/v1/completions", json=completion())) != first
    assert r.json()["error"]["type"] == "server_error"


def test_a_given_request_id_is_the_one_used(servers):
    servers["m"] = Server(Stream([], RuntimeError(LEAK)))
    r = call("POST", "/v1/completions", json=completion(), headers={"x-request-id": "abc-123"})
    assert r.status_code == 500 and "abc-123" in r.json()["error"]["message"]
    assert "x-request-id" not in r.headers  # Serve's proxy echoes its own header


def test_a_dead_replica_is_503_with_retry_after(servers):
    servers["m"] = Server(Stream([], ActorDiedError()))
    r = call("POST", "/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable_error"
    _request_id(r)


# ----- streams -----
def _events(r: httpx.Response) -> list[str]:
    return [e for e in r.text.split("\n\n") if e]


@pytest.mark.parametrize("error", [ActorDiedError(), RuntimeError(LEAK)])
def test_a_stream_cut_by_the_replica_ends_with_an_error_event_and_done(servers, error):
    stream = Stream([True, 'data: {"choices": []}\n\n'], error)
    servers["m"] = Server(stream)
    r = call("POST", "/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 200
    events = _events(r)
    assert events[0] == 'data: {"choices": []}' and events[-1] == "data: [DONE]"
    body = json.loads(events[-2].removeprefix("data: "))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert LEAK not in r.text and r.headers["x-request-id"] in body["error"]["message"]
    expected = ("service_unavailable_error" if isinstance(error, ActorDiedError)
                else "server_error")
    assert body["error"]["type"] == expected


def test_a_client_leaving_cancels_the_replica_request():
    """The relay is what the HTTP response iterates: when it is closed early (the client went
    away), the replica's stream is cancelled, which aborts the engine request."""
    stream = Stream([True, "data: 1\n\n"], hang=True)

    async def leave_after_first():
        relay = ingress._relay(stream, "rid")
        assert await relay.__anext__() is True
        await relay.aclose()

    asyncio.run(leave_after_first())
    assert stream.cancelled


def test_a_finished_stream_is_not_cancelled():
    stream = Stream(["data: [DONE]\n\n"])

    async def drain():
        return [item async for item in ingress._relay(stream, "rid")]

    assert asyncio.run(drain()) == ["data: [DONE]\n\n"] and not stream.cancelled


# ----- health -----
async def _dead():
    raise ActorDiedError()


async def _leaky():
    raise RuntimeError(LEAK)


async def _silent():
    await asyncio.sleep(3600)


@pytest.mark.parametrize("health", [_dead, _leaky, _silent])
def test_health_is_503_within_a_second_and_leaks_nothing(servers, health):
    servers["m"] = Server(health=health)
    start = time.monotonic()
    r = call("GET", "/health")
    assert time.monotonic() - start < 1.0
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert LEAK not in r.text and "ActorDiedError" not in r.text
    _request_id(r)


def test_health_is_200_when_every_replica_answers(servers):
    servers["m"] = Server()
    assert call("GET", "/health").status_code == 200
