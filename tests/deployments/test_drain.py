"""Graceful drain (issue 18, part 2): `glm53 serve` on SIGTERM refuses new requests with 503 +
Retry-After (and /health 503) while in-flight streams finish, then exits 0; the deployments'
graceful shutdown follows the same drain timeout. The gate alone, the gate in the real ingress
(in-process), the options, and one end-to-end run of `glm53 serve` in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ray import serve
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from glm53.deployments.app import build_app
from glm53.deployments.cli import _parser
from glm53.deployments.config import ServingConfig
from glm53.deployments.drain import DrainGate, DrainState, StopSignals
from glm53.deployments.serve_cli import serving_config
from tests.deployments.local_ingress import local_ingress

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "SCRIPT:</think>hi"}]}


def assert_draining_refusal(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 503 and headers["retry-after"].isdigit(), (status, headers)
    error = json.loads(body)["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "server_draining"


async def asgi_call(app, path: str, method: str = "GET") -> tuple[int, dict, bytes]:
    """One HTTP request straight to an ASGI app: (status, headers, body)."""
    scope = {"type": "http", "method": method, "path": path, "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    messages = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        messages.append(message)

    await app(scope, receive, send)
    start = messages[0]
    headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], headers, b"".join(m.get("body", b"") for m in messages[1:])


def test_gate_refuses_new_requests_while_in_flight_ones_finish():
    async def run():
        release = asyncio.Event()

        async def app(scope, receive, send):
            if scope["path"] == "/slow":
                await release.wait()
            await PlainTextResponse("done")(scope, receive, send)

        state = DrainState()
        gate = DrainGate(app, state)
        slow = asyncio.create_task(asgi_call(gate, "/slow", "POST"))
        await asyncio.sleep(0)
        assert (await asgi_call(gate, "/health"))[0] == 200  # probes are not counted
        assert state.in_flight == 1 and state.start() == 1 and state.start() == 1
        for path in ("/v1/chat/completions", "/v1/completions", "/health"):
            assert_draining_refusal(*await asgi_call(gate, path, "POST"))
        assert (await asgi_call(gate, "/metrics"))[0] == 200  # still scraped while draining
        release.set()
        assert await slow == (200, {"content-length": "4",
                                    "content-type": "text/plain; charset=utf-8"}, b"done")
        assert state.in_flight == 0 and state.start() == 0

    asyncio.run(run())


def test_the_ingress_drains(monkeypatch):
    """The gate sits in the real ingress app, behind its `drain` method (a handle call)."""
    with TestClient(local_ingress(monkeypatch)) as client:
        ingress = serve.get_replica_context().servable_object  # patched by local_ingress
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert asyncio.run(ingress.drain()) == 0
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/health"),
                             ("GET", "/v1/models")):
            r = client.request(method, path, json=CHAT if method == "POST" else None)
            assert_draining_refusal(r.status_code, dict(r.headers), r.content)
        assert client.get("/metrics").status_code == 200


def _deployment_configs(app) -> dict:
    from ray.serve._private.build_app import build_app as serve_build_app

    return {d.name: d._deployment_config for d in serve_build_app(app, name="x").deployments}


def test_drain_timeout_sets_both_deployments_graceful_shutdown():
    args = _parser().parse_args(["serve", "--drain-timeout", "45", "--device", "cpu",
                                 "--speculative", "none"])
    config = serving_config(args)
    assert config.drain_timeout_s == 45
    configs = _deployment_configs(build_app(config))
    assert set(configs) == {"OpenAIIngress", "LLMServer:glm53-tiny"}
    for deployment in configs.values():
        assert deployment.graceful_shutdown_timeout_s == 45
        assert deployment.graceful_shutdown_wait_loop_s == 2
    assert serving_config(_parser().parse_args(["serve"])).drain_timeout_s == 30
    quick = ServingConfig(drain_timeout_s=0.5, speculative="none").server_deployment_options
    assert quick("cpu")["graceful_shutdown_wait_loop_s"] == 0.5


def test_a_second_signal_stops_at_once():
    stop = StopSignals()
    stop(signal.SIGTERM, None)
    assert stop.requested.is_set()
    with pytest.raises(KeyboardInterrupt):
        stop(signal.SIGINT, None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until `glm53 serve` waits for a signal (/health answers earlier, while it starts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        if "drains the server" in log.read_text():
            return
        time.sleep(0.5)
    raise AssertionError(f"glm53 serve not up in {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow  # starts glm53 serve in a subprocess
def test_serve_drains_on_sigterm(tmp_path: Path):
    """A stream running at SIGTERM completes with [DONE]; a request after it gets 503 +
    Retry-After and /health 503; the process exits 0. Before, SIGTERM killed the driver at
    once (Ray's handler), cutting the stream and leaving Ray's processes behind."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(GLM53_CACHE_DIR=str(tmp_path / "cache"), RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "glm53.deployments.cli", "serve", "--port", str(port),
             "--speculative", "none", "--drain-timeout", "30"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_serving(proc, log, 120)
        body = {"model": "glm53-tiny", "prompt": "hello", "max_tokens": 300,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{base}/v1/completions", json=body) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(lines)  # the stream is running
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while True:  # the drain starts within moments
                r = httpx.post(f"{base}/v1/completions", timeout=10,
                               json={"model": "glm53-tiny", "prompt": "hi", "max_tokens": 2})
                if r.status_code != 200 or time.monotonic() - signalled > 10:
                    break
            assert_draining_refusal(r.status_code, dict(r.headers), r.content)
            health = httpx.get(f"{base}/health", timeout=10)
            assert_draining_refusal(health.status_code, dict(health.headers), health.content)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        text = log.read_text()
        assert "draining: 1 request(s) in flight" in text and "drained: no request" in text
    finally:
        if proc.poll() is None:  # a failed run: stop at once (two signals), then for sure
            proc.send_signal(signal.SIGTERM)
            time.sleep(1)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
