"""Graceful drain of the OpenAI ingress (issue 18): once a drain starts, new requests get 503
with Retry-After and OpenAI's error envelope, `/health` answers 503 so load balancers and
probes move away, and requests already in flight (streams included) run to their end.

Two halves: `DrainGate`, an ASGI middleware in the ingress replica that refuses and counts
requests, and, in `glm53 serve`, `StopSignals` (SIGTERM/SIGINT) and `drain_ingress`, which
starts the drain through the ingress handle and waits, up to a timeout, until nothing is in
flight.

Replicas that Serve itself stops (scale-down, a rolling update of the app, a KubeRay node
drain) drain through Serve's graceful shutdown instead: the deployments' graceful_shutdown_*
options come from the same `drain_timeout_s` (config.graceful_shutdown_options).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .openai_schema import APIError

logger = logging.getLogger(__name__)

# answered during a drain, never refused: Prometheus keeps scraping a draining server
METRICS_PATH = "/metrics"
HEALTH_PATH = "/health"
# seconds a refused client should wait: about one probe period, after which a load balancer
# has moved to another replica
RETRY_AFTER_S = 5
# how often `drain_ingress` asks the ingress how many requests are still in flight
POLL_PERIOD_S = 0.5


class DrainState:
    """One ingress replica's drain: whether it started, and the requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    def start(self) -> int:
        """Refuse new requests from now on (idempotent); returns how many are in flight."""
        self.draining = True
        return self.in_flight


def draining_error() -> APIError:
    return APIError(503, "The server is shutting down; retry the request shortly.",
                    "service_unavailable_error", None, "server_draining",
                    {"Retry-After": str(RETRY_AFTER_S)})


class DrainGate:
    """ASGI middleware: counts HTTP requests in flight (until their last body byte is sent)
    and, once `state.draining`, refuses new ones. `/metrics` is neither counted nor refused;
    `/health` is refused (503) but not counted."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == METRICS_PATH:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = draining_error()
            await JSONResponse(error.body(), status_code=error.status,
                               headers=error.headers)(scope, receive, send)
            return
        if scope["path"] == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def drain_ingress(ingress: Any, timeout_s: float) -> int:
    """Start the drain of the ingress behind the Serve handle `ingress` and wait until no
    request is in flight or `timeout_s` passed. Returns the requests still in flight."""
    deadline = time.monotonic() + timeout_s
    in_flight = ingress.drain.remote().result(timeout_s=max(timeout_s, 1.0))
    logger.info("draining: %d request(s) in flight; new requests get 503 (waiting up to "
                "%g s)", in_flight, timeout_s)
    while in_flight and time.monotonic() < deadline:
        time.sleep(min(POLL_PERIOD_S, max(0.0, deadline - time.monotonic())))
        in_flight = ingress.drain.remote().result(timeout_s=max(timeout_s, 1.0))
    if in_flight:
        logger.warning("drain timeout (%g s): %d request(s) still in flight are cut",
                       timeout_s, in_flight)
    else:
        logger.info("drained: no request in flight")
    return in_flight


class StopSignals:
    """SIGTERM and SIGINT handler of `glm53 serve`: the first signal asks for a graceful drain
    (`requested` is set), a second one stops at once (KeyboardInterrupt in the main thread)."""

    def __init__(self) -> None:
        self.requested = threading.Event()

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()
        logger.info("%s received: draining (a second signal stops at once)",
                    signal.Signals(signum).name)
