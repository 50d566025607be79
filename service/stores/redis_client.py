"""The one way stores open Redis: a client that fails fast, and the up/down state of a store that reads through it."""

from __future__ import annotations

import logging
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 0.25
# After a Redis failure, requests skip Redis for this long instead of each paying a connect timeout.
REDIS_RETRY_AFTER_S = 1.0


def redis_client(url: str, timeout_s: float = REDIS_SOCKET_TIMEOUT_S, *, decode_responses: bool = False) -> redis.Redis:
    """A client for `url` that gives up after `timeout_s` (connect and each call) and never retries: every store
    degrades (a miss, the last snapshot) or refuses (503) at once instead of holding a request on a dead Redis."""
    return redis.Redis.from_url(
        url,
        decode_responses=decode_responses,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
    )


class RedisHealth:
    """Up/down state of one Redis client: after a failure, reads skip Redis for REDIS_RETRY_AFTER_S."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._down_until = 0.0
        self._lock = threading.Lock()

    def available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def down(self, op: str, error: Exception) -> None:
        with self._lock:
            was_up = self._down_until == 0.0
            self._down_until = time.monotonic() + REDIS_RETRY_AFTER_S
        if was_up:
            log.warning("%s: Redis %s failed (%s: %s)", self._what, op, type(error).__name__, error)

    def up(self) -> None:
        with self._lock:
            was_down = self._down_until != 0.0
            self._down_until = 0.0
        if was_down:
            log.info("%s: Redis is reachable again", self._what)
