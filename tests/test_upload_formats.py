"""An uploaded recording never makes FFmpeg read a file or open a socket: only an allow-list of audio containers,
recognised from the bytes, reaches FFmpeg, with that container's demuxer forced and every nested open refused.

Before, FFmpeg probed any format: a 68-byte ffconcat playlist naming a server file was decoded from the working
directory and saved as a voice (201), and an SDP file bound UDP ports and waited 10-21 s."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.audio import decode
from service.audio.decode import READABLE_FORMATS, accepted_format, decode_audio
from service.errors import PromptAudioError, PromptAudioProblem
from service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
PROMPT = REPO / "tests" / "reference" / "tiny" / "prompts" / "zh_16k.wav"
# The reproduction, byte for byte (a path relative to the server's working directory), and the same
# playlist naming the file absolutely, so the test does not depend on where pytest runs.
FFCONCAT = b"ffconcat version 1.0\nfile 'tests/reference/tiny/prompts/zh_16k.wav'\n"
FFCONCAT_ABSOLUTE = f"ffconcat version 1.0\nfile '{PROMPT}'\n".encode()
SDP = b"v=0\r\no=- 0 0 IN IP4 0.0.0.0\r\ns=x\r\nc=IN IP4 0.0.0.0\r\nt=0 0\r\nm=audio 5004 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n"


def _png() -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\0")) + chunk(b"IEND", b"")


def _aiff() -> bytes:
    """An AIFF file (a container outside the allow-list, though FFmpeg reads it)."""
    samples = (np.sin(np.arange(32_000) / 8) * 8000).astype(">i2").tobytes()
    rate = b"\x40\x0d\xfa\x00\x00\x00\x00\x00\x00\x00"  # 16000.0 as an 80-bit extended float
    comm = b"COMM" + struct.pack(">IhIh", 18, 1, 16_000, 16) + rate
    ssnd = b"SSND" + struct.pack(">III", 8 + len(samples), 0, 0) + samples
    return b"FORM" + struct.pack(">I", 4 + len(comm) + len(ssnd)) + b"AIFF" + comm + ssnd


def _tone_file(container: str, codec: str) -> bytes:
    """Two seconds of a 16 kHz tone encoded by FFmpeg as `codec` in `container`."""
    samples = (np.sin(np.arange(32_000)[None] / 8) * 8000).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=16_000)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = 16_000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


# Files FFmpeg's probing reads from bytes alone and that are not an accepted audio container: playlists and
# manifests that name further files or URLs, session descriptions that open sockets, images, subtitles, metadata.
FOREIGN: dict[str, Callable[[], bytes]] = {
    "ffconcat": lambda: FFCONCAT,
    "ffconcat (absolute path)": lambda: FFCONCAT_ABSOLUTE,
    "concat with a url": lambda: b"ffconcat version 1.0\nfile 'http://127.0.0.1:9/a.wav'\n",
    "hls": lambda: f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile://{PROMPT}\n#EXT-X-ENDLIST\n".encode(),
    "m3u": lambda: f"#EXTM3U\n#EXTINF:-1,x\n{PROMPT}\n".encode(),
    "sdp": lambda: SDP,
    "rtsp-like sdp": lambda: SDP.replace(b"m=audio 5004", b"m=audio 0"),
    "dash manifest": lambda: (
        b'<?xml version="1.0"?><MPD xmlns="urn:mpeg:dash:schema:mpd:2011"><Period><AdaptationSet>'
        b"<Representation><BaseURL>file:///etc/passwd</BaseURL></Representation></AdaptationSet></Period></MPD>"
    ),
    "image2 png": _png,
    "image2 jpeg": lambda: b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xd9",
    "gif": lambda: b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",
    "srt subtitles": lambda: b"1\n00:00:00,000 --> 00:00:02,000\nhello\n\n2\n00:00:02,000 --> 00:00:04,000\nworld\n",
    "webvtt subtitles": lambda: b"WEBVTT\n\n00:00.000 --> 00:02.000\nhello\n",
    "ass subtitles": lambda: b"[Script Info]\nScriptType: v4.00+\n\n[Events]\nFormat: Start, End, Text\n",
    "microdvd subtitles": lambda: b"{0}{25}hello\n{25}{50}world\n",
    "ffmetadata": lambda: b";FFMETADATA1\ntitle=x\n",
    "aiff": _aiff,
    "avi (riff)": lambda: b"RIFF\x24\x00\x00\x00AVI LIST" + bytes(64),
    "mpeg-ts": lambda: _tone_file("mpegts", "mp2"),
    "html": lambda: b"<!DOCTYPE html><html><body><audio src='file:///etc/passwd'></audio></body></html>",
    "text": lambda: b"these are my notes, not a recording\n" * 20,
}


@pytest.fixture()
def ffmpeg_opens(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every av.open for reading, with its keyword arguments (the call itself goes through; writers are not counted:
    the tests encode their own files)."""
    calls: list[dict[str, Any]] = []
    real = av.open

    def spy(*args: Any, **kwargs: Any) -> Any:
        if (args[1] if len(args) > 1 else kwargs.get("mode", "r")) == "r":
            calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode.av, "open", spy)
    return calls


