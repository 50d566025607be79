"""The integration recipes of docs/integrations.md, replayed: each client's request exactly as its source sends it
(LiveKit and Pipecat OpenAI TTS plugins, the Home Assistant openai_tts integration, Open WebUI), against a real
server, parsed the way that client parses the answer."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI
from servers import AppServer

pytestmark = pytest.mark.integration

TEXT = "Hello there. This is a test of the speech endpoint."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    app = AppServer(tmp_path_factory.mktemp("integrations"), tiny_bundle, {"TTS_INTRA_OP_THREADS": "1"}, name="integ")
    app.start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def client(server: AppServer) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="any", max_retries=0, timeout=120)


def test_livekit_openai_tts_sse_pcm(client: OpenAI) -> None:
    """livekit-plugins-openai 1.8.9 (livekit/plugins/openai/tts.py, ChunkedStream._run): model gpt-4o-mini-tts asks
    for stream_format=sse; with response_format=pcm it reads speech.audio.delta events (base64 in `delta` or `audio`)
    as 24 kHz mono int16, and trusts the Content-Type over what it asked for."""
    pcm = b""
    with client.audio.speech.with_streaming_response.create(
        input=TEXT, model="gpt-4o-mini-tts", voice="alloy", response_format="pcm", speed=1.0, stream_format="sse"
    ) as stream:
        assert stream.headers["content-type"].split(";")[0].strip().lower() == "text/event-stream"
        assert stream.headers.get("x-request-id"), "the plugin warns on every call without one"
        types = []
        for line in stream.iter_lines():
            if not line or not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            types.append(event["type"])
            if event["type"] == "speech.audio.delta":
                pcm += base64.b64decode(event.get("delta", "") or event.get("audio", ""))
    assert types[-1] == "speech.audio.done" and types.count("speech.audio.delta") >= 1
    seconds = len(pcm) / 2 / 24000
    assert len(pcm) % 2 == 0 and seconds > 0.5


def test_livekit_openai_tts_tts1_mp3(client: OpenAI) -> None:
    """The same plugin with model tts-1 and its default response_format mp3: stream_format=audio, raw bytes."""
    with client.audio.speech.with_streaming_response.create(
        input=TEXT, model="tts-1", voice="nova", response_format="mp3", speed=1.0, stream_format="audio"
    ) as stream:
        assert stream.headers["content-type"].split(";")[0] == "audio/mpeg" and stream.headers.get("x-request-id")
        assert len(stream.read()) > 1000


def test_pipecat_openai_tts_pcm_24k(client: OpenAI, server: AppServer) -> None:
    """pipecat-ai 1.14.0 (pipecat/services/openai/tts.py, run_tts): input, model, an OpenAI voice name,
    response_format pcm, optional speed; the bytes are played as 24 kHz mono int16 (OPENAI_SAMPLE_RATE)."""
    with client.audio.speech.with_streaming_response.create(
        input=TEXT, model="gpt-4o-mini-tts", voice="alloy", response_format="pcm", speed=1.0
    ) as r:
        assert r.status_code == 200 and r.headers["x-sample-rate"] == "24000"
        pcm = b"".join(r.iter_bytes(4096))
    audio = np.frombuffer(pcm, dtype=np.int16)
    assert audio.size > 24000 // 2


def test_home_assistant_openai_tts(server: AppServer) -> None:
    """sfortis/openai_tts (custom_components/openai_tts/openaitts_engine.py at 0460cd2): a POST to the configured URL
    with model, input, voice, response_format and speed, a Bearer key; the body is the audio file."""
    body = {"model": "tts-1", "input": TEXT, "voice": "shimmer", "response_format": "wav", "speed": 1}
    r = httpx.post(server.base_url + "/v1/audio/speech", json=body, headers={"Authorization": "Bearer any"}, timeout=120)
    assert r.status_code == 200 and r.content[:4] == b"RIFF" and r.headers["content-type"] == "audio/wav"
    body["response_format"] = "mp3"
    r = httpx.post(server.base_url + "/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"


def test_open_webui_lists_models_and_voices_then_speaks(server: AppServer) -> None:
    """Open WebUI's OpenAI TTS engine: GET {base}/audio/models and {base}/audio/voices for its settings page, then
    POST {base}/audio/speech with model, input and voice (mp3, the OpenAI default)."""
    base = server.base_url + "/v1"
    models = httpx.get(base + "/audio/models", timeout=30).json()
    voices = httpx.get(base + "/audio/voices", timeout=30).json()
    assert models["models"] and {"id", "name"} <= models["models"][0].keys()
    assert any(v["id"] == "alloy" or v["id"] == "中文女" for v in voices["voices"])
    body = {"model": models["models"][0]["id"], "input": TEXT, "voice": voices["voices"][0]["id"]}
    r = httpx.post(base + "/audio/speech", json=body, headers={"Authorization": "Bearer any"}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg" and len(r.content) > 1000
