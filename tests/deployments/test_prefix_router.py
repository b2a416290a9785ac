"""Prefix-affinity routing (deployments/prefix_router.py): the routing key of our request
shapes, the hash choice, the load-balance fallback, the router on fake replicas, and how the
deployment switches it on (no Ray cluster started)."""

from __future__ import annotations

import asyncio
import importlib
from collections import Counter

import pytest

from glm53.deployments.config import PREFIX_ROUTER_CLASS, ServingConfig
from glm53.deployments.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)
from glm53.deployments.prefix_router import (
    PrefixAffinityRouter,
    pick_replica,
    rendezvous_order,
    routing_key,
)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 8}


def _chat(*turns: str, system: dict | None = SYSTEM) -> ChatCompletionRequest:
    messages = [system] if system else []
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return ChatCompletionRequest(model="m", messages=messages)


def test_every_turn_of_a_conversation_has_one_key():
    first = routing_key([_chat("plan a trip to Lyon"), "rid-1", None])
    later = routing_key([_chat("plan a trip to Lyon", "Sure: day 1 ...", "and day 2?"), "rid-2"])
    assert first is not None and first == later
    assert routing_key([_chat("plan a trip to Oslo")]) != first
    # dict messages (the shape Ray's router expects) key like our pydantic ones
    assert routing_key([{"messages": _chat("plan a trip to Lyon").model_dump()["messages"]}]) \
        == first


def test_keys_of_parts_prompts_and_promptless_requests():
    parts = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is "},
                                     {"type": "image_url", "image_url": {"url": "u1"}}]}])
    key = routing_key([parts])
    assert key.startswith("chat:user\x00what is <image ") and key.endswith(">\x01")
    other = parts.model_copy(deep=True)
    other.messages[0].content[1]["image_url"]["url"] = "u2"
    assert routing_key([other]) != key
    text = CompletionRequest(model="m", prompt="x" * 5000)
    assert routing_key([text], prefix_chars=64) == ("text:" + "x" * 5000)[:64]
    assert routing_key([CompletionRequest(model="m", prompt=[[1, 2, 3], [4]])]) == "text:ids:1,2,3"
    assert routing_key([]) is None
    assert routing_key([DetokenizeRequest(model="m", tokens=[1, 2])]) is None
    assert routing_key(["rid", None]) is None


def test_rendezvous_is_stable_spreads_and_moves_only_a_removed_replicas_keys():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"conversation {i}" for i in range(400)]
    first = {k: rendezvous_order(k, replicas)[0] for k in keys}
    assert first == {k: rendezvous_order(k, list(reversed(replicas)))[0] for k in keys}
    counts = Counter(first.values())
    assert set(counts) == set(replicas) and min(counts.values()) >= 60  # ~100 each
    survivors = [r for r in replicas if r != "r2"]
    for k in keys:
        if first[k] != "r2":
            assert rendezvous_order(k, survivors)[0] == first[k]


def test_pick_keeps_the_preferred_replica_unless_overloaded():
    order = ["a", "b", "c"]
    cap = {"a": 10, "b": 10, "c": 10}
    assert pick_replica(order, {"a": 5, "b": 0, "c": 1}, cap, 8) == "a"  # within threshold
    assert pick_replica(order, {"a": 9, "b": 3, "c": 0}, cap, 8) == "c"  # 9 - 0 > 8
    assert pick_replica(order, {"a": 10, "b": 2, "c": 2}, cap, 100) == "b"  # a full; tie: order
    assert pick_replica(order, {"a": None, "b": 4, "c": 5}, cap, 100) == "b"  # a silent
    assert pick_replica(order, {"a": None, "b": None}, cap, 0) == "a"  # nothing known


