"""The one table from error code to HTTP status, and the JSON error envelopes (OpenAI's shape on /v1/*)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.tracing import request_id_of
from service.errors import (
    ErrorCode,
    InvalidInputError,
    OverloadedError,
    RateLimitedError,
    StoreUnavailableError,
    TTSError,
    UnauthorizedError,
    wire_name,
)
from service.requestids import HEADER

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"

# code -> (HTTP status, OpenAI error "type"). Every error response is built from this table.
STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_INPUT: (400, "invalid_request_error"),
    ErrorCode.INVALID_AUDIO: (400, "invalid_request_error"),
    ErrorCode.EMPTY_TEXT: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_SPEAKER: (400, "invalid_request_error"),
    ErrorCode.UNSUPPORTED_FORMAT: (400, "invalid_request_error"),
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: (415, "invalid_request_error"),
    ErrorCode.TEXT_TOO_LONG: (413, "invalid_request_error"),
    ErrorCode.UNKNOWN_MODEL: (400, "invalid_request_error"),
    ErrorCode.NOT_FOUND: (404, "invalid_request_error"),
    ErrorCode.UNAUTHORIZED: (401, "invalid_request_error"),
    ErrorCode.FORBIDDEN: (403, "invalid_request_error"),
    ErrorCode.RATE_LIMITED: (429, "rate_limit_error"),
    ErrorCode.OVERLOADED: (503, "server_error"),
    ErrorCode.SHUTTING_DOWN: (503, "server_error"),
    ErrorCode.NOT_READY: (503, "server_error"),
    ErrorCode.PAYLOAD_TOO_LARGE: (413, "invalid_request_error"),
    ErrorCode.REQUEST_TIMEOUT: (408, "invalid_request_error"),
    ErrorCode.UNSUPPORTED_CAPABILITY: (400, "invalid_request_error"),
    ErrorCode.VOICE_EXISTS: (409, "invalid_request_error"),
    ErrorCode.TOO_MANY_VOICES: (409, "invalid_request_error"),
    ErrorCode.STORE_UNAVAILABLE: (503, "server_error"),
    ErrorCode.STORAGE_FULL: (507, "server_error"),
    ErrorCode.BUNDLE_INVALID: (500, "server_error"),
    ErrorCode.ENGINE_FAILURE: (500, "server_error"),
}

# OpenAI's own endpoints answer like OpenAI: over-long input is a 400 invalid_request_error (openai-python
# raises BadRequestError for it; a 413 would surface as a bare APIStatusError). Our /v1 extensions
# (lexicon, normalize) and the native routes keep the table above.
OPENAI_ENDPOINTS = ("/v1/audio/", "/v1/models")
OPENAI_STATUS: dict[ErrorCode, int] = {ErrorCode.TEXT_TOO_LONG: 400}

# Framework-raised HTTP errors (unknown path, wrong method, ...) keep their status and get the nearest code.
_HTTP_STATUS_CODES: dict[int, ErrorCode] = {401: ErrorCode.UNAUTHORIZED, 403: ErrorCode.FORBIDDEN, 404: ErrorCode.NOT_FOUND}

# Documented error responses for the OpenAPI schema of every synthesis route.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "content": {"application/json": {}}}
    for status, description in {
        400: "Invalid input (unknown speaker or model, bad format, bad speed, malformed body, ...)",
        401: "Missing or wrong API key",
        404: "Not found (a model or saved voice of that id)",
        408: "The body did not arrive within TTS_BODY_TIMEOUT_S",
        413: "Text or body too large (400 on /v1/audio/speech, as OpenAI answers)",
        415: "The body is not JSON: send `Content-Type: application/json`",
        429: "Rate limit exceeded (Retry-After)",
        503: "Queue full or not ready (Retry-After)",
    }.items()
}


class RequestFieldError(StarletteHTTPException):
    """A typed error found while the request body or query is parsed, where FastAPI lets only HTTP errors through
    (it turns any other exception there into a bare "There was an error parsing the body")."""

    def __init__(self, error: TTSError) -> None:
        super().__init__(status_of(error), error.message)
        self.error = error


def status_of(error: TTSError, path: str = "") -> int:
    """HTTP status of `error` on `path`: the table, with OpenAI's statuses on OpenAI's own endpoints."""
    if path.startswith(OPENAI_ENDPOINTS) and error.code in OPENAI_STATUS:
        return OPENAI_STATUS[error.code]
    return STATUS[error.code][0]


def error_body(path: str, code: ErrorCode, message: str, param: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`: OpenAI's envelope on /v1/*, the same four fields elsewhere
    (`code` first there, as before `type` was added)."""
    kind = STATUS[code][1]
    if path.startswith(OPENAI_PREFIX):
        return {"error": {"message": message, "type": kind, "param": param, "code": code.value}}
    return {"error": {"code": code.value, "message": message, "type": kind, "param": param}}


def error_headers(error: TTSError) -> dict[str, str]:
    """Retry-After on 429/503 (not on a store fault that does not clear by itself), WWW-Authenticate on 401."""
    headers: dict[str, str] = {}
    if isinstance(error, (OverloadedError, RateLimitedError, StoreUnavailableError)) and error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    elif error.code in (ErrorCode.SHUTTING_DOWN, ErrorCode.NOT_READY):
        headers["Retry-After"] = "5"
    if isinstance(error, UnauthorizedError):
        headers["WWW-Authenticate"] = 'Bearer realm="cosyvoice-lite"'
    return headers