@pytest.mark.parametrize("name", list(FOREIGN))
def test_a_file_outside_the_allow_list_never_reaches_ffmpeg(name: str, ffmpeg_opens: list[dict[str, Any]]) -> None:
    with pytest.raises(PromptAudioError) as info:
        decode_audio(FOREIGN[name](), max_seconds=30)
    assert info.value.reason == PromptAudioProblem.NOT_AUDIO and info.value.code == "invalid_audio"
    assert READABLE_FORMATS in info.value.message
    assert ffmpeg_opens == [], f"{name} was handed to FFmpeg"


@pytest.mark.parametrize(
    ("container", "codec", "demuxer"),
    [("wav", "pcm_s16le", "wav"), ("flac", "flac", "flac"), ("mp3", "libmp3lame", "mp3"), ("ogg", "libopus", "ogg"),
     ("ipod", "aac", "mov"), ("adts", "aac", "aac"), ("webm", "libopus", "matroska")],
)  # fmt: skip
def test_an_accepted_file_is_opened_with_its_own_demuxer_and_no_nested_opens(
    container: str, codec: str, demuxer: str, ffmpeg_opens: list[dict[str, Any]]
) -> None:
    audio, _ = decode_audio(_tone_file(container, codec), max_seconds=30)
    assert audio.size > 0
    [kwargs] = ffmpeg_opens
    assert kwargs["format"] == demuxer and kwargs["options"]["protocol_whitelist"] == "none"
    with pytest.raises(PermissionError):
        kwargs["io_open"]("file:///etc/passwd", 1, {})


def test_an_accepted_container_with_a_foreign_codec_is_refused() -> None:
    """Matroska holding video only, and an MPEG-TS's mp2 inside a WAV header's place, are not recordings we take."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        stream = out.add_stream("mpeg4", rate=25)
        stream.width, stream.height = 16, 16
        frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    with pytest.raises(PromptAudioError) as info:
        decode_audio(buf.getvalue(), max_seconds=30)
    assert info.value.reason == PromptAudioProblem.NOT_AUDIO


@pytest.mark.parametrize(
    ("tag", "bits"), [(1, 0), (0xFFFF, 16), (3, 16), (0xFFFE, 16), (0x0055, 0)]
)  # fmt: skip
def test_a_wav_with_an_impossible_format_is_refused(tag: int, bits: int) -> None:
    """Bits-per-sample 0 or format tag 0xFFFF were a 500 (FFmpeg found no decoder, the code read None)."""
    samples = (np.sin(np.arange(32_000) / 8) * 8000).astype("<i2").tobytes()
    align = max(bits // 8, 1)
    fmt = struct.pack("<HHIIHH", tag, 1, 16_000, 16_000 * align, align, bits)
    data = b"RIFF" + struct.pack("<I", 20 + len(fmt) + len(samples)) + b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt
    data += b"data" + struct.pack("<I", len(samples)) + samples
    with pytest.raises(PromptAudioError) as info:
        decode_audio(data, max_seconds=30)
    assert info.value.reason in (PromptAudioProblem.NOT_AUDIO, PromptAudioProblem.CORRUPT)


def test_a_chain_of_empty_id3_tags_is_refused() -> None:
    """500,000 bytes of 10-byte ID3 headers: recognised as an MP3's tag in one step (no recursion per tag), then
    refused by the MP3 demuxer as holding no audio."""
    with pytest.raises(PromptAudioError) as info:
        decode_audio(b"ID3\x04\x00\x00\x00\x00\x00\x00" * 50_000, max_seconds=30)
    assert info.value.reason in (PromptAudioProblem.NOT_AUDIO, PromptAudioProblem.CORRUPT)


def test_recognition_is_by_bytes_alone() -> None:
    assert accepted_format(PROMPT.read_bytes()) is not None
    for name, make in FOREIGN.items():
        assert accepted_format(make()) is None, name


# ---- every upload route -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny", "tiny-cosyvoice2"])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        _env_file=None, model_dir=REPO / "models" / request.param, intra_op_threads=1, rate_limit_per_minute=0,
        voices_dir=tmp_path_factory.mktemp("voices"),
    )  # fmt: skip
    with TestClient(create_app(settings)) as c:
        yield c


def _upload(client: TestClient, route: str, data: bytes) -> Any:
    upload = ("upload.wav", data, "audio/wav")
    if route == "/v1/voices":
        return client.post(route, data={"name": "stolen", "transcript": "你好。"}, files={"audio": upload})
    fields = {"text": "你好。", "tts_text": "你好。", "prompt_text": "你好。"}
    return client.post(route, data=fields, files={"prompt_wav": upload})


ROUTES = ("/v1/voices", "/tts/prompt", "/tts", "/inference_zero_shot", "/inference_cross_lingual")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("payload", ["ffconcat", "ffconcat (absolute path)", "sdp", "hls"])
def test_every_upload_route_refuses_playlists_and_sdp(
    client: TestClient, route: str, payload: str, ffmpeg_opens: list[dict[str, Any]]
) -> None:
    resp = _upload(client, route, FOREIGN[payload]())
    assert resp.status_code == 400, (route, payload, resp.status_code, resp.text[:200])
    error = resp.json()["error"]
    assert error["code"] == "invalid_audio" and READABLE_FORMATS in error["message"], error
    assert ffmpeg_opens == []
    assert "stolen" not in client.get("/v1/voices").text
