"""The DashScope-compatible WebSocket against a real server with the real `dashscope` SDK (tts_v2.SpeechSynthesizer):
call(), streaming_call() + streaming_complete(), streaming_cancel(), a saved voice, volume, a wrong key, an unknown
voice, over-long text, a client that disconnects mid-stream; raw protocol errors; the shared rate limit and metrics."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import dashscope
import numpy as np
import pytest
from dashscope.audio.tts_v2 import AudioFormat, ResultCallback, SpeechSynthesizer
from dashscope.common.error import RequestFailure
from gated_engine import FileGate
from servers import REPO, AppServer, metric_value, wait_until
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore:connect.. must be used as a context manager")]

USER_KEY = "dashscope-user-key"
ADMIN_KEY = "dashscope-admin-key"
MAX_CHARS = 300
PATH = "/api-ws/v1/inference"
TEXT = "今天天气很好，我们一起去公园散步吧。明天要下雨，记得带伞。"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    """Keys on, no rate limit, a gated engine (open unless a test closes it: tests/gated_engine.py)."""
    env = {"TTS_API_KEYS": USER_KEY, "TTS_ADMIN_API_KEYS": ADMIN_KEY, "TTS_RATE_LIMIT_PER_MINUTE": "0"}
    env |= {"TTS_INTRA_OP_THREADS": "1", "TTS_MAX_CHARS": str(MAX_CHARS)}
    workdir = tmp_path_factory.mktemp("dashscope")
    app = AppServer(workdir, tiny_bundle, env, name="dashscope", gate=workdir / "gate")
    app.start()
    yield app
    app.stop()
    app.dump_log()


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK reads its key from dashscope.api_key when a synthesizer is made."""
    monkeypatch.setattr(dashscope, "api_key", USER_KEY)


def url_of(app: AppServer) -> str:
    return f"ws://127.0.0.1:{app.port}{PATH}"


def synthesizer(app: AppServer, **kw: Any) -> SpeechSynthesizer:
    return SpeechSynthesizer(**({"model": "cosyvoice-v2", "voice": "中文女", "url": url_of(app)} | kw))


def metric(app: AppServer, name: str, labels: dict[str, str] | None = None) -> float:
    with app.client() as http:
        return metric_value(http.get("/metrics").text, name, labels)


class Recorder(ResultCallback):
    """Keeps every event's output and the audio; `audio_came` is set at the first binary frame."""

    def __init__(self) -> None:
        self.outputs: list[dict[str, Any]] = []
        self.audio = bytearray()
        self.audio_came = threading.Event()
        self.completed = threading.Event()
        self.errors: list[str] = []

    def on_event(self, message: str) -> None:
        self.outputs.append(json.loads(message)["payload"]["output"])

    def on_data(self, data: bytes) -> None:
        self.audio += data
        self.audio_came.set()

    def on_complete(self) -> None:
        self.completed.set()

    def on_error(self, message: str) -> None:
        self.errors.append(message)


