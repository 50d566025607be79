"""CosyVoice2 served from the committed tiny bundle (models/tiny-cosyvoice2: 24 kHz, no built-in speakers, prompt
analysis and instruct2) as `make run MODEL_DIR=models/tiny-cosyvoice2` serves it: the official v2 client's HTTP and
gRPC requests, the native and OpenAI APIs with saved voices, both WebSockets, 24 kHz stated wherever audio goes out;
a voice saved for a CosyVoice-300M model in the same store is refused, not used."""

from __future__ import annotations

import io
import json
import struct
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dashscope
import grpc
import httpx
import numpy as np
import pytest
import requests
from dashscope.audio.tts_v2 import AudioFormat, ResultCallback, SpeechSynthesizer
from fastapi.testclient import TestClient
from gated_engine import GatedEngine, ThreadGate
from servers import REPO, AppServer, free_port
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from service.api import create_app
from service.audio.encode import resample
from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.families.cosyvoice2.model import load_engine
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")]

RATE_HZ = 24000
TOKEN_SAMPLES = 960  # one speech token: 2 mel frames of 480 samples at 24 kHz
MAKE_RUN_MODEL_DIR = Path("models/tiny-cosyvoice2")  # as `make run MODEL_DIR=...` names it (the server runs in REPO)
PROMPTS = REPO / "tests" / "reference" / "tiny-cosyvoice2" / "prompts"
V1_PROMPTS = REPO / "tests" / "reference" / "tiny" / "prompts"
TTS_TEXT = "收到好友从远方寄来的生日礼物。"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
EN_TEXT = "<|en|>And then later on, fully acquiring that company."
INSTRUCT = "用四川话说这句话"
ZERO_SHOT, CROSS_LINGUAL = "v2-zero-shot", "v2-cross-lingual"  # saved on the server by the `saved` fixture
DEFAULT_VOICE = "v2-default"  # TTS_DEFAULT_SPEAKER of the in-process app, saved only by its test


# ---- servers --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One voices directory for every app of this module, as replicas on one volume share it."""
    return tmp_path_factory.mktemp("cv2-voices")


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_v2_bundle: Path, voices_dir: Path, grpc_port: int
) -> Iterator[AppServer]:
    """`python -m service.api` with what `make run MODEL_DIR=models/tiny-cosyvoice2` sets (TTS_MODEL_DIR as make
    passes it, TTS_HOST, TTS_PORT, TTS_GRPC_PORT on a free port), saved voices in `voices_dir`, no rate limit."""
    assert (REPO / MAKE_RUN_MODEL_DIR).resolve() == tiny_v2_bundle.resolve()
    env = {"TTS_GRPC_PORT": str(grpc_port), "TTS_VOICES_DIR": str(voices_dir)}
    env |= {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_INTRA_OP_THREADS": "1"}
    app = AppServer(tmp_path_factory.mktemp("cv2-serving"), MAKE_RUN_MODEL_DIR, env, name="cv2")
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
    """Two voices saved on the server: zero-shot (with its transcript) and cross-lingual (without); their records."""
    made = {
        ZERO_SHOT: save_voice(http, ZERO_SHOT, PROMPTS / "zh_16k.wav", PROMPT_TEXT),
        CROSS_LINGUAL: save_voice(http, CROSS_LINGUAL, PROMPTS / "en_48k_stereo.wav"),
    }
    for response in made.values():
        assert response.status_code == 201, response.text
    return {name: response.json() for name, response in made.items()}


def save_voice(client: httpx.Client | TestClient, name: str, wav: Path, transcript: str = "") -> httpx.Response:
    files = {"audio": (wav.name, wav.read_bytes(), "audio/wav")}
    return client.post("/v1/voices", data={"name": name, "transcript": transcript}, files=files)


@dataclass
class LocalApp:
    """The bundle served in this process: a TestClient, and its engine behind a gate (tests/gated_engine.py)."""

    client: TestClient
    gate: ThreadGate
    engines: list[GatedEngine]


@pytest.fixture(scope="module")
def local(tiny_v2_bundle: Path, voices_dir: Path) -> Iterator[LocalApp]:
    """The same bundle and voices directory in this process, with OpenAI pcm at 22,050 Hz and TTS_DEFAULT_SPEAKER
    naming a voice that is not saved yet."""
    gate, engines = ThreadGate(), []

    def gated(bundle: ModelBundle, options: RuntimeOptions) -> GatedEngine:
        engines.append(GatedEngine(load_engine(bundle, options), gate))  # type: ignore[arg-type]
        return engines[-1]

    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, model_dir=tiny_v2_bundle, voices_dir=voices_dir, intra_op_threads=1, rate_limit_per_minute=0,
        openai_pcm_sample_rate_hz=22050, default_speaker=DEFAULT_VOICE,
    )  # fmt: skip
    with TestClient(create_app(settings, engine_loader=gated)) as client:
        yield LocalApp(client, gate, engines)


