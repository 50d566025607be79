"""Audio cache (protocol, in-process LRU, fail-soft Redis, cache key) and the Redis pronunciation lexicon store."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from service.errors import StoreUnavailableError

log = logging.getLogger(__name__)

KEY_SCHEMA_VERSION = 2  # 2: entries start with the audio's length (service.tts.pack_cached); whole FLACs state theirs
DEFAULT_REDIS_PREFIX = "tts:audio:"
REDIS_SOCKET_TIMEOUT_S = 0.25
# After a Redis failure, requests skip Redis for this long instead of each paying a connect timeout.
REDIS_RETRY_AFTER_S = 1.0


@dataclass
class CacheStats:
    """Counters of one cache (thread-safe). `errors` counts backend failures, each also reported as a miss."""

    hits: int = 0
    misses: int = 0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, *, hit: bool = False, miss: bool = False, error: bool = False) -> None:
        with self._lock:
            self.hits += int(hit)
            self.misses += int(miss)
            self.errors += int(error)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy: {"hits", "misses", "errors"}."""
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "errors": self.errors}


@runtime_checkable
class AudioCache(Protocol):
    """Stores complete encoded responses by key. Implementations never raise from get/put/ping."""

    backend: str
    stats: CacheStats

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss (a backend error is a miss)."""
        ...

    def put(self, key: str, value: bytes) -> None:
        """Store a complete response; a backend error is logged and counted, never raised."""
        ...

    def ping(self) -> bool:
        """True when the backend answers now."""
        ...

    def close(self) -> None:
        """Release connections; the cache must not be used afterwards."""
        ...


class MemoryAudioCache:
    """Thread-safe in-process LRU bounded by the total size of the stored values in bytes."""

    backend = "memory"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        """Total bytes currently stored."""
        with self._lock:
            return self._size

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
        self.stats.count(hit=value is not None, miss=value is None)
        return value

    def put(self, key: str, value: bytes) -> None:
        value = bytes(value)
        if len(value) > self.max_bytes:
            return  # larger than the whole cache: storing it would only evict everything else
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= len(old)
            self._items[key] = value
            self._size += len(value)
            while self._size > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._size -= len(evicted)

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0


class RedisAudioCache:
    """Redis-backed cache shared by replicas. Redis errors are logged and counted and read as misses;
    after a failure Redis is skipped for REDIS_RETRY_AFTER_S, then tried again (so it recovers by itself)."""

    backend = "redis"

    def __init__(
        self, url: str, ttl_s: int, prefix: str = DEFAULT_REDIS_PREFIX, *, timeout_s: float = REDIS_SOCKET_TIMEOUT_S
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.prefix = prefix
        self.stats = CacheStats()
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._down_until = 0.0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        value: bytes | None = None
        if self._available():
            try:
                raw = self._client.get(self.prefix + key)
                value = raw if isinstance(raw, bytes) else None
                self._mark_up()
            except redis.RedisError as e:
                self._mark_down("get", e)
        self.stats.count(hit=value is not None, miss=value is None)
        return value

    def put(self, key: str, value: bytes) -> None:
        if not self._available():
            return
        try:
            self._client.set(self.prefix + key, bytes(value), ex=self.ttl_s)
            self._mark_up()
        except redis.RedisError as e:
            self._mark_down("put", e)

    def ping(self) -> bool:
        """Always asks Redis (ignores the back-off), so readiness reflects the present state."""
        try:
            ok = bool(self._client.ping())
        except redis.RedisError as e:
            self._mark_down("ping", e, count=False)
            return False
        self._mark_up()
        return ok

    def close(self) -> None:
        self._client.close()

    def _available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _mark_down(self, op: str, error: Exception, *, count: bool = True) -> None:
        with self._lock:
            was_up = self._down_until == 0.0
            self._down_until = time.monotonic() + REDIS_RETRY_AFTER_S
        if count:
            self.stats.count(error=True)
        if was_up:
            log.warning("audio cache: Redis %s failed (%s: %s); serving without the cache", op, type(error).__name__, error)

    def _mark_up(self) -> None:
        with self._lock:
            was_down = self._down_until != 0.0
            self._down_until = 0.0
        if was_down:
            log.info("audio cache: Redis is reachable again")


def build_audio_cache(redis_url: str | None, max_bytes: int, ttl_s: int) -> AudioCache:
    """Redis cache when `redis_url` is set (shared by replicas), else an in-process LRU of `max_bytes`."""
    if redis_url:
        return RedisAudioCache(redis_url, ttl_s)
    return MemoryAudioCache(max_bytes)


def audio_cache_key(
    *,
    bundle_sha256: str,
    text: str,
    speaker: str,
    speed: float,
    fmt: str,
    sample_rate: int,
    seed: int | None,
    lexicon_version: str = "",
) -> str:
    """Hex sha256 over a canonical JSON of everything that changes the response bytes.

    `text` should be the normalized text actually synthesized; `fmt` the output encoding (e.g. "wav");
    `sample_rate` the output rate in Hz; `seed` None means "unseeded" and is distinct from any integer.
    """
    fields = {
        "v": KEY_SCHEMA_VERSION,
        "bundle": bundle_sha256,
        "text": text,
        "speaker": speaker,
        "speed": float(speed),
        "format": fmt,
        "sample_rate": int(sample_rate),
        "seed": None if seed is None else int(seed),
        "lexicon": lexicon_version,
    }
    canonical = json.dumps(fields, sort_keys=True, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


DEFAULT_LEXICON_PREFIX = "tts:lexicon:"
LEXICON_WRITE_RETRY_AFTER_S = 5  # Retry-After of a lexicon write refused because Redis is down
LEXICON_UNREAD_VERSION = "redis:unread"  # version while Redis has never been read (only the defaults apply)

# Writes run as scripts so the entry, the epoch and the counter change together (KEYS: entries, version, epoch).
_PUT_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[3], 'NX')
return redis.call('INCR', KEYS[2])
"""
_DELETE_SCRIPT = """
local removed = redis.call('HDEL', KEYS[1], ARGV[1])
if removed > 0 then
  redis.call('SET', KEYS[3], ARGV[2], 'NX')
  redis.call('INCR', KEYS[2])
end
return removed
"""


