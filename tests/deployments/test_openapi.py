"""The served OpenAPI document (issue 18, part 7): it describes every request body, and a
schemathesis run over it finds no 5xx and only 4xx answers in OpenAI's error envelope.

Against the real ingress app in-process with the scripted engine (local_ingress.py): the
same routes, parsing, guard and LLM server as under Serve, fast enough to fuzz."""

from __future__ import annotations

import collections
import json
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from starlette.testclient import TestClient

from glm53.deployments.config import HTTPConfig
from glm53.deployments.openai_schema import MAX_N
from tests.deployments.local_ingress import local_ingress

EXAMPLES_PER_OPERATION = 60
KEY = "fuzz-key"
BODY_ROUTES = {"/v1/chat/completions": "ChatCompletionRequest",
               "/v1/completions": "CompletionRequest", "/tokenize": "TokenizeRequest",
               "/detokenize": "DetokenizeRequest"}


@pytest.fixture
def app(monkeypatch):
    return local_ingress(monkeypatch, HTTPConfig(api_keys=[KEY]))


def test_every_request_body_is_described(app):
    with TestClient(app) as client:
        doc = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    schemas = doc["components"]["schemas"]
    for path, model in BODY_ROUTES.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
    # every reference resolves inside the document
    for ref in json.dumps(doc).split('"$ref": "')[1:]:
        name = ref.split('"')[0].removeprefix("#/components/schemas/")
        assert name in schemas, name
    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    assert chat["additionalProperties"] is False
    assert chat["properties"]["n"]["maximum"] == MAX_N


def fuzz(operation, mode: schemathesis.GenerationMode) -> tuple[int, list[str]]:
    """Run EXAMPLES_PER_OPERATION cases of `operation`: (how many got 200, the failures)."""
    served, failures = 0, []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    def check(case):
        nonlocal served
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = "scripted"  # past routing, into the server
        response = case.call(headers={"Authorization": f"Bearer {KEY}"})
        served += response.status_code == 200
        where = f"{response.status_code} {operation.label} {mode.value} {case.body!r:.300}"
        if response.status_code >= 500:
            failures.append(f"{where}: {response.text:.300}")
        elif response.status_code >= 400:
            error = response.json().get("error") if response.text else None
            if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
                failures.append(f"no envelope: {where}: {response.text:.300}")

    try:
        check()
    except Unsatisfiable:  # nothing to violate: an operation without inputs
        assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    return served, failures


@pytest.mark.slow
def test_fuzzing_the_document_finds_no_server_error(app):
    """Schema-conforming (positive) and violating (negative) cases of every operation: no
    5xx, and every 4xx in the envelope."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app,
                                            headers={"Authorization": f"Bearer {KEY}"})
    failures: list[str] = []
    served: collections.Counter[str] = collections.Counter()
    start = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:
            count, found = fuzz(operation, mode)
            served[operation.label] += count
            failures += found
    assert not failures, "\n".join(failures[:20])
    # the fuzz reached the servers, not only the validation
    assert all(served[f"POST {path}"] for path in BODY_ROUTES), served
    assert time.monotonic() - start < 120
