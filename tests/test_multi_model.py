"""Several models in one server (TTS_MODEL_DIR=models/tiny,models/tiny-cosyvoice2): the OpenAI `model`, the WebSocket
config, gRPC's `x-model` metadata and DashScope's `payload.model` choose; the official endpoints use the first; an
unknown model is a 400 naming the served ones on every transport; readiness, listings, saved voices, the audio cache
and the start log cover each model."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import threading
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest
from api_bundles import flagged_bundle
from fastapi.testclient import TestClient
from servers import LOOPBACK, REPO, AppServer, app_env, free_port, wait_until
from starlette.websockets import WebSocketDisconnect

from service.api import create_app
from service.audio.encode import AudioFormat
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions
from service.errors import OverloadedError, SettingError
from service.families import registry
from service.families.cosyvoice1.voice import Voice
from service.families.model import Model, NamedVoice
from service.frontend import Sentence
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.runtime import Runtime, check_settings
from service.served import OPENAI_MODEL_ALIASES, QueueTotals, ServedModel, ServedModels
from service.settings import Settings
from service.speech.job import SynthesisObserver
from service.speech.request import SpeechRequest
from service.speech.service import TTSService
from service.stores.audio_cache import MemoryAudioCache

V1 = "CosyVoice-300M-SFT-tiny-random"
V2 = "CosyVoice2-0.5B-tiny-random-int8"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
SAVED = "v2-voice"


@pytest.fixture(scope="module")
def both(tiny_bundle: Path, tiny_v2_bundle: Path) -> str:
    assert [ModelBundle.load(b).manifest.model for b in (tiny_bundle, tiny_v2_bundle)] == [V1, V2]
    return f"{tiny_bundle},{tiny_v2_bundle}"


def settings_of(model_dir: str, voices: Path, **overrides: object) -> Settings:
    base: dict[str, object] = {"model_dir": model_dir, "intra_op_threads": 1, "rate_limit_per_minute": 0}
    return Settings(_env_file=None, **(base | {"voices_dir": voices} | overrides))  # type: ignore[arg-type]


@dataclass
class Served:
    client: TestClient
    grpc_port: int

    @property
    def runtime(self) -> Runtime:
        runtime = self.client.app.state.tts.runtime  # type: ignore[attr-defined]
        assert isinstance(runtime, Runtime)
        return runtime


@pytest.fixture(scope="module")
def served(both: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    settings = settings_of(both, tmp_path_factory.mktemp("multi") / "voices", grpc_port=port, host=LOOPBACK)
    with TestClient(create_app(settings)) as client:
        yield Served(client, port)


@pytest.fixture(scope="module")
def saved_for_v2(served: Served, tiny_v2_ref: Path) -> dict[str, Any]:
    """A voice saved for the second model (its prompt models analyse it): the POST /v1/voices answer."""
    audio = (tiny_v2_ref / "prompts" / "zh_16k.wav").read_bytes()
    form = {"name": SAVED, "transcript": PROMPT_TEXT, "model": V2}
    answer = served.client.post("/v1/voices", data=form, files={"audio": ("zh.wav", audio, "audio/wav")})
    assert answer.status_code == 201, answer.text
    body: dict[str, Any] = answer.json()
    return body


@pytest.fixture(scope="module")
def tiny_v2_ref() -> Path:
    return REPO / "tests" / "reference" / "tiny-cosyvoice2"


def speech(client: TestClient, model: str, voice: str, **extra: object) -> Any:
    body = {"model": model, "input": "你好。", "voice": voice, "response_format": "wav", "stream": False} | extra
    return client.post("/v1/audio/speech", json=body)


def wav_rate(data: bytes) -> int:
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate()


def grpc_call(port: int, spk_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id=spk_id, tts_text="你好。"))
    with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
        return b"".join(r.tts_audio for r in stub.Inference(request, metadata=metadata, timeout=120))


def run_task(model: str, voice: str = "中文女") -> dict[str, Any]:
    parameters = {"voice": voice, "format": "pcm", "sample_rate": 24000}
    return {
        "header": {"action": "run-task", "task_id": "t1", "streaming": "duplex"},
        "payload": {"model": model, "parameters": parameters, "input": {}},
    }


def dashscope_answer(client: TestClient, model: str, voice: str = "中文女") -> dict[str, Any]:
    """The first event a run-task for `model` gets (task-started or task-failed)."""
    with client.websocket_connect("/api-ws/v1/inference") as ws:
        ws.send_text(json.dumps(run_task(model, voice)))
        answer: dict[str, Any] = ws.receive_json()
    return answer


# ---- choosing a model -------------------------------------------------------------------------------


def test_the_openai_route_speaks_with_the_model_it_names(served: Served, saved_for_v2: dict[str, Any]) -> None:
    first = speech(served.client, V1, "中文女")
    second = speech(served.client, V2, SAVED)
    alias = speech(served.client, "tts-1", "中文女")
    for answer in (first, second, alias):
        assert answer.status_code == 200, answer.text
    assert (first.headers["x-sample-rate"], wav_rate(first.content)) == ("22050", 22050)
    assert (second.headers["x-sample-rate"], wav_rate(second.content)) == ("24000", 24000)
    assert wav_rate(alias.content) == 22050, "an OpenAI model name means the first model"


def test_the_official_endpoints_and_grpc_without_metadata_use_the_first_model(
    served: Served, saved_for_v2: dict[str, Any]
) -> None:
    sft = served.client.post("/inference_sft", data={"tts_text": "你好。", "spk_id": "中文女"})
    assert sft.status_code == 200 and "rate=22050" in sft.headers["content-type"]
    prompt = {"prompt_wav": ("p.wav", b"RIFF", "audio/wav")}
    instruct2 = served.client.post("/inference_instruct2", data={"tts_text": "你好。", "instruct_text": "慢慢说"}, files=prompt)
    assert instruct2.status_code == 400 and instruct2.json()["error"]["code"] == "unsupported_capability"
    assert V1 in instruct2.json()["error"]["message"], "the first model (v1) has no instruct2; the second has"
    assert grpc_call(served.grpc_port, "中文女")
    with pytest.raises(grpc.RpcError) as refused:
        grpc_call(served.grpc_port, SAVED)  # the first model cannot speak a voice saved for the second
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_call(served.grpc_port, SAVED, (("x-model", V2),)), "x-model chooses the second model"


def test_the_websocket_config_chooses_the_model(served: Served, saved_for_v2: dict[str, Any]) -> None:
    for config, model, rate in (({"voice": "中文女"}, V1, 22050), ({"voice": SAVED, "model": V2}, V2, 24000)):
        with served.client.websocket_connect("/v1/audio/speech/stream") as ws:
            ws.send_text(json.dumps({"type": "config", **config}))
            ready = ws.receive_json()
        assert (ready["type"], ready["model"], ready["sample_rate"]) == ("ready", model, rate), ready


def test_dashscope_names_choose_the_served_model_of_their_family(served: Served) -> None:
    """cosyvoice-v1 is the v1 model, cosyvoice-v2 the CosyVoice2 one (which has no 中文女), our ids choose exactly, a
    cloud name of a family not served (cosyvoice-v3-flash) is the first model."""
    events = {m: dashscope_answer(served.client, m)["header"] for m in ("cosyvoice-v1", V1, "cosyvoice-v3-flash")}
    assert all(h["event"] == "task-started" for h in events.values()), events
    for model in ("cosyvoice-v2", V2):
        failed = dashscope_answer(served.client, model)["header"]
        assert (failed["event"], failed["attributes"]["code"]) == ("task-failed", "unknown_speaker"), failed


def test_an_unknown_model_is_a_400_naming_the_served_ones_on_every_transport(served: Served) -> None:
    client = served.client
    http = speech(client, "tts-9", "中文女")
    error = http.json()["error"]
    assert (http.status_code, error["code"], error["param"]) == (400, "unknown_model", "model")
    assert V1 in error["message"] and V2 in error["message"] and "'tts-9'" in error["message"]
    for listing in (client.get("/v1/audio/voices", params={"model": "x"}), client.get("/v1/voices", params={"model": "x"})):
        assert (listing.status_code, listing.json()["error"]["code"]) == (400, "unknown_model")
    save = client.post("/v1/voices", data={"name": "n", "model": "x"}, files={"audio": ("a.wav", b"RIFF", "audio/wav")})
    assert (save.status_code, save.json()["error"]["code"]) == (400, "unknown_model"), save.text

    with client.websocket_connect("/v1/audio/speech/stream") as ws:
        ws.send_text(json.dumps({"type": "config", "model": "x"}))
        event = ws.receive_json()
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert (event["type"], event["error"]["code"], event["error"]["param"]) == ("error", "unknown_model", "model")
    reason = json.loads(closed.value.reason)
    assert closed.value.code == 4400 and reason["code"] == "unknown_model"
    assert V1 in reason["message"] and V2 in reason["message"], reason  # the close reason (123 bytes) keeps the ids

    with pytest.raises(grpc.RpcError) as refused:
        grpc_call(served.grpc_port, "中文女", (("x-model", "x"),))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details()
    assert V1 in details and V2 in details and "x-model" in details, details

    failed = dashscope_answer(client, "x")["header"]
    codes = (failed["event"], failed["error_code"], failed["attributes"]["code"])
    assert codes == ("task-failed", "InvalidParameter", "unknown_model"), failed
    assert V1 in failed["error_message"] and V2 in failed["error_message"], failed


# ---- listings and readiness -------------------------------------------------------------------------


def test_the_model_lists_name_both_then_the_aliases_of_the_first(served: Served) -> None:
    client = served.client
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == [V1, V2, *OPENAI_MODEL_ALIASES]
    assert [m["id"] for m in client.get("/v1/audio/models").json()["models"]] == ids
    card = client.get(f"/v1/models/{V2}").json()
    assert card["id"] == V2 and card["test_model"] is True and card["created"] > 0
    missing = client.get("/v1/models/nope")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    info = client.get("/info").json()
    assert (info["model"], info["sample_rate_hz"]) == (V1, 22050), "the top level stays the first model's"
    described = [(m["model"], m["family"], m["sample_rate_hz"], m["capabilities"]["instruct2"]) for m in info["models"]]
    assert described == [(V1, "cosyvoice1", 22050, False), (V2, "cosyvoice2", 24000, True)]
    assert info["models"][0]["speakers"] == info["speakers"] and info["models"][1]["speakers"] == []


def test_readiness_probes_every_model(served: Served) -> None:
    ready = served.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert [(m["model"], m["engine"]) for m in ready.json()["models"]] == [(V1, "ok"), (V2, "ok")]


def test_readiness_covers_every_model_while_they_load(both: str, tmp_path: Path) -> None:
    """The first model's engine is held until the test lets it go (by construction, not by speed): /readyz says 503
    with the first model loading and the second waiting; once both are loaded, 200."""
    release = threading.Event()

    def held(bundle: ModelBundle, options: RuntimeOptions) -> object:
        assert release.wait(60), "the test never released the load"
        return registry.family(bundle.family).load_engine(bundle, options)

    app = create_app(settings_of(both, tmp_path / "voices"), engine_loader=held, load_in_background=True)
    with TestClient(app) as client:
        try:
            runtime = app.state.tts.runtime
            wait_until(lambda: runtime.load_states.get(V1) == "loading", 60, "the first model loading")
            loading = client.get("/readyz")
            assert loading.status_code == 503 and loading.headers["retry-after"] == "5"
            body = loading.json()
            assert (body["status"], body["engine"]) == ("not_ready", "loading")
            assert [(m["model"], m["engine"]) for m in body["models"]] == [(V1, "loading"), (V2, "waiting")]
            refused = client.post("/v1/audio/speech", json={"model": V2, "input": "hi", "voice": "alloy"})
            assert (refused.status_code, refused.json()["error"]["code"]) == (503, "not_ready")
        finally:
            release.set()
        wait_until(lambda: client.get("/readyz").status_code == 200, 120, "/readyz 200 once both are loaded")
        assert [m["engine"] for m in client.get("/readyz").json()["models"]] == ["ok", "ok"]


# ---- saved voices, the audio cache, SSE usage ------------------------------------------------------------


def test_a_voice_saved_for_the_second_model_is_its_own(served: Served, saved_for_v2: dict[str, Any]) -> None:
    client = served.client
    assert (saved_for_v2["made_for"], saved_for_v2["usable"]) == (V2, True)

    def usable(params: dict[str, str]) -> bool:
        listed = {v["id"]: v["usable"] for v in client.get("/v1/voices", params=params).json()["data"]}
        one = client.get(f"/v1/voices/{SAVED}", params=params).json()["usable"]
        assert listed[SAVED] == one
        return bool(one)

    assert usable({"model": V2}) and not usable({}) and not usable({"model": V1})
    openai_ids = [v["id"] for v in client.get("/v1/audio/voices", params={"model": V2}).json()["voices"]]
    assert SAVED in openai_ids and SAVED not in [v["id"] for v in client.get("/v1/audio/voices").json()["voices"]]
    refused = speech(client, V1, SAVED)
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "unknown_speaker"), refused.text


@dataclass(frozen=True)
class FixedVoice:
    """A voice already resolved, with one fingerprint whatever the model: only the model tells two requests apart."""

    name: str = "fixed"
    fingerprint: str = "f" * 32


def test_two_models_never_share_an_audio_cache_entry(served: Served) -> None:
    first, second = (served.runtime.model_for(m).service for m in (V1, V2))
    assert first.cache is second.cache, "one audio cache for every model"
    request = SpeechRequest("你好。", FixedVoice(), AudioFormat.PCM, pcm_rate_hz=24000, seed=1)
    one, two = first.prepare(request), second.prepare(request)
    assert [s.text for s in one.sentences] == [s.text for s in two.sentences] and one.sample_rate_hz == two.sample_rate_hz
    assert one.cache_key != two.cache_key, "the same text, voice, format and rate: the key differs by the model alone"


def test_sse_usage_counts_the_speech_tokens_of_the_model_that_spoke(served: Served, saved_for_v2: dict[str, Any]) -> None:
    """CosyVoice2 makes 25 speech tokens a second (v1: 50): the usage is the second model's, not the first's."""
    answer = speech(served.client, V2, SAVED, response_format="pcm", stream_format="sse", seed=3)
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    seconds = len(audio) / 2 / 24000
    tokens = events[-1]["usage"]["output_tokens"]
    assert seconds > 0.2 and abs(tokens - seconds * 25) <= 1, (tokens, seconds)  # at v1's 50 Hz: twice as many


def test_the_queue_gauges_are_the_sum_of_every_models_queue() -> None:
    seen: list[tuple[int, int]] = []

    class Recorder(SynthesisObserver):
        def queue_changed(self, waiting: int, running: int) -> None:
            seen.append((waiting, running))

    totals = QueueTotals(Recorder())
    first, second = totals.observer_for(0), totals.observer_for(1)
    first.queue_changed(2, 1)
    second.queue_changed(1, 1)
    first.queue_changed(0, 1)
    assert seen == [(2, 1), (3, 2), (1, 2)]


# ---- the real server: its start log and its settings errors ------------------------------------------------


def test_the_start_log_states_the_memory_each_model_added(both: str, tmp_path: Path) -> None:
    app = AppServer(tmp_path, Path(both), {"TTS_INTRA_OP_THREADS": "1", "TTS_RATE_LIMIT_PER_MINUTE": "0"}, name="multi")
    try:
        app.start()
        with app.client() as http:
            assert [m["model"] for m in http.get("/readyz").json()["models"]] == [V1, V2]
            assert http.post("/v1/audio/speech", json={"model": V1, "input": "你好。", "voice": "中文女"}).status_code == 200
    finally:
        app.stop()
        app.dump_log()
    log = app.log_text()
    for model in (V1, V2):
        assert re.search(rf"model {re.escape(model)} loaded: [+-]\d+ MB resident \(\d+ MB in all\)", log), model


def test_each_bundles_family_checks_the_settings_before_the_load(tiny_bundle: Path, tiny_v2_bundle: Path) -> None:
    """The second bundle's family refuses what it cannot honour too (v1 needs a first hop of 21 tokens or more)."""
    settings = settings_of(f"{tiny_v2_bundle},{tiny_bundle}", Path("unused"), first_hop_tokens=10)
    with pytest.raises(SettingError, match="at least 21 for CosyVoice-300M") as refused:
        check_settings(settings)
    assert refused.value.param == "first_hop_tokens"


