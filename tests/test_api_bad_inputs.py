"""Bad inputs on every endpoint of a real server: always a 4xx JSON error (OpenAI envelope on /v1), never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import AppServer

pytestmark = pytest.mark.integration

KEY = "bad-inputs-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD_TTS = {"text": "你好。", "speaker": "中文女", "format": "wav"}
GOOD_V1 = {"model": "tts-1", "input": "你好。", "voice": "中文女", "response_format": "wav"}
LONG = "长" * 100_000


@dataclass(frozen=True)
class Bad:
    """One bad request: how to send it and which 4xx statuses are right for it."""

    id: str
    method: str
    path: str
    statuses: tuple[int, ...] = (400, 422)
    kwargs: dict[str, Any] = field(default_factory=dict)
    auth: bool = True


def tts(id_: str, body: Any, statuses: tuple[int, ...] = (400, 422), **kw: Any) -> Bad:
    return Bad(id_, "POST", "/tts", statuses, {"json": body, **kw})


def v1(id_: str, body: Any, statuses: tuple[int, ...] = (400, 422), **kw: Any) -> Bad:
    return Bad(id_, "POST", "/v1/audio/speech", statuses, {"json": body, **kw})


def raw(
    id_: str, path: str, content: bytes, content_type: str = "application/json", statuses: tuple[int, ...] = (400, 422)
) -> Bad:
    return Bad(id_, "POST", path, statuses, {"content": content, "headers": {"Content-Type": content_type}})


def chunked(size: int) -> Iterator[bytes]:
    """A JSON body of about `size` bytes sent without Content-Length (chunked transfer)."""
    yield b'{"text": "'
    for _ in range(size // 65_536):
        yield b"a" * 65_536
    yield b'"}'


TOO_LONG = (400, 413, 422)
UNAUTHORIZED = (401,)
CASES = [
    # POST /tts
    tts("tts-empty-text", {**GOOD_TTS, "text": ""}),
    tts("tts-whitespace-text", {**GOOD_TTS, "text": " \n\t "}),
    tts("tts-100k-chars", {**GOOD_TTS, "text": LONG}, TOO_LONG),
    tts("tts-over-max-chars", {**GOOD_TTS, "text": "a" * 5000}, TOO_LONG),  # under the body limit, over TTS_MAX_CHARS
    raw("tts-invalid-utf8", "/tts", b'{"text": "\xff\xfe\xc3\x28", "speaker": "\xe4\xb8"}'),
    tts("tts-control-chars-only", {**GOOD_TTS, "text": "\x00\x01\x02\x1b\x7f"}),
    raw("tts-lone-surrogate", "/tts", b'{"text": "\\ud800"}'),
    tts("tts-unknown-speaker", {**GOOD_TTS, "speaker": "no-such-speaker"}, (400, 404, 422)),
    tts("tts-bad-format", {**GOOD_TTS, "format": "wma"}),
    tts("tts-speed-too-low", {**GOOD_TTS, "speed": 0.1}),
    tts("tts-speed-too-high", {**GOOD_TTS, "speed": 5}),
    tts("tts-speed-not-a-number", {**GOOD_TTS, "speed": "fast"}),
    raw("tts-speed-nan", "/tts", b'{"text": "hi", "speed": NaN}'),
    raw("tts-speed-infinity", "/tts", b'{"text": "hi", "speed": Infinity}'),
    tts("tts-huge-seed", {**GOOD_TTS, "seed": 2**80}),
    tts("tts-stream-not-bool", {**GOOD_TTS, "stream": "maybe"}),
    tts("tts-text-not-a-string", {**GOOD_TTS, "text": 12345}),
    tts("tts-text-is-object", {**GOOD_TTS, "text": {"a": 1}}),
    tts("tts-missing-text", {"speaker": "中文女"}),
    tts("tts-body-is-array", [GOOD_TTS]),
    raw("tts-malformed-json", "/tts", b'{"text": "hi",', statuses=(400,)),
    raw("tts-empty-body", "/tts", b""),
    raw("tts-wrong-content-type", "/tts", json.dumps(GOOD_TTS).encode(), "text/plain", (415,)),
    raw("tts-form-content-type", "/tts", b"text=hi", "application/x-www-form-urlencoded", (415,)),
    raw("tts-oversize-body", "/tts", b'{"text": "' + b"a" * 2_000_000 + b'"}', statuses=(413,)),
    Bad(
        "tts-oversize-chunked-body",
        "POST",
        "/tts",
        (413,),
        {"content": chunked(2_000_000), "headers": {"Content-Type": "application/json"}},
    ),
    Bad("tts-missing-key", "POST", "/tts", UNAUTHORIZED, {"json": GOOD_TTS}, auth=False),
    Bad(
        "tts-wrong-key",
        "POST",
        "/tts",
        UNAUTHORIZED,
        {"json": GOOD_TTS, "headers": {"Authorization": "Bearer wrong-key-123"}},
        False,
    ),
    Bad(
        "tts-wrong-x-api-key", "POST", "/tts", UNAUTHORIZED, {"json": GOOD_TTS, "headers": {"X-API-Key": "wrong-key-123"}}, False
    ),
    Bad("tts-wrong-method", "DELETE", "/tts", (405,)),
    # POST /v1/audio/speech
    v1("v1-unknown-model", {**GOOD_V1, "model": "whisper-1"}, (400, 404, 422)),
    v1("v1-missing-input", {"model": "tts-1", "voice": "alloy"}),
    v1("v1-empty-input", {**GOOD_V1, "input": ""}),
    v1(
        "v1-input-over-4096", {**GOOD_V1, "input": "a" * 4097}, (400,)
    ),  # OpenAI's status, so openai-python raises BadRequestError
    v1("v1-unknown-voice", {**GOOD_V1, "voice": "no-such-voice"}, (400, 404, 422)),
    v1("v1-bad-response-format", {**GOOD_V1, "response_format": "wma"}),
    v1("v1-speed-too-low", {**GOOD_V1, "speed": 0.1}),
    v1("v1-speed-too-high", {**GOOD_V1, "speed": 4.5}),
    v1("v1-bad-stream-format", {**GOOD_V1, "stream_format": "websocket"}),
    v1("v1-control-chars-only", {**GOOD_V1, "input": "\x00\x07\x08"}),
    raw("v1-malformed-json", "/v1/audio/speech", b'{"model": "tts-1", "input": '),
    raw("v1-invalid-utf8", "/v1/audio/speech", b'{"model": "tts-1", "input": "\xff", "voice": "alloy"}'),
    raw("v1-wrong-content-type", "/v1/audio/speech", json.dumps(GOOD_V1).encode(), "text/plain", (415,)),
    raw("v1-form-content-type", "/v1/audio/speech", b"input=hi", "application/x-www-form-urlencoded", (415,)),
    raw("v1-oversize-body", "/v1/audio/speech", b'{"input": "' + b"a" * 2_000_000 + b'"}', statuses=(400,)),
    Bad("v1-missing-key", "POST", "/v1/audio/speech", UNAUTHORIZED, {"json": GOOD_V1}, auth=False),
    Bad(
        "v1-x-api-key-is-not-bearer",
        "POST",
        "/v1/audio/speech",
        UNAUTHORIZED,
        {"json": GOOD_V1, "headers": {"X-API-Key": "x"}},
        False,
    ),
    Bad("v1-models-wrong-key", "GET", "/v1/models", UNAUTHORIZED, {"headers": {"Authorization": "Bearer nope-nope-nope"}}, False),
    Bad(
        "v1-voices-wrong-key",
        "GET",
        "/v1/audio/voices",
        UNAUTHORIZED,
        {"headers": {"Authorization": "Bearer nope-nope-1"}},
        False,
    ),
    Bad("v1-lexicon-missing-key", "GET", "/v1/lexicon", UNAUTHORIZED, auth=False),
    Bad("v1-unknown-path", "GET", "/v1/does-not-exist", (404,)),
    # GET and POST /inference_sft (form fields)
    Bad(
        "sft-post-unknown-speaker", "POST", "/inference_sft", (400, 404, 422), {"data": {"tts_text": "你好", "spk_id": "nobody"}}
    ),
    Bad("sft-post-empty-text", "POST", "/inference_sft", (400, 422), {"data": {"tts_text": "", "spk_id": "中文女"}}),
    Bad("sft-post-missing-text", "POST", "/inference_sft", (400, 422), {"data": {"spk_id": "中文女"}}),
    Bad("sft-post-100k-chars", "POST", "/inference_sft", TOO_LONG, {"data": {"tts_text": LONG, "spk_id": "中文女"}}),
    # the official client.py sends GET with a form body
    Bad("sft-get-unknown-speaker", "GET", "/inference_sft", (400, 404, 422), {"data": {"tts_text": "你好", "spk_id": "nobody"}}),
    Bad("sft-get-empty-text", "GET", "/inference_sft", (400, 422), {"data": {"tts_text": " ", "spk_id": "中文女"}}),
    Bad("sft-get-missing-fields", "GET", "/inference_sft", (400, 422)),
    Bad("sft-wrong-key", "POST", "/inference_sft", UNAUTHORIZED, {"data": {"tts_text": "你好", "spk_id": "中文女"}}, False),
    # elsewhere
    Bad("unknown-path", "GET", "/no/such/page", (404,)),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    env = {"TTS_API_KEYS": KEY, "TTS_RATE_LIMIT_PER_MINUTE": "0"}
    app = AppServer(tmp_path_factory.mktemp("bad-inputs"), tiny_bundle, env)
    app.start()
    yield app
    app.stop()
    app.dump_log()


@pytest.fixture(scope="module")
def client(server: AppServer) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def test_there_are_at_least_30_cases() -> None:
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


def assert_error_envelope(resp: httpx.Response, openai: bool) -> None:
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and err["message"], body
    assert set(err) == {"message", "type", "param", "code"}, f"not the error envelope: {body}"
    if openai:
        assert list(err) == ["message", "type", "param", "code"], f"not OpenAI's field order: {body}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_a_4xx_json_error(client: httpx.Client, case: Bad) -> None:
    kwargs = dict(case.kwargs)
    headers = {**(AUTH if case.auth else {}), **kwargs.pop("headers", {})}
    resp = client.request(case.method, case.path, headers=headers, **kwargs)
    assert resp.status_code in case.statuses, f"{case.id}: {resp.status_code} {resp.text[:300]}"
    assert_error_envelope(resp, openai=case.path.startswith("/v1"))
    if resp.status_code == 401:
        assert "www-authenticate" in resp.headers or case.path.startswith("/v1")


# Unusual but legal text: the server may speak it (200) or refuse it (4xx), never fail (5xx).
ODD_TEXTS = {
    "latin1-digit-accent": "0Íe",
    "accents": "Crème brûlée à 3€.",
    "combining-marks": "e\u0301e\u0301 a\u0308",
    "emoji": "你好😀👍🏽",
    "zwj-sequence": "👨\u200d👩\u200d👧",
    "zero-width": "\u200b\u200c\u200d\ufeff你好",
    "rtl": "\u202eمرحبا\u202c hello",
    "digits-only": "1" * 39,
    "punctuation-only": "。，！？…—",
    "math-symbols": "∑∫√∞ ≠ ≤ 2^10",
    "supplementary-plane": "\U0004fb69\U000beeb7 a",
    "private-use": "\ue000\uf8ff 你好",
    "mixed-scripts": "Hello 世界 Привет こんにちは 안녕",
    "url-and-email": "see https://example.com/a?b=1 or a@b.co",
    "date-time-money": "2024-02-29 23:59, ¥1,234.50, 50%",
    "repeated-punct": "!!!???...,,,;;;",
    "fullwidth": "ＡＢＣ１２３",
    "tabs-newlines": "第一行\n\n\t第二行\r\n",
}


@pytest.mark.parametrize("text", list(ODD_TEXTS.values()), ids=list(ODD_TEXTS))
def test_odd_text_is_spoken_or_refused_never_a_5xx(client: httpx.Client, text: str) -> None:
    resp = client.post("/tts", json={**GOOD_TTS, "text": text}, headers=AUTH)
    assert resp.status_code < 500, f"{text!r}: {resp.status_code} {resp.text[:300]}"
    if resp.status_code == 200:
        assert resp.content[:4] == b"RIFF" and len(resp.content) > 44
    else:
        assert_error_envelope(resp, openai=False)


def test_server_is_still_ready_and_serving_afterwards(client: httpx.Client, server: AppServer) -> None:
    # runs after the parametrized cases (file order)
    assert client.get("/readyz").status_code == 200
    resp = client.post("/tts", json=GOOD_TTS, headers=AUTH)
    assert resp.status_code == 200 and resp.content[:4] == b"RIFF"
    assert server.alive()
    assert "Traceback" not in server.log_text(), "an unhandled exception was logged"
