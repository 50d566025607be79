"""Clients for the lifecycle tests (tests/test_slow_clients.py, tests/test_drain.py): an HTTP request that sends only
half its body, a WebSocket speech session and a DashScope connection driven message by message."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

from servers import LOOPBACK, AppServer
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

STREAM_PATH = "/v1/audio/speech/stream"
DASHSCOPE_PATH = "/api-ws/v1/inference"
TTS_BODY = json.dumps({"text": "慢慢发送的请求。", "format": "pcm"}).encode()


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool  # the server closed the connection after the answer

    def json(self) -> dict[str, Any]:
        return dict(json.loads(self.body))


class HalfSentRequest:
    """A POST whose headers and the first half of its body are sent, and no more unless `finish()` is called.

    It asks `Expect: 100-continue`: uvicorn answers 100 only once the app reads the body, so when the constructor
    returns the request is past admission and its body is being read. No timing involved."""

    def __init__(self, port: int, path: str = "/tts", body: bytes = TTS_BODY, timeout_s: float = 30.0) -> None:
        self.body = body
        self.sock = socket.create_connection((LOOPBACK, port), timeout=timeout_s)
        head = f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\nContent-Type: application/json\r\n"
        self.sock.sendall(f"{head}Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        interim = self.sock.recv(1024)
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        self.sock.sendall(body[: len(body) // 2])

    def answer(self) -> RawAnswer:
        """Read the answer (it has a Content-Length); `closed` tells whether the server then closed the connection."""
        data = b""
        while b"\r\n\r\n" not in data:
            data += self._recv()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers["content-length"]):
            body += self._recv()
        try:
            closed = self.sock.recv(1) == b""
        except TimeoutError:
            closed = False
        return RawAnswer(int(lines[0].split()[1]), headers, body, closed)

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        assert chunk, "the server closed the connection without an answer"
        return chunk


def open_stream(app: AppServer, config: dict[str, Any] | None = None) -> ClientConnection:
    """A WebSocket speech session past its `ready` message."""
    ws = connect(f"ws://{LOOPBACK}:{app.port}{STREAM_PATH}", max_size=None, open_timeout=30)
    ws.send(json.dumps({"type": "config", "voice": "中文女", **(config or {})}))
    ready = json.loads(ws.recv(timeout=30))
    assert ready["type"] == "ready", ready
    return ws


def until_closed(ws: ClientConnection, timeout_s: float = 60.0) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Every message until the server closes: binary frames and JSON messages."""
    frames: list[bytes] = []
    messages: list[dict[str, Any]] = []
    try:
        while True:
            message = ws.recv(timeout=timeout_s)
            if isinstance(message, bytes):
                frames.append(message)
            else:
                messages.append(json.loads(message))
    except ConnectionClosed:
        pass
    return frames, messages


def close_of(ws: ClientConnection) -> tuple[int | None, dict[str, Any]]:
    """The close code and JSON reason the server closed with (after until_closed)."""
    return ws.close_code, json.loads(ws.close_reason or "{}")


def open_dashscope(app: AppServer) -> ClientConnection:
    return connect(f"ws://{LOOPBACK}:{app.port}{DASHSCOPE_PATH}", open_timeout=30, max_size=None)


def dashscope_message(action: str, task_id: str, **payload: Any) -> str:
    """A client message; run-task gets the SDK's task fields and PCM at 16 kHz in the voice 中文女."""
    if action == "run-task":
        parameters = {"voice": "中文女", "format": "pcm", "sample_rate": 16000}
        payload = {"model": "cosyvoice-v2", "task_group": "audio", "task": "tts", "function": "SpeechSynthesizer"} | {
            "parameters": parameters,
            "input": {},
        }
    header = {"action": action, "task_id": task_id, "streaming": "duplex"}
    return json.dumps({"header": header, "payload": payload})


def start_task(ws: ClientConnection, task_id: str) -> None:
    ws.send(dashscope_message("run-task", task_id))
    header = next_event(ws)["header"]
    assert header["event"] == "task-started", header


def next_event(ws: ClientConnection, timeout_s: float = 60.0) -> dict[str, Any]:
    """The next JSON event (audio frames before it are skipped)."""
    while isinstance(message := ws.recv(timeout=timeout_s), bytes):
        pass
    return dict(json.loads(message))
