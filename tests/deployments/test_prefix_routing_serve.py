"""Prefix routing through Serve's HTTP proxy on CPU: two LLM-server replicas (an engine that
answers with its replica's id), prefix caching on, so the deployment routes with
PrefixAffinityRouter. Every turn of a conversation reaches one replica; different
conversations reach both; promptless calls (models, health) still route."""

from __future__ import annotations

import httpx
import pytest

from glm53.deployments.app import ingress_app, server_app
from glm53.deployments.config import ServingConfig
from tests.deployments.scripted_engine import ReplicaEngine

# the full tier (make test-all, CI): starts a two-replica Serve app
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http(serve_url):
    from ray import serve

    config = ServingConfig(served_model_name="m", device="cpu", speculative="none",
                           num_replicas=2, enable_prefix_caching=True)
    assert config.prefix_routing_enabled
    serve.run(ingress_app({"m": server_app(config, "cpu", ReplicaEngine)}),
              name="prefix-routing-test", route_prefix="/",
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    with httpx.Client(base_url=serve_url, timeout=60) as client:
        yield client
    serve.delete("prefix-routing-test")


def _replica(http: httpx.Client, messages: list[dict]) -> str:
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                "max_tokens": 32})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text.startswith("replica="), text
    return text


def test_turns_of_a_conversation_reach_one_replica_and_conversations_spread(http):
    seen = set()
    for c in range(12):
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"conversation {c}: hello"}]
        replicas = set()
        for turn in range(4):
            replica = _replica(http, messages)
            replicas.add(replica)
            messages += [{"role": "assistant", "content": replica},
                         {"role": "user", "content": f"turn {turn}"}]
        assert len(replicas) == 1, (c, replicas)
        seen |= replicas
    assert len(seen) == 2  # 12 conversations over 2 replicas: all on one has p = 2**-11
    assert http.get("/v1/models").status_code == 200
    assert http.get("/health").status_code == 200
