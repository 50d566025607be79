"""Every endpoint through create_app(test_settings) in process: shapes, formats, headers, cache, errors, metrics."""

from __future__ import annotations

import base64
import io
import json
import re
import struct
import wave
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
from api_bundles import flagged_bundle
from audio_readers import flac_streaminfo, libsndfile_read_to_end, pcm_md5, pyav_read, soundfile_read
from fastapi.testclient import TestClient

from service.api import create_app
from service.api.schemas import SPEAKER_DESCRIPTIONS
from service.audio.encode import AudioFormat
from service.families.model import NamedVoice
from service.settings import OPENAI_VOICES, Settings
from service.speech.request import SpeechRequest

FORMATS = ["wav", "pcm", "mp3", "opus", "flac", "aac"]
TEXT = "你好，今天天气很好。"


@pytest.fixture(scope="module")
def client(tiny_bundle: Path) -> Iterator[TestClient]:
    settings = Settings(_env_file=None, model_dir=tiny_bundle, intra_op_threads=1, rate_limit_per_minute=0, max_chars=300)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def fixed_client(tiny_bundle: Path) -> Iterator[TestClient]:
    """The tiny bundle with the official fixed chunk schedule: two requests of one seed stream the same samples. The
    default adaptive schedule sizes chunks from measured rates, so on a loaded machine two requests may cut (and so
    overlap-fade) at other tokens."""
    settings = Settings(
        _env_file=None,
        model_dir=tiny_bundle,
        intra_op_threads=1,
        rate_limit_per_minute=0,
        max_chars=300,
        engine_profile="stream_schedule=official",
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def flagged_client(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[TestClient]:
    """A second app: the tiny bundle with random_weights/test_model set in its manifest, and 128 kbit/s audio."""
    flags = {"random_weights": True, "test_model": True, "description": "Tiny random-weight bundle for tests."}
    bundle = flagged_bundle(tiny_bundle, tmp_path_factory.mktemp("flagged") / "tiny", **flags)
    settings = Settings(
        _env_file=None, model_dir=bundle, intra_op_threads=1, rate_limit_per_minute=0, max_chars=300, audio_bitrate_kbps=128
    )
    with TestClient(create_app(settings)) as c:
        yield c


def speakers_of(bundle: Path) -> list[str]:
    return [s["name"] for s in json.loads((bundle / "speakers.json").read_text(encoding="utf-8"))["speakers"]]


def decoded_seconds(data: bytes, fmt: str, rate: int) -> float:
    """Duration of an encoded body, decoded independently of the service (PyAV, or raw int16 for pcm)."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return len(data) / 2 / rate
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.codec_context.sample_rate


def wav_samples(data: bytes) -> np.ndarray:
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE" and data[36:40] == b"data"
    return np.frombuffer(data[44:], dtype="<i2")


def error_of(resp: object) -> dict[str, object]:
    body = resp.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"}, body
    return body["error"]  # type: ignore[no-any-return]


# ---- operations -------------------------------------------------------------------------------


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "engine": "ok", "cache": "memory: ok", "detail": None}


def test_models_list_our_id_and_the_openai_aliases(client: TestClient, tiny_bundle: Path) -> None:
    model = json.loads((tiny_bundle / "manifest.json").read_text(encoding="utf-8"))["model"]
    body = client.get("/v1/models").json()
    ids = [m["id"] for m in body["data"]]
    assert body["object"] == "list" and ids[0] == model
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids)
    assert all(m["object"] == "model" and m["created"] > 0 for m in body["data"])
    assert client.get("/v1/models/tts-1").json()["id"] == "tts-1"
    missing = client.get("/v1/models/whisper-1")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"


def test_audio_models_serve_open_webui_and_openai_list_shapes(client: TestClient) -> None:
    body = client.get("/v1/audio/models").json()
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ids
    assert body["models"] == [{"id": i, "name": i} for i in ids], "Open WebUI reads models[].id"
    assert all(m["object"] == "model" for m in body["data"])


def test_a_trained_bundle_carries_no_warning(tmp_path: Path, tiny_bundle: Path) -> None:
    flags = {"random_weights": False, "test_model": False, "model": "CosyVoice-300M-SFT"}
    bundle = flagged_bundle(tiny_bundle, tmp_path / "trained", **flags)
    settings = Settings(_env_file=None, model_dir=bundle, intra_op_threads=1, rate_limit_per_minute=0)  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as trained:
        info = trained.get("/info").json()
        card = trained.get("/v1/models").json()["data"][0]
    assert (info["random_weights"], info["test_model"], info["warning"]) == (False, False, None)
    assert (card["random_weights"], card["test_model"], card["warning"]) == (False, False, None)


def test_the_committed_tiny_bundle_says_it_is_noise(client: TestClient) -> None:
    info = client.get("/info").json()
    assert info["random_weights"] and info["test_model"] and "noise" in info["warning"]
    assert info["model"] == "CosyVoice-300M-SFT-tiny-random"
    assert client.get("/v1/models").json()["data"][0]["warning"] == info["warning"]


def test_a_random_weight_test_bundle_says_so_everywhere(flagged_client: TestClient) -> None:
    info = flagged_client.get("/info").json()
    assert info["random_weights"] is True and info["test_model"] is True
    assert "random weights" in info["warning"] and "noise" in info["warning"]
    for path in ("/v1/models", "/v1/audio/models"):
        cards = flagged_client.get(path).json()["data"]
        assert cards and all(c["random_weights"] and c["test_model"] and c["warning"] == info["warning"] for c in cards)
        assert cards[0]["description"] == "Tiny random-weight bundle for tests."
    assert flagged_client.get("/v1/models/tts-1").json()["test_model"] is True


def test_voices_are_the_bundle_speakers_then_the_openai_names_in_open_webui_shape(client: TestClient, tiny_bundle: Path) -> None:
    voices = client.get("/v1/audio/voices").json()["voices"]
    speakers = speakers_of(tiny_bundle)
    assert voices[: len(speakers)] == [{"id": s, "name": f"{s} — {SPEAKER_DESCRIPTIONS[s]}"} for s in speakers]
    assert voices[0] == {"id": "中文女", "name": "中文女 — Chinese, female"}
    aliases = voices[len(speakers) :]
    assert {v["id"]: v["alias_of"] for v in aliases} == OPENAI_VOICES
    assert {"id": "alloy", "name": "alloy → 英文女", "alias_of": "英文女"} in aliases


def test_info_describes_model_speakers_and_limits(client: TestClient, tiny_bundle: Path) -> None:
    info = client.get("/info").json()
    assert info["speakers"] == speakers_of(tiny_bundle) and info["sample_rate_hz"] == 22050
    assert info["formats"] == FORMATS and info["max_chars"] == 300 and info["openai_max_chars"] == 300
    assert info["audio_bitrate_kbps"] == 64
    assert info["openai_voices"]["alloy"] in info["speakers"] and info["normalizer"]


def test_web_page_is_served_without_external_resources(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<html" in page.text.lower()
    assert "https://" not in page.text and "http://" not in page.text, "the page must not load anything from a CDN"


def test_docs_are_served_offline(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert "https://" not in page.text and "http://" not in page.text, "the docs page must not load anything from a CDN"
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"docs/assets/swagger-ui-bundle.js", "docs/assets/swagger-ui.css"} <= set(assets)
    for asset in assets:
        resp = client.get("/" + asset)
        assert resp.status_code == 200 and len(resp.content) > 100, asset
    assert "javascript" in client.get("/docs/assets/swagger-ui-bundle.js").headers["content-type"]
    assert client.get("/redoc").status_code == 404, "ReDoc exists only as a CDN script"


def test_openapi_documents_the_public_endpoints(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/tts", "/v1/audio/speech", "/v1/models", "/v1/audio/voices", "/inference_sft", "/healthz", "/readyz"} <= set(paths)
    assert "/v1/audio/models" in paths
    assert set(paths["/inference_sft"]) == {"get", "post"}


# ---- POST /tts ----------------------------------------------------------------------------------


def test_tts_wav_is_a_whole_file_with_length_and_timings(client: TestClient) -> None:
    resp = client.post("/tts", json={"text": TEXT, "seed": 5})
    assert resp.status_code == 200 and resp.headers["content-type"] == "audio/wav"
    assert int(resp.headers["content-length"]) == len(resp.content)
    n = struct.unpack("<I", resp.content[40:44])[0] // 2
    samples = wav_samples(resp.content)
    assert n == samples.size and samples.size > 22050 * 0.3 and np.abs(samples).max() > 100
    stages = {part.split(";")[0].strip() for part in resp.headers["server-timing"].split(",")}
    assert {"frontend", "queue", "llm", "flow", "hift", "encode", "total"} <= stages
    assert resp.headers["x-sample-rate"] == "22050"


@pytest.mark.parametrize("fmt", FORMATS)
def test_tts_every_format_holds_the_same_audio(client: TestClient, fmt: str) -> None:
    """Same seed, same text: every format decodes to the duration of the WAV."""
    reference = wav_samples(client.post("/tts", json={"text": TEXT, "seed": 9}).content).size / 22050
    resp = client.post("/tts", json={"text": TEXT, "seed": 9, "format": fmt})
    assert resp.status_code == 200
    rate = int(resp.headers["x-sample-rate"])
    assert rate == (24000 if fmt == "opus" else 22050)
    assert decoded_seconds(resp.content, fmt, rate) == pytest.approx(reference, abs=0.12)


def test_tts_second_identical_request_is_a_cache_hit(client: TestClient) -> None:
    body = {"text": "缓存命中测试。", "seed": 21, "format": "flac"}
    hits = lambda: _metric(client, "tts_cache_hits_total")  # noqa: E731
    before = hits()
    first = client.post("/tts", json=body)
    second = client.post("/tts", json=body)
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    assert second.content == first.content and hits() == before + 1
    other_seed = client.post("/tts", json={**body, "seed": 22})
    assert other_seed.headers["x-cache"] == "miss"


def test_tts_stream_is_chunked_wav_with_a_streaming_header(client: TestClient) -> None:
    resp = client.post("/tts", json={"text": TEXT, "stream": True, "seed": 2})
    assert resp.status_code == 200 and "content-length" not in resp.headers
    assert resp.headers["x-accel-buffering"] == "no"
    assert resp.content[4:8] == b"\xff\xff\xff\xff" and resp.content[40:44] == b"\xff\xff\xff\xff"
    assert decoded_seconds(resp.content, "wav", 22050) == pytest.approx((len(resp.content) - 44) / 2 / 22050, abs=1e-3)


def wave_frames(data: bytes) -> tuple[int, int]:
    """(frames the header declares, frames really in the body), read with Python's wave module."""
    with wave.open(io.BytesIO(data)) as w:
        declared = w.getnframes()
        return declared, len(w.readframes(declared)) // (w.getsampwidth() * w.getnchannels())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tts", {"text": TEXT, "seed": 31}),
        ("/tts", {"text": TEXT, "seed": 31, "stream": False}),
        ("/v1/audio/speech", {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "wav", "seed": 31}),
        ("/v1/audio/speech", {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "wav", "stream": False}),
    ],
)
def test_a_wav_that_is_not_streamed_has_exact_sizes(client: TestClient, path: str, body: dict[str, object]) -> None:
    resp = client.post(path, json=body)
    assert resp.status_code == 200 and int(resp.headers["content-length"]) == len(resp.content)
    declared, real = wave_frames(resp.content)
    assert declared == real == (len(resp.content) - 44) // 2 and real > 22050 * 0.3
    assert struct.unpack("<I", resp.content[4:8])[0] == len(resp.content) - 8


