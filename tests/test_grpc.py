"""The official CosyVoice gRPC service against a real server process: a client written the way the official
`runtime/python/grpc/client.py` is (stubs generated from our proto), all four modes, status codes for bad input,
API keys in metadata, cancel, health and reflection; the committed stubs match the proto."""

from __future__ import annotations

import struct
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from gated_engine import FileGate
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from servers import AppServer, ManagedProcess, free_port, metric_value, wait_until

from service.api.errors import STATUS
from service.errors import ErrorCode
from service.rpc import cosyvoice_pb2, cosyvoice_pb2_grpc
from service.rpc.errors import GRPC_STATUS
from service.rpc.server import METHOD

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
INSTRUCT = (
    "Theo 'Crimson', is a fiery, passionate rebel leader. Fights with fervor for justice, but struggles with impulsiveness."
)
TTS_TEXT = "收到好友从远方寄来的生日礼物。"
MODEL_RATE_HZ = 22050


def _start(workdir: Path, bundle: Path, env: dict[str, str], name: str) -> tuple[AppServer, int]:
    port = free_port()
    app = AppServer(workdir, bundle, {"TTS_GRPC_PORT": str(port), "TTS_INTRA_OP_THREADS": "1", **env}, name=name)
    app.start()
    return app, port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[tuple[AppServer, int]]:
    app, port = _start(tmp_path_factory.mktemp("grpc"), tiny_bundle, {"TTS_RATE_LIMIT_PER_MINUTE": "0"}, "grpc")
    yield app, port
    app.stop()
    app.dump_log()


@pytest.fixture(scope="module")
def channel(server: tuple[AppServer, int]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server[1]}") as ch:
        yield ch


def prompt_pcm16k(path: Path) -> bytes:
    """What the official client sends as prompt_audio: the recording at 16 kHz as raw int16 mono PCM."""
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return w.readframes(w.getnframes())


def official_request(mode: str, prompt_wav: Path | None = None, **args: str) -> cosyvoice_pb2.Request:
    """Built as client.py builds it: one sub-request, copied into the Request's oneof."""
    request = cosyvoice_pb2.Request()
    if mode == "sft":
        sft_request = cosyvoice_pb2.sftRequest()
        sft_request.spk_id = args["spk_id"]
        sft_request.tts_text = args["tts_text"]
        request.sft_request.CopyFrom(sft_request)
    elif mode == "zero_shot":
        zero_shot_request = cosyvoice_pb2.zeroshotRequest()
        zero_shot_request.tts_text = args["tts_text"]
        zero_shot_request.prompt_text = args["prompt_text"]
        zero_shot_request.prompt_audio = prompt_pcm16k(prompt_wav) if prompt_wav else b""
        request.zero_shot_request.CopyFrom(zero_shot_request)
    elif mode == "cross_lingual":
        cross_lingual_request = cosyvoice_pb2.crosslingualRequest()
        cross_lingual_request.tts_text = args["tts_text"]
        cross_lingual_request.prompt_audio = prompt_pcm16k(prompt_wav) if prompt_wav else b""
        request.cross_lingual_request.CopyFrom(cross_lingual_request)
    else:
        instruct_request = cosyvoice_pb2.instructRequest()
        instruct_request.tts_text = args["tts_text"]
        instruct_request.spk_id = args["spk_id"]
        instruct_request.instruct_text = args["instruct_text"]
        request.instruct_request.CopyFrom(instruct_request)
    return request


Metadata = tuple[tuple[str, str], ...]


def official_call(channel: grpc.Channel, request: cosyvoice_pb2.Request, metadata: Metadata = ()) -> np.ndarray:
    """client.py's loop: join every tts_audio, read it as int16."""
    stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
    response = stub.Inference(request, metadata=metadata, timeout=120)
    tts_audio = b""
    for r in response:
        tts_audio += r.tts_audio
    return np.array(np.frombuffer(tts_audio, dtype=np.int16))


