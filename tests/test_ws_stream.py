"""WebSocket text-in / audio-out against a real server process with a real client (websockets): audio for the first
sentence before the last delta is sent, frames and timed captions, flush, barge-in (`cancel`), bad input close codes,
keys, disconnect, bounds."""

from __future__ import annotations

import io
import itertools
import json
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import pytest
from gated_engine import FileGate
from servers import AppServer, metric_value, wait_until
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")]

HEADER = struct.Struct(">II")
PATH = "/v1/audio/speech/stream"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    """The app with a gated engine (tests/gated_engine.py): the gate is open unless a test closes it."""
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_INTRA_OP_THREADS": "1"}
    workdir = tmp_path_factory.mktemp("ws")
    app = AppServer(workdir, tiny_bundle, env, name="ws", gate=workdir / "gate")
    app.start()
    yield app
    app.stop()
    app.dump_log()


def gate_of(app: AppServer) -> FileGate:
    assert app.gate_path is not None
    return FileGate(app.gate_path)


def metric(app: AppServer, name: str) -> float:
    with app.client() as http:
        return metric_value(http.get("/metrics").text, name)


def ws_url(app: AppServer) -> str:
    return f"ws://127.0.0.1:{app.port}{PATH}"


def open_stream(app: AppServer, config: dict[str, Any] | None = None, **kw: Any) -> tuple[ClientConnection, dict[str, Any]]:
    ws = connect(ws_url(app), max_size=None, open_timeout=30, **kw)
    ws.send(json.dumps({"type": "config", "voice": "中文女", **(config or {})}))
    return ws, json.loads(ws.recv(timeout=30))


def send_text(ws: ClientConnection, text: str) -> None:
    ws.send(json.dumps({"type": "text", "text": text}))


