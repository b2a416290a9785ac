"""The Serve replicas' inter-deployment gRPC server binds the node's address, not every
interface (deployments/listeners.py); under Serve, test_http_guard.py checks the replicas'
listening sockets."""

from __future__ import annotations

import inspect

from ray.serve._private import replica

from glm53.deployments.listeners import (
    WILDCARD,
    bind_replica_grpc_to_node_ip,
    node_address,
    node_bound,
)


def test_node_address():
    assert node_address("10.1.2.3") == "10.1.2.3:0"
    assert node_address("fd00::7") == "[fd00::7]:0"


def test_the_wildcard_becomes_the_node_address():
    calls = []
    add_port = node_bound(lambda server, address: calls.append(address) or 4321,
                          node_ip=lambda: "10.1.2.3")
    assert add_port("server", WILDCARD) == 4321
    add_port("server", "127.0.0.1:0")  # other addresses are left alone
    assert calls == ["10.1.2.3:0", "127.0.0.1:0"]


def test_the_replica_module_is_patched_once(monkeypatch):
    """What a Serve replica starts its server with: Ray's own code passes the wildcard here
    (if a Ray release stops doing so, the served test fails, not this one)."""
    calls = []

    def original(server, address):  # Ray's, before any deployment in this process ran
        calls.append(address)
        return 1

    monkeypatch.setattr(replica, "add_port_to_grpc_server", original)
    monkeypatch.setattr("glm53.deployments.listeners._node_ip", lambda: "10.1.2.3")
    bind_replica_grpc_to_node_ip()
    patched = replica.add_port_to_grpc_server
    assert patched is not original and patched.glm53_node_bound
    bind_replica_grpc_to_node_ip()
    assert replica.add_port_to_grpc_server is patched
    patched("server", WILDCARD)
    assert calls == ["10.1.2.3:0"]


def test_serve_binds_its_replica_server_through_the_patched_name():
    """Ray's replica starts its server as `add_port_to_grpc_server(self._server, "[::]:0")`,
    looking the name up in its module (so the patch applies); a Ray release that changes this
    fails here first."""
    source = inspect.getsource(replica.Replica._on_initialized)
    assert f'add_port_to_grpc_server(self._server, "{WILDCARD}")' in source
