"""Each Serve replica's inter-deployment gRPC server on the node's cluster address only.

Ray Serve 2.60 starts that server in every replica on `[::]:0`: a random port on all
interfaces, with no setting to change it (ray-project/ray#64544). Its callers reach it at the
replica's node IP (`RunningReplicaInfo.node_ip`, then `node_ip:port`), so binding that address
alone loses nothing. Each deployment calls `bind_replica_grpc_to_node_ip()` in `__init__`,
which Serve runs before it starts the server; a Ray that no longer binds the wildcard is left
as it is (tests/deployments/test_http_guard.py checks the replicas' listeners under Serve).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

WILDCARD = "[::]:0"  # what Serve's replica passes


def node_address(ip: str) -> str:
    """A gRPC bind address for `ip` with a port the system picks."""
    return f"[{ip}]:0" if ":" in ip else f"{ip}:0"


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def node_bound(add_port: Callable[[Any, str], int],
               node_ip: Callable[[], str] | None = None) -> Callable[[Any, str], int]:
    """`add_port(server, address)` with the wildcard address replaced by the node's."""
    def add_port_on_node(server: Any, address: str) -> int:
        if address == WILDCARD:
            address = node_address((node_ip or _node_ip)())
        return add_port(server, address)

    add_port_on_node.glm53_node_bound = True
    return add_port_on_node


def bind_replica_grpc_to_node_ip() -> None:
    """In a Serve replica's process: its inter-deployment gRPC server binds the node IP."""
    try:
        from ray.serve._private import replica
    except ImportError:  # pragma: no cover - Ray without Serve's replica module
        return
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None:
        logger.warning("Ray Serve's replica has no add_port_to_grpc_server: its gRPC port "
                       "keeps Ray's own bind address")
        return
    if not getattr(add_port, "glm53_node_bound", False):
        replica.add_port_to_grpc_server = node_bound(add_port)
