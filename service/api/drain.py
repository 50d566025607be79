"""The shutdown drain: one deadline, TTS_DRAIN_TIMEOUT_S after it begins (SIGTERM), shared by every transport, and the
HTTP middleware that answers a request still running at that deadline with 503 `shutting_down`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from service.api.errors import error_response
from service.errors import ShuttingDownError


class Drain:
    """When the app stops, and by when what runs must be over.

    `begin()` is called on the event loop by `service.api.serving.DrainingServer` as soon as uvicorn handles SIGTERM
    (the lifespan's end calls it too, for servers that do not). From then on: the listeners registered with
    `on_begin` run (gRPC stops taking calls), `wait()` returns and every scope of `until_begun()` is cancelled
    (WebSocket sessions stop reading, finish the sentence they speak and close with 1001), and every scope of
    `until_deadline()` is cancelled at `deadline`, on anyio's clock.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.deadline: float | None = None  # anyio.current_time() at which what still runs is ended; None: not begun
        self._begun = anyio.Event()
        self._scopes: set[anyio.CancelScope] = set()  # until_deadline()'s
        self._waiting: set[anyio.CancelScope] = set()  # until_begun()'s
        self._listeners: list[Callable[[float], object]] = []

    @property
    def begun(self) -> bool:
        return self.deadline is not None

    def on_begin(self, listener: Callable[[float], object]) -> None:
        """Call `listener(timeout_s)` when the drain begins (at once when it has); it must not block."""
        self._listeners.append(listener)
        if self.begun:
            listener(self.timeout_s)

    def begin(self) -> float:
        """Start draining (the first call; later ones change nothing) and return the deadline."""
        if self.deadline is None:
            self.deadline = anyio.current_time() + self.timeout_s
            for scope in self._scopes:
                scope.deadline = self.deadline
            for scope in self._waiting:
                scope.cancel()
            self._begun.set()
            for listener in self._listeners:
                listener(self.timeout_s)
        return self.deadline

    async def wait(self) -> float:
        """Return the deadline once the drain has begun."""
        await self._begun.wait()
        assert self.deadline is not None  # set before the event
        return self.deadline

    @contextmanager
    def until_begun(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that is cancelled when the drain begins (at once when it has)."""
        scope = anyio.CancelScope()
        if self.begun:
            scope.cancel()
        self._waiting.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._waiting.discard(scope)

    @contextmanager
    def until_deadline(self) -> Iterator[anyio.CancelScope]:
        """A cancel scope that is cancelled at the drain's deadline (never, unless the drain begins)."""
        scope = anyio.CancelScope(deadline=self.deadline if self.deadline is not None else math.inf)
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)


async def receive_unless_draining(ws: WebSocket, drain: Drain, timeout_s: float) -> Message | None:
    """A WebSocket session's next message; None once the drain has begun (the session then ends itself, see
    `Drain`), TimeoutError when none came within `timeout_s` seconds, WebSocketDisconnect when the client left."""
    with drain.until_begun() as draining, anyio.move_on_after(timeout_s):
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        return message
    if draining.cancelled_caught:
        return None
    raise TimeoutError(f"no message within {timeout_s:g} s")


class DrainMiddleware:
    """Ends each HTTP request still running at the drain's deadline: one whose response has not started (a whole file
    still being made, a body still arriving) gets 503 `shutting_down` with Retry-After, one whose response has started
    (a stream) is cut off without its last chunk, as a failed stream is. Without this uvicorn cancels them itself at its
    graceful-shutdown timeout, and a cancelled request it has not answered gets a plain-text 500."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        with self.drain.until_deadline() as running:
            await self.app(scope, receive, watched)
        if running.cancelled_caught and not started:
            limit = f"TTS_DRAIN_TIMEOUT_S={self.drain.timeout_s:g}"
            error = ShuttingDownError(f"the server is shutting down and the answer was not ready within {limit} s")
            await error_response(scope["path"], error)(scope, receive, send)