def drain(ws: ClientConnection, timeout_s: float = 60) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Every message until the server closes: binary frames and JSON events."""
    frames: list[bytes] = []
    events: list[dict[str, Any]] = []
    try:
        while True:
            message = ws.recv(timeout=timeout_s)
            if isinstance(message, bytes):
                frames.append(message)
            else:
                events.append(json.loads(message))
    except ConnectionClosed:
        pass
    return frames, events


def close_of(ws: ClientConnection) -> tuple[int, dict[str, Any]]:
    drain(ws, 30)
    assert ws.close_code is not None and ws.close_reason is not None
    return ws.close_code, json.loads(ws.close_reason)


def test_first_sentence_audio_arrives_before_the_last_delta_is_sent(server: AppServer) -> None:
    """An LLM-paced client: the first sentence is complete after 2 deltas; more follow, 50 ms apart, until audio comes.
    The first audio frame must come while deltas are still being sent (a server that waited for `close` never sends
    any, so this fails after 60 s); no bound on how fast the machine makes it."""
    ws, ready = open_stream(server, {"format": "pcm", "sample_rate": 24000})
    assert ready["type"] == "ready" and ready["sample_rate"] == 24000 and ready["format"] == "pcm"
    first_audio: list[float] = []

    def read() -> None:
        for message in ws:
            if isinstance(message, bytes) and not first_audio:
                first_audio.append(time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    send_text(ws, "今天天气")
    send_text(ws, "很好。")
    deltas = 0
    deadline = time.monotonic() + 60
    while not first_audio and time.monotonic() < deadline:  # the reply goes on until audio comes, however long it takes
        time.sleep(0.05)
        send_text(ws, "我们一起")
        deltas += 1
    audio_before_close = bool(first_audio)
    ws.send(json.dumps({"type": "close"}))
    reader.join(60)
    assert first_audio, "no audio at all"
    assert audio_before_close, "the first sentence's audio only came after 60 s of deltas"
    print(f"first audio after {deltas} more deltas")


def test_frames_are_numbered_and_each_sentence_ends_with_its_caption(server: AppServer) -> None:
    ws, _ = open_stream(server)
    for piece in ("你好！今天", "天气很好。", "明天见"):
        send_text(ws, piece)
    ws.send(json.dumps({"type": "close"}))  # "明天见" has no end: close releases it
    frames, events = drain(ws)
    assert ws.close_code == 1000
    seqs = [HEADER.unpack_from(f)[0] for f in frames]
    assert seqs == list(range(len(frames))) and all(len(f) > HEADER.size for f in frames)
    ends = [e for e in events if e["type"] == "sentence_end"]
    assert [e["text"] for e in ends] == ["你好！", "今天天气很好。", "明天见"]
    for e in ends:  # the frames of sentence i are first_seq..last_seq, and carry index i
        own = [HEADER.unpack_from(f)[1] for f in frames[e["first_seq"] : e["last_seq"] + 1]]
        assert own and set(own) == {e["sentence"]}
        assert e["audio_bytes"] == sum(len(f) - HEADER.size for f in frames[e["first_seq"] : e["last_seq"] + 1])
    assert events[-1] == {"type": "done", "sentences": 3, "frames": len(frames)}


def decoded_samples(audio: bytes, fmt: str) -> int:
    """Samples an independent decoder (PyAV) yields for one sentence's bytes, at the stream's own rate (Opus: 24 kHz)."""
    if fmt == "pcm":
        return len(audio) // 2
    with av.open(io.BytesIO(audio)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples * 24000 // stream.codec_context.sample_rate if fmt == "opus" else samples


@pytest.mark.parametrize(
    ("fmt", "rate", "explicit"), [("pcm", 16000, True), ("mp3", 22050, False), ("mp3", 16000, True), ("opus", 24000, False)]
)
def test_each_caption_says_where_its_sentence_lies_on_the_connection_timeline(
    server: AppServer, fmt: str, rate: int, explicit: bool
) -> None:
    """`start` and `end` of a sentence_end are seconds of decoded audio from the connection's first frame: sentence i
    ends where i+1 starts, and end - start is exactly what a decoder yields for the sentence's frames (an MP3 stream
    with its priming and its last frame's padding, Opus trimmed to its granule position). MP3 takes an explicit
    `sample_rate` (16 kHz: MPEG-2 frames), which the decoder sees."""
    ws, ready = open_stream(server, {"format": fmt} | ({"sample_rate": rate} if explicit else {}))
    assert ready["sample_rate"] == rate
    for piece in ("第一句话在这里。", "第二句话稍微长一点，", "还有一些内容。", "第三句"):
        send_text(ws, piece)
    ws.send(json.dumps({"type": "close"}))
    frames, events = drain(ws)
    ends = [e for e in events if e["type"] == "sentence_end"]
    assert len(ends) == 3 and ends[0]["start"] == 0
    for before, after in itertools.pairwise(ends):
        assert after["start"] == before["end"]
    for e in ends:
        audio = b"".join(f[HEADER.size :] for f in frames[e["first_seq"] : e["last_seq"] + 1])
        assert round((e["end"] - e["start"]) * rate) == decoded_samples(audio, fmt)
        if fmt == "mp3":  # the rate the frames declare (Opus decoders always give 48 kHz)
            with av.open(io.BytesIO(audio)) as container:
                assert container.streams.audio[0].codec_context.sample_rate == rate
        assert e["captions"] == [{"text": e["text"], "start": e["start"], "end": e["end"]}]  # one piece each


# 93 characters: the frontend cuts it at the colon (over 60 before it, over 80 with what follows) into two pieces
LONG_SENTENCE = (
    "第一部分写得比较长，里面有很多很多的汉字，用来凑够六十多个字的长度，我们一直写下去，直到长度足够为止，还要再多写几个字才行："
    "第二部分也要写得足够长，超过二十个字，这样才不会被并回前面去。"
)
LONG_PIECES = [LONG_SENTENCE[: LONG_SENTENCE.index("：") + 1], LONG_SENTENCE[LONG_SENTENCE.index("：") + 1 :]]


def test_a_sentence_spoken_in_pieces_has_a_caption_per_piece_with_its_written_text(server: AppServer) -> None:
    """The caption contract: a caption per synthesized piece (never spanning two), with the text as written (the
    digit, not its reading 两), back to back on the timeline from the sentence's start to its end."""
    ws, _ = open_stream(server, {"format": "pcm", "sample_rate": 16000})
    send_text(ws, LONG_SENTENCE + "我有2个苹果。")
    ws.send(json.dumps({"type": "close"}))
    _, events = drain(ws)
    long, short = (e for e in events if e["type"] == "sentence_end")
    assert [c["text"] for c in long["captions"]] == LONG_PIECES and long["text"] == LONG_SENTENCE
    first, second = long["captions"]
    assert first["start"] == long["start"] < first["end"] == second["start"] < second["end"] == long["end"]
    # the cut lies where the first piece's audio ends: its samples were sent before the second piece's
    assert (first["end"] - long["start"]) * 16000 < long["audio_bytes"] / 2
    assert short["captions"] == [{"text": "我有2个苹果。", "start": short["start"], "end": short["end"]}]


