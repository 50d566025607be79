"""Voice cloning over HTTP: saved voices (create, list, use, delete, limits, restarts, keys), one-off prompts, the
prompt-analysis cache, the audio cache key, and bad prompt input answered with 4xx JSON while nothing is stored."""

from __future__ import annotations

import errno
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.errors import UnknownSpeakerError
from service.families.model import NamedVoice, PromptAudio
from service.settings import Settings
from service.stores.voices import DirectoryVoiceStore

ADMIN = "admin-key-0123456789"
USER = "user-key-0123456789"


def settings_for(bundle: Path, voices_dir: Path, **overrides: object) -> Settings:
    base: dict[str, object] = {
        "model_dir": bundle,
        "intra_op_threads": 1,
        "rate_limit_per_minute": 0,
        "voices_dir": voices_dir,
        "max_chars": 200,
    }
    return Settings(_env_file=None, **(base | overrides))  # type: ignore[arg-type]


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def prompt_wav(ref_dir: Path) -> bytes:
    return (ref_dir / "prompts" / "zh_16k.wav").read_bytes()


@pytest.fixture(scope="module")
def client(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    voices_dir = tmp_path_factory.mktemp("voices")
    with TestClient(create_app(settings_for(tiny_bundle, voices_dir, max_voices=3))) as c:
        yield c


def create(client: TestClient, name: str, audio: bytes, transcript: str = "", **headers: str) -> Any:
    files = {"audio": ("prompt.wav", audio, "audio/wav")}
    return client.post("/v1/voices", data={"name": name, "transcript": transcript}, files=files, headers=headers)


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    return error


def test_saved_voice_lifecycle(client: TestClient, prompt_wav: bytes) -> None:
    made = create(client, "alice", prompt_wav, "希望你以后能够做的比我还好呦。")
    assert made.status_code == 201, made.text
    info = made.json()
    assert info["id"] == "alice" and info["kind"] == "zero_shot" and 3.5 < info["duration_s"] < 4.5
    assert info["prompt_tokens"] == 207  # 50 per second of the 16 kHz prompt, as the official tokenizer gives
    assert [v["id"] for v in client.get("/v1/voices").json()["data"]] == ["alice"]
    assert client.get("/v1/voices/alice").json() == info
    assert "alice" in [v["id"] for v in client.get("/v1/audio/voices").json()["voices"]]
    tts = client.post("/tts", json={"text": "你好。", "speaker": "alice", "format": "pcm", "seed": 1})
    assert tts.status_code == 200 and len(tts.content) > 2000
    speech = client.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alice", "input": "Hi.", "response_format": "wav"})
    assert speech.status_code == 200 and speech.content[:4] == b"RIFF"
    assert client.delete("/v1/voices/alice").status_code == 204
    assert error_of(client.get("/v1/voices/alice"), 404)["code"] == "not_found"
    assert error_of(client.delete("/v1/voices/alice"), 404)["code"] == "not_found"
    assert error_of(client.post("/tts", json={"text": "你好。", "speaker": "alice"}), 400)["code"] == "unknown_speaker"


def test_cross_lingual_voice_without_transcript(client: TestClient, ref_dir: Path) -> None:
    made = create(client, "bob.en", (ref_dir / "prompts" / "en_48k_stereo.wav").read_bytes())
    assert made.status_code == 201 and made.json()["kind"] == "cross_lingual"
    assert client.post("/tts", json={"text": "<|en|>Hello.", "speaker": "bob.en", "format": "pcm"}).status_code == 200
    assert client.delete("/v1/voices/bob.en").status_code == 204


@pytest.mark.parametrize(
    ("name", "status", "code"),
    [
        ("", 400, "invalid_input"),
        ("-dash-first", 400, "invalid_input"),
        ("has space", 400, "invalid_input"),
        ("x" * 65, 400, "invalid_input"),
        ("a/b", 400, "invalid_input"),
        ("中文女", 409, "voice_exists"),
        ("alloy", 409, "voice_exists"),
    ],
)
def test_bad_names_are_refused(client: TestClient, prompt_wav: bytes, name: str, status: int, code: str) -> None:
    assert error_of(create(client, name, prompt_wav), status)["code"] == code


@pytest.mark.parametrize("method", ["GET", "DELETE"])
@pytest.mark.parametrize("name", ["a" * 10_000, "%ED%A0%80", "a%20b"], ids=["10000-chars", "surrogate-bytes", "space"])
def test_a_name_no_voice_can_have_is_a_404_naming_the_rule(client: TestClient, method: str, name: str) -> None:
    """DELETE /v1/voices/<10,000 characters> was a 503 that showed the server's voices directory (ENAMETOOLONG)."""
    error = error_of(client.request(method, f"/v1/voices/{name}"), 404)
    assert error["code"] == "not_found" and error["param"] == "voice_id"
    assert "1-64 letters" in error["message"] and "/tmp" not in error["message"] and len(error["message"]) < 300, error


def test_a_speaker_no_voice_can_have_is_unknown_on_every_transport(client: TestClient) -> None:
    """Whatever a transport lets through, the voice library never hands such a name to the store (a lone surrogate
    was a UnicodeEncodeError in the file name: a 500, gRPC INTERNAL, WebSocket 1011)."""
    service = client.app.state.tts.runtime.service  # type: ignore[attr-defined]
    for name in ("\ud800", "x" * 10_000):
        with pytest.raises(UnknownSpeakerError) as info:
            service.resolve_voice(NamedVoice(name))
        assert len(info.value.message) < 300 and "\ud800" not in info.value.message


def test_a_name_of_64_letters_in_any_script_is_saved(client: TestClient, prompt_wav: bytes) -> None:
    """64 CJK letters are 192 UTF-8 bytes, a 384-character hex file name: over the file system's 255, it was a 503."""
    name = "语" * 64
    assert create(client, name, prompt_wav).status_code == 201
    assert client.get(f"/v1/voices/{name}").json()["name"] == name
    assert client.post("/tts", json={"text": "你好。", "speaker": name, "format": "pcm"}).status_code == 200
    assert client.delete(f"/v1/voices/{name}").status_code == 204


@pytest.mark.parametrize(
    ("error", "status", "code", "words"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), 507, "storage_full", "storage for saved voices is full"),
        (OSError(errno.EACCES, "Permission denied"), 503, "store_unavailable", "Permission denied"),
    ],
    ids=["disk-full", "not-writable"],
)
def test_a_store_fault_says_what_is_wrong_without_a_path_or_a_retry_hint(
    client: TestClient, prompt_wav: bytes, monkeypatch: pytest.MonkeyPatch, error: OSError, status: int, code: str, words: str
) -> None:
    """A full disk was a 503 with `Retry-After: 1` and the directory's absolute path; neither fault clears in a second."""

    def failing_write(self: DirectoryVoiceStore, path: Path, data: bytes) -> None:
        raise error

    monkeypatch.setattr(DirectoryVoiceStore, "_write", failing_write)
    response = create(client, "unlucky", prompt_wav)
    body = error_of(response, status)
    assert body["code"] == code and words in body["message"] and "/" not in body["message"], body
    assert "retry-after" not in response.headers
    assert "unlucky" not in [v["id"] for v in client.get("/v1/voices").json()["data"]]