@pytest.mark.parametrize(
    ("mode", "prompt", "args"),
    [
        ("sft", None, {"spk_id": "中文女", "tts_text": "你好，我是通义千问语音合成大模型，请问有什么可以帮您的吗？"}),
        ("zero_shot", "zh_16k.wav", {"tts_text": TTS_TEXT, "prompt_text": "希望你以后能够做的比我还好呦。"}),
        ("cross_lingual", "zh_16k.wav", {"tts_text": "<|en|>And then later on, fully acquiring that company."}),
        ("instruct", None, {"tts_text": TTS_TEXT, "spk_id": "中文男", "instruct_text": INSTRUCT}),
    ],
)
def test_the_official_client_gets_audio_in_every_mode(
    channel: grpc.Channel, ref_dir: Path, mode: str, prompt: str | None, args: dict[str, str]
) -> None:
    audio = official_call(channel, official_request(mode, ref_dir / "prompts" / prompt if prompt else None, **args))
    assert audio.size > MODEL_RATE_HZ // 2, f"{mode}: {audio.size} samples"
    assert np.abs(audio.astype(np.int32)).max() > 0


def test_audio_streams_as_several_messages(channel: grpc.Channel) -> None:
    stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
    text = "今天天气很好，我们一起去公园散步吧。明天见。"
    pieces = [r.tts_audio for r in stub.Inference(official_request("sft", spk_id="中文女", tts_text=text), timeout=120)]
    assert len(pieces) >= 2 and all(len(p) % 2 == 0 and p for p in pieces)


def _code(channel: grpc.Channel, request: cosyvoice_pb2.Request, metadata: Metadata = ()) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        official_call(channel, request, metadata)
    return info.value


@pytest.mark.parametrize(
    ("request_", "detail"),
    [
        (cosyvoice_pb2.Request(), "sets none of"),
        (official_request("sft", spk_id="中文女", tts_text="  "), "text"),
        (official_request("sft", spk_id="无此人", tts_text="你好。"), "unknown speaker"),
        (official_request("sft", spk_id="中文女", tts_text="你" * 5000), "sft_request.tts_text"),
        (official_request("zero_shot", tts_text="你好。", prompt_text="你好。"), "zero_shot_request.prompt_audio"),
        (official_request("instruct", tts_text="你", spk_id="中文女", instruct_text=""), "field instruct_request.instruct_text"),
    ],
    ids=["no-oneof", "blank-text", "unknown-speaker", "too-long", "no-prompt-audio", "empty-instruction"],
)
def test_bad_input_is_invalid_argument(channel: grpc.Channel, request_: cosyvoice_pb2.Request, detail: str) -> None:
    error = _code(channel, request_)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert detail in error.details()


def test_a_prompt_that_is_not_pcm_is_invalid_argument(channel: grpc.Channel) -> None:
    request = cosyvoice_pb2.Request()
    request.cross_lingual_request.tts_text = "你好。"
    request.cross_lingual_request.prompt_audio = b"\x01\x02\x03"  # odd length: not int16 samples
    error = _code(channel, request)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "prompt_audio" in error.details()


def test_a_whole_audio_file_as_prompt_audio_is_decoded_as_a_file(
    server: tuple[AppServer, int], channel: grpc.Channel, ref_dir: Path
) -> None:
    """A common mistake: the WAV file itself as prompt_audio (raw 16 kHz PCM). It was cloned from its header bytes at
    the wrong rate (this 24 kHz file at 16 kHz); it is recognised by its first bytes and decoded as a file."""
    request = official_request("cross_lingual", tts_text="<|en|>Hello there.")
    request.cross_lingual_request.prompt_audio = (ref_dir / "prompts" / "en_24k.wav").read_bytes()
    audio = official_call(channel, request)
    assert audio.size > MODEL_RATE_HZ // 4
    wait_until(lambda: "the prompt recording holds a WAV file" in server[0].log_text(), 10, "the log line")
    request.cross_lingual_request.prompt_audio = request.cross_lingual_request.prompt_audio[:3000]  # a cut file
    error = _code(channel, request)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "truncated" in error.details() and "cross_lingual_request.prompt_audio" in error.details()