def test_a_streamed_v1_wav_keeps_the_streaming_header(client: TestClient) -> None:
    body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "wav", "stream": True}
    resp = client.post("/v1/audio/speech", json=body)
    assert "content-length" not in resp.headers and resp.content[40:44] == b"\xff\xff\xff\xff"


V1_FLAC = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "flac", "seed": 33}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tts", {"text": TEXT, "seed": 33, "format": "flac"}),
        ("/v1/audio/speech", V1_FLAC),  # whole by default, like WAV
        ("/v1/audio/speech", {**V1_FLAC, "stream": False}),
    ],
)
def test_a_flac_that_is_not_streamed_states_its_length_and_soundfile_reads_it(
    client: TestClient, path: str, body: dict[str, object]
) -> None:
    """soundfile (libsndfile) raised `array is too big` on these: STREAMINFO declared no sample count."""
    resp = client.post(path, json=body)
    assert resp.status_code == 200 and int(resp.headers["content-length"]) == len(resp.content)
    samples, rate = soundfile_read(resp.content)
    assert rate == 22050 and samples.size > 22050 * 0.3
    assert flac_streaminfo(resp.content) == (22050, samples.size, pcm_md5(samples))
    decoded, _, declared = pyav_read(resp.content)
    assert np.array_equal(decoded, samples) and declared == pytest.approx(samples.size / 22050, abs=1e-3)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/tts", {"text": TEXT, "seed": 33, "format": "flac", "stream": True}), ("/v1/audio/speech", {**V1_FLAC, "stream": True})],
)
def test_a_streamed_flac_decodes_to_the_end_with_libsndfile_and_ffmpeg(
    fixed_client: TestClient, path: str, body: dict[str, object]
) -> None:
    client = fixed_client
    as_wav = {**body, "format": "wav"} if path == "/tts" else {**body, "response_format": "wav"}
    reference = wav_samples(client.post(path, json=as_wav).content)  # the same stream's samples, as WAV
    resp = client.post(path, json=body)
    assert resp.status_code == 200 and "content-length" not in resp.headers
    assert flac_streaminfo(resp.content)[:2] == (22050, 0)  # the length is unknown when the header leaves
    assert np.array_equal(libsndfile_read_to_end(resp.content), reference)
    assert np.array_equal(pyav_read(resp.content)[0], reference)


