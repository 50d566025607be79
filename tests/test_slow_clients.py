"""Clients that hold a connection and give no work (half a request body, idle WebSocket and DashScope sessions) against a
real server: as many of them as the server has places (TTS_CONCURRENT_REQUESTS + TTS_QUEUE_MAX) do not make anyone
else get 503, and the body timeout (408) and the idle timeout (4408) end them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gated_engine import FileGate
from lifecycle_clients import (
    HalfSentRequest,
    close_of,
    dashscope_message,
    next_event,
    open_dashscope,
    open_stream,
    start_task,
    until_closed,
)
from servers import AppServer

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")]

PLACES = 2  # TTS_CONCURRENT_REQUESTS + TTS_QUEUE_MAX below: the whole capacity of the server
APP_ENV = {
    "TTS_CONCURRENT_REQUESTS": "1",
    "TTS_QUEUE_MAX": "1",
    "TTS_RATE_LIMIT_PER_MINUTE": "0",
    "TTS_INTRA_OP_THREADS": "1",
}
IDLE_S = 1.0  # the strict server's TTS_WS_IDLE_TIMEOUT_S and TTS_BODY_TIMEOUT_S


@pytest.fixture(scope="module")
def patient(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    """The default body and idle timeouts (a minute or more): slow clients stay for the whole test."""
    app = AppServer(tmp_path_factory.mktemp("patient"), tiny_bundle, APP_ENV, name="patient")
    app.start()
    yield app
    app.stop()
    app.dump_log()


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    """Body and idle timeouts of IDLE_S, and a gated engine (open unless a test closes it: tests/gated_engine.py)."""
    env = APP_ENV | {"TTS_BODY_TIMEOUT_S": str(IDLE_S), "TTS_WS_IDLE_TIMEOUT_S": str(IDLE_S)}
    workdir = tmp_path_factory.mktemp("strict")
    app = AppServer(workdir, tiny_bundle, env, name="strict", gate=workdir / "gate")
    app.start()
    yield app
    app.stop()
    app.dump_log()


def speak(app: AppServer) -> httpx.Response:
    return httpx.post(app.base_url + "/tts", json={"text": "别人的请求。", "format": "pcm"}, timeout=60)


# ---- they hold no place -------------------------------------------------------------------------
def test_requests_sending_half_a_body_do_not_make_others_get_503(patient: AppServer) -> None:
    slow = [HalfSentRequest(patient.port) for _ in range(PLACES)]  # each past admission, its body half sent
    try:
        served = speak(patient)
        assert served.status_code == 200, served.text
        assert len(served.content) > 1000
    finally:
        for request in slow:
            request.close()


def test_idle_websocket_sessions_do_not_make_others_get_503_and_each_speaks_when_asked(patient: AppServer) -> None:
    sessions = [open_stream(patient) for _ in range(PLACES)]
    try:
        served = speak(patient)
        assert served.status_code == 200, served.text
        first = sessions[0]  # a place is taken for its sentence, and given back
        first.send(json.dumps({"type": "text", "text": "现在说话。"}))
        first.send(json.dumps({"type": "close"}))
        frames, messages = until_closed(first)
        assert frames and messages[-1]["type"] == "done" and first.close_code == 1000
        assert speak(patient).status_code == 200
    finally:
        for ws in sessions:
            ws.close()


def test_idle_dashscope_tasks_do_not_make_others_get_503_and_each_speaks_when_asked(patient: AppServer) -> None:
    connections = [open_dashscope(patient) for _ in range(PLACES)]
    try:
        for n, ws in enumerate(connections):
            start_task(ws, f"idle-{n}")
        served = speak(patient)
        assert served.status_code == 200, served.text
        first = connections[0]
        first.send(dashscope_message("continue-task", "idle-0", input={"text": "现在说话。"}))
        first.send(dashscope_message("finish-task", "idle-0", input={}))
        events = [next_event(first)["header"]["event"] for _ in range(3)]
        assert events == ["result-generated", "result-generated", "task-finished"]
        assert speak(patient).status_code == 200
    finally:
        for ws in connections:
            ws.close()


# ---- the timeouts end them ----------------------------------------------------------------------
def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_is_closed(strict: AppServer) -> None:
    request = HalfSentRequest(strict.port)
    try:
        answer = request.answer()
    finally:
        request.close()
    assert answer.status == 408 and answer.closed, answer
    error = answer.json()["error"]
    assert (error["code"], error["message"]) == (
        "request_timeout",
        f"the request body did not arrive within {IDLE_S:g} s (TTS_BODY_TIMEOUT_S)",
    )
    assert speak(strict).status_code == 200


def test_an_idle_websocket_session_is_closed_with_4408_but_not_while_it_is_spoken_to(strict: AppServer) -> None:
    assert strict.gate_path is not None
    gate = FileGate(strict.gate_path)
    ws = open_stream(strict)
    gate.clear()  # the sentence is held after its first chunk: it cannot end before the gate opens
    try:
        ws.send(json.dumps({"type": "text", "text": "这句话说得很慢。"}))
        ws.send(json.dumps({"type": "flush"}))
        assert isinstance(ws.recv(timeout=60), bytes)
        time.sleep(2 * IDLE_S)  # longer than the idle timeout, while its sentence is being spoken
    finally:
        gate.set()
    _, messages = until_closed(ws)
    assert [m["type"] for m in messages] == ["sentence_end", "error"], "the session was closed while it was spoken to"
    assert messages[-1]["error"]["code"] == "request_timeout"
    message = f"no message for {IDLE_S:g} s (TTS_WS_IDLE_TIMEOUT_S)"
    assert close_of(ws) == (4408, {"code": "request_timeout", "message": message})


def test_an_idle_dashscope_connection_is_closed_with_4408_and_its_task_fails(strict: AppServer) -> None:
    with_task, without = open_dashscope(strict), open_dashscope(strict)
    start_task(with_task, "sleepy")
    header = next_event(with_task)["header"]
    assert (header["event"], header["task_id"], header["attributes"]["code"]) == ("task-failed", "sleepy", "request_timeout")
    for ws in (with_task, without):
        until_closed(ws)
        code, reason = close_of(ws)
        assert code == 4408 and reason["code"] == "request_timeout", (code, reason)
