"""The official CosyVoice client's four modes against a real server process, sent exactly as
`runtime/python/fastapi/client.py` sends them; 4xx for v2-only and bad prompts; saved voices shared through Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from fastapi.testclient import TestClient
from servers import AppServer, RedisServer

from service.api import create_app
from service.settings import Settings

pytestmark = pytest.mark.integration

INSTRUCT = (
    "Theo 'Crimson', is a fiery, passionate rebel leader. Fights with fervor for justice, but struggles with impulsiveness."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_INTRA_OP_THREADS": "1"}
    app = AppServer(tmp_path_factory.mktemp("official"), tiny_bundle, env, name="official")
    app.start()
    yield app
    app.stop()
    app.dump_log()


def official_client(base_url: str, mode: str, prompt_wav: Path | None = None, **fields: str) -> tuple[requests.Response, bytes]:
    """client.py: GET /inference_<mode> with a form body (and the prompt as a multipart file), stream=True,
    16000-byte chunks concatenated and read as int16 at 22,050 Hz."""
    files = None
    if prompt_wav is not None:
        files = [("prompt_wav", ("prompt_wav", prompt_wav.open("rb"), "application/octet-stream"))]
    response = requests.request("GET", f"{base_url}/inference_{mode}", data=fields, files=files, stream=True, timeout=120)
    tts_audio = b""
    for r in response.iter_content(chunk_size=16000):
        tts_audio += r
    return response, tts_audio


def assert_pcm(response: requests.Response, audio: bytes) -> None:
    assert response.status_code == 200, audio[:500]
    assert "rate=22050" in response.headers["content-type"]
    pcm = np.frombuffer(audio, dtype=np.int16)
    assert len(audio) % 2 == 0 and pcm.size / 22050 > 0.3 and np.abs(pcm).max() > 100


@pytest.mark.parametrize(
    ("mode", "prompt", "fields"),
    [
        ("sft", None, {"tts_text": "你好，我是通义生成式语音大模型。", "spk_id": "中文女"}),
        (
            "zero_shot",
            "zh_16k.wav",
            {"tts_text": "收到好友从远方寄来的生日礼物。", "prompt_text": "希望你以后能够做的比我还好呦。"},
        ),
        ("cross_lingual", "en_48k_stereo.wav", {"tts_text": "<|zh|>今天天气很好，我们一起去公园散步吧。"}),
        ("instruct", None, {"tts_text": "在面对挑战时，他展现了非凡的勇气。", "spk_id": "中文男", "instruct_text": INSTRUCT}),
    ],
)
def test_the_official_client_gets_audio_in_every_mode(
    server: AppServer, ref_dir: Path, mode: str, prompt: str | None, fields: dict[str, str]
) -> None:
    wav = ref_dir / "prompts" / prompt if prompt else None
    assert_pcm(*official_client(server.base_url, mode, wav, **fields))


def test_post_works_too(server: AppServer, ref_dir: Path) -> None:
    files = {"prompt_wav": ("p.wav", (ref_dir / "prompts" / "zh_44k.wav").read_bytes(), "audio/wav")}
    response = requests.post(f"{server.base_url}/inference_cross_lingual", data={"tts_text": "你好。"}, files=files, timeout=120)
    assert_pcm(response, response.content)


def _error(response: requests.Response, body: bytes, status: int) -> dict[str, Any]:
    assert response.status_code == status, body[:300]
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = json.loads(body)["error"]
    return error


def test_instruct2_is_v2_only(server: AppServer, ref_dir: Path) -> None:
    response, body = official_client(
        server.base_url, "instruct2", ref_dir / "prompts" / "zh_16k.wav", tts_text="你好。", instruct_text="x"
    )
    assert _error(response, body, 400)["code"] == "unsupported_capability"


def test_bad_prompts_on_the_official_endpoints_are_4xx(server: AppServer, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01" * 5000)
    response, body = official_client(server.base_url, "zero_shot", garbage, tts_text="你好。", prompt_text="你好。")
    assert _error(response, body, 400)["param"] == "prompt_wav"
    response, body = official_client(server.base_url, "cross_lingual", None, tts_text="你好。")  # no file at all
    assert 400 <= response.status_code < 500 and json.loads(body)["error"]["message"]
    response, body = official_client(server.base_url, "instruct", None, tts_text="你好。", spk_id="无此人", instruct_text="x")
    assert _error(response, body, 400)["code"] == "unknown_speaker"


def test_a_bundle_without_prompt_models_names_the_missing_capability(tiny_bundle: Path, tmp_path: Path, ref_dir: Path) -> None:
    from api_bundles import flagged_bundle

    manifest = json.loads((tiny_bundle / "manifest.json").read_text(encoding="utf-8"))
    graphs = {n: g for n, g in manifest["graphs"].items() if g.get("group", "core") == "core"}
    caps = dict(manifest.get("capabilities", {})) | {"prompt_analysis": False, "instruct": False}
    plain = flagged_bundle(tiny_bundle, tmp_path / "sft-only", graphs=graphs, capabilities=caps)
    settings = Settings(_env_file=None, model_dir=plain, intra_op_threads=1, voices_dir=tmp_path / "v")  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as client:
        files = {"prompt_wav": ("p.wav", (ref_dir / "prompts" / "zh_16k.wav").read_bytes(), "audio/wav")}
        zero = client.post("/inference_zero_shot", data={"tts_text": "你好。", "prompt_text": "你好。"}, files=files)
        assert zero.status_code == 400 and zero.json()["error"]["code"] == "unsupported_capability"
        assert "prompt analysis" in zero.json()["error"]["message"]
        inst = client.post("/inference_instruct", data={"tts_text": "你好。", "spk_id": "中文女", "instruct_text": "x"})
        assert inst.status_code == 400 and "instruct" in inst.json()["error"]["message"]
        speech = client.post(
            "/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": "Hi.", "instructions": "calm"}
        )
        assert speech.status_code == 200 and "ignored" in speech.headers["warning"]


def test_two_replicas_share_saved_voices_through_redis(
    redis_server: RedisServer, tiny_bundle: Path, tmp_path: Path, ref_dir: Path
) -> None:
    def app(name: str) -> TestClient:
        settings = Settings(  # type: ignore[call-arg]
            _env_file=None, model_dir=tiny_bundle, intra_op_threads=1, redis_url=redis_server.url,
            voices_dir=tmp_path / name, rate_limit_per_minute=0,
        )  # fmt: skip
        return TestClient(create_app(settings))

    wav = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
    with app("a") as first, app("b") as second:
        made = first.post("/v1/voices", data={"name": "shared", "transcript": ""}, files={"audio": ("p.wav", wav, "audio/wav")})
        assert made.status_code == 201, made.text
        assert "shared" in [v["id"] for v in second.get("/v1/voices").json()["data"]]
        assert second.post("/tts", json={"text": "你好。", "speaker": "shared", "format": "pcm"}).status_code == 200
        dup = second.post("/v1/voices", data={"name": "shared"}, files={"audio": ("p.wav", wav, "audio/wav")})
        assert dup.status_code == 409
        assert second.delete("/v1/voices/shared").status_code == 204
        assert first.get("/v1/voices/shared").status_code == 404
    assert not list(tmp_path.rglob("*.voice")), "with Redis nothing is written to the voices directory"
