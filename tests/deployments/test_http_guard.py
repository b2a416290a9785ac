"""The ingress's HTTP guard (issue 18, part 3): API keys, body size and deadline, JSON-only
bodies, Host allow-list, CORS, and keys kept out of logs. Against the real ingress app served
in-process (tests/deployments/local_ingress.py), no Ray cluster; the last test checks that
the guard is mounted in a Serve replica behind Serve's proxy."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from glm53.deployments.app import ingress_app, server_app
from glm53.deployments.config import HTTPConfig, ServingConfig
from glm53.deployments.http_guard import HTTPGuard, host_name
from tests.deployments.local_ingress import local_ingress, scripted_config
from tests.deployments.scripted_engine import ScriptedEngine

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "SCRIPT:</think>hi"}]}


def envelope(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


@pytest.fixture
def client(monkeypatch, request):
    http, env = getattr(request, "param", (HTTPConfig(), {}))
    with TestClient(local_ingress(monkeypatch, http, env)) as c:
        yield c


KEYS = (HTTPConfig(api_keys=["key-from-config"]),
        {"GLM53_API_KEYS": "key-a, key-b", "GLM53_API_KEY": "key-c"})


@pytest.mark.parametrize("client", [KEYS], indirect=True)
def test_api_keys_from_config_and_environment(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a"},
                    {"Authorization": "Basic key-a"}):
        r = client.get("/v1/models", headers=headers)
        error = envelope(r, 401, "invalid_api_key")
        assert error["type"] == "authentication_error" and error["param"] is None
        assert r.headers["www-authenticate"] == "Bearer"
        assert "key-a" not in r.text and "wrong" not in r.text
    for key in ("key-from-config", "key-a", "key-b", "key-c"):
        r = client.get("/v1/models", headers={"Authorization": f"bearer {key}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "scripted"
    # every route but the probes needs the key, including ones added later (deny by default)
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/openapi.json"),
                         ("GET", "/no-such-route")):
        envelope(client.request(method, path, json={}), 401, "invalid_api_key")
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    r = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer key-b"})
    assert r.json()["choices"][0]["message"]["content"] == "hi"


def test_serve_proxy_hints_from_clients_are_refused(client):
    """Serve's proxy would let a client lift the request timeout or keep generating after it
    disconnects; such requests end at once with 400."""
    for header in ("X-Request-Timeout-Seconds", "x-request-disconnect-disabled"):
        r = client.post("/v1/chat/completions", json=CHAT, headers={header: "?1"})
        envelope(r, 400, "header_not_allowed")


def test_without_keys_everyone_is_served(client):
    assert client.get("/v1/models").status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_only_json_bodies_are_accepted(client):
    """A `text/plain` POST is a CORS "simple request" any web page can send: refused."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = client.post("/v1/chat/completions", content=b'{"model": "scripted"}',
                        headers=headers)
        envelope(r, 415, "unsupported_media_type")
    r = client.post("/v1/chat/completions", content=str(CHAT).replace("'", '"').encode(),
                    headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("client", [(HTTPConfig(max_request_bytes=4096), {})], indirect=True)
def test_declared_body_over_the_limit_is_refused_unread(client):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    envelope(client.post("/v1/chat/completions", json=big), 413, "request_too_large")
    envelope(client.post("/tokenize", json={"prompt": "x" * 5000}), 413, "request_too_large")
    assert client.post("/tokenize", json={"prompt": "x" * 3000}).status_code == 200


def _run(app, method: str, path: str, chunks, headers=()) -> tuple[int, dict, int]:
    """Drive the ASGI app with a body sent in `chunks` (None = never arrives); returns the
    status, the JSON answer and how many chunks the app pulled."""
    pulled = 0
    sent: list[dict] = []

    async def receive():
        nonlocal pulled
        if pulled == len(chunks):
            await asyncio.sleep(3600)  # the client is gone quiet
        chunk = chunks[pulled]
        pulled += 1
        if chunk is None:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": chunk, "more_body": pulled < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
             "server": ("testserver", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         *headers]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), pulled


def test_streamed_body_is_counted_while_read(monkeypatch):
    """Chunked bodies (no Content-Length): refused once the count passes the limit, without
    reading the rest."""
    app = local_ingress(monkeypatch, HTTPConfig(max_request_bytes=4096))
    chunks = [b'{"prompt": "' + b"x" * 1000] * 100 + [b'"}']
    status, body, pulled = _run(app, "POST", "/tokenize", chunks)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert pulled == 5


def test_declared_length_over_the_limit_is_refused_before_reading(monkeypatch):
    """A Content-Length past the limit is refused by the head alone: no body chunk is pulled
    (the count while reading would also give 413, but only after reading up to the limit)."""
    app = local_ingress(monkeypatch, HTTPConfig(max_request_bytes=4096))
    chunks = [b'{"prompt": "' + b"x" * 1000] * 5 + [b'"}']
    length = str(sum(len(c) for c in chunks)).encode()
    status, body, pulled = _run(app, "POST", "/tokenize", chunks,
                                headers=[(b"content-length", length)])
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert pulled == 0


def test_slow_body_hits_the_deadline(monkeypatch):
    app = local_ingress(monkeypatch, HTTPConfig(body_timeout_s=0.3))
    status, body, _ = _run(app, "POST", "/tokenize", [b'{"prompt": ', None])
    assert status == 408 and body["error"]["code"] == "request_timeout"
    status, body, _ = _run(app, "POST", "/tokenize", [b'{"prompt": ', b'"hi"}'])
    assert status == 200 and body["count"] == 2


HOSTS = (HTTPConfig(allowed_hosts=["api.example.com", "*.svc.cluster.local", "::1"]), {})