class _Replica:
    """The part of Serve's RunningReplica a router reads."""

    def __init__(self, deployment_id, name: str, queue_len: int, max_ongoing: int = 100):
        from ray.serve._private.common import ReplicaID

        self.replica_id = ReplicaID(name, deployment_id)
        self.queue_len = queue_len
        self.max_ongoing_requests = max_ongoing
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats: dict = {}
        self.is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _route(requests, lens: dict[str, int], threshold: int = 8) -> list[str]:
    """The replica name the router's first rank holds for each request."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    async def run() -> list[str]:
        dep = DeploymentID(name="LLMServer:m", app_name="app")
        router = PrefixAffinityRouter(deployment_id=dep,
                                      handle_source=DeploymentHandleSource.UNKNOWN,
                                      use_replica_queue_len_cache=False)
        router.initialize_state(imbalance_threshold=threshold)
        replicas = [_Replica(dep, name, n) for name, n in lens.items()]
        router.update_replicas(replicas)
        out = []
        for i, request in enumerate(requests):
            pending = PendingRequest(args=[request, f"rid-{i}", None], kwargs={},
                                     metadata=RequestMetadata(request_id=f"rid-{i}",
                                                              internal_request_id=f"i{i}",
                                                              call_method="chat"))
            ranks = await router.choose_replicas(replicas, pending)
            assert len(ranks) >= 2 and len(ranks[0]) == 1  # the choice, then power of two
            out.append(ranks[0][0].replica_id.unique_id)
        return out

    return asyncio.run(run())


def test_router_sends_a_conversation_to_one_replica_and_spreads_others():
    idle = {"r0": 0, "r1": 0, "r2": 0}
    turns = [_chat("hello there"), _chat("hello there", "hi!", "how are you?"),
             _chat("hello there", "hi!", "how are you?", "fine", "bye")]
    assert len(set(_route(turns * 2, idle))) == 1
    others = [_chat(f"question number {i}") for i in range(30)]
    assert len(set(_route(others, idle))) == 3


def test_router_skips_an_overloaded_preferred_replica_for_the_least_loaded():
    request = _chat("hello there")
    preferred = _route([request], {"r0": 0, "r1": 0, "r2": 0})[0]
    lens = {"r0": 5, "r1": 3, "r2": 4}
    lens[preferred] = 20
    assert _route([request], lens) == ["r1"]
    assert _route([request], lens, threshold=100) == [preferred]


def test_router_routes_promptless_calls_by_power_of_two():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    async def run():
        dep = DeploymentID(name="LLMServer:m", app_name="app")
        router = PrefixAffinityRouter(deployment_id=dep,
                                      handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        replicas = [_Replica(dep, f"r{i}", 0) for i in range(3)]
        router.update_replicas(replicas)
        pending = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(
            request_id="x", internal_request_id="x", call_method="health"))
        return await router.choose_replicas(replicas, pending)

    ranks = asyncio.run(run())
    assert len(ranks) == 1 and len(ranks[0]) == 2


@pytest.mark.parametrize("fields, on", [({}, True), ({"enable_prefix_caching": False}, False),
                                        ({"enable_prefix_caching": True}, True),
                                        ({"enable_prefix_caching": True,
                                          "prefix_routing": False}, False),
                                        ({"prefix_routing": True}, True)])
def test_deployment_uses_the_router_with_prefix_caching(fields, on):
    config = ServingConfig(speculative="none", num_replicas=2, prefix_routing_imbalance=3,
                           **fields)
    options = config.server_deployment_options("cpu")
    assert ("request_router_config" in options) is on
    if on:
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        router = options["request_router_config"]
        assert router["request_router_kwargs"] == {"imbalance_threshold": 3}
        module, name = PREFIX_ROUTER_CLASS.rsplit(".", 1)
        assert getattr(importlib.import_module(module), name) is PrefixAffinityRouter
        assert RequestRouterConfig(**router).get_request_router_class() is PrefixAffinityRouter
        serve.deployment(name="d")(object).options(**options)  # Serve accepts the options


@pytest.mark.parametrize("flags, on", [(["--enable-prefix-caching"], True),
                                       (["--enable-prefix-caching", "--no-prefix-routing"],
                                        False), (["--prefix-routing"], True), ([], True),
                                       (["--no-enable-prefix-caching"], False)])
def test_serve_prefix_routing_flag(flags, on):
    from glm53.deployments.cli import _parser
    from glm53.deployments.serve_cli import serving_config

    config = serving_config(_parser().parse_args(["serve", "--speculative", "none", *flags]))
    assert config.prefix_routing_enabled is on