def error_response(path: str, error: TTSError) -> JSONResponse:
    """The JSON response for a typed error."""
    body = error_body(path, error.code, error.message, error.param)
    return JSONResponse(body, status_code=status_of(error, path), headers=error_headers(error))


_WIRE_FIELDS = "tts.wire_fields"  # the scope key a router's field table is kept under for the request


def wire_fields_of(names: Mapping[str, str]) -> Any:
    """A router dependency: its routes' TTSErrors name fields as `names` says (domain field -> the routes' own, e.g.
    "text" -> "tts_text"); the error handler renames them, once, for every error the routes let through."""

    def declare(request: Request) -> None:
        request.scope[_WIRE_FIELDS] = names

    return Depends(declare)


async def _on_tts_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, TTSError)
    exc.param = wire_name(request.scope.get(_WIRE_FIELDS, {}), exc.param)
    if status_of(exc, request.url.path) >= 500:
        log.error("%s %s -> %s: %s", request.method, request.url.path, exc.code.value, exc.message)
    return error_response(request.url.path, exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(request.url.path, _json_error(first, exc.body))
    uploads = _upload_fields(request)
    param = field_of(first.get("loc", ())) or None
    detail = "; ".join(_describe(e, uploads) for e in errors[:5])
    return error_response(request.url.path, InvalidInputError(f"invalid request: {detail}", param=param))


_SOURCES = frozenset({"body", "query", "form", "path", "header", "cookie"})
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})


def field_of(loc: Sequence[object]) -> str:
    """The request field a pydantic error location names, in the client's terms: without where it was read from
    (body, query) and without the names pydantic gives union members it tried (`str`, `VoiceRef`)."""
    return ".".join(str(part) for part in loc if part not in _SOURCES and not _is_union_member(part))


def _is_union_member(part: object) -> bool:
    # our fields are snake_case identifiers; pydantic tags a union member by its type (`str`, `VoiceRef`, `list[int]`)
    return isinstance(part, str) and (part[:1].isupper() or not part.isidentifier() or part in _TYPE_NAMES)


def _describe(error: Mapping[str, Any], uploads: frozenset[str]) -> str:
    """`field: what is wrong`, with pydantic's wording where it is the client's, ours where it is pydantic's own."""
    field = field_of(error.get("loc", ())) or "the request body"
    kind, message = str(error.get("type", "")), str(error.get("msg", ""))
    if field in uploads and kind != "missing":
        return f"{field} must be a file upload (multipart/form-data, e.g. curl -F {field}=@voice.wav), not a text field"
    if field == "the request body" and kind == "missing":
        return "the request body is empty"
    if field == "the request body" and kind in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object"
    return f"{field}: {message.removeprefix('Value error, ')}"


def _upload_fields(request: Request) -> frozenset[str]:
    """The names of the route's file upload fields (UploadFile parameters)."""
    route = request.scope.get("route")
    params = route.dependant.body_params if isinstance(route, APIRoute) else []
    return frozenset(p.alias for p in params if p.field_info.annotation is UploadFile)


def _json_error(error: dict[str, Any], document: object) -> InvalidInputError:
    """The body is not valid JSON: say where (line and column, 1-based, as Python's json module counts)."""
    reason = str(error.get("ctx", {}).get("error", "invalid JSON"))
    loc = error.get("loc", ())
    pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    if pos is None or not isinstance(document, str):
        return InvalidInputError(f"invalid JSON: {reason}")
    line = document.count("\n", 0, pos) + 1
    column = pos - document.rfind("\n", 0, pos)
    return InvalidInputError(f"invalid JSON at line {line}, column {column}: {reason}")


async def _on_request_field_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestFieldError)
    return error_response(request.url.path, exc.error)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_STATUS_CODES.get(exc.status_code, ErrorCode.INVALID_INPUT)
    body = error_body(request.url.path, code, _http_message(request, exc))
    return JSONResponse(body, status_code=exc.status_code, headers=dict(exc.headers or {}))


def _http_message(request: Request, exc: StarletteHTTPException) -> str:
    """The framework's bare "Not Found" / "Method Not Allowed" said in terms of the request; other details as given."""
    if exc.detail != HTTPStatus(exc.status_code).phrase:
        return str(exc.detail)
    if exc.status_code == 404:
        return f"there is no {request.url.path} on this server (the API is described at /docs)"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
    return str(exc.detail)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # answered outside RequestIdMiddleware (Starlette's outermost layer sends it), so the id is added here
    rid = request_id_of(request.scope)
    log.exception("unhandled error on %s %s (request %s)", request.method, request.url.path, rid)
    body = error_body(request.url.path, ErrorCode.ENGINE_FAILURE, "internal error")
    return JSONResponse(body, status_code=500, headers={HEADER: rid} if rid else None)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise through the table above."""
    app.add_exception_handler(TTSError, _on_tts_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(RequestFieldError, _on_request_field_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
