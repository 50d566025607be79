"""Fun-CosyVoice3 served from the committed tiny bundle (models/tiny-cosyvoice3: 24 kHz, no built-in speakers, prompt
analysis and instruct2) as `make run MODEL_DIR=models/tiny-cosyvoice3` serves it: the official request shapes (the
official client's HTTP endpoints including /inference_instruct2, gRPC, the examples' `<|endofprompt|>` texts), the
native and OpenAI APIs (`instructions` -> instruct2) with saved voices, the WebSocket, DashScope, the 26 presets in
/info, 24 kHz wherever audio goes out."""

from __future__ import annotations

import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dashscope
import grpc
import httpx
import numpy as np
import pytest
import requests
from dashscope.audio.tts_v2 import AudioFormat, ResultCallback, SpeechSynthesizer
from servers import REPO, AppServer, free_port
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from service.families.cosyvoice3.contract import INSTRUCT_PRESETS
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")]

RATE_HZ = 24000
TOKEN_SAMPLES = 960  # one speech token: 2 mel frames of 480 samples at 24 kHz
MAKE_RUN_MODEL_DIR = Path("models/tiny-cosyvoice3")  # as `make run MODEL_DIR=...` names it (the server runs in REPO)
PROMPTS = REPO / "tests" / "reference" / "tiny-cosyvoice3" / "prompts"
SYSTEM = "You are a helpful assistant.<|endofprompt|>"
TTS_TEXT = "收到好友从远方寄来的生日礼物。"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
CROSS_TEXT = SYSTEM + "在他讲述那个荒诞故事的过程中，他突然[laughter]停下来。"  # example.py's cross-lingual shape
INSTRUCT = INSTRUCT_PRESETS[14]  # 请用四川话表达。
ZERO_SHOT, CROSS_LINGUAL = "v3-zero-shot", "v3-cross-lingual"


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_v3_bundle: Path, grpc_port: int) -> Iterator[AppServer]:
    """`python -m service.api` with what `make run MODEL_DIR=models/tiny-cosyvoice3` sets, gRPC on a free port."""
    assert (REPO / MAKE_RUN_MODEL_DIR).resolve() == tiny_v3_bundle.resolve()
    voices = tmp_path_factory.mktemp("cv3-voices")
    env = {"TTS_GRPC_PORT": str(grpc_port), "TTS_VOICES_DIR": str(voices), "TTS_RATE_LIMIT_PER_MINUTE": "0"}
    app = AppServer(tmp_path_factory.mktemp("cv3-serving"), MAKE_RUN_MODEL_DIR, env | {"TTS_INTRA_OP_THREADS": "1"}, name="cv3")
    app.start()
    yield app
    app.stop()
    app.dump_log()


@pytest.fixture(scope="module")
def http(server: AppServer) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def saved(http: httpx.Client) -> dict[str, dict[str, Any]]:
    """Two voices saved on the server: zero-shot (with its transcript) and cross-lingual (without)."""
    made = {
        ZERO_SHOT: save_voice(http, ZERO_SHOT, PROMPTS / "zh_16k.wav", PROMPT_TEXT),
        CROSS_LINGUAL: save_voice(http, CROSS_LINGUAL, PROMPTS / "en_48k_stereo.wav"),
    }
    for response in made.values():
        assert response.status_code == 201, response.text
    return {name: response.json() for name, response in made.items()}


def save_voice(client: httpx.Client, name: str, wav: Path, transcript: str = "") -> httpx.Response:
    files = {"audio": (wav.name, wav.read_bytes(), "audio/wav")}
    return client.post("/v1/voices", data={"name": name, "transcript": transcript}, files=files)


