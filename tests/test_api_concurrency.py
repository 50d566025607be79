"""Concurrency on a real server: queue full -> 503 at once, disconnect stops the engine, streaming delivers early."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from gated_engine import GatedEngine

from service.api import create_app
from service.api.deps import AppState
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.families.cosyvoice1.model import load_synthesizer
from service.settings import Settings
from service.speech.service import Engine

# Three sentences the frontend keeps apart (each is longer than its 60-character merge threshold).
THREE_SENTENCES = (
    "春天来了，公园里的花都开了，红的像火，粉的像霞，白的像雪，小朋友们在草地上放风筝，老人们在树下下棋聊天，到处都是欢声笑语和鸟儿的歌声。"
    "夏天的时候，我们一家人常常去海边度假，白天在沙滩上堆城堡、捡贝壳、追海浪，晚上坐在海边听海浪的声音，看满天的星星一闪一闪地眨着眼睛。"
    "秋天到了，田野里的稻谷成熟了，金黄金黄的一片，农民伯伯脸上露出了丰收的笑容，果园里的苹果和梨子也挂满了枝头，空气里都是甜甜的香味。"
)


class LiveServer:
    """uvicorn serving one app on a free loopback port, in a thread of this process."""

    def __init__(self, app: FastAPI) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> AppState:
        state = self.app.state.tts
        assert isinstance(state, AppState)
        return state

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def settings_for(bundle: Path, **overrides: object) -> Settings:
    base: dict[str, object] = {"model_dir": bundle, "intra_op_threads": 1, "rate_limit_per_minute": 0, "cache_max_bytes": 0}
    return Settings(_env_file=None, **(base | overrides))  # type: ignore[arg-type]


def gated_app(bundle: Path, **overrides: object) -> tuple[FastAPI, list[GatedEngine]]:
    engines: list[GatedEngine] = []

    def loader(b: ModelBundle, runtime: RuntimeOptions) -> Engine:
        engines.append(GatedEngine(load_synthesizer(b, runtime)))
        return engines[-1]

    return create_app(settings_for(bundle, **overrides), engine_loader=loader), engines


def wait_for(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_full_queue_is_refused_at_once_with_retry_after(tiny_bundle: Path) -> None:
    app, engines = gated_app(tiny_bundle, concurrent_requests=1, queue_max=1, retry_after_s=7)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as client:
        engine = engines[0]
        engine.gate.clear()
        results: dict[str, httpx.Response] = {}

        def post(name: str) -> None:
            results[name] = client.post("/tts", json={"text": f"第{name}个请求。", "format": "pcm"})

        running = threading.Thread(target=post, args=("一",))
        running.start()
        wait_for(engine.first_chunk.is_set)  # the only worker is busy
        waiting = threading.Thread(target=post, args=("二",))
        waiting.start()
        wait_for(lambda: live.state.service is not None and live.state.service.queue_state() == (1, 1))
        metrics = client.get("/metrics").text
        assert "tts_queue_depth 1.0" in metrics and "tts_jobs_running 1.0" in metrics

        start = time.monotonic()
        refused = client.post("/tts", json={"text": "第三个请求。"})
        refused_v1 = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "第四个。", "voice": "alloy"})
        elapsed = time.monotonic() - start
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "7"
        assert refused.json()["error"]["code"] == "overloaded"
        assert refused_v1.status_code == 503 and refused_v1.json()["error"]["type"] == "server_error"
        assert elapsed < 1.0, f"refusing took {elapsed:.2f} s: it must not wait for the queue"

        engine.gate.set()
        running.join(60)
        waiting.join(60)
        assert results["一"].status_code == 200 and results["二"].status_code == 200
        assert len(results["一"].content) > 1000
        assert client.post("/tts", json={"text": "又可以了。", "format": "pcm"}).status_code == 200


def test_client_disconnect_cancels_the_synthesis_within_one_chunk(tiny_bundle: Path) -> None:
    app, engines = gated_app(tiny_bundle, concurrent_requests=1)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=60) as client:
        engine = engines[0]
        engine.gate.clear()
        chunks_before = engine.chunks
        body = {"text": THREE_SENTENCES, "format": "pcm", "stream": True}
        with client.stream("POST", "/tts", json=body) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_raw())
            assert len(first) > 0
        # the response is closed while the engine waits before its second chunk
        cancel = engine.cancels[-1]
        wait_for(cancel.is_set, 5)
        engine.gate.set()
        state = live.state
        assert state.service is not None
        wait_for(lambda: state.service.queue_state() == (0, 0), 10)  # type: ignore[union-attr]
        assert engine.chunks - chunks_before == 1, "the engine went on after the client left"
        metrics = client.get("/metrics").text
        assert "tts_synthesis_cancelled_total 1.0" in metrics
        assert "tts_active_streams 0.0" in metrics
        assert client.post("/tts", json={"text": "还在。", "format": "pcm"}).status_code == 200


def test_three_sentence_stream_delivers_its_first_bytes_before_the_rest_is_made(tiny_bundle: Path) -> None:
    """The first bytes reach the client while the engine is held before its second chunk (by construction, not by
    the machine's speed), and the rest follows in several pieces once it goes on."""
    app, engines = gated_app(tiny_bundle, concurrent_requests=1, n_timesteps=2)
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=120) as client:
        engine = engines[0]
        engine.gate.clear()
        before = engine.chunks  # the warm-up's
        body = {"text": THREE_SENTENCES, "format": "wav", "stream": True, "seed": 3}
        try:
            with client.stream("POST", "/tts", json=body) as resp:
                assert resp.status_code == 200 and resp.headers["x-accel-buffering"] == "no"
                assert "content-length" not in resp.headers
                pieces = resp.iter_raw()
                first = len(next(pieces))
                assert engine.chunks - before == 1, "the first bytes came before the engine made its second chunk"
                engine.gate.set()
                rest = [len(piece) for piece in pieces]
        finally:
            engine.gate.set()
        n_bytes = first + sum(rest)
        audio_s = (n_bytes - 44) / 2 / 22050
        chunks = engine.chunks - before
        print(f"first read {first} bytes, then {len(rest)} reads, {audio_s:.1f} s of audio in {chunks} chunks")
        assert first > 44 and chunks >= 3 and len(rest) >= 2
        assert audio_s > 3.0


def test_client_leaving_before_a_whole_file_is_ready_cancels_it(tiny_bundle: Path) -> None:
    app, engines = gated_app(tiny_bundle, concurrent_requests=1)
    with LiveServer(app) as live:
        engine = engines[0]
        engine.gate.clear()
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=live.url, timeout=httpx.Timeout(60, read=1.0)) as impatient:
            impatient.post("/tts", json={"text": THREE_SENTENCES, "format": "mp3"})
        wait_for(engine.cancels[-1].is_set, 5)  # noticed while the engine was still busy with the file
        engine.gate.set()
        wait_for(lambda: live.state.service is not None and live.state.service.queue_state() == (0, 0), 10)
        # warm-up chunk + at most the one in flight (the engine also stops inside a chunk, between LLM tokens)
        assert engine.chunks <= 2, f"{engine.chunks - 1} chunks of a 3-sentence file after the client left"