def impossible_wav(tag: int, bits: int) -> bytes:
    """A WAV whose fmt chunk names a format tag or sample width no decoder reads (0xFFFF, 0 bits), with 2 s of samples."""
    samples = (np.sin(np.arange(32_000) / 8) * 8000).astype("<i2").tobytes()
    align = max(bits // 8, 1)
    fmt = struct.pack("<HHIIHH", tag, 1, 16_000, 16_000 * align, align, bits)
    head = b"RIFF" + struct.pack("<I", 20 + len(fmt) + len(samples)) + b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt
    return head + b"data" + struct.pack("<I", len(samples)) + samples


@pytest.mark.parametrize(("tag", "bits"), [(1, 0), (0xFFFF, 16)], ids=["bits-0", "tag-0xffff"])
def test_a_wav_no_decoder_reads_as_prompt_audio_is_invalid_argument(
    server: tuple[AppServer, int], channel: grpc.Channel, tag: int, bits: int
) -> None:
    """A whole WAV in the raw-PCM field is decoded as a file: one with an impossible format is the caller's fault
    (HTTP answers 400 invalid_audio for it), never INTERNAL."""
    request = official_request("cross_lingual", tts_text="你好。")
    request.cross_lingual_request.prompt_audio = impossible_wav(tag, bits)
    error = _code(channel, request)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "cross_lingual_request.prompt_audio" in error.details()
    assert "Traceback" not in server[0].log_text()


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (tag, varint length, bytes): strings go on the wire as they are given."""
    length, varint = len(payload), b""
    while length >= 0x80:
        varint += bytes([length & 0x7F | 0x80])
        length >>= 7
    return bytes([number << 3 | 2]) + varint + bytes([length]) + payload


def _raw_call(channel: grpc.Channel, message: bytes) -> grpc.RpcError:
    """Inference with a hand-built message (the stubs refuse to serialize a string that is not UTF-8)."""
    call = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=cosyvoice_pb2.Response.FromString)
    with pytest.raises(grpc.RpcError) as info:
        list(call(message, timeout=60))
    return info.value


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (_field(1, _field(1, "中文女".encode()) + _field(2, "你好。".encode("gbk"))), "sft_request.tts_text"),
        (_field(2, _field(1, "你好。".encode()) + _field(2, "希望你以后".encode("gbk"))), "zero_shot_request.prompt_text"),
        (_field(4, _field(1, "你好。".encode()) + _field(2, b"\xff\xfe")), "instruct_request.spk_id"),
        (_field(1, _field(1, "\ud800".encode("utf-8", "surrogatepass")) + _field(2, "你好。".encode())), "sft_request.spk_id"),
    ],
    ids=["sft-text", "zero-shot-prompt-text", "instruct-speaker", "sft-speaker-lone-surrogate"],
)
def test_a_string_that_is_not_utf8_is_invalid_argument_not_internal(
    server: tuple[AppServer, int], channel: grpc.Channel, message: bytes, field: str
) -> None:
    """grpc's own deserializer answered INTERNAL and logged a traceback for these."""
    error = _raw_call(channel, message)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert field in error.details() and "not valid UTF-8" in error.details(), error.details()
    log = server[0].log_text()
    assert "Exception deserializing request" not in log and "Traceback" not in log


def test_bytes_that_are_no_request_are_invalid_argument(channel: grpc.Channel) -> None:
    error = _raw_call(channel, b"\x0a\xff\xff\xff")  # field 1 claims more bytes than follow
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "not a valid cosyvoice.Request" in error.details()


def test_health_serving_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "cosyvoice.CosyVoice"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"cosyvoice.CosyVoice", "grpc.health.v1.Health"} <= names


def test_cancel_stops_synthesis(server: tuple[AppServer, int], channel: grpc.Channel) -> None:
    app, _ = server
    with app.client() as http:
        before = metric_value(http.get("/metrics").text, "tts_synthesis_cancelled_total")
        stub = cosyvoice_pb2_grpc.CosyVoiceStub(channel)
        call = stub.Inference(official_request("sft", spk_id="中文女", tts_text="今天天气很好，我们一起去公园散步吧。" * 20))
        assert next(call).tts_audio
        call.cancel()
        wait_until(lambda: metric_value(http.get("/metrics").text, "tts_synthesis_cancelled_total") > before, 30, "cancel")
        status = {"transport": "grpc", "status": "CANCELLED"}
        wait_until(lambda: metric_value(http.get("/metrics").text, "tts_transport_requests_total", status) >= 1, 10, "count")


def test_calls_are_counted_by_status(server: tuple[AppServer, int], channel: grpc.Channel) -> None:
    official_call(channel, official_request("sft", spk_id="中文女", tts_text="你好。"))
    with server[0].client() as http:
        text = http.get("/metrics").text
    assert metric_value(text, "tts_transport_requests_total", {"transport": "grpc", "status": "OK"}) >= 1
    assert metric_value(text, "tts_transport_requests_total", {"transport": "grpc", "status": "INVALID_ARGUMENT"}) >= 0