def test_duplicates_and_the_store_limit_answer_409(client: TestClient, prompt_wav: bytes) -> None:
    for name in ("v1", "v2", "v3"):
        assert create(client, name, prompt_wav).status_code == 201
    assert error_of(create(client, "v1", prompt_wav), 409)["code"] == "voice_exists"
    assert error_of(create(client, "v4", prompt_wav), 409)["code"] == "too_many_voices"
    for name in ("v1", "v2", "v3"):
        assert client.delete(f"/v1/voices/{name}").status_code == 204


def _tone(seconds: float, rate: int = 16000, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


BAD_AUDIO = {
    "silent": wav_bytes(np.zeros(32000, np.float32), 16000),
    "too short": wav_bytes(_tone(0.5), 16000),
    "too long": wav_bytes(_tone(31.0), 16000),
    "8 kHz": wav_bytes(_tone(3.0, 8000), 8000),
    "not audio": b"this is plain text, not a recording " * 100,
    "truncated wav": wav_bytes(_tone(3.0), 16000)[:200],
    "json": b'{"audio": "no"}',
}


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_prompt_audio_is_a_4xx_and_stores_nothing(client: TestClient, case: str) -> None:
    error = error_of(create(client, "never", BAD_AUDIO[case]), 400)
    assert error["code"] == "invalid_audio" and error["param"] == "audio"
    assert client.get("/v1/voices").json()["data"] == []


def test_a_transcript_the_audio_cannot_hold_is_refused(client: TestClient, prompt_wav: bytes) -> None:
    error = error_of(create(client, "chatty", prompt_wav, "这是一个很长的句子。" * 40), 400)
    assert error["param"] == "prompt_text" and "transcript" in error["message"]
    assert client.get("/v1/voices").json()["data"] == []


def test_an_upload_over_the_limit_is_413(tiny_bundle: Path, tmp_path: Path, prompt_wav: bytes) -> None:
    settings = settings_for(tiny_bundle, tmp_path, max_upload_bytes=64 * 1024)
    with TestClient(create_app(settings)) as small:
        error = error_of(create(small, "big", prompt_wav + b"\0" * 70_000), 413)
    assert error["code"] == "payload_too_large"


def test_saved_voices_survive_a_restart(tiny_bundle: Path, tmp_path: Path, prompt_wav: bytes) -> None:
    with TestClient(create_app(settings_for(tiny_bundle, tmp_path))) as first:
        assert create(first, "keeper", prompt_wav, "希望你以后能够做的比我还好呦。").status_code == 201
        before = first.post("/tts", json={"text": "你好。", "speaker": "keeper", "format": "pcm", "seed": 3}).content
    with TestClient(create_app(settings_for(tiny_bundle, tmp_path))) as second:
        assert [v["id"] for v in second.get("/v1/voices").json()["data"]] == ["keeper"]
        after = second.post("/tts", json={"text": "你好。", "speaker": "keeper", "format": "pcm", "seed": 3}).content
    assert after == before  # the same analysis, the same seed: the same audio


def test_writes_need_an_admin_key_when_keys_are_on(tiny_bundle: Path, tmp_path: Path, prompt_wav: bytes) -> None:
    settings = settings_for(tiny_bundle, tmp_path, api_keys=USER, admin_api_keys=ADMIN)
    with TestClient(create_app(settings)) as keyed:
        assert error_of(create(keyed, "k1", prompt_wav), 401)["code"] == "unauthorized"
        assert error_of(create(keyed, "k1", prompt_wav, authorization=f"Bearer {USER}"), 403)["code"] == "forbidden"
        assert create(keyed, "k1", prompt_wav, authorization=f"Bearer {ADMIN}").status_code == 201
        assert keyed.get("/v1/voices", headers={"authorization": f"Bearer {USER}"}).status_code == 200
        assert error_of(keyed.delete("/v1/voices/k1", headers={"authorization": f"Bearer {USER}"}), 403)["code"] == "forbidden"
        assert keyed.delete("/v1/voices/k1", headers={"authorization": f"Bearer {ADMIN}"}).status_code == 204


def test_prompt_analysis_is_cached_by_the_audio_hash(client: TestClient, prompt_wav: bytes) -> None:
    voices = client.app.state.tts.runtime.voices  # type: ignore[attr-defined]
    calls = []
    real = voices.analyzer.analyze

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return real(*args, **kw)

    voices.analyzer.analyze = counting
    try:
        for name in ("c1", "c2"):
            assert create(client, name, prompt_wav).status_code == 201
    finally:
        voices.analyzer.analyze = real
        for name in ("c1", "c2"):
            client.delete(f"/v1/voices/{name}")
    assert len(calls) <= 1  # the module's earlier tests may have analysed these bytes already


def test_the_audio_cache_key_holds_the_voice(client: TestClient, prompt_wav: bytes, ref_dir: Path) -> None:
    assert create(client, "k-zh", prompt_wav).status_code == 201
    assert create(client, "k-en", (ref_dir / "prompts" / "en_24k.wav").read_bytes()).status_code == 201
    try:
        body = {"text": "缓存。", "format": "pcm", "seed": 9}
        first = client.post("/tts", json=body | {"speaker": "k-zh"})
        other = client.post("/tts", json=body | {"speaker": "k-en"})
        again = client.post("/tts", json=body | {"speaker": "k-zh"})
        assert (first.headers["x-cache"], other.headers["x-cache"], again.headers["x-cache"]) == ("miss", "miss", "hit")
        assert again.content == first.content != other.content
    finally:
        for name in ("k-zh", "k-en"):
            client.delete(f"/v1/voices/{name}")


def test_tts_takes_a_one_off_prompt_as_multipart(client: TestClient, prompt_wav: bytes) -> None:
    files = {"prompt_wav": ("p.wav", prompt_wav, "audio/wav")}
    fields = {"text": "你好。", "prompt_text": "希望你以后能够做的比我还好呦。", "format": "pcm", "seed": "2"}
    response = client.post("/tts", data=fields, files=files)
    assert response.status_code == 200, response.text
    assert response.headers["x-sample-rate"] == "22050" and len(response.content) > 2000
    streamed = client.post("/tts", data=fields | {"stream": "true", "format": "wav"}, files=files)
    assert streamed.status_code == 200 and streamed.content[:4] == b"RIFF"
    assert client.get("/v1/voices").json()["data"] == [], "a one-off prompt is not saved"
    bad = client.post("/tts", data=fields, files={"prompt_wav": ("p.wav", b"not audio at all" * 50, "audio/wav")})
    assert error_of(bad, 400)["param"] == "prompt_wav"
    form = client.post("/tts", data={"text": "你好。"})  # a form body without a prompt: told to send JSON
    assert error_of(form, 415)["code"] == "unsupported_media_type"


def test_voice_details_need_a_key_and_the_public_list_shows_only_names(
    tiny_bundle: Path, tmp_path: Path, prompt_wav: bytes
) -> None:
    """Transcripts are personal data: with keys on, a caller without one sees ids, names and `usable` (public
    listing) and no details; any valid key sees the details; `can_manage` tells the web page whether to offer save and delete."""
    settings = settings_for(tiny_bundle, tmp_path, api_keys=USER, admin_api_keys=ADMIN)
    user, admin = {"authorization": f"Bearer {USER}"}, {"authorization": f"Bearer {ADMIN}"}
    with TestClient(create_app(settings)) as keyed:
        assert create(keyed, "private", prompt_wav, "希望你以后能够做的比我还好呦。", **admin).status_code == 201
        anonymous = keyed.get("/v1/voices")
        assert anonymous.status_code == 200, anonymous.text
        assert anonymous.json()["data"] == [{"id": "private", "name": "private", "usable": True}]
        assert "希望" not in anonymous.text and anonymous.json()["can_manage"] is False
        assert error_of(keyed.get("/v1/voices/private"), 401)["code"] == "unauthorized"
        assert error_of(keyed.get("/v1/voices", headers={"authorization": "Bearer wrong-key-000"}), 401)
        listed = keyed.get("/v1/voices", headers=user).json()
        assert listed["data"][0]["transcript"] == "希望你以后能够做的比我还好呦。" and listed["can_manage"] is False
        assert keyed.get("/v1/voices/private", headers=user).json()["transcript"] == "希望你以后能够做的比我还好呦。"
        assert keyed.get("/v1/voices", headers=admin).json()["can_manage"] is True
    closed = settings_for(tiny_bundle, tmp_path, api_keys=USER, public_model_list=False)
    with TestClient(create_app(closed)) as private:
        assert error_of(private.get("/v1/voices"), 401)["code"] == "unauthorized"
        assert private.get("/v1/voices", headers=user).json()["data"][0]["id"] == "private"


def test_without_keys_everyone_sees_details_and_may_manage(client: TestClient) -> None:
    assert client.get("/v1/voices").json()["can_manage"] is True


def test_a_whole_file_in_a_raw_pcm_field_is_decoded_as_a_file(client: TestClient, ref_dir: Path) -> None:
    """gRPC prompt_audio is raw 16 kHz int16 PCM; a WAV or MP3 sent there was read as samples (header bytes included,
    a 24 kHz file at 16 kHz: 1.5 times too long) and cloned at the wrong rate. It is now recognised and decoded."""
    voices = client.app.state.tts.runtime.voices  # type: ignore[attr-defined]
    wav_24k = (ref_dir / "prompts" / "en_24k.wav").read_bytes()
    as_file = voices.analyze(PromptAudio(wav_24k))
    in_pcm_field = voices.analyze(PromptAudio(wav_24k, pcm_rate_hz=16_000))
    assert in_pcm_field.duration_s == pytest.approx(as_file.duration_s)
    assert np.array_equal(in_pcm_field.speech_tokens, as_file.speech_tokens)
    wav_16k = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
    with wave.open(io.BytesIO(wav_16k)) as w:
        raw = w.readframes(w.getnframes())
    from_raw = voices.analyze(PromptAudio(raw, pcm_rate_hz=16_000))  # what the official client sends
    assert np.array_equal(voices.analyze(PromptAudio(wav_16k, pcm_rate_hz=16_000)).speech_tokens, from_raw.speech_tokens)