@pytest.mark.parametrize(
    ("path", "kwargs", "filename"),
    [
        ("/tts", {"json": {"text": "你好。", "format": "flac"}}, "speech.flac"),
        ("/tts", {"json": {"text": "你好。", "stream": True}}, "speech.wav"),
        ("/v1/audio/speech", {"json": {"model": "tts-1", "input": "Hi.", "voice": "alloy"}}, "speech.mp3"),
        (
            "/v1/audio/speech",
            {"json": {"model": "tts-1", "input": "Hi.", "voice": "alloy", "response_format": "opus"}},
            "speech.opus",
        ),
        ("/inference_sft", {"data": {"tts_text": "你好。", "spk_id": "中文女"}}, "speech.pcm"),
    ],
)
def test_audio_responses_name_a_file(client: TestClient, path: str, kwargs: dict[str, object], filename: str) -> None:
    resp = client.post(path, **kwargs)  # type: ignore[arg-type]
    assert resp.status_code == 200
    assert resp.headers["content-disposition"] == f'inline; filename="{filename}"'


def test_bitrate_setting_sets_the_encoded_bitrate(client: TestClient, flagged_client: TestClient) -> None:
    """Same text and seed at the default 64 kbit/s and at 128: PyAV reads each MP3 stream's bitrate back."""
    body = {"model": "tts-1", "input": TEXT, "voice": "alloy", "seed": 8, "response_format": "mp3"}
    sizes = {}
    for kbps, c in ((64, client), (128, flagged_client)):
        data = c.post("/v1/audio/speech", json=body).content
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.audio[0].bit_rate == kbps * 1000
        sizes[kbps] = len(data)
    assert sizes[128] > 1.8 * sizes[64]
    for fmt in ("opus", "aac"):
        low = client.post("/tts", json={"text": TEXT, "seed": 8, "format": fmt}).content
        high = flagged_client.post("/tts", json={"text": TEXT, "seed": 8, "format": fmt}).content
        assert len(high) > 1.3 * len(low), fmt


