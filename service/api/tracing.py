"""`x-request-id` on every HTTP answer and WebSocket handshake: the client's when it is sane, else a fresh one, kept in
the scope for error handlers and bound for the request's log lines (uvicorn's access line included)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.requestids import HEADER, request_id, serving

_HEADER = HEADER.encode("latin-1")
_STATE_KEY = "request_id"


def request_id_of(scope: Scope) -> str | None:
    """The id RequestIdMiddleware gave this request (None outside it)."""
    value = scope.get("state", {}).get(_STATE_KEY)
    return value if isinstance(value, str) else None


class RequestIdMiddleware:
    """Outermost of our middlewares, so that refusals (401/413/429/503) and streams carry the header too. A 500 from
    an unhandled error is answered outside it; its handler adds the header from the scope."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        presented = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == _HEADER), None)
        rid = request_id(presented)
        scope.setdefault("state", {})[_STATE_KEY] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, rid.encode("latin-1"))]}
            await send(message)

        with serving(rid):
            await self.app(scope, receive, send_with_id)
