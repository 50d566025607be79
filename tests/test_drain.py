"""SIGTERM against a real server process with its gRPC port on: HTTP and gRPC refuse new work at the same moment, WebSocket
and DashScope sessions finish the sentence being spoken and close with 1001, a whole-file request still running at the
drain's deadline gets a 503 JSON (not a 500), and the process is gone within TTS_DRAIN_TIMEOUT_S plus a margin for
stopping the engine. The engine is held by tests/gated_engine.py, so nothing can end early on a fast machine."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from gated_engine import FileGate
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lifecycle_clients import close_of, dashscope_message, open_dashscope, open_stream, start_task, until_closed
from servers import AppServer, free_port, wait_until
from websockets.sync.client import ClientConnection

from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")]

EXIT_MARGIN_S = 4.0  # after the deadline: stopping the engine and the interpreter (uvicorn's own shutdown took 2x drain)
TWO_SENTENCES = "第一句话说得很慢。第二句话不会再说了。"


def start_server(tmp_path: Path, tiny_bundle: Path, drain_s: int, extra: dict[str, str] | None = None) -> tuple[AppServer, int]:
    grpc_port = free_port()
    env = {"TTS_GRPC_PORT": str(grpc_port), "TTS_DRAIN_TIMEOUT_S": str(drain_s), "TTS_RATE_LIMIT_PER_MINUTE": "0"}
    env |= {"TTS_INTRA_OP_THREADS": "1", "TTS_CONCURRENT_REQUESTS": "4"} | (extra or {})
    app = AppServer(tmp_path, tiny_bundle, env, name="drain", gate=tmp_path / "gate")
    app.start()
    return app, grpc_port


def terminate(app: AppServer) -> float:
    """SIGTERM; returns once the server has begun to drain, with the time of the signal."""
    assert app.proc is not None
    app.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_until(lambda: "Shutting down" in app.log_text(), 30, "the server to handle SIGTERM")
    return sent


def exit_time(app: AppServer, timeout_s: float) -> float:
    """Monotonic time by which the process had exited (inf when it had not within `timeout_s`)."""
    assert app.proc is not None
    try:
        app.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return float("inf")
    return time.monotonic()


def refuses_new_work(app: AppServer, grpc_port: int) -> tuple[bool, grpc.StatusCode | None]:
    """(HTTP refused a new connection, the status a new gRPC call got: UNAVAILABLE when it was refused)."""
    try:
        httpx.get(app.base_url + "/healthz", timeout=5)
        http_refused = False
    except httpx.ConnectError:
        http_refused = True
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
            code = None
        except grpc.RpcError as e:
            code = e.code()
    return http_refused, code


def first_audio(ws: ClientConnection) -> list[dict[str, Any]]:
    """Read until the first binary frame; the JSON messages before it."""
    before = []
    while not isinstance(message := ws.recv(timeout=60), bytes):
        before.append(json.loads(message))
    return before


def test_sessions_finish_their_sentence_then_close_1001_while_http_and_grpc_refuse_new_work(
    tmp_path: Path, tiny_bundle: Path
) -> None:
    drain_s = 60  # far beyond what the test needs: the sessions end the drain, not the deadline
    app, grpc_port = start_server(tmp_path, tiny_bundle, drain_s)
    gate = FileGate(tmp_path / "gate")
    try:
        stream, dashscope = open_stream(app), open_dashscope(app)
        start_task(dashscope, "draining")
        gate.clear()  # each sentence is held after its first chunk: none can end before the gate opens
        stream.send(json.dumps({"type": "text", "text": TWO_SENTENCES}))
        stream.send(json.dumps({"type": "flush"}))
        dashscope.send(dashscope_message("continue-task", "draining", input={"text": TWO_SENTENCES, "flush": True}))
        first_audio(stream)
        assert [e["payload"]["output"]["type"] for e in first_audio(dashscope)] == ["sentence-begin"]
        sent = terminate(app)
        http_refused, grpc_code = refuses_new_work(app, grpc_port)
    finally:
        gate.set()
    _, messages = until_closed(stream)
    assert [m["type"] for m in messages] == ["sentence_end"] and messages[0]["sentence"] == 0, messages
    assert close_of(stream) == (1001, {"code": "shutting_down", "message": "the server is shutting down; reconnect to continue"})
    _, events = until_closed(dashscope)
    assert [e["payload"].get("output", {}).get("type") or e["header"]["event"] for e in events] == ["sentence-end", "task-failed"]
    assert events[-1]["header"]["attributes"]["code"] == "shutting_down"
    assert close_of(dashscope)[0] == 1001
    assert http_refused and grpc_code is grpc.StatusCode.UNAVAILABLE, (http_refused, grpc_code)
    assert exit_time(app, drain_s) - sent < drain_s, "the drain did not end when its sessions had closed"


def test_a_whole_file_still_running_at_the_deadline_gets_503_and_the_process_exits_in_time(
    tmp_path: Path, tiny_bundle: Path
) -> None:
    drain_s = 6
    app, grpc_port = start_server(tmp_path, tiny_bundle, drain_s, {"TEST_GATE_RELEASES_CANCELLED": "1"})
    gate = FileGate(tmp_path / "gate")
    answers: dict[str, Any] = {}

    def whole_file() -> None:
        answers["http"] = httpx.post(app.base_url + "/tts", json={"text": TWO_SENTENCES, "format": "wav"}, timeout=120)

    def grpc_stream() -> None:
        request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id="中文女", tts_text=TWO_SENTENCES))
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            try:
                for _ in cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, timeout=120):
                    answers["grpc_audio"] = True
                answers["grpc"] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                answers["grpc"] = e.code()

    clients = [threading.Thread(target=whole_file, daemon=True), threading.Thread(target=grpc_stream, daemon=True)]
    gate.clear()  # both are held after their first chunk until the server cancels them at the deadline
    try:
        for client in clients:
            client.start()
        wait_until(lambda: running_jobs(app) >= 2 and "grpc_audio" in answers, 60, "both requests to be under way")
        sent = terminate(app)
        http_refused, grpc_code = refuses_new_work(app, grpc_port)
        for client in clients:
            client.join(drain_s + 30)
        exited = exit_time(app, drain_s + 30) - sent
    finally:
        gate.set()
    assert http_refused and grpc_code is grpc.StatusCode.UNAVAILABLE, (http_refused, grpc_code)
    answer = answers["http"]
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5", answer.text
    assert answer.json()["error"]["code"] == "shutting_down"
    assert answers["grpc"] is not grpc.StatusCode.OK, "the gRPC stream was not ended at the deadline"
    assert exited < drain_s + EXIT_MARGIN_S, f"the process exited {exited:.1f} s after SIGTERM (drain {drain_s} s)"


def running_jobs(app: AppServer) -> float:
    text = httpx.get(app.base_url + "/metrics", timeout=5).text
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("tts_jobs_running "))