def decoded(data: bytes) -> tuple[int, int]:
    """(samples, rate) that PyAV decodes from one encoded stream."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        return sum(f.samples for f in container.decode(stream)), stream.codec_context.sample_rate


# ---- the SDK's calls ------------------------------------------------------------------------------
def test_call_returns_one_mp3_stream_and_the_task_usage(server: AppServer) -> None:
    """call() without a callback: the whole audio as the SDK's default format (mp3, 22,050 Hz), one stream for the
    task (one ID3 tag, not one per sentence), and task-finished with the characters spoken."""
    tts = synthesizer(server)
    audio = tts.call(TEXT)
    assert audio[:3] == b"ID3" and audio.count(b"ID3\x04") == 1
    samples, rate = decoded(audio)
    assert rate == 22050 and samples > rate
    finished = tts.get_response()
    assert finished["header"]["event"] == "task-finished"
    assert finished["payload"]["usage"]["characters"] == len(TEXT)


def test_streaming_call_gives_timed_sentences_on_the_audio_sent(server: AppServer) -> None:
    """streaming_call() pieces + streaming_complete(): sentence-begin / sentence-end per sentence, in order, with
    begin_time/end_time (ms) on the PCM actually received: contiguous, the last ending where the audio ends."""
    recorder = Recorder()
    tts = synthesizer(server, model="cosyvoice-v3-flash", format=AudioFormat.PCM_16000HZ_MONO_16BIT, callback=recorder)
    for piece in ("今天天气", "很好。明天", "要下雨。", "记得带伞"):
        tts.streaming_call(piece)
    tts.streaming_complete()
    assert recorder.completed.is_set() and not recorder.errors
    kinds = [(o["type"], o["sentence"]["index"]) for o in recorder.outputs]
    assert kinds == [(k, i) for i in range(3) for k in ("sentence-begin", "sentence-end")]
    ends = [o for o in recorder.outputs if o["type"] == "sentence-end"]
    assert [e["original_text"] for e in ends] == ["今天天气很好。", "明天要下雨。", "记得带伞"]
    assert ends[0]["sentence"]["begin_time"] == 0
    for before, after in itertools.pairwise(ends):
        assert after["sentence"]["begin_time"] == before["sentence"]["end_time"]
    assert abs(ends[-1]["sentence"]["end_time"] - len(recorder.audio) / 2 / 16000 * 1000) <= 1


# 93 characters the frontend speaks in two pieces, cut at the colon (as in test_ws_stream.py)
LONG_SENTENCE = (
    "第一部分写得比较长，里面有很多很多的汉字，用来凑够六十多个字的长度，我们一直写下去，直到长度足够为止，还要再多写几个字才行："
    "第二部分也要写得足够长，超过二十个字，这样才不会被并回前面去。"
)


def test_a_sentence_spoken_in_pieces_gets_a_sentence_begin_and_end_per_piece(server: AppServer) -> None:
    """The caption contract: one sentence-begin/sentence-end pair per synthesized piece (a caption never spans two),
    each with the text as written (the digit, not its reading), back to back on the audio received."""
    recorder = Recorder()
    tts = synthesizer(server, format=AudioFormat.PCM_16000HZ_MONO_16BIT, callback=recorder)
    tts.streaming_call(LONG_SENTENCE + "我有2个苹果。")
    tts.streaming_complete()
    assert recorder.completed.is_set() and not recorder.errors
    kinds = [(o["type"], o["sentence"]["index"]) for o in recorder.outputs]
    assert kinds == [(k, i) for i in range(3) for k in ("sentence-begin", "sentence-end")]
    cut = LONG_SENTENCE.index("：") + 1
    ends = [o for o in recorder.outputs if o["type"] == "sentence-end"]
    assert [e["original_text"] for e in ends] == [LONG_SENTENCE[:cut], LONG_SENTENCE[cut:], "我有2个苹果。"]
    assert ends[0]["sentence"]["begin_time"] == 0
    for before, after in itertools.pairwise(ends):
        assert after["sentence"]["begin_time"] == before["sentence"]["end_time"] < after["sentence"]["end_time"]
    assert abs(ends[-1]["sentence"]["end_time"] - len(recorder.audio) / 2 / 16000 * 1000) <= 1
    assert tts.get_response()["payload"]["usage"]["characters"] == len(LONG_SENTENCE) + len("我有2个苹果。")


def test_streaming_flush_speaks_text_without_an_end_before_the_task_finishes(server: AppServer) -> None:
    recorder = Recorder()
    tts = synthesizer(server, format=AudioFormat.PCM_16000HZ_MONO_16BIT, callback=recorder)
    tts.streaming_call("没有句号的一段话")
    tts.streaming_flush()
    wait_until(lambda: any(o["type"] == "sentence-end" for o in recorder.outputs), 60, "the flushed sentence's end")
    assert not recorder.completed.is_set()
    tts.streaming_complete()
    assert recorder.completed.is_set() and [o["original_text"] for o in recorder.outputs][-1] == "没有句号的一段话"


def test_wav_is_one_file_and_volume_scales_the_samples(server: AppServer) -> None:
    """wav: one RIFF header for the whole task. volume 100 is twice volume 50 (same seed, same audio), 0 is silence."""
    fmt = AudioFormat.WAV_22050HZ_MONO_16BIT
    half, full, mute = (synthesizer(server, format=fmt, seed=7, volume=v).call("你好。") for v in (50, 100, 0))
    assert half[:4] == b"RIFF" and half.count(b"RIFF") == 1 and len(half) == len(full) == len(mute)
    quiet, loud = (np.frombuffer(a[44:], dtype="<i2").astype(np.int32) for a in (half, full))
    unclipped = np.abs(quiet) < 16000
    assert np.abs(loud[unclipped] - 2 * quiet[unclipped]).max() <= 2 and np.abs(quiet).max() > 100
    assert not np.frombuffer(mute[44:], dtype="<i2").any()


def test_a_saved_voice_speaks_by_name(server: AppServer, ref_dir: Path) -> None:
    wav = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with server.client(headers=admin) as http:
        made = http.post("/v1/voices", data={"name": "dashvoice"}, files={"audio": ("p.wav", wav, "audio/wav")})
        assert made.status_code == 201, made.text
        try:
            audio = synthesizer(server, voice="dashvoice", format=AudioFormat.PCM_22050HZ_MONO_16BIT).call("你好。")
            assert len(audio) > 2 * 22050 * 0.1
        finally:
            http.delete("/v1/voices/dashvoice")


# ---- stopping early ------------------------------------------------------------------------------
def test_streaming_cancel_stops_the_synthesis_and_ends_the_task(server: AppServer) -> None:
    """streaming_cancel() while the engine is held after its first chunk: task-finished comes at once (the engine
    cannot move), and the job's engine work is released once it may."""
    before = metric(server, "tts_synthesis_cancelled_total")
    gate = FileGate(server.gate_path or Path("missing"))
    recorder = Recorder()
    tts = synthesizer(server, format=AudioFormat.PCM_22050HZ_MONO_16BIT, callback=recorder)
    gate.clear()
    try:
        tts.streaming_call("今天天气很好，我们一起去公园散步吧，然后去湖边喝杯咖啡。明天见。")
        assert recorder.audio_came.wait(60)
        tts.streaming_cancel()
        assert recorder.completed.is_set() and not recorder.errors
    finally:
        gate.set()
    assert not any(o["type"] == "sentence-end" for o in recorder.outputs), "the cut sentence has no sentence-end"
    wait_until(lambda: metric(server, "tts_synthesis_cancelled_total") > before, 30, "the cancelled job")
    wait_until(lambda: metric(server, "tts_jobs_running") == 0, 30, "every job to stop")


