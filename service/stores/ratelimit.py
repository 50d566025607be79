"""Rate limiting by plain identity strings: one fixed window per caller, in memory or in Redis shared by replicas."""

from __future__ import annotations

import logging
import math
import threading
import time

from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage, Storage, storage_from_string
from limits.strategies import FixedWindowRateLimiter

from service.errors import RateLimitedError

log = logging.getLogger(__name__)

KEY_PREFIX = "tts:ratelimit"
SCOPE = "synthesis"
_STORAGE_TIMEOUT_S = 0.25
_RETRY_REMOTE_AFTER_S = 5.0  # after a Redis failure, count in memory this long before trying Redis again


class RateLimiter:
    """`per_minute` synthesis requests per identity and minute; 0 turns it off.

    With a Redis URL the counters are shared by every replica (keys under `tts:ratelimit`). When Redis
    fails, this process counts in memory for a few seconds instead of failing requests, then tries again.
    Transport-neutral: HTTP, gRPC and WebSocket callers are all just identity strings here.
    """

    def __init__(self, per_minute: int, storage_uri: str | None = None) -> None:
        self.per_minute = per_minute
        self.enabled = per_minute > 0
        self.remote = storage_uri is not None  # a hit may wait on the network: call it off the event loop
        self._item = RateLimitItemPerMinute(max(per_minute, 1), namespace=KEY_PREFIX)
        self._memory = FixedWindowRateLimiter(MemoryStorage())
        self._primary = FixedWindowRateLimiter(_storage(storage_uri)) if storage_uri else self._memory
        self._remote_down_until = 0.0
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        return f"{self.per_minute}/minute"

    def hit(self, identity: str) -> None:
        """Count one request of `identity`; RateLimitedError (with Retry-After seconds) when over the limit."""
        if not self.enabled:
            return
        limiter = self._limiter()
        try:
            allowed = limiter.hit(self._item, SCOPE, identity)
        except Exception:  # Redis unreachable or failing: never fail a request for it
            self._remote_failed()
            limiter = self._memory
            allowed = limiter.hit(self._item, SCOPE, identity)
        if not allowed:
            raise RateLimitedError(
                f"rate limit of {self.description} exceeded; retry later", retry_after_s=self._retry_after(limiter, identity)
            )

    def _limiter(self) -> FixedWindowRateLimiter:
        with self._lock:
            return self._memory if time.monotonic() < self._remote_down_until else self._primary

    def _remote_failed(self) -> None:
        log.warning("rate-limit storage unavailable; counting in this process for %.0f s", _RETRY_REMOTE_AFTER_S, exc_info=True)
        with self._lock:
            self._remote_down_until = time.monotonic() + _RETRY_REMOTE_AFTER_S

    def _retry_after(self, limiter: FixedWindowRateLimiter, identity: str) -> int:
        """Seconds until the window that refused this request resets (at least 1)."""
        try:
            reset_at = limiter.get_window_stats(self._item, SCOPE, identity).reset_time
        except Exception:  # storage went away between the hit and this read: any positive value is honest
            return 1
        return max(1, math.ceil(reset_at - time.time()))


def _storage(uri: str) -> Storage:
    options: dict[str, float] = {}
    if uri.startswith(("redis://", "rediss://")):
        options = {"socket_timeout": _STORAGE_TIMEOUT_S, "socket_connect_timeout": _STORAGE_TIMEOUT_S}
    storage = storage_from_string(uri, **options)
    if not isinstance(storage, Storage):  # an async storage scheme (async+redis://) has no place here
        raise ValueError(f"rate-limit storage {uri.split(':', 1)[0]!r} is not a synchronous storage")
    return storage
