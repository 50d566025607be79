"""A memory limit on a real server, for a bundle of each family (v1, CosyVoice2, Fun-CosyVoice3): the streams
its budget holds run, the next one waits in the queue, one more gets 503 + Retry-After (never more than the budget at
once); a request that could never fit gets 413; /metrics and the start-up log state the budget. The figures hold by
construction: the resident size after the load and each request's footprint are injected, so nothing depends on this
machine's memory or speed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from gated_engine import GatedEngine, ThreadGate
from servers import metric_value, wait_until
from test_api_concurrency import LiveServer

import service.runtime as runtime_module
from service.api import create_app
from service.bundle import ModelBundle
from service.engine.footprint import Footprint
from service.engine.memory import HEADROOM_FLOOR
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.families.registry import family
from service.settings import Settings

MiB = 1 << 20
FOOTPRINT = 100 * MiB  # what every request says it may hold
RESIDENT = 500 * MiB  # what the process holds once the model is loaded
LIMIT = RESIDENT + HEADROOM_FLOOR + 2 * FOOTPRINT + FOOTPRINT // 2  # room for exactly two requests
WAIT_S = 60.0  # how long the test waits for another thread to reach a state (a bound, never a measured speed)
PROMPT_WAV = Path(__file__).resolve().parent / "reference" / "tiny-cosyvoice2" / "prompts" / "zh_16k.wav"


class FixedFootprint(GatedEngine):
    """The family's engine behind a gate, saying every request may hold `nbytes`."""

    def __init__(self, inner: Any, gate: ThreadGate, nbytes: int) -> None:
        super().__init__(inner, gate)
        self.nbytes = nbytes

    def request_footprint(self, voice: object, texts: Sequence[int], options: SynthesisOptions) -> Footprint:
        return Footprint((("test", self.nbytes),), speech_s=0.0)

    def worst_footprint(self, options: SynthesisOptions) -> Footprint:
        return Footprint((("test", self.nbytes),), speech_s=0.0)


def serve(bundle: Path, tmp_path: Path, nbytes: int, **overrides: object) -> tuple[LiveServer, ThreadGate]:
    gate = ThreadGate()

    def loader(b: ModelBundle, runtime: RuntimeOptions) -> FixedFootprint:
        return FixedFootprint(family(b.family).load_engine(b, runtime), gate, nbytes)

    base: dict[str, Any] = {
        "model_dir": bundle, "voices_dir": tmp_path / "voices", "intra_op_threads": 1, "rate_limit_per_minute": 0,
        "cache_max_bytes": 0, "memory_limit": LIMIT, "concurrent_requests": 8, "queue_max": 1, "retry_after_s": 5,
        "admission": "count",
    }  # fmt: skip
    settings = Settings(_env_file=None, **(base | overrides))  # type: ignore[arg-type]
    return LiveServer(create_app(settings, engine_loader=loader)), gate


@pytest.fixture
def fixed_resident(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(runtime_module, "resident_bytes", lambda: RESIDENT)
    yield


def voice_of(client: httpx.Client, bundle: Path) -> str:
    """A voice the bundle speaks: its first built-in speaker, else a voice saved from the tiny prompt recording."""
    speakers = client.get("/info").json()["speakers"]
    if speakers:
        return str(speakers[0])
    files = {"audio": (PROMPT_WAV.name, PROMPT_WAV.read_bytes(), "audio/wav")}
    saved = client.post("/v1/voices", data={"name": "held", "transcript": "希望你以后能够做的比我还好呦。"}, files=files)
    assert saved.status_code == 201, saved.text
    return "held"


@pytest.mark.parametrize("bundle_name", ["tiny_bundle", "tiny_v2_bundle", "tiny_v3_bundle"])
def test_a_memory_limit_runs_the_streams_it_holds_queues_the_next_and_refuses_one_more(
    bundle_name: str, request: pytest.FixtureRequest, tmp_path: Path, fixed_resident: None, caplog: pytest.LogCaptureFixture
) -> None:
    bundle: Path = request.getfixturevalue(bundle_name)
    caplog.set_level(logging.INFO, logger="service.memory_plan")
    live, gate = serve(bundle, tmp_path, FOOTPRINT)
    with live, httpx.Client(base_url=live.url, timeout=WAIT_S) as client:
        speaker = voice_of(client, bundle)
        service = live.state.service
        assert service is not None
        budget = LIMIT - RESIDENT - HEADROOM_FLOOR
        metrics = client.get("/metrics").text
        assert metric_value(metrics, "tts_memory_budget_bytes") == budget
        assert metric_value(metrics, "tts_streams_fit") == 2 and metric_value(metrics, "tts_stream_worst_case_bytes") == FOOTPRINT
        assert "2 such streams fit at once" in caplog.text and f"{budget // MiB} MB for requests" in caplog.text

        gate.clear()
        results: dict[int, httpx.Response] = {}

        def post(i: int) -> None:
            results[i] = client.post("/tts", json={"text": f"第{i}句话。", "speaker": speaker, "format": "pcm", "seed": i})

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        try:
            for thread in threads[:2]:
                thread.start()
            wait_until(lambda: service.queue_state() == (0, 2), WAIT_S, "two requests running")
            threads[2].start()
            wait_until(lambda: service.queue_state() == (1, 2), WAIT_S, "the third request queued")
            assert metric_value(client.get("/metrics").text, "tts_memory_reserved_bytes") == 2 * FOOTPRINT
            refused = client.post("/tts", json={"text": "第四句话。", "speaker": speaker, "format": "pcm"})
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
            assert refused.json()["error"]["code"] == "overloaded"
        finally:
            gate.set()
            for thread in threads:
                thread.join(WAIT_S)
        assert [results[i].status_code for i in range(3)] == [200, 200, 200]
        wait_until(lambda: service.queue_state() == (0, 0), WAIT_S, "every request to end")
        assert metric_value(client.get("/metrics").text, "tts_memory_reserved_bytes") == 0


@pytest.mark.parametrize("bundle_name", ["tiny_bundle", "tiny_v3_bundle"])
def test_a_request_that_could_never_fit_the_budget_is_refused_with_413(
    bundle_name: str, request: pytest.FixtureRequest, tmp_path: Path, fixed_resident: None
) -> None:
    bundle: Path = request.getfixturevalue(bundle_name)
    live, _ = serve(bundle, tmp_path, 4 * FOOTPRINT)  # more than the 250 MB the limit leaves for requests
    with live, httpx.Client(base_url=live.url, timeout=WAIT_S) as client:
        speaker = voice_of(client, bundle)
        refused = client.post("/tts", json={"text": "你好。", "speaker": speaker, "format": "pcm"})
        assert refused.status_code == 413, refused.text
        error = refused.json()["error"]
        assert error["code"] == "text_too_long" and "TTS_MEMORY_LIMIT" in error["message"]
