"""Real clients against a real server (`python -m service.api` on a free port): the official `openai` package
and a client written like the official CosyVoice `runtime/python/fastapi/client.py`."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
import requests
import soundfile as sf
from openai import BadRequestError, OpenAI
from servers import AppServer

pytestmark = pytest.mark.integration

FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
TEXT = "Hello from the official OpenAI client."
SEED = 17
CODEC_SLACK_S = 0.12  # MP3/AAC priming and padding


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_INTRA_OP_THREADS": "1", "TTS_CACHE_MAX_BYTES": "0"}
    app = AppServer(tmp_path_factory.mktemp("clients"), tiny_bundle, env, name="clients")
    app.start()
    yield app
    app.stop()
    app.dump_log()


@pytest.fixture(scope="module")
def client(server: AppServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused-without-TTS_API_KEYS", max_retries=0, timeout=120)


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """(float samples, sample rate) of a response body, decoded without the service's code."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768, 24000  # OpenAI's pcm: 24 kHz s16le
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1).astype(np.float32) for f in container.decode(stream)]
        return np.concatenate(frames), stream.codec_context.sample_rate


@pytest.fixture(scope="module")
def reference_seconds(client: OpenAI) -> float:
    samples, rate = decode(client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav",
                                                      extra_body={"seed": SEED}).content, "wav")  # fmt: skip
    return len(samples) / rate


@pytest.mark.parametrize("fmt", FORMATS)
def test_openai_speech_create_every_format(client: OpenAI, fmt: str, reference_seconds: float) -> None:
    response = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=TEXT,
        response_format=fmt,
        extra_body={"seed": SEED},  # type: ignore[arg-type]
    )
    samples, rate = decode(response.content, fmt)
    assert len(samples) / rate == pytest.approx(reference_seconds, abs=CODEC_SLACK_S)
    assert np.abs(samples).max() > 0.01, "silence"
    assert rate in (22050, 24000, 48000)


def test_openai_over_long_input_raises_bad_request_with_openai_envelope(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.audio.speech.create(model="tts-1", voice="alloy", input="a" * 4097)
    error = caught.value
    assert error.status_code == 400 and error.code == "text_too_long" and error.param == "input"
    assert error.type == "invalid_request_error" and "4096" in error.message


def test_openai_wav_file_has_exact_sizes(client: OpenAI, tmp_path: Path) -> None:
    out = tmp_path / "speech.wav"
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav")
    response.write_to_file(out)
    assert response.response.headers["content-disposition"] == 'inline; filename="speech.wav"'
    with wave.open(str(out)) as w:
        declared = w.getnframes()
        assert declared == len(w.readframes(declared)) // 2 == (out.stat().st_size - 44) // 2 > 22050 * 0.3


def test_openai_flac_file_is_read_by_soundfile(client: OpenAI, tmp_path: Path) -> None:
    """`sf.read` raised `array is too big` on this file: its STREAMINFO declared no sample count."""
    out = tmp_path / "speech.flac"
    seeded = {"seed": SEED}
    client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="flac", extra_body=seeded).write_to_file(
        out
    )
    samples, rate = sf.read(out, dtype="int16")
    wav = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="wav", extra_body=seeded)
    assert rate == 22050 and samples.size == sf.info(out).frames > 22050 * 0.3
    assert np.array_equal(samples, np.frombuffer(wav.content[44:], dtype="<i2"))


def test_openai_with_streaming_response_receives_audio_progressively(client: OpenAI) -> None:
    text = "Streaming lets playback start early. " * 3
    arrivals: list[float] = []
    body = b""
    start = time.monotonic()
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="echo", input=text, response_format="pcm"
    ) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        for chunk in response.iter_bytes():
            arrivals.append(time.monotonic() - start)
            body += chunk
    samples, rate = decode(body, "pcm")
    assert len(samples) / rate > 1.0 and np.abs(samples).max() > 0.01
    assert len(arrivals) > 1 and arrivals[0] < arrivals[-1], "the body came in one piece"


def test_openai_sse_stream_gives_delta_events_then_done(client: OpenAI) -> None:
    events: list[dict[str, object]] = []
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="shimmer", input=TEXT, response_format="mp3", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 1 and events[-1]["type"] == "speech.audio.done" and len(events) == len(deltas) + 1
    usage = events[-1]["usage"]
    assert isinstance(usage, dict) and usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    mp3 = b"".join(base64.b64decode(str(e["audio"])) for e in deltas)
    samples, rate = decode(mp3, "mp3")
    assert rate == 22050 and len(samples) / rate > 0.3


def official_client_request(url: str, tts_text: str, spk_id: str) -> tuple[requests.Response, bytes]:
    """What `client.py` does for mode 'sft': GET with a form body, stream=True, 16000-byte chunks."""
    payload = {"tts_text": tts_text, "spk_id": spk_id}
    response = requests.request("GET", url, data=payload, stream=True, timeout=120)
    tts_audio = b""
    for r in response.iter_content(chunk_size=16000):
        tts_audio += r
    return response, tts_audio


def test_official_client_gets_int16_pcm_at_22050(server: AppServer) -> None:
    response, audio = official_client_request(server.base_url + "/inference_sft", "你好，我是通义生成式语音大模型。", "中文女")
    assert response.status_code == 200 and "rate=22050" in response.headers["content-type"]
    assert len(audio) % 2 == 0
    pcm = np.frombuffer(audio, dtype=np.int16)  # client.py: np.frombuffer(tts_audio, dtype=np.int16), saved at 22050 Hz
    assert pcm.size / 22050 > 0.5
    assert np.abs(pcm).max() > 300 and np.abs(pcm).max() <= int(0.99 * 32768) + 1


def test_official_client_unknown_speaker_gets_a_json_4xx_not_a_broken_stream(server: AppServer) -> None:
    response, body = official_client_request(server.base_url + "/inference_sft", "你好。", "不存在的说话人")
    assert 400 <= response.status_code < 500
    assert response.headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == "unknown_speaker" and error["param"] == "spk_id"
