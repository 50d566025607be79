"""ASGI middleware that reads a request body in full before the app sees it: 413 beyond its size limit, 408 when it
does not arrive within its time limit."""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import error_response
from service.errors import PayloadTooLargeError, RequestTimeoutError, TextTooLongError, TTSError


class BodyLimitMiddleware:
    """Reads the body up to its limit (by Content-Length when given, else by counting) and replays it.

    Text bodies (JSON, forms) have `max_bytes` and a larger one is answered with 413 `text_too_long`;
    multipart uploads (prompt recordings) have `upload_bytes` and get 413 `payload_too_large`. Either way
    the body is not read further, and what is held in memory is bounded by the limit. A body that has not arrived in
    full `timeout_s` seconds after the first read gets 408 `request_timeout` and the connection is closed, so a client
    that sends half a body holds a connection for that long at most (and never a place of capacity: places are taken
    after this middleware).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, upload_bytes: int | None = None, *, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.upload_bytes = upload_bytes if upload_bytes is not None else max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = _is_multipart(scope)
        limit = self.upload_bytes if upload else self.max_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, limit, upload)
            return
        messages: list[Message] | None = None
        with anyio.move_on_after(self.timeout_s) as reading:
            messages = await _read_body(receive, limit)
        if reading.cancelled_caught:
            await self._timed_out(scope, receive, send)
        elif messages is None:
            await self._refuse(scope, receive, send, limit, upload)
        else:
            await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int, upload: bool) -> None:
        error: TTSError
        if upload:
            error = PayloadTooLargeError(f"the upload is larger than {limit} bytes (TTS_MAX_UPLOAD_BYTES)", param="body")
        else:
            error = TextTooLongError(f"request body is larger than {limit} bytes", param="body")
        await error_response(scope["path"], error)(scope, receive, send)

    async def _timed_out(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = RequestTimeoutError(f"the request body did not arrive within {self.timeout_s:g} s (TTS_BODY_TIMEOUT_S)")
        response = error_response(scope["path"], error)
        response.headers["connection"] = "close"  # what is left of the body is never read: the connection is done
        await response(scope, receive, send)


async def _read_body(receive: Receive, limit: int) -> list[Message] | None:
    """The body's messages up to its end (or a disconnect); None as soon as more than `limit` bytes came."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            return messages


def _is_multipart(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"content-type":
            return bool(value.split(b";", 1)[0].strip().lower() == b"multipart/form-data")
    return False


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive() that first returns the buffered messages, then defers to the server (disconnects)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


class MultipartTTSMiddleware:
    """`POST /tts` with a multipart body (a one-off prompt recording) is served by `POST /tts/prompt`: one URL
    for clients, two handlers (JSON and form) for the server. Runs before admission, which matches routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/tts" and scope["method"] == "POST" and _is_multipart(scope):
            scope = dict(scope, path="/tts/prompt", raw_path=b"/tts/prompt")
        await self.app(scope, receive, send)
