"""An engine failure becomes a JSON 500 (never a broken or empty 200), and the server stays ready."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_api_concurrency import LiveServer

from service.api import create_app
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.types import AudioChunk, SynthesisOptions
from service.families.cosyvoice1.model import load_synthesizer
from service.families.cosyvoice1.voice import Voice
from service.settings import Settings
from service.speech.service import Engine

# The speaker picks where the simulated failure happens: before any audio, or at the second sentence.
FAIL_AT_ONCE = "韩语女"
FAIL_LATER = "粤语女"
FIRST_SENTENCE = (
    "夏天的时候，我们一家人常常去海边度假，白天在沙滩上堆城堡、捡贝壳、追海浪，"
    "晚上坐在海边听海浪的声音，看满天的星星一闪一闪地眨着眼睛。"
)
SECOND_SENTENCE = "第二句话永远读不出来，引擎会在这里失败，只好放弃了，这句话就是这样的一句话，到此结束。"


class FailingEngine:
    """The real synthesizer, except that it raises for two speakers (at once, or at the second sentence)."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    @property
    def sample_rate(self) -> int:
        return self.inner.sample_rate

    @property
    def speakers(self) -> Sequence[str]:
        return self.inner.speakers

    def voice(self, speaker: str) -> Voice:
        return self.inner.voice(speaker)

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        fail_at = {FAIL_AT_ONCE: 0, FAIL_LATER: 1}.get(voice.name, len(sentences))
        return self._run(sentences, voice, options, cancel, fail_at)

    def _run(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event, fail_at: int
    ) -> Iterator[AudioChunk]:
        for i, ids in enumerate(sentences):
            if i == fail_at:
                raise RuntimeError("simulated ONNX Runtime failure")
            yield from self.inner.synthesize([ids], voice, options, cancel)


def failing_app(bundle: Path) -> FastAPI:
    def loader(b: ModelBundle, runtime: RuntimeOptions) -> Engine:
        return FailingEngine(load_synthesizer(b, runtime))

    settings = Settings(_env_file=None, model_dir=bundle, intra_op_threads=1, rate_limit_per_minute=0)  # type: ignore[call-arg]
    return create_app(settings, engine_loader=loader)


@pytest.fixture(scope="module")
def client(tiny_bundle: Path) -> Iterator[TestClient]:
    with TestClient(failing_app(tiny_bundle), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_before_any_audio_is_a_json_500(client: TestClient, stream: bool) -> None:
    resp = client.post("/tts", json={"text": "你好。", "speaker": FAIL_AT_ONCE, "stream": stream})
    assert resp.status_code == 500 and resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert error["code"] == "engine_failure" and error["message"] == "synthesis failed: RuntimeError"
    assert "simulated" not in resp.text, "internal details stay in the log"


def test_engine_failure_on_v1_uses_the_openai_envelope(client: TestClient) -> None:
    resp = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "你好。", "voice": FAIL_AT_ONCE})
    assert resp.status_code == 500
    assert resp.json()["error"] == {
        "message": "synthesis failed: RuntimeError",
        "type": "server_error",
        "param": None,
        "code": "engine_failure",
    }


def test_failure_after_audio_began_aborts_the_stream_and_nothing_is_cached(tiny_bundle: Path) -> None:
    body = {"text": FIRST_SENTENCE + SECOND_SENTENCE, "speaker": FAIL_LATER, "format": "pcm", "seed": 1}
    with LiveServer(failing_app(tiny_bundle)) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        received = bytearray()
        with pytest.raises(httpx.RemoteProtocolError), http.stream("POST", "/tts", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            for piece in resp.iter_raw():
                received += piece
        assert len(received) > 22050, "the first sentence was streamed before the failure"
        whole = http.post("/tts", json=body)
        assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_failure"
        again = http.post("/tts", json=body)
        assert again.status_code == 500 and "x-cache" not in again.headers


def test_server_is_ready_after_failures(client: TestClient) -> None:
    assert client.get("/readyz").json()["status"] == "ready"
    assert client.post("/tts", json={"text": "好的。"}).status_code == 200
