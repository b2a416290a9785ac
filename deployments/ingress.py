"""The OpenAI-compatible HTTP front (FastAPI behind Ray Serve's proxy).

Validates each request (strict pydantic; every failure is a 400 with OpenAI's error envelope,
never FastAPI's 422), routes it by `model` to that model's LLM-server deployment, and frames
the replica's stream as server-sent events. Client disconnect cancels the response generator;
Serve propagates the cancellation to the replica, which aborts the engine request.
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures at run time

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import HTTPConfig
from .drain import DrainGate, DrainState
from .http_guard import mount_http_guard
from .metrics import CONTENT_TYPE, merge_expositions
from .openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from .openapi_doc import FastAPIWithBodies, json_body

logger = logging.getLogger(__name__)

BODY_MODELS = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest]
app = FastAPIWithBodies(title="glm53", body_models=BODY_MODELS,
                        description="OpenAI-compatible API of the glm53 serving cluster")

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                503: "service_unavailable_error"}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(APIError(exc.status_code, str(exc.detail),
                                   _ERROR_TYPES.get(exc.status_code, "server_error")))


@app.exception_handler(RequestValidationError)
async def _fastapi_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = (exc.errors() or [{}])[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return error_response(APIError(400, f"{param}: {first.get('msg', 'invalid request')}",
                                   "invalid_request_error", param))


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                   "server_error"))


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
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate_json(json.dumps(body))
    except ValidationError as exc:
        raise validation_error(exc) from None


def _answer(result: Any) -> Any:
    if isinstance(result, APIError):
        raise result
    return result


async def _relay(stream: Any) -> AsyncIterator[str]:
    async for batch in stream:
        yield batch


# NOTE: module helpers sit above the class: Serve captures the class when it is decorated.
@serve.ingress(app)
class OpenAIIngress:
    """Routes by model name to LLM-server deployment handles."""

    def __init__(self, servers: dict[str, Any], http: HTTPConfig | None = None) -> None:
        self.servers = servers
        self.http = http or HTTPConfig()
        self.drain_state = DrainState()

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
        return await self._generate("chat", body)

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        body = await parse(request, CompletionRequest)
        return await self._generate("completions", body)

    async def _generate(self, method: str, body: Any) -> Response:
        handle = self._server(body.model)
        stream = getattr(handle.options(stream=True), method).remote(body)
        try:
            first = await stream.__anext__()
            if isinstance(first, APIError):
                raise first
            if not body.stream:
                return JSONResponse(first)
            return StreamingResponse(_relay(stream), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
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
    async def health(self) -> Response:
        try:
            await asyncio.gather(*(h.health.remote() for h in self.servers.values()))
        except Exception as exc:  # noqa: BLE001 - any failure means not healthy
            return error_response(APIError(503, f"unhealthy: {exc}", "service_unavailable_error"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await asyncio.gather(*(h.metrics_text.remote() for h in self.servers.values()))
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE)