def test_cancel_stops_speech_at_once_and_the_connection_takes_new_text(server: AppServer) -> None:
    """Barge-in while the engine is held after its first chunk (gate closed: nothing can finish by speed): `cancelled`
    comes at once with the last frame sent, the jobs are cancelled and their engine work released once the engine may
    move again, and new text on the same connection is spoken after the cut, on the same timeline."""
    ws, _ = open_stream(server)
    ws.send(json.dumps({"type": "cancel"}))  # nothing to stop yet: answered at once all the same
    assert json.loads(ws.recv(timeout=30)) == {"type": "cancelled", "last_seq": -1, "sentence": None, "time": 0.0}
    cancelled_before = metric(server, "tts_synthesis_cancelled_total")
    gate = gate_of(server)
    gate.clear()
    try:
        send_text(ws, "今天天气很好，我们一起去公园散步吧，然后去湖边喝杯咖啡。明天见。还没有说完的话")
        got: list[bytes | dict[str, Any]] = []
        while not any(isinstance(m, bytes) for m in got):
            message = ws.recv(timeout=60)
            got.append(message if isinstance(message, bytes) else json.loads(message))
        ws.send(json.dumps({"type": "cancel"}))
        while not (isinstance(got[-1], dict) and got[-1]["type"] == "cancelled"):
            message = ws.recv(timeout=30)  # the engine is still held: this must not wait for it
            got.append(message if isinstance(message, bytes) else json.loads(message))
    finally:
        gate.set()
    cancelled = got[-1]
    assert isinstance(cancelled, dict)
    seqs = [HEADER.unpack_from(m)[0] for m in got if isinstance(m, bytes)]
    assert cancelled["last_seq"] == seqs[-1] and cancelled["sentence"] == 0
    assert not any(isinstance(m, dict) and m["type"] == "sentence_end" for m in got), "the cut sentence has no caption"
    wait_until(lambda: metric(server, "tts_synthesis_cancelled_total") > cancelled_before, 30, "the cut job's cancel")
    wait_until(lambda: metric(server, "tts_jobs_running") == 0, 30, "every job of the connection to stop")
    send_text(ws, "新的一句话。")
    ws.send(json.dumps({"type": "close"}))
    frames, events = drain(ws)
    ends = [e for e in events if e["type"] == "sentence_end"]
    assert [(e["sentence"], e["text"]) for e in ends] == [(2, "新的一句话。")]  # 1 was dropped, the text without an end too
    assert ends[0]["first_seq"] == cancelled["last_seq"] + 1 and ends[0]["start"] == cancelled["time"] > 0
    assert HEADER.unpack_from(frames[0])[0] == cancelled["last_seq"] + 1
    assert events[-1] == {"type": "done", "sentences": 1, "frames": cancelled["last_seq"] + 1 + len(frames)}


def test_flush_speaks_text_without_an_end_at_once(server: AppServer) -> None:
    ws, _ = open_stream(server)
    send_text(ws, "没有句号的一段话")
    ws.send(json.dumps({"type": "flush"}))
    got = []
    while not any(isinstance(m, str) and json.loads(m)["type"] == "sentence_end" for m in got):
        got.append(ws.recv(timeout=60))  # the sentence ends without `close`
    assert any(isinstance(m, bytes) for m in got)
    ws.close()


@pytest.mark.parametrize(
    ("config", "messages", "code", "error"),
    [
        ({"format": "wav"}, [], 4400, "invalid_input"),
        ({"voice": "无此人"}, [], 4400, "unknown_speaker"),
        ({"voice": "\ud800"}, [], 4400, "invalid_input"),  # json.dumps writes the lone surrogate as its escape
        ({"format": "mp3", "sample_rate": 11000}, [], 4400, "invalid_input"),
        ({"format": "opus", "sample_rate": 16000}, [], 4400, "invalid_input"),
        ({"speed": 9}, [], 4400, "invalid_input"),
        ({}, ["not json"], 4400, "invalid_input"),
        ({}, [b"\x00\x01"], 4400, "invalid_input"),
        ({}, [json.dumps({"type": "text"})], 4400, "invalid_input"),
    ],
    ids=[
        "format",
        "voice",
        "voice-lone-surrogate",
        "rate-for-mp3",
        "rate-for-opus",
        "speed",
        "not-json",
        "binary",
        "text-missing",
    ],
)
def test_bad_input_closes_with_a_4xx_code_and_a_json_reason(
    server: AppServer, config: dict[str, Any], messages: list[Any], code: int, error: str
) -> None:
    ws = connect(ws_url(server), open_timeout=30)
    ws.send(json.dumps({"type": "config", **config}))
    if messages:
        assert json.loads(ws.recv(timeout=30))["type"] == "ready"
        for m in messages:
            ws.send(m)
    got_code, reason = close_of(ws)
    assert (got_code, reason["code"]) == (code, error), reason


