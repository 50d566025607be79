"""Optional API keys: Bearer on /v1/*, Bearer or X-API-Key elsewhere; 401 without a valid one, 403 for admin-only work."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.requests import Request

from service.api.errors import OPENAI_PREFIX
from service.api.ratelimit import presented_key
from service.errors import ForbiddenError, UnauthorizedError


class ApiKeys:
    """The configured keys (kept only as sha256 digests); no user keys turns authentication off.

    Admin keys are accepted wherever a key is, and are the only keys `check_admin` accepts; admin checks
    apply as soon as either list is non-empty.
    """

    def __init__(self, keys: Sequence[str], admin_keys: Sequence[str] = ()) -> None:
        self._users = tuple(_digest(k) for k in keys)
        self._admins = tuple(_digest(k) for k in admin_keys)
        self._digests = self._users + self._admins

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def check(self, request: Request, *, anonymous_ok: bool = False) -> None:
        """Raise UnauthorizedError unless the request carries a configured key in an accepted header.

        `anonymous_ok`: a request without any key passes (public listings); a key that is sent must still be valid.
        """
        if not self.enabled or (anonymous_ok and not self._sent_key(request)):
            return
        if not _matches(self._presented(request), self._digests):
            raise UnauthorizedError("the API key is not valid")

    def check_admin(self, request: Request) -> None:
        """Raise UnauthorizedError without a known key, ForbiddenError for a valid non-admin key (no-op with no keys)."""
        if not self._digests:
            return
        digest = self._presented(request)
        if _matches(digest, self._admins):
            return
        if _matches(digest, self._users):
            raise ForbiddenError("this operation needs an admin API key (TTS_ADMIN_API_KEYS)")
        raise UnauthorizedError("the API key is not valid")

    @staticmethod
    def _sent_key(request: Request) -> str | None:
        """The key in the header this route accepts (Bearer on /v1/*, Bearer or X-API-Key elsewhere), if any."""
        return _bearer(request) if request.url.path.startswith(OPENAI_PREFIX) else presented_key(request)

    @classmethod
    def _presented(cls, request: Request) -> bytes:
        """sha256 of the key in the accepted header; UnauthorizedError when there is none."""
        key = cls._sent_key(request)
        if request.url.path.startswith(OPENAI_PREFIX):
            where = "an `Authorization: Bearer <key>` header"
        else:
            where = "an `Authorization: Bearer <key>` or `X-API-Key: <key>` header"
        if not key:
            raise UnauthorizedError(f"an API key is required: send {where}")
        return _digest(key)


def _matches(digest: bytes, digests: tuple[bytes, ...]) -> bool:
    # compare against every key so the time taken does not reveal which one matched
    return any([hmac.compare_digest(digest, d) for d in digests])


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