def start_refused(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "service.api"]
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)


def test_two_bundles_of_one_model_or_a_missing_one_stop_the_start_in_one_line(tiny_bundle: Path, tmp_path: Path) -> None:
    """Before anything loads, exit 2 with one `error: TTS_MODEL_DIR: ...` line, like other settings errors."""
    copy = flagged_bundle(tiny_bundle, tmp_path / "copy")  # the same manifest, so the same model id
    same = start_refused(app_env(Path(f"{tiny_bundle},{copy}"), free_port()))
    assert same.returncode == 2, same.stderr
    assert same.stderr.splitlines() == [
        f"error: TTS_MODEL_DIR: {tiny_bundle} and {copy} are both the model {V1!r}; each bundle is served under its "
        "manifest's model id, so every id may be served once"
    ]
    missing = start_refused(app_env(Path(f"{tiny_bundle}, {tmp_path / 'nope'}"), free_port()))
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.splitlines() == [
        f"error: TTS_MODEL_DIR: {tmp_path / 'nope'}: not a directory (expected a model bundle)"
    ]


class OneSentence:
    """A text frontend that turns any text into one sentence of three token ids."""

    lexicon_version = "0"

    def sentences(self, text: str, captions: bool = False) -> list[Sentence]:
        return [Sentence(text, (1, 2, 3))]


