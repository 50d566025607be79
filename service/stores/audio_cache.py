"""Audio cache: the protocol, an in-process LRU, fail-soft Redis, the cache key and the layout of an entry."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import redis

from service.stores.redis_client import REDIS_RETRY_AFTER_S, REDIS_SOCKET_TIMEOUT_S, redis_client

log = logging.getLogger(__name__)

KEY_SCHEMA_VERSION = 2  # 2: entries start with the audio's length (pack_cached); whole FLACs state theirs
DEFAULT_REDIS_PREFIX = "tts:audio:"


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
        self._client = redis_client(url, timeout_s)
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


_CACHED = struct.Struct("<4sd")  # an audio cache entry starts with b"TTS1" and the audio's length in seconds
_CACHED_MAGIC = b"TTS1"


def pack_cached(audio_s: float, data: bytes) -> bytes:
    """An audio cache entry: the response bytes after a small header holding the audio's length in seconds."""
    return _CACHED.pack(_CACHED_MAGIC, audio_s) + data


def unpack_cached(entry: bytes | None) -> tuple[float, bytes] | None:
    """(audio seconds, response bytes) of an entry written by pack_cached; None for a miss or anything else."""
    if entry is None or len(entry) < _CACHED.size or not entry.startswith(_CACHED_MAGIC):
        return None
    _, audio_s = _CACHED.unpack_from(entry)
    return float(audio_s), entry[_CACHED.size :]
