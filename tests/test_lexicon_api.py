"""Lexicon and normalize endpoints in process: CRUD, validation, admin keys, cache-key effect, frontend timing."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from servers import metric_value
from starlette.requests import Request

from service.access import ApiKeys, Caller
from service.api import create_app
from service.api.auth import caller_of
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import ForbiddenError, UnauthorizedError
from service.families.cosyvoice1.engine import Synthesizer
from service.families.model import NamedVoice
from service.frontend import Sentence, TextFrontend
from service.settings import Settings
from service.speech.request import SpeechRequest
from service.speech.service import TTSService
from service.stores.audio_cache import MemoryAudioCache

USER = "lexicon-user-key-01"
ADMIN = "lexicon-admin-key-1"
USER_H = {"Authorization": f"Bearer {USER}"}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client(tiny_bundle: Path) -> Iterator[TestClient]:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        model_dir=tiny_bundle,
        intra_op_threads=1,
        rate_limit_per_minute=0,
        max_chars=300,
        api_keys=[SecretStr(USER)],
        admin_api_keys=[SecretStr(ADMIN)],
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def reference_frontend(tiny_bundle: Path) -> TextFrontend:
    """An independent frontend on the same tokenizer (its own in-memory lexicon with the same defaults)."""
    return TextFrontend.load(tiny_bundle / "multilingual.tiktoken")


def openai_error(resp: object, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text  # type: ignore[attr-defined]
    body = resp.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    return body["error"]  # type: ignore[no-any-return]


def entries(client: TestClient) -> dict[str, tuple[str, str]]:
    body = client.get("/v1/lexicon", headers=USER_H).json()
    return {e["word"]: (e["pinyin"], e["source"]) for e in body["data"]}


# ---- schema ----------------------------------------------------------------------------------------


def test_openapi_has_unique_operation_ids_and_the_text_routes(client: TestClient) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns "Duplicate Operation ID"
        schema = client.app.openapi()  # type: ignore[attr-defined]
    ops = [op["operationId"] for methods in schema["paths"].values() for op in methods.values()]
    assert [k for k, n in Counter(ops).items() if n > 1] == []
    assert set(schema["paths"]["/inference_sft"]) == {"get", "post"}
    assert set(schema["paths"]["/v1/lexicon/{word}"]) == {"get", "put", "delete"}
    assert set(schema["paths"]["/v1/normalize"]) == {"get", "post"} and "get" in schema["paths"]["/v1/lexicon"]


# ---- CRUD ------------------------------------------------------------------------------------------


def test_list_holds_the_defaults_and_a_version(client: TestClient) -> None:
    body = client.get("/v1/lexicon", headers=USER_H).json()
    assert body["object"] == "list" and body["version"]
    found = {e["word"]: e for e in body["data"]}
    assert found["重庆"] == {"word": "重庆", "pinyin": "chong2 qing4", "source": "default"}
    assert found["行长"]["pinyin"] == "hang2 zhang3" and len(found) >= 24
    one = client.get("/v1/lexicon/行长", headers=USER_H).json()
    assert one == {
        "object": "lexicon.entry",
        "word": "行长",
        "pinyin": "hang2 zhang3",
        "source": "default",
        "version": body["version"],
    }


def test_put_get_override_and_delete(client: TestClient) -> None:
    v0 = client.get("/v1/lexicon", headers=USER_H).json()["version"]
    put = client.put("/v1/lexicon/银行", json={"pinyin": "Yín Háng"}, headers=ADMIN_H)  # tone marks are canonicalized
    assert put.status_code == 200, put.text
    assert put.json()["pinyin"] == "yin2 hang2" and put.json()["source"] == "custom"
    v1 = put.json()["version"]
    assert v1 != v0
    assert client.get("/v1/lexicon/银行", headers=USER_H).json()["pinyin"] == "yin2 hang2"
    # an operator entry overrides a default; deleting it brings the default back
    assert client.put("/v1/lexicon/重庆", json={"pinyin": "zhong4 qing4"}, headers=ADMIN_H).status_code == 200
    assert entries(client)["重庆"] == ("zhong4 qing4", "custom")
    deleted = client.delete("/v1/lexicon/重庆", headers=ADMIN_H)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True and deleted.json()["version"] not in (v0, v1)
    assert entries(client)["重庆"] == ("chong2 qing4", "default")
    # defaults cannot be deleted, unknown words are 404
    assert "overridden" in str(openai_error(client.delete("/v1/lexicon/重庆", headers=ADMIN_H), 404)["message"])
    assert client.delete("/v1/lexicon/银行", headers=ADMIN_H).status_code == 200
    assert openai_error(client.get("/v1/lexicon/银行", headers=USER_H), 404)["code"] == "not_found"
    assert openai_error(client.delete("/v1/lexicon/银行", headers=ADMIN_H), 404)["param"] == "word"


@pytest.mark.parametrize(
    ("word", "body", "param"),
    [
        ("bank", {"pinyin": "bank1"}, "word"),  # not Chinese
        ("重" * 17, {"pinyin": " ".join(["chong2"] * 17)}, "word"),  # too long a word
        ("重庆", {"pinyin": "chong2"}, "pinyin"),  # one syllable for two characters
        ("重庆", {"pinyin": "chong2 qing4 shi4"}, "pinyin"),
        ("重庆", {"pinyin": "chong2 qing9"}, "pinyin"),  # no tone 9
        ("重庆", {"pinyin": "chong qing"}, "pinyin"),  # no tone at all reads as neutral, which these do not have
        ("重庆", {"pinyin": "zzz2 qing4"}, "pinyin"),  # not a syllable pypinyin knows
        ("重庆", {"pinyin": ""}, "pinyin"),
        ("重庆", {"pinyin": "a1 " * 100}, "pinyin"),  # body bound
        ("重庆", {"pinyin": "chong2 qing4", "extra": 1}, "extra"),
        ("重庆", {}, "pinyin"),
    ],
)
def test_invalid_entries_are_400_in_the_openai_envelope(client: TestClient, word: str, body: dict, param: str) -> None:
    before = client.get("/v1/lexicon", headers=USER_H).json()["version"]
    err = openai_error(client.put(f"/v1/lexicon/{word}", json=body, headers=ADMIN_H), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert client.get("/v1/lexicon", headers=USER_H).json()["version"] == before, "a refused write must not count"


def test_malformed_body_is_400(client: TestClient) -> None:
    resp = client.put("/v1/lexicon/重庆", content=b"{not json", headers={**ADMIN_H, "Content-Type": "application/json"})
    assert openai_error(resp, 400)["code"] == "invalid_input"


# ---- keys ------------------------------------------------------------------------------------------


def test_writes_need_an_admin_key_and_reads_any_key(client: TestClient) -> None:
    body = {"pinyin": "ke1 zhang3"}
    assert openai_error(client.put("/v1/lexicon/科长", json=body), 401)["code"] == "unauthorized"
    assert openai_error(client.put("/v1/lexicon/科长", json=body, headers=USER_H), 403)["code"] == "forbidden"
    bogus = {"Authorization": "Bearer not-a-configured-key"}
    assert openai_error(client.delete("/v1/lexicon/科长", headers=bogus), 401)["code"] == "unauthorized"
    assert openai_error(client.delete("/v1/lexicon/科长", headers=USER_H), 403)["code"] == "forbidden"
    assert client.put("/v1/lexicon/科长", json=body, headers={"X-API-Key": ADMIN}).status_code == 401, "/v1 takes Bearer only"
    assert "科长" not in entries(client)
    for path in ("/v1/lexicon", "/v1/lexicon/重庆", "/v1/normalize?text=你好"):
        assert openai_error(client.get(path), 401)["code"] == "unauthorized"
        assert client.get(path, headers=USER_H).status_code == 200
        assert client.get(path, headers=ADMIN_H).status_code == 200, "an admin key is a key too"
    assert client.post("/tts", json={"text": "你好。", "format": "pcm"}, headers={"X-API-Key": ADMIN}).status_code == 200


def _request(headers: dict[str, str], path: str = "/v1/lexicon/x") -> Caller:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": "PUT", "path": path, "headers": raw, "client": ("1.2.3.4", 1), "query_string": b""}
    return caller_of(Request(scope))


def test_admin_keys_alone_turn_keys_on() -> None:
    """Reads and synthesis were left open with admin keys alone; any configured key now means keys are on."""
    keys = ApiKeys([], [ADMIN])
    assert keys.enabled
    with pytest.raises(UnauthorizedError):
        keys.check(_request({}))
    keys.check(_request(ADMIN_H))  # an admin key works wherever a key does
    keys.check_admin(_request(ADMIN_H))
    with pytest.raises(UnauthorizedError):
        keys.check_admin(_request({}))
    with pytest.raises(UnauthorizedError):
        keys.check_admin(_request(USER_H))
    with pytest.raises(ForbiddenError):
        ApiKeys([USER], []).check_admin(_request(USER_H))  # keys on, no admin configured: nobody may write
    ApiKeys([], []).check_admin(_request({}))  # no keys at all: open, like every other route


def test_admin_keys_setting_is_a_comma_separated_secret_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_ADMIN_API_KEYS", f"{ADMIN}, second-admin-key")
    keys = Settings(_env_file=None).admin_api_keys  # type: ignore[call-arg]
    assert [k.get_secret_value() for k in keys] == [ADMIN, "second-admin-key"] and ADMIN not in repr(keys)
    monkeypatch.setenv("TTS_ADMIN_API_KEYS", "short")
    with pytest.raises(ValueError, match="8 characters"):
        Settings(_env_file=None)  # type: ignore[call-arg]


# ---- normalize -------------------------------------------------------------------------------------


def test_normalize_get_and_post_report_what_will_be_spoken(client: TestClient, reference_frontend: TextFrontend) -> None:
    text = "重庆银行的行长来了。电话13812345678，还有3.5%。"
    got = client.get("/v1/normalize", params={"text": text}, headers=USER_H)
    posted = client.post("/v1/normalize", json={"text": text}, headers=USER_H)
    assert got.status_code == posted.status_code == 200, got.text
    g, p = got.json(), posted.json()
    for key in ("normalized", "sentences", "rules", "rewrites", "token_counts", "lexicon_version"):
        assert g[key] == p[key], key
    expected = reference_frontend.sentences(text)
    assert [s["text"] for s in g["sentences"]] == [s.text for s in expected]
    assert [s["ids"] for s in g["sentences"]] == [list(s.ids) for s in expected]
    assert [s["source"] for s in g["sentences"]] == [text]  # the written text its caption shows, digits as typed
    assert g["token_counts"] == [len(s.ids) for s in expected] and g["total_tokens"] == sum(g["token_counts"])
    assert [(r["word"], r["replacement"]) for r in g["rewrites"]] == [("重庆", "崇庆"), ("行长", "航掌")]
    assert g["rules"] == ["code_after_keyword"] and g["language"] == "zh" and g["enhanced"] is True
    assert "幺三八" in g["normalized"] and "百分之三点五" in g["normalized"]
    assert p["cache_hit"] is True and p["elapsed_ms"] == 0.0, "the second call is served by the frontend LRU"


@pytest.mark.parametrize(
    ("call", "status", "code"),
    [
        (lambda c: c.get("/v1/normalize", headers=USER_H), 400, "invalid_input"),
        (lambda c: c.get("/v1/normalize", params={"text": ""}, headers=USER_H), 400, "invalid_input"),
        (lambda c: c.post("/v1/normalize", json={"text": "好" * 301}, headers=USER_H), 413, "text_too_long"),
        (lambda c: c.post("/v1/normalize", json={"text": "a\x00b"}, headers=USER_H), 400, "invalid_input"),
        (lambda c: c.post("/v1/normalize", json={"input": "你好"}, headers=USER_H), 400, "invalid_input"),
    ],
)
def test_normalize_rejects_bad_text(client: TestClient, call: object, status: int, code: str) -> None:
    assert openai_error(call(client), status)["code"] == code  # type: ignore[operator]


def test_normalize_reports_the_pause_after_each_sentence(client: TestClient) -> None:
    body = client.post("/v1/normalize", json={"text": '你好。[pause 1.5s]世界。<break time="300ms"/>再见。'}, headers=USER_H)
    assert body.status_code == 200, body.text
    assert [s["pause_after_s"] for s in body.json()["sentences"]] == [1.5, 0.3, 0.0]


def test_punctuation_only_text_has_no_sentences(client: TestClient) -> None:
    body = client.post("/v1/normalize", json={"text": "。。！"}, headers=USER_H).json()
    assert body["sentences"] == [] and body["total_tokens"] == 0


# ---- lexicon version in the audio cache key ---------------------------------------------------------


def test_a_lexicon_change_changes_the_tokens_and_is_not_served_from_the_audio_cache(client: TestClient) -> None:
    text = "他在银行上班。"
    speak = {"text": text, "format": "wav", "seed": 5}

    def ids() -> list[list[int]]:
        return [s["ids"] for s in client.get("/v1/normalize", params={"text": text}, headers=USER_H).json()["sentences"]]

    def hits() -> float:
        return metric_value(client.get("/metrics").text, "tts_cache_hits_total")

    ids_before = ids()
    first = client.post("/tts", json=speak, headers=USER_H)
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    assert client.post("/tts", json=speak, headers=USER_H).headers["x-cache"] == "hit"
    hits_before = hits()
    assert client.put("/v1/lexicon/银行", json={"pinyin": "yin2 xing2"}, headers=ADMIN_H).status_code == 200
    try:
        assert ids() != ids_before
        after = client.post("/tts", json=speak, headers=USER_H)
        assert after.status_code == 200 and after.headers["x-cache"] == "miss"
        assert hits() == hits_before, "the old audio must not be served after the change"
        assert client.post("/tts", json=speak, headers=USER_H).headers["x-cache"] == "hit"
    finally:
        client.delete("/v1/lexicon/银行", headers=ADMIN_H)
    assert ids() == ids_before
    assert client.post("/tts", json=speak, headers=USER_H).headers["x-cache"] == "miss", "the version moved again"


# ---- frontend time counts in first-chunk latency ----------------------------------------------------


class _SlowFrontend:
    """Wraps the real frontend and takes `delay_s` longer, like a slow normalization."""

    def __init__(self, inner: TextFrontend, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    @property
    def lexicon_version(self) -> str:
        return self._inner.lexicon_version

    def sentences(self, text: str) -> list[Sentence]:
        time.sleep(self._delay_s)
        return self._inner.sentences(text)


def test_frontend_time_is_part_of_first_chunk_latency(tiny_bundle: Path, reference_frontend: TextFrontend) -> None:
    bundle = ModelBundle.load(tiny_bundle)
    engine = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, inter_op_threads=1))
    delay_s = 0.3
    service = TTSService(_SlowFrontend(reference_frontend, delay_s), engine, MemoryAudioCache(0), bundle_sha256="x")
    try:
        job = service.submit(SpeechRequest(text="你好。", voice=NamedVoice("中文女"), seed=1))
        assert job.read_all()[:4] == b"RIFF"
        t = job.timings
        assert t.frontend_s >= delay_s
        assert t.first_chunk_s is not None and t.first_chunk_s >= t.frontend_s
        assert "frontend;dur=" in t.server_timing()
    finally:
        service.close()


def test_frontend_stage_metric_is_exported(client: TestClient) -> None:
    count = "tts_stage_seconds_count"
    before = metric_value(client.get("/metrics").text, count, {"stage": "frontend"})
    resp = client.post("/tts", json={"text": "度量前端。", "format": "pcm", "seed": 3}, headers=USER_H)
    assert resp.status_code == 200 and resp.headers["x-cache"] == "miss"
    text = client.get("/metrics").text
    assert metric_value(text, count, {"stage": "frontend"}) == before + 1
    assert metric_value(text, "tts_first_chunk_seconds_count") >= 1
