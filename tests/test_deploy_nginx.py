"""Real nginx (nginx/nginx.conf) in front of two app processes sharing a real Redis: streaming, faults, drain."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_servers import LoadDriver, NginxServer, Outcome, drain_timeout_s, mixed_texts, start_apps, tts_request
from gated_engine import FileGate
from servers import AppServer, RedisServer, running_apps, wait_until  # redis_server: conftest.py

pytestmark = pytest.mark.integration

APP_ENV = {
    "TTS_INTRA_OP_THREADS": "1",  # two replicas x 1 thread on a 2-core machine
    "TTS_TRUSTED_PROXIES": "127.0.0.1/32",
    "TTS_RATE_LIMIT_PER_MINUTE": "100000",  # on (kept in Redis) but never reached by these tests
}
LONG_TEXT = "第一句话在这里。第二句话也在这里。第三句话还在这里。第四句话就在这里。第五句话最后在这里。第六句话真的结束了。"
DRAIN_TIMEOUT_S = drain_timeout_s(APP_ENV)  # the apps' TTS_DRAIN_TIMEOUT_S (the default unless APP_ENV sets it)


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path, redis_server: RedisServer) -> Iterator[list[AppServer]]:
    workdir = tmp_path_factory.mktemp("apps")
    env = {**APP_ENV, "TTS_REDIS_URL": redis_server.url}
    # both behind one gate file (open unless a test closes it): see test_stream_arrives_unbuffered_through_nginx
    pair = [AppServer(workdir, tiny_bundle, env, name=name, gate=workdir / "gate") for name in ("app-a", "app-b")]
    with running_apps(pair, start_apps):
        yield pair


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory, apps: list[AppServer]) -> Iterator[NginxServer]:
    server = NginxServer(tmp_path_factory.mktemp("nginx"), [app.port for app in apps])
    server.start()
    yield server
    server.stop()
    print(server.error_log())


def test_stream_arrives_unbuffered_through_nginx(nginx: NginxServer, apps: list[AppServer]) -> None:
    """The first audio must reach the client while the replica is still holding the rest of the stream.

    The replicas' engines stop after each chunk while the gate is closed, so the stream cannot end before the test
    opens it: the check holds by construction on a machine of any speed (a wall-clock bound on the tiny model's
    stream did not, on a fast host)."""
    assert apps[0].gate_path is not None
    gate = FileGate(apps[0].gate_path)
    body = {"text": LONG_TEXT * 2, "format": "pcm", "stream": True, "seed": 3}
    gate.clear()
    try:
        with httpx.stream("POST", nginx.base_url + "/tts", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            assert "content-length" not in response.headers
            assert response.headers.get("transfer-encoding") == "chunked"
            pieces = response.iter_raw()
            held = len(next(pieces))  # nginx passed it on while the replica waits before its second chunk
            gate.set()
            rest = [len(piece) for piece in pieces]
    finally:
        gate.set()
    print(f"{held} bytes before the gate opened, then {sum(rest)} bytes in {len(rest)} reads")
    assert held > 0 and rest, "the stream should go on after the gate opens"
    assert sum(rest) > held, "most of the audio comes after the first chunk"


def test_metrics_are_not_public_and_big_bodies_stop_at_nginx(nginx: NginxServer, apps: list[AppServer]) -> None:
    assert httpx.get(nginx.base_url + "/metrics", timeout=10).status_code == 403
    assert httpx.get(apps[0].base_url + "/metrics", timeout=10).status_code == 200
    assert httpx.get(nginx.base_url + "/healthz", timeout=10).json() == {"status": "ok"}
    too_big = {"text": "长" * 40_000}  # 120 KB of UTF-8, over client_max_body_size 64k
    response = httpx.post(nginx.base_url + "/tts", json=too_big, timeout=10)
    assert response.status_code == 413
    assert "nginx" in response.text.lower(), "the body should have been refused by nginx, not by a replica"


def test_per_ip_limit_answers_429_with_retry_after(nginx: NginxServer) -> None:
    with httpx.Client(base_url=nginx.base_url, timeout=10) as client:
        answers = [client.get("/healthz") for _ in range(60)]  # > rate 10/s + burst 20, in well under a second
    limited = [r for r in answers if r.status_code == 429]
    assert {r.status_code for r in answers} == {200, 429}
    assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "rate_limited" for r in limited)
    time.sleep(2.5)  # the bucket refills at 10/s: leave it full for the next tests


def test_redis_stopped_under_load_fails_no_request(nginx: NginxServer, redis_server: RedisServer, apps: list[AppServer]) -> None:
    driver = LoadDriver(nginx.base_url, 4, lambda i: tts_request(i % 2 == 0, mixed_texts(f"红{i}"))).start()
    result = driver.result
    try:
        result.wait_completed_after(time.monotonic(), 2)
        t_down = time.monotonic()
        redis_server.kill()
        result.wait_completed_after(t_down, 4)
        readiness = httpx.get(apps[0].base_url + "/readyz", timeout=30)
    finally:
        redis_server.start()
    result.wait_completed_after(time.monotonic(), 2)
    driver.stop()
    print(result.summary(), f"; {len(result.completed_after(t_down))} succeeded after Redis went down")
    assert result.failures() == []
    assert readiness.status_code == 200 and readiness.json()["status"] == "degraded"


def test_killed_replica_fails_no_request_that_had_not_started(nginx: NginxServer, apps: list[AppServer]) -> None:
    victim = apps[1]
    driver = LoadDriver(nginx.base_url, 4, lambda i: tts_request(i % 2 == 0, mixed_texts(f"杀{i}"))).start()
    result = driver.result
    try:
        result.wait_completed_after(time.monotonic(), 6)  # both replicas busy
        t_kill = time.monotonic()
        victim.kill()
        result.wait_completed_after(t_kill, 6)  # the surviving replica carries the load
    finally:
        driver.stop()
        start_apps([victim])  # back to two replicas for the next test
        rejoin(nginx, victim)
    handed_over = [line for line in nginx.error_log().splitlines() if f"127.0.0.1:{victim.port}" in line and "[error]" in line]
    print(result.summary(), f"; {len(handed_over)} nginx upstream errors for the killed replica:", *handed_over[:4], sep="\n")
    assert [o for o in result.failures() if not o.started] == []
    assert handed_over, "nginx never saw the killed replica fail: the test did not exercise the hand-over"


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(nginx: NginxServer, apps: list[AppServer]) -> None:
    target = apps[0]
    assert target.gate_path is not None
    gate = FileGate(target.gate_path)
    # One stream under way and one queued behind it (TTS_CONCURRENT_REQUESTS=1): both were accepted before SIGTERM.
    # The closed gate holds the first stream after its first chunk, so neither can end before SIGTERM on any machine.
    streams = [
        StreamReader(target.base_url, "四句话的流。" + LONG_TEXT[:24]),
        StreamReader(target.base_url, "排队的请求。" + LONG_TEXT[:8]),
    ]
    gate.clear()
    try:
        for stream in streams:
            stream.thread.start()
            time.sleep(0.05)
        wait_until(lambda: streams[0].first_byte.is_set() or streams[0].done.is_set(), 30, "first bytes of the stream")
        # On a loaded machine the second client may not have connected yet: SIGTERM only once the app holds both.
        wait_until(lambda: jobs_accepted(target.base_url) >= 2 or streams[1].done.is_set(), 30, "the queued request to arrive")
        driver = LoadDriver(nginx.base_url, 2, lambda i: tts_request(i % 2 == 0, mixed_texts(f"停{i}"))).start()
        assert target.proc is not None
        target.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        assert not any(s.done.is_set() for s in streams), f"a stream ended before SIGTERM: {[s.outcome for s in streams]}"
    finally:
        gate.set()
    # Requests sent between the signal and its handling are still served; after "Shutting down" none may be.
    wait_until(lambda: "Shutting down" in target.log_text(), 10, "uvicorn to handle SIGTERM")
    time.sleep(0.2)
    refused = new_request_refused(target.base_url)
    for stream in streams:
        stream.thread.join(DRAIN_TIMEOUT_S + 5)
    exited = wait_exit(target, DRAIN_TIMEOUT_S + 5) - t_term
    driver.result.wait_completed_after(time.monotonic(), 2)  # the other replica serves new requests
    result = driver.stop()
    print(f"streams: {[s.outcome for s in streams]}; exit {exited:.1f} s after SIGTERM; nginx load: {result.summary()}")
    assert refused, "a new request was accepted after SIGTERM had been handled"
    assert all(s.outcome is not None and s.outcome.ok and s.outcome.n_bytes > 22_050 for s in streams)
    assert all(s.outcome is not None and s.outcome.t_end - t_term < DRAIN_TIMEOUT_S for s in streams)
    assert exited < DRAIN_TIMEOUT_S + 5
    assert result.failures() == [], "requests through nginx should have moved to the other replica"


def rejoin(nginx: NginxServer, app: AppServer, timeout_s: float = 40.0) -> None:
    """Send requests through nginx until the restarted `app` has answered one. nginx keeps a replica that failed
    out of the group until fail_timeout has passed and then a request to it has succeeded; without this the next
    test could find only one replica in the group (and none once it stops that one)."""

    def served() -> int:
        return app.log_text(tail_chars=1 << 30).count('"GET /healthz HTTP/1.1" 200')

    before = served()

    def answered() -> bool:
        httpx.get(nginx.base_url + "/healthz", timeout=5)
        return served() > before

    wait_until(answered, timeout_s, f"nginx to route to {app.name} again", interval_s=0.25)


class StreamReader:
    """One streaming request in a background thread; `first_byte` is set when the first audio arrives."""

    def __init__(self, base_url: str, text: str) -> None:
        self.first_byte = threading.Event()
        self.done = threading.Event()
        self.outcome: Outcome | None = None
        self._url, self._text = base_url + "/tts", text
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        out = Outcome("stream", time.monotonic())
        try:
            body = {"text": self._text, "format": "pcm", "stream": True, "seed": 5}
            with httpx.stream("POST", self._url, json=body, timeout=60) as response:
                out.status, out.started = response.status_code, response.status_code == 200
                for chunk in response.iter_bytes():
                    out.n_bytes += len(chunk)
                    self.first_byte.set()
        except httpx.HTTPError as e:
            out.error = f"{type(e).__name__}: {e}"
        out.t_end = time.monotonic()
        self.outcome = out
        self.done.set()


def jobs_accepted(base_url: str) -> float:
    """Synthesis jobs the app holds (running on a worker or queued for one), from its /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("tts_queue_depth ", "tts_jobs_running ")):
            total += float(line.split()[1])
    return total


