"""Access control and isolation: API keys, rate limits, trusted proxies, fail-soft Redis, two apps per process."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from servers import free_port
from starlette.requests import Request
from starlette.websockets import WebSocketDisconnect

from service.access import ClientIdentity
from service.api import create_app
from service.api.auth import caller_of
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.settings import Settings

KEY = "test-key-0123456789"
OTHER_KEY = "other-key-987654321"


def make_settings(bundle: Path, **overrides: object) -> Settings:
    base: dict[str, object] = {"model_dir": bundle, "intra_op_threads": 1, "rate_limit_per_minute": 0}
    return Settings(_env_file=None, **(base | overrides))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def keyed(tiny_bundle: Path) -> Iterator[TestClient]:
    settings = make_settings(tiny_bundle, api_keys=f"{KEY},{OTHER_KEY}", rate_limit_per_minute=3)
    with TestClient(create_app(settings)) as client:
        yield client


def tts(client: TestClient, headers: dict[str, str], text: str = "你好。") -> int:
    return client.post("/tts", json={"text": text, "format": "pcm"}, headers=headers).status_code


def test_keys_are_required_on_synthesis_and_v1_but_not_on_health(keyed: TestClient) -> None:
    missing = keyed.post("/tts", json={"text": "你好。"})
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert missing.json()["error"]["code"] == "unauthorized"
    wrong = keyed.get("/v1/models", headers={"Authorization": "Bearer not-a-valid-key"})
    assert wrong.status_code == 401 and set(wrong.json()["error"]) == {"message", "type", "param", "code"}
    assert keyed.get("/healthz").status_code == 200 and keyed.get("/readyz").status_code == 200
    assert keyed.get("/metrics").status_code == 200


def test_bearer_works_everywhere_and_x_api_key_outside_v1(keyed: TestClient) -> None:
    bearer, x_key = {"Authorization": f"Bearer {OTHER_KEY}"}, {"X-API-Key": OTHER_KEY}
    assert keyed.get("/v1/audio/voices", headers=bearer).status_code == 200
    assert keyed.get("/v1/lexicon", headers=x_key).status_code == 401, "OpenAI routes take Bearer only"
    sft = keyed.request("GET", "/inference_sft", data={"tts_text": "你好", "spk_id": "中文女"}, headers=x_key)
    assert sft.status_code == 200


LISTINGS = ["/v1/models", "/v1/models/tts-1", "/v1/audio/models", "/v1/audio/voices"]


@pytest.mark.parametrize("path", LISTINGS)
def test_model_and_voice_lists_are_public_by_default_but_synthesis_is_not(keyed: TestClient, path: str) -> None:
    resp = keyed.get(path)
    assert resp.status_code == 200, resp.text
    assert keyed.get(path, headers={"Authorization": "Bearer not-a-valid-key"}).status_code == 401, "a wrong key is still wrong"
    speech = keyed.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "alloy"})
    assert speech.status_code == 401 and speech.json()["error"]["code"] == "unauthorized"
    assert keyed.get("/v1/lexicon").status_code == 401


def test_model_and_voice_lists_need_a_key_when_not_public(tiny_bundle: Path) -> None:
    settings = make_settings(tiny_bundle, api_keys=KEY, public_model_list=False)
    with TestClient(create_app(settings)) as client:
        for path in LISTINGS:
            resp = client.get(path)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthorized", path
            assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path


def test_rate_limit_is_per_key_with_retry_after(keyed: TestClient) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses = [tts(keyed, headers, f"第{i}次。") for i in range(3)]
    assert statuses == [200, 200, 200]
    refused = keyed.post("/tts", json={"text": "再来。"}, headers=headers)
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.json()["error"]["code"] == "rate_limited"
    v1 = keyed.post("/v1/audio/speech", json={"model": "tts-1", "input": "hi", "voice": "alloy"}, headers=headers)
    assert v1.status_code == 429 and v1.json()["error"]["type"] == "rate_limit_error", "limits are shared by all routes"
    # a key with budget left is not affected, and a refused request never reaches the engine
    assert keyed.get("/v1/models", headers=headers).status_code == 200, "listing is not rate limited"


def _request(peer: str, forwarded: str | None = None, headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if forwarded is not None:
        raw.append((b"x-forwarded-for", forwarded.encode()))
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw, "client": (peer, 1234), "query_string": b""})


def test_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    identity = ClientIdentity(["10.0.0.0/8", "192.168.1.5"], keys_enabled=False)
    assert identity(caller_of(_request("203.0.113.9", "1.2.3.4"))) == "ip:203.0.113.9", "untrusted peer: header ignored"
    assert identity(caller_of(_request("10.1.2.3", "1.2.3.4"))) == "ip:1.2.3.4"
    assert identity(caller_of(_request("10.1.2.3", "6.6.6.6, 1.2.3.4, 192.168.1.5"))) == "ip:1.2.3.4", "right-most untrusted hop"
    assert identity(caller_of(_request("10.1.2.3"))) == "ip:10.1.2.3"


def test_rate_limit_identity_is_the_key_only_when_keys_are_on() -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with_keys = ClientIdentity([], keys_enabled=True)(caller_of(_request("1.1.1.1", headers=headers)))
    assert with_keys.startswith("key:") and KEY not in with_keys
    assert ClientIdentity([], keys_enabled=False)(caller_of(_request("1.1.1.1", headers=headers))) == "ip:1.1.1.1"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_redis_degrades_readiness_but_requests_succeed(tiny_bundle: Path) -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    settings = make_settings(tiny_bundle, redis_url=url, rate_limit_per_minute=100)
    with TestClient(create_app(settings)) as client:
        for _ in range(2):
            resp = client.post("/tts", json={"text": "没有缓存。", "seed": 1})
            assert resp.status_code == 200 and resp.headers["x-cache"] == "miss"
        metrics = client.get("/metrics").text
        errors = [line for line in metrics.splitlines() if line.startswith("tts_cache_errors_total ")]
        assert errors and float(errors[0].split()[1]) >= 1, "the Redis failure must be counted"
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded" and ready.json()["cache"] == "redis: down"


def test_two_apps_in_one_process_keep_separate_state_and_metrics(tiny_bundle: Path) -> None:
    first = TestClient(create_app(make_settings(tiny_bundle)))
    second = TestClient(create_app(make_settings(tiny_bundle, rate_limit_per_minute=1)))
    with first, second:
        for _ in range(3):
            assert first.get("/healthz").status_code == 200
        line = 'tts_requests_total{method="GET",route="/healthz",status="200"}'
        assert f"{line} 3.0" in first.get("/metrics").text
        assert line not in second.get("/metrics").text
        assert tts(second, {}) == 200 and tts(second, {}) == 429
        assert tts(first, {}) == 200, "the other app's limit must not apply"


def test_unknown_tts_variables_are_reported_at_start(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TTS_MODLE_DIR", "typo")
    with caplog.at_level(logging.WARNING, logger="service.api.app"):
        create_app(make_settings(tiny_bundle))
    assert any("TTS_MODLE_DIR" in r.getMessage() for r in caplog.records)


def test_a_random_weight_model_is_announced_at_start(tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="service.runtime"), TestClient(create_app(make_settings(tiny_bundle))):
        pass
    assert any("random weights: its audio is noise" in r.getMessage() for r in caplog.records)


ADMIN_ONLY = "admin-only-key-0123"
RUN_TASK = {
    "header": {"action": "run-task", "task_id": "a1", "streaming": "duplex"},
    "payload": {"model": "cosyvoice-v2", "parameters": {"voice": "中文女", "format": "pcm"}, "input": {}},
}


def _websocket_answer(
    client: TestClient, path: str, first: dict[str, Any], headers: dict[str, str], *, refused: bool
) -> tuple[Any, int | None]:
    """The first JSON the server answers `first` with, and, when `refused`, the close code that follows."""
    with client.websocket_connect(path, headers=headers) as ws:
        ws.send_text(json.dumps(first))
        answer = ws.receive_json()
        if not refused:
            return answer, None
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        return answer, closed.value.code


def _grpc_status(port: int, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id="中文女", tts_text="你好。"))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            audio = b"".join(r.tts_audio for r in cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, metadata=metadata))
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    assert audio
    return grpc.StatusCode.OK


def test_admin_keys_alone_turn_keys_on_for_every_transport(
    tiny_bundle: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only TTS_ADMIN_API_KEYS set: synthesis and transcripts were open to anyone on every transport, and nothing was
    said at start. Admin keys alone now turn keys on; an admin key works everywhere; the start says what is protected."""
    port = free_port()
    settings = make_settings(tiny_bundle, admin_api_keys=ADMIN_ONLY, grpc_port=port, host="127.0.0.1", voices_dir=tmp_path)
    admin = {"Authorization": f"Bearer {ADMIN_ONLY}"}
    with caplog.at_level(logging.INFO, logger="service.runtime"), TestClient(create_app(settings)) as client:
        assert tts(client, {}) == 401 and tts(client, admin) == 200
        speech = {"model": "tts-1", "input": "hi", "voice": "alloy", "response_format": "pcm"}
        assert client.post("/v1/audio/speech", json=speech).status_code == 401
        assert client.post("/v1/audio/speech", json=speech, headers=admin).status_code == 200
        assert client.get("/v1/voices/someone").status_code == 401, "a voice's transcript needs a key"
        assert client.get("/v1/lexicon").status_code == 401 and client.get("/v1/lexicon", headers=admin).status_code == 200
        stream = "/v1/audio/speech/stream"
        refused, code = _websocket_answer(client, stream, {"type": "config"}, {}, refused=True)
        assert (refused["error"]["code"], code) == ("unauthorized", 4401)
        ready, _ = _websocket_answer(client, stream, {"type": "config"}, admin, refused=False)
        assert ready["type"] == "ready"
        failed, code = _websocket_answer(client, "/api-ws/v1/inference", RUN_TASK, {}, refused=True)
        assert (failed["header"]["error_code"], code) == ("InvalidApiKey", 4401)
        started, _ = _websocket_answer(client, "/api-ws/v1/inference", RUN_TASK, admin, refused=False)
        assert started["header"]["event"] == "task-started"
        assert _grpc_status(port, ()) is grpc.StatusCode.UNAUTHENTICATED
        assert _grpc_status(port, (("authorization", f"Bearer {ADMIN_ONLY}"),)) is grpc.StatusCode.OK
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("API keys are")]
    assert said and "API keys are on (0 user and 1 admin keys)" in said[0] and "gRPC" in said[0], said


def test_without_any_key_the_start_says_everything_is_open(tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="service.runtime"), TestClient(create_app(make_settings(tiny_bundle))):
        pass
    assert any(r.getMessage().startswith("API keys are off") for r in caplog.records)
