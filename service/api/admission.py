"""Admission at the door: synthesis requests refused with 401/429/503 from their headers alone, before the body is read."""

from __future__ import annotations

from collections.abc import Iterable

import anyio
from fastapi.routing import APIRoute, APIRouter
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.deps import AppState, enforce_rate_limit, get_service
from service.api.errors import error_response
from service.errors import TTSError


def synthesis_routes(*routers: APIRouter) -> list[APIRoute]:
    """The routes of `routers` that carry the synthesis guards (API key and rate limit)."""
    routes = [r for router in routers for r in router.routes if isinstance(r, APIRoute)]
    return [r for r in routes if any(d.dependency is enforce_rate_limit for d in r.dependencies)]


class AdmissionMiddleware:
    """Pure ASGI middleware that answers an unwanted synthesis request at once, without a thread switch.

    In the order the routes would: API key (401), rate limit (429 + Retry-After), model loading or
    shutting down (503), then capacity (503 + Retry-After): refused while the service's queue is full or
    while `concurrent_requests + queue_max` synthesis requests are already in progress here (counted from arrival,
    so a burst is refused before any of it reaches body parsing, the text frontend or the queue).
    The bodies are the ones the error table gives. A request let through meets every check of its route
    again (validation, text, speaker, queue), and is charged to the rate limit only once.
    """

    def __init__(self, app: ASGIApp, state: AppState, routes: Iterable[APIRoute]) -> None:
        self.app = app
        self.state = state
        self.routes = tuple(routes)
        self.in_flight = 0  # guarded requests let through and not finished; touched only on the event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._guarded(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        error = await self._refusal(request)
        if error is not None:
            scope["route"] = route  # request metrics label the refusal with its route, as the router would
            await error_response(request.url.path, error)(scope, receive, send)
            return
        self.in_flight += 1  # no await since the capacity check: nothing else ran in between
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _guarded(self, scope: Scope) -> APIRoute | None:
        for route in self.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route
        return None

    async def _refusal(self, request: Request) -> TTSError | None:
        """The error this request gets now, or None to let it through."""
        state = self.state
        try:
            state.keys.check(request)
            if state.rate_limit.remote:
                await anyio.to_thread.run_sync(state.rate_limit.check, request)
            else:
                state.rate_limit.check(request)  # in-memory counters: microseconds, fine on the loop
            service = get_service(state)
        except TTSError as e:
            return e
        if self.in_flight >= service.capacity or service.queue_full():
            return service.overloaded()
        return None