def test_a_client_that_disconnects_mid_stream_cancels_its_synthesis(server: AppServer) -> None:
    before = metric(server, "tts_synthesis_cancelled_total")
    gate = FileGate(server.gate_path or Path("missing"))
    recorder = Recorder()
    tts = synthesizer(server, format=AudioFormat.PCM_22050HZ_MONO_16BIT, callback=recorder)
    gate.clear()
    try:
        tts.streaming_call("今天天气很好，我们一起去公园散步吧，然后去湖边喝杯咖啡。明天见。")
        assert recorder.audio_came.wait(60)
        tts.close()  # the socket goes away mid-sentence
    finally:
        gate.set()
    wait_until(lambda: metric(server, "tts_synthesis_cancelled_total") > before, 30, "the cancelled job")
    wait_until(lambda: metric(server, "tts_jobs_running") == 0, 30, "every job to stop")
    assert synthesizer(server).call("你好。")[:3] == b"ID3", "the server goes on serving"


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "text", "name", "words"),
    [
        ({"voice": "longxiaochun"}, "你好。", "InvalidParameter", "longxiaochun"),
        ({}, "字" * (MAX_CHARS + 1), "BadRequest.TooLarge", str(MAX_CHARS)),
        ({"pitch_rate": 1.5}, "你好。", "InvalidParameter", "pitch"),
        ({"model": "qwen-tts"}, "你好。", "InvalidParameter", "qwen-tts"),
        ({"format": AudioFormat.OGG_OPUS_24KHZ_MONO_32KBPS}, "你好。", None, None),
    ],
    ids=["unknown-voice", "over-long-text", "pitch", "unknown-model", "opus-is-fine"],
)
def test_what_cannot_be_served_fails_the_task_with_the_clouds_error_code(
    server: AppServer, kw: dict[str, Any], text: str, name: str | None, words: str | None
) -> None:
    tts = synthesizer(server, **kw)
    if name is None:
        samples, rate = decoded(tts.call(text))
        assert rate == 48000 and samples > 0  # Ogg Opus decodes at 48 kHz whatever its input rate
        return
    with pytest.raises(RequestFailure) as failure:
        tts.call(text)
    assert failure.value.name == name and str(words) in failure.value.message


