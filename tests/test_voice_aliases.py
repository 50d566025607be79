"""TTS_VOICE_ALIASES: clients that accept only OpenAI voice names (Pipecat) reach any speaker or saved voice, on every
transport that takes a voice name (OpenAI, /tts, the official endpoints, the WebSocket, gRPC), listed in
/v1/audio/voices; bad values are a one-line start error, a target that does not exist yet a warning."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from servers import free_port

from service.api import create_app
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
ALIASES = "alloy=my-voice,NOVA=中文女"


def settings_for(bundle: Path, voices_dir: Path, **overrides: object) -> Settings:
    base: dict[str, object] = {"model_dir": bundle, "intra_op_threads": 1, "rate_limit_per_minute": 0, "voices_dir": voices_dir}
    return Settings(_env_file=None, **(base | overrides))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def client(
    tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory, grpc_port: int, caplog_module: list[str]
) -> Iterator[TestClient]:
    settings = settings_for(tiny_bundle, tmp_path_factory.mktemp("voices"), voice_aliases=ALIASES, grpc_port=grpc_port)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def caplog_module() -> Iterator[list[str]]:
    """Warnings logged while the module's app starts (pytest's caplog is per test)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger()
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)


def pcm(client: TestClient, path: str, **body: object) -> bytes:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.content