@pytest.fixture(scope="module")
def token_bounds(local: LocalApp) -> Callable[[str], tuple[int, int]]:
    """Fewest and most speech tokens the engine makes for a text: one per sentence, and the official 20x its text
    tokens per sentence. Not the official 2x either: before it the official v2 sampler masks EOS only
    (Qwen2LM.sampling_ids at ace7c47), while the two stop tokens after EOS end a sentence too, and the engine samples as
    the official does; the tiny random model draws one of them now and then (a sentence of 8 tokens against the 2x
    bound of 18 failed this test once in a CI run, requests carry no seed)."""
    frontend = local.client.app.state.tts.runtime.frontend  # type: ignore[attr-defined]

    def bounds(text: str) -> tuple[int, int]:
        counts = [len(s.ids) for s in frontend.sentences(text) if s.ids]
        return len(counts), sum(20 * n for n in counts)

    return bounds


# ---- what 24 kHz audio looks like ---------------------------------------------------------------------
def assert_speech_tokens(samples: int, text: str, bounds: Callable[[str], tuple[int, int]]) -> None:
    """`samples` at 24 kHz are whole speech tokens (960 samples each), as many as the engine may make for `text`."""
    least, most = bounds(text)
    assert samples % TOKEN_SAMPLES == 0, f"{samples} samples are not whole 24 kHz speech tokens"
    assert least <= samples // TOKEN_SAMPLES <= most, (samples // TOKEN_SAMPLES, least, most)