def test_a_wrong_key_fails_the_task_with_invalid_api_key(server: AppServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dashscope, "api_key", "not-the-key")
    with pytest.raises(RequestFailure) as failure:
        synthesizer(server).call("你好。")
    assert failure.value.name == "InvalidApiKey"


def raw_connection(app: AppServer, key: str = USER_KEY) -> ClientConnection:
    return connect(url_of(app), additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30, max_size=None)


def run_task(task_id: str, **parameters: Any) -> str:
    params = {"voice": "中文女", "format": "pcm", "sample_rate": 16000} | parameters
    payload = {"model": "cosyvoice-v2", "task_group": "audio", "task": "tts", "function": "SpeechSynthesizer"}
    header = {"action": "run-task", "task_id": task_id, "streaming": "duplex"}
    return json.dumps({"header": header, "payload": payload | {"parameters": params, "input": {}}})


def next_event(ws: ClientConnection) -> dict[str, Any]:
    while isinstance(message := ws.recv(timeout=60), bytes):
        pass
    return dict(json.loads(message)["header"])


def test_a_wrong_key_is_told_then_the_connection_closes_with_4401(server: AppServer) -> None:
    ws = raw_connection(server, "not-the-key")
    ws.send(run_task("k1"))
    header = next_event(ws)
    assert (header["event"], header["error_code"], header["attributes"]["code"]) == (
        "task-failed",
        "InvalidApiKey",
        "unauthorized",
    )
    with pytest.raises(ConnectionClosed):
        ws.recv(timeout=30)
    assert ws.close_code == 4401 and json.loads(ws.close_reason or "")["code"] == "unauthorized"


def test_bad_messages_fail_with_task_failed_and_the_connection_stays_usable(server: AppServer) -> None:
    ws = raw_connection(server)
    bad: list[tuple[str | bytes, str]] = [
        (b"\x00\x01", ""),
        ("not json", ""),
        (json.dumps({"header": {"action": "dance", "task_id": "t1"}}), "t1"),
        (json.dumps({"header": {"action": "continue-task", "task_id": "t2"}, "payload": {"input": {"text": "x"}}}), "t2"),
        (run_task("t3", sample_rate=12345), "t3"),
        (run_task("t4", format="flac"), "t4"),
        (run_task("t5", volume=101), "t5"),
        (run_task("t6", word_timestamp_enabled=True), "t6"),
    ]
    for message, task_id in bad:
        ws.send(message)
        header = next_event(ws)
        assert (header["event"], header["task_id"], header["error_code"]) == ("task-failed", task_id, "InvalidParameter")
    ws.send(run_task("t7"))
    assert next_event(ws)["event"] == "task-started"
    ws.send(json.dumps({"header": {"action": "finish-task", "task_id": "t7"}, "payload": {"input": {}}}))
    assert next_event(ws)["event"] == "task-finished"
    ws.close()


