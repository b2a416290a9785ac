"""The OpenAI ingress as a plain ASGI app in this process, without Ray: for HTTP-level tests
(the guard, the OpenAPI document, fuzzing) that need many requests and no cluster.

Built the way a Serve replica builds it: a pickled copy of the module's FastAPI app, the
ingress object as the replica's servable (routes find `self` through
`serve.get_replica_context()`, patched here), `__serve_build_asgi_app__` to mount the guard.
The LLM servers are real `LLMServer` objects with the scripted engine (or the real one, for
load tests), behind handles that call them in-process with the Serve handle's call shapes.
`served_over_http` puts such an app on a loopback port (uvicorn in a thread) for clients that
need a real socket and real streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from types import SimpleNamespace
from typing import Any

import uvicorn
from ray import cloudpickle, serve
from ray.serve._private.http_util import ASGIAppReplicaWrapper

from glm53.deployments import ingress
from glm53.deployments.config import HTTPConfig, ServingConfig
from glm53.deployments.http_guard import KEY_ENV, KEYS_ENV
from glm53.deployments.llm_server import LLMServer
from tests.deployments.scripted_engine import ScriptedEngine


class _Stream:
    """A streaming handle call: an async iterator with `cancel()`."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        return await self.generator.__anext__()

    def cancel(self) -> None:  # as Serve's: returns at once, the generator closes later
        asyncio.get_running_loop().create_task(self.generator.aclose())


class LocalHandle:
    """`handle.method.remote(...)` and `handle.options(stream=True).method.remote(...)`."""

    def __init__(self, server: LLMServer, stream: bool = False) -> None:
        self.server, self.stream = server, stream

    def options(self, stream: bool = False) -> LocalHandle:
        return LocalHandle(self.server, stream)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.server, name)

        async def call(*args: Any) -> Any:
            result = method(*args)
            return await result if inspect.isawaitable(result) else result

        def remote(*args: Any) -> Any:
            return _Stream(method(*args)) if self.stream else call(*args)

        return SimpleNamespace(remote=remote)


class _LocalIngress(ingress.OpenAIIngress):
    async def __init__(self) -> None:  # never called: built field by field below
        raise NotImplementedError

    def __del__(self) -> None:  # Serve's wrapper has an async one, for its replica only
        pass


def scripted_config(name: str = "scripted") -> ServingConfig:
    return ServingConfig(served_model_name=name, speculative="none", device="cpu")


def local_ingress(monkeypatch, http: HTTPConfig | None = None,
                  env: dict[str, str] | None = None, config: ServingConfig | None = None,
                  engine_factory: Any = ScriptedEngine) -> Any:
    """The guarded ASGI app of an ingress serving one model, scripted unless `engine_factory`
    is None (then the real engine of `config`, in this process); `env`: the ingress process's
    environment variables (GLM53_API_KEYS...)."""
    config = config or scripted_config()
    for name in (KEYS_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    servers = {config.model_name: LocalHandle(LLMServer(config, "cpu", engine_factory))}
    servable = object.__new__(_LocalIngress)
    ingress.OpenAIIngress.__mro__[1].__init__(servable, servers, http)  # the user class
    app = cloudpickle.loads(cloudpickle.dumps(ingress.app))
    # a replica unpickles an app that never ran; other tests in this process may have run
    # the module's app, whose built middleware stack would then come along in the copy
    app.middleware_stack = None
    ASGIAppReplicaWrapper.__init__(servable, app)
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: SimpleNamespace(servable_object=servable))
    return servable.__serve_build_asgi_app__()


@contextlib.contextmanager
def served_over_http(app: Any, start_timeout_s: float = 30.0):
    """`app` served by uvicorn on a free loopback port in a thread; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
