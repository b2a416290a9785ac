"""Request bodies in the OpenAPI document of routes that parse their body themselves.

The ingress routes take the raw `Request` and validate it with the strict pydantic models (so a
bad body is a 400 with OpenAI's envelope, not FastAPI's 422), which leaves FastAPI nothing to
document. `json_body(Model)` is the route's `openapi_extra`: a required JSON body that refers
to `#/components/schemas/Model`; `FastAPIWithBodies` adds those models and every model they
use to the document's components, so fuzzers and client generators see them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

COMPONENTS = "#/components/schemas/"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"$ref": f"{COMPONENTS}{model.__name__}"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


class FastAPIWithBodies(FastAPI):
    """FastAPI whose OpenAPI document also lists `body_models` (validation mode) and every
    model they use under components/schemas (a subclass, not a patched `app.openapi`: Serve
    pickles the app, and a method travels with it)."""

    def __init__(self, *, body_models: list[type[BaseModel]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body_models = tuple(body_models)

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            document = super().openapi()
            _, definitions = models_json_schema([(m, "validation") for m in self.body_models],
                                                ref_template=COMPONENTS + "{model}")
            components = document.setdefault("components", {}).setdefault("schemas", {})
            components.update(definitions.get("$defs", {}))
        return self.openapi_schema
