"""The OpenAI-compatible HTTP front (FastAPI behind Ray Serve's proxy).

Validates each request (strict pydantic; every failure is a 400 with OpenAI's error envelope,
never FastAPI's 422), routes it by `model` to that model's LLM-server deployment, and frames
the replica's stream as server-sent events. Client disconnect cancels the response generator;
Serve propagates the cancellation to the replica, which aborts the engine request.

Errors never carry exception text (paths, actor ids, addresses): a message and the request's
id, whose details are in the log under that id. A replica that is gone or restarting is a 503
with Retry-After; a stream it breaks ends with an SSE error event and `[DONE]`.
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures at run time

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic_core import from_json
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from .caller_watch import Caller
from .config import HTTPConfig
from .drain import DrainGate, DrainState
from .http_guard import mount_http_guard
from .listeners import bind_replica_grpc_to_node_ip
from .metrics import CONTENT_TYPE, merge_expositions
from .openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .openapi_doc import FastAPIWithBodies, json_body
from .responses import DONE, sse

logger = logging.getLogger(__name__)

BODY_MODELS = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest]
app = FastAPIWithBodies(title="glm53", body_models=BODY_MODELS,
                        description="OpenAI-compatible API of the glm53 serving cluster")

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                503: "service_unavailable_error"}
RETRY_AFTER = {"Retry-After": "1"}
HEALTH_TIMEOUT_S = 0.75  # a replica that cannot answer this fast is not healthy
# the replica (or every replica) is gone, restarting or full: Serve replaces it, clients retry
REPLICA_UNAVAILABLE = (RayActorError, BackPressureError, DeploymentUnavailableError,
                       ReplicaUnavailableError)
REQUEST_ID_HEADER = "x-request-id"


def request_id(request: Request) -> str:
    """The request's id: Serve's proxy gives each HTTP request one (x-request-id, echoed on
    the response and carried to the replicas); a request that came another way gets one."""
    rid = request.headers.get(REQUEST_ID_HEADER) or getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.state.request_id = uuid.uuid4().hex
    return rid


def id_header(request: Request) -> dict[str, str]:
    """The request id as a response header, unless Serve's proxy gave it (and echoes it)."""
    if REQUEST_ID_HEADER in request.headers:
        return {}
    return {REQUEST_ID_HEADER: request_id(request)}


def error_response(error: APIError, request: Request) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status,
                        headers={**error.headers, **id_header(request)})


def internal_error(rid: str) -> APIError:
    return APIError(500, f"internal server error (request id {rid})", "server_error")


def unavailable_error(rid: str) -> APIError:
    return APIError(503, f"the model server is unavailable or restarting; retry later "
                    f"(request id {rid})", "service_unavailable_error", None,
                    "server_unavailable", RETRY_AFTER)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail),
                                   _ERROR_TYPES.get(exc.status_code, "server_error")), request)


@app.exception_handler(RequestValidationError)
async def _fastapi_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return error_response(APIError(400, f"{param}: {first.get('msg', 'invalid request')}",
                                   "invalid_request_error", param), request)


async def _replica_unavailable(request: Request, exc: Exception) -> JSONResponse:
    rid = request_id(request)
    logger.warning("request %s: model server unavailable: %r", rid, exc)
    return error_response(unavailable_error(rid), request)


for _unavailable in REPLICA_UNAVAILABLE:
    app.add_exception_handler(_unavailable, _replica_unavailable)


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    rid = request_id(request)
    logger.error("request %s on %s failed", rid, request.url.path, exc_info=exc)
    return error_response(internal_error(rid), request)


def validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message, "invalid_request_error", param)


async def parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        # pydantic's parser, not json.loads: it refuses NaN/Infinity literals and nesting past
        # its recursion limit (json.loads raises RecursionError at ~1000 levels, a 2 KB body)
        body = from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _answer(result: Any) -> Any:
    if isinstance(result, APIError):
        raise result
    return result


async def _relay(stream: Any, rid: str) -> AsyncIterator[str]:
    """The replica's SSE batches; if the replica or its handle fails mid-stream, an error
    event and `[DONE]` end the stream; if the client leaves, the replica's request is
    cancelled (which aborts it in the engine)."""
    over = False
    try:
        async for batch in stream:
            yield batch
        over = True
    except Exception as exc:  # noqa: BLE001 - the client gets an error event, the log the rest
        over = True
        logger.error("request %s: stream failed", rid, exc_info=exc)
        error = (unavailable_error(rid) if isinstance(exc, REPLICA_UNAVAILABLE)
                 else internal_error(rid))
        yield sse(error.body()) + DONE
    finally:
        if not over:
            stream.cancel()


# NOTE: module helpers sit above the class: Serve captures the class when it is decorated.
@serve.ingress(app)
class OpenAIIngress:
    """Routes by model name to LLM-server deployment handles."""

    def __init__(self, servers: dict[str, Any], http: HTTPConfig | None = None) -> None:
        bind_replica_grpc_to_node_ip()
        self.servers = servers
        self.http = http or HTTPConfig()
        self.drain_state = DrainState()
        # passed with each generation call: the LLM server aborts our requests if we die
        self.caller = Caller.current()

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this in the replica after __init__, before the first request: the
        guard needs this deployment's HTTPConfig, which the module-level app cannot know."""
        self.app.add_middleware(DrainGate, state=self.drain_state)  # inside the guard
        mount_http_guard(self.app, self.http)
        return self.app

    async def drain(self) -> int:
        """Refuse new requests from now on (`glm53 serve` on SIGTERM, drain.py); returns
        how many are in flight."""
        return self.drain_state.start()

    def _server(self, model: str | None) -> Any:
        if model is None and len(self.servers) == 1:
            return next(iter(self.servers.values()))
        if model not in self.servers:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error",
                           "model", "model_not_found")
        return self.servers[model]

    async def server_info(self) -> list[dict[str, Any]]:
        """Model cards with capacity lines (for `glm53 serve`'s start-up message)."""
        return list(await asyncio.gather(*(h.info.remote() for h in self.servers.values())))

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        cards = await asyncio.gather(*(h.model_card.remote() for h in self.servers.values()))
        return {"object": "list", "data": list(cards)}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        return await self._server(model_id).model_card.remote()

    @app.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        body = await parse(request, ChatCompletionRequest)
        return await self._generate("chat", body, request)

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await self._generate("completions", body, request)

    async def _generate(self, method: str, body: Any, request: Request) -> Response:
        rid = request_id(request)
        handle = self._server(body.model)
        stream = getattr(handle.options(stream=True), method).remote(body, rid, self.caller)
        try:
            first = await stream.__anext__()
            if isinstance(first, APIError):
                raise first
            if not body.stream:
                return JSONResponse(first, headers=id_header(request))
            return StreamingResponse(_relay(stream, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **id_header(request)})
        except BaseException:
            stream.cancel()
            raise

    @app.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> Any:
        body = await parse(request, TokenizeRequest)
        return _answer(await self._server(body.model).tokenize.remote(body))

    @app.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Any:
        body = await parse(request, DetokenizeRequest)
        return _answer(await self._server(body.model).detokenize.remote(body))

    @app.get("/health")
    async def health(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(asyncio.gather(
                *(h.health.remote() for h in self.servers.values())), HEALTH_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure (or silence) means not healthy
            rid = request_id(request)
            logger.warning("request %s: health check failed: %r", rid, exc)
            return error_response(APIError(503, f"unhealthy (request id {rid})",
                                            "service_unavailable_error", None, "unhealthy",
                                            RETRY_AFTER), request)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await asyncio.gather(*(h.metrics_text.remote() for h in self.servers.values()))
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE)