def test_api_keys_in_metadata(tmp_path: Path, tiny_bundle: Path) -> None:
    app, port = _start(tmp_path, tiny_bundle, {"TTS_API_KEYS": "sesame-key-1", "TTS_RATE_LIMIT_PER_MINUTE": "2"}, "grpc-keys")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            request = official_request("sft", spk_id="中文女", tts_text="你好。")
            assert _code(ch, request).code() is grpc.StatusCode.UNAUTHENTICATED
            assert _code(ch, request, (("authorization", "Bearer wrong"),)).code() is grpc.StatusCode.UNAUTHENTICATED
            assert official_call(ch, request, (("authorization", "Bearer sesame-key-1"),)).size > 0
            assert official_call(ch, request, (("x-api-key", "sesame-key-1"),)).size > 0
            limited = _code(ch, request, (("x-api-key", "sesame-key-1"),))  # the third call in a minute: over the limit of 2
            assert limited.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert int(dict(limited.trailing_metadata() or ())["retry-after"]) >= 1
    finally:
        app.stop()


def test_health_is_not_serving_while_loading(tmp_path: Path, tiny_bundle: Path) -> None:
    """The gRPC port answers from the process start: NOT_SERVING (and UNAVAILABLE calls) until the model is loaded.
    The warm-up is held (a closed gate, tests/gated_engine.py) until NOT_SERVING was seen: no race with a fast load."""
    port = free_port()
    gate = FileGate(tmp_path / "gate")
    env = {"TTS_GRPC_PORT": str(port), "TTS_INTRA_OP_THREADS": "1", "TEST_GATE_CLOSED": "1"}
    app = AppServer(tmp_path, tiny_bundle, env, name="grpc-loading", gate=gate.path)
    seen: set[int] = set()
    try:
        ManagedProcess.start(app)
        deadline = time.monotonic() + 90
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline and health_pb2.HealthCheckResponse.SERVING not in seen:
                try:
                    seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
                except grpc.RpcError:
                    time.sleep(0.02)
                if health_pb2.HealthCheckResponse.NOT_SERVING in seen:
                    gate.set()  # now let the warm-up finish
    finally:
        gate.set()
        app.stop()
    assert health_pb2.HealthCheckResponse.SERVING in seen
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen


def test_every_error_code_has_an_http_and_a_grpc_status() -> None:
    assert set(STATUS) == set(ErrorCode)
    assert set(GRPC_STATUS) == set(ErrorCode)
    assert grpc.StatusCode.OK not in GRPC_STATUS.values() and grpc.StatusCode.UNKNOWN not in GRPC_STATUS.values()


def test_the_proto_matches_the_official_wire_contract() -> None:
    """Package, service, method and every message's field names, numbers and types, as the official proto has them."""
    d = cosyvoice_pb2.DESCRIPTOR
    assert d.package == "cosyvoice"
    method = d.services_by_name["CosyVoice"].methods_by_name["Inference"]
    assert (method.input_type.name, method.output_type.name, method.server_streaming) == ("Request", "Response", True)
    assert not method.client_streaming
    fields = {
        "Request": {"sft_request": 1, "zero_shot_request": 2, "cross_lingual_request": 3, "instruct_request": 4},
        "sftRequest": {"spk_id": 1, "tts_text": 2},
        "zeroshotRequest": {"tts_text": 1, "prompt_text": 2, "prompt_audio": 3},
        "crosslingualRequest": {"tts_text": 1, "prompt_audio": 2},
        "instructRequest": {"tts_text": 1, "spk_id": 2, "instruct_text": 3},
        "Response": {"tts_audio": 1},
    }
    for message, numbers in fields.items():
        got = {f.name: f.number for f in d.message_types_by_name[message].fields}
        assert got == numbers, message
    assert [f.name for f in d.message_types_by_name["Request"].oneofs_by_name["RequestPayload"].fields] == list(fields["Request"])
    assert d.message_types_by_name["zeroshotRequest"].fields_by_name["prompt_audio"].type == 12  # TYPE_BYTES


def test_the_committed_stubs_are_what_the_proto_generates(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    from gen_grpc import GENERATED, generate

    generate(tmp_path)
    for name in GENERATED:
        assert (tmp_path / name).read_text() == (REPO / "service" / "rpc" / name).read_text(), f"regenerate {name}"
