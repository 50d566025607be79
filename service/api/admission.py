"""Admission of synthesis requests in two steps: refusals that need only the headers (401/429/503) before the body is
read, and the in-flight place taken once the body has arrived."""

from __future__ import annotations

from collections.abc import Iterable

import anyio
from fastapi.routing import APIRoute, APIRouter
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from service.access import Caller
from service.api.auth import caller_of, mark_admitted
from service.api.deps import AppState, enforce_rate_limit
from service.api.errors import error_response
from service.errors import TTSError
from service.runtime import Runtime

_ADMITTED_ROUTE = "tts_admitted_route"  # scope state: the synthesis route AdmissionMiddleware let through


def synthesis_routes(*routers: APIRouter) -> list[APIRoute]:
    """The routes of `routers` that carry the synthesis guards (API key and rate limit)."""
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    return [r for r in routes if any(d.dependency is enforce_rate_limit for d in r.dependencies)]


class AdmissionMiddleware:
    """Pure ASGI middleware that answers an unwanted synthesis request at once, without a thread switch.

    In the order the routes would: API key (401), rate limit (429 + Retry-After), model loading or
    shutting down (503), then capacity (503 + Retry-After): refused while the service's queue is full or
    while `concurrent_requests + queue_max` synthesis requests are already in progress in this runtime, over any
    transport, so a burst is refused before any of it is read, reaches the text frontend or the queue.
    Nothing is taken here: `SlotMiddleware`, inside the body limit, takes the place once the body is in.
    The bodies are the ones the error table gives. A request let through meets every check of its route
    again (validation, text, speaker, queue), and is charged to the rate limit only once.
    """

    def __init__(self, app: ASGIApp, state: AppState, routes: Iterable[APIRoute]) -> None:
        self.app = app
        self.state = state
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._guarded(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        try:
            await self._admit(request)
        except TTSError as error:
            await refuse(scope, receive, send, route, error)
            return
        mark_admitted(scope)  # the route's rate-limit dependency must not count it again
        scope["state"][_ADMITTED_ROUTE] = route  # SlotMiddleware takes its place once the body is in
        await self.app(scope, receive, send)

    def _guarded(self, scope: Scope) -> APIRoute | None:
        for route in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route
        return None

    async def _admit(self, request: Request) -> None:
        """The runtime's admission (key, rate limit, readiness, room); raises the TTSError the request gets."""
        runtime = self.state.runtime
        await check_gate(runtime, caller_of(request))
        runtime.check_room()


class SlotMiddleware:
    """Takes an in-flight place (`Runtime.claim`) for an admitted synthesis request once its body has arrived (this
    runs inside the body limit, which reads the body in full first) and holds it until the response ends; 503 +
    Retry-After when the room went meanwhile. A client that is still sending its body holds no place."""

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope.get("state", {}).get(_ADMITTED_ROUTE) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            slot = self.state.runtime.claim()
        except TTSError as error:
            await refuse(scope, receive, send, route, error)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            slot.release()


async def refuse(scope: Scope, receive: Receive, send: Send, route: APIRoute, error: TTSError) -> None:
    """Answer a refused synthesis request with the error table's body, labelled with its route in the request metrics
    as the router would label it."""
    scope["route"] = route
    await error_response(scope["path"], error)(scope, receive, send)


async def check_gate(runtime: Runtime, caller: Caller) -> None:
    """The runtime's key and rate-limit check (401, 429) for any transport on the event loop: in a worker thread
    when the counters live in Redis (a network round trip), inline when they are in memory (microseconds)."""
    if runtime.rate_limit.remote:
        await anyio.to_thread.run_sync(runtime.gate.check, caller)
    else:
        runtime.gate.check(caller)
