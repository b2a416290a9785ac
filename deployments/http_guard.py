"""The HTTP guard of the OpenAI ingress: Host allow-list, API keys, no client-set Serve proxy
hints, JSON-only bodies, a body size limit and a body deadline. Refusals use OpenAI's error
envelope; all but the body's are made from the request head, before a route runs.

One ASGI middleware (CORS, when origins are configured, is Starlette's CORSMiddleware around
it, so browsers' preflights are answered before the key check). It sits in the ingress
replica because Ray Serve's HTTP proxy takes no middleware; the proxy streams the request body
to the replica message by message, so counting it here bounds what is ever buffered.

Open paths: `/health` and `/metrics` answer without a key and for any Host, because kubelet
probes and Prometheus call them by pod IP and carry no credentials; they reveal health and
counters, never request content. Everything else (`/v1/*`, `/tokenize`, `/detokenize`, the
OpenAPI document) needs a key once keys are configured: deny by default, so a new route is
never left open by accident.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import HTTPConfig
from .openai_schema import APIError

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
KEYS_ENV, KEY_ENV = "GLM53_API_KEYS", "GLM53_API_KEY"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Serve's proxy obeys these request headers (meant for its own HAProxy mode): a client could
# lift the operator's request timeout, or keep its generation running after it disconnects.
# The proxy acts on them before the replica sees the request; refusing the request here ends
# it at once, so the hints never take effect.
PROXY_HINT_HEADERS = ("x-request-timeout-seconds", "x-request-disconnect-disabled")


def api_keys_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """GLM53_API_KEYS (comma-separated) and GLM53_API_KEY (one key, as OPENAI_API_KEY)."""
    environ = os.environ if environ is None else environ
    keys = environ.get(KEYS_ENV, "").split(",") + [environ.get(KEY_ENV, "")]
    return [k.strip() for k in keys if k.strip()]


def is_loopback(bind_host: str) -> bool:
    if bind_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        return False


def _api_keys(config: HTTPConfig, environ: Mapping[str, str] | None) -> list[str]:
    return [k.get_secret_value() for k in config.api_keys] + api_keys_from_env(environ)


def host_name(header: str) -> str:
    """The name of a Host header: lower case, no port, no IPv6 brackets, no trailing dot."""
    host = header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        end = host.find("]")
        return host[1:end] if end > 0 else host
    name, colon, port = host.rpartition(":")
    return (name if colon and port.isdigit() else host).rstrip(".")


def _digest(key: bytes) -> bytes:
    # equal-length digests: the comparison time says nothing about a key's length either
    return hashlib.sha256(key).digest()


def _error(status: int, message: str, type: str, code: str,
           headers: dict[str, str] | None = None) -> APIError:
    return APIError(status, message, type, None, code, headers)


class RequestRefused(APIError):
    """Raised from the guarded `receive`: FastAPI's APIError handler answers it."""


class HTTPGuard:
    """ASGI middleware that checks each HTTP request against an `HTTPConfig`."""

    def __init__(self, app: ASGIApp, config: HTTPConfig,
                 environ: Mapping[str, str] | None = None) -> None:
        self.app = app
        self.key_digests = tuple({_digest(k.encode()) for k in _api_keys(config, environ)})
        self.hosts = (None if config.allowed_hosts is None or "*" in config.allowed_hosts
                      else tuple(h.strip().lower().strip("[]").rstrip(".")
                                 for h in config.allowed_hosts))
        self.max_request_bytes = config.max_request_bytes
        self.body_timeout_s = config.body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.check(scope)
        if refusal is not None:
            await _answer(refusal, scope, receive, send)
            return
        if scope["method"] in BODY_METHODS:
            receive = self._bounded(receive)
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except RequestRefused as exc:  # an app without an APIError handler
            if started:
                raise
            await _answer(exc, scope, receive, send)

    def check(self, scope: Scope) -> APIError | None:
        """The refusal of a request by its head (path, Host, key, type, declared length)."""
        if scope["path"] in OPEN_PATHS:
            return None
        headers = {k.decode("latin-1"): v for k, v in scope["headers"]}
        if self.hosts is not None and not self._host_allowed(headers.get("host", b"")):
            return _error(400, "Invalid host header", "invalid_request_error", "invalid_host")
        if self.key_digests and not self._key_valid(headers.get("authorization", b"")):
            return _error(401, "Invalid or missing API key: send 'Authorization: Bearer KEY'",
                          "authentication_error", "invalid_api_key",
                          {"WWW-Authenticate": "Bearer"})
        hint = next((h for h in PROXY_HINT_HEADERS if h in headers), None)
        if hint is not None:
            return _error(400, f"the {hint} header is not accepted", "invalid_request_error",
                          "header_not_allowed")
        if scope["method"] not in BODY_METHODS:
            return None
        media_type = headers.get("content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            return _error(415, "Content-Type must be application/json",
                          "invalid_request_error", "unsupported_media_type")
        length = headers.get("content-length", b"")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return self._too_large()
        return None

    def _host_allowed(self, header: bytes) -> bool:
        name = host_name(header.decode("latin-1"))
        return any(name == h or (h.startswith("*.") and name.endswith(h[1:]))
                   for h in self.hosts or ())

    def _key_valid(self, header: bytes) -> bool:
        scheme, _, key = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = _digest(key.strip())
        valid = False
        for digest in self.key_digests:  # every key, no early exit: constant time
            valid |= hmac.compare_digest(given, digest)
        return valid

    def _too_large(self) -> RequestRefused:
        return RequestRefused(413, f"the request body exceeds {self.max_request_bytes} bytes",
                              "invalid_request_error", None, "request_too_large")

    def _bounded(self, receive: Receive) -> Receive:
        """`receive` that counts the body and enforces its deadline; after the last body
        message it is the plain `receive` (a stream waits on it for the disconnect)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        received = 0
        done = False

        async def bounded() -> Message:
            nonlocal received, done
            if done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestRefused(408, f"the request body did not arrive within "
                                     f"{self.body_timeout_s:g} s", "invalid_request_error",
                                     None, "request_timeout") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise self._too_large()
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        return bounded


async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status,
                       headers=error.headers)(scope, receive, send)


def mount_http_guard(app: Starlette, config: HTTPConfig,
                     environ: Mapping[str, str] | None = None) -> None:
    """Put the guard (and CORS, when origins are allowed) around a FastAPI/Starlette app.
    CORS goes outermost: a preflight carries no key, and refusals need CORS headers too."""
    app.add_middleware(HTTPGuard, config=config, environ=environ)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    num_keys = len(set(_api_keys(config, environ)))  # how many, never which
    hosts = ", ".join(config.allowed_hosts) if config.allowed_hosts is not None else "any"
    logger.info("HTTP guard: %d API key(s); hosts: %s; CORS origins: %s; body limit %d bytes "
                "within %g s", num_keys, hosts, ", ".join(config.allowed_origins) or "none",
                config.max_request_bytes, config.body_timeout_s)
    if not num_keys:
        logger.warning("no API key configured: every caller that reaches the port is served "
                       "(set %s or --api-key)", KEYS_ENV)