def pcm_of(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0
    return np.frombuffer(data, dtype="<i2")


def wav_facts(data: bytes) -> tuple[int, int, np.ndarray]:
    """(sample rate, declared data size, samples) of a mono 16-bit WAV, read from its 44-byte header."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    channels, rate = struct.unpack_from("<HI", data, 22)
    assert channels == 1
    return rate, struct.unpack_from("<I", data, 40)[0], pcm_of(data[44:])


# ---- 1. the official HTTP endpoints, as the official v2 client sends them -----------------------------------
def official_client(base_url: str, mode: str, prompt_wav: Path | None = None, **fields: str) -> tuple[requests.Response, bytes]:
    """runtime/python/fastapi/client.py: GET /inference_<mode> with a form body (the prompt as a multipart file),
    stream=True, 16000-byte chunks concatenated (then read as int16)."""
    files = None
    if prompt_wav is not None:
        files = [("prompt_wav", ("prompt_wav", prompt_wav.open("rb"), "application/octet-stream"))]
    response = requests.request("GET", f"{base_url}/inference_{mode}", data=fields, files=files, stream=True, timeout=120)
    tts_audio = b""
    for r in response.iter_content(chunk_size=16000):
        tts_audio += r
    return response, tts_audio


def assert_official_pcm(response: requests.Response, audio: bytes, text: str, bounds: Callable[[str], tuple[int, int]]) -> None:
    assert response.status_code == 200, audio[:500]
    assert "rate=24000" in response.headers["content-type"] and response.headers["x-sample-rate"] == "24000"
    pcm = pcm_of(audio)
    assert_speech_tokens(pcm.size, text, bounds)
    assert np.abs(pcm.astype(np.int32)).max() > 0, "silence"


@pytest.mark.parametrize(
    ("mode", "prompt", "fields"),
    [
        ("zero_shot", "zh_16k.wav", {"tts_text": TTS_TEXT, "prompt_text": PROMPT_TEXT}),
        ("cross_lingual", "en_48k_stereo.wav", {"tts_text": EN_TEXT}),
        ("instruct2", "en_24k.wav", {"tts_text": TTS_TEXT, "instruct_text": INSTRUCT}),
        ("instruct", None, {"tts_text": TTS_TEXT, "spk_id": CROSS_LINGUAL, "instruct_text": INSTRUCT}),
    ],
)
def test_the_official_client_gets_24khz_pcm_in_every_v2_mode(
    server: AppServer,
    saved: dict[str, dict[str, Any]],
    token_bounds: Callable[[str], tuple[int, int]],
    mode: str,
    prompt: str | None,
    fields: dict[str, str],
) -> None:
    """instruct with a saved voice as spk_id is instruct2 on that voice (the official v2 has no built-in speakers)."""
    response, audio = official_client(server.base_url, mode, PROMPTS / prompt if prompt else None, **fields)
    assert_official_pcm(response, audio, fields["tts_text"], token_bounds)


def _json_error(response: requests.Response | httpx.Response, body: bytes, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, body[:300]
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = json.loads(body)["error"]
    return error


def test_sft_names_that_the_model_has_no_builtin_speakers(server: AppServer) -> None:
    response, body = official_client(server.base_url, "sft", tts_text="你好。", spk_id="中文女")
    error = _json_error(response, body)
    assert error["code"] == "unknown_speaker" and error["param"] == "spk_id"
    assert "'中文女'" in error["message"] and "no built-in speakers" in error["message"]


def test_instruct_with_an_unknown_voice_is_a_json_400(server: AppServer) -> None:
    response, body = official_client(server.base_url, "instruct", tts_text="你好。", spk_id="无此人", instruct_text=INSTRUCT)
    error = _json_error(response, body)
    assert error["code"] == "unknown_speaker" and error["param"] == "spk_id" and "no built-in speakers" in error["message"]


# ---- 2. the native API ------------------------------------------------------------------------------
def test_info_states_24khz_the_capabilities_and_no_speakers(http: httpx.Client) -> None:
    info = http.get("/info").json()
    assert info["sample_rate_hz"] == RATE_HZ and info["speakers"] == [] and info["openai_voices"] == {}
    caps = info["capabilities"]
    assert caps["prompt_analysis"] and caps["instruct2"] and not caps["instruct"] and not caps["builtin_speakers"]
    assert info["test_model"] and info["random_weights"] and info["warning"]


def test_a_request_without_a_voice_says_which_voice_it_would_speak_as(http: httpx.Client) -> None:
    """The server's TTS_DEFAULT_SPEAKER (中文女) is no speaker of this model and no saved voice."""
    response = http.post("/tts", json={"text": "你好。"})
    error = _json_error(response, response.content)
    assert error["code"] == "unknown_speaker" and error["param"] == "speaker"
    message = error["message"]
    assert "'中文女'" in message and "TTS_DEFAULT_SPEAKER" in message and "no built-in speakers" in message


def test_saving_records_a_zero_shot_and_a_cross_lingual_v2_voice(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    zero, cross = saved[ZERO_SHOT], saved[CROSS_LINGUAL]
    assert zero["kind"] == "zero_shot" and zero["transcript"] == PROMPT_TEXT
    assert cross["kind"] == "cross_lingual" and cross["transcript"] == ""
    assert zero["mel_variant"] == cross["mel_variant"] == "cosyvoice2"
    # 25 speech tokens a second (speech_tokenizer_v2)
    assert zero["prompt_tokens"] == pytest.approx(25 * zero["duration_s"], abs=2)
    listed = [v["id"] for v in http.get("/v1/voices").json()["data"]]
    assert {ZERO_SHOT, CROSS_LINGUAL} <= set(listed)
    assert {ZERO_SHOT, CROSS_LINGUAL} <= {v["id"] for v in http.get("/v1/audio/voices").json()["voices"]}


@pytest.mark.parametrize("voice", [ZERO_SHOT, CROSS_LINGUAL])
def test_tts_with_a_saved_voice_is_a_24khz_wav(
    http: httpx.Client, saved: dict[str, dict[str, Any]], token_bounds: Callable[[str], tuple[int, int]], voice: str
) -> None:
    response = http.post("/tts", json={"text": TTS_TEXT, "speaker": voice, "seed": 3})
    assert response.status_code == 200, response.text
    assert response.headers["x-sample-rate"] == "24000"
    with wave.open(io.BytesIO(response.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE_HZ, 1, 2)
        frames = w.getnframes()
        assert len(w.readframes(frames)) == 2 * frames == len(response.content) - 44
    assert_speech_tokens(frames, TTS_TEXT, token_bounds)


def test_a_streamed_tts_wav_says_24khz_and_streams_its_chunks(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    body = b""
    with http.stream("POST", "/tts", json={"text": TTS_TEXT, "speaker": ZERO_SHOT, "stream": True, "seed": 4}) as response:
        assert response.status_code == 200 and response.headers["x-sample-rate"] == "24000"
        assert "content-length" not in response.headers
        for piece in response.iter_bytes():
            body += piece
    rate, declared, pcm = wav_facts(body)
    assert rate == RATE_HZ and declared == 0xFFFFFFFF  # a stream's header: sizes unknown
    assert pcm.size > 0 and np.abs(pcm.astype(np.int32)).max() > 0


def test_streamed_audio_arrives_while_the_rest_is_being_made(local: LocalApp, saved: dict[str, dict[str, Any]]) -> None:
    """The engine is held after its first chunk (the gate is closed): that chunk's audio arrives before any other
    chunk exists; opened, the stream ends with the rest (timing by construction, not by speed)."""
    engine = local.engines[0]
    before = engine.chunks
    local.gate.clear()
    try:
        request = {"text": TTS_TEXT, "speaker": ZERO_SHOT, "stream": True, "format": "pcm", "seed": 4}
        with local.client.stream("POST", "/tts", json=request) as response:
            assert response.status_code == 200 and "rate=24000" in response.headers["content-type"]
            pieces = response.iter_bytes()
            first = next(pieces)
            assert len(first) > 0 and engine.chunks == before + 1, "the first audio came after the second chunk was made"
            local.gate.set()
            rest = b"".join(pieces)
    finally:
        local.gate.set()
    assert engine.chunks > before + 1 and len(rest) > 0


def flow_cache_gauge(client: TestClient, name: str) -> float:
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"/metrics has no {name}"
    return float(lines[0].split()[1])


def test_metrics_count_a_held_streams_flow_caches_and_let_them_go(local: LocalApp, saved: dict[str, dict[str, Any]]) -> None:
    """/metrics shows the bound on the streams' flow caches and what they hold: a stream held after its first chunk
    (the gate is closed) holds some, none once it has ended."""
    assert flow_cache_gauge(local.client, "tts_flow_cache_limit_bytes") > 0  # auto: half of what the memory limit leaves
    assert flow_cache_gauge(local.client, "tts_flow_cache_bytes") == 0
    local.gate.clear()
    try:
        request = {"text": TTS_TEXT, "speaker": ZERO_SHOT, "stream": True, "format": "pcm", "seed": 5}
        with local.client.stream("POST", "/tts", json=request) as response:
            pieces = response.iter_bytes()
            assert len(next(pieces)) > 0
            assert flow_cache_gauge(local.client, "tts_flow_cache_bytes") > 0
            assert flow_cache_gauge(local.client, "tts_flow_cache_waiting") == 0
            local.gate.set()
            assert len(b"".join(pieces)) > 0
    finally:
        local.gate.set()
    assert flow_cache_gauge(local.client, "tts_flow_cache_bytes") == 0


def test_tts_prompt_clones_a_one_off_recording_at_24khz(
    http: httpx.Client, token_bounds: Callable[[str], tuple[int, int]]
) -> None:
    files = {"prompt_wav": ("p.wav", (PROMPTS / "en_24k.wav").read_bytes(), "audio/wav")}
    response = http.post("/tts/prompt", data={"text": TTS_TEXT, "format": "wav", "seed": "5"}, files=files)
    assert response.status_code == 200, response.text
    rate, declared, pcm = wav_facts(response.content)
    assert rate == RATE_HZ and declared == 2 * pcm.size
    assert_speech_tokens(pcm.size, TTS_TEXT, token_bounds)


def test_a_deleted_voice_is_gone(http: httpx.Client) -> None:
    assert save_voice(http, "v2-short-lived", PROMPTS / "en_24k.wav").status_code == 201
    assert http.post("/tts", json={"text": "你好。", "speaker": "v2-short-lived", "format": "pcm"}).status_code == 200
    assert http.delete("/v1/voices/v2-short-lived").status_code == 204
    response = http.post("/tts", json={"text": "你好。", "speaker": "v2-short-lived"})
    assert _json_error(response, response.content)["code"] == "unknown_speaker"
    assert http.get("/v1/voices/v2-short-lived").status_code == 404


def test_the_default_speaker_may_name_a_voice_saved_later(local: LocalApp) -> None:
    """TTS_DEFAULT_SPEAKER names no voice at start (the app starts, with a warning); once a voice of that name is
    saved, requests that name none speak with it; deleted, they are refused again."""
    client = local.client
    refused = client.post("/tts", json={"text": "你好。"})
    error = _json_error(refused, refused.content)
    assert error["code"] == "unknown_speaker" and f"'{DEFAULT_VOICE}'" in error["message"]
    assert "TTS_DEFAULT_SPEAKER" in error["message"]
    assert save_voice(client, DEFAULT_VOICE, PROMPTS / "zh_16k.wav", PROMPT_TEXT).status_code == 201
    try:
        spoken = client.post("/tts", json={"text": "你好。", "seed": 1})
        assert spoken.status_code == 200, spoken.text
        assert wav_facts(spoken.content)[0] == RATE_HZ
        named = client.post("/tts", json={"text": "你好。", "seed": 1, "speaker": DEFAULT_VOICE})
        assert named.content == spoken.content
        assert client.get("/readyz").json()["status"] == "ready"
    finally:
        assert client.delete(f"/v1/voices/{DEFAULT_VOICE}").status_code == 204
    assert client.post("/tts", json={"text": "你好。"}).status_code == 400


# ---- 3. OpenAI --------------------------------------------------------------------------------------
def speech(client: httpx.Client | TestClient, **body: Any) -> httpx.Response:
    request = {"model": "tts-1", "input": EN_TEXT, "voice": CROSS_LINGUAL, "seed": 11, "stream": False} | body
    response = client.post("/v1/audio/speech", json=request)
    assert response.status_code == 200, response.text
    return response


def test_openai_pcm_is_the_model_audio_at_24khz_without_resampling(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    response = speech(http, response_format="pcm")
    assert "rate=24000" in response.headers["content-type"] and response.headers["x-sample-rate"] == "24000"
    native = http.post("/tts", json={"text": EN_TEXT, "speaker": CROSS_LINGUAL, "seed": 11, "format": "pcm"})
    assert native.status_code == 200 and native.headers["x-sample-rate"] == "24000"
    assert response.content == native.content and len(native.content) > 0


def test_openai_wav_header_says_24khz(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    rate, declared, pcm = wav_facts(speech(http, response_format="wav").content)
    assert rate == RATE_HZ and declared == 2 * pcm.size > 0


def test_openai_pcm_at_22050_is_resampled_from_24khz(local: LocalApp, saved: dict[str, dict[str, Any]]) -> None:
    """TTS_OPENAI_PCM_SAMPLE_RATE_HZ=22050: the same audio (same voice, text and seed) at 22,050 samples a second."""
    resampled = speech(local.client, response_format="pcm")
    assert "rate=22050" in resampled.headers["content-type"] and resampled.headers["x-sample-rate"] == "22050"
    native = local.client.post("/tts", json={"text": EN_TEXT, "speaker": CROSS_LINGUAL, "seed": 11, "format": "pcm"})
    model_audio, out = pcm_of(native.content), pcm_of(resampled.content)
    assert model_audio.size % TOKEN_SAMPLES == 0 and model_audio.size > 0
    assert out.size == -(-model_audio.size * 22050 // RATE_HZ)  # resample_poly's length: ceil(n * 147 / 160)
    expected = resample(model_audio.astype(np.float32) / 32768, RATE_HZ, 22050) * 32768
    assert np.abs(out - expected).max() <= 4, "not the model's audio resampled"  # both rounded to int16


def test_openai_instructions_drive_instruct2_on_a_saved_voice(http: httpx.Client, saved: dict[str, dict[str, Any]]) -> None:
    plain = speech(http, response_format="pcm")
    styled = speech(http, response_format="pcm", instructions="Speak like a pirate.")
    assert "warning" not in styled.headers, styled.headers.get("warning")
    assert styled.headers["x-sample-rate"] == "24000" and len(styled.content) > 0
    assert styled.content != plain.content, "the instructions changed nothing"


# ---- 4. gRPC, as the official client sends it ------------------------------------------------------------
@pytest.fixture(scope="module")
def channel(server: AppServer, grpc_port: int) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        yield ch


def prompt_pcm16k(path: Path) -> bytes:
    """What the official client sends as prompt_audio: the recording at 16 kHz as raw int16 mono PCM."""
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return w.readframes(w.getnframes())


def grpc_request(mode: str, **args: Any) -> cosyvoice_pb2.Request:
    """Built as runtime/python/grpc/client.py builds it: one sub-request, copied into the Request's oneof."""
    request = cosyvoice_pb2.Request()
    sub = {
        "sft": cosyvoice_pb2.sftRequest,
        "zero_shot": cosyvoice_pb2.zeroshotRequest,
        "cross_lingual": cosyvoice_pb2.crosslingualRequest,
        "instruct": cosyvoice_pb2.instructRequest,
    }[mode](**args)
    getattr(request, f"{mode}_request").CopyFrom(sub)
    return request


def grpc_audio(channel: grpc.Channel, request: cosyvoice_pb2.Request) -> tuple[np.ndarray, int]:
    """client.py's loop: every tts_audio joined and read as int16; and how many messages brought it."""
    messages = list(cosyvoice_pb2_grpc.CosyVoiceStub(channel).Inference(request, timeout=120))
    return np.frombuffer(b"".join(r.tts_audio for r in messages), dtype=np.int16), len(messages)


@pytest.mark.parametrize(
    ("mode", "args"),
    [
        ("zero_shot", {"tts_text": TTS_TEXT, "prompt_text": PROMPT_TEXT, "prompt_audio": prompt_pcm16k(PROMPTS / "zh_16k.wav")}),
        ("cross_lingual", {"tts_text": EN_TEXT, "prompt_audio": prompt_pcm16k(PROMPTS / "zh_16k.wav")}),
        ("instruct", {"tts_text": TTS_TEXT, "spk_id": ZERO_SHOT, "instruct_text": INSTRUCT}),
    ],
)
def test_the_official_grpc_client_gets_24khz_audio(
    channel: grpc.Channel,
    saved: dict[str, dict[str, Any]],
    token_bounds: Callable[[str], tuple[int, int]],
    mode: str,
    args: dict[str, Any],
) -> None:
    audio, messages = grpc_audio(channel, grpc_request(mode, **args))
    assert_speech_tokens(audio.size, args["tts_text"], token_bounds)
    assert np.abs(audio.astype(np.int32)).max() > 0 and messages >= 1


def test_grpc_sft_with_an_unknown_speaker_is_invalid_argument(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        grpc_audio(channel, grpc_request("sft", spk_id="中文女", tts_text="你好。"))
    error = caught.value
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "no built-in speakers" in error.details() and "sft_request.spk_id" in error.details()


# ---- 5. the WebSockets ------------------------------------------------------------------------------
def test_the_websocket_speaks_a_saved_voice_at_24khz(server: AppServer, saved: dict[str, dict[str, Any]]) -> None:
    with connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", max_size=None, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "config", "voice": ZERO_SHOT, "seed": 2}))
        ready = json.loads(ws.recv(timeout=30))
        assert ready["type"] == "ready" and ready["sample_rate"] == RATE_HZ and ready["voice"] == ZERO_SHOT
        ws.send(json.dumps({"type": "text", "text": "今天天气很好。明天见。"}))
        ws.send(json.dumps({"type": "close"}))
        audio, events = b"", []
        try:
            while True:
                message = ws.recv(timeout=60)
                if isinstance(message, bytes):
                    audio += message[8:]  # after the frame header (sequence, sentence)
                else:
                    events.append(json.loads(message))
        except ConnectionClosed:
            pass
    ends = [e for e in events if e["type"] == "sentence_end"]
    assert events[-1]["type"] == "done" and len(ends) == 2 and all(e["spoken"] for e in ends)
    samples = pcm_of(audio).size
    assert samples % TOKEN_SAMPLES == 0 and samples > 0
    assert ends[-1]["end"] == pytest.approx(samples / RATE_HZ, abs=1e-3)  # captions on the 24 kHz timeline


class Recorder(ResultCallback):
    """The audio and every event of one SDK task."""

    def __init__(self) -> None:
        self.audio = bytearray()
        self.outputs: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def on_event(self, message: str) -> None:
        self.outputs.append(json.loads(message)["payload"]["output"])

    def on_data(self, data: bytes) -> None:
        self.audio += data

    def on_error(self, message: str) -> None:
        self.errors.append(message)


@pytest.fixture
def dashscope_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK will not connect without a key; the server has none configured, so any is accepted."""
    monkeypatch.setattr(dashscope, "api_key", "unused-without-TTS_API_KEYS")


def dashscope_url(server: AppServer) -> str:
    return f"ws://127.0.0.1:{server.port}/api-ws/v1/inference"


@pytest.mark.usefixtures("dashscope_key")
def test_dashscope_call_with_a_saved_voice_returns_a_24khz_wav(server: AppServer, saved: dict[str, dict[str, Any]]) -> None:
    tts = SpeechSynthesizer(
        model="cosyvoice-v2", voice=CROSS_LINGUAL, format=AudioFormat.WAV_24000HZ_MONO_16BIT, url=dashscope_url(server)
    )
    rate, declared, pcm = wav_facts(bytes(tts.call("今天天气很好。")))
    assert rate == RATE_HZ and declared == 0xFFFFFFFF and pcm.size % TOKEN_SAMPLES == 0 and pcm.size > 0
    assert tts.get_response()["header"]["event"] == "task-finished"


@pytest.mark.usefixtures("dashscope_key")
def test_dashscope_streaming_pcm_at_24khz_times_sentences_on_it(server: AppServer, saved: dict[str, dict[str, Any]]) -> None:
    """PCM at the model's own rate (nothing resampled), an instruction on the saved voice (instruct2), and
    sentence-end times in milliseconds of that audio."""
    recorder = Recorder()
    tts = SpeechSynthesizer(
        model="cosyvoice-v2", voice=ZERO_SHOT, format=AudioFormat.PCM_24000HZ_MONO_16BIT, instruction=INSTRUCT,
        callback=recorder, url=dashscope_url(server),
    )  # fmt: skip
    for piece in ("今天天气", "很好。明天", "见。"):
        tts.streaming_call(piece)
    tts.streaming_complete()
    assert recorder.errors == []
    samples = pcm_of(bytes(recorder.audio)).size
    assert samples % TOKEN_SAMPLES == 0 and samples > 0
    ends = [o["sentence"] for o in recorder.outputs if o.get("type") == "sentence-end"]
    assert [e["index"] for e in ends] == [0, 1]
    assert ends[-1]["end_time"] == round(1000 * samples / RATE_HZ)


# ---- 6. the server `make run MODEL_DIR=models/tiny-cosyvoice2` starts ---------------------------------------
def test_make_run_with_the_v2_bundle_is_ready_and_clones(
    server: AppServer, http: httpx.Client, token_bounds: Callable[[str], tuple[int, int]]
) -> None:
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready" and ready.json()["engine"] == "ok"
    assert http.get("/info").json()["model"] == "CosyVoice2-0.5B-tiny-random-int8"
    fields = {"tts_text": TTS_TEXT, "prompt_text": PROMPT_TEXT}
    response, audio = official_client(server.base_url, "zero_shot", PROMPTS / "zh_16k.wav", **fields)
    assert_official_pcm(response, audio, TTS_TEXT, token_bounds)


# ---- 7. a voice saved for CosyVoice-300M in the same store ----------------------------------------------
def test_a_voice_saved_by_a_v1_model_is_refused_and_kept(
    http: httpx.Client, channel: grpc.Channel, tiny_bundle: Path, voices_dir: Path
) -> None:
    """Its analysis came from the v1 prompt models (speech_tokenizer_v1, 50 Hz): a clear 400 on every transport,
    nothing deleted."""
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, model_dir=tiny_bundle, voices_dir=voices_dir, intra_op_threads=1, rate_limit_per_minute=0
    )
    with TestClient(create_app(settings)) as v1:
        assert save_voice(v1, "v1-voice", V1_PROMPTS / "zh_16k.wav").status_code == 201
    stored = sorted(p.name for p in voices_dir.glob("*.voice"))
    response = http.post("/tts", json={"text": "你好。", "speaker": "v1-voice"})
    error = _json_error(response, response.content)
    assert error["code"] == "unknown_speaker" and error["param"] == "speaker"
    assert "'v1-voice'" in error["message"] and "other prompt models" in error["message"]
    openai = http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "v1-voice"})
    assert _json_error(openai, openai.content)["param"] == "voice"
    with pytest.raises(grpc.RpcError) as caught:
        grpc_audio(channel, grpc_request("instruct", spk_id="v1-voice", tts_text="你好。", instruct_text=INSTRUCT))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "other prompt models" in caught.value.details()
    assert sorted(p.name for p in voices_dir.glob("*.voice")) == stored
    assert http.get("/v1/voices/v1-voice").json()["kind"] == "cross_lingual"
    listed = {v["id"]: v["usable"] for v in http.get("/v1/voices").json()["data"]}
    assert listed["v1-voice"] is False and all(usable for name, usable in listed.items() if name != "v1-voice")
    assert http.get("/v1/voices/v1-voice").json()["usable"] is False
    # the voice list the page and Open WebUI offer has only voices this model speaks
    assert "v1-voice" not in {v["id"] for v in http.get("/v1/audio/voices").json()["voices"]}
