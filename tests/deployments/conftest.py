"""Ray Serve for this package's Serve apps: started once, each module runs its app on it."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture(scope="package")
def serve_url(ray_session):
    """Serve's controller and HTTP proxy on a free loopback port, shared by the Serve apps of
    tests/deployments: each module runs its app at "/" and deletes it after (`serve.delete`
    waits for its replicas to stop). Starting Serve and shutting it down again cost each module
    ~6 s on 2 cores. Shut down after this package: tests/k8s runs a `glm53 serve` of its own,
    with its own port, in the same cluster."""
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
