"""The OpenAPI schema at /openapi.json, made accurate: FastAPI documents its own 422 validation errors, but
kvlab answers every error (validation included) in OpenAI's shape with the status below, so the schema
says exactly that. schemathesis fuzzes the API from this schema in the tests."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from kvlab.serve.protocol import ErrorResponse

_ERROR = {"model": ErrorResponse}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "Invalid request (OpenAI error shape)"},
    401: {**_ERROR, "description": "Missing or wrong API key"},
    403: {**_ERROR, "description": "Host not allowed (--allowed-hosts)"},
    404: {**_ERROR, "description": "Unknown model or route"},
    413: {**_ERROR, "description": "Body larger than --max-request-bytes"},
    415: {**_ERROR, "description": "POST body that is not application/json"},
    429: {**_ERROR, "description": "Waiting queue full; see Retry-After"},
    500: {**_ERROR, "description": "The engine failed on this request"},
    503: {**_ERROR, "description": "Shutting down"},
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine loop is running (empty body)", "content": {}},
    503: {"description": "The engine loop has stopped (empty body)", "content": {}},
}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def install_openapi(app: FastAPI) -> None:
    """Generate the schema once, without FastAPI's 422 (never sent: validation errors are 400s)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="kvlab's OpenAI-compatible API")
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
