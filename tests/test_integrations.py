"""The integration recipes of docs/integrations.md, replayed: each client's request exactly as its source sends it
(the LiveKit OpenAI TTS plugin, the Home Assistant openai_tts integration, Open WebUI), against a real server,
parsed the way that client parses the answer; Pipecat's OpenAI TTS service runs for real (tests/pipecat_tts.py)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from servers import AppServer

pytestmark = pytest.mark.integration

TEXT = "Hello there. This is a test of the speech endpoint."
REPO = Path(__file__).resolve().parents[1]
PIPECAT_DIR = REPO / ".venv" / "pipecat"  # requirements-pipecat.txt, installed apart from .venv by `make test`


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    env = {"TTS_INTRA_OP_THREADS": "1", "TTS_VOICE_ALIASES": "alloy=中文女"}  # Pipecat only speaks OpenAI names
    app = AppServer(tmp_path_factory.mktemp("integrations"), tiny_bundle, env, name="integ")
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


def test_pipecat_openai_tts_service_speaks_an_alias(client: OpenAI, server: AppServer, tmp_path: Path) -> None:
    """pipecat-ai 1.14.0 for real (requirements-pipecat.txt, in .venv/pipecat): the snippet of docs/integrations.md
    builds OpenAITTSService without a DeprecationWarning, and a Pipecat pipeline speaks through it with voice `alloy`,
    which this server maps to 中文女 (TTS_VOICE_ALIASES; Pipecat refuses any non-OpenAI name). The unseeded answer for
    中文女 is put in the audio cache by a direct request first, so Pipecat's audio is exactly 中文女's, not that of
    英文女 (alloy's default), and it is 24 kHz int16 as Pipecat plays it."""
    if not (PIPECAT_DIR / "pipecat").is_dir():
        pytest.fail("pipecat-ai is not in .venv/pipecat: run `make test` (it installs requirements-pipecat.txt there)")
    text = "Pipecat speaks through an alias."
    with client.audio.speech.with_streaming_response.create(
        input=text, model="gpt-4o-mini-tts", voice="中文女", response_format="pcm"
    ) as r:
        assert r.headers["x-sample-rate"] == "24000"
        direct = r.read()
    out = tmp_path / "pipecat.pcm"
    path = os.pathsep.join(p for p in (str(PIPECAT_DIR), os.environ.get("PYTHONPATH", "")) if p)
    argv = [sys.executable, str(REPO / "tests" / "pipecat_tts.py"), f"127.0.0.1:{server.port}", text, str(out)]
    done = subprocess.run(argv, cwd=REPO, env=os.environ | {"PYTHONPATH": path}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["deprecations"] == [], "the README's Pipecat snippet uses deprecated arguments"
    assert result["errors"] == [] and result["sample_rates"] == [24000], result
    assert len(direct) > 24000 and out.read_bytes() == direct, "Pipecat's alloy did not speak as 中文女"


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
