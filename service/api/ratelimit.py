"""Rate limiting with slowapi: one bucket per API key (else client IP) shared by all synthesis routes."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import time
from collections.abc import Callable, Sequence

from slowapi import Limiter
from slowapi.errors import RateLimitExceeded
from starlette.requests import Request

from service.errors import RateLimitedError

log = logging.getLogger(__name__)

KEY_PREFIX = "tts:ratelimit"
SCOPE = "synthesis"
_STORAGE_TIMEOUT_S = 0.25
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class ClientIdentity:
    """Who a request counts against: its API key (hashed) when keys are on, else the client address.

    X-Forwarded-For is believed only when the direct peer is a configured trusted proxy; the client is
    then the right-most address in the header that is not itself a trusted proxy.
    """

    def __init__(self, trusted_proxies: Sequence[str], keys_enabled: bool) -> None:
        self.trusted: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(p, strict=False) for p in trusted_proxies)
        self.keys_enabled = keys_enabled

    def __call__(self, request: Request) -> str:
        if self.keys_enabled:
            key = presented_key(request)
            if key:
                return "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]
        return "ip:" + self.client_ip(request)

    def client_ip(self, request: Request) -> str:
        peer = request.client.host if request.client else "unknown"
        if not self._is_trusted(peer):
            return peer
        hops = [h.strip() for h in request.headers.get("x-forwarded-for", "").split(",") if h.strip()]
        for hop in reversed(hops):
            if not self._is_trusted(hop):
                return hop
        return hops[0] if hops else peer

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)


def presented_key(request: Request) -> str | None:
    """The API key a request carries: `Authorization: Bearer …` or `X-API-Key: …`."""
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


class RateLimit:
    """A slowapi Limiter (memory storage, or Redis shared by replicas) with one bucket per client for all synthesis.

    The admission middleware calls `check` before the body is read: on the event loop with memory storage,
    in a worker thread with Redis (`remote`), so a slow Redis never blocks the loop. slowapi marks a request
    it has counted, so the route's dependency calling `check` again does not count it twice. If Redis fails,
    slowapi falls back to in-memory counting instead of failing requests.
    """

    def __init__(self, per_minute: int, identity: ClientIdentity, storage_uri: str | None) -> None:
        self.enabled = per_minute > 0
        self.remote = storage_uri is not None  # counters live in Redis: a check may wait on the network
        self.limit = f"{per_minute}/minute"
        self.limiter = Limiter(
            key_func=identity,
            storage_uri=storage_uri or "memory://",
            storage_options=_storage_options(storage_uri),  # type: ignore[arg-type]  # slowapi annotates str values; redis wants floats
            in_memory_fallback_enabled=True,
            key_prefix=KEY_PREFIX,
            enabled=self.enabled,
            headers_enabled=False,
        )
        self.check = self._build_check()

    def _build_check(self) -> Callable[[Request], None]:
        @self.limiter.shared_limit(self.limit, scope=SCOPE)
        def synthesis_rate_limit(request: Request) -> None:
            return None

        def check(request: Request) -> None:
            try:
                synthesis_rate_limit(request=request)
            except RateLimitExceeded as e:
                raise RateLimitedError(
                    f"rate limit of {self.limit} exceeded; retry later", retry_after_s=self._retry_after(request)
                ) from e

        return check

    def _retry_after(self, request: Request) -> int:
        """Seconds until the window that refused this request resets (at least 1)."""
        current = getattr(request.state, "view_rate_limit", None)
        if current is None:
            return 1
        try:
            reset_at, _remaining = self.limiter.limiter.get_window_stats(current[0], *current[1])
        except Exception:  # storage went away between the hit and this read: any positive value is honest
            log.warning("rate-limit storage unavailable while computing Retry-After", exc_info=True)
            return 1
        return max(1, math.ceil(reset_at - time.time()))


def _storage_options(storage_uri: str | None) -> dict[str, float]:
    if storage_uri and storage_uri.startswith(("redis://", "rediss://")):
        return {"socket_timeout": _STORAGE_TIMEOUT_S, "socket_connect_timeout": _STORAGE_TIMEOUT_S}
    return {}