@pytest.mark.parametrize(
    ("fmt", "rates"),
    [("mp3", "8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000"), ("pcm", "8000, 16000, 22050, 24000, 44100, 48000")],
)
def test_an_unsupported_sample_rate_is_refused_naming_the_supported_ones(server: AppServer, fmt: str, rates: str) -> None:
    ws = connect(ws_url(server), open_timeout=30)
    ws.send(json.dumps({"type": "config", "format": fmt, "sample_rate": 11000 if fmt == "pcm" else 11111}))
    code, reason = close_of(ws)
    assert (code, reason) == (4400, {"code": "invalid_input", "message": f"{fmt} sample_rate: {rates}"})  # not cut short


def test_a_text_frame_that_is_not_utf8_fails_the_connection_without_a_traceback(server: AppServer) -> None:
    """RFC 6455 makes the server fail the connection (1007) before the app sees the frame; uvicorn logged a traceback."""
    ws, _ = open_stream(server)
    ws.send(b'{"type": "text", "text": "' + "希望你".encode("gbk") + b'"}', text=True)
    drain(ws, 30)
    assert ws.close_code == 1007
    wait_until(lambda: "not valid UTF-8" in server.log_text(), 10, "the warning line")
    assert "Traceback" not in server.log_text() and "Invalid UTF-8 sequence" not in server.log_text()
    other, ready = open_stream(server)  # the server goes on serving
    assert ready["type"] == "ready"
    other.close()


def test_a_lone_surrogate_in_the_text_is_invalid_input(server: AppServer) -> None:
    ws, _ = open_stream(server)
    ws.send('{"type": "text", "text": "\\ud800你好。"}')
    code, reason = close_of(ws)
    assert (code, reason["code"]) == (4400, "invalid_input"), reason


def test_too_much_text_without_an_end_is_refused(server: AppServer) -> None:
    ws, ready = open_stream(server)
    send_text(ws, "字" * (ready["max_pending_chars"] + 1))
    code, reason = close_of(ws)
    assert (code, reason["code"]) == (4413, "text_too_long")


def test_disconnect_cancels_the_synthesis(server: AppServer) -> None:
    with server.client() as http:
        before = metric_value(http.get("/metrics").text, "tts_synthesis_cancelled_total")
        ws, _ = open_stream(server)
        send_text(ws, "今天天气很好，我们一起去公园散步吧，然后去湖边喝杯咖啡，再去看一场电影。" * 6 + "。")
        send_text(ws, "好")
        while not isinstance(ws.recv(timeout=60), bytes):
            pass
        ws.close()
        wait_until(lambda: metric_value(http.get("/metrics").text, "tts_synthesis_cancelled_total") > before, 30, "cancel")
        labels = {"transport": "websocket"}
        wait_until(lambda: metric_value(http.get("/metrics").text, "tts_transport_requests_total", labels) >= 1, 10, "count")


def test_a_reader_that_stops_reading_holds_at_most_two_jobs(server: AppServer) -> None:
    """Ten sentences arrive at once and the client reads nothing: one sentence streams (blocked on the socket), one is
    synthesized ahead, and the other eight wait as text; running jobs never exceed two. The count starts from an idle
    server: a job an earlier test cancelled (its session gone) may still be reaching its next chunk."""
    with server.client() as http:
        wait_until(lambda: metric_value(http.get("/metrics").text, "tts_jobs_running") == 0, 30, "idle server")
    ws, _ = open_stream(server)
    send_text(ws, "".join(f"这是第{i}句话，内容稍微长一点，好让合成需要一些时间。" for i in range(10)) + "好")
    peak = 0.0
    with server.client() as http:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            peak = max(peak, metric_value(http.get("/metrics").text, "tts_jobs_running"))
            time.sleep(0.1)
    ws.close()
    assert 1 <= peak <= 2


def test_api_keys_by_header_or_subprotocol(tmp_path: Path, tiny_bundle: Path) -> None:
    app = AppServer(tmp_path, tiny_bundle, {"TTS_API_KEYS": "sesame-key-1", "TTS_INTRA_OP_THREADS": "1"}, name="ws-keys")
    app.start()
    try:
        ws = connect(ws_url(app), open_timeout=30)  # no key: refused before the config message
        code, reason = close_of(ws)
        assert (code, reason["code"]) == (4401, "unauthorized")
        for kw in (
            {"additional_headers": {"Authorization": "Bearer sesame-key-1"}},
            {"subprotocols": ["tts.v1", "api-key.sesame-key-1"]},
        ):
            ws, ready = open_stream(app, **kw)
            assert ready["type"] == "ready"
            if "subprotocols" in kw:
                assert ws.subprotocol == "tts.v1"
            ws.close()
    finally:
        app.stop()
