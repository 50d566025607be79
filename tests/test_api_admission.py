"""Admission: 401/429/503 from headers alone (no body read, error-table bodies), in-flight requests count against
capacity from the moment their body is in (a request still sending holds no place), other routes pass, and a request
let through still meets every check of its route exactly once."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from servers import metric_value
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import create_app
from service.api.admission import AdmissionMiddleware, SlotMiddleware, synthesis_routes
from service.api.app import ROUTERS
from service.api.bodylimit import BodyLimitMiddleware
from service.api.deps import AppState
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions
from service.errors import OverloadedError
from service.families.cosyvoice1.voice import Voice
from service.families.model import NamedVoice
from service.frontend import Sentence
from service.settings import Settings
from service.speech.request import SpeechRequest
from service.speech.service import TTSService
from service.stores.audio_cache import MemoryAudioCache

KEY = "admission-key-0123"
SPEAKER = "中文女"
PEER = "198.51.100.1"


class OneSentence:
    """A text frontend that turns any text into one sentence of three token ids."""

    lexicon_version = "0"

    def sentences(self, text: str) -> list[Sentence]:
        return [Sentence(text, (1, 2, 3))]


class HeldEngine:
    """An engine whose synthesis holds its worker until `release` is set, then yields 0.1 s of silence."""

    sample_rate = 22050
    speakers: Sequence[str] = (SPEAKER,)

    def voice(self, speaker: str) -> Voice:
        return Voice.builtin(speaker, np.ones(192, np.float32))

    def __init__(self) -> None:
        self.release = threading.Event()

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        assert self.release.wait(timeout=30), "the test never released the engine"
        yield AudioChunk(np.zeros(2205, dtype=np.float32), 0, True, StageTimings(0.0, 0.0, 0.0))


@dataclass
class Inner:
    """The app behind the middleware: records the paths it saw; holds each request while `hold` is set."""

    seen: list[str] = field(default_factory=list)
    hold: asyncio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append(scope["path"])
        if self.hold is not None:
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    body_read: bool

    def json(self) -> dict[str, dict[str, object]]:
        return dict(json.loads(self.body))


def state_for(**overrides: object) -> AppState:
    """The AppState (keys, rate limit, metrics) create_app wires from these settings; no model loaded."""
    settings = Settings(_env_file=None, **({"model_dir": "models/tiny", "rate_limit_per_minute": 0} | overrides))  # type: ignore[call-arg, arg-type]
    state = create_app(settings).state.tts
    assert isinstance(state, AppState)
    return state


def middleware(state: AppState, inner: Inner) -> ASGIApp:
    """The app's admission layers around `inner`, as create_app stacks them: the header checks, the body limit, the
    place taken once the body is in."""
    s = state.settings
    body = BodyLimitMiddleware(SlotMiddleware(inner, state), s.max_body_bytes, s.max_upload_bytes, timeout_s=s.body_timeout_s)
    return AdmissionMiddleware(body, state, synthesis_routes(*ROUTERS))


Body = Callable[[], Awaitable[Message]]


async def call(
    app: ASGIApp,
    path: str,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    peer: str = PEER,
    body: Body | None = None,
) -> Answer:
    """One request straight into the ASGI app; `body_read` tells whether anything asked for the body. `body`: what
    each read of the body returns (default: the whole body at once)."""
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    scope: Scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http"}
    scope.update(path=path, raw_path=path.encode(), root_path="", query_string=b"", headers=raw)
    scope.update(client=(peer, 40000), server=("127.0.0.1", 8000), state={})
    sent: list[Message] = []
    read: list[bool] = []

    async def receive() -> Message:
        read.append(True)
        return await body() if body is not None else {"type": "http.request", "body": b'{"text": "hi"}', "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    headers_out = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return Answer(start["status"], headers_out, body, bool(read))


ServiceFactory = Callable[..., TTSService]


@pytest.fixture
def service_for() -> Iterator[ServiceFactory]:
    """Builds TTSServices over one HeldEngine; afterwards releases the engine and closes them."""
    engine, services = HeldEngine(), []

    def build(workers: int = 1, queue_max: int = 0, retry_after_s: int = 7) -> TTSService:
        service = TTSService(
            OneSentence(), engine, MemoryAudioCache(0), bundle_sha256="0" * 64,
            concurrency=workers, queue_max=queue_max, retry_after_s=retry_after_s,
        )  # fmt: skip
        services.append(service)
        return service

    yield build
    engine.release.set()
    for service in services:
        service.close()


def fill_queue(service: TTSService) -> None:
    for n in range(service.capacity):
        service.submit(SpeechRequest(f"第{n}个。", NamedVoice(SPEAKER)))
    assert service.queue_full()


def test_a_full_queue_is_refused_without_reading_the_body_with_the_error_table_bodies(service_for: ServiceFactory) -> None:
    state, inner = state_for(), Inner()
    state.service = service = service_for()
    fill_queue(service)
    app = middleware(state, inner)
    native = asyncio.run(call(app, "/tts"))
    openai_shape = asyncio.run(call(app, "/v1/audio/speech"))
    official = asyncio.run(call(app, "/inference_sft", method="GET"))
    message = "all 1 synthesis slots are busy and the queue is full; retry shortly"
    for answer in (native, openai_shape, official):
        assert (answer.status, answer.headers["retry-after"], answer.body_read) == (503, "7", False)
    assert native.json() == {"error": {"code": "overloaded", "message": message, "type": "server_error", "param": None}}
    assert official.json() == native.json()
    assert openai_shape.json() == {"error": {"message": message, "type": "server_error", "param": None, "code": "overloaded"}}
    assert inner.seen == []
    with pytest.raises(OverloadedError, match="queue is full") as refused:  # what the route itself would answer
        service.submit(SpeechRequest("再一个。", NamedVoice(SPEAKER)))
    assert refused.value.message == message and refused.value.retry_after_s == 7


def test_other_routes_and_methods_pass_while_the_queue_is_full(service_for: ServiceFactory) -> None:
    state, inner = state_for(), Inner()
    state.service = service = service_for()
    fill_queue(service)
    app = middleware(state, inner)
    for path, method in [("/healthz", "GET"), ("/v1/models", "GET"), ("/metrics", "GET"), ("/tts", "GET"), ("/lexicon", "POST")]:
        assert asyncio.run(call(app, path, method)).status == 204
    assert inner.seen == ["/healthz", "/v1/models", "/metrics", "/tts", "/lexicon"]


def test_requests_in_progress_count_against_capacity_before_they_reach_the_queue(service_for: ServiceFactory) -> None:
    state = state_for()
    state.service = service = service_for(workers=1, queue_max=1)

    async def burst() -> tuple[list[Answer], Answer, Answer]:
        hold = asyncio.Event()
        inner = Inner(hold=hold)
        app = middleware(state, inner)
        first = [asyncio.create_task(call(app, "/tts")) for _ in range(service.capacity)]
        while len(inner.seen) < service.capacity:
            await asyncio.sleep(0.001)
        refused = await asyncio.wait_for(call(app, "/v1/audio/speech"), timeout=10)  # let through, it would wait on `hold`
        assert not service.queue_full(), "the queue itself is empty: only the requests in progress are counted"
        hold.set()
        done = list(await asyncio.gather(*first))
        inner.hold = None
        return done, refused, await call(app, "/tts")

    done, refused, after = asyncio.run(burst())
    assert [a.status for a in done] == [204, 204]
    assert refused.status == 503 and refused.headers["retry-after"] == "7" and not refused.body_read
    assert refused.json()["error"]["code"] == "overloaded"
    assert after.status == 204, "finished requests free their place"


class HalfBody:
    """A body that arrives in two halves: the second only once `rest` is set (never, unless a test sets it);
    `waiting` is set when the app asks for it, i.e. the request is past admission and reading its body."""

    def __init__(self) -> None:
        self.rest = asyncio.Event()
        self.waiting = asyncio.Event()
        self.sent = 0

    async def __call__(self) -> Message:
        self.sent += 1
        if self.sent == 1:
            return {"type": "http.request", "body": b'{"text": ', "more_body": True}
        self.waiting.set()
        await self.rest.wait()
        return {"type": "http.request", "body": b'"hi"}', "more_body": False}


def test_a_request_still_sending_its_body_holds_no_place_and_takes_one_once_it_is_in(service_for: ServiceFactory) -> None:
    state = state_for()
    state.service = service = service_for(workers=1, queue_max=0)  # one place in all

    async def race() -> tuple[Answer, Answer, Answer]:
        inner = Inner(hold=asyncio.Event())
        app = middleware(state, inner)
        slow = HalfBody()
        sending = asyncio.create_task(call(app, "/tts", body=slow))
        await slow.waiting.wait()  # admitted, its body half in
        served = asyncio.create_task(call(app, "/v1/audio/speech"))  # takes the one place while the first still sends
        while inner.seen != ["/v1/audio/speech"]:
            await asyncio.sleep(0.001)
        slow.rest.set()  # the first body is in now, with no place left
        late = await asyncio.wait_for(sending, timeout=10)
        assert inner.hold is not None
        inner.hold.set()
        return late, await served, await call(app, "/tts")

    late, served, after = asyncio.run(race())
    assert served.status == 204, "a client that is still sending its body must not hold a place"
    assert late.status == 503 and late.body_read and late.json()["error"]["code"] == "overloaded"
    assert late.headers["retry-after"] == "7"
    assert after.status == 204 and service.capacity == 1


def test_a_body_that_stops_arriving_gets_408_and_the_connection_is_closed(service_for: ServiceFactory) -> None:
    state, inner = state_for(body_timeout_s=0.2), Inner()
    state.service = service_for(workers=1, queue_max=0)
    app = middleware(state, inner)
    for path in ("/tts", "/v1/audio/speech", "/v1/voices"):  # a synthesis route or not: every body has the limit
        answer = asyncio.run(asyncio.wait_for(call(app, path, body=HalfBody()), timeout=10))  # its second half never comes
        assert (answer.status, answer.headers["connection"]) == (408, "close"), answer
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")
        assert error["message"] == "the request body did not arrive within 0.2 s (TTS_BODY_TIMEOUT_S)"
    assert inner.seen == [] and asyncio.run(call(app, "/tts")).status == 204, "no place was kept by the timed-out ones"


def test_rate_limit_is_answered_from_headers_with_the_trusted_proxy_rule(service_for: ServiceFactory) -> None:
    state, inner = state_for(rate_limit_per_minute=1, trusted_proxies="127.0.0.1/32"), Inner()
    state.service = service_for(workers=1, queue_max=8)
    app = middleware(state, inner)
    via_proxy = {"X-Forwarded-For": "203.0.113.5"}
    assert asyncio.run(call(app, "/tts", headers=via_proxy, peer="127.0.0.1")).status == 204
    refused = asyncio.run(call(app, "/v1/audio/speech", headers=via_proxy, peer="127.0.0.1"))
    assert refused.status == 429 and 1 <= int(refused.headers["retry-after"]) <= 60 and not refused.body_read
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.json()["error"]["code"] == "rate_limited"
    # another client behind the same proxy has its own bucket; an untrusted peer's header is ignored
    assert asyncio.run(call(app, "/tts", headers={"X-Forwarded-For": "203.0.113.6"}, peer="127.0.0.1")).status == 204
    assert asyncio.run(call(app, "/tts", headers=via_proxy, peer="192.0.2.9")).status == 204
    assert asyncio.run(call(app, "/tts", headers={"X-Forwarded-For": "203.0.113.7"}, peer="192.0.2.9")).status == 429
    assert inner.seen == ["/tts"] * 3


def test_a_missing_key_is_refused_before_the_rate_limit_counts_it(service_for: ServiceFactory) -> None:
    state, inner = state_for(api_keys=KEY, rate_limit_per_minute=1), Inner()
    state.service = service_for(workers=1, queue_max=8)
    app = middleware(state, inner)
    for _ in range(3):
        missing = asyncio.run(call(app, "/tts"))
        assert missing.status == 401 and missing.headers["www-authenticate"].startswith("Bearer") and not missing.body_read
        assert missing.json()["error"]["code"] == "unauthorized"
    assert asyncio.run(call(app, "/v1/audio/speech", headers={"X-API-Key": KEY})).status == 401, "/v1 takes Bearer only"
    assert asyncio.run(call(app, "/tts", headers={"Authorization": f"Bearer {KEY}"})).status == 204
    assert asyncio.run(call(app, "/tts", headers={"Authorization": f"Bearer {KEY}"})).status == 429


def test_loading_and_stopping_are_refused_with_retry_after(service_for: ServiceFactory) -> None:
    state, inner = state_for(), Inner()
    app = middleware(state, inner)
    loading = asyncio.run(call(app, "/tts"))
    assert (loading.status, loading.headers["retry-after"], loading.json()["error"]["code"]) == (503, "5", "not_ready")
    state.service = service_for()
    state.runtime.closing = True
    stopping = asyncio.run(call(app, "/v1/audio/speech"))
    assert (stopping.status, stopping.json()["error"]["code"]) == (503, "shutting_down")
    assert inner.seen == [] and not loading.body_read and not stopping.body_read


def test_a_request_let_through_is_validated_by_its_route_and_charged_once(tiny_bundle: Path) -> None:
    settings = Settings(_env_file=None, model_dir=tiny_bundle, intra_op_threads=1, rate_limit_per_minute=3)  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as client:
        invalid = client.post("/tts", json={"text": "你好。", "speed": 100})
        assert invalid.status_code == 400 and invalid.json()["error"]["code"] == "invalid_input"
        assert [client.post("/tts", json={"text": f"第{n}次。", "format": "pcm"}).status_code for n in range(2)] == [200, 200]
        refused = client.post("/tts", json={"text": "第三次。"})
        assert refused.status_code == 429
        metrics = client.get("/metrics").text
    assert metric_value(metrics, "tts_requests_total", {"route": "/tts", "status": "429"}) == 1
    assert metric_value(metrics, "tts_requests_total", {"route": "/tts", "status": "200"}) == 2