class _RedisHealth:
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


class RedisLexiconStore:
    """LexiconStore shared by replicas: a Redis hash word -> pinyin plus a version counter INCRemented by every
    write, so each replica sees a change on its next request. An epoch token, set by the first write, is part of
    the version, so a flushed or restarted Redis never hands out an old version number for different entries.

    Reads never raise while Redis is unreachable: `version()` and `get_all()` serve the last entries read (none
    before the first read: then only the built-in defaults apply). `get_all()` raises StoreUnavailableError only
    when Redis fails between the two calls, so the caller keeps its own last snapshot. Writes raise
    StoreUnavailableError (HTTP 503 with Retry-After) when Redis does not take them.
    """

    def __init__(self, url: str, prefix: str = DEFAULT_LEXICON_PREFIX, *, timeout_s: float = REDIS_SOCKET_TIMEOUT_S) -> None:
        self._client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        self._keys = [prefix + "entries", prefix + "version", prefix + "epoch"]
        self._put = self._client.register_script(_PUT_SCRIPT)
        self._delete = self._client.register_script(_DELETE_SCRIPT)
        self._health = _RedisHealth("lexicon store")
        self._lock = threading.Lock()
        self._last: tuple[str, dict[str, str]] | None = None

    def version(self) -> str:
        """`redis:<epoch>:<counter>` read from Redis; the last one read while Redis is unreachable."""
        if self._health.available():
            try:
                epoch, counter = self._client.mget(self._keys[2], self._keys[1])
            except redis.RedisError as e:
                self._health.down("version read", e)
            else:
                self._health.up()
                return _lexicon_version(epoch, counter)
        return self._fallback()[0]

    def get_all(self) -> dict[str, str]:
        """Every stored entry, read together with its version (kept as the fallback for outages)."""
        if not self._health.available():
            return dict(self._fallback()[1])
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.mget(self._keys[2], self._keys[1])
                pipe.hgetall(self._keys[0])
                (epoch, counter), entries = pipe.execute()
        except redis.RedisError as e:
            self._health.down("read", e)
            raise StoreUnavailableError("the lexicon store (Redis) cannot be read now") from e
        self._health.up()
        with self._lock:
            self._last = (_lexicon_version(epoch, counter), dict(entries))
        return dict(entries)

    def put(self, word: str, pinyin: str) -> None:
        """Insert or replace one entry and bump the version; StoreUnavailableError when Redis is down."""
        self._write("write", self._put, [word, pinyin, secrets.token_hex(6)])

    def delete(self, word: str) -> bool:
        """Remove one entry (True if it existed; the version moves only then); StoreUnavailableError when Redis is down."""
        return bool(self._write("delete", self._delete, [word, secrets.token_hex(6)]))

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._client.close()

    def _write(self, op: str, script: Script, args: list[str]) -> object:
        # Writes always try Redis (ignoring the read back-off), so an operator's retry works as soon as it is back.
        try:
            result = script(keys=self._keys, args=args)
        except redis.RedisError as e:
            self._health.down(op, e)
            raise StoreUnavailableError(
                f"the lexicon store (Redis) is unavailable; the {op} was not applied", retry_after_s=LEXICON_WRITE_RETRY_AFTER_S
            ) from e
        self._health.up()
        return result

    def _fallback(self) -> tuple[str, dict[str, str]]:
        with self._lock:
            return self._last if self._last is not None else (LEXICON_UNREAD_VERSION, {})


def _lexicon_version(epoch: object, counter: object) -> str:
    """Values come decoded (str) or None for keys never written."""
    return f"redis:{epoch or '-'}:{counter or 0}"