class HeldEngine:
    """An engine whose synthesis holds its worker until `release` is set, then yields 0.1 s of silence."""

    sample_rate = 22050
    speakers: tuple[str, ...] = ("中文女",)

    def __init__(self) -> None:
        self.release = threading.Event()

    def voice(self, speaker: str) -> Voice:
        return Voice.builtin(speaker, np.ones(192, np.float32))

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        assert self.release.wait(timeout=30), "the test never released the engine"
        yield AudioChunk(np.zeros(2205, dtype=np.float32), 0, True, StageTimings(0.0, 0.0, 0.0))


def test_one_room_covers_the_jobs_of_every_model(both: str, tmp_path: Path) -> None:
    """A WebSocket or DashScope session queues its next sentence's job under the one place it holds: jobs queued on
    the second model fill the server's room (concurrent_requests + queue_max) as the first model's do."""
    engine = HeldEngine()
    services = [
        TTSService(OneSentence(), engine, MemoryAudioCache(0), bundle_sha256=str(n) * 64, concurrency=1, queue_max=1)
        for n in range(2)
    ]
    runtime = Runtime(settings_of(both, tmp_path / "voices", concurrent_requests=1, queue_max=1))
    bundles = [ModelBundle.load(Path(p)) for p in both.split(",")]
    runtime.service = services[0]
    runtime._models = ServedModels([ServedModel(b, cast(Model, engine), s, 0) for b, s in zip(bundles, services, strict=True)])
    try:
        runtime.check_room()
        for text in ("第一句。", "第二句。"):
            services[1].submit(SpeechRequest(text, NamedVoice("中文女")))  # one running, one waiting
        with pytest.raises(OverloadedError):
            runtime.check_room()
    finally:
        engine.release.set()
        for service in services:
            service.close()
