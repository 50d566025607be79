"""API keys over HTTP: Bearer on /v1/*, Bearer or X-API-Key elsewhere; what a request presents, as a plain Caller."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import Scope

from service.access import Caller
from service.api.errors import OPENAI_PREFIX

_ADMITTED = "tts_admitted"  # scope state flag: the admission middleware counted this request already
_BEARER_HINT = "an `Authorization: Bearer <key>` header"
_ANY_HINT = "an `Authorization: Bearer <key>` or `X-API-Key: <key>` header"


def caller_of(request: Request) -> Caller:
    """The key this route accepts (Bearer on /v1/*, Bearer or X-API-Key elsewhere), the peer and X-Forwarded-For."""
    openai = request.url.path.startswith(OPENAI_PREFIX)
    key = bearer(request) if openai else bearer(request) or request.headers.get("x-api-key") or None
    peer = request.client.host if request.client else "unknown"
    hint = _BEARER_HINT if openai else _ANY_HINT
    return Caller(key=key, peer=peer, forwarded_for=request.headers.get("x-forwarded-for", ""), key_hint=hint)


def bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def mark_admitted(scope: Scope) -> None:
    scope.setdefault("state", {})[_ADMITTED] = True


def was_admitted(request: Request) -> bool:
    return bool(request.scope.get("state", {}).get(_ADMITTED))
