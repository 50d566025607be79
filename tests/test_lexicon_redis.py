"""Real redis-server: the Redis lexicon store, an entry written on one app instance used by another, Redis outages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from servers import AppServer, RedisServer, metric_value, running_apps  # redis_server: conftest.py

from service.errors import StoreUnavailableError
from service.frontend import Lexicon, LexiconStore
from service.stores.lexicon import DEFAULT_LEXICON_PREFIX, LEXICON_UNREAD_VERSION, LEXICON_WRITE_RETRY_AFTER_S, RedisLexiconStore

pytestmark = pytest.mark.integration

USER = "redis-lexicon-user-1"
ADMIN = "redis-lexicon-admin1"
USER_H = {"Authorization": f"Bearer {USER}"}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
TEXT = "他在银行上班。"
CACHE_HITS = "tts_cache_hits_total"


# ---- the store on its own --------------------------------------------------------------------------


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def test_store_versions_move_on_every_write_and_survive_a_flush(own_redis: RedisServer) -> None:
    store = RedisLexiconStore(own_redis.url)
    other = RedisLexiconStore(own_redis.url)  # a second replica
    assert isinstance(store, LexiconStore)
    v0 = store.version()
    assert store.get_all() == {}
    store.put("重庆", "zhong4 qing4")
    v1 = other.version()
    assert v1 != v0 and other.get_all() == {"重庆": "zhong4 qing4"}
    assert not store.delete("银行") and other.version() == v1, "deleting nothing must not move the version"
    assert store.delete("重庆")
    v2 = other.version()
    assert v2 not in (v0, v1) and other.get_all() == {}
    with redis.Redis.from_url(own_redis.url) as r:
        assert r.exists(DEFAULT_LEXICON_PREFIX + "entries") == 0
        r.flushall()  # Redis lost everything: the counter starts again, the epoch must not repeat
    seen = {v0, v1, v2, store.version()}
    store.put("重庆", "chong2 qing4")
    store.put("重庆", "zhong4 qing4")  # the counter is back at v2's value
    assert other.version() not in seen
    store.close()
    other.close()


def test_store_reads_fall_back_and_writes_fail_when_redis_is_down(own_redis: RedisServer) -> None:
    store = RedisLexiconStore(own_redis.url)
    store.put("行长", "xing2 zhang3")
    version, entries = store.version(), store.get_all()
    own_redis.kill()
    started = time.monotonic()
    assert store.version() == version and store.get_all() == entries, "last good snapshot while Redis is down"
    with pytest.raises(StoreUnavailableError) as failed:
        store.put("银行", "yin2 hang2")
    assert failed.value.retry_after_s == LEXICON_WRITE_RETRY_AFTER_S
    with pytest.raises(StoreUnavailableError):
        store.delete("行长")
    assert time.monotonic() - started < 3.0, "Redis calls must time out quickly"
    never_read = RedisLexiconStore(own_redis.url)
    assert never_read.version() == LEXICON_UNREAD_VERSION and never_read.get_all() == {}
    # the frontend's Lexicon then serves the defaults without raising
    lex = Lexicon(never_read, defaults={"重庆": "chong2 qing4"})
    assert dict(lex.snapshot().entries) == {"重庆": "chong2 qing4"}
    own_redis.start()
    time.sleep(1.2)  # past the read back-off
    assert store.version() != version, "a restarted (empty) Redis is a new version"
    store.put("银行", "yin2 hang2")
    assert never_read.get_all() == {"银行": "yin2 hang2"}


# ---- two app instances -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def apps(
    tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path, redis_server: RedisServer
) -> Iterator[tuple[AppServer, AppServer]]:
    env = {
        "TTS_REDIS_URL": redis_server.url,
        "TTS_API_KEYS": USER,
        "TTS_ADMIN_API_KEYS": ADMIN,
        "TTS_RATE_LIMIT_PER_MINUTE": "0",
        "TTS_INTRA_OP_THREADS": "1",
    }
    workdir = tmp_path_factory.mktemp("apps")
    pair = (AppServer(workdir, tiny_bundle, env, name="lex-a"), AppServer(workdir, tiny_bundle, env, name="lex-b"))
    with running_apps(pair):
        yield pair


def normalize(app: AppServer, text: str = TEXT) -> dict[str, Any]:
    resp = httpx.get(app.base_url + "/v1/normalize", params={"text": text}, headers=USER_H, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def speak(app: AppServer, text: str = TEXT) -> httpx.Response:
    body = {"text": text, "speaker": "中文女", "format": "wav", "seed": 7}
    resp = httpx.post(app.base_url + "/tts", json=body, headers=USER_H, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def lexicon_call(app: AppServer, method: str, word: str, pinyin: str | None = None) -> httpx.Response:
    body = {"pinyin": pinyin} if pinyin is not None else None
    return httpx.request(method, f"{app.base_url}/v1/lexicon/{word}", json=body, headers=ADMIN_H, timeout=30)


def hits(app: AppServer) -> float:
    return metric_value(httpx.get(app.base_url + "/metrics", timeout=10).text, CACHE_HITS)


def test_an_entry_put_on_one_instance_changes_what_the_other_sends_to_the_engine(
    apps: tuple[AppServer, AppServer], redis_server: RedisServer
) -> None:
    a, b = apps
    before = normalize(b)
    assert before["rewrites"] == []
    old_audio = speak(b)
    assert old_audio.headers["X-Cache"] == "miss" and speak(b).headers["X-Cache"] == "hit"

    put = lexicon_call(a, "PUT", "银行", "yin2 xing2")
    assert put.status_code == 200, put.text
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as r:
        assert r.hget(DEFAULT_LEXICON_PREFIX + "entries", "银行") == "yin2 xing2"

    after = normalize(b)  # the very next request on the other instance
    assert after["lexicon_version"] == put.json()["version"] != before["lexicon_version"]
    assert [r["word"] for r in after["rewrites"]] == ["银行"]
    assert after["sentences"][0]["ids"] != before["sentences"][0]["ids"]
    got = httpx.get(b.base_url + "/v1/lexicon/银行", headers=USER_H, timeout=10).json()
    assert (got["pinyin"], got["source"]) == ("yin2 xing2", "custom")

    hits_before = hits(b)
    new_audio = speak(b)
    assert new_audio.headers["X-Cache"] == "miss", "the audio cached before the change must not be served"
    assert hits(b) == hits_before
    assert new_audio.content != old_audio.content, "other tokens, other audio"
    shared = speak(a)
    assert shared.headers["X-Cache"] == "hit" and shared.content == new_audio.content

    assert lexicon_call(b, "DELETE", "银行").status_code == 200
    assert normalize(a)["sentences"] == before["sentences"]


def test_redis_down_synthesis_works_and_lexicon_writes_get_503(
    apps: tuple[AppServer, AppServer], redis_server: RedisServer
) -> None:
    a, b = apps
    assert lexicon_call(a, "PUT", "科长", "ke1 zhang3").status_code == 200
    assert [r["word"] for r in normalize(b, "我们科长来了。")["rewrites"]] == ["科长"]
    redis_server.kill()
    try:
        for app in (a, b):
            assert speak(app, "断了也能说。").content[:4] == b"RIFF"
        listing = httpx.get(b.base_url + "/v1/lexicon", headers=USER_H, timeout=10)
        assert listing.status_code == 200
        assert {e["word"]: e["source"] for e in listing.json()["data"]}["科长"] == "custom", "last entries read"
        assert [r["word"] for r in normalize(b, "我们科长来了。")["rewrites"]] == ["科长"]
        for method, pinyin in (("PUT", "ke1 chang2"), ("DELETE", None)):
            started = time.monotonic()
            refused = lexicon_call(a, method, "科长", pinyin)
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["code"] == "store_unavailable" and refused.json()["error"]["message"]
            assert time.monotonic() - started < 3.0
    finally:
        redis_server.restart()
    time.sleep(1.5)  # past the read back-off: Redis is empty now, and a new version
    assert lexicon_call(a, "PUT", "银行", "yin2 hang2").status_code == 200
    report = normalize(b, "我们科长在银行。")
    assert [r["word"] for r in report["rewrites"]] == ["银行"], "the restarted Redis holds only the new entry"
    assert a.alive() and b.alive()