def test_the_setting_is_read_from_the_environment_form() -> None:
    assert Settings(_env_file=None, voice_aliases="alloy = my-voice, Nova=中文女").voice_aliases == {  # type: ignore[call-arg]
        "alloy": "my-voice",
        "nova": "中文女",
    }
    assert Settings(_env_file=None).voice_aliases == {}  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("alloy", "not a name=voice pair"),
        ("alloy=", "not a name=voice pair"),
        ("narrator=中文女", "not an OpenAI voice name"),
        ("alloy=a,ALLOY=b", "given twice"),
        ("alloy=nova", "must be a built-in speaker or a saved voice"),
    ],
)
def test_bad_values_are_refused(value: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Settings(_env_file=None, voice_aliases=value)  # type: ignore[call-arg]


def test_a_bad_value_is_a_one_line_start_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTS_")} | {"TTS_VOICE_ALIASES": "narrator=中文女"}
    done = subprocess.run([sys.executable, "-m", "service.api"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: TTS_VOICE_ALIASES: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and "not an OpenAI voice name" in done.stderr


def test_an_alias_to_a_builtin_speaker_works_on_every_http_transport(client: TestClient) -> None:
    """nova = 中文女 here (its default is 英文女): same seed, same audio as asking for 中文女 by name."""
    chinese = pcm(client, "/tts", text="你好。", speaker="中文女", format="pcm", seed=5)
    assert pcm(client, "/tts", text="你好。", speaker="nova", format="pcm", seed=5) == chinese
    assert pcm(client, "/tts", text="你好。", speaker="Nova", format="pcm", seed=5) == chinese, "OpenAI names ignore case"
    assert pcm(client, "/tts", text="你好。", speaker="shimmer", format="pcm", seed=5) != chinese, "shimmer keeps 英文女"
    speech = {"model": "tts-1", "input": "你好。", "response_format": "pcm", "seed": 5, "stream": False}
    assert pcm(client, "/v1/audio/speech", **speech, voice="nova") == pcm(client, "/v1/audio/speech", **speech, voice="中文女")
    sft = client.post("/inference_sft", data={"tts_text": "你好。", "spk_id": "nova"})
    assert sft.status_code == 200 and len(sft.content) > 1000


def ws_config(client: TestClient, voice: str) -> dict[str, object]:
    with client.websocket_connect("/v1/audio/speech/stream") as ws:
        ws.send_text(json.dumps({"type": "config", "voice": voice}))
        return dict(ws.receive_json())


def test_the_websocket_speaks_as_the_target(client: TestClient) -> None:
    ready = ws_config(client, "nova")
    assert ready["type"] == "ready" and ready["voice"] == "中文女", ready
    missing = ws_config(client, "alloy")  # my-voice is not saved
    assert missing["type"] == "error" and "'alloy' speaks as 'my-voice'" in str(missing["error"]), missing


def test_grpc_speaks_as_the_target(client: TestClient, grpc_port: int) -> None:
    """No seed over gRPC: the unseeded answer for 中文女 is cached, and nova (= 中文女) gets exactly those bytes."""

    def sft(spk_id: str) -> bytes:
        request = cosyvoice_pb2.Request(sft_request=cosyvoice_pb2.sftRequest(spk_id=spk_id, tts_text="别名测试。"))
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)  # type: ignore[no-untyped-call]
            return b"".join(r.tts_audio for r in stub.Inference(request, timeout=120))

    first = sft("中文女")
    assert len(first) > 1000 and sft("nova") == first


def test_an_alias_to_a_voice_not_saved_yet_warns_at_start_then_works_once_saved(
    client: TestClient, caplog_module: list[str], ref_dir: Path
) -> None:
    assert any("TTS_VOICE_ALIASES: alloy=my-voice names neither" in m for m in caplog_module), caplog_module
    missing = client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy"})
    assert missing.status_code == 400, missing.text
    error = missing.json()["error"]
    assert error["code"] == "unknown_speaker" and error["param"] == "voice"
    assert "'alloy' speaks as 'my-voice' (TTS_VOICE_ALIASES)" in error["message"], error
    audio = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
    saved = client.post("/v1/voices", data={"name": "my-voice"}, files={"audio": ("p.wav", audio, "audio/wav")})
    assert saved.status_code == 201, saved.text
    try:
        body = {"model": "tts-1", "input": "你好。", "response_format": "pcm", "seed": 3, "stream": False}
        assert pcm(client, "/v1/audio/speech", **body, voice="alloy") == pcm(client, "/v1/audio/speech", **body, voice="my-voice")
    finally:
        client.delete("/v1/voices/my-voice")


def test_aliases_are_listed_and_reserved(client: TestClient, ref_dir: Path) -> None:
    voices = client.get("/v1/audio/voices").json()["voices"]
    listed = {v["id"]: v for v in voices if "alias_of" in v}
    assert listed["alloy"] == {"id": "alloy", "name": "alloy → my-voice", "alias_of": "my-voice"}
    assert listed["nova"]["alias_of"] == "中文女" and listed["shimmer"]["alias_of"] == "英文女"
    info = client.get("/info").json()
    assert info["openai_voices"]["alloy"] == "my-voice" and info["openai_voices"]["echo"] == "英文男"
    audio = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
    taken = client.post("/v1/voices", data={"name": "Alloy"}, files={"audio": ("p.wav", audio, "audio/wav")})
    assert taken.status_code == 409 and taken.json()["error"]["param"] == "name", taken.text


def test_an_openai_name_on_a_model_without_speakers_says_how_to_get_a_voice(
    tiny_v2_bundle: Path, tmp_path: Path, ref_dir: Path
) -> None:
    """CosyVoice2 has no built-in speakers, so `alloy` has no default: the 400 says how to give it a voice (save one,
    alias it) and where voices are listed, on each transport's field; once aliased to a saved voice it speaks."""
    with TestClient(create_app(settings_for(tiny_v2_bundle, tmp_path / "voices"))) as c:
        requests = (
            ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "Hi.", "voice": "alloy"}}, "voice"),
            ("/tts", {"json": {"text": "Hi.", "speaker": "Alloy"}}, "speaker"),
            ("/inference_sft", {"data": {"tts_text": "Hi.", "spk_id": "alloy"}}, "spk_id"),
        )
        for path, body, field in requests:
            refused = c.post(path, **body)  # type: ignore[arg-type]
            assert refused.status_code == 400 and refused.headers["content-type"] == "application/json", refused.text
            error = refused.json()["error"]
            assert error["code"] == "unknown_speaker" and error["param"] == field, error
            message = error["message"]
            assert "no built-in speakers" in message and "POST /v1/voices" in message, message
            assert "TTS_VOICE_ALIASES=alloy=<saved voice>" in message and "GET /v1/audio/voices" in message, message
        audio = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
        assert c.post("/v1/voices", data={"name": "mine"}, files={"audio": ("p.wav", audio, "audio/wav")}).status_code == 201
    aliased = settings_for(tiny_v2_bundle, tmp_path / "voices", voice_aliases="alloy=mine")
    with TestClient(create_app(aliased)) as c:
        body = {"model": "tts-1", "input": "你好。", "response_format": "pcm", "seed": 3, "stream": False}
        assert pcm(c, "/v1/audio/speech", **body, voice="alloy") == pcm(c, "/v1/audio/speech", **body, voice="mine")
