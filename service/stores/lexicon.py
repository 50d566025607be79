"""The pronunciation lexicon in Redis, shared by every replica: entries, a version counter and an epoch."""

from __future__ import annotations

import secrets
import threading

import redis
from redis.commands.core import Script

from service.errors import StoreUnavailableError
from service.stores.redis_client import REDIS_SOCKET_TIMEOUT_S, RedisHealth, redis_client

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
        self._client = redis_client(url, timeout_s, decode_responses=True)
        self._keys = [prefix + "entries", prefix + "version", prefix + "epoch"]
        self._put = self._client.register_script(_PUT_SCRIPT)
        self._delete = self._client.register_script(_DELETE_SCRIPT)
        self._health = RedisHealth("lexicon store")
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