def pcm_of(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0
    return np.frombuffer(data, dtype="<i2")


def assert_24khz_tokens(samples: int) -> None:
    assert samples % TOKEN_SAMPLES == 0, f"{samples} samples are not whole 24 kHz speech tokens"


# ---- the official HTTP endpoints, as the official client sends them ---------------------------------------
def official_client(base_url: str, mode: str, prompt_wav: Path | None = None, **fields: str) -> tuple[requests.Response, bytes]:
    """runtime/python/fastapi/client.py: GET /inference_<mode> with a form body (the prompt as a multipart file)."""
    files = None
    if prompt_wav is not None:
        files = [("prompt_wav", ("prompt_wav", prompt_wav.open("rb"), "application/octet-stream"))]
    response = requests.request("GET", f"{base_url}/inference_{mode}", data=fields, files=files, stream=True, timeout=120)
    return response, b"".join(response.iter_content(chunk_size=16000))


@pytest.mark.parametrize(
    ("mode", "prompt", "fields"),
    [
        ("zero_shot", "zh_16k.wav", {"tts_text": TTS_TEXT, "prompt_text": SYSTEM + PROMPT_TEXT}),
        ("zero_shot", "zh_16k.wav", {"tts_text": TTS_TEXT, "prompt_text": PROMPT_TEXT}),
        ("cross_lingual", "en_48k_stereo.wav", {"tts_text": CROSS_TEXT}),
        ("cross_lingual", "en_48k_stereo.wav", {"tts_text": "<|en|>And then later on, fully acquiring that company."}),
        (
            "instruct2",
            "en_24k.wav",
            {"tts_text": TTS_TEXT, "instruct_text": f"You are a helpful assistant. {INSTRUCT}<|endofprompt|>"},
        ),
        ("instruct2", "en_24k.wav", {"tts_text": TTS_TEXT, "instruct_text": "Speak slowly, in a cheerful tone."}),
        ("instruct", None, {"tts_text": TTS_TEXT, "spk_id": CROSS_LINGUAL, "instruct_text": INSTRUCT}),
    ],
)
def test_the_official_client_gets_24khz_pcm_in_every_mode(
    server: AppServer, saved: dict[str, dict[str, Any]], mode: str, prompt: str | None, fields: dict[str, str]
) -> None:
    """The examples' texts (system prompt and marker written out) and plain ones (the service adds them) alike."""
    response, audio = official_client(server.base_url, mode, PROMPTS / prompt if prompt else None, **fields)
    assert response.status_code == 200, audio[:500]
    assert "rate=24000" in response.headers["content-type"] and response.headers["x-sample-rate"] == "24000"
    assert_24khz_tokens(pcm_of(audio).size)


def test_sft_names_that_the_model_has_no_builtin_speakers(server: AppServer) -> None:
    response, body = official_client(server.base_url, "sft", tts_text="你好。", spk_id="中文女")
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == "unknown_speaker" and "no built-in speakers" in error["message"]


# ---- the native and OpenAI APIs ----------------------------------------------------------------------
def test_info_states_24khz_the_presets_and_that_it_is_a_test_model(http: httpx.Client) -> None:
    info = http.get("/info").json()
    assert (
        info["sample_rate_hz"] == RATE_HZ and info["speakers"] == [] and info["model"] == "Fun-CosyVoice3-0.5B-tiny-random-int8"
    )
    assert info["instruct_presets"] == list(INSTRUCT_PRESETS) and len(info["instruct_presets"]) == 26
    caps = info["capabilities"]
    assert caps["prompt_analysis"] and caps["instruct2"] and not caps["builtin_speakers"]
    assert info["test_model"] and info["random_weights"] and info["warning"]


def test_saving_records_cosyvoice3_voices(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    zero, cross = saved[ZERO_SHOT], saved[CROSS_LINGUAL]
    assert zero["kind"] == "zero_shot" and cross["kind"] == "cross_lingual"
    assert zero["mel_variant"] == cross["mel_variant"] == "cosyvoice3"
    assert zero["prompt_tokens"] == pytest.approx(25 * zero["duration_s"], abs=2)


@pytest.mark.parametrize("stream", [False, True])
def test_tts_with_a_saved_voice_is_24khz(http: httpx.Client, saved: dict[str, dict[str, Any]], stream: bool) -> None:
    response = http.post(
        "/tts", json={"text": "今天天气很好。明天见。", "speaker": ZERO_SHOT, "format": "pcm", "stream": stream, "seed": 3}
    )
    assert response.status_code == 200 and response.headers["x-sample-rate"] == "24000"
    assert_24khz_tokens(pcm_of(response.content).size)


def test_openai_instructions_drive_instruct2_on_a_saved_voice(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    body = {"model": "tts-1", "input": "Hello there.", "voice": CROSS_LINGUAL, "seed": 11, "response_format": "pcm"}
    plain = http.post("/v1/audio/speech", json=body)
    styled = http.post("/v1/audio/speech", json=body | {"instructions": INSTRUCT})
    assert plain.status_code == styled.status_code == 200 and styled.headers["x-sample-rate"] == "24000"
    assert styled.content != plain.content, "the instructions changed nothing"


# ---- gRPC, WebSocket, DashScope ------------------------------------------------------------------------
def prompt_pcm16k(path: Path) -> bytes:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return w.readframes(w.getnframes())


@pytest.mark.parametrize(
    ("mode", "args"),
    [
        (
            "zero_shot",
            {"tts_text": TTS_TEXT, "prompt_text": SYSTEM + PROMPT_TEXT, "prompt_audio": prompt_pcm16k(PROMPTS / "zh_16k.wav")},
        ),
        ("cross_lingual", {"tts_text": CROSS_TEXT, "prompt_audio": prompt_pcm16k(PROMPTS / "zh_16k.wav")}),
        ("instruct", {"tts_text": TTS_TEXT, "spk_id": ZERO_SHOT, "instruct_text": INSTRUCT}),
    ],
)
def test_the_official_grpc_client_gets_24khz_audio(
    server: AppServer, grpc_port: int, saved: dict[str, dict[str, Any]], mode: str, args: dict[str, Any]
) -> None:
    request = cosyvoice_pb2.Request()
    sub = {"zero_shot": cosyvoice_pb2.zeroshotRequest, "cross_lingual": cosyvoice_pb2.crosslingualRequest}
    sub["instruct"] = cosyvoice_pb2.instructRequest
    getattr(request, f"{mode}_request").CopyFrom(sub[mode](**args))
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        messages = list(cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, timeout=120))
    audio = np.frombuffer(b"".join(r.tts_audio for r in messages), dtype=np.int16)
    assert_24khz_tokens(audio.size)


def test_the_websocket_speaks_a_saved_voice_at_24khz(server: AppServer, saved: dict[str, dict[str, Any]]) -> None:
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", max_size=None, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "config", "voice": ZERO_SHOT, "seed": 2}))
        ready = json.loads(ws.recv(timeout=30))
        assert ready["type"] == "ready" and ready["sample_rate"] == RATE_HZ
        ws.send(json.dumps({"type": "text", "text": "今天天气很好。明天见。"}))
        ws.send(json.dumps({"type": "close"}))
        audio, events = b"", []
        try:
            while True:
                message = ws.recv(timeout=60)
                if isinstance(message, bytes):
                    audio += message[8:]
                else:
                    events.append(json.loads(message))
        except ConnectionClosed:
            pass
    assert events[-1]["type"] == "done" and len([e for e in events if e["type"] == "sentence_end"]) == 2
    assert_24khz_tokens(pcm_of(audio).size)


class Recorder(ResultCallback):
    def __init__(self) -> None:
        self.audio = bytearray()
        self.errors: list[str] = []

    def on_data(self, data: bytes) -> None:
        self.audio += data

    def on_error(self, message: str) -> None:
        self.errors.append(message)


def test_dashscope_streaming_pcm_at_24khz_with_an_instruction(
    server: AppServer, saved: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashscope, "api_key", "unused-without-TTS_API_KEYS")
    recorder = Recorder()
    tts = SpeechSynthesizer(
        model="cosyvoice-v3", voice=ZERO_SHOT, format=AudioFormat.PCM_24000HZ_MONO_16BIT, instruction=INSTRUCT,
        callback=recorder, url=f"ws://127.0.0.1:{server.port}/api-ws/v1/inference",
    )  # fmt: skip
    for piece in ("今天天气", "很好。明天", "见。"):
        tts.streaming_call(piece)
    tts.streaming_complete()
    assert recorder.errors == []
    assert_24khz_tokens(pcm_of(bytes(recorder.audio)).size)


def test_make_run_with_the_v3_bundle_is_ready(http: httpx.Client) -> None:
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready" and ready.json()["engine"] == "ok"