@pytest.mark.parametrize("client", [HOSTS], indirect=True)
def test_host_allow_list(client):
    for host in ("api.example.com", "API.example.com:8000", "glm53.ns.svc.cluster.local",
                 "[::1]:8000", "api.example.com."):
        assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "api.example.com.evil", "svc.cluster.local.evil",
                 "example.com", "[::2]:8000", "", "api.example.com:x"):
        envelope(client.get("/v1/models", headers={"Host": host}), 400, "invalid_host")
    # probes and scrapes come by pod IP
    assert client.get("/health", headers={"Host": "10.1.2.3:8000"}).status_code == 200


def test_host_names():
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1]:8000") == "::1" and host_name("[::1]") == "::1"
    assert host_name("10.0.0.1") == "10.0.0.1" and host_name("a.b.:1") == "a.b"


CORS = (HTTPConfig(api_keys=["k"], allowed_origins=["https://app.example"]), {})


@pytest.mark.parametrize("client", [CORS], indirect=True)
def test_cors_allow_list(client):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = client.options("/v1/chat/completions", headers=preflight)  # no key on a preflight
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = client.options("/v1/chat/completions",
                       headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # refusals carry the CORS headers too, so the page can read why
    r = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = client.get("/v1/models", headers={"Origin": "https://app.example",
                                          "Authorization": "Bearer k"})
    assert r.status_code == 200


def test_without_origins_there_are_no_cors_headers(client):
    r = client.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_keys_never_reach_logs_or_reprs(monkeypatch, caplog):
    config = ServingConfig(http={"api_keys": ["sk-very-secret"]})
    assert "sk-very-secret" not in repr(config) and "sk-very-secret" not in str(config)
    assert "sk-very-secret" not in config.model_dump_json()
    for bad in ({"num_blocks": 8, "cache_bytes": 2**20}, {"profile": "nope"},
                {"http": {"max_request_bytes": 1}}):
        with pytest.raises(ValidationError) as error:
            ServingConfig.model_validate({**bad, "http": {**bad.get("http", {}),
                                                          "api_keys": ["sk-very-secret"]}})
        assert "sk-very-secret" not in str(error.value)
    with caplog.at_level(logging.DEBUG):
        app = local_ingress(monkeypatch, config.http, {"GLM53_API_KEY": "sk-env-secret"})
        with TestClient(app) as c:
            card = c.get("/v1/models", headers={"Authorization": "Bearer sk-env-secret"})
    assert card.status_code == 200 and "secret" not in card.text
    assert "2 API key(s)" in caplog.text and "secret" not in caplog.text


def test_keys_are_compared_as_digests():
    """Every key is compared (no early exit) on equal-length SHA-256 digests."""
    guard = HTTPGuard(None, HTTPConfig(api_keys=["a", "bb"]), environ={})
    assert len(guard.key_digests) == 2 and {len(d) for d in guard.key_digests} == {32}
    assert guard._key_valid(b"Bearer bb") and not guard._key_valid(b"Bearer b")
    assert not guard._key_valid("Bearer ключ".encode())


# ----- under Ray Serve: the guard is mounted in the replica, behind Serve's HTTP proxy -----
@pytest.fixture(scope="module")
def served(serve_url):
    from ray import serve

    app = ingress_app({"scripted": server_app(scripted_config(), "cpu", ScriptedEngine)},
                      HTTPConfig(api_keys=["served-key"], max_request_bytes=65536))
    serve.run(app, name="guard-test", route_prefix="/",
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    with httpx.Client(base_url=serve_url, timeout=60) as client:
        yield client
    serve.delete("guard-test")


@pytest.mark.slow  # serves the app through Ray Serve's proxy
def test_guard_under_serve(served):
    key = {"Authorization": "Bearer served-key"}
    envelope(served.get("/v1/models"), 401, "invalid_api_key")
    assert served.get("/v1/models", headers=key).status_code == 200
    envelope(served.post("/v1/chat/completions", json=CHAT,
                         headers={**key, "x-request-disconnect-disabled": "?1"}),
             400, "header_not_allowed")
    assert served.get("/health").status_code == 200
    r = served.post("/v1/chat/completions", json=CHAT, headers=key)
    assert r.json()["choices"][0]["message"]["content"] == "hi"
    envelope(served.post("/tokenize", content=b'{"prompt": "x"}',
                         headers={**key, "Content-Type": "text/plain"}),
             415, "unsupported_media_type")
    big = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    headers = {**key, "Content-Type": "application/json"}
    envelope(served.post("/tokenize", content=big, headers=headers), 413, "request_too_large")
    # chunked through the proxy: counted in the replica as the messages arrive
    chunks = (big[i:i + 8192] for i in range(0, len(big), 8192))
    envelope(served.post("/tokenize", content=chunks, headers=headers), 413,
             "request_too_large")


@pytest.mark.slow  # the same served app
def test_replicas_listen_on_the_node_address_only(served):
    """Every Serve replica (the ingress and the LLM server) listens only on the node's address
    (127.0.0.1 here): its inter-deployment gRPC port too, which Serve binds to all interfaces
    (deployments/listeners.py)."""
    import ray
    from ray._private import state

    psutil = pytest.importorskip("psutil")  # vendored with ray
    assert served.get("/health").status_code == 200
    node_ip = ray.util.get_node_ip_address()
    pids = [a["Pid"] for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].startswith("ServeReplica")]
    assert len(pids) == 2, pids
    for pid in pids:
        listening = {c.laddr.ip.removeprefix("::ffff:")
                     for c in psutil.Process(pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {node_ip}, (pid, listening)
