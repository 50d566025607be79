"""Locust scenarios for cosyvoice-lite: short zh, short en, long mixed, streaming (time to first audio), OpenAI path.

Run headless through `make loadtest USERS=… DURATION=…` (CSV + HTML under test-artifacts/loadtest/), or
`locust -f loadtest/locustfile.py --host http://127.0.0.1:8000` for the web UI. Every request carries a
random number in its text, so the audio cache does not answer for the engine. The server's per-client rate
limit counts these users as one client: start it with TTS_RATE_LIMIT_PER_MINUTE=0, or give each user an
API key through LOADTEST_API_KEY. 429/503 answers are counted as failures (the user did not get audio).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from locust import HttpUser, between, task

SHORT_ZH = ["你好，欢迎使用语音合成服务。", "今天天气很好，我们去公园散步吧。", "请在听到提示音后留言。"]
SHORT_EN = ["Hello, and welcome to the speech service.", "The meeting starts at nine thirty.", "Please leave a message."]
LONG_MIXED = (
    "欢迎收听今天的科技新闻。OpenAI and other companies released new speech models this year. "
    "这些模型可以在普通的CPU上运行，延迟也越来越低。Streaming lets the first audio arrive early, "
    "而不必等待整段文字合成完毕。最后，感谢大家的收听，我们明天再见。"
)
TTFA = "TTFA"  # request_type of the time-to-first-audio metric: its own row in the CSV and HTML reports
STREAM = "STREAM"  # the whole stream, first byte to last


def unique(text: str) -> str:
    """The same sentence with a random number, so that the audio cache misses."""
    return f"{text} {random.randint(0, 999_999)}"


class TTSUser(HttpUser):
    """One client: mostly short requests, some long ones, streams and OpenAI-style calls."""

    wait_time = between(0.5, 1.5)

    def on_start(self) -> None:
        key = os.environ.get("LOADTEST_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    def _speak(self, name: str, body: dict[str, Any]) -> None:
        with self.client.post("/tts", json=body, name=name, catch_response=True) as response:
            if response.status_code == 200 and response.content[:4] == b"RIFF":
                response.success()
            else:
                response.failure(f"{response.status_code}: {response.text[:200]}")

    @task(4)
    def short_zh(self) -> None:
        self._speak("/tts short zh", {"text": unique(random.choice(SHORT_ZH)), "speaker": "中文女", "format": "wav"})

    @task(3)
    def short_en(self) -> None:
        self._speak("/tts short en", {"text": unique(random.choice(SHORT_EN)), "speaker": "英文女", "format": "wav"})

    @task(1)
    def long_mixed(self) -> None:
        self._speak("/tts long mixed", {"text": unique(LONG_MIXED), "speaker": "中文女", "format": "wav"})

    @task(2)
    def streaming(self) -> None:
        """Chunked /tts. Rows: POST (until the response starts), TTFA (first audio bytes), STREAM (whole stream)."""
        body = {"text": unique(LONG_MIXED), "speaker": "中文女", "format": "pcm", "stream": True}
        started = time.perf_counter()
        first: float | None = None
        size = 0
        with self.client.post("/tts", json=body, name="/tts stream", stream=True, catch_response=True) as response:
            try:
                for chunk in response.iter_content(chunk_size=None):
                    if chunk and first is None:
                        first = time.perf_counter() - started
                    size += len(chunk)
            except Exception as e:  # a stream cut mid-way is a failure of this request, not of the load test
                response.failure(f"stream broke after {size} bytes: {e}")
                return
            if response.status_code != 200 or first is None:
                response.failure(f"{response.status_code}: no audio")
                return
            response.success()
        whole = time.perf_counter() - started
        for kind, seconds in ((TTFA, first), (STREAM, whole)):
            self.environment.events.request.fire(
                request_type=kind,
                name="/tts stream",
                response_time=seconds * 1000,
                response_length=size,
                exception=None,
                context={},
            )

    @task(2)
    def openai_speech(self) -> None:
        body = {"model": "tts-1", "input": unique(random.choice(SHORT_EN)), "voice": "alloy", "response_format": "mp3"}
        with self.client.post("/v1/audio/speech", json=body, name="/v1/audio/speech", catch_response=True) as response:
            if response.status_code == 200 and len(response.content) > 0:
                response.success()
            else:
                response.failure(f"{response.status_code}: {response.text[:200]}")
