"""`x-request-id` on every answer: echoed when the client sent a sane one, else fresh; on errors, refusals, streams
and a 500 (in process); in the logs of the request, on gRPC (initial metadata) and the WebSocket handshake (a real
server with real clients)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from servers import AppServer, free_port, wait_until
from websockets.sync.client import connect

from service.api import create_app
from service.requestids import request_id
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.settings import Settings

KEY = "request-id-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRESH = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def app(tiny_bundle: Path) -> FastAPI:
    settings = Settings(
        _env_file=None, model_dir=tiny_bundle, intra_op_threads=1, rate_limit_per_minute=4, api_keys=KEY, max_body_bytes=2048
    )  # type: ignore[call-arg]
    app = create_app(settings)

    @app.get("/boom")
    async def boom() -> None:  # an unhandled error: the 500 is answered outside the middlewares
        raise RuntimeError("boom")

    return app


@pytest.fixture(scope="module")
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_a_sane_client_id_is_echoed_and_others_replaced() -> None:
    for sane in ("3f2a9c1e-7b4d-4e8a-9c2f-1a2b3c4d5e6f", "req_01HZX3", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"):
        assert request_id(sane) == sane
    for insane in (None, "", " spaced id", "a" * 129, "naïve", "line\nbreak", "-starts-with-dash", "x;y"):
        assert FRESH.fullmatch(request_id(insane)), insane


def test_every_http_answer_carries_the_id(client: TestClient) -> None:
    """LiveKit warned on every call: no x-request-id. Successes, streams, errors and refusals all carry it now."""
    answers = {
        "health": client.get("/healthz"),
        "whole": client.post("/tts", json={"text": "你好。"}, headers=AUTH),
        "stream": client.post("/tts", json={"text": "你好。", "stream": True}, headers=AUTH),
        "400": client.post("/tts", json={"text": 5}, headers=AUTH),
        "401": client.post("/tts", json={"text": "你好。"}),
        "404": client.get("/no/such/page"),
        "405": client.put("/tts", headers=AUTH),
        "413": client.post(
            "/tts", content=b'{"text": "' + b"a" * 4096 + b'"}', headers={**AUTH, "content-type": "application/json"}
        ),
        "500": client.get("/boom"),
    }
    for name, resp in answers.items():
        assert FRESH.fullmatch(resp.headers.get("x-request-id", "")), f"{name}: {resp.status_code} {dict(resp.headers)}"
    assert len({r.headers["x-request-id"] for r in answers.values()}) == len(answers)
    assert [answers[s].status_code for s in ("400", "401", "404", "405", "413", "500")] == [400, 401, 404, 405, 413, 500]
    for _ in range(5):  # the rate limit (4 a minute for this key) refuses at the door
        refused = client.post("/tts", json={"text": "你好。"}, headers={**AUTH, "x-request-id": "retry-7"})
    assert refused.status_code == 429 and refused.headers["x-request-id"] == "retry-7"


def test_the_clients_id_comes_back(client: TestClient) -> None:
    resp = client.get("/healthz", headers={"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    replaced = client.get("/healthz", headers={"x-request-id": "two words"})
    assert FRESH.fullmatch(replaced.headers["x-request-id"])


# ---- a real server: logs, gRPC, WebSocket --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[tuple[AppServer, int]]:
    grpc_port = free_port()
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_INTRA_OP_THREADS": "1", "TTS_GRPC_PORT": str(grpc_port)}
    app = AppServer(tmp_path_factory.mktemp("request-ids"), tiny_bundle, env, name="request-ids")
    app.start()
    yield app, grpc_port
    app.stop()
    app.dump_log()


@pytest.mark.integration
def test_the_id_is_in_the_access_line_and_the_synthesis_lines(server: tuple[AppServer, int]) -> None:
    app, _ = server
    resp = httpx.post(
        app.base_url + "/tts", json={"text": "日志里有编号。"}, headers={"x-request-id": "trace-http-41"}, timeout=60
    )
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-http-41"
    wait_until(lambda: '"POST /tts HTTP/1.1" 200 OK [trace-http-41]' in app.log_text(), 10, "the access line")
    assert re.search(r"service\.speech\.service \[trace-http-41\]: synthesized", app.log_text()), app.log_text()[-2000:]


@pytest.mark.integration
def test_grpc_returns_the_id_in_initial_metadata_and_logs_with_it(server: tuple[AppServer, int]) -> None:
    app, port = server
    request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id="中文女", tts_text="你好。"))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(
            request, metadata=(("x-request-id", "trace-grpc-42"),), timeout=60
        )
        assert b"".join(r.tts_audio for r in call)
        assert ("x-request-id", "trace-grpc-42") in tuple(call.initial_metadata())
        fresh = cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, timeout=60)
        list(fresh)
        assert FRESH.fullmatch(dict(fresh.initial_metadata())["x-request-id"])
    wait_until(lambda: "service.speech.service [trace-grpc-42]: synthesized" in app.log_text(), 10, "the synthesis line")


@pytest.mark.integration
def test_the_websocket_handshake_and_ready_message_carry_the_id(server: tuple[AppServer, int]) -> None:
    app, _ = server
    url = f"ws://127.0.0.1:{app.port}/v1/audio/speech/stream"
    with connect(url, additional_headers={"x-request-id": "trace-ws-43"}, open_timeout=30) as ws:
        assert ws.response is not None and ws.response.headers["x-request-id"] == "trace-ws-43"
        ws.send(json.dumps({"type": "config"}))
        assert json.loads(ws.recv(timeout=30))["request_id"] == "trace-ws-43"
