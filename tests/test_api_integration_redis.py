"""Real redis-server + two real app instances: shared audio cache, Redis outage, one global rate limit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from servers import AppServer, RedisServer, metric_value, running_apps  # redis_server: conftest.py

pytestmark = pytest.mark.integration

# One API key per test, so each test has its own rate-limit budget.
CACHE_KEY = "redis-cache-key-01"
LIMIT_KEY = "redis-limit-key-01"
OTHER_KEY = "redis-other-key-01"
OUTAGE_KEY = "redis-outage-key-1"
RECOVER_KEY = "redis-recover-key1"
RATE_LIMIT = 4  # synthesis requests per minute per key, shared by both instances
CACHE_HEADER = "X-Cache"
CACHE_HITS = "tts_cache_hits_total"
CACHE_ERRORS = "tts_cache_errors_total"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def apps(
    tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path, redis_server: RedisServer
) -> Iterator[tuple[AppServer, AppServer]]:
    env = {
        "TTS_REDIS_URL": redis_server.url,
        "TTS_API_KEYS": ",".join((CACHE_KEY, LIMIT_KEY, OTHER_KEY, OUTAGE_KEY, RECOVER_KEY)),
        "TTS_RATE_LIMIT_PER_MINUTE": str(RATE_LIMIT),
    }
    workdir = tmp_path_factory.mktemp("apps")
    pair = (AppServer(workdir, tiny_bundle, env, name="app-a"), AppServer(workdir, tiny_bundle, env, name="app-b"))
    with running_apps(pair):
        yield pair


def speak(app: AppServer, key: str, text: str) -> httpx.Response:
    body = {"text": text, "speaker": "中文女", "format": "wav", "seed": 11}
    return httpx.post(app.base_url + "/tts", json=body, headers=auth(key), timeout=60)


def metrics(app: AppServer) -> str:
    return httpx.get(app.base_url + "/metrics", timeout=10).text


def test_second_identical_request_is_a_cache_hit_shared_through_redis(
    apps: tuple[AppServer, AppServer], redis_server: RedisServer
) -> None:
    a, b = apps
    hits_before = metric_value(metrics(a), CACHE_HITS)
    first = speak(a, CACHE_KEY, "缓存测试。")
    assert first.status_code == 200, first.text
    assert first.headers[CACHE_HEADER].lower() == "miss"
    second = speak(a, CACHE_KEY, "缓存测试。")
    assert second.status_code == 200 and second.headers[CACHE_HEADER].lower() == "hit"
    assert second.content == first.content
    assert metric_value(metrics(a), CACHE_HITS) == hits_before + 1
    # the entry lives in Redis, so the other replica hits it too
    third = speak(b, CACHE_KEY, "缓存测试。")
    assert third.headers[CACHE_HEADER].lower() == "hit" and third.content == first.content
    with redis.Redis.from_url(redis_server.url) as r:
        assert r.dbsize() >= 1


def test_two_instances_enforce_one_global_rate_limit(apps: tuple[AppServer, AppServer]) -> None:
    a, b = apps
    statuses = [speak((a, b)[i % 2], LIMIT_KEY, "限流。").status_code for i in range(RATE_LIMIT + 2)]
    assert statuses[:RATE_LIMIT] == [200] * RATE_LIMIT, statuses
    assert statuses[RATE_LIMIT:] == [429, 429], f"the limit is per instance, not global: {statuses}"
    refused = speak(a, LIMIT_KEY, "限流。")
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["message"]
    # another key has its own budget
    assert speak(b, OTHER_KEY, "另一个键。").status_code == 200


def test_requests_still_succeed_while_redis_is_down(apps: tuple[AppServer, AppServer], redis_server: RedisServer) -> None:
    a, b = apps
    redis_server.kill()
    try:
        for i, app in enumerate((a, b, a)):
            resp = speak(app, OUTAGE_KEY, f"缓存不可用{i}。")
            assert resp.status_code == 200, resp.text
            assert resp.content[:4] == b"RIFF" and len(resp.content) > 44
        repeat = speak(a, OUTAGE_KEY, "缓存不可用0。")
        assert repeat.status_code == 200 and repeat.headers[CACHE_HEADER].lower() != "hit"
        ready = httpx.get(a.base_url + "/readyz", timeout=30)
        assert ready.status_code == 200, "the cache is optional: readiness must not fail with it"
        assert "degraded" in ready.text.lower()
        assert metric_value(metrics(a), CACHE_ERRORS) > 0, "Redis errors must be counted"
    finally:
        redis_server.restart()
    # Redis is back (empty): after the back-off the cache works again without a restart of the app
    time.sleep(1.5)
    assert speak(a, RECOVER_KEY, "恢复了。").headers[CACHE_HEADER].lower() == "miss"
    assert speak(b, RECOVER_KEY, "恢复了。").headers[CACHE_HEADER].lower() == "hit"
    assert a.alive() and b.alive()
