"""Admission at the door: synthesis requests refused with 401/429/503 from their headers alone, before the body is read."""

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
from service.runtime import Runtime, Slot


def synthesis_routes(*routers: APIRouter) -> list[APIRoute]:
    """The routes of `routers` that carry the synthesis guards (API key and rate limit)."""
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    return [r for r in routes if any(d.dependency is enforce_rate_limit for d in r.dependencies)]


class AdmissionMiddleware:
    """Pure ASGI middleware that answers an unwanted synthesis request at once, without a thread switch.

    In the order the routes would: API key (401), rate limit (429 + Retry-After), model loading or
    shutting down (503), then capacity (503 + Retry-After): refused while the service's queue is full or
    while `concurrent_requests + queue_max` synthesis requests are already in progress in this runtime, over any
    transport (counted from arrival, so a burst is refused before any of it reaches body parsing, the text
    frontend or the queue).
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
            slot = await self._admit(request)
        except TTSError as error:
            scope["route"] = route  # request metrics label the refusal with its route, as the router would
            await error_response(request.url.path, error)(scope, receive, send)
            return
        mark_admitted(scope)  # the route's rate-limit dependency must not count it again
        try:
            await self.app(scope, receive, send)
        finally:
            slot.release()

    def _guarded(self, scope: Scope) -> APIRoute | None:
        for route in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route
        return None

    async def _admit(self, request: Request) -> Slot:
        """The runtime's admission (key, rate limit, readiness, room); raises the TTSError the request gets."""
        runtime = self.state.runtime
        await check_gate(runtime, caller_of(request))
        return runtime.claim()  # no await since here: nothing else ran in between


async def check_gate(runtime: Runtime, caller: Caller) -> None:
    """The runtime's key and rate-limit check (401, 429) for any transport on the event loop: in a worker thread
    when the counters live in Redis (a network round trip), inline when they are in memory (microseconds)."""
    if runtime.rate_limit.remote:
        await anyio.to_thread.run_sync(runtime.gate.check, caller)
    else:
        runtime.gate.check(caller)