def test_deep_or_oversized_messages_fail_the_task_and_the_connection_stays_usable(server: AppServer) -> None:
    """A message nested 1,000 deep closed the connection with 1011 (json.loads hit RecursionError while the task id was
    looked for); one over TTS_MAX_BODY_BYTES (64 KiB here) was parsed whole. Both now fail with task-failed."""
    ws = raw_connection(server)
    deep = '{"header": {"action": "run-task", "task_id": "d1"}, "payload": {"x": ' + "[" * 1000 + "]" * 1000 + "}}"
    oversized = run_task("d2", note="x" * 70_000)
    surrogate = run_task("d3", voice="\ud800")  # json.dumps writes the lone surrogate as its escape
    for message, words in ((deep, "recursion limit"), (oversized, "TTS_MAX_BODY_BYTES"), (surrogate, "surrogate")):
        ws.send(message)
        header = next_event(ws)
        assert (header["event"], header["error_code"]) == ("task-failed", "InvalidParameter"), header
        assert words in header["error_message"], header
    ws.send(run_task("d4"))
    assert next_event(ws)["event"] == "task-started"
    ws.send(json.dumps({"header": {"action": "finish-task", "task_id": "d4"}, "payload": {"input": {}}}))
    assert next_event(ws)["event"] == "task-finished"
    ws.close()


def test_rate_limit_and_metrics_are_the_other_transports(tmp_path: Path, tiny_bundle: Path) -> None:
    """One run-task is one request for the per-key rate limit (429 -> Throttling.RateQuota), and every task ends in
    tts_transport_requests_total{transport="dashscope"} with its status."""
    env = {"TTS_API_KEYS": USER_KEY, "TTS_RATE_LIMIT_PER_MINUTE": "1", "TTS_INTRA_OP_THREADS": "1"}
    app = AppServer(tmp_path, tiny_bundle, env, name="dashscope-limited")
    app.start()
    try:
        assert len(synthesizer(app, format=AudioFormat.PCM_16000HZ_MONO_16BIT).call("你好。")) > 0
        with pytest.raises(RequestFailure) as failure:
            synthesizer(app).call("你好。")
        assert failure.value.name == "Throttling.RateQuota"
        with app.client() as http:
            text = http.get("/metrics").text
        assert metric_value(text, "tts_transport_requests_total", {"transport": "dashscope", "status": "ok"}) == 1
        assert metric_value(text, "tts_transport_requests_total", {"transport": "dashscope", "status": "rate_limited"}) == 1
    finally:
        app.stop()


def test_the_example_is_the_sdk_with_one_url_changed(server: AppServer, tmp_path: Path) -> None:
    """examples/dashscope_client.py: the SDK's streaming usage with dashscope.base_websocket_api_url pointed here."""
    out = tmp_path / "reply.pcm"
    argv = [sys.executable, str(REPO / "examples" / "dashscope_client.py"), "--url", url_of(server), "--api-key", USER_KEY]
    run = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "task-started" in lines[0] and "task-finished" in lines[-2] and lines[-1].startswith("wrote")
    assert sum("sentence-end" in line for line in lines) == 3 and out.stat().st_size > 0
    refused = subprocess.run([*argv, "--voice", "longxiaochun"], capture_output=True, text=True, timeout=120, check=False)
    assert refused.returncode == 1 and refused.stderr.startswith("error:") and "longxiaochun" in refused.stderr


def test_no_message_above_left_a_traceback_in_the_server_log(server: AppServer) -> None:
    """Every refusal above was a task-failed event or a 4xxx close: the server logged no fault of its own."""
    log = server.log_text(tail_chars=10_000_000)
    assert "Traceback" not in log and "session failed" not in log
