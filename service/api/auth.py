"""Optional API keys: Bearer on /v1/*, Bearer or X-API-Key elsewhere; 401 without a valid one."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request

from service.api.errors import OPENAI_PREFIX
from service.api.ratelimit import presented_key
from service.errors import UnauthorizedError


class ApiKeys:
    """The configured keys (kept only as sha256 digests); an empty set turns authentication off."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, request: Request) -> None:
        """Raise UnauthorizedError unless the request carries a configured key in an accepted header."""
        if not self.enabled:
            return
        if request.url.path.startswith(OPENAI_PREFIX):
            key = _bearer(request)
            where = "an `Authorization: Bearer <key>` header"
        else:
            key = presented_key(request)
            where = "an `Authorization: Bearer <key>` or `X-API-Key: <key>` header"
        if not key:
            raise UnauthorizedError(f"an API key is required: send {where}")
        digest = _digest(key)
        # compare against every key so the time taken does not reveal which one matched
        matches = [hmac.compare_digest(digest, d) for d in self._digests]
        if not any(matches):
            raise UnauthorizedError("the API key is not valid")


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
