"""Audio cache: key canonicalization, the in-memory LRU, and the Redis cache against a real redis-server."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from servers import RedisServer, free_port

from service.stores import audio_cache as cache_mod
from service.stores.audio_cache import (
    AudioCache,
    MemoryAudioCache,
    RedisAudioCache,
    audio_cache_key,
    build_audio_cache,
    pack_cached,
    unpack_cached,
)

BASE = {
    "bundle_sha256": "ab" * 32,
    "text": "你好，世界。Hello!",
    "speaker": "中文女",
    "speed": 1.0,
    "fmt": "wav",
    "sample_rate": 22050,
    "seed": 7,
}


# ---------- key ----------


def test_key_is_deterministic_hex_sha256() -> None:
    k = audio_cache_key(**BASE)  # type: ignore[arg-type]
    assert k == audio_cache_key(**BASE)  # type: ignore[arg-type]
    assert len(k) == 64 and int(k, 16) >= 0


@pytest.mark.parametrize(
    ("field", "other"),
    [
        ("bundle_sha256", "cd" * 32),
        ("text", "你好，世界。Hello?"),
        ("speaker", "英文女"),
        ("speed", 1.25),
        ("fmt", "mp3"),
        ("sample_rate", 24000),
        ("seed", 8),
        ("seed", None),
        ("lexicon_version", "2"),
    ],
)
def test_every_field_changes_the_key(field: str, other: object) -> None:
    assert audio_cache_key(**{**BASE, field: other}) != audio_cache_key(**BASE)  # type: ignore[arg-type]


def test_key_equal_values_in_other_python_types_match() -> None:
    a = audio_cache_key(**{**BASE, "speed": 1})  # type: ignore[arg-type]
    assert a == audio_cache_key(**BASE)  # type: ignore[arg-type]


def test_key_fields_cannot_bleed_into_each_other() -> None:
    # a naive "text|speaker" concatenation would make these two collide
    a = audio_cache_key(**{**BASE, "text": "a|b", "speaker": "c"})  # type: ignore[arg-type]
    b = audio_cache_key(**{**BASE, "text": "a", "speaker": "b|c"})  # type: ignore[arg-type]
    assert a != b


def test_key_accepts_any_python_string() -> None:
    odd = "\ud800 lone surrogate \x00 nul \u202e"
    assert len(audio_cache_key(**{**BASE, "text": odd})) == 64  # type: ignore[arg-type]


def test_key_rejects_non_finite_speed() -> None:
    with pytest.raises(ValueError):
        audio_cache_key(**{**BASE, "speed": float("nan")})  # type: ignore[arg-type]


# ---------- memory LRU ----------


def test_memory_roundtrip_and_stats() -> None:
    c = MemoryAudioCache(max_bytes=100)
    assert c.get("k") is None
    c.put("k", b"abc")
    assert c.get("k") == b"abc"
    assert c.stats.snapshot() == {"hits": 1, "misses": 1, "errors": 0}
    assert c.ping() and c.backend == "memory"
    assert isinstance(c, AudioCache)


def test_memory_evicts_least_recently_used_by_bytes() -> None:
    c = MemoryAudioCache(max_bytes=10)
    c.put("a", b"1234")
    c.put("b", b"1234")
    assert c.get("a") == b"1234"  # a is now the most recent
    c.put("c", b"1234")  # 12 bytes > 10: evicts b
    assert c.get("b") is None
    assert c.get("a") == b"1234" and c.get("c") == b"1234"
    assert c.size_bytes == 8 and len(c) == 2


def test_memory_replacing_a_key_updates_the_size() -> None:
    c = MemoryAudioCache(max_bytes=10)
    c.put("a", b"123456")
    c.put("a", b"12")
    assert c.size_bytes == 2 and c.get("a") == b"12"


def test_memory_value_larger_than_cache_is_not_stored_and_evicts_nothing() -> None:
    c = MemoryAudioCache(max_bytes=10)
    c.put("a", b"12345")
    c.put("big", b"x" * 11)
    assert c.get("big") is None and c.get("a") == b"12345"


def test_memory_zero_capacity_stores_nothing() -> None:
    c = MemoryAudioCache(max_bytes=0)
    c.put("a", b"1")
    assert c.get("a") is None and c.size_bytes == 0


def test_memory_is_thread_safe() -> None:
    c = MemoryAudioCache(max_bytes=1000)

    def work(t: int) -> None:
        for i in range(300):
            c.put(f"{t}-{i % 40}", bytes(7 + i % 13))
            c.get(f"{(t + 1) % 4}-{i % 40}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert 0 < c.size_bytes <= 1000
    snap = c.stats.snapshot()
    assert snap["hits"] + snap["misses"] == 4 * 300


def test_memory_rejects_negative_capacity() -> None:
    with pytest.raises(ValueError):
        MemoryAudioCache(max_bytes=-1)


# ---------- factory ----------


@pytest.mark.parametrize("url", [None, ""])
def test_factory_without_redis_url_is_memory(url: str | None) -> None:
    c = build_audio_cache(url, max_bytes=5, ttl_s=60)
    assert isinstance(c, MemoryAudioCache) and c.max_bytes == 5


def test_factory_with_redis_url_is_redis_even_when_unreachable() -> None:
    c = build_audio_cache(f"redis://127.0.0.1:{free_port()}/0", max_bytes=5, ttl_s=60)
    assert isinstance(c, RedisAudioCache) and c.ttl_s == 60
    c.close()


# ---------- Redis (real redis-server) ----------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()
    server.dump_log()


@pytest.fixture
def fast_retry(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(cache_mod, "REDIS_RETRY_AFTER_S", 0.2)
    return 0.2


@pytest.mark.integration
def test_redis_roundtrip_with_ttl_and_prefix(redis_server: RedisServer) -> None:
    c = RedisAudioCache(redis_server.url, ttl_s=120, prefix="t:")
    assert c.ping() and c.backend == "redis"
    assert c.get("k") is None
    c.put("k", b"\x00\x01audio")
    assert c.get("k") == b"\x00\x01audio"
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.get("t:k") == b"\x00\x01audio"
    assert 110 <= int(raw.ttl("t:k")) <= 120  # type: ignore[arg-type]
    assert c.stats.snapshot() == {"hits": 1, "misses": 1, "errors": 0}
    raw.close()
    c.close()


@pytest.mark.integration
def test_two_clients_share_entries(redis_server: RedisServer) -> None:
    a, b = RedisAudioCache(redis_server.url, ttl_s=60), RedisAudioCache(redis_server.url, ttl_s=60)
    a.put("shared", b"pcm")
    assert b.get("shared") == b"pcm"
    a.close()
    b.close()


@pytest.mark.integration
def test_redis_down_is_a_fast_counted_miss_then_recovers(
    redis_server: RedisServer, fast_retry: float, caplog: pytest.LogCaptureFixture
) -> None:
    c = RedisAudioCache(redis_server.url, ttl_s=60)
    c.put("k", b"v")
    redis_server.kill()
    caplog.set_level(logging.WARNING, logger="service.stores.audio_cache")
    t0 = time.monotonic()
    for _ in range(20):
        assert c.get("k") is None
        c.put("k2", b"v2")
    assert time.monotonic() - t0 < 2.0, "a down Redis must not slow every request by a timeout"
    assert not c.ping()
    snap = c.stats.snapshot()
    assert snap["errors"] >= 1 and snap["misses"] == 20 and snap["hits"] == 0
    assert sum("Redis" in r.getMessage() for r in caplog.records) == 1, "one warning per outage, not one per request"

    redis_server.restart()  # same port, empty data
    time.sleep(fast_retry + 0.05)
    c.put("k", b"back")
    assert c.get("k") == b"back"
    assert c.ping()
    c.close()


@pytest.mark.integration
def test_redis_unreachable_from_the_start_never_raises(fast_retry: float) -> None:
    c = RedisAudioCache(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60)
    assert c.get("k") is None
    c.put("k", b"v")
    assert not c.ping()
    assert c.stats.snapshot()["errors"] >= 1
    c.close()


@pytest.mark.integration
def test_redis_ping_reports_recovery_at_once(redis_server: RedisServer) -> None:
    # ping ignores the back-off: readiness shows the present state
    c = RedisAudioCache(redis_server.url, ttl_s=60)
    redis_server.kill()
    assert c.get("k") is None and not c.ping()
    redis_server.restart()
    assert c.ping()
    c.put("k", b"v")
    assert c.get("k") == b"v"
    c.close()


def test_a_cache_entry_holds_the_audio_length_before_the_bytes() -> None:
    entry = pack_cached(2.5, b"RIFF....")
    assert unpack_cached(entry) == (2.5, b"RIFF....")
    assert unpack_cached(None) is None
    assert unpack_cached(b"RIFF....WAVE") is None  # an entry of the old layout (bare bytes) is a miss, never audio