def test_bitrate_is_part_of_the_cache_key(client: TestClient) -> None:
    service = client.app.state.tts.service  # type: ignore[attr-defined]
    voice = NamedVoice("中文女")
    keys = {service.prepare(SpeechRequest("你好。", voice, AudioFormat.MP3, bitrate_kbps=k)).cache_key for k in (64, 96)}
    assert len(keys) == 2


def test_speed_changes_the_duration(client: TestClient) -> None:
    normal = wav_samples(client.post("/tts", json={"text": TEXT, "seed": 4}).content).size
    fast = wav_samples(client.post("/tts", json={"text": TEXT, "seed": 4, "speed": 2.0}).content).size
    assert fast == pytest.approx(normal / 2, rel=0.02)


# ---- POST /v1/audio/speech ---------------------------------------------------------------------


def test_openai_pcm_is_24khz_resampled_from_the_same_audio(client: TestClient) -> None:
    base = {"model": "tts-1", "input": "Good morning.", "voice": "alloy", "seed": 13}
    wav = client.post("/v1/audio/speech", json={**base, "response_format": "wav"})
    pcm = client.post("/v1/audio/speech", json={**base, "response_format": "pcm"})
    assert "rate=24000" in pcm.headers["content-type"] and pcm.headers["x-sample-rate"] == "24000"
    n22 = (len(wav.content) - 44) // 2
    assert len(pcm.content) // 2 == -(-n22 * 24000 // 22050)


