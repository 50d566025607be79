"""No route blocks the event loop: while a request waits on a held voice store or rate-limit store (a slow disk or
Redis, held by the test until it lets go), /healthz still answers. The precondition holds by construction: the test
asks /healthz only once the slow call has started, and lets it go only after /healthz answered (or gave up)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.api.deps import AppState
from service.settings import Settings

HEALTHZ_TIMEOUT_S = 20.0  # only reached when the loop is blocked (the held call never returns before the release)


class Held:
    """One slow dependency: each call announces itself (`entered`) and waits until the test opens `release`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("the test never released the held call")


class HeldVoiceStore:
    """A saved-voice store whose reads wait on the test (a slow directory or Redis)."""

    def __init__(self, inner: Any, held: Held) -> None:
        self._inner = inner
        self._held = held

    def get(self, name: str) -> Any:
        self._held.hold()
        return self._inner.get(name)

    def list(self) -> Any:
        self._held.hold()
        return self._inner.list()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class HeldRateLimiter:
    """Rate-limit counters in a remote store (Redis) whose round trip waits on the test."""

    remote = True

    def __init__(self, held: Held) -> None:
        self._held = held

    def hit(self, identity: str) -> None:
        self._held.hold()


@pytest.fixture(scope="module")
def client(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        model_dir=tiny_bundle,
        intra_op_threads=1,
        rate_limit_per_minute=0,
        voices_dir=tmp_path_factory.mktemp("voices"),
    )
    with TestClient(create_app(settings)) as c:
        yield c


def state_of(client: TestClient) -> AppState:
    state = client.app.state.tts  # type: ignore[attr-defined]
    assert isinstance(state, AppState)
    return state


def healthz_while_held(client: TestClient, held: Held, slow: Callable[[], object]) -> tuple[object, float]:
    """Start `slow` in a thread, wait until it is inside the held call, then time GET /healthz; release; return
    what `slow` returned and how long /healthz took while the held call was still waiting."""
    with ThreadPoolExecutor(2) as pool:
        slow_done: Future[object] = pool.submit(slow)
        try:
            assert held.entered.wait(30), "the request never reached the held store"
            started = time.monotonic()
            health = pool.submit(client.get, "/healthz")
            try:
                answer = health.result(timeout=HEALTHZ_TIMEOUT_S)
            except TimeoutError:
                pytest.fail(f"/healthz did not answer in {HEALTHZ_TIMEOUT_S:.0f} s: the event loop is blocked")
            elapsed = time.monotonic() - started
            assert not held.release.is_set(), "the held call must still be waiting while /healthz answers"
            assert answer.status_code == 200
        finally:
            held.release.set()
        return slow_done.result(timeout=60), elapsed


def with_held_store(client: TestClient) -> Iterator[Held]:
    voices = state_of(client).runtime.voices
    held, inner = Held(), voices.store
    voices.store = HeldVoiceStore(inner, held)  # type: ignore[assignment]
    try:
        yield held
    finally:
        voices.store = inner


@pytest.fixture
def held_store(client: TestClient) -> Iterator[Held]:
    yield from with_held_store(client)


@pytest.fixture
def held_rate_limit(client: TestClient) -> Iterator[Held]:
    runtime = state_of(client).runtime
    held, inner = Held(), runtime.rate_limit
    runtime.rate_limit = runtime.gate.rate_limit = HeldRateLimiter(held)  # type: ignore[assignment]
    try:
        yield held
    finally:
        runtime.rate_limit = runtime.gate.rate_limit = inner


# Each request reads the saved-voice store ("nobody" is no built-in speaker, so the store is asked) and then fails
# with a 4xx: the point is only where the read ran.
STORE_READERS: dict[str, Callable[[TestClient], Any]] = {
    "inference_instruct": lambda c: c.post(
        "/inference_instruct", data={"tts_text": "你好。", "spk_id": "nobody", "instruct_text": "A calm voice."}
    ),
    "tts": lambda c: c.post("/tts", json={"text": "你好。", "speaker": "nobody"}),
    "openai_speech": lambda c: c.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "nobody"}),
    "openai_instructions": lambda c: c.post(
        "/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "nobody", "instructions": "calm"}
    ),
    "voice_details": lambda c: c.get("/v1/voices/nobody"),
    "voice_list": lambda c: c.get("/v1/voices"),
    "audio_voices": lambda c: c.get("/v1/audio/voices"),
}


@pytest.mark.parametrize("route", STORE_READERS)
def test_a_slow_voice_store_does_not_stall_other_requests(client: TestClient, held_store: Held, route: str) -> None:
    response, elapsed = healthz_while_held(client, held_store, lambda: STORE_READERS[route](client))
    print(f"{route}: /healthz answered in {elapsed * 1000:.1f} ms while the store was held")
    assert response.status_code in (200, 400, 404), response.text  # type: ignore[attr-defined]


def websocket_config(client: TestClient, voice: str) -> dict[str, Any]:
    """Open the speech WebSocket, send the config message, return the first JSON answer (ready or error)."""
    with client.websocket_connect("/v1/audio/speech/stream") as ws:
        ws.send_text(json.dumps({"type": "config", "voice": voice}))
        return dict(ws.receive_json())


def test_a_slow_voice_store_does_not_stall_the_websocket_config(client: TestClient, held_store: Held) -> None:
    answer, _ = healthz_while_held(client, held_store, lambda: websocket_config(client, "nobody"))
    assert answer["type"] == "error" and answer["error"]["code"] == "unknown_speaker", answer  # type: ignore[index]


def test_a_slow_rate_limit_store_does_not_stall_the_websocket_admission(client: TestClient, held_rate_limit: Held) -> None:
    answer, _ = healthz_while_held(client, held_rate_limit, lambda: websocket_config(client, "中文女"))
    assert answer["type"] == "ready", answer  # type: ignore[index]


def test_a_slow_rate_limit_store_does_not_stall_http_admission(client: TestClient, held_rate_limit: Held) -> None:
    response, _ = healthz_while_held(
        client, held_rate_limit, lambda: client.post("/tts", json={"text": "你好。", "format": "pcm"})
    )
    assert response.status_code == 200  # type: ignore[attr-defined]


def dashscope_run_task(client: TestClient, voice: str) -> dict[str, Any]:
    """Open the DashScope WebSocket, send run-task, return the first event's header (task-started or task-failed)."""
    payload = {"model": "cosyvoice-v2", "task_group": "audio", "task": "tts", "function": "SpeechSynthesizer"}
    params = {"voice": voice, "format": "pcm", "sample_rate": 16000}
    message = {
        "header": {"action": "run-task", "task_id": "t1", "streaming": "duplex"},
        "payload": payload | {"parameters": params, "input": {}},
    }
    with client.websocket_connect("/api-ws/v1/inference") as ws:
        ws.send_text(json.dumps(message))
        return dict(ws.receive_json()["header"])


def test_a_slow_rate_limit_store_does_not_stall_the_dashscope_admission(client: TestClient, held_rate_limit: Held) -> None:
    header, _ = healthz_while_held(client, held_rate_limit, lambda: dashscope_run_task(client, "中文女"))
    assert header["event"] == "task-started", header  # type: ignore[index]


def test_a_slow_voice_store_does_not_stall_the_dashscope_task(client: TestClient, held_store: Held) -> None:
    header, _ = healthz_while_held(client, held_store, lambda: dashscope_run_task(client, "nobody"))
    assert header["event"] == "task-failed", header  # type: ignore[index]
