"""Chaos under load, through Serve's HTTP proxy on CPU: 32 streams run while (a) the engine's
replica is killed, (b) one worker actor of a TP2/EP2/DCP2 replica is killed. Every stream ends,
with its finish reason or an SSE error event, and `[DONE]`, within a bound; `/health` turns 503
and back to 200 once Serve has replaced the replica; new requests are served again.

The TP2/EP2/DCP2 replica is what `glm53 serve --tp 2 --ep 2 --dcp 2` runs on a CPU box (fake
GPUs, gloo), placed as on a pair: its own placement group holds the engine and one worker per
GPU, and through the `openai` client it answers exactly as the TP1 replica does."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

from glm53.deployments.app import ingress_app, server_app
from glm53.deployments.config import ServingConfig

# the full tier (make test-all, CI): kills parts of a served app, waits for Serve to heal it
pytestmark = pytest.mark.slow

STREAMS = 32
STREAM_BOUND_S = 60  # every stream ends within this after the kill
RECOVERY_BOUND_S = 120  # health is 200 again and requests are served


@pytest.fixture(scope="module")
def base_url(serve_url, tiny_checkpoints):
    from ray import serve

    path = tiny_checkpoints(seed=4)
    common = dict(model=str(path), device="cpu", max_model_len=512, max_num_seqs=32,
                  num_blocks=1024, speculative="none")
    servers = {"solo": server_app(ServingConfig(served_model_name="solo", **common), "cpu"),
               "pair": server_app(ServingConfig(
                   served_model_name="pair", tensor_parallel_size=2, expert_parallel_size=2,
                   decode_context_parallel_size=2, **common), "cpu")}
    serve.run(ingress_app(servers), name="chaos-test", route_prefix="/",
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    yield serve_url
    serve.delete("chaos-test")


async def _stream(client: httpx.AsyncClient, model: str, seed: int) -> str:
    """'finished' or 'error' by how the stream ended; raises if it ended without [DONE]."""
    body = {"model": model, "prompt": f"chaos {seed}", "max_tokens": 200, "stream": True,
            "ignore_eos": True, "temperature": 1.0, "seed": seed}
    outcome, done = None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return "refused"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                outcome = "error"
            elif event["choices"] and event["choices"][0].get("finish_reason"):
                outcome = "finished"
    assert done, "stream ended without [DONE]"
    assert outcome is not None, "stream ended without a finish reason or an error event"
    return outcome


async def _under_load(base_url: str, model: str, kill) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=STREAM_BOUND_S) as client:
        tasks = [asyncio.create_task(_stream(client, model, i)) for i in range(STREAMS)]
        await asyncio.sleep(1.0)  # streams are running
        kill()
        return await asyncio.wait_for(asyncio.gather(*tasks), STREAM_BOUND_S)


def _recovers(base_url: str, model: str) -> None:
    """/health reports 503 at least once, then 200, and a request to `model` succeeds; every
    request meanwhile is answered 200 or 503 + Retry-After (never 500)."""
    deadline = time.monotonic() + RECOVERY_BOUND_S
    seen_503 = False
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while time.monotonic() < deadline:
            health = client.get("/health").status_code
            seen_503 |= health == 503
            r = client.post("/v1/completions", json={"model": model, "prompt": "again",
                                                      "max_tokens": 4})
            assert r.status_code in (200, 503), (r.status_code, r.text)
            if r.status_code == 503:
                assert "Retry-After" in r.headers and "error" in r.json()
            elif health == 200 and seen_503:
                return
            time.sleep(0.5)
    pytest.fail(f"not recovered within {RECOVERY_BOUND_S} s (saw 503: {seen_503})")


def _replica_actor(model: str):
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if "SERVE_REPLICA" in entry["name"] and f"LLMServer:{model}" in entry["name"]:
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    raise AssertionError(f"no replica of {model}")


def _worker_pids() -> list[int]:
    """Processes of the engine worker actors alive now (the TP=2 replica's)."""
    from ray._private import state

    return [a["Pid"] for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"] == "Worker"]


def test_killed_replica_ends_every_stream_and_is_replaced(base_url):
    import ray

    outcomes = asyncio.run(_under_load(
        base_url, "solo", lambda: ray.kill(_replica_actor("solo"), no_restart=True)))
    assert "error" in outcomes  # the kill really cut streams
    _recovers(base_url, "solo")


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=STREAM_BOUND_S)


def test_pair_replica_holds_its_engine_and_workers_in_one_placement_group(base_url):
    """Serve reserves the pair replica's placement group (one per replica, STRICT_PACK): the
    replica with its engine takes bundle 0, rank r takes bundle r + 1; the executor makes no
    group of its own. The TP1 replica and the ingress need none."""
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert [(g["bundles"], g["strategy"]) for g in groups] == [
        ({0: {"CPU": 1.0}, 1: {"GPU": 1.0}, 2: {"GPU": 1.0}}, "STRICT_PACK")]
    pg = groups[0]["placement_group_id"]
    free = ray.available_resources()
    for bundle in (f"CPU_group_0_{pg}", f"GPU_group_1_{pg}", f"GPU_group_2_{pg}"):
        assert free.get(bundle, 0) == 0, bundle  # held by the replica, rank 0, rank 1


def test_pair_greedy_output_equals_tp1_through_openai(base_url):
    client = _client(base_url)
    prompts = ["the pair and the solo", "agree token for token on every prompt"]

    def greedy(model: str) -> list[str]:
        out = client.completions.create(model=model, prompt=prompts, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in out.choices] == ["length"] * len(prompts)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    assert greedy("pair") == greedy("solo")


def test_killed_worker_of_a_pair_replica_ends_every_stream(base_url):
    """Also through the `openai` client: a stream in flight when the worker dies raises an
    APIError that says the engine is being restarted (not a hang, not a bare disconnect), and
    once Serve has replaced the replica (its health check fails) the client is served."""
    pids = _worker_pids()
    assert len(pids) == 2
    client = _client(base_url)
    in_flight = client.completions.create(model="pair", prompt="in flight", max_tokens=400,
                                          stream=True, extra_body={"ignore_eos": True})
    next(iter(in_flight))  # it is running
    outcomes = asyncio.run(_under_load(
        base_url, "pair", lambda: os.kill(pids[1], signal.SIGKILL)))
    assert "error" in outcomes
    with pytest.raises(openai.APIError, match="engine is unavailable and being restarted"):
        for _ in in_flight:
            pass
    _recovers(base_url, "pair")
    assert set(_worker_pids()).isdisjoint(pids)  # a new replica with new workers
    again = client.completions.create(model="pair", prompt="again", max_tokens=4)
    assert again.choices[0].text and again.usage.completion_tokens >= 1


def test_killed_ingress_aborts_its_requests_in_the_engine(base_url):
    """A stream whose ingress replica dies is aborted in the engine, not generated to the end:
    its requests finish as aborted (not by length), and nothing runs soon after the kill."""
    import ray
    from ray import serve

    def ingress_actor():
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if "SERVE_REPLICA" in entry["name"] and "OpenAIIngress" in entry["name"]:
                return ray.get_actor(entry["name"], namespace=entry["namespace"])
        raise AssertionError("no ingress replica")

    server = serve.get_deployment_handle("LLMServer:solo", app_name="chaos-test")

    def sample(text: bytes, prefix: str) -> float:
        line = next(ln for ln in text.decode().splitlines() if ln.startswith(prefix))
        return float(line.rsplit(" ", 1)[1])

    def running(text: bytes) -> float:
        return sample(text, "vllm:num_requests_running")

    def finished(reason: str) -> float:
        """vllm:request_success_total of one finish reason."""
        text = server.metrics_text.remote().result().decode()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith("vllm:request_success_total{")
                   and f'finished_reason="{reason}"' in ln)

    async def streams():
        async with httpx.AsyncClient(base_url=base_url, timeout=STREAM_BOUND_S) as client:
            body = {"model": "solo", "prompt": "long", "max_tokens": 480, "stream": True,
                    "ignore_eos": True}
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body))
                     for _ in range(8)]
            await asyncio.sleep(1.5)
            assert running(await server.metrics_text.remote()) > 0
            ray.kill(ingress_actor(), no_restart=True)
            await asyncio.gather(*tasks, return_exceptions=True)

    before = {reason: finished(reason) for reason in ("abort", "length")}
    asyncio.run(streams())
    deadline = time.monotonic() + 20
    while running(server.metrics_text.remote().result()) > 0:
        assert time.monotonic() < deadline, "the engine kept generating for a dead ingress"
        time.sleep(0.5)
    after = {reason: finished(reason) for reason in ("abort", "length")}
    assert (after["abort"] - before["abort"], after["length"] - before["length"]) == (8, 0)
    _recovers_health(base_url)


def _recovers_health(base_url: str) -> None:
    deadline = time.monotonic() + RECOVERY_BOUND_S
    with httpx.Client(base_url=base_url, timeout=10) as client:
        while time.monotonic() < deadline:
            try:
                if client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    pytest.fail("the ingress was not replaced")