def test_openai_default_format_is_mp3_and_instructions_drive_instruct_mode(client: TestClient) -> None:
    """The tiny bundle declares the instruct capability: `instructions` change the audio and raise no warning
    (a bundle without it answers with a Warning header: tests/test_api_official.py)."""
    base = {"model": "gpt-4o-mini-tts", "input": "Hi.", "voice": "nova", "seed": 5, "response_format": "pcm"}
    resp = client.post("/v1/audio/speech", json={**base, "response_format": "mp3", "instructions": "whisper"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "audio/mpeg"
    assert "warning" not in resp.headers
    assert decoded_seconds(resp.content, "mp3", 22050) > 0.1
    plain = client.post("/v1/audio/speech", json=base).content
    instructed = client.post("/v1/audio/speech", json={**base, "instructions": "whisper"}).content
    assert instructed != plain


def test_openai_voice_object_and_speaker_names_are_accepted(client: TestClient) -> None:
    for voice in ({"id": "英文男"}, "中文男", "ECHO"):
        body = {"model": "tts-1", "input": "Hi.", "voice": voice, "response_format": "pcm"}
        assert client.post("/v1/audio/speech", json=body).status_code == 200, voice


def test_openai_sse_events_carry_base64_audio_then_usage(client: TestClient) -> None:
    body = {"model": "tts-1", "input": "Streaming events.", "voice": "alloy", "response_format": "pcm", "stream_format": "sse"}
    resp = client.post("/v1/audio/speech", json=body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: ") :]) for line in resp.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens"] == round(len(audio) / 2 / 24000 * 50)


# a lead pause, three sentences, a pause after the first; a number the caption shows as written ("2", not 两)
TIMED_TEXT = "[pause 200ms]今天天气很好。[pause 300ms]明天要下雨。记得带2把伞。"


def sse_events(resp: object) -> list[dict[str, object]]:
    text = resp.text  # type: ignore[attr-defined]
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(("fmt", "rate", "delay"), [("pcm", 24000, 0), ("mp3", 22050, 1105), ("opus", 24000, 0)])
def test_openai_sse_timestamps_place_each_sentence_in_the_decoded_audio(
    client: TestClient, fmt: str, rate: int, delay: int
) -> None:
    """`timestamps: true` adds a speech.audio.sentence event after each sentence's audio: one per written sentence
    (sentences are not merged for synthesis then), with the sentence as written (not its reading); its times are where
    the sentence lies in what a decoder yields from the deltas (MP3: after LAME's 1105 priming samples)."""
    body = {"model": "tts-1", "input": TIMED_TEXT, "voice": "alloy", "response_format": fmt, "stream_format": "sse"}
    resp = client.post("/v1/audio/speech", json=body | {"timestamps": True})
    events = sse_events(resp)
    assert resp.status_code == 200 and events[-1]["type"] == "speech.audio.done"
    marks = [e for e in events if e["type"] == "speech.audio.sentence"]
    assert [(m["sentence"], m["text"]) for m in marks] == [(0, "今天天气很好。"), (1, "明天要下雨。"), (2, "记得带2把伞。")]
    first, second, third = (dict(m) for m in marks)
    model_rate = 22050  # the marks count the model's samples; the pauses are whole samples at that rate
    assert first["start"] == pytest.approx(round(0.2 * model_rate) / model_rate + delay / rate, abs=1e-9)
    assert second["start"] - first["end"] == pytest.approx(round(0.3 * model_rate) / model_rate, abs=1e-9)
    assert third["start"] == second["end"] and third["end"] > third["start"]  # no pause between them
    audio = b"".join(base64.b64decode(str(e["audio"])) for e in events if e["type"] == "speech.audio.delta")
    decoded = decoded_seconds(audio, fmt, rate)
    # an MP3 stream ends on a whole frame after LAME flushes its decoder delay (529 samples) past the last sample
    frame_s = (576 + 529) / rate if fmt == "mp3" else 1 / rate
    assert third["end"] <= decoded + 1 / rate and decoded - third["end"] < frame_s + 1 / rate
    before = [e for e in events[: events.index(marks[0])] if e["type"] == "speech.audio.delta"]
    if fmt == "pcm":  # the first mark comes after its audio, but for what the 22,050 -> 24,000 Hz resampler holds
        sent = sum(len(base64.b64decode(str(e["audio"]))) for e in before) / 2 / rate
        assert sent >= first["end"] - 2 * 147 / model_rate  # (it releases whole blocks of 147 inputs, one held back)


def test_openai_sse_timestamps_come_from_the_cache_only_for_one_piece_and_need_sse(client: TestClient) -> None:
    """Stored bytes carry no marks: a text spoken in one piece is answered from the cache with the mark a synthesis
    gives (its pauses left out); a text of several pieces is always synthesized."""
    one = {"model": "tts-1", "input": "[pause 100ms]缓存里的1句话。[pause 200ms]", "voice": "alloy", "response_format": "pcm"}
    one |= {"stream_format": "sse", "timestamps": True}
    fresh = client.post("/v1/audio/speech", json=one)
    cached = client.post("/v1/audio/speech", json=one)
    assert (fresh.headers["x-cache"], cached.headers["x-cache"]) == ("miss", "hit")
    marks = [[e for e in sse_events(r) if e["type"] == "speech.audio.sentence"] for r in (fresh, cached)]
    assert len(marks[0]) == len(marks[1]) == 1 and marks[1][0]["text"] == marks[0][0]["text"] == "缓存里的1句话。"
    assert marks[1][0]["start"] == pytest.approx(marks[0][0]["start"], abs=1e-9) == 0.1
    assert marks[1][0]["end"] == pytest.approx(marks[0][0]["end"], abs=1e-9)
    two = one | {"input": "缓存里的一句话。还有一句话。"}
    assert client.post("/v1/audio/speech", json=two).headers["x-cache"] == "miss"
    again = client.post("/v1/audio/speech", json=two)
    assert again.headers["x-cache"] == "miss"
    assert [e["type"] for e in sse_events(again)].count("speech.audio.sentence") == 2
    plain = client.post("/v1/audio/speech", json=one | {"stream_format": "audio"})
    assert plain.status_code == 400 and error_of(plain)["param"] == "timestamps"


def test_sse_usage_of_a_cache_hit_counts_the_tokens_of_the_audio(client: TestClient) -> None:
    """A cache hit reported output_tokens 0: the audio's length now comes with the cached bytes."""
    body = {
        "model": "tts-1",
        "input": "Cached events.",
        "voice": "alloy",
        "response_format": "pcm",
        "stream_format": "sse",
        "seed": 41,
    }
    first, second = (client.post("/v1/audio/speech", json=body) for _ in range(2))
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    done = [json.loads(r.text.strip().splitlines()[-1][len("data: ") :]) for r in (first, second)]
    assert done[0]["type"] == done[1]["type"] == "speech.audio.done"
    assert done[1]["usage"] == done[0]["usage"] and done[0]["usage"]["output_tokens"] > 0


# ---- /inference_sft ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_inference_sft_takes_form_fields_and_returns_raw_pcm(client: TestClient, method: str) -> None:
    resp = client.request(method, "/inference_sft", data={"tts_text": TEXT, "spk_id": "中文男"})
    assert resp.status_code == 200 and "rate=22050" in resp.headers["content-type"]
    pcm = np.frombuffer(resp.content, dtype="<i2")
    assert pcm.size > 22050 * 0.3 and np.abs(pcm).max() > 100
    assert not resp.content.startswith(b"RIFF")


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        ("/tts", {"text": "hi", "speaker": "nobody"}, 400, "unknown_speaker", "speaker"),
        ("/tts", {"text": "hi", "format": "wma"}, 400, "unsupported_format", "format"),
        ("/tts", {"text": "。。。"}, 400, "empty_text", "text"),
        ("/tts", {"text": "a" * 301}, 413, "text_too_long", "text"),
        ("/tts", {"text": "a\x07b"}, 400, "invalid_input", "text"),
        ("/tts", {"text": "hi", "speed": 3}, 400, "invalid_input", "speed"),
        ("/tts", {"text": "hi", "voice": "alloy"}, 400, "invalid_input", "voice"),
        ("/v1/audio/speech", {"model": "tts-1", "input": "hi", "voice": "nobody"}, 400, "unknown_speaker", "voice"),
        ("/v1/audio/speech", {"model": "tts-9", "input": "hi", "voice": "alloy"}, 400, "unknown_model", "model"),
        ("/v1/audio/speech", {"model": "tts-1", "input": "", "voice": "alloy"}, 400, "empty_text", "input"),
        ("/v1/audio/speech", {"model": "tts-1", "input": "a" * 301, "voice": "alloy"}, 400, "text_too_long", "input"),
    ],
)
def test_errors_use_the_status_table_and_envelopes(
    client: TestClient, path: str, body: dict[str, object], status: int, code: str, param: str
) -> None:
    resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    err = error_of(resp)
    assert (err["code"], err["param"]) == (code, param) and err["message"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/tts", "/v1/audio/speech"])
def test_malformed_json_names_line_and_column(client: TestClient, path: str) -> None:
    resp = client.post(
        path, content=b'{\n  "text": "hi",\n  "input": "hi"\n  "voice": "alloy"}', headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["message"] == "invalid JSON at line 4, column 3: Expecting ',' delimiter"
    assert err["param"] is None and err["code"] == "invalid_input"


@pytest.mark.parametrize("path", ["/tts", "/v1/audio/speech"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_that_is_not_json_gets_415_saying_what_to_send(client: TestClient, path: str, content_type: str) -> None:
    resp = client.post(path, content=b"text=hi&input=hi", headers={"content-type": content_type})
    assert resp.status_code == 415
    err = error_of(resp)
    assert err["code"] == "unsupported_media_type" and "Content-Type: application/json" in err["message"]
    ok = client.post(
        "/tts", content=json.dumps({"text": "你好。"}).encode(), headers={"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200


def test_unknown_spk_id_is_json_before_any_audio(client: TestClient) -> None:
    resp = client.request("GET", "/inference_sft", data={"tts_text": "你好", "spk_id": "nobody"})
    assert resp.status_code == 400 and error_of(resp)["param"] == "spk_id"


def test_body_size_limit_answers_413_before_parsing(client: TestClient) -> None:
    resp = client.post("/tts", content=b'{"text": "' + b"a" * 70_000 + b'"}', headers={"content-type": "application/json"})
    assert resp.status_code == 413 and error_of(resp)["code"] == "text_too_long"


# ---- metrics ----------------------------------------------------------------------------------


def _metric(client: TestClient, name: str, labels: str = "") -> float:
    prefix = f"{name}{{{labels}" if labels else name
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(prefix) and (labels or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_cover_requests_latency_rtf_queue_streams_cache_and_stages(client: TestClient) -> None:
    client.post("/tts", json={"text": "指标。", "seed": 1})
    client.post("/tts", json={"text": "hi", "speaker": "nobody"})
    text = client.get("/metrics").text
    assert _metric(client, "tts_requests_total", 'method="POST",route="/tts",status="200"') >= 1
    assert _metric(client, "tts_requests_total", 'method="POST",route="/tts",status="400"') >= 1
    assert _metric(client, "tts_first_chunk_seconds_count") >= 1 and _metric(client, "tts_rtf_count") >= 1
    for stage in ("frontend", "queue", "llm", "flow", "hift", "encode"):
        assert f'tts_stage_seconds_count{{stage="{stage}"}}' in text
    for gauge in ("tts_queue_depth", "tts_jobs_running", "tts_active_streams", "tts_cache_hits_total", "tts_cache_misses_total"):
        assert f"\n{gauge} " in text, gauge
    assert _metric(client, "tts_audio_seconds_total") > 0