def new_request_refused(base_url: str) -> bool:
    """True when a new request to a draining app is refused (connection refused, or 503 with Retry-After)."""
    try:
        response = httpx.post(base_url + "/tts", json={"text": "新的请求。"}, timeout=5)
    except httpx.ConnectError:
        return True
    return response.status_code == 503 and "retry-after" in response.headers


def wait_exit(app: AppServer, timeout_s: float) -> float:
    """Monotonic time at which the process had exited (inf if it did not within `timeout_s`)."""
    assert app.proc is not None
    try:
        app.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return float("inf")
    return time.monotonic()


def test_websocket_stream_passes_through_nginx(nginx: NginxServer) -> None:
    """The upgrade reaches a replica and audio frames come back through the proxy, before the client closes."""
    import json

    from websockets.sync.client import connect

    url = nginx.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    with connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "config", "voice": "中文女"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        ws.send(json.dumps({"type": "text", "text": "第一句话在这里。第二"}))
        assert isinstance(ws.recv(timeout=60), bytes)  # audio of the first sentence while the second is unfinished


def test_grpc_passes_through_nginx_grpc_conf(tmp_path: Path, tiny_bundle: Path) -> None:
    """nginx/grpc.conf (only its `server` lines and `listen` port replaced) in front of a replica's gRPC port: the
    official-style client gets audio, and health answers SERVING, through nginx."""
    import re

    import grpc
    from deploy_servers import main_config, nginx_binary
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from servers import ManagedProcess, free_port, port_open

    from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc

    grpc_port, listen = free_port(), free_port()
    app = AppServer(tmp_path, tiny_bundle, {"TTS_GRPC_PORT": str(grpc_port), "TTS_INTRA_OP_THREADS": "1"}, name="grpc-app")
    conf = (Path(__file__).resolve().parents[1] / "nginx" / "grpc.conf").read_text(encoding="utf-8")
    conf, n_servers = re.subn(r"server app-\d+:50000", f"server 127.0.0.1:{grpc_port}", conf)
    conf, n_listen = re.subn(r"listen 50051 http2;", f"listen 127.0.0.1:{listen} http2;", conf)
    assert (n_servers, n_listen) == (2, 1)
    site = tmp_path / "grpc-site.conf"
    site.write_text(conf, encoding="utf-8")
    main = tmp_path / "nginx.conf"
    main.write_text(main_config(tmp_path, site), encoding="utf-8")
    proxy = ManagedProcess("nginx-grpc", [nginx_binary(), "-p", str(tmp_path), "-c", str(main)], tmp_path / "nginx.log")
    app.start()
    proxy.start()
    try:
        wait_until(lambda: port_open(listen), 15, "nginx gRPC listener")
        with grpc.insecure_channel(f"127.0.0.1:{listen}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            request = cosyvoice_pb2.Request()
            request.sft_request.spk_id = "中文女"
            request.sft_request.tts_text = "你好，我是通义千问语音合成大模型。"
            audio = b"".join(r.tts_audio for r in cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, timeout=60))
        assert len(audio) > 22050 and len(audio) % 2 == 0
    finally:
        proxy.stop()
        app.stop()
